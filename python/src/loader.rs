//! The loader, as the Python package drives it (`imagefeed.Loader` wraps this class).
//!
//! One [`NativeLoader`] owns an [`imagefeed::loader::Loader`] and at most one epoch in progress.
//! Waiting for a batch releases the GIL and wakes up every [`SIGNAL_POLL`] to let Python run its
//! signal handlers, so Ctrl-C raises `KeyboardInterrupt` within that time; the Python loop then
//! puts the epoch aside with `stop` (its batches in flight cancelled, its position kept for
//! `state_dict`, counting only the batches it handed to the trainer).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use imagefeed::batch::BadSample;
use imagefeed::format;
use imagefeed::loader::{BadSamplePolicy, Epoch, Loader, LoaderConfig, LoaderState, MaxBad, Wait};
use imagefeed::sampler::Uneven;
use imagefeed::transform::{
    AugmentPolicy, AutoAugment, BatchMix, ColorJitter, DType, EraseValue, GaussianBlur, Geometry,
    Interpolation, Layout, Normalize, PaddingMode, PixelStep, PixelSteps, RandomErasing,
    RandomGrayscale, TimmRandAugment, TimmResample, Transform, autoaugment::DEFAULT_MAGNITUDE_BINS,
};

use crate::dlpack::{Element, HostArray, HostMemory};
use crate::errors::{config, to_py};

/// A batch as Python receives it: images and labels viewing Rust memory, sample indices, bad
/// samples.
/// `classes`: the soft labels' width (the batch mix's `num_classes`), so that an empty batch's
/// labels are still `[0, classes]`.
fn batch_parts(mut batch: imagefeed::batch::Batch, classes: usize) -> PyResult<BatchParts> {
    let shape = batch.shape;
    let element = match batch.dtype {
        DType::U8 => Element::U8,
        DType::F16 => Element::F16,
        DType::Bf16 => Element::Bf16,
        DType::F32 => Element::F32,
    };
    let n = batch.labels.len();
    let labels = match batch.soft_labels.take() {
        // MixUp/CutMix: float32 [n, classes] probabilities.
        Some(soft) => HostArray::new(
            Arc::new(HostMemory::from_vec(soft)),
            &[n, classes],
            Element::F32,
        )?,
        None => {
            let labels: Vec<i64> = batch.labels.iter().map(|&l| i64::from(l)).collect();
            HostArray::new(Arc::new(HostMemory::from_vec(labels)), &[n], Element::I64)?
        }
    };
    let samples = std::mem::take(&mut batch.samples);
    let bad: Vec<_> = std::mem::take(&mut batch.bad)
        .into_iter()
        .map(bad_tuple)
        .collect();
    let mut buffer = batch.into_buffer();
    let bytes = buffer.as_mut_slice();
    let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
    // SAFETY: the pooled buffer's block is heap memory that stays in place until the buffer is
    // dropped (it then goes back to the pool); the box below owns it from here on, and nothing
    // else holds it.
    let memory = unsafe { HostMemory::new(ptr, len, Box::new(buffer)) };
    let images = HostArray::new(Arc::new(memory), &shape, element)?;
    Ok((images, labels, samples, bad))
}

/// How long a wait for a batch runs before Python gets to check for signals.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The epoch in progress, or where the last one stopped.
#[derive(Default)]
struct Current {
    epoch: Option<Epoch>,
    /// The state of an epoch put aside (interrupted, or left by a `break`).
    stopped: Option<LoaderState>,
    /// Batches `next_batch` has returned in the epoch in progress.
    returned: usize,
    /// Counts the epochs begun, resumed or stopped: a wait that let a signal handler run checks
    /// its epoch is still the one it was waiting on.
    generation: u64,
    /// The epoch's state before each of the last [`HISTORY`] batches returned (oldest first):
    /// where it stands if Python has not handed the last ones to the trainer (one held while an
    /// exception hits, one more staged ahead on the GPU).
    history: VecDeque<LoaderState>,
}

/// Batches returned but possibly not handed over that a position can step back over.
const HISTORY: usize = 2;

impl Current {
    /// Forgets the epoch's bookkeeping (a new or resumed epoch starts).
    fn reset(&mut self) {
        self.generation += 1;
        self.stopped = None;
        self.returned = 0;
        self.history.clear();
    }

    /// Where the epoch in progress stands for a trainer that has been handed `handed` of the
    /// batches returned (None: all of them).
    fn position(&self, epoch: &Epoch, handed: Option<usize>) -> LoaderState {
        let held = handed.map_or(0, |h| self.returned.saturating_sub(h));
        match held {
            0 => epoch.state(),
            n if n <= self.history.len() => self.history[self.history.len() - n].clone(),
            // More held than remembered cannot happen with the Python loop; be exact anyway
            // about what is known.
            _ => self
                .history
                .front()
                .cloned()
                .unwrap_or_else(|| epoch.state()),
        }
    }
}

/// The Rust loader behind `imagefeed.Loader`.
#[pyclass(module = "imagefeed._native")]
pub struct NativeLoader {
    loader: Loader,
    current: Mutex<Current>,
    /// Threads waiting for `current` (see [`NativeLoader::current`]): the iterating thread
    /// lets them in between batches.
    waiting: AtomicUsize,
    /// The page-locked allocator, when batches are bound for a GPU.
    pinned: Option<Arc<imagefeed::gpu::PinnedAllocator>>,
}

/// One delivered batch: images, labels, sample indices, bad samples ([`BadTuple`]).
type BatchParts = (HostArray, HostArray, Vec<usize>, Vec<BadTuple>);

impl NativeLoader {
    /// Where in epoch `epoch`'s order the part this loader runs of it begins: 0, unless the
    /// epoch in progress (or put aside) was resumed at another world size or batch size, which
    /// deals out only what was left of it, and `continuing` says the loop in question is that
    /// one (not a new loop of the same epoch, which begins it whole).
    fn part_start(&self, py: Python<'_>, epoch: u64, continuing: bool) -> usize {
        if !continuing {
            return 0;
        }
        let current = self.current(py);
        match (&current.epoch, &current.stopped) {
            (Some(e), _) if e.number() == epoch => e.part_start(),
            (None, Some(stopped)) if stopped.epoch == epoch => stopped.start,
            _ => 0,
        }
    }

    /// The current-epoch lock, taken without holding the GIL while it is busy: a thread that
    /// holds it may be waiting for a batch with the GIL released, and must be able to take the
    /// GIL back when the batch comes.
    ///
    /// A waiting thread counts itself in `waiting`, and the thread iterating lets it in at its
    /// next batch boundary ([`Self::let_waiting_in`]): otherwise the iterating thread, which
    /// holds the lock while a batch is made and takes it back within microseconds, kept it
    /// from a `state_dict()` called from another thread for a whole epoch (48 s; found by a
    /// hostile try).
    fn current(&self, py: Python<'_>) -> MutexGuard<'_, Current> {
        let mut counted = false;
        let guard = loop {
            match self.current.try_lock() {
                Ok(guard) => break guard,
                Err(TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    if !counted {
                        self.waiting.fetch_add(1, Ordering::SeqCst);
                        counted = true;
                    }
                    py.detach(|| std::thread::sleep(Duration::from_micros(200)))
                }
            }
        };
        if counted {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        guard
    }

    /// Waits, holding neither the lock nor the GIL, while other threads wait for the lock.
    fn let_waiting_in(&self, py: Python<'_>) {
        while self.waiting.load(Ordering::SeqCst) > 0 {
            py.detach(|| std::thread::sleep(Duration::from_micros(200)));
        }
    }
}

fn parse_dtype(name: &str) -> PyResult<DType> {
    Ok(match name {
        "float32" | "f32" => DType::F32,
        "float16" | "f16" => DType::F16,
        "bfloat16" | "bf16" => DType::Bf16,
        "uint8" | "u8" => DType::U8,
        other => {
            return Err(config(format!(
                "dtype {other:?}: must be \"float32\", \"float16\", \"bfloat16\" or \"uint8\""
            )));
        }
    })
}

fn parse_layout(name: &str) -> PyResult<Layout> {
    Ok(match name.to_ascii_uppercase().as_str() {
        "NCHW" => Layout::Nchw,
        "NHWC" => Layout::Nhwc,
        _ => {
            return Err(config(format!(
                "layout {name:?}: must be \"NCHW\" or \"NHWC\""
            )));
        }
    })
}

fn pair(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<(f64, f64)>> {
    d.get_item(key)?.map(|v| v.extract()).transpose()
}

/// `d[key]`, `None` when the key is missing or holds `None`.
fn unless_none<'py, T>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<T>>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    d.get_item(key)?
        .filter(|v| !v.is_none())
        .map(|v| v.extract::<T>().map_err(Into::into))
        .transpose()
}

fn uint(d: &Bound<'_, PyDict>, key: &str) -> PyResult<u32> {
    d.get_item(key)?
        .ok_or_else(|| config(format!("transform: {key} is missing")))?
        .extract()
}

/// A transform from the dict `imagefeed.transforms` builds:
/// `{"geometry": "native" | "resize" | "center_crop" | "resize_center_crop" | "random_crop" |
/// "random_resized_crop", "width", "height", "short", "padding" (left, top, right, bottom),
/// "pad_if_needed", "scale", "ratio", "interpolation" ("nearest" | "bilinear" | "bicubic"),
/// "hflip", "mean", "std"}`.
fn parse_transform(spec: &Bound<'_, PyDict>) -> PyResult<Transform> {
    let geometry: String = spec
        .get_item("geometry")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or_else(|| "native".into());
    let geometry = match geometry.as_str() {
        "native" => Geometry::Native,
        "resize" => Geometry::Resize {
            short: uint(spec, "short")?,
        },
        "resize_to" => Geometry::ResizeTo {
            width: uint(spec, "width")?,
            height: uint(spec, "height")?,
        },
        "center_crop" => Geometry::CenterCrop {
            width: uint(spec, "width")?,
            height: uint(spec, "height")?,
        },
        "resize_center_crop" => Geometry::ResizeCenterCrop {
            short: uint(spec, "short")?,
            width: uint(spec, "width")?,
            height: uint(spec, "height")?,
        },
        "random_crop" => Geometry::RandomCrop {
            width: uint(spec, "width")?,
            height: uint(spec, "height")?,
            padding: spec
                .get_item("padding")?
                .map(|v| v.extract())
                .transpose()?
                .unwrap_or([0; 4]),
            pad_if_needed: spec
                .get_item("pad_if_needed")?
                .map(|v| v.extract())
                .transpose()?
                .unwrap_or(false),
            fill: spec
                .get_item("fill")?
                .map(|v| v.extract())
                .transpose()?
                .unwrap_or([0; 3]),
            resize: spec.get_item("short")?.map(|v| v.extract()).transpose()?,
            padding_mode: match spec.get_item("padding_mode")? {
                None => PaddingMode::Constant,
                Some(name) => {
                    let name: String = name.extract()?;
                    PaddingMode::from_name(&name).ok_or_else(|| {
                        config(format!(
                            "transform: RandomCrop padding_mode {name:?} is none of constant, \
                             edge, reflect, symmetric"
                        ))
                    })?
                }
            },
        },
        "random_resized_crop" => Geometry::RandomResizedCrop {
            width: uint(spec, "width")?,
            height: uint(spec, "height")?,
            scale: pair(spec, "scale")?.unwrap_or((0.08, 1.0)),
            ratio: pair(spec, "ratio")?.unwrap_or((3.0 / 4.0, 4.0 / 3.0)),
        },
        other => return Err(config(format!("transform: unknown geometry {other:?}"))),
    };
    let hflip: f64 = spec
        .get_item("hflip")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or(0.0);
    let mean: Option<[f32; 3]> = spec.get_item("mean")?.map(|v| v.extract()).transpose()?;
    let std: Option<[f32; 3]> = spec.get_item("std")?.map(|v| v.extract()).transpose()?;
    let normalize = match (mean, std) {
        (Some(mean), Some(std)) => Some(Normalize { mean, std }),
        (None, None) => None,
        _ => return Err(config("transform: Normalize needs both mean and std")),
    };
    let interpolation: Option<String> = spec
        .get_item("interpolation")?
        .map(|v| v.extract())
        .transpose()?;
    let interpolation = match interpolation.as_deref() {
        None | Some("bilinear") => Interpolation::Bilinear,
        Some("bicubic") => Interpolation::Bicubic,
        Some("nearest") => Interpolation::Nearest,
        Some(other) => {
            return Err(config(format!(
                "transform: unknown interpolation {other:?} (nearest, bilinear or bicubic)"
            )));
        }
    };
    let erase = spec
        .get_item("erase")?
        .map(|erase| parse_erase(&erase, normalize))
        .transpose()?;
    let steps = |key: &str| -> PyResult<PixelSteps> {
        let mut pixel_steps = PixelSteps::default();
        if let Some(steps) = spec.get_item(key)? {
            for step in steps.try_iter()? {
                pixel_steps
                    .push(parse_pixel_step(&step?)?)
                    .map_err(|e| config(format!("transform: {e}")))?;
            }
        }
        Ok(pixel_steps)
    };
    let mut transform = Transform::none();
    transform.geometry = geometry;
    transform.interpolation = interpolation;
    transform.pixel_steps = steps("pixel_steps")?;
    transform.before_geometry = steps("before_geometry")?;
    transform.flip_before_geometry = spec
        .get_item("flip_before_geometry")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or(false);
    transform.erase = erase;
    transform.hflip = hflip;
    transform.output.normalize = normalize;
    Ok(transform)
}

/// `RandomErasing`'s dict: `{"p", "scale", "ratio", "value": numbers | "random"}`, its
/// values in the units of `normalize`, or of its own `"mean"` and `"std"` when it has them (the
/// CUDA feed's workers write unnormalized pixels; the GPU normalizes).
fn parse_erase(erase: &Bound<'_, PyAny>, normalize: Option<Normalize>) -> PyResult<RandomErasing> {
    let erase = erase.cast::<PyDict>().map_err(PyErr::from)?;
    let mean: Option<[f32; 3]> = erase.get_item("mean")?.map(|v| v.extract()).transpose()?;
    let std: Option<[f32; 3]> = erase.get_item("std")?.map(|v| v.extract()).transpose()?;
    let normalize = match (mean, std) {
        (Some(mean), Some(std)) => Some(Normalize { mean, std }),
        _ => normalize,
    };
    let value: Bound<'_, PyAny> = erase
        .get_item("value")?
        .ok_or_else(|| config("transform: RandomErasing value is missing"))?;
    let value = match value.extract::<String>() {
        Ok(random) if random == "random" => EraseValue::Random,
        Ok(other) => {
            return Err(config(format!(
                "transform: RandomErasing value {other:?} must be numbers or \"random\""
            )));
        }
        Err(_) => EraseValue::Constant(value.extract()?),
    };
    let p = erase
        .get_item("p")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or(0.5);
    let mut erasing = RandomErasing::new(p, normalize);
    erasing.scale = pair(erase, "scale")?.unwrap_or(erasing.scale);
    erasing.ratio = pair(erase, "ratio")?.unwrap_or(erasing.ratio);
    erasing.value = value;
    Ok(erasing)
}

/// The automatic augmentation's dict: `{"policy": "imagenet" | "cifar10" | "svhn" |
/// "rand_augment" | "trivial_augment_wide", "num_ops", "magnitude", "num_magnitude_bins",
/// "fill": (r, g, b)}`.
fn parse_augment(augment: &Bound<'_, PyAny>) -> PyResult<AutoAugment> {
    let augment = augment.cast::<PyDict>().map_err(PyErr::from)?;
    let policy: String = augment
        .get_item("policy")?
        .ok_or_else(|| config("transform: the augmentation's policy is missing"))?
        .extract()?;
    let bins = || -> PyResult<u32> {
        Ok(augment
            .get_item("num_magnitude_bins")?
            .map(|v| v.extract())
            .transpose()?
            .unwrap_or(DEFAULT_MAGNITUDE_BINS))
    };
    let policy = match policy.as_str() {
        "imagenet" => AugmentPolicy::ImageNet,
        "cifar10" => AugmentPolicy::Cifar10,
        "svhn" => AugmentPolicy::Svhn,
        "rand_augment" => AugmentPolicy::RandAugment {
            num_ops: uint(augment, "num_ops")?,
            magnitude: uint(augment, "magnitude")?,
            num_magnitude_bins: bins()?,
        },
        "trivial_augment_wide" => AugmentPolicy::TrivialAugmentWide {
            num_magnitude_bins: bins()?,
        },
        other => return Err(config(format!("transform: unknown augmentation {other:?}"))),
    };
    let fill: [u8; 3] = augment
        .get_item("fill")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or([0; 3]);
    Ok(AutoAugment::new(policy).with_fill(fill))
}

/// `ColorJitter`'s dict: `{"brightness", "contrast", "saturation", "hue": (min, max) | None,
/// "p"}`.
fn parse_color_jitter(jitter: &Bound<'_, PyAny>) -> PyResult<ColorJitter> {
    let jitter = jitter.cast::<PyDict>().map_err(PyErr::from)?;
    Ok(ColorJitter {
        brightness: unless_none(jitter, "brightness")?,
        contrast: unless_none(jitter, "contrast")?,
        saturation: unless_none(jitter, "saturation")?,
        hue: unless_none(jitter, "hue")?,
        p: jitter
            .get_item("p")?
            .map(|v| v.extract())
            .transpose()?
            .unwrap_or(1.0),
    })
}

/// One of the dicts of `"pixel_steps"`: `{"kind": "augment" | "color_jitter" | "grayscale" |
/// "blur", ...}` with the step's own keys.
fn parse_pixel_step(step: &Bound<'_, PyAny>) -> PyResult<PixelStep> {
    let dict = step.cast::<PyDict>().map_err(PyErr::from)?;
    let kind: String = dict
        .get_item("kind")?
        .ok_or_else(|| config("transform: a pixel step has no kind"))?
        .extract()?;
    Ok(match kind.as_str() {
        "augment" => PixelStep::AutoAugment(parse_augment(step)?),
        "color_jitter" => PixelStep::ColorJitter(parse_color_jitter(step)?),
        "grayscale" => PixelStep::Grayscale(RandomGrayscale {
            p: dict
                .get_item("p")?
                .ok_or_else(|| config("transform: RandomGrayscale p is missing"))?
                .extract()?,
        }),
        "blur" => PixelStep::GaussianBlur(parse_blur(step)?),
        "timm_rand_augment" => PixelStep::TimmRandAugment(parse_timm(dict)?),
        other => return Err(config(format!("transform: unknown pixel step {other:?}"))),
    })
}

/// timm's RandAugment dict: `{"config": "rand-m9-mstd0.5-inc1", "fill": (r, g, b),
/// "interpolation": "random" | "bilinear" | "bicubic"}`.
fn parse_timm(dict: &Bound<'_, PyDict>) -> PyResult<TimmRandAugment> {
    let text: String = dict
        .get_item("config")?
        .ok_or_else(|| config("transform: timm RandAugment config is missing"))?
        .extract()?;
    let mut augment =
        TimmRandAugment::from_config(&text).map_err(|e| config(format!("transform: {e}")))?;
    if let Some(fill) = dict.get_item("fill")? {
        augment.fill = fill.extract()?;
    }
    if let Some(interpolation) = dict.get_item("interpolation")? {
        let name: String = interpolation.extract()?;
        augment.resample = match name.as_str() {
            "random" => TimmResample::Random,
            "bilinear" => TimmResample::Bilinear,
            "bicubic" => TimmResample::Bicubic,
            "nearest" => TimmResample::Nearest,
            other => {
                return Err(config(format!(
                    "transform: timm RandAugment interpolation {other:?} is none of random, \
                     nearest, bilinear, bicubic"
                )));
            }
        };
    }
    Ok(augment)
}

/// `GaussianBlur`'s dict: `{"kernel": (width, height), "sigma": (min, max), "p"}`.
fn parse_blur(blur: &Bound<'_, PyAny>) -> PyResult<GaussianBlur> {
    let blur = blur.cast::<PyDict>().map_err(PyErr::from)?;
    let kernel: (u32, u32) = blur
        .get_item("kernel")?
        .ok_or_else(|| config("transform: GaussianBlur kernel is missing"))?
        .extract()?;
    Ok(GaussianBlur {
        kernel,
        sigma: pair(blur, "sigma")?.unwrap_or((0.1, 2.0)),
        p: blur
            .get_item("p")?
            .map(|v| v.extract())
            .transpose()?
            .unwrap_or(1.0),
    })
}

/// The batch step's dict: `{"mixup_alpha": float | None, "cutmix_alpha": float | None,
/// "num_classes": int | None}` (`None` classes: 0 here, the dataset's count later).
fn parse_batch_mix(mix: &Bound<'_, PyDict>) -> PyResult<BatchMix> {
    let num_classes: Option<usize> = unless_none(mix, "num_classes")?;
    Ok(BatchMix {
        mixup_alpha: unless_none(mix, "mixup_alpha")?,
        cutmix_alpha: unless_none(mix, "cutmix_alpha")?,
        num_classes: num_classes.unwrap_or(0),
    })
}

fn parse_max_bad(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<MaxBad>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(config(
            "max_bad: a count (int) or a fraction (float), not a bool",
        ));
    }
    // A count is anything integral (`__index__`: int, NumPy integer scalars), never a float.
    if !value.is_instance_of::<pyo3::types::PyFloat>() && value.hasattr("__index__")? {
        let count = value.call_method0("__index__")?;
        return match count.extract::<u64>() {
            Ok(count) => Ok(Some(MaxBad::Count(count))),
            Err(_) => Err(config(format!(
                "max_bad {value}: a count must be between 0 and 2^64 - 1"
            ))),
        };
    }
    // Shown as Python shows it: a string "1" read as `max_bad 1`, like the count it is not.
    let fraction: f64 = value.extract().map_err(|_| {
        let shown = value
            .repr()
            .map_or_else(|_| value.to_string(), |r| r.to_string());
        config(format!(
            "max_bad {shown}: a count (int >= 0) or a fraction (float)"
        ))
    })?;
    Ok(Some(MaxBad::Fraction(fraction)))
}

/// A bad sample for Python: `(index, key, reason, replaced_by, kind, while_replacing)`.
type BadTuple = (
    usize,
    String,
    String,
    Option<usize>,
    &'static str,
    Option<usize>,
);

fn bad_tuple(b: BadSample) -> BadTuple {
    (
        b.index,
        b.key,
        b.reason,
        b.replaced_by,
        b.kind.name(),
        b.while_replacing,
    )
}

#[pymethods]
impl NativeLoader {
    #[new]
    #[pyo3(signature = (
        paths, *, batch_size, workers, seed, prefetch, shuffle, drop_last, rank, world_size,
        uneven, transform, dtype, layout, bad_samples, max_bad=None, max_pixels=None,
        reading=None, pinned_device=None, shard_window=None, scaled_decode=true, batch_mix=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        paths: Vec<std::path::PathBuf>,
        batch_size: usize,
        workers: usize,
        seed: u64,
        prefetch: usize,
        shuffle: bool,
        drop_last: bool,
        rank: usize,
        world_size: usize,
        uneven: &str,
        transform: &Bound<'_, PyDict>,
        dtype: &str,
        layout: &str,
        bad_samples: &str,
        max_bad: Option<&Bound<'_, PyAny>>,
        max_pixels: Option<u64>,
        reading: Option<crate::Reading>,
        pinned_device: Option<usize>,
        shard_window: Option<usize>,
        scaled_decode: bool,
        batch_mix: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<NativeLoader> {
        let batch_mix = batch_mix.map(parse_batch_mix).transpose()?;
        let transform =
            parse_transform(transform)?.with_output(parse_dtype(dtype)?, parse_layout(layout)?);
        let policy = match bad_samples {
            "skip" => BadSamplePolicy::Skip,
            "replace" => BadSamplePolicy::Replace,
            "error" => BadSamplePolicy::Error,
            other => {
                return Err(config(format!(
                    "bad_samples {other:?}: must be \"skip\", \"replace\" or \"error\""
                )));
            }
        };
        let uneven = match uneven {
            "pad" => Uneven::Pad,
            "drop" => Uneven::Drop,
            "exact" => Uneven::Exact,
            other => {
                return Err(config(format!(
                    "uneven {other:?}: must be \"pad\", \"drop\" or \"exact\""
                )));
            }
        };
        let mut config_ = LoaderConfig::default()
            .with_batch_size(batch_size)
            .with_workers(workers)
            .with_seed(seed)
            .with_prefetch(prefetch)
            .with_shuffle(shuffle)
            .with_drop_last(drop_last)
            .with_rank(rank, world_size)
            .with_uneven(uneven)
            .with_transform(transform)
            .with_bad_samples(policy)
            .with_max_bad(parse_max_bad(max_bad)?)
            .with_shard_window(shard_window)
            .with_scaled_decode(scaled_decode);
        if let Some(max_pixels) = max_pixels {
            config_ = config_.with_max_pixels(max_pixels);
        }
        config_.validate().map_err(to_py)?;
        let options = reading.unwrap_or_default().open_options();
        let (loader, pinned) = py
            .detach(|| {
                let dataset = format::open_files(&paths, &options)?;
                let config_ = match batch_mix {
                    None => config_,
                    Some(mut mix) => {
                        // num_classes left out: the dataset's class count.
                        if mix.num_classes == 0 {
                            mix.num_classes = dataset.info().classes.len();
                        }
                        if mix.num_classes == 0 {
                            return Err(imagefeed::Error::Config(
                                "MixUp/CutMix need num_classes: this dataset does not name its \
                                 classes"
                                    .into(),
                            ));
                        }
                        config_.with_batch_mix(mix)
                    }
                };
                config_.validate()?;
                match pinned_device {
                    // Batches bound for the GPU are written straight into page-locked memory,
                    // so the host-to-device copy is a DMA that overlaps with compute.
                    Some(ordinal) => {
                        let gpu = imagefeed::gpu::Gpu::open(ordinal)?;
                        let pinned = gpu.pinned_allocator();
                        let allocator: Arc<dyn imagefeed::pool::BatchAllocator> = pinned.clone();
                        let loader = Loader::with_allocator(dataset, config_, allocator)?;
                        // The page-locked buffers a loop needs (the Python loop's steady count:
                        // prefetch, one handed over, one in use, two being copied) are
                        // allocated now, not by the workers while the first batches wait.
                        loader.prewarm(loader.config().prefetch + 4)?;
                        Ok((loader, Some(pinned)))
                    }
                    None => Ok((Loader::new(dataset, config_)?, None)),
                }
            })
            .map_err(to_py)?;
        Ok(NativeLoader {
            loader,
            current: Mutex::new(Current::default()),
            waiting: AtomicUsize::new(0),
            pinned,
        })
    }

    /// Samples in the dataset.
    #[getter]
    fn num_samples(&self) -> usize {
        self.loader.dataset().len()
    }

    /// Class names, indexed by label.
    #[getter]
    fn classes(&self) -> Vec<String> {
        self.loader.dataset().classes().to_vec()
    }

    /// Notices from opening the dataset (an index built for a TFRecord shard, ...).
    #[getter]
    fn notices(&self) -> Vec<String> {
        self.loader.dataset().notices().to_vec()
    }

    /// The dataset's format name.
    #[getter]
    fn format(&self) -> &'static str {
        self.loader.dataset().info().format.name()
    }

    /// Starts epoch `epoch` from its first batch (cancelling any epoch in progress).
    /// Returns the epoch's [`generation`](Self::generation), the ticket of the loop that runs it.
    fn begin(&self, py: Python<'_>, epoch: u64) -> u64 {
        let mut current = self.current(py);
        current.epoch = None; // cancels its batches in flight before the new ones are queued
        current.reset();
        current.epoch = Some(self.loader.epoch(epoch));
        current.generation
    }

    /// Checks `state` (JSON of a `LoaderState`) against this loader and makes it the epoch in
    /// progress: the next batch is the one the state points at. Returns the epoch, the
    /// batches left in it, whether no rank has any left, and what the resume cannot know
    /// ([`Loader::resume_notice`], for a warning).
    fn resume(&self, py: Python<'_>, state: &str) -> PyResult<(u64, usize, bool, Option<String>)> {
        let state: LoaderState = serde_json::from_str(state)
            .map_err(|e| config(format!("not a loader state: {}", state_error(state, &e))))?;
        let epoch = py.detach(|| self.loader.resume(&state)).map_err(to_py)?;
        let (number, remaining) = (epoch.number(), epoch.remaining());
        let over = epoch.is_over_for_every_rank();
        let notice = self.loader.resume_notice(&state);
        let mut current = self.current(py);
        current.epoch = Some(epoch);
        current.reset();
        Ok((number, remaining, over, notice))
    }

    /// Counts the epochs begun, resumed or put aside: a loop takes it when it starts, and
    /// [`next_batch`](Self::next_batch) with it refuses once another loop has begun.
    #[getter]
    fn generation(&self, py: Python<'_>) -> u64 {
        self.current(py).generation
    }

    /// The next batch of the epoch in progress, or None at its end. Releases the GIL while
    /// waiting; a signal handler that raises (Ctrl-C) puts the epoch aside and propagates.
    ///
    /// `generation`: the [`generation`](Self::generation) the calling loop started at. Once a
    /// newer loop has begun, the call is refused instead of taking that loop's batch (a hostile
    /// try had a loop on another thread, superseded between its check and this call, take a
    /// batch of the next epoch, which its own loop then never saw).
    #[pyo3(signature = (generation=None))]
    fn next_batch(&self, py: Python<'_>, generation: Option<u64>) -> PyResult<Option<BatchParts>> {
        self.let_waiting_in(py);
        let mut current = self.current(py);
        if generation.is_some_and(|g| g != current.generation) {
            return Err(config(
                "this iterator was superseded: a newer loop over the loader started",
            ));
        }
        let generation = current.generation;
        let Some(epoch) = current.epoch.as_mut() else {
            return Err(config("no epoch in progress: iterate the loader"));
        };
        let before = epoch.state();
        let batch = loop {
            let same = current.generation == generation;
            // Stopped (or replaced by a new one) from another thread while this one waited.
            let epoch = current
                .epoch
                .as_mut()
                .filter(|_| same)
                .ok_or_else(|| to_py(imagefeed::Error::Cancelled))?;
            match py.detach(|| epoch.next_timeout(SIGNAL_POLL)) {
                Wait::Ready(None) => return Ok(None),
                Wait::Ready(Some(result)) => break result.map_err(to_py)?,
                Wait::TimedOut => {
                    // Signal handlers run without the lock: one may call back into the loader
                    // (a checkpoint handler taking state_dict()). The epoch stays as it is; the
                    // caller's `stop` puts it aside at the batches it actually handed over.
                    drop(current);
                    py.check_signals()?;
                    self.let_waiting_in(py);
                    current = self.current(py);
                }
            }
        };
        let classes = self.loader.config().batch_mix.map_or(0, |m| m.num_classes);
        let parts = batch_parts(batch, classes)?;
        current.returned += 1;
        if current.history.len() == HISTORY {
            current.history.pop_front();
        }
        current.history.push_back(before);
        Ok(Some(parts))
    }

    /// A batch of `indices` built now in the calling thread (the GIL released), with epoch
    /// `epoch`'s random draws: what `loader.dataset[i]` reads, one sample at a time. Samples have
    /// class labels: a batch step (MixUp/CutMix) leaves a batch of one as it is, and its soft
    /// label is dropped.
    fn build_batch(&self, py: Python<'_>, epoch: u64, indices: Vec<usize>) -> PyResult<BatchParts> {
        let mut batch = py
            .detach(|| self.loader.build_batch(epoch, indices))
            .map_err(to_py)?;
        batch.soft_labels = None;
        batch_parts(batch, 0)
    }

    /// The samples epoch `epoch` gives this rank, in order (padding included): of the part
    /// this loader runs of it, which is the whole epoch unless it was resumed at another world
    /// size or batch size.
    #[pyo3(signature = (epoch, continuing=true))]
    fn rank_indices(&self, py: Python<'_>, epoch: u64, continuing: bool) -> Vec<usize> {
        let start = self.part_start(py, epoch, continuing);
        py.detach(|| self.loader.sampler().rank_indices_from(epoch, start))
    }

    /// How many batches epoch `epoch` gives this rank (of the part this loader runs of it).
    #[pyo3(signature = (epoch, continuing=true))]
    fn batches_per_rank(&self, py: Python<'_>, epoch: u64, continuing: bool) -> usize {
        let start = self.part_start(py, epoch, continuing);
        self.loader.sampler().batches_per_epoch_from(start)
    }

    /// How many samples epoch `epoch` gives this rank (of the part this loader runs of it).
    #[pyo3(signature = (epoch, continuing=true))]
    fn samples_per_rank(&self, py: Python<'_>, epoch: u64, continuing: bool) -> usize {
        let start = self.part_start(py, epoch, continuing);
        self.loader.sampler().samples_per_rank_from(start)
    }

    /// JSON of where the epoch in progress stands for a trainer handed `handed` of the batches
    /// returned (None: all); if none is in progress, where the last one stopped; with neither,
    /// or with `fresh`, the start of epoch `epoch`.
    #[pyo3(signature = (epoch, *, fresh=false, handed=None))]
    fn state(
        &self,
        py: Python<'_>,
        epoch: u64,
        fresh: bool,
        handed: Option<usize>,
    ) -> PyResult<String> {
        let current = self.current(py);
        let state = match (&current.epoch, &current.stopped) {
            _ if fresh => self.loader.epoch(epoch).state(),
            (Some(e), _) => current.position(e, handed),
            (None, Some(stopped)) => stopped.clone(),
            (None, None) => self.loader.epoch(epoch).state(),
        };
        serde_json::to_string(&state).map_err(|e| config(format!("state: {e}")))
    }

    /// Puts the epoch in progress aside: its batches in flight are cancelled, and the position
    /// kept for `state` is the one for a trainer handed `handed` of the batches returned (None:
    /// all of them).
    ///
    /// `generation`: the ticket of the loop asking; a loop a newer one superseded puts nothing
    /// aside (its check and this call are not one step: the newer loop's epoch would go).
    #[pyo3(signature = (handed=None, generation=None))]
    fn stop(&self, py: Python<'_>, handed: Option<usize>, generation: Option<u64>) {
        let mut current = self.current(py);
        if generation.is_some_and(|g| g != current.generation) {
            return;
        }
        if let Some(epoch) = current.epoch.take() {
            let position = current.position(&epoch, handed);
            current.stopped = Some(position);
            current.generation += 1;
        }
    }

    /// Batch buffers the pool has allocated so far (constant in steady state).
    #[getter]
    fn pool_allocations(&self) -> u64 {
        self.loader.pool().allocations()
    }

    /// `(page-locked buffers, heap fallbacks)` handed out, for a loader bound for a GPU.
    #[getter]
    fn pinned_buffers(&self) -> Option<(u64, u64)> {
        self.pinned.as_ref().map(|p| (p.pinned(), p.fallbacks()))
    }

    /// Bytes of batch buffers the pool has allocated so far.
    #[getter]
    fn pool_bytes(&self) -> u64 {
        self.loader.pool().allocated_bytes()
    }

    /// Stage times (seconds, summed over workers) and counts so far.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.loader.stats();
        let d = PyDict::new(py);
        d.set_item("read_s", s.read.as_secs_f64())?;
        d.set_item("decode_s", s.decode.as_secs_f64())?;
        d.set_item("transform_s", s.transform.as_secs_f64())?;
        d.set_item("collate_s", s.collate.as_secs_f64())?;
        d.set_item("wait_s", s.waiting.as_secs_f64())?;
        d.set_item("samples", s.samples)?;
        d.set_item("batches", s.batches)?;
        d.set_item("bad_samples", s.bad_samples)?;
        d.set_item("stacked", s.stacked)?;
        Ok(d)
    }
}

/// What is wrong with the JSON `text` of a state, by the key whose value `error` is about:
/// serde_json says where in the text it stopped (a text the user never sees, made by
/// `json.dumps` from their dict), so the key before that place is named instead (a hostile try
/// met "invalid type: null, expected u64 at line 1 column 27").
fn state_error(text: &str, error: &serde_json::Error) -> String {
    let message = error.to_string();
    let message = match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message,
    };
    // A missing field is named by serde_json; its place is the object's end.
    if error.line() != 1 || message.starts_with("missing field") {
        return message;
    }
    let prefix: String = text.chars().take(error.column()).collect();
    let key = prefix.rfind("\": ").and_then(|end| {
        let start = prefix[..end].rfind('"')? + 1;
        Some(&prefix[start..end])
    });
    match key {
        Some(key) => format!("{key}: {message}"),
        None => message,
    }
}
