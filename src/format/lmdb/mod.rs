//! Single-file LMDB datasets: the writer `pack-dataset imagefolder2lmdb` uses, and the reader.
//!
//! # Layout (version 2)
//!
//! One LMDB data file, opened with `MDB_NOSUBDIR` (as Python's `lmdb.open(path, subdir=False)`),
//! holding two named databases:
//!
//! - `meta`, UTF-8 keys, JSON values:
//!   - `info`: `{"magic": "imagefeed-lmdb", "version": 2, "complete": bool, "format": "lmdb",
//!     "classes": [names...], "num_samples": N, "payload": "encoded" | "raw-rgb8",
//!     "resized_short_side": S (only when resized at pack time)}`
//!   - `pack-plan`: what the pack was asked to do (source fingerprint, options); `--resume`
//!     refuses to continue a partial file made from another source or with other options.
//!   - `pack-progress`: `{"sources_done", "samples_written", "payload_bytes", "rejected":
//!     [{"key", "reason"}]}`, updated in the same transaction as each chunk of samples.
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
//!
//! Python reads sample `i` with
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
//! environment between every `Lmdb` value of the same file, and each [`RecordReader`] holds its
//! own read transaction (created without thread-local storage, so it can move to a worker).
//! Reads return slices into the memory map: zero-copy.
//!
//! # Page cache
//!
//! Unlike the Python convention (`readahead=False`), kernel read-ahead stays on, and a file that
//! fits in half the available memory is handed to the kernel to stream in at open
//! ([`prefetch_if_it_fits`](crate::pagecache::prefetch_if_it_fits)). Small records live in
//! B-tree leaf pages that are not in file order, so without this a cold epoch faults in one 4 KiB
//! page at a time: measured on CIFAR-10 (14 MB file, cold cache), 0.45 s with `NO_READ_AHEAD`
//! against 0.02 s with read-ahead and the prefetch. A file larger than that is read on demand.

use std::collections::HashMap;
use std::fs;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use heed::types::{Bytes, Str};
use heed::{Database, Env, EnvFlags, EnvOpenOptions, RoTxn, WithoutTls};
use serde::{Deserialize, Serialize};

use crate::dataset::{Dataset, DatasetInfo, FormatKind, Record, RecordReader};
use crate::error::{Error, IoContext as _, Result};
use crate::format::output;
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, PackedRecord, WriterOptions};
use crate::format::{InfoRecord, Recognizer, pickle};

mod tree;

/// The `magic` value in `meta/info`.
pub const MAGIC: &str = "imagefeed-lmdb";
/// The layout version this build writes and the newest it reads.
pub const VERSION: u32 = 2;
/// The first layout version with the `checksums` database.
const CHECKSUMS_SINCE: u32 = 2;
/// Default LMDB map size for writing: address space only; the file grows as data is written.
pub const DEFAULT_MAP_SIZE: usize = 1 << 40;

const META_DB: &str = "meta";
const SAMPLES_DB: &str = "samples";
const CHECKSUMS_DB: &str = "checksums";
const INFO_KEY: &str = "info";
const PLAN_KEY: &str = "pack-plan";
const PROGRESS_KEY: &str = "pack-progress";
/// liblmdb's magic number, at byte 16 of the first meta page.
const LMDB_FILE_MAGIC: u32 = 0xBEEF_C0DE;

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

// ---------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------

/// Writes a dataset into `OUT.partial`, chunk by chunk, and renames it to `OUT` when finished.
pub struct LmdbWriter {
    env: Env,
    /// The map's size: doubled when the data outgrows it ([`LmdbWriter::grow_map`]).
    map_size: usize,
    /// Held while writing: see [`output::lock_staging`].
    _lock: fs::File,
    meta: Database<Str, Str>,
    samples: Database<Bytes, Bytes>,
    checksums: Database<Bytes, Bytes>,
    partial: PathBuf,
    out: PathBuf,
    value: Vec<u8>,
    /// The current chunk's checksums, as stored (`u32` LE each).
    chunk_checksums: Vec<u8>,
}

/// The smallest map the writer starts with when the asked-for one cannot be mapped.
const SMALLEST_WRITE_MAP: usize = 64 << 20;

/// Opens the writer's environment with a map of `map_size` bytes of address space (LMDB
/// reserves it all up front: 1 TiB by default), or, where the process may not map that much
/// (`ulimit -v`), the largest half, quarter, ... that it may, down to what the file already
/// holds; the map then grows with the data ([`LmdbWriter::grow_map`]). Returns the map size.
fn open_write_env(path: &Path, map_size: usize) -> Result<(Env, usize)> {
    let page = crate::pagecache::page_size();
    let held = fs::metadata(path).map_or(0, |m| m.len() as usize);
    let floor = held.max(SMALLEST_WRITE_MAP).div_ceil(page) * page;
    let mut size = map_size.max(page).div_ceil(page) * page;
    loop {
        let mut options = EnvOpenOptions::new();
        options.map_size(size).max_dbs(3);
        // SAFETY: NO_SUB_DIR only changes where LMDB puts its files (PATH and PATH-lock).
        unsafe { options.flags(EnvFlags::NO_SUB_DIR) };
        // SAFETY: the partial file is private to this writer until it is renamed; nothing else
        // in this process maps it, and other processes would go through LMDB's lock file.
        match unsafe { options.open(path) } {
            Ok(env) => return Ok((env, size)),
            Err(e) if out_of_address_space(&e) && size / 2 >= floor => {
                size = (size / 2).div_ceil(page) * page;
            }
            Err(e) if out_of_address_space(&e) => return Err(map_too_large(path, size, e)),
            Err(e) => return Err(Error::lmdb(path, e)),
        }
    }
}

/// True when LMDB could not map (or remap) its file: the process's address space is limited.
fn out_of_address_space(e: &heed::Error) -> bool {
    matches!(e, heed::Error::Io(io) if io.raw_os_error() == Some(libc::ENOMEM))
}

/// The error for a map of `size` bytes the process may not have: which limit to raise.
fn map_too_large(path: &Path, size: usize, e: heed::Error) -> Error {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    let known = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } == 0;
    let limit = if known && limit.rlim_cur != libc::RLIM_INFINITY {
        format!(
            "at most {} bytes (ulimit -v {})",
            limit.rlim_cur,
            limit.rlim_cur / 1024
        )
    } else {
        "less (memory or address space is short)".into()
    };
    Error::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!(
                "LMDB needs {size} bytes of address space to map the file, and this process may \
                 map {limit}: raise the limit (ulimit -v unlimited), then rerun with --resume \
                 (LMDB said: {e})"
            ),
        ),
    )
}

/// The error for a failed write to the LMDB at `path`, which needed about `needed` bytes.
///
/// liblmdb turns a short write, which is how a full disk shows up on many file systems, into
/// `EIO` ("Input/output error"), so the file system is asked: when it has less room left than
/// the write needed, the error says the disk is full.
fn write_error(path: &Path, needed: u64, e: heed::Error) -> Error {
    let code = match &e {
        heed::Error::Io(io) => io.raw_os_error(),
        _ => None,
    };
    if matches!(code, Some(libc::EIO | libc::ENOSPC))
        && let Some(free) = crate::file::free_space(path)
        && (code == Some(libc::ENOSPC) || free < needed.saturating_add(1 << 20))
    {
        return Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                format!(
                    "no space left on the device ({free} bytes free, about {needed} needed; \
                     LMDB said: {e}); free some and rerun with --resume"
                ),
            ),
        );
    }
    Error::lmdb(path, e)
}

impl LmdbWriter {
    /// One chunk in one transaction (nothing of it stays when it fails).
    fn try_write_chunk(
        &mut self,
        records: &[PackedRecord<'_>],
        progress: &PackProgress,
    ) -> heed::Result<()> {
        let first = progress.samples_written - records.len();
        let mut wtxn = self.env.write_txn()?;
        self.chunk_checksums.clear();
        for (offset, record) in records.iter().enumerate() {
            encode_value(&mut self.value, record.label, record.key, record.payload);
            self.chunk_checksums
                .extend_from_slice(&crc32c::crc32c(&self.value).to_le_bytes());
            self.samples
                .put(&mut wtxn, &sample_key(first + offset), &self.value)?;
        }
        if !records.is_empty() {
            self.checksums
                .put(&mut wtxn, &sample_key(first), &self.chunk_checksums)?;
        }
        self.meta.put(&mut wtxn, PROGRESS_KEY, &to_json(progress))?;
        wtxn.commit()
    }

    /// Doubles the map, or says which limit keeps it from growing.
    fn grow_map(&mut self) -> Result<()> {
        let bigger = self.map_size.saturating_mul(2);
        // SAFETY: no transaction of this environment is active: the writer is its only user,
        // and the transaction that found the map full has been dropped.
        match unsafe { self.env.resize(bigger) } {
            Ok(()) => {
                self.map_size = bigger;
                Ok(())
            }
            Err(e) if out_of_address_space(&e) => Err(map_too_large(&self.partial, bigger, e)),
            Err(e) => Err(Error::lmdb(&self.partial, e)),
        }
    }
}

impl DatasetWriter for LmdbWriter {
    fn start(out: &Path, plan: &PackPlan, options: &WriterOptions) -> Result<(Self, PackProgress)> {
        let (mode, map_size) = (options.mode, options.lmdb_map_size);
        let partial = output::prepare_output(out, mode)?;
        let existed = partial.exists();
        refuse_odd_lock_file(&partial)?;
        let (env, map_size) = open_write_env(&partial, map_size)?;
        let lock = output::lock_staging(&partial)?;
        // A file in which no transaction was committed (a run killed before its first commit)
        // holds nothing to resume: start afresh in it. Decided with the lock held.
        let fresh = !existed || holds_nothing(&partial);
        let mut wtxn = env.write_txn().map_err(|e| Error::lmdb(&partial, e))?;
        let meta: Database<Str, Str> = env
            .create_database(&mut wtxn, Some(META_DB))
            .map_err(|e| Error::lmdb(&partial, e))?;
        let samples: Database<Bytes, Bytes> = env
            .create_database(&mut wtxn, Some(SAMPLES_DB))
            .map_err(|e| Error::lmdb(&partial, e))?;
        let checksums: Database<Bytes, Bytes> = env
            .create_database(&mut wtxn, Some(CHECKSUMS_DB))
            .map_err(|e| Error::lmdb(&partial, e))?;
        let progress = if fresh {
            let info = InfoRecord::new(
                MAGIC,
                VERSION,
                false,
                plan.dataset_info(FormatKind::Lmdb, 0),
            );
            let progress = PackProgress::default();
            for (key, value) in [
                (INFO_KEY, to_json(&info)),
                (PLAN_KEY, to_json(plan)),
                (PROGRESS_KEY, to_json(&progress)),
            ] {
                meta.put(&mut wtxn, key, &value)
                    .map_err(|e| Error::lmdb(&partial, e))?;
            }
            progress
        } else {
            let get = |k: &str| -> Result<String> {
                meta.get(&wtxn, k)
                    .map_err(|e| Error::lmdb(&partial, e))?
                    .map(str::to_owned)
                    .ok_or_else(|| Error::ResumeMismatch {
                        path: partial.clone(),
                        reason: format!("meta/{k} is missing: not a partial imagefeed LMDB"),
                    })
            };
            let info: InfoRecord = from_json(&partial, INFO_KEY, &get(INFO_KEY)?)?;
            if info.version < CHECKSUMS_SINCE {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: format!(
                        "it was started by an older imagefeed (layout version {}, without \
                         checksums); pack again with --force",
                        info.version
                    ),
                });
            }
            if info.complete {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: "it holds a complete dataset (a pack whose final rename was cut \
                             short, or a copy of a finished one), so there is nothing to resume: \
                             use --force to pack again, or rename it yourself if it is the \
                             dataset you want"
                        .into(),
                });
            }
            let old_plan = parse_plan(&partial, &get(PLAN_KEY)?)?;
            old_plan.check_resumable(plan, &partial)?;
            let progress = parse_progress(&partial, &get(PROGRESS_KEY)?)?;
            let written = samples.len(&wtxn).map_err(|e| Error::lmdb(&partial, e))?;
            if written != progress.samples_written as u64 {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: format!(
                        "{written} samples stored but the progress record says {}",
                        progress.samples_written
                    ),
                });
            }
            progress
        };
        wtxn.commit().map_err(|e| Error::lmdb(&partial, e))?;
        let writer = LmdbWriter {
            env,
            map_size,
            _lock: lock,
            meta,
            samples,
            checksums,
            out: std::path::absolute(out).at(out)?,
            partial,
            value: Vec::new(),
            chunk_checksums: Vec::new(),
        };
        Ok((writer, progress))
    }

    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()> {
        loop {
            match self.try_write_chunk(records, progress) {
                // The map (a reservation of address space, smaller than the default where the
                // process may not map 1 TiB) is full: grow it and write the chunk again.
                Err(heed::Error::Mdb(heed::MdbError::MapFull)) => self.grow_map()?,
                Err(e) => {
                    let needed = records.iter().map(|r| r.payload.len() as u64 + 64).sum();
                    return Err(write_error(&self.partial, needed, e));
                }
                Ok(()) => return Ok(()),
            }
        }
    }

    fn finish(self: Box<Self>, info: &DatasetInfo, progress: &PackProgress) -> Result<()> {
        let record = InfoRecord::new(MAGIC, VERSION, true, info.clone());
        let mut wtxn = self
            .env
            .write_txn()
            .map_err(|e| Error::lmdb(&self.partial, e))?;
        self.meta
            .put(&mut wtxn, INFO_KEY, &to_json(&record))
            .and_then(|()| self.meta.put(&mut wtxn, PROGRESS_KEY, &to_json(progress)))
            .map_err(|e| Error::lmdb(&self.partial, e))?;
        wtxn.commit().map_err(|e| Error::lmdb(&self.partial, e))?;
        self.env
            .force_sync()
            .map_err(|e| Error::lmdb(&self.partial, e))?;
        let LmdbWriter {
            env, partial, out, ..
        } = *self;
        env.prepare_for_closing().wait();
        remove_lock_file(&partial);
        output::publish(&partial, &out)
    }

    fn abandon(self: Box<Self>) {
        let LmdbWriter { env, partial, .. } = *self;
        env.prepare_for_closing().wait();
        remove_lock_file(&partial);
        let _ = fs::remove_file(&partial);
    }
}

fn lock_file(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push("-lock");
    PathBuf::from(name)
}

/// `Err(NotReplaceable)` when something is at the path of the lock file liblmdb will open for
/// the partial file `partial` and it is not a lock file a writer of ours left: liblmdb opens
/// that path with `O_CREAT`, following links, and truncates and rewrites it, so a link, a file
/// with other hard links, or a file that does not start with LMDB's lock magic (`0xBEEFC0DE`)
/// is refused rather than overwritten. An empty file, a stale lock file, or an all-zero one (a
/// writer killed while liblmdb was creating it, between sizing it and writing its header) is
/// reused, as liblmdb intends.
fn refuse_odd_lock_file(partial: &Path) -> Result<()> {
    use std::io::Read as _;
    use std::os::unix::fs::MetadataExt as _;
    const LOCK_MAGIC: [u8; 4] = 0xBEEF_C0DE_u32.to_le_bytes();
    let lock = lock_file(partial);
    let Some(meta) = crate::file::entry_metadata(&lock)? else {
        return Ok(());
    };
    // Besides a lock file with LMDB's magic: an empty one, or one liblmdb sized but was
    // killed before writing its header (ftruncate, then the header through a mapping): all
    // zeros, and no larger than a lock table gets.
    const MOST_LOCK_BYTES: u64 = 16 << 20;
    let ours = meta.is_file()
        && meta.nlink() == 1
        && (meta.len() == 0
            || {
                let mut head = [0u8; 4];
                fs::File::open(&lock)
                    .and_then(|mut f| f.read_exact(&mut head))
                    .is_ok()
                    && head == LOCK_MAGIC
            }
            || (meta.len() <= MOST_LOCK_BYTES && all_zero(&lock, MOST_LOCK_BYTES)));
    if ours {
        return Ok(());
    }
    Err(Error::NotReplaceable {
        path: lock,
        reason: "the LMDB writer's lock file goes there, and this is not one (a link, a file \
                 with other hard links, or a file that is not an LMDB lock file); move it away"
            .into(),
    })
}

/// Whether the regular file at `path` holds only zero bytes, reading at most `limit` bytes
/// (one that is larger, or is not a regular file when opened, is not).
fn all_zero(path: &Path, limit: u64) -> bool {
    use std::io::Read as _;
    let Ok((file, _)) = crate::file::open_regular(path) else {
        return false;
    };
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).is_ok()
        && bytes.len() as u64 <= limit
        && bytes.iter().all(|&b| b == 0)
}

fn remove_lock_file(path: &Path) {
    let _ = fs::remove_file(lock_file(path));
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
        output::refuse_interrupted(path)?;
        has_magic(path)
    },
    open: |path, _| Ok(Arc::new(Lmdb::open(path)?)),
};

// ---------------------------------------------------------------------------------------------
// Reader
// ---------------------------------------------------------------------------------------------

type ReadEnv = Env<WithoutTls>;

/// An open environment and the identity (device, inode) of the file it maps.
struct OpenEnv {
    dev: u64,
    ino: u64,
    env: Weak<ReadEnv>,
}

/// Environments open in this process, by canonical path, with the file's identity so that a
/// file replaced on disk is not served from a stale map.
static OPEN_ENVS: Mutex<Option<HashMap<PathBuf, OpenEnv>>> = Mutex::new(None);

/// Where the process's maps of an LMDB file lie in memory, each up to the file's length: every
/// value liblmdb hands back must lie inside one. liblmdb takes a value's length from its node on
/// the page as it is; a damaged node (a flipped high byte of its size) gives a slice running past
/// the map, and reading it (a checksum, a parse) killed the process with SIGSEGV. Each value is
/// checked against these bounds before anything reads it. (A file renamed while an environment
/// under its old name is open gets a second environment and map: both count.)
#[derive(Debug, Clone, Default)]
struct MapBounds(Option<Arc<[(usize, usize)]>>);

impl MapBounds {
    /// The maps of the file `(dev, ino)` this process holds (liblmdb maps it from offset 0),
    /// from `/proc/self/maps`; unknown (no check) where that cannot be read or shows none.
    fn of(dev: u64, ino: u64, file_len: u64) -> MapBounds {
        let Ok(maps) = fs::read_to_string("/proc/self/maps") else {
            return MapBounds(None);
        };
        let device = format!("{:02x}:{:02x}", libc::major(dev), libc::minor(dev));
        let inode = ino.to_string();
        let mut ranges = Vec::new();
        for line in maps.lines() {
            let fields: Vec<&str> = line.split_whitespace().take(5).collect();
            let [range, _perms, offset, dev_field, ino_field] = fields[..] else {
                continue;
            };
            if ino_field != inode
                || !offset.trim_start_matches('0').is_empty()
                || !dev_field.eq_ignore_ascii_case(&device)
            {
                continue;
            }
            let Some((start, end)) = range.split_once('-') else {
                continue;
            };
            let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) else {
                continue;
            };
            let len = usize::try_from(file_len)
                .unwrap_or(usize::MAX)
                .min(end.saturating_sub(start));
            ranges.push((start, start + len));
        }
        MapBounds((!ranges.is_empty()).then(|| ranges.into()))
    }

    /// `value` when it lies inside a map of the file (or the maps are unknown), else why not.
    fn check<'v>(&self, value: &'v [u8]) -> std::result::Result<&'v [u8], String> {
        let Some(ranges) = &self.0 else {
            return Ok(value);
        };
        let at = value.as_ptr() as usize;
        let inside =
            |&(start, end): &(usize, usize)| at >= start && at <= end && value.len() <= end - at;
        if ranges.iter().any(inside) {
            return Ok(value);
        }
        let (start, end) = ranges
            .iter()
            .copied()
            .find(|&(start, end)| at >= start && at <= end)
            .unwrap_or(ranges[0]);
        Err(format!(
            "its node gives {} bytes at offset {} of a {}-byte file: past the file's end (a \
             damaged LMDB page)",
            value.len(),
            at.wrapping_sub(start) as isize,
            end - start
        ))
    }
}

/// Which of the two LMDB layouts a file has.
#[derive(Clone)]
enum Layout {
    /// imagefeed's own (module docs): `samples` database keyed by big-endian index, and each
    /// sample's checksum (version 2 on).
    Imagefeed {
        samples: Database<Bytes, Bytes>,
        checksums: Option<Arc<[u32]>>,
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
    path: PathBuf,
    env: Arc<ReadEnv>,
    bounds: MapBounds,
    layout: Layout,
    info: DatasetInfo,
    complete: bool,
    progress: Option<PackProgress>,
    /// What opening found that a user should hear about (labels left out of the classes).
    notices: Vec<String>,
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
        output::refuse_interrupted(path)?;
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
        let file = check_lmdb_file(path)?;
        // Small datasets stream into the page cache in one sequential read; see pagecache.
        crate::pagecache::prefetch_if_it_fits(&file);
        let len = file.metadata().at(path)?.len();
        let (env, bounds) = shared_read_env(path, len)?;
        let rtxn = env.read_txn().map_err(|e| Error::lmdb(path, e))?;
        let meta: Option<Database<Str, Bytes>> = env
            .open_database(&rtxn, Some(META_DB))
            .map_err(|e| Error::lmdb(path, e))?;
        let Some(meta) = meta else {
            return open_folder2lmdb(path, (&env, bounds), rtxn, len);
        };
        let get = |key: &str| meta_text(path, &bounds, &meta, &rtxn, key);
        let info_text =
            get(INFO_KEY)?.ok_or_else(|| Error::not_a_dataset(path, "meta/info is missing"))?;
        let record = parse_info(path, info_text)?;
        let progress = match get(PROGRESS_KEY)? {
            Some(text) => Some(parse_progress(path, text)?),
            None => None,
        };
        let samples: Database<Bytes, Bytes> = env
            .open_database(&rtxn, Some(SAMPLES_DB))
            .map_err(|e| Error::lmdb(path, e))?
            .ok_or_else(|| Error::not_a_dataset(path, "the samples database is missing"))?;
        let stored = samples.len(&rtxn).map_err(|e| Error::lmdb(path, e))? as usize;
        let mut notices = Vec::new();
        let checksums = if record.version >= CHECKSUMS_SINCE {
            Some(read_checksums(path, (&env, &bounds), &rtxn, stored)?)
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
        Ok(Lmdb {
            path: path.to_path_buf(),
            env,
            bounds,
            layout: Layout::Imagefeed { samples, checksums },
            info,
            complete: record.complete,
            progress,
            notices,
        })
    }

    /// True when the pack that wrote this file finished.
    pub fn is_complete(&self) -> bool {
        self.complete
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
    (env, bounds): (&Env<WithoutTls>, &MapBounds),
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
    for entry in db.iter(rtxn).map_err(|e| Error::lmdb(path, e))? {
        let (key, value) = entry.map_err(|e| Error::lmdb(path, e))?;
        let (key, value) = bounds
            .check(key)
            .and_then(|key| Ok((key, bounds.check(value)?)))
            .map_err(|reason| {
                Error::not_a_dataset(path, format!("the checksums database: {reason}"))
            })?;
        let first = <[u8; 8]>::try_from(key).ok().map(u64::from_be_bytes);
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

/// Refuses what is clearly not an LMDB data file, or one cut short, with a clear message;
/// returns the opened file.
///
/// The length check matters: liblmdb maps the whole database and trusts its meta page, so a
/// truncated copy would fault with SIGBUS on the first read of a missing page instead of failing.
/// We read both meta pages (LMDB keeps two and uses the one with the larger transaction id) and
/// require the file to hold every page up to that meta's last page.
fn check_lmdb_file(path: &Path) -> Result<fs::File> {
    let (file, len, live) = read_meta_pages(path)?;
    let Some(live) = live else {
        return Err(Error::not_a_dataset(
            path,
            "not an LMDB file (bad magic number)",
        ));
    };
    let needed = live.needed_len();
    if len < needed {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "truncated: LMDB's meta page needs {needed} bytes but the file has {len} (an incomplete copy?)",
            ),
        ));
    }
    Ok(file)
}

/// Whether the file at `path` carries LMDB's magic number in a meta page: what tells an LMDB
/// file from any other file (nothing else is checked; opening checks the rest). A path that is
/// missing (or an interrupted pack's), a directory or not a regular file is the error opening
/// it would give.
pub fn has_magic(path: &Path) -> Result<bool> {
    read_meta_pages(path).map(|(_, _, live)| live.is_some())
}

/// Opens `path` as a regular file and reads its live meta page: (file, length, meta), the meta
/// `None` when neither page carries LMDB's magic.
fn read_meta_pages(path: &Path) -> Result<(fs::File, u64, Option<LmdbMeta>)> {
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            output::refuse_interrupted(path)?;
            return Err(Error::io(path, e));
        }
        Err(e) => return Err(Error::io(path, e)),
    };
    if meta.is_dir() {
        return Err(Error::not_a_dataset(
            path,
            "a directory, not a single-file LMDB",
        ));
    }
    let (mut file, _) = crate::file::open_regular(path)?;
    let live = LmdbMeta::read_live(&mut file, path)?;
    Ok((file, meta.len(), live))
}

/// Bytes of a meta page we look at: page header (16) + MDB_meta up to mm_txnid (136).
pub(crate) const META_PAGE_BYTES: usize = 152;

/// The fields of liblmdb's `MDB_meta` (64-bit build) that the length check needs.
pub(crate) struct LmdbMeta {
    page_size: u64,
    last_page: u64,
    txn_id: u64,
}

impl LmdbMeta {
    /// Parses a meta page: a 16-byte page header, then `mm_magic`, `mm_version`, `mm_address`,
    /// `mm_mapsize`, two 48-byte `MDB_db` (the free-list DB's `md_pad` holds the page size),
    /// `mm_last_pg`, `mm_txnid`.
    pub(crate) fn parse(page: &[u8]) -> Option<LmdbMeta> {
        if page.len() < META_PAGE_BYTES {
            return None;
        }
        let u32_at = |o: usize| u32::from_le_bytes(page[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(page[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(16) != LMDB_FILE_MAGIC {
            return None;
        }
        let page_size = u32_at(40) as u64;
        if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
            return None;
        }
        Some(LmdbMeta {
            page_size,
            last_page: u64_at(136),
            txn_id: u64_at(144),
        })
    }
}

impl LmdbMeta {
    /// The bytes the file must hold: every page up to the last one this meta page uses.
    pub(crate) fn needed_len(&self) -> u64 {
        self.last_page
            .saturating_add(1)
            .saturating_mul(self.page_size)
    }

    /// The live meta page of the LMDB file `file` (of the two, the one with the later
    /// transaction), or `None` when the first page is not an LMDB meta page. Reads from the start.
    fn read_live(file: &mut fs::File, path: &Path) -> Result<Option<LmdbMeta>> {
        use std::io::{Seek as _, SeekFrom};
        let mut page = [0u8; META_PAGE_BYTES];
        file.seek(SeekFrom::Start(0)).at(path)?;
        let n = read_up_to(file, &mut page).at(path)?;
        let Some(first) = LmdbMeta::parse(&page[..n]) else {
            return Ok(None);
        };
        file.seek(SeekFrom::Start(first.page_size)).at(path)?;
        let n = read_up_to(file, &mut page).at(path)?;
        Ok(Some(match LmdbMeta::parse(&page[..n]) {
            Some(second) if second.txn_id > first.txn_id => second,
            _ => first,
        }))
    }
}

fn read_up_to(file: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// The text stored under `key` in `meta` (a meta database opened with byte values), checked to
/// lie in the map before it is read.
fn meta_text<'t>(
    path: &Path,
    bounds: &MapBounds,
    meta: &Database<Str, Bytes>,
    rtxn: &'t RoTxn<'_, WithoutTls>,
    key: &str,
) -> Result<Option<&'t str>> {
    let Some(value) = meta.get(rtxn, key).map_err(|e| Error::lmdb(path, e))? else {
        return Ok(None);
    };
    let value = bounds
        .check(value)
        .map_err(|reason| Error::not_a_dataset(path, format!("meta/{key}: {reason}")))?;
    std::str::from_utf8(value)
        .map(Some)
        .map_err(|_| Error::not_a_dataset(path, format!("meta/{key} is not UTF-8 text")))
}

/// The process's environment for `path` (one per file, shared), and where its map lies.
fn shared_read_env(path: &Path, file_len: u64) -> Result<(Arc<ReadEnv>, MapBounds)> {
    let env = read_env(path, file_len)?;
    let meta = fs::metadata(path).at(path)?;
    Ok((env, MapBounds::of(meta.dev(), meta.ino(), file_len)))
}

fn read_env(path: &Path, file_len: u64) -> Result<Arc<ReadEnv>> {
    let canonical = fs::canonicalize(path).at(path)?;
    let meta = fs::metadata(&canonical).at(path)?;
    let (dev, ino) = (meta.dev(), meta.ino());
    let mut guard = OPEN_ENVS.lock().unwrap_or_else(|e| e.into_inner());
    let envs = guard.get_or_insert_with(HashMap::new);
    if let Some(open) = envs.get(&canonical)
        && (open.dev, open.ino) == (dev, ino)
        && let Some(env) = open.env.upgrade()
    {
        return Ok(env);
    }
    // Every branch and leaf page is checked before liblmdb reads any (see `tree`): once per
    // file per process, as the environment is.
    let (file, _) = crate::file::open_regular(&canonical)?;
    tree::check(path, &file, file_len, &[META_DB, SAMPLES_DB, CHECKSUMS_DB])?;
    drop(file);
    let mut options = EnvOpenOptions::new().read_txn_without_tls();
    // Map the file's length, not the map size the writer recorded (1 TiB by default: LMDB keeps
    // the largest size ever configured in the meta page). A configured size takes precedence
    // and LMDB raises it to the committed data size if needed, so nothing is cut off; a process
    // under an address-space limit (ulimit -v, valgrind) can then open the file.
    let page = crate::pagecache::page_size();
    options
        .max_dbs(3)
        .map_size((file_len as usize).max(1).div_ceil(page) * page);
    // SAFETY: these flags make the environment read-only and lock-free, which is sound because
    // imagefeed never modifies a published (renamed, complete) file.
    unsafe { options.flags(EnvFlags::READ_ONLY | EnvFlags::NO_SUB_DIR | EnvFlags::NO_LOCK) };
    // The last user of an earlier environment may still be closing it on another thread; heed
    // answers EnvAlreadyOpened until it has. Wait a little for that rather than fail.
    let mut attempts = 0;
    let env = loop {
        // SAFETY: the file is opened read-only and not modified while mapped (see above); the
        // registry ensures one environment per file in this process.
        match unsafe { options.open(&canonical) } {
            Ok(env) => break env,
            Err(heed::Error::EnvAlreadyOpened) if attempts < 200 => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(heed::Error::EnvAlreadyOpened) => {
                return Err(Error::FileChanged {
                    path: path.to_path_buf(),
                    change: "replaced on disk while this process still holds the earlier file \
                             open; drop that handle first"
                        .into(),
                });
            }
            Err(e) => return Err(Error::lmdb(path, e)),
        }
    };
    let env = Arc::new(env);
    envs.insert(
        canonical,
        OpenEnv {
            dev,
            ino,
            env: Arc::downgrade(&env),
        },
    );
    Ok(env)
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

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        let txn = ReadEnv::clone(&self.env)
            .static_read_txn()
            .map_err(|e| Error::lmdb(&self.path, e))?;
        Ok(Box::new(LmdbReader {
            txn,
            _env: Arc::clone(&self.env),
            bounds: self.bounds.clone(),
            layout: self.layout.clone(),
            path: self.path.clone(),
            info: self.info.clone(),
            found: if self.info.num_samples <= FOUND_TABLE_MAX_RECORDS {
                vec![(0, 0); self.info.num_samples]
            } else {
                Vec::new()
            },
            decoded: Vec::new(),
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
}

impl LmdbReader {
    /// The value of record `index`, stored under `key` in `db`: from the table of values
    /// already found, or looked up (and remembered).
    fn value<'t>(
        txn: &'t RoTxn<'static, WithoutTls>,
        found: &mut [(usize, usize)],
        db: &Database<Bytes, Bytes>,
        index: usize,
        key: &[u8],
    ) -> heed::Result<Option<&'t [u8]>> {
        if let Some(value) = remembered(txn, found, index) {
            return Ok(Some(value));
        }
        let value = db.get(txn, key)?;
        if let (Some(value), Some(slot)) = (value, found.get_mut(index)) {
            *slot = (value.as_ptr() as usize, value.len());
        }
        Ok(value)
    }
}

/// The value of record `index` if `found` (the table of `txn`'s reader) has it. `txn` is
/// only taken for its lifetime: the slice cannot outlive the transaction that keeps it valid.
fn remembered<'t>(
    _txn: &'t RoTxn<'static, WithoutTls>,
    found: &[(usize, usize)],
    index: usize,
) -> Option<&'t [u8]> {
    let &(address, len) = found.get(index).filter(|(address, _)| *address != 0)?;
    // SAFETY: `address` and `len` are those of a value that `db.get` returned in `_txn` (the
    // reader's one read-only transaction, which `found` belongs to). LMDB keeps such bytes
    // valid and unchanged until the transaction ends, and the slice borrows `_txn` for `'t`.
    Some(unsafe { std::slice::from_raw_parts(address as *const u8, len) })
}

impl RecordReader for LmdbReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        assert!(
            index < self.info.num_samples,
            "index {index} out of range for {} samples",
            self.info.num_samples
        );
        let (txn, found) = (&self.txn, &mut self.found);
        let (label, key, payload) = match &self.layout {
            Layout::Imagefeed { samples, checksums } => {
                let value = Self::value(txn, found, samples, index, &sample_key(index))
                    .map_err(|e| Error::lmdb(&self.path, e))?
                    .ok_or_else(|| {
                        corrupt(&self.path, index, &format!("#{index}"), "record is missing")
                    })?;
                let value = self
                    .bounds
                    .check(value)
                    .map_err(|reason| corrupt(&self.path, index, &format!("#{index}"), reason))?;
                let decoded = decode_value(value);
                if let Some(checksums) = checksums {
                    let computed = crc32c::crc32c(value);
                    if computed != checksums[index] {
                        let key = decoded
                            .as_ref()
                            .map_or_else(|_| format!("#{index}"), |d| d.1.to_string());
                        let reason = crate::format::checksum_mismatch(checksums[index], computed);
                        return Err(corrupt(&self.path, index, &key, reason));
                    }
                }
                decoded
                    .map_err(|reason| corrupt(&self.path, index, &format!("#{index}"), reason))?
            }
            Layout::Folder2Lmdb { db, keys } => {
                let key = keys[index].as_str();
                let value = Self::value(txn, found, db, index, key.as_bytes())
                    .map_err(|e| Error::lmdb(&self.path, e))?
                    .ok_or_else(|| {
                        corrupt(&self.path, index, key, "key listed in __keys__ is missing")
                    })?;
                let value = self
                    .bounds
                    .check(value)
                    .map_err(|reason| corrupt(&self.path, index, key, reason))?;
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

    fn prefetch(&mut self, index: usize) {
        if let Some(value) = remembered(&self.txn, &self.found, index) {
            crate::dataset::prefetch(value);
        }
    }
}

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
fn holds_nothing(path: &Path) -> bool {
    let Ok((mut file, len)) = crate::file::open_regular(path) else {
        return false;
    };
    len == 0 || LmdbMeta::read_live(&mut file, path).is_ok_and(|m| m.is_some_and(|m| m.txn_id == 0))
}

/// True when the LMDB file at `path` has a `meta/info` that carries [`MAGIC`].
fn holds_our_magic(path: &Path) -> bool {
    let own = || -> Result<bool> {
        let file = check_lmdb_file(path)?;
        let (env, bounds) = shared_read_env(path, file.metadata().at(path)?.len())?;
        let rtxn = env.read_txn().map_err(|e| Error::lmdb(path, e))?;
        let Some(meta) = env
            .open_database::<Str, Bytes>(&rtxn, Some(META_DB))
            .map_err(|e| Error::lmdb(path, e))?
        else {
            return Ok(false);
        };
        let Some(text) = meta_text(path, &bounds, &meta, &rtxn, INFO_KEY)? else {
            return Ok(false);
        };
        let record: InfoRecord = from_json(path, INFO_KEY, text)?;
        Ok(record.magic == MAGIC)
    };
    own().unwrap_or(false)
}

/// Opens the Python folder2lmdb layout (see [`Lmdb`]); `rtxn` is a read transaction on `env`.
fn open_folder2lmdb(
    path: &Path,
    (env, bounds): (&Arc<ReadEnv>, MapBounds),
    rtxn: RoTxn<'_, WithoutTls>,
    file_len: u64,
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
    let len = match pickle::parse(len_value) {
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
    let keys: Vec<String> = match get(b"__keys__")? {
        None => (0..len).map(|i| i.to_string()).collect(),
        Some(value) => match pickle::parse(value) {
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
        },
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
    for (index, key) in keys.iter().enumerate() {
        // A damaged value is left to the reader too (it reports it as a bad sample).
        if let Ok(Some(value)) = get(key.as_bytes())
            && let Ok((_, label)) = pickle::image_and_label(value)
        {
            inference.see(|| format!("{index} (key {key:?})"), Some(label));
        }
    }
    if len > 0 && inference.is_empty() {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "no value holds a pickled (bytes, label) with a label in 0..{}",
                crate::dataset::MAX_CLASSES
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
    };
    rtxn.commit().map_err(|e| Error::lmdb(path, e))?;
    Ok(Lmdb {
        path: path.to_path_buf(),
        env: Arc::clone(env),
        bounds,
        layout: Layout::Folder2Lmdb {
            db,
            keys: keys.into(),
        },
        info,
        complete: true,
        progress: None,
        notices: notice.into_iter().collect(),
    })
}

#[cfg(test)]
mod tests {
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
