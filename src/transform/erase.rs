//! torchvision's `RandomErasing(p, scale, ratio, value)`: a rectangle of the finished image
//! replaced, drawn as torchvision draws it.
//!
//! torchvision erases the normalized tensor (it runs after `Normalize`); here the rectangle is
//! filled in the pixels before the slot writer normalizes them, with the pixel that normalizes
//! to the value asked for (`value = 0` after `Normalize(mean, std)`: the mean colour). The
//! normalized output is then within half a level of torchvision's value, and the erased pixels
//! reach the GPU feed (which normalizes on the device) the same way. `value = "random"`
//! (torchvision: one standard normal value per element) draws the normals from the sample's RNG
//! and clamps them to what a pixel can hold.

use crate::geometry::Rect;
use crate::rng::SampleRng;

use super::crop::area_and_ratio;
use super::slot::Normalize;

/// What an erased rectangle holds, in the output's units (after normalization).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EraseValue {
    /// One value per channel.
    Constant([f32; 3]),
    /// A standard normal value per element (torchvision's `value="random"`).
    Random,
}

/// torchvision `RandomErasing(p, scale, ratio, value)`, with the normalization its values are
/// in (what `Normalize` the transform applies; `None`: values on the 0..1 scale of
/// `ToTensor`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomErasing {
    /// Probability of erasing.
    pub p: f64,
    /// Range of the rectangle's area as a fraction of the image's.
    pub scale: (f64, f64),
    /// Range of the rectangle's aspect ratio (height / width, as torchvision draws it).
    pub ratio: (f64, f64),
    /// What the rectangle holds.
    pub value: EraseValue,
    /// The normalization `value` is in.
    pub normalize: Option<Normalize>,
}

impl RandomErasing {
    /// torchvision's defaults (`p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0`) with
    /// probability `p`, in the units `normalize` gives.
    pub fn new(p: f64, normalize: Option<Normalize>) -> RandomErasing {
        RandomErasing {
            p,
            scale: (0.02, 0.33),
            ratio: (0.3, 3.3),
            value: EraseValue::Constant([0.0; 3]),
            normalize,
        }
    }

    /// Checks the parameters as torchvision does.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.p) {
            return Err(format!("RandomErasing p {} is not in 0..1", self.p));
        }
        let (s, r) = (self.scale, self.ratio);
        if !(0.0 <= s.0 && s.0 <= s.1 && s.1 <= 1.0) {
            return Err(format!(
                "RandomErasing scale {s:?} must satisfy 0 <= min <= max <= 1"
            ));
        }
        if !(0.0 < r.0 && r.0 <= r.1 && r.1.is_finite()) {
            return Err(format!(
                "RandomErasing ratio {r:?} must satisfy 0 < min <= max"
            ));
        }
        if let EraseValue::Constant(v) = self.value
            && !v.iter().all(|x| x.is_finite())
        {
            return Err(format!("RandomErasing value {v:?} must be finite"));
        }
        Ok(())
    }

    /// The pixel value (0..=255) of channel `c` that normalizes to `value`.
    fn pixel(&self, c: usize, value: f32) -> u8 {
        let unit = match self.normalize {
            Some(n) => value * n.std[c] + n.mean[c],
            None => value,
        };
        (unit * 255.0).round().clamp(0.0, 255.0) as u8
    }

    /// Erases a rectangle of the `width × height` HWC image `pixels`, if the sample's draws
    /// say so. `flip`: the image will be mirrored when written, so the rectangle (drawn on the
    /// flipped image, where torchvision draws it) is mirrored here. Draws from `rng` after the
    /// crop and flip: the coin, then the rectangle, then any random values.
    pub fn apply(
        &self,
        rng: &mut SampleRng,
        pixels: &mut [u8],
        width: u32,
        height: u32,
        flip: bool,
    ) {
        if !(self.p > 0.0 && rng.unit() < self.p) {
            return;
        }
        let Some(rect) = erase_rect(rng, width, height, self.scale, self.ratio) else {
            return;
        };
        let (top, h, w) = (rect.top as usize, rect.height as usize, rect.width as usize);
        let left = if flip {
            width as usize - rect.left as usize - w
        } else {
            rect.left as usize
        };
        let constant = match self.value {
            EraseValue::Constant(v) => Some([0, 1, 2].map(|c| self.pixel(c, v[c]))),
            EraseValue::Random => None,
        };
        // torchvision fills random values channel by channel (a C x h x w tensor).
        let mut random = Vec::new();
        if constant.is_none() {
            random.extend((0..3 * h * w).map(|_| rng.normal() as f32));
        }
        for y in 0..h {
            for x in 0..w {
                // Under a flip, column x of the drawn rectangle is column w - 1 - x here.
                let xd = if flip { w - 1 - x } else { x };
                let at = ((top + y) * width as usize + left + xd) * 3;
                let px = match constant {
                    Some(px) => px,
                    None => [0, 1, 2].map(|c| self.pixel(c, random[(c * h + y) * w + x])),
                };
                pixels[at..at + 3].copy_from_slice(&px);
            }
        }
    }
}

/// torchvision `RandomErasing.get_params`: up to 10 tries at a rectangle of random area
/// (`scale` × the image's) and log-uniform aspect ratio `h / w` (`ratio`) strictly smaller than
/// the image; `None` when none fits (torchvision then leaves the image as it is).
fn erase_rect(
    rng: &mut SampleRng,
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
) -> Option<Rect> {
    let (img_w, img_h) = (width as f64, height as f64);
    let area = img_w * img_h;
    for _ in 0..10 {
        let (h, w) = area_and_ratio(rng, area, scale, ratio);
        if !(h < img_h && w < img_w) {
            continue;
        }
        let top = rng.below((img_h - h) as u64 + 1) as f64;
        let left = rng.below((img_w - w) as u64 + 1) as f64;
        return Some(Rect {
            top,
            left,
            height: h,
            width: w,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rectangles_follow_torchvisions_draws() {
        let (mut areas, mut erased) = (Vec::new(), 0);
        for index in 0..4000 {
            let mut rng = SampleRng::new(2, 0, index);
            if let Some(r) = erase_rect(&mut rng, 32, 32, (0.02, 0.33), (0.3, 3.3)) {
                erased += 1;
                assert!(r.height < 32.0 && r.width < 32.0 && r.height >= 0.0);
                assert!(
                    r.top + r.height <= 32.0 && r.left + r.width <= 32.0,
                    "{r:?}"
                );
                areas.push(r.width * r.height / 1024.0);
            }
        }
        // Nearly every draw fits on a 32x32 image; areas fill the scale range (rounding moves
        // them a little past it).
        assert!(erased > 3900, "{erased}");
        let mean = areas.iter().sum::<f64>() / areas.len() as f64;
        assert!((0.15..0.2).contains(&mean), "mean area {mean}");
        assert!(areas.iter().all(|&a| (0.0..0.4).contains(&a)));
        // No rectangle fits a 1-pixel-wide image: left as it is.
        let mut rng = SampleRng::new(0, 0, 0);
        assert_eq!(erase_rect(&mut rng, 1, 50, (0.02, 0.33), (0.3, 3.3)), None);
    }

    #[test]
    fn the_rectangle_holds_the_pixel_that_normalizes_to_the_value() {
        let erasing = RandomErasing {
            p: 1.0,
            ..RandomErasing::new(1.0, Some(Normalize::IMAGENET))
        };
        let (w, h) = (40u32, 30u32);
        for flip in [false, true] {
            for index in 0..50 {
                let mut pixels = vec![1u8; (w * h * 3) as usize];
                let mut rng = SampleRng::new(1, 0, index);
                erasing.apply(&mut rng, &mut pixels, w, h, flip);
                // The mean colour: round(mean * 255).
                let mean = [124u8, 116, 104];
                let erased: Vec<usize> = (0..(w * h) as usize)
                    .filter(|&i| pixels[i * 3..i * 3 + 3] == mean)
                    .collect();
                let mut rng = SampleRng::new(1, 0, index);
                assert!(rng.unit() < 1.0);
                let r = erase_rect(&mut rng, w, h, erasing.scale, erasing.ratio).unwrap();
                assert_eq!(erased.len(), (r.width * r.height) as usize);
                // Mirrored under a flip: the written image has it where torchvision draws it.
                let left = if flip {
                    w as f64 - r.left - r.width
                } else {
                    r.left
                };
                let first = erased[0];
                assert_eq!(
                    (first % w as usize, first / w as usize),
                    (left as usize, r.top as usize)
                );
            }
        }
        // Never erased with p = 0; always a valid config check.
        let never = RandomErasing::new(0.0, None);
        let mut pixels = vec![9u8; 300];
        never.apply(&mut SampleRng::new(0, 0, 0), &mut pixels, 10, 10, false);
        assert!(pixels.iter().all(|&p| p == 9));
        assert!(RandomErasing::new(1.5, None).validate().is_err());
        assert!(
            RandomErasing {
                scale: (0.5, 0.2),
                ..RandomErasing::new(0.5, None)
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn random_values_are_standard_normal_in_output_units() {
        let erasing = RandomErasing {
            value: EraseValue::Random,
            scale: (0.3, 0.3),
            ratio: (1.0, 1.0),
            ..RandomErasing::new(1.0, Some(Normalize::IMAGENET))
        };
        let (w, h) = (64u32, 64u32);
        let mut values = Vec::new();
        for index in 0..20 {
            let mut pixels = vec![0u8; (w * h * 3) as usize];
            erasing.apply(&mut SampleRng::new(4, 0, index), &mut pixels, w, h, false);
            // Back to output units on channel 0 of the erased pixels (non-zero: the mean colour
            // +- a few std lands inside 1..=254 nearly always).
            let n = Normalize::IMAGENET;
            values.extend(
                pixels
                    .chunks(3)
                    .filter(|p| p != &[0, 0, 0])
                    .map(|p| (p[0] as f32 / 255.0 - n.mean[0]) / n.std[0]),
            );
        }
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / values.len() as f32;
        // Clamping to 0..=255 trims the tails a little.
        assert!(
            mean.abs() < 0.05 && (0.85..1.1).contains(&var),
            "{mean} {var}"
        );
    }
}
