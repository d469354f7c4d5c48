//! What a payload may cost before it is decoded: the longest file an image of its declared
//! size can be, and whether a JPEG's bytes can code the blocks its header claims.

use image::ImageDecoder as _;

use super::image_crate::image_decoder;
use super::turbo::JpegHeader;
use super::{DEFAULT_MAX_PIXELS, DecodeError, PayloadFormat, RawImage};

/// The most bytes a file of some kind can sensibly take; see [`max_file_len`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileBound {
    /// The limit.
    pub bytes: u64,
    /// What the file was taken for (`"a 500x375 JPEG"`), for messages.
    pub what: String,
}

/// Room for metadata beside the pixels: EXIF, ICC profiles, XMP, thumbnails, text chunks.
pub(super) const METADATA_ALLOWANCE: u64 = 64 << 20;

/// The most bytes a file whose first bytes are `prefix` can take and still be an image of the
/// format and size its header declares: twice its pixels as 8-bit RGB for a JPEG (a JPEG at
/// quality 100 stays near 1 byte per sample), eight bytes per pixel for other formats (16-bit
/// RGBA, uncompressed), exactly the header and pixels for a raw payload, plus
/// a metadata allowance (`METADATA_ALLOWANCE`). When the size is not in `prefix`, the [`DEFAULT_MAX_PIXELS`] limit
/// stands in for it. `Err` says why `prefix` is not an image format at all.
///
/// What reads files of unknown content (an ImageFolder tree) uses this to refuse a file far
/// longer than any image could be before reading it whole.
pub fn max_file_len(prefix: &[u8]) -> Result<FileBound, String> {
    let format = PayloadFormat::sniff(prefix).ok_or("its first bytes are not an image format")?;
    let size = match format {
        PayloadFormat::Raw => {
            let at = |o: usize| {
                prefix
                    .get(o..o + 4)
                    .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            };
            let (w, h) = at(4)
                .zip(at(8))
                .ok_or("a raw payload cut inside its header")?;
            let bytes = (u64::from(w) * u64::from(h))
                .saturating_mul(3)
                .saturating_add(RawImage::HEADER_LEN as u64);
            return Ok(FileBound {
                bytes,
                what: format!("a {w}x{h} raw RGB payload"),
            });
        }
        PayloadFormat::Jpeg => jpeg_size(prefix),
        other => image_decoder(prefix, other, DEFAULT_MAX_PIXELS)
            .ok()
            .map(|d| d.dimensions()),
    };
    let (pixels, what) = match size {
        Some((w, h)) => (
            u64::from(w) * u64::from(h),
            format!("a {w}x{h} {}", format.name()),
        ),
        None => (
            DEFAULT_MAX_PIXELS,
            format!("a {} of at most {DEFAULT_MAX_PIXELS} pixels", format.name()),
        ),
    };
    let per_pixel = if format == PayloadFormat::Jpeg { 6 } else { 8 };
    Ok(FileBound {
        bytes: pixels
            .saturating_mul(per_pixel)
            .saturating_add(METADATA_ALLOWANCE),
        what,
    })
}

/// A JPEG's declared size from its frame header, when that lies within `prefix`: walks the
/// marker segments from SOI to the first SOFn.
fn jpeg_size(prefix: &[u8]) -> Option<(u32, u32)> {
    let mut at = 2; // after SOI
    loop {
        // Fill bytes (0xFF) may precede a marker.
        while prefix.get(at) == Some(&0xFF) && prefix.get(at + 1) == Some(&0xFF) {
            at += 1;
        }
        if prefix.get(at) != Some(&0xFF) {
            return None;
        }
        let marker = *prefix.get(at + 1)?;
        match marker {
            // Standalone markers: TEM, RSTn.
            0x01 | 0xD0..=0xD7 => at += 2,
            // SOS or EOI before any frame header: not a JPEG we can size.
            0xD9 | 0xDA => return None,
            // SOFn (not DHT, JPG or DAC): precision, height, width.
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) => {
                let h = u16::from_be_bytes([*prefix.get(at + 5)?, *prefix.get(at + 6)?]);
                let w = u16::from_be_bytes([*prefix.get(at + 7)?, *prefix.get(at + 8)?]);
                return Some((w.into(), h.into()));
            }
            _ => {
                let len = u16::from_be_bytes([*prefix.get(at + 2)?, *prefix.get(at + 3)?]);
                at += 2 + len as usize;
            }
        }
    }
}

/// Refuses a Huffman-coded JPEG whose declared size needs more 8×8 blocks than `len` bytes can
/// code. Every block of a sequential scan, and of a progressive file's first DC scan, costs at
/// least one bit; so does every sample of a lossless file. The first component has the largest
/// sampling factors when TurboJPEG knows the subsampling, so it has `⌈w/8⌉·⌈h/8⌉` blocks;
/// otherwise a component may be sampled down by up to 4 each way. Arithmetic-coding has no such
/// bound (libjpeg-turbo's memory limit covers it, see `turbo::buffer_memory_limit_mb`).
pub(super) fn jpeg_blocks_fit(header: &JpegHeader, len: usize) -> Result<(), DecodeError> {
    if header.arithmetic {
        return Ok(());
    }
    let block = if header.imcu_width.is_some() { 8 } else { 32 };
    let blocks = u64::from(header.width).div_ceil(block) * u64::from(header.height).div_ceil(block);
    if blocks > (len as u64).saturating_mul(8) {
        return Err(DecodeError::Implausible {
            width: header.width,
            height: header.height,
            blocks,
            bytes: len,
        });
    }
    Ok(())
}
