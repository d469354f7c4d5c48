//! Whether a JPEG defines every table it uses.
//!
//! libjpeg keeps quantization and Huffman tables in its decompressor from one image to the
//! next (JPEG's "abbreviated" streams rely on it), and fills Huffman slots no file has defined
//! with the standard tables (Motion-JPEG frames carry none). So a file that uses a table it does
//! not define decodes differently after another image than in a fresh decompressor: a missing
//! quantization table is an error alone ("Quantization table 0x00 was not defined") but borrows
//! the previous image's in a reused handle, and a missing Huffman table is the standard one
//! alone but the previous image's after it. Found by fuzzing the stacked decode: the outcome of
//! a sample must not depend on which image its worker decoded before.
//!
//! [`defines_its_tables`] walks a file's markers, scans included, and says whether every scan
//! finds the tables it needs already defined in the file; the decoder gives any other file a
//! fresh handle (what a fresh process would do). Ordinary files define everything before the
//! first scan and never pay for one.

use super::restart::Markers;

/// Whether every scan in `data` uses only quantization and Huffman tables that `data` defines
/// before it. `false` for anything it cannot follow (arithmetic coding, whose conditioning
/// tables persist too; a malformed marker; a file that ends without `EOI`), which costs only a
/// fresh handle.
pub(crate) fn defines_its_tables(data: &[u8]) -> bool {
    // Defined tables: quantization 0..3, Huffman DC 0..3 and AC 0..3, as bit sets.
    let (mut quant, mut dc, mut ac) = (0u8, 0u8, 0u8);
    // Each frame component's id and quantization table; whether the frame is sequential.
    let mut components: Vec<(u8, u8)> = Vec::new();
    let mut sequential = false;
    let mut markers = Markers::of(data);
    loop {
        let Some((marker, at, payload)) = markers.next() else {
            return false;
        };
        match marker {
            0xDB => {
                // DQT: (precision << 4 | id, 64 or 128 bytes)...
                let mut rest = payload;
                while let [pq_tq, tail @ ..] = rest {
                    let size = if pq_tq >> 4 == 0 { 64 } else { 128 };
                    let (id, Some(tail)) = (pq_tq & 15, tail.get(size..)) else {
                        return false;
                    };
                    if id > 3 {
                        return false;
                    }
                    quant |= 1 << id;
                    rest = tail;
                }
            }
            0xC4 => {
                // DHT: (class << 4 | id, 16 counts, the values)...
                let mut rest = payload;
                while let [tc_th, tail @ ..] = rest {
                    let Some(counts) = tail.get(..16) else {
                        return false;
                    };
                    let values: usize = counts.iter().map(|&c| c as usize).sum();
                    let (class, id) = (tc_th >> 4, tc_th & 15);
                    if id > 3 || class > 1 {
                        return false;
                    }
                    if class == 0 {
                        dc |= 1 << id;
                    } else {
                        ac |= 1 << id;
                    }
                    let Some(tail) = tail.get(16 + values..) else {
                        return false;
                    };
                    rest = tail;
                }
            }
            // Arithmetic coding (its conditioning tables persist as well; DAC is 0xCC).
            0xC9..=0xCF => return false,
            0xC0..=0xC3 | 0xC5..=0xC7 => {
                let Some(&n) = payload.get(5) else {
                    return false;
                };
                let Some(list) = payload.get(6..6 + 3 * n as usize) else {
                    return false;
                };
                components = list.chunks_exact(3).map(|c| (c[0], c[2])).collect();
                sequential = matches!(marker, 0xC0 | 0xC1);
            }
            0xDA => {
                // SOS: n, (component id, dc << 4 | ac)..., Ss, Se, Ah/Al.
                let Some(&n) = payload.first() else {
                    return false;
                };
                let (Some(list), Some(&ss), Some(&se)) = (
                    payload.get(1..1 + 2 * n as usize),
                    payload.get(1 + 2 * n as usize),
                    payload.get(2 + 2 * n as usize),
                ) else {
                    return false;
                };
                for c in list.chunks_exact(2) {
                    let Some(&(_, tq)) = components.iter().find(|(id, _)| *id == c[0]) else {
                        return false;
                    };
                    let (td, ta) = (c[1] >> 4, c[1] & 15);
                    let has = |set: u8, id: u8| id < 4 && set & (1 << id) != 0;
                    if !has(quant, tq) || (ss == 0 && !has(dc, td)) || (se > 0 && !has(ac, ta)) {
                        return false;
                    }
                }
                // A sequential scan of every component is the file's only one.
                if sequential && n as usize == components.len() {
                    return true;
                }
                // Past the entropy-coded data to the next marker (not a restart marker).
                let mut next = at + payload.len();
                loop {
                    let Some(ff) = data.get(next..).and_then(|d| memchr::memchr(0xFF, d)) else {
                        return true; // data to the end: libjpeg reports that itself
                    };
                    next += ff;
                    match data.get(next + 1) {
                        Some(0x00 | 0xD0..=0xD7) => next += 2,
                        Some(0xFF) => next += 1,
                        Some(0xD9) => return true, // EOI
                        Some(_) => break,
                        None => return true,
                    }
                }
                markers = Markers::from(data, next);
            }
            _ => {}
        }
    }
}
