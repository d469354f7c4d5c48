//! JPEG encoding with libjpeg-turbo: the encoder behind `pack-dataset --resize` and the
//! synthetic trees' libjpeg-turbo cases (progressive, CMYK).
//!
//! The synthetic trees' plain images are the one exception: they keep the `image` crate's
//! pure-Rust encoder, because their bytes (and with them the committed test fixtures and the
//! demo's epoch digests) are defined by it.

/// A JPEG encoder failed (libjpeg-turbo's message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("JPEG encoder: {0}")]
pub struct EncodeError(String);

impl From<turbojpeg::Error> for EncodeError {
    fn from(e: turbojpeg::Error) -> Self {
        EncodeError(e.to_string())
    }
}

/// How much colour resolution a JPEG keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChromaSubsampling {
    /// 4:4:4: colour at full resolution.
    Full,
    /// 4:2:0: colour at half resolution in both directions, as cameras and most datasets store
    /// photos (ImageNet's JPEGs are 4:2:0).
    Half,
}

/// A reusable libjpeg-turbo encoder with its settings (one per thread).
pub struct JpegEncoder {
    compressor: turbojpeg::Compressor,
    quality: u8,
    subsampling: ChromaSubsampling,
    progressive: bool,
    /// Whether the handle was last set up for CMYK: libjpeg-turbo keeps the colour space
    /// across calls, so an RGB encode after a CMYK one starts from a fresh handle.
    cmyk: bool,
}

impl JpegEncoder {
    /// An encoder at `quality` (1..=100) and `subsampling`, baseline (not progressive).
    pub fn new(quality: u8, subsampling: ChromaSubsampling) -> Result<Self, EncodeError> {
        Ok(JpegEncoder {
            compressor: compressor(quality, subsampling, false)?,
            quality,
            subsampling,
            progressive: false,
            cmyk: false,
        })
    }

    /// Writes progressive JPEGs (several scans of increasing detail) instead of baseline ones.
    pub fn set_progressive(&mut self, progressive: bool) -> Result<(), EncodeError> {
        self.compressor.set_progressive(progressive)?;
        self.progressive = progressive;
        Ok(())
    }

    /// Encodes `width × height` RGB pixels (`rgb.len() == width · height · 3`).
    pub fn encode_rgb(
        &mut self,
        rgb: &[u8],
        width: u32,
        height: u32,
    ) -> Result<Vec<u8>, EncodeError> {
        if self.cmyk {
            self.compressor = compressor(self.quality, self.subsampling, self.progressive)?;
            self.cmyk = false;
        }
        self.encode(rgb, width, height, turbojpeg::PixelFormat::RGB)
    }

    /// Encodes `width × height` CMYK pixels (4 bytes each) as a CMYK JPEG, the kind Adobe tools
    /// write (readers see the values inverted).
    pub fn encode_cmyk(
        &mut self,
        cmyk: &[u8],
        width: u32,
        height: u32,
    ) -> Result<Vec<u8>, EncodeError> {
        if !self.cmyk {
            self.compressor
                .set_colorspace(turbojpeg::Colorspace::CMYK)?;
            self.cmyk = true;
        }
        self.encode(cmyk, width, height, turbojpeg::PixelFormat::CMYK)
    }

    fn encode(
        &mut self,
        pixels: &[u8],
        width: u32,
        height: u32,
        format: turbojpeg::PixelFormat,
    ) -> Result<Vec<u8>, EncodeError> {
        let (width, height) = (width as usize, height as usize);
        assert_eq!(
            pixels.len(),
            width * height * format.size(),
            "pixel buffer size"
        );
        let image = turbojpeg::Image {
            pixels,
            width,
            pitch: width * format.size(),
            height,
            format,
        };
        Ok(self.compressor.compress_to_vec(image)?)
    }
}

/// A libjpeg-turbo handle with these settings.
fn compressor(
    quality: u8,
    subsampling: ChromaSubsampling,
    progressive: bool,
) -> Result<turbojpeg::Compressor, EncodeError> {
    let mut compressor = turbojpeg::Compressor::new()?;
    compressor.set_quality(i32::from(quality))?;
    compressor.set_subsamp(match subsampling {
        ChromaSubsampling::Full => turbojpeg::Subsamp::None,
        ChromaSubsampling::Half => turbojpeg::Subsamp::Sub2x2,
    })?;
    if progressive {
        compressor.set_progressive(true)?;
    }
    Ok(compressor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Decoder;

    #[test]
    fn encodes_what_the_decoder_reads_back_with_the_subsampling_asked_for() {
        let (w, h) = (48u32, 32u32);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
        for (subsampling, expected) in [
            (ChromaSubsampling::Full, turbojpeg::Subsamp::None),
            (ChromaSubsampling::Half, turbojpeg::Subsamp::Sub2x2),
        ] {
            let mut encoder = JpegEncoder::new(90, subsampling).unwrap();
            let jpeg = encoder.encode_rgb(&rgb, w, h).unwrap();
            let header = turbojpeg::read_header(&jpeg).unwrap();
            assert_eq!((header.width, header.height), (w as usize, h as usize));
            assert_eq!(header.subsamp, expected);
            let mut decoded = Vec::new();
            let info = Decoder::new().decode_rgb(&jpeg, &mut decoded).unwrap();
            assert_eq!((info.width, info.height), (w, h));
            // Reused, the encoder gives the same bytes.
            assert_eq!(encoder.encode_rgb(&rgb, w, h).unwrap(), jpeg);
        }
        let mut encoder = JpegEncoder::new(200, ChromaSubsampling::Full);
        assert!(encoder.as_mut().is_err(), "quality 200 is refused");
    }

    #[test]
    fn rgb_after_cmyk_on_one_encoder_is_what_a_fresh_encoder_writes() {
        let (w, h) = (32u32, 16u32);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 5 % 253) as u8).collect();
        let cmyk: Vec<u8> = (0..w * h * 4).map(|i| (i * 3 % 251) as u8).collect();
        let fresh = JpegEncoder::new(90, ChromaSubsampling::Full)
            .unwrap()
            .encode_rgb(&rgb, w, h)
            .unwrap();
        let mut encoder = JpegEncoder::new(90, ChromaSubsampling::Full).unwrap();
        let first = encoder.encode_cmyk(&cmyk, w, h).unwrap();
        assert_eq!(
            turbojpeg::read_header(&first).unwrap().colorspace,
            turbojpeg::Colorspace::CMYK
        );
        assert_eq!(encoder.encode_rgb(&rgb, w, h).unwrap(), fresh);
    }
}
