//! Page-cache control, for honest cold-cache measurements.
//!
//! [`evict`] asks the kernel to drop the cached pages of every file under a path
//! (`posix_fadvise(POSIX_FADV_DONTNEED)` after flushing dirty data, which needs no privileges),
//! and [`residency`] counts how much of them is still cached (`mincore` over a read-only map), so
//! a "cold" benchmark can prove it started cold. Linux semantics; elsewhere the advice may be
//! ignored, which `residency` then shows.

use std::fs;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext as _, Result};

/// Files and bytes under a path, and how many of those bytes are in the page cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Regular files found.
    pub files: usize,
    /// Their total size.
    pub bytes: u64,
    /// Bytes of them resident in the page cache (page granularity).
    pub resident_bytes: u64,
}

impl CacheStats {
    /// Resident share, 0.0 to 1.0 (0 for an empty set).
    pub fn resident_fraction(&self) -> f64 {
        if self.bytes == 0 {
            0.0
        } else {
            (self.resident_bytes as f64 / self.bytes as f64).min(1.0)
        }
    }
}

/// Every regular file at or below `path` (symlinks followed), sorted.
fn files_under(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = fs::metadata(path).at(path)?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).at(&dir)? {
            let p = entry.at(&dir)?.path();
            match fs::metadata(&p) {
                Ok(m) if m.is_dir() => stack.push(p),
                Ok(m) if m.is_file() => out.push(p),
                _ => {}
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Drops the cached pages of every file at or below `path`; returns the residency afterwards.
pub fn evict(path: impl AsRef<Path>) -> Result<CacheStats> {
    let path = path.as_ref();
    for file_path in files_under(path)? {
        let file = fs::File::open(&file_path).at(&file_path)?;
        // Dirty pages are not dropped; flush first (no-op for files we only read).
        let _ = file.sync_data();
        // SAFETY: a plain syscall on a valid, open file descriptor; offset 0 and length 0 mean
        // "the whole file".
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(Error::io(&file_path, std::io::Error::from_raw_os_error(rc)));
        }
    }
    residency(path)
}

/// Memory this process may still fill, in bytes: `MemAvailable` from `/proc/meminfo`, or less
/// where a memory cgroup the process is in (a container's limit) leaves less below its limit
/// ([`cgroup_headroom`]), or [`MEMORY_LIMIT_ENV`] sets less; `None` where none of them is
/// known. In a container `MemAvailable` is the host's: a dataset advised or read into the page
/// cache past the container's limit would only be read again.
pub fn available_memory() -> Option<u64> {
    let host = meminfo_bytes("MemAvailable:");
    let cgroup = cgroup_headroom(&|path| fs::read_to_string(path).ok());
    least([host, cgroup, env_memory_limit()])
}

/// The least of the values that are known.
fn least(values: [Option<u64>; 3]) -> Option<u64> {
    values.into_iter().flatten().min()
}

/// The environment variable that caps the memory imagefeed plans its reads for: a size
/// (`16GiB`, `512M`, bytes). Unset, it is the installed memory or the memory cgroup's limit.
/// Set it lower where other work holds most of the memory: a dataset larger than the limit is
/// read a record at a time rather than through the page cache's read-around
/// (`format::shard_data::Mapped::ready_for`, `Lmdb::direct`).
pub const MEMORY_LIMIT_ENV: &str = "IMAGEFEED_MEMORY_LIMIT";

/// The limit [`MEMORY_LIMIT_ENV`] sets, `None` where it is unset or empty.
///
/// # Errors
/// A value that is not a size ([`Error::Config`] naming the variable and the value). Opening
/// a dataset checks it ([`crate::format::open_with`]); elsewhere an invalid value counts as
/// unset.
pub fn memory_limit_from_env() -> Result<Option<u64>> {
    crate::units::from_env(MEMORY_LIMIT_ENV, crate::units::parse_bytes).map_err(Error::Config)
}

/// [`memory_limit_from_env`], an invalid value counting as unset.
fn env_memory_limit() -> Option<u64> {
    memory_limit_from_env().ok().flatten()
}

/// What the memory cgroups of this process (its own and each one above it, cgroup v2 or v1)
/// leave below their limits: the least of limit minus usage over those with a limit; `None`
/// where none has one. `read` reads a file's text (a parameter so tests can give the files).
fn cgroup_headroom(read: &dyn Fn(&Path) -> Option<String>) -> Option<u64> {
    cgroup_least(read, &|limit, usage| limit.saturating_sub(usage))
}

/// The least memory limit of this process's cgroups (its own and each one above it); `None`
/// where none has one.
fn cgroup_limit(read: &dyn Fn(&Path) -> Option<String>) -> Option<u64> {
    cgroup_least(read, &|limit, _| limit)
}

/// The least of `of(limit, usage)` over this process's memory cgroups that have a limit.
fn cgroup_least(
    read: &dyn Fn(&Path) -> Option<String>,
    of: &dyn Fn(u64, u64) -> u64,
) -> Option<u64> {
    /// v1 writes "no limit" as a page-rounded `i64::MAX`; anything this large is none.
    const UNLIMITED: u64 = 1 << 60;
    let membership = read(Path::new("/proc/self/cgroup"))?;
    let mut least: Option<u64> = None;
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(own)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (roots, limit_file, usage_file): (&[&str], _, _) = if controllers.is_empty() {
            (
                &["/sys/fs/cgroup", "/sys/fs/cgroup/unified"],
                "memory.max",
                "memory.current",
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                &["/sys/fs/cgroup/memory"],
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        for root in roots {
            // The group and every group above it, up to the root of the mount.
            let mut group = Some(Path::new(own.trim()));
            while let Some(at) = group {
                let dir = Path::new(root).join(at.strip_prefix("/").unwrap_or(at));
                let number = |file: &str| read(&dir.join(file))?.trim().parse::<u64>().ok();
                if let (Some(limit), Some(usage)) = (number(limit_file), number(usage_file))
                    && limit < UNLIMITED
                {
                    let left = of(limit, usage);
                    least = Some(least.map_or(left, |l| l.min(left)));
                }
                group = at.parent();
            }
        }
    }
    least
}

/// Installed memory in bytes (Linux `/proc/meminfo`); `None` elsewhere.
pub fn total_memory() -> Option<u64> {
    meminfo_bytes("MemTotal:")
}

/// All the memory this process could have, page cache included: the installed memory, or a
/// memory cgroup's limit or [`MEMORY_LIMIT_ENV`] where that is less; `None` where none is
/// known. (Unlike [`available_memory`], it does not shrink as the page cache fills the cgroup:
/// a file that fits in it once filled it.)
fn memory_ceiling() -> Option<u64> {
    let limit = cgroup_limit(&|path| fs::read_to_string(path).ok());
    least([total_memory(), limit, env_memory_limit()])
}

fn meminfo_bytes(field: &str) -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Files up to this size are read through at open, in order, before their index is walked
/// (at this disk's ~1.9 GB/s, 0.14 s at the limit), where a quarter of the available memory
/// holds them ([`fits_read_through`]). Past 64 MiB it still pays: a cold 84 MB LMDB of 60,000
/// CIFAR images (an epoch of 0.19 s warm) had first epochs of 0.28–0.34 s with the background
/// advice and 0.24–0.25 s read through; a 216 MB one of 2,000 ImageNet photos (1.0 s warm),
/// 1.21–1.29 s against 1.15–1.16 s.
pub(crate) const READ_THROUGH_BYTES: u64 = 256 << 20;

/// Whether a file (or a set of shards) of `len` bytes is read through at open
/// ([`prefetch_if_it_fits`]) when `available` bytes of memory are free: at most
/// [`READ_THROUGH_BYTES`], and at most a quarter of the available memory where that is known.
fn fits_read_through(len: u64, available: Option<u64>) -> bool {
    len <= READ_THROUGH_BYTES && available.is_none_or(|available| len <= available / 4)
}

/// The size of each read of [`read_through`]: the kernel's usual readahead window, so that its
/// readahead of the next window runs while a read is copied out. Measured cold, 21 rounds
/// alternating: the CIFAR-10 test LMDB (14 MB) in 10.0 ms with 128 KiB reads against 12.1 ms
/// with 1 MiB (256 and 512 KiB between), its 11 MB record shard in 8.6 against 10.6 ms.
const READ_THROUGH_REQUEST: usize = 128 << 10;

/// Reads `file` (`len` bytes) through the page cache once, in order, unless it is wholly cached
/// already (a reopen: reading it through would only copy it). A file that ends early is read to
/// its end.
///
/// # Errors
/// A read that fails (the disk cannot read part of the file: `EIO`), naming the byte it was
/// at. A format that reads the file through a memory map must not open it then: the same
/// failure under the map is a `SIGBUS` that kills the process, not an error.
fn read_through(file: &fs::File, len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    // SAFETY: the map is read-only and only its address range is used (by mincore); no byte of
    // it is read, so a concurrent change to the file cannot cause undefined behaviour.
    if len > 0 && unsafe { memmap2::Mmap::map(file) }.is_ok_and(|map| is_resident(&map)) {
        return Ok(());
    }
    let mut buffer = vec![0u8; READ_THROUGH_REQUEST];
    let mut at = 0u64;
    while at < len {
        match file.read_at(&mut buffer, at) {
            Ok(0) => break,
            Ok(n) => at += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("reading it through at byte {at}: {e}"),
                ));
            }
        }
    }
    Ok(())
}

/// What the open of a set of local shards does with their bytes, by the set's total size
/// ([`prefetch_plan`]): reads each shard through as it opens it, in order, when the set fits
/// ([`fits_read_through`]: for the same reasons as [`prefetch_if_it_fits`], and so that a part
/// of a shard the disk cannot read refuses the set with an error naming the shard and the
/// byte, where the readers, which read shards through memory maps, would die of SIGBUS on it);
/// advises a larger set to stream in; and marks a set larger than all the memory the process
/// could have as read at random (see `format::shard_data::Mapped::ready_for`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SetPrefetch {
    plan: Prefetched,
}

impl SetPrefetch {
    /// For a set of `total` bytes.
    pub(crate) fn for_total(total: u64) -> SetPrefetch {
        SetPrefetch {
            plan: plan_for(total),
        }
    }

    /// For a set of `paths`, by their sizes now (a file that cannot be looked at counts as
    /// empty: opening it fails on its own).
    pub(crate) fn for_files(paths: impl IntoIterator<Item = impl AsRef<Path>>) -> SetPrefetch {
        Self::for_total(
            paths
                .into_iter()
                .filter_map(|path| fs::metadata(path).ok())
                .fold(0u64, |sum, meta| sum.saturating_add(meta.len())),
        )
    }

    /// What the open does with the set.
    pub(crate) fn plan(&self) -> Prefetched {
        self.plan
    }

    /// Reads `file` (`path` in messages, `len` bytes) through, when the set fits.
    pub(crate) fn read(&self, path: &Path, file: &fs::File, len: u64) -> Result<()> {
        if self.plan == Prefetched::InCache {
            read_through(file, len).at(path)?;
        }
        Ok(())
    }
}

/// Brings `file` into the page cache as one sequential stream instead of one small read per
/// page fault: a file of at most 256 MiB is read through now, in order (opening
/// walks its index, whose pages are spread over the file: with only the background advice the
/// walk faulted most of CIFAR-10's 14 MB in tree order, 90 ms cold against 20 ms read through);
/// a larger one is handed to the kernel to stream in the background (`POSIX_FADV_WILLNEED`),
/// when it is at most half of the available memory, so a dataset larger than RAM is never
/// pushed through the cache this way. A small file already wholly cached (a reopen) is left as
/// it is (`mincore`, ~0.25 ms for 14 MB, against 0.7 ms to copy it through). Returns whether
/// the file is read through, cached already, or advised.
///
/// # Errors
/// A read of the read-through that fails ([`read_through`]'s errors): the disk cannot read
/// part of the file.
pub fn prefetch_if_it_fits(file: &fs::File) -> std::io::Result<bool> {
    prefetch(file).map(|done| matches!(done, Prefetched::InCache | Prefetched::Advised))
}

/// What [`prefetch`] did with a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prefetched {
    /// Read through, or wholly cached already: in the page cache now.
    InCache,
    /// Handed to the kernel to stream in the background (`POSIX_FADV_WILLNEED`).
    Advised,
    /// Neither: too large to read through or advise; read on demand.
    NotRead,
    /// Not read either, and larger than all the memory the process could have (installed, or
    /// its memory cgroup's limit): it cannot stay in the page cache, so a read that brings in
    /// more than it needs (a page fault on a map of it reads the disk's whole read-around
    /// window) evicts what other reads will need.
    TooLarge,
}

/// [`prefetch_if_it_fits`], saying what it did, and whether a file it did not read is larger
/// than the memory available ([`Prefetched::TooLarge`]): a reader of such a file reads each
/// record with a `pread` of its own.
pub(crate) fn prefetch(file: &fs::File) -> std::io::Result<Prefetched> {
    let Ok(len) = file.metadata().map(|m| m.len()) else {
        return Ok(Prefetched::NotRead);
    };
    match plan_for(len) {
        Prefetched::InCache => read_through(file, len).map(|()| Prefetched::InCache),
        Prefetched::Advised => {
            // SAFETY: a plain syscall on a valid, open file descriptor; offset 0 and length 0
            // mean "the whole file". The advice is asynchronous and has no effect on
            // correctness.
            let advised = unsafe {
                libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) == 0
            };
            Ok(if advised {
                Prefetched::Advised
            } else {
                Prefetched::NotRead
            })
        }
        other => Ok(other),
    }
}

/// [`prefetch_plan`] for `len` bytes, with the memory there is now.
fn plan_for(len: u64) -> Prefetched {
    let available = available_memory();
    // (The ceiling is only asked of a file too large to read through.)
    let ceiling = if fits_read_through(len, available) {
        None
    } else {
        memory_ceiling()
    };
    prefetch_plan(len, available, ceiling)
}

/// What [`prefetch`] does with a file of `len` bytes when `available` bytes of memory are free
/// and the process could have `ceiling` in all ([`memory_ceiling`]; `None`: unknown): read it
/// through ([`Prefetched::InCache`]), advise it, leave it, or leave it as larger than all the
/// memory there is.
fn prefetch_plan(len: u64, available: Option<u64>, ceiling: Option<u64>) -> Prefetched {
    if fits_read_through(len, available) {
        return Prefetched::InCache;
    }
    if ceiling.is_some_and(|ceiling| len > ceiling) {
        return Prefetched::TooLarge;
    }
    match available {
        Some(available) if len <= available / 2 => Prefetched::Advised,
        _ => Prefetched::NotRead,
    }
}

/// Counts how much of the files at or below `path` is in the page cache.
pub fn residency(path: impl AsRef<Path>) -> Result<CacheStats> {
    let path = path.as_ref();
    let page = crate::pool::page_size() as u64;
    let mut stats = CacheStats::default();
    let mut vec = Vec::new();
    for file_path in files_under(path)? {
        let file = fs::File::open(&file_path).at(&file_path)?;
        let len = file.metadata().at(&file_path)?.len();
        stats.files += 1;
        stats.bytes += len;
        if len == 0 {
            continue;
        }
        // SAFETY: the map is read-only and only its address range is used (by mincore); no byte
        // of it is read, so a concurrent change to the file cannot cause undefined behaviour.
        let map = unsafe { memmap2::Mmap::map(&file) }.at(&file_path)?;
        let resident_pages =
            resident_pages(&map, &mut vec).map_err(|e| Error::io(&file_path, e))? as u64;
        stats.resident_bytes += (resident_pages * page).min(len);
    }
    Ok(stats)
}

/// How many pages of `map` (a live mapping, from its page-aligned start) are in the page
/// cache; `vec` is scratch space (a byte per page).
fn resident_pages(map: &[u8], vec: &mut Vec<u8>) -> std::io::Result<usize> {
    let pages = map.len().div_ceil(crate::pool::page_size());
    vec.clear();
    vec.resize(pages, 0u8);
    // SAFETY: `map` is a live mapping of `map.len()` bytes at a page-aligned address, and
    // `vec` has one byte per page of that range, as mincore requires; no byte of the map is
    // read.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            vec.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(vec.iter().filter(|&&b| b & 1 == 1).count())
}

/// Whether every page of `map` (a live mapping of a file, from its start) is in the page
/// cache: then reading it through first would only copy it. False where it cannot be told.
pub(crate) fn is_resident(map: &[u8]) -> bool {
    let pages = map.len().div_ceil(crate::pool::page_size());
    resident_pages(map, &mut Vec::new()).is_ok_and(|resident| resident == pages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    #[test]
    fn evicting_a_read_file_drops_its_pages() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let mut sink = Vec::new();
        fs::File::open(&path)
            .unwrap()
            .read_to_end(&mut sink)
            .unwrap();
        let before = residency(dir.path()).unwrap();
        assert_eq!((before.files, before.bytes), (1, 1 << 20));
        let after = evict(dir.path()).unwrap();
        assert!(
            after.resident_bytes < before.resident_bytes || before.resident_bytes == 0,
            "{before:?} -> {after:?}"
        );
        assert!(after.resident_fraction() < 0.5, "{after:?}");
    }

    #[test]
    fn a_memory_cgroup_limit_bounds_the_memory_available() {
        use std::collections::HashMap;
        let files = |entries: &[(&str, &str)]| {
            let map: HashMap<String, String> = entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |path: &Path| map.get(path.to_str()?).cloned()
        };
        // cgroup v2: the pod's limit (above the container's unlimited group) counts.
        let v2 = files(&[
            ("/proc/self/cgroup", "0::/pod/box\n"),
            ("/sys/fs/cgroup/pod/box/memory.max", "max\n"),
            ("/sys/fs/cgroup/pod/box/memory.current", "100\n"),
            ("/sys/fs/cgroup/pod/memory.max", "8000\n"),
            ("/sys/fs/cgroup/pod/memory.current", "3000\n"),
        ]);
        assert_eq!(cgroup_headroom(&v2), Some(5000));
        assert_eq!(cgroup_limit(&v2), Some(8000), "the limit, whatever is used");
        // cgroup v1's memory controller; "no limit" is a huge number.
        let v1 = files(&[
            ("/proc/self/cgroup", "4:memory:/job\n1:cpu:/\n"),
            ("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "4096\n"),
            ("/sys/fs/cgroup/memory/job/memory.usage_in_bytes", "5000\n"),
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "1\n"),
        ]);
        assert_eq!(
            cgroup_headroom(&v1),
            Some(0),
            "usage past the limit leaves nothing"
        );
        assert_eq!(cgroup_limit(&v1), Some(4096));
        let unlimited = files(&[
            ("/proc/self/cgroup", "4:memory:/\n0::/\n"),
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "1\n"),
            ("/sys/fs/cgroup/memory.max", "max\n"),
            ("/sys/fs/cgroup/memory.current", "1\n"),
        ]);
        assert_eq!(cgroup_headroom(&unlimited), None);
        assert_eq!(cgroup_limit(&unlimited), None);
        assert_eq!(cgroup_headroom(&files(&[])), None);
    }

    #[test]
    fn files_up_to_the_limit_are_read_through_where_memory_holds_them() {
        let available = available_memory().expect("Linux reports MemAvailable");
        let reads_through = |len| fits_read_through(len, Some(available));
        assert_eq!(reads_through(1 << 20), available >= 4 << 20);
        assert_eq!(
            reads_through(READ_THROUGH_BYTES),
            available >= 4 * READ_THROUGH_BYTES
        );
        assert!(!reads_through(READ_THROUGH_BYTES + 1));
        assert!(!reads_through(u64::MAX));
        assert!(fits_read_through(READ_THROUGH_BYTES, None));
    }

    #[test]
    fn a_mapped_file_is_resident_once_read_and_not_once_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seen.bin");
        fs::write(&path, vec![3u8; (1 << 20) + 17]).unwrap();
        let file = fs::File::open(&path).unwrap();
        // SAFETY: test-only; the file is not changed while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let _ = fs::read(&path).unwrap();
        assert!(is_resident(&map));
        evict(&path).unwrap();
        assert!(!is_resident(&map));
        // Read through (not skipped as resident), and then resident.
        assert!(prefetch_if_it_fits(&file).unwrap());
        assert!(is_resident(&map));
    }

    #[test]
    fn a_read_that_fails_while_reading_through_is_an_error_naming_the_byte() {
        // A directory opens as a file whose reads fail (EISDIR), as a disk that cannot read
        // part of a file fails them (EIO): the read-through reports it instead of stopping
        // quietly, so a format read through a map refuses the file rather than crash on it.
        let dir = tempfile::tempdir().unwrap();
        let unreadable = fs::File::open(dir.path()).unwrap();
        let err = read_through(&unreadable, 1 << 20).unwrap_err();
        assert_eq!(err.raw_os_error(), None, "wrapped, with the byte it was at");
        assert!(err.to_string().contains("at byte 0"), "{err}");
        let err = prefetch_if_it_fits(&unreadable).unwrap_err();
        assert!(err.to_string().contains("at byte 0"), "{err}");
        // A file that is shorter than asked is read to its end, without error.
        let path = dir.path().join("short.bin");
        fs::write(&path, vec![5u8; 1000]).unwrap();
        evict(&path).unwrap();
        read_through(&fs::File::open(&path).unwrap(), 1 << 20).unwrap();
    }

    #[test]
    fn a_set_that_fits_is_read_through_and_an_unreadable_member_refuses_it() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
        fs::write(&a, vec![1u8; 1 << 20]).unwrap();
        fs::write(&b, vec![2u8; 1 << 20]).unwrap();
        let set = SetPrefetch::for_files([&a, &b]);
        evict(&a).unwrap();
        set.read(&a, &fs::File::open(&a).unwrap(), 1 << 20).unwrap();
        assert!(residency(&a).unwrap().resident_fraction() >= 0.99);
        // A member whose reads fail (a directory opened as a file) is an error naming it.
        let unreadable = fs::File::open(dir.path()).unwrap();
        match set.read(dir.path(), &unreadable, 1 << 20) {
            Err(Error::Io { path, source }) => {
                assert_eq!(path, dir.path());
                assert!(source.to_string().contains("at byte 0"), "{source}");
            }
            other => panic!("expected an I/O error naming the member, got {other:?}"),
        }
        // A set past the limit (a sparse member) is not read at open: nothing read, nothing
        // to fail.
        let large = dir.path().join("large.bin");
        fs::File::create(&large)
            .unwrap()
            .set_len(READ_THROUGH_BYTES + 1)
            .unwrap();
        let past = SetPrefetch::for_files([&b, &large]);
        past.read(dir.path(), &unreadable, 1 << 20).unwrap();
        evict(&b).unwrap();
        past.read(&b, &fs::File::open(&b).unwrap(), 1 << 20)
            .unwrap();
        assert!(residency(&b).unwrap().resident_fraction() < 0.5);
    }

    #[test]
    fn prefetch_streams_a_small_file_into_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.bin");
        fs::write(&path, vec![1u8; 4 << 20]).unwrap();
        evict(&path).unwrap();
        let file = fs::File::open(&path).unwrap();
        assert!(
            prefetch_if_it_fits(&file).unwrap(),
            "a 4 MiB file fits in memory"
        );
        // Read through before the call returns (not merely advised): resident at once.
        let resident = residency(&path).unwrap();
        assert!(resident.resident_fraction() >= 0.99, "{resident:?}");
    }

    #[test]
    fn a_file_is_read_through_advised_left_or_left_as_too_large_by_its_size() {
        const MIB: u64 = 1 << 20;
        // 1 GiB free of 2 GiB.
        let plan = |len| prefetch_plan(len, Some(1024 * MIB), Some(2048 * MIB));
        assert_eq!(plan(100 * MIB), Prefetched::InCache);
        assert_eq!(prefetch_plan(100 * MIB, None, None), Prefetched::InCache);
        // Past a quarter of the free memory, or past the read-through limit: advised up to
        // half of it.
        assert_eq!(plan(300 * MIB), Prefetched::Advised);
        assert_eq!(
            prefetch_plan(300 * MIB, Some(100 * 1024 * MIB), None),
            Prefetched::Advised
        );
        assert_eq!(plan(600 * MIB), Prefetched::NotRead);
        assert_eq!(plan(2048 * MIB), Prefetched::NotRead);
        // Larger than all the memory there is, however much is free; a file that fits in
        // it is not, even where the page cache has taken what was free.
        assert_eq!(plan(2049 * MIB), Prefetched::TooLarge);
        assert_eq!(
            prefetch_plan(2049 * MIB, Some(4096 * MIB), Some(2048 * MIB)),
            Prefetched::TooLarge
        );
        assert_eq!(
            prefetch_plan(600 * MIB, Some(10 * MIB), Some(2048 * MIB)),
            Prefetched::NotRead
        );
        // Memory unknown: never called too large.
        assert_eq!(prefetch_plan(1 << 40, None, None), Prefetched::NotRead);
    }

    #[test]
    fn missing_path_is_an_error_naming_it() {
        let err = evict("/no/such/place").unwrap_err().to_string();
        assert!(err.contains("/no/such/place"), "{err}");
    }
}
