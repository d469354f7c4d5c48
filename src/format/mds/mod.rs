//! Mosaic MDS: the shards MosaicML Streaming's `MDSWriter` writes, read as they are.
//!
//! # Layout
//!
//! A dataset is a directory (or an object-storage prefix) holding `index.json` and the shards
//! it lists ([`index`]). Every shard names the same columns, each with an encoding and either a
//! fixed size or none. A shard file is
//!
//! ```text
//! u32 LE sample count n | (n + 1) u32 LE offsets from the file's start | the writer's config
//! as JSON | samples
//! ```
//!
//! and sample `i` is the bytes from offset `i` to offset `i + 1`: first a `u32` LE size for
//! each column without a fixed size, in column order, then every column's value, in column
//! order. With `compression=` the index also names a compressed copy (`shard.00000.mds.zstd`)
//! and that is the file written; it is decompressed once into the cache directory
//! ([`crate::format::compressed`]) and read like an uncompressed shard.
//!
//! The image is the column encoded `jpeg` or `png` (an image file's bytes), or `pil` (raw
//! pixels, as Streaming's CIFAR converter writes them: RGB, L and RGBA, read as RGB), else a
//! `bytes` column; the label is an integer column (`int`, `int8`..`uint64`, `str_int`). When
//! several columns could be either, the one named `x`/`image`/... or `y`/`label`/... is taken
//! ([`index`]). Pickled (`pkl`) columns are never read. A sample's key is its `str` column named
//! `key`, `path`, `filename`, ... when there is one, else `SHARD#N`: the shard's name in the
//! index and the sample's place in it.
//!
//! # Reading
//!
//! Shards are memory-mapped. A shard that is missing is an error at open naming it; a damaged
//! one (cut short, offsets out of order, a sample count that differs from the index's) reads
//! as bad records that say why. Labels are read at open to find the classes, as for WebDataset
//! shards (`--num-classes` names them instead, `--label-base` shifts them).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::compressed::{self, Compression};
use crate::format::shard_data::{HeldShard, Mapped, ShardData};
use crate::format::{OpenOptions, Recognizer};

pub mod index;
#[cfg(feature = "remote")]
pub(crate) mod remote;

use index::{INDEX, ImageColumn, Index, LabelColumn, Layout, MAX_INDEX_BYTES, ShardCompression};

/// True when the directory `path` is an MDS dataset: its `index.json` is a JSON object naming
/// `"shards"` in its first 4 KiB (Streaming's sorted keys put it first; one written by hand may
/// not: a hostile try's `{"version": 2, "shards": []}` was then refused as an ImageFolder
/// without class directories), or the directory holds `*.mds` shards beside it. Only the
/// index's first bytes are read; opening parses it and says what is wrong with a damaged one.
pub fn looks_like_mds(path: &Path) -> bool {
    let index = path.join(INDEX);
    if !index.is_file() {
        return false;
    }
    let mut head = Vec::with_capacity(4096);
    let starts_like_index = fs::File::open(&index).is_ok_and(|file| {
        use std::io::Read as _;
        let _ = file.take(4096).read_to_end(&mut head);
        let text = String::from_utf8_lossy(&head);
        let text = text.trim_start_matches('\u{feff}').trim_start();
        text.starts_with('{') && text.contains("\"shards\"")
    });
    starts_like_index
        || fs::read_dir(path).is_ok_and(|entries| {
            entries
                .filter_map(|e| e.ok())
                .any(|e| is_shard_name(&e.file_name().to_string_lossy()))
        })
}

/// True for the file names MDSWriter gives shards (`shard.00000.mds`, `.mds.zstd`, ...).
fn is_shard_name(name: &str) -> bool {
    name.ends_with(".mds") || name.contains(".mds.")
}

/// [`format::open`](crate::format::open)'s recognizer for an MDS directory.
pub(crate) const DIRECTORY: Recognizer = Recognizer {
    holds: |path| Ok(path.is_dir() && looks_like_mds(path)),
    open: |path, options| Ok(Arc::new(Mds::open(path, options)?)),
};

/// [`format::open`](crate::format::open)'s recognizer for an MDS `index.json` named itself.
pub(crate) const INDEX_FILE: Recognizer = Recognizer {
    holds: |path| Ok(path.is_file() && path.file_name().is_some_and(|n| n == INDEX)),
    open: |path, options| {
        let dir = path.parent().expect("holds checked it");
        Ok(Arc::new(Mds::open(dir, options)?))
    },
};

/// One shard: where it is, its bytes, and its sample count from the index.
pub(super) struct Shard {
    path: PathBuf,
    /// The uncompressed shard's name in the index, which names its samples (`NAME#N`) the
    /// same whether it is read compressed or not, locally or from object storage.
    name: String,
    data: Arc<ShardData>,
    /// The samples the index says the shard holds.
    samples: usize,
    /// The records the shard makes in the dataset: `samples`, or where the shard's own count
    /// disagrees with the index (then every one is a bad record), the larger of the two, so
    /// that an index saying 0 for a shard holding 100 costs 100 bad records, not 100 samples
    /// gone without a word.
    records: usize,
    /// A compressed shard's damaged stream: a sample reaching past what it vouches for is a
    /// bad record (MDS samples carry no checksums of their own).
    damage: Option<compressed::Damage>,
}

struct Shared {
    path: PathBuf,
    info: DatasetInfo,
    label_base: u32,
    layout: Layout,
    shards: Vec<Shard>,
    /// Index of each shard's first sample; a final entry holds the total.
    starts: Vec<usize>,
    notices: Vec<String>,
    missing_shards: crate::format::shards::MissingShards,
}

/// A Mosaic MDS dataset opened for reading.
pub struct Mds {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Mds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mds")
            .field("path", &self.shared.path)
            .field("info", &self.shared.info)
            .field("shards", &self.shared.shards.len())
            .finish()
    }
}

impl Mds {
    /// Opens the MDS dataset in the directory `dir`.
    pub fn open(dir: &Path, options: &OpenOptions) -> Result<Mds> {
        let index_path = dir.join(INDEX);
        let (file, len) = crate::file::open_regular(&index_path)?;
        if len > MAX_INDEX_BYTES {
            return Err(Error::not_a_dataset(
                &index_path,
                format!("{len} bytes; an MDS index this large is not one"),
            ));
        }
        let mut text = Vec::with_capacity(len as usize);
        std::io::Read::read_to_end(&mut std::io::Read::take(&file, MAX_INDEX_BYTES), &mut text)
            .at(&index_path)?;
        let index = Index::parse(&index_path, &text)?;
        let mut notices = Vec::new();
        let mut cache = None;
        // A shard is missing when neither its file nor its compressed file is there at all.
        let gone = |name: &str| crate::format::shards::is_gone(&dir.join(name));
        let (present, absent): (Vec<_>, Vec<_>) = index.shards.iter().partition(|entry| {
            !gone(&entry.raw.0) || entry.zip.as_ref().is_some_and(|(zip, _)| !gone(zip))
        });
        let missing_shards = crate::format::shards::listed_members_missing(
            dir,
            absent.iter().map(|entry| entry.raw.0.clone()).collect(),
            index.shards.len(),
            options.allow_missing_shards,
            &mut notices,
        )?;
        let mut shards = Vec::with_capacity(present.len());
        // By the shards' sizes the index gives (a compressed shard's raw file may be absent).
        let prefetch =
            crate::pagecache::SetPrefetch::for_total(present.iter().map(|entry| entry.raw.1).sum());
        for entry in present {
            let (raw_name, raw_bytes) = &entry.raw;
            let raw = dir.join(raw_name);
            let (path, (file, len), compression) = match (&entry.zip, raw.is_file()) {
                // Streaming keeps the decompressed shard next to the compressed one once it
                // has read it; either is the same data.
                (None, _) | (Some(_), true) => {
                    let opened = crate::file::open_regular(&raw).map_err(|e| match e {
                        Error::Io { .. } if !raw.exists() => missing(dir, raw_name),
                        other => other,
                    })?;
                    (raw.clone(), opened, None)
                }
                (Some((zip_name, compression)), false) => {
                    let zip = dir.join(zip_name);
                    if !zip.exists() {
                        return Err(missing(dir, zip_name));
                    }
                    let opened = crate::file::open_regular(&zip)?;
                    (zip, opened, Some(*compression))
                }
            };
            let mut damage = None;
            let mapped = match compression {
                None => {
                    prefetch.read(&path, &file, len)?;
                    Mapped::new(&path, file, false)?
                }
                Some(compression) => {
                    let cache = match &mut cache {
                        Some(cache) => cache,
                        None => cache.insert(options.cache_or_env()?),
                    };
                    let copy = compressed::decompress_at_most(
                        &path,
                        &file,
                        compression.into(),
                        cache,
                        Some(*raw_bytes),
                    )?;
                    damage = copy.damage;
                    Mapped::new(&path, copy.file, true)?
                }
            };
            let shard = checked_shard(
                &path,
                raw_name,
                (ShardData::local(&path, mapped), damage),
                entry.samples,
                *raw_bytes,
                &mut notices,
            )?;
            // A set larger than memory is read at random once opened (`Mapped::ready_for`).
            shard.data.ready_for(&prefetch);
            shards.push(shard);
        }
        let listed: std::collections::HashSet<&str> = index
            .shards
            .iter()
            .flat_map(|e| {
                std::iter::once(e.raw.0.as_str()).chain(e.zip.as_ref().map(|z| z.0.as_str()))
            })
            .collect();
        let unlisted = fs::read_dir(dir)
            .at(dir)?
            .filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                is_shard_name(&name) && !listed.contains(name.as_str())
            })
            .count();
        if unlisted > 0 {
            crate::dataset::notice(
                &mut notices,
                format!(
                    "{}: {unlisted} shard file(s) beside {INDEX} are not in it and are not read \
                     (another dataset's, or an index written before they were)",
                    dir.display()
                ),
            );
        }
        notices.extend(index.notes.iter().cloned());
        assemble(dir, index.layout, shards, options, notices, missing_shards)
    }
}

impl From<ShardCompression> for Compression {
    fn from(compression: ShardCompression) -> Compression {
        match compression {
            ShardCompression::Zstd => Compression::Zstd,
            ShardCompression::Gzip => Compression::Gzip,
        }
    }
}

fn missing(dir: &Path, name: &str) -> Error {
    Error::Incomplete {
        path: dir.to_path_buf(),
        reason: format!(
            "{INDEX} lists {name}, which is not there: the dataset was not copied whole, or the \
             shard was removed"
        ),
    }
}

/// A shard whose bytes are resident, with a notice when its size or sample count is not what
/// the index says (its samples are still read, each checked, and the damaged ones fail).
pub(super) fn checked_shard(
    path: &Path,
    name: &str,
    (data, damage): (ShardData, Option<compressed::Damage>),
    samples: usize,
    expected_bytes: u64,
    notices: &mut Vec<String>,
) -> Result<Shard> {
    if let Some(damage) = &damage {
        crate::dataset::notice(notices, format!("{}: {damage}", path.display()));
    }
    let mapped = data.get()?;
    let bytes = mapped.bytes();
    // The offsets alone take 4 bytes a sample: a count the file cannot hold offsets for is
    // not believed (an index edited, or another dataset's, would make billions of samples of
    // a few bytes).
    if samples.saturating_mul(4).saturating_add(8) > bytes.len() {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{INDEX} says it holds {samples} samples, but its {} bytes cannot hold their \
                 offsets: damaged, cut short, or not the shard the index describes",
                bytes.len()
            ),
        ));
    }
    if bytes.len() as u64 != expected_bytes {
        crate::dataset::notice(
            notices,
            format!(
                "{}: {} bytes, but {INDEX} says {expected_bytes}: damaged or replaced; its \
                 samples are checked as they are read",
                path.display(),
                bytes.len()
            ),
        );
    }
    let mut records = samples;
    if let Some(count) = read_u32(bytes, 0)
        && count as usize != samples
    {
        // A count the shard cannot hold offsets for is damage, not a count: one bad record
        // at least then.
        let believable = (count as usize).saturating_mul(4).saturating_add(8) <= bytes.len();
        records = if believable {
            samples.max(count as usize)
        } else {
            samples.max(1)
        };
        crate::dataset::notice(
            notices,
            format!(
                "{}: holds {count} samples, but {INDEX} says {samples}: its {records} \
                 records read as bad records",
                path.display()
            ),
        );
    }
    Ok(Shard {
        path: path.to_path_buf(),
        name: name.to_string(),
        data: Arc::new(data),
        samples,
        records,
        damage,
    })
}

impl Shard {
    /// Why the sample at `span` of the shard is not vouched for, if it is not.
    fn unsound(&self, span: &std::ops::Range<usize>) -> Option<&str> {
        self.damage
            .as_ref()
            .filter(|damage| damage.spoils(span.end as u64))
            .map(|damage| damage.reason.as_str())
    }

    /// Sample `within`'s columns in `bytes`, the shard's, read through the map's guard
    /// ([`sample_columns`]); `Err` too for one past what a damaged stream vouches for.
    fn columns<'a>(
        &self,
        bytes: &'a [u8],
        within: usize,
        layout: &Layout,
    ) -> std::result::Result<SampleColumns<'a>, String> {
        let columns = sample_columns(bytes, self.samples, within, layout)?;
        // (The offsets are readable: `sample_columns` read them through the guard.)
        if self.damage.is_some()
            && let Some(reason) = sample_span(bytes, self.samples, within)
                .ok()
                .and_then(|span| self.unsound(&span))
        {
            return Err(reason.to_string());
        }
        Ok(columns)
    }
}

/// The dataset over `shards`: classes (given, or inferred from every sample's label), counts
/// and notices; `missing_shards`: those its index lists that were allowed missing.
pub(super) fn assemble(
    name: &Path,
    layout: Layout,
    shards: Vec<Shard>,
    options: &OpenOptions,
    mut notices: Vec<String>,
    missing_shards: crate::format::shards::MissingShards,
) -> Result<Mds> {
    let starts = crate::format::shards::starts(shards.iter().map(|s| s.records));
    let total = *starts.last().expect("starts has a final entry");
    // No notice for empty shards: see `suspect_empty_shards`.
    let label_base = options.records.label_base.unwrap_or(0);
    let classes = match options.records.given_classes()? {
        Some(classes) => classes,
        None => infer_classes(name, &layout, &shards, label_base, &mut notices)?,
    };
    let payload = match layout.image.1 {
        ImageColumn::Encoded => PayloadKind::Encoded,
        ImageColumn::Pil => {
            check_pil_modes(name, &layout, &shards, &mut notices)?;
            PayloadKind::RawRgb8
        }
    };
    Ok(Mds {
        shared: Arc::new(Shared {
            path: name.to_path_buf(),
            info: DatasetInfo {
                format: FormatKind::Mds,
                classes,
                num_samples: total,
                payload,
                resized_short_side: None,
                part: None,
                rejected_at_pack: None,
                restart_markers: false,
            },
            label_base,
            layout,
            shards,
            starts,
            notices,
            missing_shards,
        }),
    })
}

/// Refuses a `pil` image column whose images are in a mode imagefeed does not read (`P`,
/// `CMYK`, `I;16`: every record would be bad), looking at up to [`PIL_PROBES`] images spread
/// over each shard (their headers only); where only some of them are, a notice names the first.
/// (One odd image at a shard's start refused a hostile try's set of 99 RGB images.)
fn check_pil_modes(
    name: &Path,
    layout: &Layout,
    shards: &[Shard],
    notices: &mut Vec<String>,
) -> Result<()> {
    let mut looked = 0usize;
    let mut refused = 0usize;
    let mut first: Option<(String, String)> = None;
    for shard in shards.iter().filter(|s| s.samples > 0) {
        let mapped = shard.data.get()?;
        let probes = shard.samples.min(PIL_PROBES);
        for probe in 0..probes {
            let within = probe * shard.samples / probes;
            let Ok(columns) = shard.columns(mapped.bytes(), within, layout) else {
                continue;
            };
            let head = &columns.image[..columns.image.len().min(64)];
            if crate::mapguard::fault_in(head).is_err() {
                continue;
            }
            let Ok((_, _, mode)) = pil_header(columns.image) else {
                continue;
            };
            looked += 1;
            if let Err(reason) = pil_channels(mode) {
                refused += 1;
                first.get_or_insert_with(|| (sample_key(&shard.name, within), reason));
            }
        }
    }
    let Some((first, reason)) = first else {
        return Ok(());
    };
    let column = &layout.columns[layout.image.0].name;
    if refused == looked {
        return Err(Error::not_a_dataset(
            name,
            format!(
                "every one of the {looked} images looked at in column {column:?} is in a mode \
                 imagefeed does not read (the first, {first}: {reason})"
            ),
        ));
    }
    crate::dataset::notice(
        notices,
        format!(
            "{}: {refused} of {looked} images looked at in column {column:?} are in a mode \
             imagefeed does not read (the first, {first}: {reason}): such images are bad records",
            name.display(),
        ),
    );
    Ok(())
}

/// How many images of each shard [`check_pil_modes`] looks at.
const PIL_PROBES: usize = 16;

/// Classes `0..=largest label` over the samples' labels (label base taken off).
fn infer_classes(
    name: &Path,
    layout: &Layout,
    shards: &[Shard],
    label_base: u32,
    notices: &mut Vec<String>,
) -> Result<Vec<String>> {
    let mut inference = crate::dataset::ClassInference::default();
    let mut samples = 0usize;
    for shard in shards {
        let mapped = shard.data.get()?;
        if let Some(head) = mapped.bytes().get(..4) {
            crate::mapguard::check_readable(&shard.path, mapped.bytes(), head)?;
        }
        // The scan reads each sample's place and label, not its image: an unreadable one
        // (`crate::mapguard`) is left out here, and is a bad record when read.
        if read_u32(mapped.bytes(), 0) != u32::try_from(shard.samples).ok() {
            // Not the shard the index describes: every record is bad (a notice said).
            samples += shard.records;
            continue;
        }
        for within in 0..shard.samples {
            samples += 1;
            // (A sample past what a damaged stream vouches for is a bad record, not counted.)
            let Ok(columns) = shard.columns(mapped.bytes(), within, layout) else {
                continue;
            };
            if crate::mapguard::fault_in(columns.label).is_err() {
                continue;
            }
            if let Ok(label) = decode_label(columns.label, layout.label.1) {
                inference.see(
                    || sample_key(&shard.name, within),
                    label.checked_sub(i64::from(label_base)),
                );
            }
        }
    }
    if samples > 0 && inference.is_empty() {
        return Err(Error::not_a_dataset(
            name,
            format!(
                "no sample has a readable label in column {:?}",
                layout.columns[layout.label.0].name
            ),
        ));
    }
    let (classes, notice) = inference.classes();
    notices.extend(notice);
    Ok(classes)
}

/// What messages and reports call sample `within` of the shard the index names `name`.
fn sample_key(name: &str, within: usize) -> String {
    let mut key = String::new();
    write_sample_key(&mut key, name, within);
    key
}

/// [`sample_key`] into `out`, reusing its buffer.
fn write_sample_key(out: &mut String, name: &str, within: usize) {
    use std::fmt::Write as _;
    out.clear();
    let _ = write!(out, "{name}#{within}");
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let end = at.checked_add(4)?;
    Some(u32::from_le_bytes(bytes.get(at..end)?.try_into().ok()?))
}

/// The image, label and key values of one sample.
struct SampleColumns<'a> {
    image: &'a [u8],
    label: &'a [u8],
    key: Option<&'a [u8]>,
}

/// Where sample `within` of a shard of `samples` lies in its `bytes`, from the shard's offset
/// table (checked against the count it starts with and against the shard's length).
fn sample_span(
    bytes: &[u8],
    samples: usize,
    within: usize,
) -> std::result::Result<std::ops::Range<usize>, String> {
    let count = read_u32(bytes, 0).ok_or("the shard is shorter than its header")? as usize;
    if count != samples {
        return Err(format!(
            "the shard holds {count} samples, but {INDEX} says {samples}"
        ));
    }
    let header_end = 4 + 4 * (count + 1);
    let begin = read_u32(bytes, 4 + 4 * within);
    let end = read_u32(bytes, 4 + 4 * (within + 1));
    let (Some(begin), Some(end)) = (begin, end) else {
        return Err("the shard is cut short in its offset table".into());
    };
    let (begin, end) = (begin as usize, end as usize);
    if begin < header_end || begin > end || end > bytes.len() {
        return Err(format!(
            "its bytes {begin}..{end} are not inside the shard's {} sample bytes",
            bytes.len().saturating_sub(header_end)
        ));
    }
    Ok(begin..end)
}

/// Checks that the parts of an MDS shard's header that locate sample `within` can be read
/// ([`crate::mapguard`]): a page the disk cannot supply is an error naming the shard, not
/// SIGBUS.
fn check_place_readable(path: &Path, bytes: &[u8], within: usize) -> Result<()> {
    for part in sample_place(within) {
        if let Some(part) = bytes.get(part) {
            crate::mapguard::check_readable(path, bytes, part)?;
        }
    }
    Ok(())
}

/// Where an MDS shard says where sample `within` lies: its count of samples, and the sample's
/// two entries in its offset table.
fn sample_place(within: usize) -> [std::ops::Range<usize>; 2] {
    [0..4, 4 * (within + 1)..4 * (within + 3)]
}

/// Sample `within` of a shard (`bytes`, which the index says holds `samples`): its image and
/// label values, or why they cannot be read. What it reads of the shard to find them (the
/// count, the sample's offsets, its column sizes) goes through the guard of
/// [`crate::mapguard`] first, so a shard's map can be handed in: a page the disk cannot supply
/// is an error, not SIGBUS. The values themselves are not read.
fn sample_columns<'a>(
    bytes: &'a [u8],
    samples: usize,
    within: usize,
    layout: &Layout,
) -> std::result::Result<SampleColumns<'a>, String> {
    let readable = |part: std::ops::Range<usize>| {
        bytes
            .get(part)
            .is_none_or(|part| crate::mapguard::fault_in(part).is_ok())
    };
    let unreadable = || "the shard's header could not be read (an I/O error)".to_string();
    if !sample_place(within).into_iter().all(readable) {
        return Err(unreadable());
    }
    let span = sample_span(bytes, samples, within)?;
    if !readable(span.start..span.end.min(span.start + 4 * layout.variable_columns())) {
        return Err(unreadable());
    }
    columns_of(&bytes[span], layout)
}

/// The wanted columns of one sample's bytes (the span [`sample_span`] gives).
fn columns_of<'a>(
    sample: &'a [u8],
    layout: &Layout,
) -> std::result::Result<SampleColumns<'a>, String> {
    let variable = layout.variable_columns();
    let mut at = 4 * variable;
    if at > sample.len() {
        return Err("the sample is shorter than its column sizes".into());
    }
    let mut sizes = (0..variable).map(|i| read_u32(sample, 4 * i).expect("checked above"));
    // Only the three wanted values are kept: no allocation per sample.
    let (mut image, mut label, mut key) = (None, None, None);
    for (i, column) in layout.columns.iter().enumerate() {
        let size = column
            .size
            .unwrap_or_else(|| sizes.next().expect("one size per variable column"))
            as usize;
        let value = at
            .checked_add(size)
            .and_then(|value_end| sample.get(at..value_end))
            .ok_or_else(|| {
                format!(
                    "column {:?} ({size} bytes) runs past the sample's end",
                    column.name
                )
            })?;
        if i == layout.image.0 {
            image = Some(value);
        }
        if i == layout.label.0 {
            label = Some(value);
        }
        if Some(i) == layout.key {
            key = Some(value);
        }
        at += size;
    }
    if at != sample.len() {
        return Err(format!(
            "{} bytes follow the sample's last column",
            sample.len() - at
        ));
    }
    Ok(SampleColumns {
        image: image.expect("the layout's image column is one of its columns"),
        label: label.expect("the layout's label column is one of its columns"),
        key,
    })
}

/// The label a label column's value holds.
fn decode_label(value: &[u8], column: LabelColumn) -> std::result::Result<i64, String> {
    match column {
        LabelColumn::Int { bytes, signed } => {
            if value.len() != bytes as usize {
                return Err(format!("a {bytes}-byte label has {} bytes", value.len()));
            }
            let mut wide = [0u8; 8];
            wide[..value.len()].copy_from_slice(value);
            if signed && value[value.len() - 1] & 0x80 != 0 {
                wide[value.len()..].fill(0xff);
            }
            let raw = u64::from_le_bytes(wide);
            if signed {
                Ok(raw as i64)
            } else {
                i64::try_from(raw).map_err(|_| format!("label {raw} is too large"))
            }
        }
        LabelColumn::Text => std::str::from_utf8(value)
            .ok()
            .and_then(|text| text.trim().parse::<i64>().ok())
            .ok_or_else(|| {
                format!(
                    "label {:?} is not an integer",
                    String::from_utf8_lossy(&value[..value.len().min(32)])
                )
            }),
    }
}

/// A `pil` value's width, height and mode.
fn pil_header(value: &[u8]) -> std::result::Result<(u32, u32, &[u8]), String> {
    let (Some(width), Some(height), Some(mode_len)) =
        (read_u32(value, 0), read_u32(value, 4), read_u32(value, 8))
    else {
        return Err("a PIL image shorter than its header".into());
    };
    let mode = 12usize
        .checked_add(mode_len as usize)
        .and_then(|end| value.get(12..end))
        .ok_or("a PIL image shorter than its mode")?;
    Ok((width, height, mode))
}

/// The channels of a PIL mode imagefeed reads; `Err` naming any other.
fn pil_channels(mode: &[u8]) -> std::result::Result<usize, String> {
    match mode {
        b"RGB" => Ok(3),
        b"L" => Ok(1),
        b"RGBA" => Ok(4),
        other => Err(format!(
            "PIL mode {:?}; imagefeed reads RGB, L and RGBA",
            String::from_utf8_lossy(&other[..other.len().min(16)])
        )),
    }
}

/// A `pil` value as a raw RGB payload in `out` ([`crate::decode::RawImage`]).
fn pil_to_raw(value: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), String> {
    let (width, height, mode) = pil_header(value)?;
    let pixels = &value[12 + mode.len()..];
    let channels = pil_channels(mode)?;
    let pixels_count = width as u64 * height as u64;
    if pixels_count > crate::decode::DEFAULT_MAX_PIXELS {
        return Err(format!(
            "{width}x{height} image has more than {} pixels (decompression-bomb limit)",
            crate::decode::DEFAULT_MAX_PIXELS
        ));
    }
    let expected = pixels_count.checked_mul(channels as u64);
    if expected != Some(pixels.len() as u64) || width == 0 || height == 0 {
        return Err(format!(
            "a {width}x{height} {} image holds {} bytes",
            String::from_utf8_lossy(mode),
            pixels.len()
        ));
    }
    crate::decode::RawImage::start(out, width, height);
    match channels {
        3 => out.extend_from_slice(pixels),
        1 => out.extend(pixels.iter().flat_map(|&v| [v, v, v])),
        _ => out.extend(pixels.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]])),
    }
    Ok(())
}

impl Dataset for Mds {
    fn info(&self) -> &DatasetInfo {
        &self.shared.info
    }

    fn path(&self) -> &Path {
        &self.shared.path
    }

    fn notices(&self) -> &[String] {
        &self.shared.notices
    }

    fn missing_shards(&self) -> &crate::format::shards::MissingShards {
        &self.shared.missing_shards
    }

    fn shard_starts(&self) -> Option<&[usize]> {
        Some(&self.shared.starts)
    }

    /// None: the index gives every shard's count and each shard is checked against it, and
    /// MDSWriter writes an empty shard when a first sample is larger than its size limit.
    fn suspect_empty_shards(&self) -> usize {
        0
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(MdsReader {
            shared: Arc::clone(&self.shared),
            key: String::new(),
            pixels: Vec::new(),
            held: HeldShard::default(),
            copied: Vec::new(),
        }))
    }
}

/// Per-worker handle over the shared shards.
struct MdsReader {
    shared: Arc<Shared>,
    key: String,
    /// A `pil` sample's pixels, as a raw payload.
    pixels: Vec<u8>,
    held: HeldShard,
    /// The sample last read, copied out of its shard's map before it is parsed
    /// ([`crate::mapguard::copy_readable`]).
    copied: Vec<u8>,
}

impl Shared {
    /// The number of the shard holding sample `index`, and the sample's place in it.
    fn locate(&self, index: usize) -> (usize, usize) {
        crate::format::shards::locate(&self.starts, index)
    }
}

impl RecordReader for MdsReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        assert!(
            index < self.shared.info.num_samples,
            "index {index} out of range for {} samples",
            self.shared.info.num_samples
        );
        let shared = &*self.shared;
        let (number, within) = shared.locate(index);
        let shard = &shared.shards[number];
        write_sample_key(&mut self.key, &shard.name, within);
        let corrupt = |key: &str, reason: String| Error::CorruptRecord {
            path: shard.path.clone(),
            index,
            key: key.to_string(),
            reason,
        };
        let bytes = self.held.bytes(number, &shard.data)?;
        check_place_readable(&shard.path, bytes, within)?;
        let span = sample_span(bytes, shard.samples, within)
            .map_err(|reason| corrupt(&self.key, reason))?;
        if let Some(reason) = shard.unsound(&span) {
            return Err(corrupt(&self.key, reason.to_string()));
        }
        // Out of the map before anything reads it (`mapguard`).
        let sample =
            crate::mapguard::copy_readable(&shard.path, bytes, &bytes[span], &mut self.copied)?;
        let columns =
            columns_of(sample, &shared.layout).map_err(|reason| corrupt(&self.key, reason))?;
        // A key column names the sample when it holds text (else the shard's name does).
        if let Some(key) = columns.key.and_then(|k| std::str::from_utf8(k).ok())
            && !key.is_empty()
        {
            self.key.clear();
            self.key.push_str(key);
        }
        let stored = decode_label(columns.label, shared.layout.label.1)
            .map_err(|reason| corrupt(&self.key, reason))?;
        let base = i64::from(shared.label_base);
        if stored < base {
            return Err(corrupt(
                &self.key,
                format!("label {stored} is below the label base {base}"),
            ));
        }
        let label = shared
            .info
            .check_stored_label(&shard.path, index, &self.key, stored - base)?;
        let payload = match shared.layout.image.1 {
            ImageColumn::Encoded => columns.image,
            ImageColumn::Pil => {
                pil_to_raw(columns.image, &mut self.pixels)
                    .map_err(|reason| corrupt(&self.key, reason))?;
                &self.pixels
            }
        };
        Ok(Record {
            index,
            key: &self.key,
            label,
            payload,
        })
    }

    /// A set larger than memory has the batch's samples read from the disk together
    /// (`ShardData::plan_read`): their places in the offset tables first (small, and mostly
    /// cached: every read of a shard reads its table), then the samples those give.
    fn plan_reads(&mut self, indices: &[usize]) {
        let shared = &*self.shared;
        let planned = || {
            indices
                .iter()
                .filter(|&&i| i < shared.info.num_samples)
                .map(|&i| shared.locate(i))
        };
        for (number, within) in planned() {
            for part in sample_place(within) {
                shared.shards[number]
                    .data
                    .plan_read(part.start as u64, part.len() as u64);
            }
        }
        for (number, within) in planned() {
            let shard = &shared.shards[number];
            // Only a shard read at random is worth reading the table of here (the read would
            // be asked for and dropped otherwise); a table the disk cannot supply is the
            // sample's read's to report.
            if !shard.data.reads_at_random() {
                continue;
            }
            let Some(mapped) = shard.data.get_if_resident() else {
                continue;
            };
            let bytes = mapped.bytes();
            if check_place_readable(&shard.path, bytes, within).is_ok()
                && let Ok(span) = sample_span(bytes, shard.samples, within)
            {
                shard
                    .data
                    .plan_read(span.start as u64, (span.end - span.start) as u64);
            }
        }
    }

    fn prefetch(&mut self, index: usize) {
        let shared = &*self.shared;
        if index >= shared.info.num_samples {
            return;
        }
        let (number, within) = shared.locate(index);
        let shard = &shared.shards[number];
        if let Some(mapped) = shard.data.get_if_resident()
            && let Ok(columns) =
                sample_columns(mapped.bytes(), shard.samples, within, &shared.layout)
        {
            crate::dataset::prefetch(columns.image);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use index::Column;

    fn layout() -> Layout {
        let column = |name: &str, encoding: &str, size| Column {
            name: name.into(),
            encoding: encoding.into(),
            size,
        };
        Layout {
            columns: vec![
                column("i", "int", Some(8)),
                column("x", "jpeg", None),
                column("y", "int32", Some(4)),
                column("note", "str", None),
            ],
            image: (1, ImageColumn::Encoded),
            label: (
                2,
                LabelColumn::Int {
                    bytes: 4,
                    signed: true,
                },
            ),
            key: Some(3),
        }
    }

    /// A shard as MDSWriter lays it out, of samples `(image, label)`.
    fn shard(samples: &[(&[u8], i32)]) -> Vec<u8> {
        let config = br#"{"format": "mds"}"#;
        let bodies: Vec<Vec<u8>> = samples
            .iter()
            .enumerate()
            .map(|(i, (image, label))| {
                let mut body = Vec::new();
                body.extend_from_slice(&(image.len() as u32).to_le_bytes());
                body.extend_from_slice(&2u32.to_le_bytes());
                body.extend_from_slice(&(i as i64).to_le_bytes());
                body.extend_from_slice(image);
                body.extend_from_slice(&label.to_le_bytes());
                body.extend_from_slice(b"hi");
                body
            })
            .collect();
        let mut out = (samples.len() as u32).to_le_bytes().to_vec();
        let mut offset = 4 + 4 * (samples.len() + 1) + config.len();
        out.extend_from_slice(&(offset as u32).to_le_bytes());
        for body in &bodies {
            offset += body.len();
            out.extend_from_slice(&(offset as u32).to_le_bytes());
        }
        out.extend_from_slice(config);
        for body in &bodies {
            out.extend_from_slice(body);
        }
        out
    }

    #[test]
    fn samples_are_cut_into_columns_by_their_sizes() {
        let bytes = shard(&[(b"first image", 3), (b"second", -2)]);
        let layout = layout();
        let first = sample_columns(&bytes, 2, 0, &layout).unwrap();
        assert_eq!(first.image, b"first image");
        assert_eq!(first.key, Some(&b"hi"[..]));
        assert_eq!(decode_label(first.label, layout.label.1), Ok(3));
        let second = sample_columns(&bytes, 2, 1, &layout).unwrap();
        assert_eq!(second.image, b"second");
        assert_eq!(decode_label(second.label, layout.label.1), Ok(-2));
    }

    #[test]
    fn damaged_shards_give_reasons_never_panics() {
        let bytes = shard(&[(b"first image", 3), (b"second", 1)]);
        let layout = layout();
        // A count that differs from the index's, and every cut of the shard.
        assert!(
            sample_columns(&bytes, 3, 0, &layout)
                .err()
                .unwrap()
                .contains("holds 2")
        );
        for cut in 0..bytes.len() {
            for within in 0..2 {
                let _ = sample_columns(&bytes[..cut], 2, within, &layout);
            }
        }
        // A variable size claiming more than the sample holds.
        let mut grown = bytes.clone();
        let first_sample = read_u32(&bytes, 4).unwrap() as usize;
        grown[first_sample..first_sample + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let reason = sample_columns(&grown, 2, 0, &layout).err().unwrap();
        assert!(reason.contains("runs past"), "{reason}");
        // Offsets out of order.
        let mut swapped = bytes.clone();
        swapped[4..8].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
        assert!(sample_columns(&swapped, 2, 0, &layout).is_err());
        // Every single byte flipped: an error or columns, never a panic.
        for at in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0xff;
            for within in 0..2 {
                let _ = sample_columns(&flipped, 2, within, &layout);
            }
        }
    }

    #[test]
    fn labels_decode_by_width_sign_and_text() {
        let int = |bytes, signed| LabelColumn::Int { bytes, signed };
        assert_eq!(decode_label(&[0xff], int(1, true)), Ok(-1));
        assert_eq!(decode_label(&[0xff], int(1, false)), Ok(255));
        assert_eq!(decode_label(&7u16.to_le_bytes(), int(2, false)), Ok(7));
        assert!(decode_label(&u64::MAX.to_le_bytes(), int(8, false)).is_err());
        assert!(decode_label(&[1, 2, 3], int(4, true)).is_err());
        assert_eq!(decode_label(b"42", LabelColumn::Text), Ok(42));
        assert!(decode_label(b"cat", LabelColumn::Text).is_err());
    }

    #[test]
    fn pil_pixels_become_rgb_and_bad_sizes_are_refused() {
        let pil = |mode: &[u8], width: u32, height: u32, pixels: &[u8]| {
            let mut v = Vec::new();
            for n in [width, height, mode.len() as u32] {
                v.extend_from_slice(&n.to_le_bytes());
            }
            v.extend_from_slice(mode);
            v.extend_from_slice(pixels);
            v
        };
        let mut out = Vec::new();
        pil_to_raw(&pil(b"L", 2, 1, &[10, 20]), &mut out).unwrap();
        assert_eq!(
            crate::decode::RawImage::parse(&out).unwrap(),
            (2, 1, &[10, 10, 10, 20, 20, 20][..])
        );
        pil_to_raw(&pil(b"RGBA", 1, 1, &[1, 2, 3, 4]), &mut out).unwrap();
        assert_eq!(crate::decode::RawImage::parse(&out).unwrap().2, &[1, 2, 3]);
        assert!(pil_to_raw(&pil(b"RGB", 60000, 60000, &[1, 2, 3]), &mut out).is_err());
        assert!(pil_to_raw(&pil(b"CMYK", 1, 1, &[1, 2, 3, 4]), &mut out).is_err());
        assert!(pil_to_raw(&pil(b"RGB", 1, 1, &[1, 2, 3])[..13], &mut out).is_err());
    }
}
