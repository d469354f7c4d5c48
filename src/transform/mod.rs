//! Per-sample transforms: decode → geometry (resize / crop) → flip → pixel steps (automatic
//! augmentation, colour jitter, grayscale, blur, in the order given) → erasing → write into a
//! batch slot; then, on the whole batch, MixUp/CutMix ([`mix`]).
//!
//! A [`Transform`] is a plain description; a [`SampleTransformer`] (one per worker,
//! [`transformer`]) applies it. Geometry follows torchvision's semantics (`Resize`,
//! `CenterCrop`, `RandomResizedCrop` with the same size rules and crop arithmetic, Python
//! rounding included), and every random decision is drawn from the sample's own
//! [`SampleRng`](crate::rng::SampleRng) in a fixed order (crop box, flip, pixel steps,
//! erasing), so the result depends only on `(seed, epoch, index)`. docs/transforms.md sets
//! each step beside torchvision's.
//!
//! Work is cut where it can be: a JPEG whose crop will be shrunk is decoded at a reduced
//! libjpeg-turbo DCT scale (1/2, 1/4 or 1/8) when the crop stays at least twice the output there
//! ([`DctScaling::Antialiased`](crate::decode::DctScaling::Antialiased): no aliasing, no slow
//! odd scales), and the crop and resize happen in one SIMD pass (fast_image_resize, antialiased
//! bilinear like PIL). The flip, the
//! layout change and the normalization happen while writing the slot
//! ([`slot::SlotWriter`]).

pub mod affine_filter;
pub mod autoaugment;
pub mod blur;
pub mod color;
pub mod crop;
pub mod erase;
pub mod mix;
pub mod ops;
pub mod pixel;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod slot;
pub mod timm;
pub mod transformer;

pub use crate::resize::Interpolation;
pub use autoaugment::{AugmentPolicy, AutoAugment};
pub use blur::GaussianBlur;
pub use color::{ColorJitter, RandomGrayscale};
pub use crop::{Padding, PaddingMode};
pub use erase::{EraseValue, RandomErasing};
pub use mix::BatchMix;
pub use pixel::{PixelStep, PixelSteps};
pub use slot::{DType, Layout, Normalize, SlotWriter};
pub use timm::{TimmRandAugment, TimmResample};
pub use transformer::{Prepared, SampleTransformer};

/// Resizing and cropping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Geometry {
    /// Keep the decoded size; all images of a batch must then have the same size.
    Native,
    /// torchvision `Resize(short)`: the shorter side becomes `short`.
    Resize {
        /// Target shorter side.
        short: u32,
    },
    /// torchvision `Resize((height, width))`: every image to exactly this size (the aspect ratio
    /// is not kept), as the evaluation code of many projects does.
    ResizeTo {
        /// Output width.
        width: u32,
        /// Output height.
        height: u32,
    },
    /// torchvision `CenterCrop((height, width))` (zero padding when the image is smaller).
    CenterCrop {
        /// Output width.
        width: u32,
        /// Output height.
        height: u32,
    },
    /// `Resize(short)` then `CenterCrop((height, width))`: the usual evaluation transform.
    ResizeCenterCrop {
        /// Shorter side after the resize.
        short: u32,
        /// Output width.
        width: u32,
        /// Output height.
        height: u32,
    },
    /// torchvision `RandomCrop((height, width), padding, pad_if_needed, fill, padding_mode)`:
    /// the image is padded, then a `width × height` window is taken at a uniformly drawn offset
    /// (top first, then left, as torchvision draws them). An image still smaller than the
    /// window is a bad sample ([`DecodeError::SmallerThanCrop`](crate::decode::DecodeError::SmallerThanCrop)), where torchvision raises.
    RandomCrop {
        /// Output width.
        width: u32,
        /// Output height.
        height: u32,
        /// Padding added to the left, top, right and bottom (torchvision's `padding` order).
        padding: [u32; 4],
        /// Pad a side still smaller than the window on both ends, as torchvision does.
        pad_if_needed: bool,
        /// The colour the `Constant` mode pads with (torchvision's `fill`; black by default).
        fill: [u8; 3],
        /// How the padding is filled (torchvision's `padding_mode`).
        padding_mode: PaddingMode,
        /// `Resize(short)` first (`Compose([Resize(256), RandomCrop(224)])`): the window is
        /// drawn on the resized image; `None` crops the image as decoded.
        resize: Option<u32>,
    },
    /// torchvision `RandomResizedCrop((height, width), scale, ratio)`.
    RandomResizedCrop {
        /// Output width.
        width: u32,
        /// Output height.
        height: u32,
        /// Range of the crop's area as a fraction of the image's.
        scale: (f64, f64),
        /// Range of the crop's aspect ratio (width / height).
        ratio: (f64, f64),
    },
}

impl Geometry {
    /// torchvision's `RandomCrop((height, width), padding)`: black constant padding, no
    /// `pad_if_needed`.
    pub fn random_crop(width: u32, height: u32, padding: [u32; 4]) -> Geometry {
        Geometry::RandomCrop {
            width,
            height,
            padding,
            pad_if_needed: false,
            fill: [0; 3],
            padding_mode: PaddingMode::Constant,
            resize: None,
        }
    }

    /// The geometry as [`Transform::fingerprint`] names it: the derived `Debug`, except that a
    /// `RandomCrop` with the default black constant padding keeps the form it had before
    /// `fill` and `padding_mode` existed (a saved loader state names it).
    fn fingerprint(&self) -> String {
        match *self {
            Geometry::RandomCrop {
                width,
                height,
                padding,
                pad_if_needed,
                fill: [0, 0, 0],
                padding_mode: PaddingMode::Constant,
                resize: None,
            } => format!(
                "RandomCrop {{ width: {width}, height: {height}, padding: {padding:?}, \
                 pad_if_needed: {pad_if_needed} }}"
            ),
            other => format!("{other:?}"),
        }
    }
}

/// What happens to each sample between its payload and its batch slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transform {
    /// Resize / crop.
    pub geometry: Geometry,
    /// Probability of a horizontal flip (0 = never).
    pub hflip: f64,
    /// How the geometry resamples (torchvision's `interpolation`); bilinear by default.
    pub interpolation: Interpolation,
    /// The automatic augmentations, colour jitter, grayscale and blur, in order, on the cropped,
    /// resized and flipped `u8` image (see [`pixel`]); none by default.
    pub pixel_steps: PixelSteps,
    /// Pixel steps listed before the geometry (`Compose([ColorJitter(..), RandomCrop(..)])`):
    /// they run, in order, on the whole image, which is then decoded at full size (no DCT
    /// scaling, no region); none by default.
    pub before_geometry: PixelSteps,
    /// The flip is listed before the geometry (`Compose([RandomHorizontalFlip(), RandomCrop(..)])`):
    /// it mirrors the image after `before_geometry` and before the crop, which differs from a
    /// flip after it where the crop's draw is not symmetric (`RandomCrop` with more padding on
    /// one side). False by default.
    pub flip_before_geometry: bool,
    /// torchvision `RandomErasing`, applied last (after the flip, in the normalized units its
    /// values are in); `None` by default.
    pub erase: Option<RandomErasing>,
    /// Element type, layout, normalization.
    pub output: SlotWriter,
}

/// The most padding `RandomCrop` takes on one side (torchvision has no limit; this keeps the
/// arithmetic far from overflow).
pub const MAX_PADDING: u32 = 1 << 16;

/// CIFAR-10 channel statistics.
pub const CIFAR10_NORMALIZE: Normalize = Normalize {
    mean: [0.4914, 0.4822, 0.4465],
    std: [0.2470, 0.2435, 0.2616],
};

impl Transform {
    /// Decode only: native size, `u8`, NHWC (the decoder's own layout).
    pub fn none() -> Transform {
        Transform {
            geometry: Geometry::Native,
            hflip: 0.0,
            interpolation: Interpolation::Bilinear,
            pixel_steps: PixelSteps::default(),
            before_geometry: PixelSteps::default(),
            flip_before_geometry: false,
            erase: None,
            output: SlotWriter {
                dtype: DType::U8,
                layout: Layout::Nhwc,
                normalize: None,
            },
        }
    }

    /// CIFAR training: random flip and normalize at native size, `f32` NCHW.
    pub fn cifar() -> Transform {
        Transform {
            geometry: Geometry::Native,
            hflip: 0.5,
            interpolation: Interpolation::Bilinear,
            pixel_steps: PixelSteps::default(),
            before_geometry: PixelSteps::default(),
            flip_before_geometry: false,
            erase: None,
            output: SlotWriter {
                dtype: DType::F32,
                layout: Layout::Nchw,
                normalize: Some(CIFAR10_NORMALIZE),
            },
        }
    }

    /// The CIFAR training recipe of torchvision's tutorials and most papers:
    /// `RandomCrop(32, padding=4)`, random flip, CIFAR-10 normalization, `f32` NCHW.
    pub fn cifar_train() -> Transform {
        Transform {
            geometry: Geometry::random_crop(32, 32, [4; 4]),
            ..Transform::cifar()
        }
    }

    /// ImageNet training: `RandomResizedCrop(size)` (scale 0.08–1, ratio 3/4–4/3), random flip,
    /// ImageNet normalization, `f32` NCHW.
    pub fn imagenet_train(size: u32) -> Transform {
        Transform {
            geometry: Geometry::RandomResizedCrop {
                width: size,
                height: size,
                scale: (0.08, 1.0),
                ratio: (3.0 / 4.0, 4.0 / 3.0),
            },
            hflip: 0.5,
            interpolation: Interpolation::Bilinear,
            pixel_steps: PixelSteps::default(),
            before_geometry: PixelSteps::default(),
            flip_before_geometry: false,
            erase: None,
            output: SlotWriter {
                dtype: DType::F32,
                layout: Layout::Nchw,
                normalize: Some(Normalize::IMAGENET),
            },
        }
    }

    /// torchvision's classification reference recipe (`ClassificationPresetTrain` with
    /// `auto_augment_policy="ta_wide"`, `random_erase_prob=0.1`, as its current ResNet-50 and
    /// ViT recipes train at 176): `RandomResizedCrop(size)`, random flip,
    /// `TrivialAugmentWide`, ImageNet normalization, `RandomErasing(0.1)`, `f32` NCHW. (The
    /// recipe's MixUp/CutMix act on the batch, outside the per-sample transform.)
    pub fn imagenet_reference(size: u32) -> Transform {
        let train = Transform::imagenet_train(size);
        train
            .with_augment(AutoAugment::trivial_augment_wide())
            .with_random_erasing(RandomErasing::new(0.1, train.output.normalize))
    }

    /// ImageNet evaluation: `Resize(resize)`, `CenterCrop(size)`, ImageNet normalization, `f32`
    /// NCHW.
    pub fn imagenet_eval(resize: u32, size: u32) -> Transform {
        Transform {
            geometry: Geometry::ResizeCenterCrop {
                short: resize,
                width: size,
                height: size,
            },
            hflip: 0.0,
            interpolation: Interpolation::Bilinear,
            pixel_steps: PixelSteps::default(),
            before_geometry: PixelSteps::default(),
            flip_before_geometry: false,
            erase: None,
            output: SlotWriter {
                dtype: DType::F32,
                layout: Layout::Nchw,
                normalize: Some(Normalize::IMAGENET),
            },
        }
    }

    /// The same transform resampling with `interpolation` (torchvision's `interpolation=` on
    /// `Resize` and `RandomResizedCrop`).
    pub fn with_interpolation(mut self, interpolation: Interpolation) -> Transform {
        self.interpolation = interpolation;
        self
    }

    /// The same transform with one more pixel step after the others (see [`pixel`]).
    ///
    /// # Panics
    /// With more than [`pixel::MAX_PIXEL_STEPS`] steps.
    pub fn with_pixel_step(mut self, step: PixelStep) -> Transform {
        self.pixel_steps
            .push(step)
            .expect("at most MAX_PIXEL_STEPS pixel steps");
        self
    }

    /// The same transform with one more pixel step before the geometry, after the others
    /// listed there (see [`Transform::before_geometry`]).
    ///
    /// # Panics
    /// With more than [`pixel::MAX_PIXEL_STEPS`] steps before the geometry.
    pub fn with_step_before_geometry(mut self, step: PixelStep) -> Transform {
        self.before_geometry
            .push(step)
            .expect("at most MAX_PIXEL_STEPS pixel steps");
        self
    }

    /// The same transform flipping before the geometry (see
    /// [`Transform::flip_before_geometry`]).
    pub fn with_flip_before_geometry(mut self) -> Transform {
        self.flip_before_geometry = true;
        self
    }

    /// The same transform with an automatic augmentation after its other pixel steps
    /// (torchvision's `AutoAugment`, `RandAugment`, `TrivialAugmentWide`: see [`autoaugment`]).
    pub fn with_augment(self, augment: AutoAugment) -> Transform {
        self.with_pixel_step(PixelStep::AutoAugment(augment))
    }

    /// The same transform with torchvision's `ColorJitter` after its other pixel steps (see
    /// [`color`]).
    pub fn with_color_jitter(self, jitter: ColorJitter) -> Transform {
        self.with_pixel_step(PixelStep::ColorJitter(jitter))
    }

    /// The same transform with torchvision's `RandomGrayscale(p)` after its other pixel steps.
    pub fn with_random_grayscale(self, p: f64) -> Transform {
        self.with_pixel_step(PixelStep::Grayscale(RandomGrayscale { p }))
    }

    /// The same transform with torchvision's `GaussianBlur` after its other pixel steps (see
    /// [`blur`]).
    pub fn with_gaussian_blur(self, blur: GaussianBlur) -> Transform {
        self.with_pixel_step(PixelStep::GaussianBlur(blur))
    }

    /// The same transform followed by torchvision's `RandomErasing` (see [`erase`]).
    pub fn with_random_erasing(mut self, erasing: RandomErasing) -> Transform {
        self.erase = Some(erasing);
        self
    }

    /// The same transform with another output element type and layout.
    pub fn with_output(mut self, dtype: DType, layout: Layout) -> Transform {
        self.output.dtype = dtype;
        self.output.layout = layout;
        self
    }

    /// The same geometry and flips, writing the pixels as they are: `u8`, NHWC, no
    /// normalization. What the GPU feed takes from the loader; the GPU then converts and
    /// normalizes as `self` would have (`gpu::DeviceOutput::of(&self)`, feature `cuda`).
    pub fn raw_u8_nhwc(mut self) -> Transform {
        self.output = SlotWriter {
            dtype: DType::U8,
            layout: Layout::Nhwc,
            normalize: None,
        };
        self
    }

    /// Checks the description makes sense (sizes non-zero, ranges ordered, no normalization of
    /// `u8` output).
    pub fn validate(&self) -> Result<(), String> {
        let positive = |w: u32, h: u32| {
            if w == 0 || h == 0 {
                Err("output size must be non-zero".to_string())
            } else {
                Ok(())
            }
        };
        match self.geometry {
            Geometry::Native => {}
            Geometry::Resize { short } => positive(short, short)?,
            Geometry::ResizeTo { width, height } => positive(width, height)?,
            Geometry::CenterCrop { width, height } => positive(width, height)?,
            Geometry::RandomCrop {
                width,
                height,
                padding,
                resize,
                ..
            } => {
                positive(width, height)?;
                if let Some(short) = resize {
                    positive(short, short)?;
                }
                if let Some(side) = padding.iter().find(|&&p| p > MAX_PADDING) {
                    return Err(format!(
                        "RandomCrop padding {side} is more than {MAX_PADDING} pixels"
                    ));
                }
            }
            Geometry::ResizeCenterCrop {
                short,
                width,
                height,
            } => {
                positive(short, short)?;
                positive(width, height)?;
            }
            Geometry::RandomResizedCrop {
                width,
                height,
                scale,
                ratio,
            } => {
                positive(width, height)?;
                if !(0.0 < scale.0 && scale.0 <= scale.1 && scale.1 <= 1.0) {
                    return Err(format!(
                        "RandomResizedCrop scale {scale:?} must satisfy 0 < min <= max <= 1"
                    ));
                }
                if !(0.0 < ratio.0 && ratio.0 <= ratio.1 && ratio.1.is_finite()) {
                    return Err(format!(
                        "RandomResizedCrop ratio {ratio:?} must satisfy 0 < min <= max"
                    ));
                }
            }
        }
        self.pixel_steps.validate()?;
        self.before_geometry.validate()?;
        if let Some(erase) = &self.erase {
            erase.validate()?;
        }
        if !(0.0..=1.0).contains(&self.hflip) {
            return Err(format!("flip probability {} is not in 0..1", self.hflip));
        }
        if let Some(normalize) = self.output.normalize {
            normalize.validate()?;
        }
        // Every value a float16 batch could hold: Normalize(std=1e-5) made its pixels ±inf
        // without a word (a hostile try). (bfloat16 and float32 reach 3.4e38.)
        if self.output.dtype == DType::F16 {
            let (scale, bias) = Normalize::pixel_affine(self.output.normalize);
            let largest = (0..3)
                .flat_map(|c| [bias[c], 255.0 * scale[c] + bias[c]])
                .fold(0.0f32, |most, v| most.max(v.abs()));
            if largest > f32::from(half::f16::MAX) {
                return Err(format!(
                    "normalized pixels reach {largest:e}, past float16's largest \
                     ({}): use float32 or bfloat16, or another mean and std",
                    half::f16::MAX
                ));
            }
        }
        if self.output.dtype == DType::U8 && self.output.normalize.is_some() {
            return Err(
                "normalization needs a float output (float32, float16 or bfloat16), not \
                        uint8: a uint8 batch holds the pixels as they are (for Rust's GPU feed, \
                        Transform::raw_u8_nhwc drops the normalization: the GPU applies it)"
                    .into(),
            );
        }
        Ok(())
    }

    /// What decides the pixels, as text that stays the same across releases (a resume state
    /// keeps the digest of it): the steps every release had, then only the later steps that are
    /// on (non-default interpolation, erasing, augmentation, colour jitter, grayscale), so a
    /// state saved before a step existed still matches a transform that does not use it.
    pub fn fingerprint(&self) -> String {
        let mut text = format!(
            "Transform {{ geometry: {}, hflip: {:?}, output: {:?} }}",
            self.geometry.fingerprint(),
            self.hflip,
            self.output
        );
        if self.interpolation != Interpolation::Bilinear {
            text += &format!(" interpolation {:?}", self.interpolation);
        }
        if !self.pixel_steps.is_empty() {
            text += &format!(" pixel_steps {:?}", self.pixel_steps);
        }
        if !self.before_geometry.is_empty() {
            text += &format!(" before_geometry {:?}", self.before_geometry);
        }
        if self.flip_before_geometry {
            text += " flip_before_geometry";
        }
        if let Some(erase) = &self.erase {
            text += &format!(" erase {erase:?}");
        }
        text
    }

    /// The output size when the geometry fixes it (`None` for `Native` and `Resize`).
    pub fn fixed_size(&self) -> Option<(u32, u32)> {
        match self.geometry {
            Geometry::Native | Geometry::Resize { .. } => None,
            Geometry::CenterCrop { width, height }
            | Geometry::RandomCrop { width, height, .. }
            | Geometry::ResizeTo { width, height }
            | Geometry::ResizeCenterCrop { width, height, .. }
            | Geometry::RandomResizedCrop { width, height, .. } => Some((width, height)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_float16_output_refuses_a_normalization_past_its_range() {
        // Normalize(std=1e-5) made a float16 batch's pixels ±inf without a word.
        let with = |dtype, std: f32, mean: f32| {
            let mut t = Transform::imagenet_train(224);
            t.output.dtype = dtype;
            t.output.normalize = Some(Normalize {
                mean: [mean; 3],
                std: [std; 3],
            });
            t.validate()
        };
        assert!(with(DType::F16, 0.229, 0.485).is_ok());
        for (std, mean) in [(1e-5, 0.0), (1e-3, 100.0)] {
            let err = with(DType::F16, std, mean).unwrap_err();
            assert!(err.contains("past float16's largest"), "{err}");
            assert!(with(DType::F32, std, mean).is_ok());
            assert!(with(DType::Bf16, std, mean).is_ok());
        }
    }

    #[test]
    fn the_fingerprint_names_only_the_steps_that_are_on() {
        let base = Transform::imagenet_train(224);
        // The form every release had for the steps it knew: the derived Debug of those fields.
        assert!(
            base.fingerprint()
                .starts_with("Transform { geometry: RandomResizedCrop")
        );
        assert!(!base.fingerprint().contains("pixel") && !base.fingerprint().contains("erase"));
        assert_eq!(
            base.fingerprint(),
            base.with_interpolation(Interpolation::Bilinear)
                .fingerprint()
        );
        let variants = [
            base.with_interpolation(Interpolation::Bicubic),
            base.with_augment(AutoAugment::trivial_augment_wide()),
            base.with_color_jitter(ColorJitter::new(0.4, 0.4, 0.4, 0.0)),
            base.with_random_grayscale(0.2),
            base.with_gaussian_blur(GaussianBlur::new(23)),
            base.with_random_erasing(RandomErasing::new(0.25, None)),
        ];
        let mut seen: std::collections::HashSet<String> = [base.fingerprint()].into();
        for variant in variants {
            assert!(seen.insert(variant.fingerprint()), "{variant:?}");
        }
        // RandomCrop with black constant padding keeps the form saved states have; any other
        // padding is named.
        let cifar = Transform::cifar_train();
        assert_eq!(
            cifar.fingerprint(),
            "Transform { geometry: RandomCrop { width: 32, height: 32, padding: [4, 4, 4, 4], \
             pad_if_needed: false }, hflip: 0.5, output: SlotWriter { dtype: F32, layout: Nchw, \
             normalize: Some(Normalize { mean: [0.4914, 0.4822, 0.4465], std: [0.247, 0.2435, \
             0.2616] }) } }"
        );
        let padded = |fill, padding_mode| Transform {
            geometry: Geometry::RandomCrop {
                width: 32,
                height: 32,
                padding: [4; 4],
                pad_if_needed: false,
                fill,
                padding_mode,
                resize: None,
            },
            ..cifar
        };
        for variant in [
            padded([0, 0, 1], PaddingMode::Constant),
            padded([0; 3], PaddingMode::Reflect),
            padded([0; 3], PaddingMode::Edge),
            padded([0; 3], PaddingMode::Symmetric),
        ] {
            assert!(seen.insert(variant.fingerprint()), "{variant:?}");
        }
    }

    #[test]
    fn invalid_descriptions_are_refused() {
        let mut t = Transform::cifar();
        assert!(t.validate().is_ok());
        t.output.dtype = DType::U8;
        assert!(t.validate().unwrap_err().contains("float output"));
        let rrc = |scale| Transform {
            geometry: Geometry::RandomResizedCrop {
                width: 8,
                height: 8,
                scale,
                ratio: (0.75, 1.33),
            },
            ..Transform::imagenet_train(8)
        };
        assert!(rrc((0.5, 0.2)).validate().is_err());
        assert!(rrc((0.08, 1.0)).validate().is_ok());
        // Statistics that would turn pixels into infinities or NaN.
        for (mean, std) in [
            (0.5, 0.0),
            (0.5, f32::NAN),
            (0.5, -0.2),
            (0.5, 1e-7),
            (f32::INFINITY, 0.2),
            (f32::NAN, 0.2),
        ] {
            let t = Transform {
                output: SlotWriter {
                    normalize: Some(Normalize {
                        mean: [0.4, mean, 0.4],
                        std: [0.2, std, 0.2],
                    }),
                    ..Transform::cifar().output
                },
                ..Transform::cifar()
            };
            let err = t.validate().unwrap_err();
            assert!(err.contains("standard deviations"), "{mean} {std}: {err}");
        }
    }
}
