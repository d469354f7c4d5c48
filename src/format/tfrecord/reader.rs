//! The records reader: shards and indexes memory-mapped once, O(1) access to any record, both
//! CRCs checked on every read; ours (with a manifest) and other tools' shards.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[cfg(feature = "remote")]
use super::foreign::save_remote_index;
use super::foreign::{open_foreign, planner};
use super::framing::unframe;
use super::index::{self, check_index_covers, parse_index, push_index_line};
use super::{
    MAGIC, MANIFEST, Manifest, PROGRESS, RAW_FORMAT_NAME, VERSION, features, is_shard_name,
};
use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::shard_data::{HeldShard, Mapped, ShardData, ShardPlanner};
use crate::format::shards::{Picked, Selection, SetReport, check_sets};
use crate::format::{OpenOptions, example, staging};

/// How to read TFRecord shards that carry no imagefeed manifest: `RecordsOptions::default()`
/// and its `with_*` builders (new fields may come in any release).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordsOptions {
    /// The smallest label in the shards (ImageNet TFRecords: 1). Ignored when a manifest says.
    pub label_base: Option<u32>,
    /// Number of classes; when unset, found by scanning every record's label at open.
    pub num_classes: Option<usize>,
}

impl RecordsOptions {
    /// With [`label_base`](Self::label_base).
    pub fn with_label_base(mut self, base: Option<u32>) -> Self {
        self.label_base = base;
        self
    }

    /// With [`num_classes`](Self::num_classes).
    pub fn with_num_classes(mut self, classes: Option<usize>) -> Self {
        self.num_classes = classes;
        self
    }

    /// The classes `"0".."N-1"` when a count was given (refused above
    /// [`MAX_CLASSES`](crate::dataset::MAX_CLASSES)); `None`: find them from the labels.
    pub(crate) fn given_classes(&self) -> Result<Option<Vec<String>>> {
        match self.num_classes {
            Some(n) if n > crate::dataset::MAX_CLASSES => Err(Error::Config(format!(
                "{n} classes: at most {} are allowed",
                crate::dataset::MAX_CLASSES
            ))),
            Some(n) => Ok(Some((0..n).map(|c| c.to_string()).collect())),
            None => Ok(None),
        }
    }
}

pub(super) struct Shard {
    pub(super) path: PathBuf,
    /// The shard's bytes: mapped at open for a local shard, fetched when needed for a remote
    /// one.
    pub(super) data: Arc<ShardData>,
    /// `(offset, length)` of each record.
    pub(super) records: Vec<(u64, u64)>,
    /// Records that are damaged byte ranges a scan could not frame, by position in `records`,
    /// with what the scan found; reading one is a bad record that says so.
    pub(super) damaged: std::collections::HashMap<usize, String>,
    /// Whether the scan found the shard cut short at its end ([`ShardScan::cut_end`]): its last
    /// record, a bad one, stands for a tail of unknown length.
    ///
    /// [`ShardScan::cut_end`]: super::ShardScan::cut_end
    pub(super) cut_end: bool,
    /// Whether `records` came from scanning a shard that has no index file and scanned clean:
    /// an index [`Records::save_missing_indexes`] may save.
    pub(super) unsaved_index: bool,
}

pub(super) struct Shared {
    pub(super) path: PathBuf,
    pub(super) info: DatasetInfo,
    pub(super) label_base: u32,
    pub(super) shards: Vec<Shard>,
    /// Index of each shard's first record; a final entry holds the total.
    pub(super) starts: Vec<usize>,
    pub(super) notices: Vec<String>,
    /// Shards of ours shorter than their manifest lists.
    pub(super) cut_shards: usize,
    /// Members of the set that are missing, when that was allowed.
    pub(super) missing_shards: crate::format::shards::MissingShards,
    /// Other tools' shards holding under half the records the others do
    /// ([`Dataset::short_shards`]).
    pub(super) short_shards: usize,
    /// Fetches remote shards ahead of the loader; `None` when every shard is local.
    pub(super) planner: Option<ShardPlanner>,
    /// Whether the classes are those of our manifest, whose writer put each record's class
    /// name in it ([`features::SYNSET`]): every read checks that name against the class its
    /// label gives, so a manifest changed since packing (its label base or classes) makes
    /// bad records instead of labels silently shifted or renamed.
    pub(super) names_checked: bool,
}

impl Shared {
    /// The number of the shard holding record `index` (`< num_samples`), and the record's
    /// place in it.
    fn locate_number(&self, index: usize) -> (usize, usize) {
        crate::format::shards::locate(&self.starts, index)
    }
}

/// Record shards opened for reading.
pub struct Records {
    pub(super) shared: Arc<Shared>,
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

    /// Opens a records directory or a single shard, or the shards a pattern in the last
    /// component matches (`DIR/train-*`).
    pub fn open_with(path: impl AsRef<Path>, options: &RecordsOptions) -> Result<Records> {
        let options = OpenOptions {
            records: options.clone(),
            ..OpenOptions::default()
        };
        Self::open_selection(&Selection::of(path.as_ref()), &options)
    }

    /// Opens the shards `selection` names (see [`crate::format::shards`]): a directory of ours
    /// (with a manifest) as packed, or the set a directory, pattern, list or file names,
    /// checked to be one whole set (a directory) or whole sets (a pattern, a list) unless
    /// `options.allow_missing_shards`.
    pub fn open_selection(selection: &Selection, options: &OpenOptions) -> Result<Records> {
        if let Selection::File(path) | Selection::Pattern(path) = selection
            && let Some(text) = path.to_str()
            && crate::remote::is_url(text)
        {
            return Self::open_url(text, options);
        }
        let mut brace_missing = Vec::new();
        // The manifest of ours beside the shards a pattern picks: its classes, not inferred.
        let mut ours = None;
        let (name, files, picked) = match selection {
            Selection::Directory(dir) => {
                if let Some(records) = open_directory_of_ours(dir, options.allow_missing_shards)? {
                    return Ok(records);
                }
                (dir.as_path(), shard_files_in(dir)?, Picked::All)
            }
            Selection::Pattern(pattern) => {
                let (files, missing) =
                    crate::format::shards::expand_selection(pattern, options.allow_missing_shards)?;
                brace_missing = missing;
                // Index files, our manifests and reports are never data, whatever a pattern
                // matches.
                let files: Vec<PathBuf> = files
                    .into_iter()
                    .filter(|f| {
                        !super::is_never_a_shard(
                            f.file_name().and_then(|n| n.to_str()).unwrap_or(""),
                        )
                    })
                    .collect();
                // A pattern that matched only those matched no data (not an empty dataset).
                if files.is_empty() {
                    return Err(Error::ShardSet {
                        path: pattern.clone(),
                        problem: crate::format::shards::ShardSetProblem::NoMatch,
                    });
                }
                let dir = pattern.parent().unwrap_or(Path::new("."));
                let (missing, manifest) = missing_from_our_manifest(dir, pattern, &files, options)?;
                brace_missing.extend(missing);
                ours = manifest;
                (pattern.as_path(), files, Picked::by_local_pattern(pattern))
            }
            Selection::List(files) => {
                let Some(first) = files.first() else {
                    return Err(Error::Config("an empty list of shards".into()));
                };
                (first.as_path(), files.clone(), Picked::ByName)
            }
            Selection::File(file) => {
                staging::refuse_interrupted(file)?;
                fs::metadata(file).at(file)?;
                let set = SetReport::default();
                let ours = manifest_listing(file)?;
                return open_foreign(file, std::slice::from_ref(file), set, options, ours);
            }
        };
        let mut set = check_sets(name, &files, picked, options.allow_missing_shards)?;
        set.add_missing(brace_missing);
        open_foreign(name, &files, set, options, ours)
    }

    /// Opens the TFRecord shards a URL names (`s3://bucket/prefix/`; feature `remote`).
    pub fn open_url(text: &str, options: &OpenOptions) -> Result<Records> {
        #[cfg(feature = "remote")]
        {
            crate::format::remote::open_records_url(text, options)
        }
        #[cfg(not(feature = "remote"))]
        {
            let _ = options;
            let url = crate::remote::RemoteUrl::parse(text)?;
            Err(Error::FeatureDisabled {
                path: url.to_string().into(),
                what: "reading from object storage",
                feature: "remote",
            })
        }
    }

    /// The label base: stored labels are class index + this.
    pub fn label_base(&self) -> u32 {
        self.shared.label_base
    }

    /// Saves the index each shard opened without one got by scanning (in the `tfrecord`
    /// package's format, at [`saved_index_path`](super::index::saved_index_path): the `index/`
    /// sub-directory of the shard's directory), so later opens read it instead of scanning. Opening never writes; this is the explicit request (`pack-dataset index`).
    /// Returns the indexes written.
    ///
    /// A shard whose scan found damage gets none (it is scanned, and the damage reported,
    /// at every open), and an index file that appeared since opening is left as it is. Each
    /// index is written to a temporary file, synced and renamed into place, never through a
    /// link; an error names the file and leaves the indexes already written in place.
    pub fn save_missing_indexes(&self) -> Result<Vec<PathBuf>> {
        let mut written = Vec::new();
        for shard in self.shared.shards.iter().filter(|s| s.unsaved_index) {
            let mut lines = String::new();
            for &(offset, len) in &shard.records {
                push_index_line(&mut lines, offset, len);
            }
            #[cfg(feature = "remote")]
            if let Some(object) = shard.data.object() {
                written.push(save_remote_index(object, &lines)?);
                continue;
            }
            let index_path = index::saved_index_path(&shard.path);
            if fs::symlink_metadata(&index_path).is_ok() {
                continue;
            }
            if let Some(dir) = index_path.parent()
                && !dir.is_dir()
            {
                fs::create_dir(dir).at(dir)?;
            }
            staging::write_file_atomically(&index_path, lines.as_bytes())?;
            written.push(index_path);
        }
        Ok(written)
    }
}

/// Opens `dir` when it is a records dataset of ours (a manifest); `None` when it is a directory
/// of other tools' shards. A writer's staging directory is refused: its shards hold only some
/// of the records. Shards the manifest lists that are gone are an error naming them, unless
/// `allow_missing` (then the rest are read, and the dataset says which are missing).
fn open_directory_of_ours(dir: &Path, allow_missing: bool) -> Result<Option<Records>> {
    staging::refuse_interrupted(dir)?;
    let manifest_path = dir.join(MANIFEST);
    if manifest_path.is_file() {
        return open_ours(dir, &manifest_path, allow_missing).map(Some);
    }
    refuse_staging_dir(dir)?;
    Ok(None)
}

/// Refuses `dir`, a directory without a manifest of ours, when it is the staging directory of a
/// pack of ours (interrupted, or being replaced), which holds only some of the records.
fn refuse_staging_dir(dir: &Path) -> Result<()> {
    if staging::staged_magic(dir, PROGRESS).as_deref() == Some(MAGIC)
        || staging::is_being_deleted(dir)
        || dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".partial"))
    {
        return Err(Error::Incomplete {
            path: dir.to_path_buf(),
            reason: "the staging directory of an interrupted or replaced pack, not a dataset; \
                     rerun the pack with --resume to finish it"
                .into(),
        });
    }
    Ok(())
}

/// The shards of ours that `pattern` (in `dir`) would pick and that are gone, when `dir` is a
/// directory of ours ([`picked_members_missing`](crate::format::shards::picked_members_missing));
/// `files`: what the pattern picked; and the manifest when the files are all its shards
/// ([`Manifest::claiming`]). A staging directory (a pack killed, or not yet published) is
/// refused as the directory is.
fn missing_from_our_manifest(
    dir: &Path,
    pattern: &Path,
    files: &[PathBuf],
    options: &OpenOptions,
) -> Result<(Vec<String>, Option<Manifest>)> {
    let Some(manifest) = manifest_in(dir)? else {
        refuse_staging_dir(dir)?;
        return Ok((Vec::new(), None));
    };
    let present: std::collections::HashSet<&std::ffi::OsStr> =
        files.iter().filter_map(|f| f.file_name()).collect();
    let missing = crate::format::shards::picked_members_missing(
        pattern,
        manifest.shard_files(),
        Picked::by_local_pattern(pattern),
        |name| present.contains(std::ffi::OsStr::new(name)),
        files.len(),
        options.allow_missing_shards,
    )?;
    let names = files
        .iter()
        .map(|f| f.file_name().and_then(|n| n.to_str()).unwrap_or_default());
    Ok((missing, manifest.claiming(dir, names)?))
}

/// The manifest of the dataset of ours that lists the shard `file`, if one does.
fn manifest_listing(file: &Path) -> Result<Option<Manifest>> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let Some(name) = file.file_name().and_then(|n| n.to_str()) else {
        return Ok(None);
    };
    match manifest_in(dir)? {
        Some(manifest) => manifest.claiming(dir, std::iter::once(name)),
        None => Ok(None),
    }
}

/// The manifest of ours in `dir`, if it has one.
fn manifest_in(dir: &Path) -> Result<Option<Manifest>> {
    let manifest_path = dir.join(MANIFEST);
    if !manifest_path.is_file() {
        return Ok(None);
    }
    let text = fs::read(&manifest_path).at(&manifest_path)?;
    parse_manifest(dir, &manifest_path, &text).map(Some)
}

/// The TFRecord shards in `dir`, by name ([`is_shard_name`]), in name order.
fn shard_files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let files: Vec<PathBuf> = fs::read_dir(dir)
        .at(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    let (mut found, tars): (Vec<PathBuf>, Vec<PathBuf>) = files
        .into_iter()
        .filter(|p| is_shard_name(p) || crate::format::webdataset::is_shard_name(p))
        .partition(|p| is_shard_name(p));
    found.sort();
    // WebDataset tars beside the TFRecord shards are another set, never passed over (a hostile
    // try read a directory of 20 TFRecords and 40 samples in tars as 20 samples, "complete").
    if let (Some(first), Some(tar)) = (found.first(), tars.iter().min()) {
        let name = |p: &Path| {
            crate::format::shards::shard_name(&p.file_name().unwrap_or_default().to_string_lossy())
        };
        return Err(Error::ShardSet {
            path: dir.to_path_buf(),
            problem: crate::format::shards::ShardSetProblem::Mixed {
                sets: vec![
                    (format!("TFRecord {}", name(first).set()), found.len()),
                    (format!("WebDataset {}", name(tar).set()), tars.len()),
                ],
                example: name(first).pattern(),
            },
        });
    }
    if found.is_empty() {
        return Err(Error::not_a_dataset(
            dir,
            format!(
                "no {MANIFEST} and no TFRecord shards (*.tfrecord, *-NNNNN-of-NNNNN, and \
                 those names with .gz)"
            ),
        ));
    }
    Ok(found)
}

/// A manifest of ours, checked: its magic and layout version, that the pack finished, and that
/// it names each shard and index once, as a plain file name beside it. `dir` and `at` name the
/// dataset and the manifest in errors.
pub(super) fn parse_manifest(dir: &Path, at: &Path, text: &[u8]) -> Result<Manifest> {
    let manifest: Manifest = serde_json::from_slice(text)
        .map_err(|e| Error::not_a_dataset(at, format!("malformed manifest: {e}")))?;
    crate::format::check_layout(
        at,
        "magic",
        &manifest.magic,
        MAGIC,
        manifest.version,
        VERSION,
    )?;
    crate::format::require_complete(dir, manifest.complete, "the manifest")?;
    crate::format::check_classes(at, &manifest.info.classes)?;
    // Every shard and index the manifest names is a plain file name inside `dir`, named once:
    // a manifest naming `../x`, an absolute path or one shard twice is not one we wrote.
    let mut named = std::collections::HashSet::new();
    for name in manifest.shards.iter().flat_map(|e| [&e.file, &e.index]) {
        let mut components = Path::new(name).components();
        let plain = matches!(components.next(), Some(std::path::Component::Normal(_)))
            && components.next().is_none();
        if !plain || !named.insert(name.as_str()) {
            return Err(Error::not_a_dataset(
                at,
                format!(
                    "the manifest names {name:?} {}: a manifest of ours names each shard and \
                     index once, as a file in its own directory",
                    if plain { "twice" } else { "as a path" }
                ),
            ));
        }
    }
    // Its shards' records add up to its count (the writer's own sum): a hostile manifest's
    // counts of 2^63 each overflowed the sum made when a shard is missing.
    let listed = manifest
        .shards
        .iter()
        .try_fold(0usize, |sum, entry| sum.checked_add(entry.records));
    if listed != Some(manifest.info.num_samples) {
        return Err(Error::not_a_dataset(
            at,
            format!(
                "the manifest says {} records, but its shards' counts add up to {}: not as \
                 its writer left it",
                manifest.info.num_samples,
                listed.map_or("more than any count".to_string(), |n| n.to_string())
            ),
        ));
    }
    Ok(manifest)
}

fn open_ours(dir: &Path, manifest_path: &Path, allow_missing: bool) -> Result<Records> {
    let text = fs::read(manifest_path).at(manifest_path)?;
    let manifest = parse_manifest(dir, manifest_path, &text)?;
    let (manifest, mut dropped) = drop_missing_shards(dir, manifest, allow_missing, |entry| {
        crate::format::shards::is_gone(&dir.join(&entry.file))
    })?;
    // Shards of up to 256 MiB together are read through as they are opened, in order, as a
    // small LMDB is (see `pagecache`): with only the advice, a cold epoch's workers faulted
    // pages in one by one in the sampler's order (CIFAR-10, one 11 MB shard: cold epochs ~58
    // -> ~54 ms). Larger sets that fit in half the available memory are advised to stream in;
    // sets larger than memory are read at random (`Mapped::ready_for`). The sizes are the
    // manifest's, which each shard's index is checked against just after.
    let total = manifest
        .shards
        .iter()
        .fold(0u64, |sum, entry| sum.saturating_add(entry.bytes));
    let prefetch = crate::pagecache::SetPrefetch::for_total(total);
    let mut shards = Vec::with_capacity(manifest.shards.len());
    let mut lens = Vec::with_capacity(manifest.shards.len());
    for entry in &manifest.shards {
        let path = dir.join(&entry.file);
        let index_path = dir.join(&entry.index);
        let (file, file_len) = crate::file::open_regular(&path)?;
        prefetch.read(&path, &file, file_len)?;
        let mapped = Mapped::new(&path, file, false)?;
        let map = mapped.bytes();
        let index_gone = matches!(
            fs::symlink_metadata(&index_path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound
        );
        let records = if index_gone {
            // Deleted (what a damaged index's error advises): the shard is scanned instead,
            // and must hold exactly what the manifest lists.
            let records = records_by_scan(&index_path, map, entry)?;
            crate::dataset::notice(
                &mut dropped.notices,
                format!(
                    "{}: missing; its shard was scanned instead (its {} records are those the \
                     manifest lists), as it will be at every open until the index is back",
                    index_path.display(),
                    records.len()
                ),
            );
            records
        } else {
            let index = {
                use std::io::Read as _;
                let (file, len) = crate::file::open_regular(&index_path)?;
                let mut index = Vec::with_capacity(len.min(1 << 30) as usize);
                file.take(len).read_to_end(&mut index).at(&index_path)?;
                index
            };
            entry_records(&index_path, &index, entry, map.len() as u64)?
        };
        lens.push(map.len() as u64);
        let data = Arc::new(ShardData::local(&path, mapped));
        shards.push(Shard {
            path,
            data,
            records,
            damaged: Default::default(),
            cut_end: false,
            unsaved_index: false,
        });
    }
    for shard in &shards {
        shard.data.ready_for(&prefetch);
    }
    assemble_ours(dir, manifest_path, manifest, dropped, shards, &lens)
}

/// A shard's records found by scanning its frames (its index is gone), refused unless the scan
/// finds no damage and exactly the records and bytes the manifest lists.
fn records_by_scan(
    index_path: &Path,
    map: &[u8],
    entry: &super::ShardEntry,
) -> Result<Vec<(u64, u64)>> {
    let scan = super::scan_shard(map);
    if !scan.damaged.is_empty()
        || scan.records.len() != entry.records
        || map.len() as u64 != entry.bytes
    {
        return Err(Error::not_a_dataset(
            index_path,
            format!(
                "missing, and its shard cannot stand in for it: a scan finds {} records in {} \
                 bytes ({} damaged ranges) where the manifest lists {} records in {} bytes",
                scan.records.len(),
                map.len(),
                scan.damaged.len(),
                entry.records,
                entry.bytes
            ),
        ));
    }
    Ok(scan.records)
}

/// One shard's records from its index, checked against what the manifest says of the shard
/// and the shard's actual length: the index must list the shard as the manifest describes it.
/// A shard cut short since leaves its last records unreadable, each a bad record that says so;
/// a longer one holds bytes that no record of ours covers.
pub(super) fn entry_records(
    index_path: &Path,
    index: &[u8],
    entry: &super::ShardEntry,
    shard_len: u64,
) -> Result<Vec<(u64, u64)>> {
    let records = parse_index(index_path, index)?;
    let end = check_index_covers(index_path, &records, shard_len)?;
    if end != entry.bytes || shard_len > entry.bytes {
        return Err(Error::not_a_dataset(
            index_path,
            format!(
                "the index ends at byte {end}, the shard has {shard_len} bytes, the manifest \
                 says {}: the shard or its index was changed",
                entry.bytes
            ),
        ));
    }
    if records.len() != entry.records {
        return Err(Error::not_a_dataset(
            index_path,
            format!(
                "lists {} records but the manifest says {}",
                records.len(),
                entry.records
            ),
        ));
    }
    Ok(records)
}

/// A shard of ours picked by a pattern or named alone, its records found through its index
/// (or a scan): they must be those `manifest` lists for it, as when the directory is opened
/// ([`entry_records`]). A hostile try copied a shard of another pack of the same classes into
/// a pack and read it by pattern as the pack's; an index taken from another pack made every
/// record of its shard bad instead of refusing.
pub(super) fn check_picked_shard(manifest: &Manifest, shard: &Shard) -> Result<()> {
    let name = shard
        .path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let Some(entry) = manifest.shards.iter().find(|e| e.file == name) else {
        return Ok(());
    };
    let end = shard
        .records
        .last()
        .map_or(0, |&(offset, len)| offset + len);
    if shard.records.len() != entry.records || end != entry.bytes {
        return Err(Error::not_a_dataset(
            &shard.path,
            format!(
                "its index (or a scan) finds {} records in {end} bytes, where the manifest \
                 beside it lists {} records in {} bytes: not the shard this pack wrote (copied \
                 from another?), or it or its index changed since",
                shard.records.len(),
                entry.records,
                entry.bytes
            ),
        ));
    }
    Ok(())
}

/// The shards a manifest of ours lists that are gone
/// ([`ShardSetProblem::Missing`](crate::format::shards::ShardSetProblem::Missing) naming them,
/// unless `allow_missing`), and the notice that says so.
pub(super) struct Dropped {
    pub missing: crate::format::shards::MissingShards,
    pub notices: Vec<String>,
}

/// `manifest` less the shards for which `gone` is true (missing from where it says they are),
/// when `allow_missing`; else those shards are an error naming them.
pub(super) fn drop_missing_shards(
    dir: &Path,
    mut manifest: Manifest,
    allow_missing: bool,
    gone: impl Fn(&super::ShardEntry) -> bool,
) -> Result<(Manifest, Dropped)> {
    let expected = manifest.shards.len();
    let (missing, present): (Vec<_>, Vec<_>) = manifest.shards.into_iter().partition(&gone);
    let mut notices = Vec::new();
    let missing = crate::format::shards::listed_members_missing(
        dir,
        missing.into_iter().map(|e| e.file).collect(),
        expected,
        allow_missing,
        &mut notices,
    )?;
    if !missing.is_empty() {
        // The dataset info describes the whole pack; what is left is what the remaining
        // shards' entries count.
        manifest.info.num_samples = present.iter().map(|e| e.records).sum();
    }
    manifest.shards = present;
    Ok((manifest, Dropped { missing, notices }))
}

/// Records of ours from its manifest and its shards (`lens`: each shard's length now),
/// checked to hold what it says. A shard shorter than the manifest lists is a notice and
/// counts in [`Dataset::cut_shards`]: its last records are bad records, and `inspect` does not
/// call the dataset complete.
pub(super) fn assemble_ours(
    dir: &Path,
    manifest_path: &Path,
    manifest: Manifest,
    dropped: Dropped,
    shards: Vec<Shard>,
    lens: &[u64],
) -> Result<Records> {
    let Dropped {
        missing,
        mut notices,
    } = dropped;
    let mut cut_shards = 0;
    for ((entry, shard), &len) in manifest.shards.iter().zip(&shards).zip(lens) {
        if len < entry.bytes {
            cut_shards += 1;
            let unreadable = shard.records.iter().filter(|r| r.0 + r.1 > len).count();
            crate::dataset::notice(
                &mut notices,
                format!(
                    "{}: cut short: {len} of the {} bytes the manifest lists (a copy or a \
                     write cut off?); its last {unreadable} of {} records are unreadable",
                    shard.path.display(),
                    entry.bytes,
                    shard.records.len()
                ),
            );
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
            planner: planner(&shards),
            shards,
            starts,
            notices,
            cut_shards,
            missing_shards: missing,
            // Our manifest counts every shard's records.
            short_shards: 0,
            names_checked: true,
        }),
    })
}

pub(super) fn starts(shards: &[Shard]) -> Vec<usize> {
    let mut starts = Vec::with_capacity(shards.len() + 1);
    let mut total = 0;
    starts.push(0);
    for shard in shards {
        total += shard.records.len();
        starts.push(total);
    }
    starts
}

pub(super) fn record_bytes(map: &[u8], offset: u64, len: u64) -> Option<&[u8]> {
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

    fn cut_shards(&self) -> usize {
        self.shared.cut_shards
    }

    fn shards_cut_at_end(&self) -> Vec<(usize, &Path)> {
        let shards = self.shared.shards.iter();
        crate::format::shards::cut_at_end(shards.map(|s| (s.cut_end, s.path.as_path())))
    }

    fn short_shards(&self) -> usize {
        self.shared.short_shards
    }

    fn missing_shards(&self) -> &crate::format::shards::MissingShards {
        &self.shared.missing_shards
    }

    fn feed_record_extents(&self, feed: &mut dyn FnMut(&[u8])) -> bool {
        for shard in &self.shared.shards {
            let name = shard
                .path
                .file_name()
                .map_or(&[][..], |n| n.as_encoded_bytes());
            feed(&(name.len() as u64).to_le_bytes());
            feed(name);
            feed(&(shard.records.len() as u64).to_le_bytes());
            for &(offset, len) in &shard.records {
                feed(&offset.to_le_bytes());
                feed(&len.to_le_bytes());
            }
        }
        true
    }

    fn shard_starts(&self) -> Option<&[usize]> {
        Some(&self.shared.starts)
    }

    fn plan_shards(&self, upcoming: &[usize]) {
        if let Some(planner) = &self.shared.planner {
            planner.plan(upcoming);
        }
    }

    fn path(&self) -> &Path {
        &self.shared.path
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(RecordsReader {
            shared: Arc::clone(&self.shared),
            key: String::new(),
            held: HeldShard::default(),
            copied: Vec::new(),
            #[cfg(feature = "remote")]
            ahead: ReadAhead::default(),
        }))
    }
}

/// Per-worker handle over the shared shards.
struct RecordsReader {
    shared: Arc<Shared>,
    key: String,
    /// The shard last read.
    held: HeldShard,
    /// The last record read: fetched with a ranged GET (a shard read record by record), or
    /// copied out of its shard's map before it is parsed ([`crate::mapguard::copy_readable`]:
    /// a page the disk cannot supply, or a shard cut under the map, is then an error here
    /// rather than SIGBUS in the decoder).
    copied: Vec<u8>,
    /// Ranged reads started ahead of need.
    #[cfg(feature = "remote")]
    ahead: ReadAhead,
}

/// The ranged reads of one worker's next records, started before they are read
/// ([`RecordReader::plan_reads`]): a batch costs about one round trip, not one per record.
#[cfg(feature = "remote")]
#[derive(Default)]
struct ReadAhead {
    /// Planned records not yet started, in order.
    planned: std::collections::VecDeque<usize>,
    /// Started reads: the record, its length, the read.
    started: Vec<(usize, u64, crate::remote::store::PendingRange)>,
}

/// At most this many ranged reads under way per worker...
#[cfg(feature = "remote")]
const READ_AHEAD_RECORDS: usize = 64;
/// ... and at most this many bytes.
#[cfg(feature = "remote")]
const READ_AHEAD_BYTES: u64 = 32 << 20;

#[cfg(feature = "remote")]
impl ReadAhead {
    /// Starts planned reads until the bounds are reached.
    fn top_up(&mut self, shared: &Shared) {
        let mut bytes: u64 = self.started.iter().map(|(_, len, _)| len).sum();
        while self.started.len() < READ_AHEAD_RECORDS && bytes < READ_AHEAD_BYTES {
            let Some(index) = self.planned.pop_front() else {
                break;
            };
            if index >= shared.info.num_samples {
                continue;
            }
            let (number, within) = shared.locate_number(index);
            let shard = &shared.shards[number];
            if shard.damaged.contains_key(&within) {
                continue;
            }
            let (offset, len) = shard.records[within];
            if let Some(read) = shard.data.start_range(offset, len) {
                bytes += len;
                self.started.push((index, len, read));
            }
        }
    }

    /// The started read of record `index`, if there is one (and it is no longer planned).
    fn take(&mut self, index: usize) -> Option<crate::remote::store::PendingRange> {
        self.planned.retain(|&i| i != index);
        let at = self.started.iter().position(|(i, _, _)| *i == index)?;
        Some(self.started.swap_remove(at).2)
    }
}

impl RecordReader for RecordsReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        assert!(
            index < self.shared.info.num_samples,
            "index {index} out of range for {} samples",
            self.shared.info.num_samples
        );
        let (number, within) = self.shared.locate_number(index);
        let shared = &*self.shared;
        let shard = &shared.shards[number];
        let corrupt = |key: &str, reason: String| Error::CorruptRecord {
            path: shard.path.clone(),
            index,
            key: key.to_string(),
            reason: format!("record {within} of the shard: {reason}"),
        };
        let unnamed = || format!("{}#{within}", shard.path.display());
        if let Some(reason) = shard.damaged.get(&within) {
            return Err(corrupt(&unnamed(), reason.clone()));
        }
        let (offset, len) = shard.records[within];
        let bytes = if shard.data.is_ranged() {
            // One GET for the record's bytes; its framing's CRCs check them below.
            // (An error is the store's, as a failed whole-shard fetch is: FileChanged stays
            // FileChanged, which fails the batch.)
            #[cfg(feature = "remote")]
            {
                let started = self.ahead.take(index);
                let read = match started {
                    Some(read) => shard.data.remember_change(read.wait(&mut self.copied)),
                    None => shard.data.read_range(offset, len, &mut self.copied),
                };
                self.ahead.top_up(shared);
                read?;
            }
            #[cfg(not(feature = "remote"))]
            shard.data.read_range(offset, len, &mut self.copied)?;
            &self.copied[..]
        } else {
            let map = self.held.bytes(number, &shard.data)?;
            let bytes = record_bytes(map, offset, len).ok_or_else(|| {
                corrupt(
                    &unnamed(),
                    format!(
                        "the index puts it at bytes {offset}..{} but the shard has {} \
                         (truncated?)",
                        offset.saturating_add(len),
                        map.len()
                    ),
                )
            })?;
            crate::mapguard::copy_readable(&shard.path, map, bytes, &mut self.copied)?
        };
        let data = unframe(bytes).map_err(|reason| {
            // A shard cut short under its map reads as zeros to the end of the page the cut
            // falls in: not damage but a changed file.
            let len = shard.data.mapped_len();
            len.and_then(|len| crate::mapguard::shrank(&shard.path, len, ""))
                .unwrap_or_else(|| corrupt(&unnamed(), reason))
        })?;
        let features = example::parse(data).map_err(|reason| corrupt(&unnamed(), reason))?;
        let key = match example::bytes(&features, features::FILENAME)
            .ok()
            .and_then(|k| std::str::from_utf8(k).ok())
        {
            Some(key) => key,
            None => {
                self.key = unnamed();
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
        if shared.names_checked {
            let class = &shared.info.classes[label as usize];
            let named = example::bytes(&features, features::SYNSET).unwrap_or_default();
            if named != class.as_bytes() {
                return Err(corrupt(
                    key,
                    format!(
                        "it names its class {:?}, but its label {stored} is class {class:?} by \
                         the manifest (label base {base}): the manifest's classes or label base \
                         changed since packing, or the record did",
                        String::from_utf8_lossy(named)
                    ),
                ));
            }
            // Our writer names raw pixels `RAW-RGB8`, anything else by its encoding: a
            // manifest whose payload kind was edited would read every record as the other.
            let stored = example::bytes(&features, features::FORMAT).unwrap_or_default();
            let raw = stored == RAW_FORMAT_NAME.as_bytes();
            if !stored.is_empty() && raw != (shared.info.payload == PayloadKind::RawRgb8) {
                return Err(corrupt(
                    key,
                    format!(
                        "it is stored as {:?}, but the manifest says the payloads are {}: the \
                         manifest's payload kind changed since packing, or the record did",
                        String::from_utf8_lossy(stored),
                        if raw { "encoded images" } else { "raw pixels" }
                    ),
                ));
            }
        }
        Ok(Record {
            index,
            key,
            label,
            payload,
        })
    }

    fn plan_reads(&mut self, indices: &[usize]) {
        #[cfg(feature = "remote")]
        if self.shared.shards.iter().any(|s| s.data.is_ranged()) {
            // A new batch: reads left from the last one (not read after all) are cancelled.
            self.ahead.started.clear();
            self.ahead.planned = indices.iter().copied().collect();
            self.ahead.top_up(&self.shared);
        }
        // A set larger than memory: the batch's records are read from the disk together
        // (`ShardData::plan_read`).
        for &index in indices {
            if index >= self.shared.info.num_samples {
                continue;
            }
            let (number, within) = self.shared.locate_number(index);
            let shard = &self.shared.shards[number];
            // (A damaged stretch the open's scan found is never read.)
            if !shard.damaged.contains_key(&within) {
                let (offset, len) = shard.records[within];
                shard.data.plan_read(offset, len);
            }
        }
    }

    fn rereads_are_cheap(&self) -> bool {
        #[cfg(feature = "remote")]
        if self.shared.shards.iter().any(|s| s.data.is_ranged()) {
            return false;
        }
        true
    }

    fn prefetch(&mut self, index: usize) {
        let shared = &*self.shared;
        if index >= shared.info.num_samples {
            return;
        }
        let (number, within) = shared.locate_number(index);
        let shard = &shared.shards[number];
        // Only a resident shard: a hint never fetches.
        if let Some(mapped) = shard.data.get_if_resident() {
            let (offset, len) = shard.records[within];
            if let Some(bytes) = record_bytes(mapped.bytes(), offset, len) {
                crate::dataset::prefetch(bytes);
            }
        }
    }
}
