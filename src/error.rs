//! The library's error type.
//!
//! Every variant that input data or the file system can cause names the file (and, inside a
//! packed dataset, the record) and the reason, so a user can find what is broken from the message
//! alone. Bugs in the caller (an index past the end, a buffer of the wrong size) panic instead.

use std::io;
use std::path::{Path, PathBuf};

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

    /// `path` is not a dataset this library can read, or its metadata is malformed.
    #[error("{}: not a readable dataset: {reason}", path.display())]
    NotADataset {
        /// The path that was opened.
        path: PathBuf,
        /// Why it was refused.
        reason: String,
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
        /// The record's key (relative path), or `?` when the key itself is unreadable.
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

    /// `--resume` found a partial output that does not belong to this source or these options.
    #[error("{}: cannot resume: {reason}", path.display())]
    ResumeMismatch {
        /// The partial output.
        path: PathBuf,
        /// What differs.
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
}

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl AsRef<Path>, source: io::Error) -> Self {
        Error::Io {
            path: path.as_ref().to_path_buf(),
            source,
        }
    }

    pub(crate) fn lmdb(path: impl AsRef<Path>, source: heed::Error) -> Self {
        Error::Lmdb {
            path: path.as_ref().to_path_buf(),
            source,
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
    fn chain_skips_causes_already_in_the_message() {
        let err = Error::io("/data/x.jpg", io::Error::other("disk on fire"));
        assert_eq!(display_chain(&err), "/data/x.jpg: disk on fire");
        let outer = io::Error::other(err);
        assert_eq!(display_chain(&outer), "/data/x.jpg: disk on fire");
    }
}
