//! torchvision's `GaussianBlur(kernel_size, sigma)` (optionally inside `RandomApply(p)`), as it
//! runs on PIL images: the image as a `float32` tensor, convolved with the normalized Gaussian
//! kernel after reflect padding, rounded half to even.
//!
//! torchvision convolves with the 2-D kernel (the outer product of the two 1-D ones); here the
//! two 1-D passes run one after the other, the same sum in another order, so a value can land on
//! the other side of a rounding boundary: within one level of torchvision's (measured: equal on
//! every value of a test photo for kernels 3 to 23, python/tests/test_torch.py). Reflect padding repeats for images smaller than the
//! kernel, where torchvision raises.

use crate::rng::SampleRng;

/// torchvision `GaussianBlur`: the kernel's width and height (odd), the range sigma is drawn
/// from (uniform, `float32`), and the probability it applies (torchvision's `RandomApply`; 1 for
/// a plain `GaussianBlur`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GaussianBlur {
    /// Kernel width and height in pixels (odd, at least 1).
    pub kernel: (u32, u32),
    /// Range of the standard deviation (`0 < min <= max`).
    pub sigma: (f64, f64),
    /// Probability of blurring.
    pub p: f64,
}

/// The largest kernel side accepted.
pub const MAX_KERNEL: u32 = 1 << 10;

impl GaussianBlur {
    /// torchvision's `GaussianBlur(kernel_size, sigma=(0.1, 2.0))` with a square kernel.
    pub fn new(kernel_size: u32) -> GaussianBlur {
        GaussianBlur {
            kernel: (kernel_size, kernel_size),
            sigma: (0.1, 2.0),
            p: 1.0,
        }
    }

    /// Checks the parameters as torchvision does.
    pub fn validate(&self) -> Result<(), String> {
        let (kx, ky) = self.kernel;
        for k in [kx, ky] {
            if k == 0 || k % 2 == 0 || k > MAX_KERNEL {
                return Err(format!(
                    "GaussianBlur kernel size {k} must be odd and in 1..={MAX_KERNEL}"
                ));
            }
        }
        let (low, high) = self.sigma;
        if !(0.0 < low && low <= high && high.is_finite()) {
            return Err(format!(
                "GaussianBlur sigma ({low}, {high}) must satisfy 0 < min <= max"
            ));
        }
        if !(0.0..=1.0).contains(&self.p) {
            return Err(format!(
                "GaussianBlur probability {} is not in 0..1",
                self.p
            ));
        }
        Ok(())
    }

    /// Draws sigma and blurs the `width × height` RGB `pixels` (`scratch`: any contents).
    pub fn apply(
        &self,
        rng: &mut SampleRng,
        pixels: &mut [u8],
        scratch: &mut Vec<f32>,
        width: u32,
        height: u32,
    ) {
        if self.p < 1.0 && !rng.chance(self.p) {
            return;
        }
        let (low, high) = self.sigma;
        let sigma = rng.uniform(low, high).clamp(low, high) as f32;
        blur(
            pixels,
            scratch,
            width as usize,
            height as usize,
            self.kernel,
            sigma,
        );
    }
}

/// torchvision's `_get_gaussian_kernel1d`: `exp(-0.5 (x / sigma)²)` at `x` in
/// `linspace(-(k-1)/2, (k-1)/2, k)`, normalized to sum 1, in `float32`.
fn kernel1d(size: u32, sigma: f32) -> Vec<f32> {
    let half = (size as f32 - 1.0) * 0.5;
    let pdf: Vec<f32> = (0..size)
        .map(|i| {
            let x = -half + i as f32;
            (-0.5 * (x / sigma).powi(2)).exp()
        })
        .collect();
    let sum: f32 = pdf.iter().sum();
    pdf.iter().map(|v| v / sum).collect()
}

/// Index `i` of a side of `n` after reflect padding (`-1` → `1`), repeated as often as needed.
fn reflect(mut i: i64, n: i64) -> usize {
    if n == 1 {
        return 0;
    }
    let period = 2 * (n - 1);
    i = i.rem_euclid(period);
    (if i >= n { period - i } else { i }) as usize
}

/// The two 1-D passes over an HWC RGB image, the result rounded half to even.
pub fn blur(
    pixels: &mut [u8],
    scratch: &mut Vec<f32>,
    width: usize,
    height: usize,
    (kx, ky): (u32, u32),
    sigma: f32,
) {
    if width == 0 || height == 0 {
        return;
    }
    let (wx, wy) = (kernel1d(kx, sigma), kernel1d(ky, sigma));
    let (hx, hy) = ((kx / 2) as i64, (ky / 2) as i64);
    let columns: Vec<Vec<usize>> = (0..width as i64)
        .map(|x| {
            (0..kx as i64)
                .map(|i| reflect(x + i - hx, width as i64))
                .collect()
        })
        .collect();
    scratch.clear();
    scratch.resize(width * height * 3, 0.0);
    for y in 0..height {
        let row = &pixels[y * width * 3..(y + 1) * width * 3];
        let out = &mut scratch[y * width * 3..(y + 1) * width * 3];
        for (x, taps) in columns.iter().enumerate() {
            for c in 0..3 {
                out[x * 3 + c] = taps
                    .iter()
                    .zip(&wx)
                    .map(|(&sx, &k)| row[sx * 3 + c] as f32 * k)
                    .sum();
            }
        }
    }
    let rows: Vec<Vec<usize>> = (0..height as i64)
        .map(|y| {
            (0..ky as i64)
                .map(|j| reflect(y + j - hy, height as i64))
                .collect()
        })
        .collect();
    let stride = width * 3;
    for (y, taps) in rows.iter().enumerate() {
        for i in 0..stride {
            let v: f32 = taps
                .iter()
                .zip(&wy)
                .map(|(&sy, &k)| scratch[sy * stride + i] * k)
                .sum();
            pixels[y * stride + i] = v.round_ties_even().clamp(0.0, 255.0) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reflect_pads_as_torch_and_repeats_for_small_sides() {
        let n = 5;
        let got: Vec<usize> = (-3..8).map(|i| reflect(i, n)).collect();
        assert_eq!(got, [3, 2, 1, 0, 1, 2, 3, 4, 3, 2, 1]);
        assert_eq!(reflect(-7, 2), 1);
        assert_eq!(reflect(9, 1), 0);
    }

    #[test]
    fn a_flat_image_stays_flat_and_an_edge_is_softened() {
        let (w, h) = (9, 7);
        let mut flat = [50u8, 100, 150].repeat(w * h);
        let mut scratch = Vec::new();
        blur(&mut flat, &mut scratch, w, h, (5, 3), 1.3);
        assert!(flat.chunks(3).all(|p| p == [50, 100, 150]));
        // A vertical edge: black left half, white right half.
        let mut edge: Vec<u8> = (0..w * h)
            .flat_map(|i| [if i % w < w / 2 { 0u8 } else { 255 }; 3])
            .collect();
        blur(&mut edge, &mut scratch, w, h, (5, 5), 1.0);
        let row: Vec<u8> = edge[..w * 3].iter().step_by(3).copied().collect();
        assert!(row.windows(2).all(|p| p[0] <= p[1]), "{row:?}");
        assert!(row[w / 2 - 1] > 0 && row[w / 2] < 255, "{row:?}");
        // Kernel weights sum to one and are symmetric.
        let k = kernel1d(7, 1.5);
        assert!((k.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(k[0], k[6]);
    }

    #[test]
    fn tiny_images_and_parameters_are_handled() {
        let mut scratch = Vec::new();
        for (w, h) in [(1, 1), (1, 4), (3, 1), (2, 2)] {
            let mut p = vec![200u8; w * h * 3];
            blur(&mut p, &mut scratch, w, h, (23, 23), 2.0);
            assert!(p.iter().all(|&v| v == 200), "{w}x{h}");
        }
        assert!(GaussianBlur::new(4).validate().is_err());
        assert!(GaussianBlur::new(0).validate().is_err());
        let mut g = GaussianBlur::new(3);
        g.sigma = (0.0, 1.0);
        assert!(g.validate().is_err());
        assert!(GaussianBlur::new(23).validate().is_ok());
    }
}
