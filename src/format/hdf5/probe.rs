//! Opening an HDF5 file in a forked child first, so that metadata that crashes libhdf5 or loops
//! it forever costs a named error instead of the process.
//!
//! libhdf5 trusts a file's metadata: two flipped bytes of an h5py file's object header make
//! `H5Fopen` loop forever (in every tool; Ctrl-C cannot stop it), others end in SIGSEGV. Which
//! bytes do that cannot be told without parsing what libhdf5 parses, so the open is tried first
//! in a child process with a time and a memory limit: a child killed by a signal, still running
//! at the time limit, or holding more memory than the budget (then killed) refuses the file; a
//! child that finishes (with or without an error) lets the process open the file itself, as
//! before. Each file is tried once per process (by identity: device, inode, size, modification
//! time).
//!
//! The fork handlers take the HDF5 gate (`gate`) around the fork, so no other thread is inside
//! the library: the child's copy of it is consistent, and it gets a fresh gate. The child
//! first closes every descriptor it inherited (a `flock` another thread holds must not outlive
//! that thread's close), logs nothing, and leaves with `_exit`. What this does not cover:
//! damage libhdf5 only meets when a record is read later and the trial's reads (3 s) did not
//! reach: in a chunk index it walks to find a chunk (the chunks themselves are decoded by
//! checked code of ours, `chunks`, as are h5py's variable-length records, `heap`), or in a
//! dataset stored through a filter only the library undoes; and a fork that fails (the file
//! is then opened without the trial).
//!
//! `IMAGEFEED_HDF5_OPEN_SECONDS` sets the time limit (default 30; `0` turns the trial off),
//! `IMAGEFEED_HDF5_OPEN_MIB` the memory budget (default 1 GiB plus twice the file's size).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The default time a child may take to open a file.
const DEFAULT_SECONDS: u64 = 30;

/// A file's identity: device, inode, size, modification time in ns.
type Identity = (u64, u64, u64, i128);

/// Files the trial has passed in this process. Only used inside the HDF5 gate, so no thread
/// holds it when the process forks (a child opening a file must not wait for it forever).
static PASSED: Mutex<Option<HashSet<Identity>>> = Mutex::new(None);

fn passed() -> MutexGuard<'static, Option<HashSet<Identity>>> {
    debug_assert!(super::gate::held());
    PASSED.lock().unwrap_or_else(|e| e.into_inner())
}

/// The number an environment variable of ours holds, `None` where it is unset or empty.
///
/// # Errors
/// A value that is not such a number ([`Error::Config`] naming the variable): "abc", "-5" and
/// "1e20" seconds were taken silently as the default, or panicked.
pub(super) fn env_number<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    crate::units::from_env(name, |text| {
        (text.trim().parse()).map_err(|_| format!("{text:?}: not a valid number"))
    })
    .map_err(Error::Config)
}

/// The time a trial may take (`IMAGEFEED_HDF5_OPEN_SECONDS`, at most a day), `None` when the
/// trial is off (0).
fn limit() -> Result<Option<Duration>> {
    const NAME: &str = "IMAGEFEED_HDF5_OPEN_SECONDS";
    let seconds = env_number::<f64>(NAME)?.unwrap_or(DEFAULT_SECONDS as f64);
    if !(0.0..=86_400.0).contains(&seconds) {
        return Err(Error::Config(format!(
            "{NAME}={seconds}: seconds from 0 (no trial) to 86400"
        )));
    }
    Ok((seconds > 0.0).then(|| Duration::from_secs_f64(seconds)))
}

/// What a trial may allocate beyond the process's memory at the fork: `IMAGEFEED_HDF5_OPEN_MIB`,
/// else 1 GiB plus twice the file's size (an index of millions of records is read into memory
/// at open). A damaged type size or count makes libhdf5 allocate without bound: one byte of
/// h5py's variable-length fixture made it take 12 GB in 30 s.
fn memory_budget(path: &Path) -> Result<u64> {
    if let Some(mib) = env_number::<u64>("IMAGEFEED_HDF5_OPEN_MIB")? {
        return Ok(mib.saturating_mul(1 << 20));
    }
    let len = std::fs::metadata(path).map_or(0, |m| m.len());
    Ok((1u64 << 30).saturating_add(len.saturating_mul(2)))
}

/// Ends the trial child `pid`, not yet reaped, and reaps it.
fn kill_and_reap(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: `pid` is this process's child, not yet reaped; `status` is a valid out-pointer.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
    }
}

/// The resident memory of process `pid` (`None`: this one), from `/proc/PID/statm`.
fn resident_bytes(pid: Option<libc::pid_t>) -> Option<u64> {
    let statm = match pid {
        Some(pid) => std::fs::read_to_string(format!("/proc/{pid}/statm")),
        None => std::fs::read_to_string("/proc/self/statm"),
    }
    .ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages.saturating_mul(u64::try_from(page).ok()?))
}

/// Runs `open` (the whole open of `path`, metadata reads included) in a forked child first;
/// `Err` (not-a-dataset, naming `path`) when the child crashed or did not finish in time.
pub(super) fn try_in_child(path: &Path, open: impl FnOnce()) -> Result<()> {
    // Each of the HDF5 settings checked once per open, the readers' cache size too.
    super::chunks::cache_budget()?;
    let budget = memory_budget(path)?;
    let Some(limit) = limit()? else {
        return Ok(());
    };
    let identity: Option<Identity> = std::fs::metadata(path).ok().map(|m| {
        (
            m.dev(),
            m.ino(),
            m.size(),
            i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        )
    });
    let seen = |identity: Identity| passed().as_ref().is_some_and(|p| p.contains(&identity));
    if identity.is_some_and(|identity| super::gate::run(|| seen(identity))) {
        return Ok(());
    }
    // What the child may take: the process's resident memory now (the child shares it) plus
    // the budget.
    let ceiling = resident_bytes(None).map(|now| now.saturating_add(budget));
    // The fork handlers take the HDF5 gate around the fork (see `gate`): no other thread is
    // inside libhdf5, and the child gets a fresh gate.
    super::gate::register();
    // SAFETY: the child runs only `open` (libhdf5 calls, which the fork handlers made safe, and
    // allocation, which glibc makes fork-safe) with logging off, and leaves with `_exit`,
    // running no destructor or exit handler of the parent's.
    let pid = unsafe {
        let pid = libc::fork();
        if pid == 0 {
            // The child must not hold the parent's files open: a `flock` on a descriptor it
            // inherited (another thread's pack output) would look held by another run until
            // the child ends. libhdf5 opens the path afresh.
            if libc::close_range(3, libc::c_uint::MAX, 0) != 0 {
                for fd in 3..4096 {
                    libc::close(fd);
                }
            }
            log::set_max_level(log::LevelFilter::Off);
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(open));
            libc::_exit(if done.is_ok() { 0 } else { 2 });
        }
        pid
    };
    if pid < 0 {
        // No child could be made (out of processes or memory): open without the trial.
        return Ok(());
    }
    let started = Instant::now();
    let mut status = 0;
    let mut pause = Duration::from_micros(200);
    loop {
        // SAFETY: `pid` is our child; `status` is a valid out-pointer.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            break;
        }
        if done < 0 {
            // Reaped elsewhere (a SIGCHLD handler set to ignore): nothing to judge.
            return Ok(());
        }
        if let Some(ceiling) = ceiling
            && resident_bytes(Some(pid)).is_some_and(|rss| rss > ceiling)
        {
            kill_and_reap(pid);
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "libhdf5 took more than {} MiB of memory opening it in a trial process: its \
                     metadata is damaged (a size or count it allocates for without bound; \
                     IMAGEFEED_HDF5_OPEN_MIB sets the limit)",
                    budget >> 20
                ),
            ));
        }
        if started.elapsed() >= limit {
            kill_and_reap(pid);
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "libhdf5 did not finish opening it within {:.0} s in a trial process: its \
                     metadata is damaged (it loops the library), or the file system is that slow \
                     (IMAGEFEED_HDF5_OPEN_SECONDS sets the limit, 0 turns the trial off)",
                    limit.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
    if libc::WIFSIGNALED(status) {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "libhdf5 crashed (signal {}) opening it in a trial process: its metadata is \
                 damaged",
                libc::WTERMSIG(status)
            ),
        ));
    }
    if let Some(identity) = identity {
        super::gate::run(|| passed().get_or_insert_with(HashSet::new).insert(identity));
    }
    Ok(())
}
