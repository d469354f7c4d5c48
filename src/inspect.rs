//! What a dataset holds: `pack-dataset inspect`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::dataset::{Dataset, PayloadKind, par_map_chunks};
use crate::error::{Error, Result};
use crate::format::lmdb::{Lmdb, SharedHeaderSummary};
use crate::format::{self, OpenOptions, staging};
use crate::pack;

/// Samples of one class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClassCount {
    /// Class name.
    pub name: String,
    /// Number of samples with this label.
    pub count: usize,
}

/// Minimum, median and maximum of one dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Spread {
    /// Smallest value.
    pub min: u32,
    /// Median (lower middle for an even count).
    pub median: u32,
    /// Largest value.
    pub max: u32,
}

impl Spread {
    /// The spread of values given as `(value, how many)` pairs, in any order.
    fn of(counted: impl IntoIterator<Item = (u32, usize)>) -> Spread {
        let mut histogram: BTreeMap<u32, usize> = BTreeMap::new();
        for (value, count) in counted.into_iter().filter(|&(_, count)| count > 0) {
            *histogram.entry(value).or_default() += count;
        }
        let total: usize = histogram.values().sum();
        let (Some((&min, _)), Some((&max, _))) =
            (histogram.first_key_value(), histogram.last_key_value())
        else {
            return Spread::default();
        };
        // The lower middle: the value at position (total - 1) / 2 in sorted order.
        let middle = (total - 1) / 2;
        let mut before = 0;
        let median = histogram
            .iter()
            .find(|&(_, &count)| {
                before += count;
                before > middle
            })
            .map_or(max, |(&value, _)| value);
        Spread { min, median, max }
    }
}

/// A frequent image size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SizeCount {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Samples of this size.
    pub count: usize,
}

/// A record that could not be read or whose header could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BadRecord {
    /// Record index.
    pub index: usize,
    /// Record key, or `#index` if unreadable.
    pub key: String,
    /// What went wrong.
    pub reason: String,
}

/// How many bad records an [`Inspection`] lists; it counts them all
/// ([`Inspection::bad_record_count`]).
pub const LISTED_BAD_RECORDS: usize = 1000;

/// The result of [`inspect`].
#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    /// Path inspected.
    #[serde(serialize_with = "crate::file::serialize_lossy")]
    pub path: PathBuf,
    /// Format name.
    pub format: String,
    /// False for an interrupted pack.
    pub complete: bool,
    /// Number of samples (committed so far, for an incomplete pack).
    pub num_samples: usize,
    /// Payload kind.
    pub payload: PayloadKind,
    /// Pack-time resize, if any.
    pub resized_short_side: Option<u32>,
    /// Whether the JPEGs were rewritten with restart markers at pack time.
    pub restart_markers: bool,
    /// The JPEG headers stored once and shared by the samples (an LMDB packed with
    /// `--shared-headers`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_headers: Option<SharedHeaderSummary>,
    /// Samples per class, in label order.
    pub classes: Vec<ClassCount>,
    /// Sum of payload sizes.
    pub payload_bytes: u64,
    /// Size on disk (the file, or all sample files of a folder); for a URL, of the objects it
    /// names in storage.
    pub file_bytes: u64,
    /// Spread of widths.
    pub width: Spread,
    /// Spread of heights.
    pub height: Spread,
    /// The most common sizes (up to 5).
    pub common_sizes: Vec<SizeCount>,
    /// Samples per payload format (jpeg, png, raw-rgb8, ...).
    pub payload_formats: BTreeMap<String, usize>,
    /// Records that could not be read or parsed: the first [`LISTED_BAD_RECORDS`] of them.
    pub bad_records: Vec<BadRecord>,
    /// How many records could not be read or parsed in all.
    pub bad_record_count: usize,
    /// Files rejected when the dataset was packed (packed formats only).
    pub rejected_at_pack: Option<usize>,
    /// What opening the dataset reported (e.g. an index built for a TFRecord shard).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
    /// Members of its shard set that are missing (then `complete` is false): the first
    /// [`NAMED_MISSING`](crate::format::shards::NAMED_MISSING) of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_shards: Vec<String>,
    /// How many members of its shard set are missing.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub missing_shard_count: u64,
    /// How many members of its shard set hold no sample while others do (then `complete` is
    /// false: a copy cut short looks like this; the notices name them).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub empty_shards: u64,
    /// How many of its shards are cut short (then `complete` is false): shorter than its index
    /// of them says (their records past the cut are bad records), or, in a format that counts
    /// its records nowhere, found cut at their end by the scan at open (a bad record there
    /// stands for the lost tail). The notices name them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cut_shards: u64,
    /// How many of its shards hold fewer than half the samples the set's others hold, the last
    /// not compared, in a format that counts its records nowhere: what a shard cut exactly
    /// between two records looks like, which nothing else tells. `complete` cannot say no
    /// (uneven shards are legal); the notices name them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub short_shards: u64,
}

impl Inspection {
    /// True when the dataset is complete and every record read: what `pack-dataset inspect`
    /// exits 0 for.
    pub fn is_whole(&self) -> bool {
        self.complete && self.bad_record_count == 0
    }
}

/// Lets an `Arc<dyn Dataset>` stand where a `Box<dyn Dataset>` is wanted.
struct ArcDataset(std::sync::Arc<dyn Dataset>);

impl Dataset for ArcDataset {
    fn info(&self) -> &crate::dataset::DatasetInfo {
        self.0.info()
    }
    fn path(&self) -> &Path {
        self.0.path()
    }
    fn open_reader(&self) -> Result<Box<dyn crate::dataset::RecordReader>> {
        self.0.open_reader()
    }
    fn notices(&self) -> &[String] {
        self.0.notices()
    }
    fn missing_shards(&self) -> &crate::format::shards::MissingShards {
        self.0.missing_shards()
    }
    fn shard_starts(&self) -> Option<&[usize]> {
        self.0.shard_starts()
    }
    fn suspect_empty_shards(&self) -> usize {
        self.0.suspect_empty_shards()
    }
    fn cut_shards(&self) -> usize {
        self.0.cut_shards()
    }
    fn shards_cut_at_end(&self) -> Vec<(usize, &Path)> {
        self.0.shards_cut_at_end()
    }
    fn short_shards(&self) -> usize {
        self.0.short_shards()
    }
    fn plan_shards(&self, upcoming: &[usize]) {
        self.0.plan_shards(upcoming)
    }
}

/// Inspects the dataset at `path`: complete or not, classes with counts, bytes, image sizes.
/// An interrupted pack is reported as incomplete rather than refused.
pub fn inspect(path: impl AsRef<Path>) -> Result<Inspection> {
    inspect_with(path, &OpenOptions::default())
}

/// [`inspect`] with reading options. A shard set with members missing is reported (incomplete,
/// naming them) rather than refused, whatever `options.allow_missing_shards` says.
pub fn inspect_with(path: impl AsRef<Path>, options: &OpenOptions) -> Result<Inspection> {
    let path = path.as_ref();
    let options = options.clone().with_allow_missing_shards(true);
    let opened = |path: &Path| -> Result<Box<dyn Dataset>> {
        Ok(Box::new(ArcDataset(format::open_with(path, &options)?)))
    };
    let (dataset, complete, rejected_at_pack, shared_headers): (
        Box<dyn Dataset>,
        bool,
        Option<usize>,
        Option<SharedHeaderSummary>,
    ) = if (path.is_dir() && !path.join("data.mdb").is_file())
        || (!path.exists() && format::shards::is_pattern(path))
        || path.to_str().is_some_and(crate::remote::is_url)
    {
        (opened(path)?, true, None, None)
    } else if format::hdf5::has_signature(path)
        || format::tfrecord::is_shard_name(path)
        || format::webdataset::is_shard_name(path)
        || path
            .file_name()
            .is_some_and(|n| n == format::mds::index::INDEX)
        || (!path.exists() && staging::partial_path(path).is_dir())
    {
        // Incomplete HDF5 and records outputs are refused with an error that says how to
        // finish them.
        (opened(path)?, true, None, None)
    } else {
        let path = &if path.is_dir() {
            path.join("data.mdb")
        } else {
            path.to_path_buf()
        };
        let target = if !path.exists() && staging::partial_path(path).exists() {
            staging::partial_path(path)
        } else {
            path.to_path_buf()
        };
        if !format::lmdb::has_magic(&target)? {
            // Not LMDB either: the error `open` gives for what it cannot read.
            return Err(format::open_with(path, &options).err().unwrap_or_else(|| {
                Error::not_a_dataset(path, "not an LMDB file (bad magic number)")
            }));
        }
        let lmdb = Lmdb::open_incomplete(&target)?;
        let rejected = lmdb
            .info()
            .rejected_at_pack
            .or_else(|| lmdb.pack_progress().map(|p| p.rejected.len()));
        // Under a staging name it is unfinished whatever it says: a kill between marking
        // it complete and renaming it, or the old dataset of a replacement.
        let complete = lmdb.is_complete() && !staging::is_staging_name(&target);
        let shared = lmdb.shared_headers();
        (Box::new(lmdb), complete, rejected, shared)
    };
    Ok(inspect_dataset(
        path,
        dataset.as_ref(),
        complete,
        (rejected_at_pack, shared_headers),
        &options,
    ))
}

/// [`inspect`] for a list of shard files read as one dataset ([`format::open_files`]).
pub fn inspect_files(files: &[PathBuf], options: &OpenOptions) -> Result<Inspection> {
    let options = options.clone().with_allow_missing_shards(true);
    let dataset = format::open_files(files, &options)?;
    let label = files.first().map_or(Path::new(""), PathBuf::as_path);
    Ok(inspect_dataset(
        label,
        dataset.as_ref(),
        true,
        (None, None),
        &options,
    ))
}

/// Reads every record of an opened dataset for [`inspect`]; `path` names it in the report,
/// with what the caller found of the files rejected at pack time and the shared headers.
fn inspect_dataset(
    path: &Path,
    dataset: &dyn Dataset,
    complete: bool,
    (rejected_at_pack, shared_headers): (Option<usize>, Option<SharedHeaderSummary>),
    options: &OpenOptions,
) -> Inspection {
    let info = dataset.info().clone();
    let rejected_at_pack = rejected_at_pack.or(info.rejected_at_pack);
    let missing = dataset.missing_shards();
    let (missing_shards, missing_shard_count) = (missing.named.clone(), missing.count);
    let empty_shards = dataset.suspect_empty_shards() as u64;
    let cut_shards = (dataset.cut_shards() + dataset.shards_cut_at_end().len()) as u64;
    let complete = complete && missing.is_empty() && empty_shards == 0 && cut_shards == 0;
    let short_shards = dataset.short_shards() as u64;

    struct Seen {
        label: u32,
        bytes: u64,
        size: Option<(u32, u32, &'static str)>,
        error: Option<BadRecord>,
    }
    let mut counts = vec![0usize; info.classes.len()];
    let mut sizes: BTreeMap<(u32, u32), usize> = BTreeMap::new();
    let mut formats = BTreeMap::new();
    let mut bad_records = Vec::new();
    let mut bad_record_count = 0;
    let mut payload_bytes = 0;
    par_map_chunks(
        dataset,
        |decoder, record| match record {
            Ok(record) => {
                let header = decoder.header(record.payload);
                Seen {
                    label: record.label,
                    bytes: record.payload.len() as u64,
                    size: header
                        .as_ref()
                        .ok()
                        .map(|h| (h.width, h.height, h.format.name())),
                    error: header.err().map(|e| BadRecord {
                        index: record.index,
                        key: record.key.to_string(),
                        reason: e.to_string(),
                    }),
                }
            }
            Err(unread) => Seen {
                label: u32::MAX,
                bytes: 0,
                size: None,
                error: Some(BadRecord {
                    index: usize::MAX,
                    key: unread.key,
                    reason: unread.message,
                }),
            },
        },
        |first, seen| {
            for (index, s) in (first..).zip(seen) {
                if let Some(c) = counts.get_mut(s.label as usize) {
                    *c += 1;
                }
                payload_bytes += s.bytes;
                if let Some((w, h, fmt)) = s.size {
                    *sizes.entry((w, h)).or_default() += 1;
                    *formats.entry(fmt.to_string()).or_default() += 1;
                }
                if let Some(mut bad) = s.error {
                    bad_record_count += 1;
                    if bad_records.len() < LISTED_BAD_RECORDS {
                        bad.index = index;
                        bad_records.push(bad);
                    }
                }
            }
        },
    );
    let width = Spread::of(sizes.iter().map(|(&(w, _), &n)| (w, n)));
    let height = Spread::of(sizes.iter().map(|(&(_, h), &n)| (h, n)));
    let common_sizes = most_common_sizes(sizes, 5);
    let file_bytes = if info.format == crate::dataset::FormatKind::Folder {
        payload_bytes
    } else {
        selected_bytes(dataset.path(), options)
    };
    Inspection {
        path: path.to_path_buf(),
        format: info.format.name().into(),
        complete,
        num_samples: info.num_samples,
        payload: info.payload,
        resized_short_side: info.resized_short_side,
        restart_markers: info.restart_markers,
        shared_headers,
        classes: info
            .classes
            .iter()
            .zip(counts)
            .map(|(name, count)| ClassCount {
                name: name.clone(),
                count,
            })
            .collect(),
        payload_bytes,
        file_bytes,
        width,
        height,
        common_sizes,
        payload_formats: formats,
        bad_records,
        bad_record_count,
        rejected_at_pack,
        notices: dataset.notices().to_vec(),
        missing_shards,
        missing_shard_count,
        empty_shards,
        cut_shards,
        short_shards,
    }
}

/// The `n` most frequent image sizes, the most frequent first (ties: the smaller size first).
fn most_common_sizes(sizes: BTreeMap<(u32, u32), usize>, n: usize) -> Vec<SizeCount> {
    let mut common: Vec<SizeCount> = sizes
        .into_iter()
        .map(|((width, height), count)| SizeCount {
            width,
            height,
            count,
        })
        .collect();
    common.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then((a.width, a.height).cmp(&(b.width, b.height)))
    });
    common.truncate(n);
    common
}

/// Whether `n` is zero (serde: a count left out of the JSON when none).
fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Bytes on disk of what `path` names: a file, a directory's files, or the files a pattern
/// picks; for a URL, of the objects it names in storage (0 where they cannot be listed now).
fn selected_bytes(path: &Path, options: &OpenOptions) -> u64 {
    if let Some(url) = path.to_str().filter(|p| crate::remote::is_url(p)) {
        #[cfg(feature = "remote")]
        return format::remote::stored_bytes(url, options).unwrap_or(0);
        #[cfg(not(feature = "remote"))]
        return {
            let _ = (url, options);
            0
        };
    }
    match format::shards::Selection::of(path) {
        format::shards::Selection::Pattern(pattern) => {
            format::shards::expand_selection(&pattern, true)
                .map(|(files, _)| files.iter().map(|f| pack::disk_bytes(f)).sum())
                .unwrap_or(0)
        }
        _ => pack::disk_bytes(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_from_counts_is_the_spread_of_the_values_they_count() {
        // Against the values themselves, sorted: min, lower middle, max.
        let cases: [&[(u32, usize)]; 5] = [
            &[(5, 1), (1, 2), (9, 1)],
            &[(7, 1)],
            &[(3, 2), (4, 2)],
            &[(10, 0), (2, 3), (8, 1), (2, 1)],
            &[(640, 1000), (480, 999), (1, 1)],
        ];
        for counted in cases {
            let mut values: Vec<u32> = counted
                .iter()
                .flat_map(|&(v, n)| std::iter::repeat_n(v, n))
                .collect();
            values.sort_unstable();
            let expected = Spread {
                min: values[0],
                median: values[(values.len() - 1) / 2],
                max: values[values.len() - 1],
            };
            assert_eq!(Spread::of(counted.iter().copied()), expected, "{counted:?}");
        }
        assert_eq!(Spread::of([]), Spread::default());
    }
}
