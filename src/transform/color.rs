//! torchvision's `ColorJitter(brightness, contrast, saturation, hue)` (optionally inside
//! `RandomApply(p)`) and `RandomGrayscale(p)`, with PIL's arithmetic ([`super::ops`]).
//!
//! Draws as torchvision's: for `ColorJitter`, the order of the four adjustments (a random
//! permutation), then a factor for each adjustment that is on, uniform in its range and rounded
//! to `float32` (torch draws them as `float32` tensors); `RandomGrayscale` one uniform.

use crate::rng::SampleRng;

use super::ops::{adjust_brightness, adjust_contrast, adjust_hue, adjust_saturation, to_grayscale};

/// torchvision `ColorJitter`: each range `None` when the adjustment is off (torchvision's `0`,
/// or a range that is exactly its centre).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColorJitter {
    /// Brightness factor range (non-negative).
    pub brightness: Option<(f64, f64)>,
    /// Contrast factor range (non-negative).
    pub contrast: Option<(f64, f64)>,
    /// Saturation factor range (non-negative).
    pub saturation: Option<(f64, f64)>,
    /// Hue shift range, within -0.5..=0.5 (fractions of the hue circle).
    pub hue: Option<(f64, f64)>,
    /// Probability that the jitter applies at all (torchvision's `RandomApply([jitter], p)`;
    /// 1 for a plain `ColorJitter`).
    pub p: f64,
}

impl ColorJitter {
    /// torchvision's `ColorJitter(brightness, contrast, saturation, hue)` with single numbers:
    /// factors in `[max(0, 1 - x), 1 + x]`, hue in `[-hue, hue]`; 0 turns an adjustment off.
    pub fn new(brightness: f64, contrast: f64, saturation: f64, hue: f64) -> ColorJitter {
        let around_one = |x: f64| (x != 0.0).then(|| ((1.0 - x).max(0.0), 1.0 + x));
        ColorJitter {
            brightness: around_one(brightness),
            contrast: around_one(contrast),
            saturation: around_one(saturation),
            hue: (hue != 0.0).then_some((-hue, hue)),
            p: 1.0,
        }
    }

    /// Checks the ranges as torchvision does.
    pub fn validate(&self) -> Result<(), String> {
        for (name, range, low, high) in [
            ("brightness", self.brightness, 0.0, f64::INFINITY),
            ("contrast", self.contrast, 0.0, f64::INFINITY),
            ("saturation", self.saturation, 0.0, f64::INFINITY),
            ("hue", self.hue, -0.5, 0.5),
        ] {
            if let Some((a, b)) = range
                && !(low <= a && a <= b && b <= high && b.is_finite())
            {
                return Err(format!(
                    "ColorJitter {name} range ({a}, {b}) must be ordered within ({low}, {high})"
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.p) {
            return Err(format!("ColorJitter probability {} is not in 0..1", self.p));
        }
        Ok(())
    }

    /// Draws and applies the jitter to RGB `pixels`.
    pub fn apply(&self, rng: &mut SampleRng, pixels: &mut [u8]) {
        if self.p < 1.0 && !rng.chance(self.p) {
            return;
        }
        // torch.randperm(4), then the factors in the fixed order b, c, s, h.
        let mut order = [0usize, 1, 2, 3];
        for i in (1..4).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut draw = |range: Option<(f64, f64)>| {
            range.map(|(low, high)| rng.uniform(low, high).clamp(low, high) as f32)
        };
        let factors = [
            draw(self.brightness),
            draw(self.contrast),
            draw(self.saturation),
            draw(self.hue),
        ];
        for step in order {
            let Some(factor) = factors[step] else {
                continue;
            };
            match step {
                0 => adjust_brightness(pixels, factor),
                1 => adjust_contrast(pixels, factor),
                2 => adjust_saturation(pixels, factor),
                _ => adjust_hue(pixels, factor as f64),
            }
        }
    }
}

/// torchvision `RandomGrayscale(p)`: with probability `p`, PIL's gray in all three channels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomGrayscale {
    /// Probability of turning the image gray.
    pub p: f64,
}

impl RandomGrayscale {
    /// Checks the probability.
    pub fn validate(&self) -> Result<(), String> {
        if (0.0..=1.0).contains(&self.p) {
            Ok(())
        } else {
            Err(format!("RandomGrayscale p {} is not in 0..1", self.p))
        }
    }

    /// Draws and applies to RGB `pixels`.
    pub fn apply(&self, rng: &mut SampleRng, pixels: &mut [u8]) {
        if rng.chance(self.p) {
            to_grayscale(pixels);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> Vec<u8> {
        (0..16 * 16 * 3).map(|i| (i * 53 % 256) as u8).collect()
    }

    #[test]
    fn jitter_draws_depend_only_on_the_sample_and_off_means_untouched() {
        let jitter = ColorJitter::new(0.4, 0.4, 0.4, 0.1);
        jitter.validate().unwrap();
        let mut changed = 0;
        for index in 0..30 {
            let run = || {
                let mut p = image();
                jitter.apply(&mut SampleRng::new(4, 0, index), &mut p);
                p
            };
            let a = run();
            assert_eq!(a, run());
            changed += (a != image()) as usize;
        }
        assert!(changed >= 25, "{changed}");
        // Every adjustment off: nothing drawn but the order, nothing changed.
        let mut p = image();
        ColorJitter::new(0.0, 0.0, 0.0, 0.0).apply(&mut SampleRng::new(0, 0, 0), &mut p);
        assert_eq!(p, image());
        // p = 0: never applied.
        let mut p = image();
        ColorJitter { p: 0.0, ..jitter }.apply(&mut SampleRng::new(0, 0, 0), &mut p);
        assert_eq!(p, image());
    }

    #[test]
    fn grayscale_makes_channels_equal_and_ranges_are_checked() {
        let mut p = image();
        RandomGrayscale { p: 1.0 }.apply(&mut SampleRng::new(0, 0, 0), &mut p);
        assert!(p.chunks(3).all(|c| c[0] == c[1] && c[1] == c[2]));
        assert!(RandomGrayscale { p: 1.5 }.validate().is_err());
        assert!(ColorJitter::new(0.0, 0.0, 0.0, 0.6).validate().is_err());
        assert!(ColorJitter::new(1.5, 0.0, 0.0, 0.0).validate().is_ok());
        let mut backwards = ColorJitter::new(0.2, 0.0, 0.0, 0.0);
        backwards.brightness = Some((1.2, 0.8));
        assert!(backwards.validate().is_err());
    }
}
