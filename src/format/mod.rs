//! On-disk formats, one module each, reader and writer side by side, all behind the
//! [`Dataset`] trait.
//!
//! - [`folder`]: raw ImageFolder trees (torchvision's layout and order).
//! - [`lmdb`]: single-file LMDB written by `pack-dataset imagefolder2lmdb`, and the LMDBs the
//!   Python folder2lmdb scripts write (pickled `(image_bytes, label)` values).
//! - [`hdf5`]: HDF5 written by `pack-dataset imagefolder2hdf5` (payloads read with `pread`,
//!   outside the HDF5 lock), and h5py files with variable-length encoded images or pixel arrays.
//! - [`tfrecord`]: TFRecord shards of `tf.train.Example` ([`example`]) with per-shard indexes,
//!   ours or TensorFlow's.
//!
//! Shared by the formats' writers: [`writer`] (the [`DatasetWriter`](writer::DatasetWriter)
//! trait every writer implements, and [`PackFormat`](writer::PackFormat), the registry of
//! writable formats) and [`staging`] (staging, locking, resuming and publishing an output, and
//! what `--force` may replace).

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, DatasetInfo};
use crate::error::{Error, Result};

pub mod compressed;
pub mod example;
pub mod folder;
pub mod hdf5;
pub mod lmdb;
pub mod mds;
pub mod parts;
pub(crate) mod pickle;
pub mod tfrecord;
/// The record-shard module's old name (`format::records`), kept for code that names it.
#[doc(hidden)]
pub use tfrecord as records;
#[cfg(feature = "remote")]
pub(crate) mod remote;
pub mod shard_data;
pub mod shards;
pub(crate) mod shared_headers;
pub mod staging;
#[cfg(feature = "remote")]
pub mod upload;
pub mod webdataset;
pub mod writer;

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

/// What tells one file from another at a path: device, inode, size and modification time,
/// taken when a dataset is opened. A reader that opens the path again later checks it, so a
/// file replaced or rewritten in between is a named error, not another file's records.
/// (HDF5 readers use it, as a pack does for its source's files before it publishes: the
/// other formats map their files at open.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    dev: u64,
    ino: u64,
    pub(crate) len: u64,
    modified: Option<std::time::SystemTime>,
}

impl FileIdentity {
    pub(crate) fn of(meta: &std::fs::Metadata) -> FileIdentity {
        use std::os::unix::fs::MetadataExt as _;
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            modified: meta.modified().ok(),
        }
    }

    /// Checks that `path` is still this file.
    pub(crate) fn check(&self, path: &Path) -> Result<()> {
        use crate::error::IoContext as _;
        self.compare(&std::fs::metadata(path).at(path)?, path)
    }

    /// Checks that `file`, opened from `path` as this file, was neither cut short nor
    /// rewritten since (whatever is at `path` now).
    #[cfg(feature = "hdf5")]
    pub(crate) fn check_open(&self, file: &std::fs::File, path: &Path) -> Result<()> {
        use crate::error::IoContext as _;
        self.compare(&file.metadata().at(path)?, path)
    }

    fn compare(&self, meta: &std::fs::Metadata, path: &Path) -> Result<()> {
        let now = FileIdentity::of(meta);
        if now == *self {
            return Ok(());
        }
        let change = if (now.dev, now.ino) != (self.dev, self.ino) {
            "another file was put in its place".to_string()
        } else if now.len != self.len {
            format!("its size went from {} to {} bytes", self.len, now.len)
        } else {
            "its modification time changed (rewritten in place; or only touched, or opened \
             for writing, the bytes the same)"
                .to_string()
        };
        Err(Error::FileChanged {
            path: path.to_path_buf(),
            change,
        })
    }
}

/// The error for a file whose metadata says layout `version` (before checksums) while the file
/// holds the checksums `what` (database, dataset) that only later layouts write: the metadata was
/// damaged or edited, and believing it would switch the records' checks off.
pub(crate) fn checksums_contradiction(path: &Path, version: u32, what: &str) -> Error {
    Error::not_a_dataset(
        path,
        format!(
            "the metadata says layout version {version}, written before checksums, but the file \
             holds a checksums {what}: the metadata is damaged or was edited (reading it as \
             version {version} would leave every record unchecked)"
        ),
    )
}

/// The notice for a file of a layout before checksums: its records are read unchecked.
pub(crate) fn unchecked_notice(path: &Path) -> String {
    format!(
        "{}: packed by an imagefeed before 0.2 (layout version 1, no checksums): damage to its \
         records cannot be detected; pack it again to add checksums",
        path.display()
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
    if version == 0 {
        return Err(Error::not_a_dataset(
            path,
            "layout version 0 does not exist (versions start at 1): the metadata is damaged",
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

/// Refuses a class list of ours naming one class twice: the writers take class names from
/// directory names, which are unique, and a repeat makes two classes a name-to-class table
/// (Python's `class_to_idx`) cannot tell apart (a hostile try's `["cat", "cat", "cat"]`
/// passed `verify`, and `class_to_idx` came out `{"cat": 2}`).
pub(crate) fn check_classes(path: &Path, classes: &[String]) -> Result<()> {
    match crate::dataset::first_repeat(classes.iter().map(String::as_str)) {
        None => Ok(()),
        Some((first, second)) => Err(Error::not_a_dataset(
            path,
            format!(
                "its metadata names classes {first} and {second} alike ({:?}): not as a pack of \
                 ours writes it",
                classes[first]
            ),
        )),
    }
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

/// How to read datasets whose files do not say everything themselves (files other tools wrote),
/// and sets of shards. The defaults suit imagefeed's own formats; every command that reads a
/// dataset (`inspect`, `verify`, `index`, `convert`, `imagefeed-bench load/read`) and the Python
/// `Loader`/`Dataset` take the same options.
///
/// ```
/// let options = imagefeed::format::OpenOptions::default()
///     .with_label_base(1)
///     .with_allow_missing_shards(true);
/// assert_eq!(options.records.label_base, Some(1));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenOptions {
    /// Dataset names in an h5py file not in imagefeed's layout.
    pub hdf5: hdf5::Hdf5Names,
    /// Label base and class count for TFRecord shards without an imagefeed manifest.
    pub records: tfrecord::RecordsOptions,
    /// Read a set of shards with members missing (a deliberate subset; the missing ones are
    /// reported as a notice) instead of refusing it ([`Error::ShardSet`]).
    pub allow_missing_shards: bool,
    /// Where derived files go (decompressed TFRecord shards); `None`: the cache the
    /// environment names ([`Cache::from_env`](crate::cache::Cache::from_env)).
    pub cache: Option<crate::cache::Cache>,
    /// Object storage client options (`aws_endpoint`, `aws_access_key_id`, ...), over the
    /// environment's ([`RemoteUrl::with_options`](crate::remote::RemoteUrl::with_options)).
    pub storage_options: Vec<(String, String)>,
    /// Datasets in object storage: read each record with a ranged GET of its own instead of
    /// fetching whole shards into the cache ([`with_ranged_reads`](Self::with_ranged_reads)).
    pub ranged_reads: bool,
}

impl OpenOptions {
    /// The cache derived files go into: the one set, else the environment's.
    pub(crate) fn cache_or_env(&self) -> Result<crate::cache::Cache> {
        let cache = match &self.cache {
            Some(cache) => cache.clone(),
            None => crate::cache::Cache::from_env()?,
        };
        cache.check_writable()?;
        Ok(cache)
    }

    /// The datasets holding images and labels in an h5py file.
    pub fn with_hdf5_names(mut self, images: impl Into<String>, labels: impl Into<String>) -> Self {
        self.hdf5 = hdf5::Hdf5Names {
            images: images.into(),
            labels: labels.into(),
        };
        self
    }

    /// TFRecord shards without a manifest: the smallest label (ImageNet TFRecords: 1).
    pub fn with_label_base(mut self, label_base: u32) -> Self {
        self.records.label_base = Some(label_base);
        self
    }

    /// TFRecord shards without a manifest: the number of classes (else found by a scan).
    pub fn with_num_classes(mut self, num_classes: usize) -> Self {
        self.records.num_classes = Some(num_classes);
        self
    }

    /// Read a set of shards with members missing, on purpose.
    pub fn with_allow_missing_shards(mut self, allow: bool) -> Self {
        self.allow_missing_shards = allow;
        self
    }

    /// The cache directory for derived files.
    pub fn with_cache(mut self, cache: crate::cache::Cache) -> Self {
        self.cache = Some(cache);
        self
    }

    /// An object storage client option (`aws_endpoint`, `aws_access_key_id`, ...), over the
    /// environment's.
    pub fn with_storage_option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.storage_options.push((key.into(), value.into()));
        self
    }

    /// Reads each record of a dataset in object storage with a ranged GET of its own (checked
    /// against the object's listed version, and by the record's CRCs) instead of fetching its
    /// shards whole into the cache: for reading a few records of a dataset too large to cache,
    /// or a machine without room for shards. Each read waits a round trip: a loader worker
    /// starts its batch's reads together
    /// ([`RecordReader::plan_reads`](crate::dataset::RecordReader::plan_reads)), so a batch
    /// costs about one. Needs each record's place at open: record shards with their index
    /// (ours; other tools' after `pack-dataset index`). Other formats in object storage
    /// (WebDataset, MDS, LMDB, HDF5) are refused with this option; local datasets ignore it.
    pub fn with_ranged_reads(mut self, ranged: bool) -> Self {
        self.ranged_reads = ranged;
        self
    }
}

/// Opens any dataset this library reads, choosing the format from what is on disk: a directory
/// is an ImageFolder tree, a records directory or an LMDB directory; a file is identified by its
/// magic bytes (LMDB, HDF5) or its name (a TFRecord shard).
pub fn open(path: impl AsRef<Path>) -> Result<Arc<dyn Dataset>> {
    open_with(path, &OpenOptions::default())
}

/// [`open`], with options for files other tools wrote and sets of shards. `path` may also be a
/// pattern in its last component (`DIR/train-*`, quoted in a shell; see [`shards`]).
///
/// # Errors
/// Besides the dataset's own: [`Error::Config`] for an invalid
/// [`IMAGEFEED_MEMORY_LIMIT`](crate::pagecache::MEMORY_LIMIT_ENV).
pub fn open_with(path: impl AsRef<Path>, options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    let path = path.as_ref();
    crate::mapguard::claim();
    crate::pagecache::memory_limit_from_env()?;
    if let Some(text) = path.to_str()
        && crate::remote::is_url(text)
    {
        return open_url(text, options);
    }
    if !path.exists() && shards::is_pattern(path) {
        return open_shards(&shards::Selection::Pattern(path.to_path_buf()), options);
    }
    if !path.exists() {
        let partial = staging::partial_path(path);
        if partial.is_dir() && hdf5::is_own_staging(&partial) {
            return hdf5::open_dataset(path, &options.hdf5);
        }
        if partial.is_dir() {
            return Ok(Arc::new(tfrecord::Records::open_with(
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
    for format in RECOGNIZED {
        if (format.holds)(path)? {
            return (format.open)(path, options);
        }
    }
    if path.is_file() && path.file_name().and_then(|n| n.to_str()) == Some(tfrecord::MANIFEST) {
        return Err(tfrecord::manifest_named(
            path,
            format_args!(
                "its directory, {}",
                path.parent().unwrap_or(Path::new(".")).display()
            ),
        ));
    }
    if path.is_file() {
        // The recognizers read a file's first bytes and take a failed read for a format
        // mismatch: an unreadable file is said to be one.
        if crate::file::check_head_readable(path, SNIFFED_BYTES)? == 0 {
            return Err(Error::not_a_dataset(
                path,
                "the file is empty (0 bytes): no dataset file this build reads is (a pack \
                 killed before it wrote anything, or a copy that never started?)",
            ));
        }
        // A compressed file (`x.tar.xz`): say so, rather than that it is no dataset file.
        use crate::error::IoContext as _;
        let mut head = [0u8; 8];
        let got = std::fs::File::open(path)
            .and_then(|file| std::os::unix::fs::FileExt::read_at(&file, &mut head, 0))
            .at(path)?;
        compressed::refuse_unread(
            path,
            &head[..got],
            "LMDB and HDF5 files, and TFRecord and WebDataset (tar) shards plain or gzipped",
        )?;
    }
    Err(Error::not_a_dataset(
        path,
        "neither a directory (ImageFolder tree, records shards) nor a dataset file this build \
         reads (LMDB, HDF5, *.tfrecord, *.tar)",
    ))
}

/// How much of the start of a file no recognizer took is read to tell an unreadable file from
/// one of another format: a page, more than any recognizer reads.
const SNIFFED_BYTES: u64 = 4096;

/// Opens the dataset a URL names (`s3://bucket/prefix/`): see `format::remote`. Without the
/// `remote` feature a URL is refused naming the feature (never taken for a local path).
fn open_url(text: &str, options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    let url = crate::remote::RemoteUrl::parse(text)?;
    #[cfg(feature = "remote")]
    {
        let _ = url;
        remote::open_url(text, options)
    }
    #[cfg(not(feature = "remote"))]
    {
        let _ = options;
        Err(Error::FeatureDisabled {
            path: url.to_string().into(),
            what: "reading from object storage",
            feature: "remote",
        })
    }
}

/// Opens the shard files `files` as one dataset (what a shell makes of an unquoted pattern, or
/// a list a program builds): whole sets are checked to be whole, as for a directory, unless
/// `options.allow_missing_shards`. One file is read as it is.
pub fn open_files(files: &[std::path::PathBuf], options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    match files {
        [] => Err(Error::Config("no dataset files given".into())),
        [one] => open_with(one, options),
        _ => {
            // Several paths are one dataset's shards: a file of another format among them (`verify
            // a.lmdb b.lmdb`) is named as what it is, not read as a damaged TFRecord shard.
            // Tars are read as WebDataset and anything else as TFRecord: a mix is two sets.
            let tar = files.iter().find(|f| webdataset::is_shard_name(f));
            let other = files.iter().find(|f| !webdataset::is_shard_name(f));
            if let (Some(tar), Some(other)) = (tar, other) {
                return Err(Error::not_a_dataset(
                    other,
                    format!(
                        "not a WebDataset shard, while {} is: several paths are read as the \
                         shards of one dataset, of one format",
                        tar.display()
                    ),
                ));
            }
            for file in files {
                if let Some(what) = not_a_shard(file) {
                    return Err(Error::not_a_dataset(
                        file,
                        format!(
                            "{what}, not a shard: several paths are read as the shards of one \
                             dataset; name one dataset at a time"
                        ),
                    ));
                }
            }
            open_shards(&shards::Selection::List(files.to_vec()), options)
        }
    }
}

/// What `path` is when it is plainly not a shard file (a directory, or a file another format
/// recognises); `None` for anything that may be a shard.
fn not_a_shard(path: &Path) -> Option<&'static str> {
    if path.is_dir() {
        return Some("a directory");
    }
    if tfrecord::is_index_name(path) {
        return Some("a shard's index file");
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name == tfrecord::MANIFEST || name == tfrecord::PROGRESS {
        return Some("a file of an imagefeed records dataset (name its directory)");
    }
    if shards::is_pack_report(name) {
        return Some("a pack's report (name the dataset it describes)");
    }
    if tfrecord::is_shard_name(path) || webdataset::is_shard_name(path) {
        return None;
    }
    let is = |recognizer: &Recognizer| (recognizer.holds)(path).unwrap_or(false);
    if is(&hdf5::FILE) {
        Some("an HDF5 file")
    } else if is(&mds::INDEX_FILE) {
        Some("an MDS index.json")
    } else if is(&lmdb::FILE) {
        Some("an LMDB file")
    } else {
        None
    }
}

/// Opens a selection of shards made by a pattern or a list: WebDataset when every file is a tar,
/// else TFRecord shards.
fn open_shards(selection: &shards::Selection, options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    crate::pagecache::memory_limit_from_env()?;
    let files = match selection {
        shards::Selection::Pattern(pattern) => {
            shards::expand_selection(pattern, options.allow_missing_shards)?.0
        }
        shards::Selection::List(files) => files.clone(),
        shards::Selection::Directory(dir) | shards::Selection::File(dir) => vec![dir.clone()],
    };
    if files.iter().all(|f| webdataset::is_shard_name(f)) {
        return Ok(Arc::new(webdataset::WebDataset::open_selection(
            selection, options,
        )?));
    }
    Ok(Arc::new(tfrecord::Records::open_selection(
        selection, options,
    )?))
}

/// How [`open`] recognises one format on disk, and opens it. Each format module defines its
/// own; [`RECOGNIZED`] lists them.
#[derive(Clone, Copy)]
pub(crate) struct Recognizer {
    /// Whether `path` holds this format. Asked in [`RECOGNIZED`] order; the first that says
    /// yes opens the path, and an error stops the search (the path is this format's, and
    /// cannot be opened as it is).
    pub holds: fn(&Path) -> Result<bool>,
    /// Opens the dataset at `path`.
    pub open: fn(&Path, &OpenOptions) -> Result<Arc<dyn Dataset>>,
}

/// Every format [`open`] reads, in the order it asks them: directories first (an LMDB in
/// directory form, TFRecord shards, an MDS `index.json`, WebDataset shards, then any directory
/// as an ImageFolder tree), then files by signature (HDF5) or name (a TFRecord shard, a `.tar`,
/// an MDS `index.json`), and LMDB, recognised by its magic, last. A new
/// format is a module with its [`Recognizer`] and one line here.
const RECOGNIZED: &[Recognizer] = &[
    lmdb::DIRECTORY_FORM,
    tfrecord::DIRECTORY,
    mds::DIRECTORY,
    webdataset::DIRECTORY,
    folder::TREE,
    hdf5::FILE,
    tfrecord::SHARD,
    webdataset::SHARD,
    mds::INDEX_FILE,
    lmdb::FILE,
];
