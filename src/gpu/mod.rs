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
//!   as the CPU [`SlotWriter`](crate::transform::SlotWriter) up to float rounding.
//!
//! CUDA is loaded at run time (cudarc's dynamic loading): on a machine without the driver or a
//! device, [`Gpu::open`] returns [`Error::Cuda`] saying which, and nothing panics.
//!
//! The kernels ship as PTX (`src/gpu/kernels.ptx`, ISA 8.0 for compute_70, made from
//! `kernels.cu` by `scripts/make_ptx.py` with NVRTC): no CUDA compiler at build or run time;
//! the driver (525 or newer) compiles it for the GPU it finds.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr as _,
    DriverError, LaunchConfig, PushKernelArg as _, result, sys,
};
use cudarc::nvrtc::Ptx;

use crate::batch::{BadSample, Batch};
use crate::error::{Error, Result};
use crate::pool::{AlignedBuffer, BatchAllocator, BatchMemory};
use crate::transform::{DType, Layout, Normalize};

/// The cudarc this module is built on, for code that drives the same context (streams,
/// cuBLAS) without a version mismatch.
pub use cudarc;

/// The kernels, as PTX text.
pub const PTX: &str = include_str!("kernels.ptx");

fn cuda(what: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// Number of CUDA devices, or why CUDA cannot be used here: no driver library, or a driver
/// that fails to initialize (no device, a driver/library mismatch). Never panics.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver library under its known names and closes it.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Cuda(
            "no CUDA driver: libcuda.so was not found (this machine has no NVIDIA driver)".into(),
        ));
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(Error::Cuda(format!(
            "the CUDA driver did not initialize: {e}"
        ))),
    }
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

/// One GPU: its context (with the kernels loaded).
pub struct Gpu {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    busy_wait: CudaFunction,
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels.
    ///
    /// cudarc's automatic per-allocation stream tracking is turned off for this context: the
    /// [`Prefetcher`] orders its streams with its own events, and code sharing the context must
    /// order its streams itself.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let count = device_count()?;
        if count == 0 {
            return Err(Error::Cuda(
                "no CUDA device: the driver is present but reports no GPU".into(),
            ));
        }
        if ordinal >= count {
            return Err(Error::Cuda(format!(
                "no device {ordinal}: this machine has {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda("creating a context"))?;
        // SAFETY: called before any allocation or stream of this context exists; from here on
        // every cross-stream dependency is an explicit event (see the module docs).
        unsafe { ctx.disable_event_tracking() };
        let module = ctx.load_module(Ptx::from_src(PTX)).map_err(cuda(
            "loading the kernels (PTX ISA 8.0 needs driver 525 or newer)",
        ))?;
        let busy_wait = module
            .load_function("busy_wait")
            .map_err(cuda("kernel busy_wait"))?;
        Ok(Gpu {
            ctx,
            module,
            busy_wait,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("unknown ({e})"))
    }

    /// A kernel from the shipped PTX.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module
            .load_function(name)
            .map_err(|e| Error::Cuda(format!("kernel {name}: {e}")))
    }

    /// A new stream.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(cuda("creating a stream"))
    }

    /// Enqueues `ns` nanoseconds of GPU work on `stream` (one spinning thread): a stand-in
    /// for a training step of known length.
    pub fn busy_wait(&self, stream: &CudaStream, ns: u64) -> Result<()> {
        let mut launch = stream.launch_builder(&self.busy_wait);
        launch.arg(&ns);
        // SAFETY: `busy_wait(unsigned long long)` takes exactly this one argument.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }
            .map_err(cuda("launching busy_wait"))?;
        Ok(())
    }

    /// Host-to-device bandwidth in GB/s: the median of `repeats` copies of `bytes`, from
    /// page-locked memory (`pinned`) or from ordinary heap memory, timed with events.
    pub fn h2d_bandwidth(&self, bytes: usize, pinned: bool, repeats: usize) -> Result<f64> {
        let stream = self.new_stream()?;
        let mut heap = Vec::new();
        let pinned_buffer;
        let source: &[u8] = if pinned {
            pinned_buffer = PinnedBuffer::new(&self.ctx, bytes)?;
            pinned_buffer.as_slice()
        } else {
            heap.resize(bytes, 1u8);
            &heap
        };
        let device = stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(cuda("allocating device memory"))?;
        let dst = device.device_ptr(&stream).0;
        let event = || self.ctx.new_event(None).map_err(cuda("creating an event"));
        let (start, end) = (event()?, event()?);
        let mut rates = Vec::with_capacity(repeats);
        for _ in 0..repeats.max(1) + 1 {
            start.record(&stream).map_err(cuda("recording"))?;
            // SAFETY: `dst` holds `bytes` bytes; `source` outlives the copy (the stream is
            // synchronized by `elapsed_ms` below before it can be dropped).
            unsafe { result::memcpy_htod_async(dst, source, stream.cu_stream()) }
                .map_err(cuda("copying"))?;
            end.record(&stream).map_err(cuda("recording"))?;
            let ms = start.elapsed_ms(&end).map_err(cuda("timing"))?;
            rates.push(bytes as f64 / (f64::from(ms) * 1e-3) / 1e9);
        }
        rates.remove(0); // The first copy warms up the path.
        rates.sort_by(f64::total_cmp);
        Ok(rates[rates.len() / 2])
    }

    /// An allocator of page-locked batch buffers, for [`Loader::with_allocator`](crate::loader::Loader::with_allocator).
    pub fn pinned_allocator(&self) -> Arc<PinnedAllocator> {
        Arc::new(PinnedAllocator {
            ctx: Arc::clone(&self.ctx),
            pinned: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        })
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (portable: usable with every context; not
/// write-combined, so the CPU reads it at normal speed).
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer owns its allocation exclusively; `&self` gives only shared reads and
// `&mut self` exclusive writes, so moving or sharing it between threads is sound.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` zeroed page-locked bytes (at least one is reserved).
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBuffer> {
        ctx.bind_to_thread().map_err(cuda("binding the context"))?;
        // SAFETY: a plain allocation call with a non-zero size; the pointer is owned by the
        // returned buffer and freed exactly once, in `Drop`.
        let raw = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(cuda("allocating page-locked memory"))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| Error::Cuda("cuMemHostAlloc returned null".into()))?;
        // SAFETY: the block is `len.max(1)` writable bytes that nothing else references yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
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
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once; the pool hands a buffer
        // back (and so can drop it) only after every copy from it has completed.
        let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
    }
}

/// Hands the loader's pool page-locked buffers. When page-locked memory runs out, a heap
/// buffer is handed out instead (copies from it are slower, never wrong) and counted.
pub struct PinnedAllocator {
    ctx: Arc<CudaContext>,
    pinned: AtomicU64,
    fallbacks: AtomicU64,
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
}

impl BatchAllocator for PinnedAllocator {
    fn allocate(&self, bytes: usize) -> Box<dyn BatchMemory> {
        match PinnedBuffer::new(&self.ctx, bytes) {
            Ok(buffer) => {
                self.pinned.fetch_add(1, Ordering::Relaxed);
                Box::new(buffer)
            }
            Err(_) => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
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
    /// Per-channel `(scale, bias)` so that `out = pixel * scale + bias` equals
    /// `(pixel / 255 - mean) / std`.
    pub fn affine(&self) -> ([f32; 3], [f32; 3]) {
        match self.normalize {
            None => ([1.0 / 255.0; 3], [0.0; 3]),
            Some(n) => {
                let mut scale = [0.0; 3];
                let mut bias = [0.0; 3];
                for c in 0..3 {
                    scale[c] = 1.0 / (255.0 * n.std[c]);
                    bias[c] = -n.mean[c] / n.std[c];
                }
                (scale, bias)
            }
        }
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
    /// Recorded on the copy stream after the batch's copy and conversion.
    ready: CudaEvent,
    /// Recorded on the compute stream when the trainer moved past the batch.
    released: CudaEvent,
    /// `released` has been recorded (the slot held a delivered batch).
    used: bool,
    /// The host batch, held until its copy has completed (and dropped as soon as it has).
    host: Option<Batch>,
    /// What the delivered batch reports; kept apart from `host`, which may go first.
    shape: [usize; 4],
    epoch: u64,
    index: usize,
    labels_host: Vec<u32>,
    bad: Vec<BadSample>,
}

/// Feeds a loader's `u8` NHWC batches to the GPU, `depth` batches ahead (2 = double buffering).
pub struct Prefetcher<I: Iterator<Item = Result<Batch>>> {
    batches: I,
    copy: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    output: DeviceOutput,
    to_f32: CudaFunction,
    to_f16: CudaFunction,
    slots: Vec<Slot>,
    enqueued: usize,
    delivered: usize,
    finished: bool,
    stats: PrefetchStats,
}

impl<I: Iterator<Item = Result<Batch>>> Prefetcher<I> {
    /// A prefetcher over `batches` (e.g. [`Loader::epoch`](crate::loader::Loader::epoch) of a
    /// loader whose transform outputs `u8` NHWC, ideally built with
    /// [`Gpu::pinned_allocator`]). Work on delivered batches goes on `compute`.
    pub fn new(
        gpu: &Gpu,
        compute: Arc<CudaStream>,
        batches: I,
        output: DeviceOutput,
        depth: usize,
    ) -> Result<Self> {
        if depth == 0 {
            return Err(Error::Config("prefetch depth must be at least 1".into()));
        }
        if !matches!(output.dtype, DType::F32 | DType::F16) {
            return Err(Error::Config(format!(
                "the GPU converts to f32 or f16, not {}",
                output.dtype.name()
            )));
        }
        let event = || {
            gpu.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(cuda("creating an event"))
        };
        let mut slots = Vec::with_capacity(depth);
        for _ in 0..depth {
            slots.push(Slot {
                input: None,
                output: None,
                labels: None,
                ready: event()?,
                released: event()?,
                used: false,
                host: None,
                shape: [0; 4],
                epoch: 0,
                index: 0,
                labels_host: Vec::new(),
                bad: Vec::new(),
            });
        }
        Ok(Prefetcher {
            batches,
            copy: gpu.new_stream()?,
            compute,
            output,
            to_f32: gpu.function("u8_nhwc_to_f32")?,
            to_f16: gpu.function("u8_nhwc_to_f16")?,
            slots,
            enqueued: 0,
            delivered: 0,
            finished: false,
            stats: PrefetchStats::default(),
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> PrefetchStats {
        self.stats
    }

    /// The copy stream.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The next batch on the GPU, or `None` at the end of the epoch. The previous batch is
    /// released: the trainer's work enqueued on it so far is the last that may read it.
    pub fn next_batch(&mut self) -> Result<Option<DeviceBatch<'_>>> {
        let depth = self.slots.len();
        if self.delivered > 0 {
            let previous = &mut self.slots[(self.delivered - 1) % depth];
            previous
                .released
                .record(&self.compute)
                .map_err(cuda("recording a release event"))?;
            previous.used = true;
        }
        // Host batches whose copies have completed go back to the pool now.
        for slot in &mut self.slots {
            if slot.host.is_some() && slot.ready.is_complete() {
                slot.host = None;
            }
        }
        while !self.finished && self.enqueued < self.delivered + depth {
            self.enqueue()?;
        }
        if self.delivered == self.enqueued {
            return Ok(None);
        }
        let slot = &self.slots[self.delivered % depth];
        self.compute
            .wait(&slot.ready)
            .map_err(cuda("waiting for a copy"))?;
        self.delivered += 1;
        self.stats.batches += 1;
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

    /// Takes the next host batch and issues its copy and conversion into its slot.
    fn enqueue(&mut self) -> Result<()> {
        let started = Instant::now();
        let next = self.batches.next();
        self.stats.host_wait += started.elapsed();
        let Some(batch) = next else {
            self.finished = true;
            return Ok(());
        };
        let batch = batch?;
        if batch.dtype != DType::U8 || batch.layout != Layout::Nhwc {
            return Err(Error::Config(format!(
                "the GPU prefetcher takes u8 NHWC batches (the GPU converts them), got {} {:?}: \
                 set the transform's output to u8 NHWC",
                batch.dtype.name(),
                batch.layout
            )));
        }
        let [n, h, w, c] = batch.shape;
        let total = n * h * w * c;
        let out_bytes = total * self.output.element_bytes();
        let depth = self.slots.len();
        let slot = &mut self.slots[self.enqueued % depth];
        if slot.used {
            // The device buffers are overwritten only after the step that used them.
            self.copy
                .wait(&slot.released)
                .map_err(cuda("waiting for a release"))?;
        }
        if let Some(old) = slot.host.take() {
            // Its copy was issued `depth` batches ago; this returns at once in steady state.
            slot.ready
                .synchronize()
                .map_err(cuda("waiting for an old copy"))?;
            drop(old);
        }
        let input = grow(&self.copy, &mut slot.input, total)?;
        let output = grow(&self.copy, &mut slot.output, out_bytes)?;
        let labels = grow(&self.copy, &mut slot.labels, n.max(1))?;
        let stream = self.copy.cu_stream();
        // SAFETY: the destinations hold at least as many bytes as the sources; the sources
        // (the batch's pixels, page-locked when the pool's allocator is pinned, and its labels)
        // stay alive in `slot.host` until `slot.ready`, recorded after these copies, completes.
        unsafe {
            result::memcpy_htod_async(input, &batch.bytes()[..total], stream)
                .map_err(cuda("copying a batch to the device"))?;
            result::memcpy_htod_async(labels, &batch.labels[..], stream)
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
        slot.shape = match self.output.layout {
            Layout::Nchw => [n, 3, h, w],
            Layout::Nhwc => [n, h, w, 3],
        };
        slot.epoch = batch.epoch;
        slot.index = batch.index;
        slot.labels_host.clear();
        slot.labels_host.extend_from_slice(&batch.labels);
        slot.bad.clone_from(&batch.bad);
        slot.host = Some(batch);
        self.enqueued += 1;
        Ok(())
    }
}

impl<I: Iterator<Item = Result<Batch>>> Drop for Prefetcher<I> {
    /// Device buffers are freed on the copy stream and host batches go back to the pool: both
    /// only after the trainer's work enqueued so far and every copy in flight have finished.
    fn drop(&mut self) {
        if let Ok(done) = self.compute.record_event(None) {
            let _ = self.copy.wait(&done);
        }
        let _ = self.copy.synchronize();
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

    #[test]
    fn the_ptx_has_every_kernel_and_targets_compute_70() {
        assert!(PTX.contains(".target sm_70"), "compute_70 PTX");
        assert!(PTX.contains(".version 8.0"), "PTX ISA 8.0 (driver 525+)");
        for kernel in [
            "u8_nhwc_to_f32",
            "u8_nhwc_to_f16",
            "softmax_xent",
            "column_sums",
            "add_bias",
            "sgd_step",
            "busy_wait",
        ] {
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
