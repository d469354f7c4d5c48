//! [`Epoch`]: one epoch's batches, delivered in order from the workers' results.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::stats::add;
use super::{Inner, Job, LOADER_STATE_VERSION, LoaderState, MaxBad};
use crate::batch::Batch;
use crate::error::{Error, Result};

/// One epoch's batches, in order. It owns a share of its loader, so it may outlive the
/// [`Loader`](super::Loader) value it came from (the worker threads stay until both are gone). Dropping it
/// cancels the batches still being built.
pub struct Epoch {
    pub(super) loader: Arc<Inner>,
    pub(super) epoch: u64,
    /// Where in the epoch's order this part begins (0 unless resumed at another world size).
    pub(super) start: usize,
    pub(super) batches: Vec<Vec<usize>>,
    pub(super) next_send: usize,
    pub(super) next_deliver: usize,
    pub(super) pending: HashMap<usize, Result<Batch>>,
    pub(super) reply_tx: Sender<(usize, Result<Batch>)>,
    pub(super) reply_rx: Receiver<(usize, Result<Batch>)>,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) bad_samples: u64,
    pub(super) samples_seen: u64,
    /// Sample slots this rank consumed before this part began (elastic resume).
    pub(super) samples_before_part: u64,
    /// The batch the dataset was last told the coming shards from ([`Epoch::plan_shards`]).
    pub(super) planned_at: Option<usize>,
    pub(super) done: bool,
}

impl Epoch {
    /// True when no rank has a batch of this epoch left: the whole of its order was given out
    /// (or left out by `drop_last` / [`Uneven::Drop`](crate::sampler::Uneven::Drop)). A rank
    /// whose own share is done while others still have batches (a resume at a larger world
    /// size under [`Uneven::Exact`](crate::sampler::Uneven::Exact)) is not over: it still runs
    /// the epoch, empty, beside them.
    pub fn is_over_for_every_rank(&self) -> bool {
        self.loader
            .sampler
            .position_after(self.start, self.next_deliver)
            >= self.loader.sampler.len
    }

    /// Where this epoch stands: the next batch [`next`](Iterator::next) would return.
    pub fn state(&self) -> LoaderState {
        let s = &self.loader.sampler.sampling;
        LoaderState {
            version: LOADER_STATE_VERSION,
            seed: s.seed,
            epoch: self.epoch,
            batch_size: s.batch_size,
            shuffle: s.shuffle,
            shard_window: self.loader.sampler.effective_shard_window(),
            drop_last: s.drop_last,
            uneven: s.uneven,
            rank: s.rank,
            world_size: s.world_size,
            dataset: self.loader.fingerprint.clone(),
            dataset_listing: self.loader.listing.clone(),
            start: self.start,
            next_batch: self.next_deliver,
            samples_before_start: self.samples_before_part,
            bad_sample_policy: self.loader.shared.config.bad_samples,
            transform: self.loader.transform_digest.clone(),
            bad_samples: self.bad_samples,
            samples_seen: self.samples_seen,
        }
    }

    /// The epoch number.
    pub fn number(&self) -> u64 {
        self.epoch
    }

    /// Where in the epoch's order this part of it begins: 0, unless it was resumed at another
    /// world size or batch size, which deals out again only what was left
    /// ([`Sampler::rank_indices_from`](crate::sampler::Sampler::rank_indices_from)).
    pub fn part_start(&self) -> usize {
        self.start
    }

    /// Batches left in this epoch.
    pub fn remaining(&self) -> usize {
        self.batches.len().saturating_sub(self.next_deliver)
    }

    /// The limit `bad_samples` bad samples in this epoch would exceed, if any.
    fn max_bad_exceeded(&self, bad_samples: u64) -> Option<String> {
        let cap = self.loader.shared.config.max_bad?;
        let per_epoch = self
            .samples_before_part
            .saturating_add(self.batches.iter().map(Vec::len).sum::<usize>() as u64);
        cap.exceeded_by(bad_samples, per_epoch).then(|| match cap {
            MaxBad::Count(n) => format!("max {n}"),
            MaxBad::Fraction(f) => {
                format!("max {:.4}% of the epoch's {per_epoch} samples", f * 100.0)
            }
        })
    }
}

/// What waiting for the next batch with a time limit gave ([`Epoch::next_timeout`]).
#[derive(Debug)]
pub enum Wait<T> {
    /// The wait ended with this.
    Ready(T),
    /// Nothing arrived in time; the batch is still being built, and a later call waits on.
    TimedOut,
}

impl Iterator for Epoch {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        match self.next_until(None) {
            Wait::Ready(next) => next,
            Wait::TimedOut => unreachable!("no deadline"),
        }
    }
}

impl Epoch {
    /// [`next`](Iterator::next), waiting at most `timeout` for the batch: a caller that must
    /// stay responsive (a Python interpreter checking for Ctrl-C) polls with it. A time-out
    /// consumes nothing; the next call (timed or not) returns the same batch.
    pub fn next_timeout(&mut self, timeout: Duration) -> Wait<Option<Result<Batch>>> {
        self.next_until(Some(Instant::now() + timeout))
    }

    /// The job that builds the batch at `position` of this epoch.
    fn job(&self, position: usize) -> Job {
        Job {
            epoch: self.epoch,
            position,
            indices: self.batches[position].clone(),
            reply: self.reply_tx.clone(),
            cancel: Arc::clone(&self.cancel),
        }
    }

    fn next_until(&mut self, deadline: Option<Instant>) -> Wait<Option<Result<Batch>>> {
        if self.done || self.next_deliver >= self.batches.len() {
            return Wait::Ready(None);
        }
        if self.loader.inline.is_none() && std::process::id() != self.loader.process {
            // A forked child's copy of an epoch under way: the workers are the parent's
            // threads, which a fork does not copy. Waiting would be forever, and a batch they
            // had finished before the fork is the parent's too (a hostile try had the child
            // read one, then hang).
            return Wait::Ready(Some(Err(Error::Config(
                "this epoch is read in a process forked from the one that made its loader: the \
                 worker threads are the parent's, which a fork does not copy; make the loader \
                 in the process that reads it"
                    .into(),
            ))));
        }
        self.plan_shards();
        let shared = &self.loader.shared;
        if let Some(inline) = &self.loader.inline {
            // No worker threads: this thread builds the batch it is about to deliver.
            if !self.pending.contains_key(&self.next_deliver) {
                let job = self.job(self.next_deliver);
                let mut worker = inline.lock().unwrap_or_else(|e| e.into_inner());
                let result = worker.run(shared, &job);
                self.pending.insert(self.next_deliver, result);
                self.next_send = self.next_send.max(self.next_deliver + 1);
            }
        }
        let prefetch = shared.config.prefetch;
        while self.loader.inline.is_none()
            && self.next_send < self.batches.len()
            && self.next_send < self.next_deliver.saturating_add(prefetch)
        {
            let job = self.job(self.next_send);
            let jobs = self
                .loader
                .jobs
                .as_ref()
                .expect("queue open while the loader lives");
            if jobs.send(job).is_err() {
                self.done = true;
                return Wait::Ready(Some(Err(Error::WorkersStopped)));
            }
            self.next_send += 1;
        }
        let waited = Instant::now();
        let result = loop {
            if let Some(result) = self.pending.remove(&self.next_deliver) {
                break result;
            }
            let received = match deadline {
                None => self
                    .reply_rx
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => self.reply_rx.recv_deadline(deadline),
            };
            match received {
                Ok((position, result)) => {
                    self.pending.insert(position, result);
                }
                Err(RecvTimeoutError::Timeout) => {
                    add(&shared.counters.waiting, waited.elapsed());
                    return Wait::TimedOut;
                }
                Err(RecvTimeoutError::Disconnected) => unreachable!("the epoch holds a sender"),
            }
        };
        add(&shared.counters.waiting, waited.elapsed());
        let position = self.next_deliver;
        // A batch that fails is not consumed: the state still points at it.
        let batch = match result {
            Ok(batch) => batch,
            Err(e) => {
                self.done = true;
                self.cancel.store(true, Ordering::Relaxed);
                return Wait::Ready(Some(Err(e)));
            }
        };
        // Saturating: a state from outside may start it anywhere.
        let samples_seen = self
            .samples_seen
            .saturating_add(self.batches[position].len() as u64);
        // The cap counts the epoch's own samples: a replacement candidate found bad is
        // reported, not counted (so `skip` and `replace` trip at the same sample).
        let own_bad = batch
            .bad
            .iter()
            .filter(|b| b.while_replacing.is_none())
            .count() as u64;
        let bad_samples = self.bad_samples.saturating_add(own_bad);
        let c = &shared.counters;
        c.samples.fetch_add(batch.len() as u64, Ordering::Relaxed);
        c.batches.fetch_add(1, Ordering::Relaxed);
        c.bad.fetch_add(batch.bad.len() as u64, Ordering::Relaxed);
        // Only a batch with bad samples can cross the limit (a state resumed under a stricter
        // limit trips at its next bad sample).
        if let Some(last) = batch.bad.iter().rfind(|b| b.while_replacing.is_none())
            && let Some(limit) = self.max_bad_exceeded(bad_samples)
        {
            self.done = true;
            self.cancel.store(true, Ordering::Relaxed);
            return Wait::Ready(Some(Err(Error::TooManyBadSamples {
                count: bad_samples,
                seen: samples_seen,
                limit,
                index: last.index,
                key: last.key.clone(),
                kind: last.kind,
                reason: last.reason.clone(),
            })));
        }
        self.next_deliver += 1;
        self.samples_seen = samples_seen;
        self.bad_samples = bad_samples;
        Wait::Ready(Some(Ok(batch)))
    }
}

/// Without a shard window, the shards of this many batches ahead (at least those in flight)
/// are fetched ahead.
const PLAN_BATCHES: usize = 8;
/// The most shards a dataset is told about at once.
const PLAN_MAX_SHARDS: usize = 4096;

impl Epoch {
    /// Tells a dataset of shards which shards the next batches read
    /// ([`Dataset::plan_shards`]): those of the batches in flight and a few more, and under a
    /// shard window at least two windows' worth, so the next window is fetched while this one
    /// is read. Once per delivered batch; nothing for a dataset that is not shards.
    fn plan_shards(&mut self) {
        if self.planned_at == Some(self.next_deliver) {
            return;
        }
        self.planned_at = Some(self.next_deliver);
        let sampler = &self.loader.sampler;
        if sampler.shards.is_none() {
            return;
        }
        // The batches in flight read these now; beyond them, two windows' worth of shards
        // (or, without a window, a few more batches) are fetched ahead.
        let in_flight = self.loader.shared.config.prefetch.max(1);
        let window = sampler.effective_shard_window();
        let mut upcoming = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut wanted = usize::MAX;
        for (i, batch) in self.batches[self.next_deliver..].iter().enumerate() {
            if i == in_flight {
                wanted = match window {
                    Some(w) => upcoming.len() + 2 * w,
                    None => usize::MAX,
                };
            }
            if (window.is_none() && i >= in_flight.max(PLAN_BATCHES))
                || upcoming.len() >= wanted.min(PLAN_MAX_SHARDS)
            {
                break;
            }
            for &sample in batch {
                if let Some(shard) = sampler.shard_of(sample)
                    && seen.insert(shard)
                {
                    upcoming.push(shard);
                }
            }
        }
        self.loader.shared.dataset.plan_shards(&upcoming);
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}
