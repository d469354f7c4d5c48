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
//! `u32 LE CRC-32C of the header | the header`, at most [`MAX_HEADER_BYTES`] long. A header
//! joins the dictionary the second time the pack meets it (the first image stores it inline),
//! so a dataset of images that share nothing (photos of every size) holds no dictionary worth
//! speaking of; past [`MAX_HEADERS`] every new header stays inline.
//!
//! A format that stores this keeps the dictionary beside its records and checks each record's
//! stored bytes against its own checksum: a damaged header makes the records that use it bad
//! samples ([`SharedHeaders::join`] says which header), never wrong pixels.

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

    /// Appends the stored form of `payload` to `out` (module docs). Returns the header that
    /// became dictionary entry `id` with this payload, as `(id, its length)`: its bytes are
    /// `payload[..length]`, to be stored with the record that first uses it.
    pub(crate) fn encode(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Option<(u32, usize)> {
        let Some(split) = crate::decode::restart::scan_data_start(payload)
            .filter(|&split| split <= MAX_HEADER_BYTES)
        else {
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(payload);
            return None;
        };
        let (header, rest) = payload.split_at(split);
        let mut added = None;
        let id = match self.ids.get(header) {
            Some(&id) => Some(id),
            None if self.ids.len() < MAX_HEADERS as usize => {
                let sighting = (crc32c::crc32c(header), header.len());
                if self.seen_once.remove(&sighting) {
                    let id = self.ids.len() as u32 + 1;
                    self.ids.insert(header.into(), id);
                    added = Some((id, split));
                    Some(id)
                } else {
                    if self.seen_once.len() >= MAX_SEEN_ONCE {
                        self.seen_once.clear();
                    }
                    self.seen_once.insert(sighting);
                    None
                }
            }
            None => None,
        };
        match id {
            Some(id) => {
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(rest);
            }
            None => {
                out.extend_from_slice(&0u32.to_le_bytes());
                out.extend_from_slice(payload);
            }
        }
        added
    }
}

/// Appends header `bytes` as it is stored (`CRC-32C | bytes`) to `out`.
pub(crate) fn encode_header(bytes: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&crc32c::crc32c(bytes).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// A stored header's bytes, checked against its CRC-32C.
pub(crate) fn decode_header(stored: &[u8]) -> Result<&[u8], String> {
    let Some((sum, bytes)) = stored.split_first_chunk::<4>() else {
        return Err(format!("{} bytes, shorter than its checksum", stored.len()));
    };
    if bytes.len() > MAX_HEADER_BYTES {
        return Err(format!(
            "{} bytes, longer than a header may be ({MAX_HEADER_BYTES})",
            bytes.len()
        ));
    }
    let (stored_sum, computed) = (u32::from_le_bytes(*sum), crc32c::crc32c(bytes));
    if stored_sum != computed {
        return Err(super::checksum_mismatch(stored_sum, computed));
    }
    Ok(bytes)
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
                .map(|s| decode_header(s).map(Box::from))
                .collect(),
        }
    }

    /// The payload a record stored as `stored` (module docs): `stored`'s rest when it
    /// references no header, else the header then the rest, joined in `out`.
    pub(crate) fn join<'a>(
        &self,
        stored: &'a [u8],
        out: &'a mut Vec<u8>,
    ) -> Result<&'a [u8], String> {
        let Some((reference, rest)) = stored.split_first_chunk::<4>() else {
            return Err(format!(
                "payload is {} bytes, shorter than its header reference",
                stored.len()
            ));
        };
        let reference = u32::from_le_bytes(*reference);
        if reference == 0 {
            return Ok(rest);
        }
        let header = match self.headers.get(reference as usize - 1) {
            Some(Ok(header)) => header,
            Some(Err(why)) => {
                return Err(format!("its shared header {reference} is damaged: {why}"));
            }
            None => {
                return Err(format!(
                    "it refers to shared header {reference} of {}",
                    self.headers.len()
                ));
            }
        };
        out.clear();
        out.reserve(header.len() + rest.len());
        out.extend_from_slice(header);
        out.extend_from_slice(rest);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{ChromaSubsampling, JpegEncoder};

    fn jpeg(side: u32, shade: u8) -> Vec<u8> {
        let pixels: Vec<u8> = (0..side * side * 3)
            .map(|i| (i as u8).wrapping_mul(shade))
            .collect();
        JpegEncoder::new(90, ChromaSubsampling::Half)
            .and_then(|mut encoder| encoder.encode_rgb(&pixels, side, side))
            .expect("encodes")
    }

    /// Stores `payloads` through one dictionary, as a pack would; returns the stored forms and
    /// the stored headers.
    fn store(payloads: &[Vec<u8>]) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let mut dictionary = HeaderDictionary::default();
        let mut headers = Vec::new();
        let stored = payloads
            .iter()
            .map(|payload| {
                let mut out = Vec::new();
                if let Some((id, len)) = dictionary.encode(payload, &mut out) {
                    assert_eq!(id as usize, headers.len() + 1);
                    let mut header = Vec::new();
                    encode_header(&payload[..len], &mut header);
                    headers.push(header);
                }
                out
            })
            .collect();
        (stored, headers)
    }

    #[test]
    fn payloads_come_back_byte_for_byte_and_repeated_headers_are_stored_once() {
        let mut payloads: Vec<Vec<u8>> = (1..=6).map(|shade| jpeg(32, shade)).collect();
        payloads.push(jpeg(48, 7)); // another size: another frame header
        payloads.push(b"not a jpeg at all".to_vec());
        payloads.push(Vec::new());
        let (stored, headers) = store(&payloads);
        assert_eq!(headers.len(), 1, "one header met twice or more");
        let reader = SharedHeaders::from_stored(headers.iter().map(Vec::as_slice));
        let mut joined = Vec::new();
        for (payload, stored) in payloads.iter().zip(&stored) {
            assert_eq!(
                reader.join(stored, &mut joined).unwrap(),
                payload.as_slice()
            );
        }
        // The first 32×32 image stored its header inline; the other five refer to it.
        let referring = stored
            .iter()
            .filter(|s| s[..4] == 1u32.to_le_bytes())
            .count();
        assert_eq!(referring, 5);
        let split = crate::decode::restart::scan_data_start(&payloads[1]).unwrap();
        assert!(split > 500, "tables and headers: {split} bytes");
        assert_eq!(stored[1].len(), 4 + payloads[1].len() - split);
    }

    #[test]
    fn a_resumed_dictionary_refers_to_the_headers_stored_before() {
        let payloads: Vec<Vec<u8>> = (1..=3).map(|shade| jpeg(16, shade)).collect();
        let (_, headers) = store(&payloads);
        let header = decode_header(&headers[0]).unwrap().to_vec();
        let mut resumed = HeaderDictionary::resumed(vec![header]);
        let mut out = Vec::new();
        assert_eq!(resumed.encode(&jpeg(16, 9), &mut out), None);
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
                added += dictionary.encode(&file(n), &mut out).is_some() as u32;
            }
        }
        assert_eq!(added, MAX_HEADERS);
        out.clear();
        dictionary.encode(&file(MAX_HEADERS + 5), &mut out);
        assert_eq!(out[..4], 0u32.to_le_bytes(), "past the limit: inline");
    }

    #[test]
    fn damaged_headers_and_references_are_errors_that_say_which() {
        let payloads: Vec<Vec<u8>> = (1..=3).map(|shade| jpeg(16, shade)).collect();
        let (stored, mut headers) = store(&payloads);
        let mut joined = Vec::new();
        headers[0][40] ^= 1;
        let reader = SharedHeaders::from_stored(headers.iter().map(Vec::as_slice));
        let err = reader.join(&stored[1], &mut joined).unwrap_err();
        assert!(err.contains("shared header 1 is damaged"), "{err}");
        // A record stored whole does not need it.
        assert_eq!(reader.join(&stored[0], &mut joined).unwrap(), payloads[0]);
        let mut dangling = stored[1].clone();
        dangling[..4].copy_from_slice(&7u32.to_le_bytes());
        let err = reader.join(&dangling, &mut joined).unwrap_err();
        assert!(err.contains("shared header 7 of 1"), "{err}");
        assert!(reader.join(&[1, 0], &mut joined).is_err());
        assert!(decode_header(&[1, 2]).is_err());
        assert!(decode_header(&vec![0; MAX_HEADER_BYTES + 5]).is_err());
    }
}
