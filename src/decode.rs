//! Image decoding into caller-provided buffers.
//!
//! [`Decoder`] turns a payload into 8-bit RGB, `height × width × 3`, row-major:
//! - JPEG through libjpeg-turbo 3 (the `turbojpeg` crate). Any error or warning it reports, a
//!   premature end of data included, is an error here: a truncated file never becomes grey or
//!   garbage pixels. Grayscale JPEGs are expanded to RGB by libjpeg-turbo; CMYK and YCCK JPEGs are
//!   decoded to CMYK and converted the way PIL does (Adobe-inverted values, `r = c·k/255`), so
//!   the pixels match what torchvision users saw.
//! - PNG, BMP, PNM, TIFF and WebP through the `image` crate; alpha is dropped (as PIL's
//!   `convert("RGB")` does) and 16-bit samples are reduced to 8 bits.
//! - Raw payloads ([`RawImage`]) are copied as they are.
//!
//! Every path reads the header first and refuses images over [`Decoder::max_pixels`] *before*
//! allocating, so a 60000×60000 header on a 1 KB file costs nothing.
//!
//! A `Decoder` holds a libjpeg-turbo handle, which is `Send` but not `Sync`: make one per worker.

use std::io::Cursor;

use image::ImageDecoder as _;

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
        out.extend_from_slice(Self::MAGIC);
        out.extend_from_slice(&width.to_le_bytes());
        out.extend_from_slice(&height.to_le_bytes());
        out.extend_from_slice(pixels);
        out
    }

    /// Splits a raw payload into its size and pixels, checking the length.
    pub fn parse(data: &[u8]) -> Result<(u32, u32, &[u8]), DecodeError> {
        if data.len() < Self::HEADER_LEN || !data.starts_with(Self::MAGIC) {
            return Err(DecodeError::BadRaw("missing RGB8 header".into()));
        }
        let width = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes"));
        let height = u32::from_le_bytes(data[8..12].try_into().expect("4 bytes"));
        let pixels = &data[Self::HEADER_LEN..];
        let expected = width as u64 * height as u64 * 3;
        if pixels.len() as u64 != expected {
            return Err(DecodeError::BadRaw(format!(
                "header says {width}x{height} ({expected} bytes) but {} bytes follow",
                pixels.len()
            )));
        }
        Ok((width, height, pixels))
    }
}

/// Decodes payloads to RGB. One per worker thread.
pub struct Decoder {
    jpeg: Option<turbojpeg::Decompressor>,
    max_pixels: u64,
    cmyk: Vec<u8>,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    /// A decoder with the default pixel limit ([`DEFAULT_MAX_PIXELS`]). The libjpeg-turbo handle
    /// is created on the first JPEG.
    pub fn new() -> Self {
        Decoder {
            jpeg: None,
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

    fn jpeg(&mut self) -> Result<&mut turbojpeg::Decompressor, DecodeError> {
        if self.jpeg.is_none() {
            let handle =
                turbojpeg::Decompressor::new().map_err(|e| DecodeError::Jpeg(e.to_string()))?;
            self.jpeg = Some(handle);
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
        self.probe(data).map(|(header, _)| header)
    }

    /// The header, plus whether a JPEG is CMYK/YCCK (which libjpeg-turbo can only decode to
    /// CMYK pixels). One header parse serves both, so small images pay for it once.
    fn probe(&mut self, data: &[u8]) -> Result<(ImageHeader, bool), DecodeError> {
        let format = sniff_or_explain(data)?;
        let (width, height, cmyk) = match format {
            PayloadFormat::Raw => {
                let (w, h, _) = RawImage::parse(data)?;
                (w as u64, h as u64, false)
            }
            PayloadFormat::Jpeg => {
                let header = self
                    .jpeg()?
                    .read_header(data)
                    .map_err(|e| DecodeError::Jpeg(e.to_string()))?;
                let cmyk = matches!(
                    header.colorspace,
                    turbojpeg::Colorspace::CMYK | turbojpeg::Colorspace::YCCK
                );
                (header.width as u64, header.height as u64, cmyk)
            }
            other => {
                let decoder = image_decoder(data, other)?;
                let (w, h) = decoder.dimensions();
                (w as u64, h as u64, false)
            }
        };
        self.check_size(width, height)?;
        let header = ImageHeader {
            width: width as u32,
            height: height as u32,
            format,
        };
        Ok((header, cmyk))
    }

    /// Checks that `data` decodes completely, as cheaply as possible, without producing pixels.
    ///
    /// JPEGs are decoded at 1/8 scale: libjpeg-turbo still entropy-decodes every block, so a
    /// truncated file or corrupt data fails exactly as a full decode would, but most of the
    /// inverse DCT, upsampling and colour conversion is skipped. Other formats decode fully.
    pub fn validate(&mut self, data: &[u8]) -> Result<ImageHeader, DecodeError> {
        let (header, cmyk) = self.probe(data)?;
        match header.format {
            PayloadFormat::Raw => Ok(header),
            PayloadFormat::Jpeg => {
                let mut scratch = std::mem::take(&mut self.cmyk);
                let jpeg = self.jpeg()?;
                let eighth = turbojpeg::ScalingFactor::ONE_EIGHTH;
                // CMYK pixels for CMYK/YCCK files (the only output they allow), else RGB.
                let format = if cmyk {
                    turbojpeg::PixelFormat::CMYK
                } else {
                    turbojpeg::PixelFormat::RGB
                };
                let (w, h) = (
                    eighth.scale(header.width as usize),
                    eighth.scale(header.height as usize),
                );
                scratch.resize(w * h * format.size(), 0);
                let image = turbojpeg::Image {
                    pixels: &mut scratch[..],
                    width: w,
                    pitch: w * format.size(),
                    height: h,
                    format,
                };
                let result = jpeg
                    .set_scaling_factor(eighth)
                    .and_then(|()| {
                        let decoded = jpeg.decompress(data, image);
                        jpeg.set_scaling_factor(turbojpeg::ScalingFactor::ONE)?;
                        decoded
                    })
                    .map_err(|e| DecodeError::Jpeg(e.to_string()));
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
        let (header, cmyk) = self.probe(data)?;
        match header.format {
            PayloadFormat::Jpeg | PayloadFormat::Raw => {
                out.resize(header.rgb_len(), 0);
                self.decode_known(data, header, cmyk, out)?;
            }
            other => {
                // The image crate allocates its own buffer; take it instead of copying.
                *out = decode_with_image_crate(data, other, self.max_pixels)?;
            }
        }
        Ok(header)
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
        self.decode_rgb_fit(data, out, |_| (min_width, min_height))
            .map(|(_, decoded)| decoded)
    }

    /// Like [`decode_rgb_reduced`](Self::decode_rgb_reduced), with the minimum size chosen by
    /// `fit` from the full-size header (parsed once). Returns the full-size and decoded headers.
    pub fn decode_rgb_fit(
        &mut self,
        data: &[u8],
        out: &mut Vec<u8>,
        fit: impl FnOnce(&ImageHeader) -> (u32, u32),
    ) -> Result<(ImageHeader, ImageHeader), DecodeError> {
        let (header, cmyk) = self.probe(data)?;
        let (min_width, min_height) = fit(&header);
        if header.format != PayloadFormat::Jpeg {
            match header.format {
                PayloadFormat::Raw => {
                    out.resize(header.rgb_len(), 0);
                    self.decode_known(data, header, false, out)?;
                }
                other => *out = decode_with_image_crate(data, other, self.max_pixels)?,
            }
            return Ok((header, header));
        }
        let scaled = |m: u32, v: u32| (v as u64 * m as u64).div_ceil(8) as u32;
        let m = (1..=8u32)
            .find(|&m| {
                scaled(m, header.width) >= min_width && scaled(m, header.height) >= min_height
            })
            .unwrap_or(8);
        if m == 8 {
            out.resize(header.rgb_len(), 0);
            self.decode_known(data, header, cmyk, out)?;
            return Ok((header, header));
        }
        let reduced = ImageHeader {
            width: scaled(m, header.width),
            height: scaled(m, header.height),
            format: header.format,
        };
        out.resize(reduced.rgb_len(), 0);
        let factor = turbojpeg::ScalingFactor::new(m as usize, 8);
        self.jpeg()?
            .set_scaling_factor(factor)
            .map_err(|e| DecodeError::Jpeg(e.to_string()))?;
        let result = self.decode_known(data, reduced, cmyk, out);
        self.jpeg()?
            .set_scaling_factor(turbojpeg::ScalingFactor::ONE)
            .map_err(|e| DecodeError::Jpeg(e.to_string()))?;
        result.map(|()| (header, reduced))
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
        let (header, cmyk) = self.probe(data)?;
        assert_eq!(
            out.len(),
            header.rgb_len(),
            "output buffer does not match the image size {}x{}",
            header.width,
            header.height
        );
        match header.format {
            PayloadFormat::Jpeg | PayloadFormat::Raw => {
                self.decode_known(data, header, cmyk, out)?
            }
            other => out.copy_from_slice(&decode_with_image_crate(data, other, self.max_pixels)?),
        }
        Ok(header)
    }

    fn decode_known(
        &mut self,
        data: &[u8],
        header: ImageHeader,
        cmyk_jpeg: bool,
        out: &mut [u8],
    ) -> Result<(), DecodeError> {
        let (width, height) = (header.width as usize, header.height as usize);
        if header.format == PayloadFormat::Raw {
            let (_, _, pixels) = RawImage::parse(data)?;
            out.copy_from_slice(pixels);
            return Ok(());
        }
        let mut cmyk = std::mem::take(&mut self.cmyk);
        let jpeg = self.jpeg()?;
        let result = if cmyk_jpeg {
            // libjpeg-turbo only decodes CMYK JPEGs to CMYK pixels; convert as PIL does.
            cmyk.resize(width * height * 4, 0);
            let image = turbojpeg::Image {
                pixels: &mut cmyk[..],
                width,
                pitch: width * 4,
                height,
                format: turbojpeg::PixelFormat::CMYK,
            };
            jpeg.decompress(data, image)
                .map(|()| cmyk_to_rgb(&cmyk, out))
        } else {
            let image = turbojpeg::Image {
                pixels: out,
                width,
                pitch: width * 3,
                height,
                format: turbojpeg::PixelFormat::RGB,
            };
            jpeg.decompress(data, image)
        };
        self.cmyk = cmyk;
        result.map_err(|e| DecodeError::Jpeg(e.to_string()))
    }
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

fn image_decoder(
    data: &[u8],
    format: PayloadFormat,
) -> Result<impl image::ImageDecoder + '_, DecodeError> {
    let mut reader = image::ImageReader::with_format(Cursor::new(data), image_format(format));
    // The image crate's own limits: no allocation beyond what our pixel limit allows (RGBA16).
    let mut limits = image::Limits::default();
    limits.max_alloc = Some(DEFAULT_MAX_PIXELS.saturating_mul(8));
    reader.limits(limits);
    reader.into_decoder().map_err(|e| image_error(format, e))
}

fn decode_with_image_crate(
    data: &[u8],
    format: PayloadFormat,
    max_pixels: u64,
) -> Result<Vec<u8>, DecodeError> {
    let decoder = image_decoder(data, format)?;
    let (w, h) = decoder.dimensions();
    if (w as u64) * (h as u64) > max_pixels {
        return Err(DecodeError::TooLarge {
            width: w as u64,
            height: h as u64,
            limit: max_pixels,
        });
    }
    let image = image::DynamicImage::from_decoder(decoder).map_err(|e| image_error(format, e))?;
    Ok(image.into_rgb8().into_raw())
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
    fn cmyk_conversion_follows_pil() {
        let mut rgb = [0u8; 6];
        cmyk_to_rgb(&[255, 255, 255, 255, 255, 0, 128, 128], &mut rgb);
        assert_eq!(rgb, [255, 255, 255, 128, 0, 64]);
    }
}
