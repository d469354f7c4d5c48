//! The steps that change the pixels of the `u8` image (after the crop, or before it where they are
//! listed first: [`Transform::before_geometry`](super::Transform::before_geometry)), in the
//! order they are listed (torchvision's `Compose` order): the automatic augmentations,
//! `ColorJitter`, `RandomGrayscale`, `GaussianBlur`, each as often as wanted, up to
//! [`MAX_PIXEL_STEPS`].

use crate::rng::SampleRng;

use super::autoaugment::AutoAugment;
use super::blur::{BlurScratch, GaussianBlur};
use super::color::{ColorJitter, RandomGrayscale};
use super::ops::RgbImage;
use super::timm::TimmRandAugment;

/// One step on the image's pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PixelStep {
    /// torchvision's `AutoAugment`, `RandAugment` or `TrivialAugmentWide`.
    AutoAugment(AutoAugment),
    /// torchvision's `ColorJitter` (in `RandomApply(p)`).
    ColorJitter(ColorJitter),
    /// torchvision's `RandomGrayscale(p)`.
    Grayscale(RandomGrayscale),
    /// torchvision's `GaussianBlur` (in `RandomApply(p)`).
    GaussianBlur(GaussianBlur),
    /// timm's `RandAugment` (`rand-m9-mstd0.5-inc1`).
    TimmRandAugment(TimmRandAugment),
}

/// The most pixel steps one transform takes.
pub const MAX_PIXEL_STEPS: usize = 8;

/// The pixel steps of a transform, in order (a fixed-size list, so a `Transform` stays `Copy`).
#[derive(Clone, Copy, PartialEq, Default)]
pub struct PixelSteps {
    steps: [Option<PixelStep>; MAX_PIXEL_STEPS],
    len: usize,
}

impl std::fmt::Debug for PixelSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Scratch memory the steps share (one per worker).
#[derive(Default)]
pub struct PixelScratch {
    /// For the geometric ops and filters that cannot work in place.
    pub bytes: Vec<u8>,
    /// For the blur.
    pub blur: BlurScratch,
}

impl PixelSteps {
    /// Appends `step`.
    ///
    /// # Errors
    /// More than [`MAX_PIXEL_STEPS`] steps.
    pub fn push(&mut self, step: PixelStep) -> Result<(), String> {
        if self.len == MAX_PIXEL_STEPS {
            return Err(format!(
                "at most {MAX_PIXEL_STEPS} augmentation, colour and blur steps per transform"
            ));
        }
        self.steps[self.len] = Some(step);
        self.len += 1;
        Ok(())
    }

    /// The steps, in order.
    pub fn iter(&self) -> impl Iterator<Item = &PixelStep> {
        self.steps[..self.len].iter().flatten()
    }

    /// True when there is no step.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when a step moves pixels (the automatic augmentations' shears, translations and
    /// rotations), so the flip must happen on the pixels before it rather than while the slot
    /// is written: the other steps do the same to an image and its mirror.
    pub fn moves_pixels(&self) -> bool {
        self.iter()
            .any(|s| matches!(s, PixelStep::AutoAugment(_) | PixelStep::TimmRandAugment(_)))
    }

    /// Checks every step's parameters.
    pub fn validate(&self) -> Result<(), String> {
        self.iter().try_for_each(|step| match step {
            PixelStep::AutoAugment(a) => a.validate(),
            PixelStep::ColorJitter(j) => j.validate(),
            PixelStep::Grayscale(g) => g.validate(),
            PixelStep::GaussianBlur(b) => b.validate(),
            PixelStep::TimmRandAugment(t) => t.validate(),
        })
    }

    /// Draws and applies every step, in order, to the `width × height` RGB image in `pixels`
    /// (exactly that many values).
    pub fn apply(
        &self,
        rng: &mut SampleRng,
        pixels: &mut Vec<u8>,
        scratch: &mut PixelScratch,
        width: u32,
        height: u32,
    ) {
        for step in self.iter() {
            match step {
                PixelStep::AutoAugment(augment) => augment.apply(
                    rng,
                    &mut RgbImage {
                        pixels,
                        scratch: &mut scratch.bytes,
                        width,
                        height,
                    },
                ),
                PixelStep::ColorJitter(jitter) => jitter.apply(rng, pixels),
                PixelStep::Grayscale(grayscale) => grayscale.apply(rng, pixels),
                PixelStep::GaussianBlur(blur) => {
                    blur.apply(rng, pixels, &mut scratch.blur, width, height)
                }
                PixelStep::TimmRandAugment(augment) => augment.apply(
                    rng,
                    &mut RgbImage {
                        pixels,
                        scratch: &mut scratch.bytes,
                        width,
                        height,
                    },
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_keep_their_order_and_their_limit() {
        let mut steps = PixelSteps::default();
        assert!(steps.is_empty() && !steps.moves_pixels());
        steps
            .push(PixelStep::Grayscale(RandomGrayscale { p: 1.0 }))
            .unwrap();
        steps
            .push(PixelStep::ColorJitter(ColorJitter::new(0.0, 0.0, 0.0, 0.3)))
            .unwrap();
        assert!(!steps.moves_pixels());
        // Gray then hue (nothing to shift) is gray; hue then gray is gray too, but a
        // brightness step after the gray keeps it gray while one before changes the level.
        let image: Vec<u8> = (0..8 * 8 * 3).map(|i| (i * 29 % 256) as u8).collect();
        let mut p = image.clone();
        steps.apply(
            &mut SampleRng::new(0, 0, 0),
            &mut p,
            &mut PixelScratch::default(),
            8,
            8,
        );
        assert!(p.chunks(3).all(|c| c[0] == c[1] && c[1] == c[2]));
        for _ in 2..MAX_PIXEL_STEPS {
            steps
                .push(PixelStep::AutoAugment(AutoAugment::trivial_augment_wide()))
                .unwrap();
        }
        assert!(steps.moves_pixels());
        assert_eq!(steps.iter().count(), MAX_PIXEL_STEPS);
        assert!(
            steps
                .push(PixelStep::Grayscale(RandomGrayscale { p: 0.5 }))
                .is_err()
        );
        assert!(format!("{steps:?}").starts_with("[Grayscale"));
    }
}
