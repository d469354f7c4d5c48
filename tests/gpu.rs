//! The GPU feed against the CPU loader: the batches the GPU converts (f32/f16, NCHW/NHWC,
//! prefetch depth 1–3, page-locked buffers) are bit-identical to what the CPU transform writes
//! for the same seed. Needs a CUDA device; without one every test says why and returns.
#![cfg(feature = "cuda")]

use std::path::Path;
use std::sync::Arc;

use imagefeed::dataset::Dataset;
use imagefeed::gpu::{DeviceOutput, Gpu, Prefetcher};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::synthetic::{self, SyntheticSpec};
use imagefeed::transform::{CIFAR10_NORMALIZE, DType, Layout, Transform};
use imagefeed::{Error, format};

fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match imagefeed::gpu::unavailable_reason() {
        None => Some(Gpu::open(0).expect("a device is reported, so it opens")),
        Some(reason) => {
            eprintln!("{test}: skipped, no GPU here: {reason}");
            None
        }
    }
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
