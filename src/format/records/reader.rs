//! The records reader: shards and indexes memory-mapped once, O(1) access to any record, both
//! CRCs checked on every read; ours (with a manifest) and other tools' shards.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::framing::unframe;
use super::index::{check_index_covers, index_path_for, parse_index, push_index_line};
use super::{MAGIC, MANIFEST, Manifest, PROGRESS, VERSION, features, is_shard_name, scan_shard};
use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::{example, output};

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
