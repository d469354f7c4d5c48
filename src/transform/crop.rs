//! Crop boxes ([`Rect`]s) with torchvision's exact arithmetic.

use crate::decode::DecodeError;
use crate::geometry::Rect;
use crate::rng::SampleRng;

/// Python's `round()`: halves go to the even neighbour.
fn py_round(x: f64) -> f64 {
    x.round_ties_even()
}

/// One try of torchvision's box draws (`RandomResizedCrop`, `RandomErasing`): an area of
/// `scale` × `area` and a log-uniform aspect ratio in `ratio`, drawn in that order, as the
/// box's sides `(round(sqrt(area × ratio)), round(sqrt(area / ratio)))`, Python rounding.
/// `RandomResizedCrop` takes them as width and height, `RandomErasing` as height and width.
pub(crate) fn area_and_ratio(
    rng: &mut SampleRng,
    area: f64,
    scale: (f64, f64),
    ratio: (f64, f64),
) -> (f64, f64) {
    let target = area * rng.uniform(scale.0, scale.1);
    let aspect = rng.uniform(ratio.0.ln(), ratio.1.ln()).exp();
    (
        py_round((target * aspect).sqrt()),
        py_round((target / aspect).sqrt()),
    )
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
    for _ in 0..10 {
        let (w, h) = area_and_ratio(rng, area, scale, ratio);
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
    // At least one row and column: a ratio range far from the image's (100 to 200 on a
    // square) rounded the box to none, which resized to a black image without a word
    // (torchvision raises there; a hostile try).
    let (w, h) = if in_ratio < ratio.0.min(ratio.1) {
        (w_img, py_round(w_img / ratio.0.min(ratio.1)).max(1.0))
    } else if in_ratio > ratio.0.max(ratio.1) {
        (py_round(h_img * ratio.0.max(ratio.1)).max(1.0), h_img)
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

/// torchvision `RandomCrop((crop_h, crop_w), padding, pad_if_needed)` on an image of
/// `width × height`, drawing from `rng`: the window in the image's own coordinates (negative,
/// or reaching past the image, where it lies in the zero padding). `padding` is left, top,
/// right, bottom; `pad_if_needed` then pads a side still shorter than the window by the
/// difference on both ends. The offsets are drawn as torchvision's `get_params` draws them:
/// `randint(0, H - h + 1)` for the top, then the left; none when the padded image is the
/// window's size.
pub fn random_crop(
    rng: &mut SampleRng,
    width: u32,
    height: u32,
    crop_width: u32,
    crop_height: u32,
    padding: [u32; 4],
    pad_if_needed: bool,
) -> Result<Rect, DecodeError> {
    let [left, top, right, bottom] = padding.map(u64::from);
    let (mut padded_w, mut padded_h) = (
        u64::from(width) + left + right,
        u64::from(height) + top + bottom,
    );
    let (mut left, mut top) = (left, top);
    if pad_if_needed && padded_w < u64::from(crop_width) {
        let more = u64::from(crop_width) - padded_w;
        left += more;
        padded_w += 2 * more;
    }
    if pad_if_needed && padded_h < u64::from(crop_height) {
        let more = u64::from(crop_height) - padded_h;
        top += more;
        padded_h += 2 * more;
    }
    if padded_w < u64::from(crop_width) || padded_h < u64::from(crop_height) {
        return Err(DecodeError::SmallerThanCrop {
            width: padded_w,
            height: padded_h,
            crop_width,
            crop_height,
        });
    }
    let (i, j) = if (padded_w, padded_h) == (u64::from(crop_width), u64::from(crop_height)) {
        (0, 0)
    } else {
        let i = rng.below(padded_h - u64::from(crop_height) + 1);
        let j = rng.below(padded_w - u64::from(crop_width) + 1);
        (i, j)
    };
    Ok(Rect {
        top: i as f64 - top as f64,
        left: j as f64 - left as f64,
        height: crop_height as f64,
        width: crop_width as f64,
    })
}

/// What `RandomCrop` fills its padding with: torchvision's `padding_mode` (with `fill` for
/// `Constant`), on the `u8` image before it is normalized, as torchvision pads a PIL image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PaddingMode {
    /// One colour, the step's `fill` (black by default).
    #[default]
    Constant,
    /// The edge pixel, repeated: `0 0 0 | 0 1 2`.
    Edge,
    /// Mirrored about the edge pixel, which is not repeated: `3 2 1 | 0 1 2 3`.
    Reflect,
    /// Mirrored with the edge pixel repeated: `2 1 0 | 0 1 2`.
    Symmetric,
}

impl PaddingMode {
    /// torchvision's name for the mode (`padding_mode`).
    pub fn name(self) -> &'static str {
        match self {
            PaddingMode::Constant => "constant",
            PaddingMode::Edge => "edge",
            PaddingMode::Reflect => "reflect",
            PaddingMode::Symmetric => "symmetric",
        }
    }

    /// The mode torchvision calls `name`.
    pub fn from_name(name: &str) -> Option<PaddingMode> {
        [
            PaddingMode::Constant,
            PaddingMode::Edge,
            PaddingMode::Reflect,
            PaddingMode::Symmetric,
        ]
        .into_iter()
        .find(|mode| mode.name() == name)
    }

    /// Which of a line's `len` (at least 1) pixels lands at coordinate `x` (negative, or `len`
    /// and past, in the padding); `None` where the constant fill does. A padding wider than the
    /// line repeats the pattern, as numpy's `pad` (which torchvision pads PIL images with) does.
    pub fn source(self, x: i64, len: i64) -> Option<i64> {
        debug_assert!(len >= 1);
        if (0..len).contains(&x) {
            return Some(x);
        }
        match self {
            PaddingMode::Constant => None,
            PaddingMode::Edge => Some(x.clamp(0, len - 1)),
            PaddingMode::Reflect if len == 1 => Some(0),
            PaddingMode::Reflect => {
                let period = 2 * (len - 1);
                let m = x.rem_euclid(period);
                Some(if m < len { m } else { period - m })
            }
            PaddingMode::Symmetric => {
                let period = 2 * len;
                let m = x.rem_euclid(period);
                Some(if m < len { m } else { period - 1 - m })
            }
        }
    }
}

/// How a crop reaching past the image fills what lies outside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Padding {
    /// The colour `Constant` fills with.
    pub fill: [u8; 3],
    /// How the padding is filled.
    pub mode: PaddingMode,
    /// `RandomCrop`'s own padding (left, top, right, bottom): torchvision pads by it first,
    /// then (`pad_if_needed`) pads that padded image again, so a mirrored second pad mirrors
    /// the first one's pixels too.
    pub first: [u32; 4],
}

impl Padding {
    /// Which of a line's `len` pixels lands at `x` (in the image's coordinates) after the
    /// first padding (`lo` before the line, `hi` after it) and a second padding of the padded
    /// line by whatever reaches further; `None` where the constant fill does.
    pub fn source(&self, x: i64, len: i64, lo: u32, hi: u32) -> Option<i64> {
        let (lo, hi) = (i64::from(lo), i64::from(hi));
        let padded = self.mode.source(x + lo, len + lo + hi)?;
        self.mode.source(padded - lo, len)
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
        // A ratio range far from the image's: at least a row or a column, never an empty box
        // (which resized to a black image; a hostile try).
        for (ratio, (height, width)) in [
            ((100.0, 200.0), (1.0, 32.0)),
            ((1e-3, 1e-2), (32.0, 1.0)),
            ((1e300, 1e300), (1.0, 32.0)),
        ] {
            let b = random_resized_crop(&mut rng, 32, 32, (0.08, 1.0), ratio);
            assert_eq!((b.height, b.width), (height, width), "{ratio:?}");
            assert!(b.top >= 0.0 && b.top + b.height <= 32.0, "{b:?}");
        }
    }

    #[test]
    fn random_crop_draws_every_offset_of_the_padded_image_evenly() {
        // CIFAR's RandomCrop(32, padding=4): offsets -4..=4 on both axes, each about 1/9.
        let mut counts = [[0u32; 9]; 2];
        for index in 0..9000 {
            let mut rng = SampleRng::new(3, 0, index);
            let b = random_crop(&mut rng, 32, 32, 32, 32, [4; 4], false).unwrap();
            assert_eq!((b.width, b.height), (32.0, 32.0));
            counts[0][(b.top + 4.0) as usize] += 1;
            counts[1][(b.left + 4.0) as usize] += 1;
        }
        for axis in counts {
            assert!(axis.iter().all(|&c| (850..1150).contains(&c)), "{axis:?}");
        }
        // Asymmetric padding (left 1, top 2, right 3, bottom 0): the window stays inside.
        for index in 0..500 {
            let mut rng = SampleRng::new(3, 1, index);
            let b = random_crop(&mut rng, 10, 8, 12, 8, [1, 2, 3, 0], false).unwrap();
            assert!(
                (-1.0..=1.0).contains(&b.left) && (-2.0..=0.0).contains(&b.top),
                "{b:?}"
            );
        }
    }

    #[test]
    fn random_crop_pads_if_needed_and_refuses_a_window_larger_than_the_padded_image() {
        // A window exactly the padded size: no draw, the padding's corner.
        let mut rng = SampleRng::new(0, 0, 0);
        let b = random_crop(&mut rng, 30, 20, 32, 24, [1, 2, 1, 2], false).unwrap();
        assert_eq!((b.top, b.left), (-2.0, -1.0));
        // Larger: an error, or (pad_if_needed) padding by the difference on both ends: width
        // 20 -> 20 + 2 * 12 = 44 for a 32-wide window, offsets -12..=0.
        assert!(matches!(
            random_crop(&mut rng, 20, 20, 32, 20, [0; 4], false),
            Err(DecodeError::SmallerThanCrop {
                width: 20,
                crop_width: 32,
                ..
            })
        ));
        for index in 0..200 {
            let mut rng = SampleRng::new(0, 0, index);
            let b = random_crop(&mut rng, 20, 20, 32, 20, [0; 4], true).unwrap();
            assert!((-12.0..=0.0).contains(&b.left) && b.top == 0.0, "{b:?}");
        }
    }

    #[test]
    fn padding_modes_follow_numpys_pad_also_past_the_line() {
        // numpy: np.pad(np.arange(4), 9, mode) for each mode, the indices it takes.
        let line = |mode: PaddingMode| -> Vec<Option<i64>> {
            (-9..13).map(|x| mode.source(x, 4)).collect()
        };
        let some = |v: &[i64]| v.iter().map(|&x| Some(x)).collect::<Vec<_>>();
        assert_eq!(
            line(PaddingMode::Reflect),
            some(&[
                3, 2, 1, 0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1, 0
            ])
        );
        assert_eq!(
            line(PaddingMode::Symmetric),
            some(&[
                0, 0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3, 3
            ])
        );
        assert_eq!(
            line(PaddingMode::Edge),
            some(&[
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3
            ])
        );
        let constant = line(PaddingMode::Constant);
        assert!(
            constant[..9]
                .iter()
                .chain(&constant[13..])
                .all(Option::is_none)
        );
        assert_eq!(constant[9..13], some(&[0, 1, 2, 3]));
        // A one-pixel line: every mode repeats it.
        for mode in [
            PaddingMode::Edge,
            PaddingMode::Reflect,
            PaddingMode::Symmetric,
        ] {
            assert!((-5..5).all(|x| mode.source(x, 1) == Some(0)), "{mode:?}");
        }
        for mode in [
            PaddingMode::Constant,
            PaddingMode::Edge,
            PaddingMode::Reflect,
            PaddingMode::Symmetric,
        ] {
            assert_eq!(PaddingMode::from_name(mode.name()), Some(mode));
        }
        assert_eq!(PaddingMode::from_name("wrap"), None);
    }

    #[test]
    fn a_second_mirrored_pad_mirrors_the_first_one_too() {
        // torchvision: F.pad(F.pad([0, 1, 2, 3], 1, reflect), 2, reflect) = [1, 0, 1, 0, 1, 2,
        // 3, 2, 3, 2] (the second pad reflects the first one's pixels), over x = -3..7.
        let padding = Padding {
            mode: PaddingMode::Reflect,
            first: [1; 4],
            ..Padding::default()
        };
        let line: Vec<i64> = (-3..7)
            .map(|x| padding.source(x, 4, 1, 1).unwrap())
            .collect();
        assert_eq!(line, [1, 0, 1, 0, 1, 2, 3, 2, 3, 2]);
        // One pad reflecting as far would give 3, 2, 1 at x = -3..0: not torchvision's.
        assert_ne!(
            (-3..7)
                .map(|x| PaddingMode::Reflect.source(x, 4).unwrap())
                .collect::<Vec<_>>(),
            line
        );
        // Symmetric: [0, 1, 2, 3] -> [0 | 0 1 2 3 | 3] -> [0 0 | 0 0 1 2 3 3 | 3 3].
        let symmetric = Padding {
            mode: PaddingMode::Symmetric,
            ..padding
        };
        let line: Vec<i64> = (-3..7)
            .map(|x| symmetric.source(x, 4, 1, 1).unwrap())
            .collect();
        assert_eq!(line, [0, 0, 0, 0, 1, 2, 3, 3, 3, 3]);
        // Within the first padding, the second changes nothing.
        for x in -1..5 {
            assert_eq!(
                padding.source(x, 4, 1, 1),
                PaddingMode::Reflect.source(x, 4)
            );
        }
    }

    #[test]
    fn python_rounding_is_half_to_even() {
        assert_eq!(py_round(2.5), 2.0);
        assert_eq!(py_round(3.5), 4.0);
        assert_eq!(py_round(-0.5), -0.0);
    }
}
