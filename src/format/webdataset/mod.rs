//! WebDataset tar shards: the layout the large public image corpora ship in, read as they are.
//!
//! # Layout
//!
//! A shard is a POSIX tar (ustar, with PAX or GNU long-name headers, as Python's `tarfile` and
//! WebDataset's `TarWriter` write them; `.tar.gz`/`.tgz` gzipped). The files of one sample are
//! consecutive; a sample's key is the file's path up to the first dot of its name
//! (`n01440764/n01440764_10026.jpg` → key `n01440764/n01440764_10026`, field `jpg`), and a new
//! key starts a new sample. The image is the sample's first field named like an image
//! (`jpg`, `jpeg`, `png`, `webp`, `ppm`, `pgm`, `bmp`, `tif`, `tiff`, case-insensitive, also
//! as the last part of a longer field such as `seg.png`... only when no plain one is there); the
//! label is its `cls` field (else `class`, `label`, `target`) as ASCII decimal digits. Other
//! fields (`json`, `txt`, ...) are kept in the shard and ignored.
//!
//! # Reading
//!
//! Shards are memory-mapped; at open each is walked header to header (data is skipped, not
//! read), giving every sample's byte span, so any sample is found in O(1) and its image is a
//! slice of the mapped shard. A header that does not parse (a damaged or cut shard) does not end
//! the walk: the bytes up to the next 512-byte block that holds a valid tar header (its checksum
//! checks out) become one damaged sample that reads as a bad record saying why, and the walk
//! goes on. Labels are read at open to find the classes (`0..=largest label`, or
//! `--num-classes`), with the same label base as TFRecord shards. Sets of shards are named and
//! checked as TFRecord sets are ([`crate::format::shards`]).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cache::Cache;
use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::shard_data::{HeldShard, Mapped, ShardData};
use crate::format::shards::{Picked, Selection, SetReport, check_sets};
use crate::format::{OpenOptions, Recognizer, compressed};

mod members;
mod survey;
#[cfg(feature = "fuzzing")]
pub(crate) use members::tar;
#[cfg(feature = "remote")]
pub(crate) mod remote;

use members::{Span, is_tar_header, members, slice, walk_shard};
use survey::Survey;

/// True when `path` is named like a WebDataset shard: `*.tar`, `*.tar.gz`, `*.tgz`.
pub fn is_shard_name(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".tar") || lower.ends_with(".tar.gz") || lower.ends_with(".tgz")
}

/// True when the directory `path` holds WebDataset shards (a directory that also holds
/// TFRecord shards is read as TFRecords, which say what they find).
pub fn looks_like_webdataset(path: &Path) -> bool {
    path.is_dir()
        && fs::read_dir(path).is_ok_and(|entries| {
            entries
                .filter_map(|e| e.ok())
                .any(|e| e.path().is_file() && is_shard_name(&e.path()))
        })
}

/// [`format::open`](crate::format::open)'s recognizer for a directory of WebDataset shards.
pub(crate) const DIRECTORY: Recognizer = Recognizer {
    holds: |path| Ok(looks_like_webdataset(path)),
    open: open_shards,
};

/// [`format::open`](crate::format::open)'s recognizer for one WebDataset shard, by its name.
pub(crate) const SHARD: Recognizer = Recognizer {
    holds: |path| Ok(path.is_file() && is_shard_name(path)),
    open: open_shards,
};

fn open_shards(path: &Path, options: &OpenOptions) -> Result<Arc<dyn Dataset>> {
    Ok(Arc::new(WebDataset::open_selection(
        &Selection::of(path),
        options,
    )?))
}

pub(super) struct Shard {
    path: PathBuf,
    /// The shard's bytes: mapped at open for a local shard, fetched when needed for a remote
    /// one.
    data: Arc<ShardData>,
    samples: Vec<Span>,
    /// Samples that are damaged byte ranges, by position, with the reason.
    damaged: HashMap<usize, String>,
    /// Whether the walk found the shard cut short at its end ([`members::Walk::cut_end`]).
    cut_end: bool,
    /// Whether it ends after a whole member without the end-of-archive block
    /// ([`members::Walk::unterminated`]).
    unterminated: bool,
    /// Samples whose key an earlier sample of the shard has ([`members::Walk::key_again`]).
    key_again: members::Tally,
}

struct Shared {
    path: PathBuf,
    info: DatasetInfo,
    label_base: u32,
    shards: Vec<Shard>,
    /// Index of each shard's first sample; a final entry holds the total.
    starts: Vec<usize>,
    notices: Vec<String>,
    missing_shards: crate::format::shards::MissingShards,
    /// Members holding under half the samples the others do ([`Dataset::short_shards`]).
    short_shards: usize,
}

impl Shared {
    /// The number of the shard holding sample `index`, and the sample's place in it.
    fn locate_number(&self, index: usize) -> (usize, usize) {
        crate::format::shards::locate(&self.starts, index)
    }
}

/// WebDataset tar shards opened for reading.
pub struct WebDataset {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for WebDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebDataset")
            .field("path", &self.shared.path)
            .field("info", &self.shared.info)
            .field("shards", &self.shared.shards.len())
            .finish()
    }
}

impl WebDataset {
    /// Opens the shards `selection` names: a directory's `*.tar` set, a pattern, a list, or one
    /// shard, checked as [`crate::format::shards`] says.
    pub fn open_selection(selection: &Selection, options: &OpenOptions) -> Result<WebDataset> {
        let mut brace_missing = Vec::new();
        let (name, files, picked) = match selection {
            Selection::Directory(dir) => {
                let mut files: Vec<PathBuf> = fs::read_dir(dir)
                    .at(dir)?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.is_file() && is_shard_name(p))
                    .collect();
                files.sort();
                if files.is_empty() {
                    return Err(Error::not_a_dataset(dir, "no WebDataset shards (*.tar)"));
                }
                (dir.clone(), files, Picked::All)
            }
            Selection::Pattern(pattern) => {
                let (files, missing) =
                    crate::format::shards::expand_selection(pattern, options.allow_missing_shards)?;
                brace_missing = missing;
                (pattern.clone(), files, Picked::by_local_pattern(pattern))
            }
            Selection::List(files) => {
                let first = files
                    .first()
                    .ok_or_else(|| Error::Config("an empty list of shards".into()))?;
                (first.clone(), files.clone(), Picked::ByName)
            }
            Selection::File(file) => (file.clone(), vec![file.clone()], Picked::ByName),
        };
        let mut set = if files.len() > 1 || picked != Picked::ByName {
            check_sets(&name, &files, picked, options.allow_missing_shards)?
        } else {
            SetReport::default()
        };
        set.add_missing(brace_missing);
        open_files(&name, &files, set, options)
    }
}

fn open_files(
    name: &Path,
    files: &[PathBuf],
    set: SetReport,
    options: &OpenOptions,
) -> Result<WebDataset> {
    let mut notices = set.notices(name);
    let mut cache = None;
    let mut shards = Vec::with_capacity(files.len());
    let prefetch = crate::pagecache::SetPrefetch::for_files(files);
    for file in files {
        let shard = open_shard(file, options, (&mut cache, prefetch), &mut notices)?;
        // Once opened (a scan reads a shard in order): a set larger than memory is read at
        // random from here on (`Mapped::ready_for`).
        shard.data.ready_for(&prefetch);
        shards.push(shard);
    }
    assemble(name, shards, set, options, notices)
}

/// The dataset over shards walked into samples: classes (given, or inferred from every
/// sample's label), counts and notices.
pub(super) fn assemble(
    name: &Path,
    mut shards: Vec<Shard>,
    set: SetReport,
    options: &OpenOptions,
    mut notices: Vec<String>,
) -> Result<WebDataset> {
    accept_unterminated_sets(name, &mut shards, &mut notices);
    let starts = crate::format::shards::starts(shards.iter().map(|s| s.samples.len()));
    let total = *starts.last().expect("starts has a final entry");
    let short_shards = crate::format::shards::note_uneven_members(
        name,
        &set,
        &starts,
        |i| shards[i].cut_end,
        |i| &shards[i].path,
        &mut notices,
    );
    let label_base = options.records.label_base.unwrap_or(0);
    // Read whether the classes are given or not (a copied shard, a key met twice read twice).
    let key_again = survey::structure_notices(name, &shards, &mut notices);
    let classes = match options.records.given_classes()? {
        Some(classes) => classes,
        None => infer_classes(name, &shards, label_base, key_again, &mut notices)?,
    };
    Ok(WebDataset {
        shared: Arc::new(Shared {
            path: name.to_path_buf(),
            info: DatasetInfo {
                format: FormatKind::WebDataset,
                classes,
                num_samples: total,
                payload: PayloadKind::Encoded,
                resized_short_side: None,
                part: None,
                rejected_at_pack: None,
                restart_markers: false,
            },
            label_base,
            shards,
            starts,
            notices,
            missing_shards: set.missing_shards(),
            short_shards,
        }),
    })
}

/// A set of several shards, every one ending right after a whole member without the
/// end-of-archive block, was written so (a writer that never writes one; Python's tarfile reads
/// such tars): a copy cut short, or a writer killed mid-set, leaves one shard so, not every one
/// alike. Its shards are then whole: the bad record that stood for each missing end goes (a
/// hostile try's healthy set was refused as cut). One shard alone so is a cut end (it may have
/// been cut between two members).
/// Otherwise each such shard's missing end is a bad record, and its notice is given here (the
/// walk leaves it to this).
fn accept_unterminated_sets(name: &Path, shards: &mut [Shard], notices: &mut Vec<String>) {
    if shards.len() < 2 || !shards.iter().all(|s| s.unterminated) {
        for shard in shards.iter().filter(|s| s.unterminated) {
            let last = shard.samples.len() - 1;
            if let Some(reason) = shard.damaged.get(&last) {
                damage_notice(&shard.path, last, reason, notices);
            }
        }
        return;
    }
    for shard in shards.iter_mut() {
        let last = shard.samples.len() - 1;
        if shard.samples[last].len == 0 && shard.damaged.remove(&last).is_some() {
            shard.samples.pop();
            shard.cut_end = false;
            shard.unterminated = false;
        }
    }
    crate::dataset::notice(
        notices,
        format!(
            "{}: every shard ends without the end-of-archive block (its writer never writes \
             one): read as whole",
            name.display()
        ),
    );
}

/// The notice that sample `number` of the shard at `path` is damaged.
fn damage_notice(path: &Path, number: usize, reason: &str, notices: &mut Vec<String>) {
    crate::dataset::notice(
        notices,
        format!(
            "{}: sample {number} is damaged and reads as a bad record: {reason}",
            path.display()
        ),
    );
}

/// A decompressed shard walked into samples ([`walked`]), the stream's damage in a notice, and
/// every sample whose bytes reach past what the stream vouches for a bad record: a tar has no
/// checksums of its own, and a gzip checksum that fails at the end is the only sign that a
/// label or image changed (a hostile try's flipped byte read as a healthy label 2).
pub(super) fn walked_copy(
    path: &Path,
    mapped: Mapped,
    damage: Option<&compressed::Damage>,
    notices: &mut Vec<String>,
) -> Shard {
    if let Some(damage) = damage {
        crate::dataset::notice(notices, format!("{}: {damage}", path.display()));
    }
    let mut shard = walked(path, mapped, notices);
    if let Some(damage) = damage {
        for (number, span) in shard.samples.iter().enumerate() {
            if damage.spoils(span.offset.saturating_add(span.len)) {
                shard
                    .damaged
                    .entry(number)
                    .or_insert_with(|| damage.reason.clone());
            }
        }
    }
    shard
}

/// A shard walked into samples, with a notice for each damaged range.
pub(super) fn walked(path: &Path, mapped: Mapped, notices: &mut Vec<String>) -> Shard {
    let walk = walk_shard(mapped.bytes());
    // A missing end-of-archive block is told once the whole set is walked
    // (`accept_unterminated_sets`).
    let told = walk.damaged.len() - usize::from(walk.unterminated);
    for (number, reason) in &walk.damaged[..told] {
        damage_notice(path, *number, reason, notices);
    }
    if let Some(first) = &walk.nameless.first {
        crate::dataset::notice(
            notices,
            format!(
                "{}: {} no sample's (the first, {first:?}: a name that is no key.field, such as \
                 README, .DS_Store or macOS's ._a.jpg): skipped, as the webdataset package skips \
                 them",
                path.display(),
                crate::dataset::plural(walk.nameless.count, "member is", "members are")
            ),
        );
    }
    if let Some(at) = walk.trailing {
        crate::dataset::notice(
            notices,
            format!(
                "{}: bytes {at}..{} follow the end-of-archive blocks and are not tar members: \
                 left out, as tar and Python's tarfile leave them",
                path.display(),
                mapped.bytes().len()
            ),
        );
    }
    Shard {
        path: path.to_path_buf(),
        data: Arc::new(ShardData::local(path, mapped)),
        samples: walk.samples,
        damaged: walk.damaged.into_iter().collect(),
        cut_end: walk.cut_end,
        unterminated: walk.unterminated,
        key_again: walk.key_again,
    }
}

/// Maps one shard (a gzipped one's decompressed copy) and walks it into sample spans; a plain
/// one is read through first when the set fits.
fn open_shard(
    path: &Path,
    options: &OpenOptions,
    (cache, prefetch): (&mut Option<Cache>, crate::pagecache::SetPrefetch),
    notices: &mut Vec<String>,
) -> Result<Shard> {
    let (file, len) = crate::file::open_regular(path)?;
    let mut head = [0u8; compressed::SNIFF_BYTES];
    let got = read_head(&file, &mut head).at(path)?;
    let head = &head[..got];
    let mapped = match compressed::sniff(head, is_tar_header, 512) {
        Some(compression) => {
            let cache = match cache {
                Some(cache) => cache,
                None => cache.insert(options.cache_or_env()?),
            };
            let copy = compressed::decompress(path, &file, compression, cache)?;
            let mapped = Mapped::new(path, copy.file, true)?;
            return Ok(walked_copy(path, mapped, copy.damage.as_ref(), notices));
        }
        None => {
            refuse_unread_compression(path, head)?;
            prefetch.read(path, &file, len)?;
            Mapped::new(path, file, false)?
        }
    };
    Ok(walked(path, mapped, notices))
}

/// Refuses a shard that is no tar and starts like a compression imagefeed does not read
/// (bzip2 data named `.tar`), naming it.
pub(super) fn refuse_unread_compression(path: &Path, head: &[u8]) -> Result<()> {
    if is_tar_header(head) {
        return Ok(());
    }
    compressed::refuse_unread(
        path,
        head,
        "WebDataset shards as tar files, plain or gzipped",
    )
}

fn read_head(file: &fs::File, head: &mut [u8]) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt as _;
    let mut filled = 0;
    while filled < head.len() {
        match file.read_at(&mut head[filled..], filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Classes `0..=largest label` over the samples' labels (label base taken off), and what else
/// the samples' members tell ([`survey`]).
fn infer_classes(
    name: &Path,
    shards: &[Shard],
    label_base: u32,
    key_again: members::Tally,
    notices: &mut Vec<String>,
) -> Result<Vec<String>> {
    let mut survey = Survey::new(label_base, key_again);
    for shard in shards {
        let mapped = shard.data.get()?;
        survey.shard(&shard.path);
        for (number, span) in shard.samples.iter().enumerate() {
            // (Members and labels are read through the map's guard: an unreadable sample is
            // left out here, and is a bad record when read.)
            if let Some(reason) = shard.damaged.get(&number) {
                survey.damaged(number, reason);
                continue;
            }
            let bytes = slice(mapped.bytes(), *span);
            match bytes.and_then(|bytes| members(bytes).ok()) {
                Some(members) => survey.sample(number, &members),
                None => survey.unread(),
            }
        }
    }
    survey.finish(name, notices)
}

impl Dataset for WebDataset {
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

    fn shards_cut_at_end(&self) -> Vec<(usize, &Path)> {
        let shards = self.shared.shards.iter();
        crate::format::shards::cut_at_end(shards.map(|s| (s.cut_end, s.path.as_path())))
    }

    fn short_shards(&self) -> usize {
        self.shared.short_shards
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(WebDatasetReader {
            shared: Arc::clone(&self.shared),
            key: String::new(),
            held: HeldShard::default(),
            copied: Vec::new(),
        }))
    }
}

/// Per-worker handle over the shared shards.
struct WebDatasetReader {
    shared: Arc<Shared>,
    key: String,
    /// The shard last read.
    held: HeldShard,
    /// The sample last read, copied out of its shard's map before it is parsed
    /// ([`crate::mapguard::copy_readable`]).
    copied: Vec<u8>,
}

impl RecordReader for WebDatasetReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        assert!(
            index < self.shared.info.num_samples,
            "index {index} out of range for {} samples",
            self.shared.info.num_samples
        );
        let (number, within) = self.shared.locate_number(index);
        let shared = &*self.shared;
        let shard = &shared.shards[number];
        let map = self.held.bytes(number, &shard.data)?;
        let corrupt = |key: &str, reason: String| Error::CorruptRecord {
            path: shard.path.clone(),
            index,
            key: key.to_string(),
            reason: format!("sample {within} of the shard: {reason}"),
        };
        let unnamed = || format!("{}#{within}", shard.path.display());
        if let Some(reason) = shard.damaged.get(&within) {
            return Err(corrupt(&unnamed(), reason.clone()));
        }
        let bytes = slice(map, shard.samples[within])
            .ok_or_else(|| corrupt(&unnamed(), "its bytes lie past the shard's end".into()))?;
        // Out of the map before anything reads it (`mapguard`).
        let bytes = crate::mapguard::copy_readable(&shard.path, map, bytes, &mut self.copied)?;
        let members = members(bytes).map_err(|reason| corrupt(&unnamed(), reason))?;
        if let Some(field) = &members.repeated {
            return Err(corrupt(
                &members.key,
                format!(
                    "two or more members in a row hold its .{field} (the key is repeated): which \
                     image goes with which label is unknown"
                ),
            ));
        }
        let payload = members.image().ok_or_else(|| {
            corrupt(
                &members.key,
                format!("no image field (it has {})", members.described()),
            )
        })?;
        let stored = match members.label() {
            Some(Ok(label)) => label,
            Some(Err(reason)) => return Err(corrupt(&members.key, reason)),
            None => return Err(corrupt(&members.key, "no label field (.cls)".into())),
        };
        let base = i64::from(shared.label_base);
        if stored < base {
            return Err(corrupt(
                &members.key,
                format!("label {stored} is below the label base {base}"),
            ));
        }
        let label =
            shared
                .info
                .check_stored_label(&shard.path, index, &members.key, stored - base)?;
        self.key = members.key;
        Ok(Record {
            index,
            key: &self.key,
            label,
            payload,
        })
    }

    /// A set larger than memory has the batch's samples read from the disk together
    /// (`ShardData::plan_read`).
    fn plan_reads(&mut self, indices: &[usize]) {
        let shared = &*self.shared;
        for &index in indices.iter().filter(|&&i| i < shared.info.num_samples) {
            let (number, within) = shared.locate_number(index);
            let shard = &shared.shards[number];
            // (A damaged stretch the open's walk found is never read.)
            if let Some(span) = shard.samples.get(within)
                && !shard.damaged.contains_key(&within)
            {
                shard.data.plan_read(span.offset, span.len);
            }
        }
    }

    fn prefetch(&mut self, index: usize) {
        let shared = &*self.shared;
        if index >= shared.info.num_samples {
            return;
        }
        let (number, within) = shared.locate_number(index);
        let shard = &shared.shards[number];
        if let Some(mapped) = shard.data.get_if_resident()
            && let Some(bytes) = shard
                .samples
                .get(within)
                .and_then(|span| slice(mapped.bytes(), *span))
        {
            crate::dataset::prefetch(bytes);
        }
    }
}
