//! The process's LMDB environments: the file's meta pages checked before liblmdb maps it
//! ([`check_lmdb_file`]), one environment per file shared by every open of it in this process
//! ([`shared_read_env`]), and where that map lies ([`MapBounds`], [`EnvMap`]), against which
//! every value liblmdb returns is checked before anything reads it.

use std::collections::HashMap;
use std::fs;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use heed::{Env, EnvFlags, EnvOpenOptions, RoTxn, WithoutTls};

use crate::error::{Error, IoContext as _, Result};
use crate::format::staging;

use super::tree::{self, Located, Roots};
use super::{DATABASES, LMDB_FILE_MAGIC, SAMPLES_DB};

pub(super) type ReadEnv = Env<WithoutTls>;

/// An open environment and the identity (device, inode) of the file it maps.
struct OpenEnv {
    dev: u64,
    ino: u64,
    env: Weak<ReadEnv>,
    /// Where the samples' values lie, found when the environment was opened (if they were).
    located: Option<Weak<Located>>,
    /// The trees the check walked, for searches through the SIGBUS guard.
    roots: Roots,
    /// The live meta page's transaction when the file was checked: a file changed in place
    /// since (same inode, a new transaction) holds pages no check has seen.
    txn_id: u64,
    /// Where the environment's map lies, found once when it was opened: it stays there for
    /// the environment's life, also in a forked child (a DataLoader worker opens the dataset
    /// the parent holds each epoch), and `/proc/self/maps` is slow to read where PyTorch is
    /// loaded (thousands of maps: 2–4 ms an open, measured with 3,000).
    bounds: MapBounds,
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
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct MapBounds(Option<Arc<[(usize, usize)]>>);

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
            let mut fields = line.split_whitespace();
            let (Some(range), Some(_perms), Some(offset), Some(dev_field), Some(ino_field)) = (
                fields.next(),
                fields.next(),
                fields.next(),
                fields.next(),
                fields.next(),
            ) else {
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

    /// Marks the maps read at random (`MADV_RANDOM`), for a file larger than memory
    /// ([`Lmdb::direct`]) once the open has read what it reads through them: a page fault
    /// then reads only its page, not the disk's read-around window (up to 8 MiB), which for a
    /// file the page cache cannot hold evicts what later reads need. What still faults is the
    /// search for a folder2lmdb file's values (its leaf pages, mostly cached).
    pub(super) fn read_at_random(&self) {
        self.advise(libc::MADV_RANDOM);
    }

    /// Pages out what this process has mapped of the file (`MADV_PAGEOUT`), so that a test can
    /// evict it from the page cache (a mapped page is not dropped).
    #[cfg(test)]
    pub(super) fn page_out(&self) {
        self.advise(libc::MADV_PAGEOUT);
    }

    /// `madvise(advice)` on every map of the file.
    fn advise(&self, advice: libc::c_int) {
        for &(start, end) in self.0.iter().flat_map(|ranges| ranges.iter()) {
            // SAFETY: advice on a range liblmdb mapped in this process (read from
            // /proc/self/maps: page-aligned, alive as long as the environment, which the
            // caller holds); the advice used (random, page out) changes no byte and no
            // mapping: a clean page paged out is read again when next touched.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, advice);
            }
        }
    }

    /// Whether the `len` bytes from address `start` lie inside one map of the file (or the
    /// maps are unknown).
    pub(super) fn holds(&self, start: usize, len: u64) -> bool {
        let Some(ranges) = &self.0 else {
            return true;
        };
        usize::try_from(len).is_ok_and(|len| {
            ranges
                .iter()
                .any(|&(s, e)| start >= s && start <= e && len <= e - start)
        })
    }

    /// The map of the file `value` lies in: its first byte's address and the file's length
    /// (`None` where the maps are unknown).
    pub(super) fn map_of(&self, value: &[u8]) -> Option<(usize, u64)> {
        let at = value.as_ptr() as usize;
        let &(start, end) = self
            .0
            .as_ref()?
            .iter()
            .find(|&&(s, e)| at >= s && at <= e)?;
        Some((start, (end - start) as u64))
    }

    /// `value` when it lies inside a map of the file (or the maps are unknown), else why not.
    pub(super) fn check<'v>(&self, value: &'v [u8]) -> std::result::Result<&'v [u8], String> {
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

/// Where an environment's map starts and the file's length when it was opened (`None` where
/// the process's maps are unknown): a new reader's transaction reads the meta pages through the
/// map (in liblmdb), which are touched through the SIGBUS guard first ([`crate::mapguard`]): a
/// file cut short since the open is then [`Error::FileChanged`], not a dead process.
#[derive(Debug, Clone, Copy)]
pub(super) struct EnvMap(Option<(usize, u64)>);

impl EnvMap {
    /// The whole map (the file as long as it was when opened), where known. `_txn`, a
    /// transaction of the environment, is only taken for its lifetime: the slice cannot
    /// outlive what keeps the map.
    pub(super) fn bytes<'t>(&self, _txn: &'t RoTxn<'_, WithoutTls>) -> Option<&'t [u8]> {
        let (start, len) = self.0?;
        // SAFETY: `start` and `len` are those of the environment's read-only map, all of it
        // mapped (`of`: the map a value the environment returned lies in, up to the file's
        // length); `_txn` keeps the environment, and so the map, alive while the slice is.
        Some(unsafe { std::slice::from_raw_parts(start as *const u8, len as usize) })
    }

    /// Whether the map is known (the process's maps could be read).
    pub(super) fn is_known(&self) -> bool {
        self.0.is_some()
    }

    /// The map that `value`, a value the environment returned, lies in.
    pub(super) fn of(bounds: &MapBounds, value: &[u8]) -> EnvMap {
        EnvMap(bounds.map_of(value))
    }

    /// Touches the pages a transaction begins by reading (the two meta pages, whatever the
    /// file's page size) through the guard.
    pub(super) fn check_meta_pages(&self, path: &Path) -> Result<()> {
        /// Two meta pages of LMDB's largest page size.
        const META_BYTES: usize = 2 * 65536;
        let Some((start, file_len)) = self.0 else {
            return Ok(());
        };
        let len = usize::try_from(file_len).unwrap_or(usize::MAX);
        // SAFETY: `start` is where a map of the file that holds a value liblmdb returned
        // begins, and `len` at most its length (`MapBounds`): the environment's map, which
        // lives while the environment does, and the caller's `Lmdb` holds that. The bytes are
        // only read through the guard.
        let map = unsafe { std::slice::from_raw_parts(start as *const u8, len) };
        crate::mapguard::check_readable(path, map, &map[..len.min(META_BYTES)])
    }
}

/// Refuses what is clearly not an LMDB data file, or one cut short, with a clear message;
/// returns the opened file.
///
/// The length check matters: liblmdb maps the whole database and trusts its meta page, so a
/// truncated copy would fault with SIGBUS on the first read of a missing page instead of failing.
/// We read both meta pages (LMDB keeps two and uses the one with the larger transaction id) and
/// require the file to hold every page up to that meta's last page.
pub(super) fn check_lmdb_file(path: &Path) -> Result<fs::File> {
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
            staging::refuse_interrupted(path)?;
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
    pub(super) txn_id: u64,
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

    /// The bytes the file must hold: every page up to the last one this meta page uses.
    pub(crate) fn needed_len(&self) -> u64 {
        self.last_page
            .saturating_add(1)
            .saturating_mul(self.page_size)
    }

    /// The live meta page of the LMDB file `file` (of the two, the one with the later
    /// transaction), or `None` when the first page is not an LMDB meta page. Reads from the start.
    pub(crate) fn read_live(file: &mut fs::File, path: &Path) -> Result<Option<LmdbMeta>> {
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

/// The process's environment for `path` (one per file, shared), where its map lies, and where
/// the values of its samples database lie (when the open's check found them: [`Located`]).
pub(super) fn shared_read_env(path: &Path, file_len: u64) -> Result<SharedEnv> {
    let (env, bounds, located, roots, (dev, ino)) = read_env(path, file_len)?;
    Ok(SharedEnv {
        env,
        bounds,
        located,
        roots,
        identity: (dev, ino),
    })
}

/// What [`shared_read_env`] returns.
pub(super) struct SharedEnv {
    pub(super) env: Arc<ReadEnv>,
    pub(super) bounds: MapBounds,
    pub(super) located: Option<Arc<Located>>,
    /// The trees of the databases a reader opens, checked at open ([`TreeRoot::find`]).
    pub(super) roots: Roots,
    /// The file checked and mapped (device, inode): one the caller opened earlier must be
    /// this one before it reads from it at the places the map gives.
    pub(super) identity: (u64, u64),
}

/// What [`read_env`] returns: the environment, where its map lies, the located values, the
/// checked trees, and the file's (device, inode).
type ReadEnvParts = (
    Arc<ReadEnv>,
    MapBounds,
    Option<Arc<Located>>,
    Roots,
    (u64, u64),
);

fn read_env(path: &Path, file_len: u64) -> Result<ReadEnvParts> {
    let canonical = fs::canonicalize(path).at(path)?;
    let meta = fs::metadata(&canonical).at(path)?;
    let (dev, ino) = (meta.dev(), meta.ino());
    let (mut file, _) = crate::file::open_regular(&canonical)?;
    let txn_id = LmdbMeta::read_live(&mut file, path)?.map_or(0, |live| live.txn_id);
    let mut guard = OPEN_ENVS.lock().unwrap_or_else(|e| e.into_inner());
    let envs = guard.get_or_insert_with(HashMap::new);
    // A second open in this process (a forked DataLoader worker's, each epoch) shares the
    // first one's environment, unless the file on disk is another one now.
    let shared = match envs.get(&canonical) {
        Some(open) if (open.dev, open.ino) == (dev, ino) => match open.env.upgrade() {
            Some(_) if open.txn_id != txn_id => {
                return Err(Error::FileChanged {
                    path: path.to_path_buf(),
                    change: format!(
                        "written to in place (transaction {} became {txn_id}) while this \
                         process holds it open; drop that handle first",
                        open.txn_id
                    ),
                });
            }
            env => env,
        },
        _ => None,
    };
    // Every branch and leaf page is checked before liblmdb reads any (see `tree`), at every
    // open: a shared environment's pages may since have left the cache (a page the disk then
    // fails to supply, read from the map, is SIGBUS) or been damaged in place (with the same
    // transaction). What the walk finds replaces what an earlier one found.
    let (located, roots) = tree::check(path, &file, file_len, &DATABASES, Some(SAMPLES_DB))?;
    let located = located.map(Arc::new);
    if let Some(env) = shared {
        let open = envs.get_mut(&canonical).expect("found above");
        open.located = located.as_ref().map(Arc::downgrade);
        open.roots = roots.clone();
        return Ok((env, open.bounds.clone(), located, roots, (dev, ino)));
    }
    drop(file);
    let mut options = EnvOpenOptions::new().read_txn_without_tls();
    // Map the file's length, not the map size the writer recorded (1 TiB by default: LMDB keeps
    // the largest size ever configured in the meta page). A configured size takes precedence
    // and LMDB raises it to the committed data size if needed, so nothing is cut off; a process
    // under an address-space limit (ulimit -v, valgrind) can then open the file.
    let page = crate::pool::page_size();
    options
        .max_dbs(DATABASES.len() as u32)
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
    let bounds = MapBounds::of(dev, ino, file_len);
    envs.insert(
        canonical,
        OpenEnv {
            dev,
            ino,
            env: Arc::downgrade(&env),
            located: located.as_ref().map(Arc::downgrade),
            roots: roots.clone(),
            txn_id,
            bounds: bounds.clone(),
        },
    );
    Ok((env, bounds, located, roots, (dev, ino)))
}
