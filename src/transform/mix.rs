//! Batch steps: torchvision's `MixUp(alpha, num_classes)` and `CutMix(alpha, num_classes)` (and
//! a uniform choice between them, `RandomChoice([MixUp, CutMix])`, as its classification
//! reference does), on the finished batch, with soft labels.
//!
//! As torchvision's `transforms.v2` does: each image is mixed with its predecessor in the batch
//! (`roll(1, 0)`: image 0 with the last), `lam ~ Beta(alpha, alpha)` once per batch; MixUp
//! blends whole images, `rolled · (1 − lam) + image · lam`; CutMix pastes a box of the
//! predecessor (centre uniform, sides `√(1 − lam)` of the image's, clipped) and uses the
//! pasted area for `lam`. Labels become `num_classes` probabilities per sample, mixed the same
//! way. The draws come from `(seed, epoch, batch position, rank)`, so batches stay the same for
//! any worker count and across resume.
//!
//! `f32` batches are mixed in `f32` with torchvision's operation order; `f16`/`bf16` through
//! `f32`, rounded to nearest even; `u8` batches (the GPU feed's, normalized on the device: the
//! normalization is affine, so mixing before it is mixing after) rounded to the nearest level.

use half::{bf16, f16};

use crate::rng::SampleRng;

use super::slot::{DType, Layout};

/// MixUp, CutMix or a uniform choice of the two for every batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchMix {
    /// MixUp's Beta parameter (`None`: no MixUp).
    pub mixup_alpha: Option<f64>,
    /// CutMix's Beta parameter (`None`: no CutMix).
    pub cutmix_alpha: Option<f64>,
    /// Number of classes of the soft labels.
    pub num_classes: usize,
}

/// The largest alpha accepted: Beta(alpha, alpha) is 0.5 to within a millionth long before,
/// and far larger Gamma draws overflow.
pub const MAX_ALPHA: f64 = 1e12;

/// The most classes soft labels may have (a batch of 1,024 samples is then 4 MB of labels).
pub const MAX_CLASSES: usize = 1 << 20;

/// What one batch's draw decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MixDraw {
    /// Blend whole images with weight `lam` on each image (1 − `lam` on its predecessor).
    MixUp {
        /// The image's own weight (a `float32` Beta draw, as torch's).
        lam: f64,
    },
    /// Paste the predecessor's `[x1, x2) × [y1, y2)` box; `lam` is the unpasted share.
    CutMix {
        /// Box left column.
        x1: usize,
        /// Box top row.
        y1: usize,
        /// Box end column (exclusive).
        x2: usize,
        /// Box end row (exclusive).
        y2: usize,
        /// 1 − box area / image area.
        lam: f64,
    },
}

impl BatchMix {
    /// torchvision `MixUp(alpha, num_classes)`.
    pub fn mixup(alpha: f64, num_classes: usize) -> BatchMix {
        BatchMix {
            mixup_alpha: Some(alpha),
            cutmix_alpha: None,
            num_classes,
        }
    }

    /// torchvision `CutMix(alpha, num_classes)`.
    pub fn cutmix(alpha: f64, num_classes: usize) -> BatchMix {
        BatchMix {
            mixup_alpha: None,
            cutmix_alpha: Some(alpha),
            num_classes,
        }
    }

    /// torchvision's reference recipe: `RandomChoice([MixUp(mixup_alpha), CutMix(cutmix_alpha)])`.
    pub fn either(mixup_alpha: f64, cutmix_alpha: f64, num_classes: usize) -> BatchMix {
        BatchMix {
            mixup_alpha: Some(mixup_alpha),
            cutmix_alpha: Some(cutmix_alpha),
            num_classes,
        }
    }

    /// Checks the parameters (alphas positive and finite, at least one of them, classes in
    /// `1..=MAX_CLASSES`).
    pub fn validate(&self) -> Result<(), String> {
        if self.mixup_alpha.is_none() && self.cutmix_alpha.is_none() {
            return Err("MixUp/CutMix: neither alpha is set".into());
        }
        for (name, alpha) in [("MixUp", self.mixup_alpha), ("CutMix", self.cutmix_alpha)] {
            if let Some(alpha) = alpha
                && !(alpha > 0.0 && alpha <= MAX_ALPHA)
            {
                return Err(format!(
                    "{name} alpha {alpha} must be positive and at most {MAX_ALPHA:e}"
                ));
            }
        }
        if !(1..=MAX_CLASSES).contains(&self.num_classes) {
            return Err(format!(
                "MixUp/CutMix num_classes {} must be in 1..={MAX_CLASSES}",
                self.num_classes
            ));
        }
        Ok(())
    }

    /// The batch's draw, from `rng`, for images of `width × height` (torchvision's order: the
    /// choice between the two, then lam, then CutMix's box centre, x before y).
    pub fn draw(&self, rng: &mut SampleRng, width: usize, height: usize) -> MixDraw {
        let use_cutmix = match (self.mixup_alpha, self.cutmix_alpha) {
            (Some(_), Some(_)) => rng.below(2) == 1,
            (None, Some(_)) => true,
            _ => false,
        };
        if !use_cutmix {
            let alpha = self.mixup_alpha.unwrap_or(1.0);
            return MixDraw::MixUp {
                lam: rng.beta(alpha, alpha) as f32 as f64,
            };
        }
        let alpha = self.cutmix_alpha.unwrap_or(1.0);
        let lam = rng.beta(alpha, alpha) as f32 as f64;
        let rx = rng.below(width.max(1) as u64) as i64;
        let ry = rng.below(height.max(1) as u64) as i64;
        let r = 0.5 * (1.0 - lam).sqrt();
        let (half_w, half_h) = ((r * width as f64) as i64, (r * height as f64) as i64);
        let x1 = (rx - half_w).max(0) as usize;
        let y1 = (ry - half_h).max(0) as usize;
        let x2 = ((rx + half_w) as usize).min(width);
        let y2 = ((ry + half_h) as usize).min(height);
        let area = ((x2 - x1) * (y2 - y1)) as f64 / (width * height).max(1) as f64;
        MixDraw::CutMix {
            x1,
            y1,
            x2,
            y2,
            lam: 1.0 - area,
        }
    }

    /// Draws from `rng`, mixes the batch `data` (`shape` in `layout`'s order, elements of
    /// `dtype`) in place and returns the soft labels (`[n, num_classes]`, row-major).
    ///
    /// # Errors
    /// A label outside `0..num_classes`, naming it.
    pub fn apply(
        &self,
        rng: &mut SampleRng,
        data: &mut [u8],
        dtype: DType,
        layout: Layout,
        shape: [usize; 4],
        labels: &[u32],
    ) -> Result<Vec<f32>, String> {
        let n = shape[0];
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= self.num_classes) {
            return Err(format!(
                "label {bad} is outside the {} classes MixUp/CutMix were given",
                self.num_classes
            ));
        }
        let (h, w) = match layout {
            Layout::Nchw => (shape[2], shape[3]),
            Layout::Nhwc => (shape[1], shape[2]),
        };
        let draw = self.draw(rng, w, h);
        if n > 0 {
            mix_images(data, dtype, layout, shape, draw);
        }
        let lam = match draw {
            MixDraw::MixUp { lam } | MixDraw::CutMix { lam, .. } => lam,
        };
        Ok(soft_labels(labels, self.num_classes, lam))
    }
}

/// torchvision's `_mixup_label`: `one_hot(rolled) · (1 − lam) + one_hot(label) · lam`, in `f32`
/// (torch casts the two weights, computed in double, to the tensor's `float`).
fn soft_labels(labels: &[u32], classes: usize, lam: f64) -> Vec<f32> {
    let (keep, take) = (lam as f32, (1.0 - lam) as f32);
    let n = labels.len();
    let mut out = vec![0f32; n * classes];
    for i in 0..n {
        let row = &mut out[i * classes..(i + 1) * classes];
        let previous = labels[(i + n - 1) % n] as usize;
        row[previous] = take;
        row[labels[i] as usize] += keep;
    }
    out
}

/// Element access by type: read as `f32`, write back rounded as the type rounds.
trait Element {
    const SIZE: usize;
    fn get(bytes: &[u8]) -> f32;
    fn put(bytes: &mut [u8], value: f32);
}

struct F32;
struct F16;
struct Bf16;
struct U8;

impl Element for F32 {
    const SIZE: usize = 4;
    fn get(b: &[u8]) -> f32 {
        f32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    }
    fn put(b: &mut [u8], v: f32) {
        b[..4].copy_from_slice(&v.to_ne_bytes());
    }
}

impl Element for F16 {
    const SIZE: usize = 2;
    fn get(b: &[u8]) -> f32 {
        f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()
    }
    fn put(b: &mut [u8], v: f32) {
        b[..2].copy_from_slice(&f16::from_f32(v).to_bits().to_ne_bytes());
    }
}

impl Element for Bf16 {
    const SIZE: usize = 2;
    fn get(b: &[u8]) -> f32 {
        bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()
    }
    fn put(b: &mut [u8], v: f32) {
        b[..2].copy_from_slice(&bf16::from_f32(v).to_bits().to_ne_bytes());
    }
}

impl Element for U8 {
    const SIZE: usize = 1;
    fn get(b: &[u8]) -> f32 {
        b[0] as f32
    }
    fn put(b: &mut [u8], v: f32) {
        b[0] = v.round().clamp(0.0, 255.0) as u8;
    }
}

fn mix_images(data: &mut [u8], dtype: DType, layout: Layout, shape: [usize; 4], draw: MixDraw) {
    match dtype {
        DType::F32 => mix_typed::<F32>(data, layout, shape, draw),
        DType::F16 => mix_typed::<F16>(data, layout, shape, draw),
        DType::Bf16 => mix_typed::<Bf16>(data, layout, shape, draw),
        DType::U8 => mix_typed::<U8>(data, layout, shape, draw),
    }
}

/// Mixes sample `i` with sample `i − 1` for `i` from the last down to 1 (each reads a
/// predecessor not yet changed), then sample 0 with a copy of the last one's original.
fn mix_typed<E: Element>(data: &mut [u8], layout: Layout, shape: [usize; 4], draw: MixDraw) {
    let n = shape[0];
    let sample = shape[1] * shape[2] * shape[3] * E::SIZE;
    if n < 2 || sample == 0 || data.len() < n * sample {
        return;
    }
    // CutMix's box lies at the same bytes in every sample: found once for the batch.
    let boxed = match draw {
        MixDraw::CutMix { x1, y1, x2, y2, .. } => {
            box_rows(layout, shape, (x1, y1, x2, y2), E::SIZE)
        }
        MixDraw::MixUp { .. } => Vec::new(),
    };
    let last = data[(n - 1) * sample..n * sample].to_vec();
    for i in (0..n).rev() {
        let (before, rest) = data.split_at_mut(i * sample);
        let own = &mut rest[..sample];
        let previous: &[u8] = if i == 0 {
            &last
        } else {
            &before[(i - 1) * sample..]
        };
        match draw {
            MixDraw::MixUp { lam } => blend::<E>(own, previous, lam),
            MixDraw::CutMix { .. } => {
                for row in &boxed {
                    own[row.clone()].copy_from_slice(&previous[row.clone()]);
                }
            }
        }
    }
}

/// MixUp of one sample (`own`) with its predecessor, as torchvision computes it:
/// `rolled.mul_(1 - lam).add_(image.mul(lam))`.
fn blend<E: Element>(own: &mut [u8], previous: &[u8], lam: f64) {
    let (keep, take) = (lam as f32, (1.0 - lam) as f32);
    for (o, p) in own
        .chunks_exact_mut(E::SIZE)
        .zip(previous.chunks_exact(E::SIZE))
    {
        let v = E::get(p) * take + E::get(o) * keep;
        E::put(o, v);
    }
}

/// The byte ranges, within one sample, of the box `[x1, x2) × [y1, y2)`: a run per row,
/// `[c][y][x1..x2]` for NCHW, `[y][x1..x2][c]` for NHWC. None for an empty box.
fn box_rows(
    layout: Layout,
    shape: [usize; 4],
    (x1, y1, x2, y2): (usize, usize, usize, usize),
    size: usize,
) -> Vec<std::ops::Range<usize>> {
    if x1 >= x2 || y1 >= y2 {
        return Vec::new();
    }
    let (starts, row_len): (Vec<usize>, usize) = match layout {
        Layout::Nchw => {
            let (c, h, w) = (shape[1], shape[2], shape[3]);
            let starts = (0..c)
                .flat_map(|ch| (y1..y2).map(move |y| (ch * h + y) * w + x1))
                .collect();
            (starts, x2 - x1)
        }
        Layout::Nhwc => {
            let (w, c) = (shape[2], shape[3]);
            ((y1..y2).map(|y| (y * w + x1) * c).collect(), (x2 - x1) * c)
        }
    };
    starts
        .into_iter()
        .map(|start| start * size..(start + row_len) * size)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch_f32(n: usize, c: usize, h: usize, w: usize) -> Vec<f32> {
        (0..n * c * h * w).map(|i| (i % 997) as f32 / 7.0).collect()
    }

    fn bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    fn floats(data: &[u8]) -> Vec<f32> {
        data.chunks_exact(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn mixup_blends_each_image_with_its_predecessor_and_mixes_the_labels_alike() {
        let (n, c, h, w) = (4, 3, 5, 6);
        let images = batch_f32(n, c, h, w);
        let mut data = bytes(&images);
        let labels = [2u32, 0, 1, 1];
        let mix = BatchMix::mixup(0.2, 3);
        mix.validate().unwrap();
        let mut rng = SampleRng::new(1, 0, 0);
        let soft = mix
            .apply(
                &mut rng,
                &mut data,
                DType::F32,
                Layout::Nchw,
                [n, c, h, w],
                &labels,
            )
            .unwrap();
        let MixDraw::MixUp { lam } = mix.draw(&mut SampleRng::new(1, 0, 0), w, h) else {
            panic!("MixUp draws MixUp");
        };
        let got = floats(&data);
        let sample = c * h * w;
        for i in 0..n {
            let p = (i + n - 1) % n;
            for k in 0..sample {
                let want = images[p * sample + k] * (1.0 - lam) as f32
                    + images[i * sample + k] * lam as f32;
                assert_eq!(got[i * sample + k], want);
            }
            let row = &soft[i * 3..(i + 1) * 3];
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(row[labels[i] as usize] as f64 >= lam - 1e-6);
        }
        // Samples 2 and 3 share a label: its row is all on that class.
        assert!((soft[3 * 3 + 1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn cutmix_pastes_the_predecessors_box_in_either_layout() {
        let (n, c, h, w) = (3, 3, 8, 10);
        let mix = BatchMix::cutmix(1.0, 5);
        let labels = [0u32, 3, 4];
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let shape = match layout {
                Layout::Nchw => [n, c, h, w],
                Layout::Nhwc => [n, h, w, c],
            };
            for seed in 0..20 {
                let images: Vec<u8> = (0..n * c * h * w).map(|i| (i % 251) as u8).collect();
                let mut data = images.clone();
                let soft = mix
                    .apply(
                        &mut SampleRng::new(seed, 0, 0),
                        &mut data,
                        DType::U8,
                        layout,
                        shape,
                        &labels,
                    )
                    .unwrap();
                let MixDraw::CutMix {
                    x1,
                    y1,
                    x2,
                    y2,
                    lam,
                } = mix.draw(&mut SampleRng::new(seed, 0, 0), w, h)
                else {
                    panic!("CutMix draws CutMix");
                };
                let at = |i: usize, ch: usize, y: usize, x: usize| match layout {
                    Layout::Nchw => ((i * c + ch) * h + y) * w + x,
                    Layout::Nhwc => ((i * h + y) * w + x) * c + ch,
                };
                for i in 0..n {
                    let p = (i + n - 1) % n;
                    for ch in 0..c {
                        for y in 0..h {
                            for x in 0..w {
                                let inside = (x1..x2).contains(&x) && (y1..y2).contains(&y);
                                let want = images[at(if inside { p } else { i }, ch, y, x)];
                                assert_eq!(data[at(i, ch, y, x)], want, "{layout:?} {seed}");
                            }
                        }
                    }
                    let row = &soft[i * 5..(i + 1) * 5];
                    assert!((row[labels[i] as usize] as f64 - lam).abs() < 1e-6);
                }
                let area = ((x2 - x1) * (y2 - y1)) as f64 / (w * h) as f64;
                assert_eq!(lam, 1.0 - area);
            }
        }
    }

    #[test]
    fn the_choice_uses_both_and_bad_input_is_refused() {
        let mix = BatchMix::either(0.2, 1.0, 10);
        let (mut mixups, mut cutmixes) = (0, 0);
        for batch in 0..200 {
            match mix.draw(&mut SampleRng::new(0, 0, batch), 16, 16) {
                MixDraw::MixUp { .. } => mixups += 1,
                MixDraw::CutMix { .. } => cutmixes += 1,
            }
        }
        assert!(mixups > 60 && cutmixes > 60, "{mixups} / {cutmixes}");
        let mut data = vec![0u8; 2 * 3 * 2 * 2 * 4];
        let err = mix
            .apply(
                &mut SampleRng::new(0, 0, 0),
                &mut data,
                DType::F32,
                Layout::Nchw,
                [2, 3, 2, 2],
                &[1, 10],
            )
            .unwrap_err();
        assert!(err.contains("label 10"), "{err}");
        for bad in [
            BatchMix::mixup(0.0, 10),
            BatchMix::cutmix(f64::NAN, 10),
            BatchMix::cutmix(1.7e308, 10),
            BatchMix::mixup(0.2, 0),
            BatchMix {
                mixup_alpha: None,
                cutmix_alpha: None,
                num_classes: 3,
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        // A batch of one is mixed with itself: unchanged.
        let mut one = bytes(&batch_f32(1, 3, 2, 2));
        let before = one.clone();
        BatchMix::mixup(1.0, 2)
            .apply(
                &mut SampleRng::new(0, 0, 0),
                &mut one,
                DType::F32,
                Layout::Nchw,
                [1, 3, 2, 2],
                &[1],
            )
            .unwrap();
        assert_eq!(one, before);
    }
}
