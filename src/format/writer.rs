//! The writing side every format shares: the [`DatasetWriter`] trait, what it is given
//! ([`PackPlan`], [`PackedRecord`]s, [`WriterOptions`]) and the progress it commits
//! ([`PackProgress`]), and [`PackFormat`], the registry of writable formats.
//!
//! Adding a writable format: its module implements [`DatasetWriter`], and [`PackFormat`] gets a
//! variant and one arm in [`start_writer`] (the rest of `PackFormat` follows from
//! [`FormatKind`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::lmdb::{self, LmdbWriter};
use super::tfrecord::{self, RecordsWriter};
use crate::dataset::{DatasetInfo, FormatKind, PartInfo, PayloadKind};
use crate::error::{Error, Result};

/// Output formats `pack` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackFormat {
    /// A single-file LMDB ([`crate::format::lmdb`]).
    Lmdb,
    /// A single HDF5 file ([`crate::format::hdf5`]).
    Hdf5,
    /// A directory of TFRecord shards with indexes ([`crate::format::tfrecord`]).
    Records,
}

impl PackFormat {
    /// Every format, whether this build can write it or not.
    pub const ALL: [PackFormat; 3] = [PackFormat::Lmdb, PackFormat::Hdf5, PackFormat::Records];

    /// Whether this build reads and writes the format: HDF5 needs the `hdf5` feature (packing or
    /// opening it without is [`Error::FeatureDisabled`]); the others are always there.
    pub fn is_available(self) -> bool {
        match self {
            PackFormat::Hdf5 => cfg!(feature = "hdf5"),
            PackFormat::Lmdb | PackFormat::Records => true,
        }
    }

    /// `Ok` when this build writes the format, else [`Error::FeatureDisabled`] for `out`: checked
    /// before any input is read, so a build without HDF5 says so at once.
    pub fn require(self, out: &Path) -> Result<()> {
        if self.is_available() {
            return Ok(());
        }
        Err(super::hdf5::feature_disabled(out, "writing an HDF5 file"))
    }

    /// The formats this build reads and writes ([`is_available`](Self::is_available)).
    pub fn available() -> impl Iterator<Item = PackFormat> {
        PackFormat::ALL.into_iter().filter(|f| f.is_available())
    }

    /// The format's short name (`lmdb`, `hdf5`, `records`).
    pub fn name(self) -> &'static str {
        self.kind().name()
    }

    /// The format called `name` ([`name`](Self::name)), whether this build writes it or not.
    pub fn from_name(name: &str) -> Option<PackFormat> {
        PackFormat::ALL.into_iter().find(|f| f.name() == name)
    }

    /// What a dataset of this format reports as its kind.
    pub fn kind(self) -> FormatKind {
        match self {
            PackFormat::Lmdb => FormatKind::Lmdb,
            PackFormat::Hdf5 => FormatKind::Hdf5,
            PackFormat::Records => FormatKind::Records,
        }
    }
}

/// How a writer treats existing output, and each format's own settings. Every writer reads
/// `mode`; the rest only matter to the format named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterOptions {
    /// Continue an interrupted run, replace, or refuse to touch existing output.
    pub mode: StartMode,
    /// LMDB map size (address space reserved for the file).
    pub lmdb_map_size: usize,
    /// Records format: close a shard once it holds this many bytes.
    pub shard_bytes: u64,
    /// Records format: store `label + label_base` (ImageNet TFRecords use 1).
    pub label_base: u32,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            mode: StartMode::default(),
            lmdb_map_size: lmdb::DEFAULT_MAP_SIZE,
            shard_bytes: tfrecord::DEFAULT_SHARD_BYTES,
            label_base: 0,
        }
    }
}

/// Starts the writer of `format` for `out` ([`DatasetWriter::start`]); returns it with the
/// progress already committed (non-zero when resuming). HDF5 without the `hdf5` feature is
/// [`Error::FeatureDisabled`].
pub fn start_writer(
    format: PackFormat,
    out: &Path,
    plan: &PackPlan,
    options: &WriterOptions,
) -> Result<(Box<dyn DatasetWriter>, PackProgress)> {
    match format {
        PackFormat::Lmdb => boxed::<LmdbWriter>(out, plan, options),
        PackFormat::Hdf5 => super::hdf5::start_writer(out, plan, options),
        PackFormat::Records => boxed::<RecordsWriter>(out, plan, options),
    }
}

/// [`DatasetWriter::start`] for `W`, boxed.
pub(crate) fn boxed<W: DatasetWriter + 'static>(
    out: &Path,
    plan: &PackPlan,
    options: &WriterOptions,
) -> Result<(Box<dyn DatasetWriter>, PackProgress)> {
    let (writer, progress) = W::start(out, plan, options)?;
    Ok((Box::new(writer), progress))
}

/// What to do about output that already exists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StartMode {
    /// Continue from `OUT.partial` if there is one.
    pub resume: bool,
    /// Replace an existing `OUT` (only once the new one is complete) and discard a partial one
    /// when not resuming.
    pub force: bool,
}

/// What a writer is asked to produce; stored in the partial output so `--resume` can check it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackPlan {
    /// SHA-256 over the source listing (key, label, size of every file).
    pub source_fingerprint: String,
    /// Number of source files.
    pub num_sources: usize,
    /// Class names.
    pub classes: Vec<String>,
    /// Payload kind written.
    pub payload: PayloadKind,
    /// `--resize`, if any.
    pub resize_short_side: Option<u32>,
    /// JPEG quality for re-encoded images.
    pub quality: u8,
    /// The part of a split conversion this output holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<PartInfo>,
    /// `--restart-markers`: JPEGs rewritten with restart markers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restart_markers: bool,
    /// `--shared-headers`: JPEG headers stored once per dataset
    /// ([`shared_headers`](super::shared_headers)).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_headers: bool,
    /// `--max-pixels`: images larger are rejected, so a resume with another limit would keep
    /// files the first run rejected, or the reverse (found by a hostile try). `None` in a
    /// partial output written before it was recorded: any limit resumes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pixels: Option<u64>,
}

impl PackPlan {
    /// The dataset metadata this plan produces, for `num_samples` samples.
    pub fn dataset_info(&self, format: FormatKind, num_samples: usize) -> DatasetInfo {
        DatasetInfo {
            format,
            classes: self.classes.clone(),
            num_samples,
            payload: self.payload,
            resized_short_side: self.resize_short_side,
            part: self.part.clone(),
            rejected_at_pack: None,
            restart_markers: self.restart_markers,
        }
    }

    /// `Ok` when a partial output made with `self` can be continued with `new`.
    pub fn check_resumable(&self, new: &PackPlan, partial: &Path) -> Result<()> {
        let mismatch = |reason: String| {
            Err(Error::ResumeMismatch {
                path: partial.to_path_buf(),
                reason,
            })
        };
        if self.source_fingerprint != new.source_fingerprint {
            return mismatch(format!(
                "the source is not the interrupted run's ({} samples then, {} now, or other names \
                 or sizes: another source, or one changed since); resume with the same source, \
                 or use --force to start over",
                self.num_sources, new.num_sources
            ));
        }
        // A partial output that did not record its limit resumes under any.
        let recorded = PackPlan {
            max_pixels: self.max_pixels.and(new.max_pixels),
            ..new.clone()
        };
        if *self != recorded {
            let new = &recorded;
            // Each with the first run's value and this one's: "use the same ones" needs them.
            let shown = |value: Option<String>| value.unwrap_or_else(|| "none".into());
            let differ: Vec<String> = [
                (
                    self.payload != new.payload,
                    "--raw",
                    format!("{:?}", self.payload),
                    format!("{:?}", new.payload),
                ),
                (
                    self.resize_short_side != new.resize_short_side,
                    "--resize",
                    shown(self.resize_short_side.map(|s| s.to_string())),
                    shown(new.resize_short_side.map(|s| s.to_string())),
                ),
                (
                    self.quality != new.quality,
                    "--quality",
                    self.quality.to_string(),
                    new.quality.to_string(),
                ),
                (
                    self.part != new.part,
                    "--num-parts/--part-index",
                    shown(
                        self.part
                            .as_ref()
                            .map(|p| format!("{} of {}", p.index, p.count)),
                    ),
                    shown(
                        new.part
                            .as_ref()
                            .map(|p| format!("{} of {}", p.index, p.count)),
                    ),
                ),
                (
                    self.restart_markers != new.restart_markers,
                    "--restart-markers",
                    self.restart_markers.to_string(),
                    new.restart_markers.to_string(),
                ),
                (
                    self.shared_headers != new.shared_headers,
                    "--shared-headers",
                    self.shared_headers.to_string(),
                    new.shared_headers.to_string(),
                ),
                (
                    self.max_pixels != new.max_pixels,
                    "--max-pixels",
                    shown(self.max_pixels.map(|p| p.to_string())),
                    shown(new.max_pixels.map(|p| p.to_string())),
                ),
            ]
            .into_iter()
            .filter(|(differs, ..)| *differs)
            .map(|(_, flag, then, now)| format!("{flag} ({then} then, {now} now)"))
            .collect();
            let which = if differ.is_empty() {
                "other options (--raw/--resize/--quality/--part-index/--restart-markers/--shared-headers/--max-pixels)"
                    .into()
            } else {
                format!("other options: {} differ", differ.join(", "))
            };
            return mismatch(format!(
                "it was started with {which}; use the same ones, or --force"
            ));
        }
        Ok(())
    }
}

/// A file left out of the dataset, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// Path relative to the source root.
    pub key: String,
    /// Why it was rejected.
    pub reason: String,
}

/// How far a pack has got; committed with every chunk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackProgress {
    /// Source files consumed (written or rejected), in source order.
    pub sources_done: usize,
    /// Samples written.
    pub samples_written: usize,
    /// Payload bytes written.
    pub payload_bytes: u64,
    /// Files rejected so far.
    pub rejected: Vec<Rejection>,
}

/// One sample handed to a writer.
#[derive(Debug, Clone, Copy)]
pub struct PackedRecord<'a> {
    /// Class index.
    pub label: u32,
    /// Path relative to the source root.
    pub key: &'a str,
    /// Bytes to store.
    pub payload: &'a [u8],
}

/// A format's writing side. The pack pipeline drives every format the same way: [`start`]
/// (prepare the staging output, or pick up a resumed one), [`write_chunk`] for each chunk in
/// source order, then [`finish`] (seal and publish) or [`abandon`]. The writer owns its
/// output's whole life (staging, lock, progress record, publishing; see [`super::staging`]);
/// the pipeline never touches the files.
///
/// [`start`]: DatasetWriter::start
/// [`write_chunk`]: DatasetWriter::write_chunk
/// [`finish`]: DatasetWriter::finish
/// [`abandon`]: DatasetWriter::abandon
pub trait DatasetWriter {
    /// Starts (or, with `options.mode.resume`, continues) writing `out` for `plan`. Returns the
    /// writer and the progress already committed (empty for a fresh start).
    ///
    /// Refuses to touch an existing `out` unless `options.mode.force`; refuses an existing
    /// partial output unless resuming (then its plan must equal `plan`) or forcing (then it is
    /// discarded). See [`super::staging::prepare_output`].
    fn start(out: &Path, plan: &PackPlan, options: &WriterOptions) -> Result<(Self, PackProgress)>
    where
        Self: Sized;

    /// Appends `records` (indices `progress.samples_written - records.len()..`) and commits them
    /// atomically with `progress`.
    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()>;
    /// Marks the output complete and moves it to its final name.
    fn finish(self: Box<Self>, info: &DatasetInfo, progress: &PackProgress) -> Result<()>;
    /// Deletes the partial output (strict mode's "nothing left behind").
    fn abandon(self: Box<Self>);
}
