//! `imagefeed-bench`: throughput measurements.
//!
//! - `read`: read (and optionally decode) every record of a dataset with N threads, each
//!   through its own reader handle;
//! - `load`: run the loader over a dataset, one line per epoch;
//! - `compare`: the loader over the raw folder and every packed format, beside the PyTorch
//!   DataLoader, in one table, JSON file and chart.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use imagefeed::cli::{MaxBadArg, ReadingArgs};
use imagefeed::decode::Decoder;
use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig, Stats};
use imagefeed::transform::{DType, Layout, Transform};
use sha2::{Digest as _, Sha256};

mod bar_chart;
mod ceiling;
mod chart;
mod compare;
#[cfg(feature = "cuda")]
mod gpu;
mod latency_proxy;
mod png_canvas;
mod report;
mod soak;

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
    /// RandomCrop 32 with padding 4 + random flip + normalize (the CIFAR training recipe).
    CifarTrain,
    /// RandomResizedCrop 224 + random flip + normalize.
    Imagenet,
    /// torchvision's reference recipe: RandomResizedCrop 176 + random flip +
    /// TrivialAugmentWide + normalize + RandomErasing(0.1), then MixUp(0.2) or CutMix(1.0) on
    /// each batch.
    ImagenetRef,
    /// The reference recipe's per-sample steps DALI's CPU pipeline has too: RandomResizedCrop
    /// 176 + random flip + TrivialAugmentWide + normalize (no erasing, no batch mix).
    ImagenetTa,
    /// timm's recipe: RandomResizedCrop 224 + random flip + timm's RandAugment
    /// ("rand-m9-mstd0.5-inc1", mean fill, random bilinear/bicubic) + normalize.
    ImagenetTimm,
    /// Resize 256 + CenterCrop 224 + normalize (evaluation).
    ImagenetEval,
    /// RandomResizedCrop 64 + random flip + normalize (Tiny-ImageNet-size images).
    Tiny,
    /// Decode only, u8 NHWC.
    None,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DTypeArg {
    U8,
    F16,
    Bf16,
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
    /// A packed dataset file, an ImageFolder directory, a directory of shards or a quoted
    /// pattern ('DIR/train-*').
    dataset: PathBuf,
    #[command(flatten)]
    input: ReadingArgs,
    /// Stop with an error when an epoch holds more bad samples than this: a count (10), a
    /// fraction of the epoch (0.01 or 1%), or none.
    #[arg(long, default_value = "1%")]
    max_bad: MaxBadArg,
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
    /// Decode every JPEG whole before resizing, as torchvision does with PIL (pixels within
    /// one level of torchvision's), instead of at a reduced DCT scale.
    #[arg(long)]
    whole_decode: bool,
    /// Shards (TFRecord, WebDataset): shuffle within windows of this many shards.
    #[arg(long, value_name = "SHARDS")]
    shard_window: Option<usize>,
    /// Print a SHA-256 over each epoch's batches (pixels and labels, in order).
    #[arg(long)]
    digest: bool,
    /// Also measure decode references on the first N payloads (0: skip), before each timed
    /// epoch and after the last: one thread of libjpeg-turbo (the ceiling is that rate ×
    /// workers) and, with several workers, that many threads decoding at once. Each epoch is
    /// quoted against the mean of the measurements just before and just after it, so drift in
    /// machine speed falls on both sides of the ratio.
    #[arg(long, default_value_t = 0)]
    ceiling_samples: usize,
    /// Untimed epochs before the timed ones (not counted in `--epochs`).
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Evict the dataset's pages from the page cache before each epoch, then open the dataset
    /// and start the loader again (both timed).
    #[arg(long)]
    cold: bool,
    /// Open the dataset and start the loader again before each epoch (both timed), as `--cold`
    /// does but without evicting anything: the warm baseline a `--cold` run is compared with.
    #[arg(long)]
    reopen: bool,
    /// Print JSON lines (start, one per timed epoch, stages) instead of text: what `compare`
    /// reads.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Compare imagefeed over the raw folder and each packed format with the PyTorch
    /// DataLoader on the same images: warm and cold cache, across worker counts; writes a
    /// Markdown table, JSON and a PNG chart.
    Compare(compare::CompareArgs),
    /// GPU feed: host-to-device bandwidth (page-locked vs pageable), and copy/compute overlap
    /// at prefetch depth 1, 2, 3 for ImageNet-size batches against a cuBLAS step of known
    /// length, beside the same steps on data already on the GPU (needs CUDA and cuBLAS).
    #[cfg(feature = "cuda")]
    Gpu(gpu::GpuArgs),
    /// Run the loader over a dataset: one line per epoch with images/s (and a digest).
    Load(LoadArgs),
    /// Many epochs of one loader over a dataset with bad samples: resident memory flat, no
    /// buffer growth, determinism and exact resume checked every few epochs.
    Soak(soak::SoakArgs),
    /// Draws labelled values as a PNG of horizontal bars (for benchmark scripts).
    BarChart {
        /// The chart's title.
        #[arg(long)]
        title: String,
        /// What the values measure, for the axis.
        #[arg(long, default_value = "images/s")]
        unit: String,
        /// Where to write the PNG.
        #[arg(long)]
        out: PathBuf,
        /// The bars, top to bottom: `LABEL=VALUE`, or `GROUP:LABEL=VALUE` (one colour per group).
        #[arg(required = true)]
        bars: Vec<String>,
    },
    /// A TCP proxy on loopback that adds a delay to every request on its way to `upstream`
    /// (object storage latency for the benchmarks); prints its address, then runs until
    /// killed.
    LatencyProxy {
        /// Where to forward (`host:port`, or `http://host:port`).
        #[arg(long)]
        upstream: String,
        /// Milliseconds added to each request.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// Read every record of a dataset (a packed file or an ImageFolder directory). Exits with
    /// an error when more records fail than --max-bad allows.
    Read {
        /// The dataset.
        dataset: PathBuf,
        #[command(flatten)]
        input: ReadingArgs,
        /// The most records that may fail to read (or decode): a count, a fraction (0.01 or
        /// 1%), or none.
        #[arg(long, default_value = "1%")]
        max_bad: MaxBadArg,
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

/// Prints the library's notices (`log::warn!` and worse from `imagefeed`) to stderr as
/// `note: …`, each text once: `--reopen` and `--cold` open the dataset every epoch.
struct NoteLogger(std::sync::Mutex<Option<std::collections::HashSet<String>>>);

static NOTES: NoteLogger = NoteLogger(std::sync::Mutex::new(None));

impl log::Log for NoteLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn && metadata.target().starts_with("imagefeed")
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let text = record.args().to_string();
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if seen
            .get_or_insert_with(Default::default)
            .insert(text.clone())
        {
            eprintln!("note: {text}");
        }
    }

    fn flush(&self) {}
}

fn main() -> std::process::ExitCode {
    // Output piped into a reader that stops early (`| head`) ends the process quietly, as it
    // does `cat`, instead of panicking on the closed pipe (Rust ignores SIGPIPE by default).
    // SAFETY: restoring a signal's default action before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Notices about the data (a shard set with an empty member, labels out of range, a cache
    // lock waited on) go to stderr; a hostile try found every one invisible here.
    log::set_logger(&NOTES).ok();
    log::set_max_level(log::LevelFilter::Warn);
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

/// One stage snapshot minus another (the loader's counters only grow).
fn stats_since(now: Stats, before: Stats) -> Stats {
    Stats {
        read: now.read.saturating_sub(before.read),
        decode: now.decode.saturating_sub(before.decode),
        transform: now.transform.saturating_sub(before.transform),
        collate: now.collate.saturating_sub(before.collate),
        waiting: now.waiting.saturating_sub(before.waiting),
        samples: now.samples - before.samples,
        batches: now.batches - before.batches,
        bad_samples: now.bad_samples - before.bad_samples,
        stacked: now.stacked - before.stacked,
    }
}

fn stats_sum(a: Stats, b: Stats) -> Stats {
    Stats {
        read: a.read + b.read,
        decode: a.decode + b.decode,
        transform: a.transform + b.transform,
        collate: a.collate + b.collate,
        waiting: a.waiting + b.waiting,
        samples: a.samples + b.samples,
        batches: a.batches + b.batches,
        bad_samples: a.bad_samples + b.bad_samples,
        stacked: a.stacked + b.stacked,
    }
}

/// `imagefeed-bench load`: builds the loader the flags describe ([`load_config`]), runs the
/// warm-up and timed epochs ([`run_epoch`]), measuring the decode references around each timed
/// epoch when asked, and prints a line per timed epoch ([`print_epoch`]) and the stage times
/// of the timed epochs ([`print_stages`]), as text or JSON.
fn load(args: LoadArgs) -> Result<()> {
    let (config, t) = load_config(&args);
    let LoadArgs {
        dataset,
        batch_size,
        workers,
        epochs,
        transform,
        digest,
        ceiling_samples,
        warmup,
        cold,
        reopen,
        json,
        ..
    } = args;
    let options = args.input.open_options();
    let open = || -> Result<Arc<dyn imagefeed::Dataset>> {
        imagefeed::format::open_with(&dataset, &options)
            .with_context(|| format!("opening {}", dataset.display()))
    };
    let transform_name = match transform {
        TransformArg::Cifar => "cifar",
        TransformArg::CifarTrain => "cifar-train",
        TransformArg::Imagenet => "imagenet",
        TransformArg::ImagenetRef => "imagenet-ref",
        TransformArg::ImagenetTa => "imagenet-ta",
        TransformArg::ImagenetTimm => "imagenet-timm",
        TransformArg::ImagenetEval => "imagenet-eval",
        TransformArg::Tiny => "tiny",
        TransformArg::None => "none",
    };
    let opening = Instant::now();
    let ds = open()?;
    let open_seconds = opening.elapsed().as_secs_f64();
    // The reference recipe's batch step: RandomChoice([MixUp(0.2), CutMix(1.0)]) over the
    // dataset's classes.
    let config =
        match transform {
            TransformArg::ImagenetRef => config.with_batch_mix(
                imagefeed::transform::BatchMix::either(0.2, 1.0, ds.info().classes.len().max(1)),
            ),
            _ => config,
        };
    let references = if ceiling_samples > 0 {
        let payloads = ceiling::payloads(ds.as_ref(), Some(ceiling_samples))?;
        if !json {
            println!(
                "decode references on {} payloads (libjpeg-turbo, full size, in memory), measured before each timed epoch and after the last",
                payloads.len()
            );
        }
        Some(payloads)
    } else {
        None
    };
    let measure_references = || -> Result<Option<ceiling::References>> {
        references
            .as_deref()
            .map(|p| ceiling::References::measure(p, workers))
            .transpose()
    };
    let mut shares: Vec<(f64, f64)> = Vec::new();
    let making = Instant::now();
    let mut loader = Some(Loader::new(ds, config.clone())?);
    // Opening and making the loader come before epoch 0's clock starts; a user waits for them
    // too (time to the first batch is their sum plus epoch 0's `first_batch_seconds`).
    let setup_seconds = open_seconds + making.elapsed().as_secs_f64();
    let first = loader.as_ref().expect("just made");
    if json {
        let start = serde_json::json!({
            "event": "start",
            "loader": "imagefeed",
            "format": first.dataset().info().format.name(),
            "samples": first.dataset().len(),
            "workers": workers,
            "batch_size": batch_size,
            "transform": transform_name,
            "dtype": t.output.dtype.name(),
            "layout": format!("{:?}", t.output.layout),
            "setup_seconds": setup_seconds,
        });
        println!("{start}");
    } else {
        println!(
            "{}: {} samples, {} batches/epoch of {batch_size}, {workers} workers, transform {transform_name}, {} {:?}{}",
            dataset.display(),
            first.dataset().len(),
            first.batches_per_epoch(),
            t.output.dtype.name(),
            t.output.layout,
            match (cold, reopen) {
                (true, _) => ", cold page cache",
                (false, true) => ", reopened each epoch",
                (false, false) => "",
            }
        );
    }
    // Stage times of the timed epochs only: earlier loaders' totals plus the current loader's
    // counters since `baseline`.
    let mut finished = Stats::default();
    let mut baseline = Stats::default();
    let mut before = None;
    let Some(all_epochs) = warmup.checked_add(epochs) else {
        bail!("--warmup {warmup} plus --epochs {epochs} is more epochs than can be counted");
    };
    for epoch in 0..all_epochs {
        let timed = epoch >= warmup;
        if timed && epoch == warmup {
            baseline = loader.as_ref().map(Loader::stats).unwrap_or_default();
            before = measure_references()?;
        }
        let (start, setup) = if cold || reopen {
            // The kernel keeps pages this process maps: close everything, evict, reopen.
            if let Some(done) = loader.take() {
                if timed {
                    finished = stats_sum(finished, stats_since(done.stats(), baseline));
                }
                baseline = Stats::default();
            }
            if cold {
                imagefeed::pagecache::evict(&dataset)?;
            }
            let start = Instant::now();
            loader = Some(Loader::new(open()?, config.clone())?);
            (start, Some(start.elapsed().as_secs_f64()))
        } else {
            (Instant::now(), None)
        };
        let current = loader.as_ref().expect("a loader is open");
        let mut run = run_epoch(current, epoch, digest)?;
        run.setup = setup;
        let secs = start.elapsed().as_secs_f64();
        if !timed {
            continue;
        }
        let rate = run.images as f64 / secs;
        // The references just after this epoch are also those just before the next.
        let around = match (before, measure_references()?) {
            (Some(b), Some(a)) => {
                before = Some(a);
                Some((b, a))
            }
            _ => None,
        };
        let share = around.map(|(b, a)| {
            let one = (b.one_thread + a.one_thread) / 2.0;
            let together = (b.n_threads + a.n_threads) / 2.0;
            (rate / (one * workers as f64), rate / together)
        });
        shares.extend(share);
        print_epoch(epoch, run, secs, around, share, workers, json);
    }
    let current = loader.as_ref().expect("a loader is open");
    let stages = stats_sum(finished, stats_since(current.stats(), baseline));
    print_stages(
        &stages,
        &shares,
        workers,
        current.pool().allocations(),
        json,
    );
    Ok(())
}

/// The loader configuration and transform `imagefeed-bench load`'s flags ask for.
fn load_config(args: &LoadArgs) -> (LoaderConfig, Transform) {
    let t = match args.transform {
        TransformArg::Cifar => Transform::cifar(),
        TransformArg::CifarTrain => Transform::cifar_train(),
        TransformArg::Imagenet => Transform::imagenet_train(224),
        TransformArg::ImagenetRef => Transform::imagenet_reference(176),
        TransformArg::ImagenetTa => Transform::imagenet_train(176)
            .with_augment(imagefeed::transform::AutoAugment::trivial_augment_wide()),
        TransformArg::ImagenetTimm => {
            let mut augment =
                imagefeed::transform::TimmRandAugment::from_config("rand-m9-mstd0.5-inc1")
                    .expect("a valid timm config");
            augment.fill = [124, 116, 104];
            Transform::imagenet_train(224)
                .with_pixel_step(imagefeed::transform::PixelStep::TimmRandAugment(augment))
        }
        TransformArg::ImagenetEval => Transform::imagenet_eval(256, 224),
        TransformArg::Tiny => Transform::imagenet_train(64),
        TransformArg::None => Transform::none(),
    };
    let dtype = args.dtype.map(|d| match d {
        DTypeArg::U8 => DType::U8,
        DTypeArg::F16 => DType::F16,
        DTypeArg::Bf16 => DType::Bf16,
        DTypeArg::F32 => DType::F32,
    });
    let layout = args.layout.map(|l| match l {
        LayoutArg::Nchw => Layout::Nchw,
        LayoutArg::Nhwc => Layout::Nhwc,
    });
    let t = t.with_output(
        dtype.unwrap_or(t.output.dtype),
        layout.unwrap_or(t.output.layout),
    );
    let config = LoaderConfig::default()
        .with_batch_size(args.batch_size)
        .with_workers(args.workers)
        // Two per worker, one with none (`--workers 0` was refused as "prefetch 0", and a huge
        // count overflowed here before the loader could refuse it).
        .with_prefetch(
            args.prefetch
                .unwrap_or(args.workers.saturating_mul(2).max(1)),
        )
        .with_seed(args.seed)
        .with_shuffle(!args.no_shuffle)
        .with_shard_window(args.shard_window)
        .with_transform(t)
        .with_bad_samples(match args.bad {
            PolicyArg::Skip => BadSamplePolicy::Skip,
            PolicyArg::Replace => BadSamplePolicy::Replace,
            PolicyArg::Error => BadSamplePolicy::Error,
        })
        .with_max_bad(args.max_bad.0)
        .with_scaled_decode(!args.whole_decode);
    (config, t)
}

/// What one epoch delivered.
struct EpochRun {
    images: usize,
    bad_samples: usize,
    /// The first bad sample's key and why it was bad (what the count alone does not say).
    first_bad: Option<String>,
    /// Seconds from the epoch's start to its first batch.
    first_batch: f64,
    /// With `--cold` or `--reopen`: seconds of the epoch spent opening the dataset and making
    /// the loader (before its first batch was asked for).
    setup: Option<f64>,
    /// SHA-256 over every batch's bytes and labels, in order (with `--digest`); finished
    /// after the epoch's clock stops.
    digest: Option<Sha256>,
}

/// Iterates epoch `epoch` of `loader` to the end, counting (and with `digest`, hashing) what
/// it delivers.
fn run_epoch(loader: &Loader, epoch: u64, digest: bool) -> Result<EpochRun> {
    let mut images = 0usize;
    let mut bad_samples = 0usize;
    let mut first_bad = None;
    let mut hasher = Sha256::new();
    let started = Instant::now();
    let mut first_batch = None;
    for batch in loader.epoch(epoch) {
        let batch = batch?;
        first_batch.get_or_insert_with(|| started.elapsed().as_secs_f64());
        images += batch.len();
        bad_samples += batch.bad.len();
        if first_bad.is_none()
            && let Some(bad) = batch.bad.first()
        {
            first_bad = Some(format!("{}: {}", bad.key, bad.reason));
        }
        if digest {
            hasher.update(batch.bytes());
            for label in &batch.labels {
                hasher.update(label.to_le_bytes());
            }
        }
    }
    Ok(EpochRun {
        images,
        bad_samples,
        first_bad,
        first_batch: first_batch.unwrap_or(0.0),
        setup: None,
        digest: digest.then_some(hasher),
    })
}

/// One timed epoch's line: rate, memory, the share of the decode ceiling (with the references
/// measured `around` it), the digest; or the JSON `epoch` event.
fn print_epoch(
    epoch: u64,
    run: EpochRun,
    secs: f64,
    around: Option<(ceiling::References, ceiling::References)>,
    share: Option<(f64, f64)>,
    workers: usize,
    json: bool,
) {
    let EpochRun {
        images,
        bad_samples,
        first_bad,
        first_batch,
        setup,
        ..
    } = run;
    if json {
        let mut line = serde_json::json!({
            "event": "epoch",
            "epoch": epoch,
            "images": images,
            "seconds": secs,
            "first_batch_seconds": first_batch,
            "bad": bad_samples,
        });
        if let Some(first) = &first_bad {
            line["first_bad"] = serde_json::json!(first);
        }
        if let Some(setup) = setup {
            line["setup_seconds"] = serde_json::json!(setup);
        }
        if let Some((b, a)) = around {
            line["decode_references"] = serde_json::json!({
                "one_thread": [b.one_thread, a.one_thread],
                "n_threads": [b.n_threads, a.n_threads],
            });
        }
        println!("{line}");
        return;
    }
    let rate = images as f64 / secs;
    let (rss, peak, anon) = memory_mb();
    let mut line = format!(
        "epoch {epoch}: {images} images in {secs:.3} s: {rate:.0} images/s, {bad_samples} bad, rss {rss:.0} MB (anon {anon:.0} MB, peak {peak:.0} MB)"
    );
    if let Some(setup) = setup {
        line.push_str(&format!(
            " (open and new loader {:.1} ms, first batch {:.1} ms later)",
            setup * 1e3,
            first_batch * 1e3
        ));
    }
    if let (Some((b, a)), Some((of_ceiling, of_together))) = (around, share) {
        line.push_str(&format!(
            "; {:.0}% of ceiling (1 thread decodes {:.0} / {:.0} images/s before / after)",
            100.0 * of_ceiling,
            b.one_thread,
            a.one_thread
        ));
        if workers > 1 {
            line.push_str(&format!(
                ", {:.0}% of {workers} threads decoding at once ({:.0} / {:.0})",
                100.0 * of_together,
                b.n_threads,
                a.n_threads
            ));
        }
    }
    if let Some(hasher) = run.digest {
        line.push_str(&format!(", sha256 {:x}", hasher.finalize()));
    }
    println!("{line}");
    if let Some(first) = first_bad {
        // On stderr: scripts that read the epoch lines see them as before.
        eprintln!("  first bad sample of epoch {epoch}: {first}");
    }
}

/// The stage times of the timed epochs (and the median share of the decode ceiling), or the
/// JSON `stages` event.
fn print_stages(s: &Stats, shares: &[(f64, f64)], workers: usize, buffers: u64, json: bool) {
    let secs = |d: std::time::Duration| d.as_secs_f64();
    if json {
        let (_, peak, anon) = memory_mb();
        let line = serde_json::json!({
            "event": "stages",
            "read_s": secs(s.read),
            "decode_s": secs(s.decode),
            "transform_s": secs(s.transform),
            "collate_s": secs(s.collate),
            "wait_s": secs(s.waiting),
            "stacked": s.stacked,
            "samples": s.samples,
            "peak_rss_mb": peak,
            "anon_mb": anon,
        });
        println!("{line}");
        return;
    }
    if !shares.is_empty() {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "median over the timed epochs: {:.0}% of ceiling, {:.0}% of {workers} threads decoding at once",
            100.0 * median(shares.iter().map(|s| s.0).collect()),
            100.0 * median(shares.iter().map(|s| s.1).collect()),
        );
    }
    println!(
        "stages of the timed epochs (summed over workers): read {:.0} ms, decode {:.0} ms, transform {:.0} ms, collate {:.0} ms; consumer waited {:.0} ms; buffers allocated {buffers}; {} of {} samples decoded stacked",
        1e3 * secs(s.read),
        1e3 * secs(s.decode),
        1e3 * secs(s.transform),
        1e3 * secs(s.collate),
        1e3 * secs(s.waiting),
        s.stacked,
        s.samples,
    );
}

fn run() -> Result<()> {
    match Cli::parse().command {
        Command::Load(args) => load(args),
        Command::Compare(args) => compare::compare(args),
        Command::Soak(args) => soak::soak(&args),
        #[cfg(feature = "cuda")]
        Command::Gpu(args) => gpu::run(args),
        Command::BarChart {
            title,
            unit,
            out,
            bars,
        } => {
            let bars = bars
                .iter()
                .map(|b| bar_chart::Bar::parse(b))
                .collect::<Result<Vec<_>>>()?;
            bar_chart::draw(&title, &unit, &bars, &out)
        }
        Command::LatencyProxy { upstream, delay_ms } => {
            latency_proxy::run(&upstream, std::time::Duration::from_millis(delay_ms))
        }
        Command::Read {
            dataset,
            input,
            max_bad,
            threads,
            decode,
            epochs,
            cold,
        } => {
            let options = input.open_options();
            // As `load --workers` and `pack-dataset --threads` are: a million spawned threads
            // until the system refused, or a capacity overflow, was a panic.
            if !(1..=imagefeed::MAX_THREADS).contains(&threads) {
                bail!(
                    "--threads {threads}: 1 to {} reader threads",
                    imagefeed::MAX_THREADS
                );
            }
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
                let ds = imagefeed::format::open_with(&dataset, &options)
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
                                    // A sample that fails to read or decode is counted, not
                                    // fatal; a file changed since the open (or a full cache)
                                    // is, as in the loader: every later read would fail too.
                                    let record = match reader.read(index) {
                                        Ok(record) => record,
                                        Err(
                                            e @ (imagefeed::Error::FileChanged { .. }
                                            | imagefeed::Error::CacheFull { .. }),
                                        ) => return Err(e.into()),
                                        Err(_) => {
                                            bad.fetch_add(1, Ordering::Relaxed);
                                            continue;
                                        }
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
                let bad = bad.load(Ordering::Relaxed);
                if let Some(cap) = max_bad.0
                    && cap.exceeded_by(bad, n as u64)
                {
                    anyhow::bail!(
                        "{}: {bad} of {n} records could not be read{}: more than --max-bad {cap}",
                        dataset.display(),
                        if decode { " or decoded" } else { "" }
                    );
                }
            }
            Ok(())
        }
    }
}
