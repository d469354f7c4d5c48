//! Whose LMDB a file is: ours (finished or not, or holding nothing), and Python folder2lmdb
//! files (pickled samples) opened read-only.

use std::path::Path;
use std::sync::Arc;

use heed::types::{Bytes, Str};
use heed::{Database, RoTxn, WithoutTls};

use crate::dataset::{DatasetInfo, FormatKind, MAX_CLASSES};
use crate::error::{Error, IoContext as _, Result};
use crate::format::{InfoRecord, pickle};

use super::env::{LmdbMeta, MapBounds, ReadEnv, check_lmdb_file, shared_read_env};
use super::reader::{Layout, copied, meta_text};
use super::tree::TreeRoot;
use super::{INFO_KEY, Lmdb, MAGIC, META_DB, from_json};

/// True when `path` is an LMDB file an imagefeed writer made, finished or not (its `meta/info`
/// carries [`MAGIC`]), or one that holds nothing (an LMDB in which no transaction was ever
/// committed, as a writer killed before its first commit leaves it, or an empty file): what
/// `--force` may replace. A Python folder2lmdb file, an LMDB of any other layout with anything
/// in it, a truncated file or anything else is not. Reads only the metadata.
pub(crate) fn is_own_file(path: &Path) -> bool {
    holds_our_magic(path) || holds_nothing(path)
}

/// True when `path` is a regular file that is empty, or an LMDB file in which no transaction
/// was ever committed.
pub(super) fn holds_nothing(path: &Path) -> bool {
    let Ok((mut file, len)) = crate::file::open_regular(path) else {
        return false;
    };
    len == 0 || LmdbMeta::read_live(&mut file, path).is_ok_and(|m| m.is_some_and(|m| m.txn_id == 0))
}

/// True when the LMDB file at `path` has a `meta/info` that carries [`MAGIC`].
fn holds_our_magic(path: &Path) -> bool {
    let own = || -> Result<bool> {
        let file = check_lmdb_file(path)?;
        let shared = shared_read_env(path, file.metadata().at(path)?.len())?;
        let (env, bounds) = (shared.env, shared.bounds);
        let rtxn = env.read_txn().map_err(|e| Error::lmdb(path, e))?;
        let Some(meta) = env
            .open_database::<Str, Bytes>(&rtxn, Some(META_DB))
            .map_err(|e| Error::lmdb(path, e))?
        else {
            return Ok(false);
        };
        let Some((text, _)) = meta_text(path, &bounds, &meta, &rtxn, INFO_KEY)? else {
            return Ok(false);
        };
        let record: InfoRecord = from_json(path, INFO_KEY, &text)?;
        Ok(record.magic == MAGIC)
    };
    own().unwrap_or(false)
}

/// folder2lmdb's `__keys__` value: a pickled list of `len` str or bytes keys, UTF-8. Its total
/// key bytes are checked against the value's size before any key is copied.
fn folder2lmdb_keys(path: &Path, value: &[u8], len: usize) -> Result<Vec<String>> {
    let keys = match pickle::parse(value) {
        Ok(pickle::Value::List(items)) if items.len() != len => {
            return Err(Error::not_a_dataset(
                path,
                format!("__len__ is {len} but __keys__ lists {} keys", items.len()),
            ));
        }
        Ok(pickle::Value::List(items)) => {
            // Checked before any key is copied: a pickle may name one long text many times
            // (memo references), which would make a few megabytes of file terabytes of keys.
            let key_bytes: usize = items
                .iter()
                .map(|item| match item {
                    pickle::Value::Str(text) => text.len(),
                    bytes => bytes.bytes(value).map_or(0, <[u8]>::len),
                })
                .fold(0usize, usize::saturating_add);
            if key_bytes > value.len() {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "__keys__ repeats its keys: {key_bytes} bytes of keys from a {}-byte \
                         value",
                        value.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|item| match item {
                    pickle::Value::Str(text) => Some(text.to_string()),
                    bytes => bytes
                        .bytes(value)
                        .and_then(|b| String::from_utf8(b.to_vec()).ok()),
                })
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| {
                    Error::not_a_dataset(
                        path,
                        "__keys__ holds something other than UTF-8 keys (bytes or str)",
                    )
                })?
        }
        Ok(_) => return Err(Error::not_a_dataset(path, "__keys__ is not a pickled list")),
        Err(reason) => return Err(Error::not_a_dataset(path, format!("__keys__: {reason}"))),
    };
    // A key listed twice is one record read twice, and some other record never (a hostile try
    // read a file whose __keys__ named "0" twelve times as twelve copies of record 0).
    if let Some((_, again)) = crate::dataset::first_repeat(keys.iter().map(String::as_str)) {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "__keys__ lists the key {:?} more than once: its record would be read twice \
                 and another never",
                keys[again]
            ),
        ));
    }
    Ok(keys)
}

/// The label of the pickled `(bytes, label)` `value`, for the open's scan, parsed from bytes
/// copied out of the map through the SIGBUS guard, never from the map itself (which a file cut
/// or failing meanwhile turns into SIGBUS): where the pickle (protocol 3 on) opens with the
/// image as one bytes item, everything but the image is copied, with an empty bytes item in its
/// place; anything else is copied whole. `Err`: unreadable, or not such a pickle, saying what
/// it is (left to the reader, which reports the record). `copy` is the scan's buffer.
fn scan_label(value: &[u8], copy: &mut Vec<u8>) -> std::result::Result<(i64, usize), String> {
    let unreadable = |_| "its value could not be read (an I/O error)".to_string();
    let mut head = [0u8; 32];
    let head = &mut head[..value.len().min(32)];
    crate::mapguard::copy_to_slice(head, &value[..head.len()]).map_err(unreadable)?;
    match image_bytes(head).filter(|(_, image)| image.end <= value.len()) {
        Some((opcode, image)) => {
            crate::mapguard::copy_into(&value[..opcode], copy).map_err(unreadable)?;
            copy.extend_from_slice(b"C\x00"); // SHORT_BINBYTES of no bytes
            let rest = &value[image.end..];
            let at = copy.len();
            copy.resize(at + rest.len(), 0);
            crate::mapguard::copy_to_slice(&mut copy[at..], rest).map_err(unreadable)?;
        }
        None => crate::mapguard::copy_into(value, copy).map_err(unreadable)?,
    }
    pickle::image_label_and_items(copy).map(|(_, label, items)| (label, items))
}

/// Where the image's bytes item lies in a pickle that begins with `head` (its opcode's offset)
/// and where its bytes lie: protocol 3 on, an optional frame, then the bytes
/// (`SHORT_BINBYTES`, `BINBYTES` or `BINBYTES8`) as its first item.
fn image_bytes(head: &[u8]) -> Option<(usize, std::ops::Range<usize>)> {
    let [0x80, protocol, ..] = *head else {
        return None;
    };
    let mut at = 2;
    if protocol < 3 {
        return None;
    }
    if head.get(at) == Some(&0x95) {
        at += 9; // FRAME and its 8-byte length
    }
    let (header, len) = match *head.get(at)? {
        b'C' => (2, u64::from(*head.get(at + 1)?)),
        b'B' => (
            5,
            u64::from(u32::from_le_bytes(
                head.get(at + 1..at + 5)?.try_into().ok()?,
            )),
        ),
        0x8e => (
            9,
            u64::from_le_bytes(head.get(at + 1..at + 9)?.try_into().ok()?),
        ),
        _ => return None,
    };
    let start = at + header;
    Some((at, start..start.checked_add(usize::try_from(len).ok()?)?))
}

/// Opens the Python folder2lmdb layout (see [`Lmdb`]); `rtxn` is a read transaction on `env`.
pub(super) fn open_folder2lmdb(
    path: &Path,
    (env, bounds, tree): (&Arc<ReadEnv>, MapBounds, Option<TreeRoot>),
    rtxn: RoTxn<'_, WithoutTls>,
    (file_len, direct): (u64, Option<Arc<std::fs::File>>),
) -> Result<Lmdb> {
    let not_ours = || {
        Error::not_a_dataset(
            path,
            "LMDB file with neither imagefeed's meta database nor folder2lmdb's __len__ key",
        )
    };
    let db: Database<Bytes, Bytes> = env
        .open_database(&rtxn, None)
        .map_err(|e| Error::lmdb(path, e))?
        .ok_or_else(not_ours)?;
    let get = |key: &[u8]| -> Result<Option<&[u8]>> {
        match db.get(&rtxn, key).map_err(|e| Error::lmdb(path, e))? {
            None => Ok(None),
            Some(value) => bounds.check(value).map(Some).map_err(|reason| {
                Error::not_a_dataset(
                    path,
                    format!("the value of {:?}: {reason}", String::from_utf8_lossy(key)),
                )
            }),
        }
    };
    let len_value = get(b"__len__")?.ok_or_else(not_ours)?;
    let map = super::env::EnvMap::of(&bounds, len_value);
    let len = match pickle::parse(&copied(path, &bounds, len_value)?) {
        Ok(pickle::Value::Int(n)) if n >= 0 => n as u64,
        _ => {
            return Err(Error::not_a_dataset(
                path,
                "__len__ is not a pickled non-negative int",
            ));
        }
    };
    // Every sample is an entry of the database, and an entry takes at least its node header
    // (8 bytes), a key byte and a line pointer (2 bytes) of a leaf page. Checked before the key
    // list (or anything else sized by __len__) is made.
    let entries = db.len(&rtxn).map_err(|e| Error::lmdb(path, e))?;
    let can_hold = entries.min(file_len / 11);
    if len > can_hold {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "__len__ is {len}, but the database holds {entries} entries in a {file_len}-byte \
                 file: it cannot hold that many samples"
            ),
        ));
    }
    let len = len as usize;
    let mut notices = Vec::new();
    let listed_keys = get(b"__keys__")?;
    // The entries that are no sample: `__len__`, and `__keys__` where there is one.
    let bookkeeping = 1 + u64::from(listed_keys.is_some());
    // Whether the notice of a record past `__len__` was given (the count of unlisted entries
    // below would repeat it).
    let mut told_past_len = false;
    let keys: Vec<String> = match listed_keys {
        None => {
            // Keys 0..__len__: a record under the next key is one __len__ leaves out (a
            // hostile try's file of 30 records and `__len__` 20 read as 20 without a word).
            if get(len.to_string().as_bytes()).ok().flatten().is_some() {
                told_past_len = true;
                crate::dataset::notice(
                    &mut notices,
                    format!(
                        "{}: a record is stored under the key \"{len}\", past __len__ ({len}; \
                         the database holds {entries} entries): only the keys 0..{len} are \
                         read, as folder2lmdb reads them",
                        path.display()
                    ),
                );
            }
            (0..len).map(|i| i.to_string()).collect()
        }
        Some(value) => folder2lmdb_keys(path, &copied(path, &bounds, value)?, len)?,
    };
    if keys.len() != len {
        return Err(Error::not_a_dataset(
            path,
            format!("__len__ is {len} but __keys__ lists {} keys", keys.len()),
        ));
    }
    // No class names are stored: classes are 0..=max label over the readable values (see
    // MAX_CLASSES). A value that does not parse is left to the reader, which reports it as a bad
    // sample.
    let mut inference = crate::dataset::ClassInference::default();
    let mut pages = super::tree::SearchPages::default();
    let mut copy = Vec::new();
    let whole = map.bytes(&rtxn);
    // The first value without a usable label and why, for a refusal when none has one.
    let mut first_unusable: Option<String> = None;
    // Listed keys the database holds (a damaged value's too).
    let mut found = 0u64;
    // Values that are tuples of more than (image, label), and the first's record and length.
    let mut longer = 0usize;
    let mut first_longer: Option<(String, usize)> = None;
    for (index, key) in keys.iter().enumerate() {
        // A damaged or unreadable value is left to the reader too (it reports it as a bad
        // sample). Found by the guarded search where the map is known (a file too large to
        // read through at open is read here one value at a time, where a disk error was SIGBUS).
        // (A search that meets damage, or a value past the map, counts as held: the record is
        // there, and bad.)
        let (held, value) = match tree.zip(whole) {
            Some((tree, whole)) => match tree.find(path, whole, key.as_bytes(), &mut pages) {
                Ok(Some((offset, len))) => (
                    true,
                    usize::try_from(offset)
                        .ok()
                        .and_then(|at| whole.get(at..at.checked_add(len)?)),
                ),
                Ok(None) => (false, None),
                Err(_) => (true, None),
            },
            None => match get(key.as_bytes()) {
                Ok(value) => (value.is_some(), value),
                Err(_) => (true, None),
            },
        };
        let record = || format!("record {index} (key {key:?})");
        found += u64::from(held);
        match value.map(|value| scan_label(value, &mut copy)) {
            Some(Ok((label, items))) => {
                if items > 2 {
                    longer += 1;
                    first_longer.get_or_insert_with(|| (record(), items));
                }
                if !inference.see(record, Some(label)) && first_unusable.is_none() {
                    first_unusable = Some(format!("{}: label {label}", record()));
                }
            }
            Some(Err(reason)) => {
                first_unusable.get_or_insert_with(|| format!("{}: {reason}", record()));
            }
            None => {
                first_unusable.get_or_insert_with(|| format!("{}: not found or damaged", record()));
            }
        }
    }
    // Records no listed key names are not read (folder2lmdb's loader never reads them): said,
    // where a hostile try's 12 records under 8 `__keys__` read as 8 without a word. (Keys
    // 0..__len__ with a record past them have their own notice above.)
    let unlisted = entries.saturating_sub(bookkeeping + found);
    if unlisted > 0 && !told_past_len {
        crate::dataset::notice(
            &mut notices,
            format!(
                "{}: the database holds {} that {} not name ({entries} in all): they are not \
                 read, as folder2lmdb reads only the keys it lists",
                path.display(),
                crate::dataset::plural(unlisted as usize, "entry", "entries"),
                if bookkeeping == 2 {
                    "__keys__ does"
                } else {
                    "the keys 0..__len__ do"
                }
            ),
        );
    }
    if let Some((first, items)) = first_longer {
        crate::dataset::notice(
            &mut notices,
            format!(
                "{}: {longer} of {len} values are tuples of more than (image, label) (the \
                 first, {first}, of {items} items): their first two items are read as the image \
                 and the label, as folder2lmdb's loader reads them",
                path.display(),
            ),
        );
    }
    if len > 0 && inference.is_empty() {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "no value holds a pickled (bytes, label) with a label in 0..{MAX_CLASSES} (the \
                 first, {})",
                first_unusable.unwrap_or_default()
            ),
        ));
    }
    let (classes, notice) = inference.classes();
    let info = DatasetInfo {
        format: FormatKind::Lmdb,
        classes,
        num_samples: len,
        payload: crate::dataset::PayloadKind::Encoded,
        resized_short_side: None,
        part: None,
        rejected_at_pack: None,
        restart_markers: false,
    };
    rtxn.commit().map_err(|e| Error::lmdb(path, e))?;
    if direct.is_some() {
        bounds.read_at_random();
    }
    Ok(Lmdb {
        path: path.to_path_buf(),
        env: Arc::clone(env),
        map,
        bounds,
        located: None,
        tree,
        layout: Layout::Folder2Lmdb {
            db,
            keys: keys.into(),
        },
        info,
        complete: true,
        progress: None,
        notices: notices.into_iter().chain(notice).collect(),
        direct,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_label_scan_parses_copies_not_the_map() {
        // A pickled (bytes, label), protocol 4: the image as bytes the scan leaves out.
        let mut value = vec![0x80, 4, b'B'];
        value.extend_from_slice(&(3 * 4096u32).to_le_bytes());
        value.extend(std::iter::repeat_n(b'a', 3 * 4096));
        value.extend_from_slice(b"K\x07\x86.");
        let mut copy = Vec::new();
        let (_dir, _path, map) = crate::mapguard::map_then_cut(&value, value.len() as u64);
        assert_eq!(scan_label(&map, &mut copy), Ok((7, 2)));
        // The last page cut away, and the label with it.
        let (_dir, _path, map) = crate::mapguard::map_then_cut(&value, 3 * 4096);
        assert_eq!(
            scan_label(&map, &mut copy),
            Err("its value could not be read (an I/O error)".into())
        );
        // Anything else is copied whole and parsed as it is: a str image is no (bytes, label).
        let text = [&b"\x80\x02X\x03\x00\x00\x00abc"[..], b"K\x09\x86."].concat();
        assert!(
            scan_label(&text, &mut copy).is_err_and(|reason| reason.contains("its image is a str")),
            "a str image is no (bytes, label)"
        );
        // Where the image lies: after a frame, in each bytes opcode; none for text or protocol 2.
        assert_eq!(image_bytes(&value), Some((2, 7..7 + 3 * 4096)));
        let framed = [&[0x80, 4, 0x95][..], &[0; 8], b"C\x05"].concat();
        assert_eq!(image_bytes(&framed), Some((11, 13..18)));
        let eight = [&[0x80, 5, 0x8e][..], &9u64.to_le_bytes()].concat();
        assert_eq!(image_bytes(&eight), Some((2, 11..20)));
        assert_eq!(image_bytes(b"\x80\x04X\x05\x00\x00\x00hello"), None);
        assert_eq!(image_bytes(b"\x80\x02C\x05hello"), None);
        assert_eq!(image_bytes(&[0x80, 4, b'B', 0xff]), None);
    }
}
