//! timm's RandAugment (`rand_augment_transform("rand-m9-mstd0.5-inc1", hparams)`), the automatic
//! augmentation of timm's recipes (DeiT, ConvNeXt, Swin, EfficientNet): its own op set and level
//! functions, which differ from torchvision's `RandAugment`.
//!
//! For each of `num_ops` ops drawn with replacement from the 15 of timm's list: the op applies
//! with probability `prob` (0.5); its magnitude is the configured one, or with `mstd` a normal
//! draw around it (uniform in 0..m when `mstd` > 100), clipped to 0..`mmax` (10); the level
//! function turns it into the op's argument, negated with probability ½ for the signed ops; the
//! geometric ops sample bilinearly, bicubically or (timm's default) either at random, and fill
//! with the image mean colour timm passes (`img_mean`). The ops are PIL's, as timm runs them:
//! value for value (see [`super::ops`] and [`super::affine_filter`]).
//!
//! Draws come from the sample's [`SampleRng`]; the same seed gives other draws than timm's
//! Python `random`, with the same distributions.

use crate::rng::SampleRng;

use super::affine_filter::AffineFilter;
use super::ops::{Op, RgbImage};

/// One op of timm's RandAugment lists; each takes the argument its level function makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimmOp {
    /// PIL `ImageOps.autocontrast`.
    AutoContrast,
    /// PIL `ImageOps.equalize`.
    Equalize,
    /// PIL `ImageOps.invert`.
    Invert,
    /// `Image.rotate(degrees)`.
    Rotate,
    /// Keep `bits` high bits (`bits >= 8`: unchanged).
    Posterize,
    /// Invert values at or above the threshold.
    Solarize,
    /// Add to values below 128 (clipped at 255).
    SolarizeAdd,
    /// `ImageEnhance.Color(factor)`.
    Color,
    /// `ImageEnhance.Contrast(factor)`.
    Contrast,
    /// `ImageEnhance.Brightness(factor)`.
    Brightness,
    /// `ImageEnhance.Sharpness(factor)`.
    Sharpness,
    /// Affine `(1, factor, 0, 0, 1, 0)`.
    ShearX,
    /// Affine `(1, 0, 0, factor, 1, 0)`.
    ShearY,
    /// Shift by `fraction × width` pixels (not rounded).
    TranslateXRel,
    /// Shift by `fraction × height` pixels.
    TranslateYRel,
}

/// timm's `_RAND_TRANSFORMS` (and, with `increasing`, `_RAND_INCREASING_TRANSFORMS`: the same
/// ops with the level functions that grow with the magnitude), in its order.
pub const TIMM_RAND_OPS: [TimmOp; 15] = [
    TimmOp::AutoContrast,
    TimmOp::Equalize,
    TimmOp::Invert,
    TimmOp::Rotate,
    TimmOp::Posterize,
    TimmOp::Solarize,
    TimmOp::SolarizeAdd,
    TimmOp::Color,
    TimmOp::Contrast,
    TimmOp::Brightness,
    TimmOp::Sharpness,
    TimmOp::ShearX,
    TimmOp::ShearY,
    TimmOp::TranslateXRel,
    TimmOp::TranslateYRel,
];

impl TimmOp {
    /// timm's name of the op.
    pub fn name(self) -> &'static str {
        match self {
            TimmOp::AutoContrast => "AutoContrast",
            TimmOp::Equalize => "Equalize",
            TimmOp::Invert => "Invert",
            TimmOp::Rotate => "Rotate",
            TimmOp::Posterize => "Posterize",
            TimmOp::Solarize => "Solarize",
            TimmOp::SolarizeAdd => "SolarizeAdd",
            TimmOp::Color => "Color",
            TimmOp::Contrast => "Contrast",
            TimmOp::Brightness => "Brightness",
            TimmOp::Sharpness => "Sharpness",
            TimmOp::ShearX => "ShearX",
            TimmOp::ShearY => "ShearY",
            TimmOp::TranslateXRel => "TranslateXRel",
            TimmOp::TranslateYRel => "TranslateYRel",
        }
    }

    /// The op timm names `name`.
    pub fn from_name(name: &str) -> Option<TimmOp> {
        TIMM_RAND_OPS.into_iter().find(|op| op.name() == name)
    }

    /// Whether the op moves pixels (and so samples with a filter).
    pub fn is_geometric(self) -> bool {
        matches!(
            self,
            TimmOp::Rotate
                | TimmOp::ShearX
                | TimmOp::ShearY
                | TimmOp::TranslateXRel
                | TimmOp::TranslateYRel
        )
    }

    /// Applies the op with its argument `arg` (what timm's level function returns), as timm's
    /// op function does on a PIL image, the geometric ops sampling with `filter` (`None`:
    /// nearest neighbour).
    pub fn apply(
        self,
        image: &mut RgbImage<'_>,
        arg: f64,
        fill: [u8; 3],
        filter: Option<AffineFilter>,
    ) {
        let (w, h) = (f64::from(image.width), f64::from(image.height));
        let affine = |image: &mut RgbImage<'_>, m| image.affine_with(m, fill, filter);
        match self {
            TimmOp::AutoContrast => image.apply(Op::AutoContrast, 0.0, fill),
            TimmOp::Equalize => image.apply(Op::Equalize, 0.0, fill),
            TimmOp::Invert => image.apply(Op::Invert, 0.0, fill),
            TimmOp::Rotate => image.rotate(arg, fill, filter),
            TimmOp::Posterize if arg >= 8.0 => {}
            TimmOp::Posterize => image.apply(Op::Posterize, arg, fill),
            TimmOp::Solarize => image.apply(Op::Solarize, arg, fill),
            TimmOp::SolarizeAdd => {
                let add = arg.clamp(0.0, 255.0) as u16;
                let lut: [u8; 256] = std::array::from_fn(|v| {
                    if v < 128 {
                        (v as u16 + add).min(255) as u8
                    } else {
                        v as u8
                    }
                });
                for v in image.pixels.iter_mut() {
                    *v = lut[usize::from(*v)];
                }
            }
            TimmOp::Color => image.enhance(Op::Color, arg as f32),
            TimmOp::Contrast => image.enhance(Op::Contrast, arg as f32),
            TimmOp::Brightness => image.enhance(Op::Brightness, arg as f32),
            TimmOp::Sharpness => image.enhance(Op::Sharpness, arg as f32),
            TimmOp::ShearX => affine(image, [1.0, arg, 0.0, 0.0, 1.0, 0.0]),
            TimmOp::ShearY => affine(image, [1.0, 0.0, 0.0, arg, 1.0, 0.0]),
            TimmOp::TranslateXRel => affine(image, [1.0, 0.0, arg * w, 0.0, 1.0, 0.0]),
            TimmOp::TranslateYRel => affine(image, [1.0, 0.0, 0.0, 0.0, 1.0, arg * h]),
        }
    }
}

/// How timm's geometric ops sample (its `interpolation` hparam).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TimmResample {
    /// Bilinear or bicubic, drawn per op (timm's default, `_RANDOM_INTERPOLATION`).
    #[default]
    Random,
    /// Always bilinear.
    Bilinear,
    /// Always bicubic.
    Bicubic,
    /// Always nearest neighbour.
    Nearest,
}

/// timm's magnitude scale: magnitudes are tenths of an op's full range.
const LEVEL_DENOM: f64 = 10.0;

/// timm's `RandAugment` as `rand_augment_transform` builds it from a config string.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimmRandAugment {
    /// Ops per image (`n`, default 2).
    pub num_ops: u32,
    /// The magnitude (`m`, default 10) on timm's 0..10 scale.
    pub magnitude: f64,
    /// The magnitude's noise (`mstd`): the standard deviation of a normal draw around
    /// `magnitude`; infinite for a uniform draw in 0..`magnitude`; 0 for none.
    pub magnitude_std: f64,
    /// The largest magnitude after the noise (`mmax`, default 10).
    pub magnitude_max: f64,
    /// Each op's probability of applying (`p`, default 0.5).
    pub prob: f64,
    /// timm's `_RAND_INCREASING_TRANSFORMS` level functions (`inc1`).
    pub increasing: bool,
    /// The colour moved-in pixels take (timm's `img_mean`; its default `(128, 128, 128)`).
    pub fill: [u8; 3],
    /// How the geometric ops sample.
    pub resample: TimmResample,
    /// TranslateXRel/YRel's largest shift as a fraction of the side (`translate_pct`, 0.45).
    pub translate_pct: f64,
}

/// The most ops timm's RandAugment takes per image here.
pub const MAX_TIMM_OPS: u32 = 64;

/// The largest magnitude (and `mmax`) accepted: ten times timm's scale, past which every op's
/// argument is saturated or meaningless (timm has no limit; a huge one overflows the levels).
pub const MAX_TIMM_MAGNITUDE: f64 = 100.0;

impl TimmRandAugment {
    /// timm's defaults (`"rand"`): 2 ops at magnitude 10, p 0.5, no noise, grey fill.
    pub fn new() -> TimmRandAugment {
        TimmRandAugment {
            num_ops: 2,
            magnitude: LEVEL_DENOM,
            magnitude_std: 0.0,
            magnitude_max: LEVEL_DENOM,
            prob: 0.5,
            increasing: false,
            fill: [128; 3],
            resample: TimmResample::Random,
            translate_pct: 0.45,
        }
    }

    /// Parses timm's config string (`"rand-m9-mstd0.5-inc1"`: sections `m`, `n`, `p`, `mstd`,
    /// `mmax`, `inc`), with timm's defaults for what it leaves out.
    ///
    /// # Errors
    /// Not a `rand` config, an unknown section, an unparsable number, or a transform set
    /// (`t...`) other than the default.
    pub fn from_config(config: &str) -> Result<TimmRandAugment, String> {
        let mut sections = config.split('-');
        if sections.next() != Some("rand") {
            return Err(format!(
                "timm RandAugment config {config:?} must start with \"rand\""
            ));
        }
        let mut ra = TimmRandAugment::new();
        // timm sets mstd and mmax with `setdefault` (the first one given counts) and the others
        // by assignment (the last one counts).
        let (mut std_given, mut max_given) = (false, false);
        for section in sections.filter(|s| !s.is_empty()) {
            let split = section
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(section.len());
            let (key, value) = section.split_at(split);
            let bad = || {
                format!(
                    "timm RandAugment config {config:?}: section {section:?} is not one of m, n, \
                     mmax, inc with a whole number or p, mstd with a decimal one (transform sets \
                     are not supported)"
                )
            };
            // What timm's int() and float() take, less their exotic forms (exponents, signs,
            // underscores, other digits), which are refused.
            let whole = || -> Result<f64, String> {
                if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                value.parse::<f64>().map_err(|_| bad())
            };
            let decimal = || -> Result<f64, String> {
                let digits = value.bytes().filter(u8::is_ascii_digit).count();
                let dots = value.bytes().filter(|&b| b == b'.').count();
                if digits == 0 || dots > 1 || digits + dots != value.len() {
                    return Err(bad());
                }
                value.parse::<f64>().map_err(|_| bad())
            };
            match key {
                "m" => ra.magnitude = whole()?,
                "n" => {
                    // Checked here, as written: clamped first, 2^32 was reported as 2^32 - 1.
                    let n = whole()?;
                    if n > f64::from(MAX_TIMM_OPS) {
                        return Err(format!(
                            "timm RandAugment config {config:?}: n{value} is more than \
                             {MAX_TIMM_OPS} operations"
                        ));
                    }
                    ra.num_ops = n as u32;
                }
                "p" => ra.prob = decimal()?,
                "mstd" => {
                    let std = decimal()?;
                    if !std_given {
                        ra.magnitude_std = if std > 100.0 { f64::INFINITY } else { std };
                        std_given = true;
                    }
                }
                "mmax" => {
                    let max = whole()?;
                    if !max_given {
                        // timm: `magnitude_max or 10`, so 0 is the default ceiling.
                        ra.magnitude_max = if max == 0.0 { LEVEL_DENOM } else { max };
                        max_given = true;
                    }
                }
                "inc" => ra.increasing = whole()? != 0.0,
                _ => return Err(bad()),
            }
        }
        ra.validate()?;
        Ok(ra)
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_ops > MAX_TIMM_OPS {
            return Err(format!(
                "timm RandAugment num_ops {} is more than {MAX_TIMM_OPS}",
                self.num_ops
            ));
        }
        let sane = |v: f64| (0.0..=MAX_TIMM_MAGNITUDE).contains(&v);
        if !sane(self.magnitude) || !sane(self.magnitude_max) {
            return Err(format!(
                "timm RandAugment magnitude {} and mmax {} must be in 0..{MAX_TIMM_MAGNITUDE}",
                self.magnitude, self.magnitude_max
            ));
        }
        if self.magnitude_std.is_nan() || self.magnitude_std < 0.0 {
            return Err(format!(
                "timm RandAugment mstd {} must be non-negative",
                self.magnitude_std
            ));
        }
        if !(0.0..=1.0).contains(&self.prob) {
            return Err(format!("timm RandAugment p {} is not in 0..1", self.prob));
        }
        if !(0.0..=1.0).contains(&self.translate_pct) {
            return Err(format!(
                "timm RandAugment translate_pct {} is not in 0..1",
                self.translate_pct
            ));
        }
        Ok(())
    }

    /// Draws and applies the ops to one image.
    pub fn apply(&self, rng: &mut SampleRng, image: &mut RgbImage<'_>) {
        for _ in 0..self.num_ops {
            let op = TIMM_RAND_OPS[rng.below(TIMM_RAND_OPS.len() as u64) as usize];
            if self.prob < 1.0 && rng.unit() > self.prob {
                continue;
            }
            let magnitude = self.noisy_magnitude(rng);
            let arg = self.level(op, magnitude, rng);
            let filter = match self.resample {
                TimmResample::Bilinear => Some(AffineFilter::Bilinear),
                TimmResample::Bicubic => Some(AffineFilter::Bicubic),
                TimmResample::Nearest => None,
                TimmResample::Random if op.is_geometric() => {
                    Some([AffineFilter::Bilinear, AffineFilter::Bicubic][rng.below(2) as usize])
                }
                TimmResample::Random => None,
            };
            op.apply(image, arg, self.fill, filter);
        }
    }

    /// timm's `AugmentOp.__call__`: the magnitude with its noise, clipped to 0..`mmax`.
    fn noisy_magnitude(&self, rng: &mut SampleRng) -> f64 {
        let magnitude = if self.magnitude_std == f64::INFINITY {
            rng.uniform(0.0, self.magnitude)
        } else if self.magnitude_std > 0.0 {
            self.magnitude + self.magnitude_std * rng.normal()
        } else {
            self.magnitude
        };
        magnitude.min(self.magnitude_max).max(0.0)
    }

    /// timm's level function for `op` (`LEVEL_TO_ARG`, the increasing ones with `inc1`).
    fn level(&self, op: TimmOp, magnitude: f64, rng: &mut SampleRng) -> f64 {
        let level = magnitude / LEVEL_DENOM;
        // `_randomly_negate`: negative when random() > 0.5.
        let mut negate = |v: f64| if rng.unit() > 0.5 { -v } else { v };
        match op {
            TimmOp::AutoContrast | TimmOp::Equalize | TimmOp::Invert => 0.0,
            TimmOp::Rotate => negate(level * 30.0),
            TimmOp::Posterize => {
                let bits = (level * 4.0).trunc();
                if self.increasing { 4.0 - bits } else { bits }
            }
            TimmOp::Solarize => {
                let threshold = (level * 256.0).trunc().min(256.0);
                if self.increasing {
                    256.0 - threshold
                } else {
                    threshold
                }
            }
            TimmOp::SolarizeAdd => (level * 110.0).trunc().min(128.0),
            TimmOp::Color | TimmOp::Contrast | TimmOp::Brightness | TimmOp::Sharpness => {
                if self.increasing {
                    (1.0 + negate(level * 0.9)).max(0.1)
                } else {
                    level * 1.8 + 0.1
                }
            }
            TimmOp::ShearX | TimmOp::ShearY => negate(level * 0.3),
            TimmOp::TranslateXRel | TimmOp::TranslateYRel => negate(level * self.translate_pct),
        }
    }
}

impl Default for TimmRandAugment {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_parse_as_timm_reads_them() {
        let ra = TimmRandAugment::from_config("rand-m9-mstd0.5-inc1").unwrap();
        assert_eq!(
            (
                ra.num_ops,
                ra.magnitude,
                ra.magnitude_std,
                ra.increasing,
                ra.prob
            ),
            (2, 9.0, 0.5, true, 0.5)
        );
        let ra = TimmRandAugment::from_config("rand-n3-m7-mstd101-mmax15-p0.7").unwrap();
        assert_eq!(ra.num_ops, 3);
        assert_eq!(ra.magnitude_std, f64::INFINITY);
        assert_eq!((ra.magnitude_max, ra.prob), (15.0, 0.7));
        assert_eq!(
            TimmRandAugment::from_config("rand").unwrap(),
            TimmRandAugment::new()
        );
        for bad in [
            "augmix-m5",
            "rand-x3",
            "rand-mfoo",
            "rand-tweights",
            "rand-p2",
            "rand-n99",
        ] {
            assert!(TimmRandAugment::from_config(bad).is_err(), "{bad}");
        }
        // A count past u32 is named as written, not as the largest u32.
        let err = TimmRandAugment::from_config("rand-m9-n4294967296").unwrap_err();
        assert!(err.contains("n4294967296"), "{err}");
        assert_eq!(
            TimmRandAugment::from_config("rand-n64").unwrap().num_ops,
            MAX_TIMM_OPS
        );
    }

    #[test]
    fn level_functions_are_timms() {
        let mut ra = TimmRandAugment::from_config("rand-m9").unwrap();
        let mut rng = SampleRng::new(0, 0, 0);
        // Unsigned levels at m = 9.
        assert_eq!(ra.level(TimmOp::Posterize, 9.0, &mut rng), 3.0);
        assert_eq!(ra.level(TimmOp::Solarize, 9.0, &mut rng), 230.0);
        assert_eq!(ra.level(TimmOp::SolarizeAdd, 9.0, &mut rng), 99.0);
        assert!((ra.level(TimmOp::Color, 9.0, &mut rng) - 1.72).abs() < 1e-12);
        ra.increasing = true;
        assert_eq!(ra.level(TimmOp::Posterize, 9.0, &mut rng), 1.0);
        assert_eq!(ra.level(TimmOp::Solarize, 9.0, &mut rng), 26.0);
        // Signed levels: both signs, the right size.
        let mut signs = [0; 2];
        for _ in 0..200 {
            let v = ra.level(TimmOp::Rotate, 10.0, &mut rng);
            assert_eq!(v.abs(), 30.0);
            signs[usize::from(v > 0.0)] += 1;
            let f = ra.level(TimmOp::Brightness, 10.0, &mut rng);
            assert!(f == 1.9 || f == 0.1, "{f}");
        }
        assert!(signs[0] > 60 && signs[1] > 60, "{signs:?}");
    }

    #[test]
    fn noise_is_clipped_to_the_range_and_centred_on_the_magnitude() {
        let ra = TimmRandAugment::from_config("rand-m9-mstd0.5").unwrap();
        let mut rng = SampleRng::new(1, 0, 0);
        let draws: Vec<f64> = (0..4000).map(|_| ra.noisy_magnitude(&mut rng)).collect();
        assert!(draws.iter().all(|&m| (0.0..=10.0).contains(&m)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 9.0).abs() < 0.05, "{mean}");
        let uniform = TimmRandAugment::from_config("rand-m8-mstd200").unwrap();
        let draws: Vec<f64> = (0..4000)
            .map(|_| uniform.noisy_magnitude(&mut rng))
            .collect();
        assert!(draws.iter().all(|&m| (0.0..8.0).contains(&m)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 4.0).abs() < 0.2, "{mean}");
    }
}
