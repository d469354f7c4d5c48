//! `imagefeed-bench gpu`: the GPU feed's measurements.
//!
//! 1. Host-to-device bandwidth from page-locked and from pageable memory.
//! 2. A stand-in training loop: every step is `--step-us` of GPU work on the compute stream
//!    (a spinning kernel) followed by a stream synchronize (as `loss.item()` would), fed by the
//!    prefetcher at depth 1, 2, 3. Step time is compared with the same steps on data that is
//!    already on the GPU; the data-stall share is the part of the wall time not spent in steps.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, Result};
use imagefeed::gpu::{DeviceOutput, Gpu, Prefetcher};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::transform::{CIFAR10_NORMALIZE, DType, Layout, Normalize, Transform};

#[derive(clap::Args)]
pub struct GpuArgs {
    /// A packed dataset or an ImageFolder tree.
    pub dataset: PathBuf,
    /// cifar: flip at native size; imagenet: RandomResizedCrop 224 + flip. Converted on the
    /// GPU to normalized f32 NCHW.
    #[arg(long, value_enum, default_value = "cifar")]
    pub transform: crate::compare::CompareTransform,
    /// Samples per batch (default: 256 for cifar, 64 for imagenet).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Loader worker threads.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Prefetch depths to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub depths: Vec<usize>,
    /// GPU time of one stand-in training step, in microseconds.
    #[arg(long, default_value_t = 2000)]
    pub step_us: u64,
    /// Bytes per bandwidth copy.
    #[arg(long, default_value_t = 64 << 20)]
    pub copy_bytes: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

pub fn run(args: GpuArgs) -> Result<()> {
    let gpu = Gpu::open(args.device)?;
    println!("device {}: {}", args.device, gpu.name());

    // 1. Bandwidth.
    let pinned = gpu.h2d_bandwidth(args.copy_bytes, true, 10)?;
    let pageable = gpu.h2d_bandwidth(args.copy_bytes, false, 10)?;
    println!(
        "host-to-device, {} MiB copies, median of 10: page-locked {pinned:.1} GB/s, pageable {pageable:.1} GB/s ({:.1}x)",
        args.copy_bytes >> 20,
        pinned / pageable
    );

    // 2. The stand-in training loop.
    let ds = imagefeed::format::open(&args.dataset)
        .with_context(|| format!("opening {}", args.dataset.display()))?;
    let (transform, normalize, batch_size): (Transform, Normalize, usize) = match args.transform {
        crate::compare::CompareTransform::Cifar => (Transform::cifar(), CIFAR10_NORMALIZE, 256),
        crate::compare::CompareTransform::Imagenet => {
            (Transform::imagenet_train(224), Normalize::IMAGENET, 64)
        }
    };
    let batch_size = args.batch_size.unwrap_or(batch_size);
    let config = LoaderConfig::default()
        .with_batch_size(batch_size)
        .with_workers(args.workers)
        .with_prefetch(2 * args.workers)
        .with_transform(transform.with_output(DType::U8, Layout::Nhwc));
    let output = DeviceOutput {
        dtype: DType::F32,
        layout: Layout::Nchw,
        normalize: Some(normalize),
    };
    let step_ns = args.step_us * 1000;
    let compute = gpu.new_stream()?;

    // Steps on resident data: the floor.
    let steps = Loader::new(Arc::clone(&ds), config.clone())?.batches_per_epoch();
    let resident = {
        let start = Instant::now();
        for _ in 0..steps {
            gpu.busy_wait(&compute, step_ns)?;
            compute.synchronize()?;
        }
        start.elapsed().as_secs_f64() / steps as f64
    };
    println!(
        "{} batches of {batch_size}; step {} us of GPU work + synchronize; data already on the GPU: {:.3} ms/step",
        steps,
        args.step_us,
        resident * 1e3
    );
    println!(
        "| depth | images/s | ms/step | vs resident | data stall | host waited for the loader | MB copied |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &depth in &args.depths {
        let allocator = gpu.pinned_allocator();
        let loader = Loader::with_allocator(Arc::clone(&ds), config.clone(), allocator.clone())?;
        // One warm-up epoch fills the pool and the device buffers.
        for (epoch, timed) in [(0, false), (1, true)] {
            let mut feed = Prefetcher::new(
                &gpu,
                Arc::clone(&compute),
                loader.epoch(epoch),
                output,
                depth,
            )?;
            let start = Instant::now();
            let mut images = 0;
            let mut done = 0;
            while let Some(batch) = feed.next_batch()? {
                images += batch.len();
                gpu.busy_wait(&compute, step_ns)?;
                compute.synchronize()?;
                done += 1;
            }
            let wall = start.elapsed().as_secs_f64();
            if !timed {
                continue;
            }
            let stats = feed.stats();
            let per_step = wall / done.max(1) as f64;
            println!(
                "| {depth} | {:.0} | {:.3} | {:+.1}% | {:.1}% | {:.0} ms | {:.0} |",
                images as f64 / wall,
                per_step * 1e3,
                100.0 * (per_step / resident - 1.0),
                100.0 * (1.0 - resident * done as f64 / wall).max(0.0),
                stats.host_wait.as_secs_f64() * 1e3,
                stats.bytes_copied as f64 / 1e6
            );
        }
        if allocator.fallbacks() > 0 {
            println!(
                "note: depth {depth}: {} batch buffers were not page-locked (allocation failed)",
                allocator.fallbacks()
            );
        }
    }
    Ok(())
}
