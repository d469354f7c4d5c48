//! Which samples go in which batch, for one rank of a distributed job.
//!
//! A [`Sampler`] needs only `(len, seed, epoch, rank, world_size)` and its options (and, for a
//! dataset of shards read a window at a time, where the shards start), never the loader. For an
//! epoch it:
//! 1. orders `0..len`: sequentially, or by a Fisher–Yates shuffle seeded by `(seed, epoch)`
//!    (the same permutation on every rank); or, with a shard window of `w` shards, by permuting
//!    the shards (seeded by `(seed, epoch)`), cutting that into windows of `w` consecutive
//!    shards and shuffling the samples of each window (seeded by `(seed, epoch, window)`), so
//!    the epoch reads a bounded set of shards at a time — what shards fetched from object
//!    storage need — while every sample still comes once per epoch;
//! 2. makes the length a multiple of `world_size`: [`Uneven::Pad`] repeats samples from the
//!    start of the order, [`Uneven::Drop`] drops the tail ([`Uneven::Exact`] leaves it as it is);
//! 3. gives rank `r` every `world_size`-th sample starting at `r` (as PyTorch's
//!    `DistributedSampler`), so ranks are disjoint (up to the padding) and equally long;
//! 4. cuts that into batches of `batch_size`; with `drop_last` a final short batch is dropped.
//!
//! Under `Pad` and `Drop` every rank therefore gets the same number of batches per epoch, so a
//! distributed training job never hangs waiting for a rank that ran out of data. `Exact` is for
//! evaluation: every sample exactly once over all ranks, the first `len % world_size` ranks one
//! sample more than the others, so their batch counts may differ by one.

use serde::{Deserialize, Serialize};

use crate::rng::SampleRng;

/// What to do when the dataset does not divide evenly between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Uneven {
    /// Repeat samples from the start of the epoch's order (every sample is seen at least once).
    #[default]
    Pad,
    /// Drop the last `len % world_size` samples of the epoch's order.
    Drop,
    /// Neither: every sample exactly once over all ranks, the first `len % world_size` ranks
    /// taking one more sample than the rest (so batch counts may differ by one between ranks:
    /// for evaluation, where no collective waits on every rank's step, not for training).
    Exact,
}

/// Everything that decides which samples a rank's batches hold, besides the dataset's length:
/// the settings a [`Sampler`] and a [`LoaderConfig`](crate::loader::LoaderConfig) share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sampling {
    /// Samples per batch (at least 1).
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
    /// Padding or dropping when the samples do not divide evenly between ranks.
    pub uneven: Uneven,
    /// Shuffle within windows of this many shards (the shards themselves permuted each epoch)
    /// instead of over the whole dataset, for a dataset of shards; `None`: a global shuffle.
    /// Ignored for datasets that are not shards, and when not shuffling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_window: Option<usize>,
}

impl Default for Sampling {
    /// Batches of 32, shuffled with seed 0, one rank, padding, a global shuffle.
    fn default() -> Self {
        Sampling {
            batch_size: 32,
            seed: 0,
            shuffle: true,
            drop_last: false,
            rank: 0,
            world_size: 1,
            uneven: Uneven::Pad,
            shard_window: None,
        }
    }
}

/// Batch membership for one rank.
///
/// An epoch may start part-way through its order (`start` in the `*_from` methods): the first
/// `start` samples of the epoch's order were delivered before, possibly at another world size,
/// and the rest of the epoch is the remaining order dealt out at this world size. This is what
/// resuming a checkpoint at another world size uses; `start` 0 is a whole epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampler {
    /// Number of samples in the dataset.
    pub len: usize,
    /// Batch size, shuffling and sharding.
    pub sampling: Sampling,
    /// For a dataset of shards: the index of each shard's first sample, then `len`
    /// ([`Dataset::shard_starts`](crate::dataset::Dataset::shard_starts)); what a shard window
    /// shuffles within.
    pub shards: Option<std::sync::Arc<[usize]>>,
}

/// Domain separator for the shuffle stream (sample streams use domain 0).
const SHUFFLE_DOMAIN: u64 = 1;
/// Domain separator for the permutation of shards under a shard window.
const SHARD_DOMAIN: u64 = 4;
/// Domain separator for the shuffle of one window's samples.
const WINDOW_DOMAIN: u64 = 5;

impl Sampler {
    /// A sequential, single-rank sampler.
    ///
    /// # Panics
    /// When `batch_size` is 0.
    pub fn new(len: usize, batch_size: usize) -> Sampler {
        assert!(batch_size > 0, "batch_size must be at least 1");
        Sampler {
            len,
            sampling: Sampling {
                batch_size,
                shuffle: false,
                ..Sampling::default()
            },
            shards: None,
        }
    }

    /// The epoch's order of all samples (before sharding).
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        if !self.sampling.shuffle {
            return (0..self.len).collect();
        }
        if let (Some(window), Some(starts)) = (self.sampling.shard_window, &self.shards)
            && window > 0
            && starts.len() >= 2
            && starts.last() == Some(&self.len)
        {
            return self.windowed_order(epoch, window, starts);
        }
        let mut order: Vec<usize> = (0..self.len).collect();
        shuffle(
            &mut order,
            SampleRng::keyed(self.sampling.seed, epoch, 0, SHUFFLE_DOMAIN),
        );
        order
    }

    /// The order under a shard window: shards permuted, then the samples of each window of
    /// `window` consecutive shards (in the permuted order) shuffled among themselves.
    fn windowed_order(&self, epoch: u64, window: usize, starts: &[usize]) -> Vec<usize> {
        let mut shard_order: Vec<usize> = (0..starts.len() - 1).collect();
        shuffle(
            &mut shard_order,
            SampleRng::keyed(self.sampling.seed, epoch, 0, SHARD_DOMAIN),
        );
        let mut order = Vec::with_capacity(self.len);
        for (number, shards) in shard_order.chunks(window).enumerate() {
            let from = order.len();
            for &shard in shards {
                order.extend(starts[shard]..starts[shard + 1]);
            }
            shuffle(
                &mut order[from..],
                SampleRng::keyed(self.sampling.seed, epoch, number as u64, WINDOW_DOMAIN),
            );
        }
        order
    }

    /// The shard window the order uses: the configured one when the sampler shuffles a dataset
    /// of shards, else `None` (what a saved state records, so a state resumes only a loader
    /// that gives the same order).
    pub fn effective_shard_window(&self) -> Option<usize> {
        self.sampling
            .shard_window
            .filter(|_| self.sampling.shuffle && self.shards.is_some())
    }

    /// The shard holding sample `index`; `None` for a dataset that is not shards.
    pub fn shard_of(&self, index: usize) -> Option<usize> {
        let starts = self.shards.as_ref()?;
        Some(starts.partition_point(|&s| s <= index).saturating_sub(1))
    }

    /// This rank's samples for `epoch`, in order.
    ///
    /// # Panics
    /// When `rank >= world_size` or `world_size == 0`.
    pub fn rank_indices(&self, epoch: u64) -> Vec<usize> {
        self.rank_indices_from(epoch, 0)
    }

    /// This rank's samples for the part of `epoch` that starts at position `start` of the
    /// epoch's order: the remaining order is padded or cut to a multiple of the world size and
    /// dealt out round-robin. Padding repeats samples from the start of the order: of the whole
    /// order for a whole epoch, of the delivered part for a part epoch (so that each remaining
    /// sample is given out once).
    ///
    /// # Panics
    /// When `rank >= world_size` or `world_size == 0`.
    pub fn rank_indices_from(&self, epoch: u64, start: usize) -> Vec<usize> {
        let Sampling {
            rank,
            world_size: w,
            ..
        } = self.sampling;
        assert!(w > 0 && rank < w, "rank {rank} out of 0..{w}");
        let order = self.order(epoch);
        let mut rest = order[start.min(order.len())..].to_vec();
        match self.sampling.uneven {
            Uneven::Drop => rest.truncate(rest.len() - rest.len() % w),
            Uneven::Pad if !rest.len().is_multiple_of(w) && !rest.is_empty() => {
                // Padding repeats samples already delivered where there are any, so that the
                // rest of a part epoch holds each remaining sample once.
                let missing = w - rest.len() % w;
                let delivered = &order[..start.min(order.len())];
                let source = if delivered.is_empty() {
                    &order
                } else {
                    delivered
                };
                rest.extend(source.iter().copied().cycle().take(missing));
            }
            Uneven::Pad | Uneven::Exact => {}
        }
        rest.into_iter().skip(rank).step_by(w).collect()
    }

    /// Number of samples this rank gets per epoch (the same on every rank, except under
    /// [`Uneven::Exact`]).
    pub fn samples_per_rank(&self) -> usize {
        self.samples_per_rank_from(0)
    }

    /// Number of samples this rank gets from position `start` of an epoch's order on.
    pub fn samples_per_rank_from(&self, start: usize) -> usize {
        let rest = self.len.saturating_sub(start);
        let w = self.sampling.world_size;
        match self.sampling.uneven {
            Uneven::Drop => rest / w,
            Uneven::Pad => rest.div_ceil(w),
            // Rank r takes positions r, r + w, ... of the rest.
            Uneven::Exact => rest.saturating_sub(self.sampling.rank).div_ceil(w),
        }
    }

    /// The most samples any batch of an epoch holds: `batch_size`, or fewer when a rank's whole
    /// epoch is smaller than that.
    pub fn largest_batch(&self) -> usize {
        self.sampling.batch_size.min(self.samples_per_rank())
    }

    /// Number of batches this rank gets per epoch (the same on every rank, except under
    /// [`Uneven::Exact`], where a rank may get one fewer than rank 0).
    pub fn batches_per_epoch(&self) -> usize {
        self.batches_per_epoch_from(0)
    }

    /// Number of batches this rank gets from position `start` of an epoch's order on.
    pub fn batches_per_epoch_from(&self, start: usize) -> usize {
        let per_rank = self.samples_per_rank_from(start);
        if self.sampling.drop_last {
            per_rank / self.sampling.batch_size
        } else {
            per_rank.div_ceil(self.sampling.batch_size)
        }
    }

    /// This rank's batches for `epoch`: sample indices per batch, in delivery order.
    pub fn batches(&self, epoch: u64) -> Vec<Vec<usize>> {
        self.batches_from(epoch, 0)
    }

    /// This rank's batches for the part of `epoch` from position `start` of its order on.
    pub fn batches_from(&self, epoch: u64, start: usize) -> Vec<Vec<usize>> {
        let batch_size = self.sampling.batch_size;
        let indices = self.rank_indices_from(epoch, start);
        let mut batches: Vec<Vec<usize>> =
            indices.chunks(batch_size).map(<[usize]>::to_vec).collect();
        if self.sampling.drop_last && batches.last().is_some_and(|b| b.len() < batch_size) {
            batches.pop();
        }
        debug_assert_eq!(batches.len(), self.batches_per_epoch_from(start));
        batches
    }

    /// The same epochs dealt to `rank` of `world_size` in batches of `batch_size`: how another
    /// rank, or the run a state was saved in, sees them.
    pub fn dealt(&self, rank: usize, world_size: usize, batch_size: usize) -> Sampler {
        Sampler {
            len: self.len,
            sampling: Sampling {
                rank,
                world_size,
                batch_size,
                ..self.sampling
            },
            shards: self.shards.clone(),
        }
    }

    /// How many samples of the epoch's order every rank together has been given once each rank
    /// has taken `delivered` batches of the part of the epoch that began at `start`: where that
    /// part continues, at this or any other world size. Ranks take their samples round-robin,
    /// so their first `delivered` batches are exactly the next `delivered × batch_size ×
    /// world_size` samples of the order; once the part's last batch is delivered, the epoch is
    /// over (`len`), including what `drop_last` or [`Uneven::Drop`] left out. The answer is the
    /// same on every rank: under [`Uneven::Exact`] the epoch is over only once rank 0, which
    /// holds the most batches, has taken its last.
    pub fn position_after(&self, start: usize, delivered: usize) -> usize {
        let first_rank = self.dealt(0, self.sampling.world_size, self.sampling.batch_size);
        if delivered >= first_rank.batches_per_epoch_from(start) {
            return self.len;
        }
        let taken = delivered * self.sampling.batch_size * self.sampling.world_size;
        (start + taken).min(self.len)
    }
}

/// A Fisher–Yates shuffle of `items` drawing from `rng`.
fn shuffle(items: &mut [usize], mut rng: SampleRng) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn uneven() -> impl Strategy<Value = Uneven> {
        prop_oneof![Just(Uneven::Pad), Just(Uneven::Drop), Just(Uneven::Exact)]
    }

    fn sampler(len: usize, batch: usize, world: usize, uneven: Uneven, drop_last: bool) -> Sampler {
        Sampler {
            len,
            sampling: Sampling {
                batch_size: batch,
                seed: 42,
                shuffle: true,
                drop_last,
                world_size: world,
                uneven,
                ..Sampling::default()
            },
            shards: None,
        }
    }

    /// `s` over shards of `shard` samples (the last shorter) with a window of `window` shards;
    /// `s` itself for window 0 (the global shuffle).
    fn in_shards(mut s: Sampler, window: usize, shard: usize) -> Sampler {
        if window > 0 {
            let mut starts: Vec<usize> = (0..s.len).step_by(shard).collect();
            starts.push(s.len);
            s.sampling.shard_window = Some(window);
            s.shards = Some(starts.into());
        }
        s
    }

    /// A sampler over shards of the given sizes, with a window of `window` shards.
    fn windowed(sizes: &[usize], window: usize) -> Sampler {
        let mut starts = vec![0];
        for size in sizes {
            starts.push(starts.last().unwrap() + size);
        }
        let mut s = sampler(*starts.last().unwrap(), 4, 1, Uneven::Pad, false);
        s.sampling.shard_window = Some(window);
        s.shards = Some(starts.into());
        s
    }

    #[test]
    fn a_shard_window_reads_a_bounded_set_of_shards_at_a_time() {
        let s = windowed(&[5, 3, 7, 1, 6, 4, 5], 2);
        let order = s.order(1);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..31).collect::<Vec<_>>(), "every sample once");
        // Consecutive runs of the order come from at most 2 shards: the window.
        let shards: Vec<usize> = order.iter().map(|&i| s.shard_of(i).unwrap()).collect();
        let mut position = 0;
        let mut windows = 0;
        while position < shards.len() {
            let mut seen = HashSet::new();
            let mut size = 0;
            while position < shards.len() && (seen.len() < 2 || seen.contains(&shards[position])) {
                seen.insert(shards[position]);
                position += 1;
                size += 1;
            }
            assert!(seen.len() <= 2 && size > 0);
            windows += 1;
        }
        assert!(
            windows >= 4,
            "7 shards in windows of 2 make 4 windows, got {windows}"
        );
        // Seeded by (seed, epoch) only; another epoch, another order.
        assert_eq!(s.order(1), order);
        assert_ne!(s.order(2), order);
        // Without a window, or without shards, the global shuffle as before.
        let mut global = s.clone();
        global.sampling.shard_window = None;
        assert_eq!(
            global.order(1),
            sampler(31, 4, 1, Uneven::Pad, false).order(1)
        );
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
                sampling: Sampling {
                    seed: 43,
                    ..s.sampling
                },
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
            uneven in uneven(), drop_last in any::<bool>(), epoch in 0u64..5,
            window in 0usize..4, shard in 1usize..40,
        ) {
            let ranks: Vec<Sampler> = (0..world)
                .map(|rank| {
                    let mut s = in_shards(sampler(len, batch, world, uneven, drop_last), window, shard);
                    s.sampling.rank = rank;
                    s
                })
                .collect();
            for s in &ranks {
                prop_assert_eq!(s.batches(epoch).len(), s.batches_per_epoch());
                prop_assert_eq!(s.rank_indices(epoch).len(), s.samples_per_rank());
            }
            let counts: Vec<usize> = ranks.iter().map(|s| s.batches(epoch).len()).collect();
            let per_rank: Vec<Vec<usize>> = ranks.iter().map(|s| s.rank_indices(epoch)).collect();
            let lens: Vec<usize> = per_rank.iter().map(Vec::len).collect();
            if uneven == Uneven::Exact {
                // Rank 0 holds the most; no rank more than one sample or batch fewer.
                prop_assert!(counts.iter().all(|&c| c <= counts[0] && c + 1 >= counts[0]));
                prop_assert!(lens.iter().all(|&l| l <= lens[0] && l + 1 >= lens[0]));
            } else {
                prop_assert!(counts.iter().all(|&c| c == counts[0]), "ranks got different batch counts");
                prop_assert!(lens.iter().all(|&l| l == lens[0]));
            }
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
                Uneven::Exact => {
                    prop_assert_eq!(unique.len(), len, "every sample is seen");
                    prop_assert_eq!(all.len(), len, "no sample twice");
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

        #[test]
        fn a_part_epoch_at_another_world_size_deals_out_exactly_what_was_not_delivered(
            len in 0usize..200, batch in 1usize..9, world in 1usize..6, next_world in 1usize..6,
            uneven in uneven(), drop_last in any::<bool>(), pick in 0usize..400,
            window in 0usize..4, shard in 1usize..40,
        ) {
            let at = |world: usize, rank: usize| {
                let mut s = in_shards(sampler(len, batch, world, uneven, drop_last), window, shard);
                s.sampling.rank = rank;
                s
            };
            let epoch = 2;
            let order = at(1, 0).order(epoch);
            let batches = at(world, 0).batches_per_epoch();
            // Half the cases stop within the first few batches, where padding could reach the
            // remaining samples.
            let delivered = if pick < 200 { pick % 4 } else { pick - 200 }.min(batches);
            // What every rank at `world` was given in its first `delivered` batches ...
            let mut given: Vec<usize> = (0..world)
                .flat_map(|r| at(world, r).batches(epoch).into_iter().take(delivered).flatten())
                .collect();
            given.sort_unstable();
            // ... is exactly the order up to the position the next part starts at, whichever
            // rank works it out (under Exact a rank may have taken its last batch already).
            let start = at(world, 0).position_after(0, delivered);
            for r in 1..world {
                prop_assert_eq!(at(world, r).position_after(0, delivered), start);
            }
            if delivered < batches {
                let mut prefix = order[..start].to_vec();
                prefix.sort_unstable();
                prop_assert_eq!(given, prefix);
            } else {
                prop_assert_eq!(start, len, "an epoch whose batches were all delivered is over");
            }
            // At `next_world`, the rest of the order is dealt out once, in equal batch counts.
            let ranks: Vec<Vec<Vec<usize>>> =
                (0..next_world).map(|r| at(next_world, r).batches_from(epoch, start)).collect();
            let counts: Vec<usize> = ranks.iter().map(Vec::len).collect();
            let most = counts.iter().copied().max().unwrap_or(0);
            let spread = if uneven == Uneven::Exact { 1 } else { 0 };
            prop_assert!(counts.iter().all(|&c| c + spread >= most), "batch counts differ too much");
            if start == 0 {
                return Ok(()); // a whole epoch: the test above
            }
            let rest: HashSet<usize> = order[start..].iter().copied().collect();
            let dealt: Vec<usize> = ranks.concat().concat();
            let from_rest: Vec<usize> = dealt.iter().copied().filter(|i| rest.contains(i)).collect();
            let unique: HashSet<usize> = from_rest.iter().copied().collect();
            prop_assert_eq!(unique.len(), from_rest.len(), "a remaining sample was dealt twice");
            if uneven == Uneven::Pad {
                // Padding, less than one sample per rank, repeats samples already given.
                prop_assert!(dealt.len() - from_rest.len() < next_world, "padding beyond one per rank");
                if !drop_last {
                    prop_assert_eq!(unique, rest, "a remaining sample was left out");
                }
            } else {
                prop_assert_eq!(dealt.len(), from_rest.len(), "only remaining samples are dealt");
                if uneven == Uneven::Exact && !drop_last {
                    prop_assert_eq!(unique, rest, "a remaining sample was left out");
                }
            }
        }
    }
}
