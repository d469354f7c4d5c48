//! The feed itself: [`Prefetcher`] copies `u8` NHWC batches to the device on a copy stream,
//! `depth` ahead, converts them there ([`DeviceOutput`]) and hands them over as
//! [`DeviceBatch`]es ordered on the trainer's stream (see the module docs of [`crate::gpu`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr as _, LaunchConfig,
    PushKernelArg as _, result, sys,
};

use super::cuda;
use super::device::Gpu;
use super::pinned::PinnedBuffer;
use crate::batch::{BadSample, Batch};
use crate::error::{Error, Result};
use crate::loader::{Epoch, Loader};
use crate::pool::{AlignedBuffer, BatchMemory};
use crate::transform::{DType, Layout, Normalize, Transform};

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
    /// GPU time of the host-to-device copies (pixels and labels), from events on the copy
    /// stream (counted when a copy's host batch is returned to the pool).
    pub copy_time: Duration,
    /// GPU time from the end of the copies to the end of the conversion kernel. While the
    /// trainer's kernels hold the GPU's multiprocessors this includes the kernel's wait for
    /// them, so it measures contention as well as the conversion.
    pub convert_time: Duration,
    /// Copies counted in `copy_time` and `convert_time` (it lags `batches` by the copies still
    /// under way).
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
    /// Recorded on the copy stream after the batch's copies, before its conversion (timing
    /// enabled).
    copied: CudaEvent,
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
        let copy_ms = self
            .copy_started
            .elapsed_ms(&self.copied)
            .map_err(cuda("timing a copy"))?;
        let convert_ms = self
            .copied
            .elapsed_ms(&self.ready)
            .map_err(cuda("timing a conversion"))?;
        stats.copy_time += Duration::from_secs_f64(f64::from(copy_ms.max(0.0)) * 1e-3);
        stats.convert_time += Duration::from_secs_f64(f64::from(convert_ms.max(0.0)) * 1e-3);
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
        if loader.config().batch_mix.is_some() {
            return Err(Error::Config(
                "the GPU prefetcher does not carry MixUp/CutMix soft labels yet: mix the device \
                 batch (or use the Python loader's device=\"cuda\", which does)"
                    .into(),
            ));
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
                copied: gpu.timing_event()?,
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
            ctx: Arc::clone(gpu.context()),
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
        slot.copied
            .record(&self.copy)
            .map_err(cuda("recording a copy event"))?;
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
}
