//! The local cache directory: files imagefeed derives from a dataset to read it fast (a
//! compressed TFRecord shard decompressed for random access), kept for the next open.
//!
//! Where: `IMAGEFEED_CACHE_DIR`, else `$XDG_CACHE_HOME/imagefeed`, else `~/.cache/imagefeed`.
//! How much: `IMAGEFEED_CACHE_LIMIT` bytes (`50GiB`, `500G`, `1000000`), else no limit but the
//! disk: an entry is never written when it would leave less than [`RESERVE_FRACTION`] of the
//! file system, or [`RESERVE_MAX`] if that is less, free ([`Error::CacheFull`] says so, naming the directory).
//!
//! Guarantees:
//! - **Never half an entry.** An entry is filled as `NAME.partial`, synced, then renamed to
//!   `NAME`; a reader only ever opens a complete one. A kill mid-fill leaves a `.partial`
//!   that the next fill of that name replaces.
//! - **One fill per machine.** Filling holds an exclusive lock on `NAME.lock` (`flock`): other
//!   processes and threads wanting the same entry wait for it, then use it.
//! - **Eviction never pulls an entry from under a reader.** Every open entry holds a shared
//!   lock on its file for as long as it is used ([`CachedFile`]); eviction takes entries least
//!   recently used first, only its own entries (regular files directly in a section directory
//!   that are not `.partial` or `.lock`), and only those no reader holds. A limit that in-use
//!   entries alone exceed is an error, never a deleted file in use.
//!
//! Entry names carry what they were made from (see [`source_key`]), so a changed source makes
//! a new entry and the stale one ages out.

use std::fs;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crate::error::{Error, IoContext as _, Result};

/// The share of the cache's file system an entry may never fill: filling stops short of
/// leaving less than this free.
pub const RESERVE_FRACTION: f64 = 0.05;

/// The most the reserve takes (5% of a shared 20 TB volume would be a terabyte held back).
pub const RESERVE_MAX: u64 = 1 << 30;

/// A cache directory, with its byte limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cache {
    root: PathBuf,
    limit: Option<u64>,
}

/// A complete cache entry, open for reading and held against eviction for as long as this
/// value (or a map of its file) lives.
#[derive(Debug)]
pub struct CachedFile {
    /// Where the entry is.
    pub path: PathBuf,
    /// The entry, open for reading, holding a shared lock.
    pub file: fs::File,
}

/// How much more room a fill reserves at a time once past what it reserved (fewer, when only
/// fewer fit).
const GROW_STEP: u64 = 64 << 20;

/// An entry being filled ([`Cache::get_or_fill`]): a writer that keeps the entry within the
/// cache's limit and the file system's reserve, reserving more room (evicting entries no reader
/// holds) as the bytes pass what was reserved. Past the room there is, a write fails and the
/// fill ends with [`Error::CacheFull`]: a size hint that lied (a gzip trailer's size of the last
/// member only, a server sending more than it listed) never fills the disk.
pub struct Filling<'a> {
    cache: &'a Cache,
    dir: PathBuf,
    path: PathBuf,
    file: fs::File,
    /// The partial file's length: room reserved, seen by other fills.
    reserved: u64,
    position: u64,
    /// Why room was refused, reported instead of the write error it caused.
    refused: Option<Error>,
}

impl Filling<'_> {
    /// Where the entry is being filled (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes written so far (the position reached).
    pub fn written(&self) -> u64 {
        self.position
    }

    /// The bytes written so far as a file of their own that outlives the fill (which must
    /// then fail, so no entry is made: the file is unnamed once the fill's partial file is
    /// removed, and its space is freed when it is closed). For data that must not be cached,
    /// such as a damaged stream's readable part.
    pub fn detach(&mut self) -> Result<fs::File> {
        self.file.set_len(self.position).at(&self.path)?;
        self.reserved = self.position;
        self.file.try_clone().at(&self.path)
    }

    /// Reserves room for the entry to reach `end` bytes, or says why not.
    fn reserve(&mut self, end: u64) -> std::io::Result<()> {
        let result = (|| {
            let _whole = self.cache.lock_whole()?;
            let need = end - self.reserved;
            let more = match self.cache.make_room(&self.dir, need.max(GROW_STEP)) {
                Ok(()) => need.max(GROW_STEP),
                Err(_) => {
                    self.cache.make_room(&self.dir, need)?;
                    need
                }
            };
            self.file.set_len(self.reserved + more).at(&self.path)?;
            self.reserved += more;
            Ok(())
        })();
        result.map_err(|e: Error| {
            let message = e.to_string();
            self.refused = Some(e);
            std::io::Error::other(message)
        })
    }
}

impl std::io::Write for Filling<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let end = self.position.saturating_add(buf.len() as u64);
        if end > self.reserved {
            self.reserve(end)?;
        }
        match self.file.write(buf) {
            Ok(n) => {
                self.position += n as u64;
                Ok(n)
            }
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => {
                // The file system filled up beside the reservation (another program's writes).
                self.refused = Some(Error::CacheFull {
                    dir: self.cache.root.clone(),
                    needed: buf.len() as u64,
                    limit: self.cache.limit,
                    free: Some(0),
                    in_use: 0,
                });
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl std::io::Seek for Filling<'_> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        self.position = self.file.seek(to)?;
        Ok(self.position)
    }
}

impl Cache {
    /// The cache the environment names (see the module docs).
    pub fn from_env() -> Result<Cache> {
        let root = match std::env::var_os("IMAGEFEED_CACHE_DIR") {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => match (std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
                (Some(xdg), _) if !xdg.is_empty() => PathBuf::from(xdg).join("imagefeed"),
                (_, Some(home)) if !home.is_empty() => {
                    PathBuf::from(home).join(".cache").join("imagefeed")
                }
                _ => {
                    return Err(Error::Config(
                        "no cache directory: set IMAGEFEED_CACHE_DIR (or HOME)".into(),
                    ));
                }
            },
        };
        let limit = match std::env::var("IMAGEFEED_CACHE_LIMIT") {
            Ok(text) if !text.trim().is_empty() => Some(
                crate::units::parse_bytes(&text)
                    .map_err(|e| Error::Config(format!("IMAGEFEED_CACHE_LIMIT={text:?}: {e}")))?,
            ),
            _ => None,
        };
        Ok(Cache { root, limit })
    }

    /// Makes the cache directory if it is not there, and checks this process may write in it:
    /// a directory that cannot hold the cache (`/dev/null/x`, a regular file, a read-only
    /// mount) is an error naming it when a dataset that needs the cache is opened, where a
    /// hostile try met it only mid-epoch, as every sample bad ("256 bad samples ... Not a
    /// directory").
    pub fn check_writable(&self) -> Result<()> {
        let root = &self.root;
        fs::create_dir_all(root).at(root)?;
        let text = std::ffi::CString::new(root.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::io(root, std::io::Error::other("a NUL byte in the path")))?;
        // SAFETY: a NUL-terminated path; access(2) only reads it.
        if unsafe { libc::access(text.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
            let why = std::io::Error::last_os_error();
            return Err(Error::io(
                root,
                std::io::Error::new(
                    why.kind(),
                    format!("{why}: the cache directory (IMAGEFEED_CACHE_DIR) cannot be written"),
                ),
            ));
        }
        Ok(())
    }

    /// A cache at `root`, with an optional byte limit.
    pub fn at(root: impl Into<PathBuf>, limit: Option<u64>) -> Cache {
        Cache {
            root: root.into(),
            limit,
        }
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The byte limit, if any.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Entry `name` of `section` (a sub-directory per kind of entry), filled by `fill` when it
    /// is not there yet. `size_hint` is what the entry is expected to take: that much room is
    /// made and reserved before filling (`None`: nothing up front). `fill` writes the whole
    /// entry from its start through the [`Filling`] it is given, which reserves more room as
    /// the bytes go past the reservation, and fails with [`Error::CacheFull`] at the limit or
    /// the file system's reserve, whatever the hint said. An error from `fill` leaves no entry.
    pub fn get_or_fill(
        &self,
        section: &str,
        name: &str,
        size_hint: Option<u64>,
        fill: impl FnOnce(&mut Filling<'_>) -> Result<()>,
    ) -> Result<CachedFile> {
        let dir = self.root.join(section);
        let path = dir.join(name);
        if let Some(hit) = open_entry(&path)? {
            return Ok(hit);
        }
        fs::create_dir_all(&dir).at(&dir)?;
        let lock_path = dir.join(format!("{name}.lock"));
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .at(&lock_path)?;
        lock_saying_so(&lock, &lock_path, "fill this cache entry")?;
        // Filled by another process while this one waited.
        if let Some(hit) = open_entry(&path)? {
            return Ok(hit);
        }
        let partial = dir.join(format!("{name}.partial"));
        let reserved = size_hint.unwrap_or(0);
        let file = {
            // Room is made and reserved (the partial file sized to the hint) under the
            // cache-wide lock, so fills of different entries, in threads or processes, never
            // together overrun the limit.
            let _whole = self.lock_whole()?;
            self.make_room(&dir, reserved)?;
            let file = fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(&partial)
                .at(&partial)?;
            file.set_len(reserved).at(&partial)?;
            file
        };
        let mut filling = Filling {
            cache: self,
            dir,
            path: partial.clone(),
            file,
            reserved,
            position: 0,
            refused: None,
        };
        let filled = fill(&mut filling).and_then(|()| {
            // What was written ends at the position reached (the reservation past it is cut).
            filling.file.set_len(filling.position).at(&partial)?;
            filling.file.sync_data().at(&partial)
        });
        if let Err(e) = filled {
            let _ = fs::remove_file(&partial);
            // Room refused mid-fill surfaces as itself, not as the write error it caused.
            return Err(filling.refused.take().unwrap_or(e));
        }
        drop(filling);
        fs::rename(&partial, &path).at(&path)?;
        drop(lock);
        open_entry(&path)?.ok_or_else(|| {
            Error::io(
                &path,
                std::io::Error::other("the cache entry vanished right after it was filled"),
            )
        })
    }

    /// An exclusive lock on the whole cache (`.lock` in its root), held while room is made and
    /// reserved.
    fn lock_whole(&self) -> Result<fs::File> {
        fs::create_dir_all(&self.root).at(&self.root)?;
        let path = self.root.join(".lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .at(&path)?;
        lock_saying_so(&file, &path, "make room in the cache")?;
        Ok(file)
    }

    /// Evicts least recently used entries of this cache that no reader holds until `needed`
    /// more bytes fit under the limit and in the file system's free space (less the reserve).
    /// Entries being filled count with what they reserved, and are never evicted.
    fn make_room(&self, dir: &Path, needed: u64) -> Result<()> {
        let free = crate::file::free_space(dir);
        let total = total_space(dir);
        let reserve = total.map_or(0, |t| {
            ((t as f64 * RESERVE_FRACTION) as u64).min(RESERVE_MAX)
        });
        let fits = |used: u64, free: Option<u64>| {
            self.limit
                .is_none_or(|limit| used.saturating_add(needed) <= limit)
                && free.is_none_or(|free| needed.saturating_add(reserve) <= free)
        };
        let (mut entries, reserved) = self.entries()?;
        let mut used: u64 = entries.iter().map(|e| e.len).sum::<u64>() + reserved;
        let mut free = free;
        if fits(used, free) {
            return Ok(());
        }
        entries.sort_by_key(|e| e.used);
        let mut held = 0u64;
        for entry in entries {
            if fits(used, free) {
                return Ok(());
            }
            match evict(&entry.path) {
                Ok(true) => {
                    used -= entry.len;
                    free = free.map(|f| f.saturating_add(entry.len));
                }
                Ok(false) => held += entry.len,
                Err(_) => held += entry.len,
            }
        }
        if fits(used, free) {
            return Ok(());
        }
        Err(Error::CacheFull {
            dir: self.root.clone(),
            needed,
            limit: self.limit,
            free: free.map(|f| f.saturating_sub(reserve)),
            in_use: held,
        })
    }

    /// Every complete entry of every section, with its size and last use; and the bytes that
    /// entries being filled reserve. A `.partial` left by a fill that died (its entry's lock is
    /// free) is deleted.
    fn entries(&self) -> Result<(Vec<Entry>, u64)> {
        let mut found = Vec::new();
        let mut reserved = 0u64;
        let sections = match fs::read_dir(&self.root) {
            Ok(sections) => sections,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((found, 0)),
            Err(e) => return Err(Error::io(&self.root, e)),
        };
        for section in sections.flatten() {
            let Ok(files) = fs::read_dir(section.path()) else {
                continue;
            };
            for file in files.flatten() {
                let name = file.file_name();
                let Some(name) = name.to_str() else { continue };
                if let Some(entry) = name.strip_suffix(".partial") {
                    let lock = section.path().join(format!("{entry}.lock"));
                    if fill_is_running(&lock) {
                        reserved += fs::metadata(file.path()).map_or(0, |m| m.len());
                    } else {
                        let _ = fs::remove_file(file.path());
                    }
                    continue;
                }
                if name.ends_with(".lock") {
                    continue;
                }
                // Only regular files are ours: a link or a directory is left alone.
                let Ok(meta) = fs::symlink_metadata(file.path()) else {
                    continue;
                };
                if !meta.is_file() {
                    continue;
                }
                found.push(Entry {
                    path: file.path(),
                    len: meta.len(),
                    used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                });
            }
        }
        Ok((found, reserved))
    }
}

/// True when the fill guarded by the lock file `lock` is running (another holder has it).
fn fill_is_running(lock: &Path) -> bool {
    let Ok(file) = fs::OpenOptions::new().write(true).open(lock) else {
        return false;
    };
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return true;
    }
    false
}

/// A complete entry found on disk.
struct Entry {
    path: PathBuf,
    len: u64,
    used: SystemTime,
}

/// Opens the complete entry at `path` holding a shared lock, and marks it used now; `None`
/// when there is none (or it was evicted while being opened).
fn open_entry(path: &Path) -> Result<Option<CachedFile>> {
    use std::os::unix::fs::MetadataExt as _;
    let file = match fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    flock(&file, libc::LOCK_SH).at(path)?;
    // Evicted between the open and the lock: the file is unlinked; fill it again.
    if file.metadata().at(path)?.nlink() == 0 {
        return Ok(None);
    }
    // The entry's modification time is its last use (least recently used goes first). A
    // read-only cache cannot record it; that only changes which entry is evicted.
    if let Ok(writable) = fs::OpenOptions::new().write(true).open(path) {
        let _ = writable.set_modified(SystemTime::now());
    }
    Ok(Some(CachedFile {
        path: path.to_path_buf(),
        file,
    }))
}

/// Deletes the entry at `path` unless a reader holds it; `Ok(true)` when it was deleted.
fn evict(path: &Path) -> std::io::Result<bool> {
    let file = fs::File::open(path)?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Ok(false);
    }
    fs::remove_file(path)?;
    Ok(true)
}

/// How long a process waits for another's exclusive lock on the cache before saying so.
const LOCK_PATIENCE: Duration = Duration::from_secs(5);

/// An exclusive lock on `file` (the lock file at `path`), taken to do `what`; a wait longer than
/// [`LOCK_PATIENCE`] is reported (`log::warn!`) before it goes on. The holder may be filling
/// the entry, or stopped while filling it (a job suspended with Ctrl-Z): a hostile try found
/// the open waiting there without a word.
fn lock_saying_so(file: &fs::File, path: &Path, what: &str) -> Result<()> {
    lock_exclusive(file, LOCK_PATIENCE, || {
        log::warn!(
            "{}: waiting for another process's lock to {what} (it may be filling it, or be \
             stopped while it does: `fuser -v {}` names it); going on once it is released",
            path.display(),
            path.display()
        );
    })
    .at(path)
}

/// `flock(file, LOCK_EX)`, trying without blocking until `patience` has passed, then calling
/// `waiting` once and blocking.
fn lock_exclusive(
    file: &fs::File,
    patience: Duration,
    waiting: impl FnOnce(),
) -> std::io::Result<()> {
    let started = Instant::now();
    loop {
        match flock(file, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        if started.elapsed() >= patience {
            waiting();
            return flock(file, libc::LOCK_EX);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `flock(file, operation)`, retried when a signal interrupts the wait.
fn flock(file: &fs::File, operation: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor `file` owns; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The size of the file system that holds `path`, or `None` when it cannot be found out.
fn total_space(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt as _;
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `name` is NUL-terminated and `stat` is valid for writes of one statvfs.
    if unsafe { libc::statvfs(name.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    // Both are narrower than u64 on 32-bit targets.
    #[allow(clippy::useless_conversion)]
    let total = u64::from(stat.f_blocks).saturating_mul(u64::from(stat.f_frsize));
    Some(total)
}

/// A name for the entry made from the file at `path` as it is now: a digest of its absolute
/// path, device, inode, size and modification time, then its file name (for people), so the
/// entry of a file that changed or moved is never mistaken for the new one's.
pub fn source_key(path: &Path, meta: &fs::Metadata) -> String {
    use sha2::{Digest as _, Sha256};
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::fs::MetadataExt as _;
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut hash = Sha256::new();
    hash.update(absolute.as_os_str().as_bytes());
    for n in [
        meta.dev(),
        meta.ino(),
        meta.len(),
        meta.mtime() as u64,
        meta.mtime_nsec() as u64,
    ] {
        hash.update(n.to_le_bytes());
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    keyed_name(hash, &name)
}

/// An entry name: the first 12 bytes of `hash` in hex, then `name` (for people) with
/// characters other than ASCII letters, digits, `-`, `_` and `.` made `_`, at most 100 of them.
pub(crate) fn keyed_name(hash: sha2::Sha256, name: &str) -> String {
    use sha2::Digest as _;
    let digest: String = hash.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(100)
        .collect();
    format!("{digest}-{name}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn a_directory_that_cannot_hold_the_cache_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = Cache::at(dir.path().join("a/b"), None);
        fresh.check_writable().unwrap();
        assert!(dir.path().join("a/b").is_dir());
        let file = dir.path().join("file");
        fs::write(&file, b"x").unwrap();
        for root in [file.clone(), file.join("below"), "/dev/null/x".into()] {
            match Cache::at(&root, None).check_writable() {
                Err(Error::Io { path, .. }) => assert!(root.starts_with(&path), "{path:?}"),
                other => panic!("{root:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_long_wait_for_another_holders_lock_is_reported_once_then_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.lock");
        let open = || {
            fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .unwrap()
        };
        // Free: taken at once, nothing reported.
        let holder = open();
        let mut said = 0;
        lock_exclusive(&holder, Duration::from_millis(50), || said += 1).unwrap();
        assert_eq!(said, 0);
        // Held (a second open file description of the lock file is another holder): the
        // wait is reported once, and the lock is had once the holder lets go.
        let waiter = std::thread::spawn({
            let waiter = open();
            move || {
                let said = std::sync::atomic::AtomicUsize::new(0);
                let started = Instant::now();
                lock_exclusive(&waiter, Duration::from_millis(50), || {
                    said.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                })
                .unwrap();
                (said.into_inner(), started.elapsed())
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        drop(holder);
        let (said, waited) = waiter.join().unwrap();
        assert_eq!(said, 1);
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
    }

    fn fill_with(bytes: usize) -> impl FnOnce(&mut Filling<'_>) -> Result<()> {
        move |file| {
            let path = file.path().to_path_buf();
            file.write_all(&vec![7u8; bytes]).at(&path)
        }
    }

    #[test]
    fn an_entry_is_filled_once_and_found_again() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path(), None);
        let first = cache
            .get_or_fill("s", "a", Some(10), fill_with(10))
            .unwrap();
        assert_eq!(fs::read(&first.path).unwrap(), vec![7u8; 10]);
        let again = cache
            .get_or_fill("s", "a", Some(10), |_| panic!("filled twice"))
            .unwrap();
        assert_eq!(again.path, first.path);
        // Nothing half-made is left beside it.
        assert!(!dir.path().join("s/a.partial").exists());
    }

    #[test]
    fn a_failed_fill_leaves_no_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path(), None);
        let failed = cache.get_or_fill("s", "a", None, |file| {
            file.write_all(b"half").at(Path::new("a"))?;
            Err(Error::Config("stopped".into()))
        });
        assert!(matches!(failed, Err(Error::Config(_))));
        assert!(!dir.path().join("s/a").exists());
        assert!(!dir.path().join("s/a.partial").exists());
        let filled = cache.get_or_fill("s", "a", None, fill_with(3)).unwrap();
        assert_eq!(fs::read(filled.path).unwrap().len(), 3);
    }

    #[test]
    fn the_limit_evicts_least_recently_used_entries_not_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path(), Some(25));
        let a = cache
            .get_or_fill("s", "a", Some(10), fill_with(10))
            .unwrap();
        drop(a);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let held = cache
            .get_or_fill("s", "b", Some(10), fill_with(10))
            .unwrap();
        // c needs room: a (unused, oldest) goes, b (held) stays.
        let c = cache
            .get_or_fill("s", "c", Some(10), fill_with(10))
            .unwrap();
        assert!(!dir.path().join("s/a").exists());
        assert!(held.path.exists() && c.path.exists());
        // d would need b or c gone, and both are held: an error, nothing deleted.
        let full = cache.get_or_fill("s", "d", Some(10), fill_with(10));
        match full {
            Err(Error::CacheFull {
                needed,
                limit,
                in_use,
                ..
            }) => assert_eq!((needed, limit, in_use), (10, Some(25), 20)),
            other => panic!("expected CacheFull, got {other:?}"),
        }
        assert!(held.path.exists() && c.path.exists());
        drop(held);
        assert!(cache.get_or_fill("s", "d", Some(10), fill_with(10)).is_ok());
        assert!(!dir.path().join("s/b").exists());
    }

    #[test]
    fn fills_running_at_once_never_overrun_the_limit_together() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path(), Some(35));
        let on_disk = || -> u64 {
            fs::read_dir(dir.path().join("s"))
                // (A file renamed or removed between the listing and its metadata by a fill
                // running at the same time is not on disk any more: not counted.)
                .map(|d| {
                    d.flatten()
                        .filter_map(|e| e.metadata().ok())
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0)
        };
        std::thread::scope(|scope| {
            for n in 0..8 {
                let cache = &cache;
                let on_disk = &on_disk;
                scope.spawn(move || {
                    let filled = cache.get_or_fill("s", &format!("e{n}"), Some(10), |file| {
                        std::thread::sleep(std::time::Duration::from_millis(30));
                        assert!(on_disk() <= 35, "{} bytes on disk", on_disk());
                        file.write_all(&[1u8; 10]).at(Path::new("e"))
                    });
                    // Some fills find no room while others hold theirs: an error, never more.
                    if let Err(e) = filled {
                        assert!(matches!(e, Error::CacheFull { .. }), "{e}");
                    }
                });
            }
        });
        assert!(on_disk() <= 35);
    }

    #[test]
    fn a_fill_past_its_hint_is_held_to_the_limit() {
        // Found by a hostile review: a gzip shard whose trailer understated its size (a
        // multi-member file) was written in full, 20 times the limit, and with no limit it
        // filled the disk. Writes past the reservation now reserve more, or stop.
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path(), Some(1000));
        let old = cache
            .get_or_fill("s", "old", Some(600), fill_with(600))
            .unwrap();
        drop(old);
        let over = cache.get_or_fill("s", "big", Some(10), fill_with(5000));
        match over {
            Err(Error::CacheFull { limit, .. }) => assert_eq!(limit, Some(1000)),
            other => panic!("expected CacheFull, got {other:?}"),
        }
        assert!(!dir.path().join("s/big").exists());
        assert!(!dir.path().join("s/big.partial").exists());
        // Growing evicts what no reader holds, as reserving up front does.
        let grown = cache
            .get_or_fill("s", "grown", Some(10), fill_with(900))
            .unwrap();
        assert_eq!(fs::metadata(&grown.path).unwrap().len(), 900);
        assert!(!dir.path().join("s/old").exists());
    }

    #[test]
    fn a_rewound_fill_ends_where_it_last_wrote_and_detaches() {
        use std::io::Seek as _;
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path(), None);
        let entry = cache
            .get_or_fill("s", "a", Some(100), |file| {
                file.write_all(&[1u8; 50]).at(Path::new("a"))?;
                file.rewind().at(Path::new("a"))?;
                file.write_all(&[2u8; 20]).at(Path::new("a"))
            })
            .unwrap();
        assert_eq!(fs::read(&entry.path).unwrap(), vec![2u8; 20]);
        // A detached fill keeps its bytes in an unnamed file and leaves no entry.
        let mut kept = None;
        let failed = cache.get_or_fill("s", "b", Some(100), |file| {
            file.write_all(&[3u8; 30]).at(Path::new("b"))?;
            kept = Some(file.detach()?);
            Err(Error::Config("damaged".into()))
        });
        assert!(matches!(failed, Err(Error::Config(_))));
        assert!(!dir.path().join("s/b").exists() && !dir.path().join("s/b.partial").exists());
        let kept = kept.unwrap();
        assert_eq!(kept.metadata().unwrap().len(), 30);
    }

    #[test]
    fn a_partial_left_by_a_dead_fill_is_cleared_and_not_counted() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("s")).unwrap();
        fs::write(dir.path().join("s/dead.partial"), vec![0u8; 30]).unwrap();
        let cache = Cache::at(dir.path(), Some(35));
        cache
            .get_or_fill("s", "a", Some(10), fill_with(10))
            .unwrap();
        assert!(!dir.path().join("s/dead.partial").exists());
    }

    #[test]
    fn keys_change_with_the_source() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x y.gz");
        fs::write(&file, b"one").unwrap();
        let before = source_key(&file, &fs::metadata(&file).unwrap());
        assert!(before.ends_with("-x_y.gz"), "{before}");
        fs::write(&file, b"three").unwrap();
        assert_ne!(before, source_key(&file, &fs::metadata(&file).unwrap()));
    }
}
