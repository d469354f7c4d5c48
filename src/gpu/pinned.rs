//! Page-locked host memory: [`PinnedBuffer`], and [`PinnedAllocator`] that hands the loader's
//! pool such buffers (ordinary memory, counted and logged, when page-locked memory runs out).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, result, sys};

use super::context::{RestoreCurrentContext, RestoringDrop};
use super::cuda;
use crate::error::{Error, Result};
use crate::pool::{AlignedBuffer, BatchAllocator, BatchMemory};

/// Page-locked host memory from `cuMemHostAlloc` (portable: usable with every context; not
/// write-combined, so the CPU reads it at normal speed).
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    ctx: RestoringDrop<Arc<CudaContext>>,
}

// SAFETY: the buffer owns its allocation exclusively; `&self` gives only shared reads and
// `&mut self` exclusive writes, so moving or sharing it between threads is sound.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` zeroed page-locked bytes (at least one is reserved).
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBuffer> {
        let _restore =
            RestoreCurrentContext::remember().map_err(cuda("reading the current context"))?;
        // Made current directly: `bind_to_thread` would also take the error an earlier call
        // left stored on the context (cudarc keeps one per context), and a loader worker
        // allocating here would then swallow it while the feed never heard of it.
        // SAFETY: the context is alive (the caller holds a reference to it).
        unsafe { result::ctx::set_current(ctx.cu_ctx()) }.map_err(cuda("binding the context"))?;
        // SAFETY: a plain allocation call with a non-zero size; the pointer is owned by the
        // returned buffer and freed exactly once, in `Drop`.
        let raw = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(cuda("allocating page-locked memory"))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| Error::cuda_unavailable("cuMemHostAlloc returned null"))?;
        // SAFETY: the block is `len.max(1)` writable bytes that nothing else references yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx: RestoringDrop::new(Arc::clone(ctx)),
        })
    }
}

impl BatchMemory for PinnedBuffer {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialized bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _restore = RestoreCurrentContext::remember().ok();
        // Made current directly: `bind_to_thread` would also take (and so lose) an error an
        // earlier asynchronous call left on the context.
        // SAFETY: the context is alive (this buffer holds a reference to it).
        let _ = unsafe { result::ctx::set_current(self.ctx.cu_ctx()) };
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once; the pool hands a buffer
        // back (and so can drop it) only after every copy from it has completed.
        let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
    }
}

/// Hands the loader's pool page-locked buffers. When page-locked memory runs out, a heap
/// buffer is handed out instead (copies from it are slower, never wrong), counted, and the
/// first such failure is logged and kept ([`fallback_reason`](Self::fallback_reason)).
pub struct PinnedAllocator {
    ctx: RestoringDrop<Arc<CudaContext>>,
    pinned: AtomicU64,
    fallbacks: AtomicU64,
    first_fallback: Mutex<Option<String>>,
}

impl PinnedAllocator {
    /// An allocator of buffers page-locked in `ctx` ([`Gpu::pinned_allocator`]).
    ///
    /// [`Gpu::pinned_allocator`]: super::Gpu::pinned_allocator
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Arc<PinnedAllocator> {
        Arc::new(PinnedAllocator {
            ctx: RestoringDrop::new(Arc::clone(ctx)),
            pinned: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            first_fallback: Mutex::new(None),
        })
    }

    /// Page-locked buffers handed out.
    pub fn pinned(&self) -> u64 {
        self.pinned.load(Ordering::Relaxed)
    }

    /// Heap buffers handed out because page-locked allocation failed.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    /// Why the first heap buffer was handed out, if one was.
    pub fn fallback_reason(&self) -> Option<String> {
        self.first_fallback
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl BatchAllocator for PinnedAllocator {
    fn allocate(&self, bytes: usize) -> Box<dyn BatchMemory> {
        self.try_allocate(bytes)
            .unwrap_or_else(|| Box::new(AlignedBuffer::new(bytes)))
    }

    /// Page-locked memory, else ordinary memory (said once), else `None`.
    fn try_allocate(&self, bytes: usize) -> Option<Box<dyn BatchMemory>> {
        Some(match PinnedBuffer::new(&self.ctx, bytes) {
            Ok(buffer) => {
                self.pinned.fetch_add(1, Ordering::Relaxed);
                Box::new(buffer)
            }
            Err(e) => {
                if self.fallbacks.fetch_add(1, Ordering::Relaxed) == 0 {
                    log::warn!(
                        "page-locked memory for a {bytes}-byte batch: {e}; batches that do not \
                         fit go in ordinary memory (slower copies)"
                    );
                    *self
                        .first_fallback
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                }
                Box::new(AlignedBuffer::try_new(bytes)?)
            }
        })
    }
}
