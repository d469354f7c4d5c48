//! Decoding the fixture edge cases: unusual-but-valid files come out as RGB close to the
//! generator's pixels; broken ones fail with the right reason.

use crate::support;

use std::fs;

use imagefeed::decode::{DecodeError, Decoder, PayloadFormat};
use imagefeed::synthetic::synthetic_pixels;
use support::{fixture_root, fixture_spec};

/// The pixels the edge-case files were encoded from.
fn reference() -> Vec<u8> {
    synthetic_pixels(&fixture_spec(), 0, 1_000_000)
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .sum::<f64>()
        / a.len() as f64
}

fn decode(name: &str) -> Result<(imagefeed::decode::ImageHeader, Vec<u8>), DecodeError> {
    let bytes = fs::read(fixture_root().join(name)).unwrap();
    let mut out = Vec::new();
    Decoder::new()
        .decode_rgb(&bytes, &mut out)
        .map(|h| (h, out))
}

#[test]
fn colour_edge_cases_decode_to_the_source_pixels() {
    let reference = reference();
    for (name, format, tolerance) in [
        ("class00/edge-cmyk.jpg", PayloadFormat::Jpeg, 10.0),
        ("class00/edge-progressive.JPEG", PayloadFormat::Jpeg, 10.0),
        // Lossless: exact.
        ("class00/edge-alpha.png", PayloadFormat::Png, 0.0),
    ] {
        let (header, rgb) = decode(name).unwrap();
        assert_eq!(
            (header.width, header.height, header.format),
            (40, 32, format),
            "{name}"
        );
        let diff = mean_abs_diff(&rgb, &reference);
        assert!(
            diff <= tolerance,
            "{name}: mean abs diff {diff} > {tolerance}"
        );
        // The tolerance separates right from wrong: the colour-inverted image (what reading
        // Adobe CMYK without inversion gives) is far away.
        let inverted: Vec<u8> = reference.iter().map(|v| 255 - v).collect();
        assert!(mean_abs_diff(&rgb, &inverted) > 50.0, "{name}");
    }
}

#[test]
fn grayscale_jpeg_becomes_three_equal_channels() {
    let (header, rgb) = decode("class00/edge-grayscale.jpg").unwrap();
    assert_eq!(rgb.len(), header.rgb_len());
    assert!(rgb.chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]));
    let gray: Vec<u8> = reference()
        .chunks(3)
        .map(|p| ((p[0] as u32 + p[1] as u32 + p[2] as u32) / 3) as u8)
        .collect();
    let channel0: Vec<u8> = rgb.chunks(3).map(|p| p[0]).collect();
    assert!(mean_abs_diff(&channel0, &gray) < 4.0);
}

#[test]
fn broken_files_fail_with_their_reason() {
    assert_eq!(
        decode("class01/bad-empty.jpg").unwrap_err(),
        DecodeError::Empty
    );
    assert!(matches!(
        decode("class01/bad-text.jpg"),
        Err(DecodeError::UnknownFormat(_))
    ));
    match decode("class01/bad-truncated.jpg") {
        Err(DecodeError::Jpeg(message)) => assert!(message.contains("Premature end"), "{message}"),
        other => panic!("truncated JPEG gave {other:?}"),
    }
    assert!(matches!(
        decode("class01/bad-bomb.jpg"),
        Err(DecodeError::TooLarge {
            width: 60000,
            height: 60000,
            ..
        })
    ));
}

#[test]
fn decode_into_a_caller_buffer_writes_every_byte() {
    let bytes = fs::read(fixture_root().join("class02/img00001.jpg")).unwrap();
    let mut decoder = Decoder::new();
    let header = decoder.header(&bytes).unwrap();
    let mut expected = Vec::new();
    decoder.decode_rgb(&bytes, &mut expected).unwrap();
    // Poisoned buffers of two different fill values must come out identical.
    for poison in [0u8, 255] {
        let mut slot = vec![poison; header.rgb_len()];
        decoder.decode_rgb_into(&bytes, &mut slot).unwrap();
        assert_eq!(slot, expected);
    }
}

#[test]
#[should_panic(expected = "output buffer does not match")]
fn decode_into_a_wrong_sized_buffer_is_a_caller_bug() {
    let bytes = fs::read(fixture_root().join("class02/img00001.jpg")).unwrap();
    Decoder::new()
        .decode_rgb_into(&bytes, &mut [0u8; 10])
        .unwrap();
}

/// Where each decoding path lands for one file: the header fields, the pixels and (for a crop)
/// the geometry, as bytes, so that results of different paths compare the same way.
#[derive(Debug, Clone, Copy)]
enum DecodePath {
    Header,
    Validate,
    Full,
    Reduced,
    Crop,
    Into,
}

const PATHS: [DecodePath; 6] = [
    DecodePath::Header,
    DecodePath::Validate,
    DecodePath::Full,
    DecodePath::Reduced,
    DecodePath::Crop,
    DecodePath::Into,
];

fn run_path(decoder: &mut Decoder, path: DecodePath, bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let size = |h: imagefeed::decode::ImageHeader| [h.width.to_le_bytes(), h.height.to_le_bytes()];
    let mut out = Vec::new();
    match path {
        DecodePath::Header => Ok(size(decoder.header(bytes)?).concat()),
        DecodePath::Validate => Ok(size(decoder.validate(bytes)?).concat()),
        DecodePath::Full => {
            decoder.decode_rgb(bytes, &mut out)?;
            Ok(out)
        }
        DecodePath::Reduced => {
            let header = decoder.decode_rgb_reduced(bytes, 9, 7, &mut out)?;
            out.extend(size(header).concat());
            Ok(out)
        }
        DecodePath::Crop => {
            let decoded = decoder.decode_crop(bytes, &mut out, |h| {
                let (w, h) = (h.width as f64, h.height as f64);
                Some(imagefeed::decode::CropPlan {
                    crop: imagefeed::geometry::Rect {
                        left: w * 0.3,
                        top: h * 0.2,
                        width: w * 0.5,
                        height: h * 0.6,
                    },
                    out_width: 12,
                    out_height: 10,
                    scaling: imagefeed::decode::DctScaling::Smallest,
                })
            })?;
            out.extend(format!("{decoded:?}").into_bytes());
            Ok(out)
        }
        DecodePath::Into => {
            let header = decoder.header(bytes)?;
            let mut slot = vec![0u8; header.rgb_len()];
            decoder.decode_rgb_into(bytes, &mut slot)?;
            Ok(slot)
        }
    }
}

/// Good JPEGs of every kind the decoder handles differently: baseline 4:4:4 and 4:2:0,
/// progressive, grayscale, CMYK, and a larger 4:2:0 image whose crops decode a region.
fn good_jpegs() -> Vec<(String, Vec<u8>)> {
    let mut good: Vec<(String, Vec<u8>)> = [
        "class00/img00000.jpg",
        "class00/edge-progressive.JPEG",
        "class00/edge-grayscale.jpg",
        "class00/edge-cmyk.jpg",
        "class02/img00003.jpg",
    ]
    .iter()
    .map(|name| {
        (
            name.to_string(),
            fs::read(fixture_root().join(name)).unwrap(),
        )
    })
    .collect();
    let spec = imagefeed::synthetic::SyntheticSpec {
        width: 120,
        height: 88,
        ..Default::default()
    };
    let pixels = synthetic_pixels(&spec, 1, 7);
    let image = turbojpeg::Image {
        pixels: pixels.as_slice(),
        width: 120,
        pitch: 120 * 3,
        height: 88,
        format: turbojpeg::PixelFormat::RGB,
    };
    let jpeg = turbojpeg::compress(image, 85, turbojpeg::Subsamp::Sub2x2).unwrap();
    good.push(("120x88 4:2:0".into(), jpeg.to_vec()));
    good
}

/// The offset of the first `0xFF marker` segment in a JPEG.
fn marker(jpeg: &[u8], marker: u8) -> Option<usize> {
    jpeg.windows(2).position(|w| w == [0xFF, marker])
}

/// Every kind of corrupt JPEG we can make from `jpeg`: bad tables, bad frame and scan headers,
/// cuts at many points, flipped entropy-coded bytes.
fn corruptions(jpeg: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut edit = |what: &str, f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = jpeg.to_vec();
        f(&mut b);
        out.push((what.to_string(), b));
    };
    if let Some(i) = marker(jpeg, 0xC4) {
        edit("bad DHT counts", &|b| b[i + 5..i + 21].fill(0xFF));
        edit("bad DHT class", &|b| b[i + 4] = 0x37);
    }
    if let Some(i) = marker(jpeg, 0xDB) {
        edit("bad DQT index", &|b| b[i + 4] = 0x0F);
        edit("bad DQT length", &|b| {
            b[i + 2..i + 4].copy_from_slice(&[0xFF, 0xF0])
        });
    }
    let sof = marker(jpeg, 0xC0).or_else(|| marker(jpeg, 0xC2));
    if let Some(i) = sof {
        edit("bad SOF precision", &|b| b[i + 4] = 99);
        edit("bad SOF components", &|b| b[i + 9] = 0);
        edit("bad SOF sampling", &|b| b[i + 11] = 0x55);
    }
    if let Some(i) = marker(jpeg, 0xDA) {
        edit("bad SOS components", &|b| b[i + 4] = 9);
        edit("bad SOS table", &|b| b[i + 6] = 0x77);
        let data = i + 2 + u16::from_be_bytes([jpeg[i + 2], jpeg[i + 3]]) as usize;
        for k in 0..8 {
            let at = data + (jpeg.len() - 2 - data) * k / 8;
            edit(&format!("entropy byte {at} flipped"), &|b| b[at] ^= 0x5A);
        }
    }
    for k in 1..24 {
        let cut = jpeg.len() * k / 24;
        out.push((format!("cut at byte {cut}"), jpeg[..cut].to_vec()));
    }
    out.push((
        "SOI then garbage".into(),
        [&jpeg[..2], &[0x13; 64][..]].concat(),
    ));
    out
}

#[test]
fn a_corrupt_jpeg_never_changes_how_the_good_ones_after_it_decode() {
    let good = good_jpegs();
    // What each path gives for each good file in a decoder that never saw anything else.
    let fresh: Vec<Vec<Vec<u8>>> = PATHS
        .iter()
        .map(|&path| {
            good.iter()
                .map(|(name, bytes)| {
                    run_path(&mut Decoder::new(), path, bytes)
                        .unwrap_or_else(|e| panic!("{name} ({path:?}): {e}"))
                })
                .collect()
        })
        .collect();
    let mut failures = 0;
    for (base_name, base) in &good {
        for (what, corrupt) in corruptions(base) {
            for (p, &path) in PATHS.iter().enumerate() {
                // One decoder per worker, as in the loader and the packer: the corrupt file,
                // then every good one through the same handle.
                let mut decoder = Decoder::new();
                if run_path(&mut decoder, path, &corrupt).is_err() {
                    failures += 1;
                }
                for (g, (name, bytes)) in good.iter().enumerate() {
                    let got = run_path(&mut decoder, path, bytes).unwrap_or_else(|e| {
                        panic!("{name} ({path:?}) after {base_name} with {what}: {e}")
                    });
                    assert!(
                        got == fresh[p][g],
                        "{name} ({path:?}) after {base_name} with {what}: output differs from a fresh decoder's"
                    );
                }
            }
        }
    }
    // The corruptions really exercise the error paths (most of them fail on every path).
    assert!(failures > 500, "only {failures} corrupt decodes failed");
}

#[test]
fn a_small_jpeg_claiming_a_huge_size_is_refused_before_decoding() {
    // The progressive fixture (2 KB) with its frame header saying 13000x13000: every block
    // costs at least a bit, so 2 KB cannot hold 2.6 million of them.
    let mut bytes = fs::read(fixture_root().join("class00/edge-progressive.JPEG")).unwrap();
    let sof = marker(&bytes, 0xC2).expect("a progressive frame header");
    bytes[sof + 5..sof + 9].copy_from_slice(&[0x32, 0xC8, 0x32, 0xC8]);
    for path in PATHS {
        match run_path(&mut Decoder::new(), path, &bytes) {
            Err(DecodeError::Implausible {
                width: 13000,
                height: 13000,
                blocks,
                bytes: len,
            }) => {
                assert_eq!(blocks, 1625 * 1625);
                assert_eq!(len, bytes.len());
            }
            other => panic!("{path:?}: {other:?}"),
        }
    }
    // The pixel limit still speaks first for what it covers.
    assert!(matches!(
        decode("class01/bad-bomb.jpg"),
        Err(DecodeError::TooLarge { .. })
    ));
}

#[test]
fn an_arithmetic_coded_jpeg_claiming_a_huge_size_hits_the_buffer_limit() {
    // Arithmetic coding has no bits-per-block floor, so the size check cannot refuse this file;
    // libjpeg-turbo's memory limit (4096 bytes per file byte, at least 64 MB) must stop it before
    // it allocates the ~190 MB of coefficients an 8000x8000 progressive image needs.
    let spec = imagefeed::synthetic::SyntheticSpec {
        width: 64,
        height: 48,
        ..Default::default()
    };
    let pixels = synthetic_pixels(&spec, 0, 3);
    let mut compressor = turbojpeg::Compressor::new().unwrap();
    compressor.set_arithmetic(true).unwrap();
    compressor.set_progressive(true).unwrap();
    compressor.set_subsamp(turbojpeg::Subsamp::Sub2x2).unwrap();
    let image = turbojpeg::Image {
        pixels: pixels.as_slice(),
        width: 64,
        pitch: 64 * 3,
        height: 48,
        format: turbojpeg::PixelFormat::RGB,
    };
    let good = compressor.compress_to_vec(image).unwrap();
    // The real file decodes (the limit leaves ordinary images alone) ...
    let mut out = Vec::new();
    Decoder::new().decode_rgb(&good, &mut out).unwrap();
    assert_eq!(out.len(), 64 * 48 * 3);
    // ... and the same bytes claiming 8000x8000 are refused for the memory they would take.
    let mut bomb = good.clone();
    let sof = marker(&bomb, 0xCA).expect("a progressive arithmetic frame header");
    bomb[sof + 5..sof + 9].copy_from_slice(&[0x1F, 0x40, 0x1F, 0x40]);
    for path in [DecodePath::Validate, DecodePath::Full, DecodePath::Crop] {
        match run_path(&mut Decoder::new(), path, &bomb) {
            Err(DecodeError::Jpeg(message)) => {
                assert!(
                    message.contains("Memory limit exceeded"),
                    "{path:?}: {message}"
                )
            }
            other => panic!("{path:?}: {other:?}"),
        }
    }
}
