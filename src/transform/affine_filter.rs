//! PIL's affine transform with bilinear or bicubic sampling (`Image.transform(AFFINE, m,
//! BILINEAR | BICUBIC)`, `Image.rotate(angle, BICUBIC)`), as timm's RandAugment runs its
//! geometric ops.
//!
//! PIL takes these through its generic transform: output pixel (x, y) samples the source at
//! `m · (x + ½, y + ½)` (in doubles, in PIL's order); a point outside the image keeps the fill;
//! inside, the taps clamp to the edge rows and columns, interpolate in doubles, and the result
//! is truncated to `u8` (bicubic clipped to 0..255 first). Reproduced operation for operation,
//! so the values are PIL's.

/// How the affine transform samples the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AffineFilter {
    /// Two by two taps.
    Bilinear,
    /// Four by four taps (the transform's own cubic, not the one PIL resizes with).
    Bicubic,
}

/// Writes the `width × height` RGB image `src` transformed by `m` (output → source, PIL's
/// `data`) into `out` (resized to fit), `fill` where the source point is outside the image.
pub(crate) fn transform(
    src: &[u8],
    width: u32,
    height: u32,
    m: [f64; 6],
    fill: [u8; 3],
    filter: AffineFilter,
    out: &mut Vec<u8>,
) {
    let (w, h) = (i64::from(width), i64::from(height));
    out.clear();
    out.reserve(src.len());
    let image = Source { src, w, h };
    for y in 0..h {
        for x in 0..w {
            let (xin, yin) = (x as f64 + 0.5, y as f64 + 0.5);
            let xx = m[0] * xin + m[1] * yin + m[2];
            let yy = m[3] * xin + m[4] * yin + m[5];
            let pixel = match filter {
                AffineFilter::Bilinear => image.bilinear(xx, yy),
                AffineFilter::Bicubic => image.bicubic(xx, yy),
            };
            out.extend_from_slice(&pixel.unwrap_or(fill));
        }
    }
}

struct Source<'a> {
    src: &'a [u8],
    w: i64,
    h: i64,
}

impl Source<'_> {
    /// The byte offset of column `x`, clamped to the image (PIL's `XCLIP`).
    fn column(&self, x: i64) -> usize {
        (x.clamp(0, self.w - 1) * 3) as usize
    }

    /// The byte offset of row `y`, if the image has it.
    fn row(&self, y: i64) -> Option<usize> {
        (0..self.h).contains(&y).then(|| (y * self.w * 3) as usize)
    }

    /// PIL's test before sampling: inside `[0, size)` on both axes (a NaN passes, as in C).
    fn outside(&self, xin: f64, yin: f64) -> bool {
        xin < 0.0 || xin >= self.w as f64 || yin < 0.0 || yin >= self.h as f64
    }

    /// Where a point's taps start: the integer and fractional parts after PIL's half-pixel
    /// shift.
    fn split(v: f64) -> (i64, f64) {
        let v = v - 0.5;
        let i = v.floor();
        (i as i64, v - i)
    }

    fn bilinear(&self, xin: f64, yin: f64) -> Option<[u8; 3]> {
        if self.outside(xin, yin) {
            return None;
        }
        let ((x, dx), (y, dy)) = (Self::split(xin), Self::split(yin));
        let lerp = |a: f64, b: f64, d: f64| a + (b - a) * d;
        let (x0, x1) = (self.column(x), self.column(x + 1));
        // The first row is clamped into the image; a missing second row repeats the first.
        let first = (y.clamp(0, self.h - 1) * self.w * 3) as usize;
        let second = self.row(y + 1);
        let at = |row: usize, col: usize, band: usize| f64::from(self.src[row + col + band]);
        let mut pixel = [0u8; 3];
        for (band, value) in pixel.iter_mut().enumerate() {
            let v1 = lerp(at(first, x0, band), at(first, x1, band), dx);
            let v2 = second.map_or(v1, |row| lerp(at(row, x0, band), at(row, x1, band), dx));
            *value = lerp(v1, v2, dy) as u8;
        }
        Some(pixel)
    }

    fn bicubic(&self, xin: f64, yin: f64) -> Option<[u8; 3]> {
        if self.outside(xin, yin) {
            return None;
        }
        let ((x, dx), (y, dy)) = (Self::split(xin), Self::split(yin));
        let (x, y) = (x - 1, y - 1);
        let cols = [0, 1, 2, 3].map(|i| self.column(x + i));
        let first = (y.clamp(0, self.h - 1) * self.w * 3) as usize;
        let rows = [self.row(y + 1), self.row(y + 2), self.row(y + 3)];
        let mut pixel = [0u8; 3];
        for (band, value) in pixel.iter_mut().enumerate() {
            let line = |row: usize| {
                let taps = cols.map(|c| f64::from(self.src[row + c + band]));
                cubic(taps, dx)
            };
            // A missing row repeats the one above it, as PIL's body does.
            let v1 = line(first);
            let v2 = rows[0].map_or(v1, line);
            let v3 = rows[1].map_or(v2, line);
            let v4 = rows[2].map_or(v3, line);
            let v = cubic([v1, v2, v3, v4], dy);
            *value = if v <= 0.0 {
                0
            } else if v >= 255.0 {
                255
            } else {
                v as u8
            };
        }
        Some(pixel)
    }
}

/// PIL's `BICUBIC(v, v1, v2, v3, v4, d)`, its terms in its order.
fn cubic([v1, v2, v3, v4]: [f64; 4], d: f64) -> f64 {
    let p1 = v2;
    let p2 = -v1 + v3;
    let p3 = 2.0 * (v1 - v2) + v3 - v4;
    let p4 = -v1 + v2 - v3 + v4;
    p1 + d * (p2 + d * (p3 + d * p4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_keeps_every_pixel_and_a_shift_fills_what_comes_in() {
        let (w, h) = (7u32, 5u32);
        let src: Vec<u8> = (0..w * h * 3).map(|i| (i * 11 % 256) as u8).collect();
        let mut out = Vec::new();
        for filter in [AffineFilter::Bilinear, AffineFilter::Bicubic] {
            transform(
                &src,
                w,
                h,
                [1.0, 0.0, 0.0, 0.0, 1.0, 0.0],
                [9; 3],
                filter,
                &mut out,
            );
            assert_eq!(out, src, "{filter:?}");
            // Source x = x + 2: the last two columns sample outside and keep the fill.
            transform(
                &src,
                w,
                h,
                [1.0, 0.0, 2.0, 0.0, 1.0, 0.0],
                [9; 3],
                filter,
                &mut out,
            );
            for y in 0..h as usize {
                for x in 0..w as usize {
                    let got = &out[(y * w as usize + x) * 3..][..3];
                    if x + 2 < w as usize {
                        assert_eq!(got, &src[(y * w as usize + x + 2) * 3..][..3]);
                    } else {
                        assert_eq!(got, [9; 3]);
                    }
                }
            }
        }
    }

    #[test]
    fn half_a_pixel_interpolates_and_a_point_past_the_edge_keeps_the_fill() {
        // One row 0, 100, 200, 100 sampled half a pixel to the right: output x samples source
        // x + 1 (centre to centre, PIL's -0.5), between pixels x and x + 1; the last output
        // pixel samples at 4.0, outside.
        let src: Vec<u8> = [0u8, 100, 200, 100]
            .iter()
            .flat_map(|&v| [v, v, v])
            .collect();
        let mut out = Vec::new();
        let half = [1.0, 0.0, 0.5, 0.0, 1.0, 0.0];
        let row = |out: &[u8]| -> Vec<u8> { out.chunks(3).map(|p| p[0]).collect() };
        transform(&src, 4, 1, half, [0; 3], AffineFilter::Bilinear, &mut out);
        assert_eq!(row(&out), [50, 150, 150, 0]);
        // The cubic's taps clamp at the edges: (0, 0, 100, 200) at 0.5 is 37.5, (0, 100, 200,
        // 100) 175, (100, 200, 100, 100) 162.5; truncated.
        transform(&src, 4, 1, half, [0; 3], AffineFilter::Bicubic, &mut out);
        assert_eq!(row(&out), [37, 175, 162, 0]);
    }
}
