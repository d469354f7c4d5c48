//! `imagefeed-bench`: throughput measurements. For now `read`: read (and optionally decode)
//! every record of a dataset with N threads, each through its own reader handle.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use imagefeed::decode::Decoder;
use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig};
use imagefeed::transform::{DType, Layout, Transform};
use sha2::{Digest as _, Sha256};

mod ceiling;

#[derive(Parser)]
#[command(
    name = "imagefeed-bench",
    version,
    about = "Measure imagefeed throughput"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TransformArg {
    /// Random flip + normalize at native size.
    Cifar,
    /// RandomResizedCrop 224 + random flip + normalize.
    Imagenet,
    /// Decode only, u8 NHWC.
    None,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DTypeArg {
    U8,
    F16,
    F32,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LayoutArg {
    Nchw,
    Nhwc,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PolicyArg {
    Skip,
    Replace,
    Error,
}

#[derive(clap::Args)]
struct LoadArgs {
    /// A packed dataset file or an ImageFolder directory.
    dataset: PathBuf,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Batches in flight (default: 2 per worker).
    #[arg(long)]
    prefetch: Option<usize>,
    /// Seed for shuffling and augmentation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Epochs to run.
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    /// Per-sample transform.
    #[arg(long, value_enum, default_value = "cifar")]
    transform: TransformArg,
    /// Output element type (default: f32, or u8 for `--transform none`).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// Output layout (default: nchw, or nhwc for `--transform none`).
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
    /// Bad-sample policy.
    #[arg(long, value_enum, default_value = "skip")]
    bad: PolicyArg,
    /// Keep dataset order instead of shuffling.
    #[arg(long)]
    no_shuffle: bool,
    /// Print a SHA-256 over each epoch's batches (pixels and labels, in order).
    #[arg(long)]
    digest: bool,
    /// Also measure the decode ceiling (1-thread libjpeg-turbo rate × workers) on the first
    /// N payloads (0: skip).
    #[arg(long, default_value_t = 0)]
    ceiling_samples: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Run the loader over a dataset: one line per epoch with images/s (and a digest).
    Load(LoadArgs),
    /// Read every record of a dataset (a packed file or an ImageFolder directory).
    Read {
        /// The dataset.
        dataset: PathBuf,
        /// Reader threads; records are split between them in contiguous ranges.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Also decode each payload to RGB.
        #[arg(long)]
        decode: bool,
        /// Passes over the dataset; one line each.
        #[arg(long, default_value_t = 1)]
        epochs: usize,
        /// Evict the dataset's pages from the page cache before each pass (posix_fadvise).
        #[arg(long)]
        cold: bool,
    },
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", imagefeed::error::display_chain(err.as_ref()));
            std::process::ExitCode::from(2)
        }
    }
}

/// Resident memory of this process in MB (Linux /proc): total, peak, and anonymous (the
/// process's own allocations, without pages of memory-mapped dataset files, which the kernel
/// can drop at will).
fn memory_mb() -> (f64, f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"), field("RssAnon:"))
}

fn load(args: LoadArgs) -> Result<()> {
    let LoadArgs {
        dataset,
        batch_size,
        workers,
        prefetch,
        seed,
        epochs,
        transform,
        dtype,
        layout,
        bad,
        no_shuffle,
        digest,
        ceiling_samples,
    } = args;
    let ds = imagefeed::format::open(&dataset)
        .with_context(|| format!("opening {}", dataset.display()))?;
    let mut t = match transform {
        TransformArg::Cifar => Transform::cifar(),
        TransformArg::Imagenet => Transform::imagenet_train(224),
        TransformArg::None => Transform::none(),
    };
    let dtype = dtype.map(|d| match d {
        DTypeArg::U8 => DType::U8,
        DTypeArg::F16 => DType::F16,
        DTypeArg::F32 => DType::F32,
    });
    let layout = layout.map(|l| match l {
        LayoutArg::Nchw => Layout::Nchw,
        LayoutArg::Nhwc => Layout::Nhwc,
    });
    t = t.with_output(
        dtype.unwrap_or(t.output.dtype),
        layout.unwrap_or(t.output.layout),
    );
    let config = LoaderConfig {
        batch_size,
        workers,
        prefetch: prefetch.unwrap_or(2 * workers),
        seed,
        shuffle: !no_shuffle,
        transform: t,
        bad_samples: match bad {
            PolicyArg::Skip => BadSamplePolicy::Skip,
            PolicyArg::Replace => BadSamplePolicy::Replace,
            PolicyArg::Error => BadSamplePolicy::Error,
        },
        ..LoaderConfig::default()
    };
    let ceiling = if ceiling_samples > 0 {
        let rate = ceiling::single_thread_decode_rate(ds.as_ref(), Some(ceiling_samples))?;
        println!(
            "decode ceiling: {rate:.0} images/s per thread (libjpeg-turbo, full size) x {workers} = {:.0} images/s",
            rate * workers as f64
        );
        Some(rate * workers as f64)
    } else {
        None
    };
    let loader = Loader::new(ds, config)?;
    println!(
        "{}: {} samples, {} batches/epoch of {batch_size}, {workers} workers, transform {}, {} {:?}",
        dataset.display(),
        loader.dataset().len(),
        loader.batches_per_epoch(),
        match transform {
            TransformArg::Cifar => "cifar",
            TransformArg::Imagenet => "imagenet",
            TransformArg::None => "none",
        },
        t.output.dtype.name(),
        t.output.layout
    );
    for epoch in 0..epochs {
        let start = Instant::now();
        let mut images = 0usize;
        let mut bad_samples = 0usize;
        let mut hasher = Sha256::new();
        for batch in loader.epoch(epoch) {
            let batch = batch?;
            images += batch.len();
            bad_samples += batch.bad.len();
            if digest {
                hasher.update(batch.bytes());
                for label in &batch.labels {
                    hasher.update(label.to_le_bytes());
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let rate = images as f64 / secs;
        let (rss, peak, anon) = memory_mb();
        let mut line = format!(
            "epoch {epoch}: {images} images in {secs:.3} s: {rate:.0} images/s, {bad_samples} bad, rss {rss:.0} MB (anon {anon:.0} MB, peak {peak:.0} MB)"
        );
        if let Some(c) = ceiling {
            line.push_str(&format!(", {:.0}% of ceiling", 100.0 * rate / c));
        }
        if digest {
            line.push_str(&format!(", sha256 {:x}", hasher.finalize()));
        }
        println!("{line}");
    }
    let s = loader.stats();
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    println!(
        "stages (summed over workers): read {:.0} ms, decode {:.0} ms, transform {:.0} ms, collate {:.0} ms; consumer waited {:.0} ms; buffers allocated {}",
        ms(s.read),
        ms(s.decode),
        ms(s.transform),
        ms(s.collate),
        ms(s.waiting),
        loader.pool().allocations()
    );
    Ok(())
}

fn run() -> Result<()> {
    match Cli::parse().command {
        Command::Load(args) => load(args),
        Command::Read {
            dataset,
            threads,
            decode,
            epochs,
            cold,
        } => {
            let threads = threads.max(1);
            for epoch in 0..epochs {
                let cache = if cold {
                    let stats = imagefeed::pagecache::evict(&dataset)?;
                    format!(
                        ", cold: {:.1}% of {} files resident at start",
                        stats.resident_fraction() * 100.0,
                        stats.files
                    )
                } else {
                    String::new()
                };
                // Opened after eviction, dropped after the pass: the kernel does not evict pages
                // that this process keeps mapped. Opening is timed too (a folder scans its
                // directories; an LMDB may start streaming into the page cache).
                let start = Instant::now();
                let ds = imagefeed::format::open(&dataset)
                    .with_context(|| format!("opening {}", dataset.display()))?;
                let n = ds.len();
                let bytes = AtomicU64::new(0);
                let bad = AtomicU64::new(0);
                std::thread::scope(|scope| -> Result<()> {
                    let workers: Vec<_> = (0..threads)
                        .map(|t| {
                            let (ds, bytes, bad) = (&ds, &bytes, &bad);
                            scope.spawn(move || -> Result<()> {
                                let mut reader = ds.open_reader()?;
                                let mut decoder = Decoder::new();
                                let mut rgb = Vec::new();
                                let mut local = 0u64;
                                for index in (t * n / threads)..((t + 1) * n / threads) {
                                    // A sample that fails to read or decode is counted, not fatal.
                                    let Ok(record) = reader.read(index) else {
                                        bad.fetch_add(1, Ordering::Relaxed);
                                        continue;
                                    };
                                    local += record.payload.len() as u64;
                                    if decode
                                        && decoder.decode_rgb(record.payload, &mut rgb).is_err()
                                    {
                                        bad.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                                bytes.fetch_add(local, Ordering::Relaxed);
                                Ok(())
                            })
                        })
                        .collect();
                    for w in workers {
                        w.join().expect("reader thread panicked")?;
                    }
                    Ok(())
                })?;
                let secs = start.elapsed().as_secs_f64();
                let mb = bytes.load(Ordering::Relaxed) as f64 / 1e6;
                println!(
                    "read{} {} epoch {epoch}: {n} samples ({} bad), {mb:.1} MB in {secs:.3} s: {:.0} images/s, {:.1} MB/s ({threads} threads{cache})",
                    if decode { "+decode" } else { "" },
                    ds.info().format.name(),
                    bad.load(Ordering::Relaxed),
                    n as f64 / secs,
                    mb / secs
                );
            }
            Ok(())
        }
    }
}
