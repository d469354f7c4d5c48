//! PNG, BMP, PNM, TIFF and WebP through the `image` crate, with its allocations bounded and
//! its 8-bit conversion made PIL's.

use std::io::Cursor;

use image::ImageDecoder as _;

use super::{DecodeError, PayloadFormat};

fn image_format(format: PayloadFormat) -> image::ImageFormat {
    match format {
        PayloadFormat::Png => image::ImageFormat::Png,
        PayloadFormat::Bmp => image::ImageFormat::Bmp,
        PayloadFormat::Pnm => image::ImageFormat::Pnm,
        PayloadFormat::Tiff => image::ImageFormat::Tiff,
        PayloadFormat::WebP => image::ImageFormat::WebP,
        PayloadFormat::Jpeg | PayloadFormat::Raw => unreachable!("decoded without the image crate"),
    }
}

fn image_error(format: PayloadFormat, e: image::ImageError) -> DecodeError {
    DecodeError::Image {
        format: format.name(),
        reason: e.to_string(),
    }
}

/// Refuses a TIFF whose first directory has an entry, among those the decoder reads, claiming
/// more values than the file holds.
///
/// The tiff crate sizes a value list from the entry's count before reading it (up to 256 MiB
/// for a 200-byte file, found by fuzzing), and the image crate applies its allocation limits only
/// after that first directory is read. A value list that is not inline must lie inside the file,
/// which bounds that allocation by the file's size. Tags the decoder never reads (a private tag,
/// XMP, an ICC profile) are not looked at: a dangling one does not stop a file from decoding.
/// (BigTIFF is not recognised as TIFF by `PayloadFormat::sniff`, so only classic TIFF is here.)
fn check_tiff_directory(data: &[u8]) -> Result<(), DecodeError> {
    /// The tags tiff 0.10 and the image crate read while decoding an image.
    const READ_TAGS: [u16; 21] = [
        255, 256, 257, 258, 259, 262, 273, 277, 278, 279, 284, 317, 322, 323, 324, 325, 330, 339,
        347, 0x8769, 0x8825,
    ];
    let little = match data.get(..4) {
        Some(b"II*\0") => true,
        Some(b"MM\0*") => false,
        _ => return Ok(()), // not classic TIFF: the decoder says what it is
    };
    // An unsigned integer of `n` bytes at `offset`, in the file's byte order.
    let uint_at = |offset: u64, n: usize| -> Option<u64> {
        let start = usize::try_from(offset).ok()?;
        let bytes = data.get(start..start.checked_add(n)?)?;
        let fold = |v: u64, &b: &u8| v << 8 | u64::from(b);
        Some(if little {
            bytes.iter().rev().fold(0, fold)
        } else {
            bytes.iter().fold(0, fold)
        })
    };
    let Some(ifd) = uint_at(4, 4) else {
        return Ok(());
    };
    let Some(entries) = uint_at(ifd, 2) else {
        return Ok(());
    };
    for i in 0..entries {
        let at = ifd + 2 + i * 12;
        let (Some(tag), Some(kind), Some(count), Some(offset)) = (
            uint_at(at, 2),
            uint_at(at + 2, 2),
            uint_at(at + 4, 4),
            uint_at(at + 8, 4),
        ) else {
            break;
        };
        if !READ_TAGS.contains(&(tag as u16)) {
            continue;
        }
        let size = match kind {
            1 | 2 | 6 | 7 => 1,
            3 | 8 => 2,
            4 | 9 | 11 | 13 => 4,
            5 | 10 | 12 | 16 | 17 | 18 => 8,
            _ => continue,
        };
        let bytes = count * size;
        if bytes > 4 && offset + bytes > data.len() as u64 {
            return Err(DecodeError::Image {
                format: "tiff",
                reason: format!(
                    "directory entry {i} (tag {tag}) claims {count} values ({bytes} bytes at \
                     offset {offset}) in a {}-byte file",
                    data.len()
                ),
            });
        }
    }
    Ok(())
}

/// The image crate's decoder for `data`, allocating no more than an RGBA16 image of
/// `max_pixels` pixels needs (its decoders size buffers from header fields such as TIFF strip
/// lengths, which can claim far more than the image's dimensions).
pub(super) fn image_decoder(
    data: &[u8],
    format: PayloadFormat,
    max_pixels: u64,
) -> Result<impl image::ImageDecoder + '_, DecodeError> {
    if format == PayloadFormat::Tiff {
        check_tiff_directory(data)?;
    }
    let mut reader = image::ImageReader::with_format(Cursor::new(data), image_format(format));
    let mut limits = image::Limits::default();
    // RGBA16 at the pixel limit, plus room for the directory values the TIFF decoder is allowed
    // beside the image (it gives them what the image leaves of this limit).
    limits.max_alloc = Some(max_pixels.saturating_mul(8).saturating_add(16 << 20));
    reader.limits(limits);
    reader.into_decoder().map_err(|e| image_error(format, e))
}

pub(super) fn decode_with_image_crate(
    data: &[u8],
    format: PayloadFormat,
    max_pixels: u64,
) -> Result<Vec<u8>, DecodeError> {
    let decoder = image_decoder(data, format, max_pixels)?;
    let (w, h) = decoder.dimensions();
    if (w as u64) * (h as u64) > max_pixels {
        return Err(DecodeError::TooLarge {
            width: w as u64,
            height: h as u64,
            limit: max_pixels,
        });
    }
    let image = image::DynamicImage::from_decoder(decoder).map_err(|e| image_error(format, e))?;
    Ok(rgb8_as_pil_converts(image))
}

/// `image` in 8-bit RGB the way PIL's `Image.open(...).convert("RGB")` gives it, so pixels
/// match what torchvision users saw: 16-bit grayscale opens in PIL as a 16-bit integer image
/// (`I;16`), whose conversion clips each value to 255 (it does not scale); 16-bit colour and
/// grayscale-with-alpha open as 8-bit by keeping each sample's high byte. (The `image` crate's
/// own conversion rounds `v / 257` for both.) Alpha is dropped. Other depths convert as the
/// `image` crate does, which is what PIL does for them.
fn rgb8_as_pil_converts(image: image::DynamicImage) -> Vec<u8> {
    use image::DynamicImage as D;
    let high = |v: u16| (v >> 8) as u8;
    match image {
        D::ImageLuma16(gray) => gray
            .into_raw()
            .into_iter()
            .flat_map(|v| [v.min(255) as u8; 3])
            .collect(),
        D::ImageLumaA16(gray) => gray.pixels().flat_map(|p| [high(p[0]); 3]).collect(),
        D::ImageRgb16(rgb) => rgb.into_raw().into_iter().map(high).collect(),
        D::ImageRgba16(rgba) => rgba
            .pixels()
            .flat_map(|p| [high(p[0]), high(p[1]), high(p[2])])
            .collect(),
        other => other.into_rgb8().into_raw(),
    }
}
