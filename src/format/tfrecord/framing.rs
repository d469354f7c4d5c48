//! TFRecord framing: each record is `u64 LE length | u32 LE masked CRC-32C of the length | data |
//! u32 LE masked CRC-32C of data`; building frames, checking one, and walking a whole shard.

const MASK_DELTA: u32 = 0xa282_ead8;
pub(crate) const HEADER_BYTES: usize = 12;
pub(crate) const FOOTER_BYTES: usize = 4;

/// TFRecord's masked CRC-32C.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// True when `head` (a file's first bytes) starts with a frame header whose length CRC checks
/// out: an uncompressed shard, whatever else follows.
pub fn starts_with_frame(head: &[u8]) -> bool {
    head.len() >= HEADER_BYTES
        && masked_crc(&head[..8]) == u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"))
}

/// Appends one TFRecord frame holding `data` to `out`.
pub fn frame(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// Checks the frame at the start of `bytes` (exactly one record's bytes, as an index gives them)
/// and returns its data.
pub fn unframe(bytes: &[u8]) -> std::result::Result<&[u8], String> {
    if bytes.len() < HEADER_BYTES + FOOTER_BYTES {
        return Err(format!(
            "{} bytes is shorter than a TFRecord frame",
            bytes.len()
        ));
    }
    let len_bytes = &bytes[..8];
    let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    let len_crc = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if masked_crc(len_bytes) != len_crc {
        return Err("the length's CRC does not match (corrupt record header)".into());
    }
    if len != (bytes.len() - HEADER_BYTES - FOOTER_BYTES) as u64 {
        return Err(format!(
            "the frame says {len} data bytes but the index gives the record {} bytes",
            bytes.len()
        ));
    }
    let data = &bytes[HEADER_BYTES..bytes.len() - FOOTER_BYTES];
    let data_crc = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().expect("4 bytes"));
    if masked_crc(data) != data_crc {
        return Err("the data's CRC does not match (corrupt record)".into());
    }
    Ok(data)
}

/// What [`scan_shard`] found: every record's `(offset, length)` in file order, and the entries
/// among them that are damaged byte ranges rather than records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardScan {
    /// `(offset, length)` of each entry; together they cover the whole shard.
    pub records: Vec<(u64, u64)>,
    /// `(position in records, what is wrong)` for each damaged range.
    pub damaged: Vec<(usize, String)>,
    /// Whether the shard ends cut short: its last frame declares more bytes than are left, or
    /// too few bytes for a frame are left. How many records the lost tail held is unknown;
    /// the last entry (a damaged range) stands for all of them.
    pub cut_end: bool,
}

/// Builds an index by walking the frames of a shard, from its first byte to its last.
///
/// A frame whose length CRC is wrong, whose declared length runs past the end, or a tail too
/// short for a header does not end the walk: the bytes from there to the next place where a
/// whole frame checks out (length CRC, length and data CRC) become one damaged entry, and the
/// walk goes on from that frame. So nothing after damage is silently dropped: a damaged range is
/// a record that reads as bad, named with the reason, and the shard keeps every good record.
pub fn scan_shard(bytes: &[u8]) -> ShardScan {
    let mut scan = ShardScan::default();
    let mut offset = 0usize;
    while offset < bytes.len() {
        match frame_at(bytes, offset) {
            Ok(total) => {
                scan.records.push((offset as u64, total as u64));
                offset += total;
            }
            Err(problem) => {
                let next = next_frame(bytes, offset + 1);
                scan.cut_end = next == bytes.len() && runs_past_end(bytes, offset);
                let reason = format!(
                    "bytes {offset}..{next} of the shard are not a TFRecord frame ({problem}){}",
                    if next == bytes.len() {
                        " and nothing after them is"
                    } else {
                        "; the next frame starts after them"
                    }
                );
                scan.damaged.push((scan.records.len(), reason));
                scan.records.push((offset as u64, (next - offset) as u64));
                offset = next;
            }
        }
    }
    scan
}

/// The first place from `from` on where a whole frame checks out (length CRC, length, data
/// CRC), or the shard's end. Bytes that cannot be read ([`crate::mapguard`]: a page of a mapped
/// shard the disk failed to supply) are skipped a page at a time.
fn next_frame(bytes: &[u8], from: usize) -> usize {
    let mut at = from;
    while at < bytes.len() {
        let header = &bytes[at..bytes.len().min(at + HEADER_BYTES)];
        if let Err(fault) = crate::mapguard::fault_in(header) {
            at = crate::mapguard::past_page_of(bytes, fault);
            continue;
        }
        if frame_at(bytes, at).is_ok_and(|_| full_frame_ok(bytes, at)) {
            return at;
        }
        at += 1;
    }
    bytes.len()
}

/// The total length of the frame whose header starts at `offset`, when the header's CRC checks
/// out and the frame fits in `bytes`; otherwise what is wrong (also when the header cannot be
/// read: [`crate::mapguard`]).
fn frame_at(bytes: &[u8], offset: usize) -> std::result::Result<usize, String> {
    let rest = &bytes[offset..];
    if rest.len() < HEADER_BYTES + FOOTER_BYTES {
        return Err(format!("{} bytes left, too few for a frame", rest.len()));
    }
    crate::mapguard::fault_in(&rest[..HEADER_BYTES])
        .map_err(|_| "its header could not be read (an I/O error)".to_string())?;
    let len_bytes = &rest[..8];
    let crc = u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes"));
    if masked_crc(len_bytes) != crc {
        return Err("bad length CRC".into());
    }
    let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    let total = len.saturating_add((HEADER_BYTES + FOOTER_BYTES) as u64);
    if total > rest.len() as u64 {
        return Err(format!(
            "declares {len} data bytes but only {} are left",
            rest.len()
        ));
    }
    Ok(total as usize)
}

/// Whether what starts at `offset` is a frame the shard's end cuts off: too few bytes left for
/// a frame, or a header (its length CRC good) declaring more bytes than are left.
fn runs_past_end(bytes: &[u8], offset: usize) -> bool {
    let rest = &bytes[offset..];
    if rest.len() < HEADER_BYTES + FOOTER_BYTES {
        return true;
    }
    if crate::mapguard::fault_in(&rest[..HEADER_BYTES]).is_err() {
        return false;
    }
    let len_bytes = &rest[..8];
    let crc = u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    masked_crc(len_bytes) == crc
        && len.saturating_add((HEADER_BYTES + FOOTER_BYTES) as u64) > rest.len() as u64
}

/// Whether the frame at `offset` (whose header [`frame_at`] accepted) has a good data CRC too:
/// the check that makes a place found by resynchronising a real frame.
fn full_frame_ok(bytes: &[u8], offset: usize) -> bool {
    frame_at(bytes, offset).is_ok_and(|total| {
        let frame = &bytes[offset..offset + total];
        crate::mapguard::fault_in(frame).is_ok() && unframe(frame).is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scan_over_a_map_whose_file_was_cut_marks_the_rest_unreadable_not_sigbus() {
        let mut shard = Vec::new();
        for i in 0..2000u32 {
            frame(
                &mut shard,
                format!("record {i:04} {}", "x".repeat(80)).as_bytes(),
            );
        }
        let clean = scan_shard(&shard);
        // Three pages stay; the map still says the whole shard.
        let (_dir, _, map) = crate::mapguard::map_then_cut(&shard, 3 * 4096);
        let scan = scan_shard(&map);
        let (&(last_at, last_len), before) = scan.records.split_last().unwrap();
        assert_eq!(before, &clean.records[..before.len()]);
        assert_eq!(
            last_at + last_len,
            shard.len() as u64,
            "{:?}",
            scan.records.last()
        );
        // From the first frame whose header lies past the cut (frames are 108 bytes).
        assert!((3 * 4096..3 * 4096 + 108).contains(&last_at), "{last_at}");
        assert_eq!(scan.damaged.len(), 1, "{:?}", scan.damaged);
        assert_eq!(scan.damaged[0].0, before.len());
        assert!(
            scan.damaged[0].1.contains("could not be read"),
            "{:?}",
            scan.damaged
        );
    }

    #[test]
    fn crc_is_castagnoli() {
        // The CRC-32C check value; the mask itself is checked against TensorFlow-format files
        // written by the Python tfrecord package (tests/integration/compat.rs).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_ne!(masked_crc(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn frames_round_trip_and_corruption_is_detected() {
        let mut shard = Vec::new();
        frame(&mut shard, b"first");
        frame(&mut shard, b"second record");
        let scan = scan_shard(&shard);
        assert_eq!(scan.damaged, []);
        assert!(!scan.cut_end);
        assert_eq!(scan.records, [(0, 21), (21, 29)]);
        assert_eq!(unframe(&shard[21..]).unwrap(), b"second record");

        let mut bad = shard.clone();
        bad[21 + 14] ^= 1; // a data byte of the second record
        assert!(unframe(&bad[21..]).unwrap_err().contains("data's CRC"));
        let mut bad = shard.clone();
        bad[21] ^= 1; // its length
        assert!(unframe(&bad[21..]).unwrap_err().contains("length's CRC"));
        let scan = scan_shard(&bad);
        assert_eq!(scan.records, [(0, 21), (21, 29)]);
        assert_eq!(scan.damaged.len(), 1);
        assert_eq!(scan.damaged[0].0, 1);
        assert!(
            scan.damaged[0].1.contains("bytes 21..50"),
            "{:?}",
            scan.damaged
        );
        assert!(scan.damaged[0].1.contains("bad length CRC"));
        // Damage at the end that is not a cut: the tail holds no more records.
        assert!(!scan.cut_end);

        // Cut inside the last frame's data, then inside its header: a cut end.
        for cut in [45, 30] {
            assert!(scan_shard(&shard[..cut]).cut_end, "cut at {cut}");
        }
        let scan = scan_shard(&shard[..40]);
        assert_eq!(scan.records, [(0, 21), (21, 19)]);
        assert!(scan.cut_end);
        assert_eq!(scan.damaged.len(), 1);
        assert!(
            scan.damaged[0]
                .1
                .contains("declares 13 data bytes but only 19 are left")
        );
    }

    #[test]
    fn a_damaged_frame_costs_only_its_own_bytes() {
        let mut shard = Vec::new();
        for data in [&b"first"[..], b"second record", b"third"] {
            frame(&mut shard, data);
        }
        // The second record's length CRC, then instead a huge length with a valid CRC.
        let mut bad_crc = shard.clone();
        bad_crc[21 + 8] ^= 0xFF;
        let mut huge = shard.clone();
        let len = (1u64 << 60).to_le_bytes();
        huge[21..29].copy_from_slice(&len);
        huge[29..33].copy_from_slice(&masked_crc(&len).to_le_bytes());
        for (what, bytes) in [("bad CRC", bad_crc), ("huge length", huge)] {
            let scan = scan_shard(&bytes);
            assert_eq!(scan.records, [(0, 21), (21, 29), (50, 21)], "{what}");
            assert_eq!(scan.damaged.len(), 1, "{what}");
            assert_eq!(scan.damaged[0].0, 1, "{what}");
            assert!(!scan.cut_end, "{what}");
            assert!(
                scan.damaged[0]
                    .1
                    .contains("the next frame starts after them"),
                "{what}: {}",
                scan.damaged[0].1
            );
            assert_eq!(unframe(&bytes[50..]).unwrap(), b"third");
        }
        // Stray bytes after the last frame are damage too, never ignored.
        let mut tail = shard.clone();
        tail.extend_from_slice(b"junk");
        let scan = scan_shard(&tail);
        assert_eq!(scan.records.last(), Some(&(71, 4)));
        assert!(scan.damaged[0].1.contains("nothing after them is"));
    }
}
