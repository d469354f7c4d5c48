//! Record shards: TFRecord files of `tf.train.Example` records, with per-shard indexes. The
//! writer `pack-dataset imagefolder2records` uses, and the reader for those and for TFRecord
//! shards other tools made.
//!
//! # Layout (version 1)
//!
//! A directory holding:
//!
//! - `shard-00000.tfrecord`, `shard-00001.tfrecord`, …: TFRecord framing, each record
//!   `u64 LE length | u32 LE masked CRC-32C of the length | data | u32 LE masked CRC-32C of data`
//!   (mask: `((crc >> 15) | (crc << 17)) + 0xa282ead8`), a shard closed once it reaches the shard
//!   size. Each record is a `tf.train.Example` with the ImageNet-standard features:
//!   `image/encoded` (the file's bytes), `image/class/label` (int64: class index + label base),
//!   `image/class/synset` (the class folder's name), `image/format` (`JPEG`, `PNG`, …, or
//!   `RAW-RGB8` for `--raw` payloads), `image/filename` (path relative to the ImageFolder root),
//!   `image/height` and `image/width`.
//! - `shard-00000.index`, …: the Python `tfrecord` package's index format, one text line per
//!   record, `"<byte offset> <record length in bytes>"`.
//! - `imagefeed-records.json`: `{"magic": "imagefeed-records", "version": 1, "complete": true,
//!   "label_base": 0, "shards": [{"file", "index", "records", "bytes"}], …dataset info}`.
//!
//! TensorFlow reads the shards with `tf.data.TFRecordDataset`, the `tfrecord` package with
//! `tfrecord.reader.tfrecord_loader(shard, index, description)`.
//!
//! # Reading
//!
//! Shards and indexes are memory-mapped (memmap2). At open each index is parsed once, giving
//! O(1) access to any record; reading copies the record out of the mapped shard once, under the
//! SIGBUS guard ([`crate::mapguard`]), and returns `image/encoded` as a slice of that copy. Both
//! CRCs are checked on every read: a corrupt record, or one an index places past the end of a
//! truncated shard, is a bad sample naming the shard and record, never a crash.
//!
//! Shards without an imagefeed manifest (a directory of `*.tfrecord` / `*-NNNNN-of-NNNNN` files,
//! or a single shard) are read too. The label base is then an option (0, or 1 for ImageNet
//! TFRecords, whose labels run 1..=1000), and classes are `"0"..="max label"` unless a class
//! count is given. A shard with no index gets one built in memory by scanning it, and
//! [`Records::notices`] says so. Opening never writes: [`Records::save_missing_indexes`]
//! (`pack-dataset index`) saves those indexes beside their shards, so later opens skip the scan.
//!
//! # Crash safety
//!
//! The writer builds `OUT.partial/` and renames it to `OUT` once complete. After each chunk the
//! open shard and its index are synced and `progress.json` (the committed length of every shard
//! and index) is replaced atomically; `--resume` cuts the files back to those lengths.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, DatasetInfo};
use crate::error::Result;
use crate::format::{Recognizer, staging};

mod foreign;
mod framing;
mod index;
mod reader;
#[cfg(feature = "remote")]
pub(crate) mod remote;
mod writer;

pub use framing::{ShardScan, frame, masked_crc, scan_shard, starts_with_frame, unframe};
pub use index::{INDEX_DIR, find_index, index_path_for, is_index_name, saved_index_path};
#[cfg_attr(not(feature = "fuzzing"), allow(unused_imports))]
pub(crate) use index::{check_index_covers, parse_index};
pub use reader::{Records, RecordsOptions};
pub use writer::RecordsWriter;

/// The progress record inside a writer's staging directory.
pub(crate) const PROGRESS: &str = "progress.json";

/// Whether a file named `name`, found beside shards, is never one, whatever a pattern matches:
/// an index file, our manifest or progress record, or a pack's report.
pub(crate) fn is_never_a_shard(name: &str) -> bool {
    is_index_name(std::path::Path::new(name))
        || name == MANIFEST
        || name == PROGRESS
        || crate::format::shards::is_pack_report(name)
}

/// The `magic` value in the manifest.
pub const MAGIC: &str = "imagefeed-records";
/// The layout version this build writes and the newest it reads.
pub const VERSION: u32 = 1;
/// The manifest's file name inside a records directory.
pub const MANIFEST: &str = "imagefeed-records.json";
/// The `image/format` our writer gives raw pixels ([`RawImage`](crate::decode::RawImage)).
pub const RAW_FORMAT_NAME: &str = "RAW-RGB8";
/// Default shard size: large enough for efficient streaming, small enough to spread over
/// machines (TensorFlow's guidance is 100–200 MB per file).
pub const DEFAULT_SHARD_BYTES: u64 = 128 << 20;

/// Feature names.
pub mod features {
    /// The image file's bytes.
    pub const ENCODED: &str = "image/encoded";
    /// Class index plus the label base (int64).
    pub const LABEL: &str = "image/class/label";
    /// Class folder name.
    pub const SYNSET: &str = "image/class/synset";
    /// A class's human-readable name (TensorFlow's ImageNet scripts: `"tench, Tinca tinca"`);
    /// read as the class name when a shard has no synset.
    pub const TEXT: &str = "image/class/text";
    /// `JPEG`, `PNG`, …
    pub const FORMAT: &str = "image/format";
    /// Path relative to the ImageFolder root.
    pub const FILENAME: &str = "image/filename";
    /// Height in pixels (int64).
    pub const HEIGHT: &str = "image/height";
    /// Width in pixels (int64).
    pub const WIDTH: &str = "image/width";
}

/// One shard in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// Shard file name, relative to the directory.
    pub file: String,
    /// Index file name, relative to the directory.
    pub index: String,
    /// Records in the shard.
    pub records: usize,
    /// Bytes in the shard.
    pub bytes: u64,
}

/// The manifest of a records dataset of ours ([`MANIFEST`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Manifest {
    magic: String,
    version: u32,
    complete: bool,
    label_base: u32,
    shards: Vec<ShardEntry>,
    #[serde(flatten)]
    info: DatasetInfo,
}

impl Manifest {
    /// The shard files it lists, in order.
    pub(crate) fn shard_files(&self) -> Vec<String> {
        self.shards.iter().map(|entry| entry.file.clone()).collect()
    }

    /// Whether it lists the shard file `name`.
    pub(crate) fn lists(&self, name: &str) -> bool {
        self.shards.iter().any(|entry| entry.file == name)
    }

    /// The manifest, when the shards `names`, picked in its directory `dir`, are all its own
    /// (then they read as this dataset's: [`Manifest::lists`]); `None` when some are another
    /// tool's. One named like its writer's shards that it does not list is an error naming it
    /// (a hostile try took a shard left out of an edited manifest for another tool's, its
    /// classes inferred from its own labels).
    pub(crate) fn claiming<'a>(
        self,
        dir: &Path,
        mut names: impl Iterator<Item = &'a str>,
    ) -> crate::error::Result<Option<Manifest>> {
        let all = names.try_fold(true, |all, name| {
            if self.lists(name) {
                Ok(all)
            } else if is_writer_file(name) {
                Err(crate::error::Error::not_a_dataset(
                    dir.join(name),
                    format!(
                        "named as a shard of the records dataset of ours beside it, whose {MANIFEST} \
                         does not list it: the manifest or the directory changed since packing"
                    ),
                ))
            } else {
                Ok(false)
            }
        })?;
        Ok(all.then_some(self))
    }
}

/// The error for our manifest (`label`) named where its dataset was due: fetched or opened, it
/// would be named by whatever read it next (a hostile try's message named a cache file).
/// `holder`: the directory or prefix to name instead.
pub(crate) fn manifest_named(label: &Path, holder: impl std::fmt::Display) -> crate::error::Error {
    crate::error::Error::not_a_dataset(
        label,
        format!("the manifest of an imagefeed records dataset, not the dataset: name {holder}"),
    )
}

/// True when the directory `path` is a records dataset or staging directory an imagefeed writer
/// made: its manifest or progress record carries [`MAGIC`].
pub(crate) fn is_own_dir(path: &Path) -> bool {
    staging::staged_magic(path, MANIFEST).as_deref() == Some(MAGIC)
        || staging::staged_magic(path, PROGRESS).as_deref() == Some(MAGIC)
}

/// Whether `name` is one the records writer gives a file: the manifest, the progress record,
/// `shard-NNNNN.tfrecord` or `shard-NNNNN.index`.
pub(crate) fn is_writer_file(name: &str) -> bool {
    let shard = |stem: &str| {
        stem.strip_prefix("shard-")
            .is_some_and(|n| n.len() >= 5 && n.bytes().all(|b| b.is_ascii_digit()))
    };
    name == MANIFEST
        || name == PROGRESS
        || name
            .strip_suffix(".tfrecord")
            .or_else(|| name.strip_suffix(".index"))
            .is_some_and(shard)
}

/// In a directory holding a manifest of ours, the first file named like a shard or index that
/// the manifest does not list (someone's file that only looks like ours); `None` when there is
/// none, or no readable manifest (a staging directory's in-flight shard is not listed yet).
pub(crate) fn unlisted_shard_file(dir: &Path) -> Option<std::ffi::OsString> {
    #[derive(Deserialize)]
    struct Listed {
        shards: Vec<ShardEntry>,
    }
    let text = fs::read(dir.join(MANIFEST)).ok()?;
    let listed: Listed = serde_json::from_slice(&text).ok()?;
    let names: std::collections::HashSet<&str> = listed
        .shards
        .iter()
        .flat_map(|e| [e.file.as_str(), e.index.as_str()])
        .collect();
    fs::read_dir(dir).ok()?.flatten().find_map(|entry| {
        let name = entry.file_name();
        let text = name.to_str()?;
        (is_writer_file(text) && text != MANIFEST && text != PROGRESS && !names.contains(text))
            .then_some(name)
    })
}

fn shard_names(number: usize) -> (String, String) {
    (
        format!("shard-{number:05}.tfrecord"),
        format!("shard-{number:05}.index"),
    )
}

/// True when `path` looks like a TFRecord shard by name: `*.tfrecord`, `*.tfrecords`,
/// `*.tfr`, TensorFlow's sharded `NAME-NNNNN-of-NNNNN`, and each of those with `.gz` (a
/// compressed shard; compression itself is told by content, see
/// [`Compression`](crate::format::compressed::Compression)).
pub fn is_shard_name(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let name = name.strip_suffix(".gz").unwrap_or(name);
    if matches!(
        Path::new(name).extension().and_then(|e| e.to_str()),
        Some("tfrecord" | "tfrecords" | "tfr")
    ) {
        return true;
    }
    // TensorFlow's sharded names: train-00000-of-01024.
    let parts: Vec<&str> = name.rsplitn(3, '-').collect();
    parts.len() == 3
        && parts[1] == "of"
        && parts[0].len() == 5
        && parts[0].bytes().all(|b| b.is_ascii_digit())
        && parts[2]
            .rsplit('-')
            .next()
            .is_some_and(|n| n.len() == 5 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// True when `path` is a records directory (with a manifest or with shard files) or a shard.
pub fn looks_like_records(path: &Path) -> bool {
    if path.is_dir() {
        path.join(MANIFEST).is_file()
            || fs::read_dir(path).is_ok_and(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .any(|e| e.path().is_file() && is_shard_name(&e.path()))
            })
    } else {
        is_shard_name(path)
    }
}

/// [`format::open`](crate::format::open)'s recognizer for a directory of record shards
/// (ours, with a manifest, or TensorFlow's).
pub(crate) const DIRECTORY: Recognizer = Recognizer {
    holds: |path| Ok(path.is_dir() && looks_like_records(path)),
    open: open_records,
};

/// [`format::open`](crate::format::open)'s recognizer for a single TFRecord shard, by its name
/// ([`is_shard_name`]).
pub(crate) const SHARD: Recognizer = Recognizer {
    holds: |path| Ok(is_shard_name(path)),
    open: open_records,
};

fn open_records(path: &Path, options: &crate::format::OpenOptions) -> Result<Arc<dyn Dataset>> {
    Ok(Arc::new(Records::open_selection(
        &crate::format::shards::Selection::of(path),
        options,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_and_index_paths() {
        assert!(is_shard_name(Path::new("/d/train-00000-of-01024")));
        assert!(is_shard_name(Path::new("/d/x.tfrecord")));
        assert!(is_shard_name(Path::new("/d/x.tfrecord.gz")));
        assert!(is_shard_name(Path::new("/d/train-00000-of-01024.gz")));
        assert!(!is_shard_name(Path::new("/d/x.gz")));
        assert!(!is_shard_name(Path::new("/d/x.index")));
        assert!(!is_shard_name(Path::new("/d/notes-of-12345")));
        assert_eq!(
            index_path_for(Path::new("/d/x.tfrecord")),
            Path::new("/d/x.index")
        );
        assert_eq!(
            index_path_for(Path::new("/d/train-00000-of-01024")),
            Path::new("/d/train-00000-of-01024.index")
        );
    }
}
