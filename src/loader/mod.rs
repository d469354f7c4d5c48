//! The loader: worker threads turn sampler batches into collated [`Batch`]es, delivered in order.
//!
//! ```text
//! Sampler (seed, epoch, rank) ──batch ids──▶ job queue ──▶ worker threads (persistent)
//!   each worker: LazyReader (its own handle, opened on first use) + SampleTransformer
//!   per sample: rng = (seed, epoch, index) → read → decode → transform → write into its slot
//! results ──▶ reorder by batch id ──▶ Epoch iterator (bounded: `prefetch` batches in flight)
//! ```
//!
//! Guarantees:
//! - **Determinism.** A batch is a function of `(seed, epoch, batch position)` and the data:
//!   membership comes from the [`Sampler`], every random choice from the sample's own
//!   [`SampleRng`], and batches are delivered by position, never in completion order. The stream
//!   is bit-identical for any number of workers and any prefetch depth.
//! - **Bounded memory.** At most `prefetch` batches are being built or waiting; their buffers come
//!   from a [`BufferPool`] and return to it when the caller drops the [`Batch`], so steady state
//!   allocates nothing. Workers are threads sharing one dataset, not processes copying it.
//! - **Bad data is not fatal** unless asked: a sample that fails to read or decode is reported
//!   (index, key, reason) on its batch and in the running total, and handled by the
//!   [`BadSamplePolicy`]; `max_bad` (by default [`DEFAULT_MAX_BAD`]: 1% of the epoch) turns
//!   too many into a clear error, so an epoch that lost much of its data never ends as if
//!   it were complete.
//! - **Exact resume.** [`Epoch::state`] is serializable; [`Loader::resume`] yields exactly the
//!   remaining batches of that epoch, identical to an uninterrupted run, and refuses a loader
//!   or dataset that would give another stream ([`Error::StateMismatch`]). At another world
//!   size it continues the epoch with exactly the samples no rank had been given, each once.
//! - **Owned epochs.** An [`Epoch`] shares the loader's workers instead of borrowing the
//!   [`Loader`], so the two can live side by side in a trainer's struct (or a Python object).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::batch::Batch;
use crate::dataset::Dataset;
use crate::dataset::{fingerprint, hex, listing_digest};
use crate::error::{Error, Result};
use crate::pool::{BatchAllocator, BufferPool, HeapAllocator};
use crate::rng::SampleRng;
use crate::sampler::{Sampler, Uneven};

mod config;
mod epoch;
mod state;
mod stats;
mod worker;

pub use config::{BadSamplePolicy, DEFAULT_MAX_BAD, LoaderConfig, MAX_PREFETCH, MaxBad};
pub use epoch::{Epoch, Wait};
pub use state::{LOADER_STATE_VERSION, LoaderState};
use stats::Counters;
pub use stats::Stats;
use worker::{Worker, worker_loop};

/// The size of a loader's batches, as [`Loader::prewarm`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchGeometry {
    /// Image width after the transform.
    pub width: u32,
    /// Image height after the transform.
    pub height: u32,
    /// The most samples a batch holds.
    pub samples: usize,
    /// Bytes of a batch buffer.
    pub bytes: usize,
}

/// What workers share.
struct Shared {
    dataset: Arc<dyn Dataset>,
    /// The most samples a batch can hold ([`Sampler::largest_batch`]): what batch buffers are
    /// sized for, so that `batch_size` 100,000 over 1,004 samples allocates 1,004 slots.
    largest_batch: usize,
    config: LoaderConfig,
    pool: BufferPool,
    counters: Counters,
}

struct Job {
    epoch: u64,
    position: usize,
    indices: Vec<usize>,
    reply: Sender<(usize, Result<Batch>)>,
    cancel: Arc<AtomicBool>,
}

/// A multi-threaded, deterministic, fault-tolerant batch loader over a [`Dataset`].
///
/// The worker threads live as long as the loader or any [`Epoch`] it made, whichever is
/// dropped last; an epoch owns what it needs, so a trainer (or a Python object) can keep the
/// loader and its current epoch side by side.
pub struct Loader {
    inner: Arc<Inner>,
}

/// What a loader and its epochs share.
struct Inner {
    shared: Arc<Shared>,
    sampler: Sampler,
    /// [`fingerprint`] of the dataset, taken when the loader was made.
    fingerprint: String,
    /// [`listing_digest`] of the dataset, taken when the loader was made.
    listing: Option<String>,
    /// [`LoaderState::transform`] for this loader's transform and pixel limit.
    transform_digest: String,
    jobs: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    /// With no worker threads: the reader and transformer of the thread asking for a batch.
    inline: Option<Mutex<Worker>>,
    /// The reader and transformer of [`Loader::build_batch`] when there are worker threads,
    /// made on first use.
    side: Mutex<Option<Worker>>,
    /// The process that made the workers ([`std::process::id`]).
    process: u32,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if std::process::id() != self.process {
            // A forked child's copy: its workers are the parent's threads, which a fork does
            // not copy. Joining them panicked (or could wait forever), and the queue's lock may
            // have been held by one of them at the fork: leave both alone. The parent's own
            // loader is unaffected.
            std::mem::forget(self.jobs.take());
            for worker in self.workers.drain(..) {
                std::mem::forget(worker);
            }
            return;
        }
        self.jobs.take(); // closes the queue: workers finish their job and exit
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// Refuses a dataset whose shards cut short (or emptied) lost more records than `max_bad`
/// allows, or an unknown number of them ([`ShardSetProblem::CutShort`](crate::error::ShardSetProblem::CutShort)).
/// Each cut shard reads as one bad record, however much of it is gone (a hostile try: a
/// TFRecord shard cut to a tenth lost 67 of 300 records, counted 1 bad, and the epoch ended
/// "complete" under the 1% limit). The estimate ([`crate::dataset::cut_loss`]) is taken
/// against the dataset as if it were whole; where it cannot be made (a set of one or two, every
/// shard cut) the loss is unknown and the dataset is refused, as TensorFlow and the
/// `webdataset` package stop at a truncated shard.
fn refuse_cut_shards_past_max_bad(dataset: &dyn Dataset, max_bad: Option<MaxBad>) -> Result<()> {
    let Some(cap) = max_bad else {
        return Ok(());
    };
    let Some(loss) = crate::dataset::cut_loss(dataset) else {
        return Ok(());
    };
    if let Some(lost) = loss.lost
        && (lost == 0 || !cap.exceeded_by(lost, dataset.len() as u64 + lost))
    {
        return Ok(());
    }
    Err(Error::ShardSet {
        path: dataset.path().to_path_buf(),
        problem: crate::error::ShardSetProblem::CutShort {
            shards: crate::dataset::first_names(loss.cut.iter().map(|(_, path)| path.as_path())),
            count: loss.cut.len(),
            empty: loss.empty,
            lost: loss.lost,
            limit: cap.to_string(),
        },
    })
}

impl Loader {
    /// A loader with heap batch buffers.
    pub fn new(dataset: Arc<dyn Dataset>, config: LoaderConfig) -> Result<Loader> {
        Self::with_allocator(dataset, config, Arc::new(HeapAllocator))
    }

    /// A loader whose batch buffers come from `allocator` (e.g. page-locked memory).
    pub fn with_allocator(
        dataset: Arc<dyn Dataset>,
        config: LoaderConfig,
        allocator: Arc<dyn BatchAllocator>,
    ) -> Result<Loader> {
        config.validate()?;
        if let Some((w, h)) = config.transform.fixed_size() {
            config.check_batch_memory(w, h, dataset.len())?;
        }
        if let Some(mix) = &config.batch_mix {
            let classes = dataset.info().classes.len();
            if classes > mix.num_classes {
                return Err(Error::Config(format!(
                    "MixUp/CutMix were given num_classes {} but the dataset has {classes} classes",
                    mix.num_classes
                )));
            }
        }
        refuse_cut_shards_past_max_bad(dataset.as_ref(), config.max_bad)?;
        if config.sampling.world_size > dataset.len().max(1) {
            return Err(Error::Config(format!(
                "world_size {} exceeds the dataset's {} samples: some ranks would get none",
                config.sampling.world_size,
                dataset.len()
            )));
        }
        let sampler = Sampler {
            len: dataset.len(),
            sampling: config.sampling,
            shards: dataset.shard_starts().map(Arc::from),
        };
        let fingerprint = fingerprint(dataset.as_ref());
        let listing = listing_digest(dataset.as_ref());
        let transform_digest = {
            use sha2::{Digest as _, Sha256};
            let digest = Sha256::digest(
                // (A whole decode is named only when chosen, so states saved before the
                // setting existed keep resuming.)
                format!(
                    "{} max_pixels {}{}{}",
                    config.transform.fingerprint(),
                    config.max_pixels,
                    if config.scaled_decode {
                        ""
                    } else {
                        " whole decode"
                    },
                    config
                        .batch_mix
                        .map(|mix| format!(" batch_mix {mix:?}"))
                        .unwrap_or_default()
                )
                .as_bytes(),
            );
            hex(&digest[..8])
        };
        let shared = Arc::new(Shared {
            dataset,
            largest_batch: sampler.largest_batch(),
            config,
            pool: BufferPool::new(allocator),
            counters: Counters::default(),
        });
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let workers = (0..shared.config.workers)
            .map(|i| {
                let shared = Arc::clone(&shared);
                let queue = queue.clone();
                std::thread::Builder::new()
                    .name(format!("imagefeed-worker-{i}"))
                    .spawn(move || worker_loop(&shared, &queue))
                    .map_err(|source| Error::ThreadSpawn { source })
            })
            .collect::<Result<Vec<_>>>()?;
        let inline = workers.is_empty().then(|| Mutex::new(Worker::new(&shared)));
        Ok(Loader {
            inner: Arc::new(Inner {
                shared,
                sampler,
                fingerprint,
                listing,
                transform_digest,
                jobs: Some(jobs),
                inline,
                side: Mutex::new(None),
                workers,
                process: std::process::id(),
            }),
        })
    }

    /// The dataset being loaded.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.inner.shared.dataset
    }

    /// The configuration.
    pub fn config(&self) -> &LoaderConfig {
        &self.inner.shared.config
    }

    /// The dataset's [`fingerprint`], as a [`LoaderState`] records it.
    pub fn dataset_fingerprint(&self) -> &str {
        &self.inner.fingerprint
    }

    /// Batches per epoch for this rank.
    pub fn batches_per_epoch(&self) -> usize {
        self.inner.sampler.batches_per_epoch()
    }

    /// The sampler that deals this rank's batches (its [`Sampler::rank_indices`] are the samples
    /// an epoch gives this rank, padding included).
    pub fn sampler(&self) -> &Sampler {
        &self.inner.sampler
    }

    /// Builds a batch of `indices` now, in the calling thread, as an epoch's batch holding them
    /// would be built: each sample transformed with the random draws of `(seed, epoch, index)`,
    /// bad samples handled by the loader's policy (so a skipped one leaves the batch shorter).
    /// What a map-style view of the loader's samples (`loader.dataset[i]` in Python) reads.
    /// The batch buffer holds `indices.len()` slots at least, [`Sampler::largest_batch`] at
    /// most when that is more; the indices must be below the dataset's length.
    ///
    /// # Errors
    /// [`Error::Config`] for an index past the dataset; [`Error::BadSample`] under
    /// [`BadSamplePolicy::Error`]; a read or allocation error as an epoch would give it.
    pub fn build_batch(&self, epoch: u64, indices: Vec<usize>) -> Result<Batch> {
        let len = self.inner.shared.dataset.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(Error::Config(format!(
                "sample {index} is past the dataset's {len} samples"
            )));
        }
        let (reply, _replies) = crossbeam_channel::bounded(0);
        let job = Job {
            epoch,
            position: 0,
            indices,
            reply,
            cancel: Arc::new(AtomicBool::new(false)),
        };
        let shared = &self.inner.shared;
        if let Some(inline) = &self.inner.inline {
            return inline
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .run(shared, &job);
        }
        let mut side = self.inner.side.lock().unwrap_or_else(|e| e.into_inner());
        side.get_or_insert_with(|| Worker::new(shared))
            .run(shared, &job)
    }

    /// The batch buffer pool (its allocation count shows steady-state reuse).
    pub fn pool(&self) -> &BufferPool {
        &self.inner.shared.pool
    }

    /// Allocates `buffers` batch buffers now, sized for this loader's batches, so that a slow
    /// allocator (page-locked memory for the GPU feed) runs before the first epoch instead of
    /// on the worker threads during it. The size comes from preparing the first record that
    /// decodes (of the first 16): exact for transforms with a fixed output size and for
    /// datasets of equal-size images; a later batch of another size allocates its own buffer.
    ///
    /// Returns the geometry the buffers were sized for, or `None` when none of the first 16
    /// records could be prepared (nothing is allocated then).
    pub fn prewarm(&self, buffers: usize) -> Result<Option<BatchGeometry>> {
        const PROBES: usize = 16;
        let shared = &self.inner.shared;
        let config = &shared.config;
        let mut reader = shared.dataset.open_reader()?;
        let mut transformer = config.transformer();
        for index in 0..shared.dataset.len().min(PROBES) {
            let Ok(record) = reader.read(index) else {
                continue;
            };
            let mut rng = SampleRng::new(config.sampling.seed, 0, index as u64);
            let Ok(prepared) = transformer.apply(&config.transform, record.payload, &mut rng)
            else {
                continue;
            };
            let geometry = BatchGeometry {
                width: prepared.width,
                height: prepared.height,
                samples: shared.largest_batch,
                bytes: config
                    .transform
                    .output
                    .slot_len(prepared.width, prepared.height)
                    * shared.largest_batch,
            };
            shared.pool.reserve(buffers, geometry.bytes);
            return Ok(Some(geometry));
        }
        Ok(None)
    }

    /// Iterates over `epoch`'s batches from the start.
    pub fn epoch(&self, epoch: u64) -> Epoch {
        self.start(epoch, 0, 0)
    }

    /// Continues the epoch recorded in `state`, with its running totals.
    ///
    /// At the state's world size and batch size the epoch continues from its next batch,
    /// exactly as an uninterrupted run would. At another world size (elastic resume) or batch
    /// size, the rest of the epoch is every sample of the epoch's order that no rank had been
    /// given when the state was saved, each once, in that order, dealt out again in this
    /// loader's batches between its ranks with equal batch counts per rank (padding, under
    /// [`Uneven::Pad`], repeats samples already given).
    ///
    /// # Errors
    /// [`Error::StateMismatch`] naming the first setting that differs (seed, shuffle,
    /// drop_last, uneven, dataset, state version); [`Error::Config`] when the state's position
    /// lies past its epoch.
    pub fn resume(&self, state: &LoaderState) -> Result<Epoch> {
        self.check_resumable(state)?;
        let sampler = &self.inner.sampler;
        if state.world_size == 0 || state.batch_size == 0 {
            return Err(Error::Config(format!(
                "the state's world size ({}) and batch size ({}) must be at least 1",
                state.world_size, state.batch_size
            )));
        }
        if state.rank >= state.world_size {
            return Err(Error::Config(format!(
                "the state's rank ({}) must be below its world size ({})",
                state.rank, state.world_size
            )));
        }
        // The epoch as it was being dealt out when the state was saved.
        let saved = sampler.dealt(0, state.world_size, state.batch_size);
        let batches = saved.batches_per_epoch_from(state.start);
        if state.world_size == 0 || state.start > sampler.len || state.next_batch > batches {
            return Err(Error::Config(format!(
                "the state's position (batch {} of the part from sample {} at world size {}) \
                 is past its epoch's {batches} batches",
                state.next_batch, state.start, state.world_size
            )));
        }
        // The counters must fit the position: `max_bad` is judged by them (a hostile state's
        // `samples_before_start` of 10^12 at position 0 made a 20%-bad epoch pass a 10% limit,
        // and `bad_samples` of u64::MAX overflowed at the next bad sample).
        let most_seen = (state.next_batch as u64)
            .checked_mul(state.batch_size as u64)
            .and_then(|slots| slots.checked_add(state.samples_before_start));
        // Every batch taken but the last was full, and none was empty (a hostile try's
        // `samples_seen: 0` at batch 2 was accepted).
        let least_seen = match state.next_batch as u64 {
            0 => Some(state.samples_before_start),
            taken => (taken - 1)
                .checked_mul(state.batch_size as u64)
                .and_then(|full| full.checked_add(1))
                .and_then(|slots| slots.checked_add(state.samples_before_start)),
        };
        if state.samples_before_start > sampler.len as u64
            || least_seen.is_none_or(|least| state.samples_seen < least)
            || most_seen.is_none_or(|most| state.samples_seen > most)
            || state.bad_samples > state.samples_seen
        {
            return Err(Error::Config(format!(
                "the state's counters ({} samples seen, {} before its part, {} bad) do not fit \
                 its position (batch {} of {} samples, of an epoch of {}): not as a loader \
                 saved it",
                state.samples_seen,
                state.samples_before_start,
                state.bad_samples,
                state.next_batch,
                state.batch_size,
                sampler.len
            )));
        }
        // The same deal goes on where it stopped; another world size or batch size deals the
        // samples not yet given out again, from where the saved deal had got to (the order of
        // the epoch's samples depends on neither).
        let mut epoch = if state.world_size == sampler.sampling.world_size
            && state.batch_size == sampler.sampling.batch_size
        {
            let mut epoch = self.start(state.epoch, state.start, state.next_batch);
            epoch.samples_before_part = state.samples_before_start;
            epoch
        } else {
            let start = saved.position_after(state.start, state.next_batch);
            let mut epoch = self.start(state.epoch, start, 0);
            epoch.samples_before_part = state.samples_seen;
            epoch
        };
        epoch.bad_samples = state.bad_samples;
        epoch.samples_seen = state.samples_seen;
        Ok(epoch)
    }

    /// Refuses a state whose stream this loader would not continue.
    fn check_resumable(&self, state: &LoaderState) -> Result<()> {
        let s = &self.inner.sampler.sampling;
        let config = &self.inner.shared.config;
        // (setting, in the state, in this loader), in the order they are checked.
        // Every record's listing, compared where both the state and this loader have one
        // (states saved before it existed do not).
        let (saved_listing, listing) = match (&state.dataset_listing, &self.inner.listing) {
            (Some(saved), Some(current)) => (saved.as_str(), current.as_str()),
            _ => ("", ""),
        };
        let settings: [(&'static str, String, String); 10] = [
            (
                "state version",
                state.version.to_string(),
                LOADER_STATE_VERSION.to_string(),
            ),
            (
                "dataset",
                format!("fingerprint {}", state.dataset),
                format!("fingerprint {}", self.inner.fingerprint),
            ),
            (
                "dataset",
                format!("listing {saved_listing}"),
                format!("listing {listing}"),
            ),
            ("seed", state.seed.to_string(), s.seed.to_string()),
            (
                "bad_sample_policy",
                setting_name(&state.bad_sample_policy),
                setting_name(&config.bad_samples),
            ),
            (
                "transform",
                format!("digest {}", state.transform),
                format!("digest {}", self.inner.transform_digest),
            ),
            ("shuffle", state.shuffle.to_string(), s.shuffle.to_string()),
            (
                "shard_window",
                shard_window_name(state.shard_window),
                shard_window_name(self.inner.sampler.effective_shard_window()),
            ),
            (
                "drop_last",
                state.drop_last.to_string(),
                s.drop_last.to_string(),
            ),
            (
                "uneven",
                setting_name(&state.uneven),
                setting_name(&s.uneven),
            ),
        ];
        match settings
            .into_iter()
            .find(|(_, saved, current)| saved != current)
        {
            None => Ok(()),
            Some((setting, saved, mut current)) => {
                if setting == "dataset" {
                    current.push_str(&format!(" ({})", self.dataset().path().display()));
                }
                if setting == "transform" {
                    // One digest of all that makes a sample's pixels from its bytes, said so: a
                    // hostile try changed only the dtype and read "transform digest".
                    current.push_str(
                        " (of the transform chain with its output dtype, layout and \
                         normalization, max_pixels, the decode mode and the batch mix)",
                    );
                }
                Err(Error::StateMismatch {
                    setting,
                    saved,
                    current,
                })
            }
        }
    }

    /// What resuming `state` here cannot know, as a sentence for the user, or None.
    ///
    /// Under [`Uneven::Exact`] ranks do not run in lockstep at an epoch's end: the first ranks
    /// may have one batch more than the others. A state saved by a shorter rank after its last
    /// batch says the epoch goes on with those longer ranks' last batches (it cannot know
    /// whether they had taken them); resumed on another rank or at another world size or batch
    /// size, it gives them again if they had. Resumed on its own rank, at its world and batch
    /// size, it is exact (that rank has nothing left), and so is a state of the rank with the
    /// most batches, rank 0.
    pub fn resume_notice(&self, state: &LoaderState) -> Option<String> {
        let here = &self.inner.sampler.sampling;
        if state.uneven != Uneven::Exact
            || state.world_size == 0
            || state.batch_size == 0
            || state.rank >= state.world_size
            || (state.rank, state.world_size, state.batch_size)
                == (here.rank, here.world_size, here.batch_size)
        {
            return None;
        }
        let saved = |rank| {
            self.inner
                .sampler
                .dealt(rank, state.world_size, state.batch_size)
        };
        let own = saved(state.rank).batches_per_epoch_from(state.start);
        let longest = saved(0).batches_per_epoch_from(state.start);
        (state.next_batch == own && own < longest).then(|| {
            format!(
                "this state was saved by rank {} of {} after its last batch of epoch {}, when \
                 the first ranks had one batch more (uneven \"exact\"); whether they had taken \
                 it is not in the state, so the resume gives those batches, again if they had: \
                 resume from rank 0's state, the rank with the most batches",
                state.rank, state.world_size, state.epoch
            )
        })
    }

    /// The part of `epoch` from position `start` of its order, from batch `first` of that part.
    fn start(&self, epoch: u64, start: usize, first: usize) -> Epoch {
        let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
        Epoch {
            loader: Arc::clone(&self.inner),
            epoch,
            start,
            batches: self.inner.sampler.batches_from(epoch, start),
            next_send: first,
            next_deliver: first,
            pending: HashMap::new(),
            reply_tx,
            reply_rx,
            cancel: Arc::new(AtomicBool::new(false)),
            bad_samples: 0,
            samples_seen: 0,
            samples_before_part: 0,
            planned_at: None,
            done: false,
        }
    }

    /// Stage times and counts so far.
    pub fn stats(&self) -> Stats {
        let c = &self.inner.shared.counters;
        let d = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        Stats {
            read: d(&c.read),
            decode: d(&c.decode),
            transform: d(&c.transform),
            collate: d(&c.collate),
            waiting: d(&c.waiting),
            samples: c.samples.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
            bad_samples: c.bad.load(Ordering::Relaxed),
            stacked: c.stacked.load(Ordering::Relaxed),
        }
    }
}

/// A setting as the state and the Python package spell it (`"exact"`, `"replace"`).
fn setting_name(value: &impl serde::Serialize) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(name)) => format!("{name:?}"),
        _ => "?".into(),
    }
}

/// A shard window as a user gives it: a number of shards, or none.
fn shard_window_name(window: Option<usize>) -> String {
    window.map_or_else(|| "none".into(), |shards| shards.to_string())
}
