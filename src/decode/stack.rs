//! Small JPEGs decoded many per libjpeg-turbo call: a batch's CIFAR-size images stacked into
//! one tall JPEG.
//!
//! Decoding a 32×32 JPEG is mostly fixed cost: parsing its four Huffman tables and expanding
//! them into lookup tables, and setting up the decompressor, every image again (6.2 µs per
//! CIFAR-10 image decoded alone on this project's machine; 2.7 µs per image stacked, to planes).
//! Files written by one encoder with the same settings share every byte before their
//! entropy-coded data: tables, frame header, scan header. And a sequential scan starts with
//! every DC prediction at zero and ends byte-aligned, padded with 1-bits, exactly as a restart
//! interval does. So the data of N such images, joined by `RSTn` markers under the first
//! image's headers with the frame height set to N × H and a restart interval of one image's
//! MCUs, is a valid JPEG whose MCU rows are the N images' in order (each image a whole number
//! of MCU rows). libjpeg-turbo decodes it in one call to Y, Cb and Cr planes (entropy decoding
//! and inverse DCT), and each image's RGB is made from its own rows of the planes by
//! [`super::ycc`], with the upsampling and colour conversion libjpeg-turbo applies to the file
//! alone: the pixels are bit-identical to decoding each file on its own.
//!
//! What is stacked: baseline or extended sequential (SOF0/SOF1), Huffman-coded, 8-bit, one
//! scan of every component, no restart markers, grayscale or YCbCr 4:4:4 or 4:2:0, at most
//! [`MAX_PIXELS`] pixels and [`ycc::MAX_WIDTH`] wide, a height that is a whole number of MCUs,
//! entropy-coded data with no marker in it (every `0xFF` stuffed) ending the file with `EOI`,
//! and every byte before that data equal to the stack's first image's. Anything else is decoded
//! alone, as before.
//!
//! Damage: if libjpeg-turbo reports any error or warning for the stack, none of it is used and
//! every image is decoded alone, so a damaged file fails with its own error, as it would have.
//! The stack keeps each member's bytes (the shared headers once, its data), so a member that
//! needs another decode than the whole image (a DCT-scaled crop) is decoded alone from them.

use std::ops::Range;

use super::DecodeError;
use super::ImageHeader;
use super::restart::{Markers, is_frame};
use super::turbo::{JpegHeader, Turbo};
use super::ycc::{self, Planes, Sampling};

/// The most pixels a stacked image may have. Past CIFAR and Tiny-ImageNet sizes the fixed
/// cost a stack saves is a small share of a decode.
pub(crate) const MAX_PIXELS: u32 = 128 * 128;

/// The most memory a stack's planes may take: a batch of larger images is decoded in part
/// stacked, the rest alone, rather than holding tens of megabytes per worker.
const MAX_PLANE_BYTES: u64 = 4 << 20;

/// The most entropy-coded bytes a stack holds: hostile files padded with megabytes of
/// marker-free bytes must not make a worker copy a batch's worth of them.
const MAX_DATA_BYTES: usize = 16 << 20;

/// The most entropy-coded bytes an image of `pixels` pixels may have to be stacked: more than
/// any real file needs (a block's 64 coefficients take at most 64 × 27 bits per component,
/// about 10 bytes a pixel for three full-resolution components), far less than padding.
fn max_data_len(pixels: u32) -> usize {
    12 * pixels as usize + 1024
}

/// The tallest stack: libjpeg's largest image dimension (`JPEG_MAX_DIMENSION`), below the
/// frame header's 65535.
const MAX_HEIGHT: u64 = 65_500;

/// A JPEG frame's and scan's rows, as far as stacking needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Offset of the scan header's marker: the restart-interval segment goes just before it.
    sos_at: usize,
    /// Offset of the entropy-coded data (just past the scan header); the data ends two bytes
    /// before the end of the file (`EOI`).
    data_at: usize,
    /// Offset of the frame header's 16-bit height.
    height_at: usize,
    width: u32,
    height: u32,
    sampling: Sampling,
    /// MCUs per image: the stack's restart interval.
    mcus: u32,
}

impl Shape {
    /// `data`'s shape when it can be stacked (the module docs), else `None`. Reads nothing
    /// past the slice.
    pub(crate) fn of(data: &[u8]) -> Option<Shape> {
        let mut frame: Option<(usize, u32, u32, Sampling)> = None;
        for (marker, at, payload) in Markers::of(data) {
            match marker {
                0xC0 | 0xC1 if frame.is_none() => frame = Some(parse_frame(at, payload)?),
                m if is_frame(m) => return None, // another frame type, or a second frame
                0xDD | 0xCC => return None,      // restart markers already; arithmetic coding
                0xDA => {
                    let (height_at, width, height, sampling) = frame?;
                    let components = if sampling == Sampling::Gray { 1 } else { 3 };
                    // Every component in one scan, all 64 coefficients, no successive
                    // approximation.
                    if payload.len() != 4 + 2 * components
                        || payload[0] as usize != components
                        || payload[payload.len() - 3..] != [0, 63, 0]
                    {
                        return None;
                    }
                    let (mcu_w, mcu_h) = match sampling {
                        Sampling::Ycc420 => (16, 16),
                        Sampling::Gray | Sampling::Ycc444 => (8, 8),
                    };
                    let fits = (8..=ycc::MAX_WIDTH as u32).contains(&width)
                        && height.is_multiple_of(mcu_h)
                        && width * height <= MAX_PIXELS;
                    let data_at = at + payload.len();
                    let scan = data.get(data_at..data.len().checked_sub(2)?)?;
                    if !fits
                        || scan.len() > max_data_len(width * height)
                        || data[data.len() - 2..] != [0xFF, 0xD9]
                        || !marker_free(scan)
                    {
                        return None;
                    }
                    return Some(Shape {
                        sos_at: at - 4,
                        data_at,
                        height_at,
                        width,
                        height,
                        sampling,
                        mcus: width.div_ceil(mcu_w) * (height / mcu_h),
                    });
                }
                _ => {}
            }
        }
        None
    }

    /// Image size in pixels.
    pub(crate) fn size(&self) -> (u32, u32) {
        (self.width, self.height)
    }
}

/// A SOF0/SOF1 payload at offset `at`: (offset of its height, width, height, sampling), for
/// 8-bit grayscale or YCbCr 4:4:4 or 4:2:0 only.
fn parse_frame(at: usize, payload: &[u8]) -> Option<(usize, u32, u32, Sampling)> {
    let [precision, h0, h1, w0, w1, components, rest @ ..] = payload else {
        return None;
    };
    if *precision != 8 || rest.len() != 3 * *components as usize {
        return None;
    }
    let factors: Vec<u8> = rest.chunks_exact(3).map(|c| c[1]).collect();
    let sampling = match factors.as_slice() {
        // One component is coded one block per MCU whatever its factors say.
        [_] => Sampling::Gray,
        [0x11, 0x11, 0x11] => Sampling::Ycc444,
        [0x22, 0x11, 0x11] => Sampling::Ycc420,
        _ => return None,
    };
    let height = u16::from_be_bytes([*h0, *h1]) as u32;
    let width = u16::from_be_bytes([*w0, *w1]) as u32;
    Some((at + 1, width, height, sampling))
}

/// Whether entropy-coded `data` holds no marker: every `0xFF` is followed by a stuffed zero.
fn marker_free(data: &[u8]) -> bool {
    let mut rest = data;
    while let Some(at) = memchr::memchr(0xFF, rest) {
        if rest.get(at + 1) != Some(&0) {
            return false;
        }
        rest = &rest[at + 2..];
    }
    !data.is_empty()
}

/// One stacked image.
#[derive(Debug, Clone)]
struct Member {
    /// The caller's position for it (increasing).
    position: usize,
    /// Its entropy-coded data in the stack's JPEG.
    data: Range<usize>,
}

/// The first image's headers, and what libjpeg-turbo made of them.
#[derive(Debug, Clone)]
struct Group {
    shape: Shape,
    /// Every byte before the first image's entropy-coded data: a member's must equal them.
    head: Vec<u8>,
    header: ImageHeader,
    jpeg_header: JpegHeader,
}

/// A stack being filled, or decoded; reused from batch to batch.
#[derive(Default)]
pub(crate) struct JpegStack {
    group: Option<Group>,
    /// The stack's JPEG: the first image's headers with a restart interval, the members'
    /// data joined by restart markers, then (once decoded) `EOI`.
    jpeg: Vec<u8>,
    members: Vec<Member>,
    /// Y, Cb, Cr planes of the whole stack, once decoded.
    planes: Vec<u8>,
    decoded: bool,
    /// Members whose pixels were handed out since the stack was cleared.
    used: usize,
}

/// Where one image's rows lie in a stack's planes: its Y rows `y_stride` apart, `y_len` bytes
/// in all, and each chroma plane's rows `c_stride` apart, `c_len` bytes. A stack of `n` images
/// holds `n` of each, image after image (its height is whole MCU rows, so no chroma row is
/// shared).
#[derive(Debug, Clone, Copy)]
struct PlaneSizes {
    y_stride: usize,
    y_len: usize,
    c_stride: usize,
    c_len: usize,
}

impl Shape {
    fn plane_sizes(&self) -> PlaneSizes {
        let (w, h) = (self.width as usize, self.height as usize);
        let y_stride = match self.sampling {
            // TurboJPEG's Y plane is a whole number of chroma samples wide.
            Sampling::Ycc420 => w.next_multiple_of(2),
            Sampling::Gray | Sampling::Ycc444 => w,
        };
        let (c_stride, c_rows) = self.sampling.chroma_size(w, h);
        PlaneSizes {
            y_stride,
            y_len: y_stride * h,
            c_stride,
            c_len: c_stride * c_rows,
        }
    }
}

impl JpegStack {
    /// Empties the stack (keeping its memory).
    pub(crate) fn clear(&mut self) {
        self.group = None;
        self.jpeg.clear();
        self.members.clear();
        self.decoded = false;
        self.used = 0;
    }

    /// Whether the stack has its first image's headers.
    pub(crate) fn has_group(&self) -> bool {
        self.group.is_some()
    }

    /// Images stacked, and of those, whose pixels were handed out.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.members.len(), self.used)
    }

    /// Starts a stack with `data`'s headers (`shape` is [`Shape::of`] it; `header` and
    /// `jpeg_header` what the decoder read from it).
    pub(crate) fn start(
        &mut self,
        data: &[u8],
        shape: Shape,
        header: ImageHeader,
        jpeg_header: JpegHeader,
    ) {
        self.clear();
        self.jpeg.extend_from_slice(&data[..shape.sos_at]);
        let [hi, lo] = (shape.mcus as u16).to_be_bytes();
        self.jpeg.extend_from_slice(&[0xFF, 0xDD, 0, 4, hi, lo]);
        self.jpeg
            .extend_from_slice(&data[shape.sos_at..shape.data_at]);
        self.group = Some(Group {
            shape,
            head: data[..shape.data_at].to_vec(),
            header,
            jpeg_header,
        });
    }

    /// Whether the stack has no room for another image of its shape (its height or its planes
    /// would pass [`MAX_HEIGHT`] or [`MAX_PLANE_BYTES`]); false before its first image.
    pub(crate) fn is_full(&self) -> bool {
        let Some(group) = &self.group else {
            return false;
        };
        let count = self.members.len() as u64 + 1;
        let sizes = group.shape.plane_sizes();
        let image_bytes = (sizes.y_len + 2 * sizes.c_len) as u64;
        count * group.shape.height as u64 > MAX_HEIGHT || count * image_bytes > MAX_PLANE_BYTES
    }

    /// Adds `data` as the image at `position` (greater than any before) when it has the
    /// stack's headers and stackable data and the stack has room; says whether it did.
    pub(crate) fn push(&mut self, position: usize, data: &[u8]) -> bool {
        let full = self.is_full();
        let Some(group) = &self.group else {
            return false;
        };
        let head = group.head.len();
        if self.decoded
            || full
            || data.len() < head + 3
            || data[..head] != group.head[..]
            || data[data.len() - 2..] != [0xFF, 0xD9]
            || self.members.last().is_some_and(|m| m.position >= position)
        {
            return false;
        }
        let scan = &data[head..data.len() - 2];
        let pixels = group.shape.width * group.shape.height;
        if scan.len() > max_data_len(pixels)
            || self.jpeg.len() + scan.len() + 4 > MAX_DATA_BYTES
            || !marker_free(scan)
        {
            return false;
        }
        if !self.members.is_empty() {
            let marker = 0xD0 + ((self.members.len() - 1) % 8) as u8;
            self.jpeg.extend_from_slice(&[0xFF, marker]);
        }
        let start = self.jpeg.len();
        self.jpeg.extend_from_slice(scan);
        self.members.push(Member {
            position,
            data: start..self.jpeg.len(),
        });
        true
    }

    /// Decodes the stack to planes with `turbo`. On an error nothing of the stack is used
    /// afterwards (every member is then decoded alone).
    pub(crate) fn decode(&mut self, turbo: &mut Turbo) -> Result<(), DecodeError> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        if self.decoded || self.members.is_empty() {
            return Ok(());
        }
        let shape = group.shape;
        let height = self.members.len() * shape.height as usize;
        let [hi, lo] = (height as u16).to_be_bytes();
        self.jpeg[shape.height_at..shape.height_at + 2].copy_from_slice(&[hi, lo]);
        self.jpeg.extend_from_slice(&[0xFF, 0xD9]);
        let n = self.members.len();
        let sizes = shape.plane_sizes();
        let (y_len, c_len) = (n * sizes.y_len, n * sizes.c_len);
        self.planes.resize(y_len + 2 * c_len, 0);
        let result = turbo.read_header(&self.jpeg).and_then(|jh| {
            if (jh.width as usize, jh.height as usize) != (shape.width as usize, height) {
                return Err(DecodeError::Jpeg("the stacked JPEG's size changed".into()));
            }
            turbo.decompress_planes(
                &self.jpeg,
                &mut self.planes,
                [sizes.y_stride, sizes.c_stride, sizes.c_stride],
                [y_len, c_len, c_len],
            )
        });
        match result {
            Ok(()) => self.decoded = true,
            Err(_) => self.clear(),
        }
        result
    }

    /// The header of the image stacked at `position`, once the stack is decoded: `(header,
    /// jpeg header)` as the decoder reads them from its bytes.
    pub(crate) fn member(&self, position: usize) -> Option<(ImageHeader, JpegHeader)> {
        let group = self.group.as_ref()?;
        self.find(position)?;
        self.decoded.then_some((group.header, group.jpeg_header))
    }

    fn find(&self, position: usize) -> Option<usize> {
        self.members
            .binary_search_by_key(&position, |m| m.position)
            .ok()
    }

    /// The bytes of the file stacked at `position` (its headers, data and `EOI`), into `out`.
    ///
    /// # Panics
    /// When there is no such member (a caller bug).
    pub(crate) fn bytes(&self, position: usize, out: &mut Vec<u8>) {
        let group = self.group.as_ref().expect("a stack");
        let member = &self.members[self.find(position).expect("a stacked member")];
        out.clear();
        out.extend_from_slice(&group.head);
        out.extend_from_slice(&self.jpeg[member.data.clone()]);
        out.extend_from_slice(&[0xFF, 0xD9]);
    }

    /// Writes the RGB pixels of the image at `position` into `out` (resized to fit), once the
    /// stack is decoded.
    ///
    /// # Panics
    /// When there is no such decoded member (a caller bug).
    pub(crate) fn pixels(&mut self, position: usize, out: &mut Vec<u8>) {
        let group = self.group.as_ref().expect("a decoded stack");
        assert!(self.decoded, "a decoded stack");
        let index = self.find(position).expect("a stacked member");
        let shape = group.shape;
        let (w, h) = (shape.width as usize, shape.height as usize);
        let n = self.members.len();
        let sizes = shape.plane_sizes();
        let (y, chroma) = self.planes.split_at(n * sizes.y_len);
        let (cb, cr) = chroma.split_at(n * sizes.c_len);
        let (y_at, c_at) = (index * sizes.y_len, index * sizes.c_len);
        let planes = Planes {
            y: &y[y_at..y_at + sizes.y_len],
            y_stride: sizes.y_stride,
            cb: &cb[c_at..c_at + sizes.c_len],
            cr: &cr[c_at..c_at + sizes.c_len],
            c_stride: sizes.c_stride,
        };
        out.resize(w * h * 3, 0);
        ycc::to_rgb(shape.sampling, planes, w, h, &mut out[..]);
        self.used += 1;
    }
}
