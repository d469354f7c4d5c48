//! One gate around every use of libhdf5, closed across `fork()`.
//!
//! libhdf5 keeps process-wide state (open files, its metadata cache, free lists), and the `hdf5`
//! crate guards it with a reentrant lock. A `fork()` while another thread is inside the library
//! leaves the child a half-changed copy of that state and the lock held by a thread the child
//! does not have: the child's first HDF5 call hangs forever (a PyTorch DataLoader forking its
//! workers while a Loader read an HDF5 file hung 6 times in 7). Releasing that lock in the child
//! is not enough either: on release it can be handed to a waiting thread, which in the child does
//! not exist.
//!
//! So every libhdf5 call imagefeed makes (opening, reading, writing, and dropping a library
//! handle) runs inside [`run`], which holds the gate, a plain pthread mutex (reentered by the
//! thread holding it without locking again). A `pthread_atfork` handler, registered on first
//! use, takes the gate before any fork in the process, then the crate's lock itself: code
//! outside imagefeed in the same process may use the `hdf5` crate without the gate (a test
//! writing a damaged file, a user's own reads), and a child copied while such a thread held the
//! crate's lock hung in its first HDF5 call. So when the process is copied no thread is inside
//! libhdf5 and the child's copy of the library is consistent. The parent opens both after the
//! fork; the child makes fresh ones (the crate's lock as a new, unlocked mutex: a thread of the
//! parent's waiting for it must not be handed it, as it does not exist in the child). A fork
//! waits at most for the work in progress inside the library: one record, one block of a write,
//! or one file's open (its metadata read), or whatever the other code does under the lock.
//! (Code that takes the crate's lock and then calls imagefeed's HDF5 code inside it, while
//! another thread forks, deadlocks both: a lock-order inversion the gate cannot see.)
//!
//! Known limit: with glibc older than 2.36, a filter plugin that libhdf5 loads for the first time
//! (inside the gate) and that registers fork handlers of its own, at the moment another thread
//! forks, deadlocks both (that glibc holds one lock across all prepare handlers).
//!
//! What must not leave the gate: a library handle (`hdf5::File`, `Dataset`, ...), unless wrapped
//! in [`Gated`], whose drop goes through the gate, and an `hdf5::Error` (it holds a handle to
//! the error stack): [`error`] turns it into text inside the gate.

use std::cell::{Cell, UnsafeCell};
use std::mem::ManuallyDrop;
use std::path::Path;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::Error;

struct Mutex(UnsafeCell<libc::pthread_mutex_t>);

// SAFETY: the pthread mutex is made to be shared between threads; it is only used through the
// pthread calls below.
unsafe impl Sync for Mutex {}

static GATE: Mutex = Mutex(UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER));

thread_local! {
    /// How deep this thread is inside `run` (0: it does not hold the gate).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Whether the prepare handler locked the gate for the fork in progress (the parent handler
/// then unlocks it).
static LOCKED_FOR_FORK: AtomicBool = AtomicBool::new(false);

/// Whether the forking thread already held the crate's lock when the prepare handler took it
/// again (the child then keeps it, one level down, instead of making a fresh one).
static CRATE_LOCK_HELD_BEFORE_FORK: AtomicBool = AtomicBool::new(false);

static REGISTER: Once = Once::new();

fn lock() {
    // SAFETY: GATE is a valid, initialized mutex for the process's lifetime.
    unsafe { libc::pthread_mutex_lock(GATE.0.get()) };
}

fn unlock() {
    // SAFETY: called only by the thread that locked it (or, in `after_fork_in_parent`, by the
    // thread whose prepare handler did).
    unsafe { libc::pthread_mutex_unlock(GATE.0.get()) };
}

fn depth() -> usize {
    DEPTH.with(Cell::get)
}

extern "C" fn before_fork() {
    // A thread forking from inside the gate already holds it.
    if depth() == 0 {
        lock();
        LOCKED_FOR_FORK.store(true, Ordering::SeqCst);
    }
    // Gate first, then the crate's lock, the order `run` takes them in. Held until the
    // handlers below release it (a guard cannot outlive this call).
    CRATE_LOCK_HELD_BEFORE_FORK.store(
        hdf5_sys::LOCK.is_owned_by_current_thread(),
        Ordering::SeqCst,
    );
    std::mem::forget(hdf5_sys::LOCK.lock());
}

extern "C" fn after_fork_in_parent() {
    // SAFETY: this thread locked it in `before_fork` (one level of a reentrant lock).
    unsafe { hdf5_sys::LOCK.force_unlock() };
    if LOCKED_FOR_FORK.swap(false, Ordering::SeqCst) {
        unlock();
    }
}

extern "C" fn after_fork_in_child() {
    LOCKED_FOR_FORK.store(false, Ordering::SeqCst);
    if CRATE_LOCK_HELD_BEFORE_FORK.load(Ordering::SeqCst) {
        // The forking thread was inside the crate's lock: it goes on holding it, one level
        // down. SAFETY: this thread locked it in `before_fork`.
        unsafe { hdf5_sys::LOCK.force_unlock() };
    } else {
        // SAFETY: the child has one thread, this one, and it is inside no use of the lock; a
        // fresh, unlocked mutex replaces the copy, whose waiters (parked threads of the
        // parent's) do not exist here. Every field of the mutex is an atomic or a `Cell`, so
        // the static is written through interior mutability.
        unsafe {
            std::ptr::addr_of!(hdf5_sys::LOCK)
                .cast_mut()
                .write(parking_lot::ReentrantMutex::new(()));
        }
    }
    // SAFETY: the child has one thread, this one; no other can be using the mutex. A fresh one
    // replaces the copy, which belongs to the parent's threads.
    unsafe {
        GATE.0.get().write(libc::PTHREAD_MUTEX_INITIALIZER);
        // The forking thread was inside `run`: it goes on holding the gate in the child.
        if depth() > 0 {
            libc::pthread_mutex_lock(GATE.0.get());
        }
    }
}

/// Opens the gate when the outermost `run` of a thread ends, also by a panic.
struct Held;

impl Drop for Held {
    fn drop(&mut self) {
        let depth = depth() - 1;
        DEPTH.with(|d| d.set(depth));
        if depth == 0 {
            unlock();
        }
    }
}

/// Registers the fork handlers (once per process; `run` does it on first use). A thread about
/// to fork a child that uses libhdf5 calls this first, and forks outside the gate: the prepare
/// handler takes the gate. (Forking while holding it deadlocks on glibc 2.28 to 2.35, which
/// runs the prepare handlers under a lock that a fork inside the gate would wait for, while
/// another thread's prepare handler waits for the gate.)
pub(crate) fn register() {
    REGISTER.call_once(|| {
        // The crate initializes libhdf5 once, under its lock, on first use: done before any
        // fork is guarded, so no child is ever copied halfway through it.
        hdf5::sync::sync(|| ());
        // SAFETY: the handlers are `extern "C"` functions that live as long as the process.
        // Registration fails only without memory; forks then go unguarded, as before.
        unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_in_parent),
                Some(after_fork_in_child),
            )
        };
    });
}

/// Runs `f`, which may call libhdf5, holding the gate.
pub(crate) fn run<T>(f: impl FnOnce() -> T) -> T {
    register();
    if depth() == 0 {
        lock();
    }
    DEPTH.with(|d| d.set(d.get() + 1));
    let _held = Held;
    f()
}

/// Whether this thread holds the gate.
pub(crate) fn held() -> bool {
    depth() > 0
}

/// [`Error::Hdf5`] for a libhdf5 error met while `doing` something to `path`; the library's
/// error (and its handle) is turned into text here, inside the gate. A failed system call
/// (a full disk, a read error) is [`Error::Io`] with its `errno`, as for any other format,
/// not the library's dump of the call.
pub(crate) fn error(path: &Path, doing: &str, e: hdf5::Error) -> Error {
    debug_assert!(held(), "an hdf5::Error is read outside the HDF5 gate");
    let message = e.to_string();
    drop(e);
    match os_error_in(&message) {
        Some(code) => {
            let os = std::io::Error::from_raw_os_error(code);
            Error::io(
                path,
                std::io::Error::new(os.kind(), format!("HDF5, {doing}: {os}")),
            )
        }
        None => Error::hdf5(path, doing, message),
    }
}

/// The `errno` libhdf5's file driver put in its message for a failed read or write
/// (`..., errno = 28, error message = 'No space left on device', ...`).
fn os_error_in(message: &str) -> Option<i32> {
    let (_, after) = message.split_once("errno = ")?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().filter(|&code| code > 0)
}

/// A libhdf5 handle that is only used, and dropped, inside the gate.
pub(crate) struct Gated<T>(ManuallyDrop<T>);

impl<T> Gated<T> {
    /// Wraps `value`, made inside the gate.
    pub fn new(value: T) -> Gated<T> {
        Gated(ManuallyDrop::new(value))
    }

    /// Runs `f` on the handle inside the gate.
    pub fn with<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        run(|| f(&self.0))
    }

    /// Hands the handle itself to `f` (which consumes it: `File::close`) inside the gate.
    pub fn finish<R>(self, f: impl FnOnce(T) -> R) -> R {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the value is taken out exactly once.
        let value = unsafe { ManuallyDrop::take(&mut this.0) };
        run(|| f(value))
    }
}

impl<T> Drop for Gated<T> {
    fn drop(&mut self) {
        // SAFETY: dropped once, here; the value is not used afterwards.
        run(|| unsafe { ManuallyDrop::drop(&mut self.0) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_errno_of_a_failed_file_call_is_found_in_the_message() {
        let message = "H5Dwrite(): can't write data: file write failed: time = Sun Nov 29 \
            12:15:58 2026\n, filename = 'x.h5', file descriptor = 6, errno = 28, error message = \
            'No space left on device', buf = 0x7f30, total write size = 60179";
        assert_eq!(os_error_in(message), Some(28));
        assert_eq!(
            os_error_in("H5Fopen(): unable to open file: bad signature"),
            None
        );
        assert_eq!(os_error_in("errno = 0, error message = 'Success'"), None);
        assert_eq!(os_error_in("errno = x"), None);
    }

    #[test]
    fn the_gate_is_reentrant_and_opens_after_a_panic() {
        assert!(!held());
        run(|| {
            assert!(held());
            run(|| assert!(held()));
            assert!(held());
        });
        assert!(!held());
        let caught = std::panic::catch_unwind(|| run(|| panic!("inside the gate")));
        assert!(caught.is_err());
        assert!(!held());
        // Another thread can take it: it was opened.
        std::thread::spawn(|| run(|| assert!(held())))
            .join()
            .unwrap();
    }

    #[test]
    fn a_fork_waits_for_the_gate_and_the_child_gets_a_free_one() {
        // One thread holds the gate; a fork from another thread must wait until it has left,
        // and the child, whose copy would otherwise be held by a thread it does not have, can
        // take the gate at once.
        use std::sync::atomic::AtomicBool;
        static LEFT: AtomicBool = AtomicBool::new(false);
        let (tx, rx) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            run(|| {
                tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
                LEFT.store(true, Ordering::SeqCst);
            })
        });
        rx.recv().unwrap();
        // SAFETY: the child only takes the gate and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            run(|| ());
            // SAFETY: leaves the child without running the parent's destructors.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0);
        assert!(
            LEFT.load(Ordering::SeqCst),
            "fork went ahead while another thread held the gate"
        );
        let mut status = 0;
        // SAFETY: `pid` is our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        holder.join().unwrap();
        run(|| ());
    }
}
