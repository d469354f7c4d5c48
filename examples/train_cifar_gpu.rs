//! Softmax regression trained on the GPU (cuBLAS through cudarc), fed by imagefeed's GPU
//! prefetcher: the loader decodes and flips on the CPU into page-locked u8 NHWC batches, the
//! prefetcher copies them on a side stream and normalizes them to f32 NCHW on the GPU, and every
//! step runs on the compute stream.
//!
//! ```sh
//! cargo run --release --example train_cifar_gpu -- DATASET [--epochs 5] [--batch-size 256]
//!     [--lr 0.01] [--depth 2] [--workers 2]
//! ```
//!
//! DATASET: CIFAR-10 as an ImageFolder tree or packed (any dataset of equal-size images). Each
//! epoch prints the mean loss (it falls), images/s, and the share of the epoch spent waiting
//! for data. Without CUDA or cuBLAS it says so and exits with status 2. cuBLAS is found as
//! [`imagefeed::gpu::blas`] says (CUDA 12 or 13, pip's wheels, or `IMAGEFEED_CUBLAS`).
//!
//! `make test-gpu-fake` runs it on the fake CUDA driver (tests/fake_cuda), which checks the
//! ordering of every copy, kernel and SGEMM.
//!
//! The learning rate: 0.05 is above what this model tolerates on normalized 3,072-feature
//! CIFAR inputs (the loss rises and oscillates); 0.01 makes it fall steadily. The same model
//! in numpy on the CIFAR-10 test set, 5 epochs, mean loss per epoch
//! (`scripts/softmax_lr_check.py`): lr 0.05: 4.02 3.65 3.47 3.57 3.22; 0.02: 2.05 1.91 1.84 1.82
//! 1.80; 0.01: 1.96 1.84 1.80 1.78 1.77; 0.005: 2.00 1.87 1.83 1.81 1.79.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imagefeed::gpu::blas::Blas;
use imagefeed::gpu::cudarc::driver::{LaunchConfig, PushKernelArg as _, result};
use imagefeed::gpu::cudarc::nvrtc::Ptx;
use imagefeed::gpu::{DeviceOutput, Gpu, Prefetcher};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::transform::Transform;

/// The training kernels, as PTX text.
const TRAINING_PTX: &str = include_str!("train_cifar_gpu.ptx");

struct Args {
    dataset: String,
    epochs: u64,
    batch_size: usize,
    lr: f32,
    depth: usize,
    workers: usize,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        dataset: String::new(),
        epochs: 5,
        batch_size: 256,
        lr: 0.01,
        depth: 2,
        workers: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--epochs" => args.epochs = value(&a)?.parse().map_err(|e| format!("--epochs: {e}"))?,
            "--batch-size" => {
                args.batch_size = value(&a)?
                    .parse()
                    .map_err(|e| format!("--batch-size: {e}"))?
            }
            "--lr" => args.lr = value(&a)?.parse().map_err(|e| format!("--lr: {e}"))?,
            "--depth" => args.depth = value(&a)?.parse().map_err(|e| format!("--depth: {e}"))?,
            "--workers" => {
                args.workers = value(&a)?.parse().map_err(|e| format!("--workers: {e}"))?
            }
            _ if a.starts_with("--") => return Err(format!("unknown option {a}")),
            _ => args.dataset = a,
        }
    }
    if args.batch_size == 0 || args.batch_size > 4096 {
        return Err("--batch-size: 1 to 4096".into());
    }
    if args.dataset.is_empty() {
        return Err("usage: train_cifar_gpu DATASET [--epochs N] [--batch-size N] [--lr X] [--depth N] [--workers N]".into());
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    // The loader's settings are checked before anything needs a GPU, so that a mistake in
    // them shows on any machine.
    if let Err(e) = loader_config(&args).validate() {
        eprintln!("train_cifar_gpu: {e}");
        return ExitCode::from(2);
    }
    if let Some(reason) = imagefeed::gpu::unavailable_reason() {
        eprintln!("train_cifar_gpu: cannot run here: {reason}");
        return ExitCode::from(2);
    }
    match train(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_cifar_gpu: {e}");
            match e.downcast_ref::<imagefeed::Error>() {
                // CUDA or cuBLAS missing: "cannot run here", as above.
                Some(imagefeed::Error::Cuda { source: None, .. }) => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// What the model trains on: CIFAR's random flip and normalization, f32 NCHW.
fn training_transform() -> Transform {
    Transform::cifar()
}

/// The loader writes the flipped pixels as they are (u8 NHWC, page-locked); the GPU converts
/// and normalizes them (`DeviceOutput::of(&training_transform())`).
fn loader_config(args: &Args) -> LoaderConfig {
    LoaderConfig::default()
        .with_batch_size(args.batch_size)
        .with_workers(args.workers)
        .with_prefetch(2 * args.workers)
        .with_drop_last(true)
        .with_transform(training_transform().raw_u8_nhwc())
}

fn train(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::open(0)?;
    let ds = imagefeed::format::open(&args.dataset)?;
    let classes = ds.info().classes.len();
    let allocator = gpu.pinned_allocator();
    let loader = Loader::with_allocator(ds, loader_config(args), allocator.clone())?;
    let output = DeviceOutput::of(&training_transform());
    let compute = gpu.new_stream()?;
    let cublas = Blas::new(&compute)?;
    // The example's own kernels (examples/train_cifar_gpu.cu, compiled to PTX by
    // scripts/make_ptx.py), loaded into the same context as the library's.
    let kernels = gpu
        .context()
        .load_module(Ptx::from_src(TRAINING_PTX))
        .map_err(|e| format!("loading the training kernels: {e}"))?;
    let add_bias = kernels.load_function("add_bias")?;
    let softmax_xent = kernels.load_function("softmax_xent")?;
    let column_sums = kernels.load_function("column_sums")?;
    let sgd_step = kernels.load_function("sgd_step")?;
    println!(
        "{}: {} classes, {} batches of {} per epoch, depth {}, on {} (cuBLAS: {})",
        args.dataset,
        classes,
        loader.batches_per_epoch(),
        args.batch_size,
        args.depth,
        gpu.name(),
        cublas.library()
    );
    // The step reads the loss back every step, as a trainer logging it would: an event that
    // lets this thread sleep while it waits (the stream's own synchronize would spin a core).
    let step_done = gpu.timing_event()?;

    // Parameters and scratch, sized on the first batch (features = 3·h·w).
    let mut state: Option<Model> = None;
    // One prefetcher for the run: its stream, events and device buffers are made once, and
    // the page-locked batch buffers are allocated before the first epoch.
    let mut feed = Prefetcher::for_loader(&gpu, Arc::clone(&compute), &loader, output, args.depth)?;
    for epoch in 0..args.epochs {
        feed.start(loader.epoch(epoch))?;
        let start = Instant::now();
        let mut waited = Duration::ZERO;
        let (mut images, mut loss_sum, mut steps) = (0usize, 0f64, 0usize);
        loop {
            let asked = Instant::now();
            let Some(batch) = feed.next_batch()? else {
                break;
            };
            waited += asked.elapsed();
            let n = batch.len();
            let features = batch.shape[1] * batch.shape[2] * batch.shape[3];
            // The loss kernel indexes the logits by label: a label past the classes would read
            // and write out of bounds on the GPU. (Readers check labels; this says so here.)
            if let Some(&label) = batch.labels.iter().find(|&&l| l as usize >= classes) {
                return Err(format!(
                    "batch {} holds label {label}, but the dataset has {classes} classes",
                    batch.index
                )
                .into());
            }
            let m = match &mut state {
                Some(m) => m,
                None => state.insert(Model::new(&compute, features, classes)?),
            };
            let x = batch.device_ptr();
            let labels = batch.labels_device_ptr();
            let (c, d, ni) = (classes as i32, features as i32, n as i32);
            // SAFETY: every pointer is a live device allocation of the size the call reads or
            // writes (x: n×d, W: d×c, logits/grad: n×c, dW: d×c, b/db: c, loss: 1), all
            // ordered on the compute stream, which already waits for this batch's copy.
            unsafe {
                // logits[n,c] = x[n,d] · W[d,c]  (row-major, as column-major transposes)
                gemm(&cublas, false, c, ni, d, m.w, x, d, m.logits)?;
                let mut l = compute.launch_builder(&add_bias);
                l.arg(&m.logits).arg(&m.b).arg(&ni).arg(&c);
                l.launch(LaunchConfig::for_num_elems((n * classes) as u32))
                    .map_err(doing("launching add_bias"))?;
                result::memset_d8_async(m.loss, 0, 4, compute.cu_stream())
                    .map_err(doing("clearing the loss"))?;
                let mut l = compute.launch_builder(&softmax_xent);
                l.arg(&m.logits)
                    .arg(&labels)
                    .arg(&ni)
                    .arg(&c)
                    .arg(&m.grad)
                    .arg(&m.loss);
                l.launch(LaunchConfig {
                    grid_dim: (n as u32, 1, 1),
                    block_dim: (1, 1, 1),
                    shared_mem_bytes: 0,
                })
                .map_err(doing("launching softmax_xent"))?;
                // dW[d,c] = x[n,d]ᵀ · grad[n,c]
                gemm(&cublas, true, c, d, ni, m.grad, x, d, m.dw)?;
                let mut l = compute.launch_builder(&column_sums);
                l.arg(&m.grad).arg(&ni).arg(&c).arg(&m.db);
                l.launch(LaunchConfig::for_num_elems(classes as u32))
                    .map_err(doing("launching column_sums"))?;
                let (wl, bl) = ((features * classes) as i64, classes as i64);
                let mut l = compute.launch_builder(&sgd_step);
                l.arg(&m.w).arg(&m.dw).arg(&wl).arg(&args.lr);
                l.launch(LaunchConfig::for_num_elems((features * classes) as u32))
                    .map_err(doing("launching sgd_step (weights)"))?;
                let mut l = compute.launch_builder(&sgd_step);
                l.arg(&m.b).arg(&m.db).arg(&bl).arg(&args.lr);
                l.launch(LaunchConfig::for_num_elems(classes as u32))
                    .map_err(doing("launching sgd_step (bias)"))?;
            }
            // The loss, as a trainer logging it every step would read it (synchronizes).
            let mut loss = [0f32];
            step_done
                .record(&compute)
                .map_err(doing("recording the step's end"))?;
            step_done
                .synchronize()
                .map_err(doing("waiting for the step"))?;
            // SAFETY: `m.loss` holds one f32 and the stream is idle.
            unsafe { result::memcpy_dtoh_sync(&mut loss, m.loss) }
                .map_err(doing("reading the loss back"))?;
            loss_sum += f64::from(loss[0]);
            images += n;
            steps += 1;
        }
        // An error a drop stored on the context (cudarc keeps it until a call takes it) ends
        // the run here rather than going unnoticed.
        gpu.context().check_err().map_err(doing(
            "an earlier CUDA call that could not report its error",
        ))?;
        let wall = start.elapsed().as_secs_f64();
        println!(
            "epoch {epoch}: mean loss {:.4} over {steps} steps, {:.0} images/s, waiting for data {:.1}% of the epoch",
            loss_sum / steps.max(1) as f64,
            images as f64 / wall,
            100.0 * waited.as_secs_f64() / wall
        );
    }
    println!(
        "page-locked batch buffers: {} (heap fallbacks: {})",
        allocator.pinned(),
        allocator.fallbacks()
    );
    Ok(())
}

/// Names what was being done when a CUDA call failed.
fn doing(what: &'static str) -> impl FnOnce(result::DriverError) -> String {
    move |e| format!("{what}: {e}")
}

/// `out = a · op(b)` in cuBLAS's column-major terms, with `a` `m×k` (leading dimension `m`),
/// `b` `k×n` or, with `transpose_b`, `n×k` (leading dimension `ldb`), and `out` `m×n`.
///
/// # Safety
/// The addresses must be live device allocations of those sizes, ordered on cuBLAS's stream.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
    cublas: &Blas,
    transpose_b: bool,
    m: i32,
    n: i32,
    k: i32,
    a: u64,
    b: u64,
    ldb: i32,
    out: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: the caller's contract above.
    unsafe {
        cublas.sgemm(
            false,
            transpose_b,
            (m, n, k),
            1.0,
            (a, m),
            (b, ldb),
            0.0,
            (out, m),
        )
    }?;
    Ok(())
}

/// Device buffers of the model, as raw addresses (owned by `_slices`).
struct Model {
    w: u64,
    b: u64,
    dw: u64,
    db: u64,
    logits: u64,
    grad: u64,
    loss: u64,
    _slices: Vec<imagefeed::gpu::cudarc::driver::CudaSlice<f32>>,
}

impl Model {
    fn new(
        stream: &Arc<imagefeed::gpu::cudarc::driver::CudaStream>,
        features: usize,
        classes: usize,
    ) -> Result<Model, Box<dyn std::error::Error>> {
        use imagefeed::gpu::cudarc::driver::DevicePtr as _;
        // Logits and gradients are sized for batches of up to 4096.
        let sizes = [
            features * classes,
            classes,
            features * classes,
            classes,
            4096 * classes,
            4096 * classes,
            1,
        ];
        let mut slices = Vec::new();
        let mut ptrs = Vec::new();
        for len in sizes {
            let s = stream.alloc_zeros::<f32>(len)?;
            ptrs.push(s.device_ptr(stream).0);
            slices.push(s);
        }
        Ok(Model {
            w: ptrs[0],
            b: ptrs[1],
            dw: ptrs[2],
            db: ptrs[3],
            logits: ptrs[4],
            grad: ptrs[5],
            loss: ptrs[6],
            _slices: slices,
        })
    }
}
