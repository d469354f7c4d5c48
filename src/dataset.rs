//! The sample model shared by every format, and the reader trait the loader depends on.
//!
//! A dataset is an ordered list of records `{index, key, label, payload}` plus [`DatasetInfo`]
//! (class names, payload kind, sample count, completeness). `key` is the sample's path relative to
//! the ImageFolder root it came from, with `/` separators; `payload` is the encoded image file as
//! it was on disk, or decoded pixels in the [raw payload](crate::decode::RawImage) layout.
//!
//! Reading is split in two so that worker threads never share a handle:
//! [`Dataset`] is the shared, thread-safe description (`Send + Sync`, cheap to clone behind an
//! `Arc`), and [`RecordReader`] is a per-worker handle that [`Dataset::open_reader`] creates. A
//! handle keeps whatever per-thread state its format needs (an LMDB read transaction, a reusable
//! file buffer, the copy of a record taken out of a memory map under the SIGBUS guard) and
//! returns records that borrow from it.
//! [`LazyReader`] opens that handle on first use, which is what a worker thread wants.
//!
//! Panic versus error: an index `>= len()` is a bug in the caller and panics; anything the data on
//! disk can cause (a missing file, a corrupt record, a label out of range) returns `Err` naming the
//! file and record.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use rayon::prelude::*;

use crate::decode::Decoder;
use crate::error::{Error, Result};

/// What a dataset's payloads hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PayloadKind {
    /// Encoded image files (JPEG, PNG, ...), byte for byte as they were packed.
    Encoded,
    /// Decoded 8-bit RGB pixels in the [`RawImage`](crate::decode::RawImage) layout.
    RawRgb8,
}

/// Which on-disk format a dataset is stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FormatKind {
    /// A torchvision-style ImageFolder tree, read file by file.
    Folder,
    /// A single-file LMDB (ours, or a Python folder2lmdb one).
    Lmdb,
    /// An HDF5 file (ours, or an h5py file in one of the common layouts).
    Hdf5,
    /// TFRecord shards holding `tf.train.Example` records.
    Records,
    /// WebDataset tar shards.
    WebDataset,
    /// Mosaic MDS shards (MosaicML Streaming's `MDSWriter`).
    Mds,
}

impl FormatKind {
    /// The short name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            FormatKind::Folder => "folder",
            FormatKind::Lmdb => "lmdb",
            FormatKind::Hdf5 => "hdf5",
            FormatKind::Records => "records",
            FormatKind::WebDataset => "webdataset",
            FormatKind::Mds => "mds",
        }
    }
}

/// Dataset-level metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetInfo {
    /// The storage format.
    pub format: FormatKind,
    /// Class names; a record's label indexes this list.
    pub classes: Vec<String>,
    /// Number of records.
    pub num_samples: usize,
    /// What the payloads hold.
    pub payload: PayloadKind,
    /// Set when images were shrunk at pack time so that their shorter side is at most this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resized_short_side: Option<u32>,
    /// Set when this dataset is one part of a conversion split across machines
    /// (`--num-parts/--part-index`); `pack-dataset join` puts the parts together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<PartInfo>,
    /// How many source files the pack that wrote this dataset rejected (the pack report lists
    /// them); `None` for datasets imagefeed did not pack, or packed before this was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected_at_pack: Option<usize>,
    /// Set when the JPEGs were rewritten at pack time with restart markers
    /// (`--restart-markers`): the same pixels as the source files, other bytes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restart_markers: bool,
}

/// Which part of a split conversion a dataset holds.
///
/// The source listing (every file of the ImageFolder tree, or every record of a source dataset)
/// is cut into `count` contiguous ranges of nearly equal length; part `index` holds range
/// `index` (as [`PartInfo::range`] computes it). Joining the parts in index order gives exactly the
/// dataset an unsplit conversion would have written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartInfo {
    /// This part's number, `0..count`.
    pub index: usize,
    /// How many parts the source was split into.
    pub count: usize,
    /// Fingerprint of the whole source listing: parts of different sources never join.
    pub source_fingerprint: String,
    /// Number of source items in the whole listing.
    pub source_items: usize,
    /// The JPEG quality images were re-encoded at (`--resize` without `--raw`; `None`: none
    /// were): parts re-encoded at different qualities never join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<u8>,
}

impl PartInfo {
    /// The source items part `index` of `count` covers, for a listing of `items`.
    ///
    /// # Panics
    /// When `count == 0` or `index >= count`.
    pub fn range(items: usize, index: usize, count: usize) -> std::ops::Range<usize> {
        assert!(index < count, "part {index} of {count}");
        // In u128: the products overflow usize for numbers a damaged part's metadata may say
        // (2^40 items), and the quotients are at most `items`.
        let at = |part: usize| (items as u128 * part as u128 / count as u128) as usize;
        at(index)..at(index + 1)
    }
}

impl DatasetInfo {
    /// Returns `Err` naming the record when `label` is not a valid class index.
    ///
    /// Labels outside `0..num_classes` are what later becomes CUDA's opaque "device-side assert"
    /// in a loss function, so every reader checks them on the way out.
    pub fn check_label(&self, path: &Path, index: usize, key: &str, label: u32) -> Result<()> {
        self.check_stored_label(path, index, key, label.into())
            .map(|_| ())
    }

    /// [`check_label`](Self::check_label) for a label as a file stores it (any `i64`, negative
    /// or past `u32` included); returns it as a class index.
    pub fn check_stored_label(
        &self,
        path: &Path,
        index: usize,
        key: &str,
        label: i64,
    ) -> Result<u32> {
        match u32::try_from(label) {
            Ok(class) if (class as usize) < self.classes.len() => Ok(class),
            _ => Err(Error::CorruptRecord {
                path: path.to_path_buf(),
                index,
                key: key.to_string(),
                reason: format!(
                    "label {label} is outside 0..{} (the number of classes)",
                    self.classes.len()
                ),
            }),
        }
    }
}

/// The most classes a dataset may have when its file names none: classes are then inferred as
/// `"0"..="largest label"`, or given as a count, and 2²⁰ of them are more than any image dataset
/// has (ImageNet-21k: 21,841; Google Landmarks v2: 203,094). A label read from such a file at or
/// above this (2³¹ − 1, say, which would otherwise make a table of two billion names) does not
/// count towards the classes: its record reads as a bad record whose label is outside them.
pub const MAX_CLASSES: usize = 1 << 20;

/// Infers the classes of a file that names none from the labels of its records (see
/// [`MAX_CLASSES`]): feed it every `(record, label)` with [`see`](Self::see), then
/// [`classes`](Self::classes).
#[derive(Debug, Default)]
pub(crate) struct ClassInference {
    largest: Option<usize>,
    smallest: Option<usize>,
    ignored: usize,
    first_ignored: Option<(String, i64)>,
}

impl ClassInference {
    /// Counts one record's label (`None`: a label that is not even an integer in range, such as
    /// `i64::MIN` minus a label base). `record` names the record, for the notice. Returns
    /// whether the label is a class (in `0..MAX_CLASSES`); one that is not is left out.
    pub fn see(&mut self, record: impl FnOnce() -> String, label: Option<i64>) -> bool {
        match label
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l < MAX_CLASSES)
        {
            Some(label) => {
                self.largest = Some(self.largest.map_or(label, |m| m.max(label)));
                self.smallest = Some(self.smallest.map_or(label, |m| m.min(label)));
                true
            }
            None => {
                self.ignored += 1;
                if self.first_ignored.is_none() {
                    self.first_ignored = Some((record(), label.unwrap_or(i64::MIN)));
                }
                false
            }
        }
    }

    /// The classes `"0"..="largest label counted"`, and a notice when labels were left out.
    pub fn classes(self) -> (Vec<String>, Option<String>) {
        let classes = match self.largest {
            Some(largest) => (0..=largest).map(|c| c.to_string()).collect(),
            None => Vec::new(),
        };
        let notice = self.first_ignored.map(|(record, label)| {
            let message = format!(
                "{} record(s) have a label outside 0..{MAX_CLASSES} (the most classes a dataset \
                 without class names may have), the first {record} with label {label}; they \
                 read as bad records",
                self.ignored
            );
            log::warn!("{message}");
            message
        });
        (classes, notice)
    }

    /// The smallest label counted.
    pub fn smallest(&self) -> Option<usize> {
        self.smallest
    }

    /// True when no label was counted.
    pub fn is_empty(&self) -> bool {
        self.largest.is_none()
    }
}

/// One sample, borrowed from the reader that produced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// Position in the dataset, `0..len`.
    pub index: usize,
    /// Relative path of the source file, `/`-separated.
    pub key: &'a str,
    /// Class index, always `< classes.len()`.
    pub label: u32,
    /// Encoded image bytes or a raw payload, per [`DatasetInfo::payload`].
    pub payload: &'a [u8],
}

/// A dataset that can be read by many worker threads, each through its own handle.
pub trait Dataset: Send + Sync {
    /// Metadata: format, classes, sample count, payload kind.
    fn info(&self) -> &DatasetInfo;

    /// The path the dataset was opened from (for messages).
    fn path(&self) -> &Path;

    /// Opens a per-worker handle. Cheap enough to call once per worker thread; the handle is
    /// `Send`, so it may be created on one thread and used on another.
    fn open_reader(&self) -> Result<Box<dyn RecordReader>>;

    /// Number of records.
    fn len(&self) -> usize {
        self.info().num_samples
    }

    /// True when the dataset holds no records.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Class names, indexed by label.
    fn classes(&self) -> &[String] {
        &self.info().classes
    }

    /// Things opening the dataset did or found that the user should hear about (for example an
    /// index built for a TFRecord shard that had none); empty by default. Each was also
    /// reported through the [`log`] facade when it happened (`log::warn!`, target
    /// `imagefeed::…`), which is how the CLIs print them; this keeps them for programs that
    /// show them later (a pack report, `inspect --json`, Python's `Loader.notices`).
    fn notices(&self) -> &[String] {
        &[]
    }

    /// Shards of the dataset's set that are missing, when it was opened with
    /// [`allow_missing_shards`](crate::format::OpenOptions::allow_missing_shards) (a
    /// deliberate subset); empty for a whole dataset, and for formats that are not shards.
    fn missing_shards(&self) -> &MissingShards {
        static NONE: MissingShards = MissingShards::NONE;
        &NONE
    }

    /// For a dataset stored as shards: the index of each shard's first record, then the
    /// number of records (so shard `i` holds `starts[i]..starts[i + 1]`). What a shard window
    /// ([`Sampling::shard_window`](crate::sampler::Sampling::shard_window)) shuffles within;
    /// `None` for other datasets.
    fn shard_starts(&self) -> Option<&[usize]> {
        None
    }

    /// The key and label of record `index` when the dataset knows them without reading the
    /// record (an image folder's listing); `None` otherwise, and past the end.
    fn listed(&self, index: usize) -> Option<(&str, u32)> {
        let _ = index;
        None
    }

    /// Shards holding no record while others hold some: what a file created and never
    /// written, or a copy cut short, looks like, so `inspect` does not call such a dataset
    /// complete. A format whose index gives every shard's count, checked against the shard,
    /// says 0 (MDSWriter writes empty shards of its own).
    fn suspect_empty_shards(&self) -> usize {
        self.shard_starts().map_or(0, empty_members)
    }

    /// Each record's stored checksum (CRC-32C of its label, key and payload), in order, where
    /// the format keeps one for every record (imagefeed's LMDB and HDF5 layouts from version
    /// 2): what [`listing_digest`] hashes. `None` by default.
    fn record_checksums(&self) -> Option<&[u32]> {
        None
    }

    /// Where each record lies, for a format that keeps no checksum of each but an index of
    /// its records (record shards): every shard's file name, then the byte offset and length
    /// of each of its records, fed to `feed` in order. What [`listing_digest`] hashes where
    /// there are no [`record_checksums`](Self::record_checksums): a record replaced by one of
    /// another size moves every offset after it. `false` (nothing fed) by default.
    fn feed_record_extents(&self, feed: &mut dyn FnMut(&[u8])) -> bool {
        let _ = feed;
        false
    }

    /// Shards of a set holding fewer than half the samples its other shards hold, the last
    /// not compared ([`short_members`](crate::format::shards::short_members)), in a format that
    /// keeps no count of them: a shard cut exactly between two records looks so, and nothing
    /// else tells. A notice names them; `inspect` says so beside "complete", which it cannot
    /// deny (uneven shards are legal). 0 by default.
    fn short_shards(&self) -> usize {
        0
    }

    /// Shards shorter than the dataset's own index of them says (a copy cut short, a write cut
    /// off): their last records are unreadable (bad records), the notices name each, and
    /// `inspect` does not call such a dataset complete. 0 where the format keeps no such
    /// index.
    fn cut_shards(&self) -> usize {
        0
    }

    /// Shards of a format that keeps no count of their records anywhere (other tools' TFRecord
    /// and WebDataset shards) that the scan at open found cut short at their end, by position
    /// in the set, with their paths: the last record of each is a bad record standing for a
    /// tail of unknown length ([`cut_loss`] estimates it). Empty by default.
    fn shards_cut_at_end(&self) -> Vec<(usize, &Path)> {
        Vec::new()
    }

    /// The shards the loader's next batches read, in the order it first reads them (the
    /// first ones are being read now). A dataset whose shards are fetched on demand (from
    /// object storage) fetches them ahead in this order and lets go of the shards not listed,
    /// so its cache holds about what the list names; reads of a shard not fetched yet still
    /// fetch it. The default (local data) does nothing. Never blocks.
    fn plan_shards(&self, upcoming: &[usize]) {
        let _ = upcoming;
    }
}

/// The members of a set missing from a dataset opened with
/// [`allow_missing_shards`](crate::format::OpenOptions::allow_missing_shards).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MissingShards {
    /// The first [`NAMED_MISSING`](crate::format::shards::NAMED_MISSING) missing members' file
    /// names.
    pub named: Vec<String>,
    /// How many members are missing.
    pub count: u64,
}

impl MissingShards {
    /// No member missing.
    pub const NONE: MissingShards = MissingShards {
        named: Vec::new(),
        count: 0,
    };

    /// Whether no member is missing.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

impl std::fmt::Display for MissingShards {
    /// The names, with how many more there are (`a, b and 998 more`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&missing_list(&self.named, self.count))
    }
}

/// The file names of the first ten of `paths`: the names a message lists ([`missing_list`]).
pub(crate) fn first_names<'p>(paths: impl IntoIterator<Item = &'p Path>) -> Vec<String> {
    paths
        .into_iter()
        .take(10)
        .map(|path| {
            path.file_name()
                .unwrap_or(path.as_os_str())
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// `names` (the first of `count` missing members), with how many more there are.
pub fn missing_list(names: &[String], count: u64) -> String {
    let more = count.saturating_sub(names.len() as u64);
    if more == 0 {
        names.join(", ")
    } else {
        format!("{} and {more} more", names.join(", "))
    }
}

/// The positions of the first name that `names` holds twice: where it first was, and where it
/// came again. Keys or class names must be unique: one listed twice is a record read twice,
/// or a class a name-to-class table cannot tell from the other.
pub(crate) fn first_repeat<T: std::hash::Hash + Eq>(
    names: impl IntoIterator<Item = T>,
) -> Option<(usize, usize)> {
    let mut first = std::collections::HashMap::new();
    names
        .into_iter()
        .enumerate()
        .find_map(|(at, name)| first.insert(name, at).map(|before| (before, at)))
}

/// Adds `message` to a dataset's notices ([`Dataset::notices`]) and reports it through the
/// [`log`] facade.
pub(crate) fn notice(notices: &mut Vec<String>, message: String) {
    log::warn!("{message}");
    notices.push(message);
}

/// `count` and the noun, `one` or `many` as the count asks: for notices ("1 entry", "3
/// entries").
pub(crate) fn plural(count: usize, one: &str, many: &str) -> String {
    if count == 1 {
        format!("1 {one}")
    } else {
        format!("{count} {many}")
    }
}

/// Up to the first `shown` of `items` joined by ", ", then how many more there are: for messages
/// that would otherwise list a whole directory ("a, b, c and 148 more").
pub(crate) fn first_of(items: &[String], shown: usize) -> String {
    missing_list(&items[..items.len().min(shown)], items.len() as u64)
}

/// What the shards of a set that lost records nobody counted may have lost: shards cut short at
/// their end ([`Dataset::shards_cut_at_end`]; each reads as one bad record at its end) and
/// members other than the last holding no record while the others hold some (a copy cut to
/// nothing; the open's notices name them). Found by [`cut_loss`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CutLoss {
    /// The shards cut short at their end: position in the set, and path.
    pub cut: Vec<(usize, PathBuf)>,
    /// How many members other than the last hold no record while others do.
    pub empty: usize,
    /// About how many records they lost beyond the bad record each cut one reads as, by the
    /// set's whole shards (the median count of those neither cut, nor empty, nor last: writers
    /// fill their shards alike and leave the last one short), at most, since a cut last shard
    /// may have been short already. `None` when no such shard gives a count to go by (a set of
    /// one or two, or every shard cut): the loss is then unknown.
    pub lost: Option<u64>,
}

/// What `dataset`'s shards cut short or emptied lost ([`CutLoss`]); `None` when none is.
pub fn cut_loss(dataset: &dyn Dataset) -> Option<CutLoss> {
    let starts = dataset.shard_starts()?;
    let counts: Vec<usize> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    let cut: Vec<(usize, PathBuf)> = dataset
        .shards_cut_at_end()
        .into_iter()
        .map(|(i, path)| (i, path.to_path_buf()))
        .collect();
    let is_cut = |i: usize| cut.iter().any(|(c, _)| *c == i);
    // The last member may be empty by design (a writer with fewer records than shards): only
    // the others count (a hostile try's healthy [150, 150, 0] set was refused).
    let last = counts.len().saturating_sub(1);
    let empty: Vec<usize> = if empty_members(starts) > 0 {
        (0..counts.len())
            .filter(|&i| i != last && counts[i] == 0 && !is_cut(i))
            .collect()
    } else {
        Vec::new()
    };
    if cut.is_empty() && empty.is_empty() {
        return None;
    }
    let mut whole: Vec<usize> = (0..counts.len())
        .filter(|&i| i != last && counts[i] > 0 && !is_cut(i))
        .map(|i| counts[i])
        .collect();
    whole.sort_unstable();
    let lost = whole.get(whole.len() / 2).map(|&typical| {
        let short = |i: usize| typical.saturating_sub(counts[i]) as u64;
        cut.iter().map(|(i, _)| short(*i)).sum::<u64>()
            + empty.iter().map(|&i| short(i)).sum::<u64>()
    });
    Some(CutLoss {
        cut,
        empty: empty.len(),
        lost,
    })
}

/// The number of members of a set holding no sample while others do (`starts`: each member's
/// first sample, then the total); 0 for a whole set or one whose members are all empty.
pub fn empty_members(starts: &[usize]) -> usize {
    let members = starts.len().saturating_sub(1);
    let empty = starts.windows(2).filter(|w| w[0] == w[1]).count();
    if empty == members { 0 } else { empty }
}

/// Records whose keys and labels go into a [`fingerprint`].
const FINGERPRINT_PROBES: usize = 8;

/// A short hex digest that tells datasets apart: SHA-256 over the format, sample count, payload
/// kind, pack-time resize, class names, and the keys, labels and payload bytes of up to eight
/// records spread evenly over the dataset (a record that cannot be read counts as unreadable,
/// not as an error).
///
/// Two opens of the same dataset give the same fingerprint, wherever the dataset was moved; a
/// dataset with other classes, another sample count, another order or other files at the probed
/// positions gives another. It reads at most eight records, so it can miss an edit elsewhere:
/// it guards a checkpoint against the wrong dataset, not against tampering.
pub fn fingerprint(dataset: &dyn Dataset) -> String {
    use sha2::{Digest as _, Sha256};
    let mut hash = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    let info = dataset.info();
    field(info.format.name().as_bytes());
    field(&(info.num_samples as u64).to_le_bytes());
    field(match info.payload {
        PayloadKind::Encoded => b"encoded",
        PayloadKind::RawRgb8 => b"raw-rgb8",
    });
    field(&u64::from(info.resized_short_side.unwrap_or(0)).to_le_bytes());
    field(&(info.classes.len() as u64).to_le_bytes());
    for class in &info.classes {
        field(class.as_bytes());
    }
    let len = dataset.len();
    if len > 0 {
        let probes = FINGERPRINT_PROBES.min(len);
        let indices: Vec<usize> = (0..probes)
            .map(|probe| {
                if probes == 1 {
                    0
                } else {
                    probe * (len - 1) / (probes - 1)
                }
            })
            .collect();
        // Hashed one by one with one reader: which probes are readable must not depend on
        // which thread won room in a full cache. Over object storage each probe may be a shard
        // download, and one after another they were most of the time to the first batch: once
        // a read takes long (a fetch), the probes after it are fetched at once before they are
        // read. A local read takes microseconds, where a thread and a reader for each probe
        // cost ~0.6 ms of a 3.4 ms open and new loader of CIFAR-10's test set packed.
        let mut reader = dataset.open_reader().ok();
        let mut fetched = false;
        let mut tight = false;
        for (probe, &index) in indices.iter().enumerate() {
            let started = Instant::now();
            // A shard cache too small to hold every probe's shard at once (they stay fetched
            // until a loader plans its reads): the probes so far are let go and the probe
            // read again with a fresh reader, so the fingerprint does not depend on the
            // cache's size (a hostile try's probes each waited 5 s for room, then counted as
            // unreadable).
            for attempt in 0..2 {
                // The first read does not wait for room; the one after the probes' shards
                // were let go waits for the planner to let them go.
                let read = if attempt == 0 {
                    without_waiting_for_room(|| reader.as_mut().map(|r| r.read(index)))
                } else {
                    reader.as_mut().map(|r| r.read(index))
                };
                match read {
                    Some(Ok(record)) => {
                        field(record.key.as_bytes());
                        field(&record.label.to_le_bytes());
                        field(record.payload);
                        break;
                    }
                    Some(Err(crate::Error::CacheFull { .. })) if attempt == 0 => tight = true,
                    _ => {
                        field(b"unreadable");
                        break;
                    }
                }
                dataset.plan_shards(&[]);
                reader = dataset.open_reader().ok();
            }
            // Once the cache was found too small, each probe's shard is let go after it.
            if tight {
                dataset.plan_shards(&[]);
                reader = dataset.open_reader().ok();
            }
            if !fetched && started.elapsed() >= FETCHES_AFTER {
                warm_up(dataset, &indices[probe + 1..]);
                fetched = true;
            }
        }
    }
    hex(&hash.finalize()[..16])
}

/// A short hex digest of every record of a dataset that says what each holds without reading
/// it: the stored checksums of imagefeed's own packs ([`Dataset::record_checksums`]: label,
/// key and payload of every record), else where each record lies in a format with an index of
/// them (record shards, [`Dataset::feed_record_extents`]), else the key and label of every
/// record of a dataset that lists them (an image folder, [`Dataset::listed`]); `None` for
/// other formats. Where
/// [`fingerprint`] probes eight records, this covers them all, so a checkpoint of one dataset is
/// not resumed on another of the same size and classes (a hostile try resumed on a folder with
/// 30 of 300 files changed). Cheap: a pass over what the open already holds.
pub fn listing_digest(dataset: &dyn Dataset) -> Option<String> {
    use sha2::{Digest as _, Sha256};
    if let Some(sums) = dataset.record_checksums() {
        let mut hash = Sha256::new_with_prefix(b"checksums");
        for sum in sums {
            hash.update(sum.to_le_bytes());
        }
        return Some(hex(&hash.finalize()[..16]));
    }
    let mut extents = Sha256::new_with_prefix(b"extents");
    if dataset.feed_record_extents(&mut |bytes| extents.update(bytes)) {
        return Some(hex(&extents.finalize()[..16]));
    }
    dataset.listed(0)?;
    let mut hash = Sha256::new_with_prefix(b"listing");
    for index in 0..dataset.len() {
        let (key, label) = dataset.listed(index)?;
        hash.update((key.len() as u64).to_le_bytes());
        hash.update(key.as_bytes());
        hash.update(label.to_le_bytes());
    }
    Some(hex(&hash.finalize()[..16]))
}

/// A read that takes this long fetched its record (from object storage, or a disk that seeks):
/// [`fingerprint`] then fetches the probes after it at once.
const FETCHES_AFTER: Duration = Duration::from_millis(1);

/// Reads the records `indices` at once, a thread and a reader each, for what reading them
/// fetches (shards of a dataset in object storage) and nothing else: errors are left for the
/// reads that need the records. Nothing is read where threads cannot start.
fn warm_up(dataset: &dyn Dataset, indices: &[usize]) {
    std::thread::scope(|scope| {
        for &index in indices {
            let spawned = std::thread::Builder::new()
                .name("imagefeed-fingerprint".into())
                .spawn_scoped(scope, move || {
                    without_waiting_for_room(|| {
                        if let Ok(mut reader) = dataset.open_reader() {
                            let _ = reader.read(index);
                        }
                    })
                });
            if spawned.is_err() {
                break;
            }
        }
    });
}

thread_local! {
    /// Whether reads on this thread wait for room in a full shard cache
    /// ([`without_waiting_for_room`]).
    static WAITS_FOR_ROOM: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Runs `f` with reads on this thread never waiting for room in a full shard cache: the
/// [`fingerprint`]'s probes, which nothing else frees room for before a loader plans its reads
/// (each waited 5 s in a hostile try), and which let their shards go instead.
fn without_waiting_for_room<T>(f: impl FnOnce() -> T) -> T {
    let before = WAITS_FOR_ROOM.with(|w| w.replace(false));
    let result = f();
    WAITS_FOR_ROOM.with(|w| w.set(before));
    result
}

/// Whether a read on this thread that finds the shard cache full waits for readers to free
/// room (false inside [`without_waiting_for_room`]).
#[cfg(feature = "remote")]
pub(crate) fn waits_for_room() -> bool {
    WAITS_FOR_ROOM.with(std::cell::Cell::get)
}

/// Lower-case hex of a digest.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl std::fmt::Debug for dyn Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset")
            .field("path", &self.path())
            .field("info", self.info())
            .finish()
    }
}

/// A per-worker read handle.
pub trait RecordReader: Send {
    /// Reads record `index`. The returned record borrows from the handle (its buffer, or the
    /// file's map where the format allows) until the next call.
    ///
    /// # Panics
    /// When `index >= len()`.
    fn read(&mut self, index: usize) -> Result<Record<'_>>;

    /// A hint that record `index` will be read next. A format that knows where its bytes lie
    /// without searching starts pulling them into the CPU caches, so that decoding the current
    /// record overlaps with the memory latency of the next (shuffled reads jump around the
    /// file). Never blocks, fails or changes what `read` returns; the default does nothing.
    fn prefetch(&mut self, index: usize) {
        let _ = index;
    }

    /// A hint that records `indices` will be read next, in that order (the loader gives each
    /// batch's as it starts the batch). A format whose reads wait on the network starts them
    /// now, a bounded number at a time, so a batch costs about one round trip rather than one
    /// per record; one whose file is larger than memory starts their disk reads together. Never
    /// fails or changes what `read` returns, and waits for nothing the reads would not wait
    /// for (a format that must search for a record's place may search now); the default does
    /// nothing.
    fn plan_reads(&mut self, indices: &[usize]) {
        let _ = indices;
    }

    /// Whether reading a record a second time soon after costs about as little as the first
    /// (local files: the bytes are in memory). The loader reads a batch's records twice when
    /// that lets it decode small JPEGs together (see `Decoder::stack_offer`); a format whose
    /// records may come over the network says `false`. The default is `true`.
    fn rereads_are_cheap(&self) -> bool {
        true
    }
}

/// Asks the CPU to start loading the first [`PREFETCH_BYTES`] of `bytes` into its caches
/// (hardware prefetchers follow on from there). A hint only: nothing is read architecturally,
/// and addresses that are not mapped in yet are skipped rather than faulted in.
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        const LINE: usize = 64;
        let start = bytes.as_ptr() as usize;
        let end = start + bytes.len().min(PREFETCH_BYTES);
        let mut line = start & !(LINE - 1);
        while line < end {
            // SAFETY: PREFETCHT0 is part of SSE, which every x86-64 CPU has; it loads nothing
            // into registers and never faults, and `line` is within the cache lines `bytes`
            // touches.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            line += LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// How much of a record [`prefetch`] asks for.
pub(crate) const PREFETCH_BYTES: usize = 2048;

/// A reader that opens its handle on the first read and keeps it: the "lazily opened per-worker
/// handle" a worker thread holds. Opening errors are returned by that first read (and retried on
/// the next one).
pub struct LazyReader {
    dataset: Arc<dyn Dataset>,
    handle: Option<Box<dyn RecordReader>>,
}

impl LazyReader {
    /// A reader over `dataset` that has not opened anything yet.
    pub fn new(dataset: Arc<dyn Dataset>) -> Self {
        LazyReader {
            dataset,
            handle: None,
        }
    }

    /// True once the handle has been opened.
    pub fn is_open(&self) -> bool {
        self.handle.is_some()
    }

    /// Reads record `index`, opening the handle first if needed.
    pub fn read(&mut self, index: usize) -> Result<Record<'_>> {
        let handle = match &mut self.handle {
            Some(handle) => handle,
            slot @ None => slot.insert(self.dataset.open_reader()?),
        };
        handle.read(index)
    }

    /// Passes the hint on to the handle ([`RecordReader::prefetch`]) once it is open.
    pub fn prefetch(&mut self, index: usize) {
        if let Some(handle) = &mut self.handle {
            handle.prefetch(index);
        }
    }

    /// [`RecordReader::rereads_are_cheap`] of the open handle (`false` before it is open).
    pub fn rereads_are_cheap(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| h.rereads_are_cheap())
    }

    /// Passes the hint on ([`RecordReader::plan_reads`]), opening the handle first if needed
    /// (an opening error is left for the first read to report).
    pub fn plan_reads(&mut self, indices: &[usize]) {
        if self.handle.is_none() {
            self.handle = self.dataset.open_reader().ok();
        }
        if let Some(handle) = &mut self.handle {
            handle.plan_reads(indices);
        }
    }
}

/// Records per parallel pass of [`par_map_chunks`]: what a pass holds of results at once.
const RECORDS_PER_PASS: usize = 1 << 16;

/// Runs `f` on every record of `dataset` in parallel, each rayon thread with its own reader and
/// decoder, and returns the results in index order. A reader that cannot be opened turns into an
/// `Err` for each record that thread would have read.
pub(crate) fn par_map_records<T, F>(dataset: &dyn Dataset, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(&mut Decoder, std::result::Result<Record<'_>, UnreadRecord>) -> T + Sync,
{
    let mut all = Vec::with_capacity(dataset.len());
    par_map_chunks(dataset, f, |_, results| all.extend(results));
    all
}

/// [`par_map_records`], handing the results to `take` a pass of up to [`RECORDS_PER_PASS`]
/// records at a time, in index order, with the index of the pass's first record: what holds
/// the results of every record at once (`inspect` and `verify` did, ~100 bytes a record, a
/// gigabyte for ten million) holds a pass's.
pub(crate) fn par_map_chunks<T, F>(dataset: &dyn Dataset, f: F, mut take: impl FnMut(usize, Vec<T>))
where
    T: Send,
    F: Fn(&mut Decoder, std::result::Result<Record<'_>, UnreadRecord>) -> T + Sync,
{
    let len = dataset.len();
    let mut start = 0;
    while start < len {
        let end = len.min(start + RECORDS_PER_PASS);
        let results = (start..end)
            .into_par_iter()
            .map_init(
                || {
                    (
                        dataset.open_reader().map_err(|e| e.to_string()),
                        Decoder::new(),
                    )
                },
                |(reader, decoder), index| match reader {
                    Ok(reader) => f(
                        decoder,
                        reader.read(index).map_err(|e| UnreadRecord::of(index, e)),
                    ),
                    Err(e) => f(
                        decoder,
                        Err(UnreadRecord {
                            key: format!("#{index}"),
                            message: format!("cannot open a reader: {e}"),
                            reason: format!("cannot open a reader: {e}"),
                        }),
                    ),
                },
            )
            .collect();
        take(start, results);
        start = end;
    }
}

/// The key and label of every record, in index order: from the dataset's listing where it has
/// one ([`Dataset::listed`]: no file is read), else by reading every record in parallel (for a
/// dataset in object storage, that downloads it).
///
/// # Errors
/// The first record (by index) that cannot be read, as [`Error::CorruptRecord`] naming it.
pub fn keys_and_labels(dataset: &dyn Dataset) -> Result<Vec<(String, u32)>> {
    let listed: Option<Vec<(String, u32)>> = (0..dataset.len())
        .map(|index| {
            dataset
                .listed(index)
                .map(|(key, label)| (key.to_owned(), label))
        })
        .collect();
    if let Some(listed) = listed {
        return Ok(listed);
    }
    par_map_records(dataset, |_, record| {
        record
            .map(|r| (r.key.to_owned(), r.label))
            .map_err(|unread| (unread.key, unread.reason))
    })
    .into_iter()
    .enumerate()
    .map(|(index, result)| {
        result.map_err(|(key, reason)| Error::CorruptRecord {
            path: dataset.path().to_path_buf(),
            index,
            key,
            reason,
        })
    })
    .collect()
}

/// A record [`par_map_records`] could not read: its key when the error names one (`#index`
/// otherwise), and the error's message.
pub(crate) struct UnreadRecord {
    pub key: String,
    pub message: String,
    /// Why, without the dataset and record the message names first.
    pub reason: String,
}

impl UnreadRecord {
    /// Record `index`, which failed with `e`.
    fn of(index: usize, e: Error) -> Self {
        let (key, reason) = match &e {
            Error::CorruptRecord { key, reason, .. } => (key.clone(), reason.clone()),
            _ => (format!("#{index}"), e.to_string()),
        };
        UnreadRecord {
            key,
            message: e.to_string(),
            reason,
        }
    }
}
