//! On-disk formats, one module each, reader and writer side by side, all behind the
//! [`Dataset`] trait.
//!
//! - [`folder`]: raw ImageFolder trees (torchvision's layout and order).
//! - [`lmdb`]: single-file LMDB written by `pack-dataset imagefolder2lmdb`, and the LMDBs the
//!   Python folder2lmdb scripts write (pickled `(image_bytes, label)` values).
//! - [`hdf5`]: HDF5 written by `pack-dataset imagefolder2hdf5` (payloads read with `pread`,
//!   outside the HDF5 lock), and h5py files with variable-length encoded images or pixel arrays.
//! - [`records`]: TFRecord shards of `tf.train.Example` ([`example`]) with per-shard indexes,
//!   ours or TensorFlow's.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, DatasetInfo};
use crate::error::{Error, Result};

pub mod example;
pub mod folder;
pub mod hdf5;
pub mod lmdb;
pub(crate) mod pickle;
pub mod records;

/// The checksum of one record, as LMDB and HDF5 datasets of layout version 2 store it:
/// CRC-32C (Castagnoli) of `label u32 LE | key length u32 LE | key | payload` (the bytes of an
/// LMDB sample value). Reading a record recomputes it, so bytes changed on disk since packing
/// (bit rot, a bad copy, a flipped byte) make the record bad instead of handing out wrong
/// pixels, labels or keys as good.
pub fn record_checksum(label: u32, key: &str, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(checksum_start(label, key), payload)
}

/// The CRC-32C state after a record's label and key: [`record_checksum`] continued over the
/// payload with `crc32c::crc32c_append` (for payloads written in pieces).
#[cfg_attr(not(feature = "hdf5"), allow(dead_code))]
pub(crate) fn checksum_start(label: u32, key: &str) -> u32 {
    let mut head = [0u8; 8];
    head[..4].copy_from_slice(&label.to_le_bytes());
    head[4..].copy_from_slice(&(key.len() as u32).to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c(&head), key.as_bytes())
}

/// The reason given for a record whose checksum does not match.
pub(crate) fn checksum_mismatch(stored: u32, computed: u32) -> String {
    format!(
        "checksum mismatch (stored CRC-32C {stored:08x}, the record's bytes give {computed:08x}): \
         the file changed since it was packed"
    )
}

/// Refuses metadata whose magic is not `expected` or whose layout `version` is newer than
/// `newest`. `magic_label` names where the magic was read, for the message.
pub(crate) fn check_layout(
    path: &Path,
    magic_label: &str,
    magic: &str,
    expected: &str,
    version: u32,
    newest: u32,
) -> Result<()> {
    if magic != expected {
        return Err(Error::not_a_dataset(
            path,
            format!("{magic_label} is {magic:?}"),
        ));
    }
    if version > newest {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "layout version {version} is newer than this build reads ({newest}); upgrade imagefeed"
            ),
        ));
    }
    Ok(())
}

/// The metadata record imagefeed stores in an LMDB (`meta/info`) or HDF5 file (the `imagefeed`
/// attribute): layout magic and version, whether the pack finished, and the dataset's info.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct InfoRecord {
    pub magic: String,
    pub version: u32,
    pub complete: bool,
    #[serde(flatten)]
    pub info: DatasetInfo,
}

impl InfoRecord {
    /// A record of the given layout.
    pub fn new(magic: &str, version: u32, complete: bool, info: DatasetInfo) -> InfoRecord {
        InfoRecord {
            magic: magic.into(),
            version,
            complete,
            info,
        }
    }
}

/// Refuses a dataset whose metadata says the pack did not finish; `what` names that metadata.
pub(crate) fn require_complete(path: &Path, complete: bool, what: &str) -> Result<()> {
    if complete {
        return Ok(());
    }
    Err(Error::Incomplete {
        path: path.to_path_buf(),
        reason: format!("{what} is marked incomplete"),
    })
}

/// True when `path` holds something an imagefeed writer made, which `pack-dataset --force` may
/// replace or delete: a dataset of ours (an LMDB or HDF5 file whose metadata carries our magic,
/// a records directory with our manifest), a writer's partial output (its progress record
/// carries our magic), one of those whose deletion was interrupted ([`DELETING`]), or something
/// that holds nothing (an empty directory or file, an LMDB never committed to, a directory
/// holding only a writer's uncommitted `.tmp` files).
///
/// A directory must say so by its content (the magic) *and* hold nothing but the regular files
/// our writers make there ([`foreign_entry`]): a directory of other files, even ones named like
/// our shards, is not ours, nor is one with a manifest of ours copied or forged into it next to
/// other files (a project tree, or a dataset someone added notes to). Anything else (a source
/// tree, an h5py or folder2lmdb file) is not ours either, whatever its name. Symlinks are
/// followed for the question (what is replaced or deleted is the link, never what it points
/// to). A missing path is not ours.
pub fn is_own_output(path: &Path) -> bool {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            // Empty, or holding only a writer's uncommitted `.tmp` files (a pack killed while
            // writing its first record), it holds nothing; otherwise it must carry our magic.
            let uncommitted = std::fs::read_dir(path).is_ok_and(|entries| {
                entries
                    .into_iter()
                    .all(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".tmp")))
            });
            (uncommitted || dir_says_ours(path)) && foreign_entry(path).is_none()
        }
        Ok(meta) if meta.is_file() => lmdb::is_own_file(path) || hdf5::is_own_file(path),
        _ => false,
    }
}

/// True when the directory `path` carries our magic: a records manifest or progress record, an
/// HDF5 staging progress record, or the [`DELETING`] mark. (What else it holds is
/// [`foreign_entry`]'s question.)
pub(crate) fn dir_says_ours(path: &Path) -> bool {
    records::is_own_dir(path) || hdf5::is_own_staging(path) || is_being_deleted(path)
}

/// The first entry of the directory `dir` that no imagefeed writer makes there (anything but a
/// regular file named like a records manifest, progress record, shard or shard index, an HDF5
/// staging file, the [`DELETING`] mark, or one of those with `.tmp` appended; and, beside a
/// manifest of ours, a shard or index it does not list); `None` when there is none. An unreadable directory answers with its own name.
pub fn foreign_entry(dir: &Path) -> Option<std::ffi::OsString> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Some(dir.as_os_str().to_owned());
    };
    for entry in entries {
        let Ok(entry) = entry else {
            return Some(dir.as_os_str().to_owned());
        };
        let name = entry.file_name();
        let ours = entry.file_type().is_ok_and(|t| t.is_file())
            && name.to_str().is_some_and(|name| {
                let name = name.strip_suffix(".tmp").unwrap_or(name);
                name == DELETING || records::is_writer_file(name) || hdf5::is_staging_file(name)
            });
        if !ours {
            return Some(name);
        }
    }
    records::unlisted_shard_file(dir)
}

/// The file `remove_own_output` puts in a directory before deleting anything in it, and
/// deletes last: a directory whose deletion was interrupted still says it is ours, and that it
/// is not a dataset.
pub const DELETING: &str = "imagefeed-deleting";

/// The magic [`DELETING`] holds.
const DELETING_MAGIC: &str = "imagefeed-deleting";

/// True when `dir` is a directory of ours whose deletion was interrupted (see [`DELETING`]).
pub(crate) fn is_being_deleted(dir: &Path) -> bool {
    staged_magic(dir, DELETING).as_deref() == Some(DELETING_MAGIC)
}

/// Deletes an output [`is_own_output`] recognised; a symlink is removed, not what it points to.
/// A directory is marked first ([`DELETING`]), then loses its manifest and progress record, its
/// other files, and the mark last: if this is interrupted, what is left is never taken for a
/// dataset, and is still recognised as ours.
pub(crate) fn remove_own_output(path: &Path) -> Result<()> {
    use crate::error::IoContext as _;
    let meta = std::fs::symlink_metadata(path).at(path)?;
    if meta.is_dir() {
        let mark = path.join(DELETING);
        let json = format!("{{\"magic\": \"{DELETING_MAGIC}\"}}\n");
        std::fs::write(&mark, json).at(&mark)?;
        let remove = |name: &std::ffi::OsStr| -> Result<()> {
            let entry = path.join(name);
            let result = match std::fs::symlink_metadata(&entry) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&entry),
                Ok(_) => std::fs::remove_file(&entry),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            };
            result.at(entry)
        };
        // What makes it a dataset (or a resumable pack) goes first.
        remove(records::MANIFEST.as_ref())?;
        remove(records::PROGRESS.as_ref())?;
        remove(hdf5::STAGED_PROGRESS.as_ref())?;
        for entry in std::fs::read_dir(path).at(path)? {
            let name = entry.at(path)?.file_name();
            if name != DELETING {
                remove(&name)?;
            }
        }
        std::fs::remove_file(&mark).at(&mark)?;
        std::fs::remove_dir(path).at(path)
    } else {
        std::fs::remove_file(path).at(path)?;
        // An LMDB writer's lock file, if one was left.
        let mut lock = path.as_os_str().to_owned();
        lock.push("-lock");
        let _ = std::fs::remove_file(lock);
        Ok(())
    }
}

/// The `magic` field of the JSON file `name` in the directory `dir`, if it has one.
pub(crate) fn staged_magic(dir: &Path, name: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Magic {
        magic: String,
    }
    use std::io::Read as _;
    let (file, _) = crate::file::open_regular(&dir.join(name)).ok()?;
    let mut text = Vec::new();
    // A progress record or manifest is small; a huge file under that name is not ours.
    file.take(64 << 20).read_to_end(&mut text).ok()?;
    serde_json::from_slice::<Magic>(&text).ok().map(|m| m.magic)
}

/// How to read datasets whose files do not say everything themselves (files other tools wrote).
/// The defaults suit imagefeed's own formats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// Dataset names in an h5py file not in imagefeed's layout.
    pub hdf5: hdf5::Hdf5Names,
    /// Label base and class count for TFRecord shards without an imagefeed manifest.
    pub records: records::RecordsOptions,
}

/// Opens any dataset this library reads, choosing the format from what is on disk: a directory
/// is an ImageFolder tree, a records directory or an LMDB directory; a file is identified by its
/// magic bytes (LMDB, HDF5) or its name (a TFRecord shard).
pub fn open(path: impl AsRef<Path>) -> Result<Arc<dyn Dataset>> {
    open_with(path, &OpenOptions::default())
}

/// [`open`], with options for files other tools wrote.
pub fn open_with(path: impl AsRef<Path>, options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    let path = path.as_ref();
    if !path.exists() {
        let partial = crate::pack::partial_path(path);
        if partial.is_dir() && hdf5::is_own_staging(&partial) {
            return hdf5::open_dataset(path, &options.hdf5);
        }
        if partial.is_dir() {
            return Ok(Arc::new(records::Records::open_with(
                path,
                &options.records,
            )?));
        }
    }
    if path.is_dir() && hdf5::is_own_staging(path) {
        return Err(Error::Incomplete {
            path: path.to_path_buf(),
            reason: "the staging directory of an interrupted HDF5 pack, not a dataset; rerun the \
                     pack with --resume to finish it"
                .into(),
        });
    }
    // An LMDB in directory form (Python's lmdb.open default): DIR/data.mdb.
    if path.is_dir() && path.join("data.mdb").is_file() {
        return Ok(Arc::new(lmdb::Lmdb::open(path.join("data.mdb"))?));
    }
    if path.is_dir() && records::looks_like_records(path) {
        return Ok(Arc::new(records::Records::open_with(
            path,
            &options.records,
        )?));
    }
    if path.is_dir() {
        return Ok(Arc::new(folder::ImageFolder::open(path)?));
    }
    if hdf5::has_signature(path) {
        return hdf5::open_dataset(path, &options.hdf5);
    }
    if records::is_shard_name(path) {
        return Ok(Arc::new(records::Records::open_with(
            path,
            &options.records,
        )?));
    }
    // What the LMDB reader refuses first: a staging name (an interrupted pack's output).
    crate::pack::refuse_interrupted(path)?;
    if !lmdb::has_magic(path)? {
        return Err(Error::not_a_dataset(
            path,
            "neither a directory (ImageFolder tree, records shards) nor a dataset file this build \
             reads (LMDB, HDF5, *.tfrecord)",
        ));
    }
    Ok(Arc::new(lmdb::Lmdb::open(path)?))
}
