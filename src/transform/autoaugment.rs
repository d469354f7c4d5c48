//! torchvision's automatic augmentation policies: `AutoAugment` (ImageNet, CIFAR-10 and SVHN
//! policies), `RandAugment(num_ops, magnitude)` and `TrivialAugmentWide`, with torchvision's op
//! sets, magnitude tables and draws; the ops themselves are in [`super::ops`].
//!
//! Every draw comes from the sample's [`SampleRng`], after the crop and the flip, so the result
//! depends only on `(seed, epoch, index)`. Magnitude tables are torchvision's `linspace`s,
//! evaluated exactly and rounded to `float32` (torch's own `float32` `linspace` can differ in
//! the last bit with the CPU's vector width: on an AVX-512 machine its `TrivialAugmentWide`
//! translation of bin 15 is 15.999999, truncated to 15 pixels, where this table has 16).

use crate::rng::SampleRng;

use super::ops::{ALL_OPS, Op, RgbImage};

/// Which policy [`AutoAugment`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AugmentPolicy {
    /// torchvision `AutoAugment(AutoAugmentPolicy.IMAGENET)`: one of 25 learned sub-policies.
    ImageNet,
    /// torchvision `AutoAugment(AutoAugmentPolicy.CIFAR10)`.
    Cifar10,
    /// torchvision `AutoAugment(AutoAugmentPolicy.SVHN)`.
    Svhn,
    /// torchvision `RandAugment(num_ops, magnitude, num_magnitude_bins)`.
    RandAugment {
        /// Ops applied one after another.
        num_ops: u32,
        /// The magnitude bin every op uses.
        magnitude: u32,
        /// Bins of the magnitude tables.
        num_magnitude_bins: u32,
    },
    /// torchvision `TrivialAugmentWide(num_magnitude_bins)`: one op, a random bin of the wide
    /// tables.
    TrivialAugmentWide {
        /// Bins of the magnitude tables.
        num_magnitude_bins: u32,
    },
}

/// An automatic augmentation step: the policy and the colour the geometric ops fill with
/// (torchvision's `fill`; black by default). Nearest-neighbour sampling, torchvision's default
/// (and only) interpolation here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutoAugment {
    /// The policy.
    pub policy: AugmentPolicy,
    /// The value of pixels moved in from outside the image.
    pub fill: [u8; 3],
}

/// torchvision's `TrivialAugmentWide()`, `RandAugment()` defaults: 31 magnitude bins.
pub const DEFAULT_MAGNITUDE_BINS: u32 = 31;

/// The most magnitude bins accepted (torchvision has no limit; tables this fine are
/// indistinguishable).
pub const MAX_MAGNITUDE_BINS: u32 = 1 << 16;

/// The most ops `RandAugment` applies to one image.
pub const MAX_RAND_AUGMENT_OPS: u32 = 64;

impl AutoAugment {
    /// The policy with black fill.
    pub fn new(policy: AugmentPolicy) -> AutoAugment {
        AutoAugment {
            policy,
            fill: [0; 3],
        }
    }

    /// torchvision's `TrivialAugmentWide()`: 31 bins, black fill.
    pub fn trivial_augment_wide() -> AutoAugment {
        AutoAugment::new(AugmentPolicy::TrivialAugmentWide {
            num_magnitude_bins: DEFAULT_MAGNITUDE_BINS,
        })
    }

    /// torchvision's `RandAugment(num_ops, magnitude)` with 31 bins, black fill.
    pub fn rand_augment(num_ops: u32, magnitude: u32) -> AutoAugment {
        AutoAugment::new(AugmentPolicy::RandAugment {
            num_ops,
            magnitude,
            num_magnitude_bins: DEFAULT_MAGNITUDE_BINS,
        })
    }

    /// The same policy filling with `fill`.
    pub fn with_fill(mut self, fill: [u8; 3]) -> AutoAugment {
        self.fill = fill;
        self
    }

    /// Checks the parameters as torchvision does (a magnitude inside the table, at least two
    /// bins), with limits that keep the work per image bounded.
    pub fn validate(&self) -> Result<(), String> {
        match self.policy {
            AugmentPolicy::ImageNet | AugmentPolicy::Cifar10 | AugmentPolicy::Svhn => Ok(()),
            AugmentPolicy::RandAugment {
                num_ops,
                magnitude,
                num_magnitude_bins,
            } => {
                bins_in_range(num_magnitude_bins)?;
                if num_ops > MAX_RAND_AUGMENT_OPS {
                    return Err(format!(
                        "RandAugment num_ops {num_ops} is more than {MAX_RAND_AUGMENT_OPS}"
                    ));
                }
                if magnitude >= num_magnitude_bins {
                    return Err(format!(
                        "RandAugment magnitude {magnitude} must be below num_magnitude_bins \
                         {num_magnitude_bins}"
                    ));
                }
                Ok(())
            }
            AugmentPolicy::TrivialAugmentWide { num_magnitude_bins } => {
                bins_in_range(num_magnitude_bins)
            }
        }
    }

    /// Draws the ops for one image from `rng` (as torchvision draws them) and applies them.
    pub fn apply(&self, rng: &mut SampleRng, image: &mut RgbImage<'_>) {
        let size = (image.width, image.height);
        match self.policy {
            AugmentPolicy::TrivialAugmentWide { num_magnitude_bins } => {
                let op = RAND_AUGMENT_OPS[rng.below(RAND_AUGMENT_OPS.len() as u64) as usize];
                let table = Table::new(op, Space::Wide, num_magnitude_bins, size);
                let magnitude = match table.bins() {
                    Some(bins) => table.magnitude(rng.below(bins as u64) as u32),
                    None => 0.0,
                };
                let magnitude = signed(rng, op, magnitude);
                image.apply(op, magnitude, self.fill);
            }
            AugmentPolicy::RandAugment {
                num_ops,
                magnitude: bin,
                num_magnitude_bins,
            } => {
                for _ in 0..num_ops {
                    let op = RAND_AUGMENT_OPS[rng.below(RAND_AUGMENT_OPS.len() as u64) as usize];
                    let table = Table::new(op, Space::Standard, num_magnitude_bins, size);
                    let magnitude = match table.bins() {
                        Some(_) => table.magnitude(bin),
                        None => 0.0,
                    };
                    let magnitude = signed(rng, op, magnitude);
                    image.apply(op, magnitude, self.fill);
                }
            }
            AugmentPolicy::ImageNet | AugmentPolicy::Cifar10 | AugmentPolicy::Svhn => {
                let policies = match self.policy {
                    AugmentPolicy::ImageNet => &IMAGENET_POLICY,
                    AugmentPolicy::Cifar10 => &CIFAR10_POLICY,
                    _ => &SVHN_POLICY,
                };
                // torchvision's get_params: the sub-policy, two probabilities, two signs.
                let pair = &policies[rng.below(policies.len() as u64) as usize];
                let probs = [rng.unit(), rng.unit()];
                let negative = [rng.below(2) == 0, rng.below(2) == 0];
                for (i, &(op, p, bin)) in pair.iter().enumerate() {
                    if probs[i] <= p {
                        let magnitude = match bin {
                            Some(bin) => Table::new(op, Space::Standard, 10, size).magnitude(bin),
                            None => 0.0,
                        };
                        let magnitude = if is_signed(op) && negative[i] {
                            -magnitude
                        } else {
                            magnitude
                        };
                        image.apply(op, magnitude, self.fill);
                    }
                }
            }
        }
    }
}

fn bins_in_range(bins: u32) -> Result<(), String> {
    if (2..=MAX_MAGNITUDE_BINS).contains(&bins) {
        Ok(())
    } else {
        Err(format!(
            "num_magnitude_bins {bins} must be in 2..={MAX_MAGNITUDE_BINS}"
        ))
    }
}

/// The ops `RandAugment` and `TrivialAugmentWide` choose from, in torchvision's order: all but
/// `Invert`.
pub const RAND_AUGMENT_OPS: &[Op] = ALL_OPS.split_at(14).0;

/// Whether torchvision draws a sign for `op`'s magnitude.
fn is_signed(op: Op) -> bool {
    matches!(
        op,
        Op::ShearX
            | Op::ShearY
            | Op::TranslateX
            | Op::TranslateY
            | Op::Rotate
            | Op::Brightness
            | Op::Color
            | Op::Contrast
            | Op::Sharpness
    )
}

/// torchvision's `if signed and torch.randint(2, (1,))`: negative on a 1.
fn signed(rng: &mut SampleRng, op: Op, magnitude: f64) -> f64 {
    if is_signed(op) && rng.below(2) == 1 {
        -magnitude
    } else {
        magnitude
    }
}

/// Which magnitude tables: `AutoAugment`/`RandAugment`'s or `TrivialAugmentWide`'s wider ones.
#[derive(Clone, Copy, PartialEq)]
enum Space {
    Standard,
    Wide,
}

/// One op's magnitude table.
enum Table {
    /// The op takes no magnitude.
    None,
    /// `linspace(start, end, bins)`.
    Linear { start: f64, end: f64, bins: u32 },
    /// `8 - round(arange(bins) / ((bins - 1) / divisor))`.
    Posterize { divisor: f32, bins: u32 },
}

impl Table {
    fn new(op: Op, space: Space, bins: u32, (width, height): (u32, u32)) -> Table {
        let wide = space == Space::Wide;
        let linear = |end: f64| Table::Linear {
            start: 0.0,
            end,
            bins,
        };
        match op {
            Op::ShearX | Op::ShearY => linear(if wide { 0.99 } else { 0.3 }),
            Op::TranslateX | Op::TranslateY if wide => linear(32.0),
            Op::TranslateX => linear(150.0 / 331.0 * width as f64),
            Op::TranslateY => linear(150.0 / 331.0 * height as f64),
            Op::Rotate => linear(if wide { 135.0 } else { 30.0 }),
            Op::Brightness | Op::Color | Op::Contrast | Op::Sharpness => {
                linear(if wide { 0.99 } else { 0.9 })
            }
            Op::Posterize => Table::Posterize {
                divisor: if wide { 6.0 } else { 4.0 },
                bins,
            },
            Op::Solarize => Table::Linear {
                start: 255.0,
                end: 0.0,
                bins,
            },
            Op::Identity | Op::AutoContrast | Op::Equalize | Op::Invert => Table::None,
        }
    }

    fn bins(&self) -> Option<u32> {
        match *self {
            Table::None => None,
            Table::Linear { bins, .. } | Table::Posterize { bins, .. } => Some(bins),
        }
    }

    /// The magnitude of bin `k` (as torchvision reads it: a `float32` table value).
    fn magnitude(&self, k: u32) -> f64 {
        match *self {
            Table::None => 0.0,
            Table::Linear { start, end, bins } => {
                let start32 = start as f32 as f64;
                let end32 = end as f32 as f64;
                let v = start32 + (end32 - start32) * k as f64 / (bins.max(2) - 1) as f64;
                v as f32 as f64
            }
            Table::Posterize { divisor, bins } => {
                let step = (bins.max(2) - 1) as f32 / divisor;
                (8.0 - (k as f32 / step).round_ties_even()) as f64
            }
        }
    }
}

/// One step of a sub-policy: the op, its probability, its magnitude bin (of 10).
type PolicyStep = (Op, f64, Option<u32>);

use Op::{
    AutoContrast as AC, Brightness as Br, Color as Co, Contrast as Ct, Equalize as Eq,
    Invert as In, Posterize as Po, Rotate as Ro, Sharpness as Sh, ShearX as SX, ShearY as SY,
    Solarize as So, TranslateX as TX, TranslateY as TY,
};

/// torchvision's `AutoAugmentPolicy.IMAGENET` sub-policies.
const IMAGENET_POLICY: [[PolicyStep; 2]; 25] = [
    [(Po, 0.4, Some(8)), (Ro, 0.6, Some(9))],
    [(So, 0.6, Some(5)), (AC, 0.6, None)],
    [(Eq, 0.8, None), (Eq, 0.6, None)],
    [(Po, 0.6, Some(7)), (Po, 0.6, Some(6))],
    [(Eq, 0.4, None), (So, 0.2, Some(4))],
    [(Eq, 0.4, None), (Ro, 0.8, Some(8))],
    [(So, 0.6, Some(3)), (Eq, 0.6, None)],
    [(Po, 0.8, Some(5)), (Eq, 1.0, None)],
    [(Ro, 0.2, Some(3)), (So, 0.6, Some(8))],
    [(Eq, 0.6, None), (Po, 0.4, Some(6))],
    [(Ro, 0.8, Some(8)), (Co, 0.4, Some(0))],
    [(Ro, 0.4, Some(9)), (Eq, 0.6, None)],
    [(Eq, 0.0, None), (Eq, 0.8, None)],
    [(In, 0.6, None), (Eq, 1.0, None)],
    [(Co, 0.6, Some(4)), (Ct, 1.0, Some(8))],
    [(Ro, 0.8, Some(8)), (Co, 1.0, Some(2))],
    [(Co, 0.8, Some(8)), (So, 0.8, Some(7))],
    [(Sh, 0.4, Some(7)), (In, 0.6, None)],
    [(SX, 0.6, Some(5)), (Eq, 1.0, None)],
    [(Co, 0.4, Some(0)), (Eq, 0.6, None)],
    [(Eq, 0.4, None), (So, 0.2, Some(4))],
    [(So, 0.6, Some(5)), (AC, 0.6, None)],
    [(In, 0.6, None), (Eq, 1.0, None)],
    [(Co, 0.6, Some(4)), (Ct, 1.0, Some(8))],
    [(Eq, 0.8, None), (Eq, 0.6, None)],
];

/// torchvision's `AutoAugmentPolicy.CIFAR10` sub-policies.
const CIFAR10_POLICY: [[PolicyStep; 2]; 25] = [
    [(In, 0.1, None), (Ct, 0.2, Some(6))],
    [(Ro, 0.7, Some(2)), (TX, 0.3, Some(9))],
    [(Sh, 0.8, Some(1)), (Sh, 0.9, Some(3))],
    [(SY, 0.5, Some(8)), (TY, 0.7, Some(9))],
    [(AC, 0.5, None), (Eq, 0.9, None)],
    [(SY, 0.2, Some(7)), (Po, 0.3, Some(7))],
    [(Co, 0.4, Some(3)), (Br, 0.6, Some(7))],
    [(Sh, 0.3, Some(9)), (Br, 0.7, Some(9))],
    [(Eq, 0.6, None), (Eq, 0.5, None)],
    [(Ct, 0.6, Some(7)), (Sh, 0.6, Some(5))],
    [(Co, 0.7, Some(7)), (TX, 0.5, Some(8))],
    [(Eq, 0.3, None), (AC, 0.4, None)],
    [(TY, 0.4, Some(3)), (Sh, 0.2, Some(6))],
    [(Br, 0.9, Some(6)), (Co, 0.2, Some(8))],
    [(So, 0.5, Some(2)), (In, 0.0, None)],
    [(Eq, 0.2, None), (AC, 0.6, None)],
    [(Eq, 0.2, None), (Eq, 0.6, None)],
    [(Co, 0.9, Some(9)), (Eq, 0.6, None)],
    [(AC, 0.8, None), (So, 0.2, Some(8))],
    [(Br, 0.1, Some(3)), (Co, 0.7, Some(0))],
    [(So, 0.4, Some(5)), (AC, 0.9, None)],
    [(TY, 0.9, Some(9)), (TY, 0.7, Some(9))],
    [(AC, 0.9, None), (So, 0.8, Some(3))],
    [(Eq, 0.8, None), (In, 0.1, None)],
    [(TY, 0.7, Some(9)), (AC, 0.9, None)],
];

/// torchvision's `AutoAugmentPolicy.SVHN` sub-policies.
const SVHN_POLICY: [[PolicyStep; 2]; 25] = [
    [(SX, 0.9, Some(4)), (In, 0.2, None)],
    [(SY, 0.9, Some(8)), (In, 0.7, None)],
    [(Eq, 0.6, None), (So, 0.6, Some(6))],
    [(In, 0.9, None), (Eq, 0.6, None)],
    [(Eq, 0.6, None), (Ro, 0.9, Some(3))],
    [(SX, 0.9, Some(4)), (AC, 0.8, None)],
    [(SY, 0.9, Some(8)), (In, 0.4, None)],
    [(SY, 0.9, Some(5)), (So, 0.2, Some(6))],
    [(In, 0.9, None), (AC, 0.8, None)],
    [(Eq, 0.6, None), (Ro, 0.9, Some(3))],
    [(SX, 0.9, Some(4)), (So, 0.3, Some(3))],
    [(SY, 0.8, Some(8)), (In, 0.7, None)],
    [(Eq, 0.9, None), (TY, 0.6, Some(6))],
    [(In, 0.9, None), (Eq, 0.6, None)],
    [(Ct, 0.3, Some(3)), (Ro, 0.8, Some(4))],
    [(In, 0.8, None), (TY, 0.0, Some(2))],
    [(SY, 0.7, Some(6)), (So, 0.4, Some(8))],
    [(In, 0.6, None), (Ro, 0.8, Some(4))],
    [(SY, 0.3, Some(7)), (TX, 0.9, Some(3))],
    [(SX, 0.1, Some(6)), (In, 0.6, None)],
    [(So, 0.7, Some(2)), (TY, 0.6, Some(7))],
    [(SY, 0.8, Some(4)), (In, 0.8, None)],
    [(SX, 0.7, Some(9)), (TY, 0.8, Some(3))],
    [(SY, 0.8, Some(5)), (AC, 0.7, None)],
    [(SX, 0.7, Some(2)), (In, 0.1, None)],
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_torchvisions() {
        let size = (224, 160);
        let t = |op, space, bins| Table::new(op, space, bins, size);
        // Ends and a middle bin of each table (float32 values read back as doubles).
        assert_eq!(t(Op::ShearX, Space::Wide, 31).magnitude(30), 0.99f32 as f64);
        assert_eq!(t(Op::TranslateX, Space::Wide, 31).magnitude(15), 16.0);
        assert_eq!(t(Op::Rotate, Space::Wide, 31).magnitude(20), 90.0);
        assert_eq!(t(Op::Rotate, Space::Standard, 31).magnitude(9), 9.0);
        assert_eq!(
            t(Op::TranslateY, Space::Standard, 10).magnitude(9),
            (150.0 / 331.0 * 160.0) as f32 as f64
        );
        assert_eq!(t(Op::Solarize, Space::Standard, 10).magnitude(0), 255.0);
        assert_eq!(t(Op::Solarize, Space::Standard, 10).magnitude(9), 0.0);
        // Posterize: 8 - round(k / 5) on 31 wide bins (8 .. 2), 8 - round(k / 2.25) on 10.
        let wide: Vec<f64> = (0..31)
            .map(|k| t(Op::Posterize, Space::Wide, 31).magnitude(k))
            .collect();
        assert_eq!((wide[0], wide[2], wide[3], wide[30]), (8.0, 8.0, 7.0, 2.0));
        assert_eq!(t(Op::Posterize, Space::Standard, 10).magnitude(8), 4.0);
        assert!(t(Op::Equalize, Space::Wide, 31).bins().is_none());
        assert_eq!(RAND_AUGMENT_OPS.len(), 14);
        assert!(!RAND_AUGMENT_OPS.contains(&Op::Invert));
    }

    #[test]
    fn draws_depend_only_on_the_sample_rng_and_change_the_image() {
        let (w, h) = (24u32, 20u32);
        let image: Vec<u8> = (0..w * h * 3).map(|i| (i * 37 % 251) as u8).collect();
        for policy in [
            AugmentPolicy::ImageNet,
            AugmentPolicy::Cifar10,
            AugmentPolicy::Svhn,
            AugmentPolicy::RandAugment {
                num_ops: 2,
                magnitude: 9,
                num_magnitude_bins: 31,
            },
            AugmentPolicy::TrivialAugmentWide {
                num_magnitude_bins: 31,
            },
        ] {
            let augment = AutoAugment::new(policy);
            augment.validate().unwrap();
            let mut changed = 0;
            for index in 0..40 {
                let run = || {
                    let (mut p, mut s) = (image.clone(), Vec::new());
                    let mut rng = SampleRng::new(1, 2, index);
                    augment.apply(
                        &mut rng,
                        &mut RgbImage {
                            pixels: &mut p,
                            scratch: &mut s,
                            width: w,
                            height: h,
                        },
                    );
                    (p, rng.next_u64())
                };
                let (a, next) = run();
                assert_eq!((a.clone(), next), run(), "{policy:?} sample {index}");
                changed += (a != image) as usize;
            }
            assert!(changed >= 15, "{policy:?}: {changed} of 40 changed");
        }
    }

    #[test]
    fn invalid_parameters_are_refused() {
        let rand = |num_ops, magnitude, num_magnitude_bins| {
            AutoAugment::new(AugmentPolicy::RandAugment {
                num_ops,
                magnitude,
                num_magnitude_bins,
            })
            .validate()
        };
        assert!(rand(2, 9, 31).is_ok());
        assert!(rand(2, 31, 31).is_err());
        assert!(rand(2, 0, 1).is_err());
        assert!(rand(MAX_RAND_AUGMENT_OPS + 1, 9, 31).is_err());
        let wide = |num_magnitude_bins| {
            AutoAugment::new(AugmentPolicy::TrivialAugmentWide { num_magnitude_bins }).validate()
        };
        assert!(wide(0).is_err() && wide(MAX_MAGNITUDE_BINS + 1).is_err());
        assert!(wide(2).is_ok());
    }
}
