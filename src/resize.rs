//! SIMD resizing of RGB images (fast_image_resize), with torchvision's size rules.

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::geometry::Rect;

/// The size torchvision's `Resize(short)` produces: the shorter side becomes `short`, the longer
/// one `int(short * long / shorter)` (truncated), keeping the orientation. A longer side past
/// `u32::MAX` is `u32::MAX` (it wrapped: a 2097152x1 image under `Resize(2048)` came out 0 wide),
/// which no pixel limit lets through.
pub fn short_side_size(width: u32, height: u32, short: u32) -> (u32, u32) {
    let (w, h) = (width as u64, height as u64);
    let long = |long: u64, shorter: u64| {
        u32::try_from((short as u64 * long / shorter).max(1)).unwrap_or(u32::MAX)
    };
    if w <= h {
        (short, long(h, w))
    } else {
        (long(w, h), short)
    }
}

/// How a resize samples: torchvision's `InterpolationMode`s on PIL images, antialiased when
/// shrinking as PIL always is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Interpolation {
    /// PIL `NEAREST`: the source pixel under each output pixel's centre.
    Nearest,
    /// PIL `BILINEAR` (torchvision's default): a triangle filter, widened when shrinking.
    #[default]
    Bilinear,
    /// PIL `BICUBIC` (the ViT recipes'): a cubic filter with a = -0.5 (Catmull-Rom), widened
    /// when shrinking.
    Bicubic,
}

impl Interpolation {
    fn algorithm(self) -> ResizeAlg {
        match self {
            Interpolation::Nearest => ResizeAlg::Nearest,
            Interpolation::Bilinear => ResizeAlg::Convolution(FilterType::Bilinear),
            Interpolation::Bicubic => ResizeAlg::Convolution(FilterType::CatmullRom),
        }
    }
}

/// Resizes 8-bit RGB images, by default with an antialiased bilinear filter (what PIL, and so
/// torchvision's `Resize`, uses by default). Holds scratch state: one per worker.
pub struct RgbResizer {
    resizer: Resizer,
    options: ResizeOptions,
    interpolation: Interpolation,
    /// The horizontal pass's output, for the bicubic filter's two passes in PIL's order.
    between: Vec<u8>,
}

impl Default for RgbResizer {
    fn default() -> Self {
        Self::new()
    }
}

impl RgbResizer {
    /// A bilinear (antialiased) resizer.
    pub fn new() -> Self {
        let interpolation = Interpolation::Bilinear;
        RgbResizer {
            resizer: Resizer::new(),
            options: ResizeOptions::new().resize_alg(interpolation.algorithm()),
            interpolation,
            between: Vec::new(),
        }
    }

    /// Resizes with `interpolation` from now on.
    pub fn set_interpolation(&mut self, interpolation: Interpolation) {
        if interpolation != self.interpolation {
            self.interpolation = interpolation;
            self.options = ResizeOptions::new().resize_alg(interpolation.algorithm());
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
        let scales = dst_width as f64 != region.width && dst_height as f64 != region.height;
        let columns_first =
            pillow_columns_first(region.width, region.height, dst_width, dst_height);
        if self.interpolation == Interpolation::Bicubic && scales && !columns_first {
            // PIL resamples rows first and rounds them to 8 bits, then columns; fast_image_resize
            // does 8-bit images columns first, which clips the cubic's overshoot elsewhere (up
            // to 22 levels from PIL on noise). So the rows are resampled on their own first:
            // those the columns' filter reaches (its support, 2, widened when shrinking), plus
            // one, so that only the image's own edges cut the filter, as in PIL.
            let reach = (2.0 * (region.height / dst_height as f64).max(1.0)).ceil() + 1.0;
            let first = (region.top - reach).floor().max(0.0) as u32;
            let last = ((region.top + region.height + reach).ceil() as u32).min(height);
            let rows = last - first;
            self.between
                .resize(dst_width as usize * rows as usize * 3, 0);
            let mut between =
                Image::from_slice_u8(dst_width, rows, &mut self.between, PixelType::U8x3)
                    .expect("the rows' buffer matches its size");
            let rows_only =
                self.options
                    .crop(region.left, f64::from(first), region.width, f64::from(rows));
            self.resizer
                .resize(&src, &mut between, &rows_only)
                .expect("same pixel type, non-zero sizes");
            let columns_only = self.options.crop(
                0.0,
                region.top - f64::from(first),
                f64::from(dst_width),
                region.height,
            );
            self.resizer
                .resize(&between, &mut dst, &columns_only)
                .expect("same pixel type, non-zero sizes");
            return;
        }
        let options = self
            .options
            .crop(region.left, region.top, region.width, region.height);
        self.resizer
            .resize(&src, &mut dst, &options)
            .expect("same pixel type, non-zero sizes");
    }
}

/// Whether Pillow resamples the columns before the rows for this change of size: since Pillow 13,
/// when the height shrinks by more than twice as many pixels as the width does (widening while
/// shortening included); rows first otherwise, and always in Pillow 12 and earlier. Found by
/// replaying both orders of PIL's fixed-point passes against Pillow 13 on noise: one of them
/// equals it exactly on every one of 400 random shapes, and this rule names which (the pixel
/// boundary included: 300x300 to 250x200 rows, to 250x199 columns).
fn pillow_columns_first(src_width: f64, src_height: f64, dst_width: u32, dst_height: u32) -> bool {
    let (width, height) = (f64::from(dst_width), f64::from(dst_height));
    height < src_height && src_height - height > 2.0 * (src_width - width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bicubic_pass_order_is_pillows_on_the_measured_shapes() {
        // (source, destination, whether Pillow 13's output equals the columns-first passes),
        // each read off Pillow 13 on noise by replaying both orders of its fixed-point passes.
        let measured = [
            ((300, 300), (250, 200), false),
            ((300, 300), (250, 199), true),
            ((200, 300), (150, 200), false),
            ((200, 300), (150, 199), true),
            ((100, 50), (90, 30), false),
            ((100, 50), (90, 29), true),
            ((50, 400), (60, 380), true),
            ((43, 70), (362, 296), false),
            ((118, 377), (83, 286), true),
            ((261, 259), (130, 23), false),
            ((329, 172), (364, 72), true),
            ((145, 84), (187, 203), false),
        ];
        for ((sw, sh), (dw, dh), columns) in measured {
            assert_eq!(
                pillow_columns_first(f64::from(sw), f64::from(sh), dw, dh),
                columns,
                "{sw}x{sh} -> {dw}x{dh}"
            );
        }
    }

    #[test]
    fn short_side_matches_torchvision() {
        // torchvision: Resize(256) on 500x375 -> (341, 256); on 375x500 -> (256, 341).
        assert_eq!(short_side_size(500, 375, 256), (341, 256));
        assert_eq!(short_side_size(375, 500, 256), (256, 341));
        assert_eq!(short_side_size(32, 32, 16), (16, 16));
        // A long side past u32 saturates (it wrapped to 0).
        assert_eq!(short_side_size(2_097_152, 1, 2048), (u32::MAX, 2048));
        assert_eq!(short_side_size(1, 2_097_153, 2048), (2048, u32::MAX));
    }

    #[test]
    fn resizing_a_flat_image_keeps_its_colour_with_every_interpolation() {
        let src = [200u8, 100, 50].repeat(40 * 30);
        for interpolation in [
            Interpolation::Nearest,
            Interpolation::Bilinear,
            Interpolation::Bicubic,
        ] {
            let mut dst = vec![0u8; 23 * 15 * 3];
            let mut resizer = RgbResizer::new();
            resizer.set_interpolation(interpolation);
            resizer.resize(&src, 40, 30, &mut dst, 23, 15);
            assert!(
                dst.chunks(3).all(|p| p == [200, 100, 50]),
                "{interpolation:?}"
            );
        }
    }

    #[test]
    fn each_interpolation_samples_differently_and_nearest_only_copies() {
        // A noisy image: nearest hands out source values only; the filters mix them, bicubic
        // (negative lobes) differently from bilinear.
        let src: Vec<u8> = (0..30 * 20 * 3).map(|i| ((i * 7919) % 251) as u8).collect();
        let resized = |interpolation| {
            let mut resizer = RgbResizer::new();
            resizer.set_interpolation(interpolation);
            let mut dst = vec![0u8; 13 * 9 * 3];
            resizer.resize(&src, 30, 20, &mut dst, 13, 9);
            dst
        };
        let (nearest, bilinear, bicubic) = (
            resized(Interpolation::Nearest),
            resized(Interpolation::Bilinear),
            resized(Interpolation::Bicubic),
        );
        assert_ne!(bilinear, bicubic);
        assert_ne!(nearest, bilinear);
        for (at, value) in nearest.iter().enumerate() {
            let channel = at % 3;
            assert!(
                src.iter().skip(channel).step_by(3).any(|v| v == value),
                "nearest made a value no source pixel has"
            );
        }
        // Switching back restores the first filter.
        let mut resizer = RgbResizer::new();
        resizer.set_interpolation(Interpolation::Bicubic);
        resizer.set_interpolation(Interpolation::Bilinear);
        let mut dst = vec![0u8; 13 * 9 * 3];
        resizer.resize(&src, 30, 20, &mut dst, 13, 9);
        assert_eq!(dst, bilinear);
    }
}
