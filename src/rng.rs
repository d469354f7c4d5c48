//! Seeded randomness with an explicit, pinned algorithm.
//!
//! Every random decision for a sample (crop box, flip, ...) comes from [`SampleRng::new`]`(seed,
//! epoch, index)`: ChaCha8 keyed by those three numbers. Nothing depends on which worker handles
//! the sample, or when, so batches are bit-identical for a seed whatever the number of workers.
//! The algorithm is pinned (`rand_chacha`'s ChaCha8, used only through `rand_core`), and the
//! conversions to floats and ranges are written here, so results do not change when a `rand`
//! release changes its distributions.

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore as _, SeedableRng as _};

/// A deterministic random stream for one sample in one epoch (or for one epoch's shuffle).
pub struct SampleRng(ChaCha8Rng);

impl SampleRng {
    /// The stream for sample `index` of `epoch` under `seed`.
    pub fn new(seed: u64, epoch: u64, index: u64) -> Self {
        Self::keyed(seed, epoch, index, 0)
    }

    /// A stream for another purpose than per-sample augmentation (`domain` != 0), e.g. the
    /// epoch's shuffle or bad-sample replacement, independent of the sample streams.
    pub fn keyed(seed: u64, epoch: u64, index: u64, domain: u64) -> Self {
        let mut key = [0u8; 32];
        key[0..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&epoch.to_le_bytes());
        key[16..24].copy_from_slice(&index.to_le_bytes());
        key[24..32].copy_from_slice(&domain.to_le_bytes());
        SampleRng(ChaCha8Rng::from_seed(key))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `[0, 1)`, 53 bits of precision.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[low, high)`.
    pub fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.unit()
    }

    /// Uniform integer in `0..n` (unbiased, by rejection). `n` must be > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let v = self.next_u64();
            if v < zone {
                return v % n;
            }
        }
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// A standard normal value (Box-Muller on two uniforms; the cosine branch only).
    pub fn normal(&mut self) -> f64 {
        let u = 1.0 - self.unit(); // (0, 1]: ln is finite
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    /// A Gamma(`shape`, 1) value, `shape` > 0 (Marsaglia and Tsang's method; for `shape` < 1,
    /// Gamma(`shape` + 1) · U^(1/`shape`)).
    pub fn gamma(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            let u = 1.0 - self.unit();
            return self.gamma(shape + 1.0) * u.powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let (x, v) = loop {
                let x = self.normal();
                let v = 1.0 + c * x;
                if v > 0.0 {
                    break (x, v * v * v);
                }
            };
            let u = 1.0 - self.unit();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v;
            }
        }
    }

    /// A Beta(`a`, `b`) value (two Gamma values), `a`, `b` > 0; never NaN.
    pub fn beta(&mut self, a: f64, b: f64) -> f64 {
        let x = self.gamma(a);
        let y = self.gamma(b);
        if x + y > 0.0 {
            x / (x + y)
        } else {
            // Both underflowed (tiny shapes): the limit is 0 or 1 with these odds.
            if self.chance(a / (a + b)) { 1.0 } else { 0.0 }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beta_values_have_the_distributions_moments() {
        for (a, b) in [(0.2, 0.2), (1.0, 1.0), (2.5, 0.7)] {
            let n = 40_000;
            let mut rng = SampleRng::new(9, 0, 0);
            let values: Vec<f64> = (0..n).map(|_| rng.beta(a, b)).collect();
            assert!(values.iter().all(|v| (0.0..=1.0).contains(v)));
            let mean = values.iter().sum::<f64>() / n as f64;
            let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
            let (want_mean, want_var) = (a / (a + b), a * b / ((a + b).powi(2) * (a + b + 1.0)));
            assert!(
                (mean - want_mean).abs() < 0.01,
                "Beta({a}, {b}) mean {mean}"
            );
            assert!(
                (var - want_var).abs() < 0.01,
                "Beta({a}, {b}) variance {var}"
            );
        }
    }

    #[test]
    fn streams_depend_on_every_key_part_and_nothing_else() {
        let first = |s, e, i, d| SampleRng::keyed(s, e, i, d).next_u64();
        assert_eq!(first(1, 2, 3, 0), first(1, 2, 3, 0));
        let base = first(1, 2, 3, 0);
        for other in [
            first(9, 2, 3, 0),
            first(1, 9, 3, 0),
            first(1, 2, 9, 0),
            first(1, 2, 3, 9),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(SampleRng::new(1, 2, 3).next_u64(), base);
    }

    #[test]
    fn pinned_algorithm_gives_pinned_values() {
        // ChaCha8 with key (seed=0, epoch=0, index=0, domain=0): if this changes, every
        // published digest changes with it. Regenerate deliberately, never by accident.
        let mut rng = SampleRng::new(0, 0, 0);
        let first = rng.next_u64();
        let mut again = SampleRng::new(0, 0, 0);
        assert_eq!(again.next_u64(), first);
        let reference = ChaCha8Rng::from_seed([0u8; 32]).next_u64();
        assert_eq!(first, reference);
    }

    #[test]
    fn ranges_hold() {
        let mut rng = SampleRng::new(5, 0, 0);
        let mut counts = [0usize; 7];
        for _ in 0..7000 {
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
            let x = rng.uniform(-2.0, 3.0);
            assert!((-2.0..3.0).contains(&x));
            counts[rng.below(7) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }
}
