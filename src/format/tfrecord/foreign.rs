//! TFRecord shards other tools wrote (no imagefeed manifest): opened with an index built by a
//! scan (saved beside the shard, or next to the cache for one in object storage), labels read
//! from each `tf.train.Example`, classes inferred from them.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::framing::unframe;
use super::index::{self, check_index_covers, parse_index};
use super::{Manifest, ShardScan, features, scan_shard, starts_with_frame};
use crate::cache::Cache;
use crate::dataset::{DatasetInfo, FormatKind, PayloadKind};
use crate::error::{Error, IoContext as _, Result};
use crate::format::compressed;
use crate::format::shard_data::{Mapped, ShardData, ShardPlanner};
use crate::format::shards::SetReport;
use crate::format::{OpenOptions, example};

use super::reader::{Records, Shard, Shared, check_picked_shard, record_bytes, starts};

/// The shards an open decompressed into the cache for the first time, told in one notice (a
/// set of 1,024 gzip shards said it 1,024 times, burying the others).
#[derive(Default)]
pub(super) struct DecompressedCopies {
    count: usize,
    bytes: u64,
    /// The compressions met, in the order met (a set may mix GZIP and ZLIB shards).
    compressions: Vec<&'static str>,
    /// The first shard, and where its copy is.
    first: Option<(PathBuf, PathBuf)>,
}

impl DecompressedCopies {
    fn add(&mut self, path: &Path, compression: &'static str, bytes: u64, copy: PathBuf) {
        self.count += 1;
        self.bytes += bytes;
        if !self.compressions.contains(&compression) {
            self.compressions.push(compression);
        }
        self.first.get_or_insert_with(|| (path.to_path_buf(), copy));
    }

    /// The notice for the set `name` of `shards`, if any was decompressed.
    fn notice(self, name: &Path, shards: usize, notices: &mut Vec<String>) {
        let Some((first, copy)) = self.first else {
            return;
        };
        let dir = copy.parent().unwrap_or(&copy);
        let compressions = self.compressions.join(" and ");
        let what = if shards == 1 {
            format!("{}: {compressions}-compressed", first.display())
        } else {
            format!(
                "{}: {} of {shards} compressed ({compressions}; the first: {})",
                name.display(),
                crate::dataset::plural(self.count, "shard", "shards"),
                first.display()
            )
        };
        crate::dataset::notice(
            notices,
            format!(
                "{what}; decompressed once ({} bytes) into {} for random access, kept for \
                 later opens",
                self.bytes,
                dir.display()
            ),
        );
    }
}

/// Opens shards other tools wrote (no manifest): `files`, named `name` in messages, after the
/// shard-set checks found `set`. Shards of ours a pattern picked open here too, with `ours`,
/// their dataset's manifest ([`assemble_foreign`]).
pub(super) fn open_foreign(
    name: &Path,
    files: &[PathBuf],
    set: SetReport,
    options: &OpenOptions,
    ours: Option<Manifest>,
) -> Result<Records> {
    let mut notices = set.notices(name);
    let mut cache = None;
    let mut shards = Vec::with_capacity(files.len());
    let prefetch = crate::pagecache::SetPrefetch::for_files(files);
    let mut copies = DecompressedCopies::default();
    for file in files {
        let shard = open_foreign_shard(
            file,
            options,
            (&mut cache, prefetch),
            &mut copies,
            &mut notices,
        )?;
        // Once opened (a scan reads a shard in order): a set larger than memory is read at
        // random from here on (`Mapped::ready_for`).
        shard.data.ready_for(&prefetch);
        shards.push(shard);
    }
    copies.notice(name, files.len(), &mut notices);
    let single = match files {
        [one] => Some(one.as_path()),
        _ => None,
    };
    assemble_foreign(name, shards, set, options, single, ours, notices)
}

/// Records over other tools' shards, once each shard's records are found: the classes (given,
/// or inferred from every record's label), counts and notices. `single` is the one shard
/// opened alone, if that is what was opened. Shards of ours that a pattern picked (`ours`:
/// their dataset's manifest) keep what the manifest says: its classes (a pick need not hold
/// every class), label base, and how the pack stored the images.
pub(super) fn assemble_foreign(
    name: &Path,
    shards: Vec<Shard>,
    set: SetReport,
    options: &OpenOptions,
    single: Option<&Path>,
    ours: Option<Manifest>,
    mut notices: Vec<String>,
) -> Result<Records> {
    let label_base = match &ours {
        Some(manifest) => manifest.label_base,
        None => options.records.label_base.unwrap_or(0),
    };
    if let Some(manifest) = &ours {
        for shard in &shards {
            check_picked_shard(manifest, shard)?;
        }
    }
    // One notice for the shards scanned for want of an index (a set of 1,024 said it 1,024
    // times, burying the others).
    let scanned: Vec<&Shard> = shards.iter().filter(|s| s.unsaved_index).collect();
    if let Some(first) = scanned.first() {
        crate::dataset::notice(
            &mut notices,
            format!(
                "{}: {} of {} have no index: built by scanning ({} records), kept in memory \
                 (`pack-dataset index` saves them; the first, {})",
                name.display(),
                crate::dataset::plural(scanned.len(), "shard", "shards"),
                shards.len(),
                scanned.iter().map(|s| s.records.len()).sum::<usize>(),
                first.path.display()
            ),
        );
    }
    let starts = starts(&shards);
    let num_samples = *starts.last().expect("starts has a total");
    let short_shards = crate::format::shards::note_uneven_members(
        name,
        &set,
        &starts,
        |i| shards[i].cut_end,
        |i| &shards[i].path,
        &mut notices,
    );
    let packed = ours.map(|manifest| manifest.info);
    let classes = match (&packed, options.records.given_classes()?) {
        (Some(info), _) => info.classes.clone(),
        (None, Some(classes)) => classes,
        // Finding the classes reads every record's label: with ranged reads that would fetch
        // every shard whole (and hold it), which the option asked not to do.
        (None, None) if shards.iter().any(|s| s.data.is_ranged()) => {
            return Err(Error::Config(format!(
                "{}: ranged reads of TFRecord shards without our manifest need the number of \
                 classes (--num-classes): finding it would read every record",
                name.display()
            )));
        }
        (None, None) => infer_classes(name, &shards, options, single, &mut notices)?,
    };
    Ok(Records {
        shared: Arc::new(Shared {
            path: name.to_path_buf(),
            info: DatasetInfo {
                format: FormatKind::Records,
                classes,
                num_samples,
                payload: packed.as_ref().map_or(PayloadKind::Encoded, |i| i.payload),
                resized_short_side: packed.as_ref().and_then(|i| i.resized_short_side),
                part: None,
                // What the pack left out is the whole dataset's, not a pick's.
                rejected_at_pack: None,
                restart_markers: packed.as_ref().is_some_and(|i| i.restart_markers),
            },
            label_base,
            planner: planner(&shards),
            shards,
            starts,
            notices,
            // Other tools' shards: an index that runs past its shard is refused at open, and
            // a shard without one is scanned (its cut tail is a notice of damage).
            cut_shards: 0,
            missing_shards: set.missing_shards(),
            short_shards,
            names_checked: packed.is_some(),
        }),
    })
}

/// The planner over `shards` (when any is remote).
pub(super) fn planner(shards: &[Shard]) -> Option<ShardPlanner> {
    ShardPlanner::new(shards.iter().map(|s| Arc::clone(&s.data)).collect())
}

/// Opens one shard another tool wrote: memory-maps it (a compressed one's decompressed copy;
/// a plain one read through first when the set fits) and finds its records through its index,
/// or by scanning it when it has none.
pub(super) fn open_foreign_shard(
    path: &Path,
    options: &OpenOptions,
    (cache, prefetch): (&mut Option<Cache>, crate::pagecache::SetPrefetch),
    copies: &mut DecompressedCopies,
    notices: &mut Vec<String>,
) -> Result<Shard> {
    let (file, len) = crate::file::open_regular(path)?;
    let mut head = [0u8; compressed::SNIFF_BYTES];
    let head_len = read_head(&file, &mut head).at(path)?;
    let head = &head[..head_len];
    if let Some(compression) =
        compressed::sniff(head, starts_with_frame, super::framing::HEADER_BYTES)
    {
        let cache = match cache {
            Some(cache) => cache,
            None => cache.insert(options.cache_or_env()?),
        };
        let copy = compressed::decompress(path, &file, compression, cache)?;
        let mapped = Mapped::new(path, copy.file, true)?;
        let map = mapped.bytes();
        if copy.fresh
            && let Some(at) = copy.cached_at
        {
            copies.add(path, compression.name(), map.len() as u64, at);
        }
        let ShardScan {
            records,
            damaged,
            cut_end,
        } = scan_decompressed(map, copy.damage.map(|d| d.reason));
        report_damage(path, &damaged, notices);
        return Ok(Shard {
            path: path.to_path_buf(),
            data: Arc::new(ShardData::local(path, mapped)),
            records,
            damaged: damaged.into_iter().collect(),
            cut_end,
            unsaved_index: false,
        });
    }
    // bzip2 or xz data named like a shard: named so, not scanned into "not a TFRecord frame".
    if !starts_with_frame(head) {
        compressed::refuse_unread(
            path,
            head,
            "TFRecord shards plain or with TensorFlow's GZIP or ZLIB compression",
        )?;
    }
    prefetch.read(path, &file, len)?;
    let mapped = Mapped::new(path, file, false)?;
    if let Some(index_path) = index::find_index(path) {
        let records = parse_index(&index_path, &fs::read(&index_path).at(&index_path)?)?;
        check_index_covers(&index_path, &records, mapped.bytes().len() as u64)?;
        return Ok(Shard {
            path: path.to_path_buf(),
            data: Arc::new(ShardData::local(path, mapped)),
            records,
            damaged: Default::default(),
            cut_end: false,
            unsaved_index: false,
        });
    }
    let scan = scan_shard(mapped.bytes());
    // A clean scan is counted in one notice for the set (`assemble_foreign`); one with damage
    // is scanned again at every open, and says so every time.
    let clean = scan.damaged.is_empty();
    if !clean {
        crate::dataset::notice(
            notices,
            format!(
                "{}: no index; built one by scanning ({} records), not saved: the shard is \
                 damaged",
                path.display(),
                scan.records.len() - scan.damaged.len(),
            ),
        );
    }
    report_damage(path, &scan.damaged, notices);
    Ok(Shard {
        path: path.to_path_buf(),
        data: Arc::new(ShardData::local(path, mapped)),
        records: scan.records,
        damaged: scan.damaged.into_iter().collect(),
        cut_end: scan.cut_end,
        unsaved_index: clean,
    })
}

/// Uploads the index `lines` of the remote shard `object` to `index/NAME.index` beside it
/// (never over an object already there); returns its URL as a path.
#[cfg(feature = "remote")]
pub(super) fn save_remote_index(
    object: &crate::remote::store::ObjectInfo,
    lines: &str,
) -> Result<PathBuf> {
    let url = object
        .url
        .parent()
        .join(super::INDEX_DIR)
        .join(&format!("{}.index", object.url.file_name()));
    let mut local = tempfile_for_upload()?;
    use std::io::Write as _;
    local.1.write_all(lines.as_bytes()).at(&local.0)?;
    let uploaded = crate::remote::store::upload(&local.0, &url, true);
    let _ = fs::remove_file(&local.0);
    match uploaded {
        Ok(()) | Err(Error::AlreadyExists { .. }) => Ok(PathBuf::from(url.to_string())),
        Err(e) => Err(e),
    }
}

/// A new local file to stage an upload in (the cache directory, else the temp directory).
#[cfg(feature = "remote")]
pub(super) fn tempfile_for_upload() -> Result<(PathBuf, fs::File)> {
    let dir = crate::cache::Cache::from_env()
        .map(|c| c.root().to_path_buf())
        .unwrap_or_else(|_| std::env::temp_dir());
    fs::create_dir_all(&dir).at(&dir)?;
    let path = dir.join(format!(
        ".index-upload-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let file = fs::File::create(&path).at(&path)?;
    Ok((path, file))
}

/// Scans a decompressed shard; when its stream was damaged (`damage`), the cut stream's
/// partial last frame, if there is one, is that damage, else a record of no bytes at the end
/// stands for what was lost, and the shard's end counts as cut (how much the stream held
/// past the damage is unknown).
pub(super) fn scan_decompressed(map: &[u8], damage: Option<String>) -> ShardScan {
    let ShardScan {
        mut records,
        mut damaged,
        mut cut_end,
    } = scan_shard(map);
    if let Some(damage) = damage {
        cut_end = true;
        let reason = format!("{damage} ({} records before it)", records.len());
        match damaged.last_mut() {
            Some((at, last)) if *at + 1 == records.len() => *last = reason,
            _ => {
                damaged.push((records.len(), reason));
                records.push((map.len() as u64, 0));
            }
        }
    }
    ShardScan {
        records,
        damaged,
        cut_end,
    }
}

/// A notice for each damaged range a scan found in the shard at `path`.
pub(super) fn report_damage(path: &Path, damaged: &[(usize, String)], notices: &mut Vec<String>) {
    for (number, reason) in damaged {
        crate::dataset::notice(
            notices,
            format!(
                "{}: record {number} is damaged and reads as a bad record: {reason}",
                path.display()
            ),
        );
    }
}

/// Reads up to `head.len()` bytes from the start of `file`; returns how many there were.
pub(super) fn read_head(file: &fs::File, head: &mut [u8]) -> std::io::Result<usize> {
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

/// The classes of shards without a manifest, from one pass over every record's label (CRCs
/// checked; unreadable records are left for the reader to report as bad samples): `0..=largest
/// label`, named by the records' `image/class/synset` (or `image/class/text`) where every label
/// has one name, else by number. Notices say when the labels suggest a label base of 1 or come
/// from part of a set only.
pub(super) fn infer_classes(
    name: &Path,
    shards: &[Shard],
    options: &OpenOptions,
    single: Option<&Path>,
    notices: &mut Vec<String>,
) -> Result<Vec<String>> {
    let label_base = options.records.label_base.unwrap_or(0);
    let mut inference = crate::dataset::ClassInference::default();
    let mut names = ClassNames::default();
    // Why the first record without a usable label has none (a float list, several values, no
    // feature): what the error says when no record has one.
    let mut first_without = None;
    // Records with a label and an image the reader takes, and why the first with a label has
    // no image (two values in `image/encoded`, no such feature): a set in which none has one
    // opened, and every record was bad at the first batch.
    let mut with_image = 0usize;
    let mut imageless = 0usize;
    let mut first_imageless = None;
    for shard in shards {
        let mapped = shard.data.get()?;
        for (number, &(offset, len)) in shard.records.iter().enumerate() {
            if let Some(bytes) = record_bytes(mapped.bytes(), offset, len)
                && crate::mapguard::fault_in(bytes).is_ok()
                && let Ok(data) = unframe(bytes)
                && let Ok(features) = example::parse(data)
            {
                let label = match example::int64(&features, features::LABEL) {
                    Ok(label) => label,
                    Err(reason) => {
                        first_without.get_or_insert_with(|| {
                            format!("{} record {number}: {reason}", shard.path.display())
                        });
                        continue;
                    }
                };
                match example::bytes(&features, features::ENCODED) {
                    Ok(_) => with_image += 1,
                    Err(reason) => {
                        imageless += 1;
                        first_imageless.get_or_insert_with(|| {
                            format!("{} record {number}: {reason}", shard.path.display())
                        });
                    }
                }
                let class = label.checked_sub(i64::from(label_base));
                inference.see(
                    || format!("{} record {number}", shard.path.display()),
                    class,
                );
                let text = example::bytes(&features, features::SYNSET)
                    .or_else(|_| example::bytes(&features, features::TEXT))
                    .ok()
                    .and_then(|n| std::str::from_utf8(n).ok());
                names.see(class, text);
            }
        }
    }
    let num_samples: usize = shards.iter().map(|s| s.records.len()).sum();
    if num_samples > 0 && inference.is_empty() {
        return Err(Error::not_a_dataset(
            name,
            format!(
                "no record has an {} in {label_base}..{} (the label base and the most classes \
                 allowed){}",
                features::LABEL,
                i64::from(label_base) + crate::dataset::MAX_CLASSES as i64,
                first_without.map_or(String::new(), |why| format!("; the first without: {why}"))
            ),
        ));
    }
    if let Some(why) = first_imageless {
        if with_image == 0 {
            return Err(Error::not_a_dataset(
                name,
                format!(
                    "no labelled record has an image the reader takes (one value in {}); the \
                     first: {why}",
                    features::ENCODED
                ),
            ));
        }
        crate::dataset::notice(
            notices,
            format!(
                "{}: {imageless} of {num_samples} records have a label and no image the reader \
                 takes (one value in {}; the first, {why}): they are bad records when read",
                name.display(),
                features::ENCODED
            ),
        );
    }
    if options.records.label_base.is_none()
        && let Some(smallest) = inference.smallest()
        && smallest >= 1
    {
        crate::dataset::notice(
            notices,
            format!(
                "{}: no record has label 0 (the smallest is {smallest}): TFRecords made by \
                 TensorFlow's ImageNet scripts store class + 1 (labels 1..=1000); if these do, \
                 read them with --input-label-base 1 (Python: label_base=1), else class 0 has \
                 no samples",
                name.display()
            ),
        );
    }
    if let Some(file) = single
        && let Some(total) = crate::format::shards::shard_name(
            &file.file_name().unwrap_or_default().to_string_lossy(),
        )
        .total
        .filter(|&t| t > 1)
    {
        crate::dataset::notice(
            notices,
            format!(
                "{}: one shard of a set of {total}: its classes are the labels this shard holds; \
                 open the whole set (its directory, or a pattern) or give --num-classes for the \
                 set's",
                file.display()
            ),
        );
    }
    let (numbered, notice) = inference.classes();
    notices.extend(notice);
    Ok(names.apply(numbered, name, notices))
}

/// The names records give their labels (`image/class/synset`, else `image/class/text`).
#[derive(Default)]
pub(super) struct ClassNames {
    /// The name of each class seen with one.
    names: std::collections::HashMap<i64, String>,
    /// A class seen without a name, or with two names: `(class, what)`.
    unusable: Option<(i64, String)>,
    /// Whether any record names its class: where none does, classes are numbers without a
    /// word; where some do and the names cannot be used, a notice says why.
    any_named: bool,
}

impl ClassNames {
    fn see(&mut self, class: Option<i64>, name: Option<&str>) {
        let Some(class) = class else { return };
        self.any_named |= name.is_some_and(|n| !n.is_empty());
        if self.unusable.is_some() {
            return;
        }
        match (name, self.names.get(&class)) {
            (None, _) | (Some(""), _) => {
                self.unusable = Some((class, "a record without a class name".into()));
            }
            (Some(name), Some(known)) if known != name => {
                self.unusable = Some((class, format!("the names {known:?} and {name:?}")));
            }
            (Some(name), None) => {
                self.names.insert(class, name.to_string());
            }
            (Some(_), Some(_)) => {}
        }
    }

    /// `numbered` named where every class in it that has records has one name.
    fn apply(self, numbered: Vec<String>, path: &Path, notices: &mut Vec<String>) -> Vec<String> {
        if !self.any_named {
            return numbered;
        }
        if let Some((class, what)) = self.unusable {
            crate::dataset::notice(
                notices,
                format!(
                    "{}: class {class} has {what}: classes are named by number",
                    path.display()
                ),
            );
            return numbered;
        }
        let named: Vec<String> = numbered
            .iter()
            .enumerate()
            .map(|(class, number)| self.names.get(&(class as i64)).unwrap_or(number).clone())
            .collect();
        // One name for two classes (two records' names, or a name that is a class's number)
        // would make a name-to-class table (Python's `class_to_idx`) keep only the later one,
        // and a converted copy hold two classes of one name.
        match crate::dataset::first_repeat(named.iter().map(String::as_str)) {
            None => named,
            Some((before, again)) => {
                crate::dataset::notice(
                    notices,
                    format!(
                        "{}: classes {before} and {again} are both named {:?}: classes are \
                         named by number",
                        path.display(),
                        named[again]
                    ),
                );
                numbered
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(seen: &[(i64, Option<&str>)], classes: usize) -> (Vec<String>, Vec<String>) {
        let mut names = ClassNames::default();
        for &(class, name) in seen {
            names.see(Some(class), name);
        }
        let mut notices = Vec::new();
        let numbered = (0..classes).map(|c| c.to_string()).collect();
        let classes = names.apply(numbered, Path::new("x.tfrecord"), &mut notices);
        (classes, notices)
    }

    #[test]
    fn classes_take_their_records_names_only_where_each_name_is_one_class() {
        let (classes, notices) = named(&[(0, Some("cat")), (1, Some("dog")), (0, Some("cat"))], 2);
        assert_eq!(
            (classes, notices.len()),
            (vec!["cat".into(), "dog".into()], 0)
        );
        // A class without records keeps its number.
        let (classes, _) = named(&[(0, Some("cat")), (2, Some("dog"))], 3);
        assert_eq!(classes, ["cat", "1", "dog"]);
        // One class with two names, a record without a name: numbers, with a notice.
        // (A first record without one hid the later records' names without a word.)
        for seen in [
            &[(0, Some("cat")), (0, Some("kitten"))][..],
            &[(0, Some("cat")), (1, None)],
            &[(1, None), (0, Some("cat"))],
        ] {
            let (classes, notices) = named(seen, 2);
            assert_eq!(classes, ["0", "1"], "{seen:?}");
            assert_eq!(notices.len(), 1, "{seen:?}");
        }
        // Two classes of one name (a hostile try: `class_to_idx` kept only the later one), or
        // a name that is another class's number: numbers, with a notice naming it.
        let (classes, notices) = named(&[(0, Some("cat")), (1, Some("dog")), (2, Some("cat"))], 3);
        assert_eq!(classes, ["0", "1", "2"]);
        assert!(
            notices[0].contains("classes 0 and 2 are both named \"cat\""),
            "{notices:?}"
        );
        let (classes, notices) = named(&[(0, Some("1")), (2, Some("two"))], 3);
        assert_eq!(classes, ["0", "1", "2"]);
        assert_eq!(notices.len(), 1);
        // No record names its class: numbers, nothing said.
        let (classes, notices) = named(&[(0, None), (1, Some(""))], 2);
        assert_eq!((classes, notices.len()), (vec!["0".into(), "1".into()], 0));
    }
}
