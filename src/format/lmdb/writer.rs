//! [`LmdbWriter`]: packs records into an LMDB file, crash-safe (`OUT.partial` until complete),
//! resumable, its map grown as needed.

use std::fs;
use std::path::{Path, PathBuf};

use heed::types::{Bytes, Str};
use heed::{Database, Env, EnvFlags, EnvOpenOptions, PutFlags};

use crate::dataset::{DatasetInfo, FormatKind};
use crate::error::{Error, IoContext as _, Result};
use crate::format::InfoRecord;
use crate::format::shared_headers::{
    HeaderDictionary, decode_header, encode_header, stored_value_checksum,
};
use crate::format::staging;
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, PackedRecord, WriterOptions};

use super::foreign::holds_nothing;
use super::{
    CHECKSUMS_DB, CHECKSUMS_SINCE, HEADERS_DB, HEADERS_KEY, INFO_KEY, MAGIC, META_DB, PLAN_KEY,
    PROGRESS_KEY, SAMPLES_DB, encode_value, from_json, header_key, next_header_id, parse_plan,
    parse_progress, sample_key, to_json, version_written,
};

/// Writes a dataset into `OUT.partial`, chunk by chunk, and renames it to `OUT` when finished.
pub struct LmdbWriter {
    env: Env,
    /// The map's size: doubled when the data outgrows it ([`LmdbWriter::grow_map`]).
    map_size: usize,
    /// Held while writing: see [`staging::lock_staging`].
    _lock: fs::File,
    meta: Database<Str, Str>,
    samples: Database<Bytes, Bytes>,
    checksums: Database<Bytes, Bytes>,
    partial: PathBuf,
    out: PathBuf,
    value: Vec<u8>,
    /// The current chunk's checksums, as stored (`u32` LE each).
    chunk_checksums: Vec<u8>,
    /// With `--shared-headers`: the `headers` database and what goes into it.
    shared: Option<SharedChunk>,
}

/// A pack with shared headers: the `headers` database, the dictionary so far, and the current
/// chunk's payloads as stored, prepared once before its transaction (which may be tried again
/// after the map grows: the dictionary must not see the chunk twice).
struct SharedChunk {
    db: Database<Bytes, Bytes>,
    dictionary: HeaderDictionary,
    /// The chunk's stored payloads end to end, and where each ends.
    payloads: Vec<u8>,
    ends: Vec<usize>,
    /// The length of the header each record refers to (`None`: stored whole): the record's
    /// checksum covers it ([`stored_value_checksum`]).
    header_lens: Vec<Option<usize>>,
    /// The headers the chunk adds to the dictionary: `(id, stored form)`.
    added: Vec<(u32, Vec<u8>)>,
}

impl SharedChunk {
    fn prepare(&mut self, records: &[PackedRecord<'_>]) {
        self.payloads.clear();
        self.ends.clear();
        self.header_lens.clear();
        self.added.clear();
        for record in records {
            let encoded = self.dictionary.encode(record.payload, &mut self.payloads);
            let header = &record.payload[..encoded.header_len];
            if encoded.added {
                let mut stored = Vec::with_capacity(header.len() + 4);
                encode_header(encoded.reference, header, &mut stored);
                self.added.push((encoded.reference, stored));
            }
            self.ends.push(self.payloads.len());
            self.header_lens
                .push((encoded.reference != 0).then_some(encoded.header_len));
        }
    }

    /// Record `offset` of the prepared chunk as stored, and the header it refers to.
    fn payload<'a>(
        &'a self,
        offset: usize,
        record: &PackedRecord<'a>,
    ) -> (&'a [u8], Option<&'a [u8]>) {
        let start = offset.checked_sub(1).map_or(0, |before| self.ends[before]);
        let header = self.header_lens[offset].map(|len| &record.payload[..len]);
        (&self.payloads[start..self.ends[offset]], header)
    }
}

/// The smallest map the writer starts with when the asked-for one cannot be mapped.
const SMALLEST_WRITE_MAP: usize = 64 << 20;

/// Opens the writer's environment with a map of `map_size` bytes of address space (LMDB
/// reserves it all up front: 1 TiB by default), or, where the process may not map that much
/// (`ulimit -v`), the largest half, quarter, ... that it may, down to what the file already
/// holds; the map then grows with the data ([`LmdbWriter::grow_map`]). Returns the map size.
pub(super) fn open_write_env(path: &Path, map_size: usize) -> Result<(Env, usize)> {
    let page = crate::pool::page_size();
    let held = fs::metadata(path).map_or(0, |m| m.len() as usize);
    let floor = held.max(SMALLEST_WRITE_MAP).div_ceil(page) * page;
    let mut size = map_size.max(page).div_ceil(page) * page;
    loop {
        let mut options = EnvOpenOptions::new();
        options
            .map_size(size)
            .max_dbs(super::DATABASES.len() as u32);
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
                     LMDB said: {e})"
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
        if let Some(shared) = &self.shared
            && !shared.added.is_empty()
        {
            for (id, stored) in &shared.added {
                shared
                    .db
                    .put_with_flags(&mut wtxn, PutFlags::APPEND, &header_key(*id), stored)?;
            }
            let count = shared.dictionary.len().to_string();
            self.meta.put(&mut wtxn, HEADERS_KEY, &count)?;
        }
        for (offset, record) in records.iter().enumerate() {
            let (payload, header) = match &self.shared {
                Some(shared) => shared.payload(offset, record),
                None => (record.payload, None),
            };
            encode_value(&mut self.value, record.label, record.key, payload);
            self.chunk_checksums
                .extend_from_slice(&stored_value_checksum(&self.value, header).to_le_bytes());
            // Keys only rise (sample indices, each chunk after the last committed one): with
            // APPEND a full leaf is left full and the next key starts a new one, where a plain
            // put splits it in half. Leaves ~95% full instead of ~65%: a smaller file to read.
            self.samples.put_with_flags(
                &mut wtxn,
                PutFlags::APPEND,
                &sample_key(first + offset),
                &self.value,
            )?;
        }
        if !records.is_empty() {
            self.checksums.put_with_flags(
                &mut wtxn,
                PutFlags::APPEND,
                &sample_key(first),
                &self.chunk_checksums,
            )?;
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
        let partial = staging::prepare_output(out, mode)?;
        let existed = partial.exists();
        refuse_odd_lock_file(&partial)?;
        // A writer of ours leaves its lock file until the file is published (`finish`): a
        // complete file with one was killed between its last commit and its rename.
        let left_by_a_writer = lock_file(&partial).is_file();
        let (env, map_size) = open_write_env(&partial, map_size)?;
        let lock = staging::lock_staging(&partial)?;
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
        let headers: Option<Database<Bytes, Bytes>> = if plan.shared_headers {
            let db = env
                .create_database(&mut wtxn, Some(HEADERS_DB))
                .map_err(|e| Error::lmdb(&partial, e))?;
            Some(db)
        } else {
            None
        };
        let progress = if fresh {
            let info = InfoRecord::new(
                MAGIC,
                version_written(plan.shared_headers),
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
            // A partial file marked complete, with the lock file a writer of ours leaves, is
            // a pack killed between its last commit and its rename: when its plan is this one
            // (below), resuming only publishes it (`finish`). The kill loop
            // (pack-dataset/tests/kill_loop.rs) found that window refused. Without the lock
            // file it is a copy of a finished dataset put there, which is not ours to publish.
            if info.complete && !left_by_a_writer {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: "it holds a complete dataset that no interrupted pack left (a copy \
                             of a finished one?), so there is nothing to resume: use --force to \
                             pack again, or rename it yourself if it is the dataset you want"
                        .into(),
                });
            }
            let old_plan = parse_plan(&partial, &get(PLAN_KEY)?)?;
            old_plan.check_resumable(plan, &partial)?;
            let progress = parse_progress(&partial, &get(PROGRESS_KEY)?)?;
            let written = samples.len(&wtxn).map_err(|e| Error::lmdb(&partial, e))?;
            staging::check_staged_samples(&partial, written, &progress)?;
            progress
        };
        let shared = match headers {
            Some(db) => Some(SharedChunk {
                dictionary: HeaderDictionary::resumed(stored_headers(
                    &partial,
                    (&db, &meta),
                    &wtxn,
                )?),
                db,
                payloads: Vec::new(),
                ends: Vec::new(),
                header_lens: Vec::new(),
                added: Vec::new(),
            }),
            None => None,
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
            shared,
        };
        Ok((writer, progress))
    }

    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()> {
        if let Some(shared) = &mut self.shared {
            shared.prepare(records);
        }
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
        let version = version_written(self.shared.is_some());
        let record = InfoRecord::new(MAGIC, version, true, info.clone());
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
        // The lock file goes after the rename: until then it marks the complete partial file
        // as one a writer of ours left (see `start`).
        staging::publish(&partial, &out)?;
        remove_lock_file(&partial);
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        let LmdbWriter { env, partial, .. } = *self;
        env.prepare_for_closing().wait();
        remove_lock_file(&partial);
        let _ = fs::remove_file(&partial);
    }
}

/// The headers a resumed pack stored before, in id order, each checked, and as many as its
/// commits recorded (`meta`'s [`HEADERS_KEY`]): the pack goes on referring to them, so one that
/// is not what was written, or missing, stops it.
fn stored_headers(
    partial: &Path,
    (db, meta): (&Database<Bytes, Bytes>, &Database<Str, Str>),
    wtxn: &heed::RwTxn<'_>,
) -> Result<Vec<Vec<u8>>> {
    let mismatch = |reason: String| Error::ResumeMismatch {
        path: partial.to_path_buf(),
        reason: format!("{reason}; pack again with --force"),
    };
    let recorded = match meta
        .get(wtxn, HEADERS_KEY)
        .map_err(|e| Error::lmdb(partial, e))?
    {
        None => 0,
        Some(text) => text.parse::<usize>().map_err(|_| {
            mismatch(format!(
                "meta/{HEADERS_KEY} is {text:?}, not a number of headers"
            ))
        })?,
    };
    let mut headers = Vec::new();
    for entry in db.iter(wtxn).map_err(|e| Error::lmdb(partial, e))? {
        let (key, value) = entry.map_err(|e| Error::lmdb(partial, e))?;
        let header = next_header_id(headers.len(), key).and_then(|id| decode_header(id, value));
        match header {
            Ok(header) => headers.push(header.to_vec()),
            Err(why) => {
                return Err(mismatch(format!(
                    "its shared header {} is damaged ({why})",
                    headers.len() + 1
                )));
            }
        }
    }
    if headers.len() != recorded {
        return Err(mismatch(format!(
            "it holds {} shared headers where its commits recorded {recorded}",
            headers.len()
        )));
    }
    // The writer stores each header once: one stored twice (damage, or an edit) would leave
    // the resumed dictionary short of a number, and the next new header collided with a stored
    // one ("MDB_KEYEXIST", a hostile try).
    if let Some((first, second)) = crate::dataset::first_repeat(headers.iter()) {
        return Err(mismatch(format!(
            "it holds one shared header twice, as headers {} and {}",
            first + 1,
            second + 1
        )));
    }
    Ok(headers)
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
