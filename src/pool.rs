//! Batch memory: where collate writes, and how it is reused.
//!
//! [`BatchAllocator`] is the one interface through which the loader gets memory, so a GPU feed can
//! supply page-locked buffers and collate writes straight into them (no extra copy). The default,
//! [`HeapAllocator`], gives 64-byte-aligned [`AlignedBuffer`]s (aligned for any element type and
//! for SIMD; from 1 MiB up, mappings of their own with huge pages). [`BufferPool`] keeps returned buffers and hands them out again: in steady state no
//! batch allocates.

use std::alloc::{Layout, dealloc};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

/// The default allocator: [`AlignedBuffer`]s.
#[derive(Debug, Default, Clone, Copy)]
pub struct HeapAllocator;

impl BatchAllocator for HeapAllocator {
    fn allocate(&self, bytes: usize) -> Box<dyn BatchMemory> {
        Box::new(AlignedBuffer::new(bytes))
    }

    fn try_allocate(&self, bytes: usize) -> Option<Box<dyn BatchMemory>> {
        Some(Box::new(AlignedBuffer::try_new(bytes)?))
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
