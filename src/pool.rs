//! Batch memory: where collate writes, and how it is reused.
//!
//! [`BatchAllocator`] is the one interface through which the loader gets memory, so a GPU feed can
//! supply page-locked buffers and collate writes straight into them (no extra copy). The default,
//! [`HeapAllocator`], gives 64-byte-aligned [`AlignedBuffer`]s (aligned for any element type and
//! for SIMD; from 1 MiB up, mappings of their own with huge pages). [`BufferPool`] keeps
//! returned buffers and hands them out again: in steady state no batch allocates. The mapped
//! buffers of a loader that is dropped are kept a moment longer for the process's next loader
//! (`SpareBuffers`).

use std::alloc::{Layout, dealloc};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

/// A block of host memory a batch is written into.
pub trait BatchMemory: Send + Sync {
    /// The whole block.
    fn as_slice(&self) -> &[u8];
    /// The whole block, writable.
    fn as_mut_slice(&mut self) -> &mut [u8];
}

/// Supplies [`BatchMemory`] blocks of at least a given size.
pub trait BatchAllocator: Send + Sync {
    /// A block of at least `bytes` bytes, aligned to at least 16 bytes.
    fn allocate(&self, bytes: usize) -> Box<dyn BatchMemory>;

    /// [`allocate`](Self::allocate), or `None` where the memory cannot be had (what the loader
    /// calls, so that running out is an error for the batch instead of an abort). The default
    /// calls `allocate`.
    fn try_allocate(&self, bytes: usize) -> Option<Box<dyn BatchMemory>> {
        Some(self.allocate(bytes))
    }
}

/// Alignment of [`AlignedBuffer`]s.
pub const ALIGNMENT: usize = 64;

/// Buffers of at least this many bytes are mapped from the kernel on their own (see
/// [`AlignedBuffer`]); smaller ones come from the heap.
const MAPPED_FROM: usize = 1 << 20;

/// The size of a transparent huge page on x86-64 and (with 4 KiB pages) arm64.
const HUGE_PAGE: usize = 2 << 20;

/// A 64-byte-aligned, zero-initialized block.
///
/// A batch buffer of 1 MiB or more is an anonymous mapping of its own, which the kernel hands
/// out zeroed as it is first written, and whose whole 2 MiB stretches are marked for
/// transparent huge pages (`MADV_HUGEPAGE`: the default "madvise" setting honours it). From
/// the heap, a 64-byte-aligned zeroed block is an `aligned_alloc` plus a `memset` that faults
/// in every 4 KiB page up front, before collate writes them all again: a new loader's first
/// batches of CIFAR-size images spent ~5% of their CPU time there.
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes mapped (`mmap`), or 0 for a heap block.
    mapped: usize,
}

// SAFETY: the buffer owns its allocation exclusively; &self gives only shared reads and
// &mut self exclusive writes, so moving or sharing it between threads is sound.
unsafe impl Send for AlignedBuffer {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// Allocates `len` zeroed bytes (at least one byte is reserved); aborts the process where
    /// the memory cannot be had, as `Vec` does.
    pub fn new(len: usize) -> AlignedBuffer {
        AlignedBuffer::try_new(len).unwrap_or_else(|| out_of_memory(len))
    }

    /// [`new`](Self::new), or `None` where the memory cannot be had (or `len` is past what a
    /// layout can hold).
    pub fn try_new(len: usize) -> Option<AlignedBuffer> {
        if len >= MAPPED_FROM {
            return AlignedBuffer::mapped(len);
        }
        let layout = Layout::from_size_align(len.max(1), ALIGNMENT).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(AlignedBuffer {
            ptr: NonNull::new(ptr)?,
            len,
            mapped: 0,
        })
    }

    /// `len` zeroed bytes in an anonymous mapping of their own (page-aligned, so 64-byte
    /// aligned too), huge pages asked for where whole ones fit.
    fn mapped(len: usize) -> Option<AlignedBuffer> {
        // Asked for as a multiple of the huge page size, so that the kernel aligns the start to
        // one (Linux 6.7+; elsewhere the advice covers what it can), then cut back to the pages
        // `len` needs: a whole 2 MiB stretch left past `len` would cost address space, and
        // under THP "always" a huge page for the last few bytes.
        let asked = len.checked_next_multiple_of(HUGE_PAGE)?;
        let kept = len.checked_next_multiple_of(page_size())?;
        Layout::from_size_align(asked, ALIGNMENT).ok()?;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to the range.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                asked,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        if kept < asked {
            // SAFETY: `kept..asked` is the page-aligned tail of the mapping just made, which
            // nothing refers to. Where it fails the buffer keeps it, and frees it with the rest.
            let cut = unsafe { libc::munmap(ptr.cast::<u8>().add(kept).cast(), asked - kept) };
            if cut != 0 {
                return AlignedBuffer::advised(ptr, len, asked);
            }
        }
        AlignedBuffer::advised(ptr, len, kept)
    }

    /// Whether a child forked later gets this mapping's contents (the default) or zeroed pages
    /// in its place (`MADV_WIPEONFORK`, Linux 4.14+). Advice only; a heap block is left as it is.
    fn inherit_on_fork(&self, inherit: bool) {
        if self.mapped == 0 {
            return;
        }
        let advice = if inherit {
            libc::MADV_KEEPONFORK
        } else {
            libc::MADV_WIPEONFORK
        };
        // SAFETY: advice on exactly the private anonymous mapping this buffer owns; it changes
        // no byte in this process.
        unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.mapped, advice) };
    }

    /// The buffer of `len` bytes at `ptr`, a mapping of `mapped` bytes, with `MADV_HUGEPAGE`
    /// over the whole huge pages inside `len`. Advice only; where it is refused, 4 KiB pages
    /// serve as well. (With THP's defrag set to "madvise", a first touch may compact memory to
    /// find a huge page: on a fragmented host, latency in collate instead of page faults.)
    fn advised(ptr: *mut libc::c_void, len: usize, mapped: usize) -> Option<AlignedBuffer> {
        let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
        let end = (ptr as usize + len) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: `start..end` lies inside the mapping at `ptr`.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
        Some(AlignedBuffer {
            ptr: NonNull::new(ptr.cast())?,
            len,
            mapped,
        })
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if self.mapped != 0 {
            // SAFETY: `ptr` and `mapped` are exactly the mapping `mapped` made, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
            return;
        }
        let layout =
            Layout::from_size_align(self.len.max(1), ALIGNMENT).expect("same layout as allocated");
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl BatchMemory for AlignedBuffer {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialized (zeroed, then written) bytes for the life
        // of `self`, and `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// The system's memory page size in bytes (4096 if it cannot be read).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf with a valid name has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// Aborts as `Vec` does when `len` bytes of batch memory cannot be had.
fn out_of_memory(len: usize) -> ! {
    std::alloc::handle_alloc_error(
        Layout::from_size_align(len.max(1), ALIGNMENT).unwrap_or(Layout::new::<u8>()),
    )
}

/// The default allocator: [`AlignedBuffer`]s, zeroed when new. Those of 1 MiB or more go to
/// the process's spare buffers when dropped (kept at most 2 s, 256 MiB in all), and a later
/// allocation of about their size takes one back as it is (holding what was last written to
/// it) instead of mapping memory the kernel must zero.
#[derive(Debug, Default, Clone, Copy)]
pub struct HeapAllocator;

/// The spare batch buffers of this process, shared by every [`HeapAllocator`].
static SPARE: SpareBuffers = SpareBuffers::new(SPARE_LIMIT, SPARE_KEPT_FOR);

/// At most this many bytes of spare buffers are kept.
const SPARE_LIMIT: usize = 256 << 20;
/// A spare buffer no allocation took within this long is unmapped.
const SPARE_KEPT_FOR: Duration = Duration::from_secs(2);

impl BatchAllocator for HeapAllocator {
    fn allocate(&self, bytes: usize) -> Box<dyn BatchMemory> {
        self.try_allocate(bytes)
            .unwrap_or_else(|| out_of_memory(bytes))
    }

    fn try_allocate(&self, bytes: usize) -> Option<Box<dyn BatchMemory>> {
        let buffer = match SPARE.take(bytes) {
            Some(spare) => spare,
            // Where fresh memory cannot be had (`ulimit -v`, a full machine), the spares give
            // theirs back first: keeping them must never fail an allocation.
            None => AlignedBuffer::try_new(bytes).or_else(|| {
                SPARE.clear();
                AlignedBuffer::try_new(bytes)
            })?,
        };
        Some(Box::new(HeapBlock(Some(buffer))))
    }
}

/// What [`HeapAllocator`] hands out: an [`AlignedBuffer`] (present until drop) that is
/// offered to the process's spare buffers when dropped.
struct HeapBlock(Option<AlignedBuffer>);

impl BatchMemory for HeapBlock {
    fn as_slice(&self) -> &[u8] {
        self.0.as_ref().expect("present until drop").as_slice()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_mut().expect("present until drop").as_mut_slice()
    }
}

impl Drop for HeapBlock {
    fn drop(&mut self) {
        if let Some(buffer) = self.0.take() {
            SPARE.offer(buffer);
        }
    }
}

/// Batch buffers whose loader was dropped, kept for a moment for the next loader of the
/// process: a new epoch's loader, a resumed run's, a benchmark's reopened one.
///
/// A new mapping costs a page fault per page (or huge page) on first touch, each zeroed by the
/// kernel: a new CIFAR-10 loader's first batches spent 2–6 ms there, a sixth of an epoch of the
/// CIFAR-10 test set. Only mapped buffers (1 MiB and more) are kept, at most `limit` bytes
/// of them (the oldest go first) and for at most `kept_for`: a thread of its own unmaps the
/// ones no allocation took in time, and ends when none is left. Every lock on the shared list
/// from an allocation or a drop is a `try_lock` that gives up when another thread holds it
/// (the buffer is then mapped or unmapped as without the list), so a child forked while
/// another thread held it never waits for it. Kept buffers are marked `MADV_WIPEONFORK`, so a
/// forked child holds zeroed pages in their place rather than copies, and a child drops the
/// list it inherited at its first allocation or drop instead of handing it out. A buffer
/// serves a request of its size to half its size only: a next loader of another size maps
/// fresh memory while these are kept (at most `limit` bytes for `kept_for` more).
pub(crate) struct SpareBuffers {
    state: Mutex<SpareState>,
    limit: usize,
    kept_for: Duration,
}

struct SpareState {
    /// The process the buffers were kept in (0 before the first).
    pid: u32,
    /// Each buffer with when it was offered, oldest first.
    buffers: Vec<(AlignedBuffer, Instant)>,
    /// Whether the thread that unmaps expired buffers is running.
    reaping: bool,
}

impl SpareState {
    /// The bytes of the buffers kept.
    fn bytes(&self) -> usize {
        self.buffers.iter().map(|(b, _)| b.len).sum()
    }

    /// Buffers inherited from another process (this one is a forked child): taken out, to be
    /// unmapped by the caller.
    fn adopt(&mut self, pid: u32) -> Vec<(AlignedBuffer, Instant)> {
        if self.pid == pid {
            return Vec::new();
        }
        self.pid = pid;
        self.reaping = false;
        std::mem::take(&mut self.buffers)
    }
}

impl SpareBuffers {
    /// An empty list that keeps at most `limit` bytes, each buffer for at most `kept_for`.
    pub(crate) const fn new(limit: usize, kept_for: Duration) -> SpareBuffers {
        SpareBuffers {
            state: Mutex::new(SpareState {
                pid: 0,
                buffers: Vec::new(),
                reaping: false,
            }),
            limit,
            kept_for,
        }
    }

    /// The shared list, or `None` where another thread holds it.
    fn try_state(&self) -> Option<std::sync::MutexGuard<'_, SpareState>> {
        match self.state.try_lock() {
            Ok(state) => Some(state),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// A kept buffer of `bytes` to twice `bytes` (the smallest), or `None`.
    pub(crate) fn take(&self, bytes: usize) -> Option<AlignedBuffer> {
        let (taken, inherited) = {
            let mut state = self.try_state()?;
            let inherited = state.adopt(std::process::id());
            let best = state
                .buffers
                .iter()
                .enumerate()
                .filter(|(_, (b, _))| b.len >= bytes && b.len / 2 <= bytes)
                .min_by_key(|(_, (b, _))| b.len)
                .map(|(i, _)| i);
            // `remove`, not `swap_remove`: the list stays oldest first for `offer`.
            let taken = best.map(|i| state.buffers.remove(i).0);
            (taken, inherited)
        };
        drop(inherited);
        if let Some(b) = &taken {
            b.inherit_on_fork(true);
        }
        taken
    }

    /// Unmaps every kept buffer (where no other thread holds the list).
    fn clear(&self) {
        let Some(mut state) = self.try_state() else {
            return;
        };
        let cleared = std::mem::take(&mut state.buffers);
        drop(state);
        drop(cleared);
    }

    /// Keeps `buffer` if it is mapped and fits under the limit (making room by unmapping the
    /// oldest), else unmaps or frees it now.
    pub(crate) fn offer(&'static self, buffer: AlignedBuffer) {
        if buffer.mapped == 0 || buffer.len > self.limit {
            return;
        }
        // A child forked while it is kept gets zeroed pages in its place, not a copy of it.
        buffer.inherit_on_fork(false);
        let Some(mut state) = self.try_state() else {
            return;
        };
        let mut unmapped = state.adopt(std::process::id());
        while state.bytes() + buffer.len > self.limit && !state.buffers.is_empty() {
            unmapped.push(state.buffers.remove(0));
        }
        state.buffers.push((buffer, Instant::now()));
        if !state.reaping {
            let started = std::thread::Builder::new()
                .name("imagefeed-spares".into())
                .spawn(|| self.reap());
            // Without the thread nothing would unmap them in time: keep none.
            match started {
                Ok(_) => state.reaping = true,
                Err(_) => unmapped.append(&mut state.buffers),
            }
        }
        drop(state);
        drop(unmapped);
    }

    /// The thread that unmaps buffers kept longer than `kept_for`; ends when none is left.
    /// It starts with the buffer just offered the only one kept (`offer` starts it where none
    /// runs), so it first sleeps that buffer's time out: taking the lock at once would make an
    /// allocation or drop right after the offer find the list held, and pass it by.
    fn reap(&self) {
        std::thread::sleep(self.kept_for);
        loop {
            let (expired, wait) = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let now = Instant::now();
                let (expired, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut state.buffers)
                    .into_iter()
                    .partition(|(_, at)| now.duration_since(*at) >= self.kept_for);
                state.buffers = kept;
                let next = state.buffers.iter().map(|(_, at)| *at).min();
                if next.is_none() {
                    state.reaping = false;
                }
                (
                    expired,
                    next.map(|at| (at + self.kept_for).saturating_duration_since(now)),
                )
            };
            drop(expired);
            match wait {
                Some(wait) => std::thread::sleep(wait),
                None => return,
            }
        }
    }

    /// Bytes kept now.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).bytes()
    }
}

/// Reuses batch memory. Cheap to clone (shared).
#[derive(Clone)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    allocator: Arc<dyn BatchAllocator>,
    free: Mutex<Vec<Box<dyn BatchMemory>>>,
    allocations: AtomicU64,
    allocated_bytes: AtomicU64,
    recent: Mutex<RecentNeed>,
}

/// Takes per window of [`RecentNeed`].
const NEED_WINDOW: u64 = 64;

/// How large the buffers taken lately were: the largest of the current window of
/// [`NEED_WINDOW`] takes and of the one before, so a spike is forgotten two windows after it.
#[derive(Default)]
struct RecentNeed {
    takes: u64,
    current: usize,
    previous: usize,
}

impl RecentNeed {
    fn saw(&mut self, len: usize) {
        if self.takes > 0 && self.takes.is_multiple_of(NEED_WINDOW) {
            self.previous = self.current;
            self.current = 0;
        }
        self.takes += 1;
        self.current = self.current.max(len);
    }

    /// True for a free block too large to keep: more than twice the largest recent need, once
    /// a whole window has been seen (a pool warmed by `reserve` keeps its blocks until then).
    fn too_large(&self, len: usize) -> bool {
        self.takes >= NEED_WINDOW && len > 2 * self.current.max(self.previous).max(1)
    }
}

impl BufferPool {
    /// A pool over `allocator`.
    pub fn new(allocator: Arc<dyn BatchAllocator>) -> BufferPool {
        BufferPool {
            inner: Arc::new(PoolInner {
                allocator,
                free: Mutex::new(Vec::new()),
                allocations: AtomicU64::new(0),
                allocated_bytes: AtomicU64::new(0),
                recent: Mutex::new(RecentNeed::default()),
            }),
        }
    }

    /// A buffer of exactly `len` visible bytes: a free one that is large enough, else a new one.
    /// Aborts where a new one cannot be had; the loader uses [`try_take`](Self::try_take).
    pub fn take(&self, len: usize) -> PooledBuffer {
        self.try_take(len).unwrap_or_else(|| out_of_memory(len))
    }

    /// [`take`](Self::take), or `None` where a new buffer was needed and the allocator could
    /// not supply it (nothing is counted then).
    pub fn try_take(&self, len: usize) -> Option<PooledBuffer> {
        self.inner
            .recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .saw(len);
        let reused = {
            let mut free = self.inner.free.lock().unwrap_or_else(|e| e.into_inner());
            // Best fit: the smallest free block that is large enough.
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, m)| m.as_slice().len() >= len)
                .min_by_key(|(_, m)| m.as_slice().len())
                .map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let memory = match reused {
            Some(memory) => memory,
            None => {
                let memory = self.inner.allocator.try_allocate(len)?;
                self.inner.allocations.fetch_add(1, Ordering::Relaxed);
                self.inner
                    .allocated_bytes
                    .fetch_add(len as u64, Ordering::Relaxed);
                memory
            }
        };
        Some(PooledBuffer {
            memory: Some(memory),
            len,
            pool: self.clone(),
        })
    }

    /// Makes sure the pool holds at least `count` free buffers of at least `len` bytes,
    /// allocating the missing ones now: so that a slow allocator (page-locked memory) runs
    /// before a run starts instead of on the worker threads during its first batches.
    pub fn reserve(&self, count: usize, len: usize) {
        let fitting = {
            let free = self.inner.free.lock().unwrap_or_else(|e| e.into_inner());
            free.iter().filter(|m| m.as_slice().len() >= len).count()
        };
        for _ in fitting..count {
            self.inner.allocations.fetch_add(1, Ordering::Relaxed);
            self.inner
                .allocated_bytes
                .fetch_add(len as u64, Ordering::Relaxed);
            let memory = self.inner.allocator.allocate(len);
            self.give_back(memory);
        }
    }

    /// Blocks allocated so far (a steady state stops growing this).
    pub fn allocations(&self) -> u64 {
        self.inner.allocations.load(Ordering::Relaxed)
    }

    /// Bytes requested by those allocations.
    pub fn allocated_bytes(&self) -> u64 {
        self.inner.allocated_bytes.load(Ordering::Relaxed)
    }

    /// Keeps `memory` for reuse. Free blocks far larger than what batches have needed lately
    /// (a spike: one batch of large images in a loader without a fixed output size) are freed
    /// instead of being held for the rest of the run.
    fn give_back(&self, memory: Box<dyn BatchMemory>) {
        let dropped: Vec<Box<dyn BatchMemory>> = {
            let recent = self.inner.recent.lock().unwrap_or_else(|e| e.into_inner());
            let mut free = self.inner.free.lock().unwrap_or_else(|e| e.into_inner());
            free.push(memory);
            let (keep, drop): (Vec<_>, Vec<_>) = std::mem::take(&mut *free)
                .into_iter()
                .partition(|m| !recent.too_large(m.as_slice().len()));
            *free = keep;
            drop
        };
        // Freed with no lock held: page-locked memory's free can wait for the device.
        drop(dropped);
    }

    /// Bytes held in free blocks now.
    pub fn free_bytes(&self) -> usize {
        self.inner
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|m| m.as_slice().len())
            .sum()
    }
}

/// A buffer on loan from a [`BufferPool`]; goes back to the pool when dropped.
pub struct PooledBuffer {
    memory: Option<Box<dyn BatchMemory>>,
    len: usize,
    pool: BufferPool,
}

impl PooledBuffer {
    /// The visible bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.memory.as_ref().expect("present until drop").as_slice()[..self.len]
    }

    /// The visible bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self
            .memory
            .as_mut()
            .expect("present until drop")
            .as_mut_slice()[..self.len]
    }

    /// Shrinks the visible length (e.g. a batch that lost samples to the `skip` policy).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.take() {
            self.pool.give_back(memory);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spike_is_given_back_once_batches_are_small_again() {
        // Hostile finding (#30): one batch of large images kept 517 MB in the pool for the
        // rest of the run.
        let pool = BufferPool::new(Arc::new(HeapAllocator));
        let small = 1 << 10;
        for _ in 0..NEED_WINDOW {
            drop(pool.take(small));
        }
        let spike = pool.take(1 << 24);
        drop(pool.take(small));
        drop(spike);
        // Right after the spike it is recent: kept (the next batch may be as large).
        assert!(pool.free_bytes() >= 1 << 24);
        // Two windows of small batches later, it is too large to keep, and freed.
        for _ in 0..2 * NEED_WINDOW {
            drop(pool.take(small));
        }
        assert!(
            pool.free_bytes() < 1 << 20,
            "{} bytes held",
            pool.free_bytes()
        );
        // Steady batches are never freed: no allocation after the first ones.
        let before = pool.allocations();
        for _ in 0..4 * NEED_WINDOW {
            drop(pool.take(small));
        }
        assert_eq!(pool.allocations(), before);
    }

    #[test]
    fn buffers_are_zeroed_aligned_and_writable_from_the_heap_and_mapped() {
        for len in [
            0,
            1,
            MAPPED_FROM - 1,
            MAPPED_FROM,
            HUGE_PAGE,
            HUGE_PAGE + 1,
            3 * HUGE_PAGE + 4099,
        ] {
            let mut buffer = AlignedBuffer::new(len);
            assert_eq!(buffer.mapped != 0, len >= MAPPED_FROM, "{len} bytes");
            if buffer.mapped != 0 {
                // Cut back to whole pages: no huge page's worth of address space past `len`.
                let page = page_size();
                assert_eq!(buffer.mapped, len.next_multiple_of(page), "{len} bytes");
            }
            assert!((buffer.as_slice().as_ptr() as usize).is_multiple_of(ALIGNMENT));
            assert_eq!(buffer.as_slice().len(), len);
            assert!(buffer.as_slice().iter().all(|&b| b == 0), "{len} bytes");
            for (i, byte) in buffer.as_mut_slice().iter_mut().enumerate() {
                *byte = (i % 251) as u8;
            }
            assert!(
                buffer
                    .as_slice()
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i % 251) as u8)
            );
        }
    }

    #[test]
    fn memory_that_cannot_be_had_is_none_and_counts_nothing() {
        // More than any machine has (malloc refuses it), and more than a layout can hold.
        assert!(AlignedBuffer::try_new(1 << 62).is_none());
        assert!(AlignedBuffer::try_new(usize::MAX).is_none());
        assert!(HeapAllocator.try_allocate(1 << 62).is_none());
        let pool = BufferPool::new(Arc::new(HeapAllocator));
        assert!(pool.try_take(1 << 62).is_none());
        assert_eq!((pool.allocations(), pool.allocated_bytes()), (0, 0));
        let buffer = pool.try_take(100).expect("100 bytes");
        assert_eq!(buffer.as_slice().len(), 100);
        assert_eq!(pool.allocations(), 1);
    }

    /// A list of its own for a test (the process's is shared by every test running).
    fn spares(limit: usize, kept_for: Duration) -> &'static SpareBuffers {
        Box::leak(Box::new(SpareBuffers::new(limit, kept_for)))
    }

    #[test]
    fn a_spare_buffer_goes_to_the_next_allocation_of_about_its_size() {
        let spares = spares(16 << 20, Duration::from_secs(600));
        let mut buffer = AlignedBuffer::new(3 << 20);
        buffer.as_mut_slice().fill(7);
        let addr = buffer.as_slice().as_ptr();
        spares.offer(buffer);
        assert_eq!(spares.bytes(), 3 << 20);
        // Larger than it, or under half of it: not taken.
        assert!(spares.take((3 << 20) + 1).is_none());
        assert!(spares.take((3 << 20) / 2 - 1).is_none());
        // About its size: the same memory, as it was left.
        let taken = spares.take((2 << 20) + 5).expect("a fitting spare");
        assert_eq!(taken.as_slice().as_ptr(), addr);
        assert!(taken.as_slice().iter().all(|&b| b == 7));
        assert_eq!(spares.bytes(), 0);
        assert!(spares.take(2 << 20).is_none(), "taken once");
        // The smallest that fits is the one taken.
        let (a, b) = (AlignedBuffer::new(4 << 20), AlignedBuffer::new(3 << 20));
        let smaller = b.as_slice().as_ptr();
        spares.offer(a);
        spares.offer(b);
        assert_eq!(spares.take(2 << 20).unwrap().as_slice().as_ptr(), smaller);
    }

    #[test]
    fn spares_stay_under_the_limit_oldest_out_and_heap_blocks_are_not_kept() {
        let spares = spares(5 << 20, Duration::from_secs(600));
        // From the heap (under 1 MiB): freed at once, never kept.
        spares.offer(AlignedBuffer::new(MAPPED_FROM - 1));
        assert_eq!(spares.bytes(), 0);
        // Larger than the whole limit: not kept.
        spares.offer(AlignedBuffer::new(6 << 20));
        assert_eq!(spares.bytes(), 0);
        let first = AlignedBuffer::new(2 << 20);
        let first_addr = first.as_slice().as_ptr();
        spares.offer(first);
        let second = AlignedBuffer::new(2 << 20);
        let second_addr = second.as_slice().as_ptr();
        spares.offer(second);
        // A third does not fit beside both: the oldest is unmapped to make room.
        spares.offer(AlignedBuffer::new(2 << 20));
        assert_eq!(spares.bytes(), 4 << 20);
        let mut kept = Vec::new();
        while let Some(b) = spares.take(2 << 20) {
            kept.push(b.as_slice().as_ptr());
            std::mem::forget(b); // keep its address from being reused by a later mapping
        }
        assert_eq!(kept.len(), 2);
        assert!(kept.contains(&second_addr) && !kept.contains(&first_addr));
    }

    #[test]
    fn spares_no_allocation_took_are_unmapped_in_time_and_the_thread_ends() {
        let spares = spares(16 << 20, Duration::from_millis(50));
        spares.offer(AlignedBuffer::new(2 << 20));
        spares.offer(AlignedBuffer::new(2 << 20));
        assert_eq!(spares.bytes(), 4 << 20);
        let ended = |spares: &SpareBuffers| {
            let state = spares.state.lock().unwrap();
            state.buffers.is_empty() && !state.reaping
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ended(spares) {
            assert!(Instant::now() < deadline, "the spares were never unmapped");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Offered again after the thread ended: a new one unmaps it too.
        spares.offer(AlignedBuffer::new(2 << 20));
        assert_eq!(spares.bytes(), 2 << 20);
        while !ended(spares) {
            assert!(
                Instant::now() < deadline,
                "the second spare was never unmapped"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_forked_child_drops_the_spares_it_inherited_instead_of_handing_them_out() {
        let mut state = SpareState {
            pid: 0,
            buffers: Vec::new(),
            reaping: false,
        };
        assert!(
            state.adopt(100).is_empty(),
            "the first process adopts an empty list"
        );
        state
            .buffers
            .push((AlignedBuffer::new(2 << 20), Instant::now()));
        state.reaping = true;
        assert!(
            state.adopt(100).is_empty(),
            "the same process keeps its spares"
        );
        assert_eq!(state.buffers.len(), 1);
        // Another process id: the list was inherited across a fork.
        let inherited = state.adopt(101);
        assert_eq!(inherited.len(), 1);
        assert!(state.buffers.is_empty());
        assert_eq!((state.bytes(), state.reaping, state.pid), (0, false, 101));
    }

    #[test]
    fn after_a_take_the_oldest_spare_is_still_the_first_unmapped() {
        let spares = spares(6 << 20, Duration::from_secs(600));
        let offer = || {
            let b = AlignedBuffer::new(2 << 20);
            let addr = b.as_slice().as_ptr() as usize;
            spares.offer(b);
            addr
        };
        let (a, b, c) = (offer(), offer(), offer());
        let taken = spares.take(2 << 20).unwrap();
        assert_eq!(
            taken.as_slice().as_ptr() as usize,
            a,
            "the oldest fitting one"
        );
        offer();
        // Full: a fifth makes room by unmapping the oldest left, `b`.
        offer();
        // Held (not dropped) until the end, so no address is mapped again meanwhile.
        let held: Vec<AlignedBuffer> = std::iter::from_fn(|| spares.take(2 << 20)).collect();
        let left: Vec<usize> = held
            .iter()
            .map(|x| x.as_slice().as_ptr() as usize)
            .collect();
        assert_eq!(left.len(), 3);
        assert!(!left.contains(&b) && left.contains(&c), "{left:?}");
    }

    #[test]
    fn a_forked_child_gets_zeroed_pages_where_a_spare_is_kept() {
        let spares = spares(16 << 20, Duration::from_secs(600));
        let mut buffer = AlignedBuffer::new(2 << 20);
        buffer.as_mut_slice().fill(7);
        let addr = buffer.as_slice().as_ptr() as usize;
        spares.offer(buffer);
        // SAFETY: the child only reads memory and exits without unwinding.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: the kept buffer's mapping, still mapped in the child.
            let wiped = unsafe { std::slice::from_raw_parts(addr as *const u8, 2 << 20) }
                .iter()
                .all(|&x| x == 0);
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if wiped { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child saw the parent's bytes (status {status})"
        );
        // In the parent the spare is as it was, and once taken again it is inherited as usual.
        let taken = spares.take(2 << 20).unwrap();
        assert!(taken.as_slice().iter().all(|&x| x == 7));
    }

    #[test]
    fn a_held_list_is_passed_by_never_waited_for() {
        let spares = spares(16 << 20, Duration::from_secs(600));
        spares.offer(AlignedBuffer::new(2 << 20));
        let held = spares.state.lock().unwrap();
        // As in a child forked while another thread held it: nothing waits.
        assert!(spares.take(2 << 20).is_none());
        spares.offer(AlignedBuffer::new(2 << 20));
        assert_eq!(
            held.bytes(),
            2 << 20,
            "the second offer was unmapped, not kept"
        );
        drop(held);
        assert!(spares.take(2 << 20).is_some());
    }

    #[test]
    fn the_default_allocator_reuses_what_a_dropped_pool_held() {
        // A size no other test of this process asks for (a spare serves up to twice its
        // request): 48 MiB and a bit.
        let bytes = (48 << 20) + 777;
        let first = HeapAllocator.allocate(bytes);
        let addr = first.as_slice().as_ptr();
        let pool = BufferPool::new(Arc::new(HeapAllocator));
        pool.reserve(1, bytes);
        let pooled = pool.take(bytes).as_slice().as_ptr();
        drop(pool);
        drop(first);
        // Both went to the process's spares: the next two allocations of that size take them.
        let again: Vec<_> = (0..2).map(|_| HeapAllocator.allocate(bytes)).collect();
        let mut got: Vec<_> = again.iter().map(|b| b.as_slice().as_ptr()).collect();
        let mut want = vec![addr, pooled];
        got.sort();
        want.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn buffers_are_aligned_and_reused() {
        let pool = BufferPool::new(Arc::new(HeapAllocator));
        let a = pool.take(1000);
        assert_eq!(a.as_slice().as_ptr() as usize % ALIGNMENT, 0);
        assert_eq!(a.as_slice().len(), 1000);
        let addr = a.as_slice().as_ptr();
        drop(a);
        let b = pool.take(800);
        assert_eq!(
            b.as_slice().as_ptr(),
            addr,
            "a large-enough free buffer is reused"
        );
        assert_eq!(b.as_slice().len(), 800);
        let _c = pool.take(2000);
        assert_eq!(pool.allocations(), 2);
    }

    #[test]
    fn reserved_buffers_serve_the_next_takes_without_allocating() {
        let pool = BufferPool::new(Arc::new(HeapAllocator));
        let small = pool.take(10);
        drop(small); // one free buffer, too small for what is reserved next
        pool.reserve(3, 1000);
        assert_eq!(pool.allocations(), 4);
        pool.reserve(3, 1000);
        assert_eq!(
            pool.allocations(),
            4,
            "already there: nothing more is allocated"
        );
        let taken: Vec<PooledBuffer> = (0..3).map(|_| pool.take(1000)).collect();
        assert_eq!(
            pool.allocations(),
            4,
            "the reserved buffers were handed out"
        );
        drop(taken);
        let _fourth = [
            pool.take(1000),
            pool.take(1000),
            pool.take(1000),
            pool.take(1000),
        ];
        assert_eq!(pool.allocations(), 5, "only a fourth large buffer is new");
    }
}
