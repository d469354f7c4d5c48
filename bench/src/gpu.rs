//! `imagefeed-bench gpu`: the GPU feed's measurements.
//!
//! 1. Host-to-device bandwidth from page-locked and from pageable memory, 1, 8 and 64 MiB
//!    copies, timed with events on one stream.
//! 2. Overlap: the prefetcher at depth 1, 2, 3 feeding ImageNet-size `u8` batches
//!    (`--batch` × 224 × 224 × 3) to a training step that fills the GPU: a cuBLAS SGEMM sized
//!    to take `--step-ms`, followed by a stream synchronize (as `loss.item()` would). The
//!    batches come from a source that cycles page-locked buffers filled once, so the CPU side
//!    costs nothing and only the copy/compute overlap is measured. Step time is compared with
//!    the same steps on data already on the GPU; the copy time comes from events on the copy
//!    stream; the stall share is the part of the wall time not spent in steps.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use imagefeed::batch::Batch;
use imagefeed::gpu::blas::Blas;
use imagefeed::gpu::cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _, result};
use imagefeed::gpu::{DeviceOutput, Gpu, PinnedBuffer, Prefetcher};
use imagefeed::pool::{BatchMemory as _, BufferPool};
use imagefeed::transform::{DType, Layout, Normalize};

#[derive(clap::Args)]
pub struct GpuArgs {
    /// Images per batch (224 × 224 × 3 `u8` each).
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Prefetch depths to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub depths: Vec<usize>,
    /// GPU time of one training step (an SGEMM sized to take it), in milliseconds.
    #[arg(long, default_value_t = 2.0)]
    pub step_ms: f64,
    /// Timed steps per depth (after 10 warm-up steps).
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Copy sizes for the bandwidth measurement, in MiB.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub copy_mib: Vec<usize>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

const SIDE: usize = 224;
const WARMUP_STEPS: usize = 10;

pub fn run(args: GpuArgs) -> Result<()> {
    if args.batch == 0
        || args.batch > 1024
        || args.steps == 0
        || args.step_ms.is_nan()
        || args.step_ms <= 0.0
    {
        bail!("--batch must be 1..=1024, --steps at least 1, --step-ms positive");
    }
    if args.depths.iter().any(|&d| d == 0 || d > 16) {
        bail!("--depths must be 1..=16");
    }
    let gpu = Gpu::open(args.device)?;
    println!("device {}: {}", args.device, gpu.name());

    // 1. Bandwidth.
    for &mib in &args.copy_mib {
        let bytes = mib << 20;
        let pinned = h2d_bandwidth(&gpu, bytes, true, 20)?;
        let pageable = h2d_bandwidth(&gpu, bytes, false, 20)?;
        println!(
            "host-to-device {mib} MiB, median of 20: page-locked {pinned:.2} GB/s, pageable {pageable:.2} GB/s ({:.2}x)",
            pinned / pageable
        );
    }

    // 2. Overlap.
    let compute = gpu.new_stream()?;
    let step = GemmStep::calibrated(&gpu, &compute, args.step_ms)?;
    let resident = {
        for _ in 0..WARMUP_STEPS {
            step.run(&compute)?;
        }
        let start = Instant::now();
        for _ in 0..args.steps {
            step.run(&compute)?;
            compute.synchronize()?;
        }
        start.elapsed().as_secs_f64() / args.steps as f64
    };
    let batch_bytes = args.batch * SIDE * SIDE * 3;
    println!(
        "step: SGEMM {n}x{n}x{n} ({:.2} ms of GPU time) + synchronize; data already on the GPU: {:.3} ms/step",
        step.gpu_ms,
        resident * 1e3,
        n = step.n
    );
    println!(
        "batches: {} x 224x224x3 u8 ({:.1} MB), page-locked, converted to f32 NCHW normalized on the GPU",
        args.batch,
        batch_bytes as f64 / 1e6
    );
    println!(
        "| depth | ms/step | vs resident | data stall | copy ms/batch (events) | copy GB/s | conversion ms/batch (events) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let output = DeviceOutput {
        dtype: DType::F32,
        layout: Layout::Nchw,
        normalize: Some(Normalize::IMAGENET),
    };
    for &depth in &args.depths {
        let pool = BufferPool::new(gpu.pinned_allocator());
        pool.reserve(depth + 2, batch_bytes);
        let mut feed: Prefetcher<CyclingBatches> =
            Prefetcher::new(&gpu, Arc::clone(&compute), output, depth)?;
        let steps_run =
            |feed: &mut Prefetcher<CyclingBatches>, count: usize, epoch: u64| -> Result<f64> {
                feed.start(CyclingBatches::new(&pool, args.batch, count, epoch))?;
                let start = Instant::now();
                let mut done = 0;
                while let Some(_batch) = feed.next_batch()? {
                    step.run(&compute)?;
                    compute.synchronize()?;
                    done += 1;
                }
                if done != count {
                    bail!("the prefetcher delivered {done} of {count} batches");
                }
                Ok(start.elapsed().as_secs_f64())
            };
        steps_run(&mut feed, WARMUP_STEPS, 0)?;
        let before = feed.stats();
        let wall = steps_run(&mut feed, args.steps, 1)?;
        let stats = feed.stats();
        let per_step = wall / args.steps as f64;
        let copies = (stats.copies_timed - before.copies_timed).max(1) as f64;
        let copy_s = (stats.copy_time - before.copy_time).as_secs_f64() / copies;
        let convert_s = (stats.convert_time - before.convert_time).as_secs_f64() / copies;
        println!(
            "| {depth} | {:.3} | {:.3}x | {:.1}% | {:.3} | {:.1} | {:.3} |",
            per_step * 1e3,
            per_step / resident,
            100.0 * (1.0 - resident * args.steps as f64 / wall).max(0.0),
            copy_s * 1e3,
            batch_bytes as f64 / copy_s.max(1e-9) / 1e9,
            convert_s * 1e3
        );
    }
    Ok(())
}

/// Host-to-device bandwidth in GB/s: the median of `repeats` copies of `bytes`, from
/// page-locked memory (`pinned`) or from ordinary heap memory, timed with timing events.
fn h2d_bandwidth(gpu: &Gpu, bytes: usize, pinned: bool, repeats: usize) -> Result<f64> {
    let stream = gpu.new_stream()?;
    let mut heap = Vec::new();
    let pinned_buffer;
    let source: &[u8] = if pinned {
        pinned_buffer = PinnedBuffer::new(gpu.context(), bytes)?;
        pinned_buffer.as_slice()
    } else {
        heap.resize(bytes, 1u8);
        &heap
    };
    let device = stream.alloc_zeros::<u8>(bytes.max(1))?;
    let dst = device.device_ptr(&stream).0;
    let (start, end) = (gpu.timing_event()?, gpu.timing_event()?);
    let mut rates = Vec::with_capacity(repeats + 1);
    for _ in 0..repeats.max(1) + 1 {
        start.record(&stream)?;
        // SAFETY: `dst` holds `bytes` bytes; `source` outlives the copy: `elapsed_ms` below
        // waits for `end`, recorded after it.
        unsafe { result::memcpy_htod_async(dst, source, stream.cu_stream()) }?;
        end.record(&stream)?;
        let ms = start.elapsed_ms(&end)?;
        rates.push(bytes as f64 / (f64::from(ms) * 1e-3) / 1e9);
    }
    rates.remove(0); // The first copy warms up the path.
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

/// `count` batches of `n` × 224 × 224 × 3 `u8`, each in a buffer of `pool` (page-locked,
/// filled once: a buffer returns to the pool after its copy and is handed out again).
struct CyclingBatches {
    pool: BufferPool,
    n: usize,
    count: usize,
    next: usize,
    epoch: u64,
}

impl CyclingBatches {
    fn new(pool: &BufferPool, n: usize, count: usize, epoch: u64) -> Self {
        CyclingBatches {
            pool: pool.clone(),
            n,
            count,
            next: 0,
            epoch,
        }
    }
}

impl Iterator for CyclingBatches {
    type Item = imagefeed::Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next == self.count {
            return None;
        }
        let index = self.next;
        self.next += 1;
        let data = self.pool.take(self.n * SIDE * SIDE * 3);
        Some(Batch::from_parts(
            self.epoch,
            index,
            (0..self.n).collect(),
            (0..self.n as u32).map(|i| i % 1000).collect(),
            [self.n, SIDE, SIDE, 3],
            DType::U8,
            Layout::Nhwc,
            data,
        ))
    }
}

/// A training step of known GPU time: `C = A · B` on `n × n` f32 matrices.
struct GemmStep {
    blas: Blas,
    n: usize,
    gpu_ms: f64,
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    c: CudaSlice<f32>,
}

impl GemmStep {
    fn new(stream: &Arc<CudaStream>, n: usize) -> Result<Self> {
        Ok(GemmStep {
            blas: Blas::new(stream).context("creating a cuBLAS handle")?,
            n,
            gpu_ms: 0.0,
            a: stream.alloc_zeros::<f32>(n * n)?,
            b: stream.alloc_zeros::<f32>(n * n)?,
            c: stream.alloc_zeros::<f32>(n * n)?,
        })
    }

    /// A step sized (n a multiple of 256) to take about `target_ms` of GPU time.
    fn calibrated(gpu: &Gpu, stream: &Arc<CudaStream>, target_ms: f64) -> Result<Self> {
        let mut n = 1024;
        loop {
            let mut step = Self::new(stream, n)?;
            step.gpu_ms = step.time(gpu, stream)?;
            let scale = (target_ms / step.gpu_ms).cbrt();
            if (0.9..=1.1).contains(&scale) || n >= 16_384 {
                return Ok(step);
            }
            let next = ((n as f64 * scale / 256.0).round() as usize).clamp(1, 64) * 256;
            if next == n {
                return Ok(step);
            }
            n = next;
        }
    }

    /// Median GPU time of the step in ms, from events.
    fn time(&self, gpu: &Gpu, stream: &Arc<CudaStream>) -> Result<f64> {
        let (start, end) = (gpu.timing_event()?, gpu.timing_event()?);
        self.run(stream)?;
        let mut times = Vec::new();
        for _ in 0..7 {
            start.record(stream)?;
            self.run(stream)?;
            end.record(stream)?;
            times.push(f64::from(start.elapsed_ms(&end)?));
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    fn run(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let n = self.n as i32;
        let a = self.a.device_ptr(stream).0;
        let b = self.b.device_ptr(stream).0;
        let c = self.c.device_ptr(stream).0;
        // SAFETY: a, b and c are n×n f32 device matrices of this context; the handle runs on
        // `stream`, which the matrices were allocated on.
        unsafe {
            self.blas
                .sgemm(false, false, (n, n, n), 1.0, (a, n), (b, n), 0.0, (c, n))
        }?;
        Ok(())
    }
}
