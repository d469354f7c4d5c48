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
}

#[cfg(test)]
mod tests {
    use super::*;

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
