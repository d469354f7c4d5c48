//! The GPU feed against the CPU loader: the batches the GPU converts (f32/f16, NCHW/NHWC,
//! prefetch depth 1–3, page-locked buffers) are bit-identical to what the CPU transform writes
//! for the same seed, including for a trainer that never waits for its batches.
//!
//! Needs a CUDA driver: a real one, or imagefeed's fake (tests/fake_cuda, `make test-gpu-fake`),
//! which also checks the ordering of every copy, kernel and free, and on which the tests that
//! inject faults and misuse the driver on purpose run. Without a driver every test says why and
//! returns. The tests in this file take turns (they count what the driver holds).
#![cfg(feature = "cuda")]

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use imagefeed::dataset::Dataset;
use imagefeed::gpu::cudarc::driver::{
    CudaSlice, DevicePtr as _, LaunchConfig, PushKernelArg as _, result,
};
use imagefeed::gpu::cudarc::nvrtc::Ptx;
use imagefeed::gpu::{DeviceOutput, Gpu, PinnedBuffer, Prefetcher};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::pool::{BatchAllocator as _, BatchMemory as _};
use imagefeed::synthetic::{self, SyntheticSpec};
use imagefeed::transform::{CIFAR10_NORMALIZE, DType, Layout, Transform};
use imagefeed::{Error, format};

/// The training example's kernels: `column_sums` serves as a trainer's step that reads a batch.
const EXAMPLE_PTX: &str = include_str!("../examples/train_cifar_gpu.ptx");

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The fake CUDA driver's own entry points, when the driver loaded is the fake.
mod fake {
    use std::ffi::{CStr, CString, c_void};

    /// What the fake holds and has done (its `imagefeed_fake_cuda_counts`).
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    pub struct Counts {
        pub device_allocations_live: u64,
        pub page_locked_allocations_live: u64,
        pub streams_live: u64,
        pub events_live: u64,
        pub contexts_retained: u64,
        pub kernels_launched: u64,
        pub copies: u64,
        pub checked_accesses: u64,
        pub spinning_waits: u64,
        pub pageable_async_copies: u64,
        pub blas_calls: u64,
        pub stream_synchronizes: u64,
    }

    fn symbol(name: &CStr) -> Option<*mut c_void> {
        for library in [c"libcuda.so.1", c"libcuda.so"] {
            // SAFETY: RTLD_NOLOAD only finds a library already loaded (by cudarc).
            let handle =
                unsafe { libc::dlopen(library.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
            if handle.is_null() {
                continue;
            }
            // SAFETY: a valid handle and a NUL-terminated name.
            let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
            if !address.is_null() {
                return Some(address);
            }
        }
        None
    }

    /// True when the CUDA driver loaded is imagefeed's fake (the driver must be loaded).
    pub fn present() -> bool {
        symbol(c"imagefeed_fake_cuda_version").is_some()
    }

    pub fn counts() -> Counts {
        let address = symbol(c"imagefeed_fake_cuda_counts").expect("the fake driver");
        // SAFETY: the fake's `int imagefeed_fake_cuda_counts(struct *, size_t)`.
        let f: extern "C" fn(*mut Counts, usize) -> i32 = unsafe { std::mem::transmute(address) };
        let mut counts = Counts::default();
        f(&mut counts, std::mem::size_of::<Counts>());
        counts
    }

    /// Makes the calls `spec` names fail ("NAME[@N][=CODE|=sticky],..."; "" for none).
    pub fn inject(spec: &str) {
        let address = symbol(c"imagefeed_fake_cuda_inject").expect("the fake driver");
        // SAFETY: the fake's `int imagefeed_fake_cuda_inject(const char *)`.
        let f: extern "C" fn(*const std::ffi::c_char) -> i32 =
            unsafe { std::mem::transmute(address) };
        let spec = CString::new(spec).unwrap();
        assert_eq!(f(spec.as_ptr()), 0, "a valid fault spec");
    }

    /// Clears the injected faults when dropped (also when the test fails).
    pub struct Faults;

    impl Faults {
        pub fn inject(spec: &str) -> Faults {
            inject(spec);
            Faults
        }
    }

    impl Drop for Faults {
        fn drop(&mut self) {
            inject("");
        }
    }
}

fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match imagefeed::gpu::unavailable_reason() {
        None => {
            let gpu = Gpu::open(0).expect("a device is reported, so it opens");
            if fake::present() {
                eprintln!("{test}: on the fake CUDA driver");
            }
            Some(gpu)
        }
        Some(reason) => {
            eprintln!("{test}: skipped, no GPU here: {reason}");
            None
        }
    }
}

/// A GPU that is imagefeed's fake driver, for the tests that only make sense there.
fn fake_gpu_or_skip(test: &str) -> Option<Gpu> {
    let gpu = gpu_or_skip(test)?;
    if !fake::present() {
        eprintln!("{test}: skipped, needs the fake CUDA driver (this is a real GPU)");
        return None;
    }
    Some(gpu)
}

fn dataset(dir: &Path) -> Arc<dyn Dataset> {
    let src = dir.join("src");
    let spec = SyntheticSpec {
        classes: 3,
        per_class: 11,
        width: 20,
        height: 12,
        ..SyntheticSpec::default()
    };
    synthetic::write_image_folder(&src, &spec).unwrap();
    format::open(&src).unwrap()
}

fn config(transform: Transform) -> LoaderConfig {
    LoaderConfig::default()
        .with_batch_size(8)
        .with_workers(2)
        .with_seed(7)
        .with_transform(transform)
}

/// Equal up to the rounding of `pixel * (1 / 255)` (what the GPU computes) against
/// `pixel / 255` (what a test writes down).
fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-6
}

/// A device batch copied back, as floats.
fn floats(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

#[test]
fn gpu_batches_equal_the_cpu_transform_for_every_output_and_depth() {
    let _serial = serial();
    let Some(gpu) = gpu_or_skip("gpu_batches_equal_the_cpu_transform") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let flip = Transform {
        hflip: 0.5,
        ..Transform::cifar()
    };
    for layout in [Layout::Nchw, Layout::Nhwc] {
        for dtype in [DType::F32, DType::F16] {
            // The CPU reference: flip + normalize written by the slot writer.
            let cpu =
                Loader::new(Arc::clone(&ds), config(flip.with_output(dtype, layout))).unwrap();
            let expected: Vec<(Vec<u32>, Vec<f32>)> = cpu
                .epoch(0)
                .map(|b| {
                    let b = b.unwrap();
                    let values = match dtype {
                        DType::F16 => b
                            .as_f16_bits()
                            .iter()
                            .map(|&h| half::f16::from_bits(h).to_f32())
                            .collect(),
                        _ => b.as_f32().to_vec(),
                    };
                    (b.labels.clone(), values)
                })
                .collect();
            // The same flips (same seed) as u8 NHWC, converted on the GPU: one prefetcher for
            // two epochs (it lives across epochs), the second equal to the first's stream
            // for epoch 0 again.
            let float_transform = flip.with_output(dtype, layout);
            let u8_transform = float_transform.raw_u8_nhwc();
            for depth in 1..=3 {
                let allocator = gpu.pinned_allocator();
                let loader = Loader::with_allocator(
                    Arc::clone(&ds),
                    config(u8_transform),
                    allocator.clone(),
                )
                .unwrap();
                let output = DeviceOutput::of(&float_transform);
                assert_eq!(output.normalize, Some(CIFAR10_NORMALIZE));
                let stream = gpu.new_stream().unwrap();
                let mut feed =
                    Prefetcher::for_loader(&gpu, stream, &loader, output, depth).unwrap();
                let prewarmed = allocator.pinned();
                assert_eq!(
                    prewarmed as usize,
                    loader.config().prefetch + depth + 1,
                    "the page-locked buffers are allocated before the first epoch"
                );
                for round in 0..2 {
                    feed.start(loader.epoch(0)).unwrap();
                    let mut got = 0;
                    while let Some(batch) = feed.next_batch().unwrap() {
                        let (labels, values) = &expected[got];
                        assert_eq!(batch.labels, &labels[..], "batch {got} labels");
                        let device = floats(&batch.to_host().unwrap(), dtype);
                        assert_eq!(device.len(), values.len());
                        // Bit-identical: the kernel rounds the multiply and the add apart,
                        // as the CPU does, and both round to f16 to nearest-even.
                        for (i, (a, b)) in device.iter().zip(values).enumerate() {
                            assert!(
                                a.to_bits() == b.to_bits(),
                                "{layout:?} {dtype:?} depth {depth} round {round} batch {got} element {i}: {a} vs {b}"
                            );
                        }
                        got += 1;
                    }
                    assert_eq!(got, expected.len(), "every batch delivered");
                }
                assert!(
                    feed.stats().copy_time > std::time::Duration::ZERO,
                    "copies are timed with events"
                );
                assert!(
                    feed.stats().convert_time > std::time::Duration::ZERO,
                    "conversions are timed with events"
                );
                assert_eq!(
                    allocator.pinned(),
                    prewarmed,
                    "no page-locked allocation during the epochs"
                );
                assert_eq!(allocator.fallbacks(), 0);
            }
        }
    }
}

#[test]
fn a_new_epoch_started_mid_way_discards_the_rest_and_delivers_its_own_batches() {
    let _serial = serial();
    let Some(gpu) = gpu_or_skip("a_new_epoch_started_mid_way") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let u8_transform = Transform::cifar().raw_u8_nhwc();
    let loader = Loader::with_allocator(
        Arc::clone(&ds),
        config(u8_transform),
        gpu.pinned_allocator(),
    )
    .unwrap();
    let expected: Vec<Vec<u8>> = loader
        .epoch(1)
        .map(|b| b.unwrap().bytes().to_vec())
        .collect();
    let output = DeviceOutput {
        dtype: DType::F32,
        layout: Layout::Nhwc,
        normalize: None,
    };
    let mut feed =
        Prefetcher::for_loader(&gpu, gpu.new_stream().unwrap(), &loader, output, 3).unwrap();
    feed.start(loader.epoch(0)).unwrap();
    let first = feed.next_batch().unwrap().expect("a batch");
    assert_eq!((first.epoch, first.index), (0, 0));
    feed.start(loader.epoch(1)).unwrap();
    let mut index = 0;
    while let Some(batch) = feed.next_batch().unwrap() {
        assert_eq!((batch.epoch, batch.index), (1, index));
        let values = floats(&batch.to_host().unwrap(), DType::F32);
        let pixels: Vec<f32> = expected[index].iter().map(|&p| p as f32 / 255.0).collect();
        assert_eq!(values.len(), pixels.len());
        for (a, b) in values.iter().zip(&pixels) {
            assert!(close(*a, *b), "{a} vs {b}");
        }
        index += 1;
    }
    assert_eq!(index, expected.len());
}

#[test]
fn copies_are_timed_with_events_that_allow_timing() {
    let _serial = serial();
    let Some(gpu) = gpu_or_skip("copies_are_timed_with_events_that_allow_timing") else {
        return;
    };
    let stream = gpu.new_stream().unwrap();
    let (start, end) = (gpu.timing_event().unwrap(), gpu.timing_event().unwrap());
    let device = stream.alloc_zeros::<u8>(1 << 20).unwrap();
    start.record(&stream).unwrap();
    let host = vec![1u8; 1 << 20];
    let mut device = device;
    stream.memcpy_htod(&host, &mut device).unwrap();
    end.record(&stream).unwrap();
    let ms = start.elapsed_ms(&end).expect("timing events can be timed");
    assert!(ms >= 0.0, "{ms}");
}

#[test]
fn the_prefetcher_refuses_batches_it_cannot_convert() {
    let _serial = serial();
    let Some(gpu) = gpu_or_skip("the_prefetcher_refuses_batches_it_cannot_convert") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let loader = Loader::new(ds, config(Transform::cifar())).unwrap(); // f32 NCHW on the CPU
    let output = DeviceOutput {
        dtype: DType::F32,
        layout: Layout::Nchw,
        normalize: None,
    };
    let stream = gpu.new_stream().unwrap();
    // A loader whose batches the GPU cannot take is refused when the prefetcher is built.
    match Prefetcher::for_loader(&gpu, stream.clone(), &loader, output, 2) {
        Err(Error::Config(msg)) => assert!(msg.contains("u8 NHWC"), "{msg}"),
        Err(other) => panic!("expected a configuration error, got {other}"),
        Ok(_) => panic!("expected a configuration error, got a prefetcher"),
    }
    // Any other source of such batches is refused at its first batch.
    let mut feed = Prefetcher::new(&gpu, stream.clone(), output, 2).unwrap();
    feed.start(loader.epoch(0)).unwrap();
    match feed.next_batch() {
        Err(Error::Config(msg)) => assert!(msg.contains("u8 NHWC"), "{msg}"),
        other => panic!(
            "expected a configuration error, got {:?}",
            other.map(|b| b.is_some())
        ),
    }
    let u8_output = DeviceOutput {
        dtype: DType::U8,
        ..output
    };
    assert!(matches!(
        Prefetcher::<std::iter::Empty<_>>::new(&gpu, stream.clone(), u8_output, 2),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        Prefetcher::<std::iter::Empty<_>>::new(&gpu, stream, output, 0),
        Err(Error::Config(_))
    ));
}

/// The CPU reference for a float transform: labels and values of each batch.
fn cpu_batches(
    ds: &Arc<dyn Dataset>,
    transform: Transform,
    epoch: u64,
) -> Vec<(Vec<u32>, Vec<f32>)> {
    let cpu = Loader::new(Arc::clone(ds), config(transform)).unwrap();
    cpu.epoch(epoch)
        .map(|b| {
            let b = b.unwrap();
            (b.labels.clone(), b.as_f32().to_vec())
        })
        .collect()
}

/// A trainer that never waits: each batch's per-feature sums over its samples (the training
/// example's `column_sums` kernel, reading the batch on the compute stream) go into a buffer of
/// their own, and the host synchronizes once, after the epoch. The feed alone keeps a slot from
/// being overwritten while a step still reads it (the copy stream waits for the step's release
/// event), and keeps a step from reading a batch before its copy and conversion are done (the
/// compute stream waits for the ready event). On the fake driver, leaving out either wait is
/// an unordered access, found whatever the timing; on a GPU, wrong sums.
#[test]
fn batches_stay_right_when_the_trainer_never_waits_for_them() {
    let _serial = serial();
    let Some(gpu) = gpu_or_skip("batches_stay_right_when_the_trainer_never_waits_for_them") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let float_transform = Transform {
        hflip: 0.5,
        ..Transform::cifar()
    }
    .with_output(DType::F32, Layout::Nchw);
    let expected = cpu_batches(&ds, float_transform, 2);
    let compute = gpu.new_stream().unwrap();
    let kernels = gpu
        .context()
        .load_module(Ptx::from_src(EXAMPLE_PTX))
        .unwrap();
    let column_sums = kernels.load_function("column_sums").unwrap();
    for depth in [1, 2, 3] {
        let loader = Loader::with_allocator(
            Arc::clone(&ds),
            config(float_transform.raw_u8_nhwc()),
            gpu.pinned_allocator(),
        )
        .unwrap();
        let mut feed = Prefetcher::for_loader(
            &gpu,
            Arc::clone(&compute),
            &loader,
            DeviceOutput::of(&float_transform),
            depth,
        )
        .unwrap();
        let features = 3 * 12 * 20;
        let sums: Vec<CudaSlice<f32>> = (0..expected.len())
            .map(|_| compute.alloc_zeros::<f32>(features).unwrap())
            .collect();
        feed.start(loader.epoch(2)).unwrap();
        let mut delivered = 0;
        while let Some(batch) = feed.next_batch().unwrap() {
            assert_eq!(batch.labels, &expected[delivered].0[..]);
            let (n, f) = (batch.len() as i32, features as i32);
            let x = batch.device_ptr();
            let out = sums[delivered].device_ptr(&compute).0;
            let mut launch = compute.launch_builder(&column_sums);
            launch.arg(&x).arg(&n).arg(&f).arg(&out);
            // SAFETY: `x` is the batch, n × features f32 on the device; `out` holds features
            // floats; both are used on the compute stream, which waits for the batch's copy.
            unsafe { launch.launch(LaunchConfig::for_num_elems(features as u32)) }.unwrap();
            delivered += 1;
        }
        assert_eq!(
            delivered,
            expected.len(),
            "depth {depth}: every batch delivered"
        );
        compute.synchronize().unwrap();
        for (i, ((_, values), sums)) in expected.iter().zip(&sums).enumerate() {
            let mut got = vec![0f32; features];
            // SAFETY: `sums` holds `features` floats and the compute stream is idle.
            unsafe { result::memcpy_dtoh_sync(&mut got, sums.device_ptr(&compute).0) }.unwrap();
            let n = values.len() / features;
            for k in 0..features {
                // The kernel's order: rows one after another, in f32.
                let want = (0..n).fold(0f32, |acc, row| acc + values[row * features + k]);
                assert!(
                    got[k].to_bits() == want.to_bits(),
                    "depth {depth} batch {i} feature {k}: {} vs {want}",
                    got[k]
                );
            }
        }
    }
}

/// Everything the feed, the loader and the GPU took (device and page-locked memory, streams,
/// events, the context) is given back when they are dropped; waits sleep rather than spin.
#[test]
fn nothing_is_left_behind_and_no_wait_spins() {
    let _serial = serial();
    let Some(gpu) = fake_gpu_or_skip("nothing_is_left_behind_and_no_wait_spins") else {
        return;
    };
    drop(gpu);
    let before = fake::counts();
    {
        let gpu = Gpu::open(0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ds = dataset(dir.path());
        let transform = Transform::cifar();
        let allocator = gpu.pinned_allocator();
        let loader = Loader::with_allocator(
            Arc::clone(&ds),
            config(transform.raw_u8_nhwc()),
            allocator.clone(),
        )
        .unwrap();
        let mut feed = Prefetcher::for_loader(
            &gpu,
            gpu.new_stream().unwrap(),
            &loader,
            DeviceOutput::of(&transform),
            2,
        )
        .unwrap();
        for epoch in 0..2 {
            feed.start(loader.epoch(epoch)).unwrap();
            while feed.next_batch().unwrap().is_some() {}
        }
        let during = fake::counts();
        assert!(during.page_locked_allocations_live > before.page_locked_allocations_live);
        assert!(during.kernels_launched > before.kernels_launched);
        assert_eq!(allocator.fallbacks(), 0);
        assert_eq!(
            during.stream_synchronizes, before.stream_synchronizes,
            "the epochs wait on events only, never on a whole stream"
        );
    }
    let after = fake::counts();
    let live = |c: &fake::Counts| {
        (
            c.device_allocations_live,
            c.page_locked_allocations_live,
            c.streams_live,
            c.events_live,
            c.contexts_retained,
        )
    };
    // (Compared with before: a test before this one may have leaked on purpose, as the feed
    // does in a failed context.)
    assert_eq!(live(&after), live(&before), "all given back: {after:?}");
    assert_eq!(
        after.spinning_waits, before.spinning_waits,
        "the feed's host waits are on blocking-sync events"
    );
    assert_eq!(
        after.pageable_async_copies, before.pageable_async_copies,
        "pixels and labels are copied from page-locked memory"
    );
}

/// Page-locked memory running out (every cuMemHostAlloc failing) costs speed, not batches: the
/// pool and the labels' staging buffers fall back to ordinary memory, and the reason is kept.
#[test]
fn page_locked_memory_running_out_falls_back_to_ordinary_memory() {
    let _serial = serial();
    let Some(gpu) = fake_gpu_or_skip("page_locked_memory_running_out_falls_back") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let transform = Transform::cifar();
    let expected = cpu_batches(&ds, transform, 0);
    let _faults = fake::Faults::inject("cuMemHostAlloc@0");
    let allocator = gpu.pinned_allocator();
    let loader = Loader::with_allocator(
        Arc::clone(&ds),
        config(transform.raw_u8_nhwc()),
        allocator.clone(),
    )
    .unwrap();
    let mut feed = Prefetcher::for_loader(
        &gpu,
        gpu.new_stream().unwrap(),
        &loader,
        DeviceOutput::of(&transform),
        2,
    )
    .unwrap();
    feed.start(loader.epoch(0)).unwrap();
    let mut got = 0;
    while let Some(batch) = feed.next_batch().unwrap() {
        let values = floats(&batch.to_host().unwrap(), DType::F32);
        assert!(
            values
                .iter()
                .zip(&expected[got].1)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        got += 1;
    }
    assert_eq!(got, expected.len());
    assert_eq!(allocator.pinned(), 0);
    assert!(allocator.fallbacks() > 0);
    let reason = allocator
        .fallback_reason()
        .expect("the first failure is kept");
    assert!(reason.contains("OUT_OF_MEMORY"), "{reason}");
}

/// Each call of the feed that fails gives an `Error::Cuda` saying what was being done; the feed
/// stops (nothing more is delivered), nothing hangs, and dropping it gives everything back.
#[test]
fn a_failed_cuda_call_is_a_named_error_and_the_feed_stops_cleanly() {
    let _serial = serial();
    let Some(gpu) = fake_gpu_or_skip("a_failed_cuda_call_is_a_named_error") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let transform = Transform::cifar();
    for (spec, doing) in [
        ("cuLaunchKernel@2", "launching the conversion"),
        ("cuMemcpyHtoDAsync_v2@3", "copying a batch to the device"),
        ("cuMemAllocAsync@2", "allocating device memory"),
        ("cuEventRecord@4", "recording a copy event"),
        ("cuStreamWaitEvent@2", "waiting for a "),
    ] {
        let before = fake::counts();
        {
            let loader = Loader::with_allocator(
                Arc::clone(&ds),
                config(transform.raw_u8_nhwc()),
                gpu.pinned_allocator(),
            )
            .unwrap();
            let mut feed = Prefetcher::for_loader(
                &gpu,
                gpu.new_stream().unwrap(),
                &loader,
                DeviceOutput::of(&transform),
                2,
            )
            .unwrap();
            let _faults = fake::Faults::inject(spec);
            feed.start(loader.epoch(0)).unwrap();
            let err = loop {
                match feed.next_batch() {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("{spec}: the epoch ended without the injected failure"),
                    Err(e) => break e,
                }
            };
            match &err {
                Error::Cuda { doing: d, source } => {
                    assert!(d.contains(doing), "{spec}: {err}");
                    assert!(source.is_some(), "{spec}: the driver's error is kept");
                }
                other => panic!("{spec}: not Error::Cuda: {other}"),
            }
            assert!(
                feed.next_batch().is_err(),
                "{spec}: nothing is delivered after a failure"
            );
        }
        let after = fake::counts();
        assert_eq!(
            (
                after.page_locked_allocations_live,
                after.device_allocations_live,
                after.streams_live
            ),
            (
                before.page_locked_allocations_live,
                before.device_allocations_live,
                before.streams_live
            ),
            "{spec}: all given back"
        );
    }
}

/// A kernel that fails on the device leaves the context failing every later call (a sticky
/// error): the feed reports it and stops, and nothing waits forever.
#[test]
fn a_kernel_failing_on_the_device_is_reported_not_hung() {
    let _serial = serial();
    let Some(gpu) = fake_gpu_or_skip("a_kernel_failing_on_the_device") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let transform = Transform::cifar();
    let loader = Loader::with_allocator(
        Arc::clone(&ds),
        config(transform.raw_u8_nhwc()),
        gpu.pinned_allocator(),
    )
    .unwrap();
    let mut feed = Prefetcher::for_loader(
        &gpu,
        gpu.new_stream().unwrap(),
        &loader,
        DeviceOutput::of(&transform),
        2,
    )
    .unwrap();
    let _faults = fake::Faults::inject("cuLaunchKernel@1=sticky");
    feed.start(loader.epoch(0)).unwrap();
    let err = loop {
        match feed.next_batch().and_then(|b| match b {
            Some(batch) => batch.to_host().map(Some),
            None => Ok(None),
        }) {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the epoch ended without the kernel's failure"),
            Err(e) => break e,
        }
    };
    let Error::Cuda { source, .. } = &err else {
        panic!("not Error::Cuda: {err}")
    };
    let source = format!("{:?}", source.as_ref().expect("the driver's error"));
    assert!(source.contains("LAUNCH_FAILED"), "{err}: {source}");
    // Dropping the feed in a failed context returns promptly (its waits fail rather than hang).
    drop(feed);
}

/// An error cudarc stored from a drop (here, an event that failed to be destroyed) reaches the
/// feed as itself: a loader worker allocating page-locked memory does not take it and fall back
/// to ordinary memory in silence, and it is not blamed on whichever call came next.
#[test]
fn an_error_stored_by_a_drop_is_reported_by_the_feed_not_swallowed() {
    let _serial = serial();
    let Some(gpu) = fake_gpu_or_skip("an_error_stored_by_a_drop") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let transform = Transform::cifar();
    let allocator = gpu.pinned_allocator();
    let loader = Loader::with_allocator(
        Arc::clone(&ds),
        config(transform.raw_u8_nhwc()),
        allocator.clone(),
    )
    .unwrap();
    let mut feed = Prefetcher::for_loader(
        &gpu,
        gpu.new_stream().unwrap(),
        &loader,
        DeviceOutput::of(&transform),
        2,
    )
    .unwrap();
    {
        let _faults = fake::Faults::inject("cuEventDestroy_v2@1");
        drop(gpu.event().unwrap());
    }
    // A worker's allocation, with the error stored on the context.
    let buffer = allocator.allocate(4096);
    assert_eq!(buffer.as_slice().len(), 4096);
    assert_eq!(
        allocator.fallbacks(),
        0,
        "the stored error did not make it fall back"
    );
    match feed.start(loader.epoch(0)) {
        Err(Error::Cuda { doing, source }) => {
            assert!(doing.contains("could not report its error"), "{doing}");
            assert!(
                format!("{source:?}").contains("INVALID_VALUE"),
                "{source:?}"
            );
        }
        other => panic!("expected the stored error, got {:?}", other.map(|_| ())),
    }
    // It stopped the feed, as any failed call does.
    assert!(feed.start(loader.epoch(0)).is_err());
    assert!(feed.next_batch().is_err());
}

/// The toolkit's stub libcuda.so found before the driver is named as such, not reported as a
/// driver that failed to start (run in a child: the fake reads the setting at cuInit).
#[test]
fn the_toolkits_stub_library_is_named() {
    let _serial = serial();
    if fake_gpu_or_skip("the_toolkits_stub_library_is_named").is_none() {
        return;
    }
    let out = child("stub-library", &[("IMAGEFEED_FAKE_CUDA_STUB", "1")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("toolkit's stub") && text.contains("stubs"),
        "{text}"
    );
}

/// Runs `checker_child` in a child process for `case`, with `env` set.
fn child(case: &str, env: &[(&str, &str)]) -> std::process::Output {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--ignored",
            "--exact",
            "checker_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("IMAGEFEED_GPU_TEST_CASE", case)
        // Faults injected for the whole test binary are not the child's to meet.
        .env_remove("IMAGEFEED_FAKE_CUDA_FAIL");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

/// The fake driver's checks fail on purpose, each in a child process: what a GPU would punish
/// only sometimes aborts at once, saying which rule, which calls and which memory.
#[test]
fn the_fake_driver_aborts_on_each_ordering_mistake() {
    let _serial = serial();
    if fake_gpu_or_skip("the_fake_driver_aborts_on_each_ordering_mistake").is_none() {
        return;
    }
    for (case, expected) in [
        (
            "read-without-wait",
            "unordered accesses to device allocation",
        ),
        (
            "write-after-read-without-wait",
            "reads it, then cuMemsetD8Async",
        ),
        (
            "free-page-locked-while-copying",
            "cuMemFreeHost of page-locked allocation",
        ),
        (
            "rewrite-page-locked-while-copying",
            "the host wrote page-locked allocation",
        ),
        ("use-after-free", "after cuMemFreeAsync"),
        ("no-current-context", "no current context"),
        (
            "past-the-end",
            "touched memory past the end of device allocation",
        ),
        ("stale-ptx", "the PTX is stale"),
    ] {
        let out = child(case, &[("IMAGEFEED_FAKE_CUDA_MAX_DELAY_US", "20000")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{case}: the child did not fail\n{stderr}"
        );
        assert!(
            stderr.contains("imagefeed fake CUDA: ") && stderr.contains(expected),
            "{case}: expected {expected:?}\n{stderr}"
        );
    }
    // The same steps done right pass the checks.
    let out = child(
        "all-ordered",
        &[("IMAGEFEED_FAKE_CUDA_MAX_DELAY_US", "20000")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child side of the tests above (`IMAGEFEED_GPU_TEST_CASE` says which case).
#[test]
#[ignore = "run by the_fake_driver_aborts_on_each_ordering_mistake in a child process"]
fn checker_child() {
    let case = std::env::var("IMAGEFEED_GPU_TEST_CASE").expect("run as a child");
    if case == "stub-library" {
        match Gpu::open(0) {
            Ok(_) => println!("opened"),
            Err(e) => println!("{e}"),
        }
        return;
    }
    let gpu = Gpu::open(0).unwrap();
    let (a, b) = (gpu.new_stream().unwrap(), gpu.new_stream().unwrap());
    let kernels = gpu
        .context()
        .load_module(Ptx::from_src(EXAMPLE_PTX))
        .unwrap();
    let column_sums = kernels.load_function("column_sums").unwrap();
    // sums[k] = Σ rows of data: data read on one stream, sums written.
    let sums_of = |stream: &Arc<imagefeed::gpu::cudarc::driver::CudaStream>,
                   data: u64,
                   rows: i32,
                   out: u64| {
        let cols = 16i32;
        let mut launch = stream.launch_builder(&column_sums);
        launch.arg(&data).arg(&rows).arg(&cols).arg(&out);
        // SAFETY: data holds rows × 16 floats and out 16, or the case is about that mistake.
        unsafe { launch.launch(LaunchConfig::for_num_elems(16)) }.unwrap();
    };
    let data = a.alloc_zeros::<f32>(64).unwrap(); // written (zeroed) on stream a
    let sums = b.alloc_zeros::<f32>(16).unwrap();
    let (data_ptr, sums_ptr) = (data.device_ptr(&a).0, sums.device_ptr(&b).0);
    let ordered = gpu.event().unwrap();
    match case.as_str() {
        "read-without-wait" => sums_of(&b, data_ptr, 4, sums_ptr),
        "write-after-read-without-wait" => {
            b.wait(&a.record_event(None).unwrap()).unwrap();
            sums_of(&b, data_ptr, 4, sums_ptr);
            // SAFETY: a valid range; the mistake is the missing wait for b's read.
            unsafe { result::memset_d8_async(data_ptr, 1, 256, a.cu_stream()) }.unwrap();
        }
        "free-page-locked-while-copying" | "rewrite-page-locked-while-copying" => {
            let mut pinned = PinnedBuffer::new(gpu.context(), 256).unwrap();
            a.synchronize().unwrap();
            // SAFETY: data holds 256 bytes; the source outlives the copy, unless the case is
            // about that mistake.
            unsafe { result::memcpy_htod_async(data_ptr, pinned.as_slice(), a.cu_stream()) }
                .unwrap();
            if case.starts_with("rewrite") {
                pinned.as_mut_slice()[7] = 1;
                a.synchronize().unwrap();
            } else {
                drop(pinned);
            }
        }
        "use-after-free" => {
            b.wait(&a.record_event(None).unwrap()).unwrap();
            drop(data);
            a.synchronize().unwrap();
            sums_of(&b, data_ptr, 4, sums_ptr);
        }
        "no-current-context" => {
            std::thread::spawn(move || {
                // SAFETY: a plain allocation call; the mistake is the thread's missing context.
                let _ = unsafe { result::malloc_sync(64) };
            })
            .join()
            .unwrap();
        }
        "past-the-end" => {
            b.wait(&a.record_event(None).unwrap()).unwrap();
            sums_of(&b, data_ptr, 400, sums_ptr); // 400 rows of a 4-row matrix
            b.synchronize().unwrap();
        }
        "stale-ptx" => {
            let stale = imagefeed::gpu::PTX.replacen(
                ".param .u32 u8_nhwc_to_f32_param_3",
                ".param .u64 u8_nhwc_to_f32_param_3",
                1,
            );
            let _ = gpu.context().load_module(Ptx::from_src(stale));
        }
        "all-ordered" => {
            ordered.record(&a).unwrap();
            b.wait(&ordered).unwrap();
            sums_of(&b, data_ptr, 4, sums_ptr);
            // An event recorded again elsewhere: b still waits for the record it saw, so the
            // memory b frees is freed after a's work on it, however long that takes.
            // SAFETY: raw allocation, writes and free of 256 bytes, ordered by `ordered`.
            unsafe {
                let raw = result::malloc_async(a.cu_stream(), 256).unwrap();
                for value in 0..20 {
                    result::memset_d8_async(raw, value, 256, a.cu_stream()).unwrap();
                }
                ordered.record(&a).unwrap();
                b.wait(&ordered).unwrap();
                ordered.record(&gpu.new_stream().unwrap()).unwrap();
                result::free_async(raw, b.cu_stream()).unwrap();
            }
            let mut pinned = PinnedBuffer::new(gpu.context(), 256).unwrap();
            b.record_event(None).map(|e| a.wait(&e)).unwrap().unwrap();
            // SAFETY: data holds 256 bytes; the source is kept until the copy is done.
            unsafe { result::memcpy_htod_async(data_ptr, pinned.as_slice(), a.cu_stream()) }
                .unwrap();
            a.synchronize().unwrap();
            pinned.as_mut_slice()[7] = 1;
            drop(pinned);
            b.synchronize().unwrap();
        }
        other => panic!("unknown case {other}"),
    }
    drop(sums);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    println!("{case}: no mistake found");
}

/// A batch larger than one launch grid (65,535 blocks of 256 threads: 16.8 M elements) is
/// converted whole: the kernel's grid-stride loop covers the rest, bit for bit as the CPU.
#[test]
fn a_batch_larger_than_one_grid_is_converted_whole() {
    let _serial = serial();
    let Some(gpu) = gpu_or_skip("a_batch_larger_than_one_grid_is_converted_whole") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let spec = SyntheticSpec {
        classes: 2,
        per_class: 3,
        width: 1201,
        height: 799,
        ..SyntheticSpec::default()
    };
    synthetic::write_image_folder(&src, &spec).unwrap();
    let ds = format::open(&src).unwrap();
    let transform = Transform::cifar().with_output(DType::F32, Layout::Nchw);
    let config = |t: Transform| {
        LoaderConfig::default()
            .with_batch_size(6)
            .with_workers(2)
            .with_seed(3)
            .with_transform(t)
    };
    let cpu = Loader::new(Arc::clone(&ds), config(transform)).unwrap();
    let expected = cpu.epoch(0).next().unwrap().unwrap();
    let total = expected.as_f32().len();
    assert!(total > 65_535 * 256, "{total} elements: more than one grid");
    let loader =
        Loader::with_allocator(ds, config(transform.raw_u8_nhwc()), gpu.pinned_allocator())
            .unwrap();
    let mut feed = Prefetcher::for_loader(
        &gpu,
        gpu.new_stream().unwrap(),
        &loader,
        DeviceOutput::of(&transform),
        1,
    )
    .unwrap();
    feed.start(loader.epoch(0)).unwrap();
    let batch = feed.next_batch().unwrap().expect("one batch");
    let got = floats(&batch.to_host().unwrap(), DType::F32);
    assert_eq!(got.len(), total);
    let first_wrong = got
        .iter()
        .zip(expected.as_f32())
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert_eq!(first_wrong, None, "element {first_wrong:?} differs");
}
