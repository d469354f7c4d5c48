//! Writing a finished HWC `u8` image into its slot of a batch: element type, layout and
//! normalization in one pass (the horizontal flip is folded in too, by reading columns
//! backwards), so every batch comes out contiguous with no separate transpose.
//!
//! On x86-64 CPUs with AVX2 (checked at run time) an AVX2 kernel writes 16 pixels at a time
//! (`transform::simd`, ~3× the portable loop); its output is identical to the portable
//! writer's, bit for bit, so a batch does not depend on the CPU it was made on.

use std::ops::Range;

use half::{bf16, f16};

/// Element type of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 8-bit unsigned integers, 0..=255 (no normalization).
    U8,
    /// 32-bit floats.
    F32,
    /// 16-bit floats (IEEE binary16).
    F16,
    /// bfloat16: the top half of an `f32`, rounded to nearest-even (what `torch.bfloat16`
    /// holds and `tensor.to(torch.bfloat16)` gives).
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
        }
    }
}

/// Order of a batch's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `[batch, channel, height, width]` (PyTorch's default).
    Nchw,
    /// `[batch, height, width, channel]` (channels-last).
    Nhwc,
}

/// `Normalize(mean, std)` after `ToTensor` (which divides by 255), as in torchvision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalize {
    /// Per-channel mean, on the 0..1 scale.
    pub mean: [f32; 3],
    /// Per-channel standard deviation, on the 0..1 scale.
    pub std: [f32; 3],
}

impl Normalize {
    /// The ImageNet statistics everyone uses.
    pub const IMAGENET: Normalize = Normalize {
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };

    /// The smallest standard deviation accepted (as Python's `imagefeed.transforms.Normalize`).
    pub const MIN_STD: f32 = 1e-6;

    /// Checks that the statistics give finite values: finite means, finite standard deviations
    /// of at least [`Normalize::MIN_STD`] (a zero or NaN one would turn every pixel into
    /// infinity or NaN).
    pub fn validate(&self) -> Result<(), String> {
        let finite_means = self.mean.iter().all(|m| m.is_finite());
        let usable_stds = self
            .std
            .iter()
            .all(|s| s.is_finite() && *s >= Self::MIN_STD);
        if finite_means && usable_stds {
            Ok(())
        } else {
            Err(format!(
                "normalization mean {:?}, std {:?}: means must be finite, and standard \
                 deviations finite and at least {}",
                self.mean,
                self.std,
                Self::MIN_STD
            ))
        }
    }

    /// Per-channel `(scale, bias)` with `value = pixel · scale + bias`: ToTensor (`/ 255`),
    /// then `normalize` if there is one. The one place both the CPU slot writer and the GPU
    /// feed take them from, so that both compute with the same `f32` values.
    pub fn pixel_affine(normalize: Option<Normalize>) -> ([f32; 3], [f32; 3]) {
        match normalize {
            Some(n) => n.affine(),
            None => ([1.0 / 255.0; 3], [0.0; 3]),
        }
    }

    /// `value = pixel · scale + bias`, per channel.
    fn affine(&self) -> ([f32; 3], [f32; 3]) {
        let scale = std::array::from_fn(|c| 1.0 / (255.0 * self.std[c]));
        let bias = std::array::from_fn(|c| -self.mean[c] / self.std[c]);
        (scale, bias)
    }
}

/// How one image becomes one batch slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlotWriter {
    /// Element type.
    pub dtype: DType,
    /// Layout.
    pub layout: Layout,
    /// Normalization for float outputs; `None` means ToTensor only (`pixel / 255`).
    pub normalize: Option<Normalize>,
}

impl SlotWriter {
    /// Bytes of one slot for an image of `width × height`.
    pub fn slot_len(&self, width: u32, height: u32) -> usize {
        width as usize * height as usize * 3 * self.dtype.size()
    }

    /// Writes `image` (HWC RGB `u8`, `width × height`) into `slot`, mirrored left-right when
    /// `flip`.
    ///
    /// # Panics
    /// When a buffer length does not match the size (a caller bug).
    pub fn write(&self, image: &[u8], width: u32, height: u32, flip: bool, slot: &mut [u8]) {
        let (w, h) = (width as usize, height as usize);
        assert_eq!(
            image.len(),
            w * h * 3,
            "image buffer does not match {w}x{h}"
        );
        assert_eq!(
            slot.len(),
            self.slot_len(width, height),
            "slot does not match {w}x{h}"
        );
        let (scale, bias) = Normalize::pixel_affine(self.normalize);
        let element = self.dtype.size();
        assert!(
            (slot.as_ptr() as usize).is_multiple_of(element),
            "{} slot is not {element}-byte aligned",
            self.dtype.name()
        );
        if self.dtype == DType::U8 && self.layout == Layout::Nhwc && !flip {
            slot.copy_from_slice(image);
            return;
        }
        let mut done = 0;
        // (bfloat16 has no F16C instruction: the portable writer does all of it.)
        #[cfg(target_arch = "x86_64")]
        if self.dtype != DType::Bf16 && super::simd::available() {
            // SAFETY: the CPU has the kernel's features (just checked); `image` and `slot`
            // have the lengths the kernel needs (asserted above).
            unsafe {
                super::simd::write(
                    image,
                    w,
                    h,
                    flip,
                    self.dtype,
                    self.layout,
                    scale,
                    bias,
                    slot,
                )
            };
            done = w / super::simd::BLOCK * super::simd::BLOCK;
        }
        if done < w {
            self.write_columns(image, w, h, flip, scale, bias, slot, done..w);
        }
    }

    /// The portable writer, for output columns `columns` of every row; `write` uses it for the
    /// whole image where the SIMD kernel cannot run, and for the columns right of the kernel's
    /// last 16-pixel block.
    #[allow(clippy::too_many_arguments)]
    fn write_columns(
        &self,
        image: &[u8],
        w: usize,
        h: usize,
        flip: bool,
        scale: [f32; 3],
        bias: [f32; 3],
        slot: &mut [u8],
        columns: Range<usize>,
    ) {
        let layout = self.layout;
        match self.dtype {
            DType::U8 => write_columns(image, w, h, flip, layout, columns, slot, |_, v| v),
            DType::F32 => {
                // SAFETY: any bit pattern is a valid f32; `write` checked the alignment, so
                // the middle part is the whole slot.
                let (_, out, _) = unsafe { slot.align_to_mut::<f32>() };
                write_columns(image, w, h, flip, layout, columns, out, |c, v| {
                    v as f32 * scale[c] + bias[c]
                });
            }
            DType::F16 => {
                // SAFETY: any bit pattern is a valid u16; alignment as above.
                let (_, out, _) = unsafe { slot.align_to_mut::<u16>() };
                write_columns(image, w, h, flip, layout, columns, out, |c, v| {
                    f16::from_f32(v as f32 * scale[c] + bias[c]).to_bits()
                });
            }
            DType::Bf16 => {
                // SAFETY: any bit pattern is a valid u16; alignment as above.
                let (_, out, _) = unsafe { slot.align_to_mut::<u16>() };
                write_columns(image, w, h, flip, layout, columns, out, |c, v| {
                    bf16::from_f32(v as f32 * scale[c] + bias[c]).to_bits()
                });
            }
        }
    }
}

/// Output columns `columns` of every row: element `(c, y, x)` (NCHW) or `(y, x, c)` (NHWC) is
/// `value(c, pixel)` of source column `x`, or `w - 1 - x` when flipped.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn write_columns<T: Copy>(
    image: &[u8],
    w: usize,
    h: usize,
    flip: bool,
    layout: Layout,
    columns: Range<usize>,
    out: &mut [T],
    value: impl Fn(usize, u8) -> T,
) {
    assert_eq!(out.len(), w * h * 3, "slot does not match {w}x{h}");
    for (y, row) in image.chunks_exact(w * 3).enumerate() {
        for x in columns.clone() {
            let source = if flip { w - 1 - x } else { x };
            for c in 0..3 {
                let at = match layout {
                    Layout::Nchw => (c * h + y) * w + x,
                    Layout::Nhwc => (y * w + x) * 3 + c,
                };
                out[at] = value(c, row[source * 3 + c]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2x2 image with distinct values: pixel (y, x) = [10y + x, 100 + 10y + x, 200 + x].
    fn image() -> Vec<u8> {
        let mut v = Vec::new();
        for y in 0..2u8 {
            for x in 0..2u8 {
                v.extend([10 * y + x, 100 + 10 * y + x, 200 + x]);
            }
        }
        v
    }

    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect()
    }

    /// A zeroed byte buffer of `len` bytes, 8-byte aligned (as pool buffers are).
    fn aligned(len: usize) -> Vec<u64> {
        vec![0; len.div_ceil(8)]
    }

    fn bytes(buffer: &mut [u64], len: usize) -> &mut [u8] {
        // SAFETY: u64 memory viewed as bytes; `len` is within the buffer.
        unsafe { std::slice::from_raw_parts_mut(buffer.as_mut_ptr().cast::<u8>(), len) }
    }

    /// The fast path (`write`: SIMD where the CPU has it, portable columns after the last
    /// 16-pixel block) and the portable writer over the whole image give the same bytes, for
    /// every element type, layout, flip and normalization, on sizes below, at and around the
    /// block width, with all 256 pixel values present.
    #[test]
    fn fast_and_portable_writers_agree_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if !super::super::simd::available() {
            eprintln!("skipped: this CPU has no AVX2/F16C, so only the portable writer runs");
            return;
        }
        for (w, h) in [
            (1, 1),
            (15, 2),
            (16, 3),
            (17, 2),
            (32, 32),
            (50, 7),
            (224, 3),
        ] {
            let image: Vec<u8> = (0..w * h * 3).map(|i| (i * 37 + 11) as u8).collect();
            for dtype in [DType::U8, DType::F32, DType::F16] {
                for layout in [Layout::Nchw, Layout::Nhwc] {
                    for normalize in [None, Some(Normalize::IMAGENET)] {
                        if dtype == DType::U8 && normalize.is_some() {
                            continue;
                        }
                        let writer = SlotWriter {
                            dtype,
                            layout,
                            normalize,
                        };
                        let (scale, bias) = Normalize::pixel_affine(normalize);
                        let len = writer.slot_len(w as u32, h as u32);
                        for flip in [false, true] {
                            let (mut fast, mut portable) = (aligned(len), aligned(len));
                            writer.write(&image, w as u32, h as u32, flip, bytes(&mut fast, len));
                            writer.write_columns(
                                &image,
                                w,
                                h,
                                flip,
                                scale,
                                bias,
                                bytes(&mut portable, len),
                                0..w,
                            );
                            assert!(
                                fast == portable,
                                "{w}x{h} {dtype:?} {layout:?} flip {flip} normalize {}",
                                normalize.is_some()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn unaligned_float_slots_are_refused() {
        let w = SlotWriter {
            dtype: DType::F32,
            layout: Layout::Nchw,
            normalize: None,
        };
        let mut buffer = aligned(64);
        let slot = &mut bytes(&mut buffer, 64)[1..49];
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            w.write(&image(), 2, 2, false, slot)
        }));
        let message = *result.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("not 4-byte aligned"), "{message}");
    }

    #[test]
    fn u8_nchw_is_planar_and_flip_mirrors_columns() {
        let w = SlotWriter {
            dtype: DType::U8,
            layout: Layout::Nchw,
            normalize: None,
        };
        let mut slot = vec![0; 12];
        w.write(&image(), 2, 2, false, &mut slot);
        assert_eq!(slot, [0, 1, 10, 11, 100, 101, 110, 111, 200, 201, 200, 201]);
        w.write(&image(), 2, 2, true, &mut slot);
        assert_eq!(slot, [1, 0, 11, 10, 101, 100, 111, 110, 201, 200, 201, 200]);
    }

    #[test]
    fn u8_nhwc_flip() {
        let w = SlotWriter {
            dtype: DType::U8,
            layout: Layout::Nhwc,
            normalize: None,
        };
        let mut slot = vec![0; 12];
        w.write(&image(), 2, 2, true, &mut slot);
        assert_eq!(slot, [1, 101, 201, 0, 100, 200, 11, 111, 201, 10, 110, 200]);
    }

    #[test]
    fn f32_normalize_matches_torchvision_formula() {
        let n = Normalize::IMAGENET;
        let w = SlotWriter {
            dtype: DType::F32,
            layout: Layout::Nchw,
            normalize: Some(n),
        };
        let mut slot = vec![0; 48];
        w.write(&image(), 2, 2, false, &mut slot);
        let got = floats(&slot);
        let img = image();
        for c in 0..3 {
            for p in 0..4 {
                // (x / 255 - mean) / std, computed in f64 as the reference.
                let want = (img[p * 3 + c] as f64 / 255.0 - n.mean[c] as f64) / n.std[c] as f64;
                assert!(
                    (got[c * 4 + p] as f64 - want).abs() < 1e-5,
                    "c{c} p{p}: {} vs {want}",
                    got[c * 4 + p]
                );
            }
        }
    }

    /// #33 item 5: bfloat16 on the CPU is the f32 output rounded to nearest-even, element by
    /// element, in both layouts, flipped or not, over widths past the SIMD block.
    #[test]
    fn bf16_is_the_f32_output_rounded_to_nearest_even() {
        let (w, h) = (37usize, 5usize);
        let pixels: Vec<u8> = (0..w * h * 3).map(|i| (i * 131 % 256) as u8).collect();
        for layout in [Layout::Nchw, Layout::Nhwc] {
            for flip in [false, true] {
                let writer = |dtype| SlotWriter {
                    dtype,
                    layout,
                    normalize: Some(Normalize::IMAGENET),
                };
                let mut f32_slot = vec![0u32; w * h * 3];
                // SAFETY: any bytes are valid u8s; a u32 buffer is aligned for its bytes.
                let bytes = unsafe { f32_slot.align_to_mut::<u8>().1 };
                writer(DType::F32).write(&pixels, w as u32, h as u32, flip, bytes);
                let mut bf16_slot = vec![0u16; w * h * 3];
                // SAFETY: as above.
                let bytes = unsafe { bf16_slot.align_to_mut::<u8>().1 };
                writer(DType::Bf16).write(&pixels, w as u32, h as u32, flip, bytes);
                for (i, (&f, &b)) in f32_slot.iter().zip(&bf16_slot).enumerate() {
                    let want = bf16::from_f32(f32::from_bits(f)).to_bits();
                    assert_eq!(b, want, "{layout:?} flip {flip}: element {i}");
                }
            }
        }
        assert_eq!((DType::Bf16.size(), DType::Bf16.name()), (2, "bf16"));
    }

    #[test]
    fn f16_nhwc_without_normalize_is_to_tensor() {
        let w = SlotWriter {
            dtype: DType::F16,
            layout: Layout::Nhwc,
            normalize: None,
        };
        let mut slot = vec![0; 24];
        w.write(&image(), 2, 2, false, &mut slot);
        let got: Vec<f32> = slot
            .chunks(2)
            .map(|b| f16::from_ne_bytes(b.try_into().unwrap()).to_f32())
            .collect();
        for (g, v) in got.iter().zip(image()) {
            assert!((g - v as f32 / 255.0).abs() < 1e-3);
        }
    }
}
