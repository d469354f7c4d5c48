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
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

use crate::batch::{BadSample, BadSampleKind, Batch};
use crate::dataset::{Dataset, LazyReader};
use crate::dataset::{fingerprint, hex};
use crate::decode::DEFAULT_MAX_PIXELS;
use crate::error::{Error, Result};
use crate::pool::{BatchAllocator, BufferPool, HeapAllocator, PooledBuffer};
use crate::rng::SampleRng;
use crate::sampler::{Sampler, Sampling, Uneven};
use crate::transform::{Geometry, Layout, SampleTransformer, Transform};

/// What to do with a sample that cannot be read or decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BadSamplePolicy {
    /// Leave it out: the batch is one sample shorter.
    #[default]
    Skip,
    /// Put another sample in its slot (chosen deterministically from `(seed, epoch, index)`),
    /// so the batch keeps its shape.
    Replace,
    /// Fail with the sample's index, key and reason.
    Error,
}

/// How many bad samples one epoch may hold before the loader stops with an error.
///
/// Counted per epoch: a file that is bad is met again every epoch, so a lifetime total would
/// eventually stop any long run. The lifetime total is in [`Stats::bad_samples`].
///
/// Loaders have [`DEFAULT_MAX_BAD`] unless configured otherwise; `with_max_bad(None)` lifts
/// the cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaxBad {
    /// More than this many bad samples in the epoch.
    Count(u64),
    /// More than this fraction of the rank's samples per epoch.
    Fraction(f64),
}

impl MaxBad {
    /// Whether `bad` bad samples among `samples` exceed this cap.
    pub fn exceeded_by(self, bad: u64, samples: u64) -> bool {
        match self {
            MaxBad::Count(n) => bad > n,
            MaxBad::Fraction(f) => bad as f64 > f * samples as f64,
        }
    }
}

impl std::fmt::Display for MaxBad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaxBad::Count(n) => write!(f, "{n} bad samples"),
            MaxBad::Fraction(x) => write!(f, "{}% of the samples", x * 100.0),
        }
    }
}

/// The bad-sample cap a loader has unless told otherwise: more than 1% of the epoch's samples
/// bad is [`Error::TooManyBadSamples`].
///
/// Sporadic damage (a few corrupt JPEGs in a large dataset, a flipped byte) stays within it and
/// is handled by the [`BadSamplePolicy`], each sample reported by key; losing much of the data
/// for one reason (an unreadable shard, a compression this build cannot undo, a disk going bad)
/// does not: the epoch stops with an error naming the last bad sample instead of ending as if
/// it were complete. `with_max_bad(None)` lifts the cap.
pub const DEFAULT_MAX_BAD: MaxBad = MaxBad::Fraction(0.01);

/// Loader settings: build them with [`LoaderConfig::default`] and the `with_*` methods.
///
/// ```
/// use imagefeed::loader::{BadSamplePolicy, LoaderConfig};
/// use imagefeed::transform::Transform;
///
/// let config = LoaderConfig::default()
///     .with_batch_size(256)
///     .with_workers(8)
///     .with_seed(42)
///     .with_transform(Transform::imagenet_train(224))
///     .with_bad_samples(BadSamplePolicy::Replace)
///     .with_rank(1, 4);
/// assert_eq!(config.sampling.batch_size, 256);
/// assert_eq!((config.sampling.rank, config.sampling.world_size), (1, 4));
/// ```
///
/// The fields are public to read (and to set one at a time); new fields may be added in any
/// release, so the struct cannot be written as a literal outside this crate.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LoaderConfig {
    /// Batch size, shuffling, seed and sharding: everything that decides batch membership.
    pub sampling: Sampling,
    /// Worker threads; 0 builds each batch in the thread that asks for it (as a PyTorch
    /// DataLoader with `num_workers=0`), with nothing built ahead.
    pub workers: usize,
    /// Batches being built or waiting at any time (>= 1).
    pub prefetch: usize,
    /// Per-sample transform.
    pub transform: Transform,
    /// Bad-sample handling.
    pub bad_samples: BadSamplePolicy,
    /// Stop after too many bad samples ([`DEFAULT_MAX_BAD`] unless set; `None`: no limit).
    pub max_bad: Option<MaxBad>,
    /// Decompression-bomb limit in pixels.
    pub max_pixels: u64,
    /// Decode a JPEG that will be shrunk to under half its size at a reduced DCT scale (the
    /// default, [`DctScaling::Antialiased`](crate::decode::DctScaling::Antialiased): within one
    /// level of torchvision on 99.96% of ImageNet eval values); `false` decodes it whole before
    /// resizing, as torchvision does with PIL: every value within one level.
    pub scaled_decode: bool,
}

impl Default for LoaderConfig {
    /// Batches of 32, 2 workers, 4 batches prefetched, seed 0, shuffled, one rank, no
    /// transform, bad samples skipped up to [`DEFAULT_MAX_BAD`] (1% of the epoch).
    fn default() -> Self {
        LoaderConfig {
            sampling: Sampling::default(),
            workers: 2,
            prefetch: 4,
            transform: Transform::none(),
            bad_samples: BadSamplePolicy::Skip,
            max_bad: Some(DEFAULT_MAX_BAD),
            max_pixels: DEFAULT_MAX_PIXELS,
            scaled_decode: true,
        }
    }
}

impl LoaderConfig {
    /// Samples per batch.
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.sampling.batch_size = batch_size;
        self
    }

    /// Seed for shuffling and augmentation.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.sampling.seed = seed;
        self
    }

    /// For a dataset of shards: shuffle within windows of this many shards, the shards
    /// permuted each epoch, instead of over the whole dataset ([`Sampling::shard_window`]), so
    /// an epoch reads a bounded set of shards at a time (shards fetched from object storage);
    /// `None` (the default): a global shuffle.
    pub fn with_shard_window(mut self, shards: Option<usize>) -> Self {
        self.sampling.shard_window = shards;
        self
    }

    /// Shuffle every epoch (the default) or keep the dataset's order.
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.sampling.shuffle = shuffle;
        self
    }

    /// Drop a final batch shorter than the batch size.
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.sampling.drop_last = drop_last;
        self
    }

    /// This process's rank among `world_size` (distributed training).
    pub fn with_rank(mut self, rank: usize, world_size: usize) -> Self {
        self.sampling.rank = rank;
        self.sampling.world_size = world_size;
        self
    }

    /// Pad or drop when the samples do not divide evenly between ranks.
    pub fn with_uneven(mut self, uneven: Uneven) -> Self {
        self.sampling.uneven = uneven;
        self
    }

    /// All the sampling settings at once.
    pub fn with_sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }

    /// Worker threads (0: batches built in the thread that asks for them).
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// Batches being built or waiting at any time.
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Per-sample transform.
    pub fn with_transform(mut self, transform: Transform) -> Self {
        self.transform = transform;
        self
    }

    /// Bad-sample handling.
    pub fn with_bad_samples(mut self, policy: BadSamplePolicy) -> Self {
        self.bad_samples = policy;
        self
    }

    /// Stop after too many bad samples in an epoch (`None`: never).
    pub fn with_max_bad(mut self, max_bad: Option<MaxBad>) -> Self {
        self.max_bad = max_bad;
        self
    }

    /// Decompression-bomb limit in pixels.
    pub fn with_max_pixels(mut self, max_pixels: u64) -> Self {
        self.max_pixels = max_pixels;
        self
    }

    /// Whether a JPEG that will be shrunk is decoded at a reduced DCT scale
    /// ([`scaled_decode`](Self::scaled_decode); default true).
    pub fn with_scaled_decode(mut self, scaled_decode: bool) -> Self {
        self.scaled_decode = scaled_decode;
        self
    }

    /// A transformer for this configuration's pixel limit and decode mode.
    fn transformer(&self) -> SampleTransformer {
        SampleTransformer::new(self.max_pixels).with_scaled_decode(self.scaled_decode)
    }

    /// Checks the settings, naming the first impossible one.
    pub fn validate(&self) -> Result<()> {
        let invalid = |m: String| Err(Error::Config(m));
        let s = &self.sampling;
        if s.batch_size == 0 {
            return invalid("batch_size must be at least 1".into());
        }
        if self.workers > crate::MAX_THREADS {
            return invalid(format!(
                "workers {} must be 0..={} (0: batches built in the calling thread)",
                self.workers,
                crate::MAX_THREADS
            ));
        }
        if !(1..=MAX_PREFETCH).contains(&self.prefetch) {
            return invalid(format!(
                "prefetch {} must be 1..={MAX_PREFETCH} (batches built ahead of the consumer)",
                self.prefetch
            ));
        }
        if s.shard_window == Some(0) {
            return invalid("shard_window must be at least 1 shard".into());
        }
        if s.world_size == 0 || s.rank >= s.world_size {
            return invalid(format!(
                "rank {} is not in 0..{} (world_size)",
                s.rank, s.world_size
            ));
        }
        if let Some(MaxBad::Fraction(f)) = self.max_bad
            && !(0.0..=1.0).contains(&f)
        {
            return invalid("max_bad fraction must be in 0..1".into());
        }
        if self.max_pixels == 0 {
            return invalid("max_pixels 0 would refuse every image".into());
        }
        self.transform.validate().map_err(Error::Config)?;
        // An output image larger than the pixel limit could never be made: refusing it here
        // keeps a typo (CenterCrop(65536)) from becoming a batch buffer allocation that aborts.
        let output = match self.transform.geometry {
            Geometry::Resize { short } => Some((u64::from(short), u64::from(short))),
            _ => self
                .transform
                .fixed_size()
                .map(|(w, h)| (u64::from(w), u64::from(h))),
        };
        if let Some((w, h)) = output
            && w * h > self.max_pixels
        {
            return invalid(format!(
                "the transform's output ({w}x{h}{}) exceeds max_pixels {}",
                if matches!(self.transform.geometry, Geometry::Resize { .. }) {
                    " at least"
                } else {
                    ""
                },
                self.max_pixels
            ));
        }
        Ok(())
    }

    /// Refuses a batch shape whose buffers could not be allocated: `prefetch` batches of
    /// `batch_size` slots (at most `samples`) of `w × h` (ready batches waiting) beyond this
    /// machine's memory, or beyond the address-space limit (`ulimit -v`) where one is set. A
    /// typo (`CenterCrop(13000)`, 520 GB a batch of 256 as `f32`) is a configuration error that
    /// says how much it needs, not an allocation that aborts the process.
    fn check_batch_memory(&self, w: u32, h: u32, samples: usize) -> Result<()> {
        // A batch never holds more samples than the dataset has (batch_size 100000 over 1,000
        // samples allocates 1,000 slots).
        let slots = self.sampling.batch_size.min(samples.max(1)) as u128;
        let slot = u128::from(w) * u128::from(h) * 3 * self.transform.output.dtype.size() as u128;
        let batch = slot * slots;
        let needed = batch * self.prefetch as u128;
        let Some((limit, what)) = memory_limit() else {
            return Ok(());
        };
        if needed <= u128::from(limit) {
            return Ok(());
        }
        let gb = |bytes: u128| bytes as f64 / 1e9;
        Err(Error::Config(format!(
            "batches of {} images of {w}x{h} ({:?}) need {:.1} GB each, and prefetch {} keeps {:.1} \
             GB of them ready: more than {what} ({:.1} GB); lower batch_size, the output size or \
             prefetch",
            slots,
            self.transform.output.dtype,
            gb(batch),
            self.prefetch,
            gb(needed),
            gb(u128::from(limit)),
        )))
    }
}

/// The most memory batches can take: the smaller of the machine's physical memory and the
/// address-space limit (`RLIMIT_AS`), with which one it is; `None` when neither is known.
fn memory_limit() -> Option<(u64, &'static str)> {
    // SAFETY: sysconf and getrlimit only read process and system settings into locals.
    let (pages, page, limit) = unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        let got = libc::getrlimit(libc::RLIMIT_AS, &mut limit) == 0;
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
            got.then_some(limit.rlim_cur),
        )
    };
    let physical = (pages > 0 && page > 0)
        .then(|| (pages as u64).saturating_mul(page as u64))
        .map(|bytes| (bytes, "this machine's memory"));
    let address_space = limit
        .filter(|&l| l != libc::RLIM_INFINITY)
        .map(|bytes| (bytes, "the address-space limit (ulimit -v)"));
    match (physical, address_space) {
        (Some(p), Some(a)) => Some(if a.0 < p.0 { a } else { p }),
        (p, a) => p.or(a),
    }
}

/// The most batches [`LoaderConfig::prefetch`] may build ahead: four per worker at the most
/// workers (2 to 4 per worker keep them busy), a bound on what a typo can hold in memory.
pub const MAX_PREFETCH: usize = 4 * crate::MAX_THREADS;

/// The version of [`LoaderState`]'s layout; a state of another version is refused.
pub const LOADER_STATE_VERSION: u32 = 2;

/// Where an epoch stands, with everything that decides its stream: enough to resume it exactly,
/// and to refuse a loader that would give a different stream. Serializable (serde).
///
/// [`Loader::resume`] checks `version`, `seed`, `shuffle`, `drop_last`, `uneven`,
/// `bad_sample_policy`, `transform` and `dataset` against the loader. `rank`, `world_size` and
/// `batch_size` may differ: every rank of a job stands at the same batch of an epoch, so any
/// rank's state resumes any rank, and a state saved at another world size or batch size
/// continues the epoch with exactly the samples no rank has been given yet ([`Loader::resume`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// [`LOADER_STATE_VERSION`] when saved.
    pub version: u32,
    /// The loader's seed.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// Samples per batch.
    pub batch_size: usize,
    /// Whether epochs are shuffled.
    pub shuffle: bool,
    /// The shard window shuffled within ([`Sampling::shard_window`]); absent: a global
    /// shuffle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_window: Option<usize>,
    /// Whether a final short batch is dropped.
    pub drop_last: bool,
    /// Padding or dropping between ranks.
    pub uneven: Uneven,
    /// The rank that saved the state.
    pub rank: usize,
    /// The world size the epoch was running at.
    pub world_size: usize,
    /// [`fingerprint`] of the dataset.
    pub dataset: String,
    /// Samples of the epoch's order given out before the current world size took over: 0,
    /// unless the epoch was resumed at another world size.
    pub start: usize,
    /// The next batch to deliver, counted from `start`.
    pub next_batch: usize,
    /// Sample slots this rank had consumed when the part beginning at `start` began (what a
    /// `max_bad` fraction counts the part's samples on top of).
    pub samples_before_start: u64,
    /// The bad-sample policy (`replace` changes which samples a batch holds).
    pub bad_sample_policy: BadSamplePolicy,
    /// A digest of the transform and the pixel limit (they decide the pixels, and which
    /// samples are bad).
    pub transform: String,
    /// Bad samples met so far in this epoch by the rank that saved the state (what `max_bad`
    /// applies to).
    pub bad_samples: u64,
    /// Sample slots of this epoch this rank has consumed so far.
    pub samples_seen: u64,
}

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

/// Time per stage, summed over workers, and counts. A snapshot from [`Loader::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Reading records (with the sample loop's own work between them, such as the hint that
    /// starts loading the next record).
    pub read: Duration,
    /// Decoding.
    pub decode: Duration,
    /// Resizing and cropping.
    pub transform: Duration,
    /// Writing slots (flip, normalize, layout).
    pub collate: Duration,
    /// Time the consumer spent waiting for the next batch.
    pub waiting: Duration,
    /// Samples delivered.
    pub samples: u64,
    /// Batches delivered.
    pub batches: u64,
    /// Bad samples met.
    pub bad_samples: u64,
}

#[derive(Default)]
struct Counters {
    read: AtomicU64,
    decode: AtomicU64,
    transform: AtomicU64,
    collate: AtomicU64,
    waiting: AtomicU64,
    samples: AtomicU64,
    batches: AtomicU64,
    bad: AtomicU64,
}

fn add(counter: &AtomicU64, d: Duration) {
    counter.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
}

/// Stage times of one batch, kept by its worker and added to the shared [`Counters`] once per
/// batch: per-sample atomic adds on one shared cache line would bounce it between the workers'
/// cores tens of thousands of times a second.
///
/// The stages are timed as one chain of clock readings (`clock`): each stage ends where the
/// next begins, four readings per sample instead of two per stage.
struct StageTimes {
    read: Duration,
    decode: Duration,
    transform: Duration,
    collate: Duration,
    clock: Stopwatch,
}

impl StageTimes {
    /// Zero times, the chain starting now.
    fn starting_now() -> StageTimes {
        StageTimes {
            read: Duration::ZERO,
            decode: Duration::ZERO,
            transform: Duration::ZERO,
            collate: Duration::ZERO,
            clock: Stopwatch {
                last: Instant::now(),
            },
        }
    }

    fn add_to(&self, counters: &Counters) {
        add(&counters.read, self.read);
        add(&counters.decode, self.decode);
        add(&counters.transform, self.transform);
        add(&counters.collate, self.collate);
    }
}

/// A chain of clock readings.
struct Stopwatch {
    /// The last reading: the end of the previous stage.
    last: Instant,
}

impl Stopwatch {
    /// Ends the stage that began at `last`: returns its length and starts the next.
    fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let stage = now - self.last;
        self.last = now;
        stage
    }
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
        let transform_digest = {
            use sha2::{Digest as _, Sha256};
            let digest = Sha256::digest(
                // (A whole decode is named only when chosen, so states saved before the
                // setting existed keep resuming.)
                format!(
                    "{:?} max_pixels {}{}",
                    config.transform,
                    config.max_pixels,
                    if config.scaled_decode {
                        ""
                    } else {
                        " whole decode"
                    }
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
        let inline = workers.is_empty().then(|| {
            Mutex::new(Worker {
                reader: LazyReader::new(Arc::clone(&shared.dataset)),
                transformer: shared.config.transformer(),
            })
        });
        Ok(Loader {
            inner: Arc::new(Inner {
                shared,
                sampler,
                fingerprint,
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
        side.get_or_insert_with(|| Worker {
            reader: LazyReader::new(Arc::clone(&shared.dataset)),
            transformer: shared.config.transformer(),
        })
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
        // The epoch as it was being dealt out when the state was saved.
        let saved = Sampler {
            len: sampler.len,
            sampling: Sampling {
                rank: 0,
                world_size: state.world_size,
                batch_size: state.batch_size,
                ..sampler.sampling
            },
            shards: sampler.shards.clone(),
        };
        let batches = saved.batches_per_epoch_from(state.start);
        if state.world_size == 0 || state.start > sampler.len || state.next_batch > batches {
            return Err(Error::Config(format!(
                "the state's position (batch {} of the part from sample {} at world size {}) \
                 is past its epoch's {batches} batches",
                state.next_batch, state.start, state.world_size
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
        let settings: [(&'static str, String, String); 9] = [
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
            ("seed", state.seed.to_string(), s.seed.to_string()),
            (
                "bad_sample_policy",
                format!("{:?}", state.bad_sample_policy),
                format!("{:?}", config.bad_samples),
            ),
            (
                "transform",
                format!("digest {}", state.transform),
                format!("digest {}", self.inner.transform_digest),
            ),
            ("shuffle", state.shuffle.to_string(), s.shuffle.to_string()),
            (
                "shard_window",
                format!("{:?}", state.shard_window),
                format!("{:?}", self.inner.sampler.effective_shard_window()),
            ),
            (
                "drop_last",
                state.drop_last.to_string(),
                s.drop_last.to_string(),
            ),
            (
                "uneven",
                format!("{:?}", state.uneven),
                format!("{:?}", s.uneven),
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
                Err(Error::StateMismatch {
                    setting,
                    saved,
                    current,
                })
            }
        }
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
        }
    }
}

/// One epoch's batches, in order. It owns a share of its loader, so it may outlive the
/// [`Loader`] value it came from (the worker threads stay until both are gone). Dropping it
/// cancels the batches still being built.
pub struct Epoch {
    loader: Arc<Inner>,
    epoch: u64,
    /// Where in the epoch's order this part begins (0 unless resumed at another world size).
    start: usize,
    batches: Vec<Vec<usize>>,
    next_send: usize,
    next_deliver: usize,
    pending: HashMap<usize, Result<Batch>>,
    reply_tx: Sender<(usize, Result<Batch>)>,
    reply_rx: Receiver<(usize, Result<Batch>)>,
    cancel: Arc<AtomicBool>,
    bad_samples: u64,
    samples_seen: u64,
    /// Sample slots this rank consumed before this part began (elastic resume).
    samples_before_part: u64,
    /// The batch the dataset was last told the coming shards from ([`Epoch::plan_shards`]).
    planned_at: Option<usize>,
    done: bool,
}

impl Epoch {
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
        let bad_samples = self.bad_samples + own_bad;
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

// ---------------------------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------------------------

/// Domain of the replacement-choice streams (sample streams use 0, the shuffle 1).
const REPLACE_DOMAIN: u64 = 2;
/// Candidates tried for one bad sample under `Replace`.
const REPLACE_ATTEMPTS: usize = 16;

fn worker_loop(shared: &Shared, queue: &Receiver<Job>) {
    let mut worker = Worker {
        reader: LazyReader::new(Arc::clone(&shared.dataset)),
        transformer: shared.config.transformer(),
    };
    for job in queue.iter() {
        if job.cancel.load(Ordering::Relaxed) {
            continue;
        }
        let result = worker.run(shared, &job);
        let _ = job.reply.send((job.position, result)); // the epoch may be gone
    }
}

/// A worker's private state: its own reader handle and transformer.
struct Worker {
    reader: LazyReader,
    transformer: SampleTransformer,
}

impl Worker {
    /// Builds `job`'s batch; a panic is an error naming the batch, not the end of the thread.
    fn run(&mut self, shared: &Shared, job: &Job) -> Result<Batch> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.build(shared, job)))
            .unwrap_or_else(|panic| {
                Err(Error::Panicked {
                    what: format!("a worker building batch {}", job.position),
                    message: crate::error::panic_message(&*panic),
                })
            })
    }
}

/// How one sample went.
enum Outcome {
    Ok(u32),
    Bad {
        key: String,
        kind: BadSampleKind,
        reason: String,
    },
}

/// The batch being filled: slot memory is taken once the slot size is known.
struct Collator {
    buffer: Option<PooledBuffer>,
    capacity: usize,
    slot_len: usize,
    size: Option<(u32, u32, usize, String)>,
    written: usize,
}

impl Worker {
    fn build(&mut self, shared: &Shared, job: &Job) -> Result<Batch> {
        let config = &shared.config;
        let mut collator = Collator {
            buffer: None,
            // The largest batch's capacity even for the short last batch, so every buffer fits
            // every batch and the pool never needs more than `prefetch` of them (fixed-size
            // outputs); never more than an epoch can fill.
            capacity: shared.largest_batch.max(job.indices.len()),
            slot_len: 0,
            size: None,
            written: 0,
        };
        let mut samples = Vec::with_capacity(job.indices.len());
        let mut labels = Vec::with_capacity(job.indices.len());
        let mut bad = Vec::new();
        let mut times = StageTimes::starting_now();
        // Reads that wait on the network (ranged reads from object storage) start together.
        self.reader.plan_reads(&job.indices);
        // The samples, in a closure so that the stage times are counted however it ends.
        let mut fill = || -> Result<()> {
            for (position, &index) in job.indices.iter().enumerate() {
                if job.cancel.load(Ordering::Relaxed) {
                    return Err(Error::Cancelled);
                }
                // The next sample's bytes load while this one decodes.
                if let Some(&next) = job.indices.get(position + 1) {
                    self.reader.prefetch(next);
                }
                match self.sample(shared, job.epoch, index, &mut collator, &mut times)? {
                    Outcome::Ok(label) => {
                        samples.push(index);
                        labels.push(label);
                    }
                    Outcome::Bad { key, kind, reason } => {
                        if config.bad_samples == BadSamplePolicy::Error {
                            return Err(Error::BadSample {
                                index,
                                key,
                                kind,
                                reason,
                            });
                        }
                        let mut record = BadSample {
                            index,
                            key,
                            kind,
                            reason,
                            replaced_by: None,
                            while_replacing: None,
                        };
                        if config.bad_samples == BadSamplePolicy::Replace
                            && let Some((candidate, label)) = self.replacement(
                                shared,
                                job.epoch,
                                index,
                                &mut collator,
                                &mut times,
                                &mut bad,
                            )?
                        {
                            samples.push(candidate);
                            labels.push(label);
                            record.replaced_by = Some(candidate);
                        }
                        bad.push(record);
                    }
                }
            }
            Ok(())
        };
        let result = fill();
        times.add_to(&shared.counters);
        result?;
        // A batch left with no sample keeps the transform's size when it has one, so that its
        // shape is still [0, 3, h, w] (only a native-size batch with no image has no size).
        let (width, height) = collator
            .size
            .as_ref()
            .map(|s| (s.0, s.1))
            .or_else(|| config.transform.fixed_size())
            .unwrap_or((0, 0));
        let mut data = collator
            .buffer
            .take()
            .unwrap_or_else(|| shared.pool.take(0));
        data.truncate(collator.written * collator.slot_len);
        let (h, w, n) = (height as usize, width as usize, collator.written);
        let shape = match config.transform.output.layout {
            Layout::Nchw => [n, 3, h, w],
            Layout::Nhwc => [n, h, w, 3],
        };
        Ok(Batch {
            epoch: job.epoch,
            index: job.position,
            samples,
            labels,
            bad,
            shape,
            dtype: config.transform.output.dtype,
            layout: config.transform.output.layout,
            data,
        })
    }

    /// Under `Replace`: the first of up to [`REPLACE_ATTEMPTS`] candidates, drawn from
    /// `(seed, epoch, index)`, that loads into the next slot, with its label. Candidates that
    /// are bad themselves are recorded in `bad`.
    fn replacement(
        &mut self,
        shared: &Shared,
        epoch: u64,
        index: usize,
        collator: &mut Collator,
        times: &mut StageTimes,
        bad: &mut Vec<BadSample>,
    ) -> Result<Option<(usize, u32)>> {
        let config = &shared.config;
        let mut rng = SampleRng::keyed(config.sampling.seed, epoch, index as u64, REPLACE_DOMAIN);
        let len = shared.dataset.len() as u64;
        for _ in 0..REPLACE_ATTEMPTS {
            let candidate = rng.below(len) as usize;
            if candidate == index {
                continue;
            }
            match self.sample(shared, epoch, candidate, collator, times)? {
                Outcome::Ok(label) => return Ok(Some((candidate, label))),
                Outcome::Bad { key, kind, reason } => bad.push(BadSample {
                    index: candidate,
                    key,
                    kind,
                    reason: format!("{reason} (while replacing sample {index})"),
                    replaced_by: None,
                    while_replacing: Some(index),
                }),
            }
        }
        Ok(None)
    }

    /// Reads, decodes and transforms sample `index` into the next free slot. A problem with the
    /// sample is an `Outcome::Bad`; only a batch-level problem (mixed sizes) is an `Err`.
    fn sample(
        &mut self,
        shared: &Shared,
        epoch: u64,
        index: usize,
        collator: &mut Collator,
        times: &mut StageTimes,
    ) -> Result<Outcome> {
        let config = &shared.config;
        // The read stage runs from the end of the previous sample (or the batch's start), so
        // it includes the loop's own work, such as the prefetch hint for this record.
        let record = self.reader.read(index);
        times.read += times.clock.lap();
        let record = match record {
            Ok(record) => record,
            // Not the sample's fault: the cache has no room for its shard. Going on would make
            // every later sample of that shard bad too; the batch fails, saying what to do.
            Err(e @ Error::CacheFull { .. }) => return Err(e),
            // The dataset's file was replaced or rewritten since it was opened: every later
            // sample would be bad too, or another file's. The batch fails, naming the file.
            Err(e @ Error::FileChanged { .. }) => return Err(e),
            Err(e) => {
                return Ok(Outcome::Bad {
                    key: match &e {
                        Error::CorruptRecord { key, .. } => key.clone(),
                        _ => format!("#{index}"),
                    },
                    kind: BadSampleKind::of_read_error(&e),
                    reason: e.to_string(),
                });
            }
        };
        let label = record.label;
        let mut rng = SampleRng::new(config.sampling.seed, epoch, index as u64);
        let prepared = match self.transformer.apply_since(
            times.clock.last,
            &config.transform,
            record.payload,
            &mut rng,
        ) {
            Ok(p) => p,
            Err(e) => {
                times.decode += times.clock.lap();
                return Ok(Outcome::Bad {
                    key: record.key.to_string(),
                    kind: BadSampleKind::of_decode_error(&e),
                    reason: e.to_string(),
                });
            }
        };
        times.decode += prepared.decode_time;
        times.transform += prepared.transform_time;
        times.clock.last = prepared.finished;
        let (w, h) = (prepared.width, prepared.height);
        match &collator.size {
            None => {
                collator.size = Some((w, h, index, record.key.to_string()));
                collator.slot_len = config.transform.output.slot_len(w, h);
                let bytes = collator.slot_len * collator.capacity;
                collator.buffer =
                    Some(
                        shared
                            .pool
                            .try_take(bytes)
                            .ok_or_else(|| Error::OutOfMemory {
                                bytes: bytes as u64,
                                what: format!(
                                    "a batch of {} samples (epoch {epoch})",
                                    collator.capacity
                                ),
                            })?,
                    );
            }
            Some((fw, fh, first_index, first_key)) if (*fw, *fh) != (w, h) => {
                return Err(Error::ShapeMismatch {
                    first_index: *first_index,
                    first_key: first_key.clone(),
                    first_size: (*fw, *fh),
                    index,
                    key: record.key.to_string(),
                    size: (w, h),
                });
            }
            Some(_) => {}
        }
        let at = collator.written * collator.slot_len;
        let buffer = collator.buffer.as_mut().expect("allocated with the size");
        let slot = &mut buffer.as_mut_slice()[at..at + collator.slot_len];
        config
            .transform
            .output
            .write(prepared.pixels, w, h, prepared.flip, slot);
        collator.written += 1;
        times.collate += times.clock.lap();
        Ok(Outcome::Ok(label))
    }
}
