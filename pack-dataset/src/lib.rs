//! `pack-dataset`: packs ImageFolder trees into dataset files, and inspects and verifies them.
//!
//! A thin layer over the `imagefeed` library: parse flags, call the library, print. The
//! command line lives here, as a library, so that the `pack-dataset` binary and the Python
//! package's `pack-dataset` console script (`imagefeed._native.pack_dataset_main`) run the
//! same code: [`main_with`] takes the arguments and returns the exit code.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use imagefeed::cli::{ReadingArgs, describe};
use imagefeed::inspect::Inspection;
use imagefeed::pack::{self, PackFormat, PackObserver, PackOptions, PackSummary, Part, StartMode};
use imagefeed::progress::{PackProgressBar, human_bytes};
use imagefeed::synthetic::{self, SyntheticSpec};

/// Exit code of a command that did what it was asked.
const SUCCESS: u8 = 0;
/// Exit code of a command that found a problem (a failed check, rejected files).
const FAILURE: u8 = 1;

/// The command line being run, `argv[0]` first: what the `to finish:` line of an interrupted
/// pack repeats.
static ARGS: OnceLock<Vec<OsString>> = OnceLock::new();

#[derive(Parser)]
#[command(
    name = "pack-dataset",
    version,
    about = "Pack, inspect and verify image datasets for imagefeed"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Pack an ImageFolder tree (one sub-folder per class) into a single-file LMDB.
    #[command(name = "imagefolder2lmdb")]
    ImageFolder2Lmdb(PackArgs),
    /// Pack an ImageFolder tree into one HDF5 file (h5py-friendly: images, offsets, labels,
    /// keys; see docs/formats.md).
    #[command(name = "imagefolder2hdf5")]
    ImageFolder2Hdf5(PackArgs),
    /// Pack an ImageFolder tree into a directory of TFRecord shards of tf.train.Example
    /// records, each with an index (TensorFlow and the Python tfrecord package read them).
    #[command(name = "imagefolder2records")]
    ImageFolder2Records(PackArgs),
    /// Rewrite any dataset imagefeed reads (an imagefeed or Python folder2lmdb LMDB, an HDF5 or
    /// h5py file, TFRecord shards, an ImageFolder tree) into one of our formats. Takes the same
    /// options as the imagefolder2* commands.
    Convert {
        /// Output format.
        #[arg(long, value_parser = output_format(), default_value = "lmdb")]
        to: PackFormat,
        #[command(flatten)]
        input: ReadingArgs,
        #[command(flatten)]
        args: PackArgs,
    },
    /// Join the parts of a split conversion (made with --num-parts N --part-index i) into one
    /// dataset, identical to an unsplit conversion.
    Join {
        /// Output format.
        #[arg(long, value_parser = output_format(), default_value = "lmdb")]
        to: PackFormat,
        /// Output path.
        #[arg(long, short)]
        out: PathBuf,
        /// The parts, in any order.
        #[arg(required = true)]
        parts: Vec<PathBuf>,
        /// Records output: close a shard at this size (bytes; K, M, G, KiB, MiB, GiB suffixes).
        #[arg(long, default_value = "128MiB", value_parser = parse_bytes)]
        shard_size: u64,
        /// Records output: store labels as class index + this (ImageNet TFRecords use 1).
        #[arg(long, default_value_t = 0)]
        label_base: u32,
        /// LMDB output: store the JPEG headers files share once (as `imagefolder2lmdb
        /// --shared-headers`).
        #[arg(long)]
        shared_headers: bool,
        /// Finish an interrupted join.
        #[arg(long)]
        resume: bool,
        /// Replace an existing output.
        #[arg(long)]
        force: bool,
        /// No progress bar.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Show what a dataset holds: format, samples, classes, bytes, image sizes, completeness.
    /// Exits 1 when the dataset is incomplete (an interrupted pack, shards missing from its
    /// set) or a record could not be read.
    Inspect {
        /// A packed dataset file, an ImageFolder directory, a directory of shards, a quoted
        /// pattern ('DIR/train-*'), or several shard files read as one dataset.
        #[arg(required = true)]
        dataset: Vec<PathBuf>,
        #[command(flatten)]
        input: ReadingArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Check every record reads and decodes; with --against, that it equals its source tree.
    Verify {
        /// A packed dataset file, an ImageFolder directory, a directory of shards, a quoted
        /// pattern ('DIR/train-*'), or several shard files read as one dataset.
        #[arg(required = true)]
        dataset: Vec<PathBuf>,
        #[command(flatten)]
        input: ReadingArgs,
        /// The ImageFolder tree the dataset was packed from.
        #[arg(long, value_name = "SRC_DIR")]
        against: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Save the index of each TFRecord shard that has none (opening such shards scans them and
    /// keeps the index in memory only), so later opens skip the scan. Shards a scan finds
    /// damaged get none.
    Index {
        /// A directory of TFRecord shards, a quoted pattern ('DIR/train-*'), or shard files.
        #[arg(required = true)]
        shards: Vec<PathBuf>,
        /// Index shards of a set with members missing, on purpose.
        #[arg(long)]
        allow_missing_shards: bool,
    },
    /// Write a deterministic synthetic ImageFolder tree (for demos and tests). Files already at
    /// the names it writes are replaced (links there are replaced, never followed); nothing
    /// else is touched.
    Synth {
        /// Output directory.
        out: PathBuf,
        /// Number of classes.
        #[arg(long, default_value_t = 10)]
        classes: usize,
        /// Images per class.
        #[arg(long, default_value_t = 100)]
        per_class: usize,
        /// Image size, WIDTHxHEIGHT, each side at most 8192.
        #[arg(long, default_value = "64x48", value_parser = parse_size)]
        size: (u32, u32),
        /// Seed for the pixel noise.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Add unusual and broken files (grayscale, CMYK, progressive, PNG+alpha, truncated,
        /// empty, text, decompression bomb).
        #[arg(long)]
        edge_cases: bool,
    },
}

/// `--to`: the name of any format the library writes ([`PackFormat::ALL`]; one this build
/// lacks is refused when the command runs, naming the Cargo feature).
fn output_format() -> impl clap::builder::TypedValueParser<Value = PackFormat> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(PackFormat::ALL.map(PackFormat::name))
        .map(|name: String| PackFormat::from_name(&name).expect("one of the possible values"))
}

#[derive(clap::Args)]
struct PackArgs {
    /// Root of the ImageFolder tree (for convert: any dataset imagefeed reads).
    src_dir: PathBuf,
    /// Output file.
    out: PathBuf,
    /// Shrink images whose shorter side exceeds this, re-encoding them as JPEG.
    #[arg(long, value_name = "SHORT_SIDE", value_parser = clap::value_parser!(u32).range(1..))]
    resize: Option<u32>,
    /// JPEG quality for re-encoded images (with --resize: only they are re-encoded).
    #[arg(
        long,
        default_value_t = 90,
        requires = "resize",
        value_parser = clap::value_parser!(u8).range(1..=100)
    )]
    quality: u8,
    /// Store decoded RGB pixels instead of the encoded files.
    #[arg(long)]
    raw: bool,
    /// Rewrite each JPEG losslessly (same pixels) with restart markers every ~32 pixels along
    /// each row, so RandomResizedCrop decodes only the blocks around its crop (faster crops,
    /// whole-image decodes ~7% slower, files ~2.5% larger; docs/formats.md).
    #[arg(long, alias = "restart-rows")]
    restart_markers: bool,
    /// LMDB output: store the bytes before each JPEG's image data (tables and headers, ~620
    /// bytes a file) once per dataset where files share them. CIFAR-size images pack to about
    /// a third of the size; imagefeed hands out the original files, but other LMDB readers see
    /// the stored form (docs/formats.md).
    #[arg(long)]
    shared_headers: bool,
    /// Fail on the first file that is not a usable image, leaving nothing behind.
    #[arg(long)]
    strict: bool,
    /// Finish an interrupted run (OUT.partial) without redoing finished samples.
    #[arg(long)]
    resume: bool,
    /// Replace an existing output (the old one stays until the new one is complete).
    #[arg(long)]
    force: bool,
    /// Worker threads (default: one per core).
    #[arg(long, value_parser = parse_threads)]
    threads: Option<usize>,
    /// Reject images with more pixels than this (decompression bombs).
    #[arg(long, default_value_t = imagefeed::decode::DEFAULT_MAX_PIXELS, value_parser = clap::value_parser!(u64).range(1..))]
    max_pixels: u64,
    /// Split the conversion into this many parts (one per machine or job-array task); pack
    /// only part --part-index, then put the parts together with `pack-dataset join`.
    // `--num-shards` and `--shard-index` are the old names: hidden aliases, still accepted.
    #[arg(long, alias = "num-shards", requires = "part_index")]
    num_parts: Option<usize>,
    /// Which part to pack, 0..num-parts.
    #[arg(long, alias = "shard-index", requires = "num_parts")]
    part_index: Option<usize>,
    /// Records output: close a shard at this size (bytes; K, M, G, KiB, MiB, GiB suffixes).
    #[arg(long, default_value = "128MiB", value_parser = parse_bytes)]
    shard_size: u64,
    /// Records output: store labels as class index + this (ImageNet TFRecords use 1).
    #[arg(long, default_value_t = 0)]
    label_base: u32,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

/// `writeln!` into a String (which cannot fail).
macro_rules! w {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

/// `println!` through [`emit`].
macro_rules! out {
    ($($arg:tt)*) => {
        emit(&format!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes to stdout; a closed pipe (`pack-dataset inspect X | head`) is not an error.
fn emit(text: &str) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        eprintln!("error: writing to stdout: {e}");
    }
}

/// Parses a byte count: `1000`, `64K`, `128MiB`, `1G`, ...
fn parse_bytes(text: &str) -> Result<u64, String> {
    imagefeed::units::parse_bytes(text)
}

fn parse_threads(text: &str) -> Result<usize, String> {
    let max = imagefeed::MAX_THREADS;
    text.parse::<usize>()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| format!("{text:?}: expected a number of threads, 1..={max}"))
}

fn parse_size(text: &str) -> Result<(u32, u32), String> {
    let (w, h) = text
        .split_once('x')
        .ok_or("expected WIDTHxHEIGHT, e.g. 64x48")?;
    let max = imagefeed::synthetic::MAX_SIDE;
    let parse = |v: &str| {
        v.parse::<u32>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| format!("{v:?}: each side must be a number in 1..={max}"))
    };
    Ok((parse(w)?, parse(h)?))
}

/// The signal (SIGINT or SIGTERM) that asked the pack in progress to stop; 0 while none has.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn request_stop(signal: libc::c_int) {
    STOP_SIGNAL.store(signal, Ordering::SeqCst);
    const SAYING: &[u8] =
        b"\npack-dataset: stopping after the chunk in progress (again to stop at once)\n";
    // SAFETY: `write` and `signal` are async-signal-safe; the message is a static buffer. A
    // second signal ends the process at once (what was committed is kept either way).
    unsafe {
        libc::write(2, SAYING.as_ptr().cast(), SAYING.len());
        libc::signal(signal, libc::SIG_DFL);
    }
}

/// Makes `signal` ask the pack to stop, unless it is ignored (a job started in the background
/// by a non-interactive shell ignores SIGINT, and must go on ignoring it).
fn catch(signal: libc::c_int) {
    // SAFETY: `sigaction` with a null new action only reads the current one into `old`;
    // `signal` then installs a handler that only stores to an atomic, writes and resets.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
        {
            return;
        }
        libc::signal(
            signal,
            request_stop as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// The progress bar, and Ctrl-C or SIGTERM as a request to stop after the chunk in progress.
struct Stoppable(PackProgressBar);

impl Stoppable {
    fn new(quiet: bool) -> Stoppable {
        catch(libc::SIGINT);
        catch(libc::SIGTERM);
        Stoppable(PackProgressBar::new(quiet))
    }

    /// Ends the pack's output: its summary and exit code; for a pack a signal stopped, what
    /// was written, how to finish it, and the exit code a shell expects (128 + the signal: 130,
    /// 143); an error, with `doing` as its context.
    fn finish(
        &self,
        result: imagefeed::Result<PackSummary>,
        doing: impl FnOnce() -> String,
    ) -> Result<u8> {
        self.0.finish();
        let signal = STOP_SIGNAL.load(Ordering::SeqCst);
        let summary = match result {
            Err(imagefeed::Error::Interrupted { reason, .. }) if signal != 0 => {
                eprintln!("pack-dataset: stopped by signal {signal}: {reason}");
                use std::io::Write as _;
                let mut line = b"to finish: ".to_vec();
                line.extend(resume_command());
                line.push(b'\n');
                let _ = std::io::stderr().write_all(&line);
                return Ok(128 + signal as u8);
            }
            other => other.with_context(doing)?,
        };
        if signal != 0 {
            eprintln!(
                "pack-dataset: signal {signal} came after the last chunk; the pack is complete"
            );
        }
        emit(&format_summary(&summary));
        Ok(exit_for(&summary))
    }
}

impl PackObserver for Stoppable {
    fn started(&self, total: usize, already_done: usize) {
        self.0.started(total, already_done);
    }
    fn advanced(&self, done: usize, payload_bytes: u64) {
        self.0.advanced(done, payload_bytes);
    }
    fn rejected(&self, rejection: &imagefeed::pack::Rejection) {
        self.0.rejected(rejection);
    }
    fn should_stop(&self) -> bool {
        STOP_SIGNAL.load(Ordering::SeqCst) != 0
    }
}

/// This command line with `--resume` added, quoted for a POSIX shell, as bytes (arguments need
/// not be UTF-8). `--force` stays: the old output it replaces is kept until the new one is
/// complete, and a resume without it is refused.
fn resume_command() -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt as _;
    let mut line = Vec::new();
    let args = ARGS
        .get()
        .into_iter()
        .flatten()
        .filter(|a| *a != "--resume")
        .cloned();
    for (i, arg) in args.chain(std::iter::once("--resume".into())).enumerate() {
        if i > 0 {
            line.push(b' ');
        }
        let bytes = arg.as_bytes();
        if !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(b))
        {
            line.extend_from_slice(bytes);
        } else {
            line.push(b'\'');
            for &b in bytes {
                if b == b'\'' {
                    line.extend_from_slice(b"'\\''");
                } else {
                    line.push(b);
                }
            }
            line.push(b'\'');
        }
    }
    line
}

/// Draws the progress bar: files done, rate, ETA.
fn pack(
    args: PackArgs,
    format: PackFormat,
    input: Option<imagefeed::format::OpenOptions>,
) -> Result<u8> {
    let options = PackOptions::default()
        .with_resize_short_side(args.resize)
        .with_quality(args.quality)
        .with_restart_markers(args.restart_markers)
        .with_shared_headers(args.shared_headers)
        .with_raw(args.raw)
        .with_strict(args.strict)
        .with_mode(StartMode {
            resume: args.resume,
            force: args.force,
        })
        .with_max_pixels(args.max_pixels)
        .with_threads(args.threads)
        .with_shard_bytes(args.shard_size)
        .with_label_base(args.label_base)
        .with_part(
            args.part_index
                .zip(args.num_parts)
                .map(|(index, count)| Part { index, count }),
        );
    let progress = Stoppable::new(args.quiet);
    let result = if let Some(input) = input {
        pack::convert_with(
            &args.src_dir,
            &args.out,
            format,
            &options,
            &input,
            &progress,
        )
    } else {
        pack::pack_image_folder(&args.src_dir, &args.out, format, &options, &progress)
    };
    progress.finish(result, || {
        format!(
            "packing {} into {}",
            args.src_dir.display(),
            args.out.display()
        )
    })
}

/// 1 when records of a dataset source were left out (the output holds fewer than the source
/// declares), else 0.
fn exit_for(summary: &PackSummary) -> u8 {
    if summary.dropped_records == 0 {
        return SUCCESS;
    }
    eprintln!(
        "error: {} of the source's records could not be read or are not images (listed above); \
         {} holds the other {}",
        summary.dropped_records,
        summary.output.display(),
        summary.samples
    );
    FAILURE
}

fn format_summary(s: &PackSummary) -> String {
    let mut o = String::new();
    w!(
        o,
        "packed {} samples ({} classes) into {}: {} of payload, {} file",
        s.samples,
        s.classes,
        s.output.display(),
        human_bytes(s.payload_bytes),
        human_bytes(s.file_bytes)
    );
    if s.resumed_from > 0 {
        w!(
            o,
            "resumed after {} files done by an earlier run",
            s.resumed_from
        );
    }
    if s.skipped_non_images > 0 {
        w!(
            o,
            "skipped {} files without an image extension",
            s.skipped_non_images
        );
    }
    if s.rejected.is_empty() {
        w!(o, "rejected 0 files");
    } else {
        w!(o, "rejected {} files:", s.rejected.len());
        for r in &s.rejected {
            w!(o, "  {}: {}", r.key, r.reason);
        }
    }
    w!(
        o,
        "{:.2} s, {:.0} images/s; report: {}",
        s.seconds,
        s.images_per_sec,
        pack::report_path(&s.output).display()
    );
    o
}

fn format_inspection(i: &Inspection) -> String {
    let mut o = String::new();
    w!(o, "dataset:     {}", i.path.display());
    w!(o, "format:      {} ({:?} payloads)", i.format, i.payload);
    w!(
        o,
        "complete:    {}",
        if !i.missing_shards.is_empty() {
            format!(
                "NO: {} shard(s) of the set are missing: {}",
                i.missing_shard_count,
                imagefeed::format::shards::missing_list(&i.missing_shards, i.missing_shard_count)
            )
        } else if i.empty_shards > 0 {
            format!(
                "NO: {} shard(s) hold no sample while the others do (a copy cut short?): see \
                 the notices",
                i.empty_shards
            )
        } else if i.cut_shards > 0 {
            format!(
                "NO: {} shard(s) are cut short (shorter than the dataset's index says, or \
                 ending inside a record: a copy or a write cut off?): see the notices",
                i.cut_shards
            )
        } else if i.complete && i.short_shards > 0 {
            format!(
                "yes, as far as its files tell: {} shard(s) hold under half the samples the \
                 others do (cut between two records?): see the notices",
                i.short_shards
            )
        } else if i.complete {
            "yes".to_string()
        } else {
            "NO: an interrupted pack; rerun it with --resume".to_string()
        }
    );
    w!(o, "samples:     {}", i.num_samples);
    if i.restart_markers {
        w!(
            o,
            "jpeg:        rewritten with restart markers (crops decode only what they need)"
        );
    }
    if let Some(h) = &i.shared_headers {
        w!(
            o,
            "jpeg:        {} shared header(s), {} stored once for all samples{}",
            h.headers,
            human_bytes(h.bytes),
            if h.damaged > 0 {
                format!(
                    "; {} DAMAGED (the samples using them are bad records)",
                    h.damaged
                )
            } else {
                String::new()
            }
        );
    }
    if let Some(s) = i.resized_short_side {
        w!(o, "resized:     shorter side at most {s}");
    }
    w!(
        o,
        "bytes:       {} payload, {} {}",
        human_bytes(i.payload_bytes),
        human_bytes(i.file_bytes),
        if i.path.to_str().is_some_and(imagefeed::remote::is_url) {
            "in storage"
        } else {
            "on disk"
        }
    );
    w!(
        o,
        "image size:  width {}..{} (median {}), height {}..{} (median {})",
        i.width.min,
        i.width.max,
        i.width.median,
        i.height.min,
        i.height.max,
        i.height.median
    );
    let common: Vec<String> = i
        .common_sizes
        .iter()
        .map(|s| format!("{}x{} ({})", s.width, s.height, s.count))
        .collect();
    w!(o, "most common: {}", common.join(", "));
    let formats: Vec<String> = i
        .payload_formats
        .iter()
        .map(|(f, n)| format!("{f} {n}"))
        .collect();
    w!(o, "encodings:   {}", formats.join(", "));
    if let Some(n) = i.rejected_at_pack {
        w!(o, "rejected when packed: {n}");
    }
    w!(o, "classes:     {}", i.classes.len());
    for (label, c) in i.classes.iter().enumerate() {
        w!(o, "  {label:>5}  {:<30} {}", c.name, c.count);
    }
    if i.bad_record_count > 0 {
        w!(
            o,
            "unreadable records: {} of {}",
            i.bad_record_count,
            i.num_samples
        );
        for b in &i.bad_records {
            w!(o, "  {} ({}): {}", b.index, b.key, b.reason);
        }
        if i.bad_record_count > i.bad_records.len() {
            w!(
                o,
                "  ... and {} more (the first {} are listed)",
                i.bad_record_count - i.bad_records.len(),
                i.bad_records.len()
            );
        }
    }
    o
}

fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::ImageFolder2Lmdb(args) => pack(args, PackFormat::Lmdb, None),
        Command::ImageFolder2Hdf5(args) => pack(args, PackFormat::Hdf5, None),
        Command::ImageFolder2Records(args) => pack(args, PackFormat::Records, None),
        Command::Convert { to, input, args } => pack(args, to, Some(input.open_options())),
        Command::Join {
            to,
            out,
            parts,
            shard_size,
            label_base,
            shared_headers,
            resume,
            force,
            quiet,
        } => {
            let options = PackOptions::default()
                .with_mode(StartMode { resume, force })
                .with_shard_bytes(shard_size)
                .with_label_base(label_base)
                .with_shared_headers(shared_headers);
            let progress = Stoppable::new(quiet);
            let result = pack::join(&parts, &out, to, &options, &progress);
            progress.finish(result, || {
                format!("joining {} parts into {}", parts.len(), out.display())
            })
        }
        Command::Inspect {
            dataset,
            input,
            json,
        } => {
            let options = input.open_options();
            let inspected = match dataset.as_slice() {
                [one] => imagefeed::inspect::inspect_with(one, &options),
                files => imagefeed::inspect::inspect_files(files, &options),
            };
            // An interrupted HDF5 or records pack has no dataset to read yet (LMDB's partial
            // file is one): still an answer, "incomplete", as for LMDB, not a failure to look.
            if let Err(imagefeed::Error::Incomplete { path, reason }) = &inspected {
                if json {
                    let report = serde_json::json!({
                        "path": path.to_string_lossy(),
                        "complete": false,
                        "incomplete": reason,
                    });
                    out!("{}", serde_json::to_string_pretty(&report)?);
                } else {
                    out!("dataset:     {}", path.display());
                    out!("complete:    NO: {reason}");
                }
                return Ok(FAILURE);
            }
            let inspection =
                inspected.with_context(|| format!("inspecting {}", describe(&dataset)))?;
            if json {
                out!("{}", serde_json::to_string_pretty(&inspection)?);
            } else {
                emit(&format_inspection(&inspection));
            }
            Ok(if inspection.is_whole() {
                SUCCESS
            } else {
                FAILURE
            })
        }
        Command::Verify {
            dataset,
            input,
            against,
            json,
        } => {
            let options = input.open_options();
            let report = match dataset.as_slice() {
                [one] => imagefeed::verify::verify_with(one, against.as_deref(), &options),
                files => imagefeed::verify::verify_files(files, against.as_deref(), &options),
            }
            .with_context(|| format!("verifying {}", describe(&dataset)))?;
            if json {
                out!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                for p in &report.problems {
                    let kind = match p.kind {
                        imagefeed::verify::ProblemKind::Unreadable => "UNREADABLE",
                        imagefeed::verify::ProblemKind::Undecodable => "UNDECODABLE",
                        imagefeed::verify::ProblemKind::Mismatch => "MISMATCH",
                    };
                    match p.index {
                        Some(i) => out!("{kind} record {i} ({}): {}", p.key, p.problem),
                        None => out!("{kind} {}: {}", p.key, p.problem),
                    }
                }
                if report.problem_count > report.problems.len() {
                    out!(
                        "... and {} more problems (the first {} are listed)",
                        report.problem_count - report.problems.len(),
                        report.problems.len()
                    );
                }
                let against = match &report.against {
                    Some(src) => format!(
                        " against {} ({} undecodable source files skipped, as packing rejects them)",
                        src.display(),
                        report.source_rejects
                    ),
                    None => String::new(),
                };
                out!(
                    "{}: {} records checked{against}: {}",
                    describe(&dataset),
                    report.checked,
                    if report.is_ok() {
                        "OK".to_string()
                    } else {
                        format!("{} problems", report.problem_count)
                    }
                );
            }
            Ok(if report.is_ok() { SUCCESS } else { FAILURE })
        }
        Command::Index {
            shards,
            allow_missing_shards,
        } => {
            use imagefeed::format::shards::Selection;
            let selection = match shards.as_slice() {
                [one] => Selection::of(one),
                files => Selection::List(files.to_vec()),
            };
            let options = imagefeed::format::OpenOptions::default()
                .with_allow_missing_shards(allow_missing_shards);
            let records =
                imagefeed::format::tfrecord::Records::open_selection(&selection, &options)
                    .with_context(|| format!("opening {}", describe(&shards)))?;
            let written = records
                .save_missing_indexes()
                .with_context(|| format!("saving the indexes of {}", describe(&shards)))?;
            for path in &written {
                out!("wrote {}", path.display());
            }
            if written.is_empty() {
                out!(
                    "no index written: every shard of {} has one, is damaged or compressed, or has something else at its index path (`pack-dataset inspect` lists the damage)",
                    describe(&shards)
                );
            }
            Ok(SUCCESS)
        }
        Command::Synth {
            out,
            classes,
            per_class,
            size: (width, height),
            seed,
            edge_cases,
        } => {
            let spec = SyntheticSpec {
                classes,
                per_class,
                width,
                height,
                seed,
                edge_cases,
                ..SyntheticSpec::default()
            };
            if classes == 0 || per_class == 0 {
                bail!("--classes and --per-class must be at least 1");
            }
            let tree = synthetic::write_image_folder(&out, &spec)?;
            out!(
                "wrote {} image files in {} classes under {}",
                tree.image_files,
                tree.classes.len(),
                out.display()
            );
            for case in &tree.edge_cases {
                let verdict = if case.valid { "valid" } else { "broken" };
                out!("  {} ({verdict}: {})", case.key, case.what);
            }
            Ok(SUCCESS)
        }
    }
}

/// Prints what the library reports through the `log` facade (its notices: an index built in
/// memory for a TFRecord shard, labels out of range) to stderr as `note: …`, when it happens.
/// `-q` does not silence them: they are about the data, not progress.
struct NoteLogger;

impl log::Log for NoteLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn && metadata.target().starts_with("imagefeed")
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("note: {}", record.args());
        }
    }

    fn flush(&self) {}
}

/// Runs `pack-dataset` with `args` (`argv[0]` first) and returns its exit code: 0 done, 1 a
/// problem found, 2 an error or bad usage, 130/143 a pack stopped by SIGINT/SIGTERM. Meant for
/// a process that runs nothing else: it restores SIGPIPE's default action (so `| head` ends
/// it quietly) and handles SIGINT/SIGTERM while a pack runs.
pub fn main_with(args: Vec<OsString>) -> u8 {
    // Output piped into a reader that stops early (`| head`) ends the process quietly, as it
    // does `cat`, instead of panicking on the closed pipe (Rust and Python ignore SIGPIPE).
    // SAFETY: restoring a signal's default action; nothing in this process relies on it being
    // ignored while the command runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    static LOGGER: NoteLogger = NoteLogger;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(err) => {
            // --help and --version are "errors" that print to stdout and exit 0.
            let _ = err.print();
            return err.exit_code().clamp(0, 255) as u8;
        }
    };
    let _ = ARGS.set(args);
    match run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", imagefeed::error::display_chain(err.as_ref()));
            2
        }
    }
}
