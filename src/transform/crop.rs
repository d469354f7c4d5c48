//! Crop boxes ([`Rect`]s) with torchvision's exact arithmetic.

use crate::geometry::Rect;
use crate::rng::SampleRng;

/// Python's `round()`: halves go to the even neighbour.
fn py_round(x: f64) -> f64 {
    x.round_ties_even()
}

/// torchvision `RandomResizedCrop.get_params(img, scale, ratio)`, drawing from `rng`.
///
/// Up to 10 attempts at a box of random area (`scale` × image area) and log-uniform aspect ratio
/// (`ratio`) that fits; otherwise the central crop with the aspect ratio clamped into `ratio`.
pub fn random_resized_crop(
    rng: &mut SampleRng,
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
) -> Rect {
    let (w_img, h_img) = (width as f64, height as f64);
    let area = w_img * h_img;
    let log_ratio = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target_area = area * rng.uniform(scale.0, scale.1);
        let aspect = rng.uniform(log_ratio.0, log_ratio.1).exp();
        let w = py_round((target_area * aspect).sqrt());
        let h = py_round((target_area / aspect).sqrt());
        if 0.0 < w && w <= w_img && 0.0 < h && h <= h_img {
            // torch.randint(0, H - h + 1): an integer in 0..=H-h.
            let top = rng.below((h_img - h) as u64 + 1) as f64;
            let left = rng.below((w_img - w) as u64 + 1) as f64;
            return Rect {
                top,
                left,
                height: h,
                width: w,
            };
        }
    }
    let in_ratio = w_img / h_img;
    let (w, h) = if in_ratio < ratio.0.min(ratio.1) {
        (w_img, py_round(w_img / ratio.0.min(ratio.1)))
    } else if in_ratio > ratio.0.max(ratio.1) {
        (py_round(h_img * ratio.0.max(ratio.1)), h_img)
    } else {
        (w_img, h_img)
    };
    Rect {
        top: ((h_img - h) / 2.0).floor(),
        left: ((w_img - w) / 2.0).floor(),
        height: h,
        width: w,
    }
}

/// torchvision `CenterCrop((crop_h, crop_w))` on an image of `width × height`: offsets
/// `int(round((H - h) / 2))`, negative (padding) when the crop is larger.
pub fn center_crop(width: u32, height: u32, crop_width: u32, crop_height: u32) -> Rect {
    Rect {
        top: py_round((height as f64 - crop_height as f64) / 2.0),
        left: py_round((width as f64 - crop_width as f64) / 2.0),
        height: crop_height as f64,
        width: crop_width as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn center_crop_matches_torchvision_offsets() {
        // torchvision: CenterCrop(224) on 256x341 (h x w) -> top 16, left int(round(58.5)) = 58.
        let b = center_crop(341, 256, 224, 224);
        assert_eq!(
            (b.top, b.left, b.height, b.width),
            (16.0, 58.0, 224.0, 224.0)
        );
        // Larger than the image: negative offsets (zero padding).
        let b = center_crop(20, 10, 30, 30);
        assert_eq!((b.top, b.left), (-10.0, -5.0));
    }

    #[test]
    fn random_resized_crop_stays_inside_and_respects_scale_and_ratio() {
        for index in 0..2000 {
            let mut rng = SampleRng::new(1, 0, index);
            let (w, h) = (500, 375);
            let b = random_resized_crop(&mut rng, w, h, (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0));
            assert!(b.top >= 0.0 && b.left >= 0.0, "{b:?}");
            assert!(
                b.top + b.height <= h as f64 && b.left + b.width <= w as f64,
                "{b:?}"
            );
            assert_eq!(b.width.fract(), 0.0);
            let area = b.width * b.height / (w * h) as f64;
            // Rounding moves area and ratio a little past the nominal bounds.
            assert!((0.07..=1.0).contains(&area), "{b:?} area {area}");
            let ratio = b.width / b.height;
            assert!((0.70..=1.40).contains(&ratio), "{b:?} ratio {ratio}");
        }
    }

    #[test]
    fn impossible_ratio_falls_back_to_the_clamped_center_crop() {
        // A 1000x10 strip cannot hold a crop with ratio <= 4/3 of any large area: after 10
        // failed attempts torchvision takes the full height and width = round(10 * 4/3) = 13.
        let mut rng = SampleRng::new(0, 0, 0);
        let b = random_resized_crop(&mut rng, 1000, 10, (0.9, 1.0), (3.0 / 4.0, 4.0 / 3.0));
        assert_eq!((b.top, b.left, b.height, b.width), (0.0, 493.0, 10.0, 13.0));
    }

    #[test]
    fn python_rounding_is_half_to_even() {
        assert_eq!(py_round(2.5), 2.0);
        assert_eq!(py_round(3.5), 4.0);
        assert_eq!(py_round(-0.5), -0.0);
    }
}
