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
//! O(1) access to any record; reading returns `image/encoded` as a slice of the mapped shard
//! (zero-copy). Both CRCs are checked on every read: a corrupt record, or one an index places
//! past the end of a truncated shard, is a bad sample naming the shard and record, never a crash.
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
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::decode::{PayloadFormat, RawImage};
use crate::error::{Error, IoContext as _, Result};
use crate::format::example::{self, FeatureValue};
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, PackedRecord, WriterOptions};
use crate::format::{Recognizer, output};

/// The `magic` value in the manifest.
pub const MAGIC: &str = "imagefeed-records";
/// The layout version this build writes and the newest it reads.
pub const VERSION: u32 = 1;
/// The manifest's file name inside a records directory.
pub const MANIFEST: &str = "imagefeed-records.json";
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
    /// `JPEG`, `PNG`, …
    pub const FORMAT: &str = "image/format";
    /// Path relative to the ImageFolder root.
    pub const FILENAME: &str = "image/filename";
    /// Height in pixels (int64).
    pub const HEIGHT: &str = "image/height";
    /// Width in pixels (int64).
    pub const WIDTH: &str = "image/width";
}

const MASK_DELTA: u32 = 0xa282_ead8;
const HEADER_BYTES: usize = 12;
const FOOTER_BYTES: usize = 4;

/// TFRecord's masked CRC-32C.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Appends one TFRecord frame holding `data` to `out`.
pub fn frame(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// Checks the frame at the start of `bytes` (exactly one record's bytes, as an index gives them)
/// and returns its data.
pub fn unframe(bytes: &[u8]) -> std::result::Result<&[u8], String> {
    if bytes.len() < HEADER_BYTES + FOOTER_BYTES {
        return Err(format!(
            "{} bytes is shorter than a TFRecord frame",
            bytes.len()
        ));
    }
    let len_bytes = &bytes[..8];
    let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    let len_crc = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if masked_crc(len_bytes) != len_crc {
        return Err("the length's CRC does not match (corrupt record header)".into());
    }
    if len != (bytes.len() - HEADER_BYTES - FOOTER_BYTES) as u64 {
        return Err(format!(
            "the frame says {len} data bytes but the index gives the record {} bytes",
            bytes.len()
        ));
    }
    let data = &bytes[HEADER_BYTES..bytes.len() - FOOTER_BYTES];
    let data_crc = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().expect("4 bytes"));
    if masked_crc(data) != data_crc {
        return Err("the data's CRC does not match (corrupt record)".into());
    }
    Ok(data)
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

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    magic: String,
    version: u32,
    complete: bool,
    label_base: u32,
    shards: Vec<ShardEntry>,
    #[serde(flatten)]
    info: DatasetInfo,
}

/// True when the directory `path` is a records dataset or staging directory an imagefeed writer
/// made: its manifest or progress record carries [`MAGIC`].
pub(crate) fn is_own_dir(path: &Path) -> bool {
    output::staged_magic(path, MANIFEST).as_deref() == Some(MAGIC)
        || output::staged_magic(path, PROGRESS).as_deref() == Some(MAGIC)
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

// ---------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------

pub(crate) const PROGRESS: &str = "progress.json";

/// What `OUT.partial/progress.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StagedProgress {
    magic: String,
    plan: PackPlan,
    progress: PackProgress,
    label_base: u32,
    shard_bytes: u64,
    /// Committed shards; the last one is the one being written. `bytes` and `records` are the
    /// committed amounts; `index_bytes` the index file's committed length.
    shards: Vec<(ShardEntry, u64)>,
}

/// Writes record shards into `OUT.partial/` and renames the directory when finished.
pub struct RecordsWriter {
    partial: PathBuf,
    /// Held while writing: see [`output::lock_staging`].
    _lock: fs::File,
    out: PathBuf,
    staged: StagedProgress,
    shard: Option<(fs::File, fs::File)>,
    classes: Vec<String>,
    example: Vec<u8>,
    framed: Vec<u8>,
    index_lines: String,
    decoder: crate::decode::Decoder,
}

impl RecordsWriter {
    fn open_shard_files(&self, entry: &ShardEntry, create: bool) -> Result<(fs::File, fs::File)> {
        let open = |name: &str| output::open_staged_file(&self.partial, name, create);
        Ok((open(&entry.file)?, open(&entry.index)?))
    }

    fn save_progress(&self) -> Result<()> {
        output::write_file_atomically(
            &self.partial.join(PROGRESS),
            &serde_json::to_vec(&self.staged).expect("progress serializes"),
        )
    }

    fn sync_open_shard(&self) -> Result<()> {
        if let (Some((shard, index)), Some((entry, _))) = (&self.shard, self.staged.shards.last()) {
            shard.sync_data().at(self.partial.join(&entry.file))?;
            index.sync_data().at(self.partial.join(&entry.index))?;
        }
        Ok(())
    }

    /// Appends one framed record (in `self.framed`) to the open shard, rolling over to a new
    /// shard first when the open one is full.
    fn append(&mut self) -> Result<()> {
        use std::os::unix::fs::FileExt as _;
        let full = self.staged.shards.last().is_none_or(|(entry, _)| {
            entry.records > 0 && entry.bytes + self.framed.len() as u64 > self.staged.shard_bytes
        });
        if full {
            self.sync_open_shard()?;
            let (file, index) = shard_names(self.staged.shards.len());
            let entry = ShardEntry {
                file,
                index,
                records: 0,
                bytes: 0,
            };
            self.shard = Some(self.open_shard_files(&entry, true)?);
            self.staged.shards.push((entry, 0));
        }
        let (entry, index_bytes) = self.staged.shards.last_mut().expect("a shard is open");
        let (shard, index) = self.shard.as_ref().expect("a shard is open");
        shard
            .write_all_at(&self.framed, entry.bytes)
            .at(self.partial.join(&entry.file))?;
        self.index_lines.clear();
        push_index_line(&mut self.index_lines, entry.bytes, self.framed.len() as u64);
        index
            .write_all_at(self.index_lines.as_bytes(), *index_bytes)
            .at(self.partial.join(&entry.index))?;
        entry.bytes += self.framed.len() as u64;
        entry.records += 1;
        *index_bytes += self.index_lines.len() as u64;
        Ok(())
    }
}

impl DatasetWriter for RecordsWriter {
    fn start(out: &Path, plan: &PackPlan, options: &WriterOptions) -> Result<(Self, PackProgress)> {
        let (mode, shard_bytes, label_base) =
            (options.mode, options.shard_bytes, options.label_base);
        let partial = output::prepare_output(out, mode)?;
        let out = std::path::absolute(out).at(out)?;
        let resuming = partial.exists();
        if !resuming {
            fs::create_dir(&partial).at(&partial)?;
        }
        let lock = output::lock_staging(&partial)?;
        // A run killed before its first progress record committed nothing: start afresh.
        let resuming = resuming && !output::nothing_committed(&partial, PROGRESS);
        if !resuming {
            output::clear_uncommitted(&partial)?;
        }
        let staged = if resuming {
            if !partial.join(PROGRESS).exists() && partial.join(MANIFEST).exists() {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: "it holds a complete records dataset (an interrupted --force \
                             replacement, or a pack whose final rename was cut short), so \
                             there is nothing to resume: use --force to pack again, or rename \
                             it yourself if it is the dataset you want"
                        .into(),
                });
            }
            let staged: StagedProgress =
                output::read_staged_progress(&partial, PROGRESS, "records directory")?;
            staged.plan.check_resumable(plan, &partial)?;
            if (staged.shard_bytes, staged.label_base) != (shard_bytes, label_base) {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: "it was started with another --shard-size or --label-base".into(),
                });
            }
            // The writer names shard i `shard-{i:05}.*` and nothing else: a progress record
            // naming other files (`../x`, an absolute path) is not ours, and is never followed.
            for (number, (entry, _)) in staged.shards.iter().enumerate() {
                let (file, index) = shard_names(number);
                if (entry.file.as_str(), entry.index.as_str()) != (&file, &index) {
                    return Err(Error::ResumeMismatch {
                        path: partial.join(PROGRESS),
                        reason: format!(
                            "shard {number} is recorded as {:?} and {:?}; this writer names it \
                             {file:?} and {index:?}: not a progress record of ours",
                            entry.file, entry.index
                        ),
                    });
                }
            }
            staged
        } else {
            StagedProgress {
                magic: MAGIC.into(),
                plan: plan.clone(),
                progress: PackProgress::default(),
                label_base,
                shard_bytes,
                shards: Vec::new(),
            }
        };
        let mut writer = RecordsWriter {
            _lock: lock,
            partial,
            out,
            classes: plan.classes.clone(),
            staged,
            shard: None,
            example: Vec::new(),
            framed: Vec::new(),
            index_lines: String::new(),
            decoder: crate::decode::Decoder::new(),
        };
        // Cut every listed shard and index back to its committed length (only the last can
        // have grown since, but checking all costs nothing), and reopen the last one.
        for (entry, index_bytes) in writer.staged.shards.clone() {
            let shard = writer.open_shard_files(&entry, false)?;
            output::cut_to_committed(&shard.0, &writer.partial.join(&entry.file), entry.bytes)?;
            output::cut_to_committed(&shard.1, &writer.partial.join(&entry.index), index_bytes)?;
            writer.shard = Some(shard);
        }
        // Shards opened after the last commit (a crash right after rollover) are not listed.
        let listed = writer.staged.shards.len();
        for number in listed..listed + 2 {
            let (file, index) = shard_names(number);
            let _ = fs::remove_file(writer.partial.join(file));
            let _ = fs::remove_file(writer.partial.join(index));
        }
        writer.save_progress()?;
        let progress = writer.staged.progress.clone();
        Ok((writer, progress))
    }

    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()> {
        for record in records {
            let (format, width, height) = match PayloadFormat::sniff(record.payload) {
                Some(PayloadFormat::Raw) => {
                    let (w, h, _) =
                        RawImage::parse(record.payload).map_err(|e| Error::Rejected {
                            path: PathBuf::from(record.key),
                            reason: e.to_string(),
                        })?;
                    ("RAW-RGB8", w, h)
                }
                _ => {
                    let header =
                        self.decoder
                            .header(record.payload)
                            .map_err(|e| Error::Rejected {
                                path: PathBuf::from(record.key),
                                reason: e.to_string(),
                            })?;
                    (format_name(header.format), header.width, header.height)
                }
            };
            let label = i64::from(record.label) + i64::from(self.staged.label_base);
            let synset = self
                .classes
                .get(record.label as usize)
                .map_or("", String::as_str);
            example::encode(
                &mut self.example,
                &[
                    (features::ENCODED, FeatureValue::Bytes(record.payload)),
                    (features::LABEL, FeatureValue::Int64(label)),
                    (features::SYNSET, FeatureValue::Bytes(synset.as_bytes())),
                    (features::FORMAT, FeatureValue::Bytes(format.as_bytes())),
                    (
                        features::FILENAME,
                        FeatureValue::Bytes(record.key.as_bytes()),
                    ),
                    (features::HEIGHT, FeatureValue::Int64(height.into())),
                    (features::WIDTH, FeatureValue::Int64(width.into())),
                ],
            );
            self.framed.clear();
            frame(&mut self.framed, &self.example);
            self.append()?;
        }
        self.sync_open_shard()?;
        self.staged.progress = progress.clone();
        self.save_progress()
    }

    fn finish(mut self: Box<Self>, info: &DatasetInfo, progress: &PackProgress) -> Result<()> {
        self.sync_open_shard()?;
        self.staged.progress = progress.clone();
        let manifest = Manifest {
            magic: MAGIC.into(),
            version: VERSION,
            complete: true,
            label_base: self.staged.label_base,
            shards: self.staged.shards.iter().map(|(e, _)| e.clone()).collect(),
            info: info.clone(),
        };
        output::write_file_atomically(
            &self.partial.join(MANIFEST),
            &serde_json::to_vec_pretty(&manifest).expect("manifest serializes"),
        )?;
        let _ = fs::remove_file(self.partial.join(PROGRESS));
        output::publish(&self.partial, &self.out)
    }

    fn abandon(self: Box<Self>) {
        let _ = fs::remove_dir_all(&self.partial);
    }
}

/// The `image/format` value for a payload format (TensorFlow's ImageNet scripts write `JPEG`).
fn format_name(format: PayloadFormat) -> &'static str {
    match format {
        PayloadFormat::Jpeg => "JPEG",
        PayloadFormat::Png => "PNG",
        PayloadFormat::Bmp => "BMP",
        PayloadFormat::Pnm => "PNM",
        PayloadFormat::Tiff => "TIFF",
        PayloadFormat::WebP => "WEBP",
        PayloadFormat::Raw => "RAW-RGB8",
    }
}

// ---------------------------------------------------------------------------------------------
// Reader
// ---------------------------------------------------------------------------------------------

/// How to read TFRecord shards that carry no imagefeed manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordsOptions {
    /// The smallest label in the shards (ImageNet TFRecords: 1). Ignored when a manifest says.
    pub label_base: Option<u32>,
    /// Number of classes; when unset, found by scanning every record's label at open.
    pub num_classes: Option<usize>,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// `(offset, length)` of each record.
    records: Vec<(u64, u64)>,
    /// Records that are damaged byte ranges a scan could not frame, by position in `records`,
    /// with what the scan found; reading one is a bad record that says so.
    damaged: std::collections::HashMap<usize, String>,
    /// Whether `records` came from scanning a shard that has no index file and scanned clean:
    /// an index [`Records::save_missing_indexes`] may save.
    unsaved_index: bool,
}

struct Shared {
    path: PathBuf,
    info: DatasetInfo,
    label_base: u32,
    shards: Vec<Shard>,
    /// Index of each shard's first record; a final entry holds the total.
    starts: Vec<usize>,
    notices: Vec<String>,
}

impl Shared {
    /// The shard holding record `index` (`< num_samples`), and the record's place in it.
    fn locate(&self, index: usize) -> (&Shard, usize) {
        let shard_number = self.starts.partition_point(|&s| s <= index) - 1;
        (
            &self.shards[shard_number],
            index - self.starts[shard_number],
        )
    }
}

/// Record shards opened for reading.
pub struct Records {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("path", &self.shared.path)
            .field("info", &self.shared.info)
            .field("shards", &self.shared.shards.len())
            .finish()
    }
}

/// True when `path` looks like a TFRecord shard by name.
pub fn is_shard_name(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    if matches!(
        path.extension().and_then(|e| e.to_str()),
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

/// The index file for a shard: `x.index` for `x.tfrecord`, else the shard name plus `.index`.
pub fn index_path_for(shard: &Path) -> PathBuf {
    match shard.extension().and_then(|e| e.to_str()) {
        Some("tfrecord" | "tfrecords" | "tfr") => shard.with_extension("index"),
        _ => {
            let mut name = shard.as_os_str().to_owned();
            name.push(".index");
            PathBuf::from(name)
        }
    }
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
    Ok(Arc::new(Records::open_with(path, &options.records)?))
}

impl Records {
    /// Opens a records directory (ours or foreign) or a single shard with default options.
    pub fn open(path: impl AsRef<Path>) -> Result<Records> {
        Self::open_with(path, &RecordsOptions::default())
    }

    /// Opens a records directory or a single shard.
    pub fn open_with(path: impl AsRef<Path>, options: &RecordsOptions) -> Result<Records> {
        let path = path.as_ref();
        output::refuse_interrupted(path)?;
        let manifest_path = path.join(MANIFEST);
        if path.is_dir() && manifest_path.is_file() {
            return open_ours(path, &manifest_path);
        }
        // A writer's staging directory holds shards and indexes that look like a foreign
        // dataset's, but only some of the records: it is never opened as one.
        if path.is_dir()
            && (output::staged_magic(path, PROGRESS).as_deref() == Some(MAGIC)
                || output::is_being_deleted(path)
                || path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with(".partial")))
        {
            return Err(Error::Incomplete {
                path: path.to_path_buf(),
                reason: "the staging directory of an interrupted or replaced pack, not a dataset; \
                         rerun the pack with --resume to finish it"
                    .into(),
            });
        }
        let shard_paths: Vec<PathBuf> = if path.is_dir() {
            let mut found: Vec<PathBuf> = fs::read_dir(path)
                .at(path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && is_shard_name(p))
                .collect();
            found.sort();
            found
        } else {
            fs::metadata(path).at(path)?;
            vec![path.to_path_buf()]
        };
        if shard_paths.is_empty() {
            return Err(Error::not_a_dataset(
                path,
                format!("no {MANIFEST} and no TFRecord shards (*.tfrecord, *-NNNNN-of-NNNNN)"),
            ));
        }
        open_foreign(path, &shard_paths, options)
    }

    /// The label base: stored labels are class index + this.
    pub fn label_base(&self) -> u32 {
        self.shared.label_base
    }

    /// Saves the index each shard opened without one got by scanning (in the `tfrecord`
    /// package's format, at [`index_path_for`] the shard), so later opens read it instead of
    /// scanning. Opening never writes; this is the explicit request (`pack-dataset index`).
    /// Returns the indexes written.
    ///
    /// A shard whose scan found damage gets none (it is scanned, and the damage reported,
    /// at every open), and an index file that appeared since opening is left as it is. Each
    /// index is written to a temporary file, synced and renamed into place, never through a
    /// link; an error names the file and leaves the indexes already written in place.
    pub fn save_missing_indexes(&self) -> Result<Vec<PathBuf>> {
        let mut written = Vec::new();
        for shard in self.shared.shards.iter().filter(|s| s.unsaved_index) {
            let index_path = index_path_for(&shard.path);
            if fs::symlink_metadata(&index_path).is_ok() {
                continue;
            }
            let mut lines = String::new();
            for &(offset, len) in &shard.records {
                push_index_line(&mut lines, offset, len);
            }
            output::write_file_atomically(&index_path, lines.as_bytes())?;
            written.push(index_path);
        }
        Ok(written)
    }
}

fn map_file(path: &Path) -> Result<Mmap> {
    let (file, _) = crate::file::open_regular(path)?;
    // SAFETY: the mapping is read-only, and imagefeed never modifies a published shard. Another
    // process truncating the file while it is mapped would make reads past the new end fault;
    // every read is first checked against the length the file had when mapped.
    unsafe { Mmap::map(&file) }.at(path)
}

/// Appends one index line, `"<offset> <length>\n"` (the `tfrecord` package's format, which
/// [`parse_index`] reads).
fn push_index_line(index: &mut String, offset: u64, len: u64) {
    use std::fmt::Write as _;
    let _ = writeln!(index, "{offset} {len}");
}

/// Parses an index: one `"<offset> <length>"` line per record.
pub(crate) fn parse_index(path: &Path, text: &[u8]) -> Result<Vec<(u64, u64)>> {
    let text = std::str::from_utf8(text)
        .map_err(|_| Error::not_a_dataset(path, "index file is not text"))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            let mut parts = line.split_whitespace();
            let parse = |s: Option<&str>| s.and_then(|s| s.parse::<u64>().ok());
            match (parse(parts.next()), parse(parts.next()), parts.next()) {
                (Some(offset), Some(len), None) => Ok((offset, len)),
                _ => Err(Error::not_a_dataset(
                    path,
                    format!(
                        "index line {} is not \"<offset> <length>\": {line:?}",
                        number + 1
                    ),
                )),
            }
        })
        .collect()
}

/// What [`scan_shard`] found: every record's `(offset, length)` in file order, and the entries
/// among them that are damaged byte ranges rather than records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardScan {
    /// `(offset, length)` of each entry; together they cover the whole shard.
    pub records: Vec<(u64, u64)>,
    /// `(position in records, what is wrong)` for each damaged range.
    pub damaged: Vec<(usize, String)>,
}

/// Builds an index by walking the frames of a shard, from its first byte to its last.
///
/// A frame whose length CRC is wrong, whose declared length runs past the end, or a tail too
/// short for a header does not end the walk: the bytes from there to the next place where a
/// whole frame checks out (length CRC, length and data CRC) become one damaged entry, and the
/// walk goes on from that frame. So nothing after damage is silently dropped: a damaged range is
/// a record that reads as bad, named with the reason, and the shard keeps every good record.
pub fn scan_shard(bytes: &[u8]) -> ShardScan {
    let mut scan = ShardScan::default();
    let mut offset = 0usize;
    while offset < bytes.len() {
        match frame_at(bytes, offset) {
            Ok(total) => {
                scan.records.push((offset as u64, total as u64));
                offset += total;
            }
            Err(problem) => {
                let next = (offset + 1..bytes.len())
                    .find(|&o| frame_at(bytes, o).is_ok_and(|_| full_frame_ok(bytes, o)))
                    .unwrap_or(bytes.len());
                let reason = format!(
                    "bytes {offset}..{next} of the shard are not a TFRecord frame ({problem}){}",
                    if next == bytes.len() {
                        " and nothing after them is"
                    } else {
                        "; the next frame starts after them"
                    }
                );
                scan.damaged.push((scan.records.len(), reason));
                scan.records.push((offset as u64, (next - offset) as u64));
                offset = next;
            }
        }
    }
    scan
}

/// The total length of the frame whose header starts at `offset`, when the header's CRC checks
/// out and the frame fits in `bytes`; otherwise what is wrong.
fn frame_at(bytes: &[u8], offset: usize) -> std::result::Result<usize, String> {
    let rest = &bytes[offset..];
    if rest.len() < HEADER_BYTES + FOOTER_BYTES {
        return Err(format!("{} bytes left, too few for a frame", rest.len()));
    }
    let len_bytes = &rest[..8];
    let crc = u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes"));
    if masked_crc(len_bytes) != crc {
        return Err("bad length CRC".into());
    }
    let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    let total = len.saturating_add((HEADER_BYTES + FOOTER_BYTES) as u64);
    if total > rest.len() as u64 {
        return Err(format!(
            "declares {len} data bytes but only {} are left",
            rest.len()
        ));
    }
    Ok(total as usize)
}

/// Whether the frame at `offset` (whose header [`frame_at`] accepted) has a good data CRC too:
/// the check that makes a place found by resynchronising a real frame.
fn full_frame_ok(bytes: &[u8], offset: usize) -> bool {
    frame_at(bytes, offset).is_ok_and(|total| unframe(&bytes[offset..offset + total]).is_ok())
}

/// Refuses an index that does not account for every byte of its shard: its records must follow
/// one another from byte 0 to at least the shard's end. A stale or cut index would otherwise make
/// the records it does not list silently unreachable. (An index reaching past the end is a cut
/// shard: the records past the end read as bad records that say so.) Returns where the index
/// says the shard ends.
pub(crate) fn check_index_covers(
    index_path: &Path,
    records: &[(u64, u64)],
    shard_len: u64,
) -> Result<u64> {
    let mut end = 0u64;
    for (number, &(offset, len)) in records.iter().enumerate() {
        if offset != end {
            return Err(Error::not_a_dataset(
                index_path,
                format!(
                    "record {number} starts at byte {offset}, but the one before ends at {end}: \
                     the index does not match its shard (delete it to have it rebuilt)"
                ),
            ));
        }
        end = offset.saturating_add(len);
    }
    if end < shard_len {
        return Err(Error::not_a_dataset(
            index_path,
            format!(
                "lists records up to byte {end} but the shard has {shard_len} bytes: the index or \
                 the shard was changed (delete the index to have it rebuilt)"
            ),
        ));
    }
    Ok(end)
}

fn open_ours(dir: &Path, manifest_path: &Path) -> Result<Records> {
    let text = fs::read_to_string(manifest_path).at(manifest_path)?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| Error::not_a_dataset(manifest_path, format!("malformed manifest: {e}")))?;
    crate::format::check_layout(
        manifest_path,
        "magic",
        &manifest.magic,
        MAGIC,
        manifest.version,
        VERSION,
    )?;
    crate::format::require_complete(dir, manifest.complete, "the manifest")?;
    // Every shard and index the manifest names is a plain file name inside `dir`, named once:
    // a manifest naming `../x`, an absolute path or one shard twice is not one we wrote.
    let mut named = std::collections::HashSet::new();
    for name in manifest.shards.iter().flat_map(|e| [&e.file, &e.index]) {
        let mut components = Path::new(name).components();
        let plain = matches!(components.next(), Some(std::path::Component::Normal(_)))
            && components.next().is_none();
        if !plain || !named.insert(name.as_str()) {
            return Err(Error::not_a_dataset(
                manifest_path,
                format!(
                    "the manifest names {name:?} {}: a manifest of ours names each shard and \
                     index once, as a file in its own directory",
                    if plain { "twice" } else { "as a path" }
                ),
            ));
        }
    }
    let mut shards = Vec::with_capacity(manifest.shards.len());
    for entry in &manifest.shards {
        let path = dir.join(&entry.file);
        let index_path = dir.join(&entry.index);
        let map = map_file(&path)?;
        let index = {
            use std::io::Read as _;
            let (file, len) = crate::file::open_regular(&index_path)?;
            let mut index = Vec::with_capacity(len.min(1 << 30) as usize);
            file.take(len).read_to_end(&mut index).at(&index_path)?;
            index
        };
        let records = parse_index(&index_path, &index)?;
        // The index must list the shard as the manifest describes it. A shard cut short since
        // leaves its last records unreadable, each a bad record that says so; a longer one holds
        // bytes that no record of ours covers.
        let end = check_index_covers(&index_path, &records, entry.bytes)?;
        if end != entry.bytes || map.len() as u64 > entry.bytes {
            return Err(Error::not_a_dataset(
                &index_path,
                format!(
                    "the index ends at byte {end}, the shard has {} bytes, the manifest says {}: \
                     the shard or its index was changed",
                    map.len(),
                    entry.bytes
                ),
            ));
        }
        if records.len() != entry.records {
            return Err(Error::not_a_dataset(
                &index_path,
                format!(
                    "lists {} records but the manifest says {}",
                    records.len(),
                    entry.records
                ),
            ));
        }
        shards.push(Shard {
            path,
            map,
            records,
            damaged: Default::default(),
            unsaved_index: false,
        });
    }
    // Shards that together fit in half the available memory stream into the page cache in one
    // sequential read each, as an LMDB does (see `pagecache`), instead of a fault per page.
    let total: u64 = shards.iter().map(|s| s.map.len() as u64).sum();
    if crate::pagecache::available_memory().is_some_and(|available| total <= available / 2) {
        for shard in &shards {
            // Advice only: failure changes nothing but speed.
            let _ = shard.map.advise(memmap2::Advice::WillNeed);
        }
    }
    let mut info = manifest.info;
    info.format = FormatKind::Records;
    let starts = starts(&shards);
    if starts.last() != Some(&info.num_samples) {
        return Err(Error::not_a_dataset(
            manifest_path,
            format!(
                "the shards hold {} records but the manifest says {}",
                starts.last().copied().unwrap_or(0),
                info.num_samples
            ),
        ));
    }
    Ok(Records {
        shared: Arc::new(Shared {
            path: dir.to_path_buf(),
            info,
            label_base: manifest.label_base,
            shards,
            starts,
            notices: Vec::new(),
        }),
    })
}

fn starts(shards: &[Shard]) -> Vec<usize> {
    let mut starts = Vec::with_capacity(shards.len() + 1);
    let mut total = 0;
    starts.push(0);
    for shard in shards {
        total += shard.records.len();
        starts.push(total);
    }
    starts
}

fn open_foreign(path: &Path, shard_paths: &[PathBuf], options: &RecordsOptions) -> Result<Records> {
    let mut notices = Vec::new();
    let mut shards = Vec::with_capacity(shard_paths.len());
    for shard_path in shard_paths {
        let map = map_file(shard_path)?;
        let index_path = index_path_for(shard_path);
        let (records, damaged, unsaved_index) = if index_path.is_file() {
            let records = parse_index(&index_path, &fs::read(&index_path).at(&index_path)?)?;
            check_index_covers(&index_path, &records, map.len() as u64)?;
            (records, Default::default(), false)
        } else {
            let scan = scan_shard(&map);
            let clean = scan.damaged.is_empty();
            crate::dataset::notice(
                &mut notices,
                format!(
                    "{}: no index; built one by scanning ({} records), {}",
                    shard_path.display(),
                    scan.records.len() - scan.damaged.len(),
                    if clean {
                        "kept in memory (`pack-dataset index` saves it)"
                    } else {
                        // One with damage is scanned again at every open, and says so every time.
                        "not saved: the shard is damaged"
                    }
                ),
            );
            for (number, reason) in &scan.damaged {
                crate::dataset::notice(
                    &mut notices,
                    format!(
                        "{}: record {number} is damaged and reads as a bad record: {reason}",
                        shard_path.display()
                    ),
                );
            }
            (scan.records, scan.damaged.into_iter().collect(), clean)
        };
        shards.push(Shard {
            path: shard_path.clone(),
            map,
            records,
            damaged,
            unsaved_index,
        });
    }
    let label_base = options.label_base.unwrap_or(0);
    let starts = starts(&shards);
    let num_samples = *starts.last().expect("starts has a total");
    let classes = match options.num_classes {
        Some(n) if n > crate::dataset::MAX_CLASSES => {
            return Err(Error::Options(format!(
                "{n} classes: at most {} are allowed",
                crate::dataset::MAX_CLASSES
            )));
        }
        Some(n) => (0..n).map(|c| c.to_string()).collect(),
        None => {
            // One pass over the labels: every record is parsed (its CRCs too); unreadable ones
            // are left for the reader to report as bad samples.
            let mut inference = crate::dataset::ClassInference::default();
            for shard in &shards {
                for (number, &(offset, len)) in shard.records.iter().enumerate() {
                    if let Some(bytes) = record_bytes(&shard.map, offset, len)
                        && let Ok(data) = unframe(bytes)
                        && let Ok(features) = example::parse(data)
                        && let Ok(label) = example::int64(&features, features::LABEL)
                    {
                        inference.see(
                            || format!("{} record {number}", shard.path.display()),
                            label.checked_sub(i64::from(label_base)),
                        );
                    }
                }
            }
            if num_samples > 0 && inference.is_empty() {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "no record has an {} in {label_base}..{} (the label base and the most \
                         classes allowed)",
                        features::LABEL,
                        i64::from(label_base) + crate::dataset::MAX_CLASSES as i64
                    ),
                ));
            }
            let (classes, notice) = inference.classes();
            notices.extend(notice);
            classes
        }
    };
    Ok(Records {
        shared: Arc::new(Shared {
            path: path.to_path_buf(),
            info: DatasetInfo {
                format: FormatKind::Records,
                classes,
                num_samples,
                payload: PayloadKind::Encoded,
                resized_short_side: None,
                part: None,
                rejected_at_pack: None,
            },
            label_base,
            shards,
            starts,
            notices,
        }),
    })
}

fn record_bytes(map: &[u8], offset: u64, len: u64) -> Option<&[u8]> {
    let end = offset.checked_add(len)?;
    map.get(usize::try_from(offset).ok()?..usize::try_from(end).ok()?)
}

impl Dataset for Records {
    fn info(&self) -> &DatasetInfo {
        &self.shared.info
    }

    fn notices(&self) -> &[String] {
        &self.shared.notices
    }

    fn path(&self) -> &Path {
        &self.shared.path
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(RecordsReader {
            shared: Arc::clone(&self.shared),
            key: String::new(),
        }))
    }
}

/// Per-worker handle over the shared maps.
struct RecordsReader {
    shared: Arc<Shared>,
    key: String,
}

impl RecordReader for RecordsReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        let shared = &*self.shared;
        assert!(
            index < shared.info.num_samples,
            "index {index} out of range for {} samples",
            shared.info.num_samples
        );
        let (shard, within) = shared.locate(index);
        let corrupt = |key: &str, reason: String| Error::CorruptRecord {
            path: shard.path.clone(),
            index,
            key: key.to_string(),
            reason: format!("record {within} of the shard: {reason}"),
        };
        if let Some(reason) = shard.damaged.get(&within) {
            return Err(corrupt("?", reason.clone()));
        }
        let (offset, len) = shard.records[within];
        let bytes = record_bytes(&shard.map, offset, len).ok_or_else(|| {
            corrupt(
                "?",
                format!(
                    "the index puts it at bytes {offset}..{} but the shard has {} (truncated?)",
                    offset.saturating_add(len),
                    shard.map.len()
                ),
            )
        })?;
        let data = unframe(bytes).map_err(|reason| corrupt("?", reason))?;
        let features = example::parse(data).map_err(|reason| corrupt("?", reason))?;
        let key = match example::bytes(&features, features::FILENAME)
            .ok()
            .and_then(|k| std::str::from_utf8(k).ok())
        {
            Some(key) => key,
            None => {
                self.key = format!("{}#{within}", shard.path.display());
                self.key.as_str()
            }
        };
        let payload =
            example::bytes(&features, features::ENCODED).map_err(|reason| corrupt(key, reason))?;
        let stored =
            example::int64(&features, features::LABEL).map_err(|reason| corrupt(key, reason))?;
        let base = i64::from(shared.label_base);
        if stored < base {
            return Err(corrupt(
                key,
                format!("label {stored} is below the label base {base}"),
            ));
        }
        let label = shared
            .info
            .check_stored_label(&shard.path, index, key, stored - base)?;
        Ok(Record {
            index,
            key,
            label,
            payload,
        })
    }

    fn prefetch(&mut self, index: usize) {
        let shared = &*self.shared;
        if index >= shared.info.num_samples {
            return;
        }
        let (shard, within) = shared.locate(index);
        let (offset, len) = shard.records[within];
        if let Some(bytes) = record_bytes(&shard.map, offset, len) {
            crate::dataset::prefetch(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_is_castagnoli() {
        // The CRC-32C check value; the mask itself is checked against TensorFlow-format files
        // written by the Python tfrecord package (tests/compat.rs).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_ne!(masked_crc(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn frames_round_trip_and_corruption_is_detected() {
        let mut shard = Vec::new();
        frame(&mut shard, b"first");
        frame(&mut shard, b"second record");
        let scan = scan_shard(&shard);
        assert_eq!(scan.damaged, []);
        assert_eq!(scan.records, [(0, 21), (21, 29)]);
        assert_eq!(unframe(&shard[21..]).unwrap(), b"second record");

        let mut bad = shard.clone();
        bad[21 + 14] ^= 1; // a data byte of the second record
        assert!(unframe(&bad[21..]).unwrap_err().contains("data's CRC"));
        let mut bad = shard.clone();
        bad[21] ^= 1; // its length
        assert!(unframe(&bad[21..]).unwrap_err().contains("length's CRC"));
        let scan = scan_shard(&bad);
        assert_eq!(scan.records, [(0, 21), (21, 29)]);
        assert_eq!(scan.damaged.len(), 1);
        assert_eq!(scan.damaged[0].0, 1);
        assert!(
            scan.damaged[0].1.contains("bytes 21..50"),
            "{:?}",
            scan.damaged
        );
        assert!(scan.damaged[0].1.contains("bad length CRC"));

        let scan = scan_shard(&shard[..40]);
        assert_eq!(scan.records, [(0, 21), (21, 19)]);
        assert_eq!(scan.damaged.len(), 1);
        assert!(
            scan.damaged[0]
                .1
                .contains("declares 13 data bytes but only 19 are left")
        );
    }

    #[test]
    fn a_damaged_frame_costs_only_its_own_bytes() {
        let mut shard = Vec::new();
        for data in [&b"first"[..], b"second record", b"third"] {
            frame(&mut shard, data);
        }
        // The second record's length CRC, then instead a huge length with a valid CRC.
        let mut bad_crc = shard.clone();
        bad_crc[21 + 8] ^= 0xFF;
        let mut huge = shard.clone();
        let len = (1u64 << 60).to_le_bytes();
        huge[21..29].copy_from_slice(&len);
        huge[29..33].copy_from_slice(&masked_crc(&len).to_le_bytes());
        for (what, bytes) in [("bad CRC", bad_crc), ("huge length", huge)] {
            let scan = scan_shard(&bytes);
            assert_eq!(scan.records, [(0, 21), (21, 29), (50, 21)], "{what}");
            assert_eq!(scan.damaged.len(), 1, "{what}");
            assert_eq!(scan.damaged[0].0, 1, "{what}");
            assert!(
                scan.damaged[0]
                    .1
                    .contains("the next frame starts after them"),
                "{what}: {}",
                scan.damaged[0].1
            );
            assert_eq!(unframe(&bytes[50..]).unwrap(), b"third");
        }
        // Stray bytes after the last frame are damage too, never ignored.
        let mut tail = shard.clone();
        tail.extend_from_slice(b"junk");
        let scan = scan_shard(&tail);
        assert_eq!(scan.records.last(), Some(&(71, 4)));
        assert!(scan.damaged[0].1.contains("nothing after them is"));
    }

    #[test]
    fn an_index_must_cover_its_shard() {
        let path = Path::new("x.index");
        assert_eq!(
            check_index_covers(path, &[(0, 21), (21, 29)], 50).unwrap(),
            50
        );
        // A shard cut after its index was written: the last record reads as truncated.
        assert_eq!(
            check_index_covers(path, &[(0, 21), (21, 29)], 40).unwrap(),
            50
        );
        let short = check_index_covers(path, &[(0, 21)], 50).unwrap_err();
        assert!(
            short
                .to_string()
                .contains("up to byte 21 but the shard has 50")
        );
        let gap = check_index_covers(path, &[(0, 21), (30, 20)], 50).unwrap_err();
        assert!(gap.to_string().contains("record 1 starts at byte 30"));
    }

    #[test]
    fn shard_names_and_index_paths() {
        assert!(is_shard_name(Path::new("/d/train-00000-of-01024")));
        assert!(is_shard_name(Path::new("/d/x.tfrecord")));
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
