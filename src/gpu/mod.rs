//! The GPU feed (feature `cuda`): page-locked batch memory, asynchronous double-buffered
//! host-to-device copies on a copy stream, and normalization on the GPU.
//!
//! ```text
//! loader workers ─▶ u8 NHWC batch in page-locked memory (PinnedAllocator, via the pool)
//!   ─▶ copy stream: wait(slot released) · memcpy H2D · normalize kernel → f32/f16 NCHW/NHWC
//!      · record(slot ready)
//!   ─▶ trainer's stream: wait(slot ready) · the training step · record(slot released)
//! ```
//!
//! Guarantees:
//! - the trainer's stream waits only for the copy and conversion of the batch it is given
//!   (an event), never for the whole device;
//! - a device slot is overwritten only after the trainer's stream has finished the step that
//!   used it (an event recorded when the next batch is asked for);
//! - a host batch returns to the pool only after its copy has completed;
//! - PCIe carries `u8` (4× fewer bytes than `f32`); the GPU converts, with the same arithmetic
//!   as the CPU [`SlotWriter`](crate::transform::SlotWriter), rounded the same way (a rounded
//!   multiply, then a rounded add; no fused multiply-add), so the batches are meant to be
//!   bit-identical (asserted by the GPU tests, which have not yet run on a GPU);
//! - what this module does on a caller's thread without being asked to work there (opening a
//!   device, allocating and freeing page-locked memory, dropping a [`Gpu`] or a
//!   [`PinnedAllocator`]) leaves the thread's current CUDA context as it was, so PyTorch's
//!   current device does not move. cudarc's safe calls make the context current themselves;
//!   code making raw driver calls makes it current first (`gpu.context().bind_to_thread()`).
//!
//! CUDA is loaded at run time (cudarc's dynamic loading): on a machine without the driver or a
//! device, [`Gpu::open`] returns [`Error::Cuda`] saying which, and nothing panics.
//!
//! The kernels ship as PTX (`src/gpu/kernels.ptx`, ISA 8.0 for compute_70, made from
//! `kernels.cu` by `scripts/make_ptx.py` with NVRTC): no CUDA compiler at build or run time;
//! the driver (525 or newer) compiles it for the GPU it finds.

use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr as _,
    DriverError, LaunchConfig, PushKernelArg as _, result, sys,
};
use cudarc::nvrtc::Ptx;

use crate::batch::{BadSample, Batch};
use crate::error::{Error, Result};
use crate::loader::{Epoch, Loader};
use crate::pool::{AlignedBuffer, BatchAllocator, BatchMemory};
use crate::transform::{DType, Layout, Normalize, Transform};

/// The cudarc this module is built on, for code that drives the same context (streams,
/// kernels) without a version mismatch.
pub use cudarc;

pub mod blas;

/// The kernels, as PTX text.
pub const PTX: &str = include_str!("kernels.ptx");

fn cuda(what: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::cuda_call(what, e)
}

/// Number of CUDA devices, or why CUDA cannot be used here: no driver library, or a driver
/// that fails to initialize (no device, a driver/library mismatch). Never panics.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver library under its known names and closes it.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::cuda_unavailable(
            "no CUDA driver: libcuda.so was not found (this machine has no NVIDIA driver)",
        ));
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(DriverError(sys::cudaError_enum::CUDA_ERROR_STUB_LIBRARY)) => {
            Err(Error::cuda_unavailable(format!(
                "the libcuda.so loaded{} is the CUDA toolkit's stub, not the NVIDIA driver: a \
                 toolkit's lib64/stubs folder on LD_LIBRARY_PATH comes before the driver's \
                 library; take it off the path",
                loaded_driver_path()
                    .map(|p| format!(" ({p})"))
                    .unwrap_or_default()
            )))
        }
        Err(e) => Err(Error::cuda_call("the CUDA driver did not initialize", e)),
    }
}

/// The file the loaded `cuInit` comes from, when the system can say.
fn loaded_driver_path() -> Option<String> {
    for name in [c"libcuda.so", c"libcuda.so.1"] {
        // SAFETY: RTLD_NOLOAD only looks up a library already loaded; the handle is closed.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if handle.is_null() {
                continue;
            }
            let address = libc::dlsym(handle, c"cuInit".as_ptr());
            let mut info: libc::Dl_info = std::mem::zeroed();
            let found = !address.is_null()
                && libc::dladdr(address, &mut info) != 0
                && !info.dli_fname.is_null();
            let path = found.then(|| {
                std::ffi::CStr::from_ptr(info.dli_fname)
                    .to_string_lossy()
                    .into_owned()
            });
            libc::dlclose(handle);
            if path.is_some() {
                return path;
            }
        }
    }
    None
}

/// Why there is no usable GPU here, or `None` when device 0 can be used. For tests and tools
/// that skip GPU work and say why.
pub fn unavailable_reason() -> Option<String> {
    match device_count() {
        Ok(0) => Some("no CUDA device: the driver is present but reports no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Puts back, when dropped, the context that was current on this thread when it was made (or
/// none). The calls this module makes on a caller's thread that are not followed by the
/// caller's own CUDA work (opening a device, allocating and freeing page-locked memory) leave
/// the thread's current context, and so the CUDA runtime's current device (PyTorch's
/// `torch.cuda.current_device()`), as they found it: opening device 1 from a process working
/// on device 0 does not move that process's later work to device 1.
struct RestoreCurrentContext {
    previous: Option<sys::CUcontext>,
}

impl RestoreCurrentContext {
    /// Remembers this thread's current context (the driver must be initialized).
    fn remember() -> std::result::Result<Self, DriverError> {
        Ok(RestoreCurrentContext {
            previous: result::ctx::get_current()?,
        })
    }
}

impl Drop for RestoreCurrentContext {
    fn drop(&mut self) {
        let current = result::ctx::get_current().ok().flatten();
        if current != self.previous {
            // SAFETY: `previous` was current on this thread moments ago, inside a call of this
            // module that destroys no context (contexts are primary contexts, retained by
            // their owners); null makes no context current, as before.
            let _ =
                unsafe { result::ctx::set_current(self.previous.unwrap_or(std::ptr::null_mut())) };
        }
    }
}

/// A value whose drop leaves this thread's current context as it was. cudarc's `CudaContext`
/// and `CudaModule` make their context current to release or unload it, and the last
/// reference may be dropped on a caller's thread (a Python loader deleted on the main thread).
struct RestoringDrop<T>(ManuallyDrop<T>);

impl<T> RestoringDrop<T> {
    fn new(value: T) -> Self {
        RestoringDrop(ManuallyDrop::new(value))
    }
}

impl<T> std::ops::Deref for RestoringDrop<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> Drop for RestoringDrop<T> {
    fn drop(&mut self) {
        let _restore = RestoreCurrentContext::remember().ok();
        // SAFETY: the value is dropped exactly once, here, and the wrapper is never used again.
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}

/// One GPU: its context, and the kernels once something needs them.
pub struct Gpu {
    ctx: RestoringDrop<Arc<CudaContext>>,
    /// Loaded on first use: a program that only wants page-locked memory (the Python
    /// package's CUDA path) never JIT-compiles PTX, so it works with any driver cudarc does.
    module: OnceLock<RestoringDrop<Arc<CudaModule>>>,
}

impl Gpu {
    /// Opens device `ordinal`. The kernels are loaded when first asked for
    /// ([`function`](Self::function), [`Prefetcher::new`]).
    ///
    /// cudarc's automatic per-allocation stream tracking is turned off for this context: the
    /// [`Prefetcher`] orders its streams with its own events, and code sharing the context must
    /// order its streams itself.
    ///
    /// The calling thread's current context is left as it was (none, or another device's):
    /// cudarc's calls make this one current when they need it; before a raw driver call, call
    /// `gpu.context().bind_to_thread()`.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let count = device_count()?;
        if count == 0 {
            return Err(Error::cuda_unavailable(
                "no CUDA device: the driver is present but reports no GPU",
            ));
        }
        if ordinal >= count {
            return Err(Error::cuda_unavailable(format!(
                "no device {ordinal}: this machine has {count}"
            )));
        }
        // `CudaContext::new` makes the new context current on this thread.
        let _restore =
            RestoreCurrentContext::remember().map_err(cuda("reading the current context"))?;
        let ctx = CudaContext::new(ordinal).map_err(cuda("creating a context"))?;
        // SAFETY: called before any allocation or stream of this context exists; from here on
        // every cross-stream dependency is an explicit event (see the module docs).
        unsafe { ctx.disable_event_tracking() };
        Ok(Gpu {
            ctx: RestoringDrop::new(ctx),
            module: OnceLock::new(),
        })
    }

    /// The kernels' module, loaded (JIT-compiled by the driver) on first use.
    fn module(&self) -> Result<&Arc<CudaModule>> {
        if let Some(module) = self.module.get() {
            return Ok(module);
        }
        let _restore =
            RestoreCurrentContext::remember().map_err(cuda("reading the current context"))?;
        let module = self.ctx.load_module(Ptx::from_src(PTX)).map_err(cuda(
            "loading the kernels (PTX ISA 8.0 needs driver 525 or newer)",
        ))?;
        // Two threads racing here both load it; one module is kept, the other unloaded.
        Ok(self.module.get_or_init(|| RestoringDrop::new(module)))
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("unknown ({e})"))
    }

    /// A kernel from the shipped PTX (loading the kernels on first use).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let module = self.module()?;
        // cuModuleGetFunction works in the current context, which `open` did not leave bound.
        self.ctx
            .bind_to_thread()
            .map_err(cuda("binding the context"))?;
        module
            .load_function(name)
            .map_err(|e| Error::cuda_call(format!("kernel {name}"), e))
    }

    /// A new stream.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(cuda("creating a stream"))
    }

    /// An event for ordering streams (timing disabled: cheaper to record and wait on). For
    /// the device to wait on: a host thread waiting for it would spin.
    pub fn event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(cuda("creating an event"))
    }

    /// An event that can be timed with [`CudaEvent::elapsed_ms`] (cudarc's `new_event(None)`
    /// disables timing, and `cuEventElapsedTime` then fails). A host thread waiting for it
    /// sleeps rather than spinning a core (blocking synchronization).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(cuda("creating a timing event"))
    }

    /// An allocator of page-locked batch buffers, for [`Loader::with_allocator`](crate::loader::Loader::with_allocator).
    pub fn pinned_allocator(&self) -> Arc<PinnedAllocator> {
        Arc::new(PinnedAllocator {
            ctx: RestoringDrop::new(Arc::clone(&self.ctx)),
            pinned: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            first_fallback: Mutex::new(None),
        })
    }
}

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
        match PinnedBuffer::new(&self.ctx, bytes) {
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
                Box::new(AlignedBuffer::new(bytes))
            }
        }
    }
}

/// What the GPU turns a `u8` NHWC batch into.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceOutput {
    /// `F32` or `F16`.
    pub dtype: DType,
    /// NCHW or NHWC (channels-last).
    pub layout: Layout,
    /// Mean/std per channel; `None`: `pixel / 255` only.
    pub normalize: Option<Normalize>,
}

impl DeviceOutput {
    /// What `transform` writes on the CPU (element type, layout, normalization), made on the
    /// GPU instead. The GPU feed's recipe: the loader gets [`Transform::raw_u8_nhwc`] of the
    /// transform, the [`Prefetcher`] `DeviceOutput::of` it, and the batches on the device equal
    /// what `transform` alone writes on the CPU. A `u8` transform gives a `u8` output, which
    /// the prefetcher refuses (the GPU converts to `f32` or `f16`).
    ///
    /// [`Transform::raw_u8_nhwc`]: crate::transform::Transform::raw_u8_nhwc
    pub fn of(transform: &Transform) -> DeviceOutput {
        DeviceOutput {
            dtype: transform.output.dtype,
            layout: transform.output.layout,
            normalize: transform.output.normalize,
        }
    }

    /// Per-channel `(scale, bias)` so that `out = pixel * scale + bias` equals
    /// `(pixel / 255 - mean) / std`: the CPU slot writer's own values
    /// ([`Normalize::pixel_affine`]).
    pub fn affine(&self) -> ([f32; 3], [f32; 3]) {
        Normalize::pixel_affine(self.normalize)
    }

    fn element_bytes(&self) -> usize {
        match self.dtype {
            DType::F16 => 2,
            _ => 4,
        }
    }
}

/// Counters of a [`Prefetcher`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefetchStats {
    /// Batches delivered.
    pub batches: u64,
    /// Bytes copied host to device (the `u8` batches and labels).
    pub bytes_copied: u64,
    /// Time the caller's thread spent waiting for the loader to produce a host batch.
    pub host_wait: Duration,
    /// GPU time of the copies and conversions, from events on the copy stream (counted when
    /// a copy's host batch is returned to the pool).
    pub copy_time: Duration,
    /// Copies counted in `copy_time` (it lags `batches` by the copies still under way).
    pub copies_timed: u64,
}

/// A batch on the GPU, valid until the next [`Prefetcher::next_batch`] call (the borrow says
/// so). Work on it must be enqueued on the prefetcher's compute stream, which already waits for
/// its copy.
pub struct DeviceBatch<'p> {
    /// Epoch.
    pub epoch: u64,
    /// Position in the epoch.
    pub index: usize,
    /// `[n, 3, h, w]` (NCHW) or `[n, h, w, 3]` (NHWC).
    pub shape: [usize; 4],
    /// Element type on the device.
    pub dtype: DType,
    /// Dimension order on the device.
    pub layout: Layout,
    /// Labels (host copy).
    pub labels: &'p [u32],
    /// Bad samples met while building the batch.
    pub bad: &'p [BadSample],
    data: &'p CudaSlice<u8>,
    labels_device: &'p CudaSlice<u32>,
    stream: &'p Arc<CudaStream>,
}

impl DeviceBatch<'_> {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.shape[0]
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.shape[0] == 0
    }

    /// Bytes of the converted batch.
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * if self.dtype == DType::F16 { 2 } else { 4 }
    }

    /// Device address of the converted batch (contiguous, [`Self::byte_len`] bytes).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.data.device_ptr(self.stream).0
    }

    /// Device address of the labels (`u32`, one per sample).
    pub fn labels_device_ptr(&self) -> sys::CUdeviceptr {
        self.labels_device.device_ptr(self.stream).0
    }

    /// Copies the converted batch back to the host (for checks and tests; synchronizes the
    /// compute stream).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.byte_len()];
        self.stream
            .synchronize()
            .map_err(cuda("synchronizing the compute stream"))?;
        // SAFETY: the device block holds at least `byte_len` bytes and the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.device_ptr()) }
            .map_err(cuda("copying the batch back"))?;
        Ok(out)
    }
}

/// One device buffer and what occupies it.
struct Slot {
    input: Option<CudaSlice<u8>>,
    output: Option<CudaSlice<u8>>,
    labels: Option<CudaSlice<u32>>,
    /// The labels' staging copy: page-locked (an asynchronous copy from ordinary memory
    /// stalls the host until the driver has staged it), or ordinary memory when page-locked
    /// memory ran out.
    labels_staging: Option<Box<dyn BatchMemory>>,
    /// Recorded on the copy stream before the batch's copy (timing enabled).
    copy_started: CudaEvent,
    /// Recorded on the copy stream after the batch's copy and conversion (timing enabled).
    ready: CudaEvent,
    /// Recorded on the compute stream when the trainer moved past the batch.
    released: CudaEvent,
    /// `released` has been recorded (the slot held a delivered batch).
    used: bool,
    /// `ready` has been recorded for a copy whose time is not yet counted.
    timing: bool,
    /// The host batch, held until its copy has completed (and dropped as soon as it has).
    host: Option<Batch>,
    /// What the delivered batch reports; kept apart from `host`, which may go first.
    shape: [usize; 4],
    epoch: u64,
    index: usize,
    labels_host: Vec<u32>,
    bad: Vec<BadSample>,
}

impl Slot {
    /// When the slot's last copy has completed: returns its host batch to the pool and adds
    /// the copy's duration (from the copy stream's events) to `stats`. `wait`: block until it
    /// has completed.
    fn retire(&mut self, wait: bool, stats: &mut PrefetchStats) -> Result<()> {
        if !self.timing {
            return Ok(());
        }
        if wait {
            self.ready
                .synchronize()
                .map_err(cuda("waiting for an earlier copy"))?;
        } else if !self.ready.is_complete() {
            // Not done yet, or the context failed (then the batch is kept: leaking it is
            // safe, returning memory a copy may still read is not).
            return Ok(());
        }
        let ms = self
            .copy_started
            .elapsed_ms(&self.ready)
            .map_err(cuda("timing a copy"))?;
        stats.copy_time += Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3);
        stats.copies_timed += 1;
        self.timing = false;
        self.host = None;
        Ok(())
    }
}

/// Feeds `u8` NHWC batches to the GPU, `depth` batches ahead (2 = double buffering).
///
/// One prefetcher serves a whole run: its copy stream, events and device buffers are made
/// once, and each epoch is handed to it with [`start`](Self::start). Batches come from any
/// iterator of host [`Batch`]es; for a [`Loader`], build it with [`for_loader`](Self::for_loader),
/// which checks the loader's output format and allocates its page-locked buffers up front.
pub struct Prefetcher<I: Iterator<Item = Result<Batch>> = Epoch> {
    batches: Option<I>,
    copy: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    output: DeviceOutput,
    to_f32: CudaFunction,
    to_f16: CudaFunction,
    slots: Vec<Slot>,
    enqueued: usize,
    delivered: usize,
    finished: bool,
    /// A CUDA call failed part-way through issuing a copy: nothing more is delivered.
    failed: bool,
    stats: PrefetchStats,
}

impl Prefetcher<Epoch> {
    /// A prefetcher for `loader`'s epochs. Checks at once that the loader's transform outputs
    /// `u8` NHWC (what the GPU converts), and allocates the batch buffers the run will need
    /// (the loader's prefetch, plus `depth` being copied, plus one) through the loader's
    /// allocator, so that a page-locked pool ([`Gpu::pinned_allocator`]) is filled before the
    /// first epoch rather than by the workers during it.
    pub fn for_loader(
        gpu: &Gpu,
        compute: Arc<CudaStream>,
        loader: &Loader,
        output: DeviceOutput,
        depth: usize,
    ) -> Result<Self> {
        let host = loader.config().transform.output;
        if host.dtype != DType::U8 || host.layout != Layout::Nhwc {
            return Err(Error::Config(format!(
                "the GPU prefetcher takes u8 NHWC batches (the GPU converts them), but the \
                 loader's transform outputs {} {:?}: give the loader Transform::raw_u8_nhwc() \
                 and the GPU DeviceOutput::of(&transform)",
                host.dtype.name(),
                host.layout
            )));
        }
        let prefetcher = Self::new(gpu, compute, output, depth)?;
        loader.prewarm(loader.config().prefetch + depth + 1)?;
        Ok(prefetcher)
    }
}

impl<I: Iterator<Item = Result<Batch>>> Prefetcher<I> {
    /// A prefetcher with nothing to feed yet: hand it batches with [`start`](Self::start).
    /// Work on delivered batches goes on `compute`.
    pub fn new(
        gpu: &Gpu,
        compute: Arc<CudaStream>,
        output: DeviceOutput,
        depth: usize,
    ) -> Result<Self> {
        if depth == 0 {
            return Err(Error::Config("prefetch depth must be at least 1".into()));
        }
        if let Some(normalize) = output.normalize {
            normalize.validate().map_err(Error::Config)?;
        }
        if !matches!(output.dtype, DType::F32 | DType::F16) {
            return Err(Error::Config(format!(
                "the GPU converts to f32 or f16, not {}",
                output.dtype.name()
            )));
        }
        let mut slots = Vec::with_capacity(depth);
        for _ in 0..depth {
            slots.push(Slot {
                input: None,
                output: None,
                labels: None,
                labels_staging: None,
                copy_started: gpu.timing_event()?,
                ready: gpu.timing_event()?,
                released: gpu.event()?,
                used: false,
                timing: false,
                host: None,
                shape: [0; 4],
                epoch: 0,
                index: 0,
                labels_host: Vec::new(),
                bad: Vec::new(),
            });
        }
        Ok(Prefetcher {
            batches: None,
            copy: gpu.new_stream()?,
            compute,
            ctx: Arc::clone(&gpu.ctx),
            output,
            to_f32: gpu.function("u8_nhwc_to_f32")?,
            to_f16: gpu.function("u8_nhwc_to_f16")?,
            slots,
            enqueued: 0,
            delivered: 0,
            finished: true,
            failed: false,
            stats: PrefetchStats::default(),
        })
    }

    /// Feeds `batches` from now on (an epoch). Batches of the previous source that were copied
    /// but not delivered are discarded (once their copies complete); device buffers, events
    /// and the copy stream are kept.
    pub fn start(&mut self, batches: I) -> Result<()> {
        self.check_usable()?;
        if let Err(e) = self.release_delivered() {
            self.failed = true;
            return Err(e);
        }
        // Undelivered slots were never handed out, so the trainer has nothing to release.
        self.delivered = self.enqueued;
        self.batches = Some(batches);
        self.finished = false;
        Ok(())
    }

    /// Counters so far.
    pub fn stats(&self) -> PrefetchStats {
        self.stats
    }

    /// The copy stream.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    fn check_usable(&mut self) -> Result<()> {
        if self.failed {
            return Err(Error::cuda_unavailable(
                "the prefetcher stopped after a failed CUDA call (see the error it returned)",
            ));
        }
        // cudarc keeps the error of a call that could not return one (a drop) on the context
        // until some later call takes it: reported here, as itself, not as the failure of
        // whichever unrelated call would have met it next. It stops the prefetcher as any
        // failed call does.
        self.ctx.check_err().map_err(|e| {
            self.failed = true;
            Error::cuda_call(
                "an earlier CUDA call that could not report its error (cudarc stored it)",
                e,
            )
        })
    }

    /// Records that the trainer moved past the last delivered batch: its device buffers may be
    /// overwritten once the work enqueued on the compute stream so far has finished. (Recording
    /// again for the same batch only moves that point later, which is still safe.)
    fn release_delivered(&mut self) -> Result<()> {
        if self.delivered > 0 {
            let depth = self.slots.len();
            let previous = &mut self.slots[(self.delivered - 1) % depth];
            previous
                .released
                .record(&self.compute)
                .map_err(cuda("recording a release event"))?;
            previous.used = true;
        }
        Ok(())
    }

    /// The next batch on the GPU, or `None` at the end of the current source. The previous
    /// batch is released: the trainer's work enqueued on it so far is the last that may read it.
    ///
    /// A CUDA call that fails ([`Error::Cuda`]) stops the prefetcher: this call and every later
    /// one return an error, so no batch is skipped or delivered out of order after it. An error
    /// of the batches' source (the loader) is returned as it is, and the next call goes on with
    /// the source's next batch.
    pub fn next_batch(&mut self) -> Result<Option<DeviceBatch<'_>>> {
        self.check_usable()?;
        let slot = match self.advance() {
            Ok(Some(slot)) => slot,
            Ok(None) => return Ok(None),
            Err(e) => {
                if matches!(e, Error::Cuda { .. }) {
                    self.failed = true;
                }
                return Err(e);
            }
        };
        let slot = &self.slots[slot];
        Ok(Some(DeviceBatch {
            epoch: slot.epoch,
            index: slot.index,
            shape: slot.shape,
            dtype: self.output.dtype,
            layout: self.output.layout,
            labels: &slot.labels_host,
            bad: &slot.bad,
            data: slot.output.as_ref().expect("filled"),
            labels_device: slot.labels.as_ref().expect("filled"),
            stream: &self.compute,
        }))
    }

    /// Releases the last batch, issues copies until `depth` are ahead, and orders the compute
    /// stream after the next one's: its slot, or `None` at the end of the source.
    fn advance(&mut self) -> Result<Option<usize>> {
        self.release_delivered()?;
        // Host batches whose copies have completed go back to the pool now.
        for slot in &mut self.slots {
            slot.retire(false, &mut self.stats)?;
        }
        while !self.finished && self.enqueued < self.delivered + self.slots.len() {
            self.enqueue()?;
        }
        if self.delivered == self.enqueued {
            return Ok(None);
        }
        let slot = self.delivered % self.slots.len();
        self.compute
            .wait(&self.slots[slot].ready)
            .map_err(cuda("waiting for a copy"))?;
        self.delivered += 1;
        self.stats.batches += 1;
        Ok(Some(slot))
    }

    /// Takes the next host batch and issues its copy and conversion into its slot.
    fn enqueue(&mut self) -> Result<()> {
        let started = Instant::now();
        let next = self.batches.as_mut().and_then(Iterator::next);
        self.stats.host_wait += started.elapsed();
        let Some(batch) = next else {
            self.finished = true;
            self.batches = None;
            return Ok(());
        };
        let batch = batch?;
        if batch.dtype != DType::U8 || batch.layout != Layout::Nhwc {
            return Err(Error::Config(format!(
                "the GPU prefetcher takes u8 NHWC batches (the GPU converts them), got {} {:?}: \
                 give the loader Transform::raw_u8_nhwc()",
                batch.dtype.name(),
                batch.layout
            )));
        }
        let depth = self.slots.len();
        let slot_index = self.enqueued % depth;
        {
            let slot = &mut self.slots[slot_index];
            if slot.used {
                // The device buffers are overwritten only after the step that used them.
                self.copy
                    .wait(&slot.released)
                    .map_err(cuda("waiting for a release"))?;
            }
            // Its copy was issued `depth` batches ago; this returns at once in steady state.
            // The labels' staging buffer is rewritten below, so the old copy must be done.
            slot.retire(true, &mut self.stats)?;
        }
        match self.issue(slot_index, batch) {
            Ok(()) => {
                self.enqueued += 1;
                Ok(())
            }
            Err(e) => {
                // Copies from the batch's memory may be in flight: the batch stays in its
                // slot (it goes back to the pool only once the copy stream is known to be past
                // it: here, or when the prefetcher is dropped), and nothing more is delivered
                // (`next_batch` marks the prefetcher failed).
                if self.copy.synchronize().is_ok() {
                    self.slots[slot_index].host = None;
                }
                Err(e)
            }
        }
    }

    /// Issues the copies and the conversion of `batch` into slot `slot_index`. From the first
    /// copy on, `batch` is held by the slot, so no error path can return its memory to the pool
    /// while a copy may read it.
    fn issue(&mut self, slot_index: usize, batch: Batch) -> Result<()> {
        let [n, h, w, c] = batch.shape;
        let total = n * h * w * c;
        let out_bytes = total * self.output.element_bytes();
        let label_bytes = 4 * n.max(1);
        let slot = &mut self.slots[slot_index];
        let input = grow(&self.copy, &mut slot.input, total)?;
        let output = grow(&self.copy, &mut slot.output, out_bytes)?;
        let labels = grow(&self.copy, &mut slot.labels, n.max(1))?;
        if slot
            .labels_staging
            .as_ref()
            .is_none_or(|b| b.as_slice().len() < label_bytes)
        {
            slot.labels_staging = Some(match PinnedBuffer::new(&self.ctx, label_bytes) {
                Ok(pinned) => Box::new(pinned),
                Err(_) => Box::new(AlignedBuffer::new(label_bytes)),
            });
        }
        let staging = slot.labels_staging.as_mut().expect("allocated above");
        for (chunk, label) in staging
            .as_mut_slice()
            .chunks_exact_mut(4)
            .zip(&batch.labels)
        {
            chunk.copy_from_slice(&label.to_ne_bytes());
        }
        slot.copy_started
            .record(&self.copy)
            .map_err(cuda("recording a copy event"))?;
        let stream = self.copy.cu_stream();
        slot.labels_host.clear();
        slot.labels_host.extend_from_slice(&batch.labels);
        slot.bad.clone_from(&batch.bad);
        slot.epoch = batch.epoch;
        slot.index = batch.index;
        slot.shape = match self.output.layout {
            Layout::Nchw => [n, 3, h, w],
            Layout::Nhwc => [n, h, w, 3],
        };
        let host = slot.host.insert(batch);
        // SAFETY: the destinations hold at least as many bytes as the sources; the sources (the
        // batch's pixels, page-locked when the pool's allocator is pinned, and the page-locked
        // labels staging buffer) stay alive and unwritten until `slot.ready`, recorded after
        // these copies, has completed: `host` stays in the slot until `retire` sees that, and
        // the staging buffer is rewritten only after `retire(true)`.
        unsafe {
            result::memcpy_htod_async(input, &host.bytes()[..total], stream)
                .map_err(cuda("copying a batch to the device"))?;
            result::memcpy_htod_async(
                labels,
                &slot
                    .labels_staging
                    .as_ref()
                    .expect("allocated above")
                    .as_slice()[..4 * n],
                stream,
            )
            .map_err(cuda("copying labels to the device"))?;
        }
        self.stats.bytes_copied += (total + 4 * n) as u64;
        let (scale, bias) = self.output.affine();
        let function = if self.output.dtype == DType::F16 {
            &self.to_f16
        } else {
            &self.to_f32
        };
        let total_i64 = total as i64;
        let (h_i32, w_i32) = (h as i32, w as i32);
        let nchw = i32::from(self.output.layout == Layout::Nchw);
        let blocks = total.div_ceil(256).clamp(1, 65_535) as u32;
        let mut launch = self.copy.launch_builder(function);
        launch
            .arg(&input)
            .arg(&output)
            .arg(&total_i64)
            .arg(&h_i32)
            .arg(&w_i32)
            .arg(&nchw)
            .arg(&scale[0])
            .arg(&scale[1])
            .arg(&scale[2])
            .arg(&bias[0])
            .arg(&bias[1])
            .arg(&bias[2]);
        if total > 0 {
            // SAFETY: the argument list matches the kernel's signature in kernels.cu; `input`
            // holds `total` bytes and `output` `total` elements of the output type.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(cuda("launching the conversion"))?;
        }
        slot.ready
            .record(&self.copy)
            .map_err(cuda("recording a copy event"))?;
        slot.timing = true;
        Ok(())
    }
}

impl<I: Iterator<Item = Result<Batch>>> Drop for Prefetcher<I> {
    /// Device buffers are freed on the copy stream and host batches go back to the pool: both
    /// only after the trainer's work enqueued so far and every copy in flight have finished.
    /// Should that wait fail (a failed context), host batches still held are leaked rather
    /// than returned while a copy might read them.
    fn drop(&mut self) {
        // The device buffers are freed on the copy stream: after the trainer's work on them.
        let ordered = match self.compute.record_event(None) {
            Ok(done) => self.copy.wait(&done).is_ok(),
            Err(_) => false,
        };
        if !ordered && self.compute.synchronize().is_err() {
            // Neither ordered nor known finished: freeing could pull memory from under the
            // trainer's kernels. Leak the buffers (and host batches) instead.
            for slot in &mut self.slots {
                std::mem::forget(slot.input.take());
                std::mem::forget(slot.output.take());
                std::mem::forget(slot.labels.take());
            }
        }
        if self.copy.synchronize().is_err() {
            // Copies may still read the host batches and the labels' staging buffers.
            for slot in &mut self.slots {
                std::mem::forget(slot.host.take());
                std::mem::forget(slot.labels_staging.take());
            }
        }
    }
}

/// Makes `buffer` hold at least `len` elements (reallocating on `stream` when it is smaller)
/// and returns its device address.
fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buffer: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<cudarc::driver::sys::CUdeviceptr> {
    if buffer.as_ref().is_none_or(|b| b.len() < len) {
        *buffer = Some(
            stream
                .alloc_zeros::<T>(len.max(1))
                .map_err(cuda("allocating device memory"))?,
        );
    }
    let buffer = buffer.as_ref().expect("allocated above");
    Ok(buffer.device_ptr(stream).0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_call_keeps_the_driver_error_as_source() {
        let driver = DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE);
        let err = cuda("copying a batch to the device")(driver);
        let source = std::error::Error::source(&err).expect("the driver's error is kept");
        // (Not formatted here: cudarc formats a DriverError by asking the driver, which this
        // machine may not have.)
        assert_eq!(source.downcast_ref::<DriverError>(), Some(&driver));
        let Error::Cuda { doing, .. } = &err else {
            panic!("not Error::Cuda")
        };
        assert_eq!(doing, "copying a batch to the device");
        // The message is what was done, then the library's error, each said once.
        let err = Error::cuda_call(
            "SGEMM",
            std::io::Error::other("CUBLAS_STATUS_EXECUTION_FAILED"),
        );
        assert_eq!(
            err.to_string(),
            "CUDA: SGEMM: CUBLAS_STATUS_EXECUTION_FAILED"
        );
        assert_eq!(crate::error::display_chain(&err), err.to_string());
        // CUDA that cannot be used at all has no library error behind it.
        let none = Error::cuda_unavailable("no CUDA device");
        assert!(std::error::Error::source(&none).is_none());
        assert_eq!(none.to_string(), "CUDA: no CUDA device");
    }

    #[test]
    fn affine_matches_to_tensor_then_normalize() {
        let out = DeviceOutput {
            dtype: DType::F32,
            layout: Layout::Nchw,
            normalize: Some(Normalize::IMAGENET),
        };
        let (scale, bias) = out.affine();
        for c in 0..3 {
            for pixel in [0u8, 1, 128, 255] {
                let expected = (pixel as f32 / 255.0 - Normalize::IMAGENET.mean[c])
                    / Normalize::IMAGENET.std[c];
                let got = pixel as f32 * scale[c] + bias[c];
                assert!(
                    (got - expected).abs() < 1e-5,
                    "{c} {pixel}: {got} vs {expected}"
                );
            }
        }
        let plain = DeviceOutput {
            normalize: None,
            ..out
        };
        assert_eq!(plain.affine(), ([1.0 / 255.0; 3], [0.0; 3]));
    }

    /// The GPU feed's recipe, checked without a GPU: the loader configuration it makes is
    /// valid, and the conversion `DeviceOutput::of` describes (`pixel * scale + bias`, each
    /// rounded, then the layout), done here on the CPU over the raw batches, gives bit for bit
    /// what the float transform writes itself.
    #[test]
    fn the_gpu_feed_recipe_is_a_valid_loader_and_converts_to_the_cpu_transform() {
        use crate::loader::LoaderConfig;
        use crate::synthetic::{SyntheticSpec, write_image_folder};
        use crate::transform::CIFAR10_NORMALIZE;

        let dir = tempfile::tempdir().unwrap();
        let spec = SyntheticSpec {
            classes: 3,
            per_class: 11,
            width: 20,
            height: 12,
            ..SyntheticSpec::default()
        };
        write_image_folder(dir.path(), &spec).unwrap();
        let ds = crate::format::open(dir.path()).unwrap();
        let config = |transform| {
            LoaderConfig::default()
                .with_batch_size(8)
                .with_workers(2)
                .with_seed(7)
                .with_transform(transform)
        };
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let float_transform = Transform {
                hflip: 0.5,
                ..Transform::cifar()
            }
            .with_output(DType::F32, layout);
            let raw = Loader::new(Arc::clone(&ds), config(float_transform.raw_u8_nhwc()))
                .expect("the recipe's loader configuration is valid");
            let float = Loader::new(Arc::clone(&ds), config(float_transform)).unwrap();
            let output = DeviceOutput::of(&float_transform);
            assert_eq!(
                output,
                DeviceOutput {
                    dtype: DType::F32,
                    layout,
                    normalize: Some(CIFAR10_NORMALIZE)
                }
            );
            let (scale, bias) = output.affine();
            let mut batches = 0;
            for (r, f) in raw.epoch(3).zip(float.epoch(3)) {
                let (r, f) = (r.unwrap(), f.unwrap());
                assert_eq!(r.labels, f.labels);
                let [n, h, w, channels] = r.shape;
                assert_eq!((r.dtype, r.layout, channels), (DType::U8, Layout::Nhwc, 3));
                let (pixels, expected) = (r.bytes(), f.as_f32());
                assert_eq!(pixels.len(), expected.len());
                for i in 0..n {
                    for y in 0..h {
                        for x in 0..w {
                            for c in 0..3 {
                                let p = f32::from(pixels[((i * h + y) * w + x) * 3 + c]);
                                let at = match layout {
                                    Layout::Nchw => ((i * 3 + c) * h + y) * w + x,
                                    Layout::Nhwc => ((i * h + y) * w + x) * 3 + c,
                                };
                                // What the kernel computes, rounded as it rounds.
                                let (a, b) = (p * scale[c] + bias[c], expected[at]);
                                assert!(a.to_bits() == b.to_bits(), "{layout:?} {at}: {a} vs {b}");
                            }
                        }
                    }
                }
                batches += 1;
            }
            assert_eq!(batches, raw.batches_per_epoch());
        }
        // Without the recipe the same mistake is caught, and the message says what to do.
        let wrong = Transform::cifar().with_output(DType::U8, Layout::Nhwc);
        match Loader::new(ds, config(wrong)) {
            Err(e) => assert!(e.to_string().contains("raw_u8_nhwc"), "{e}"),
            Ok(_) => panic!("a u8 transform with normalization was accepted"),
        }
    }

    #[test]
    fn the_ptx_has_every_kernel_and_targets_compute_70() {
        assert!(PTX.contains(".target sm_70"), "compute_70 PTX");
        // Rounded like the CPU: a multiply and an add, each rounded, never one fused FMA.
        assert!(
            !PTX.contains("fma."),
            "the conversion must not fuse the multiply-add"
        );
        assert!(PTX.contains("mul.rn.f32") && PTX.contains("add.rn.f32"));
        assert!(PTX.contains(".version 8.0"), "PTX ISA 8.0 (driver 525+)");
        for kernel in ["u8_nhwc_to_f32", "u8_nhwc_to_f16"] {
            assert!(
                PTX.contains(&format!(".visible .entry {kernel}(")),
                "{kernel} missing from kernels.ptx: run scripts/make_ptx.py"
            );
        }
    }

    #[test]
    fn without_a_gpu_open_says_why_instead_of_panicking() {
        match unavailable_reason() {
            Some(reason) => {
                let err = Gpu::open(0).err().expect("no GPU, so open fails");
                let text = err.to_string();
                assert!(text.starts_with("CUDA: no CUDA"), "{text}");
                assert!(reason.contains("no CUDA"), "{reason}");
                eprintln!("no GPU here ({reason}): checked that open fails cleanly");
            }
            None => {
                let gpu = Gpu::open(0).expect("a GPU is present");
                assert!(!gpu.name().is_empty());
                assert!(
                    Gpu::open(usize::MAX).is_err(),
                    "a device that does not exist"
                );
            }
        }
    }
}
