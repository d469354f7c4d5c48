//! Single-file LMDB datasets: the writer `pack-dataset imagefolder2lmdb` uses, and the reader.
//!
//! # Layout (versions 2 and 3)
//!
//! One LMDB data file, opened with `MDB_NOSUBDIR` (as Python's `lmdb.open(path, subdir=False)`),
//! holding these named databases:
//!
//! - `meta`, UTF-8 keys, JSON values:
//!   - `info`: `{"magic": "imagefeed-lmdb", "version": 2, "complete": bool, "format": "lmdb",
//!     "classes": [names...], "num_samples": N, "payload": "encoded" | "raw-rgb8",
//!     "resized_short_side": S (only when resized at pack time)}`
//!   - `pack-plan`: what the pack was asked to do (source fingerprint, options); `--resume`
//!     refuses to continue a partial file made from another source or with other options.
//!   - `pack-progress`: `{"sources_done", "samples_written", "payload_bytes", "rejected":
//!     [{"key", "reason"}]}`, updated in the same transaction as each chunk of samples.
//!   - `pack-headers` (version 3): the number of shared headers stored, with them; `--resume`
//!     checks it against the `headers` database.
//! - `samples`: key = the sample index as a `u64` big-endian (8 bytes, so keys sort in index
//!   order); value =
//!
//!   ```text
//!   offset 0      u32 LE   label (0 ≤ label < number of classes)
//!   offset 4      u32 LE   K, the key's length in bytes
//!   offset 8      K bytes  key: the path relative to the ImageFolder root, UTF-8, '/'-separated
//!   offset 8 + K  ...      payload to the end of the value: the original file's bytes, or a raw
//!                          payload (`"RGB8" | u32 LE width | u32 LE height | RGB pixels`)
//!   ```
//!
//! - `checksums` (version 2 on): key = the first sample index of a committed chunk (`u64`
//!   big-endian), value = one `u32` LE per sample of the chunk: CRC-32C of the sample's value
//!   ([`record_checksum`](crate::format::record_checksum)). The reader checks every value
//!   against it, so bytes changed since packing make a bad sample, never wrong pixels. Version 1
//!   files (no checksums) are still read, unchecked.
//! - `headers` (version 3, written only by `pack-dataset --shared-headers`): key = a header's
//!   number `n` (`u32` big-endian, from 1), value = `u32` LE CRC-32C of the header, then the
//!   header: the bytes before a JPEG's entropy-coded data, shared by many samples. Every sample
//!   payload of a version-3 file starts with a `u32` LE reference, 0 (the file follows whole)
//!   or `n` (header `n`, then the rest of the file follows); see
//!   [`shared_headers`](crate::format::shared_headers). The checksums cover the values as
//!   stored. Packs without `--shared-headers` are version 2, as before.
//!
//! Python reads sample `i` of a version-2 file with
//! `env = lmdb.open(p, subdir=False, readonly=True, lock=False, max_dbs=2)`,
//! `v = env.begin(db=env.open_db(b"samples")).get(i.to_bytes(8, "big"))`, then
//! `label, k = struct.unpack_from("<II", v)` and `payload = v[8 + k:]`.
//!
//! # Crash safety
//!
//! The writer builds `OUT.partial` and renames it to `OUT` only after the final transaction has
//! marked `complete: true` and been synced. Every chunk of samples is committed together with the
//! progress record, so a killed run loses at most the chunk in flight and `--resume` continues
//! from the last commit. A reader refuses a file whose `info` says `complete: false`.
//!
//! # Sharing
//!
//! heed allows one open environment per file per process. [`Lmdb::open`] therefore shares one
//! environment between every `Lmdb` value of the same file, and each [`RecordReader`](crate::dataset::RecordReader) holds its
//! own read transaction (created without thread-local storage, so it can move to a worker).
//! Reads copy each value out of the memory map once, under the SIGBUS guard
//! ([`crate::mapguard`]: a page the disk cannot supply, or a file cut under the map, is an
//! error, not a dead process), and return slices of that copy.
//!
//! # Page cache
//!
//! Unlike the Python convention (`readahead=False`), kernel read-ahead stays on, and a file that
//! fits in half the available memory is read through in order at open (up to 256 MiB) or handed
//! to the kernel to stream in (larger)
//! ([`prefetch_if_it_fits`](crate::pagecache::prefetch_if_it_fits)). Small records live in
//! B-tree leaf pages that are not in file order, so without this a cold epoch faults in one 4 KiB
//! page at a time: measured on CIFAR-10 (14 MB file, cold cache), 0.45 s with `NO_READ_AHEAD`
//! against 0.02 s with read-ahead and the prefetch. A file larger than that is read on demand:
//! through the map while it could stay in the page cache (a fault reads the disk's read-around
//! window, which brings such a file in within a few dozen faults), and with a `pread` of
//! exactly each value where it is larger than all the memory available, where read-around
//! would evict what later reads need (`Lmdb::direct`). The checksums are always read with
//! `pread` at open.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::staging;
use crate::format::writer::{PackPlan, PackProgress};
use crate::format::{InfoRecord, Recognizer};

mod env;
mod foreign;
mod reader;
mod tree;
mod writer;

pub use crate::format::shared_headers::SharedHeaderSummary;
pub use env::has_magic;
#[cfg(feature = "fuzzing")]
pub(crate) use env::{LmdbMeta, META_PAGE_BYTES};
pub(crate) use foreign::is_own_file;
pub use reader::Lmdb;
pub use writer::LmdbWriter;

/// The `magic` value in `meta/info`.
pub const MAGIC: &str = "imagefeed-lmdb";
/// The newest layout version this build reads (and writes, with shared headers).
pub const VERSION: u32 = 3;
/// The layout version this build writes without shared headers, so that a dataset packed
/// without them stays readable by the builds before version 3 and by plain LMDB readers.
const PLAIN_VERSION: u32 = 2;
/// The first layout version with the `checksums` database.
const CHECKSUMS_SINCE: u32 = 2;
/// The first layout version with the `headers` database (and header references in payloads).
const SHARED_HEADERS_SINCE: u32 = 3;
/// Default LMDB map size for writing: address space only; the file grows as data is written.
pub const DEFAULT_MAP_SIZE: usize = 1 << 40;

const META_DB: &str = "meta";
const SAMPLES_DB: &str = "samples";
const CHECKSUMS_DB: &str = "checksums";
const HEADERS_DB: &str = "headers";
/// Every named database of the layout.
const DATABASES: [&str; 4] = [META_DB, SAMPLES_DB, CHECKSUMS_DB, HEADERS_DB];
const INFO_KEY: &str = "info";
const PLAN_KEY: &str = "pack-plan";
const PROGRESS_KEY: &str = "pack-progress";
/// With shared headers: how many the `headers` database holds, committed with them.
const HEADERS_KEY: &str = "pack-headers";
/// liblmdb's magic number, at byte 16 of the first meta page.
const LMDB_FILE_MAGIC: u32 = 0xBEEF_C0DE;

/// The layout version of a file written with or without shared headers.
fn version_written(shared_headers: bool) -> u32 {
    if shared_headers {
        SHARED_HEADERS_SINCE
    } else {
        PLAIN_VERSION
    }
}

/// The key of shared header `id` in the `headers` database.
fn header_key(id: u32) -> [u8; 4] {
    id.to_be_bytes()
}

/// The number of the header stored under `key` after `before` others: headers are numbered
/// from 1 without a gap, at most [`MAX_HEADERS`](crate::format::shared_headers::MAX_HEADERS).
fn next_header_id(before: usize, key: &[u8]) -> std::result::Result<u32, String> {
    use crate::format::shared_headers::MAX_HEADERS;
    let id = u32::try_from(before + 1).unwrap_or(u32::MAX);
    if id > MAX_HEADERS || key != header_key(id) {
        return Err(format!(
            "key {key:02x?} after {before} headers (at most {MAX_HEADERS}, numbered from 1)"
        ));
    }
    Ok(id)
}

/// Encodes a sample's key in the `samples` database.
fn sample_key(index: usize) -> [u8; 8] {
    (index as u64).to_be_bytes()
}

/// Appends a sample value (`label | key length | key | payload`) to `out`.
pub(crate) fn encode_value(out: &mut Vec<u8>, label: u32, key: &str, payload: &[u8]) {
    out.clear();
    out.reserve(8 + key.len() + payload.len());
    out.extend_from_slice(&label.to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(payload);
}

/// Splits a sample value into label, key and payload.
pub(crate) fn decode_value(value: &[u8]) -> std::result::Result<(u32, &str, &[u8]), String> {
    if value.len() < 8 {
        return Err(format!(
            "value is {} bytes, shorter than its 8-byte header",
            value.len()
        ));
    }
    let label = u32::from_le_bytes(value[0..4].try_into().expect("4 bytes"));
    let key_len = u32::from_le_bytes(value[4..8].try_into().expect("4 bytes")) as usize;
    let rest = &value[8..];
    if key_len > rest.len() {
        return Err(format!(
            "key length {key_len} runs past the {}-byte value",
            value.len()
        ));
    }
    let key =
        std::str::from_utf8(&rest[..key_len]).map_err(|_| "key is not valid UTF-8".to_string())?;
    Ok((label, key, &rest[key_len..]))
}

fn corrupt(path: &Path, index: usize, key: &str, reason: impl Into<String>) -> Error {
    Error::CorruptRecord {
        path: path.to_path_buf(),
        index,
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// Parses `meta/info` and checks its layout magic and version.
pub(crate) fn parse_info(path: &Path, text: &str) -> Result<InfoRecord> {
    let record: InfoRecord = from_json(path, INFO_KEY, text)?;
    crate::format::check_layout(
        path,
        "meta/info magic",
        &record.magic,
        MAGIC,
        record.version,
        VERSION,
    )?;
    crate::format::check_classes(path, &record.info.classes)?;
    Ok(record)
}

/// Parses `meta/pack-progress`.
pub(crate) fn parse_progress(path: &Path, text: &str) -> Result<PackProgress> {
    from_json(path, PROGRESS_KEY, text)
}

/// Parses `meta/pack-plan`.
pub(crate) fn parse_plan(path: &Path, text: &str) -> Result<PackPlan> {
    from_json(path, PLAN_KEY, text)
}

fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("metadata serializes")
}

fn from_json<T: for<'de> Deserialize<'de>>(path: &Path, what: &str, text: &str) -> Result<T> {
    serde_json::from_str(text)
        .map_err(|e| Error::not_a_dataset(path, format!("malformed meta/{what}: {e}")))
}

/// [`format::open`](crate::format::open)'s recognizer for an LMDB in directory form (Python's
/// `lmdb.open` default): `DIR/data.mdb`.
pub(crate) const DIRECTORY_FORM: Recognizer = Recognizer {
    holds: |path| Ok(path.is_dir() && path.join("data.mdb").is_file()),
    open: |path, _| Ok(Arc::new(Lmdb::open(path.join("data.mdb"))?)),
};

/// [`format::open`](crate::format::open)'s recognizer for an LMDB file, by its magic number;
/// asked last. A path named like an interrupted pack's staging output is refused first, as
/// the reader would.
pub(crate) const FILE: Recognizer = Recognizer {
    holds: |path| {
        staging::refuse_interrupted(path)?;
        has_magic(path)
    },
    open: |path, _| Ok(Arc::new(Lmdb::open(path)?)),
};

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::PathBuf;

    use heed::types::Str;

    use super::writer::open_write_env;
    use super::*;

    #[test]
    fn an_lmdb_that_holds_nothing_is_ours_to_replace_and_one_holding_anything_else_is_not() {
        // A writer killed between creating OUT.partial and its first commit leaves an LMDB
        // that stores nothing; `--force` must be able to start over from it.
        let dir = tempfile::tempdir().unwrap();
        let never_committed = dir.path().join("killed.lmdb.partial");
        drop(open_write_env(&never_committed, 1 << 20).unwrap());
        assert!(fs::metadata(&never_committed).unwrap().len() > 0);
        assert!(is_own_file(&never_committed));
        let empty = dir.path().join("empty");
        fs::write(&empty, b"").unwrap();
        assert!(is_own_file(&empty));

        // One committed transaction of anyone else's data, and the file is not ours.
        let theirs = dir.path().join("theirs.lmdb");
        let (env, _) = open_write_env(&theirs, 1 << 20).unwrap();
        let mut wtxn = env.write_txn().unwrap();
        let db = env
            .create_database::<Str, Str>(&mut wtxn, Some("theirs"))
            .unwrap();
        db.put(&mut wtxn, "key", "value").unwrap();
        wtxn.commit().unwrap();
        drop(env);
        assert!(!is_own_file(&theirs));
        let text = dir.path().join("notes");
        fs::write(&text, b"x").unwrap();
        assert!(!is_own_file(&text));
    }

    /// `dir/NAME.lmdb`, packed from a synthetic tree of `classes × per_class` JPEGs `side`
    /// pixels square (written at `dir/NAME`).
    fn packed(dir: &Path, name: &str, classes: usize, per_class: usize, side: u32) -> PathBuf {
        packed_with(dir, name, (classes, per_class, side), false)
    }

    /// [`packed`], with or without shared headers.
    fn packed_with(
        dir: &Path,
        name: &str,
        dims: (usize, usize, u32),
        shared_headers: bool,
    ) -> PathBuf {
        let options = crate::pack::PackOptions::default().with_shared_headers(shared_headers);
        packed_by(dir, name, dims, options)
    }

    /// [`packed`], with `options` (and a 64 MiB map).
    fn packed_by(
        dir: &Path,
        name: &str,
        (classes, per_class, side): (usize, usize, u32),
        options: crate::pack::PackOptions,
    ) -> PathBuf {
        use crate::pack::{NoProgress, PackFormat, pack_image_folder};
        use crate::synthetic::{SyntheticSpec, write_image_folder};
        let src = dir.join(name);
        let spec = SyntheticSpec {
            classes,
            per_class,
            width: side,
            height: side,
            ..SyntheticSpec::default()
        };
        write_image_folder(&src, &spec).unwrap();
        let out = dir.join(format!("{name}.lmdb"));
        let options = options.with_lmdb_map_size(64 << 20);
        pack_image_folder(&src, &out, PackFormat::Lmdb, &options, &NoProgress).unwrap();
        out
    }

    type BytesDb = heed::Database<heed::types::Bytes, heed::types::Bytes>;

    /// Changes the published LMDB at `path` in one write transaction (a damaged file, for the
    /// reader): `change` gets the transaction, the `meta` database and, when `named`, that
    /// database (`headers`, `checksums`; created if missing).
    fn rewrite(
        path: &Path,
        named: Option<&str>,
        change: impl FnOnce(&mut heed::RwTxn<'_>, heed::Database<Str, Str>, Option<BytesDb>),
    ) {
        let (env, _) = open_write_env(path, 64 << 20).unwrap();
        let mut wtxn = env.write_txn().unwrap();
        let meta = env.create_database(&mut wtxn, Some(META_DB)).unwrap();
        let named = named.map(|name| env.create_database(&mut wtxn, Some(name)).unwrap());
        change(&mut wtxn, meta, named);
        wtxn.commit().unwrap();
        drop(env);
        let _ = fs::remove_file(format!("{}-lock", path.display()));
    }

    /// `path`'s `meta/info` with `from` replaced by `to`.
    fn edit_info(wtxn: &mut heed::RwTxn<'_>, meta: heed::Database<Str, Str>, from: &str, to: &str) {
        let info = meta.get(wtxn, INFO_KEY).unwrap().unwrap();
        assert!(info.contains(from), "{info}");
        let info = info.replace(from, to);
        meta.put(wtxn, INFO_KEY, &info).unwrap();
    }

    #[test]
    fn values_read_with_pread_are_those_in_the_map_and_a_cut_file_is_a_change() {
        // A file larger than the memory available is read with a `pread` per value
        // (`Lmdb::direct`); here a small one is made to read that way.
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        let out = packed(dir.path(), "direct", 2, 6, 32);
        let mut lmdb = Lmdb::open(&out).unwrap();
        assert!(
            lmdb.direct.is_none(),
            "a small file is read through the map"
        );
        let payloads = |lmdb: &Lmdb| -> Vec<Vec<u8>> {
            let mut reader = lmdb.open_reader().unwrap();
            // (Reads planned ahead, as the loader does at each batch: advice only.)
            reader.plan_reads(&(0..lmdb.len()).rev().collect::<Vec<_>>());
            (0..lmdb.len())
                .map(|i| reader.read(i).unwrap().payload.to_vec())
                .collect()
        };
        let through_map = payloads(&lmdb);
        lmdb.direct = Some(Arc::new(fs::File::open(&out).unwrap()));
        assert_eq!(payloads(&lmdb), through_map);
        // Cut under the reader: the values past the cut are a changed file, not damage.
        let mut reader = lmdb.open_reader().unwrap();
        let len = fs::metadata(&out).unwrap().len();
        fs::OpenOptions::new()
            .write(true)
            .open(&out)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let (mut whole, mut changed) = (0, 0);
        for (i, before) in through_map.iter().enumerate() {
            match reader.read(i) {
                Ok(record) => {
                    assert_eq!(record.payload, before.as_slice(), "record {i}");
                    whole += 1;
                }
                Err(Error::FileChanged { .. }) => changed += 1,
                Err(e) => panic!("record {i}: {e:?}"),
            }
        }
        assert!(
            whole > 0 && changed > 0,
            "{whole} read, {changed} past the cut"
        );
    }

    #[test]
    fn a_folder2lmdb_file_read_with_pread_finds_and_starts_a_batch_when_announced() {
        // A folder2lmdb file larger than memory: its map read at random, its values read with
        // `pread`. Announcing a batch searches for its values and starts their reads.
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat/folder2lmdb.lmdb");
        let (sized, path) = (dir.path().join("sized.lmdb"), dir.path().join("f2l.lmdb"));
        fs::copy(&fixture, &sized).unwrap();
        fs::copy(&fixture, &path).unwrap();
        // The payloads' bytes, read from another copy.
        let payloads: u64 = {
            let lmdb = Lmdb::open(&sized).unwrap();
            let mut reader = lmdb.open_reader().unwrap();
            (0..lmdb.len())
                .map(|i| reader.read(i).unwrap().payload.len() as u64)
                .sum()
        };
        let mut lmdb = Lmdb::open(&path).unwrap();
        lmdb.direct = Some(Arc::new(fs::File::open(&path).unwrap()));
        lmdb.bounds.read_at_random();
        let mut reader = lmdb.open_reader().unwrap();
        // Out of the page cache, the pages the open touched through the map too (paging out
        // can miss a page another thread's LRU batch holds for a moment: tried again).
        let resident = || crate::pagecache::residency(&path).unwrap().resident_bytes;
        for _ in 0..50 {
            lmdb.bounds.page_out();
            crate::pagecache::evict(&path).unwrap();
            if resident() == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(resident(), 0, "the file could not be evicted");
        let all: Vec<usize> = (0..lmdb.len()).collect();
        reader.plan_reads(&all);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while resident() < payloads && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            resident() >= payloads,
            "{} of {payloads} bytes read",
            resident()
        );
        // And read as from the map.
        let mut through_map = Lmdb::open(&sized).unwrap().open_reader().unwrap();
        for i in all {
            assert_eq!(
                reader.read(i).unwrap().payload,
                through_map.read(i).unwrap().payload,
                "record {i}"
            );
        }
    }

    #[test]
    fn checksums_on_overflow_pages_are_read_from_their_place_in_the_file() {
        // The open reads each entry of the checksums database with a `pread` at the place
        // liblmdb's map puts it (not through the map): a chunk of 800 samples makes an entry of
        // 3,200 bytes, on overflow pages. Every record checks against its own checksum, and a
        // checksum changed in the file fails exactly its record.
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        let options = crate::pack::PackOptions::default().with_chunk_size(1000);
        let out = packed_by(dir.path(), "chunky", (2, 400, 8), options);
        let read_all = |out: &Path| -> Vec<bool> {
            let lmdb = Lmdb::open(out).unwrap();
            let mut reader = lmdb.open_reader().unwrap();
            (0..lmdb.len()).map(|i| reader.read(i).is_ok()).collect()
        };
        assert_eq!(read_all(&out), vec![true; 800]);
        rewrite(&out, Some(CHECKSUMS_DB), |wtxn, _, sums_db| {
            let sums_db = sums_db.unwrap();
            let key = 0u64.to_be_bytes();
            let mut sums = sums_db.get(wtxn, &key).unwrap().unwrap().to_vec();
            assert_eq!(sums.len(), 3200, "one entry for the one chunk");
            sums[4 * 517] ^= 0x40;
            sums_db.put(wtxn, &key, &sums).unwrap();
        });
        let read = read_all(&out);
        assert!(!read[517]);
        assert_eq!(read.iter().filter(|ok| **ok).count(), 799);
    }

    #[test]
    fn a_damaged_shared_header_makes_the_samples_that_use_it_bad_naming_it() {
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        let out = packed_with(dir.path(), "damaged", (2, 6, 32), true);
        let whole: Vec<Vec<u8>> = {
            let lmdb = Lmdb::open(&out).unwrap();
            let summary = lmdb.shared_headers().expect("packed with shared headers");
            assert_eq!((summary.headers, summary.damaged), (1, 0), "{summary:?}");
            assert!(summary.bytes > 100, "{summary:?}");
            let mut reader = lmdb.open_reader().unwrap();
            (0..lmdb.len())
                .map(|i| reader.read(i).unwrap().payload.to_vec())
                .collect()
        };
        rewrite(&out, Some(HEADERS_DB), |wtxn, _, headers| {
            let headers = headers.unwrap();
            let mut header = headers.get(wtxn, &header_key(1)).unwrap().unwrap().to_vec();
            header[100] ^= 0x10;
            headers.put(wtxn, &header_key(1), &header).unwrap();
        });
        let lmdb = Lmdb::open(&out).unwrap();
        let summary = lmdb.shared_headers().unwrap();
        assert_eq!((summary.headers, summary.bytes, summary.damaged), (1, 0, 1));
        let mut reader = lmdb.open_reader().unwrap();
        // The first image stored its header inline; the others refer to header 1.
        assert_eq!(reader.read(0).unwrap().payload, whole[0].as_slice());
        for index in 1..lmdb.len() {
            match reader.read(index) {
                Err(Error::CorruptRecord {
                    index: i, reason, ..
                }) => {
                    assert_eq!(i, index);
                    assert!(reason.contains("shared header 1"), "{reason}");
                }
                other => panic!("record {index}: {other:?}"),
            }
        }
    }

    #[test]
    fn headers_swapped_between_numbers_hand_out_no_wrong_file() {
        // Hostile review's finding: two encoders' headers swapped between their keys (each
        // entry's own checksum intact) were joined to the other encoder's records, and every
        // check passed. Now the entries' checksums cover their numbers and the samples'
        // checksums the header they refer to.
        use crate::dataset::Dataset as _;
        use crate::decode::{ChromaSubsampling, JpegEncoder};
        use crate::pack::{NoProgress, PackFormat, PackOptions, pack_image_folder};
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        fs::create_dir_all(src.join("a")).unwrap();
        for (i, quality) in [90, 90, 90, 60, 60, 60].into_iter().enumerate() {
            let pixels: Vec<u8> = (0..16 * 16 * 3).map(|p| (p * (i + 1)) as u8).collect();
            let mut encoder = JpegEncoder::new(quality, ChromaSubsampling::Half).unwrap();
            let jpeg = encoder.encode_rgb(&pixels, 16, 16).unwrap();
            fs::write(src.join(format!("a/{i}.jpg")), jpeg).unwrap();
        }
        let out = dir.path().join("swapped.lmdb");
        let options = PackOptions::default()
            .with_lmdb_map_size(64 << 20)
            .with_shared_headers(true);
        pack_image_folder(&src, &out, PackFormat::Lmdb, &options, &NoProgress).unwrap();
        let headers_of = |wtxn: &heed::RwTxn<'_>, headers: BytesDb| -> Vec<Vec<u8>> {
            (1..=2)
                .map(|id| {
                    headers
                        .get(wtxn, &header_key(id))
                        .unwrap()
                        .unwrap()
                        .to_vec()
                })
                .collect()
        };
        rewrite(&out, Some(HEADERS_DB), |wtxn, _, headers| {
            let headers = headers.unwrap();
            let stored = headers_of(wtxn, headers);
            headers.put(wtxn, &header_key(1), &stored[1]).unwrap();
            headers.put(wtxn, &header_key(2), &stored[0]).unwrap();
        });
        let lmdb = Lmdb::open(&out).unwrap();
        let mut reader = lmdb.open_reader().unwrap();
        let mut good = Vec::new();
        for index in 0..lmdb.len() {
            match reader.read(index) {
                Ok(record) => {
                    let file = fs::read(src.join(record.key)).unwrap();
                    assert_eq!(record.payload, file.as_slice(), "record {index}");
                    good.push(index);
                }
                Err(Error::CorruptRecord { .. }) => {}
                Err(other) => panic!("record {index}: {other}"),
            }
        }
        // The first file of each quality keeps its header inline.
        assert_eq!(good.len(), 2, "{good:?}");
    }

    #[test]
    fn a_resume_refuses_a_partial_pack_whose_headers_went_missing() {
        use crate::pack::{PackFormat, PackObserver, PackOptions, StartMode, pack_image_folder};
        use crate::synthetic::{SyntheticSpec, write_image_folder};
        use std::sync::atomic::{AtomicUsize, Ordering};
        struct StopAfterTwo(AtomicUsize);
        impl PackObserver for StopAfterTwo {
            fn advanced(&self, _done: usize, _payload_bytes: u64) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
            fn should_stop(&self) -> bool {
                self.0.load(Ordering::Relaxed) >= 2
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let spec = SyntheticSpec {
            classes: 2,
            per_class: 8,
            width: 16,
            height: 16,
            ..SyntheticSpec::default()
        };
        write_image_folder(&src, &spec).unwrap();
        let out = dir.path().join("cut.lmdb");
        let options = PackOptions::default()
            .with_lmdb_map_size(64 << 20)
            .with_chunk_size(4)
            .with_threads(Some(1))
            .with_shared_headers(true);
        let stop = StopAfterTwo(AtomicUsize::new(0));
        let err = pack_image_folder(&src, &out, PackFormat::Lmdb, &options, &stop).unwrap_err();
        assert!(matches!(err, Error::Interrupted { .. }), "{err}");
        let partial = staging::partial_path(&out);
        rewrite(&partial, Some(HEADERS_DB), |wtxn, _, headers| {
            let headers = headers.unwrap();
            assert!(headers.len(wtxn).unwrap() > 0, "a header was stored");
            headers.clear(wtxn).unwrap();
        });
        let resume = options.with_mode(StartMode {
            resume: true,
            force: false,
        });
        let observer = crate::pack::NoProgress;
        match pack_image_folder(&src, &out, PackFormat::Lmdb, &resume, &observer) {
            Err(Error::ResumeMismatch { reason, .. }) => {
                assert!(reason.contains("commits recorded 1"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_headers_database_the_layout_version_contradicts_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let refused = |path: &Path, what: &str| match Lmdb::open(path) {
            Err(Error::NotADataset { reason, .. }) => {
                assert!(reason.contains(what), "{reason}")
            }
            other => panic!("{what}: {other:?}"),
        };
        // Version 3 said to be 2: the references would be handed out as payload bytes.
        let out = packed_with(dir.path(), "older", (1, 3, 16), true);
        rewrite(&out, None, |wtxn, meta, _| {
            edit_info(wtxn, meta, "\"version\":3", "\"version\":2")
        });
        refused(&out, "yet the file holds their database");
        // A version-2 pack said to be 3: its headers database is missing.
        let out = packed_with(dir.path(), "newer", (1, 3, 16), false);
        rewrite(&out, None, |wtxn, meta, _| {
            edit_info(wtxn, meta, "\"version\":2", "\"version\":3")
        });
        refused(&out, "the headers database is missing");
        // Headers numbered with a gap.
        let out = packed_with(dir.path(), "gap", (1, 3, 16), true);
        rewrite(&out, Some(HEADERS_DB), |wtxn, _, headers| {
            let entry = [0u8; 4];
            headers.unwrap().put(wtxn, &header_key(9), &entry).unwrap();
        });
        refused(&out, "the headers database is damaged");
    }

    #[test]
    fn values_located_at_open_read_as_liblmdb_looks_them_up() {
        // Small images' values lie inline in leaf pages, large ones' on overflow pages: read
        // through where the open's check located them and through liblmdb's lookups, every
        // record is the same, in any order.
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        for (name, side) in [("inline", 16), ("overflow", 96)] {
            let out = packed(dir.path(), name, 3, 12, side);
            let located = Lmdb::open(&out).unwrap();
            assert!(located.located.is_some(), "{name}: nothing located");
            let mut looked_up = Lmdb::open(&out).unwrap();
            looked_up.located = None;
            let mut a = located.open_reader().unwrap();
            let mut b = looked_up.open_reader().unwrap();
            for index in (0..located.len()).rev() {
                let (x, y) = (a.read(index).unwrap(), b.read(index).unwrap());
                assert_eq!(
                    (x.key, x.label, x.payload),
                    (y.key, y.label, y.payload),
                    "{name}: record {index}"
                );
            }
            if side == 96 {
                assert!(
                    a.read(0).unwrap().payload.len() > 4096,
                    "not on overflow pages"
                );
            }
        }
    }

    #[test]
    fn a_second_open_of_a_held_file_shares_its_map_and_checks_values_against_it() {
        // The map's place is found once per environment (not by reading /proc/self/maps at
        // every open); a second open must still check values against that map.
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        let out = packed(dir.path(), "twice", 2, 4, 32);
        let first = Lmdb::open(&out).unwrap();
        let second = Lmdb::open(&out).unwrap();
        assert!(Arc::ptr_eq(&first.env, &second.env), "one environment");
        assert_eq!(first.bounds, second.bounds);
        let name = fs::canonicalize(&out).unwrap();
        let name = name.to_str().unwrap();
        let maps = fs::read_to_string("/proc/self/maps").unwrap();
        let start =
            maps.lines()
                .filter(|line| line.ends_with(name))
                .find_map(|line| {
                    let mut fields = line.split_whitespace();
                    let range = fields.next()?;
                    let offset = fields.nth(1)?;
                    offset.trim_start_matches('0').is_empty().then(|| {
                        usize::from_str_radix(range.split_once('-').unwrap().0, 16).unwrap()
                    })
                })
                .expect("the file is mapped");
        let len = fs::metadata(&out).unwrap().len();
        assert!(second.bounds.holds(start, len));
        assert!(
            !second.bounds.holds(start, len + 1),
            "one byte past the end"
        );
        assert!(
            !second.bounds.holds(start - 1, 1),
            "one byte before the map"
        );
        drop(first);
        // The second open keeps the environment, and its bounds, alive.
        assert_eq!(second.open_reader().unwrap().read(1).unwrap().label, 0);
    }

    #[test]
    fn an_open_dataset_maps_its_file_once() {
        // liblmdb's map is sized so that a process under an address-space limit (`ulimit -v`)
        // can open the file; the located values are read from it, not from a second map.
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        let out = packed(dir.path(), "once", 2, 5, 32);
        let lmdb = Lmdb::open(&out).unwrap();
        assert!(lmdb.located.is_some());
        let mut reader = lmdb.open_reader().unwrap();
        reader.read(3).unwrap();
        let name = fs::canonicalize(&out).unwrap();
        let name = name.to_str().unwrap();
        let maps = fs::read_to_string("/proc/self/maps").unwrap();
        let from_start = maps
            .lines()
            .filter(|line| line.ends_with(name))
            .filter(|line| {
                line.split_whitespace()
                    .nth(2)
                    .is_some_and(|offset| offset.trim_start_matches('0').is_empty())
            })
            .count();
        assert_eq!(from_start, 1, "{maps}");
    }

    #[test]
    fn a_file_written_in_place_while_open_is_refused_until_its_handle_goes() {
        // Reviewer's finding: a second open reused the first one's environment and the values
        // its check located, though another writer had committed to the file since.
        let dir = tempfile::tempdir().unwrap();
        let out = packed(dir.path(), "inplace", 2, 4, 32);
        let first = Lmdb::open(&out).unwrap();
        // A commit that changes nothing but the transaction: the live meta page copied into
        // the other slot with the next transaction id.
        let mut bytes = fs::read(&out).unwrap();
        let page = u32::from_le_bytes(bytes[40..44].try_into().unwrap()) as usize;
        let txn =
            |b: &[u8], at: usize| u64::from_le_bytes(b[at + 144..at + 152].try_into().unwrap());
        let (live, other) = if txn(&bytes, page) > txn(&bytes, 0) {
            (page, 0)
        } else {
            (0, page)
        };
        let next = txn(&bytes, live) + 1;
        let fields = bytes[live + 16..live + 152].to_vec();
        bytes[other + 16..other + 152].copy_from_slice(&fields);
        bytes[other + 144..other + 152].copy_from_slice(&next.to_le_bytes());
        fs::write(&out, &bytes).unwrap();
        match Lmdb::open(&out) {
            Err(Error::FileChanged { path, .. }) => assert_eq!(path, out),
            Err(other) => panic!("expected FileChanged, got {other}"),
            Ok(_) => panic!("reopened a file changed in place with its old check"),
        }
        drop(first);
        let again = Lmdb::open(&out).unwrap();
        assert_eq!(again.info.num_samples, 8);
    }

    #[test]
    fn a_file_replaced_by_rename_while_open_is_refused_until_its_handle_goes() {
        // A new pack renamed over a path this process still reads (how `pack-dataset` publishes
        // one). The handle keeps reading the file it opened (its map holds that inode); a second
        // open is FileChanged naming the path, not the new file's samples read through the old
        // environment (liblmdb keeps one per path); once the handle is gone, the path opens as
        // the new file.
        use crate::dataset::Dataset as _;
        let dir = tempfile::tempdir().unwrap();
        let out = packed(dir.path(), "renamed", 2, 4, 32);
        let newer = packed(dir.path(), "newer", 3, 2, 24);
        let first = Lmdb::open(&out).unwrap();
        let mut reader = first.open_reader().unwrap();
        let mut read = |index| {
            let record = reader.read(index).unwrap();
            (record.label, record.key.to_owned(), record.payload.to_vec())
        };
        let before = read(7);
        fs::rename(&newer, &out).unwrap();
        match Lmdb::open(&out) {
            Err(Error::FileChanged { path, .. }) => assert_eq!(path, out),
            Err(other) => panic!("expected FileChanged, got {other}"),
            Ok(_) => panic!("opened a file renamed over one this process holds open"),
        }
        assert_eq!(read(7), before);
        drop(reader);
        drop(first);
        let again = Lmdb::open(&out).unwrap();
        assert_eq!((again.info.num_samples, again.info.classes.len()), (6, 3));
        let mut reader = again.open_reader().unwrap();
        assert!(reader.read(5).unwrap().key.starts_with("class02/"));
    }

    #[test]
    fn value_layout_round_trips() {
        let mut buf = Vec::new();
        encode_value(&mut buf, 7, "cat/ü.jpg", b"\xff\xd8payload");
        assert_eq!(&buf[..8], &[7, 0, 0, 0, 10, 0, 0, 0]);
        assert_eq!(
            decode_value(&buf).unwrap(),
            (7, "cat/ü.jpg", &b"\xff\xd8payload"[..])
        );
    }

    #[test]
    fn malformed_values_are_explained() {
        assert!(
            decode_value(&[1, 2, 3])
                .unwrap_err()
                .contains("shorter than its 8-byte header")
        );
        let mut buf = Vec::new();
        encode_value(&mut buf, 0, "abc", b"");
        buf[4] = 200;
        assert!(
            decode_value(&buf)
                .unwrap_err()
                .contains("key length 200 runs past")
        );
    }

    #[test]
    fn sample_keys_sort_in_index_order() {
        let keys: Vec<[u8; 8]> = [0, 1, 255, 256, 70_000]
            .into_iter()
            .map(sample_key)
            .collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
    }
}
