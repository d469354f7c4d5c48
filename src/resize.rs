//! SIMD resizing of RGB images (fast_image_resize), with torchvision's size rules.

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::geometry::Rect;

/// The size torchvision's `Resize(short)` produces: the shorter side becomes `short`, the longer
/// one `int(short * long / shorter)` (truncated), keeping the orientation.
pub fn short_side_size(width: u32, height: u32, short: u32) -> (u32, u32) {
    let (w, h) = (width as u64, height as u64);
    if w <= h {
        (short, ((short as u64 * h) / w).max(1) as u32)
    } else {
        (((short as u64 * w) / h).max(1) as u32, short)
    }
}

/// Resizes 8-bit RGB images with an antialiased bilinear filter (what PIL, and so torchvision's
/// `Resize`, uses by default). Holds scratch state: one per worker.
pub struct RgbResizer {
    resizer: Resizer,
    options: ResizeOptions,
}

impl Default for RgbResizer {
    fn default() -> Self {
        Self::new()
    }
}

impl RgbResizer {
    /// A bilinear (antialiased) resizer.
    pub fn new() -> Self {
        RgbResizer {
            resizer: Resizer::new(),
            options: ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear)),
        }
    }

    /// Resizes `src` (`width × height × 3`) into `dst` (`dst_width × dst_height × 3`).
    ///
    /// # Panics
    /// When a buffer's length does not match its size, or a size is zero (caller bugs).
    pub fn resize(
        &mut self,
        src: &[u8],
        width: u32,
        height: u32,
        dst: &mut [u8],
        dst_width: u32,
        dst_height: u32,
    ) {
        let full = Rect::full(width, height);
        self.resize_region(src, width, height, full, dst, dst_width, dst_height);
    }

    /// Resizes the region `region` of `src` (fractional source pixels, inside the image) into
    /// `dst`: crop and resize in one pass.
    ///
    /// # Panics
    /// When a buffer's length does not match its size, or a size is zero (caller bugs).
    #[allow(clippy::too_many_arguments)]
    pub fn resize_region(
        &mut self,
        src: &[u8],
        width: u32,
        height: u32,
        region: Rect,
        dst: &mut [u8],
        dst_width: u32,
        dst_height: u32,
    ) {
        let src = ImageRef::new(width, height, src, PixelType::U8x3)
            .expect("source buffer matches its size");
        let mut dst = Image::from_slice_u8(dst_width, dst_height, dst, PixelType::U8x3)
            .expect("destination buffer matches its size");
        let options = self
            .options
            .crop(region.left, region.top, region.width, region.height);
        self.resizer
            .resize(&src, &mut dst, &options)
            .expect("same pixel type, non-zero sizes");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_side_matches_torchvision() {
        // torchvision: Resize(256) on 500x375 -> (341, 256); on 375x500 -> (256, 341).
        assert_eq!(short_side_size(500, 375, 256), (341, 256));
        assert_eq!(short_side_size(375, 500, 256), (256, 341));
        assert_eq!(short_side_size(32, 32, 16), (16, 16));
    }

    #[test]
    fn resizing_a_flat_image_keeps_its_colour() {
        let src = [200u8, 100, 50].repeat(40 * 30);
        let mut dst = vec![0u8; 20 * 15 * 3];
        RgbResizer::new().resize(&src, 40, 30, &mut dst, 20, 15);
        assert!(dst.chunks(3).all(|p| p == [200, 100, 50]));
    }
}
