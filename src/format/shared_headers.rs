//! Shared JPEG headers (`pack-dataset --shared-headers`): the bytes of a JPEG before its first
//! scan's entropy-coded data (quantization and Huffman tables, frame and scan headers), stored
//! once per dataset instead of once per image.
//!
//! Files one encoder wrote with the same settings at the same size share all of those bytes:
//! 623 of a CIFAR-10 JPEG's 918 on average. Stored once, a dataset of such images is about a
//! third of the size, so a cold epoch reads a third as much. The split is a cut of the bytes,
//! nothing is re-encoded: a reader puts each header back in front of its record's rest and hands
//! out the original file, byte for byte.
//!
//! # Stored payload
//!
//! ```text
//! offset 0   u32 LE   reference: 0 = the payload follows whole; n ≥ 1 = header n, then this
//! offset 4   ...      the rest of the payload
//! ```
//!
//! Header `n` (1 ≤ n ≤ [`MAX_HEADERS`], numbered in the order the pack met them) is stored as
//! `u32 LE CRC-32C of n (u32 big-endian) and the header | the header`, at most
//! [`MAX_HEADER_BYTES`] long, and must be a JPEG's bytes up to the end of its scan header. A
//! header
//! joins the dictionary the second time the pack meets it (the first image stores it inline),
//! so a dataset of images that share nothing (photos of every size) holds no dictionary worth
//! speaking of; past [`MAX_HEADERS`] every new header stays inline.
//!
//! A format that stores this keeps the dictionary beside its records, and each record's
//! checksum covers its stored bytes and then the header it refers to ([`stored_value_checksum`]): a
//! damaged header makes the records that use it bad samples ([`SharedHeaders::split`] says
//! which header), and a header swapped for another fails their checksums, never wrong pixels.

use std::collections::{HashMap, HashSet};

/// The most headers a dataset's dictionary holds.
pub const MAX_HEADERS: u32 = 1024;

/// The longest header the dictionary takes: tables and headers are ~600 bytes; a file whose
/// bytes before its data run longer (large EXIF or ICC segments) is stored whole.
pub const MAX_HEADER_BYTES: usize = 8 << 10;

/// The most headers met once that the pack remembers while waiting for a second sighting;
/// forgotten all at once when full (a dataset of unique headers then costs nothing more).
const MAX_SEEN_ONCE: usize = 1 << 16;

/// The pack's side: the headers stored so far, and the ones met once.
#[derive(Debug, Default)]
pub(crate) struct HeaderDictionary {
    ids: HashMap<Box<[u8]>, u32>,
    /// `(CRC-32C, length)` of headers met once and stored inline.
    seen_once: HashSet<(u32, usize)>,
}

/// How [`HeaderDictionary::encode`] stored a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Encoded {
    /// The header it refers to (0: none, the payload is stored whole).
    pub reference: u32,
    /// That header's length: it is `payload[..header_len]` (0 with no reference).
    pub header_len: usize,
    /// Whether the header joined the dictionary with this payload: it is stored with it.
    pub added: bool,
}

impl HeaderDictionary {
    /// The dictionary of a resumed pack: `headers` in id order (`headers[0]` is header 1).
    pub(crate) fn resumed(headers: Vec<Vec<u8>>) -> HeaderDictionary {
        let ids = headers
            .into_iter()
            .zip(1..)
            .map(|(header, id)| (header.into_boxed_slice(), id))
            .collect();
        HeaderDictionary {
            ids,
            seen_once: HashSet::new(),
        }
    }

    /// Number of headers.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// Appends the stored form of `payload` to `out` (module docs) and says how it was stored.
    pub(crate) fn encode(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Encoded {
        let whole = |out: &mut Vec<u8>| {
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(payload);
            Encoded {
                reference: 0,
                header_len: 0,
                added: false,
            }
        };
        let Some(split) = crate::decode::restart::scan_data_start(payload)
            .filter(|&split| split <= MAX_HEADER_BYTES)
        else {
            return whole(out);
        };
        let (header, rest) = payload.split_at(split);
        let (reference, added) = match self.ids.get(header) {
            Some(&id) => (id, false),
            None if self.ids.len() < MAX_HEADERS as usize => {
                let sighting = (crc32c::crc32c(header), header.len());
                if !self.seen_once.remove(&sighting) {
                    if self.seen_once.len() >= MAX_SEEN_ONCE {
                        self.seen_once.clear();
                    }
                    self.seen_once.insert(sighting);
                    return whole(out);
                }
                let id = self.ids.len() as u32 + 1;
                self.ids.insert(header.into(), id);
                (id, true)
            }
            None => return whole(out),
        };
        out.extend_from_slice(&reference.to_le_bytes());
        out.extend_from_slice(rest);
        Encoded {
            reference,
            header_len: split,
            added,
        }
    }
}

/// The checksum a record stored as `value` keeps: CRC-32C of the value, continued over the
/// header it refers to. A header swapped for another, or emptied, then fails the record's
/// check: a header's own checksum only says that its bytes are some header's.
pub(crate) fn stored_value_checksum(value: &[u8], header: Option<&[u8]>) -> u32 {
    let sum = crc32c::crc32c(value);
    header.map_or(sum, |header| crc32c::crc32c_append(sum, header))
}

/// CRC-32C of header `id`'s number (`u32` big-endian) and bytes: a header stored under
/// another number fails it.
fn header_checksum(id: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&id.to_be_bytes()), bytes)
}

/// Appends header `id` as it is stored (`CRC-32C | bytes`) to `out`.
pub(crate) fn encode_header(id: u32, bytes: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&header_checksum(id, bytes).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Stored header `id`'s bytes, checked against its CRC-32C and to be what a pack stores: the
/// bytes of a JPEG up to the end of its first scan header, no more.
pub(crate) fn decode_header(id: u32, stored: &[u8]) -> Result<&[u8], String> {
    let Some((sum, bytes)) = stored.split_first_chunk::<4>() else {
        return Err(format!("{} bytes, shorter than its checksum", stored.len()));
    };
    if bytes.len() > MAX_HEADER_BYTES {
        return Err(format!(
            "{} bytes, longer than a header may be ({MAX_HEADER_BYTES})",
            bytes.len()
        ));
    }
    let (stored_sum, computed) = (u32::from_le_bytes(*sum), header_checksum(id, bytes));
    if stored_sum != computed {
        return Err(super::checksum_mismatch(stored_sum, computed));
    }
    if crate::decode::restart::scan_data_start(bytes) != Some(bytes.len()) {
        return Err(format!(
            "its {} bytes are not a JPEG's up to the end of its scan header",
            bytes.len()
        ));
    }
    Ok(bytes)
}

/// What [`SharedHeaders::summary`] counts: the headers a dataset stores once for its samples
/// (`pack-dataset inspect` reports it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SharedHeaderSummary {
    /// Headers stored.
    pub headers: usize,
    /// Their bytes (those that pass their check).
    pub bytes: u64,
    /// Headers that fail their check: every sample that uses one is a bad record.
    pub damaged: usize,
}

/// The reader's side: every header of a dataset, each checked (or why it is unusable).
#[derive(Debug, Default)]
pub(crate) struct SharedHeaders {
    headers: Vec<Result<Box<[u8]>, String>>,
}

impl SharedHeaders {
    /// Headers 1, 2, ... as stored, each [`decode_header`]d: one that fails its check only
    /// makes the records that use it bad.
    pub(crate) fn from_stored<'a>(stored: impl IntoIterator<Item = &'a [u8]>) -> SharedHeaders {
        SharedHeaders {
            headers: stored
                .into_iter()
                .zip(1..)
                .map(|(s, id)| decode_header(id, s).map(Box::from))
                .collect(),
        }
    }

    /// How many headers there are, their bytes, and how many of them fail their check.
    pub(crate) fn summary(&self) -> SharedHeaderSummary {
        let mut summary = SharedHeaderSummary {
            headers: self.headers.len(),
            ..SharedHeaderSummary::default()
        };
        for header in &self.headers {
            match header {
                Ok(bytes) => summary.bytes += bytes.len() as u64,
                Err(_) => summary.damaged += 1,
            }
        }
        summary
    }

    /// A payload stored as `stored` (module docs), taken apart: the header it refers to, if
    /// any, and the rest of the file.
    pub(crate) fn split<'a>(
        &'a self,
        stored: &'a [u8],
    ) -> Result<(Option<&'a [u8]>, &'a [u8]), String> {
        let Some((reference, rest)) = stored.split_first_chunk::<4>() else {
            return Err(format!(
                "payload is {} bytes, shorter than its header reference",
                stored.len()
            ));
        };
        let reference = u32::from_le_bytes(*reference);
        if reference == 0 {
            return Ok((None, rest));
        }
        match self.headers.get(reference as usize - 1) {
            Some(Ok(header)) => Ok((Some(header), rest)),
            Some(Err(why)) => Err(format!("its shared header {reference} is damaged: {why}")),
            None => Err(format!(
                "it refers to shared header {reference} of {}",
                self.headers.len()
            )),
        }
    }
}

/// The file a record stored as `header` and `rest` ([`SharedHeaders::split`]) holds: `rest`
/// itself, or the two joined in `out`.
pub(crate) fn join<'a>(header: Option<&[u8]>, rest: &'a [u8], out: &'a mut Vec<u8>) -> &'a [u8] {
    let Some(header) = header else {
        return rest;
    };
    out.clear();
    out.reserve(header.len() + rest.len());
    out.extend_from_slice(header);
    out.extend_from_slice(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{ChromaSubsampling, JpegEncoder};

    fn jpeg(side: u32, shade: u8, quality: u8) -> Vec<u8> {
        let pixels: Vec<u8> = (0..side * side * 3)
            .map(|i| (i as u8).wrapping_mul(shade))
            .collect();
        JpegEncoder::new(quality, ChromaSubsampling::Half)
            .and_then(|mut encoder| encoder.encode_rgb(&pixels, side, side))
            .expect("encodes")
    }

    /// A pack's output in memory: the stored payloads, their checksums, the stored headers.
    struct Stored {
        payloads: Vec<Vec<u8>>,
        sums: Vec<u32>,
        headers: Vec<Vec<u8>>,
    }

    /// Stores `payloads` through one dictionary, as a pack does.
    fn store(payloads: &[Vec<u8>]) -> Stored {
        let mut dictionary = HeaderDictionary::default();
        let mut stored = Stored {
            payloads: Vec::new(),
            sums: Vec::new(),
            headers: Vec::new(),
        };
        for payload in payloads {
            let mut out = Vec::new();
            let encoded = dictionary.encode(payload, &mut out);
            let header = &payload[..encoded.header_len];
            if encoded.added {
                assert_eq!(encoded.reference as usize, stored.headers.len() + 1);
                let mut entry = Vec::new();
                encode_header(encoded.reference, header, &mut entry);
                stored.headers.push(entry);
            }
            let header = (encoded.reference != 0).then_some(header);
            stored.sums.push(stored_value_checksum(&out, header));
            stored.payloads.push(out);
        }
        assert_eq!(dictionary.len(), stored.headers.len());
        stored
    }

    /// Record `index` of `stored` read back as a reader does: `Err` when it is damaged or its
    /// checksum fails.
    fn read(reader: &SharedHeaders, stored: &Stored, index: usize) -> Result<Vec<u8>, String> {
        let value = &stored.payloads[index];
        let (header, rest) = reader.split(value)?;
        let computed = stored_value_checksum(value, header);
        if computed != stored.sums[index] {
            return Err(crate::format::checksum_mismatch(
                stored.sums[index],
                computed,
            ));
        }
        Ok(join(header, rest, &mut Vec::new()).to_vec())
    }

    fn reader(headers: &[Vec<u8>]) -> SharedHeaders {
        SharedHeaders::from_stored(headers.iter().map(Vec::as_slice))
    }

    #[test]
    fn payloads_come_back_byte_for_byte_and_repeated_headers_are_stored_once() {
        let mut payloads: Vec<Vec<u8>> = (1..=6).map(|shade| jpeg(32, shade, 90)).collect();
        payloads.push(jpeg(48, 7, 90)); // another size: another frame header
        payloads.push(b"not a jpeg at all".to_vec());
        payloads.push(Vec::new());
        let stored = store(&payloads);
        assert_eq!(stored.headers.len(), 1, "one header met twice or more");
        let reader = reader(&stored.headers);
        for (index, payload) in payloads.iter().enumerate() {
            assert_eq!(&read(&reader, &stored, index).unwrap(), payload);
        }
        // The first 32×32 image stored its header inline; the other five refer to it.
        let referring = stored
            .payloads
            .iter()
            .filter(|s| s[..4] == 1u32.to_le_bytes())
            .count();
        assert_eq!(referring, 5);
        let split = crate::decode::restart::scan_data_start(&payloads[1]).unwrap();
        assert!(split > 500, "tables and headers: {split} bytes");
        assert_eq!(stored.payloads[1].len(), 4 + payloads[1].len() - split);
    }

    #[test]
    fn a_resumed_dictionary_refers_to_the_headers_stored_before() {
        let payloads: Vec<Vec<u8>> = (1..=3).map(|shade| jpeg(16, shade, 90)).collect();
        let stored = store(&payloads);
        let header = decode_header(1, &stored.headers[0]).unwrap().to_vec();
        let mut resumed = HeaderDictionary::resumed(vec![header]);
        let mut out = Vec::new();
        let encoded = resumed.encode(&jpeg(16, 9, 90), &mut out);
        assert_eq!((encoded.reference, encoded.added), (1, false));
        assert_eq!(out[..4], 1u32.to_le_bytes());
    }

    #[test]
    fn the_dictionary_stops_growing_at_its_limit() {
        let mut dictionary = HeaderDictionary::default();
        let mut out = Vec::new();
        // Distinct "headers": SOI, an APP segment holding the number, a scan header, data.
        let file = |n: u32| {
            let mut f = vec![0xFF, 0xD8, 0xFF, 0xE1, 0, 6];
            f.extend_from_slice(&n.to_le_bytes());
            f.extend_from_slice(&[0xFF, 0xDA, 0, 2, 1, 2, 3, 0xFF, 0xD9]);
            f
        };
        let mut added = 0;
        for n in 0..MAX_HEADERS + 10 {
            for _ in 0..2 {
                out.clear();
                added += dictionary.encode(&file(n), &mut out).added as u32;
            }
        }
        assert_eq!(added, MAX_HEADERS);
        out.clear();
        dictionary.encode(&file(MAX_HEADERS + 5), &mut out);
        assert_eq!(out[..4], 0u32.to_le_bytes(), "past the limit: inline");
    }

    #[test]
    fn damaged_headers_and_references_are_errors_that_say_which() {
        let payloads: Vec<Vec<u8>> = (1..=3).map(|shade| jpeg(16, shade, 90)).collect();
        let mut stored = store(&payloads);
        let mut damaged = stored.headers.clone();
        damaged[0][40] ^= 1;
        let reader = reader(&damaged);
        let err = read(&reader, &stored, 1).unwrap_err();
        assert!(err.contains("shared header 1 is damaged"), "{err}");
        // A record stored whole does not need it.
        assert_eq!(read(&reader, &stored, 0).unwrap(), payloads[0]);
        stored.payloads[1][..4].copy_from_slice(&7u32.to_le_bytes());
        let err = read(&self::reader(&stored.headers), &stored, 1).unwrap_err();
        assert!(err.contains("shared header 7 of 1"), "{err}");
        assert!(reader.split(&[1, 0]).is_err());
        assert!(decode_header(1, &[1, 2]).is_err());
        assert!(decode_header(1, &vec![0; MAX_HEADER_BYTES + 5]).is_err());
    }

    #[test]
    fn headers_swapped_emptied_or_renumbered_fail_the_records_that_use_them() {
        // Two encoders' settings (two qualities), two headers; each checks on its own.
        let payloads: Vec<Vec<u8>> = [90, 90, 90, 60, 60, 60]
            .iter()
            .zip(1..)
            .map(|(&quality, shade)| jpeg(16, shade, quality))
            .collect();
        let stored = store(&payloads);
        assert_eq!(stored.headers.len(), 2);
        let readable = |headers: &[Vec<u8>]| -> Vec<bool> {
            let reader = reader(headers);
            (0..payloads.len())
                .map(|index| read(&reader, &stored, index).is_ok_and(|p| p == payloads[index]))
                .collect()
        };
        assert!(readable(&stored.headers).iter().all(|&ok| ok));
        // Values swapped between the two keys: each fails its number's checksum.
        let swapped = vec![stored.headers[1].clone(), stored.headers[0].clone()];
        assert_eq!(readable(&swapped), [true, false, false, true, false, false]);
        assert!(decode_header(1, &stored.headers[1]).is_err());
        // Replaced by a well-formed entry of another header (its checksum recomputed for the
        // number), or by an empty one: the records' own checksums fail.
        let mut renumbered = Vec::new();
        encode_header(
            1,
            decode_header(2, &stored.headers[1]).unwrap(),
            &mut renumbered,
        );
        assert_eq!(
            readable(&[renumbered, stored.headers[1].clone()]),
            [true, false, false, true, true, true]
        );
        let mut empty = Vec::new();
        encode_header(1, b"", &mut empty);
        assert!(decode_header(1, &empty).is_err(), "no JPEG header");
        // Bytes that are no JPEG prefix, whatever their checksum says.
        let mut junk = Vec::new();
        encode_header(1, b"\xFF\xD8 not a header", &mut junk);
        assert!(decode_header(1, &junk).is_err());
    }
}
