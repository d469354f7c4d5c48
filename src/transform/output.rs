//! Writing a finished HWC `u8` image into its slot of a batch: element type, layout and
//! normalization in one pass (the horizontal flip is folded in too, by reading columns
//! backwards), so every batch comes out contiguous with no separate transpose.

use half::f16;

/// Element type of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 8-bit unsigned integers, 0..=255 (no normalization).
    U8,
    /// 32-bit floats.
    F32,
    /// 16-bit floats (IEEE binary16).
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::F16 => "f16",
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
        let (scale, bias) = match self.normalize {
            Some(n) => n.affine(),
            None => ([1.0 / 255.0; 3], [0.0; 3]),
        };
        // Source pixel for output column x.
        let src_x = |x: usize| if flip { w - 1 - x } else { x };
        match self.dtype {
            DType::U8 => match self.layout {
                Layout::Nhwc if !flip => slot.copy_from_slice(image),
                Layout::Nhwc => {
                    for y in 0..h {
                        let row = &image[y * w * 3..(y + 1) * w * 3];
                        let out = &mut slot[y * w * 3..(y + 1) * w * 3];
                        for x in 0..w {
                            out[x * 3..x * 3 + 3]
                                .copy_from_slice(&row[src_x(x) * 3..src_x(x) * 3 + 3]);
                        }
                    }
                }
                Layout::Nchw => {
                    for c in 0..3 {
                        let plane = &mut slot[c * w * h..(c + 1) * w * h];
                        for y in 0..h {
                            let row = &image[y * w * 3..(y + 1) * w * 3];
                            for x in 0..w {
                                plane[y * w + x] = row[src_x(x) * 3 + c];
                            }
                        }
                    }
                }
            },
            DType::F32 => {
                // SAFETY: any bit pattern is a valid f32; alignment is checked below.
                let (head, out, tail) = unsafe { slot.align_to_mut::<f32>() };
                assert!(
                    head.is_empty() && tail.is_empty(),
                    "f32 slot is not 4-byte aligned"
                );
                write_float(image, w, h, flip, self.layout, scale, bias, out, |v| v);
            }
            DType::F16 => {
                // SAFETY: any bit pattern is a valid u16; alignment is checked below.
                let (head, out, tail) = unsafe { slot.align_to_mut::<u16>() };
                assert!(
                    head.is_empty() && tail.is_empty(),
                    "f16 slot is not 2-byte aligned"
                );
                write_float(image, w, h, flip, self.layout, scale, bias, out, |v| {
                    f16::from_f32(v).to_bits()
                });
            }
        }
    }
}

/// `out = pixel · scale + bias` per channel, converted by `convert`, in `layout`; each output
/// row is written front to back (the flip reverses the source row instead).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn write_float<T: Copy>(
    image: &[u8],
    w: usize,
    h: usize,
    flip: bool,
    layout: Layout,
    scale: [f32; 3],
    bias: [f32; 3],
    out: &mut [T],
    convert: impl Fn(f32) -> T,
) {
    let [s0, s1, s2] = scale;
    let [b0, b1, b2] = bias;
    // Iterators rather than indices: no bounds checks in the inner loop.
    match layout {
        Layout::Nchw => {
            let plane = w * h;
            let (r, rest) = out.split_at_mut(plane);
            let (g, b) = rest.split_at_mut(plane);
            let rows = image.chunks_exact(w * 3);
            let planes = r
                .chunks_exact_mut(w)
                .zip(g.chunks_exact_mut(w))
                .zip(b.chunks_exact_mut(w));
            for (row, ((r, g), b)) in rows.zip(planes) {
                let dst = r.iter_mut().zip(g.iter_mut()).zip(b.iter_mut());
                let put = |(((r, g), b), px): (((&mut T, &mut T), &mut T), &[u8])| {
                    *r = convert(px[0] as f32 * s0 + b0);
                    *g = convert(px[1] as f32 * s1 + b1);
                    *b = convert(px[2] as f32 * s2 + b2);
                };
                if flip {
                    dst.zip(row.chunks_exact(3).rev()).for_each(put);
                } else {
                    dst.zip(row.chunks_exact(3)).for_each(put);
                }
            }
        }
        Layout::Nhwc => {
            for (row, dst) in image.chunks_exact(w * 3).zip(out.chunks_exact_mut(w * 3)) {
                let put = |(d, px): (&mut [T], &[u8])| {
                    d[0] = convert(px[0] as f32 * s0 + b0);
                    d[1] = convert(px[1] as f32 * s1 + b1);
                    d[2] = convert(px[2] as f32 * s2 + b2);
                };
                if flip {
                    dst.chunks_exact_mut(3)
                        .zip(row.chunks_exact(3).rev())
                        .for_each(put);
                } else {
                    dst.chunks_exact_mut(3)
                        .zip(row.chunks_exact(3))
                        .for_each(put);
                }
            }
        }
    }
    let _ = h;
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
