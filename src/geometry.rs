//! [`Rect`]: a region of an image in (fractional) pixels, the one type for crops from the
//! crop arithmetic ([`transform::crop`](crate::transform::crop)) through region decoding
//! ([`decode::CropPlan`](crate::decode::CropPlan)) to resizing
//! ([`resize::RgbResizer::resize_region`](crate::resize::RgbResizer::resize_region)).

/// A region of an image: `left`, `top`, `width`, `height` in pixels, fractional where a crop
/// was scaled (decoding at a reduced DCT scale). It may extend past the image's edges: a
/// center crop larger than the image, which is zero-padded as torchvision does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rect {
    /// Left column (negative when the region starts left of the image).
    pub left: f64,
    /// Top row (negative when the region starts above the image).
    pub top: f64,
    /// Width in pixels.
    pub width: f64,
    /// Height in pixels.
    pub height: f64,
}

impl Rect {
    /// The whole of a `width × height` image.
    pub fn full(width: u32, height: u32) -> Rect {
        Rect {
            left: 0.0,
            top: 0.0,
            width: width as f64,
            height: height as f64,
        }
    }

    /// The same region in an image scaled by `sx` horizontally and `sy` vertically.
    pub fn scaled(self, sx: f64, sy: f64) -> Rect {
        Rect {
            left: self.left * sx,
            top: self.top * sy,
            width: self.width * sx,
            height: self.height * sy,
        }
    }

    /// The same region seen from an origin moved to (`x`, `y`): in a buffer holding only the
    /// part of the image from there on.
    pub fn relative_to(self, x: f64, y: f64) -> Rect {
        Rect {
            left: self.left - x,
            top: self.top - y,
            ..self
        }
    }

    /// Whether the region lies inside a `width × height` image (edges included).
    pub fn is_inside(&self, width: f64, height: f64) -> bool {
        self.left >= 0.0
            && self.top >= 0.0
            && self.left + self.width <= width
            && self.top + self.height <= height
    }

    /// Whether the region is exactly the whole `width × height` image.
    pub fn is_whole(&self, width: f64, height: f64) -> bool {
        self.left == 0.0 && self.top == 0.0 && self.width == width && self.height == height
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inside_whole_scaled_and_moved() {
        let full = Rect::full(40, 30);
        assert!(full.is_whole(40.0, 30.0) && full.is_inside(40.0, 30.0));
        let crop = Rect {
            left: 4.0,
            top: 2.0,
            width: 20.0,
            height: 10.0,
        };
        assert!(crop.is_inside(40.0, 30.0) && !crop.is_whole(40.0, 30.0));
        assert!(!crop.is_inside(23.0, 30.0), "reaches past the right edge");
        let padded = Rect { left: -2.0, ..crop };
        assert!(!padded.is_inside(40.0, 30.0));
        let half = crop.scaled(0.5, 0.25);
        assert_eq!(
            (half.left, half.top, half.width, half.height),
            (2.0, 0.5, 10.0, 2.5)
        );
        let moved = crop.relative_to(3.0, 1.0);
        assert_eq!(
            (moved.left, moved.top, moved.width, moved.height),
            (1.0, 1.0, 20.0, 10.0)
        );
    }
}
