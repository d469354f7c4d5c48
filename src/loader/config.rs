//! [`LoaderConfig`]: the loader's settings, checked before any thread starts, and the bad-sample policy.

use serde::{Deserialize, Serialize};

use crate::decode::DEFAULT_MAX_PIXELS;
use crate::error::{Error, Result};
use crate::sampler::{Sampling, Uneven};
use crate::transform::{BatchMix, Geometry, SampleTransformer, Transform};

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
/// eventually stop any long run. The lifetime total is in
/// [`Stats::bad_samples`](super::Stats::bad_samples).
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
    /// MixUp and/or CutMix on each finished batch, with soft labels ([`Batch::soft_labels`]);
    /// `None` by default.
    ///
    /// [`Batch::soft_labels`]: crate::batch::Batch::soft_labels
    pub batch_mix: Option<BatchMix>,
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
            batch_mix: None,
        }
    }
}

impl LoaderConfig {
    /// MixUp/CutMix on every batch (torchvision's `MixUp`, `CutMix`, or the uniform choice of
    /// the two its reference recipe uses).
    pub fn with_batch_mix(mut self, mix: BatchMix) -> Self {
        self.batch_mix = Some(mix);
        self
    }

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
    pub(super) fn transformer(&self) -> SampleTransformer {
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
        if s.world_size == 0 {
            return invalid("world_size must be at least 1 (the number of ranks)".into());
        }
        if s.rank >= s.world_size {
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
        if let Some(mix) = &self.batch_mix {
            mix.validate().map_err(Error::Config)?;
        }
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
    pub(super) fn check_batch_memory(&self, w: u32, h: u32, samples: usize) -> Result<()> {
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
