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
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::cache::Cache;
use crate::dataset::{Dataset, DatasetInfo, FormatKind, PayloadKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::shards::{Selection, SetReport, check_sets};
use crate::format::{OpenOptions, Recognizer, compressed};

/// Fields that hold the image, in the order they are preferred.
const IMAGE_FIELDS: &[&str] = &[
    "jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "tif", "tiff",
];

/// Fields that hold the label, in the order they are preferred.
const LABEL_FIELDS: &[&str] = &["cls", "class", "label", "target"];

/// A tar block.
const BLOCK: u64 = 512;

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

/// One sample's place in its shard: the byte span of its members, headers included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    offset: u64,
    len: u64,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
    samples: Vec<Span>,
    /// Samples that are damaged byte ranges, by position, with the reason.
    damaged: HashMap<usize, String>,
    /// The decompressed copy of a gzipped shard, held (in the cache) while mapped.
    _held: Option<fs::File>,
}

struct Shared {
    path: PathBuf,
    info: DatasetInfo,
    label_base: u32,
    shards: Vec<Shard>,
    /// Index of each shard's first sample; a final entry holds the total.
    starts: Vec<usize>,
    notices: Vec<String>,
    missing_shards: Vec<String>,
}

impl Shared {
    fn locate(&self, index: usize) -> (&Shard, usize) {
        let shard = self.starts.partition_point(|&s| s <= index) - 1;
        (&self.shards[shard], index - self.starts[shard])
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
        let (name, files, one_set) = match selection {
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
                (dir.clone(), files, true)
            }
            Selection::Pattern(pattern) => {
                let (files, missing) =
                    crate::format::shards::expand_selection(pattern, options.allow_missing_shards)?;
                brace_missing = missing;
                (pattern.clone(), files, false)
            }
            Selection::List(files) => {
                let first = files
                    .first()
                    .ok_or_else(|| Error::Options("an empty list of shards".into()))?;
                (first.clone(), files.clone(), false)
            }
            Selection::File(file) => (file.clone(), vec![file.clone()], false),
        };
        let mut set = if files.len() > 1 || one_set {
            check_sets(&name, &files, one_set, options.allow_missing_shards)?
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
    let mut notices = Vec::new();
    if !set.missing.is_empty() {
        crate::dataset::notice(
            &mut notices,
            format!(
                "{}: reading a set with {} shard(s) missing, as asked: {}",
                name.display(),
                set.missing.len(),
                set.missing.join(", ")
            ),
        );
    }
    let mut cache = None;
    let mut shards = Vec::with_capacity(files.len());
    for file in files {
        shards.push(open_shard(file, options, &mut cache, &mut notices)?);
    }
    let mut starts = Vec::with_capacity(shards.len() + 1);
    let mut total = 0usize;
    starts.push(0);
    for shard in &shards {
        total += shard.samples.len();
        starts.push(total);
    }
    let label_base = options.records.label_base.unwrap_or(0);
    let classes = match options.records.num_classes {
        Some(n) if n > crate::dataset::MAX_CLASSES => {
            return Err(Error::Options(format!(
                "{n} classes: at most {} are allowed",
                crate::dataset::MAX_CLASSES
            )));
        }
        Some(n) => (0..n).map(|c| c.to_string()).collect(),
        None => infer_classes(name, &shards, label_base, &mut notices)?,
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
            },
            label_base,
            shards,
            starts,
            notices,
            missing_shards: set.missing,
        }),
    })
}

/// Maps one shard (a gzipped one's decompressed copy) and walks it into sample spans.
fn open_shard(
    path: &Path,
    options: &OpenOptions,
    cache: &mut Option<Cache>,
    notices: &mut Vec<String>,
) -> Result<Shard> {
    let (file, _) = crate::file::open_regular(path)?;
    let mut head = [0u8; 512];
    let got = read_head(&file, &mut head).at(path)?;
    let head = &head[..got];
    let (map, held) = match compressed::sniff(head, is_tar_header(head)) {
        Some(compression) => {
            let cache = match cache {
                Some(cache) => cache,
                None => cache.insert(match &options.cache {
                    Some(cache) => cache.clone(),
                    None => Cache::from_env()?,
                }),
            };
            let copy = compressed::decompress(path, &file, compression, cache)?;
            if let Some(damage) = &copy.damage {
                crate::dataset::notice(notices, format!("{}: {damage}", path.display()));
            }
            (map(path, &copy.file)?, Some(copy.file))
        }
        None => (map(path, &file)?, None),
    };
    let walk = walk_shard(&map);
    for (number, reason) in &walk.damaged {
        crate::dataset::notice(
            notices,
            format!(
                "{}: sample {number} is damaged and reads as a bad record: {reason}",
                path.display()
            ),
        );
    }
    Ok(Shard {
        path: path.to_path_buf(),
        map,
        samples: walk.samples,
        damaged: walk.damaged.into_iter().collect(),
        _held: held,
    })
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

fn map(path: &Path, file: &fs::File) -> Result<Mmap> {
    // SAFETY: read-only mapping of a shard (or a cache entry held open) that imagefeed never
    // modifies; every read is bounds-checked against the length it had when mapped.
    unsafe { Mmap::map(file) }.at(path)
}

/// True when `block` is a tar header: 512 bytes whose checksum field matches the sum of its
/// bytes (the checksum field counted as spaces).
fn is_tar_header(block: &[u8]) -> bool {
    if block.len() < BLOCK as usize || block.iter().take(BLOCK as usize).all(|&b| b == 0) {
        return false;
    }
    let field = &block[148..156];
    let digits: String = field
        .iter()
        .take_while(|&&b| b != 0 && b != b' ')
        .skip_while(|&&b| b == b' ')
        .map(|&b| b as char)
        .collect();
    let Ok(stored) = u32::from_str_radix(digits.trim(), 8) else {
        return false;
    };
    let sum: u32 = block[..BLOCK as usize]
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                32
            } else {
                u32::from(b)
            }
        })
        .sum();
    sum == stored
}

/// A shard walked into samples.
#[derive(Debug, Default, PartialEq, Eq)]
struct Walk {
    samples: Vec<Span>,
    /// `(sample position, reason)` of each damaged range.
    damaged: Vec<(usize, String)>,
}

/// The key and field of a member's path: up to and after the first dot of its file name.
fn key_and_field(path: &str) -> (&str, &str) {
    let name_start = path.rfind('/').map_or(0, |i| i + 1);
    match path[name_start..].find('.') {
        Some(dot) => (&path[..name_start + dot], &path[name_start + dot + 1..]),
        None => (path, ""),
    }
}

/// Walks a shard's headers (skipping data) into sample spans; damage costs only the bytes up to
/// the next valid header (see the module docs).
fn walk_shard(bytes: &[u8]) -> Walk {
    let mut walk = Walk::default();
    let mut from = 0u64;
    let end = bytes.len() as u64;
    while from < end {
        match walk_from(bytes, from, &mut walk) {
            Ok(()) => break,
            Err((at, problem)) => {
                // Resynchronise: the next block after the problem holding a valid header.
                let next = ((at / BLOCK) + 1..end.div_ceil(BLOCK))
                    .map(|b| b * BLOCK)
                    .find(|&o| is_tar_header(&bytes[o as usize..]))
                    .unwrap_or(end);
                let start = walk
                    .samples
                    .last()
                    .map_or(from, |s| (s.offset + s.len).max(from));
                let start = start.min(at);
                walk.damaged.push((
                    walk.samples.len(),
                    format!(
                        "bytes {start}..{next} of the shard are not tar members ({problem}){}",
                        if next == end {
                            " and nothing after them is"
                        } else {
                            "; the next member starts after them"
                        }
                    ),
                ));
                walk.samples.push(Span {
                    offset: start,
                    len: next - start,
                });
                from = next;
            }
        }
    }
    walk
}

/// Walks members from byte `from` to the end of the archive, adding samples to `walk`; on a
/// member that does not parse, returns where it was and why.
fn walk_from(bytes: &[u8], from: u64, walk: &mut Walk) -> std::result::Result<(), (u64, String)> {
    let mut archive = tar::Archive::new(Cursor::new(&bytes[from as usize..]));
    let entries = archive
        .entries_with_seek()
        .map_err(|e| (from, e.to_string()))?;
    // The sample being gathered: key, first header offset, end of its last member's data.
    let mut open: Option<(String, u64, u64)> = None;
    let close = |open: &mut Option<(String, u64, u64)>, walk: &mut Walk| {
        if let Some((_, start, end)) = open.take() {
            walk.samples.push(Span {
                offset: start,
                len: end - start,
            });
        }
    };
    // Where the previous member's data ends: the next member (its extension headers, such as
    // a GNU long name or PAX record, included) starts there.
    let mut last_end = from;
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                close(&mut open, walk);
                return Err((last_end, e.to_string()));
            }
        };
        let member_at = last_end;
        let data_at = from + entry.raw_file_position();
        let size = entry.size();
        let data_end = data_at.saturating_add(size);
        if data_end > bytes.len() as u64 {
            close(&mut open, walk);
            return Err((
                member_at,
                format!(
                    "a member declares {size} bytes but the shard ends {} bytes after its header",
                    (bytes.len() as u64).saturating_sub(data_at)
                ),
            ));
        }
        let padded_end = data_end.div_ceil(BLOCK) * BLOCK;
        last_end = padded_end.min(bytes.len() as u64);
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let (key, _) = key_and_field(&path);
        match &mut open {
            Some((current, _, end)) if current == key => *end = last_end,
            _ => {
                close(&mut open, walk);
                open = Some((key.to_string(), member_at, last_end));
            }
        }
    }
    close(&mut open, walk);
    // The walk stops at an all-zero block (the end of the archive) or where a header is cut
    // short: only zeros may follow, else the tail is damage, never silently dropped.
    if bytes[last_end as usize..].iter().any(|&b| b != 0) {
        return Err((
            last_end,
            "the archive ends early: a header is cut short, or a block of zeros stands where a \
             header should"
                .into(),
        ));
    }
    Ok(())
}

/// The members of one sample: its key, and each field's name and data range in `span`.
struct Members<'a> {
    key: String,
    fields: Vec<(String, &'a [u8])>,
}

/// Parses the members in a sample's bytes.
fn members(span: &[u8]) -> std::result::Result<Members<'_>, String> {
    let mut archive = tar::Archive::new(Cursor::new(span));
    let entries = archive.entries_with_seek().map_err(|e| e.to_string())?;
    let mut key = None;
    let mut fields = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| e.to_string())?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let start = usize::try_from(entry.raw_file_position()).map_err(|e| e.to_string())?;
        let len = usize::try_from(entry.size()).map_err(|e| e.to_string())?;
        let data = span
            .get(start..start.saturating_add(len))
            .ok_or("a member runs past its sample's bytes")?;
        let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let (k, field) = key_and_field(&path);
        key.get_or_insert_with(|| k.to_string());
        fields.push((field.to_ascii_lowercase(), data));
    }
    Ok(Members {
        key: key.ok_or("no file in the sample")?,
        fields,
    })
}

impl<'a> Members<'a> {
    /// The image: the first field named exactly like an image, else the first whose last part
    /// is (`seg.png`).
    fn image(&self) -> Option<&'a [u8]> {
        IMAGE_FIELDS
            .iter()
            .find_map(|name| self.fields.iter().find(|(f, _)| f == name))
            .or_else(|| {
                self.fields.iter().find(|(f, _)| {
                    f.rsplit('.')
                        .next()
                        .is_some_and(|last| IMAGE_FIELDS.contains(&last))
                })
            })
            .map(|(_, data)| *data)
    }

    /// The label field's text as an integer, when there is one; `Err` when it is not an integer.
    fn label(&self) -> Option<std::result::Result<i64, String>> {
        let (field, data) = LABEL_FIELDS
            .iter()
            .find_map(|name| self.fields.iter().find(|(f, _)| f == name))?;
        let text = std::str::from_utf8(data)
            .ok()
            .map(str::trim)
            .filter(|t| !t.is_empty());
        Some(
            text.and_then(|t| t.parse::<i64>().ok())
                .ok_or_else(|| format!("its .{field} is not an integer label")),
        )
    }
}

/// Classes `0..=largest label` over the samples' labels (label base taken off).
fn infer_classes(
    name: &Path,
    shards: &[Shard],
    label_base: u32,
    notices: &mut Vec<String>,
) -> Result<Vec<String>> {
    let mut inference = crate::dataset::ClassInference::default();
    let mut samples = 0usize;
    for shard in shards {
        for (number, span) in shard.samples.iter().enumerate() {
            samples += 1;
            if shard.damaged.contains_key(&number) {
                continue;
            }
            let Some(bytes) = slice(&shard.map, *span) else {
                continue;
            };
            if let Ok(members) = members(bytes)
                && let Some(Ok(label)) = members.label()
            {
                inference.see(
                    || format!("{} sample {number} ({})", shard.path.display(), members.key),
                    label.checked_sub(i64::from(label_base)),
                );
            }
        }
    }
    if samples > 0 && inference.is_empty() {
        return Err(Error::not_a_dataset(
            name,
            format!(
                "no sample has a label ({} holding an integer in {label_base}..{}); imagefeed \
                 reads labelled image samples",
                LABEL_FIELDS
                    .iter()
                    .map(|f| format!(".{f}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                i64::from(label_base) + crate::dataset::MAX_CLASSES as i64
            ),
        ));
    }
    let (classes, notice) = inference.classes();
    notices.extend(notice);
    Ok(classes)
}

fn slice(map: &[u8], span: Span) -> Option<&[u8]> {
    let start = usize::try_from(span.offset).ok()?;
    let end = start.checked_add(usize::try_from(span.len).ok()?)?;
    map.get(start..end)
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

    fn missing_shards(&self) -> &[String] {
        &self.shared.missing_shards
    }

    fn shard_starts(&self) -> Option<&[usize]> {
        Some(&self.shared.starts)
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(WebDatasetReader {
            shared: Arc::clone(&self.shared),
            key: String::new(),
        }))
    }
}

/// Per-worker handle over the shared maps.
struct WebDatasetReader {
    shared: Arc<Shared>,
    key: String,
}

impl RecordReader for WebDatasetReader {
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
            reason: format!("sample {within} of the shard: {reason}"),
        };
        let unnamed = format!("#{within}");
        if let Some(reason) = shard.damaged.get(&within) {
            return Err(corrupt(&unnamed, reason.clone()));
        }
        let bytes = slice(&shard.map, shard.samples[within])
            .ok_or_else(|| corrupt(&unnamed, "its bytes lie past the shard's end".into()))?;
        let members = members(bytes).map_err(|reason| corrupt(&unnamed, reason))?;
        let payload = members.image().ok_or_else(|| {
            let fields: Vec<&str> = members.fields.iter().map(|(f, _)| f.as_str()).collect();
            corrupt(
                &members.key,
                format!("no image field (it has {})", fields.join(", ")),
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

    fn prefetch(&mut self, index: usize) {
        let shared = &*self.shared;
        if index >= shared.info.num_samples {
            return;
        }
        let (shard, within) = shared.locate(index);
        if let Some(bytes) = shard
            .samples
            .get(within)
            .and_then(|span| slice(&shard.map, *span))
        {
            crate::dataset::prefetch(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, data) in members {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::Regular);
            builder.append_data(&mut header, path, *data).unwrap();
        }
        builder.into_inner().unwrap()
    }

    #[test]
    fn keys_and_fields_split_at_the_first_dot_of_the_name() {
        assert_eq!(key_and_field("a/b.c/x.seg.png"), ("a/b.c/x", "seg.png"));
        assert_eq!(key_and_field("000001.jpg"), ("000001", "jpg"));
        assert_eq!(key_and_field("README"), ("README", ""));
    }

    #[test]
    fn members_group_into_samples_by_key() {
        let long = format!("{}/img.jpg", "d".repeat(150));
        let bytes = tar(&[
            ("s0.jpg", b"J0"),
            ("s0.cls", b"3"),
            ("s0.json", b"{}"),
            ("s1.cls", b" 1\n"),
            ("s1.png", b"P1"),
            (&long, b"J2"),
            (&long.replace("img.jpg", "img.cls"), b"0"),
        ]);
        let walk = walk_shard(&bytes);
        assert_eq!(walk.damaged, []);
        assert_eq!(walk.samples.len(), 3);
        let read = |i: usize| {
            let m = members(slice(&bytes, walk.samples[i]).unwrap()).unwrap();
            (
                m.key.clone(),
                m.image().unwrap().to_vec(),
                m.label().unwrap().unwrap(),
            )
        };
        assert_eq!(read(0), ("s0".into(), b"J0".to_vec(), 3));
        assert_eq!(read(1), ("s1".into(), b"P1".to_vec(), 1));
        assert_eq!(read(2), (long.replace(".jpg", ""), b"J2".to_vec(), 0));
    }

    #[test]
    fn damage_costs_only_the_samples_it_touches() {
        let bytes = tar(&[
            ("a.jpg", &[1u8; 600]),
            ("a.cls", b"0"),
            ("b.jpg", b"B"),
            ("b.cls", b"1"),
            ("c.jpg", b"C"),
            ("c.cls", b"2"),
        ]);
        let clean = walk_shard(&bytes);
        assert_eq!(clean.samples.len(), 3);
        // b's first header: corrupt its checksum.
        let b_at = clean.samples[1].offset as usize;
        let mut bad = bytes.clone();
        bad[b_at + 150] ^= 0x07;
        let walk = walk_shard(&bad);
        assert_eq!(walk.damaged.len(), 1, "{walk:?}");
        let (at, reason) = &walk.damaged[0];
        assert_eq!(*at, 1);
        assert!(reason.contains("next member starts after them"), "{reason}");
        // a before it and b's label member, then c after it, still read.
        let keys: Vec<String> = walk
            .samples
            .iter()
            .enumerate()
            .filter(|(i, _)| !walk.damaged.iter().any(|(d, _)| d == i))
            .map(|(_, s)| members(slice(&bad, *s).unwrap()).unwrap().key)
            .collect();
        assert_eq!(keys, ["a", "b", "c"]);
        // A shard cut inside a member's data, or inside a header: its tail is one damaged
        // sample, never dropped without a word.
        for cut_at in [1000, clean.samples[2].offset as usize + 1024 + 100] {
            let walk = walk_shard(&bytes[..cut_at]);
            assert_eq!(walk.damaged.len(), 1, "cut at {cut_at}: {walk:?}");
            assert!(
                walk.damaged[0].1.contains("nothing after them is"),
                "{:?}",
                walk.damaged
            );
        }
        // Cutting only the end-of-archive zeros loses nothing.
        let walk = walk_shard(&bytes[..bytes.len() - 1024]);
        assert_eq!((walk.samples.len(), walk.damaged.len()), (3, 0));
    }

    #[test]
    fn headers_are_told_by_their_checksum() {
        let bytes = tar(&[("a.jpg", b"x")]);
        assert!(is_tar_header(&bytes));
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        assert!(!is_tar_header(&bad));
        assert!(!is_tar_header(&[0u8; 512]));
        assert!(!is_tar_header(b"short"));
    }
}
