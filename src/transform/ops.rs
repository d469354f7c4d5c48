//! The pixel operations of torchvision's automatic augmentations (`AutoAugment`, `RandAugment`,
//! `TrivialAugmentWide`) on RGB `u8` images, with PIL's arithmetic.
//!
//! torchvision's reference recipes run these ops on PIL images, so PIL's code is the reference:
//! `Image.blend` truncates (it does not round) and extrapolates with clipping; grayscale is
//! ITU-R 601 in 16-bit fixed point (`L24`); `Contrast` blends with the rounded mean gray;
//! `Sharpness` blends with PIL's 3×3 `SMOOTH` filter (edges kept, float sums in PIL's order);
//! `AutoContrast` and `Equalize` build PIL's per-channel lookup tables; the geometric ops are
//! PIL's nearest-neighbour affine transform, including its 16.16 fixed-point path and the
//! exact transposes `Image.rotate` takes for 90° and 180°. Each op is tested against PIL (and
//! torchvision's own `_apply_op` where torch is installed) on photos.

use super::affine_filter::{self, AffineFilter};

/// One operation of the automatic augmentation policies (torchvision's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Nothing.
    Identity,
    /// Horizontal shear: source x = x + magnitude · y (torchvision: shear of atan(magnitude)).
    ShearX,
    /// Vertical shear.
    ShearY,
    /// Shift right by `int(magnitude)` pixels.
    TranslateX,
    /// Shift down by `int(magnitude)` pixels.
    TranslateY,
    /// Rotate counter-clockwise by `magnitude` degrees about the centre.
    Rotate,
    /// PIL `ImageEnhance.Brightness(1 + magnitude)`.
    Brightness,
    /// PIL `ImageEnhance.Color(1 + magnitude)` (saturation).
    Color,
    /// PIL `ImageEnhance.Contrast(1 + magnitude)`.
    Contrast,
    /// PIL `ImageEnhance.Sharpness(1 + magnitude)`.
    Sharpness,
    /// Keep the `int(magnitude)` high bits of each value.
    Posterize,
    /// Invert values at or above the threshold `magnitude`.
    Solarize,
    /// Stretch each channel to 0..255 (PIL `ImageOps.autocontrast`).
    AutoContrast,
    /// Equalize each channel's histogram (PIL `ImageOps.equalize`).
    Equalize,
    /// 255 − value.
    Invert,
}

impl Op {
    /// torchvision's name of the op.
    pub fn name(self) -> &'static str {
        match self {
            Op::Identity => "Identity",
            Op::ShearX => "ShearX",
            Op::ShearY => "ShearY",
            Op::TranslateX => "TranslateX",
            Op::TranslateY => "TranslateY",
            Op::Rotate => "Rotate",
            Op::Brightness => "Brightness",
            Op::Color => "Color",
            Op::Contrast => "Contrast",
            Op::Sharpness => "Sharpness",
            Op::Posterize => "Posterize",
            Op::Solarize => "Solarize",
            Op::AutoContrast => "AutoContrast",
            Op::Equalize => "Equalize",
            Op::Invert => "Invert",
        }
    }

    /// The op named `name` (torchvision's spelling).
    pub fn from_name(name: &str) -> Option<Op> {
        ALL_OPS.iter().copied().find(|op| op.name() == name)
    }
}

/// Every op, in declaration order.
pub const ALL_OPS: [Op; 15] = [
    Op::Identity,
    Op::ShearX,
    Op::ShearY,
    Op::TranslateX,
    Op::TranslateY,
    Op::Rotate,
    Op::Brightness,
    Op::Color,
    Op::Contrast,
    Op::Sharpness,
    Op::Posterize,
    Op::Solarize,
    Op::AutoContrast,
    Op::Equalize,
    Op::Invert,
];

/// A `width × height` RGB image being augmented: the pixels, and a scratch buffer the ops that
/// cannot work in place write into (then the two are swapped).
pub struct RgbImage<'a> {
    /// HWC RGB pixels, exactly `width · height · 3` of them.
    pub pixels: &'a mut Vec<u8>,
    /// Scratch space (any contents).
    pub scratch: &'a mut Vec<u8>,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

impl RgbImage<'_> {
    /// Applies `op` with `magnitude` (torchvision's `_apply_op`), `fill` for the pixels the
    /// geometric ops move in from outside the image.
    pub fn apply(&mut self, op: Op, magnitude: f64, fill: [u8; 3]) {
        let (w, h) = (self.width as f64, self.height as f64);
        match op {
            Op::Identity => {}
            // torchvision: F.affine(shear=[degrees(atan(m)), 0], center=[0, 0]).
            Op::ShearX => {
                let degrees = magnitude.atan().to_degrees();
                self.affine(
                    inverse_affine((0.0, 0.0), 0.0, (0.0, 0.0), (degrees, 0.0)),
                    fill,
                )
            }
            Op::ShearY => {
                let degrees = magnitude.atan().to_degrees();
                self.affine(
                    inverse_affine((0.0, 0.0), 0.0, (0.0, 0.0), (0.0, degrees)),
                    fill,
                )
            }
            // torchvision: F.affine(translate=[int(m), 0]) about the PIL centre (w/2, h/2).
            Op::TranslateX => self.affine(
                inverse_affine(
                    (w * 0.5, h * 0.5),
                    0.0,
                    (magnitude.trunc(), 0.0),
                    (0.0, 0.0),
                ),
                fill,
            ),
            Op::TranslateY => self.affine(
                inverse_affine(
                    (w * 0.5, h * 0.5),
                    0.0,
                    (0.0, magnitude.trunc()),
                    (0.0, 0.0),
                ),
                fill,
            ),
            Op::Rotate => self.rotate(magnitude, fill, None),
            Op::Brightness | Op::Color | Op::Contrast | Op::Sharpness => {
                self.enhance(op, factor(magnitude))
            }
            Op::Posterize => {
                let bits = magnitude.trunc().clamp(0.0, 8.0) as u32;
                let mask = !((1u32 << (8 - bits)) - 1) as u8;
                map_values(self.pixels, |v| v & mask);
            }
            Op::Solarize => map_values(self.pixels, |v| {
                if (v as f64) < magnitude { v } else { 255 - v }
            }),
            Op::AutoContrast => self.per_channel_lut(autocontrast_lut),
            Op::Equalize => self.per_channel_lut(equalize_lut),
            Op::Invert => map_values(self.pixels, |v| 255 - v),
        }
    }

    /// PIL `ImageEnhance.Brightness`, `Color`, `Contrast` or `Sharpness` (`op`) with `factor`
    /// (PIL's blend takes it as a `float`). Other ops are left alone.
    pub fn enhance(&mut self, op: Op, factor: f32) {
        match op {
            Op::Brightness => adjust_brightness(self.pixels, factor),
            Op::Color => adjust_saturation(self.pixels, factor),
            Op::Contrast => adjust_contrast(self.pixels, factor),
            Op::Sharpness => {
                smooth(self.pixels, self.scratch, self.width, self.height);
                blend(self.scratch, self.pixels, factor);
            }
            _ => {}
        }
    }

    /// PIL `Image.transform(AFFINE, m)` sampling with `filter` (`None`: nearest neighbour).
    pub fn affine_with(&mut self, m: [f64; 6], fill: [u8; 3], filter: Option<AffineFilter>) {
        match filter {
            None => self.affine(m, fill),
            Some(filter) => {
                affine_filter::transform(
                    self.pixels,
                    self.width,
                    self.height,
                    m,
                    fill,
                    filter,
                    self.scratch,
                );
                std::mem::swap(self.pixels, self.scratch);
            }
        }
    }

    /// PIL `Image.rotate(angle, resample)`, no expansion, about the centre, sampling with
    /// `filter` (`None`: nearest neighbour): the exact transposes for 0°, 180° and (square
    /// images) 90° / 270°, else the affine transform with PIL's matrix (its sines and cosines
    /// rounded to 15 decimals as PIL does).
    pub fn rotate(&mut self, angle: f64, fill: [u8; 3], filter: Option<AffineFilter>) {
        let angle = python_mod(angle, 360.0);
        let (w, h) = (self.width, self.height);
        if angle == 0.0 {
            return;
        }
        if angle == 180.0 || ((angle == 90.0 || angle == 270.0) && w == h) {
            let (w, h) = (w as usize, h as usize);
            self.scratch.resize(w * h * 3, 0);
            for y in 0..h {
                for x in 0..w {
                    let (sx, sy) = if angle == 180.0 {
                        (w - 1 - x, h - 1 - y)
                    } else if angle == 90.0 {
                        (w - 1 - y, x)
                    } else {
                        (y, h - 1 - x)
                    };
                    let (d, s) = ((y * w + x) * 3, (sy * w + sx) * 3);
                    self.scratch[d..d + 3].copy_from_slice(&self.pixels[s..s + 3]);
                }
            }
            std::mem::swap(self.pixels, self.scratch);
            return;
        }
        let (cx, cy) = (w as f64 / 2.0, h as f64 / 2.0);
        let a = -angle.to_radians();
        let (cos, sin) = (round15(a.cos()), round15(a.sin()));
        let mut m = [cos, sin, 0.0, round15(-a.sin()), cos, 0.0];
        // PIL: (a·x + b·y) + c, the same double as c + (a·x + b·y).
        let (x, y) = (-cx, -cy);
        m[2] += m[0] * x + m[1] * y;
        m[5] += m[3] * x + m[4] * y;
        m[2] += cx;
        m[5] += cy;
        self.affine_with(m, fill, filter);
    }

    /// PIL's nearest-neighbour `Image.transform(AFFINE, m)`: output pixel (x, y) takes the
    /// source pixel at `m · (x + ½, y + ½)`, `fill` where that is outside. PIL's three code
    /// paths, each reproduced: a pure scale/shift in floating point, 16.16 fixed point when
    /// every corner maps within ±32768, else floating point.
    fn affine(&mut self, m: [f64; 6], fill: [u8; 3]) {
        let (w, h) = (self.width as i64, self.height as i64);
        let n = (w * h) as usize * 3;
        self.scratch.clear();
        self.scratch.reserve(n);
        for _ in 0..w * h {
            self.scratch.extend_from_slice(&fill);
        }
        let (src, out) = (&*self.pixels, &mut *self.scratch);
        let mut put = |x: i64, y: i64, sx: i64, sy: i64| {
            if (0..w).contains(&sx) && (0..h).contains(&sy) {
                let (d, s) = (((y * w + x) * 3) as usize, ((sy * w + sx) * 3) as usize);
                out[d..d + 3].copy_from_slice(&src[s..s + 3]);
            }
        };
        let coord = |v: f64| if v < 0.0 { -1 } else { v as i64 };
        if m[1] == 0.0 && m[3] == 0.0 {
            // ImagingScaleAffine: positions accumulated in doubles.
            let mut yo = m[5] + m[4] * 0.5;
            for y in 0..h {
                let mut xo = m[2] + m[0] * 0.5;
                let sy = coord(yo);
                for x in 0..w {
                    put(x, y, coord(xo), sy);
                    xo += m[0];
                }
                yo += m[4];
            }
        } else if [(0, 0), (w, h), (0, h), (w, 0)].iter().all(|&(x, y)| {
            let (x, y) = (x as f64, y as f64);
            (x * m[0] + y * m[1] + m[2]).abs() < 32768.0
                && (x * m[3] + y * m[4] + m[5]).abs() < 32768.0
        }) {
            // affine_fixed: 16.16 fixed point, the source index by an arithmetic shift.
            let fix = |v: f64| (v * 65536.0 + 0.5).floor() as i32;
            let (a0, a1, a3, a4) = (fix(m[0]), fix(m[1]), fix(m[3]), fix(m[4]));
            let mut a2 = fix(m[2] + m[0] * 0.5 + m[1] * 0.5);
            let mut a5 = fix(m[5] + m[3] * 0.5 + m[4] * 0.5);
            for y in 0..h {
                let (mut xx, mut yy) = (a2, a5);
                for x in 0..w {
                    put(x, y, (xx >> 16) as i64, (yy >> 16) as i64);
                    xx = xx.wrapping_add(a0);
                    yy = yy.wrapping_add(a3);
                }
                a2 = a2.wrapping_add(a1);
                a5 = a5.wrapping_add(a4);
            }
        } else {
            let mut xo = m[2] + m[1] * 0.5 + m[0] * 0.5;
            let mut yo = m[5] + m[4] * 0.5 + m[3] * 0.5;
            for y in 0..h {
                let (mut xx, mut yy) = (xo, yo);
                for x in 0..w {
                    put(x, y, coord(xx), coord(yy));
                    xx += m[0];
                    yy += m[3];
                }
                xo += m[1];
                yo += m[4];
            }
        }
        std::mem::swap(self.pixels, self.scratch);
    }

    /// Maps each channel through a lookup table built from that channel's histogram.
    fn per_channel_lut(&mut self, build: fn(&[u64; 256]) -> [u8; 256]) {
        let mut histograms = [[0u64; 256]; 3];
        for px in self.pixels.chunks_exact(3) {
            for (c, &v) in px.iter().enumerate() {
                histograms[c][v as usize] += 1;
            }
        }
        let luts = histograms.map(|h| build(&h));
        for px in self.pixels.chunks_exact_mut(3) {
            for (c, v) in px.iter_mut().enumerate() {
                *v = luts[c][*v as usize];
            }
        }
    }
}

/// torchvision `adjust_brightness(img, factor)` on a PIL image: `ImageEnhance.Brightness`, a
/// blend with black.
pub fn adjust_brightness(pixels: &mut [u8], factor: f32) {
    blend_with(pixels, factor, |_| [0; 3]);
}

/// torchvision `adjust_saturation(img, factor)` on a PIL image: `ImageEnhance.Color`, a blend
/// with the pixel's gray.
pub fn adjust_saturation(pixels: &mut [u8], factor: f32) {
    blend_with(pixels, factor, |px| [gray(px); 3]);
}

/// torchvision `adjust_contrast(img, factor)` on a PIL image: `ImageEnhance.Contrast`, a blend
/// with the image's mean gray, rounded.
pub fn adjust_contrast(pixels: &mut [u8], factor: f32) {
    let mean = mean_gray(pixels);
    blend_with(pixels, factor, |_| [mean; 3]);
}

/// torchvision `adjust_hue(img, hue_factor)` on a PIL image: to PIL's 8-bit HSV, the hue
/// shifted by `int(hue_factor · 255)` modulo 256, back to RGB.
pub fn adjust_hue(pixels: &mut [u8], hue_factor: f64) {
    // PIL's round trip through HSV changes some pixels even with no shift: kept, as PIL does.
    let shift = ((hue_factor * 255.0) as i32) as u8;
    for px in pixels.chunks_exact_mut(3) {
        let (h, s, v) = rgb_to_hsv(px[0], px[1], px[2]);
        px.copy_from_slice(&hsv_to_rgb(h.wrapping_add(shift), s, v));
    }
}

/// torchvision `rgb_to_grayscale(img, 3)` on a PIL image: `convert("L")`, three times.
pub fn to_grayscale(pixels: &mut [u8]) {
    for px in pixels.chunks_exact_mut(3) {
        px.fill(gray(px));
    }
}

/// PIL's `rgb2hsv` (after `colorsys`), in its mix of `float` and `double` arithmetic.
fn rgb_to_hsv(r: u8, g: u8, b: u8) -> (u8, u8, u8) {
    let (maxc, minc) = (r.max(g).max(b), r.min(g).min(b));
    if maxc == minc {
        return (0, 0, maxc);
    }
    let cr = (maxc - minc) as f32;
    let s = cr / maxc as f32;
    let rc = (maxc - r) as f32 / cr;
    let gc = (maxc - g) as f32 / cr;
    let bc = (maxc - b) as f32 / cr;
    let h = if r == maxc {
        bc - gc
    } else if g == maxc {
        (2.0 + rc as f64 - bc as f64) as f32
    } else {
        (4.0 + gc as f64 - rc as f64) as f32
    };
    let h = ((h as f64 / 6.0 + 1.0) % 1.0) as f32;
    let clip8 = |v: f64| (v as i32).clamp(0, 255) as u8;
    (clip8(h as f64 * 255.0), clip8(s as f64 * 255.0), maxc)
}

/// PIL's `hsv2rgb`, likewise.
fn hsv_to_rgb(h: u8, s: u8, v: u8) -> [u8; 3] {
    if s == 0 {
        return [v; 3];
    }
    let h6 = h as f64 * 6.0 / 255.0;
    let i = h6.floor() as i32;
    let f = (h6 - i as f64) as f32;
    let fs = (s as f64 / 255.0) as f32;
    let vf = v as f64;
    let clip8 = |x: f64| (x.round() as i32).clamp(0, 255) as u8;
    let p = clip8(vf * (1.0 - fs as f64));
    let q = clip8(vf * (1.0 - (fs * f) as f64));
    let t = clip8(vf * (1.0 - fs as f64 * (1.0 - f as f64)));
    match i % 6 {
        0 => [v, t, p],
        1 => [q, v, p],
        2 => [p, v, t],
        3 => [p, q, v],
        4 => [t, p, v],
        _ => [v, p, q],
    }
}

/// torchvision's `_get_inverse_affine_matrix(center, angle, translate, scale=1, shear)`: the
/// matrix PIL's transform takes (output → source), computed in the same order so the doubles
/// are the same.
fn inverse_affine(
    center: (f64, f64),
    angle: f64,
    translate: (f64, f64),
    shear: (f64, f64),
) -> [f64; 6] {
    let rot = angle.to_radians();
    let (sx, sy) = (shear.0.to_radians(), shear.1.to_radians());
    let (cx, cy) = center;
    let (tx, ty) = translate;
    let a = (rot - sy).cos() / sy.cos();
    let b = -(rot - sy).cos() * sx.tan() / sy.cos() - rot.sin();
    let c = (rot - sy).sin() / sy.cos();
    let d = -(rot - sy).sin() * sx.tan() / sy.cos() + rot.cos();
    let mut m = [d, -b, 0.0, -c, a, 0.0];
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty);
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty);
    m[2] += cx;
    m[5] += cy;
    m
}

/// Python's `x % y` for floats (the result takes the divisor's sign; zero is +0).
fn python_mod(x: f64, y: f64) -> f64 {
    let r = x % y;
    if r == 0.0 {
        0.0f64.copysign(y)
    } else if (r < 0.0) != (y < 0.0) {
        r + y
    } else {
        r
    }
}

/// Python's `round(x, 15)`: the nearest double to the decimal rounded at 15 places.
fn round15(x: f64) -> f64 {
    format!("{x:.15}").parse().unwrap_or(x)
}

/// `ImageEnhance`'s factor `1 + magnitude`, as the C `float` PIL's blend takes.
fn factor(magnitude: f64) -> f32 {
    (1.0 + magnitude) as f32
}

/// PIL's RGB → L: ITU-R 601 weights in 16-bit fixed point, rounded.
fn gray(px: &[u8]) -> u8 {
    ((px[0] as u32 * 19595 + px[1] as u32 * 38470 + px[2] as u32 * 7471 + 0x8000) >> 16) as u8
}

/// `ImageEnhance.Contrast`'s degenerate value: `int(mean(L) + 0.5)`.
fn mean_gray(pixels: &[u8]) -> u8 {
    let mut histogram = [0u64; 256];
    for px in pixels.chunks_exact(3) {
        histogram[gray(px) as usize] += 1;
    }
    let count: u64 = histogram.iter().sum();
    if count == 0 {
        return 0;
    }
    let sum: f64 = histogram
        .iter()
        .enumerate()
        .map(|(v, &n)| v as f64 * n as f64)
        .sum();
    (sum / count as f64 + 0.5) as u8
}

/// PIL's `ImagingBlend(degenerate, image, alpha)` one value at a time: `degenerate + alpha ·
/// (image − degenerate)` in `float`, truncated, clipped to 0..255 (a saturating cast).
fn blend_value(degenerate: u8, value: u8, alpha: f32) -> u8 {
    (degenerate as i32 as f32 + alpha * (value as i32 - degenerate as i32) as f32) as u8
}

/// `Image.blend(degenerate, image, alpha)` into `image`, the degenerate pixel computed from
/// each image pixel (PIL's shortcuts for alpha 0 and 1 included).
fn blend_with(pixels: &mut [u8], alpha: f32, degenerate: impl Fn(&[u8]) -> [u8; 3]) {
    if alpha == 1.0 {
        return;
    }
    for px in pixels.chunks_exact_mut(3) {
        let d = degenerate(px);
        for c in 0..3 {
            px[c] = if alpha == 0.0 {
                d[c]
            } else {
                blend_value(d[c], px[c], alpha)
            };
        }
    }
}

/// `Image.blend(degenerate, image, alpha)` into `image`, from a degenerate image.
fn blend(degenerate: &[u8], pixels: &mut [u8], alpha: f32) {
    if alpha == 1.0 {
        return;
    }
    for (v, &d) in pixels.iter_mut().zip(degenerate) {
        *v = if alpha == 0.0 {
            d
        } else {
            blend_value(d, *v, alpha)
        };
    }
}

/// PIL's `filter(SMOOTH)` (3×3 kernel 1 1 1 / 1 5 1 / 1 1 1 over 13) into `out`: the border
/// pixels copied, the inside summed in `float` in PIL's order (rows below, at and above, each
/// left to right), plus ½, truncated. Images under 3 pixels in either side are copied whole.
fn smooth(pixels: &[u8], out: &mut Vec<u8>, width: u32, height: u32) {
    out.clear();
    out.extend_from_slice(pixels);
    let (w, h) = (width as usize, height as usize);
    if w < 3 || h < 3 {
        return;
    }
    let (k1, k5) = (1.0f32 / 13.0, 5.0f32 / 13.0);
    let kernel = [k1, k1, k1, k1, k5, k1, k1, k1, k1];
    let row = |y: usize, x: usize, c: usize, k: &[f32]| {
        let at = |x: usize| pixels[(y * w + x) * 3 + c] as f32;
        at(x - 1) * k[0] + at(x) * k[1] + at(x + 1) * k[2]
    };
    for y in 1..h - 1 {
        for x in 1..w - 1 {
            for c in 0..3 {
                let mut sum = 0.5f32;
                sum += row(y + 1, x, c, &kernel[0..3]);
                sum += row(y, x, c, &kernel[3..6]);
                sum += row(y - 1, x, c, &kernel[6..9]);
                out[(y * w + x) * 3 + c] = sum.clamp(0.0, 255.0) as u8;
            }
        }
    }
}

/// Every value through `f`, by a lookup table.
fn map_values(pixels: &mut [u8], f: impl Fn(u8) -> u8) {
    let lut: [u8; 256] = std::array::from_fn(|v| f(v as u8));
    for v in pixels {
        *v = lut[*v as usize];
    }
}

/// `ImageOps.autocontrast` (no cutoff): the lowest and highest values present stretched to 0
/// and 255, `int(v · scale + offset)` clipped.
fn autocontrast_lut(histogram: &[u64; 256]) -> [u8; 256] {
    let lo = histogram.iter().position(|&n| n > 0);
    let hi = histogram.iter().rposition(|&n| n > 0);
    match (lo, hi) {
        (Some(lo), Some(hi)) if hi > lo => {
            let scale = 255.0 / (hi - lo) as f64;
            let offset = -(lo as f64) * scale;
            std::array::from_fn(|v| (v as f64 * scale + offset).trunc().clamp(0.0, 255.0) as u8)
        }
        _ => std::array::from_fn(|v| v as u8),
    }
}

/// `ImageOps.equalize`: PIL's cumulative-histogram table (its integer steps, `// 255`).
fn equalize_lut(histogram: &[u64; 256]) -> [u8; 256] {
    let identity = std::array::from_fn(|v| v as u8);
    let present = histogram.iter().filter(|&&n| n > 0).count();
    let last = histogram
        .iter()
        .rev()
        .find(|&&n| n > 0)
        .copied()
        .unwrap_or(0);
    if present <= 1 {
        return identity;
    }
    let step = (histogram.iter().sum::<u64>() - last) / 255;
    if step == 0 {
        return identity;
    }
    let mut n = step / 2;
    std::array::from_fn(|i| {
        let v = (n / step).min(255) as u8;
        n += histogram[i];
        v
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic, textured w×h image.
    fn texture(w: u32, h: u32) -> Vec<u8> {
        (0..w * h * 3)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 / 2 + (i % 97) as u8)
            .collect()
    }

    fn run(op: Op, magnitude: f64, pixels: &[u8], w: u32, h: u32) -> Vec<u8> {
        let (mut p, mut s) = (pixels.to_vec(), Vec::new());
        RgbImage {
            pixels: &mut p,
            scratch: &mut s,
            width: w,
            height: h,
        }
        .apply(op, magnitude, [1, 2, 3]);
        p
    }

    fn px(pixels: &[u8], w: u32, x: u32, y: u32) -> [u8; 3] {
        let i = ((y * w + x) * 3) as usize;
        [pixels[i], pixels[i + 1], pixels[i + 2]]
    }

    #[test]
    fn geometric_ops_move_pixels_where_pil_does() {
        let (w, h) = (9, 7);
        let img = texture(w, h);
        // Translate right by 2 (the magnitude truncates): columns shift, fill enters left.
        let t = run(Op::TranslateX, 2.9, &img, w, h);
        assert_eq!(px(&t, w, 0, 3), [1, 2, 3]);
        assert_eq!(px(&t, w, 5, 3), px(&img, w, 3, 3));
        let t = run(Op::TranslateY, -1.0, &img, w, h);
        assert_eq!(px(&t, w, 4, 2), px(&img, w, 4, 3));
        assert_eq!(px(&t, w, 4, 6), [1, 2, 3]);
        // 180° is an exact point reflection; 360° and 0 change nothing.
        let r = run(Op::Rotate, 180.0, &img, w, h);
        assert_eq!(px(&r, w, 0, 0), px(&img, w, w - 1, h - 1));
        assert_eq!(run(Op::Rotate, -360.0, &img, w, h), img);
        // On a square image, 90° counter-clockwise: the top-right corner goes top-left, and
        // four of them are the identity.
        let sq = texture(6, 6);
        let r = run(Op::Rotate, 90.0, &sq, 6, 6);
        assert_eq!(px(&r, 6, 0, 0), px(&sq, 6, 5, 0));
        let mut back = r;
        for _ in 0..3 {
            back = run(Op::Rotate, -270.0, &back, 6, 6);
        }
        assert_eq!(back, sq);
        // Shear x by 1: row y samples from x + y (+ rounding at the pixel centre).
        let s = run(Op::ShearX, 1.0, &img, w, h);
        assert_eq!(px(&s, w, 2, 3), px(&img, w, 6, 3));
        assert_eq!(px(&s, w, 8, 3), [1, 2, 3]);
        assert_eq!(run(Op::ShearY, 0.0, &img, w, h), img);
    }

    #[test]
    fn colour_ops_follow_pils_blend() {
        let (w, h) = (8, 8);
        let img = texture(w, h);
        // Factor 1 is the image, factor 0 the degenerate image.
        assert_eq!(run(Op::Brightness, 0.0, &img, w, h), img);
        assert!(
            run(Op::Brightness, -1.0, &img, w, h)
                .iter()
                .all(|&v| v == 0)
        );
        let gray = run(Op::Color, -1.0, &img, w, h);
        assert!(gray.chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]));
        let flat = run(Op::Contrast, -1.0, &img, w, h);
        assert!(flat.iter().all(|&v| v == flat[0]));
        // Truncation, not rounding: 0.5 · 255 = 127.5 → 127; extrapolation clips.
        assert_eq!(blend_value(0, 255, 0.5), 127);
        assert_eq!(blend_value(0, 200, 1.9), 255);
        assert_eq!(blend_value(100, 0, 1.9), 0);
        // A flat image is its own smoothing: sharpness changes nothing.
        let plain = [40u8, 80, 120].repeat(25);
        assert_eq!(run(Op::Sharpness, 0.9, &plain, 5, 5), plain);
    }

    #[test]
    fn lookup_ops_match_their_definitions() {
        let (w, h) = (16, 16);
        let img = texture(w, h);
        assert!(
            run(Op::Posterize, 3.0, &img, w, h)
                .iter()
                .all(|&v| v & 0x1f == 0)
        );
        let s = run(Op::Solarize, 128.0, &img, w, h);
        for (a, b) in img.iter().zip(&s) {
            assert_eq!(*b, if *a < 128 { *a } else { 255 - *a });
        }
        assert_eq!(
            run(Op::Invert, 0.0, &run(Op::Invert, 0.0, &img, w, h), w, h),
            img
        );
        // Autocontrast reaches both ends in every channel that has two values (the top within
        // PIL's truncation of `hi · scale + offset`).
        let a = run(Op::AutoContrast, 0.0, &img, w, h);
        for c in 0..3 {
            let channel: Vec<u8> = a.iter().skip(c).step_by(3).copied().collect();
            assert_eq!(channel.iter().min(), Some(&0));
            assert!(channel.iter().max() >= Some(&254));
        }
        // Equalizing an image with one value per channel changes nothing.
        let plain = [7u8, 99, 250].repeat(16);
        assert_eq!(run(Op::Equalize, 0.0, &plain, 4, 4), plain);
        assert_eq!(python_mod(-4.5, 360.0), 355.5);
        assert_eq!(round15(0.1 + 0.2), 0.3);
    }

    #[test]
    fn tiny_and_degenerate_images_do_not_panic() {
        for (w, h) in [(1, 1), (1, 5), (5, 1), (2, 2)] {
            let img = texture(w, h);
            for op in ALL_OPS {
                for m in [-135.0, -0.99, 0.0, 0.5, 8.0, 90.0, 255.0] {
                    assert_eq!(run(op, m, &img, w, h).len(), img.len(), "{op:?} {m}");
                }
            }
        }
    }
}
