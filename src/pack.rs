//! Packing an ImageFolder tree into a dataset file: the work behind `pack-dataset`.
//!
//! The pipeline: scan the tree ([`ImageFolder`]) → read and check files in parallel (rayon), a
//! chunk at a time → hand each chunk, in source order, to the format's writer, which commits it
//! atomically together with a progress record → mark the output complete and rename it into
//! place.
//!
//! Every file is fully decoded once while packing, so a truncated or corrupt image is *rejected*
//! (its path and reason are listed in the summary and the report) instead of being stored for a
//! training run to trip over. Rejection does not stop the run unless [`PackOptions::strict`].
//!
//! Crash safety comes from two rules: the output is built under `OUT.partial` and only renamed
//! to `OUT` once complete, and each chunk is committed with the count of source files consumed.
//! [`StartMode::resume`] picks up from that count; the plan check makes sure a resumed run uses
//! the same source tree and options.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::dataset::{Dataset, DatasetInfo, FormatKind, PartInfo, PayloadKind, RecordReader, hex};
use crate::decode::{DEFAULT_MAX_PIXELS, Decoder, RawImage};
use crate::error::{Error, IoContext as _, Result};
use crate::format::folder::ImageFolder;
use crate::format::lmdb::{self, LmdbWriter};
use crate::format::records::{self, RecordsWriter};
use crate::resize::{RgbResizer, short_side_size};

/// The most worker threads a pack (or a loader) may be asked for: more than any machine has
/// cores, far fewer than would exhaust its memory for stacks.
pub const MAX_THREADS: usize = 1024;

/// Output formats `pack` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackFormat {
    /// A single-file LMDB ([`crate::format::lmdb`]).
    Lmdb,
    /// A single HDF5 file ([`crate::format::hdf5`]).
    Hdf5,
    /// A directory of TFRecord shards with indexes ([`crate::format::records`]).
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
        Err(crate::format::hdf5::feature_disabled(
            out,
            "writing an HDF5 file",
        ))
    }

    /// The formats this build reads and writes ([`is_available`](Self::is_available)).
    pub fn available() -> impl Iterator<Item = PackFormat> {
        PackFormat::ALL.into_iter().filter(|f| f.is_available())
    }

    /// The format's short name (`lmdb`, `hdf5`, `records`).
    pub fn name(self) -> &'static str {
        self.kind().name()
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

/// How to pack.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Shrink images whose shorter side is longer than this (torchvision `Resize` rules) and
    /// re-encode them as JPEG at [`quality`](Self::quality). Smaller images are kept as they are.
    pub resize_short_side: Option<u32>,
    /// JPEG quality for re-encoded images (1..=100).
    pub quality: u8,
    /// Store decoded RGB pixels instead of encoded files, so training skips decoding.
    pub raw: bool,
    /// Fail on the first rejected file, leaving nothing behind.
    pub strict: bool,
    /// Continue an interrupted run, replace, or refuse to touch existing output.
    pub mode: StartMode,
    /// Decompression-bomb limit, in pixels.
    pub max_pixels: u64,
    /// Worker threads for reading and checking (`None`: rayon's default, one per core).
    pub threads: Option<usize>,
    /// Source files per committed chunk.
    pub chunk_size: usize,
    /// LMDB map size (address space reserved for the file).
    pub lmdb_map_size: usize,
    /// Records format: close a shard once it holds this many bytes.
    pub shard_bytes: u64,
    /// Records format: store `label + label_base` (ImageNet TFRecords use 1).
    pub label_base: u32,
    /// Pack only part `.0` of `.1` of the source listing (a job array's share); see
    /// [`PartInfo`] and [`join`].
    pub part: Option<(usize, usize)>,
}

impl PackOptions {
    /// `Err(Error::Options)` for settings no pack can run with.
    pub fn validate(&self) -> Result<()> {
        let invalid = |m: String| Err(Error::Options(m));
        if let Some(threads) = self.threads
            && !(1..=MAX_THREADS).contains(&threads)
        {
            return invalid(format!("--threads {threads}: must be 1..={MAX_THREADS}"));
        }
        if self.resize_short_side == Some(0) {
            return invalid("--resize 0: the shorter side must be at least 1 pixel".into());
        }
        if !(1..=100).contains(&self.quality) {
            return invalid(format!("--quality {}: must be 1..=100", self.quality));
        }
        if self.max_pixels == 0 {
            return invalid("--max-pixels 0 would reject every image".into());
        }
        if self.shard_bytes == 0 {
            return invalid("--shard-size 0: a shard must hold at least a byte".into());
        }
        Ok(())
    }
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            resize_short_side: None,
            quality: 90,
            raw: false,
            strict: false,
            mode: StartMode::default(),
            max_pixels: DEFAULT_MAX_PIXELS,
            threads: None,
            chunk_size: 256,
            lmdb_map_size: lmdb::DEFAULT_MAP_SIZE,
            shard_bytes: records::DEFAULT_SHARD_BYTES,
            label_base: 0,
            part: None,
        }
    }
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

/// What a pack was asked to do; stored in the partial output so `--resume` can check it.
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
                "the source tree changed since the interrupted run ({} files then, {} now, or different \
                 names/sizes); use --force to start over",
                self.num_sources, new.num_sources
            ));
        }
        if self != new {
            return mismatch("it was started with other options (--raw/--resize/--quality/--part-index); use the same ones, or --force".into());
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

/// A format's writing side, as the pack pipeline drives it.
pub trait PackSink {
    /// Appends `records` (indices `progress.samples_written - records.len()..`) and commits them
    /// atomically with `progress`.
    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()>;
    /// Marks the output complete and moves it to its final name.
    fn finish(self: Box<Self>, info: &DatasetInfo, progress: &PackProgress) -> Result<()>;
    /// Deletes the partial output (strict mode's "nothing left behind").
    fn abandon(self: Box<Self>);
}

/// Receives progress while packing (the binary draws a progress bar with it).
pub trait PackObserver: Sync {
    /// Called once, with the number of source files and how many a resumed run already did.
    fn started(&self, _total: usize, _already_done: usize) {}
    /// Called after each committed chunk.
    fn advanced(&self, _done: usize, _payload_bytes: u64) {}
    /// Called for each rejected file.
    fn rejected(&self, _rejection: &Rejection) {}
    /// Asked after each committed chunk: `true` stops the pack there with
    /// [`Error::Interrupted`], leaving the partial output for a `resume` run (a user pressed
    /// Ctrl-C). The default never stops.
    fn should_stop(&self) -> bool {
        false
    }
}

/// An observer that ignores everything.
pub struct NoProgress;
impl PackObserver for NoProgress {}

/// The outcome of a pack, also written as JSON to [`report_path`]`(out)`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PackSummary {
    /// Source root.
    pub source: PathBuf,
    /// Output path.
    pub output: PathBuf,
    /// Output format name.
    pub format: String,
    /// Samples written.
    pub samples: usize,
    /// Number of classes.
    pub classes: usize,
    /// Payload bytes written.
    pub payload_bytes: u64,
    /// Size of the output file.
    pub file_bytes: u64,
    /// Files rejected, with reasons.
    pub rejected: Vec<Rejection>,
    /// Files skipped for not having an image extension.
    pub skipped_non_images: usize,
    /// Source files a resumed run found already done.
    pub resumed_from: usize,
    /// What opening the source reported (e.g. an index built for a TFRecord shard).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
    /// Wall time of this run.
    pub seconds: f64,
    /// Source files processed per second in this run.
    pub images_per_sec: f64,
}

/// `OUT.partial`: where an output is built.
pub fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

/// Whether `path` is named like a writer's staging output (`*.partial`). Readers refuse such
/// paths whatever they hold, and writers refuse them as outputs: a dataset under that name
/// could not be told from a half-written one.
pub fn is_staging_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".partial"))
}

/// `OUT.report.json`: the machine-readable pack report.
pub fn report_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".report.json");
    PathBuf::from(name)
}

/// Applies `mode` to an output path: errors if `out` exists without `force`, or a partial output
/// exists without `resume`/`force`; deletes a partial output when forcing a fresh start. Returns
/// the partial path to write.
///
/// `force` only ever replaces what an imagefeed writer made ([`format::is_own_output`]): an
/// existing `out` or `OUT.partial` that is anything else (a source tree, a folder2lmdb or h5py
/// file, a directory of other files) is an [`Error::NotReplaceable`], and nothing is touched.
/// The old `out` itself stays in place until the new one is complete ([`publish`]).
///
/// [`format::is_own_output`]: crate::format::is_own_output
pub fn prepare_output(out: &Path, mode: StartMode) -> Result<PathBuf> {
    // Absolute, so that libraries that canonicalize the parent (heed does) accept a bare name.
    let out = &std::path::absolute(out).at(out)?;
    if is_staging_name(out) {
        return Err(Error::Options(format!(
            "{}: an output may not be named *.partial: that name is how pack-dataset marks \
             unfinished output, and readers refuse it",
            out.display()
        )));
    }
    let partial = partial_path(out);
    if exists(out) {
        if !mode.force {
            return Err(Error::AlreadyExists {
                path: out.to_path_buf(),
                hint: "use --force to replace it".into(),
            });
        }
        refuse_foreign(out)?;
    }
    if exists(&partial) && mode.resume {
        refuse_to_resume_into_foreign(&partial)?;
        drop(lock_staging(&partial)?);
    }
    if exists(&partial) && !mode.resume {
        if !mode.force {
            return Err(Error::AlreadyExists {
                path: partial,
                hint: "an interrupted run left it: --resume to finish it, or --force to start over"
                    .into(),
            });
        }
        refuse_foreign(&partial)?;
        let _writer_lock = lock_staging(&partial)?;
        crate::format::remove_own_output(&partial)?;
    }
    refuse_foreign_report(out)?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).at(parent)?;
    }
    Ok(partial)
}

/// Takes the writer's lock on the staging output `partial` (a directory or file): an exclusive,
/// non-blocking `flock` held as long as the returned handle lives, and released by the kernel
/// when the process dies however it dies. A second pack to the same `OUT` (with `--force` or
/// `--resume`) is refused while one is writing, instead of deleting or appending to its files.
pub(crate) fn lock_staging(partial: &Path) -> Result<fs::File> {
    use std::os::fd::AsRawFd as _;
    let file = fs::File::open(partial).at(partial)?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(Error::NotReplaceable {
                path: partial.to_path_buf(),
                reason: "another pack-dataset run is writing it right now; wait for it to \
                         finish, or stop it first"
                    .into(),
            });
        }
        return Err(Error::io(partial, e));
    }
    Ok(file)
}

/// `Err(NotReplaceable)` unless the staging output `partial` that `--resume` would continue is
/// our own, reached without links: not a link itself, recognised by content, a directory holding
/// only regular files our writers make (no link inside to write through), and a file with no
/// other hard link (a resume rewrites it in place).
fn refuse_to_resume_into_foreign(partial: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = fs::symlink_metadata(partial).at(partial)?;
    let refuse = |why: &str| {
        Err(Error::NotReplaceable {
            path: partial.to_path_buf(),
            reason: format!("--resume continues only its own staging output, and this is {why}"),
        })
    };
    if meta.file_type().is_symlink() {
        return refuse("a link (resuming would write wherever it leads)");
    }
    if meta.is_file() && meta.nlink() > 1 {
        return refuse("a file with other hard links (resuming would rewrite them too)");
    }
    match foreign_description(partial) {
        None => Ok(()),
        Some(what) => refuse(&what),
    }
}

/// `Err(NotReplaceable)` when `OUT.report.json` exists and is not a pack report (a regular file
/// holding one): the report written at the end replaces only an earlier report, never a file of
/// someone else's, and never through a symlink.
fn refuse_foreign_report(out: &Path) -> Result<()> {
    let report = report_path(out);
    let Some(meta) = crate::file::entry_metadata(&report)? else {
        return Ok(());
    };
    let is_report = meta.is_file()
        && meta.len() <= 1 << 30
        && fs::read(&report)
            .ok()
            .is_some_and(|bytes| serde_json::from_slice::<PackSummary>(&bytes).is_ok());
    if is_report {
        return Ok(());
    }
    Err(Error::NotReplaceable {
        path: report,
        reason: "the pack report goes there, and it is not an earlier pack report; move it away \
                 or write the output somewhere else"
            .into(),
    })
}

/// True when something (even a dangling symlink) is at `path`.
fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// `Err(NotReplaceable)` unless `path` is an output an imagefeed writer made.
fn refuse_foreign(path: &Path) -> Result<()> {
    match foreign_description(path) {
        None => Ok(()),
        // Whether an HDF5 file is ours takes libhdf5 to tell: without it, say so instead of
        // calling the file foreign.
        Some(_) if !PackFormat::Hdf5.is_available() && crate::format::hdf5::has_signature(path) => {
            Err(crate::format::hdf5::feature_disabled(
                path,
                "replacing an HDF5 file",
            ))
        }
        Some(what) => Err(Error::NotReplaceable {
            path: path.to_path_buf(),
            reason: format!(
                "it is {what}; --force only replaces datasets pack-dataset wrote, and only when \
                 they hold nothing else. Move it away or write somewhere else"
            ),
        }),
    }
}

/// `None` when `path` is an output an imagefeed writer made ([`crate::format::is_own_output`]);
/// otherwise what it is, for the message that refuses it.
fn foreign_description(path: &Path) -> Option<String> {
    if crate::format::is_own_output(path) {
        return None;
    }
    Some(match fs::metadata(path) {
        Ok(m) if m.is_dir() => match crate::format::foreign_entry(path) {
            Some(name) if crate::format::dir_says_ours(path) => {
                format!("a directory holding {name:?}, which pack-dataset did not write")
            }
            _ => "a directory that is not an imagefeed dataset (no imagefeed manifest or magic)"
                .to_string(),
        },
        Ok(m) if m.is_file() => {
            "a file that is not an imagefeed dataset (no imagefeed magic)".to_string()
        }
        _ => "not an imagefeed dataset".to_string(),
    })
}

/// Refuses an output that would replace or delete a source: `out` (or `OUT.partial`) is one of
/// `sources`, or a directory that holds one.
pub(crate) fn refuse_source_as_output(out: &Path, sources: &[&Path]) -> Result<()> {
    let canonical = |p: &Path| fs::canonicalize(p).ok();
    for target in [out.to_path_buf(), partial_path(out)] {
        let Some(target) = canonical(&target) else {
            continue; // does not exist yet: it cannot hold anything
        };
        for source in sources {
            if let Some(source) = canonical(source)
                && source.starts_with(&target)
            {
                return Err(Error::NotReplaceable {
                    path: target.clone(),
                    reason: if source == target {
                        "it is the source being packed; write the output elsewhere".into()
                    } else {
                        format!(
                            "it holds the source being packed ({}); write the output elsewhere",
                            source.display()
                        )
                    },
                });
            }
        }
    }
    Ok(())
}

/// Moves the finished `partial` to `out`, replacing what is there, so that at every instant
/// `out` is either the old dataset or the new complete one, and syncs the directory so the
/// change survives a crash.
///
/// A file replaces a file with one `rename`, which is atomic. Where a directory is involved (a
/// records dataset), the two are swapped with `renameat2(RENAME_EXCHANGE)`, atomic too, and the
/// old one, now at `partial`, is deleted afterwards (marked, then manifest first: see
/// `format::remove_own_output`); a crash during that
/// deletion leaves the new dataset in place and the remains of the old one at `partial`, which no
/// reader accepts and the next `--force` run deletes. On a file system without
/// `RENAME_EXCHANGE` the old one is first renamed to `OUT.replaced`, then the new one into place.
pub fn publish(partial: &Path, out: &Path) -> Result<()> {
    // LMDB creates files 0600; a dataset is meant to be shared (readable by all, like cp).
    if partial.is_file() {
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(partial, fs::Permissions::from_mode(0o644)).at(partial)?;
    }
    let sync_parent = || -> Result<()> {
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::File::open(parent)
                .and_then(|d| d.sync_all())
                .at(parent)?;
        }
        Ok(())
    };
    let old = fs::symlink_metadata(out).ok();
    if old.is_some() {
        // Checked when the pack started, and again now: something may have been put there since.
        refuse_foreign(out)?;
    }
    let involves_a_directory = old.as_ref().is_some_and(|m| m.is_dir()) || partial.is_dir();
    if old.is_none() || !involves_a_directory {
        fs::rename(partial, out).at(out)?;
        return sync_parent();
    }
    match exchange(partial, out) {
        Ok(()) => {
            sync_parent()?;
            // The new dataset is in place; what is at `partial` now is the old one.
            crate::format::remove_own_output(partial)
        }
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::ENOSYS | libc::ENOTSUP)
            ) =>
        {
            let mut aside = out.as_os_str().to_owned();
            aside.push(".replaced");
            let aside = PathBuf::from(aside);
            fs::rename(out, &aside).at(out)?;
            fs::rename(partial, out).at(out)?;
            sync_parent()?;
            crate::format::remove_own_output(&aside)
        }
        Err(e) => Err(Error::io(out, e)),
    }
}

/// Swaps two paths atomically (Linux `renameat2` with `RENAME_EXCHANGE`).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt as _;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| std::io::Error::other("NUL in path"))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both paths are NUL-terminated strings that live across the call; renameat2 reads
    // them and touches no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> std::io::Result<()> {
    Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
}

/// `Err(Incomplete)` when `path` does not exist but `PATH.partial` does: a pack was interrupted,
/// and the message says how to finish it.
pub(crate) fn refuse_interrupted(path: &Path) -> Result<()> {
    if is_staging_name(path) {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            reason: "named like a pack's staging output (*.partial), which is never a dataset: \
                     it may hold part of one, or the old dataset of an interrupted --force \
                     replacement. Finish the pack with --resume, start over with --force, or \
                     rename it if you know it is complete"
                .into(),
        });
    }
    let partial = partial_path(path);
    let mut aside = path.as_os_str().to_owned();
    aside.push(".replaced");
    let aside = PathBuf::from(aside);
    if !exists(path) && exists(&aside) {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            reason: format!(
                "a replacement was interrupted: the old dataset is {} and the new one {}; \
                 rename the one you want to {}",
                aside.display(),
                partial.display(),
                path.display()
            ),
        });
    }
    if !path.exists() && partial.exists() {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            reason: format!(
                "only {} exists: the pack was interrupted; rerun it with --resume",
                partial.display()
            ),
        });
    }
    Ok(())
}

/// True when the staging directory `partial` was left by a run killed before its first progress
/// record (`progress_name`) was renamed into place: it holds nothing but uncommitted `.tmp`
/// files of our writers, so nothing was committed and `--resume` starts afresh in it. Call with
/// the staging lock held, then [`clear_uncommitted`].
pub(crate) fn nothing_committed(partial: &Path, progress_name: &str) -> bool {
    !partial.join(progress_name).exists()
        && crate::format::foreign_entry(partial).is_none()
        && fs::read_dir(partial).is_ok_and(|entries| {
            entries.into_iter().all(|e| {
                e.is_ok_and(|e| {
                    e.file_type().is_ok_and(|t| t.is_file())
                        && e.file_name().to_string_lossy().ends_with(".tmp")
                })
            })
        })
}

/// Removes the uncommitted `.tmp` files of a staging directory [`nothing_committed`] accepted.
pub(crate) fn clear_uncommitted(partial: &Path) -> Result<()> {
    for entry in fs::read_dir(partial).at(partial)? {
        let path = entry.at(partial)?.path();
        fs::remove_file(&path).at(&path)?;
    }
    Ok(())
}

/// Reads the JSON progress record `name` that a staged writer keeps in `partial`.
pub(crate) fn read_staged_progress<T: for<'de> Deserialize<'de>>(
    partial: &Path,
    name: &str,
    what: &str,
) -> Result<T> {
    let path = partial.join(name);
    let text = fs::read_to_string(&path).map_err(|e| Error::ResumeMismatch {
        path: partial.to_path_buf(),
        reason: format!("not a partial {what} (no readable {name}: {e})"),
    })?;
    serde_json::from_str(&text).map_err(|e| Error::ResumeMismatch {
        path,
        reason: format!("malformed: {e}"),
    })
}

/// Cuts a staged file back to the `committed` length its progress record gives, dropping what
/// a chunk in flight wrote before the run stopped; refuses a file shorter than that.
pub(crate) fn cut_to_committed(file: &fs::File, path: &Path, committed: u64) -> Result<()> {
    let have = file.metadata().at(path)?.len();
    if have < committed {
        return Err(Error::ResumeMismatch {
            path: path.to_path_buf(),
            reason: format!("{have} bytes, but {committed} were committed: the file was cut"),
        });
    }
    file.set_len(committed).at(path)
}

/// Replaces `path` with `bytes` atomically: writes `PATH.tmp`, syncs it, renames it over `path`
/// ([`crate::file::replace_via`]: never through a link).
pub(crate) fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    crate::file::replace_via(Path::new(&tmp), path, bytes, true)
}

/// Bytes a dataset takes: a file's length, or the total of the files in a directory (record
/// shards, indexes and manifest).
pub fn disk_bytes(path: &Path) -> u64 {
    match fs::metadata(path) {
        Ok(meta) if meta.is_dir() => fs::read_dir(path)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0),
        Ok(meta) => meta.len(),
        Err(_) => 0,
    }
}

/// SHA-256 of the listing (key, label, size of each file): changes when the tree does.
pub fn source_fingerprint(folder: &ImageFolder) -> Result<String> {
    let mut hasher = Sha256::new();
    for (index, entry) in folder.entries().iter().enumerate() {
        let path = folder.file_path(index);
        // A file that vanished hashes as size u64::MAX; reading it will reject it with the reason.
        let size = fs::metadata(&path).map(|m| m.len()).unwrap_or(u64::MAX);
        hasher.update(entry.key.as_bytes());
        hasher.update([0]);
        hasher.update(entry.label.to_le_bytes());
        hasher.update(size.to_le_bytes());
    }
    Ok(hex(&hasher.finalize()))
}

/// What a pack reads: the files of an ImageFolder tree, or the records of any dataset.
enum Source<'a> {
    Folder(&'a ImageFolder),
    Records(&'a dyn Dataset),
    /// The parts of a split conversion, in part order; their payloads were checked when the
    /// parts were packed and are copied as they are.
    Joined(&'a JoinedParts),
}

impl Source<'_> {
    /// The records of a dataset-backed source.
    fn dataset(&self) -> Option<&dyn Dataset> {
        match self {
            Source::Folder(_) => None,
            Source::Records(d) => Some(*d),
            Source::Joined(j) => Some(*j),
        }
    }

    fn len(&self) -> usize {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.len(),
            (_, Some(d)) => d.len(),
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }

    fn classes(&self) -> &[String] {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.classes(),
            (_, Some(d)) => d.classes(),
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }

    fn payload(&self) -> PayloadKind {
        self.dataset()
            .map_or(PayloadKind::Encoded, |d| d.info().payload)
    }

    fn resized_short_side(&self) -> Option<u32> {
        self.dataset().and_then(|d| d.info().resized_short_side)
    }

    /// What changes when the source does: the listing for a tree; path, size, modification
    /// time and sample count for a dataset file.
    fn fingerprint(&self) -> Result<String> {
        match self {
            Source::Folder(f) => source_fingerprint(f),
            Source::Joined(j) => {
                let mut hasher = Sha256::new();
                for part in &j.parts {
                    hasher.update(Source::Records(part.as_ref()).fingerprint()?.as_bytes());
                }
                Ok(hex(&hasher.finalize()))
            }
            Source::Records(d) => {
                let meta = fs::metadata(d.path()).at(d.path())?;
                let mut hasher = Sha256::new();
                hasher.update(
                    fs::canonicalize(d.path())
                        .at(d.path())?
                        .as_os_str()
                        .as_encoded_bytes(),
                );
                hasher.update(meta.len().to_le_bytes());
                let mtime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                hasher.update(mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
                hasher.update((d.len() as u64).to_le_bytes());
                Ok(hex(&hasher.finalize()))
            }
        }
    }

    /// The files or directories the items are read from.
    fn paths(&self) -> Vec<&Path> {
        match self {
            Source::Folder(f) => vec![f.path()],
            Source::Records(d) => vec![d.path()],
            Source::Joined(j) => j.parts.iter().map(|p| p.path()).collect(),
        }
    }

    /// Where a rejected item lives, for strict mode's error.
    fn locate(&self, index: usize, key: &str) -> PathBuf {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.file_path(index),
            (_, Some(d)) => {
                PathBuf::from(format!("{}: record {index} ({key})", d.path().display()))
            }
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }
}

/// One fetched item: (key, label, payload to store), or (key, rejection reason).
type Fetched = std::result::Result<(String, u32, Vec<u8>), (String, String)>;

/// Per-thread state for checking and transforming files.
struct PackWorker {
    reader: Option<Box<dyn RecordReader>>,
    decoder: Decoder,
    rgb: Vec<u8>,
    resized: Vec<u8>,
    resizer: Option<RgbResizer>,
    compressor: Option<turbojpeg::Compressor>,
}

impl PackWorker {
    fn new(max_pixels: u64) -> Self {
        PackWorker {
            reader: None,
            decoder: Decoder::new().with_max_pixels(max_pixels),
            rgb: Vec::new(),
            resized: Vec::new(),
            resizer: None,
            compressor: None,
        }
    }

    /// Fetches source item `index`: its key, label and bytes, or (key, reason) when it cannot
    /// be read.
    fn fetch(&mut self, source: &Source<'_>, index: usize) -> Fetched {
        match source {
            Source::Folder(folder) => {
                let entry = &folder.entries()[index];
                let mut bytes = Vec::new();
                match folder.read_file(index, &mut bytes) {
                    Ok(()) => Ok((entry.key.clone(), entry.label, bytes)),
                    Err(Error::RefusedFile { reason, .. }) => Err((entry.key.clone(), reason)),
                    Err(e) => Err((entry.key.clone(), format!("cannot read: {e}"))),
                }
            }
            Source::Records(_) | Source::Joined(_) => {
                let dataset = source.dataset().expect("a dataset-backed source");
                let reader = match &mut self.reader {
                    Some(reader) => reader,
                    slot @ None => match dataset.open_reader() {
                        Ok(reader) => slot.insert(reader),
                        Err(e) => {
                            return Err((index.to_string(), format!("cannot open a reader: {e}")));
                        }
                    },
                };
                match reader.read(index) {
                    Ok(r) => Ok((r.key.to_string(), r.label, r.payload.to_vec())),
                    Err(e) => Err((index.to_string(), e.to_string())),
                }
            }
        }
    }

    /// Fetches and checks one item; returns what to store, or the rejection.
    fn prepare(&mut self, source: &Source<'_>, index: usize, options: &PackOptions) -> Fetched {
        let (key, label, bytes) = self.fetch(source, index)?;
        if key.contains('\0') {
            // A key is a path relative to the source root, which cannot hold a NUL; HDF5's
            // strings cannot store one either.
            return Err((key.replace('\0', "\\0"), "its key holds a NUL byte".into()));
        }
        if let Source::Joined(_) = source {
            return Ok((key, label, bytes));
        }
        match self.prepare_bytes(bytes, options) {
            Ok(payload) => Ok((key, label, payload)),
            Err(reason) => Err((key, reason)),
        }
    }

    /// Checks (and with --raw/--resize, transforms) one image's bytes.
    fn prepare_bytes(
        &mut self,
        bytes: Vec<u8>,
        options: &PackOptions,
    ) -> std::result::Result<Vec<u8>, String> {
        if !options.raw && options.resize_short_side.is_none() {
            // Stored as is: only check that it decodes (the cheap way).
            self.decoder.validate(&bytes).map_err(|e| e.to_string())?;
            return Ok(bytes);
        }
        let header = self
            .decoder
            .decode_rgb(&bytes, &mut self.rgb)
            .map_err(|e| e.to_string())?;
        let (w, h) = (header.width, header.height);
        let target = options
            .resize_short_side
            .filter(|&s| w.min(h) > s)
            .map(|s| short_side_size(w, h, s));
        let (pixels, pw, ph) = match target {
            Some((tw, th)) => {
                self.resized.resize(tw as usize * th as usize * 3, 0);
                self.resizer.get_or_insert_with(RgbResizer::new).resize(
                    &self.rgb,
                    w,
                    h,
                    &mut self.resized,
                    tw,
                    th,
                );
                (&self.resized, tw, th)
            }
            None if !options.raw => return Ok(bytes),
            None => (&self.rgb, w, h),
        };
        if options.raw {
            return Ok(RawImage::encode(pw, ph, pixels));
        }
        let compressor = match &mut self.compressor {
            Some(c) => c,
            slot @ None => {
                let mut c =
                    turbojpeg::Compressor::new().map_err(|e| format!("JPEG encoder: {e}"))?;
                c.set_quality(options.quality as i32)
                    .map_err(|e| format!("JPEG encoder: {e}"))?;
                c.set_subsamp(turbojpeg::Subsamp::Sub2x2)
                    .map_err(|e| format!("JPEG encoder: {e}"))?;
                slot.insert(c)
            }
        };
        let image = turbojpeg::Image {
            pixels: &pixels[..],
            width: pw as usize,
            pitch: pw as usize * 3,
            height: ph as usize,
            format: turbojpeg::PixelFormat::RGB,
        };
        compressor
            .compress_to_vec(image)
            .map_err(|e| format!("JPEG encoder: {e}"))
    }
}

/// Packs the ImageFolder tree at `source` into `out`.
///
/// Returns the summary (also written to [`report_path`]`(out)`). Rejected files are listed there;
/// with `options.strict` the first one is an [`Error::Rejected`] and no output remains.
pub fn pack_image_folder(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    let folder = ImageFolder::open(source)?;
    pack_source(
        &Source::Folder(&folder),
        source,
        out,
        format,
        options,
        observer,
    )
}

/// Rewrites any dataset this library reads (an imagefeed LMDB, a Python folder2lmdb LMDB, an
/// ImageFolder tree) into `out`, with the same checks, options, crash safety and report as
/// [`pack_image_folder`]. Records keep their keys, labels and order; classes are the source's.
pub fn convert(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    convert_with(
        source,
        out,
        format,
        options,
        &crate::format::OpenOptions::default(),
        observer,
    )
}

/// [`convert`], with options for reading a source other tools wrote (h5py dataset names,
/// TFRecord label base).
pub fn convert_with(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    input: &crate::format::OpenOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    if source.is_dir()
        && !source.join("data.mdb").is_file()
        && !crate::format::records::looks_like_records(source)
    {
        return pack_image_folder(source, out, format, options, observer);
    }
    let dataset = crate::format::open_with(source, input)?;
    pack_source(
        &Source::Records(dataset.as_ref()),
        source,
        out,
        format,
        options,
        observer,
    )
}

fn pack_source(
    items: &Source<'_>,
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    let started = Instant::now();
    options.validate()?;
    let part = match options.part {
        None => None,
        Some((index, count)) => {
            if count == 0 || index >= count {
                return Err(Error::Options(format!(
                    "--part-index {index} must be below --num-parts {count}"
                )));
            }
            Some(PartInfo {
                index,
                count,
                source_fingerprint: items.fingerprint()?,
                source_items: items.len(),
            })
        }
    };
    let range = match &part {
        Some(p) => PartInfo::range(items.len(), p.index, p.count),
        None => 0..items.len(),
    };
    if let Some(p) = part.as_ref().filter(|_| range.is_empty()) {
        return Err(Error::Options(format!(
            "--part-index {} of --num-parts {} holds none of the {} source files; split into \
             at most {} parts",
            p.index,
            p.count,
            items.len(),
            items.len().max(1)
        )));
    }
    refuse_source_as_output(out, &items.paths())?;
    if let Some(class) = items.classes().iter().find(|c| c.contains('\0')) {
        return Err(Error::not_a_dataset(
            source,
            format!("class name {class:?} holds a NUL byte, which no output can store"),
        ));
    }
    let source_raw = items.payload() == PayloadKind::RawRgb8;
    let plan = PackPlan {
        source_fingerprint: items.fingerprint()?,
        num_sources: range.len(),
        classes: items.classes().to_vec(),
        payload: if options.raw || (source_raw && options.resize_short_side.is_none()) {
            PayloadKind::RawRgb8
        } else {
            PayloadKind::Encoded
        },
        resize_short_side: items.resized_short_side().or(options.resize_short_side),
        quality: options.quality,
        part,
    };
    let (sink, mut progress) = start_writer(format, out, &plan, options)?;
    let resumed_from = progress.sources_done;
    observer.started(range.len(), resumed_from);

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(options.threads.unwrap_or(0))
        .thread_name(|i| format!("pack-{i}"))
        .build()
        .map_err(|e| Error::io(source, std::io::Error::other(e)))?;
    let todo: Vec<usize> = (range.start + resumed_from..range.end).collect();
    let chunk_size = options.chunk_size.max(1);
    let (sender, receiver) = crossbeam_channel::bounded::<Vec<Fetched>>(1);

    // A producer thread checks chunk k+1 on the pool while this thread commits chunk k.
    let mut sink = Some(sink);
    let outcome = std::thread::scope(|scope| -> Result<()> {
        let pool = &pool;
        let todo = &todo;
        scope.spawn(move || {
            for chunk in todo.chunks(chunk_size) {
                let results: Vec<_> = pool.install(|| {
                    chunk
                        .par_iter()
                        .map_init(
                            || PackWorker::new(options.max_pixels),
                            |worker, &index| worker.prepare(items, index, options),
                        )
                        .collect()
                });
                if sender.send(results).is_err() {
                    break; // the committing side stopped (error or strict rejection)
                }
            }
        });
        let result = (|| {
            for (chunk, results) in todo.chunks(chunk_size).zip(receiver.iter()) {
                let mut records = Vec::with_capacity(chunk.len());
                for (&index, result) in chunk.iter().zip(&results) {
                    match result {
                        Ok((key, label, payload)) => {
                            records.push(PackedRecord {
                                label: *label,
                                key,
                                payload,
                            });
                            progress.payload_bytes += payload.len() as u64;
                        }
                        Err((key, reason)) => {
                            if options.strict {
                                return Err(Error::Rejected {
                                    path: items.locate(index, key),
                                    reason: reason.clone(),
                                });
                            }
                            let rejection = Rejection {
                                key: key.clone(),
                                reason: reason.clone(),
                            };
                            observer.rejected(&rejection);
                            progress.rejected.push(rejection);
                        }
                    }
                }
                progress.samples_written += records.len();
                progress.sources_done += chunk.len();
                sink.as_mut()
                    .expect("sink lives until finish")
                    .write_chunk(&records, &progress)?;
                observer.advanced(progress.sources_done, progress.payload_bytes);
                if observer.should_stop() && progress.sources_done < range.len() {
                    return Err(Error::Interrupted {
                        path: out.to_path_buf(),
                        reason: format!(
                            "stopped after {} of {} files; the part done is kept in {}: \
                             rerun with --resume to finish",
                            progress.sources_done,
                            range.len(),
                            partial_path(out).display()
                        ),
                    });
                }
            }
            Ok(())
        })();
        drop(receiver); // unblocks the producer if we stopped early
        result
    });
    let sink = sink.take().expect("sink not consumed yet");
    if let Err(err) = outcome {
        if options.strict {
            sink.abandon();
        }
        return Err(err);
    }
    if progress.samples_written == 0 {
        sink.abandon();
        return Err(Error::BadImageFolder {
            path: source.to_path_buf(),
            reason: format!("all {} files were rejected; nothing to pack", range.len()),
        });
    }
    let mut info = plan.dataset_info(format.kind(), progress.samples_written);
    // A joined dataset counts what its parts rejected too.
    let earlier = match items {
        Source::Joined(j) => j.info.rejected_at_pack.unwrap_or(0),
        Source::Folder(_) | Source::Records(_) => 0,
    };
    info.rejected_at_pack = Some(progress.rejected.len() + earlier);
    sink.finish(&info, &progress)?;

    let seconds = started.elapsed().as_secs_f64();
    let processed = range.len() - resumed_from;
    let summary = PackSummary {
        source: source.to_path_buf(),
        output: out.to_path_buf(),
        format: format.kind().name().into(),
        samples: progress.samples_written,
        classes: plan.classes.len(),
        payload_bytes: progress.payload_bytes,
        file_bytes: disk_bytes(out),
        rejected: progress.rejected,
        skipped_non_images: match items {
            Source::Folder(f) => f.skipped_files(),
            Source::Records(_) | Source::Joined(_) => 0,
        },
        resumed_from,
        notices: items
            .dataset()
            .map(|d| d.notices().to_vec())
            .unwrap_or_default(),
        seconds,
        images_per_sec: processed as f64 / seconds.max(1e-9),
    };
    // Replaced with a rename: an earlier report's path is never followed or written through.
    write_file_atomically(
        &report_path(out),
        &serde_json::to_vec_pretty(&summary).expect("summary serializes"),
    )?;
    Ok(summary)
}

/// Starts the writer of `format` for `out` (with `options.mode`, `lmdb_map_size`, `shard_bytes`
/// and `label_base`); returns it with the progress already committed (non-zero when resuming).
/// HDF5 without the `hdf5` feature is [`Error::FeatureDisabled`].
pub fn start_writer(
    format: PackFormat,
    out: &Path,
    plan: &PackPlan,
    options: &PackOptions,
) -> Result<(Box<dyn PackSink>, PackProgress)> {
    Ok(match format {
        PackFormat::Lmdb => {
            let (writer, progress) =
                LmdbWriter::start(out, plan, options.mode, options.lmdb_map_size)?;
            (Box::new(writer), progress)
        }
        PackFormat::Hdf5 => crate::format::hdf5::start_writer(out, plan, options.mode)?,
        PackFormat::Records => {
            let (writer, progress) = RecordsWriter::start(
                out,
                plan,
                options.mode,
                options.shard_bytes,
                options.label_base,
            )?;
            (Box::new(writer), progress)
        }
    })
}

/// The parts of a split conversion, checked to belong together and read as one dataset.
pub struct JoinedParts {
    parts: Vec<std::sync::Arc<dyn Dataset>>,
    /// Index of each part's first record; a final entry holds the total.
    starts: Vec<usize>,
    info: DatasetInfo,
    path: PathBuf,
    notices: Vec<String>,
}

impl JoinedParts {
    /// Opens `paths` (in any order) and checks that they are all the parts of one split
    /// conversion: each part exactly once, the same source fingerprint, classes and payload.
    pub fn open(paths: &[PathBuf]) -> Result<JoinedParts> {
        let first = paths.first().ok_or_else(|| {
            Error::Options("join needs the parts of a split conversion; none were given".into())
        })?;
        let mut parts: Vec<(PartInfo, std::sync::Arc<dyn Dataset>)> = Vec::new();
        for path in paths {
            let dataset = crate::format::open(path)?;
            let part = dataset.info().part.clone().ok_or_else(|| {
                Error::not_a_dataset(
                    path,
                    "not a part of a split conversion (packed without --num-parts/--part-index)",
                )
            })?;
            parts.push((part, dataset));
        }
        parts.sort_by_key(|(part, _)| part.index);
        let (reference, reference_set) = (&parts[0].0, &parts[0].1);
        let mismatch = |path: &Path, what: &str| {
            Err(Error::not_a_dataset(
                path,
                format!(
                    "{what} differs from {}'s: parts of different conversions",
                    reference_set.path().display()
                ),
            ))
        };
        for (part, dataset) in &parts[1..] {
            let path = dataset.path();
            if part.source_fingerprint != reference.source_fingerprint
                || part.count != reference.count
            {
                return mismatch(path, "the source listing or the number of parts");
            }
            if dataset.classes() != reference_set.classes() {
                return mismatch(path, "the class list");
            }
            if dataset.info().payload != reference_set.info().payload
                || dataset.info().resized_short_side != reference_set.info().resized_short_side
            {
                return mismatch(path, "the payload kind (--raw/--resize)");
            }
        }
        let have: Vec<usize> = parts.iter().map(|(p, _)| p.index).collect();
        let want: Vec<usize> = (0..reference.count).collect();
        if have != want {
            let missing: Vec<String> = want
                .iter()
                .filter(|i| !have.contains(i))
                .map(|i| i.to_string())
                .collect();
            let dupes: Vec<String> = have
                .windows(2)
                .filter(|w| w[0] == w[1])
                .map(|w| w[0].to_string())
                .collect();
            return Err(Error::Options(format!(
                "join needs parts 0..{} exactly once; missing: [{}], given twice: [{}]",
                reference.count,
                missing.join(", "),
                dupes.join(", ")
            )));
        }
        let mut starts = vec![0];
        for (_, dataset) in &parts {
            starts.push(starts.last().expect("non-empty") + dataset.len());
        }
        let mut info = reference_set.info().clone();
        info.num_samples = *starts.last().expect("non-empty");
        info.part = None;
        info.rejected_at_pack = Some(
            parts
                .iter()
                .map(|(_, d)| d.info().rejected_at_pack.unwrap_or(0))
                .sum(),
        );
        let notices = parts
            .iter()
            .flat_map(|(_, d)| d.notices().iter().cloned())
            .collect();
        Ok(JoinedParts {
            notices,
            parts: parts.into_iter().map(|(_, d)| d).collect(),
            starts,
            info,
            path: first.clone(),
        })
    }
}

impl Dataset for JoinedParts {
    fn info(&self) -> &DatasetInfo {
        &self.info
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn notices(&self) -> &[String] {
        &self.notices
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(JoinedReader {
            readers: self
                .parts
                .iter()
                .map(|p| crate::dataset::LazyReader::new(std::sync::Arc::clone(p)))
                .collect(),
            starts: self.starts.clone(),
        }))
    }
}

struct JoinedReader {
    readers: Vec<crate::dataset::LazyReader>,
    starts: Vec<usize>,
}

impl RecordReader for JoinedReader {
    fn read(&mut self, index: usize) -> Result<crate::dataset::Record<'_>> {
        let part = self.starts.partition_point(|&s| s <= index) - 1;
        let mut record = self.readers[part].read(index - self.starts[part])?;
        record.index = index;
        Ok(record)
    }
}

/// Joins the parts of a split conversion (`--num-parts N --part-index i` runs, in any order)
/// into one dataset at `out`, identical to what an unsplit conversion would have written.
/// Payloads are copied without being decoded again (each part checked its own when packed);
/// `options` supplies the output side (resume/force, threads, shard size, label base).
pub fn join(
    parts: &[PathBuf],
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    let joined = JoinedParts::open(parts)?;
    if options.raw || options.resize_short_side.is_some() || options.part.is_some() {
        return Err(Error::Options(
            "join copies the parts as they are: --raw, --resize and --part-index do not apply"
                .into(),
        ));
    }
    pack_source(
        &Source::Joined(&joined),
        &joined.path.clone(),
        out,
        format,
        options,
        observer,
    )
}
