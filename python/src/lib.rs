//! `imagefeed._native`: the Rust extension behind the `imagefeed` Python package.
//!
//! The Python package (`python/imagefeed/`) is the public interface; this module is the thin
//! layer it stands on: [`loader::NativeLoader`] (epochs, batches as zero-copy DLPack arrays,
//! resume state), [`dataset::NativeDataset`] (random access for map-style datasets), and packing,
//! inspecting and verifying. Errors become the exceptions of `imagefeed.errors`
//! ([`errors::to_py`]). No Python object is touched by the loader's worker threads; every call
//! that reads, decodes or waits releases the GIL.

mod dataset;
mod dlpack;
mod errors;
mod loader;

use std::path::PathBuf;

use pyo3::prelude::*;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use imagefeed::pack::{self, PackFormat, PackObserver, PackOptions, Part, Rejection, StartMode};
use imagefeed::progress::PackProgressBar;

use crate::errors::{config, to_py};

/// The reading options every Python call that opens a dataset takes, as the dict
/// `imagefeed._reading.reading_options` makes (`hdf5_images`, `hdf5_labels`, `label_base`,
/// `num_classes`, `allow_missing_shards`, `storage_options`, `ranged_reads`; None: imagefeed's
/// defaults), made one `OpenOptions`.
#[derive(FromPyObject, Default)]
#[pyo3(from_item_all)]
pub(crate) struct Reading {
    hdf5_images: Option<String>,
    hdf5_labels: Option<String>,
    label_base: Option<u32>,
    num_classes: Option<usize>,
    allow_missing_shards: bool,
    storage_options: Vec<(String, String)>,
    ranged_reads: bool,
}

impl Reading {
    pub(crate) fn open_options(self) -> imagefeed::format::OpenOptions {
        let mut options = imagefeed::format::OpenOptions::default()
            .with_allow_missing_shards(self.allow_missing_shards)
            .with_ranged_reads(self.ranged_reads);
        if let Some(images) = self.hdf5_images {
            options.hdf5.images = images;
        }
        if let Some(labels) = self.hdf5_labels {
            options.hdf5.labels = labels;
        }
        options.records.label_base = self.label_base;
        options.records.num_classes = self.num_classes;
        options.storage_options = self.storage_options;
        options
    }
}

fn pack_format(name: &str) -> PyResult<PackFormat> {
    Ok(match name {
        "lmdb" => PackFormat::Lmdb,
        "hdf5" | "h5" => PackFormat::Hdf5,
        "records" | "tfrecord" => PackFormat::Records,
        other => {
            return Err(config(format!(
                "format {other:?}: must be \"lmdb\", \"hdf5\" or \"records\""
            )));
        }
    })
}

/// The progress bar, plus a flag that stops the pack after its current chunk.
struct StoppableProgress {
    bar: PackProgressBar,
    stop: AtomicBool,
}

impl PackObserver for StoppableProgress {
    fn started(&self, total: usize, already_done: usize) {
        self.bar.started(total, already_done);
    }
    fn advanced(&self, done: usize, payload_bytes: u64) {
        self.bar.advanced(done, payload_bytes);
    }
    fn rejected(&self, rejection: &Rejection) {
        self.bar.rejected(rejection);
    }
    fn should_stop(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// Packs (or converts) `source` into `out`; returns the summary as JSON. Any source `convert`
/// reads works: an ImageFolder tree, or a dataset imagefeed opens.
#[pyfunction]
#[pyo3(signature = (
    source, out, *, format, resize=None, quality=90, raw=false, strict=false, resume=false,
    force=false, threads=None, shard_bytes=None, label_base=0, part=None, max_pixels=None,
    quiet=false, reading=None, restart_markers=false, shared_headers=false,
))]
#[allow(clippy::too_many_arguments)]
fn pack_dataset(
    py: Python<'_>,
    source: PathBuf,
    out: PathBuf,
    format: &str,
    resize: Option<u32>,
    quality: u8,
    raw: bool,
    strict: bool,
    resume: bool,
    force: bool,
    threads: Option<usize>,
    shard_bytes: Option<u64>,
    label_base: u32,
    part: Option<(usize, usize)>,
    max_pixels: Option<u64>,
    quiet: bool,
    reading: Option<Reading>,
    restart_markers: bool,
    shared_headers: bool,
) -> PyResult<String> {
    let format = pack_format(format)?;
    let input = reading.unwrap_or_default().open_options();
    let mut options = PackOptions::default()
        .with_resize_short_side(resize)
        .with_quality(quality)
        .with_raw(raw)
        .with_restart_markers(restart_markers)
        .with_shared_headers(shared_headers)
        .with_strict(strict)
        .with_mode(StartMode { resume, force })
        .with_threads(threads)
        .with_label_base(label_base)
        .with_part(part.map(|(index, count)| Part { index, count }));
    if let Some(bytes) = shard_bytes {
        options.shard_bytes = bytes;
    }
    if let Some(max_pixels) = max_pixels {
        options.max_pixels = max_pixels;
    }
    // An output in object storage is reached with the same client options as the input.
    options.storage_options = input.storage_options.clone();
    options.validate().map_err(to_py)?;
    let summary = run_interruptibly(py, quiet, |observer| {
        pack::convert_with(&source, &out, format, &options, &input, observer)
    })?;
    serde_json::to_string(&summary).map_err(|e| config(format!("summary: {e}")))
}

/// Runs a pack (`work`, given the observer to report to) on its own thread while this one
/// waits with the GIL released, waking every 50 ms to let Python handle signals: Ctrl-C stops
/// the pack after its current chunk (what was committed stays for `resume=True`) and raises
/// KeyboardInterrupt.
fn run_interruptibly<F>(py: Python<'_>, quiet: bool, work: F) -> PyResult<pack::PackSummary>
where
    F: FnOnce(&StoppableProgress) -> imagefeed::Result<pack::PackSummary> + Send,
{
    let progress = StoppableProgress {
        bar: PackProgressBar::new(quiet),
        stop: AtomicBool::new(false),
    };
    std::thread::scope(|scope| {
        let pack = scope.spawn(|| work(&progress));
        loop {
            py.detach(|| {
                for _ in 0..10 {
                    if pack.is_finished() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
            if pack.is_finished() {
                progress.bar.finish();
                return pack
                    .join()
                    .unwrap_or_else(|panic| {
                        Err(imagefeed::Error::Panicked {
                            what: "the pack".into(),
                            message: imagefeed::error::panic_message(&*panic),
                        })
                    })
                    .map_err(to_py);
            }
            if let Err(interrupt) = py.check_signals() {
                progress.stop.store(true, Ordering::Relaxed);
                let stopped = py.detach(|| pack.join());
                progress.bar.finish();
                return match stopped {
                    // Finished before it saw the request (the output is complete) or panicked:
                    // the interrupt still propagates.
                    Ok(Ok(_)) | Err(_) => Err(interrupt),
                    Ok(Err(imagefeed::Error::Interrupted { .. })) => Err(interrupt),
                    Ok(Err(other)) => Err(to_py(other)),
                };
            }
        }
    })
}

/// Joins the parts of a split pack (`pack(..., part=(i, n))`) into one dataset at `out`,
/// identical to an unsplit pack; returns the summary as JSON.
#[pyfunction]
#[pyo3(signature = (
    parts, out, *, format, resume=false, force=false, threads=None, shard_bytes=None,
    label_base=0, shared_headers=false, quiet=false,
))]
#[allow(clippy::too_many_arguments)]
fn join_parts(
    py: Python<'_>,
    parts: Vec<PathBuf>,
    out: PathBuf,
    format: &str,
    resume: bool,
    force: bool,
    threads: Option<usize>,
    shard_bytes: Option<u64>,
    label_base: u32,
    shared_headers: bool,
    quiet: bool,
) -> PyResult<String> {
    let format = pack_format(format)?;
    let mut options = PackOptions::default()
        .with_mode(StartMode { resume, force })
        .with_threads(threads)
        .with_label_base(label_base)
        .with_shared_headers(shared_headers);
    if let Some(bytes) = shard_bytes {
        options.shard_bytes = bytes;
    }
    options.validate().map_err(to_py)?;
    let summary = run_interruptibly(py, quiet, |observer| {
        pack::join(&parts, &out, format, &options, observer)
    })?;
    serde_json::to_string(&summary).map_err(|e| config(format!("summary: {e}")))
}

/// What `pack-dataset inspect` shows, as JSON.
#[pyfunction]
#[pyo3(signature = (paths, reading=None))]
fn inspect_dataset(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    reading: Option<Reading>,
) -> PyResult<String> {
    let options = reading.unwrap_or_default().open_options();
    let inspection = py
        .detach(|| match paths.as_slice() {
            [one] => imagefeed::inspect::inspect_with(one, &options),
            files => imagefeed::inspect::inspect_files(files, &options),
        })
        .map_err(to_py)?;
    serde_json::to_string(&inspection).map_err(|e| config(format!("inspection: {e}")))
}

/// What `pack-dataset verify` reports, as JSON.
#[pyfunction]
#[pyo3(signature = (paths, against=None, reading=None))]
fn verify_dataset(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    against: Option<PathBuf>,
    reading: Option<Reading>,
) -> PyResult<String> {
    let options = reading.unwrap_or_default().open_options();
    let report = py
        .detach(|| match paths.as_slice() {
            [one] => imagefeed::verify::verify_with(one, against.as_deref(), &options),
            files => imagefeed::verify::verify_files(files, against.as_deref(), &options),
        })
        .map_err(to_py)?;
    serde_json::to_string(&report).map_err(|e| config(format!("report: {e}")))
}

/// Writes a synthetic ImageFolder tree (what `pack-dataset synth` makes); returns the number of
/// files with an image extension.
#[pyfunction]
#[pyo3(signature = (root, *, classes=10, per_class=100, width=64, height=48, seed=0, edge_cases=false))]
#[allow(clippy::too_many_arguments)]
fn synthesize(
    py: Python<'_>,
    root: PathBuf,
    classes: usize,
    per_class: usize,
    width: u32,
    height: u32,
    seed: u64,
    edge_cases: bool,
) -> PyResult<usize> {
    let spec = imagefeed::synthetic::SyntheticSpec {
        classes,
        per_class,
        width,
        height,
        seed,
        edge_cases,
        ..Default::default()
    };
    let tree = py
        .detach(|| imagefeed::synthetic::write_image_folder(&root, &spec))
        .map_err(to_py)?;
    Ok(tree.image_files)
}

/// Refuses `pixels` that are not a `width × height` RGB image (for the op helpers below).
fn check_rgb(pixels: &[u8], width: u32, height: u32) -> PyResult<()> {
    if width == 0 || height == 0 || pixels.len() as u64 != width as u64 * height as u64 * 3 {
        return Err(config(format!(
            "{} bytes are not a {width}x{height} RGB image",
            pixels.len()
        )));
    }
    Ok(())
}

/// One automatic-augmentation op (torchvision's name, e.g. `"ShearX"`) with `magnitude` applied
/// to a `width × height` RGB image; returns the new pixels. For checking the ops against PIL and
/// torchvision op by op (the loader draws them itself).
#[pyfunction]
#[pyo3(signature = (op, magnitude, pixels, width, height, fill=(0, 0, 0)))]
fn _augment_op<'py>(
    py: Python<'py>,
    op: &str,
    magnitude: f64,
    pixels: Vec<u8>,
    width: u32,
    height: u32,
    fill: (u8, u8, u8),
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    use imagefeed::transform::ops::{Op, RgbImage};
    let op = Op::from_name(op).ok_or_else(|| config(format!("unknown op {op:?}")))?;
    check_rgb(&pixels, width, height)?;
    let (mut pixels, mut scratch) = (pixels, Vec::new());
    RgbImage {
        pixels: &mut pixels,
        scratch: &mut scratch,
        width,
        height,
    }
    .apply(op, magnitude, [fill.0, fill.1, fill.2]);
    Ok(pyo3::types::PyBytes::new(py, &pixels))
}

/// One op of timm's RandAugment (its name) with its argument (what timm's level function
/// returns) on a `width × height` RGB image, sampling with `"bilinear"` or `"bicubic"`; returns
/// the new pixels. For checking the ops against timm's and PIL's.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _timm_op<'py>(
    py: Python<'py>,
    op: &str,
    arg: f64,
    pixels: Vec<u8>,
    width: u32,
    height: u32,
    fill: (u8, u8, u8),
    resample: &str,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    use imagefeed::transform::affine_filter::AffineFilter;
    use imagefeed::transform::ops::RgbImage;
    use imagefeed::transform::timm::TimmOp;
    let op = TimmOp::from_name(op).ok_or_else(|| config(format!("unknown timm op {op:?}")))?;
    let filter = match resample {
        "bilinear" => Some(AffineFilter::Bilinear),
        "bicubic" => Some(AffineFilter::Bicubic),
        "nearest" => None,
        other => return Err(config(format!("unknown resample {other:?}"))),
    };
    check_rgb(&pixels, width, height)?;
    let (mut pixels, mut scratch) = (pixels, Vec::new());
    op.apply(
        &mut RgbImage {
            pixels: &mut pixels,
            scratch: &mut scratch,
            width,
            height,
        },
        arg,
        [fill.0, fill.1, fill.2],
        filter,
    );
    Ok(pyo3::types::PyBytes::new(py, &pixels))
}

/// Checks a timm RandAugment config string as the loader reads it
/// (`TimmRandAugment::from_config`), so that `T.TimmRandAugment` refuses a bad one when it is
/// made: `ConfigError` naming the section.
#[pyfunction]
fn _check_timm_config(config_str: &str) -> PyResult<()> {
    imagefeed::transform::TimmRandAugment::from_config(config_str)
        .map(drop)
        .map_err(|e| config(format!("TimmRandAugment: {e}")))
}

/// One colour adjustment (`"brightness"`, `"contrast"`, `"saturation"`, `"hue"` with its factor,
/// or `"grayscale"`) applied to a `width × height` RGB image, as `ColorJitter` and
/// `RandomGrayscale` apply them; returns the new pixels. For checking them against PIL and
/// torchvision.
#[pyfunction]
fn _color_op<'py>(
    py: Python<'py>,
    op: &str,
    factor: f64,
    pixels: Vec<u8>,
    width: u32,
    height: u32,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    use imagefeed::transform::ops;
    check_rgb(&pixels, width, height)?;
    let mut pixels = pixels;
    match op {
        "brightness" => ops::adjust_brightness(&mut pixels, factor as f32),
        "contrast" => ops::adjust_contrast(&mut pixels, factor as f32),
        "saturation" => ops::adjust_saturation(&mut pixels, factor as f32),
        "hue" => ops::adjust_hue(&mut pixels, factor),
        "grayscale" => ops::to_grayscale(&mut pixels),
        other => return Err(config(format!("unknown colour op {other:?}"))),
    }
    Ok(pyo3::types::PyBytes::new(py, &pixels))
}

/// torchvision's `GaussianBlur` with a given sigma on a `width × height` RGB image (the loader
/// draws sigma itself); returns the new pixels. For checking against torchvision.
#[pyfunction]
fn _blur_op<'py>(
    py: Python<'py>,
    kernel: (u32, u32),
    sigma: f32,
    pixels: Vec<u8>,
    width: u32,
    height: u32,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let check = imagefeed::transform::GaussianBlur {
        kernel,
        sigma: (sigma as f64, sigma as f64),
        p: 1.0,
    };
    check.validate().map_err(config)?;
    check_rgb(&pixels, width, height)?;
    let mut pixels = pixels;
    let mut scratch = imagefeed::transform::blur::BlurScratch::default();
    imagefeed::transform::blur::blur(
        &mut pixels,
        &mut scratch,
        width as usize,
        height as usize,
        kernel,
        sigma,
    );
    Ok(pyo3::types::PyBytes::new(py, &pixels))
}

/// Runs the `pack-dataset` command line with `argv` (`argv[0]` first) and returns its exit
/// code, the GIL released: what the wheel's `pack-dataset` console script and
/// `python -m imagefeed.pack_dataset` run. SIGINT/SIGTERM stop a pack after its chunk in
/// progress (the command's own handlers replace Python's while it runs).
#[pyfunction]
fn pack_dataset_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> u8 {
    py.detach(|| pack_dataset_cli::main_with(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<loader::NativeLoader>()?;
    m.add_class::<dataset::NativeDataset>()?;
    m.add_class::<dlpack::HostArray>()?;
    m.add_function(wrap_pyfunction!(pack_dataset, m)?)?;
    m.add_function(wrap_pyfunction!(join_parts, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_dataset, m)?)?;
    m.add_function(wrap_pyfunction!(verify_dataset, m)?)?;
    m.add_function(wrap_pyfunction!(synthesize, m)?)?;
    m.add_function(wrap_pyfunction!(_augment_op, m)?)?;
    m.add_function(wrap_pyfunction!(_color_op, m)?)?;
    m.add_function(wrap_pyfunction!(_timm_op, m)?)?;
    m.add_function(wrap_pyfunction!(_check_timm_config, m)?)?;
    m.add_function(wrap_pyfunction!(_blur_op, m)?)?;
    m.add_function(wrap_pyfunction!(pack_dataset_main, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
