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

use image::ImageDecoder as _;

mod encode;
mod image_crate;
mod limits;
pub(crate) mod restart;
mod stack;
mod tables;
mod turbo;
mod ycc;

use image_crate::{decode_with_image_crate, image_decoder};
use limits::jpeg_blocks_fit;
pub use limits::{FileBound, max_file_len};

pub use encode::{ChromaSubsampling, EncodeError, JpegEncoder};

use crate::geometry::Rect;

use stack::{JpegStack, Shape};
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
    /// The image, padded as the transform says, is smaller than the window `RandomCrop` takes
    /// (torchvision raises; `pad_if_needed` pads it).
    #[error(
        "the image is {width}x{height} after padding, smaller than the {crop_width}x{crop_height} RandomCrop window (pad_if_needed pads it)"
    )]
    SmallerThanCrop {
        /// Padded width.
        width: u64,
        /// Padded height.
        height: u64,
        /// The window's width.
        crop_width: u32,
        /// The window's height.
        crop_height: u32,
    },
    /// The transform would resize the image to more pixels than allowed (a 20000x1 image under
    /// `Resize(1000)` is 20,000,000x1000: its allocation aborted the process).
    #[error(
        "{width}x{height} image resized to {to_width}x{to_height} would have more than {limit} pixels (max_pixels)"
    )]
    ResizedTooLarge {
        /// The image's width.
        width: u32,
        /// The image's height.
        height: u32,
        /// The width it would be resized to.
        to_width: u64,
        /// The height it would be resized to.
        to_height: u64,
        /// The limit in force.
        limit: u64,
    },
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
    /// The segments of a segmented JPEG that a crop needs, as a JPEG of their own
    /// ([`restart::RestartSegments::window_as_jpeg`]).
    rows: Vec<u8>,
    /// Small JPEGs decoded together ([`stack`]; [`Decoder::stack_offer`]).
    stack: JpegStack,
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

/// Whether a crop of this JPEG is decoded as a region of it. Not for small images (up to
/// [`stack::MAX_PIXELS`], CIFAR and Tiny-ImageNet sizes): a region saves them little, and the
/// crop is then resized from the whole decoded image exactly as PIL's decode-then-crop does
/// (a region's edges make the resize differ by up to a level), and the same whether or not the
/// image was decoded in a stack.
fn decodes_regions(jh: &JpegHeader) -> bool {
    jh.width as u64 * jh.height as u64 > stack::MAX_PIXELS as u64
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
            rows: Vec::new(),
            stack: JpegStack::default(),
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
        self.decode_planned(data, header, plan, out)
    }

    /// [`decode_crop`](Self::decode_crop) of the image stacked at `position`
    /// ([`stack_offer`](Self::stack_offer)), whose bytes the stack holds: its pixels come from
    /// the decoded stack when they are what the plan needs (the whole image at full size),
    /// otherwise it is decoded alone from those bytes.
    pub(crate) fn decode_crop_stacked(
        &mut self,
        position: usize,
        out: &mut Vec<u8>,
        plan: impl FnOnce(&ImageHeader) -> Option<CropPlan>,
    ) -> Result<CropDecoded, DecodeError> {
        let Some((header, jh)) = self.stack.member(position) else {
            return Err(DecodeError::Jpeg(format!(
                "no image was stacked at position {position}"
            )));
        };
        let plan = plan(&header);
        // A stacked image is small: never decoded as a region (`decodes_regions`), so the
        // stack's whole image is what a full-scale plan needs.
        debug_assert!(!decodes_regions(&jh));
        let whole = plan.is_none_or(|plan| dct_scale_for(&jh, &plan) == 8);
        if whole {
            self.stack.pixels(position, out);
            let crop = plan.map_or(Rect::full(header.width, header.height), |p| p.crop);
            return Ok(CropDecoded {
                header,
                width: header.width,
                height: header.height,
                crop,
            });
        }
        let mut data = std::mem::take(&mut self.rows);
        self.stack.bytes(position, &mut data);
        let result = self
            .probe(&data)
            .and_then(|header| self.decode_planned(&data, header, plan, out));
        self.rows = data;
        result
    }

    /// The rest of [`decode_crop`](Self::decode_crop) once `data`'s header is probed
    /// and the plan made.
    fn decode_planned(
        &mut self,
        data: &[u8],
        header: ImageHeader,
        plan: Option<CropPlan>,
        out: &mut Vec<u8>,
    ) -> Result<CropDecoded, DecodeError> {
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
        let region =
            if decodes_regions(&jh) && plan.crop.is_inside(jh.width as f64, jh.height as f64) {
                region_around(&jh, m, scaled_crop, &plan)
            } else {
                None
            };
        match region {
            Some(r) => {
                if !self.decompress_window(data, &jh, m, r, out)? {
                    self.decompress_rgb(data, &jh, m, Some(r), r.width, r.height, out)?;
                }
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

    /// For a JPEG whose restart markers cut its rows into segments (`pack-dataset
    /// --restart-rows`): decodes `region` (of the image at scale `eighths`/8) into `out` from
    /// only the segments around it, with one MCU of context on every side (chroma upsampling
    /// reads neighbouring samples), so the pixels equal those of a decode of the whole file.
    /// Returns false, having done nothing, for any other JPEG, or when the region needs every
    /// segment.
    fn decompress_window(
        &mut self,
        data: &[u8],
        jh: &JpegHeader,
        eighths: u32,
        region: Region,
        out: &mut Vec<u8>,
    ) -> Result<bool, DecodeError> {
        let Some(segments) = jh.segments else {
            return Ok(false);
        };
        let Some(window) =
            segments.window_for(eighths, (region.x, region.y, region.width, region.height))
        else {
            return Ok(false);
        };
        let mut jpeg = std::mem::take(&mut self.rows);
        let result = if segments.window_as_jpeg(data, window, &mut jpeg).is_none() {
            Ok(false)
        } else {
            let (left, top) = segments.origin(window, eighths);
            let within = Region {
                x: region.x - left,
                y: region.y - top,
                ..region
            };
            self.jpeg()
                .and_then(|turbo| turbo.read_header(&jpeg))
                .and_then(|window_jh| {
                    debug_assert_eq!(window_jh.imcu_width, jh.imcu_width);
                    self.decompress_rgb(
                        &jpeg,
                        &window_jh,
                        eighths,
                        Some(within),
                        region.width,
                        region.height,
                        out,
                    )
                })
                .map(|()| true)
        };
        self.rows = jpeg;
        result
    }

    /// Empties the stack of small JPEGs ([`stack_offer`](Self::stack_offer)).
    pub(crate) fn stack_clear(&mut self) {
        self.stack.clear();
    }

    /// Offers `data`, the image the caller will later decode as `position` (increasing from
    /// one offer to the next), to the stack: small JPEGs with the same headers as the stack's
    /// first are decoded together by [`stack_decode`](Self::stack_decode), and
    /// [`decode_crop_stacked`](Self::decode_crop_stacked) then takes their pixels from there. Says
    /// whether it was stacked; nothing is ever an error here (an image that is not stacked,
    /// or a damaged one, is decoded alone later). The stack keeps a copy of what it needs of
    /// `data`: a stacked image is later decoded by position alone
    /// ([`decode_crop_stacked`](Self::decode_crop_stacked)).
    pub(crate) fn stack_offer(&mut self, position: usize, data: &[u8]) -> bool {
        if !self.stack.has_group() {
            let Some(shape) = Shape::of(data) else {
                return false;
            };
            // What libjpeg-turbo makes of the first image's headers, which every member shares
            // byte for byte: its colour space, the pixel limit, the size.
            let Ok(header) = self.probe(data) else {
                return false;
            };
            let Some(jh) = self.last_jpeg.take() else {
                return false;
            };
            if !jh.ycc_or_gray || jh.cmyk || (jh.width, jh.height) != shape.size() {
                return false;
            }
            self.stack.start(data, shape, header, jh);
        }
        self.stack.push(position, data)
    }

    /// Whether the stack has no room for another image ([`JpegStack::is_full`]): the images
    /// after it go into the next stack.
    pub(crate) fn stack_is_full(&self) -> bool {
        self.stack.is_full()
    }

    /// Decodes the stacked images in one libjpeg-turbo call. Returns how many were stacked:
    /// 0 after any error or warning, when none of them is in the stack any more (the caller
    /// decodes each alone, and a damaged one gets its own error).
    pub(crate) fn stack_decode(&mut self) -> usize {
        if self.stack.counts().0 < 2 || self.jpeg().is_err() {
            self.stack.clear();
            return 0;
        }
        let turbo = self.jpeg.as_mut().expect("made above");
        match self.stack.decode(turbo) {
            Ok(()) => self.stack.counts().0,
            Err(_) => 0,
        }
    }

    /// Images stacked since the last [`stack_clear`](Self::stack_clear), and how many of them
    /// [`decode_crop_stacked`](Self::decode_crop_stacked) took from the stack.
    pub(crate) fn stack_counts(&self) -> (usize, usize) {
        self.stack.counts()
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

/// What [`Decoder::decode_batch_stacked`] gives for each image: the crop decode and its pixels.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) type StackedResult = Result<(CropDecoded, Vec<u8>), DecodeError>;

#[cfg(any(test, feature = "fuzzing"))]
impl Decoder {
    /// Decodes `images` as a worker decodes a batch (tests and fuzzing): every one offered to
    /// the stack at its position, the stack decoded, then each image taken from the stack when
    /// it was stacked and decoded alone otherwise, with `plan`. `stack_counts` says afterwards
    /// how many were stacked and taken from it.
    pub(crate) fn decode_batch_stacked(
        &mut self,
        images: &[impl AsRef<[u8]>],
        plan: impl Fn(&ImageHeader) -> Option<CropPlan>,
    ) -> Vec<StackedResult> {
        self.stack_clear();
        let offered: Vec<bool> = images
            .iter()
            .enumerate()
            .map(|(position, image)| self.stack_offer(position, image.as_ref()))
            .collect();
        let stacked = self.stack_decode();
        images
            .iter()
            .enumerate()
            .map(|(position, image)| {
                let mut out = Vec::new();
                if offered[position] && stacked > 0 {
                    self.decode_crop_stacked(position, &mut out, &plan)
                } else {
                    self.decode_crop(image.as_ref(), &mut out, &plan)
                }
                .map(|c| (c, out))
            })
            .collect()
    }
}

/// Rewrites a JPEG losslessly, its pixels unchanged, with restart markers that cut every MCU
/// row into segments about 32 pixels wide (and optimized Huffman tables), so that
/// [`Decoder::decode_crop`] Huffman-decodes only the segments around a crop instead of every
/// row above it and the whole width of its own rows: what `pack-dataset --restart-rows` stores. A progressive or arithmetic-coded file comes out baseline and Huffman-coded, with
/// the same pixels.
pub fn add_restart_markers(jpeg: &[u8]) -> Result<Vec<u8>, DecodeError> {
    turbo::add_restart_markers(jpeg)
}

/// Whether `jpeg` already has the restart markers [`add_restart_markers`] writes (any segment
/// width that divides its rows): rewriting it again would change nothing a crop uses.
pub fn has_restart_segments(jpeg: &[u8]) -> bool {
    restart::RestartSegments::parse(jpeg).is_some()
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

#[cfg(test)]
mod tests;
