//! The per-sample work: a [`SampleTransformer`] (one per worker) decodes a payload, crops and
//! resizes it, runs the pixel steps and the erasing, and hands the slot writer a [`Prepared`]
//! image. Random decisions come from the sample's [`SampleRng`] in a fixed order: the crop box,
//! the flip, the pixel steps, the erasing.

use std::time::{Duration, Instant};

use crate::decode::{
    CropDecoded, CropPlan, DEFAULT_MAX_PIXELS, DctScaling, DecodeError, Decoder, ImageHeader,
};
use crate::geometry::Rect;
use crate::resize::{Interpolation, RgbResizer, short_side_size};
use crate::rng::SampleRng;

use super::crop::{Padding, PaddingMode, center_crop, random_crop, random_resized_crop};
use super::pixel::PixelScratch;
use super::{Geometry, Transform};

/// Where a sample's image comes from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source<'a> {
    /// Its payload, as read.
    Payload(&'a [u8]),
    /// The image the decoder's stack holds at this position (see
    /// [`SampleTransformer::stack_offer`]).
    Stacked(usize),
}

/// Which of a [`SampleTransformer`]'s buffers holds a finished image.
enum Finished {
    /// The decoder's output, already the output size.
    Decoded,
    /// The resized or padded image.
    Image,
}

/// A transformed sample, ready for [`SlotWriter::write`](super::SlotWriter::write).
#[derive(Debug)]
pub struct Prepared<'a> {
    /// HWC RGB `u8` pixels.
    pub pixels: &'a [u8],
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
    /// Mirror left-right while writing.
    pub flip: bool,
    /// Time spent decoding.
    pub decode_time: Duration,
    /// Time spent resizing and cropping.
    pub transform_time: Duration,
    /// When the transform finished (the clock reading that ended `transform_time`), so that a
    /// caller timing the next stage need not read the clock again.
    pub finished: Instant,
}

/// Applies [`Transform`]s; holds a decoder, a resizer and scratch buffers. One per worker.
pub struct SampleTransformer {
    decoder: Decoder,
    /// Decode JPEGs at a reduced DCT scale where the crop allows (see
    /// [`with_scaled_decode`](Self::with_scaled_decode)).
    scaled_decode: bool,
    resizer: RgbResizer,
    decoded: Vec<u8>,
    image: Vec<u8>,
    staging: Vec<u8>,
    pixel_scratch: PixelScratch,
    /// The source column of each output column of a mirror-padded crop.
    columns: Vec<usize>,
}

impl Default for SampleTransformer {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_PIXELS)
    }
}

impl SampleTransformer {
    /// A transformer whose decoder refuses images over `max_pixels`.
    pub fn new(max_pixels: u64) -> Self {
        SampleTransformer {
            decoder: Decoder::new().with_max_pixels(max_pixels),
            scaled_decode: true,
            resizer: RgbResizer::new(),
            decoded: Vec::new(),
            image: Vec::new(),
            staging: Vec::new(),
            pixel_scratch: PixelScratch::default(),
            columns: Vec::new(),
        }
    }

    /// With `false`, a JPEG is always decoded at full size before it is resized, as torchvision
    /// does with PIL (whose `resize` never uses libjpeg's DCT scaling): every value within one
    /// level of torchvision's, at the cost of a full decode of large images. Default `true`
    /// ([`DctScaling::Antialiased`]: within one level on 99.96% of ImageNet eval values).
    pub fn with_scaled_decode(mut self, scaled_decode: bool) -> Self {
        self.scaled_decode = scaled_decode;
        self
    }

    /// Decodes `payload` and applies `transform`'s geometry, drawing random choices from `rng`.
    pub fn apply(
        &mut self,
        transform: &Transform,
        payload: &[u8],
        rng: &mut SampleRng,
    ) -> Result<Prepared<'_>, DecodeError> {
        self.apply_since(Instant::now(), transform, payload, rng)
    }

    /// [`apply`](Self::apply), with the decode time counted from `started` (a clock reading
    /// the caller already has, e.g. the end of its read stage): at tens of thousands of samples
    /// per second per thread, each clock reading is ~0.2% of a 32×32 image.
    pub fn apply_since(
        &mut self,
        started: Instant,
        transform: &Transform,
        payload: &[u8],
        rng: &mut SampleRng,
    ) -> Result<Prepared<'_>, DecodeError> {
        self.apply_to(started, transform, Source::Payload(payload), rng)
    }

    /// Empties the decoder's stack of small JPEGs (see [`Self::stack_offer`]).
    pub(crate) fn stack_clear(&mut self) {
        self.decoder.stack_clear();
    }

    /// Offers the payload the caller will later transform as `position` to the decoder's
    /// stack of small JPEGs, which [`stack_decode`](Self::stack_decode) decodes in one call;
    /// [`apply_to`](Self::apply_to) with [`Source::Stacked`] then takes its pixels from
    /// there (when the transform needs the whole image at full size; else it decodes the bytes
    /// the stack kept). Same pixels either way.
    pub(crate) fn stack_offer(&mut self, position: usize, payload: &[u8]) -> bool {
        self.decoder.stack_offer(position, payload)
    }

    /// Whether the decoder's stack has no room for another image.
    pub(crate) fn stack_is_full(&self) -> bool {
        self.decoder.stack_is_full()
    }

    /// Decodes the stack; returns how many images it holds (0 after an error: those decode
    /// alone).
    pub(crate) fn stack_decode(&mut self) -> usize {
        self.decoder.stack_decode()
    }

    /// Images stacked, and how many of them were taken from the stack.
    pub(crate) fn stack_counts(&self) -> (usize, usize) {
        self.decoder.stack_counts()
    }

    /// [`apply_since`](Self::apply_since) of a payload or of an image in the decoder's stack.
    pub(crate) fn apply_to(
        &mut self,
        started: Instant,
        transform: &Transform,
        source: Source<'_>,
        rng: &mut SampleRng,
    ) -> Result<Prepared<'_>, DecodeError> {
        let mut plan = None;
        // A DCT-scaled decode averages pixels: nearest-neighbour sampling must see them whole.
        let scaling = if self.scaled_decode && transform.interpolation != Interpolation::Nearest {
            DctScaling::Antialiased
        } else {
            DctScaling::Off
        };
        // Steps before the geometry see the whole image at full size.
        let whole_image = !transform.before_geometry.is_empty();
        let max_pixels = self.decoder.max_pixels();
        // One header parse: the crop box (drawn from `rng`, crop first, then flip) decides the
        // decode scale and region.
        let plan_for = |header: &ImageHeader| {
            let planned = plan_crop(transform, header, rng, max_pixels);
            let crop = planned.as_ref().ok().map(|&(crop, out_w, out_h, _)| {
                if whole_image {
                    CropPlan {
                        crop: Rect::full(header.width, header.height),
                        out_width: header.width,
                        out_height: header.height,
                        scaling: DctScaling::Off,
                    }
                } else {
                    CropPlan {
                        crop,
                        out_width: out_w,
                        out_height: out_h,
                        scaling,
                    }
                }
            });
            plan = Some(planned);
            crop.filter(|_| !matches!(transform.geometry, Geometry::Native))
        };
        let mut decoded = match source {
            Source::Payload(payload) => {
                self.decoder
                    .decode_crop(payload, &mut self.decoded, plan_for)?
            }
            Source::Stacked(position) => {
                self.decoder
                    .decode_crop_stacked(position, &mut self.decoded, plan_for)?
            }
        };
        let (crop, out_w, out_h, mut flip) =
            plan.expect("the plan runs once the header is read")?;
        if whole_image {
            // Decoded whole, at full size: the crop is in the decoded buffer's pixels as drawn.
            decoded.crop = crop;
            let (w, h) = (decoded.width, decoded.height);
            self.decoded.truncate(w as usize * h as usize * 3);
            transform
                .before_geometry
                .apply(rng, &mut self.decoded, &mut self.pixel_scratch, w, h);
        }
        let decoded_at = Instant::now();
        self.resizer.set_interpolation(transform.interpolation);
        let padding = match transform.geometry {
            Geometry::RandomCrop {
                fill,
                padding_mode,
                padding,
                ..
            } => Padding {
                fill,
                mode: padding_mode,
                first: padding,
            },
            _ => Padding::default(),
        };
        let pixels = match self.crop_and_resize(&decoded, out_w, out_h, padding) {
            Finished::Decoded => &mut self.decoded,
            Finished::Image => &mut self.image,
        };
        if !transform.pixel_steps.is_empty() {
            pixels.truncate(out_w as usize * out_h as usize * 3);
            // The geometric ops do not commute with the flip: it happens first, as in
            // torchvision's recipes (flip, then the augmentation).
            if flip && transform.pixel_steps.moves_pixels() {
                flip_rows(pixels, out_w);
                flip = false;
            }
            transform
                .pixel_steps
                .apply(rng, pixels, &mut self.pixel_scratch, out_w, out_h);
        }
        if let Some(erase) = &transform.erase {
            erase.apply(rng, pixels, out_w, out_h, flip);
        }
        let pixels = &*pixels;
        let finished = Instant::now();
        Ok(Prepared {
            pixels,
            width: out_w,
            height: out_h,
            flip,
            decode_time: decoded_at - started,
            transform_time: finished - decoded_at,
            finished,
        })
    }

    /// The decoded image's crop, resized to `out_w × out_h`: the decoded buffer itself when
    /// that is already it, one resampling pass for a crop inside the image, or the padded path
    /// for a crop reaching past it ([`Self::pad_oversized_crop`]). Says which buffer holds it.
    fn crop_and_resize(
        &mut self,
        decoded: &CropDecoded,
        out_w: u32,
        out_h: u32,
        padding: Padding,
    ) -> Finished {
        let crop = decoded.crop;
        let (dw, dh) = (decoded.width as f64, decoded.height as f64);
        if crop.is_whole(dw, dh) && (out_w, out_h) == (decoded.width, decoded.height) {
            Finished::Decoded
        } else if crop.is_inside(dw, dh) {
            self.image.resize(out_w as usize * out_h as usize * 3, 0);
            self.resizer.resize_region(
                &self.decoded,
                decoded.width,
                decoded.height,
                crop,
                &mut self.image,
                out_w,
                out_h,
            );
            Finished::Image
        } else {
            self.pad_oversized_crop(decoded, out_w, out_h, padding);
            Finished::Image
        }
    }

    /// A crop reaching past the (resized) image: resize to the scale the crop is taken at,
    /// then fill `self.image` from it as `padding` says (torchvision pads a center crop with
    /// black, a `RandomCrop` with its `fill` or `padding_mode`).
    fn pad_oversized_crop(
        &mut self,
        decoded: &CropDecoded,
        out_w: u32,
        out_h: u32,
        padding: Padding,
    ) {
        let crop = decoded.crop;
        let (dw, dh) = (decoded.width as f64, decoded.height as f64);
        let (sw, sh) = (
            (dw * out_w as f64 / crop.width).round().max(1.0) as u32,
            (dh * out_h as f64 / crop.height).round().max(1.0) as u32,
        );
        let source: &[u8] = if (sw, sh) == (decoded.width, decoded.height) {
            &self.decoded
        } else {
            self.staging.resize(sw as usize * sh as usize * 3, 0);
            self.resizer.resize(
                &self.decoded,
                decoded.width,
                decoded.height,
                &mut self.staging,
                sw,
                sh,
            );
            &self.staging
        };
        let top = (crop.top * sh as f64 / dh).round() as i64;
        let left = (crop.left * sw as f64 / dw).round() as i64;
        let image = Image {
            pixels: source,
            width: sw as i64,
            height: sh as i64,
        };
        self.image.clear();
        let window = Window {
            top,
            left,
            width: out_w,
            height: out_h,
        };
        if padding.mode == PaddingMode::Constant {
            pad_constant(&image, window, padding.fill, &mut self.image);
        } else {
            pad_mirrored(&image, window, padding, &mut self.columns, &mut self.image);
        }
    }
}

/// An RGB `u8` image a padded crop is taken from.
struct Image<'a> {
    pixels: &'a [u8],
    width: i64,
    height: i64,
}

/// Fills `out` (empty) with `window` of `image` padded
/// with `fill`: the overlap row by row, the rest `fill`.
fn pad_constant(image: &Image<'_>, window: Window, fill: [u8; 3], out: &mut Vec<u8>) {
    let Window {
        top,
        left,
        width: out_w,
        height: out_h,
    } = window;
    let len = out_w as usize * out_h as usize * 3;
    if fill == [0; 3] {
        out.resize(len, 0);
    } else {
        out.extend(fill.iter().copied().cycle().take(len));
    }
    let x0 = (-left).max(0);
    let x1 = (image.width - left).min(out_w as i64);
    if x0 >= x1 {
        return;
    }
    let n = ((x1 - x0) * 3) as usize;
    for y in 0..out_h as i64 {
        let sy = y + top;
        if !(0..image.height).contains(&sy) {
            continue;
        }
        let src = ((sy * image.width + x0 + left) * 3) as usize;
        let dst = ((y * out_w as i64 + x0) * 3) as usize;
        out[dst..dst + n].copy_from_slice(&image.pixels[src..src + n]);
    }
}

/// Fills `out` (empty) with `window` of `image` padded
/// as `padding` says (edge, reflect or symmetric: every position has a source pixel).
fn pad_mirrored(
    image: &Image<'_>,
    window: Window,
    padding: Padding,
    columns: &mut Vec<usize>,
    out: &mut Vec<u8>,
) {
    let [l, t, r, b] = padding.first;
    let source = |x: i64, len: i64, lo: u32, hi: u32| {
        padding
            .source(x, len, lo, hi)
            .expect("only the constant mode leaves a position without a source") as usize
    };
    // Every row takes the same columns: their byte offsets, found once.
    columns.clear();
    columns.extend(
        (0..i64::from(window.width)).map(|x| source(x + window.left, image.width, l, r) * 3),
    );
    out.reserve(window.width as usize * window.height as usize * 3);
    for y in 0..i64::from(window.height) {
        let row = source(y + window.top, image.height, t, b) * image.width as usize * 3;
        for &column in columns.iter() {
            out.extend_from_slice(&image.pixels[row + column..row + column + 3]);
        }
    }
}

/// Where a padded crop's window lies in the image (its top-left corner may be outside it).
#[derive(Clone, Copy)]
struct Window {
    top: i64,
    left: i64,
    width: u32,
    height: u32,
}

/// Mirrors each row of a `width`-wide RGB image in place.
fn flip_rows(pixels: &mut [u8], width: u32) {
    let row = width as usize * 3;
    if row == 0 {
        return;
    }
    for line in pixels.chunks_exact_mut(row) {
        let (mut a, mut b) = (0, width as usize - 1);
        while a < b {
            for c in 0..3 {
                line.swap(a * 3 + c, b * 3 + c);
            }
            a += 1;
            b -= 1;
        }
    }
}

/// Where `transform` crops an image of `header`'s size, the size it resizes the crop to, and
/// whether it flips: the sample's random choices, drawn from `rng` in a fixed order (the crop
/// box, then the flip), so they never depend on which worker runs the sample.
fn plan_crop(
    transform: &Transform,
    header: &ImageHeader,
    rng: &mut SampleRng,
    max_pixels: u64,
) -> Result<(Rect, u32, u32, bool), DecodeError> {
    let (w, h) = (header.width, header.height);
    // Every image the plan makes (a resized whole image, which a padded crop is cut from, or
    // the output) within the pixel limit: a sample's error, never an allocation that aborts.
    // (A crop inside the resized image is cut from the source: nothing of that size is made.)
    let within = |to_width: u32, to_height: u32| {
        let (to_width, to_height) = (u64::from(to_width), u64::from(to_height));
        if to_width * to_height > max_pixels {
            return Err(DecodeError::ResizedTooLarge {
                width: w,
                height: h,
                to_width,
                to_height,
                limit: max_pixels,
            });
        }
        Ok(())
    };
    let (crop, out_w, out_h) = match transform.geometry {
        Geometry::Native => (Rect::full(w, h), w, h),
        Geometry::ResizeTo { width, height } => (Rect::full(w, h), width, height),
        Geometry::Resize { short } => {
            let (rw, rh) = short_side_size(w, h, short);
            within(rw, rh)?;
            (Rect::full(w, h), rw, rh)
        }
        Geometry::CenterCrop { width, height } => (center_crop(w, h, width, height), width, height),
        Geometry::RandomCrop {
            width,
            height,
            padding,
            pad_if_needed,
            resize,
            ..
        } => {
            // With a Resize first, the window is drawn on the resized image and mapped back.
            let (rw, rh) = resize.map_or((w, h), |short| short_side_size(w, h, short));
            let window = random_crop(rng, rw, rh, width, height, padding, pad_if_needed)?;
            // Only a window reaching into the padding has the whole resized image made.
            if !window.is_inside(f64::from(rw), f64::from(rh)) {
                within(rw, rh)?;
            }
            let crop = window.scaled(w as f64 / rw as f64, h as f64 / rh as f64);
            (crop, width, height)
        }
        Geometry::ResizeCenterCrop {
            short,
            width,
            height,
        } => {
            let (rw, rh) = short_side_size(w, h, short);
            let c = center_crop(rw, rh, width, height);
            if !c.is_inside(f64::from(rw), f64::from(rh)) {
                within(rw, rh)?;
            }
            let crop = c.scaled(w as f64 / rw as f64, h as f64 / rh as f64);
            (crop, width, height)
        }
        Geometry::RandomResizedCrop {
            width,
            height,
            scale,
            ratio,
        } => (random_resized_crop(rng, w, h, scale, ratio), width, height),
    };
    let flip = transform.hflip > 0.0 && rng.chance(transform.hflip);
    // A flip before the geometry: the crop of the mirrored image is the mirror of the crop at
    // the mirrored place (padding included: every padding mode is symmetric).
    let crop = if flip && transform.flip_before_geometry {
        Rect {
            left: w as f64 - crop.left - crop.width,
            ..crop
        }
    } else {
        crop
    };
    Ok((crop, out_w, out_h, flip))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::RawImage;
    use crate::transform::color::ColorJitter;
    use crate::transform::pixel::{PixelStep, PixelSteps};
    /// A raw payload whose pixel (x, y) is [x, y, 7].
    fn ramp(w: u32, h: u32) -> Vec<u8> {
        let pixels: Vec<u8> = (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [x as u8, y as u8, 7]))
            .collect();
        RawImage::encode(w, h, &pixels)
    }

    fn geometry(g: Geometry) -> Transform {
        Transform {
            geometry: g,
            ..Transform::none()
        }
    }

    #[test]
    fn a_resize_past_the_pixel_limit_is_the_samples_error_not_an_allocation() {
        // A 20000x1 image under Resize(1000) is 20,000,000x1000 (60 GB: the process aborted);
        // a 2097152x1 one under Resize(2048) has a long side past u32 (it wrapped to 0 wide).
        let mut t = SampleTransformer::default();
        let cases = [
            (
                ramp(20_000, 1),
                Geometry::Resize { short: 1000 },
                20_000_000,
            ),
            (
                ramp(2_097_152, 1),
                Geometry::Resize { short: 2048 },
                u64::from(u32::MAX),
            ),
            (
                ramp(20_000, 1),
                Geometry::ResizeCenterCrop {
                    short: 1000,
                    width: 1001,
                    height: 1001,
                },
                20_000_000,
            ),
            (
                ramp(20_000, 1),
                Geometry::RandomCrop {
                    width: 1001,
                    height: 1001,
                    padding: [0; 4],
                    pad_if_needed: true,
                    fill: [0; 3],
                    padding_mode: PaddingMode::Constant,
                    resize: Some(1000),
                },
                20_000_000,
            ),
        ];
        for (payload, g, wide) in cases {
            let err = t
                .apply(&geometry(g), &payload, &mut SampleRng::new(0, 0, 0))
                .unwrap_err();
            assert!(
                matches!(err, DecodeError::ResizedTooLarge { to_width, limit, .. }
                    if to_width == wide && limit == crate::decode::DEFAULT_MAX_PIXELS),
                "{g:?}: {err:?}"
            );
        }
        // A crop inside a resized image too large to make is cut from the source: no error (a
        // hostile try: 40x32 images, max_pixels 4096, Resize(64) + CenterCrop(48) were all
        // refused as "resized to 80x64").
        let mut small = SampleTransformer::new(4096);
        let p = small
            .apply(
                &geometry(Geometry::ResizeCenterCrop {
                    short: 64,
                    width: 48,
                    height: 48,
                }),
                &ramp(40, 32),
                &mut SampleRng::new(0, 0, 0),
            )
            .unwrap();
        assert_eq!((p.width, p.height), (48, 48));
        // Within the limit, the same geometry resizes as torchvision does.
        let p = t
            .apply(
                &geometry(Geometry::Resize { short: 2 }),
                &ramp(200, 1),
                &mut SampleRng::new(0, 0, 0),
            )
            .unwrap();
        assert_eq!((p.width, p.height), (400, 2));
    }

    #[test]
    fn native_passes_pixels_through() {
        let payload = ramp(5, 4);
        let mut t = SampleTransformer::default();
        let p = t
            .apply(&Transform::none(), &payload, &mut SampleRng::new(0, 0, 0))
            .unwrap();
        assert_eq!((p.width, p.height, p.flip), (5, 4, false));
        assert_eq!(p.pixels, RawImage::parse(&payload).unwrap().2);
    }

    #[test]
    fn center_crop_takes_the_middle_and_pads_when_larger() {
        let payload = ramp(10, 8);
        let mut t = SampleTransformer::default();
        let p = t
            .apply(
                &geometry(Geometry::CenterCrop {
                    width: 4,
                    height: 2,
                }),
                &payload,
                &mut SampleRng::new(0, 0, 0),
            )
            .unwrap();
        // left = round((10-4)/2) = 3, top = round((8-2)/2) = 3.
        assert_eq!(&p.pixels[..6], &[3, 3, 7, 4, 3, 7]);
        let p = t
            .apply(
                &geometry(Geometry::CenterCrop {
                    width: 12,
                    height: 8,
                }),
                &payload,
                &mut SampleRng::new(0, 0, 0),
            )
            .unwrap();
        // left = round(-1) = -1: one zero column on each side.
        assert_eq!(&p.pixels[..6], &[0, 0, 0, 0, 0, 7]);
        assert_eq!(&p.pixels[11 * 3..12 * 3], &[0, 0, 0]);
    }

    #[test]
    fn random_crop_is_the_window_of_the_padded_image_at_the_drawn_offset() {
        let (w, h) = (10u32, 8u32);
        let payload = ramp(w, h);
        // Padding wider than the image on the left and bottom: the mirrored modes repeat.
        let padding = [13, 1, 2, 9];
        let mut transformer = SampleTransformer::default();
        for (fill, mode) in [
            ([0; 3], PaddingMode::Constant),
            ([10, 200, 30], PaddingMode::Constant),
            ([0; 3], PaddingMode::Edge),
            ([0; 3], PaddingMode::Reflect),
            ([0; 3], PaddingMode::Symmetric),
        ] {
            let t = geometry(Geometry::RandomCrop {
                width: 9,
                height: 7,
                padding,
                pad_if_needed: false,
                fill,
                padding_mode: mode,
                resize: None,
            });
            let mut seen = std::collections::HashSet::new();
            for index in 0..80 {
                let p = transformer
                    .apply(&t, &payload, &mut SampleRng::new(5, 0, index))
                    .unwrap();
                assert_eq!((p.width, p.height), (9, 7));
                let window =
                    random_crop(&mut SampleRng::new(5, 0, index), w, h, 9, 7, padding, false)
                        .unwrap();
                let (top, left) = (window.top as i64, window.left as i64);
                seen.insert((top, left));
                for y in 0..7i64 {
                    for x in 0..9i64 {
                        let (sy, sx) = (y + top, x + left);
                        // The ramp's pixel (x, y) is [x, y, 7].
                        let want = match (mode.source(sx, w.into()), mode.source(sy, h.into())) {
                            (Some(sx), Some(sy)) => [sx as u8, sy as u8, 7],
                            _ => fill,
                        };
                        let at = ((y * 9 + x) * 3) as usize;
                        assert_eq!(
                            p.pixels[at..at + 3],
                            want,
                            "{mode:?} sample {index} at ({x}, {y})"
                        );
                    }
                }
            }
            // Windows reaching past every side were drawn.
            assert!(seen.iter().any(|&(t, _)| t < 0) && seen.iter().any(|&(t, _)| t > 1));
            assert!(seen.iter().any(|&(_, l)| l < -9) && seen.iter().any(|&(_, l)| l > 1));
        }
        // An image too small for the window is a bad sample, not a panic.
        let small = geometry(Geometry::random_crop(32, 32, [0; 4]));
        assert!(matches!(
            transformer.apply(&small, &payload, &mut SampleRng::new(0, 0, 0)),
            Err(DecodeError::SmallerThanCrop { .. })
        ));
    }

    /// The pixels a [`Prepared`] stands for: mirrored when it says so.
    fn finished(p: &Prepared<'_>) -> Vec<u8> {
        let mut pixels = p.pixels.to_vec();
        if p.flip {
            flip_rows(&mut pixels, p.width);
        }
        pixels
    }

    #[test]
    fn steps_before_the_geometry_see_the_whole_image() {
        // Contrast blends with the image's mean: before a crop it is the whole image's, after it
        // the window's, so the order shows in the pixels.
        let (w, h) = (40u32, 30u32);
        let pixels: Vec<u8> = (0..w * h * 3).map(|i| (i * 37 % 251) as u8).collect();
        let payload = RawImage::encode(w, h, &pixels);
        let jitter = PixelStep::ColorJitter(ColorJitter::new(0.0, 0.9, 0.0, 0.0));
        let crop = Geometry::CenterCrop {
            width: 12,
            height: 10,
        };
        let before = geometry(crop).with_step_before_geometry(jitter);
        let after = geometry(crop).with_pixel_step(jitter);
        let mut transformer = SampleTransformer::default();
        let mut steps = PixelSteps::default();
        steps.push(jitter).unwrap();
        for index in 0..8 {
            // CenterCrop draws nothing: the jitter's draws are the sample's first.
            let mut whole = pixels.clone();
            steps.apply(
                &mut SampleRng::new(2, 0, index),
                &mut whole,
                &mut PixelScratch::default(),
                w,
                h,
            );
            let want: Vec<u8> = (10..20)
                .flat_map(|y| {
                    let at = ((y * w + 14) * 3) as usize;
                    whole[at..at + 12 * 3].to_vec()
                })
                .collect();
            let got = transformer
                .apply(&before, &payload, &mut SampleRng::new(2, 0, index))
                .unwrap();
            assert_eq!(finished(&got), want, "sample {index}");
            let later = transformer
                .apply(&after, &payload, &mut SampleRng::new(2, 0, index))
                .unwrap();
            assert_ne!(
                finished(&later),
                want,
                "sample {index}: the order must show"
            );
        }
    }

    #[test]
    fn a_flip_before_the_geometry_is_the_crop_of_the_mirrored_image() {
        // RandomCrop with padding on the left only: cropping the mirrored image puts the black
        // columns on the left of the window, mirroring the crop on the right.
        let (w, h) = (10u32, 6u32);
        let payload = ramp(w, h);
        let padding = [4, 0, 0, 0];
        let t = Transform {
            hflip: 1.0,
            ..geometry(Geometry::random_crop(9, 6, padding))
        };
        let first = t.with_flip_before_geometry();
        let mut transformer = SampleTransformer::default();
        let (mut black_left, mut black_right) = (0, 0);
        for index in 0..40 {
            let window =
                random_crop(&mut SampleRng::new(1, 0, index), w, h, 9, 6, padding, false).unwrap();
            let left = window.left as i64;
            let got = transformer
                .apply(&first, &payload, &mut SampleRng::new(1, 0, index))
                .unwrap();
            let got = finished(&got);
            for y in 0..6i64 {
                for x in 0..9i64 {
                    // Column x of the window is column x + left of the mirrored image, which is
                    // column w - 1 - (x + left) of the image.
                    let sx = x + left;
                    let want = if (0..w as i64).contains(&sx) {
                        [(w as i64 - 1 - sx) as u8, y as u8, 7]
                    } else {
                        [0, 0, 0]
                    };
                    let at = ((y * 9 + x) * 3) as usize;
                    assert_eq!(got[at..at + 3], want, "sample {index} at ({x}, {y})");
                }
            }
            let flipped_after = finished(
                &transformer
                    .apply(&t, &payload, &mut SampleRng::new(1, 0, index))
                    .unwrap(),
            );
            black_left += usize::from(got[..3] == [0, 0, 0]);
            black_right += usize::from(flipped_after[8 * 3..9 * 3] == [0, 0, 0]);
        }
        assert!(
            black_left > 0 && black_right > 0,
            "{black_left} {black_right}"
        );
    }

    #[test]
    fn a_random_crop_after_a_resize_draws_its_window_on_the_resized_image() {
        let payload = ramp(32, 24);
        let crop = |resize| {
            geometry(Geometry::RandomCrop {
                width: 12,
                height: 10,
                padding: [2; 4],
                pad_if_needed: false,
                fill: [0; 3],
                padding_mode: PaddingMode::Constant,
                resize,
            })
        };
        let mut transformer = SampleTransformer::default();
        // A resize to the image's own short side changes nothing: the same windows.
        for index in 0..20 {
            let plain = finished(
                &transformer
                    .apply(&crop(None), &payload, &mut SampleRng::new(7, 0, index))
                    .unwrap(),
            );
            let same = finished(
                &transformer
                    .apply(&crop(Some(24)), &payload, &mut SampleRng::new(7, 0, index))
                    .unwrap(),
            );
            assert_eq!(plain, same, "sample {index}");
        }
        // Halving: the ramp's steps double, and the windows (offsets 0..=2+12+2-12 on the
        // 16 x 12 image) stay within it and its padding.
        let mut offsets = std::collections::HashSet::new();
        for index in 0..40 {
            let p = transformer
                .apply(&crop(Some(12)), &payload, &mut SampleRng::new(7, 0, index))
                .unwrap();
            assert_eq!((p.width, p.height), (12, 10));
            let window = random_crop(
                &mut SampleRng::new(7, 0, index),
                16,
                12,
                12,
                10,
                [2; 4],
                false,
            )
            .unwrap();
            offsets.insert((window.left as i64, window.top as i64));
            let pixels = finished(&p);
            // Inside the resized image, red is about twice the resized column.
            let (x, y) = (6i64, 5i64);
            let (sx, sy) = (x + window.left as i64, y + window.top as i64);
            if (1..15).contains(&sx) && (1..11).contains(&sy) {
                let red = i64::from(pixels[((y * 12 + x) * 3) as usize]);
                assert!(
                    (red - (2 * sx + 1)).abs() <= 1,
                    "sample {index}: {red} at {sx}"
                );
            }
        }
        assert!(offsets.len() > 10, "{offsets:?}");
    }

    #[test]
    fn resize_center_crop_of_a_flat_image_is_flat_and_sized() {
        let pixels = [90u8, 60, 30].repeat(64 * 48);
        let payload = RawImage::encode(64, 48, &pixels);
        let mut t = SampleTransformer::default();
        let p = t
            .apply(
                &geometry(Geometry::ResizeCenterCrop {
                    short: 24,
                    width: 20,
                    height: 20,
                }),
                &payload,
                &mut SampleRng::new(0, 0, 0),
            )
            .unwrap();
        assert_eq!((p.width, p.height), (20, 20));
        assert!(p.pixels.chunks(3).all(|px| px == [90, 60, 30]));
    }

    #[test]
    fn random_resized_crop_is_a_function_of_the_sample_rng() {
        let payload = ramp(200, 150);
        let t = Transform {
            hflip: 0.5,
            ..geometry(Geometry::RandomResizedCrop {
                width: 32,
                height: 32,
                scale: (0.08, 1.0),
                ratio: (0.75, 4.0 / 3.0),
            })
        };
        let mut a = SampleTransformer::default();
        let mut b = SampleTransformer::default();
        let mut flips = 0;
        for index in 0..40 {
            let pa = a
                .apply(&t, &payload, &mut SampleRng::new(3, 1, index))
                .unwrap();
            let (pixels, flip) = (pa.pixels.to_vec(), pa.flip);
            let pb = b
                .apply(&t, &payload, &mut SampleRng::new(3, 1, index))
                .unwrap();
            assert_eq!((pixels.as_slice(), flip), (pb.pixels, pb.flip));
            flips += flip as usize;
        }
        assert!((8..=32).contains(&flips), "{flips} flips in 40");
    }

    /// A noisy 200x150 JPEG: any misplaced crop shows up as a large difference.
    fn photo() -> Vec<u8> {
        let spec = crate::synthetic::SyntheticSpec {
            width: 200,
            height: 150,
            ..Default::default()
        };
        let pixels = crate::synthetic::synthetic_pixels(&spec, 2, 5);
        let mut out = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut std::io::Cursor::new(&mut out), 95)
            .encode(&pixels, 200, 150, image::ExtendedColorType::Rgb8)
            .unwrap();
        out
    }

    fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - *y as f64).abs())
            .sum::<f64>()
            / a.len() as f64
    }

    #[test]
    fn region_decoding_crops_the_same_pixels_as_a_full_decode() {
        let jpeg = photo();
        let mut full = Vec::new();
        Decoder::new().decode_rgb(&jpeg, &mut full).unwrap();
        // (left, top, width, height, output): output near the crop size keeps full DCT scale
        // (only the region decode is tested); the last one also scales down (DCT 1/2).
        for (crop, out, tolerance) in [
            ((37.0, 21.0, 90.0, 70.0), (90, 70), 1.0),
            ((0.0, 80.0, 57.0, 70.0), (50, 60), 3.0),
            ((131.0, 0.0, 69.0, 40.0), (69, 40), 1.0),
            ((20.0, 10.0, 160.0, 120.0), (40, 30), 6.0),
        ] {
            let (left, top, width, height) = crop;
            let crop = Rect {
                left,
                top,
                width,
                height,
            };
            let mut transformer = SampleTransformer::default();
            // Drive decode_crop + resize the way `apply` does, with a chosen crop.
            let decoded = transformer
                .decoder
                .decode_crop(&jpeg, &mut transformer.decoded, |_| {
                    Some(CropPlan {
                        crop,
                        out_width: out.0,
                        out_height: out.1,
                        scaling: DctScaling::Antialiased,
                    })
                })
                .unwrap();
            assert!(
                (decoded.width, decoded.height) != (200, 150) || crop.width > 150.0,
                "{crop:?}: expected a region or scaled decode"
            );
            let mut got = vec![0; out.0 as usize * out.1 as usize * 3];
            transformer.resizer.resize_region(
                &transformer.decoded,
                decoded.width,
                decoded.height,
                decoded.crop,
                &mut got,
                out.0,
                out.1,
            );
            let mut want = vec![0; got.len()];
            RgbResizer::new().resize_region(&full, 200, 150, crop, &mut want, out.0, out.1);
            let diff = mean_abs_diff(&got, &want);
            assert!(
                diff <= tolerance,
                "{crop:?} -> {out:?}: mean abs diff {diff}"
            );
        }
    }
}
