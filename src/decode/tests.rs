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
    // Every 37th byte, and every marker byte (the restart markers, the stuffed 0xFF 0x00 pairs
    // of the entropy-coded data, the headers'): damage there changes the file's structure.
    // (Every 11th byte alone took 40 s of the test run.)
    let marker = |at: usize| rewritten[at] == 0xFF || at > 0 && rewritten[at - 1] == 0xFF;
    for at in (0..rewritten.len()).filter(|&at| at % 37 == 0 || marker(at)) {
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

/// `w × h` noise-and-gradient pixels that differ with `seed`, as a libjpeg-turbo JPEG: files
/// of one size, subsampling and quality share every header byte.
fn seeded_jpeg(w: u32, h: u32, subsamp: turbojpeg::Subsamp, seed: u32, quality: i32) -> Vec<u8> {
    let channels = if subsamp == turbojpeg::Subsamp::Gray {
        1
    } else {
        3
    };
    let pixels: Vec<u8> = (0..w * h * channels)
        .map(|i| {
            let (p, c) = (i / channels, i % channels);
            let (x, y) = (p % w, p / w);
            let noise = ((p ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(2654435761) >> 13) as u8;
            ((x * (3 + seed % 5) + y * 5 + c * 80 + seed * 31) as u8).wrapping_add(noise / 2)
        })
        .collect();
    compress(&pixels, w, h, quality, subsamp)
}

/// Each image's result through [`Decoder::decode_batch_stacked`] with `plan`; and how many
/// were stacked and taken from the stack.
fn through_the_stack(
    images: &[Vec<u8>],
    plan: impl Fn(&ImageHeader) -> Option<CropPlan>,
) -> (Vec<StackedResult>, usize, usize) {
    let mut decoder = Decoder::new();
    let results = decoder.decode_batch_stacked(images, plan);
    let (stacked, used) = decoder.stack_counts();
    (results, stacked, used)
}

/// Each image decoded alone, as before stacks.
fn alone(
    image: &[u8],
    plan: impl Fn(&ImageHeader) -> Option<CropPlan>,
) -> Result<(CropDecoded, Vec<u8>), DecodeError> {
    let mut out = Vec::new();
    Decoder::new()
        .decode_crop(image, &mut out, plan)
        .map(|c| (c, out))
}

/// Small JPEGs that share their headers decode in one stack, to exactly the pixels each
/// gives alone: every stackable subsampling, odd and even widths, one MCU row and several.
#[test]
fn stacked_small_jpegs_have_the_pixels_each_has_alone() {
    use turbojpeg::Subsamp::*;
    for (subsamp, sizes) in [
        (
            Sub2x2,
            &[
                (32, 32),
                (8, 16),
                (17, 32),
                (33, 48),
                (64, 64),
                (100, 16),
                (128, 128),
            ][..],
        ),
        (None, &[(32, 32), (8, 8), (21, 40), (96, 96)][..]),
        (Gray, &[(32, 32), (9, 8), (64, 24)][..]),
    ] {
        for &(w, h) in sizes {
            let images: Vec<_> = (0..9).map(|s| seeded_jpeg(w, h, subsamp, s, 90)).collect();
            assert!(
                stack::Shape::of(&images[0]).is_some(),
                "{subsamp:?} {w}×{h} stackable"
            );
            let (results, stacked, used) = through_the_stack(&images, |_| Option::None);
            assert_eq!((stacked, used), (9, 9), "{subsamp:?} {w}×{h}");
            for (image, result) in images.iter().zip(results) {
                let (c, pixels) = result.unwrap();
                let (c0, expected) = alone(image, |_| Option::None).unwrap();
                assert_eq!(c, c0);
                assert!(pixels == expected, "{subsamp:?} {w}×{h}: pixels differ");
            }
        }
    }
}

/// What a stack cannot hold is refused at the door: other headers (quality), progressive
/// files, restart markers, 4:2:2, a height that is not whole MCU rows, large images, a marker
/// inside the data, bytes after the end. Refused images still decode, alone; a position
/// holding no stacked image is an error.
#[test]
fn what_cannot_be_stacked_decodes_alone() {
    use turbojpeg::Subsamp::*;
    let good = seeded_jpeg(32, 32, Sub2x2, 1, 90);
    let mut progressive = JpegEncoder::new(90, ChromaSubsampling::Half).unwrap();
    progressive.set_progressive(true).unwrap();
    let pixels = vec![100u8; 32 * 32 * 3];
    let mut trailing = seeded_jpeg(32, 32, Sub2x2, 2, 90);
    trailing.push(0);
    let mut marker_inside = seeded_jpeg(32, 32, Sub2x2, 3, 90);
    let n = marker_inside.len();
    marker_inside[n - 6..n - 4].copy_from_slice(&[0xFF, 0xD1]);
    let refused = [
        (
            "progressive",
            progressive.encode_rgb(&pixels, 32, 32).unwrap(),
        ),
        ("restart markers", add_restart_markers(&good).unwrap()),
        ("4:2:2", seeded_jpeg(32, 32, Sub2x1, 1, 90)),
        ("height 24 at 4:2:0", seeded_jpeg(32, 24, Sub2x2, 1, 90)),
        ("256×256", seeded_jpeg(256, 256, Sub2x2, 1, 90)),
        ("4 wide", seeded_jpeg(4, 16, Sub2x2, 1, 90)),
        ("bytes after EOI", trailing),
        ("a marker in the data", marker_inside),
    ];
    for (what, image) in &refused {
        assert_eq!(stack::Shape::of(image), Option::None, "{what}");
    }
    // Another quality: other tables, so not the stack's headers.
    let other_quality = seeded_jpeg(32, 32, Sub2x2, 4, 50);
    let same = seeded_jpeg(32, 32, Sub2x2, 5, 90);
    let mut decoder = Decoder::new();
    decoder.stack_clear();
    assert!(decoder.stack_offer(0, &good));
    assert!(!decoder.stack_offer(1, &other_quality));
    assert!(decoder.stack_offer(2, &same));
    assert_eq!(decoder.stack_decode(), 2);
    for (position, image) in [(0, &good), (2, &same)] {
        let mut out = Vec::new();
        decoder
            .decode_crop_stacked(position, &mut out, |_| Option::None)
            .unwrap();
        assert!(out == alone(image, |_| Option::None).unwrap().1);
    }
    assert_eq!(decoder.stack_counts(), (2, 2));
    // A position that holds no stacked image is an error, not another image's pixels.
    let mut out = Vec::new();
    assert!(
        decoder
            .decode_crop_stacked(1, &mut out, |_| Option::None)
            .is_err()
    );
    // The refused ones, offered after a good one, decode alone with their own pixels.
    let mut images = vec![good.clone()];
    images.extend(refused.iter().map(|(_, image)| image.clone()));
    let (results, _, used) = through_the_stack(&images, |_| Option::None);
    assert_eq!(used, 0, "one stackable image is no stack");
    for (image, result) in images.iter().zip(results) {
        match (result, alone(image, |_| Option::None)) {
            (Ok((c, pixels)), Ok((c0, expected))) => {
                assert_eq!(c, c0);
                assert!(pixels == expected);
            }
            (Err(e), Err(e0)) => assert_eq!(e, e0),
            (a, b) => panic!("stacked {:?}, alone {:?}", a.map(|r| r.0), b.map(|r| r.0)),
        }
    }
}

/// A plan that needs less than the whole image at full size (a DCT-scaled crop) decodes the
/// stacked image alone, as it would have been: same pixels and rectangle.
#[test]
fn a_stacked_image_whose_plan_wants_a_scaled_crop_decodes_alone() {
    let images: Vec<_> = (0..4)
        .map(|s| seeded_jpeg(128, 128, turbojpeg::Subsamp::Sub2x2, s, 90))
        .collect();
    let plan = |_: &ImageHeader| {
        Some(CropPlan {
            crop: Rect {
                left: 4.0,
                top: 6.0,
                width: 120.0,
                height: 120.0,
            },
            out_width: 24,
            out_height: 24,
            scaling: DctScaling::Antialiased,
        })
    };
    let (results, stacked, used) = through_the_stack(&images, plan);
    assert_eq!((stacked, used), (4, 0));
    for (image, result) in images.iter().zip(results) {
        let (c, pixels) = result.unwrap();
        let (c0, expected) = alone(image, plan).unwrap();
        assert_eq!(c, c0);
        assert!(c.width < 128, "decoded at a reduced scale");
        assert!(pixels == expected);
    }
}

/// Damage to one stacked image's data never changes another's pixels or an outcome: every
/// image gets exactly what it gets alone (its pixels, or its own error), whether the damage
/// broke the stack's decode (everything then decodes alone) or not.
#[test]
fn a_damaged_stacked_image_is_an_error_or_its_own_pixels_and_harms_no_other() {
    let images: Vec<_> = (0..6)
        .map(|s| seeded_jpeg(32, 32, turbojpeg::Subsamp::Sub2x2, s, 90))
        .collect();
    let data_at = images[2].len() - 300.min(images[2].len() / 3);
    let (mut broken_stacks, mut compared, mut errors) = (0, 0, 0);
    for at in (data_at..images[2].len()).step_by(3) {
        for value in [0x00, 0xFF, 0x7F, images[2][at] ^ 0x21] {
            let mut damaged = images.clone();
            damaged[2][at] = value;
            if at % 5 == 0 {
                damaged[2].truncate(at + 1);
            }
            let (results, stacked, _) = through_the_stack(&damaged, |_| Option::None);
            if stacked == 0 {
                broken_stacks += 1;
            }
            for (image, result) in damaged.iter().zip(results) {
                match (result, alone(image, |_| Option::None)) {
                    (Ok((_, pixels)), Ok((_, expected))) => {
                        assert!(pixels == expected, "byte {at} = {value:#x}");
                        compared += 1;
                    }
                    (Err(e), Err(e0)) => {
                        assert_eq!(e, e0);
                        errors += 1;
                    }
                    (a, b) => panic!(
                        "byte {at} = {value:#x}: stacked {:?}, alone {:?}",
                        a.map(|r| r.0),
                        b.map(|r| r.0)
                    ),
                }
            }
        }
    }
    assert!(
        broken_stacks > 10 && errors > 10 && compared > 1000,
        "{broken_stacks} broken stacks, {errors} errors, {compared} compared"
    );
}

/// A stack takes images until it would be taller than libjpeg decodes (65,500 rows) or its
/// planes would pass 4 MiB; the images after that decode alone, with the same pixels.
#[test]
fn a_full_stack_leaves_the_rest_to_decode_alone() {
    use turbojpeg::Subsamp::Sub2x2;
    // 63 × 1040 = 65,520 rows: past libjpeg's limit, under the frame header's.
    for ((w, h), count, fit) in [((8, 1040), 70, 62), ((128, 128), 200, 170)] {
        let images: Vec<_> = (0..count)
            .map(|s| seeded_jpeg(w, h, Sub2x2, s, 80))
            .collect();
        let (results, stacked, used) = through_the_stack(&images, |_| Option::None);
        assert_eq!((stacked, used), (fit, fit), "{w}×{h}");
        for (image, result) in images.iter().zip(results) {
            assert!(result.unwrap().1 == alone(image, |_| Option::None).unwrap().1);
        }
    }
}

/// Bytes of junk between an image's last MCU and its end (short enough that libjpeg may read
/// them ahead into its bit buffer): stacked, in the middle or last, the image has the outcome
/// it has alone.
#[test]
fn junk_after_a_stacked_images_data_gives_the_outcome_it_gives_alone() {
    use turbojpeg::Subsamp::*;
    let mut mismatches = Vec::new();
    let mut errors = 0;
    for (subsamp, w, h) in [
        (Gray, 64, 64),
        (None, 64, 64),
        (Sub2x2, 64, 64),
        (Sub2x2, 32, 32),
    ] {
        let images: Vec<_> = (0..4).map(|s| seeded_jpeg(w, h, subsamp, s, 95)).collect();
        for junk in 1..=12 {
            for (value, victim) in [(0x00u8, 1), (0x55, 3), (0xA3, 3), (0x00, 3)] {
                let mut damaged = images.clone();
                let n = damaged[victim].len();
                damaged[victim].splice(n - 2..n - 2, std::iter::repeat_n(value, junk));
                let (results, _, _) = through_the_stack(&damaged, |_| Option::None);
                for (position, (image, result)) in damaged.iter().zip(results).enumerate() {
                    let alone = alone(image, |_| Option::None);
                    match (&result, &alone) {
                        (Ok(a), Ok(b)) if a == b => {}
                        (Err(_), Err(_)) => errors += 1,
                        _ => mismatches.push(format!(
                            "{subsamp:?} {w}x{h} junk {junk}×{value:#x} in image {victim}: \
                             image {position} stacked ok {}, alone ok {}",
                            result.is_ok(),
                            alone.is_ok()
                        )),
                    }
                }
            }
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    assert!(errors > 0);
}

/// A full-size crop of a small image (a RandomResizedCrop of a Tiny-ImageNet-size image) is
/// resized from the whole decoded image, stacked or not: the same crop rectangle and pixels
/// either way, and the pixels are the whole decode's (as PIL crops after decoding).
#[test]
fn a_small_images_crop_comes_from_the_whole_image_stacked_or_alone() {
    let images: Vec<_> = (0..4)
        .map(|s| seeded_jpeg(64, 64, turbojpeg::Subsamp::Sub2x2, s, 90))
        .collect();
    let crop = Rect {
        left: 9.5,
        top: 17.25,
        width: 30.0,
        height: 21.0,
    };
    let plan = |_: &ImageHeader| {
        Some(CropPlan {
            crop,
            out_width: 56,
            out_height: 56,
            scaling: DctScaling::Antialiased,
        })
    };
    let (results, stacked, used) = through_the_stack(&images, plan);
    assert_eq!((stacked, used), (4, 4));
    for (image, result) in images.iter().zip(results) {
        let (c, pixels) = result.unwrap();
        let (c0, expected) = alone(image, plan).unwrap();
        assert_eq!(c, c0);
        assert_eq!((c.width, c.height, c.crop), (64, 64, crop));
        let mut whole = Vec::new();
        Decoder::new().decode_rgb(image, &mut whole).unwrap();
        assert!(pixels == expected && pixels == whole);
    }
}

/// `jpeg` without its segments with marker `marker` (before the first scan).
fn without_segments(jpeg: &[u8], marker: u8) -> Vec<u8> {
    let mut out = jpeg[..2].to_vec();
    let mut at = 2;
    while jpeg[at + 1] != 0xDA {
        let len = u16::from_be_bytes([jpeg[at + 2], jpeg[at + 3]]) as usize;
        if jpeg[at + 1] != marker {
            out.extend_from_slice(&jpeg[at..at + 2 + len]);
        }
        at += 2 + len;
    }
    out.extend_from_slice(&jpeg[at..]);
    out
}

/// libjpeg keeps tables from one image to the next in a decompressor: a file that uses tables
/// it does not define must decode as in a fresh decoder whatever came before it (found by
/// fuzzing the stack: such a file failed alone and decoded after another image).
#[test]
fn a_jpeg_missing_its_tables_decodes_as_alone_whatever_came_before() {
    use turbojpeg::Subsamp::*;
    let plain = seeded_jpeg(32, 32, Sub2x2, 1, 90);
    // Another image's tables in the handle first: other quantization (quality 40) and
    // optimized Huffman tables (the restart-marker rewrite optimizes them).
    let before = add_restart_markers(&seeded_jpeg(48, 32, Sub2x2, 2, 40)).unwrap();
    let no_dqt = without_segments(&plain, 0xDB);
    let no_dht = without_segments(&plain, 0xC4);
    assert!(tables::defines_its_tables(&plain));
    assert!(tables::defines_its_tables(&before));
    assert!(!tables::defines_its_tables(&no_dqt));
    assert!(!tables::defines_its_tables(&no_dht));
    let progressive = {
        let mut encoder = JpegEncoder::new(90, ChromaSubsampling::Half).unwrap();
        encoder.set_progressive(true).unwrap();
        encoder
            .encode_rgb(&vec![90u8; 40 * 24 * 3], 40, 24)
            .unwrap()
    };
    assert!(
        tables::defines_its_tables(&progressive),
        "tables between scans"
    );
    for (what, image) in [("no DQT", &no_dqt), ("no DHT", &no_dht)] {
        let mut fresh = Vec::new();
        let alone = Decoder::new().decode_rgb(image, &mut fresh).map(|_| ());
        let mut decoder = Decoder::new();
        let mut out = Vec::new();
        decoder.decode_rgb(&before, &mut out).unwrap();
        let after = decoder.decode_rgb(image, &mut out).map(|_| ());
        assert_eq!(after, alone, "{what}");
        if alone.is_ok() {
            assert!(out == fresh, "{what}: other pixels after another image");
        }
    }
    // Without DQT: an error alone. Without DHT: libjpeg's standard tables, which these are.
    let mut out = Vec::new();
    assert!(Decoder::new().decode_rgb(&no_dqt, &mut out).is_err());
    let mut expected = Vec::new();
    Decoder::new().decode_rgb(&plain, &mut expected).unwrap();
    Decoder::new().decode_rgb(&no_dht, &mut out).unwrap();
    assert!(out == expected);
}
