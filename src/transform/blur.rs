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

    /// Draws sigma and blurs the `width × height` RGB `pixels`.
    pub fn apply(
        &self,
        rng: &mut SampleRng,
        pixels: &mut [u8],
        scratch: &mut BlurScratch,
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

/// Memory [`blur`] reuses from one image to the next (one per worker): the kernels, the
/// reflected tap positions and the first pass's output.
#[derive(Default)]
pub struct BlurScratch {
    kernel_x: Vec<f32>,
    kernel_y: Vec<f32>,
    taps_x: Vec<usize>,
    taps_y: Vec<usize>,
    pass: Vec<f32>,
}

/// torchvision's `_get_gaussian_kernel1d` into `out`: `exp(-0.5 (x / sigma)²)` at `x` in
/// `linspace(-(k-1)/2, (k-1)/2, k)`, normalized to sum 1, in `float32`.
///
/// A sigma that is 0 in `float32` (drawn from a range like 1e-46, which is positive in
/// `float64`) counts as the smallest normal one: the kernel is the identity, where 0 / 0 made
/// every weight NaN and every image black (a hostile try).
fn kernel1d(size: u32, sigma: f32, out: &mut Vec<f32>) {
    let sigma = sigma.max(f32::MIN_POSITIVE);
    let half = (size as f32 - 1.0) * 0.5;
    out.clear();
    out.extend((0..size).map(|i| {
        let x = -half + i as f32;
        (-0.5 * (x / sigma).powi(2)).exp()
    }));
    let sum: f32 = out.iter().sum();
    for v in out.iter_mut() {
        *v /= sum;
    }
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

/// For each of the `n` positions of a side, the source positions of its `k` taps after
/// reflect padding, one run of `k` after the other in `out`.
fn reflected_taps(n: usize, k: u32, out: &mut Vec<usize>) {
    let half = (k / 2) as i64;
    out.clear();
    for position in 0..n as i64 {
        out.extend((0..k as i64).map(|i| reflect(position + i - half, n as i64)));
    }
}

/// The two 1-D passes over an HWC RGB image, the result rounded half to even.
pub fn blur(
    pixels: &mut [u8],
    scratch: &mut BlurScratch,
    width: usize,
    height: usize,
    (kx, ky): (u32, u32),
    sigma: f32,
) {
    if width == 0 || height == 0 {
        return;
    }
    let BlurScratch {
        kernel_x,
        kernel_y,
        taps_x,
        taps_y,
        pass,
    } = scratch;
    kernel1d(kx, sigma, kernel_x);
    kernel1d(ky, sigma, kernel_y);
    reflected_taps(width, kx, taps_x);
    reflected_taps(height, ky, taps_y);
    let stride = width * 3;
    pass.clear();
    pass.resize(stride * height, 0.0);
    for y in 0..height {
        let row = &pixels[y * stride..(y + 1) * stride];
        let out = &mut pass[y * stride..(y + 1) * stride];
        for (x, taps) in taps_x.chunks_exact(kx as usize).enumerate() {
            for c in 0..3 {
                out[x * 3 + c] = taps
                    .iter()
                    .zip(kernel_x.iter())
                    .map(|(&sx, &k)| row[sx * 3 + c] as f32 * k)
                    .sum();
            }
        }
    }
    for (y, taps) in taps_y.chunks_exact(ky as usize).enumerate() {
        for i in 0..stride {
            let v: f32 = taps
                .iter()
                .zip(kernel_y.iter())
                .map(|(&sy, &k)| pass[sy * stride + i] * k)
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
        let mut scratch = BlurScratch::default();
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
        let mut k = Vec::new();
        kernel1d(7, 1.5, &mut k);
        assert!((k.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(k[0], k[6]);
    }

    #[test]
    fn tiny_images_and_parameters_are_handled() {
        let mut scratch = BlurScratch::default();
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
        // A sigma positive in f64 and 0 in f32: the identity, never NaN weights (a hostile
        // try's images came out black).
        g.sigma = (1e-46, 1e-46);
        assert!(g.validate().is_ok());
        let mut k = Vec::new();
        kernel1d(5, 0.0, &mut k);
        assert_eq!(k, [0.0, 0.0, 1.0, 0.0, 0.0]);
        let (w, h) = (4, 3);
        let mut ramp: Vec<u8> = (0..(w * h * 3) as u8).collect();
        let before = ramp.clone();
        g.apply(&mut SampleRng::new(0, 0, 0), &mut ramp, &mut scratch, w, h);
        assert_eq!(ramp, before);
    }
}
