//! `imagefeed-bench compare`: imagefeed over the raw folder and each packed format, beside the
//! PyTorch DataLoader on the same images, warm and cold page cache, across worker counts; one
//! table, one JSON file, one chart.
//!
//! How a configuration is measured, the same way for every loader:
//! - it runs in a child process of its own (`imagefeed-bench load --json`, or
//!   `torch_baseline.py`), so its memory is its own and nothing is shared between runs;
//! - one untimed warm-up epoch, then `--epochs` timed epochs; the median and the range of the
//!   epochs' images/s are reported;
//! - cold: every file of the dataset is evicted from the page cache before each epoch
//!   (`posix_fadvise(DONTNEED)`, plus `drop_caches` with `--drop-caches`);
//! - peak memory is sampled from outside every 50 ms: the proportional set size (PSS) of the
//!   child and all its descendants, so a DataLoader's worker processes count too and pages they
//!   share are not counted twice; an imagefeed run also reports its own peak RSS, which counts
//!   when higher (a run shorter than the interval can end between two samples);
//! - the decode ceiling (one thread of libjpeg-turbo on the same payloads, full size, in memory,
//!   × workers) is measured in the same run, before and after the configurations, and so is
//!   what `workers` threads decoding at once really reach on this machine.

use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use imagefeed::Dataset as _;
use imagefeed::format::folder::ImageFolder;
use imagefeed::pack::{self, NoProgress, PackFormat, PackOptions, StartMode};
use serde::Serialize;

use crate::ceiling;

/// The PyTorch baseline, written next to the results when it runs.
const TORCH_SCRIPT: &str = include_str!("../torch_baseline.py");
/// What `--with-torch` installs (CPU use only; the PyPI wheels bring their CUDA libraries).
pub const TORCH_PACKAGES: &[&str] = &[
    "torch==2.15.0",
    "torchvision==0.29.2",
    "pillow==13.0.0",
    "numpy==2.4.6",
];

/// A loader in the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Subject {
    /// imagefeed over the ImageFolder tree itself.
    Folder,
    /// imagefeed over a packed LMDB.
    Lmdb,
    /// imagefeed over a packed HDF5 file.
    Hdf5,
    /// imagefeed over packed record shards.
    Records,
    /// torchvision ImageFolder + torch DataLoader over the tree.
    Pytorch,
}

impl Subject {
    pub fn name(self) -> &'static str {
        match self {
            Subject::Folder => "folder",
            Subject::Lmdb => "lmdb",
            Subject::Hdf5 => "hdf5",
            Subject::Records => "records",
            Subject::Pytorch => "pytorch",
        }
    }

    /// What the table calls it.
    pub fn label(self) -> &'static str {
        match self {
            Subject::Folder => "imagefeed, raw folder",
            Subject::Lmdb => "imagefeed, LMDB",
            Subject::Hdf5 => "imagefeed, HDF5",
            Subject::Records => "imagefeed, record shards",
            Subject::Pytorch => "PyTorch DataLoader",
        }
    }

    fn pack_format(self) -> Option<(PackFormat, &'static str)> {
        match self {
            Subject::Lmdb => Some((PackFormat::Lmdb, "lmdb")),
            Subject::Hdf5 => Some((PackFormat::Hdf5, "h5")),
            Subject::Records => Some((PackFormat::Records, "records")),
            Subject::Folder | Subject::Pytorch => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CompareTransform {
    /// Random flip + CIFAR-10 normalize at native size, f32 NCHW.
    Cifar,
    /// RandomCrop 32 with padding 4 + random flip + CIFAR-10 normalize, f32 NCHW (the CIFAR
    /// training recipe).
    CifarTrain,
    /// RandomResizedCrop 224 + random flip + ImageNet normalize, f32 NCHW.
    Imagenet,
    /// torchvision's reference recipe: RandomResizedCrop 176 + random flip +
    /// TrivialAugmentWide + ImageNet normalize + RandomErasing(0.1), f32 NCHW, then MixUp(0.2)
    /// or CutMix(1.0) on each batch.
    ImagenetRef,
    /// timm's recipe: RandomResizedCrop 224 + random flip + timm's RandAugment
    /// ("rand-m9-mstd0.5-inc1") + ImageNet normalize, f32 NCHW.
    ImagenetTimm,
}

impl CompareTransform {
    fn name(self) -> &'static str {
        match self {
            CompareTransform::Cifar => "cifar",
            CompareTransform::CifarTrain => "cifar-train",
            CompareTransform::Imagenet => "imagenet",
            CompareTransform::ImagenetRef => "imagenet-ref",
            CompareTransform::ImagenetTimm => "imagenet-timm",
        }
    }
}

#[derive(clap::Args)]
pub struct CompareArgs {
    /// The ImageFolder tree to measure (one sub-folder per class).
    pub src: PathBuf,
    /// imagefeed configurations: the raw folder and packed formats (packed on first use, then
    /// reused while the tree is unchanged).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "folder,lmdb,hdf5,records"
    )]
    pub formats: Vec<Subject>,
    /// Worker counts to run each configuration with.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub workers: Vec<usize>,
    /// The per-sample transform (the PyTorch baseline uses torchvision's equivalent).
    #[arg(long, value_enum, default_value = "cifar")]
    pub transform: CompareTransform,
    /// Samples per batch (default: 256 for cifar, 64 for imagenet).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Timed epochs per configuration (after one untimed warm-up epoch).
    #[arg(long, default_value_t = 5)]
    pub epochs: u64,
    /// Also run every configuration with a cold page cache.
    #[arg(long)]
    pub cold: bool,
    /// Skip the warm-cache runs (with `--cold`: cold only).
    #[arg(long)]
    pub no_warm: bool,
    /// For cold runs, also drop the whole page cache (`/proc/sys/vm/drop_caches`; needs root).
    #[arg(long)]
    pub drop_caches: bool,
    /// Where the table, JSON, chart and packed datasets go (default: bench-out/NAME-TRANSFORM).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Where packed datasets are cached (default: OUT/packed).
    #[arg(long)]
    pub pack_dir: Option<PathBuf>,
    /// Create a virtual environment with torch and torchvision (at --torch-venv) if it lacks them.
    #[arg(long)]
    pub with_torch: bool,
    /// The virtual environment for the PyTorch baseline.
    #[arg(long, default_value = ".venv-torch")]
    pub torch_venv: PathBuf,
    /// A Python with torch and torchvision to use instead of the virtual environment.
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Leave the PyTorch baseline out.
    #[arg(long)]
    pub no_torch: bool,
    /// Payloads the decode ceiling is measured on.
    #[arg(long, default_value_t = 2000)]
    pub ceiling_samples: usize,
    /// Threads for packing.
    #[arg(long)]
    pub pack_threads: Option<usize>,
    /// Pack with `--restart-markers` (JPEGs rewritten so crops decode only their segments;
    /// docs/formats.md). The raw folder and the PyTorch baseline read the original files.
    #[arg(long)]
    pub restart_markers: bool,
}

/// Page-cache state of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Cache {
    Warm,
    Cold,
}

impl Cache {
    pub fn name(self) -> &'static str {
        match self {
            Cache::Warm => "warm",
            Cache::Cold => "cold",
        }
    }
}

/// Stage times of a run's timed epochs, per epoch, summed over workers (seconds).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StageTimes {
    pub read: f64,
    pub decode: f64,
    pub transform: f64,
    /// imagefeed only: writing slots (flip, normalize, layout) into the batch.
    pub collate: Option<f64>,
    /// The consumer waiting for the next batch.
    pub wait: f64,
}

/// One configuration's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub subject: Subject,
    pub workers: usize,
    pub cache: Cache,
    /// images/s of each timed epoch.
    pub epoch_rates: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// Payload MB/s at the median rate (the same encoded bytes in every format).
    pub mb_per_s: f64,
    /// Median as a share of the decode ceiling × workers.
    pub ceiling_share: f64,
    /// Median as a share of what `workers` threads decoding together measured.
    pub measured_share: f64,
    pub stages: Option<StageTimes>,
    /// Peak PSS of the process and its descendants (MB), and the anonymous part of it.
    pub peak_pss_mb: f64,
    pub peak_anon_mb: f64,
    /// Bad samples met over the timed epochs.
    pub bad: u64,
    /// Versions and the like from the run's start line.
    pub detail: serde_json::Value,
}

/// Everything one `compare` produced.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub source: PathBuf,
    pub samples: usize,
    pub payload_bytes: u64,
    pub transform: CompareTransform,
    pub batch_size: usize,
    pub epochs: u64,
    /// Single-thread decode rates measured before and after the runs; the ceiling uses the higher.
    pub ceiling_per_thread: Vec<f64>,
    pub ceiling_per_thread_used: f64,
    /// For each worker count: what that many threads decoding at once reach together
    /// (measured before and after the runs; the higher is used).
    pub measured_decode: Vec<MeasuredDecode>,
    pub results: Vec<RunResult>,
    /// Configurations that failed, with the reason.
    pub failures: Vec<(String, String)>,
    pub notes: Vec<String>,
    pub machine: String,
    pub date: String,
    pub command: String,
}

/// Decode rate of several threads at once.
#[derive(Debug, Clone, Serialize)]
pub struct MeasuredDecode {
    pub threads: usize,
    pub rates: Vec<f64>,
    pub used: f64,
}

impl Report {
    /// The measured decode rate for `threads` (the ideal when it was not measured).
    pub fn measured_decode_rate(&self, threads: usize) -> f64 {
        self.measured_decode
            .iter()
            .find(|m| m.threads == threads)
            .map_or(self.ceiling_per_thread_used * threads as f64, |m| m.used)
    }

    pub fn find(&self, subject: Subject, workers: usize, cache: Cache) -> Option<&RunResult> {
        self.results
            .iter()
            .find(|r| r.subject == subject && r.workers == workers && r.cache == cache)
    }

    pub fn mean_payload_bytes(&self) -> f64 {
        self.payload_bytes as f64 / self.samples.max(1) as f64
    }
}

pub fn compare(args: CompareArgs) -> Result<()> {
    let caches = check_args(&args)?;
    let folder =
        ImageFolder::open(&args.src).with_context(|| format!("opening {}", args.src.display()))?;
    let name = args
        .src
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "dataset".into());
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from("bench-out").join(format!("{name}-{}", args.transform.name()))
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let batch_size = args.batch_size.unwrap_or(match args.transform {
        CompareTransform::Cifar | CompareTransform::CifarTrain => 256,
        CompareTransform::Imagenet
        | CompareTransform::ImagenetRef
        | CompareTransform::ImagenetTimm => 64,
    });
    let mut notes = Vec::new();

    // 1. The datasets: the tree itself and each packed format (cached), and the PyTorch
    //    baseline when a Python with torch is found.
    let (subjects, torch) = subjects(&args, &folder, &name, &out, &mut notes)?;

    // 2. The decode ceiling, before the runs: one thread, and each worker count at once.
    let mut ceiling = DecodeCeiling::new(&folder, &args)?;
    ceiling.measure()?;
    ceiling.print_first();

    // 3. The runs, interleaved so that drift in machine speed spreads over every loader.
    let (results, failures) = run_all(&args, &caches, &subjects, torch.as_ref(), batch_size)?;

    // 4. The ceiling again, after the runs.
    ceiling.measure()?;
    let report = build_report(
        &args, &folder, batch_size, ceiling, results, failures, notes,
    );

    // 5. Output.
    write_outputs(&report, &out)
}

/// The cache states to run in; `Err` for flags that cannot run.
fn check_args(args: &CompareArgs) -> Result<Vec<Cache>> {
    if !args.src.is_dir() {
        bail!(
            "{}: not a directory (compare takes an ImageFolder tree)",
            args.src.display()
        );
    }
    if args.workers.is_empty() || args.workers.contains(&0) {
        bail!("--workers: give one or more counts of at least 1");
    }
    if args.epochs == 0 {
        bail!("--epochs: at least 1");
    }
    let caches = match (args.no_warm, args.cold) {
        (false, false) => vec![Cache::Warm],
        (false, true) => vec![Cache::Warm, Cache::Cold],
        (true, true) => vec![Cache::Cold],
        (true, false) => bail!("--no-warm without --cold leaves nothing to run"),
    };
    if args.drop_caches && !args.cold {
        bail!("--drop-caches applies to cold runs: add --cold");
    }
    Ok(caches)
}

/// A loader or format under test, and the path it reads.
type Subjects = Vec<(Subject, PathBuf)>;

/// A configuration that failed: what it was, and why.
type Failure = (String, String);

/// The PyTorch baseline: the Python that runs it and the script it runs.
struct TorchBaseline {
    python: PathBuf,
    script: PathBuf,
}

/// What is measured: the tree itself and each packed format asked for (packed into the pack
/// directory unless a pack of the same tree is already there), and the PyTorch baseline when
/// a Python with torch is found (otherwise a note says why not).
fn subjects(
    args: &CompareArgs,
    folder: &ImageFolder,
    name: &str,
    out: &Path,
    notes: &mut Vec<String>,
) -> Result<(Subjects, Option<TorchBaseline>)> {
    let pack_dir = args.pack_dir.clone().unwrap_or_else(|| out.join("packed"));
    // A pack with restart markers is another dataset than a plain one of the same tree.
    let fingerprint = pack::source_fingerprint(folder)?
        + if args.restart_markers {
            " restart-markers"
        } else {
            ""
        };
    let mut subjects: Subjects = Vec::new();
    for &subject in &args.formats {
        if subject == Subject::Pytorch {
            continue; // Added below when a Python with torch is found.
        }
        if subjects.iter().any(|(s, _)| *s == subject) {
            continue;
        }
        let path = match subject.pack_format() {
            None => args.src.clone(),
            Some((format, ext)) => {
                let path = pack_dir.join(format!("{name}.{ext}"));
                ensure_packed(&fingerprint, &args.src, &path, format, args)?;
                path
            }
        };
        subjects.push((subject, path));
    }
    if args.no_torch {
        return Ok((subjects, None));
    }
    let python = match find_torch_python(args)? {
        Ok(python) => python,
        Err(why) => {
            eprintln!("note: PyTorch baseline left out: {why}");
            notes.push(format!("PyTorch baseline left out: {why}"));
            return Ok((subjects, None));
        }
    };
    subjects.push((Subject::Pytorch, args.src.clone()));
    let script = out.join("torch_baseline.py");
    std::fs::write(&script, TORCH_SCRIPT)
        .with_context(|| format!("writing {}", script.display()))?;
    Ok((subjects, Some(TorchBaseline { python, script })))
}

/// libjpeg-turbo's decode rate on the tree's payloads (full size, in memory): on one thread
/// and on each worker count at once, measured before and after the runs.
struct DecodeCeiling {
    payloads: Vec<Vec<u8>>,
    /// 1 and every worker count, ascending.
    thread_counts: Vec<usize>,
    /// Per thread count, each measurement.
    rates: Vec<Vec<f64>>,
}

impl DecodeCeiling {
    fn new(folder: &ImageFolder, args: &CompareArgs) -> Result<Self> {
        let payloads = ceiling::payloads(folder, Some(args.ceiling_samples.max(1)))?;
        let mut thread_counts: Vec<usize> = std::iter::once(1)
            .chain(args.workers.iter().copied())
            .collect();
        thread_counts.sort_unstable();
        thread_counts.dedup();
        Ok(DecodeCeiling {
            payloads,
            rates: vec![Vec::new(); thread_counts.len()],
            thread_counts,
        })
    }

    /// Measures every thread count once more.
    fn measure(&mut self) -> Result<()> {
        for (k, &threads) in self.thread_counts.iter().enumerate() {
            self.rates[k].push(ceiling::decode_rate(&self.payloads, threads)?);
        }
        Ok(())
    }

    fn print_first(&self) {
        eprintln!(
            "decode ceiling: {:.0} images/s per thread (libjpeg-turbo, full size, {} payloads); {}",
            self.rates[0][0],
            self.payloads.len(),
            self.thread_counts
                .iter()
                .zip(&self.rates)
                .skip(1)
                .map(|(t, r)| format!("{t} threads together: {:.0}", r[0]))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// Runs every configuration (cache state × worker count × subject) in a child process, in
/// that interleaved order; returns the results and the configurations that failed, with why.
fn run_all(
    args: &CompareArgs,
    caches: &[Cache],
    subjects: &[(Subject, PathBuf)],
    torch: Option<&TorchBaseline>,
    batch_size: usize,
) -> Result<(Vec<RunResult>, Vec<Failure>)> {
    let exe = std::env::current_exe().context("finding imagefeed-bench itself")?;
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for &cache in caches {
        for &workers in &args.workers {
            for (subject, path) in subjects {
                let what = format!("{} {} workers {}", subject.name(), workers, cache.name());
                eprintln!("== {what}");
                let mut command = match subject {
                    Subject::Pytorch => {
                        let torch = torch.expect("a PyTorch subject comes with its baseline");
                        let mut c = Command::new(&torch.python);
                        c.arg(&torch.script).arg(path);
                        c
                    }
                    _ => {
                        let mut c = Command::new(&exe);
                        // Speed over the tree as it is: broken files are skipped and counted,
                        // as torchvision's loader would have to, never a reason to stop.
                        c.arg("load")
                            .arg(path)
                            .arg("--json")
                            .args(["--max-bad", "none"]);
                        c
                    }
                };
                command
                    .args(["--transform", args.transform.name()])
                    .args(["--batch-size", &batch_size.to_string()])
                    .args(["--workers", &workers.to_string()])
                    .args(["--epochs", &args.epochs.to_string()])
                    .args(["--warmup", "1"]);
                if cache == Cache::Cold {
                    command.arg("--cold");
                    if args.drop_caches {
                        drop_all_caches()?;
                    }
                }
                match run_child(command) {
                    Ok(child) => {
                        let result = summarize(*subject, workers, cache, child);
                        eprintln!(
                            "   {:.0} images/s (median of {}; {:.0}–{:.0}), peak {:.0} MB",
                            result.median,
                            result.epoch_rates.len(),
                            result.min,
                            result.max,
                            result.peak_pss_mb
                        );
                        results.push(result);
                    }
                    Err(err) => {
                        let why = imagefeed::error::display_chain(err.as_ref());
                        eprintln!("   failed: {why}");
                        failures.push((what, why));
                    }
                }
            }
        }
    }
    Ok((results, failures))
}

/// The report: the runs with their throughput in MB/s and their share of the decode ceiling
/// (the best of its measurements, per thread and for their worker count at once).
fn build_report(
    args: &CompareArgs,
    folder: &ImageFolder,
    batch_size: usize,
    ceiling: DecodeCeiling,
    results: Vec<RunResult>,
    failures: Vec<Failure>,
    notes: Vec<String>,
) -> Report {
    let best = |rates: &[f64]| rates.iter().copied().fold(0.0, f64::max);
    let ceiling_per_thread = ceiling.rates[0].clone();
    let per_thread = best(&ceiling_per_thread);
    let measured_decode = ceiling
        .thread_counts
        .iter()
        .zip(&ceiling.rates)
        .map(|(&threads, rates)| MeasuredDecode {
            threads,
            rates: rates.clone(),
            used: best(rates),
        })
        .collect();
    let payload_bytes: u64 = (0..folder.len())
        .map(|i| std::fs::metadata(folder.file_path(i)).map_or(0, |m| m.len()))
        .sum();
    let mut report = Report {
        source: args.src.clone(),
        samples: folder.len(),
        payload_bytes,
        transform: args.transform,
        batch_size,
        epochs: args.epochs,
        ceiling_per_thread,
        ceiling_per_thread_used: per_thread,
        measured_decode,
        results,
        failures,
        notes,
        machine: machine_description(),
        date: utc_now(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    let mean_bytes = report.mean_payload_bytes();
    for r in &mut report.results {
        r.mb_per_s = r.median * mean_bytes / 1e6;
        r.ceiling_share = r.median / (per_thread * r.workers as f64);
    }
    for k in 0..report.results.len() {
        let measured = report.measured_decode_rate(report.results[k].workers);
        report.results[k].measured_share = report.results[k].median / measured;
    }
    report
}

/// Writes `results.json`, `results.md` and `chart.png` into `out` and prints the table; `Err`
/// when a configuration failed (after writing everything).
fn write_outputs(report: &Report, out: &Path) -> Result<()> {
    let json_path = out.join("results.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(report)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let markdown = crate::report::markdown(report);
    let md_path = out.join("results.md");
    std::fs::write(&md_path, &markdown)
        .with_context(|| format!("writing {}", md_path.display()))?;
    let png_path = out.join("chart.png");
    match crate::chart::draw(report, &png_path) {
        Ok(()) => eprintln!("chart: {}", png_path.display()),
        Err(err) => eprintln!(
            "note: no chart: {}",
            imagefeed::error::display_chain(err.as_ref())
        ),
    }
    println!("{markdown}");
    eprintln!("wrote {} and {}", md_path.display(), json_path.display());
    if !report.failures.is_empty() {
        bail!(
            "{} configuration(s) failed (listed above and in the table)",
            report.failures.len()
        );
    }
    Ok(())
}

/// Packs `src` into `path` unless a pack of the same tree is already there. The stamp beside it
/// holds the tree's `fingerprint` ([`pack::source_fingerprint`]: keys, labels, sizes) and is
/// written only after a complete pack.
fn ensure_packed(
    fingerprint: &str,
    src: &Path,
    path: &Path,
    format: PackFormat,
    args: &CompareArgs,
) -> Result<()> {
    let stamp = stamp_path(path);
    if path.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(fingerprint) {
        eprintln!(
            "using {} (packed earlier from the same tree)",
            path.display()
        );
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&stamp);
    eprintln!("packing {} into {} ...", src.display(), path.display());
    let options = PackOptions::default()
        .with_threads(args.pack_threads)
        .with_restart_markers(args.restart_markers)
        .with_mode(StartMode {
            resume: false,
            force: true,
        });
    let summary = pack::pack_image_folder(src, path, format, &options, &NoProgress)
        .with_context(|| format!("packing {} into {}", src.display(), path.display()))?;
    eprintln!(
        "packed {} samples ({} rejected) in {:.1} s",
        summary.samples,
        summary.rejected.len(),
        summary.seconds
    );
    std::fs::write(&stamp, fingerprint).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(())
}

fn stamp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".source");
    path.with_file_name(name)
}

/// A Python that imports torch and torchvision: `--python`, else the virtual environment
/// (created first with `--with-torch`), else `python3`. The inner error says why there is none.
fn find_torch_python(args: &CompareArgs) -> Result<std::result::Result<PathBuf, String>> {
    let has_torch = |python: &Path| {
        Command::new(python)
            .args(["-c", "import torch, torchvision"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(python) = &args.python {
        return Ok(if has_torch(python) {
            Ok(python.clone())
        } else {
            Err(format!(
                "{} cannot import torch and torchvision",
                python.display()
            ))
        });
    }
    let venv_python = args.torch_venv.join("bin").join("python");
    if has_torch(&venv_python) {
        return Ok(Ok(venv_python));
    }
    if args.with_torch {
        eprintln!(
            "creating {} with {} (the torch wheel is large: minutes)",
            args.torch_venv.display(),
            TORCH_PACKAGES.join(" ")
        );
        let created = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&args.torch_venv)
            .status()
            .context("running python3 -m venv")?;
        if !created.success() {
            bail!(
                "python3 -m venv {} failed (on Debian: apt-get install python3-venv)",
                args.torch_venv.display()
            );
        }
        let installed = Command::new(&venv_python)
            .args(["-m", "pip", "install", "-q"])
            .args(TORCH_PACKAGES)
            .status()
            .context("running pip")?;
        if !installed.success() || !has_torch(&venv_python) {
            bail!(
                "could not install {} into {}",
                TORCH_PACKAGES.join(" "),
                args.torch_venv.display()
            );
        }
        return Ok(Ok(venv_python));
    }
    if has_torch(Path::new("python3")) {
        return Ok(Ok(PathBuf::from("python3")));
    }
    Ok(Err(format!(
        "no Python with torch and torchvision ({} has none; add --with-torch to create it, or --python PATH)",
        args.torch_venv.display()
    )))
}

/// What a child printed, and the memory it used.
struct ChildOutput {
    lines: Vec<serde_json::Value>,
    peak_pss_mb: f64,
    peak_anon_mb: f64,
}

/// Runs a measurement child, sampling its memory, and parses its JSON lines.
fn run_child(mut command: Command) -> Result<ChildOutput> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {:?}", command.get_program()))?;
    let pid = child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut peak = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let (pss, anon) = tree_pss_kb(pid);
                peak = (peak.0.max(pss), peak.1.max(anon));
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        })
    };
    let mut stderr = child.stderr.take().expect("piped");
    let stderr_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let mut lines = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line.context("reading the child's output")?;
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) {
            lines.push(value);
        }
    }
    let status = child.wait().context("waiting for the child")?;
    stop.store(true, Ordering::Relaxed);
    let (pss, anon) = sampler.join().expect("memory sampler panicked");
    let stderr = stderr_reader.join().expect("stderr reader panicked");
    if !status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("exited with {status}: {}", tail.join(" / "));
    }
    if !lines.iter().any(|l| l["event"] == "epoch") {
        bail!("printed no epoch line");
    }
    Ok(ChildOutput {
        lines,
        peak_pss_mb: pss as f64 / 1024.0,
        peak_anon_mb: anon as f64 / 1024.0,
    })
}

fn summarize(subject: Subject, workers: usize, cache: Cache, child: ChildOutput) -> RunResult {
    let epochs: Vec<&serde_json::Value> = child
        .lines
        .iter()
        .filter(|l| l["event"] == "epoch")
        .collect();
    let mut rates: Vec<f64> = epochs
        .iter()
        .map(|e| e["images"].as_f64().unwrap_or(0.0) / e["seconds"].as_f64().unwrap_or(f64::NAN))
        .collect();
    let bad = epochs.iter().map(|e| e["bad"].as_u64().unwrap_or(0)).sum();
    let epoch_rates = rates.clone();
    rates.sort_by(f64::total_cmp);
    let n = epochs.len().max(1) as f64;
    let stages = child
        .lines
        .iter()
        .find(|l| l["event"] == "stages")
        .map(|s| {
            let get = |k: &str| s[k].as_f64().map(|v| v / n);
            StageTimes {
                read: get("read_s").unwrap_or(0.0),
                decode: get("decode_s").unwrap_or(0.0),
                transform: get("transform_s").unwrap_or(0.0),
                collate: get("collate_s"),
                wait: get("wait_s").unwrap_or(0.0),
            }
        });
    // A short run can end between two samples: its own peak (VmHWM, RSS) and its anonymous
    // memory at the end, while its buffers are still held, are floors.
    let own = child.lines.iter().find(|l| l["event"] == "stages");
    let own_peak = own.and_then(|s| s["peak_rss_mb"].as_f64()).unwrap_or(0.0);
    let own_anon = own.and_then(|s| s["anon_mb"].as_f64()).unwrap_or(0.0);
    let detail = child
        .lines
        .iter()
        .find(|l| l["event"] == "start")
        .cloned()
        .unwrap_or_default();
    RunResult {
        subject,
        workers,
        cache,
        median: median(&rates),
        min: rates.first().copied().unwrap_or(0.0),
        max: rates.last().copied().unwrap_or(0.0),
        epoch_rates,
        mb_per_s: 0.0,
        ceiling_share: 0.0,
        measured_share: 0.0,
        stages,
        peak_pss_mb: child.peak_pss_mb.max(own_peak),
        peak_anon_mb: child.peak_anon_mb.max(own_anon),
        bad,
        detail,
    }
}

/// Median of sorted values.
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Sum of PSS and anonymous PSS (kB) over `root` and its descendants (Linux; 0 elsewhere).
fn tree_pss_kb(root: u32) -> (u64, u64) {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            // The parent pid is the 2nd field after the parenthesized command name.
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                && let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..])
                && let Some(ppid) = after.split_whitespace().nth(1).and_then(|p| p.parse().ok())
            {
                parents.push((pid, ppid));
            }
        }
    }
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    let mut total = (0, 0);
    for pid in tree {
        if let Ok(rollup) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) {
            for line in rollup.lines() {
                let kb = || {
                    line.split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                if line.starts_with("Pss:") {
                    total.0 += kb();
                } else if line.starts_with("Pss_Anon:") {
                    total.1 += kb();
                }
            }
        }
    }
    total
}

/// `sync`, then drop the page cache, dentries and inodes (root only).
fn drop_all_caches() -> Result<()> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").context(
        "writing 3 to /proc/sys/vm/drop_caches (--drop-caches needs root and a writable /proc/sys)",
    )
}

fn machine_description() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib =
        imagefeed::pagecache::total_memory().map_or(0.0, |b| b as f64 / (1u64 << 30) as f64);
    format!("{cores} cores ({cpu}), {mem_gib:.0} GiB")
}

/// The current UTC time as `YYYY-MM-DD HH:MM UTC`, from the system clock.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0]), 3.0);
        assert_eq!(median(&[1.0, 2.0, 10.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 10.0]), 3.0);
    }

    #[test]
    fn memory_of_this_process_tree_is_seen() {
        let (pss, _) = tree_pss_kb(std::process::id());
        assert!(pss > 0, "no PSS read for this process");
        assert_eq!(tree_pss_kb(u32::MAX), (0, 0));
    }
}
