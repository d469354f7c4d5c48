//! imagefeed feeds images to training fast, reproducibly, and without crashing on bad data.
//!
//! The main pieces:
//! - [`format`](mod@format): datasets on disk. [`format::open`](fn@format::open) opens an ImageFolder tree or a packed file
//!   behind the [`Dataset`] trait; each worker thread reads through its own [`RecordReader`]
//!   (memory-mapped formats copy each record out of the map once, under a SIGBUS guard).
//! - [`pack`]: packs an ImageFolder tree into a crash-safe, resumable dataset file (what the
//!   `pack-dataset` binary runs).
//! - [`decode`]: JPEG (libjpeg-turbo), PNG and others into caller buffers, with a
//!   decompression-bomb limit; corrupt data is always an error, never garbage pixels.
//! - [`loader`]: the multi-threaded loader: [`sampler`] (shuffle, rank sharding), per-sample
//!   seeded [`rng`], [`transform`]s (torchvision's crop and resize arithmetic, normalize, layout)
//!   written straight into pooled batch buffers ([`pool`], [`batch`]), bad-sample policies and
//!   exact resume. Batches are bit-identical for a seed whatever the number of workers.
//! - [`inspect`] and [`verify`]: what a dataset holds, and whether it matches its source.
//! - [`pagecache`]: cold-cache control for honest measurements.
//! - [`synthetic`]: deterministic ImageFolder trees (including broken files) for demos and tests.
//!
//! ```no_run
//! use imagefeed::{decode::Decoder, format};
//!
//! let dataset = format::open("train.lmdb")?;
//! let mut reader = dataset.open_reader()?;
//! let mut decoder = Decoder::new();
//! let mut rgb = Vec::new();
//! for index in 0..dataset.len() {
//!     let record = reader.read(index)?;
//!     let header = decoder.decode_rgb(record.payload, &mut rgb).map_err(|source| {
//!         imagefeed::Error::Decode { location: record.key.to_string(), source }
//!     })?;
//!     println!("{} {} {}x{}", record.key, dataset.classes()[record.label as usize], header.width, header.height);
//! }
//! # Ok::<(), imagefeed::Error>(())
//! ```

pub mod batch;
pub mod cache;
#[cfg(feature = "cli")]
pub mod cli;
pub mod dataset;
pub mod decode;
pub mod error;
pub(crate) mod file;
pub mod format;
/// The fuzz targets' entry points (feature `fuzzing`). The file lives beside the harness, in
/// `fuzz/targets.rs`; it is compiled into the library because it drives the crate's private
/// parsers.
#[cfg(feature = "fuzzing")]
#[path = "../fuzz/targets.rs"]
pub mod fuzzing;
pub mod geometry;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod inspect;
pub mod loader;
pub(crate) mod mapguard;
pub mod pack;
pub mod pagecache;
pub mod pool;
#[cfg(feature = "progress")]
pub mod progress;
pub mod remote;
pub mod resize;
pub mod rng;
pub mod sampler;
pub mod synthetic;
pub mod transform;
pub mod units;
pub mod verify;

/// The README's Rust examples, compiled as doctests so they stay true to the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeExamples;

/// The loader guide's examples (docs/loader.md), compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/loader.md")]
pub struct LoaderGuideExamples;

/// The GPU guide's examples (docs/gpu.md), compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/gpu.md")]
pub struct GpuGuideExamples;

/// The most worker threads a pack or a loader may be asked for: more than any machine has
/// cores, far fewer than would exhaust its memory for stacks.
pub const MAX_THREADS: usize = 1024;

/// Puts imagefeed's SIGBUS guard (which turns a memory-mapped page the kernel cannot supply
/// into an error instead of the end of the process) in front again if a SIGBUS handler was
/// installed since, as PyTorch's DataLoader does in each worker it forks; the handler found is
/// kept, and every SIGBUS not the guard's goes to it. [`open`], each batch a loader worker
/// builds and the Python package's reads call this themselves; a program that reads records
/// through its own [`RecordReader`] after installing a SIGBUS handler calls it once. One
/// system call; nothing to do on platforms without the guard.
pub fn reclaim_sigbus_guard() {
    mapguard::claim();
}

pub use dataset::{Dataset, DatasetInfo, LazyReader, PayloadKind, Record, RecordReader};
pub use decode::Decoder;
pub use error::{Error, Result};
pub use format::{OpenOptions, open, open_with};
pub use loader::{Loader, LoaderConfig};
pub use pack::{PackFormat, PackOptions};
pub use transform::Transform;
