//! The library's error type.
//!
//! Every variant that input data or the file system can cause names the file (and, inside a
//! packed dataset, the record) and the reason, so a user can find what is broken from the message
//! alone. Bugs in the caller (an index past the end, a buffer of the wrong size) panic instead.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::decode::DecodeError;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong reading, writing or checking a dataset.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O operation on `path` failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// LMDB reported an error for the environment at `path`.
    #[error("{}: LMDB: {source}", path.display())]
    Lmdb {
        /// The LMDB file.
        path: PathBuf,
        /// The underlying error.
        source: heed::Error,
    },

    /// The HDF5 library reported an error for the file at `path` (feature `hdf5`).
    #[cfg(feature = "hdf5")]
    #[error("{}: HDF5: {doing}: {source}", path.display())]
    Hdf5 {
        /// The HDF5 file.
        path: PathBuf,
        /// What we were doing ("writing offsets").
        doing: String,
        /// What the library said.
        source: Hdf5Message,
    },

    /// `path` needs a part of imagefeed this build was compiled without (a Cargo feature, such as
    /// `hdf5`).
    #[error(
        "{}: {what} needs imagefeed's `{feature}` feature, which this build was compiled without",
        path.display()
    )]
    FeatureDisabled {
        /// The path that was opened or written.
        path: PathBuf,
        /// What was asked for ("reading an HDF5 file").
        what: &'static str,
        /// The Cargo feature that provides it.
        feature: &'static str,
    },

    /// `path` is not a dataset this library can read, or its metadata is malformed.
    #[error("{}: not a readable dataset: {reason}", path.display())]
    NotADataset {
        /// The path that was opened.
        path: PathBuf,
        /// Why it was refused.
        reason: String,
    },

    /// A dataset's file changed on disk, or its object in storage, after the dataset was
    /// opened (replaced, rewritten): a reader opened since would read other records than the
    /// ones indexed at open. Open the dataset again.
    #[error("{}: changed since the dataset was opened ({change}); open it again", path.display())]
    FileChanged {
        /// The file.
        path: PathBuf,
        /// What changed.
        change: String,
    },

    /// A URL that names nothing imagefeed can read or write: an unknown scheme, no bucket, or an
    /// object that is not what its listing said.
    #[error("{url}: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Object storage refused or failed a request (after its retries): the URL, what was being
    /// done, and the store's error (status, attempts) as the source.
    #[cfg(feature = "remote")]
    #[error("{url}: {doing}: {source}")]
    Remote {
        /// The object or prefix.
        url: String,
        /// What was being done ("listing", "downloading").
        doing: String,
        /// What the store said.
        source: object_store::Error,
    },

    /// The shard files named by `path` (a directory, a pattern, a list) are not one whole set:
    /// several sets in one directory, members missing, or names that contradict each other.
    #[error("{}: {problem}", path.display())]
    ShardSet {
        /// The directory, pattern or first file of the list.
        path: PathBuf,
        /// What is wrong, with what to do about it.
        problem: ShardSetProblem,
    },

    /// The dataset at `path` stores its records in a way this build cannot read (a compression
    /// filter libhdf5 has no plugin for, a compression the reader does not undo): an error at
    /// open, never a dataset whose every record is bad.
    #[error("{}: {what} cannot be read: {remedy}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What is stored that way ("dataset \"images\" is compressed with the blosc filter").
        what: String,
        /// Why this build cannot read it, and what to do.
        remedy: String,
    },

    /// The cache directory has no room for an entry: the byte limit, or the file system's free
    /// space less its reserve, cannot fit `needed` more bytes even after evicting every entry
    /// no reader holds ([`crate::cache`]).
    #[error(
        "{}: no room in the cache for {needed} more bytes ({}{}; {in_use} bytes are held by readers): set IMAGEFEED_CACHE_DIR to a larger disk or raise IMAGEFEED_CACHE_LIMIT",
        dir.display(),
        limit.map_or("no limit".to_string(), |l| format!("limit {l} bytes")),
        free.map_or(String::new(), |f| format!(", {f} bytes free on its disk beyond the reserve"))
    )]
    CacheFull {
        /// The cache directory.
        dir: PathBuf,
        /// Bytes the new entry needs.
        needed: u64,
        /// The cache's byte limit.
        limit: Option<u64>,
        /// Free bytes on its file system beyond the reserve, when known.
        free: Option<u64>,
        /// Bytes of entries that readers hold, which cannot be evicted.
        in_use: u64,
    },

    /// The dataset at `path` was never finished (an interrupted or failed pack).
    #[error("{}: incomplete dataset: {reason}", path.display())]
    Incomplete {
        /// The path that was opened.
        path: PathBuf,
        /// What is missing, and how to finish it.
        reason: String,
    },

    /// A record inside a packed dataset is malformed.
    #[error("{}: record {index} ({key}): {reason}", path.display())]
    CorruptRecord {
        /// The dataset file.
        path: PathBuf,
        /// The record's index.
        index: usize,
        /// The record's key (relative path), or `#index` (or `shard#record`) when the key
        /// itself is unreadable.
        key: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A sample could not be decoded.
    #[error("{}: {source}", location)]
    Decode {
        /// The file path, or `dataset: record N (key)` for a packed sample.
        location: String,
        /// The decoder's reason.
        source: DecodeError,
    },

    /// An ImageFolder tree is unusable as a whole (no classes, an empty class, ...).
    #[error("{}: {reason}", path.display())]
    BadImageFolder {
        /// The root of the tree.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// The output already exists and overwriting was not asked for.
    #[error("{}: already exists ({hint})", path.display())]
    AlreadyExists {
        /// The output path.
        path: PathBuf,
        /// What to do about it.
        hint: String,
    },

    /// `--force` was asked to replace something that is not an imagefeed output (a source tree,
    /// another tool's file, a directory of other files), or the source itself; or a path a
    /// writer creates beside its output (the pack report, the LMDB lock file) holds something
    /// that is not ours to overwrite.
    #[error("{}: will not replace it: {reason}", path.display())]
    NotReplaceable {
        /// The existing path.
        path: PathBuf,
        /// What it is, and what to do instead.
        reason: String,
    },

    /// `--resume` found a partial output that does not belong to this source or these options.
    #[error("{}: cannot resume: {reason}", path.display())]
    ResumeMismatch {
        /// The partial output.
        path: PathBuf,
        /// What differs.
        reason: String,
    },

    /// A sample failed under the `error` bad-sample policy.
    #[error("sample {index} ({key}): {reason}")]
    BadSample {
        /// Dataset index.
        index: usize,
        /// Record key, or `#index` when it could not be read.
        key: String,
        /// What kind of failure it was.
        kind: BadSampleKind,
        /// Why it failed.
        reason: String,
    },

    /// More bad samples than `max_bad` allows.
    #[error(
        "{count} bad samples after {seen} samples exceed the limit ({limit}); last: sample {index} ({key}): {reason}"
    )]
    TooManyBadSamples {
        /// Bad samples so far.
        count: u64,
        /// Samples delivered or dropped so far.
        seen: u64,
        /// The limit, as configured.
        limit: String,
        /// The last bad sample's index.
        index: usize,
        /// Its key.
        key: String,
        /// Its kind of failure.
        kind: BadSampleKind,
        /// Its reason.
        reason: String,
    },

    /// Images of different sizes in one batch with no resizing transform.
    #[error(
        "images of different sizes in one batch with no resizing transform: sample {first_index} ({first_key}) is {}x{} but sample {index} ({key}) is {}x{}; add a Resize/crop transform",
        first_size.0, first_size.1, size.0, size.1
    )]
    ShapeMismatch {
        /// The sample that fixed the batch's size.
        first_index: usize,
        /// Its key.
        first_key: String,
        /// Its size (width, height).
        first_size: (u32, u32),
        /// The sample that differs.
        index: usize,
        /// Its key.
        key: String,
        /// Its size (width, height).
        size: (u32, u32),
    },

    /// Settings that cannot work, named: a loader's (a batch size of zero, a transform that
    /// cannot run), a pack's or a conversion's (a thread count of zero, a class count beyond
    /// [`MAX_CLASSES`](crate::dataset::MAX_CLASSES), no input given), an environment
    /// variable's value.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// Memory for a batch could not be had: the allocator said no (the machine is out of
    /// memory, or an address-space limit such as `ulimit -v` was reached). The process goes on.
    #[error(
        "could not allocate {bytes} bytes for {what}: out of memory or over an address-space \
         limit (ulimit -v); lower the batch size, the output size or the prefetch depth"
    )]
    OutOfMemory {
        /// The bytes asked for.
        bytes: u64,
        /// What they were for ("a batch").
        what: String,
    },

    /// The epoch was cancelled (dropped, or stopped from Python by Ctrl-C) while this batch was
    /// being built. Nothing is wrong with the data; the batch is simply not delivered.
    #[error("the epoch was cancelled")]
    Cancelled,

    /// Code that must not panic did; the panic was caught and is reported here instead of
    /// unwinding through the caller (a bug in imagefeed or in a dependency: please report it).
    #[error("{what} panicked: {message}")]
    Panicked {
        /// What was running ("a worker building batch 7", "the pack").
        what: String,
        /// The panic's message.
        message: String,
    },

    /// The loader's worker threads are gone, so no further batch can be built.
    #[error("the loader's worker threads have stopped")]
    WorkersStopped,

    /// A loader worker thread could not be started (the process is out of threads or memory).
    #[error("cannot start a loader worker thread: {source}")]
    ThreadSpawn {
        /// What the OS said.
        source: io::Error,
    },

    /// A saved [`LoaderState`](crate::loader::LoaderState) does not fit the loader asked to
    /// resume it: one of the settings that decide the stream, or the dataset, differs.
    #[error(
        "cannot resume: the state was saved with {setting} {saved}, but this loader has {setting} {current}; resuming would give a different stream"
    )]
    StateMismatch {
        /// The setting that differs (`seed`, `batch_size`, `shuffle`, `drop_last`, `uneven`,
        /// `dataset`, ...).
        setting: &'static str,
        /// Its value in the state.
        saved: String,
        /// Its value in this loader.
        current: String,
    },

    /// A file was not read: it is not a regular file (a FIFO, a device, a directory), or it is
    /// far longer than an image of its kind can be.
    #[error("{}: refused: {reason}", path.display())]
    RefusedFile {
        /// The file.
        path: PathBuf,
        /// What it is, and why it was not read.
        reason: String,
    },

    /// Strict packing stopped at the first file that is not a usable image.
    #[error("{}: rejected in strict mode: {reason}", path.display())]
    Rejected {
        /// The source file.
        path: PathBuf,
        /// Why it was rejected.
        reason: String,
    },

    /// A pack was stopped on request ([`PackObserver::should_stop`](crate::pack::PackObserver::should_stop)):
    /// what was committed is kept for a resume.
    #[error("{}: interrupted: {reason}", path.display())]
    Interrupted {
        /// The output path.
        path: PathBuf,
        /// How far it got, and how to finish.
        reason: String,
    },

    /// No usable CUDA driver or device, or a CUDA call failed (the GPU feed). When a call
    /// failed, the driver's (or cuBLAS's, NVRTC's) error is the `source`.
    #[error("CUDA: {doing}{}", cuda_cause(.source))]
    Cuda {
        /// What was being done ("copying a batch to the device"), or why CUDA cannot be used.
        doing: String,
        /// The library's error, when a call failed.
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
}

/// `": {source}"` for an [`Error::Cuda`] with a library error, else nothing.
fn cuda_cause(source: &Option<Box<dyn std::error::Error + Send + Sync + 'static>>) -> String {
    source
        .as_ref()
        .map(|e| format!(": {e}"))
        .unwrap_or_default()
}

/// The message of a caught panic's payload (`panic!` with a literal or a formatted string),
/// for [`Error::Panicked`].
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message")
        .to_string()
}

impl Error {
    /// Whether this error from reading one record is the whole dataset's rather than the
    /// record's: its file or object changed since it was opened (replaced, rewritten, cut
    /// short), or the shard cache has no room for it. Every later record would fail the same
    /// way or read another version's bytes, so a loader fails the batch and a pack stops,
    /// where a record's own error is a bad sample or a rejection.
    pub fn is_dataset_wide(&self) -> bool {
        matches!(self, Error::FileChanged { .. } | Error::CacheFull { .. })
    }

    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl AsRef<Path>, source: io::Error) -> Self {
        Error::Io {
            path: path.as_ref().to_path_buf(),
            source,
        }
    }

    /// The error liblmdb (through heed) reported for the file at `path`: an I/O error is
    /// [`Error::Io`], as any other format's (a read-only or full file system is not a problem
    /// of the LMDB file; a hostile try met Python's `DataError` for LMDB where HDF5 and record
    /// shards raised `FileError`, an `OSError`); the rest are [`Error::Lmdb`].
    pub(crate) fn lmdb(path: impl AsRef<Path>, source: heed::Error) -> Self {
        match source {
            heed::Error::Io(source) => Error::Io {
                path: path.as_ref().to_path_buf(),
                source,
            },
            source => Error::Lmdb {
                path: path.as_ref().to_path_buf(),
                source,
            },
        }
    }

    /// [`Error::Remote`] for a failed request on `url`.
    #[cfg(feature = "remote")]
    pub(crate) fn remote(url: impl ToString, doing: &str, source: object_store::Error) -> Self {
        Error::Remote {
            url: url.to_string(),
            doing: doing.into(),
            source,
        }
    }

    /// [`Error::Hdf5`] from the library's message, already text (see [`Hdf5Message`]).
    #[cfg(feature = "hdf5")]
    pub(crate) fn hdf5(path: impl AsRef<Path>, doing: &str, message: String) -> Self {
        Error::Hdf5 {
            path: path.as_ref().to_path_buf(),
            doing: doing.into(),
            source: Hdf5Message(message),
        }
    }

    /// [`Error::Cuda`] for CUDA that cannot be used at all (no driver, no device), with no
    /// library error behind it.
    pub fn cuda_unavailable(why: impl Into<String>) -> Self {
        Error::Cuda {
            doing: why.into(),
            source: None,
        }
    }

    /// [`Error::Cuda`] for a CUDA library call that failed while `doing` something, keeping the
    /// library's error as the source.
    pub fn cuda_call(
        doing: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Cuda {
            doing: doing.into(),
            source: Some(Box::new(source)),
        }
    }

    pub(crate) fn not_a_dataset(path: impl AsRef<Path>, reason: impl Into<String>) -> Self {
        Error::NotADataset {
            path: path.as_ref().to_path_buf(),
            reason: reason.into(),
        }
    }
}

/// Extension for attaching a path to `io::Result`s.
pub(crate) trait IoContext<T> {
    fn at(self, path: impl AsRef<Path>) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn at(self, path: impl AsRef<Path>) -> Result<T> {
        self.map_err(|e| Error::io(path, e))
    }
}

/// Formats an error and its causes as `outer: cause: cause`, leaving out a cause whose text the
/// message before it already ends with (this crate's messages include their cause, so that
/// `to_string()` alone is complete; printing the chain as well would repeat it).
pub fn display_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut last = out.clone();
    let mut cause = err.source();
    while let Some(e) = cause {
        let text = e.to_string();
        if !last.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        last = text;
        cause = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_liblmdb_reports_is_an_io_error() {
        let read_only = io::Error::from_raw_os_error(libc::EROFS);
        match Error::lmdb("/ro/out.lmdb.partial", heed::Error::Io(read_only)) {
            Error::Io { path, source } => {
                assert_eq!(path, Path::new("/ro/out.lmdb.partial"));
                assert_eq!(source.raw_os_error(), Some(libc::EROFS));
            }
            other => panic!("expected an I/O error, got {other:?}"),
        }
        let own = heed::Error::Mdb(heed::MdbError::Corrupted);
        assert!(matches!(Error::lmdb("/d/x.lmdb", own), Error::Lmdb { .. }));
    }

    #[test]
    fn chain_skips_causes_already_in_the_message() {
        let err = Error::io("/data/x.jpg", io::Error::other("disk on fire"));
        assert_eq!(display_chain(&err), "/data/x.jpg: disk on fire");
        let outer = io::Error::other(err);
        assert_eq!(display_chain(&outer), "/data/x.jpg: disk on fire");
    }
}

/// What made a sample bad, for code that treats failures differently (counts them by kind,
/// stops on storage damage but not on odd images). [`BadSample::reason`](crate::batch::BadSample::reason) keeps the full
/// message for people.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum BadSampleKind {
    /// The record could not be read: an I/O error, a file cut short, a file refused (not a
    /// regular file, too large).
    Unreadable,
    /// The stored record is damaged: a checksum mismatch, a broken TFRecord frame or index
    /// entry, a value the format cannot parse, a label out of range. The data changed since
    /// it was written, or was written wrong.
    Corrupt,
    /// The payload is not an image format this build decodes.
    UnknownFormat,
    /// The image declares more pixels than the decoder's limit (a decompression bomb), or the
    /// transform would resize it past that limit (a very long, thin image).
    TooLarge,
    /// The payload is an image whose bytes do not decode: truncated or corrupt data, an empty
    /// or zero-sized image, a raw payload whose header does not match its length; or one too
    /// small for the transform's `RandomCrop` window.
    Undecodable,
}

impl BadSampleKind {
    /// The kind of a record the reader could not deliver.
    pub fn of_read_error(error: &Error) -> BadSampleKind {
        match error {
            Error::CorruptRecord { .. } => BadSampleKind::Corrupt,
            _ => BadSampleKind::Unreadable,
        }
    }

    /// The kind of a payload the decoder refused.
    pub fn of_decode_error(error: &DecodeError) -> BadSampleKind {
        match error {
            DecodeError::UnknownFormat(_) => BadSampleKind::UnknownFormat,
            DecodeError::TooLarge { .. } | DecodeError::ResizedTooLarge { .. } => {
                BadSampleKind::TooLarge
            }
            DecodeError::Empty
            | DecodeError::ZeroSized
            | DecodeError::Implausible { .. }
            | DecodeError::Jpeg(_)
            | DecodeError::Image { .. }
            | DecodeError::BadRaw(_)
            | DecodeError::SmallerThanCrop { .. } => BadSampleKind::Undecodable,
        }
    }

    /// The kind's name as serialized (`unreadable`, `corrupt`, `unknown_format`, `too_large`,
    /// `undecodable`).
    pub fn name(self) -> &'static str {
        match self {
            BadSampleKind::Unreadable => "unreadable",
            BadSampleKind::Corrupt => "corrupt",
            BadSampleKind::UnknownFormat => "unknown_format",
            BadSampleKind::TooLarge => "too_large",
            BadSampleKind::Undecodable => "undecodable",
        }
    }
}

impl std::fmt::Display for BadSampleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a set of shards cannot be read as one dataset ([`Error::ShardSet`]; [`crate::format::shards`] finds it).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShardSetProblem {
    /// A directory holds several sets; `sets` lists each with its number of files.
    Mixed {
        /// `(set name, files)`, in name order.
        sets: Vec<(String, usize)>,
        /// A pattern that selects the first of them (`train-*-of-01024`).
        example: String,
    },
    /// Members of a set are missing.
    #[non_exhaustive]
    Missing {
        /// The set.
        set: String,
        /// The missing members' file names (the first 10 when there are more).
        missing: Vec<String>,
        /// How many are missing in all.
        count: u64,
        /// How many the set should have (its `-of-` count, or the span of its numbers).
        expected: u64,
        /// What stands under a named member's name, or beside it, that is not read as it:
        /// `(name, what)`, such as `("x-00001-of-00004", "a FIFO (named pipe), not a regular
        /// file")` or `(.., "x-00001-of-00004.xz is there instead")`.
        in_their_place: Vec<(String, String)>,
    },
    /// A file's number does not fit its set (`train-00009-of-00008`), or two files claim one
    /// number (`x-00001-of-00002` and `x-00001-of-00002.gz`).
    Inconsistent {
        /// The file.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// A pattern matched no file.
    NoMatch,
    /// Shards of a format that counts its records nowhere (other tools' TFRecord or WebDataset
    /// shards) end cut short or hold nothing, and the records they lost, estimated from the
    /// set's whole shards ([`cut_loss`](crate::dataset::cut_loss)), are more than the loader's
    /// bad-sample limit allows, or cannot be estimated. Each cut shard reads as one bad record
    /// at its end: counted so, a shard that lost most of its records would stay under any
    /// limit.
    CutShort {
        /// The cut shards' names (the first 10 when there are more).
        shards: Vec<String>,
        /// How many shards are cut.
        count: usize,
        /// How many members hold no record while the others do.
        empty: usize,
        /// About how many records they lost (at most), or `None` when no whole shard of the
        /// set gives a count to go by.
        lost: Option<u64>,
        /// The limit, as configured.
        limit: String,
    },
}

impl std::fmt::Display for ShardSetProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardSetProblem::Mixed { sets, example } => {
                let listed: Vec<String> = sets
                    .iter()
                    .map(|(set, files)| format!("{set} ({files} files)"))
                    .collect();
                write!(
                    f,
                    "holds {} sets of shards: {}; read one by naming it with a pattern, such as \
                     DIR/{example} (quoted in a shell), or by listing its files (several sets \
                     are read as one only when listed, file by file or with a brace list)",
                    sets.len(),
                    listed.join(", ")
                )
            }
            ShardSetProblem::Missing {
                set,
                missing,
                count,
                expected,
                in_their_place,
            } => write!(
                f,
                "set {set} is missing {count} of its {expected} shards: {}; restore them, or \
                 read the rest on purpose with --allow-missing-shards",
                crate::dataset::missing_list(
                    &missing
                        .iter()
                        .map(
                            |name| match in_their_place.iter().find(|(n, _)| n == name) {
                                Some((_, what)) => format!("{name} ({what})"),
                                None => name.clone(),
                            }
                        )
                        .collect::<Vec<_>>(),
                    *count
                )
            ),
            ShardSetProblem::Inconsistent { file, reason } => write!(f, "{file}: {reason}"),
            ShardSetProblem::NoMatch => {
                f.write_str("no file matches this pattern (index files and manifests do not count)")
            }
            ShardSetProblem::CutShort {
                shards,
                count,
                empty,
                lost,
                limit,
            } => {
                let mut what = Vec::new();
                if *count > 0 {
                    what.push(format!(
                        "{count} shard(s) end cut short ({})",
                        crate::dataset::missing_list(shards, *count as u64)
                    ));
                }
                if *empty > 0 {
                    what.push(format!(
                        "{empty} shard(s) hold no record while the others do (the notices name them)"
                    ));
                }
                write!(f, "{}: ", what.join("; "))?;
                match lost {
                    Some(lost) => write!(
                        f,
                        "up to about {lost} records are lost with them (by the set's whole \
                         shards' record counts), more than the bad-sample limit ({limit}) allows"
                    )?,
                    None => write!(
                        f,
                        "how many records are lost with them cannot be estimated (no whole shard \
                         of the set to compare with), and the bad-sample limit is {limit}"
                    )?,
                }
                f.write_str(
                    "; restore them, or train on what is left on purpose with max_bad=None \
                     (--max-bad None)",
                )
            }
        }
    }
}

/// What libhdf5 said about a call that failed ([`Error::Hdf5`]'s source, feature `hdf5`), as
/// text. The `hdf5` crate's own error holds a handle to the library's error stack, and every
/// use of libhdf5 must happen inside imagefeed's HDF5 gate (`format::hdf5::gate`: that is what
/// makes `fork()` safe), so the message is read there and the handle let go.
#[cfg(feature = "hdf5")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hdf5Message(String);

#[cfg(feature = "hdf5")]
impl Hdf5Message {
    /// The library's message.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(feature = "hdf5")]
impl std::fmt::Display for Hdf5Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(feature = "hdf5")]
impl std::error::Error for Hdf5Message {}
