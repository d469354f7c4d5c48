//! The decoder's unit tests: formats, scaling, regions, limits, and PIL's conversions.

use std::io::Cursor;

use super::limits::METADATA_ALLOWANCE;
use super::*;

fn png(width: u32, height: u32, color: image::ColorType, pixel: &[u8]) -> Vec<u8> {
    let n = (width * height) as usize;
    let data: Vec<u8> = pixel
        .iter()
        .copied()
        .cycle()
        .take(n * pixel.len())
        .collect();
    let mut out = Vec::new();
    image::write_buffer_with_format(
        &mut Cursor::new(&mut out),
        &data,
        width,
        height,
        color,
        image::ImageFormat::Png,
    )
    .unwrap();
    out
}

/// #32 finding 10: 16-bit PNGs come out as PIL's `convert("RGB")` gives them (values
/// checked against Pillow 13): grayscale clipped to 255, colour and grayscale with alpha
/// reduced to the high byte.
#[test]
fn sixteen_bit_pngs_convert_as_pil_does() {
    let values: [u16; 9] = [0, 1, 127, 255, 256, 383, 32768, 65280, 65535];
    let encode = |image: image::DynamicImage| {
        let mut out = Vec::new();
        image
            .write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        out
    };
    let n = values.len() as u32;
    let gray = image::ImageBuffer::<image::Luma<u16>, _>::from_raw(n, 1, values.to_vec());
    let gray_alpha = image::ImageBuffer::<image::LumaA<u16>, _>::from_raw(
        n,
        1,
        values.iter().flat_map(|&v| [v, 65535]).collect(),
    );
    let rgb = image::ImageBuffer::<image::Rgb<u16>, _>::from_raw(
        n,
        1,
        values.iter().flat_map(|&v| [v, 65535 - v, v / 2]).collect(),
    );
    let rgba = image::ImageBuffer::<image::Rgba<u16>, _>::from_raw(
        n,
        1,
        values
            .iter()
            .flat_map(|&v| [v, 65535 - v, v / 2, 0])
            .collect(),
    );
    let clipped: Vec<u8> = values.iter().flat_map(|&v| [v.min(255) as u8; 3]).collect();
    let high = |v: u16| (v >> 8) as u8;
    let gray_high: Vec<u8> = values.iter().flat_map(|&v| [high(v); 3]).collect();
    let rgb_high: Vec<u8> = values
        .iter()
        .flat_map(|&v| [high(v), high(65535 - v), high(v / 2)])
        .collect();
    let mut decoder = Decoder::new();
    for (name, image, expected) in [
        (
            "L16",
            image::DynamicImage::ImageLuma16(gray.unwrap()),
            &clipped,
        ),
        (
            "LA16",
            image::DynamicImage::ImageLumaA16(gray_alpha.unwrap()),
            &gray_high,
        ),
        (
            "RGB16",
            image::DynamicImage::ImageRgb16(rgb.unwrap()),
            &rgb_high,
        ),
        (
            "RGBA16",
            image::DynamicImage::ImageRgba16(rgba.unwrap()),
            &rgb_high,
        ),
    ] {
        let mut out = Vec::new();
        decoder.decode_rgb(&encode(image), &mut out).unwrap();
        assert_eq!(&out, expected, "{name}");
    }
    // 256: 255 in grayscale (clipped), 1 in colour (high byte); the image crate gave 1 for
    // both.
    assert_eq!((clipped[4 * 3], gray_high[4 * 3]), (255, 1));
}

/// The DCT scale each policy picks: the smallest covering scale (odd ones included), only
/// SIMD scales keeping the crop twice the output, or none (#32: aliasing).
#[test]
fn dct_scaling_policies_pick_their_scales() {
    let jpeg = jpeg_420(800, 600);
    let mut decoder = Decoder::new();
    let mut out = Vec::new();
    let mut size = |scaling, (w, h)| {
        let d = decoder
            .decode_crop(&jpeg, &mut out, |header| {
                Some(CropPlan {
                    crop: Rect::full(header.width, header.height),
                    out_width: w,
                    out_height: h,
                    scaling,
                })
            })
            .unwrap();
        (d.width, d.height)
    };
    use DctScaling::*;
    // 800x600 -> 100x75: 1/8 covers it; twice the output needs 1/4.
    assert_eq!(size(Smallest, (100, 75)), (100, 75));
    assert_eq!(size(Antialiased, (100, 75)), (200, 150));
    assert_eq!(size(Off, (100, 75)), (800, 600));
    // -> 300x225: 3/8 covers it (slow without SIMD); twice the output needs full size.
    assert_eq!(size(Smallest, (300, 225)), (300, 225));
    assert_eq!(size(Antialiased, (300, 225)), (800, 600));
    // -> 150x110: 1/4 covers it; twice the output (300x220) needs 1/2.
    assert_eq!(size(Smallest, (150, 110)), (200, 150));
    assert_eq!(size(Antialiased, (150, 110)), (400, 300));
}

/// A 4:2:0 JPEG of `w × h` synthetic pixels (decoded by libjpeg-turbo's SIMD colour
/// converter, the one that streams aligned rows).
fn jpeg_420(w: u32, h: u32) -> Vec<u8> {
    let spec = crate::synthetic::SyntheticSpec {
        width: w,
        height: h,
        ..Default::default()
    };
    let pixels = crate::synthetic::synthetic_pixels(&spec, 0, 0);
    compress(&pixels, w, h, 90, turbojpeg::Subsamp::Sub2x2)
}

/// `w × h` pixels (RGB, or gray for `Subsamp::Gray`) as a libjpeg-turbo JPEG.
fn compress(pixels: &[u8], w: u32, h: u32, quality: i32, subsamp: turbojpeg::Subsamp) -> Vec<u8> {
    let gray = subsamp == turbojpeg::Subsamp::Gray;
    let image = turbojpeg::Image {
        pixels,
        width: w as usize,
        pitch: w as usize * if gray { 1 } else { 3 },
        height: h as usize,
        format: if gray {
            turbojpeg::PixelFormat::GRAY
        } else {
            turbojpeg::PixelFormat::RGB
        },
    };
    turbojpeg::compress(image, quality, subsamp)
        .unwrap()
        .to_vec()
}

#[test]
fn output_alignment_never_changes_the_pixels() {
    // Rows of 96 bytes (all rows as aligned as the first), 48 bytes (every other row),
    // 111 bytes (one in 32) and 672 bytes; every start offset modulo 64, so both the staged
    // and the in-place paths run.
    let mut decoder = Decoder::new();
    for (w, h) in [(32, 32), (16, 24), (37, 21), (224, 40)] {
        let jpeg = jpeg_420(w, h);
        let mut expected = Vec::new();
        decoder.decode_rgb(&jpeg, &mut expected).unwrap();
        let len = (w * h * 3) as usize;
        assert_eq!(expected.len(), len);
        let mut buffer = vec![0u8; len + 128];
        for offset in 0..64 {
            buffer.fill(0xA5);
            let out = &mut buffer[offset..offset + len];
            decoder.decode_rgb_into(&jpeg, out).unwrap();
            assert!(
                out == expected.as_slice(),
                "{w}x{h} at offset {offset}: pixels differ"
            );
            assert!(
                buffer[..offset]
                    .iter()
                    .chain(&buffer[offset + len..])
                    .all(|&b| b == 0xA5),
                "{w}x{h} at offset {offset}: wrote outside the output"
            );
        }
    }
}

#[test]
fn png_with_alpha_drops_alpha() {
    let data = png(3, 2, image::ColorType::Rgba8, &[10, 20, 30, 40]);
    let mut out = Vec::new();
    let header = Decoder::new().decode_rgb(&data, &mut out).unwrap();
    assert_eq!(
        (header.width, header.height, header.format),
        (3, 2, PayloadFormat::Png)
    );
    assert_eq!(out, [10, 20, 30].repeat(6));
}

#[test]
fn grayscale_png_expands_to_rgb() {
    let data = png(2, 2, image::ColorType::L8, &[77]);
    let mut out = vec![0; 12];
    Decoder::new().decode_rgb_into(&data, &mut out).unwrap();
    assert_eq!(out, vec![77; 12]);
}

#[test]
fn raw_payload_round_trips_and_checks_length() {
    let pixels: Vec<u8> = (0..2 * 3 * 3).map(|i| i as u8).collect();
    let raw = RawImage::encode(2, 3, &pixels);
    let mut out = Vec::new();
    let header = Decoder::new().decode_rgb(&raw, &mut out).unwrap();
    assert_eq!((header.width, header.height), (2, 3));
    assert_eq!(out, pixels);
    let err = Decoder::new()
        .decode_rgb(&raw[..raw.len() - 1], &mut out)
        .unwrap_err();
    assert!(matches!(err, DecodeError::BadRaw(_)), "{err}");
}

#[test]
fn pixel_limit_applies_before_decoding() {
    let data = png(20, 20, image::ColorType::Rgb8, &[1, 2, 3]);
    let err = Decoder::new()
        .with_max_pixels(399)
        .header(&data)
        .unwrap_err();
    assert_eq!(
        err,
        DecodeError::TooLarge {
            width: 20,
            height: 20,
            limit: 399
        }
    );
    assert!(Decoder::new().with_max_pixels(400).header(&data).is_ok());
}

#[test]
fn unknown_and_empty_payloads_are_explained() {
    let mut out = Vec::new();
    assert_eq!(
        Decoder::new().decode_rgb(b"", &mut out),
        Err(DecodeError::Empty)
    );
    let err = Decoder::new()
        .decode_rgb(b"hello world", &mut out)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "not a recognized image format (starts with text \"hello wo\")"
    );
}

#[test]
fn file_bounds_come_from_the_declared_size() {
    let jpeg = jpeg_420(40, 24);
    let bound = max_file_len(&jpeg).unwrap();
    assert_eq!(bound.what, "a 40x24 jpeg");
    assert_eq!(bound.bytes, 40 * 24 * 6 + METADATA_ALLOWANCE);
    let png = png(7, 5, image::ColorType::Rgb8, &[1, 2, 3]);
    assert_eq!(
        max_file_len(&png).unwrap().bytes,
        7 * 5 * 8 + METADATA_ALLOWANCE
    );
    let raw = RawImage::encode(2, 3, &[0; 18]);
    assert_eq!(max_file_len(&raw[..12]).unwrap().bytes, 12 + 18);
    // A JPEG whose frame header is past the prefix: the pixel limit stands in.
    assert_eq!(
        max_file_len(&jpeg[..20]).unwrap().bytes,
        DEFAULT_MAX_PIXELS * 6 + METADATA_ALLOWANCE
    );
    assert!(
        max_file_len(&[0u8; 64])
            .unwrap_err()
            .contains("not an image format")
    );
}

#[test]
fn cmyk_conversion_follows_pil() {
    let mut rgb = [0u8; 6];
    cmyk_to_rgb(&[255, 255, 255, 255, 255, 0, 128, 128], &mut rgb);
    assert_eq!(rgb, [255, 255, 255, 128, 0, 64]);
}

#[test]
fn raw_headers_whose_size_overflows_are_errors_not_panics() {
    // Found by fuzzing: 3·w·h overflowed u64.
    let mut raw = RawImage::MAGIC.to_vec();
    raw.extend_from_slice(&u32::MAX.to_le_bytes());
    raw.extend_from_slice(&u32::MAX.to_le_bytes());
    raw.extend_from_slice(&[0; 30]);
    assert!(matches!(RawImage::parse(&raw), Err(DecodeError::BadRaw(_))));
    assert_eq!(max_file_len(&raw).unwrap().bytes, u64::MAX);
}

#[test]
fn a_tiff_entry_claiming_values_past_the_file_is_refused_before_decoding() {
    // Found by fuzzing: the tiff crate reserved 32 bytes per claimed value (160 MiB for this
    // 40-byte file) before reading them.
    let mut tiff = b"II*\0".to_vec();
    tiff.extend_from_slice(&8u32.to_le_bytes()); // first directory at 8
    tiff.extend_from_slice(&1u16.to_le_bytes()); // one entry
    tiff.extend_from_slice(&273u16.to_le_bytes()); // StripOffsets
    tiff.extend_from_slice(&4u16.to_le_bytes()); // LONG
    tiff.extend_from_slice(&5_000_000u32.to_le_bytes()); // count
    tiff.extend_from_slice(&26u32.to_le_bytes()); // offset
    tiff.extend_from_slice(&0u32.to_le_bytes()); // no next directory
    let err = Decoder::new().header(&tiff).unwrap_err().to_string();
    assert!(err.contains("claims 5000000 values"), "{err}");
    // The same count in a tag the decoder never reads is not looked at.
    tiff[10..12].copy_from_slice(&700u16.to_le_bytes()); // XMP
    let err = Decoder::new().header(&tiff).unwrap_err().to_string();
    assert!(!err.contains("claims"), "{err}");
    // Real TIFFs, with their values inline and in the file, decode.
    for (w, h) in [(4u32, 3u32), (64, 40)] {
        let pixels: Vec<u8> = (0..w * h * 3).map(|i| i as u8).collect();
        let mut file = std::io::Cursor::new(Vec::new());
        image::codecs::tiff::TiffEncoder::new(&mut file)
            .encode(&pixels, w, h, image::ExtendedColorType::Rgb8)
            .unwrap();
        let mut out = Vec::new();
        Decoder::new().decode_rgb(file.get_ref(), &mut out).unwrap();
        assert_eq!(out, pixels);
    }
}

/// A JPEG of `w × h` noisy pixels (sharp colour edges everywhere, so a chroma sample taken
/// from the wrong neighbour shows) at `subsamp`; grayscale for `Subsamp::Gray`.
fn noisy_jpeg(w: u32, h: u32, subsamp: turbojpeg::Subsamp) -> Vec<u8> {
    let gray = subsamp == turbojpeg::Subsamp::Gray;
    let channels = if gray { 1 } else { 3 };
    let pixels: Vec<u8> = (0..w * h * channels)
        .map(|i| {
            let (p, c) = (i / channels, i % channels);
            let (x, y) = (p % w, p / w);
            let noise = (p.wrapping_mul(2654435761) >> 13) as u8;
            ((x * 3 + y * 5 + c * 80) as u8).wrapping_add(noise / 2)
        })
        .collect();
    compress(&pixels, w, h, 92, subsamp)
}

/// `--restart-markers`: a crop of a rewritten JPEG decodes from the segments around it only,
/// with the same pixels, size and crop rectangle as the original file gives, for every
/// subsampling, DCT scale policy and odd size, crops at the edges included.
#[test]
fn a_crop_of_a_jpeg_with_restart_markers_has_the_original_pixels() {
    use turbojpeg::Subsamp::*;
    let mut rng = crate::rng::SampleRng::new(7, 0, 0);
    let mut windows = 0;
    for subsamp in [None, Sub2x2, Sub2x1, Sub1x2, Gray] {
        for (w, h) in [(517, 389), (64, 48), (1000, 17), (33, 700), (301, 301)] {
            let original = noisy_jpeg(w, h, subsamp);
            let rewritten = add_restart_markers(&original).unwrap();
            assert!(
                restart::RestartSegments::parse(&rewritten).is_some(),
                "{subsamp:?} {w}x{h}: not recognised"
            );
            assert!(restart::RestartSegments::parse(&original).is_none());
            let (mut a, mut b) = (Decoder::new(), Decoder::new());
            let (mut pa, mut pb) = (Vec::new(), Vec::new());
            a.decode_rgb(&original, &mut pa).unwrap();
            b.decode_rgb(&rewritten, &mut pb).unwrap();
            assert!(pa == pb, "{subsamp:?} {w}x{h}: whole decodes differ");
            for i in 0..60 {
                let scaling = [
                    DctScaling::Off,
                    DctScaling::Smallest,
                    DctScaling::Antialiased,
                ][i % 3];
                let (cw, ch) = (
                    1.0 + rng.below(w as u64) as f64,
                    1.0 + rng.below(h as u64) as f64,
                );
                let crop = Rect {
                    left: rng.below((w as f64 - cw) as u64 + 1) as f64,
                    top: rng.below((h as f64 - ch) as u64 + 1) as f64,
                    width: cw,
                    height: ch,
                };
                let out = [8, 32, 224][i % 3];
                let plan = |_: &ImageHeader| {
                    Some(CropPlan {
                        crop,
                        out_width: out,
                        out_height: out,
                        scaling,
                    })
                };
                let da = a.decode_crop(&original, &mut pa, plan).unwrap();
                b.rows.clear();
                let db = b.decode_crop(&rewritten, &mut pb, plan).unwrap();
                assert_eq!(
                    (da.width, da.height, da.crop),
                    (db.width, db.height, db.crop),
                    "{subsamp:?} {w}x{h} {crop:?} {scaling:?}"
                );
                assert!(
                    pa == pb,
                    "{subsamp:?} {w}x{h} {crop:?} {scaling:?}: pixels differ"
                );
                if !b.rows.is_empty() {
                    windows += 1;
                    assert!(b.rows.len() < rewritten.len());
                }
            }
        }
    }
    // Most crops decode a window (the others need every segment, or nothing is gained).
    assert!(windows > 5 * 5 * 60 / 2, "{windows} windows");
}

/// A rewritten JPEG damaged anywhere (a byte changed, or cut short) decodes or fails with an
/// error, whatever the crop: never a panic. Where the window decode succeeds and a decode of
/// the same region through every row above it does too, their pixels are the same (restart
/// markers keep damage in one segment from reaching the others).
#[test]
fn a_damaged_jpeg_with_restart_markers_is_an_error_or_the_same_pixels() {
    let rewritten = add_restart_markers(&noisy_jpeg(333, 250, turbojpeg::Subsamp::Sub2x2)).unwrap();
    let (mut windowed, mut through) = (Decoder::new(), Decoder::new());
    let (mut window_pixels, mut through_pixels) = (Vec::new(), Vec::new());
    let crop = Rect {
        left: 100.0,
        top: 90.0,
        width: 120.0,
        height: 80.0,
    };
    let plan = |_: &ImageHeader| {
        Some(CropPlan {
            crop,
            out_width: 120,
            out_height: 80,
            scaling: DctScaling::Off,
        })
    };
    let mut damaged = rewritten.clone();
    let (mut compared, mut failed) = (0, 0);
    for at in (0..rewritten.len()).step_by(11) {
        for value in [0x00, 0xFF, 0xD3, rewritten[at] ^ 0x10] {
            damaged.copy_from_slice(&rewritten);
            damaged[at] = value;
            windowed.rows.clear();
            let Ok(c) = windowed.decode_crop(&damaged, &mut window_pixels, plan) else {
                failed += 1;
                continue;
            };
            if windowed.rows.is_empty() {
                continue; // the damage made it no segmented JPEG: decoded as usual
            }
            // The same region, decoded through every row above it.
            let region = Region {
                x: (crop.left - c.crop.left) as u32,
                y: (crop.top - c.crop.top) as u32,
                width: c.width,
                height: c.height,
            };
            let Ok(_) = through.probe(&damaged) else {
                continue;
            };
            let jh = through.last_jpeg.take().unwrap();
            let decoded = through.decompress_rgb(
                &damaged,
                &jh,
                8,
                Some(region),
                c.width,
                c.height,
                &mut through_pixels,
            );
            if decoded.is_ok() {
                assert!(window_pixels == through_pixels, "byte {at} = {value:#x}");
                compared += 1;
            }
        }
        let _ = windowed.decode_crop(&rewritten[..at], &mut window_pixels, plan);
    }
    assert!(
        compared > 100 && failed > 100,
        "{compared} compared, {failed} failed"
    );
}

/// Sampling factors TurboJPEG misclasses (every component 2x1: "4:4:4" with an 8-pixel MCU;
/// the file's MCU is 16 wide): a crop's region is aligned to the file's real iMCU, so every
/// crop decodes (a hostile try found half of them failing with "Unexplained mismatch between
/// specified and actual cropping region"), and the rewrite with restart markers gives the same
/// crops.
#[test]
fn crops_of_jpegs_with_unusual_sampling_factors_decode() {
    for file in [
        &include_bytes!("../../fixtures/jpeg/sampling-2x1-all.jpg")[..],
        &include_bytes!("../../fixtures/jpeg/sampling-2x2-2x1-2x1.jpg")[..],
    ] {
        let rewritten = add_restart_markers(file).unwrap();
        let (mut a, mut b) = (Decoder::new(), Decoder::new());
        let (mut pa, mut pb) = (Vec::new(), Vec::new());
        for left in 0..60 {
            for scaling in [DctScaling::Off, DctScaling::Antialiased] {
                let plan = |_: &ImageHeader| {
                    Some(CropPlan {
                        crop: Rect {
                            left: left as f64,
                            top: 3.0,
                            width: 12.0,
                            height: 30.0,
                        },
                        out_width: 6,
                        out_height: 15,
                        scaling,
                    })
                };
                let da = a.decode_crop(file, &mut pa, plan).unwrap();
                let db = b.decode_crop(&rewritten, &mut pb, plan).unwrap();
                assert_eq!(
                    (da.width, da.height, da.crop),
                    (db.width, db.height, db.crop)
                );
                assert!(pa == pb, "left {left} {scaling:?}");
            }
        }
    }
}

/// Progressive and arithmetic-coded sources come out of the rewrite baseline and
/// Huffman-coded, with restart segments crops use (a hostile try found them left progressive,
/// with a marker every block or two: +50% bytes and no faster crops), and the same pixels.
#[test]
fn a_progressive_jpeg_is_rewritten_baseline_with_the_same_pixels() {
    let spec = crate::synthetic::SyntheticSpec {
        width: 300,
        height: 200,
        ..Default::default()
    };
    let pixels = crate::synthetic::synthetic_pixels(&spec, 0, 0);
    let mut encoder = JpegEncoder::new(90, ChromaSubsampling::Half).unwrap();
    encoder.set_progressive(true).unwrap();
    let progressive = encoder.encode_rgb(&pixels, 300, 200).unwrap();
    assert!(restart::Layout::of(&progressive).frame.unwrap().marker == 0xC2);
    let rewritten = add_restart_markers(&progressive).unwrap();
    assert_eq!(restart::Layout::of(&rewritten).frame.unwrap().marker, 0xC0);
    assert!(restart::RestartSegments::parse(&rewritten).is_some());
    assert!(
        rewritten.len() < progressive.len() * 6 / 5,
        "{} -> {} bytes",
        progressive.len(),
        rewritten.len()
    );
    let mut decoder = Decoder::new();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    decoder.decode_rgb(&progressive, &mut a).unwrap();
    decoder.decode_rgb(&rewritten, &mut b).unwrap();
    assert!(a == b);
}
