//! The GPU feed against the CPU loader: the batches the GPU converts (f32/f16, NCHW/NHWC,
//! prefetch depth 1–3, page-locked buffers) equal what the CPU transform writes for the same
//! seed. Needs a CUDA device; without one every test says why and returns.
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

/// Equal up to float rounding: the GPU may fuse the multiply-add, and f16 rounds that
/// result (one f16 step is 2^-10 relative).
fn close(a: f32, b: f32, dtype: DType) -> bool {
    let tolerance = match dtype {
        DType::F16 => 2e-3 * b.abs().max(1.0),
        _ => 1e-5 * b.abs().max(1.0),
    };
    (a - b).abs() <= tolerance
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
            // The same flips (same seed) as u8 NHWC, converted on the GPU.
            let u8_transform = flip.with_output(DType::U8, Layout::Nhwc);
            for depth in 1..=3 {
                let allocator = gpu.pinned_allocator();
                let loader = Loader::with_allocator(
                    Arc::clone(&ds),
                    config(u8_transform),
                    allocator.clone(),
                )
                .unwrap();
                let output = DeviceOutput {
                    dtype,
                    layout,
                    normalize: Some(CIFAR10_NORMALIZE),
                };
                let stream = gpu.new_stream().unwrap();
                let mut feed =
                    Prefetcher::new(&gpu, stream, loader.epoch(0), output, depth).unwrap();
                let mut got = 0;
                while let Some(batch) = feed.next_batch().unwrap() {
                    let (labels, values) = &expected[got];
                    assert_eq!(batch.labels, &labels[..], "batch {got} labels");
                    let bytes = batch.to_host().unwrap();
                    let device: Vec<f32> = match dtype {
                        DType::F16 => bytes
                            .chunks_exact(2)
                            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                            .collect(),
                        _ => bytes
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect(),
                    };
                    assert_eq!(device.len(), values.len());
                    for (i, (a, b)) in device.iter().zip(values).enumerate() {
                        assert!(
                            close(*a, *b, dtype),
                            "{layout:?} {dtype:?} depth {depth} batch {got} element {i}: {a} vs {b}"
                        );
                    }
                    got += 1;
                }
                assert_eq!(got, expected.len(), "every batch delivered");
                assert!(
                    allocator.pinned() > 0,
                    "collate wrote into page-locked memory"
                );
                assert_eq!(allocator.fallbacks(), 0);
            }
        }
    }
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
    let mut feed = Prefetcher::new(&gpu, stream.clone(), loader.epoch(0), output, 2).unwrap();
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
        Prefetcher::new(&gpu, stream.clone(), std::iter::empty(), u8_output, 2),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        Prefetcher::new(&gpu, stream, std::iter::empty(), output, 0),
        Err(Error::Config(_))
    ));
}
