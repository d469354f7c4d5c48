//! Random access to the pixels of a JPEG whose restart markers cut every MCU row into equal
//! segments (what `pack-dataset --restart-rows` writes; [`add_restart_markers`]).
//!
//! A JPEG's entropy-coded data is one bit stream: to decode a block, a decoder normally
//! Huffman-decodes every block before it, since each block's DC coefficient is coded relative
//! to the previous block's, and the codes have no boundaries. A restart marker (`RSTn`) resets
//! that prediction and byte-aligns the stream. With markers at every row start and at equal
//! steps along each row, the segments covering a window of the image are a complete scan on
//! their own: this module builds that smaller JPEG (the original headers with the frame cut to
//! the window, the segments' data with their markers renumbered from `RST0`, `EOI`), and
//! libjpeg-turbo decodes it without Huffman-decoding anything outside the window. For a
//! RandomResizedCrop that is most of the decode's cost (the entropy decoding of rows above the
//! crop and of columns beside it, which no decoder API skips).
//!
//! The pixels are those of a decode of the whole file, provided the window keeps one MCU of
//! context on every side of the pixels the caller needs (chroma upsampling reads neighbouring
//! samples): [`RestartSegments::window_for`] does.
//!
//! Only what libjpeg-turbo's lossless transform writes is recognised: one Huffman-coded
//! sequential scan (SOF0/SOF1, 8 bits) holding every component, whose restart interval divides
//! the MCUs of a row. Anything else, or any inconsistency, is `None`, and the caller decodes the
//! file as usual; nothing here reads past a slice's end or trusts a length it has not checked.
//!
//! [`add_restart_markers`]: super::turbo::add_restart_markers

/// Where the pieces of a segmented JPEG are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RestartSegments {
    /// Offset of the frame header's 16-bit image height (the width follows it).
    height_at: usize,
    /// Image size in pixels.
    width: u32,
    height: u32,
    /// MCU size in pixels.
    mcu_width: u32,
    mcu_height: u32,
    /// MCUs per restart interval, and intervals per MCU row.
    interval: u32,
    per_row: u32,
    /// Number of MCU rows.
    rows: u32,
    /// Offset of the first byte of entropy-coded data (just past the scan header).
    data_start: usize,
}

/// A window of whole segments: MCU rows `rows`, segment columns `columns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub rows: (u32, u32),
    pub columns: (u32, u32),
}

/// `0xFF 0xD0`..`0xFF 0xD7`.
const RST0: u8 = 0xD0;
const EOI: u8 = 0xD9;

/// The header segments of a JPEG in order, up to and including the first scan header (SOS):
/// `(marker, offset of the segment's payload, payload)`. Ends early, without an error, at
/// anything malformed; nothing is read past a slice's end.
pub(super) struct Markers<'a> {
    data: &'a [u8],
    at: usize,
    done: bool,
}

impl<'a> Markers<'a> {
    pub(super) fn of(data: &'a [u8]) -> Self {
        let jpeg = data.get(..2) == Some(&[0xFF, 0xD8]);
        Markers {
            data,
            at: 2,
            done: !jpeg,
        }
    }

    /// The segments from offset `at` on (a marker there: after a scan's data, say).
    pub(super) fn from(data: &'a [u8], at: usize) -> Self {
        Markers {
            data,
            at,
            done: false,
        }
    }

    fn step(&mut self) -> Option<(u8, usize, &'a [u8])> {
        let data = self.data;
        let mut at = self.at;
        // Markers may be preceded by any number of fill bytes.
        if *data.get(at)? != 0xFF {
            return None;
        }
        while *data.get(at)? == 0xFF {
            at += 1;
        }
        let marker = *data.get(at)?;
        at += 1;
        // Start of image, end of image, a restart marker or TEM: no length, and not where a
        // header segment belongs.
        if matches!(marker, 0xD0..=0xD9 | 0x01) {
            return None;
        }
        let len = u16::from_be_bytes([*data.get(at)?, *data.get(at + 1)?]) as usize;
        let payload = data.get(at + 2..at + len.checked_sub(2)? + 2)?;
        self.at = at + len;
        self.done = marker == 0xDA;
        Some((marker, at + 2, payload))
    }
}

impl<'a> Iterator for Markers<'a> {
    type Item = (u8, usize, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let step = self.step();
        if step.is_none() {
            self.done = true;
        }
        step
    }
}

/// Where the first scan's entropy-coded data begins in `data` (just past its scan header):
/// every byte before it is tables and headers, identical across the files one encoder writes
/// with the same settings and size. `None` for anything that is not a JPEG whose header
/// segments parse up to a scan header.
pub(crate) fn scan_data_start(data: &[u8]) -> Option<usize> {
    Markers::of(data)
        .find(|&(marker, _, _)| marker == 0xDA)
        .map(|(_, at, payload)| at + payload.len())
}

/// A frame header's numbers: components and the largest sampling factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Frame {
    pub marker: u8,
    pub width: u32,
    pub height: u32,
    pub components: u8,
    pub h_max: u32,
    pub v_max: u32,
}

impl Frame {
    fn parse(marker: u8, payload: &[u8]) -> Option<Frame> {
        let components = *payload.get(5)?;
        if components == 0 || payload.len() != 6 + 3 * components as usize {
            return None;
        }
        let (mut h_max, mut v_max) = (1, 1);
        for c in payload[6..].chunks_exact(3) {
            let (h, v) = ((c[1] >> 4) as u32, (c[1] & 15) as u32);
            if !(1..=4).contains(&h) || !(1..=4).contains(&v) {
                return None;
            }
            h_max = h_max.max(h);
            v_max = v_max.max(v);
        }
        Some(Frame {
            marker,
            width: u16::from_be_bytes([payload[3], payload[4]]) as u32,
            height: u16::from_be_bytes([payload[1], payload[2]]) as u32,
            components,
            h_max,
            v_max,
        })
    }

    /// The MCU's size in pixels, as libjpeg lays out a scan of every component (one block for
    /// a single component, whatever its sampling factors say).
    pub(crate) fn mcu_size(&self) -> (u32, u32) {
        if self.components == 1 {
            (8, 8)
        } else {
            (8 * self.h_max, 8 * self.v_max)
        }
    }
}

/// SOF0..SOF15 but DHT (0xC4), JPG (0xC8) and DAC (0xCC).
pub(super) fn is_frame(marker: u8) -> bool {
    (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC)
}

/// What a JPEG's header segments say, from one walk over them: its frame header, and whether
/// it is a segmented JPEG (the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The first frame header (any SOF type).
    pub frame: Option<Frame>,
    pub segments: Option<RestartSegments>,
}

impl Layout {
    pub(crate) fn of(data: &[u8]) -> Layout {
        let mut layout = Layout::default();
        // Where the frame's height is, and whether it is baseline or extended sequential,
        // Huffman-coded, 8 bits: segments are recognised in nothing else.
        let mut height_at = 0;
        let mut sequential = false;
        let mut interval = 0u32;
        for (marker, at, payload) in Markers::of(data) {
            match marker {
                m if is_frame(m) => {
                    if layout.frame.is_some() {
                        return layout; // a second frame: no file of ours
                    }
                    layout.frame = Frame::parse(m, payload);
                    height_at = at + 1;
                    sequential = matches!(m, 0xC0 | 0xC1) && payload.first() == Some(&8);
                }
                0xDD => match payload {
                    [high, low, ..] => interval = u16::from_be_bytes([*high, *low]) as u32,
                    _ => return layout,
                },
                0xDA => {
                    layout.segments = layout.frame.filter(|_| sequential).and_then(|frame| {
                        RestartSegments::of(frame, height_at, interval, payload, at)
                    });
                    return layout;
                }
                _ => {}
            }
        }
        layout
    }
}

impl RestartSegments {
    /// Parses `data`'s markers up to the scan; `None` unless it is a segmented JPEG as the
    /// module docs describe.
    pub(crate) fn parse(data: &[u8]) -> Option<RestartSegments> {
        Layout::of(data).segments
    }

    /// The segments of a sequential scan of `frame` with restart `interval` (`height_at`: the
    /// frame height's offset; `scan` the scan header's payload, at offset `scan_at`).
    fn of(
        frame: Frame,
        height_at: usize,
        interval: u32,
        scan: &[u8],
        scan_at: usize,
    ) -> Option<RestartSegments> {
        // One scan holding every component.
        if frame.width == 0 || frame.height == 0 || *scan.first()? != frame.components {
            return None;
        }
        let (mcu_width, mcu_height) = frame.mcu_size();
        let mcus = frame.width.div_ceil(mcu_width);
        if interval == 0 || !mcus.is_multiple_of(interval) {
            return None;
        }
        Some(RestartSegments {
            height_at,
            width: frame.width,
            height: frame.height,
            mcu_width,
            mcu_height,
            interval,
            per_row: mcus / interval,
            rows: frame.height.div_ceil(mcu_height),
            data_start: scan_at + scan.len(),
        })
    }

    /// The window of segments that covers `x..x + width`, `y..y + height` of the image decoded
    /// at scale `eighths`/8, with one MCU of context on each side; `None` when that is the
    /// whole image (nothing to gain).
    pub(crate) fn window_for(
        &self,
        eighths: u32,
        (x, y, width, height): (u32, u32, u32, u32),
    ) -> Option<Window> {
        let (mcu_w, mcu_h) = (self.mcu_width * eighths / 8, self.mcu_height * eighths / 8);
        let segment_w = mcu_w * self.interval;
        let window = Window {
            rows: (
                y.saturating_sub(mcu_h) / mcu_h,
                (y + height + mcu_h).div_ceil(mcu_h).min(self.rows),
            ),
            columns: (
                x.saturating_sub(mcu_w) / segment_w,
                (x + width + mcu_w).div_ceil(segment_w).min(self.per_row),
            ),
        };
        (window.rows != (0, self.rows) || window.columns != (0, self.per_row)).then_some(window)
    }

    /// The top-left corner of `window` in pixels of the image at scale `eighths`/8.
    pub(crate) fn origin(&self, window: Window, eighths: u32) -> (u32, u32) {
        (
            window.columns.0 * self.interval * self.mcu_width * eighths / 8,
            window.rows.0 * self.mcu_height * eighths / 8,
        )
    }

    /// Writes into `out` a JPEG of `window` of `data` (which `self` was parsed from); `None` when
    /// the window is out of range or the data does not hold the restart markers the header
    /// promises (a damaged file: the caller decodes it whole, and libjpeg-turbo reports the
    /// damage).
    pub(crate) fn window_as_jpeg(
        &self,
        data: &[u8],
        window: Window,
        out: &mut Vec<u8>,
    ) -> Option<()> {
        let Window {
            rows: (first_row, end_row),
            columns: (first_column, end_column),
        } = window;
        if first_row >= end_row
            || end_row > self.rows
            || first_column >= end_column
            || end_column > self.per_row
        {
            return None;
        }
        let top = first_row * self.mcu_height;
        let left = first_column * self.interval * self.mcu_width;
        let height = (end_row * self.mcu_height).min(self.height) - top;
        let width = (end_column * self.interval * self.mcu_width).min(self.width) - left;
        out.clear();
        out.extend_from_slice(data.get(..self.data_start)?);
        out[self.height_at..self.height_at + 2].copy_from_slice(&(height as u16).to_be_bytes());
        out[self.height_at + 2..self.height_at + 4].copy_from_slice(&(width as u16).to_be_bytes());
        let per_row = end_column - first_column;
        let wanted = (end_row - first_row) * per_row;
        let mut written = 0u32;
        // Walk the entropy-coded data marker by marker: segment `k` runs from just past the
        // marker ending segment `k - 1` to the 0xFF that starts the marker ending it.
        let scan = data.get(self.data_start..)?;
        let last = end_row * self.per_row;
        let mut segment = 0u32;
        let mut start = 0usize;
        let mut at = 0usize;
        while segment < last {
            let ff = at + memchr::memchr(0xFF, scan.get(at..)?)?;
            let mut next = ff + 1;
            while *scan.get(next)? == 0xFF {
                next += 1;
            }
            let byte = scan[next];
            if byte == 0x00 {
                // A stuffed 0xFF data byte.
                at = next + 1;
                continue;
            }
            let restart = (RST0..RST0 + 8).contains(&byte);
            if restart && byte != RST0 + (segment % 8) as u8 {
                return None;
            }
            let (row, column) = (segment / self.per_row, segment % self.per_row);
            if row >= first_row && (first_column..end_column).contains(&column) {
                out.extend_from_slice(&scan[start..ff]);
                written += 1;
                if written == wanted {
                    out.extend_from_slice(&[0xFF, EOI]);
                    return Some(());
                }
                out.extend_from_slice(&[0xFF, RST0 + ((written - 1) % 8) as u8]);
            }
            if !restart {
                // The scan ended before the segments the header promises.
                return None;
            }
            segment += 1;
            start = next + 1;
            at = start;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any bytes, any window: `None` or a JPEG, never a panic or a read out of bounds.
        #[test]
        fn any_bytes_and_window_are_safe(
            head in proptest::collection::vec(any::<u8>(), 0..64),
            body in proptest::collection::vec(prop_oneof![Just(0xFFu8), Just(0xD0), Just(0x00), any::<u8>()], 0..400),
            rows in (0u32..40, 0u32..40),
            columns in (0u32..40, 0u32..40),
            eighths in 1u32..=8,
            region in (0u32..2000, 0u32..2000, 1u32..2000, 1u32..2000),
        ) {
            // A valid segmented header (4:4:4, 40x24, 5 MCUs a row in one-MCU segments), then
            // arbitrary bytes; and arbitrary bytes alone.
            let mut data = vec![0xFF, 0xD8, 0xFF, 0xC0, 0, 17, 8, 0, 24, 0, 40, 3,
                1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1, 0xFF, 0xDD, 0, 4, 0, 1,
                0xFF, 0xDA, 0, 12, 3, 1, 0, 2, 0x11, 3, 0x11, 0, 63, 0];
            data.extend_from_slice(&body);
            let mut out = Vec::new();
            for bytes in [&data[..], &head[..]] {
                if let Some(segments) = RestartSegments::parse(bytes) {
                    let window = Window { rows, columns };
                    let _ = segments.window_as_jpeg(bytes, window, &mut out);
                    if let Some(window) = segments.window_for(eighths, region) {
                        let _ = segments.origin(window, eighths);
                        let _ = segments.window_as_jpeg(bytes, window, &mut out);
                    }
                }
            }
        }
    }

    #[test]
    fn a_segmented_header_is_recognised_and_windows_cover_their_region() {
        let mut data = vec![
            0xFF, 0xD8, 0xFF, 0xC0, 0, 17, 8, 0, 24, 0, 40, 3, 1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1,
            0xFF, 0xDD, 0, 4, 0, 1, 0xFF, 0xDA, 0, 12, 3, 1, 0, 2, 0x11, 3, 0x11, 0, 63, 0,
        ];
        let segments = RestartSegments::parse(&data).unwrap();
        assert_eq!(
            (segments.per_row, segments.rows, segments.interval),
            (5, 3, 1)
        );
        // Pixels 17..20 x 9..10: MCU column 2, row 1, and one MCU of context around.
        let window = segments.window_for(8, (17, 9, 3, 1)).unwrap();
        assert_eq!(
            window,
            Window {
                rows: (0, 3),
                columns: (1, 4)
            }
        );
        assert_eq!(segments.origin(window, 8), (8, 0));
        // 15 segments, one byte each, the markers numbered RST0..RST7, RST0..: the window's
        // nine segments come out renumbered from RST0, and the frame cut to 24x24.
        for k in 0..15u8 {
            data.push(k);
            data.extend_from_slice(&[0xFF, if k == 14 { 0xD9 } else { 0xD0 + k % 8 }]);
        }
        let mut out = Vec::new();
        segments.window_as_jpeg(&data, window, &mut out).unwrap();
        let scan = &out[segments.data_start..];
        assert_eq!(
            scan,
            [
                1, 0xFF, 0xD0, 2, 0xFF, 0xD1, 3, 0xFF, 0xD2, 6, 0xFF, 0xD3, 7, 0xFF, 0xD4, 8, 0xFF,
                0xD5, 11, 0xFF, 0xD6, 12, 0xFF, 0xD7, 13, 0xFF, 0xD9
            ]
        );
        assert_eq!(
            &out[segments.height_at..segments.height_at + 4],
            [0, 24, 0, 24]
        );
        // A marker out of sequence: not what the header promises.
        let bad = data.len() - 8;
        data[bad] = 0xD0;
        assert_eq!(segments.window_as_jpeg(&data, window, &mut out), None);
        // A whole-image window gains nothing.
        assert_eq!(segments.window_for(8, (0, 0, 40, 24)), None);
    }

    #[test]
    fn files_without_restart_rows_are_not_recognised() {
        assert_eq!(RestartSegments::parse(b""), None);
        assert_eq!(RestartSegments::parse(&[0xFF, 0xD8, 0xFF]), None);
        // A marker whose length runs past the end.
        assert_eq!(
            RestartSegments::parse(&[0xFF, 0xD8, 0xFF, 0xE0, 0xFF, 0xFF]),
            None
        );
        // A length shorter than its own two bytes.
        assert_eq!(
            RestartSegments::parse(&[0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x01]),
            None
        );
    }
}
