//! Image decoding into caller-provided buffers.
//!
//! [`Decoder`] turns a payload into 8-bit RGB, `height × width × 3`, row-major:
//! - JPEG through libjpeg-turbo 3 (the `turbojpeg` crate). Any error or warning it reports, a
//!   premature end of data included, is an error here: a truncated file never becomes grey or
//!   garbage pixels. Grayscale JPEGs are expanded to RGB by libjpeg-turbo; CMYK and YCCK JPEGs are
//!   decoded to CMYK and converted the way PIL does (Adobe-inverted values, `r = c·k/255`), so
//!   the pixels match what torchvision users saw.
//! - PNG, BMP, PNM, TIFF and WebP through the `image` crate; alpha is dropped and 16-bit
//!   samples are reduced to 8 bits as PIL's `convert("RGB")` does (16-bit grayscale clipped to
//!   255, 16-bit colour to its high byte).
//! - Raw payloads ([`RawImage`]) are copied as they are.
//!
//! Every path reads the header first and refuses images over [`Decoder::max_pixels`] *before*
//! allocating, so a 60000×60000 header on a 1 KB file costs nothing. A JPEG whose header claims
//! more 8×8 blocks than its bytes can code is refused the same way ([`DecodeError::Implausible`]),
//! and libjpeg-turbo's whole-image buffers are capped in proportion to the file's size, so a 7 KB
//! progressive file claiming 13000×13000 pixels costs no more than a real 7 KB image.
//!
//! After any libjpeg-turbo error the handle is replaced (see `turbo`): one corrupt file never
//! changes how the files after it decode.
//!
//! A `Decoder` holds a libjpeg-turbo handle, which is `Send` but not `Sync`: make one per worker.

use std::io::Cursor;

use image::ImageDecoder as _;

mod encode;
mod turbo;

pub use encode::{ChromaSubsampling, EncodeError, JpegEncoder};

use crate::geometry::Rect;

use turbo::{JpegHeader, Region, Turbo};

/// PIL refuses images over twice its `MAX_IMAGE_PIXELS` (89,478,485) as decompression bombs; we
/// use the same limit so that what opens in torchvision opens here.
pub const DEFAULT_MAX_PIXELS: u64 = 2 * 89_478_485;

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload has no bytes.
    #[error("empty file (0 bytes)")]
    Empty,
    /// The payload is not in any format we decode.
    #[error("not a recognized image format (starts with {0})")]
    UnknownFormat(String),
    /// The header declares more pixels than allowed.
    #[error("{width}x{height} image has more than {limit} pixels (decompression-bomb limit)")]
    TooLarge {
        /// Declared width.
        width: u64,
        /// Declared height.
        height: u64,
        /// The limit in force.
        limit: u64,
    },
    /// The header declares a zero-sized image.
    #[error("image has zero width or height")]
    ZeroSized,
    /// A Huffman-coded JPEG whose header declares more 8×8 blocks than its bytes can code (at
    /// least one bit each): a truncated file, or one made to make the decoder allocate.
    #[error(
        "{width}x{height} JPEG needs at least one bit per 8x8 block ({blocks} blocks) but has only {bytes} bytes: truncated, or a decompression bomb"
    )]
    Implausible {
        /// Declared width.
        width: u32,
        /// Declared height.
        height: u32,
        /// The fewest blocks the declared size implies.
        blocks: u64,
        /// The file's length.
        bytes: usize,
    },
    /// libjpeg-turbo reported an error or warning.
    #[error("JPEG: {0}")]
    Jpeg(String),
    /// The `image` crate reported an error.
    #[error("{format}: {reason}")]
    Image {
        /// The format that was being decoded.
        format: &'static str,
        /// The decoder's message.
        reason: String,
    },
    /// A raw payload's header does not match its length.
    #[error("raw RGB payload: {0}")]
    BadRaw(String),
}

/// The container format of a payload, from its leading bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadFormat {
    /// JPEG (JFIF/EXIF), decoded with libjpeg-turbo.
    Jpeg,
    /// PNG.
    Png,
    /// Windows bitmap.
    Bmp,
    /// PBM/PGM/PPM.
    Pnm,
    /// TIFF.
    Tiff,
    /// WebP.
    WebP,
    /// A [`RawImage`] payload.
    Raw,
}

impl PayloadFormat {
    /// Recognizes a payload by its magic bytes, or `None`.
    pub fn sniff(data: &[u8]) -> Option<PayloadFormat> {
        if data.starts_with(RawImage::MAGIC) {
            return Some(PayloadFormat::Raw);
        }
        if data.starts_with(&[0xFF, 0xD8, 0xFF]) {
            return Some(PayloadFormat::Jpeg);
        }
        match image::guess_format(data).ok()? {
            image::ImageFormat::Png => Some(PayloadFormat::Png),
            image::ImageFormat::Bmp => Some(PayloadFormat::Bmp),
            image::ImageFormat::Pnm => Some(PayloadFormat::Pnm),
            image::ImageFormat::Tiff => Some(PayloadFormat::Tiff),
            image::ImageFormat::WebP => Some(PayloadFormat::WebP),
            image::ImageFormat::Jpeg => Some(PayloadFormat::Jpeg),
            _ => None,
        }
    }

    /// Lower-case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            PayloadFormat::Jpeg => "jpeg",
            PayloadFormat::Png => "png",
            PayloadFormat::Bmp => "bmp",
            PayloadFormat::Pnm => "pnm",
            PayloadFormat::Tiff => "tiff",
            PayloadFormat::WebP => "webp",
            PayloadFormat::Raw => "raw-rgb8",
        }
    }
}

/// What a header says about an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Container format.
    pub format: PayloadFormat,
}

impl ImageHeader {
    /// Bytes of the decoded RGB image: `width × height × 3`.
    pub fn rgb_len(&self) -> usize {
        self.width as usize * self.height as usize * 3
    }
}

/// The raw payload layout: decoded pixels stored so that training skips decoding.
///
/// ```text
/// offset 0   4 bytes  magic "RGB8"
/// offset 4   u32 LE   width
/// offset 8   u32 LE   height
/// offset 12  width × height × 3 bytes, RGB, row-major, no padding
/// ```
pub struct RawImage;

impl RawImage {
    /// The leading bytes of every raw payload.
    pub const MAGIC: &'static [u8; 4] = b"RGB8";
    /// Bytes before the pixels.
    pub const HEADER_LEN: usize = 12;

    /// Builds a raw payload. Panics if `pixels.len() != width × height × 3` (a caller bug).
    pub fn encode(width: u32, height: u32, pixels: &[u8]) -> Vec<u8> {
        assert_eq!(pixels.len(), width as usize * height as usize * 3);
        let mut out = Vec::with_capacity(Self::HEADER_LEN + pixels.len());
        Self::start(&mut out, width, height);
        out.extend_from_slice(pixels);
        out
    }

    /// Clears `out` and writes a raw payload's header into it; the caller appends the
    /// `width × height × 3` pixel bytes (this lets a reader reuse one buffer per sample).
    pub fn start(out: &mut Vec<u8>, width: u32, height: u32) {
        out.clear();
        out.extend_from_slice(Self::MAGIC);
        out.extend_from_slice(&width.to_le_bytes());
        out.extend_from_slice(&height.to_le_bytes());
    }

    /// Splits a raw payload into its size and pixels, checking the length.
    pub fn parse(data: &[u8]) -> Result<(u32, u32, &[u8]), DecodeError> {
        if data.len() < Self::HEADER_LEN || !data.starts_with(Self::MAGIC) {
            return Err(DecodeError::BadRaw("missing RGB8 header".into()));
        }
        let width = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes"));
        let height = u32::from_le_bytes(data[8..12].try_into().expect("4 bytes"));
        let pixels = &data[Self::HEADER_LEN..];
        // 3·w·h overflows u64 for the largest sizes (found by fuzzing): checked, not wrapped.
        let expected = (width as u64 * height as u64).checked_mul(3);
        if expected != Some(pixels.len() as u64) {
            return Err(DecodeError::BadRaw(format!(
                "header says {width}x{height} ({} bytes) but {} bytes follow",
                expected.map_or("over 2^64".into(), |e| e.to_string()),
                pixels.len()
            )));
        }
        Ok((width, height, pixels))
    }
}

/// Decodes payloads to RGB. One per worker thread.
pub struct Decoder {
    jpeg: Option<Turbo>,
    /// The header `probe` just read into the JPEG handle, and for which bytes.
    last_jpeg: Option<JpegHeader>,
    max_pixels: u64,
    cmyk: Vec<u8>,
}

/// How far [`Decoder::decode_crop`] may shrink a JPEG in the DCT domain (decoding at M/8 of its
/// size) before the crop is resized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DctScaling {
    /// Never: decode at full size, as PIL does for torchvision (whose `resize` does not use
    /// libjpeg's scaling). Pixels within one level of torchvision's.
    Off,
    /// The smallest scale M/8 (M = 1..8) at which the crop still covers the output: the least
    /// decoding. A scaled IDCT is no antialiasing filter, though: fine periodic texture (a
    /// fence, fabric) aliases, up to 20 levels from torchvision on average over an image; and
    /// libjpeg-turbo has SIMD code only for M = 1, 2, 4, 8, so 3/8, 5/8, 6/8 and 7/8 decode
    /// slower than a full decode.
    Smallest,
    /// The smallest of the SIMD scales (1/8, 1/4, 1/2) at which the crop is still at least
    /// twice the output, so the antialiased resize that follows does the low-pass filtering:
    /// ImageNet photos' eval crops within one level of torchvision's on 99.96% of values (against
    /// 57.5% with [`Smallest`](Self::Smallest)), at the same speed or faster (bench/RESULTS.md).
    #[default]
    Antialiased,
}

/// The DCT scale M (decoding at M/8 of full size) `scaling` picks for `plan`'s crop; 8 (full
/// size) when no smaller one qualifies.
fn dct_scale_for(jh: &JpegHeader, plan: &CropPlan) -> u32 {
    let (margin, simd_only) = match plan.scaling {
        DctScaling::Off => return 8,
        DctScaling::Smallest => (1.0, false),
        DctScaling::Antialiased => (2.0, true),
    };
    let crop = plan.crop;
    let min_w = (margin * plan.out_width as f64 * jh.width as f64 / crop.width).ceil();
    let min_h = (margin * plan.out_height as f64 * jh.height as f64 / crop.height).ceil();
    (1..=8u32)
        .filter(|m| !simd_only || m.is_power_of_two())
        .find(|&m| {
            turbo::scaled(jh.width, m) as f64 >= min_w
                && turbo::scaled(jh.height, m) as f64 >= min_h
        })
        .unwrap_or(8)
}

/// The region to decode at scale `m` for `scaled_crop` (the crop in scaled pixels, inside the
/// image): the crop plus a margin for the resampling filter's support, aligned as TurboJPEG
/// requires. `None` when the region would be the whole scaled image, or the subsampling is
/// unknown: decode everything then.
fn region_around(jh: &JpegHeader, m: u32, scaled_crop: Rect, plan: &CropPlan) -> Option<Region> {
    let (sw, sh) = (turbo::scaled(jh.width, m), turbo::scaled(jh.height, m));
    let margin = (scaled_crop.width / plan.out_width as f64)
        .max(scaled_crop.height / plan.out_height as f64)
        .ceil() as u32
        + 2;
    let x0 = (scaled_crop.left.floor() as u32).saturating_sub(margin);
    let y0 = (scaled_crop.top.floor() as u32).saturating_sub(margin);
    let x1 = ((scaled_crop.left + scaled_crop.width).ceil() as u32 + margin).min(sw);
    let y1 = ((scaled_crop.top + scaled_crop.height).ceil() as u32 + margin).min(sh);
    turbo::aligned_region(jh, m, x0, y0, x1 - x0, y1 - y0)
        .map(|(region, _)| region)
        .filter(|r| (r.width, r.height) != (sw, sh))
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

/// How to decode an image that will be cropped to `crop` (in full-size pixels) and resized to
/// `out_width × out_height`; see [`Decoder::decode_crop`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CropPlan {
    /// The crop in full-size source pixels. It may extend past the image (a padded center
    /// crop); then the whole image is decoded.
    pub crop: Rect,
    /// Width the crop will be resized to.
    pub out_width: u32,
    /// Height the crop will be resized to.
    pub out_height: u32,
    /// How far a JPEG may be shrunk in the DCT domain first.
    pub scaling: DctScaling,
}

/// The result of [`Decoder::decode_crop`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CropDecoded {
    /// The full-size image's header.
    pub header: ImageHeader,
    /// Width of the decoded buffer.
    pub width: u32,
    /// Height of the decoded buffer.
    pub height: u32,
    /// The crop in the decoded buffer's pixels.
    pub crop: Rect,
}

impl Decoder {
    /// A decoder with the default pixel limit ([`DEFAULT_MAX_PIXELS`]). The libjpeg-turbo handle
    /// is created on the first JPEG.
    pub fn new() -> Self {
        Decoder {
            jpeg: None,
            last_jpeg: None,
            max_pixels: DEFAULT_MAX_PIXELS,
            cmyk: Vec::new(),
        }
    }

    /// Sets the largest `width × height` accepted; larger images fail with
    /// [`DecodeError::TooLarge`] before any pixel memory is allocated.
    pub fn with_max_pixels(mut self, max_pixels: u64) -> Self {
        self.max_pixels = max_pixels;
        self
    }

    /// The pixel limit in force.
    pub fn max_pixels(&self) -> u64 {
        self.max_pixels
    }

    fn jpeg(&mut self) -> Result<&mut Turbo, DecodeError> {
        if self.jpeg.is_none() {
            self.jpeg = Some(Turbo::new()?);
        }
        Ok(self.jpeg.as_mut().expect("just set"))
    }

    fn check_size(&self, width: u64, height: u64) -> Result<(), DecodeError> {
        if width == 0 || height == 0 {
            return Err(DecodeError::ZeroSized);
        }
        if width.saturating_mul(height) > self.max_pixels {
            return Err(DecodeError::TooLarge {
                width,
                height,
                limit: self.max_pixels,
            });
        }
        Ok(())
    }

    /// Reads the header only: size and format. Applies the pixel limit.
    pub fn header(&mut self, data: &[u8]) -> Result<ImageHeader, DecodeError> {
        self.probe(data)
    }

    /// Reads the header (for a JPEG, into the handle, ready for one decompression of the same
    /// bytes: libjpeg-turbo then does not parse it again) and applies the pixel limit.
    fn probe(&mut self, data: &[u8]) -> Result<ImageHeader, DecodeError> {
        self.last_jpeg = None;
        let format = sniff_or_explain(data)?;
        let (width, height) = match format {
            PayloadFormat::Raw => {
                let (w, h, _) = RawImage::parse(data)?;
                (w as u64, h as u64)
            }
            PayloadFormat::Jpeg => {
                let header = self.jpeg()?.read_header(data)?;
                self.last_jpeg = Some(header);
                (header.width as u64, header.height as u64)
            }
            other => {
                let decoder = image_decoder(data, other, self.max_pixels)?;
                let (w, h) = decoder.dimensions();
                (w as u64, h as u64)
            }
        };
        self.check_size(width, height)?;
        if let Some(jpeg) = &self.last_jpeg {
            jpeg_blocks_fit(jpeg, data.len())?;
        }
        Ok(ImageHeader {
            width: width as u32,
            height: height as u32,
            format,
        })
    }

    /// Checks that `data` decodes completely, as cheaply as possible, without producing pixels.
    ///
    /// JPEGs are decoded at 1/8 scale: libjpeg-turbo still entropy-decodes every block, so a
    /// truncated file or corrupt data fails exactly as a full decode would, but most of the
    /// inverse DCT, upsampling and colour conversion is skipped. Other formats decode fully.
    pub fn validate(&mut self, data: &[u8]) -> Result<ImageHeader, DecodeError> {
        let header = self.probe(data)?;
        match header.format {
            PayloadFormat::Raw => Ok(header),
            PayloadFormat::Jpeg => {
                let jh = self.last_jpeg.take().expect("probe read the JPEG header");
                let mut scratch = std::mem::take(&mut self.cmyk);
                let channels = if jh.cmyk { 4 } else { 3 };
                scratch.resize(
                    turbo::scaled(jh.width, 1) as usize
                        * turbo::scaled(jh.height, 1) as usize
                        * channels,
                    0,
                );
                let result = self.jpeg()?.decompress(data, &jh, 1, None, &mut scratch);
                self.cmyk = scratch;
                result.map(|()| header)
            }
            other => decode_with_image_crate(data, other, self.max_pixels).map(|_| header),
        }
    }

    /// Decodes `data` into `out`, resizing it to `width × height × 3` (its capacity is reused).
    pub fn decode_rgb(
        &mut self,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ImageHeader, DecodeError> {
        self.decode_crop(data, out, |_| None).map(|d| d.header)
    }

    /// Decodes `data` into `out` at the smallest size that is still at least
    /// `min_width × min_height`, and returns that size (in the header).
    ///
    /// For JPEG this uses libjpeg-turbo's DCT-domain scaling (factors M/8, M = 1..8), which skips
    /// most of the work for pixels that would be thrown away by a later downscale; the result is
    /// `ceil(width·M/8) × ceil(height·M/8)`. Other formats decode at full size. Pass
    /// `(0, 0)` for the smallest size, `(u32::MAX, u32::MAX)` for full size.
    pub fn decode_rgb_reduced(
        &mut self,
        data: &[u8],
        min_width: u32,
        min_height: u32,
        out: &mut Vec<u8>,
    ) -> Result<ImageHeader, DecodeError> {
        // A whole-image "crop" resized to the minimum size: decode_crop picks the scale.
        let decoded = self.decode_crop(data, out, |h| {
            Some(CropPlan {
                crop: Rect::full(h.width, h.height),
                out_width: min_width,
                out_height: min_height,
                scaling: DctScaling::Smallest,
            })
        })?;
        Ok(ImageHeader {
            width: decoded.width,
            height: decoded.height,
            format: decoded.header.format,
        })
    }

    /// Decodes just enough of `data` for a crop that will be resized: `plan` sees the full-size
    /// header (parsed once) and returns the crop and output size, or `None` for a plain full
    /// decode. For JPEG, the image is decoded at the smallest DCT scale M/8 whose crop still
    /// covers the output resolution, and only the rows and (iMCU-aligned) columns around the crop
    /// are decoded. Other formats decode fully. The returned crop is in the decoded buffer's
    /// pixels.
    pub fn decode_crop(
        &mut self,
        data: &[u8],
        out: &mut Vec<u8>,
        plan: impl FnOnce(&ImageHeader) -> Option<CropPlan>,
    ) -> Result<CropDecoded, DecodeError> {
        let header = self.probe(data)?;
        let plan = plan(&header);
        let whole = |header: ImageHeader, crop| CropDecoded {
            header,
            width: header.width,
            height: header.height,
            crop,
        };
        match header.format {
            PayloadFormat::Jpeg => {}
            PayloadFormat::Raw => {
                let (_, _, pixels) = RawImage::parse(data)?;
                out.clear();
                out.extend_from_slice(pixels);
                let crop = plan.map_or(Rect::full(header.width, header.height), |p| p.crop);
                return Ok(whole(header, crop));
            }
            other => {
                *out = decode_with_image_crate(data, other, self.max_pixels)?;
                let crop = plan.map_or(Rect::full(header.width, header.height), |p| p.crop);
                return Ok(whole(header, crop));
            }
        }
        let jh = self.last_jpeg.take().expect("probe read the JPEG header");
        let Some(plan) = plan else {
            self.decompress_rgb(data, &jh, 8, None, jh.width, jh.height, out)?;
            return Ok(whole(header, Rect::full(header.width, header.height)));
        };
        let m = dct_scale_for(&jh, &plan);
        let (sw, sh) = (turbo::scaled(jh.width, m), turbo::scaled(jh.height, m));
        let (fx, fy) = (sw as f64 / jh.width as f64, sh as f64 / jh.height as f64);
        let scaled_crop = plan.crop.scaled(fx, fy);
        let region = if plan.crop.is_inside(jh.width as f64, jh.height as f64) {
            region_around(&jh, m, scaled_crop, &plan)
        } else {
            None
        };
        match region {
            Some(r) => {
                self.decompress_rgb(data, &jh, m, Some(r), r.width, r.height, out)?;
                Ok(CropDecoded {
                    header,
                    width: r.width,
                    height: r.height,
                    crop: scaled_crop.relative_to(r.x as f64, r.y as f64),
                })
            }
            None => {
                self.decompress_rgb(data, &jh, m, None, sw, sh, out)?;
                Ok(CropDecoded {
                    header,
                    width: sw,
                    height: sh,
                    crop: scaled_crop,
                })
            }
        }
    }

    /// Decompresses into `out` as `w × h` RGB (through the CMYK scratch buffer for CMYK files).
    #[allow(clippy::too_many_arguments)]
    fn decompress_rgb(
        &mut self,
        data: &[u8],
        jh: &JpegHeader,
        eighths: u32,
        region: Option<Region>,
        w: u32,
        h: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), DecodeError> {
        let pixels = w as usize * h as usize;
        out.resize(pixels * 3, 0);
        if jh.cmyk {
            let mut cmyk = std::mem::take(&mut self.cmyk);
            cmyk.resize(pixels * 4, 0);
            let result = self
                .jpeg()?
                .decompress(data, jh, eighths, region, &mut cmyk);
            if result.is_ok() {
                cmyk_to_rgb(&cmyk, out);
            }
            self.cmyk = cmyk;
            result
        } else {
            self.jpeg()?.decompress(data, jh, eighths, region, out)
        }
    }

    /// Decodes `data` into `out`, which must be exactly `header(data).rgb_len()` bytes: the path
    /// for writing straight into a batch slot.
    ///
    /// # Panics
    /// When `out` has the wrong length (read the header first).
    pub fn decode_rgb_into(
        &mut self,
        data: &[u8],
        out: &mut [u8],
    ) -> Result<ImageHeader, DecodeError> {
        let header = self.probe(data)?;
        assert_eq!(
            out.len(),
            header.rgb_len(),
            "output buffer does not match the image size {}x{}",
            header.width,
            header.height
        );
        match header.format {
            PayloadFormat::Raw => out.copy_from_slice(RawImage::parse(data)?.2),
            PayloadFormat::Jpeg => {
                let jh = self.last_jpeg.take().expect("probe read the JPEG header");
                if jh.cmyk {
                    let mut rgb = Vec::new();
                    self.decompress_rgb(data, &jh, 8, None, jh.width, jh.height, &mut rgb)?;
                    out.copy_from_slice(&rgb);
                } else {
                    self.jpeg()?.decompress(data, &jh, 8, None, out)?;
                }
            }
            other => out.copy_from_slice(&decode_with_image_crate(data, other, self.max_pixels)?),
        }
        Ok(header)
    }
}

/// The most bytes a file of some kind can sensibly take; see [`max_file_len`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileBound {
    /// The limit.
    pub bytes: u64,
    /// What the file was taken for (`"a 500x375 JPEG"`), for messages.
    pub what: String,
}

/// Room for metadata beside the pixels: EXIF, ICC profiles, XMP, thumbnails, text chunks.
const METADATA_ALLOWANCE: u64 = 64 << 20;

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
fn jpeg_blocks_fit(header: &JpegHeader, len: usize) -> Result<(), DecodeError> {
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

/// Converts Adobe-inverted CMYK (what Photoshop and libjpeg write, and PIL assumes) to RGB.
fn cmyk_to_rgb(cmyk: &[u8], rgb: &mut [u8]) {
    for (src, dst) in cmyk.chunks_exact(4).zip(rgb.chunks_exact_mut(3)) {
        let k = src[3] as u32;
        for c in 0..3 {
            dst[c] = ((src[c] as u32 * k + 127) / 255) as u8;
        }
    }
}

fn sniff_or_explain(data: &[u8]) -> Result<PayloadFormat, DecodeError> {
    if data.is_empty() {
        return Err(DecodeError::Empty);
    }
    PayloadFormat::sniff(data).ok_or_else(|| DecodeError::UnknownFormat(describe_prefix(data)))
}

/// Shows the first bytes of an unknown payload: as text when it is printable, else as hex.
fn describe_prefix(data: &[u8]) -> String {
    let head = &data[..data.len().min(8)];
    if head.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!("text {:?}", String::from_utf8_lossy(head))
    } else {
        let hex: Vec<String> = head.iter().map(|b| format!("{b:02x}")).collect();
        format!("bytes {}", hex.join(" "))
    }
}

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
fn image_decoder(
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

fn decode_with_image_crate(
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

#[cfg(test)]
mod tests {
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
        let image = turbojpeg::Image {
            pixels: pixels.as_slice(),
            width: w as usize,
            pitch: w as usize * 3,
            height: h as usize,
            format: turbojpeg::PixelFormat::RGB,
        };
        turbojpeg::compress(image, 90, turbojpeg::Subsamp::Sub2x2)
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
}
