//! The harness around `imagefeed::fuzzing`: an allocator that turns an allocation beyond a
//! stated bound into a crash the fuzzer records, and the corpus layout.
//!
//! - `fuzz/corpus/<target>/`: the minimized inputs AFL++ found (committed; replayed by
//!   `cargo test`).
//! - `fuzz/regressions/<target>/`: inputs that once crashed, hung or over-allocated, each kept
//!   beside the fix (replayed by `cargo test`).
//!
//! See TESTING.md for how to run the fuzzers (`make fuzz`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The largest single allocation a target may make: 64 MiB. The fuzz decoders' pixel limit
/// (4 MP) needs at most 16 MiB per buffer; anything near this bound means a count or size from
/// the input drove an allocation.
pub const MAX_ALLOCATION: usize = 64 << 20;

/// The most a target may hold at once: 512 MiB.
pub const MAX_LIVE: usize = 512 << 20;

static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, aborting the process (a crash to AFL++, a failed replay to
/// `cargo test`) on an allocation over [`MAX_ALLOCATION`] or with more than [`MAX_LIVE`] live.
pub struct BoundedAlloc;

fn over_bound(what: &'static [u8]) -> ! {
    // No formatting: allocating here would recurse.
    let _ = std::io::stderr().write_all(what);
    std::process::abort()
}

fn account(size: usize) {
    if size > MAX_ALLOCATION {
        over_bound(b"imagefeed-fuzz: one allocation over MAX_ALLOCATION (64 MiB)\n");
    }
    if LIVE.fetch_add(size, Ordering::Relaxed) + size > MAX_LIVE {
        over_bound(b"imagefeed-fuzz: more than MAX_LIVE (512 MiB) allocated\n");
    }
}

// SAFETY: every method forwards to `System` with the caller's layout and pointer unchanged; the
// accounting only reads sizes.
unsafe impl GlobalAlloc for BoundedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        account(layout.size());
        // SAFETY: forwarded as received.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        account(layout.size());
        // SAFETY: forwarded as received.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        account(new_size);
        // SAFETY: forwarded as received.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The `fuzz/` directory.
pub fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The files of `fuzz/<kind>/<target>/` (`kind`: `corpus` or `regressions`), sorted; none when
/// the directory does not exist.
pub fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}
