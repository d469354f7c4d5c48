//! [`Lmdb`]: opens an imagefeed or folder2lmdb LMDB file (its structure checked before liblmdb
//! touches it) and reads records from per-worker handles, each value copied once out of the map
//! under the SIGBUS guard ([`crate::mapguard`]) before it is parsed.

use std::fs;
use std::ops::Bound;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use heed::types::{Bytes, Str};
use heed::{Database, Env, RoTxn, WithoutTls};

use crate::dataset::{Dataset, DatasetInfo, FormatKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::pickle;
use crate::format::shared_headers::{
    self, SharedHeaderSummary, SharedHeaders, stored_value_checksum,
};
use crate::format::staging;
use crate::format::writer::PackProgress;
use crate::pagecache::Prefetched;

use super::env::{EnvMap, MapBounds, ReadEnv, SharedEnv, check_lmdb_file, shared_read_env};
use super::foreign::open_folder2lmdb;
use super::tree::{Located, NotFound, SearchPages, TreeRoot};
use super::{
    CHECKSUMS_DB, CHECKSUMS_SINCE, HEADERS_DB, INFO_KEY, META_DB, PROGRESS_KEY, SAMPLES_DB,
    SHARED_HEADERS_SINCE, corrupt, decode_value, next_header_id, parse_info, parse_progress,
    sample_key,
};
use crate::mapguard::copy_mapped;

/// Which of the two LMDB layouts a file has.
#[derive(Clone)]
pub(super) enum Layout {
    /// imagefeed's own (module docs): `samples` database keyed by big-endian index, and each
    /// sample's checksum (version 2 on).
    Imagefeed {
        samples: Database<Bytes, Bytes>,
        checksums: Option<Arc<[u32]>>,
        /// The shared JPEG headers payloads refer to (version 3 on).
        headers: Option<Arc<SharedHeaders>>,
    },
    /// Python folder2lmdb: the unnamed database, keys listed in `__keys__`, pickled
    /// `(image_bytes, label)` values.
    Folder2Lmdb {
        db: Database<Bytes, Bytes>,
        keys: Arc<[String]>,
    },
}

/// A packed LMDB dataset opened for reading: imagefeed's layout, or one written by the Python
/// folder2lmdb scripts (Efficient-PyTorch `tools/folder2lmdb.py` and its forks), detected by its
/// `__len__` key. Those store no class names: classes are then `"0"..="max label"`, found by a
/// scan of every value's label at open (one read of each value's last page).
pub struct Lmdb {
    pub(super) path: PathBuf,
    pub(super) env: Arc<ReadEnv>,
    pub(super) bounds: MapBounds,
    /// Where the samples' values lie (imagefeed's layout, found by the open's check).
    pub(super) located: Option<LocatedValues>,
    /// The tree the samples' values are searched in where they were not located.
    pub(super) tree: Option<TreeRoot>,
    pub(super) layout: Layout,
    pub(super) info: DatasetInfo,
    pub(super) complete: bool,
    pub(super) progress: Option<PackProgress>,
    /// What opening found that a user should hear about (labels left out of the classes).
    pub(super) notices: Vec<String>,
    /// The environment's map (see [`EnvMap`]).
    pub(super) map: EnvMap,
    /// The file, where it is larger than the memory available (so it cannot stay in the page
    /// cache): readers then read each value with a `pread` of exactly its bytes
    /// ([`read_value`]) instead of from the map, where each page fault reads the disk's whole
    /// read-around window (8 MiB on this VM) and evicts what later reads need. Measured, a
    /// 626 MB LMDB of 600,000 CIFAR images in a 384 MiB memory cgroup, 2 workers: an epoch
    /// through the map did not finish in 300 s; with `pread`, 16–19 s. A file that fits keeps
    /// the map: there the read-around brings the file in within a few dozen faults (the same
    /// file in a 768 MiB cgroup: a cold epoch 1.95 s through the map, 2.3 s with `pread`).
    pub(super) direct: Option<Arc<fs::File>>,
}

impl std::fmt::Debug for Lmdb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lmdb")
            .field("path", &self.path)
            .field("info", &self.info)
            .field("complete", &self.complete)
            .finish()
    }
}

impl Lmdb {
    /// Opens a complete dataset. An interrupted pack (`complete: false`, only `PATH.partial` on
    /// disk, or a path named `*.partial` whatever it holds) is an [`Error::Incomplete`] that
    /// says how to finish it.
    pub fn open(path: impl AsRef<Path>) -> Result<Lmdb> {
        let path = path.as_ref();
        staging::refuse_interrupted(path)?;
        let lmdb = Self::open_incomplete(path)?;
        if !lmdb.complete {
            return Err(Error::Incomplete {
                path: path.to_path_buf(),
                reason: format!(
                    "the pack that wrote it did not finish ({} samples so far); rerun it with --resume",
                    lmdb.info.num_samples
                ),
            });
        }
        Ok(lmdb)
    }

    /// Opens a dataset whether or not it is complete (for `inspect`). For an incomplete one,
    /// `len()` is the number of samples committed so far.
    pub fn open_incomplete(path: impl AsRef<Path>) -> Result<Lmdb> {
        let path = path.as_ref();
        crate::pagecache::memory_limit_from_env()?;
        let file = check_lmdb_file(path)?;
        // Small datasets stream into the page cache in one sequential read; see pagecache. A
        // part the disk cannot read is an error here: liblmdb reads through a map, where it
        // would be a SIGBUS.
        let prefetched = crate::pagecache::prefetch(&file).at(path)?;
        let opened = file.metadata().at(path)?;
        let len = opened.len();
        let file = Arc::new(file);
        let direct = (prefetched == Prefetched::TooLarge).then(|| Arc::clone(&file));
        let SharedEnv {
            env,
            bounds,
            located,
            roots,
            identity,
        } = shared_read_env(path, len)?;
        // The checksums (and, for a file larger than memory, every value) are read from `file`
        // at the places the map gives: it must be the file checked and mapped, not one the path
        // named before a replacement (a rename over it) in between.
        if (opened.dev(), opened.ino()) != identity {
            return Err(Error::FileChanged {
                path: path.to_path_buf(),
                change: "replaced on disk while it was being opened; open it again".into(),
            });
        }
        let rtxn = env.read_txn().map_err(|e| Error::lmdb(path, e))?;
        let meta: Option<Database<Str, Bytes>> = env
            .open_database(&rtxn, Some(META_DB))
            .map_err(|e| Error::lmdb(path, e))?;
        let Some(meta) = meta else {
            return open_folder2lmdb(path, (&env, bounds, roots.main), rtxn, (len, direct));
        };
        let get = |key: &str| meta_text(path, &bounds, &meta, &rtxn, key);
        let (info_text, map) =
            get(INFO_KEY)?.ok_or_else(|| Error::not_a_dataset(path, "meta/info is missing"))?;
        let record = parse_info(path, &info_text)?;
        let progress = match get(PROGRESS_KEY)? {
            Some((text, _)) => Some(parse_progress(path, &text)?),
            None => None,
        };
        let samples: Database<Bytes, Bytes> = env
            .open_database(&rtxn, Some(SAMPLES_DB))
            .map_err(|e| Error::lmdb(path, e))?
            .ok_or_else(|| Error::not_a_dataset(path, "the samples database is missing"))?;
        let stored = samples.len(&rtxn).map_err(|e| Error::lmdb(path, e))? as usize;
        let located =
            located.and_then(|table| LocatedValues::anchor(table, &samples, &rtxn, &bounds));
        let mut notices = Vec::new();
        let checksums = if record.version >= CHECKSUMS_SINCE {
            Some(read_checksums(path, (&env, &bounds, &file), &rtxn, stored)?)
        } else {
            // A version-1 file never has the checksums database: one that does had its info
            // record changed (a digit of "version"), which would switch the checks off.
            let sums: Option<Database<Bytes, Bytes>> = env
                .open_database(&rtxn, Some(CHECKSUMS_DB))
                .map_err(|e| Error::lmdb(path, e))?;
            if sums.is_some() {
                return Err(crate::format::checksums_contradiction(
                    path,
                    record.version,
                    "database",
                ));
            }
            crate::dataset::notice(&mut notices, crate::format::unchecked_notice(path));
            None
        };
        let headers = read_headers(path, (&env, &bounds), &rtxn, record.version)?;
        let mut info = record.info;
        if record.complete && stored != info.num_samples {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "meta/info says {} samples but {stored} are stored",
                    info.num_samples
                ),
            ));
        }
        info.num_samples = stored;
        info.format = FormatKind::Lmdb;
        // Database handles opened in a read transaction become usable by others after commit.
        rtxn.commit().map_err(|e| Error::lmdb(path, e))?;
        if direct.is_some() {
            bounds.read_at_random();
        }
        Ok(Lmdb {
            path: path.to_path_buf(),
            map,
            env,
            bounds,
            located,
            tree: roots.named(SAMPLES_DB),
            layout: Layout::Imagefeed {
                samples,
                checksums,
                headers,
            },
            info,
            complete: record.complete,
            progress,
            notices,
            direct,
        })
    }

    /// True when the pack that wrote this file finished.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// The JPEG headers this file stores once and its samples share (layout version 3,
    /// `--shared-headers`); `None` for a file without them.
    pub fn shared_headers(&self) -> Option<SharedHeaderSummary> {
        match &self.layout {
            Layout::Imagefeed {
                headers: Some(headers),
                ..
            } => Some(headers.summary()),
            _ => None,
        }
    }

    /// The pack's progress record: files consumed and files rejected (with reasons).
    pub fn pack_progress(&self) -> Option<&PackProgress> {
        self.progress.as_ref()
    }
}

/// Reads the `checksums` database of a version-2 file: one CRC-32C per stored sample, in
/// chunks keyed by their first index, which must follow one another from 0 to `stored`.
fn read_checksums(
    path: &Path,
    (env, bounds, file): (&Env<WithoutTls>, &MapBounds, &fs::File),
    rtxn: &RoTxn<'_, WithoutTls>,
    stored: usize,
) -> Result<Arc<[u32]>> {
    let db: Database<Bytes, Bytes> = env
        .open_database(rtxn, Some(CHECKSUMS_DB))
        .map_err(|e| Error::lmdb(path, e))?
        .ok_or_else(|| {
            Error::not_a_dataset(
                path,
                "layout version 2 but the checksums database is missing",
            )
        })?;
    let mut sums = Vec::with_capacity(stored);
    // Each entry copied out through the guard before it is parsed (see `copied`).
    let mut copy = Vec::new();
    for entry in checked_entries(path, bounds, &db, rtxn, "checksums")? {
        let (key, value) = entry?;
        let first = <[u8; 8]>::try_from(key).ok().map(u64::from_be_bytes);
        let value = read_value(path, file, bounds.map_of(value), value, &mut copy)?;
        let count = value.len() / 4;
        if first != Some(sums.len() as u64) || value.len() % 4 != 0 || sums.len() + count > stored {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "the checksums database is damaged: an entry of {} bytes at key {key:02x?} \
                     after {} checksums, for {stored} samples",
                    value.len(),
                    sums.len()
                ),
            ));
        }
        sums.extend(
            value
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))),
        );
    }
    if sums.len() != stored {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "the checksums database covers {} of the {stored} samples",
                sums.len()
            ),
        ));
    }
    Ok(sums.into())
}

/// `value`, a value liblmdb returned from its map of `file` (at `path`; `map`, where known, as
/// [`MapBounds::map_of`] gives it), copied into `copy`: with one `pread` of exactly its bytes
/// where its place in the file is known, else through the map (under the guard). A page fault on the map of a cold file reads the disk's whole
/// read-around window (8 MiB on this VM's disk: 5.7 ms a fault, against 36 µs for a `pread` of
/// 16 KiB), which the open paid once per entry of the checksums database: ~1 s for a 2.4 GB
/// file of 600,000 records. A file now shorter than the value's end is
/// [`Error::FileChanged`], as under the map.
fn read_value<'c>(
    path: &Path,
    file: &fs::File,
    map: Option<(usize, u64)>,
    value: &[u8],
    copy: &'c mut Vec<u8>,
) -> Result<&'c [u8]> {
    use std::os::unix::fs::FileExt as _;
    let Some((start, len)) = map else {
        return copy_mapped(path, None, value, copy);
    };
    let at = (value.as_ptr() as usize - start) as u64;
    copy.clear();
    copy.resize(value.len(), 0);
    match file.read_exact_at(copy, at) {
        Ok(()) => Ok(copy),
        // The value lies inside the file as it was at open: a read that ends early means the
        // file was cut since.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(Error::FileChanged {
            path: path.to_path_buf(),
            change: format!(
                "cut short while open: it was {len} bytes and the {} at byte {at} are gone",
                value.len()
            ),
        }),
        Err(e) => Err(Error::io(
            path,
            std::io::Error::new(
                e.kind(),
                format!("reading {} bytes at byte {at}: {e}", value.len()),
            ),
        )),
    }
}

/// A record's `value` (from the map, checked inside it) copied into `copy`: with a `pread`
/// where the reader has the file (`direct`: a file the open did not bring into the page cache,
/// where each fault on the map would read the disk's read-around window), else out of the map
/// through the guard.
fn copy_value<'c>(
    path: &Path,
    direct: Option<&fs::File>,
    map: Option<(usize, u64)>,
    value: &[u8],
    copy: &'c mut Vec<u8>,
) -> Result<&'c [u8]> {
    match direct {
        Some(file) => read_value(path, file, map, value, copy),
        None => copy_mapped(path, map, value, copy),
    }
}

/// The entries of the named database `db` (`name` in messages) in key order, each key and
/// value checked to lie inside the map (`bounds`) before anything reads them.
fn checked_entries<'t>(
    path: &'t Path,
    bounds: &'t MapBounds,
    db: &Database<Bytes, Bytes>,
    rtxn: &'t RoTxn<'_, WithoutTls>,
    name: &'t str,
) -> Result<impl Iterator<Item = Result<(&'t [u8], &'t [u8])>> + 't> {
    let entries = db.iter(rtxn).map_err(|e| Error::lmdb(path, e))?;
    Ok(entries.map(move |entry| {
        let (key, value) = entry.map_err(|e| Error::lmdb(path, e))?;
        bounds
            .check(key)
            .and_then(|key| Ok((key, bounds.check(value)?)))
            .map_err(|reason| Error::not_a_dataset(path, format!("the {name} database: {reason}")))
    }))
}

/// Reads the `headers` database of a version-3 file ([`SharedHeaders`]): headers numbered
/// from 1 without a gap, each copied out through the guard. A header that fails its checksum
/// only makes the samples that use it bad. An older version with the database had its info
/// record changed, which would hand out payloads with their references in front.
fn read_headers(
    path: &Path,
    (env, bounds): (&Env<WithoutTls>, &MapBounds),
    rtxn: &RoTxn<'_, WithoutTls>,
    version: u32,
) -> Result<Option<Arc<SharedHeaders>>> {
    let db: Option<Database<Bytes, Bytes>> = env
        .open_database(rtxn, Some(HEADERS_DB))
        .map_err(|e| Error::lmdb(path, e))?;
    let db = match (db, version >= SHARED_HEADERS_SINCE) {
        (Some(db), true) => db,
        (None, false) => return Ok(None),
        (None, true) => {
            return Err(Error::not_a_dataset(
                path,
                format!("layout version {version} but the headers database is missing"),
            ));
        }
        (Some(_), false) => {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "layout version {version} has no shared headers, yet the file holds their \
                     database: its meta/info record was changed"
                ),
            ));
        }
    };
    let mut stored = Vec::new();
    for entry in checked_entries(path, bounds, &db, rtxn, "headers")? {
        let (key, value) = entry?;
        if let Err(why) = next_header_id(stored.len(), key) {
            return Err(Error::not_a_dataset(
                path,
                format!("the headers database is damaged: {why}"),
            ));
        }
        stored.push(copied(path, bounds, value)?);
    }
    Ok(Some(Arc::new(SharedHeaders::from_stored(
        stored.iter().map(Vec::as_slice),
    ))))
}

/// The text stored under `key` in `meta` (a meta database opened with byte values), checked to
/// lie in the map and then [`copied`] out of it, with the map it lies in.
pub(super) fn meta_text(
    path: &Path,
    bounds: &MapBounds,
    meta: &Database<Str, Bytes>,
    rtxn: &RoTxn<'_, WithoutTls>,
    key: &str,
) -> Result<Option<(String, EnvMap)>> {
    let Some(value) = meta.get(rtxn, key).map_err(|e| Error::lmdb(path, e))? else {
        return Ok(None);
    };
    let value = bounds
        .check(value)
        .map_err(|reason| Error::not_a_dataset(path, format!("meta/{key}: {reason}")))?;
    let map = EnvMap::of(bounds, value);
    let text = copied(path, bounds, value)?;
    String::from_utf8(text)
        .map(|text| Some((text, map)))
        .map_err(|_| Error::not_a_dataset(path, format!("meta/{key} is not UTF-8 text")))
}

/// `value`, which liblmdb returned from the map of the file at `path` (`bounds`), copied out
/// through the SIGBUS guard ([`crate::mapguard`]) before the open parses it: liblmdb only
/// reads the page holding a value's node (which the open's check has just read) and returns
/// where the value lies, so a value on overflow pages of a file too large to read through
/// (folder2lmdb's `__keys__`, the checksums) is first read here.
pub(super) fn copied(path: &Path, bounds: &MapBounds, value: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    crate::mapguard::copy_mapped(path, bounds.map_of(value), value, &mut out)?;
    Ok(out)
}

impl Dataset for Lmdb {
    fn info(&self) -> &DatasetInfo {
        &self.info
    }

    fn notices(&self) -> &[String] {
        &self.notices
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn record_checksums(&self) -> Option<&[u32]> {
        match &self.layout {
            Layout::Imagefeed { checksums, .. } => checksums.as_deref(),
            Layout::Folder2Lmdb { .. } => None,
        }
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        self.map.check_meta_pages(&self.path)?;
        let txn = ReadEnv::clone(&self.env)
            .static_read_txn()
            .map_err(|e| Error::lmdb(&self.path, e))?;
        Ok(Box::new(LmdbReader {
            txn,
            _env: Arc::clone(&self.env),
            bounds: self.bounds.clone(),
            located: self.located.clone(),
            layout: self.layout.clone(),
            path: self.path.clone(),
            info: self.info.clone(),
            // Values already located need no table of their own.
            found: if self.located.is_none() && self.info.num_samples <= FOUND_TABLE_MAX_RECORDS {
                vec![(0, 0); self.info.num_samples]
            } else {
                Vec::new()
            },
            decoded: Vec::new(),
            copied: Vec::new(),
            joined: Vec::new(),
            search: self
                .tree
                .filter(|_| self.map.is_known())
                .map(|tree| Search {
                    tree,
                    map: self.map,
                    pages: SearchPages::default(),
                }),
            direct: self.direct.clone(),
        }))
    }
}

/// The values of the samples the open's check located ([`Located`]), anchored to the map of
/// one environment: the address of the file's first byte there.
#[derive(Clone)]
pub(super) struct LocatedValues {
    table: Arc<Located>,
    base: usize,
}

impl LocatedValues {
    /// `table` anchored to the map `rtxn`'s environment reads `samples` from: the address
    /// liblmdb gives the first and the last located value, less its offset, agreeing, with the
    /// whole file inside a map of it (`bounds`). `None` where anything disagrees (then every
    /// value is looked up as before).
    fn anchor(
        table: Arc<Located>,
        samples: &Database<Bytes, Bytes>,
        rtxn: &RoTxn<'_, WithoutTls>,
        bounds: &MapBounds,
    ) -> Option<LocatedValues> {
        let (first, last) = table.ends()?;
        let base_of = |index: usize| -> Option<usize> {
            let (offset, len) = table.location(index)?.ok()?;
            let value = samples.get(rtxn, &sample_key(index)).ok()??;
            let value = bounds.check(value).ok()?;
            (value.len() == len).then_some(())?;
            (value.as_ptr() as usize).checked_sub(offset)
        };
        let base = base_of(first)?;
        (base_of(last)? == base && bounds.holds(base, table.file_len()))
            .then_some(LocatedValues { table, base })
    }

    /// Where record `index`'s value lies in the file, `(offset, len)`, when located and inside
    /// the file.
    fn place(&self, index: usize) -> Option<(usize, usize)> {
        self.table.location(index)?.ok()
    }

    /// The value of record `index` (`None`: not located; `Err`: its size runs past the file).
    /// `_txn` (a transaction of the environment this was anchored to) is only taken for its
    /// lifetime: the slice cannot outlive what keeps the map.
    fn value<'t>(
        &self,
        _txn: &'t RoTxn<'static, WithoutTls>,
        index: usize,
    ) -> Option<std::result::Result<&'t [u8], String>> {
        Some(self.table.location(index)?.map(|(offset, len)| {
            // SAFETY: `base` is where byte 0 of the file lies in the map of the environment
            // `_txn` belongs to (`anchor`: two values liblmdb returned there, and the whole
            // file inside a map of it), and `offset + len` is at most the file's length
            // (`location`). The map is read-only and lives as long as its environment, which
            // the transaction keeps alive; the slice borrows the transaction for `'t`.
            unsafe { std::slice::from_raw_parts((self.base + offset) as *const u8, len) }
        }))
    }
}

/// Datasets of at most this many records get a per-reader table of where each value lies
/// (16 bytes a record: 16 MiB at the limit). Past it the B-tree lookup is kept: its ~1 µs
/// matters for small images, and datasets with millions of records are mostly large ones.
const FOUND_TABLE_MAX_RECORDS: usize = 1 << 20;

/// Per-worker handle: one long-lived read transaction over the shared map.
struct LmdbReader {
    // Field order matters: the transaction must go before the last `Arc` to its environment.
    txn: RoTxn<'static, WithoutTls>,
    _env: Arc<ReadEnv>,
    /// Where the map lies: every value is checked to be inside it before it is read.
    bounds: MapBounds,
    /// Where the samples' values lie, when the open found them: read from there, with no
    /// lookup at all.
    located: Option<LocatedValues>,
    layout: Layout,
    path: PathBuf,
    info: DatasetInfo,
    /// `(address, length)` of each record's value once read (address 0: not read yet; empty
    /// when the dataset is over [`FOUND_TABLE_MAX_RECORDS`]; read through [`remembered`]).
    /// LMDB keeps a value's bytes valid until the transaction that returned them ends, and
    /// `txn` lives as long as this reader, so a later read (every epoch after the first) skips
    /// the lookup, and [`prefetch`](RecordReader::prefetch) knows where to fetch from.
    found: Vec<(usize, usize)>,
    /// A folder2lmdb image that had to be decoded (pickle protocols 0 to 2).
    decoded: Vec<u8>,
    /// The value last read, copied out of the map before it is parsed
    /// ([`crate::mapguard::copy_mapped`]): a page the disk cannot supply, or a file cut under
    /// the map, is then an error here rather than SIGBUS in the decoder.
    copied: Vec<u8>,
    /// The payload last read, its shared header put back in front (version 3).
    joined: Vec<u8>,
    /// Where values not located at open nor found before are searched for, through the SIGBUS
    /// guard (`None` where the environment's map is unknown: liblmdb's own search then).
    search: Option<Search>,
    /// The file, where values are read with `pread` ([`Lmdb::direct`]).
    direct: Option<Arc<fs::File>>,
}

/// A search of the database a reader reads values from, through the SIGBUS guard
/// ([`TreeRoot::find`]): liblmdb's own search reads the tree's pages straight from the map,
/// where a page the disk cannot supply (a folder2lmdb ImageNet file of 140 GB is never read
/// through at open) or a file cut under the reader was SIGBUS.
struct Search {
    tree: TreeRoot,
    /// The environment's map (known: a reader searches only where it is).
    map: EnvMap,
    /// The pages searched last, copied out of the map.
    pages: SearchPages,
}

impl Search {
    /// The value stored under `key` (record `index`, `name` in messages), in the map of `txn`'s
    /// environment.
    fn value<'t>(
        &mut self,
        txn: &'t RoTxn<'static, WithoutTls>,
        path: &Path,
        (index, name): (usize, &str),
        key: &[u8],
    ) -> Result<Option<&'t [u8]>> {
        let map = self
            .map
            .bytes(txn)
            .expect("a search is made only where the map is known");
        let found = self.tree.find(path, map, key, &mut self.pages);
        let (offset, len) = match found {
            Ok(Some(location)) => location,
            Ok(None) => return Ok(None),
            Err(NotFound::Unreadable(e)) => return Err(e),
            Err(NotFound::Changed(why)) => {
                return Err(Error::FileChanged {
                    path: path.to_path_buf(),
                    change: format!("{why}, not what the open checked; open it again"),
                });
            }
        };
        let Some(value) = usize::try_from(offset)
            .ok()
            .and_then(|at| map.get(at..at.checked_add(len)?))
        else {
            return Err(corrupt(
                path,
                index,
                name,
                format!(
                    "its node gives {len} bytes at offset {offset} of a {}-byte file: past the \
                     file's end (a damaged LMDB page)",
                    map.len()
                ),
            ));
        };
        Ok(Some(value))
    }
}

impl LmdbReader {
    /// The value of record `index` (`name` in messages), stored under `key` in `db`: from the
    /// table of values already found, or searched for through the guard (`search`; liblmdb's
    /// lookup where there is none), and remembered if it lies inside the map (`bounds`).
    fn value<'t>(
        txn: &'t RoTxn<'static, WithoutTls>,
        (found, bounds, search): (&mut [(usize, usize)], &MapBounds, Option<&mut Search>),
        (path, db): (&Path, &Database<Bytes, Bytes>),
        (index, name, key): (usize, &str, &[u8]),
    ) -> Result<Option<&'t [u8]>> {
        if let Some(value) = remembered(txn, found, index) {
            return Ok(Some(value));
        }
        let value = match search {
            Some(search) => search.value(txn, path, (index, name), key)?,
            None => db.get(txn, key).map_err(|e| Error::lmdb(path, e))?,
        };
        if let Some(value) = value {
            remember(found, bounds, index, value);
        }
        Ok(value)
    }

    /// The value of sample `index` of an imagefeed file: from the table of values already
    /// found or, on a miss, by one cursor run from its key that remembers the next
    /// [`FILL_RUN`] samples' values too (keys are the indices, so the run follows the file's
    /// order). A fresh reader's first epoch then costs one B-tree search per run instead of one
    /// per sample: ~1 µs each, 5% of a CIFAR-size epoch's CPU time. The run only reaches pages
    /// the open checked (`tree`): the leaves after this one, through their checked parents.
    fn sample_value<'t>(
        txn: &'t RoTxn<'static, WithoutTls>,
        (found, bounds, search): (&mut [(usize, usize)], &MapBounds, Option<&mut Search>),
        (path, samples): (&Path, &Database<Bytes, Bytes>),
        index: usize,
    ) -> Result<Option<&'t [u8]>> {
        let start = sample_key(index);
        // (Not where the guarded search can be had: the run is liblmdb's, from the map.)
        if search.is_none() && !found.is_empty() && remembered(txn, found, index).is_none() {
            let from: (Bound<&[u8]>, Bound<&[u8]>) = (Bound::Included(&start), Bound::Unbounded);
            let run = samples
                .range(txn, &from)
                .map_err(|e| Error::lmdb(path, e))?;
            for entry in run.take(FILL_RUN) {
                // A key that is no sample's ends the run; so does an error, which the lookup
                // below then meets (or not) on its own.
                let Ok((key, value)) = entry else { break };
                let Some(at) = sample_index(key).filter(|&at| at < found.len()) else {
                    break;
                };
                remember(found, bounds, at, value);
            }
        }
        // A sample the run did not find is missing: the lookup says so as before.
        let name = format!("#{index}");
        Self::value(
            txn,
            (found, bounds, search),
            (path, samples),
            (index, &name, &start),
        )
    }
}

/// Remembers where sample `index`'s `value` lies, if it lies inside the map (`bounds`): only
/// checked values reach [`remembered`], and so [`RecordReader::prefetch`]. One that does not is
/// looked up again when read, and refused then.
fn remember(found: &mut [(usize, usize)], bounds: &MapBounds, index: usize, value: &[u8]) {
    if let (Some(slot), Ok(value)) = (found.get_mut(index), bounds.check(value)) {
        *slot = (value.as_ptr() as usize, value.len());
    }
}

/// Samples whose values one cursor run remembers ([`LmdbReader::sample_value`]).
const FILL_RUN: usize = 64;

/// The index a sample key stores ([`sample_key`]'s inverse), if `key` is one.
fn sample_index(key: &[u8]) -> Option<usize> {
    let bytes: [u8; 8] = key.try_into().ok()?;
    usize::try_from(u64::from_be_bytes(bytes)).ok()
}

/// The value of record `index` if `found` (the table of `txn`'s reader) has it. `txn` is
/// only taken for its lifetime: the slice cannot outlive the transaction that keeps it valid.
fn remembered<'t>(
    _txn: &'t RoTxn<'static, WithoutTls>,
    found: &[(usize, usize)],
    index: usize,
) -> Option<&'t [u8]> {
    let &(address, len) = found.get(index).filter(|(address, _)| *address != 0)?;
    // SAFETY: `address` and `len` are those of a value that liblmdb returned in `_txn` (the
    // reader's one read-only transaction, which `found` belongs to), by `db.get` or by a
    // cursor run over it, and that lies inside the map (`remember`). LMDB keeps such bytes
    // valid and unchanged until the transaction ends (cursors closed or not: this build has no
    // `MDB_VL32`), and the slice borrows `_txn` for `'t`.
    Some(unsafe { std::slice::from_raw_parts(address as *const u8, len) })
}

impl RecordReader for LmdbReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        assert!(
            index < self.info.num_samples,
            "index {index} out of range for {} samples",
            self.info.num_samples
        );
        let (txn, path) = (&self.txn, self.path.as_path());
        let lookup = (&mut self.found[..], &self.bounds, self.search.as_mut());
        let (label, key, payload) = match &self.layout {
            Layout::Imagefeed {
                samples,
                checksums,
                headers,
            } => {
                let value = match self.located.as_ref().and_then(|l| l.value(txn, index)) {
                    Some(located) => located,
                    None => Self::sample_value(txn, lookup, (path, samples), index)?
                        .ok_or_else(|| {
                            corrupt(&self.path, index, &format!("#{index}"), "record is missing")
                        })
                        .map(|value| self.bounds.check(value))?,
                }
                .map_err(|reason| corrupt(&self.path, index, &format!("#{index}"), reason))?;
                // Out of the map (or the file) before anything reads it (`mapguard`).
                let map = self.bounds.map_of(value);
                let direct = self.direct.as_deref();
                let value = copy_value(&self.path, direct, map, value, &mut self.copied)?;
                let decoded = decode_value(value);
                // With shared headers (version 3): the header the payload refers to, which
                // its checksum covers too. One that is damaged or not there fails the sample
                // first, naming it.
                let split = match (headers.as_deref(), &decoded) {
                    (Some(headers), Ok((_, key, payload))) => Some(
                        headers
                            .split(payload)
                            .map_err(|reason| corrupt(&self.path, index, key, reason))?,
                    ),
                    _ => None,
                };
                if let Some(checksums) = checksums {
                    let header = split.and_then(|(header, _)| header);
                    let computed = stored_value_checksum(value, header);
                    if computed != checksums[index] {
                        let key = decoded
                            .as_ref()
                            .map_or_else(|_| format!("#{index}"), |d| d.1.to_string());
                        // A file cut inside this value's last page reads as zeros from the
                        // cut on: a changed file, not damage.
                        if let Some(e) =
                            map.and_then(|(_, len)| crate::mapguard::shrank(&self.path, len, ""))
                        {
                            return Err(e);
                        }
                        let reason = crate::format::checksum_mismatch(checksums[index], computed);
                        return Err(corrupt(&self.path, index, &key, reason));
                    }
                }
                let (label, key, payload) = decoded
                    .map_err(|reason| corrupt(&self.path, index, &format!("#{index}"), reason))?;
                let payload = match split {
                    Some((header, rest)) => shared_headers::join(header, rest, &mut self.joined),
                    None => payload,
                };
                (label, key, payload)
            }
            Layout::Folder2Lmdb { db, keys } => {
                let key = keys[index].as_str();
                let value = Self::value(txn, lookup, (path, db), (index, key, key.as_bytes()))?
                    .ok_or_else(|| {
                        corrupt(&self.path, index, key, "key listed in __keys__ is missing")
                    })?;
                let value = self
                    .bounds
                    .check(value)
                    .map_err(|reason| corrupt(&self.path, index, key, reason))?;
                let map = self.bounds.map_of(value);
                let direct = self.direct.as_deref();
                let value = copy_value(&self.path, direct, map, value, &mut self.copied)?;
                let (image, label) = pickle::image_and_label(value)
                    .map_err(|reason| corrupt(&self.path, index, key, reason))?;
                let label = self
                    .info
                    .check_stored_label(&self.path, index, key, label)?;
                let payload = match image {
                    pickle::Image::Stored(range) => &value[range],
                    // Protocols 0 to 2 store bytes as latin-1 text: decoded into the reader's
                    // own buffer, which lives until the next read.
                    pickle::Image::Decoded(bytes) => {
                        self.decoded = bytes;
                        self.decoded.as_slice()
                    }
                };
                (label, key, payload)
            }
        };
        self.info.check_label(&self.path, index, key, label)?;
        Ok(Record {
            index,
            key,
            label,
            payload,
        })
    }

    /// A file read with `pread` ([`Lmdb::direct`]: larger than the memory) has the reads of
    /// the batch's values started now (`POSIX_FADV_WILLNEED` on exactly each value's bytes,
    /// which returns at once), so they come from the disk together rather than one `pread`
    /// at a time.
    ///
    /// A folder2lmdb file's values are found now (the search a read would make, its result
    /// remembered for the read where the reader keeps a table, [`FOUND_TABLE_MAX_RECORDS`]).
    fn plan_reads(&mut self, indices: &[usize]) {
        let Some(file) = &self.direct else {
            return;
        };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&**file);
        let advise = |offset: usize, len: usize| {
            // (A length of 0 would advise the rest of the file.)
            let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
                return;
            };
            if len > 0 {
                // SAFETY: a plain syscall on a valid, open file descriptor (the reader holds
                // the file); the advice is asynchronous and changes nothing any read returns.
                unsafe { libc::posix_fadvise(fd, offset, len, libc::POSIX_FADV_WILLNEED) };
            }
        };
        if let Some(located) = &self.located {
            for &index in indices {
                if let Some((offset, len)) = located.place(index) {
                    advise(offset, len);
                }
            }
            return;
        }
        let Layout::Folder2Lmdb { db, keys } = &self.layout else {
            return;
        };
        for &index in indices.iter().filter(|&&i| i < keys.len()) {
            let key = keys[index].as_str();
            let lookup = (&mut self.found[..], &self.bounds, self.search.as_mut());
            // An error is the read's to report.
            let Ok(Some(value)) = Self::value(
                &self.txn,
                lookup,
                (&self.path, db),
                (index, key, key.as_bytes()),
            ) else {
                continue;
            };
            if let Some((start, _)) = self.bounds.map_of(value) {
                advise(value.as_ptr() as usize - start, value.len());
            }
        }
    }

    fn prefetch(&mut self, index: usize) {
        if let Some(Ok(value)) = self
            .located
            .as_ref()
            .and_then(|l| l.value(&self.txn, index))
        {
            crate::dataset::prefetch(value);
        } else if let Some(value) = remembered(&self.txn, &self.found, index) {
            crate::dataset::prefetch(value);
        }
    }
}
