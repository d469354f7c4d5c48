//! Decoding the fixture edge cases: unusual-but-valid files come out as RGB close to the
//! generator's pixels; broken ones fail with the right reason.

mod support;

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
