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
}

impl JpegEncoder {
    /// An encoder at `quality` (1..=100) and `subsampling`, baseline (not progressive).
    pub fn new(quality: u8, subsampling: ChromaSubsampling) -> Result<Self, EncodeError> {
        let mut compressor = turbojpeg::Compressor::new()?;
        compressor.set_quality(i32::from(quality))?;
        compressor.set_subsamp(match subsampling {
            ChromaSubsampling::Full => turbojpeg::Subsamp::None,
            ChromaSubsampling::Half => turbojpeg::Subsamp::Sub2x2,
        })?;
        Ok(JpegEncoder { compressor })
    }

    /// Writes progressive JPEGs (several scans of increasing detail) instead of baseline ones.
    pub fn set_progressive(&mut self, progressive: bool) -> Result<(), EncodeError> {
        Ok(self.compressor.set_progressive(progressive)?)
    }

    /// Encodes `width × height` RGB pixels (`rgb.len() == width · height · 3`).
    pub fn encode_rgb(
        &mut self,
        rgb: &[u8],
        width: u32,
        height: u32,
    ) -> Result<Vec<u8>, EncodeError> {
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
        self.compressor
            .set_colorspace(turbojpeg::Colorspace::CMYK)?;
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
}
