//! Reading memory-mapped files without dying of SIGBUS.
//!
//! A read through a file mapping whose page the kernel cannot supply (the disk or a network
//! filesystem returns an I/O error, or another process truncated the file) is not an error
//! return but a SIGBUS, which ends the process. Datasets small enough are read through at open
//! ([`crate::pagecache`]), which turns a failing disk into an error there; this module covers
//! the rest. A reader copies each record's bytes out of the map ([`copy_readable`]) in a small
//! assembly routine before anything parses or decodes them, and a process-wide SIGBUS handler
//! that finds the fault at that routine's load instruction resumes it at a common exit with the
//! faulting address instead of letting the signal kill the process. The record is then an error
//! naming the file and byte ([`Error::Io`], or [`Error::FileChanged`] when the file has
//! shrunk), and the loader goes on. Scans that only look at a few bytes (headers, offsets)
//! touch their pages first with [`fault_in`], a second routine of the same kind.
//!
//! The copy is the point: a record is parsed, checked and decoded for tens of microseconds to
//! milliseconds, and a page dropped or cut in that time would fault inside libjpeg-turbo, out
//! of any guard's reach (a hostile run found exactly that when records were only touched
//! first). After the copy, nothing reads the map again. It costs a `memcpy` of the record
//! (tens of nanoseconds for a CIFAR-size JPEG; bench/RESULTS.md).
//!
//! This is the way the Linux kernel reads user memory (an exception table: the fault's
//! instruction address says whether it is expected); no `longjmp`, no thread-local state, so
//! the handler is async-signal-safe. Any other SIGBUS goes to the handler that was there
//! before (Rust's own, Python's `faulthandler`, or the default action, which ends the process
//! as it always did; a SIGBUS sent by `kill` ends it too). A handler installed after ours
//! (PyTorch's DataLoader workers install one; Python's `faulthandler.enable()`) is put behind
//! ours again at the next open, batch or Python `Dataset` read ([`claim`]).
//!
//! What stays unguarded: liblmdb's own reads of tree pages at open (opening the databases, the
//! lookups of an LMDB file's records, which the values are then copied out of through the
//! guard; the open's check has just read those pages, and a file of up to 256 MiB is read
//! through before them), every B-tree search where the process's maps cannot be listed
//! (`/proc/self/maps`; elsewhere readers search the checked tree through the guard), and the
//! short windows between a [`fault_in`] and the bytes read after it in the open's scans. x86-64 and AArch64 Linux only; elsewhere the routines are a plain
//! copy and a plain touch.

use std::io;
use std::path::Path;
#[cfg(guarded_touch)]
use std::sync::atomic::Ordering;

use crate::error::{Error, Result};

/// Copies `bytes`, part of the map of the file at `path` whose whole mapping is `map`, into
/// `out` (cleared first) and returns the copy; else the error for the first page that could
/// not be read (see the module docs).
pub(crate) fn copy_readable<'o>(
    path: &Path,
    map: &[u8],
    bytes: &[u8],
    out: &'o mut Vec<u8>,
) -> Result<&'o [u8]> {
    copy_mapped(
        path,
        Some((map.as_ptr() as usize, map.len() as u64)),
        bytes,
        out,
    )
}

/// [`copy_readable`] where the map is known by its start address and the file's length when
/// it was mapped (`None`: unknown, and the error names no byte).
pub(crate) fn copy_mapped<'o>(
    path: &Path,
    map: Option<(usize, u64)>,
    bytes: &[u8],
    out: &'o mut Vec<u8>,
) -> Result<&'o [u8]> {
    match copy_into(bytes, out) {
        Ok(()) => Ok(out),
        Err(fault) => Err(unreadable(path, map, fault)),
    }
}

/// Touches every page under `bytes`, part of the map of the file at `path` whose whole mapping
/// is `map`: `Ok` when each could be read, else the error for the first that could not.
pub(crate) fn check_readable(path: &Path, map: &[u8], bytes: &[u8]) -> Result<()> {
    fault_in(bytes)
        .map_err(|fault| unreadable(path, Some((map.as_ptr() as usize, map.len() as u64)), fault))
}

/// The error for the faulting address `fault` in the map `map` of the file at `path`.
fn unreadable(path: &Path, map: Option<(usize, u64)>, fault: usize) -> Error {
    let byte = map.map(|(start, _)| fault.saturating_sub(start));
    let at = byte.map_or_else(|| "a byte".to_string(), |byte| format!("byte {byte}"));
    let shrank = map.and_then(|(_, len)| shrank(path, len, &format!(", and {at} is gone")));
    match shrank {
        Some(e) => e,
        None => Error::Io {
            path: path.to_path_buf(),
            source: io::Error::other(format!(
                "{at} could not be read through the file's map: the disk or network \
                 filesystem failed to supply its page (an I/O error)"
            )),
        },
    }
}

/// [`Error::FileChanged`] when the file at `path` is now shorter than the `len` bytes it had
/// when mapped (`more` is added to what it says). A cut inside a page leaves the rest of that
/// page reading as zeros, not SIGBUS: a reader whose record fails its checksum asks this
/// before calling the record damaged.
pub(crate) fn shrank(path: &Path, len: u64, more: &str) -> Option<Error> {
    let now = std::fs::metadata(path).ok()?.len();
    (now < len).then(|| Error::FileChanged {
        path: path.to_path_buf(),
        change: format!("it shrank to {now} bytes from {len} while mapped{more}"),
    })
}

/// The step between the addresses [`fault_in`] touches: the smallest page size there is (larger
/// pages are touched more than once, which costs a few loads). A scan that meets an unreadable
/// byte can skip to the next multiple of it.
pub(crate) const TOUCH_STRIDE: usize = 4096;

/// The offset in `bytes` of the first byte after the page that holds the address `fault` (one
/// [`fault_in`] returned for part of `bytes`): where a scan goes on after an unreadable page.
pub(crate) fn past_page_of(bytes: &[u8], fault: usize) -> usize {
    let next_page = (fault / TOUCH_STRIDE + 1) * TOUCH_STRIDE;
    next_page.saturating_sub(bytes.as_ptr() as usize)
}

/// Copies `bytes` into `out` (cleared first): `Err` with the address that faulted when the
/// kernel could not supply a page of `bytes` (SIGBUS, caught; `out` is then empty).
pub(crate) fn copy_into(bytes: &[u8], out: &mut Vec<u8>) -> std::result::Result<(), usize> {
    out.clear();
    out.reserve(bytes.len());
    // SAFETY: the spare capacity holds at least `bytes.len()` bytes, and it is not a part of
    // `bytes` (which is borrowed while `out` is borrowed mutably).
    unsafe { copy_raw(out.spare_capacity_mut().as_mut_ptr().cast::<u8>(), bytes) }?;
    // SAFETY: the routine wrote all `bytes.len()` bytes of the spare capacity (it returned 0).
    unsafe { out.set_len(bytes.len()) };
    Ok(())
}

/// Copies `src` (part of a file's map) into `dst`, of the same length: `Err` with the faulting
/// address (and `dst` partly written) when a page of `src` is unreadable.
pub(crate) fn copy_to_slice(dst: &mut [u8], src: &[u8]) -> std::result::Result<(), usize> {
    assert_eq!(dst.len(), src.len(), "copy_to_slice needs equal lengths");
    // SAFETY: `dst` is writable for `src.len()` bytes and, borrowed mutably, does not overlap
    // `src`.
    unsafe { copy_raw(dst.as_mut_ptr(), src) }
}

/// The guarded copy of `src` to `dst`.
///
/// # Safety
/// `dst` is valid for writes of `src.len()` bytes and does not overlap `src`.
unsafe fn copy_raw(dst: *mut u8, src: &[u8]) -> std::result::Result<(), usize> {
    if src.is_empty() {
        return Ok(());
    }
    #[cfg(guarded_touch)]
    {
        install_handler();
        // SAFETY: `src` is a live slice and `dst` is writable for as many bytes (the caller's
        // promise): the routine reads `src.len()` bytes from the one and writes as many to the
        // other, and clobbers only registers the C ABI lets it (see the assembly below).
        let fault = unsafe { imagefeed_copy_bytes(dst, src.as_ptr(), src.len()) };
        if fault == 0 { Ok(()) } else { Err(fault) }
    }
    #[cfg(not(guarded_touch))]
    {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }
}

/// Touches one byte of every page under `bytes`: `Err` with the address that faulted when
/// the kernel could not supply a page (SIGBUS, caught).
pub(crate) fn fault_in(bytes: &[u8]) -> std::result::Result<(), usize> {
    if bytes.is_empty() {
        return Ok(());
    }
    #[cfg(guarded_touch)]
    {
        install_handler();
        // SAFETY: `bytes` is a live slice, so every address the routine loads (its first byte,
        // each 4 KiB boundary inside it, all below its end) lies in memory mapped readable for
        // the duration of the call; the routine writes nothing but its scratch registers,
        // which the C ABI lets it clobber.
        let fault = unsafe { imagefeed_touch_pages(bytes.as_ptr(), bytes.len()) };
        if fault == 0 { Ok(()) } else { Err(fault) }
    }
    #[cfg(not(guarded_touch))]
    {
        let mut at = 0;
        while at < bytes.len() {
            // SAFETY: `at` is within `bytes`.
            unsafe { std::ptr::read_volatile(bytes.as_ptr().add(at)) };
            at = (at & !(TOUCH_STRIDE - 1)) + TOUCH_STRIDE;
        }
        Ok(())
    }
}

#[cfg(guarded_touch)]
unsafe extern "C" {
    /// Loads one byte at `ptr` and at every 4 KiB boundary in `ptr + 1 .. ptr + len`;
    /// returns 0, or the faulting address when [`on_sigbus`] resumed it at the common exit.
    fn imagefeed_touch_pages(ptr: *const u8, len: usize) -> usize;
    /// Copies `len` bytes from `src` to `dst`; returns 0, or the faulting address when
    /// [`on_sigbus`] resumed it at the common exit.
    fn imagefeed_copy_bytes(dst: *mut u8, src: *const u8, len: usize) -> usize;
    /// The touch routine's load instruction.
    static imagefeed_touch_load: u8;
    /// The copy routine's load instruction (`rep movsb` on x86-64; the 16-byte load on
    /// AArch64, whose byte tail has [`imagefeed_copy_tail_load`]).
    static imagefeed_copy_load: u8;
    /// The AArch64 copy's byte-tail load (on x86-64, the same address as the copy's load).
    static imagefeed_copy_tail_load: u8;
    /// The common exit [`on_sigbus`] resumes a routine at, with the faulting address in the
    /// result register. Every routine is a leaf that keeps nothing on the stack, so one `ret`
    /// serves them all.
    static imagefeed_guard_fault: u8;
}

// x86-64 System V: arguments in rdi, rsi, rdx; result in rax; rcx and the direction flag
// (clear on entry, by the ABI) are the caller's to lose.
#[cfg(all(guarded_touch, target_arch = "x86_64"))]
std::arch::global_asm!(
    ".text",
    ".p2align 4",
    ".globl imagefeed_touch_pages",
    ".hidden imagefeed_touch_pages",
    ".type imagefeed_touch_pages, @function",
    "imagefeed_touch_pages:",       // rdi = ptr, rsi = len (non-zero)
    "    lea rsi, [rdi + rsi - 1]", // the last byte
    ".globl imagefeed_touch_load",
    ".hidden imagefeed_touch_load",
    "imagefeed_touch_load:",
    "    movzx eax, byte ptr [rdi]",
    "    and rdi, -4096",
    "    add rdi, 4096", // the next page
    "    cmp rdi, rsi",
    "    jbe imagefeed_touch_load",
    "    xor eax, eax",
    "    ret",
    ".size imagefeed_touch_pages, . - imagefeed_touch_pages",
    "",
    ".p2align 4",
    ".globl imagefeed_copy_bytes",
    ".hidden imagefeed_copy_bytes",
    ".type imagefeed_copy_bytes, @function",
    "imagefeed_copy_bytes:", // rdi = dst, rsi = src, rdx = len (non-zero)
    "    mov rcx, rdx",
    // A fault leaves rip at this instruction (it restarts where it stopped).
    ".globl imagefeed_copy_load",
    ".hidden imagefeed_copy_load",
    ".globl imagefeed_copy_tail_load",
    ".hidden imagefeed_copy_tail_load",
    "imagefeed_copy_load:",
    "imagefeed_copy_tail_load:",
    "    rep movsb",
    "    xor eax, eax",
    "    ret",
    ".size imagefeed_copy_bytes, . - imagefeed_copy_bytes",
    "",
    ".globl imagefeed_guard_fault",
    ".hidden imagefeed_guard_fault",
    "imagefeed_guard_fault:",
    "    ret", // rax holds the faulting address (set by the handler)
);

// AArch64 (AAPCS64): arguments in x0, x1, x2; result in x0; x3 and v0 are the caller's to lose.
#[cfg(all(guarded_touch, target_arch = "aarch64"))]
std::arch::global_asm!(
    ".text",
    ".p2align 4",
    ".globl imagefeed_touch_pages",
    ".hidden imagefeed_touch_pages",
    ".type imagefeed_touch_pages, %function",
    "imagefeed_touch_pages:", // x0 = ptr, x1 = len (non-zero)
    "    add x1, x0, x1",
    "    sub x1, x1, #1", // the last byte
    ".globl imagefeed_touch_load",
    ".hidden imagefeed_touch_load",
    "imagefeed_touch_load:",
    "    ldrb w2, [x0]",
    "    and x0, x0, #0xfffffffffffff000",
    "    add x0, x0, #4096", // the next page
    "    cmp x0, x1",
    "    b.ls imagefeed_touch_load",
    "    mov x0, #0",
    "    ret",
    ".size imagefeed_touch_pages, . - imagefeed_touch_pages",
    "",
    ".p2align 4",
    ".globl imagefeed_copy_bytes",
    ".hidden imagefeed_copy_bytes",
    ".type imagefeed_copy_bytes, %function",
    "imagefeed_copy_bytes:", // x0 = dst, x1 = src, x2 = len (non-zero)
    "    cmp x2, #16",
    "    b.lo 2f",
    "1:",
    ".globl imagefeed_copy_load",
    ".hidden imagefeed_copy_load",
    "imagefeed_copy_load:",
    "    ldr q0, [x1], #16",
    "    str q0, [x0], #16",
    "    sub x2, x2, #16",
    "    cmp x2, #16",
    "    b.hs 1b",
    "2:",
    "    cbz x2, 4f",
    "3:",
    ".globl imagefeed_copy_tail_load",
    ".hidden imagefeed_copy_tail_load",
    "imagefeed_copy_tail_load:",
    "    ldrb w3, [x1], #1",
    "    strb w3, [x0], #1",
    "    subs x2, x2, #1",
    "    b.ne 3b",
    "4:",
    "    mov x0, #0",
    "    ret",
    ".size imagefeed_copy_bytes, . - imagefeed_copy_bytes",
    "",
    ".globl imagefeed_guard_fault",
    ".hidden imagefeed_guard_fault",
    "imagefeed_guard_fault:",
    "    ret", // x0 holds the faulting address (set by the handler)
);

/// The SIGBUS action that was in place when ours was last put in front, which every signal
/// not ours is passed to; null until then. Each one recorded is leaked: the handler may be
/// reading it on another thread when a later [`claim`] records the next, and a new one is
/// recorded only when another handler has taken SIGBUS since.
#[cfg(guarded_touch)]
static PREVIOUS: std::sync::atomic::AtomicPtr<libc::sigaction> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// What [`pass_on`] keeps per thread (by thread id modulo [`THREAD_SLOTS`]; no thread-local
/// storage, whose first use in a loaded library can allocate, which a handler must not): whether
/// the thread is inside a handler ours passed a signal to, and the last fault passed on that
/// left ours in place (address, instruction, when).
#[cfg(guarded_touch)]
struct ThreadSlot {
    tid: std::sync::atomic::AtomicI32,
    passing: std::sync::atomic::AtomicBool,
    address: std::sync::atomic::AtomicUsize,
    pc: std::sync::atomic::AtomicUsize,
    at_ns: std::sync::atomic::AtomicU64,
}

#[cfg(guarded_touch)]
const THREAD_SLOTS: usize = 64;

#[cfg(guarded_touch)]
static THREADS: [ThreadSlot; THREAD_SLOTS] = [const {
    ThreadSlot {
        tid: std::sync::atomic::AtomicI32::new(0),
        passing: std::sync::atomic::AtomicBool::new(false),
        address: std::sync::atomic::AtomicUsize::new(0),
        pc: std::sync::atomic::AtomicUsize::new(0),
        at_ns: std::sync::atomic::AtomicU64::new(0),
    }
}; THREAD_SLOTS];

/// A fault that comes back within this long, at the same address and instruction of the same
/// thread, after the handler it was passed to returned leaving ours in place, recurs forever.
#[cfg(guarded_touch)]
const RECURS_WITHIN_NS: u64 = 100_000_000;

/// True once [`claim`] has put ours in place in this process.
#[cfg(guarded_touch)]
static CLAIMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Installs [`on_sigbus`] on the first guarded read (one atomic load on every later one).
#[cfg(guarded_touch)]
fn install_handler() {
    if !CLAIMED.load(Ordering::Acquire) {
        claim();
    }
}

/// Puts [`on_sigbus`] in front again if a handler installed since took SIGBUS, keeping that
/// one as the action every signal not ours is passed to. PyTorch's DataLoader installs its own
/// SIGBUS handler in each worker process it forks, after the parent opened (and so guarded)
/// the dataset; Python's `faulthandler.enable()` can come after the first read. Either would
/// otherwise take the signal first and end the process on a page the guard was there to
/// catch. One `sigaction` query when ours is in place; called at each open, each batch a
/// loader worker builds and each call of the Python package's `Dataset` that reads (not in a
/// Rust reader's loop over records: the query is a system call). A handler recorded here stays
/// the next in line after it puts ours back itself (`faulthandler.disable()`): a SIGBUS sent by
/// `kill` then reaches it, and a disabled `faulthandler` lets it pass.
pub(crate) fn claim() {
    #[cfg(guarded_touch)]
    // SAFETY: `sigaction` with zeroed structs whose handler, flags and mask are set: ours has
    // the SA_SIGINFO signature. The action it replaces is recorded (leaked, never freed) before
    // ours is installed, so the handler never passes a signal to an action not yet recorded;
    // a SIGBUS before the first record finds none and takes the default action (`pass_on`).
    // Two threads claiming at once both find the same other action and record it twice.
    unsafe {
        let ours = on_sigbus as *const () as usize;
        let mut current: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut current) != 0 {
            return;
        }
        if current.sa_sigaction == ours {
            CLAIMED.store(true, Ordering::Release);
            return;
        }
        let recorded = PREVIOUS.load(Ordering::Acquire);
        let same = !recorded.is_null()
            && (*recorded).sa_sigaction == current.sa_sigaction
            && (*recorded).sa_flags == current.sa_flags;
        if !same {
            PREVIOUS.store(Box::into_raw(Box::new(current)), Ordering::Release);
        }
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = ours;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        let mut replaced: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, &action, &mut replaced) == 0
            && replaced.sa_sigaction != current.sa_sigaction
            && replaced.sa_sigaction != ours
        {
            // Another thread installed a handler between the query and ours: that one is next.
            PREVIOUS.store(Box::into_raw(Box::new(replaced)), Ordering::Release);
        }
        CLAIMED.store(true, Ordering::Release);
    }
}

/// The SIGBUS handler: a fault at one of the routines' load instructions resumes the routine at
/// the common exit with the faulting address as its result; anything else goes to the
/// previous action.
#[cfg(guarded_touch)]
extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    let loads = [
        &raw const imagefeed_touch_load as usize,
        &raw const imagefeed_copy_load as usize,
        &raw const imagefeed_copy_tail_load as usize,
    ];
    let resume = &raw const imagefeed_guard_fault as usize;
    // SAFETY: the kernel passes a valid siginfo and ucontext to an SA_SIGINFO handler; the
    // registers it saved are the interrupted thread's and are restored from it on return.
    // A signal sent by a process (si_code <= 0) never counts as a routine's fault.
    unsafe {
        let context = &mut *(context as *mut libc::ucontext_t);
        let address = (*info).si_addr() as usize;
        let fault = (*info).si_code > 0;
        #[cfg(target_arch = "x86_64")]
        {
            let registers = &mut context.uc_mcontext.gregs;
            if fault && loads.contains(&(registers[libc::REG_RIP as usize] as usize)) {
                registers[libc::REG_RIP as usize] = resume as i64;
                registers[libc::REG_RAX as usize] = address.max(1) as i64;
                return;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            let registers = &mut context.uc_mcontext;
            if fault && loads.contains(&(registers.pc as usize)) {
                registers.pc = resume as u64;
                registers.regs[0] = address.max(1) as u64;
                return;
            }
        }
        pass_on(
            signal,
            info,
            context as *mut libc::ucontext_t as *mut libc::c_void,
        );
    }
}

/// Hands a SIGBUS that is not ours to the action that was in place before ours: its handler,
/// or (default or none) the default action, raised again so that it takes effect whether the
/// signal came from a fault (which would recur on return anyway) or from `kill`. A handler that
/// answers a signal from `kill` by restoring the default action and returning, as Rust's own
/// does (it expects a fault to recur), would leave the process running with no handler at all:
/// that signal is raised again, so it ends the process as the default action says. A handler
/// put behind ours by [`claim`] may hand the signal back to ours, and the two would pass it to
/// and fro forever; each way ends with the default action instead: one that calls the handler
/// it replaced (ours) as a function (trap handlers of other runtimes, another copy of this
/// library) re-enters ours on the same thread; Python's `faulthandler` restores the action it
/// replaced (ours) and raises the signal again, for each signal, leaving it pending; a
/// `signal.signal` handler only notes the signal and returns, and the same thread then faults
/// at the same address and instruction again within 100 ms. (A handler that mends the page
/// and returns, or resumes the thread elsewhere, sees its fault once.)
///
/// # Safety
/// Only from [`on_sigbus`], with the arguments it was given.
#[cfg(guarded_touch)]
unsafe fn pass_on(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let previous = PREVIOUS.load(Ordering::Acquire);
    // SAFETY: (for the whole block) a recorded action is never freed; the previous action's
    // handler was installed for this signal with these flags, so calling it as the kernel would
    // is what it expects; `syscall(gettid)`, `clock_gettime`, `sigaction`, `sigpending` and
    // `raise` are async-signal-safe.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as i32;
        let slot = &THREADS[tid as usize % THREAD_SLOTS];
        if slot.tid.load(Ordering::Relaxed) == tid && slot.passing.load(Ordering::Relaxed) {
            // Back in ours from the handler ours passed the signal to, on the same thread: it
            // passes signals on to the one it replaced (ours) by calling it, and the two would
            // call each other until the stack ran out.
            end_with(signal);
            return;
        }
        if slot.tid.swap(tid, Ordering::Relaxed) != tid {
            slot.address.store(0, Ordering::Relaxed);
        }
        let previous = previous.as_ref();
        let handler = previous.map_or(libc::SIG_DFL, |p| p.sa_sigaction);
        let sent = (*info).si_code <= 0;
        if handler == libc::SIG_IGN && sent {
            // Sent by a process, and ignored before imagefeed was loaded: still ignored.
            return;
        }
        if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
            end_with(signal);
            return;
        }
        let pc = instruction_of(context);
        slot.passing.store(true, Ordering::Relaxed);
        if previous.is_some_and(|p| p.sa_flags & libc::SA_SIGINFO != 0) {
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(handler);
            handler(signal, info, context);
        } else {
            let handler: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
            handler(signal);
        }
        slot.passing.store(false, Ordering::Relaxed);
        let mut now: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, std::ptr::null(), &mut now) != 0 {
            return;
        }
        if now.sa_sigaction == libc::SIG_DFL {
            if sent {
                libc::raise(signal);
            }
        } else if now.sa_sigaction == on_sigbus as *const () as usize {
            let mut pending: libc::sigset_t = std::mem::zeroed();
            let raised_again =
                libc::sigpending(&mut pending) == 0 && libc::sigismember(&pending, signal) == 1;
            // A handler that resumed the thread elsewhere dealt with the fault.
            let recurs = !sent && instruction_of(context) == pc && {
                let address = (*info).si_addr() as usize;
                let mut clock: libc::timespec = std::mem::zeroed();
                libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut clock);
                let at = (clock.tv_sec as u64)
                    .saturating_mul(1_000_000_000)
                    .saturating_add(clock.tv_nsec as u64);
                let same = slot.address.load(Ordering::Relaxed) == address
                    && slot.pc.load(Ordering::Relaxed) == pc
                    && at.saturating_sub(slot.at_ns.load(Ordering::Relaxed)) < RECURS_WITHIN_NS;
                slot.address.store(address, Ordering::Relaxed);
                slot.pc.store(pc, Ordering::Relaxed);
                slot.at_ns.store(at, Ordering::Relaxed);
                same
            };
            if raised_again || recurs {
                end_with(signal);
            }
        }
    }
}

/// The address of the instruction the interrupted thread resumes at.
///
/// # Safety
/// `context` is the `ucontext_t` the kernel passed to an SA_SIGINFO handler.
#[cfg(guarded_touch)]
unsafe fn instruction_of(context: *mut libc::c_void) -> usize {
    // SAFETY: the caller's promise.
    let context = unsafe { &*(context as *const libc::ucontext_t) };
    #[cfg(target_arch = "x86_64")]
    {
        context.uc_mcontext.gregs[libc::REG_RIP as usize] as usize
    }
    #[cfg(target_arch = "aarch64")]
    {
        context.uc_mcontext.pc as usize
    }
}

/// Restores the default action for `signal` and raises it: delivered when the handler
/// returns (it is blocked until then), it ends the process.
///
/// # Safety
/// Only from a signal handler for `signal`.
#[cfg(guarded_touch)]
unsafe fn end_with(signal: libc::c_int) {
    // SAFETY: `sigaction` and `raise` are async-signal-safe; the struct is fully initialised.
    unsafe {
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut default.sa_mask);
        libc::sigaction(signal, &default, std::ptr::null_mut());
        libc::raise(signal);
    }
}

/// `bytes` written to a file, mapped, and the file then cut to `keep` bytes: reading the map
/// past `keep` (rounded up to a page) is SIGBUS unless guarded. The directory holds the file,
/// at the path returned.
#[cfg(test)]
pub(crate) fn map_then_cut(
    bytes: &[u8],
    keep: u64,
) -> (tempfile::TempDir, std::path::PathBuf, memmap2::Mmap) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.bin");
    std::fs::write(&path, bytes).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    // SAFETY: a test's own file, cut on purpose; read only through the guard.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let cut = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    cut.set_len(keep).unwrap();
    (dir, path, map)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `pages` pages mapped, then cut to `keep` bytes ([`map_then_cut`]).
    fn truncated_map(
        pages: usize,
        keep: u64,
    ) -> (tempfile::TempDir, std::path::PathBuf, memmap2::Mmap) {
        map_then_cut(&vec![5u8; pages * 4096], keep)
    }

    #[test]
    fn readable_pages_pass() {
        let (_dir, path, map) = truncated_map(4, 4 * 4096);
        for (start, end) in [
            (0, 1),
            (0, 4 * 4096),
            (4095, 4097),
            (100, 3 * 4096 + 1),
            (8192, 8192),
        ] {
            assert_eq!(fault_in(&map[start..end]), Ok(()), "{start}..{end}");
            check_readable(&path, &map, &map[start..end]).unwrap();
        }
    }

    #[cfg(guarded_touch)]
    #[test]
    fn a_page_past_a_truncation_is_an_error_not_sigbus() {
        let (_dir, path, map) = truncated_map(4, 4096 + 10);
        // The first two pages are still in the file.
        assert_eq!(fault_in(&map[..2 * 4096]), Ok(()));
        // From the third on, the fault's address is the first byte of the missing page the
        // routine touched (a range's first byte, or a page boundary inside it).
        let base = map.as_ptr() as usize;
        assert_eq!(fault_in(&map[3 * 4096 + 7..]), Err(base + 3 * 4096 + 7));
        assert_eq!(fault_in(&map[100..3 * 4096 + 8]), Err(base + 2 * 4096));
        // Twice in a row, and from another thread: the handler stays in place.
        assert_eq!(fault_in(&map[2 * 4096..]), Err(base + 2 * 4096));
        let at = std::thread::scope(|s| s.spawn(|| fault_in(&map[2 * 4096 + 1..])).join().unwrap());
        assert_eq!(at, Err(base + 2 * 4096 + 1));
        match check_readable(&path, &map, &map[3 * 4096..]) {
            Err(Error::FileChanged { path: p, change }) => {
                assert_eq!(p, path);
                assert!(change.contains("byte 12288 is gone"), "{change}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[cfg(guarded_touch)]
    #[test]
    fn a_copy_past_a_truncation_is_an_error_and_leaves_nothing() {
        let (_dir, path, map) = truncated_map(4, 2 * 4096);
        let mut out = vec![1, 2, 3];
        // Lengths around the routines' 16-byte steps, inside the pages still there.
        for (start, end) in [(0, 1), (5, 21), (0, 2 * 4096), (4090, 4096 + 17)] {
            assert_eq!(
                copy_into(&map[start..end], &mut out),
                Ok(()),
                "{start}..{end}"
            );
            assert_eq!(out, &map[start..end], "{start}..{end}");
        }
        let base = map.as_ptr() as usize;
        // Across the cut: the fault is the first byte of the first missing page.
        assert_eq!(
            copy_into(&map[4000..3 * 4096], &mut out),
            Err(base + 2 * 4096)
        );
        assert!(out.is_empty());
        assert_eq!(
            copy_into(&map[3 * 4096 + 9..], &mut out),
            Err(base + 3 * 4096 + 9)
        );
        // Fewer than 16 bytes: AArch64's byte tail faults, not its 16-byte loop.
        assert_eq!(
            copy_into(&map[2 * 4096 - 5..2 * 4096 + 3], &mut out),
            Err(base + 2 * 4096)
        );
        let mut buffer = Vec::new();
        match copy_readable(&path, &map, &map[2 * 4096 - 3..], &mut buffer) {
            Err(Error::FileChanged { change, .. }) => {
                assert!(change.contains("byte 8192 is gone"), "{change}");
            }
            other => panic!("{other:?}"),
        }
        // And the map's pages that are there still copy.
        assert_eq!(
            copy_readable(&path, &map, &map[..9], &mut buffer).unwrap(),
            &map[..9]
        );
    }

    /// Runs the ignored test `name` of this binary in a child process; its exit status (a
    /// signal passed on wrongly would leave it faulting forever: killed after 60 s).
    #[cfg(guarded_touch)]
    fn child_status(name: &str) -> std::process::ExitStatus {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "--ignored", name])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if started.elapsed() > std::time::Duration::from_secs(60) {
                child.kill().unwrap();
                panic!("{name} still runs after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// A SIGBUS anywhere else still ends the process, as it would without imagefeed, whether
    /// from a fault or sent by `kill`: run in child processes (this test binary, filtered to
    /// the tests below).
    #[cfg(guarded_touch)]
    #[test]
    fn a_sigbus_elsewhere_still_ends_the_process() {
        use std::os::unix::process::ExitStatusExt as _;
        for child in [
            "mapguard::tests::child_reads_past_a_truncation",
            "mapguard::tests::child_is_sent_sigbus",
        ] {
            let status = child_status(child);
            assert_eq!(status.signal(), Some(libc::SIGBUS), "{child}: {status:?}");
        }
    }

    #[cfg(guarded_touch)]
    #[test]
    #[ignore = "the child process of a_sigbus_elsewhere_still_ends_the_process"]
    fn child_reads_past_a_truncation() {
        let (_dir, _path, map) = truncated_map(2, 0);
        // The guard is installed and catches its own fault...
        assert!(fault_in(&map[..1]).is_err());
        // ...but a plain read is not its to catch.
        // SAFETY: within the map; the file behind it is gone, which is the point: SIGBUS.
        let byte = unsafe { std::ptr::read_volatile(map.as_ptr().add(4096)) };
        panic!("read {byte} past the end of a truncated file");
    }

    #[cfg(guarded_touch)]
    #[test]
    #[ignore = "the child process of a_sigbus_elsewhere_still_ends_the_process"]
    fn child_is_sent_sigbus() {
        let (_dir, _path, map) = truncated_map(2, 0);
        assert!(fault_in(&map[..1]).is_err());
        // Rust's own handler (installed before ours, in this test binary's main thread) answers
        // a SIGBUS that no fault explains by restoring the default action and returning: the
        // process would go on, with no guard left.
        // SAFETY: raising a signal in this process is what the test is for.
        unsafe { libc::raise(libc::SIGBUS) };
        std::thread::sleep(std::time::Duration::from_millis(200));
        panic!("still running after a SIGBUS sent to the process");
    }
    /// Which step a child below has reached, for the exit status of [`exits_with_stage`].
    #[cfg(guarded_touch)]
    static STAGE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

    /// A handler like PyTorch's in its DataLoader workers: ends the process, here with a status
    /// that says which step the child had reached.
    #[cfg(guarded_touch)]
    extern "C" fn exits_with_stage(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
        // SAFETY: `_exit` is async-signal-safe.
        unsafe { libc::_exit(40 + STAGE.load(Ordering::SeqCst)) };
    }

    /// The action [`puts_the_old_one_back`] replaced.
    #[cfg(guarded_touch)]
    static REPLACED: std::sync::OnceLock<libc::sigaction> = std::sync::OnceLock::new();

    /// A handler like Python's `faulthandler`: puts back the action it replaced and raises
    /// the signal again for it.
    #[cfg(guarded_touch)]
    extern "C" fn puts_the_old_one_back(
        signal: libc::c_int,
        _: *mut libc::siginfo_t,
        _: *mut libc::c_void,
    ) {
        // SAFETY: `sigaction` and `raise` are async-signal-safe; REPLACED was set before this
        // handler was installed.
        unsafe {
            libc::sigaction(signal, REPLACED.get().unwrap(), std::ptr::null_mut());
            libc::raise(signal);
        }
    }

    /// A handler like one set with Python's `signal.signal`: notes the signal and returns.
    #[cfg(guarded_touch)]
    extern "C" fn only_returns(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

    /// Installs `handler` for SIGBUS in front of whatever is there (ours, in the children),
    /// keeping what it replaces in [`REPLACED`].
    #[cfg(guarded_touch)]
    fn install_after_ours(
        handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void),
        flags: libc::c_int,
    ) {
        // SAFETY: a zeroed action with an SA_SIGINFO handler, flags and an empty mask.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | flags;
            libc::sigemptyset(&mut action.sa_mask);
            let mut replaced: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGBUS, &action, &mut replaced), 0);
            let ours = on_sigbus as *const () as usize;
            assert_eq!(replaced.sa_sigaction, ours, "the guard was not in place");
            let _ = REPLACED.set(replaced);
        }
    }

    /// A SIGBUS handler installed after the guard (PyTorch's DataLoader installs one in each
    /// worker process it forks; Python's `faulthandler.enable()`) is put behind it by
    /// [`claim`]: the guard catches its faults again, and every other SIGBUS reaches the
    /// handler found, or ends the process when that handler would have the fault recur
    /// forever.
    #[cfg(guarded_touch)]
    #[test]
    fn a_handler_installed_later_goes_behind_the_guard() {
        use std::os::unix::process::ExitStatusExt as _;
        let status = child_status("mapguard::tests::child_claims_back_from_a_later_handler");
        // 41: the guarded read went to the later handler; 42: it was caught, and the plain
        // read after it went to the later handler.
        assert_eq!(status.code(), Some(42), "{status:?}");
        for child in [
            "mapguard::tests::child_faults_under_a_handler_that_puts_ours_back",
            "mapguard::tests::child_faults_under_a_handler_that_only_returns",
            "mapguard::tests::child_faults_under_a_handler_that_calls_ours",
        ] {
            let status = child_status(child);
            assert_eq!(status.signal(), Some(libc::SIGBUS), "{child}: {status:?}");
        }
    }

    #[cfg(guarded_touch)]
    #[test]
    #[ignore = "a child process of a_handler_installed_later_goes_behind_the_guard"]
    fn child_claims_back_from_a_later_handler() {
        let (_dir, _path, map) = truncated_map(2, 0);
        assert!(fault_in(&map[..1]).is_err());
        install_after_ours(exits_with_stage, 0);
        STAGE.store(1, Ordering::SeqCst);
        claim();
        assert!(fault_in(&map[..1]).is_err());
        let mut out = Vec::new();
        assert!(copy_into(&map[4090..4100], &mut out).is_err());
        STAGE.store(2, Ordering::SeqCst);
        // SAFETY: within the map; the file behind it is gone: SIGBUS, for the later handler.
        let byte = unsafe { std::ptr::read_volatile(map.as_ptr().add(4096)) };
        panic!("read {byte} past the end of a truncated file");
    }

    #[cfg(guarded_touch)]
    #[test]
    #[ignore = "a child process of a_handler_installed_later_goes_behind_the_guard"]
    fn child_faults_under_a_handler_that_puts_ours_back() {
        fault_behind_the_guard(puts_the_old_one_back, libc::SA_NODEFER);
    }

    /// With `handler` installed after the guard (`flags` added) and put behind it again, the
    /// guard still catches its own faults; then a plain read past a truncation, for `handler`.
    #[cfg(guarded_touch)]
    fn fault_behind_the_guard(
        handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void),
        flags: libc::c_int,
    ) -> ! {
        let (_dir, _path, map) = truncated_map(2, 0);
        assert!(fault_in(&map[..1]).is_err());
        install_after_ours(handler, flags);
        claim();
        assert!(fault_in(&map[..1]).is_err());
        // SAFETY: within the map; the file behind it is gone: SIGBUS, not the guard's.
        let byte = unsafe { std::ptr::read_volatile(map.as_ptr().add(4096)) };
        panic!("read {byte} past the end of a truncated file");
    }

    #[cfg(guarded_touch)]
    #[test]
    #[ignore = "a child process of a_handler_installed_later_goes_behind_the_guard"]
    fn child_faults_under_a_handler_that_only_returns() {
        fault_behind_the_guard(only_returns, 0);
    }

    /// A handler like another runtime's trap handler, or another copy of this library: passes
    /// the signal on by calling the handler it replaced (ours) as a function.
    #[cfg(guarded_touch)]
    extern "C" fn calls_the_old_one(
        signal: libc::c_int,
        info: *mut libc::siginfo_t,
        context: *mut libc::c_void,
    ) {
        let replaced = REPLACED.get().unwrap().sa_sigaction;
        // SAFETY: the replaced action is ours, an SA_SIGINFO handler.
        unsafe {
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(replaced);
            handler(signal, info, context);
        }
    }

    #[cfg(guarded_touch)]
    #[test]
    #[ignore = "a child process of a_handler_installed_later_goes_behind_the_guard"]
    fn child_faults_under_a_handler_that_calls_ours() {
        fault_behind_the_guard(calls_the_old_one, 0);
    }
}
