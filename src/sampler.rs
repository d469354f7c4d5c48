//! Which samples go in which batch, for one rank of a distributed job.
//!
//! A [`Sampler`] needs only `(len, seed, epoch, rank, world_size)` and its options, never the
//! loader. For an epoch it:
//! 1. orders `0..len`: sequentially, or by a Fisher–Yates shuffle seeded by `(seed, epoch)`
//!    (the same permutation on every rank);
//! 2. makes the length a multiple of `world_size`: [`Uneven::Pad`] repeats samples from the
//!    start of the order, [`Uneven::Drop`] drops the tail;
//! 3. gives rank `r` every `world_size`-th sample starting at `r` (as PyTorch's
//!    `DistributedSampler`), so ranks are disjoint (up to the padding) and equally long;
//! 4. cuts that into batches of `batch_size`; with `drop_last` a final short batch is dropped.
//!
//! Every rank therefore gets the same number of batches per epoch, so a distributed job never
//! hangs waiting for a rank that ran out of data.

use crate::rng::SampleRng;

/// What to do when the dataset does not divide evenly between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Uneven {
    /// Repeat samples from the start of the epoch's order (every sample is seen at least once).
    #[default]
    Pad,
    /// Drop the last `len % world_size` samples of the epoch's order.
    Drop,
}

/// Batch membership for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampler {
    /// Number of samples in the dataset.
    pub len: usize,
    /// Samples per batch.
    pub batch_size: usize,
    /// Shuffle seed.
    pub seed: u64,
    /// Shuffle each epoch (otherwise sequential order).
    pub shuffle: bool,
    /// Drop a final batch shorter than `batch_size`.
    pub drop_last: bool,
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Padding or dropping when `len % world_size != 0`.
    pub uneven: Uneven,
}

/// Domain separator for the shuffle stream (sample streams use domain 0).
const SHUFFLE_DOMAIN: u64 = 1;

impl Sampler {
    /// A sequential, single-rank sampler.
    ///
    /// # Panics
    /// When `batch_size` is 0.
    pub fn new(len: usize, batch_size: usize) -> Sampler {
        assert!(batch_size > 0, "batch_size must be at least 1");
        Sampler {
            len,
            batch_size,
            seed: 0,
            shuffle: false,
            drop_last: false,
            rank: 0,
            world_size: 1,
            uneven: Uneven::Pad,
        }
    }

    /// The epoch's order of all samples (before sharding).
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SampleRng::keyed(self.seed, epoch, 0, SHUFFLE_DOMAIN);
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// This rank's samples for `epoch`, in order.
    ///
    /// # Panics
    /// When `rank >= world_size` or `world_size == 0`.
    pub fn rank_indices(&self, epoch: u64) -> Vec<usize> {
        assert!(
            self.world_size > 0 && self.rank < self.world_size,
            "rank {} out of 0..{}",
            self.rank,
            self.world_size
        );
        let mut order = self.order(epoch);
        let w = self.world_size;
        match self.uneven {
            Uneven::Drop => order.truncate(order.len() - order.len() % w),
            Uneven::Pad if !order.len().is_multiple_of(w) && !order.is_empty() => {
                let missing = w - order.len() % w;
                let pad: Vec<usize> = order.iter().copied().cycle().take(missing).collect();
                order.extend(pad);
            }
            Uneven::Pad => {}
        }
        order.into_iter().skip(self.rank).step_by(w).collect()
    }

    /// Number of samples each rank gets per epoch.
    pub fn samples_per_rank(&self) -> usize {
        match self.uneven {
            Uneven::Drop => self.len / self.world_size,
            Uneven::Pad => self.len.div_ceil(self.world_size),
        }
    }

    /// The most samples any batch of an epoch holds: `batch_size`, or fewer when a rank's whole
    /// epoch is smaller than that.
    pub fn largest_batch(&self) -> usize {
        self.batch_size.min(self.samples_per_rank())
    }

    /// Number of batches each rank gets per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        let per_rank = self.samples_per_rank();
        if self.drop_last {
            per_rank / self.batch_size
        } else {
            per_rank.div_ceil(self.batch_size)
        }
    }

    /// This rank's batches for `epoch`: sample indices per batch, in delivery order.
    pub fn batches(&self, epoch: u64) -> Vec<Vec<usize>> {
        let indices = self.rank_indices(epoch);
        let mut batches: Vec<Vec<usize>> = indices
            .chunks(self.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        if self.drop_last && batches.last().is_some_and(|b| b.len() < self.batch_size) {
            batches.pop();
        }
        debug_assert_eq!(batches.len(), self.batches_per_epoch());
        batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn sampler(len: usize, batch: usize, world: usize, uneven: Uneven, drop_last: bool) -> Sampler {
        Sampler {
            seed: 42,
            shuffle: true,
            drop_last,
            world_size: world,
            uneven,
            ..Sampler::new(len, batch)
        }
    }

    #[test]
    fn sequential_single_rank_is_the_identity() {
        let s = Sampler::new(5, 2);
        assert_eq!(s.batches(0), vec![vec![0, 1], vec![2, 3], vec![4]]);
        assert_eq!(s.batches(7), s.batches(0));
    }

    #[test]
    fn shuffle_depends_on_seed_and_epoch_only() {
        let s = sampler(100, 10, 1, Uneven::Pad, false);
        assert_eq!(s.order(3), s.order(3));
        assert_ne!(s.order(3), s.order(4));
        assert_ne!(
            s.order(3),
            Sampler {
                seed: 43,
                ..s.clone()
            }
            .order(3)
        );
        let mut sorted = s.order(3);
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }

    proptest! {
        #[test]
        fn ranks_are_disjoint_complete_and_equally_long(
            len in 0usize..300, batch in 1usize..17, world in 1usize..9,
            pad in any::<bool>(), drop_last in any::<bool>(), epoch in 0u64..5,
        ) {
            let uneven = if pad { Uneven::Pad } else { Uneven::Drop };
            let ranks: Vec<Sampler> = (0..world)
                .map(|rank| Sampler { rank, ..sampler(len, batch, world, uneven, drop_last) })
                .collect();
            let counts: HashSet<usize> = ranks.iter().map(|s| s.batches(epoch).len()).collect();
            prop_assert_eq!(counts.len(), 1, "ranks got different batch counts");
            prop_assert_eq!(*counts.iter().next().unwrap(), ranks[0].batches_per_epoch());
            let per_rank: Vec<Vec<usize>> = ranks.iter().map(|s| s.rank_indices(epoch)).collect();
            let lens: HashSet<usize> = per_rank.iter().map(Vec::len).collect();
            prop_assert_eq!(lens.len(), 1);
            let all: Vec<usize> = per_rank.concat();
            let unique: HashSet<usize> = all.iter().copied().collect();
            match uneven {
                Uneven::Drop => {
                    prop_assert_eq!(unique.len(), all.len(), "a sample went to two ranks");
                    prop_assert_eq!(all.len(), len - len % world);
                }
                Uneven::Pad => {
                    prop_assert_eq!(unique.len(), len, "every sample is seen");
                    prop_assert!(all.len() - len < world, "padding is less than one per rank");
                }
            }
            for (s, indices) in ranks.iter().zip(&per_rank) {
                let batched: Vec<usize> = s.batches(epoch).concat();
                prop_assert!(indices.starts_with(&batched));
                if drop_last {
                    prop_assert!(s.batches(epoch).iter().all(|b| b.len() == batch));
                }
            }
        }
    }
}
