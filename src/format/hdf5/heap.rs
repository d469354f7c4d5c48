//! h5py's variable-length elements (`h5py.vlen_dtype(np.uint8)`) read with `pread` and checked
//! here, without libhdf5.
//!
//! libhdf5 stores each element of a variable-length dataset as a small descriptor in the
//! dataset's raw data, `u32 LE length | collection address | u32 LE object index` (the "global
//! heap ID"; the address is as wide as the file's offsets, 8 bytes in every file h5py writes),
//! and the element's bytes as an object in a *global heap collection* elsewhere in the file
//! (HDF5 File Format Specification, "Global Heap" and "Disk Format: Level 0A"):
//!
//! ```text
//! collection: "GCOL" | version 1 | 3 reserved | u<L> LE collection size (header included)
//!             (the header padded to a multiple of 8)
//!             then objects, each: u16 LE index | u16 refcount | 4 reserved | u<L> LE size
//!                                  | data padded to a multiple of 8
//!             index 0 marks the free space that ends the collection
//! ```
//!
//! (`L` is the file's size of lengths, 8 in h5py's files.) Reading records through libhdf5 took
//! its process-wide lock for every record, so workers took turns, and a damaged heap could crash
//! the library mid-epoch; a thread inside it at `fork()` also left the child's copy locked. Here
//! every number read from the file is checked against the collection and the file before it
//! indexes or sizes anything: a damaged descriptor or collection is a reason string the reader
//! turns into a bad sample naming the record.

use std::fs;
use std::os::unix::fs::FileExt as _;

/// The widths the superblock gives the file's addresses and lengths. (Addresses are relative to
/// the superblock's position, which libhdf5 takes as the base address whatever the field says;
/// the files read here have it at byte 0.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Widths {
    /// Bytes in a file address ("size of offsets"): 2, 4 or 8.
    pub offsets: usize,
    /// Bytes in a length ("size of lengths"): 2, 4 or 8.
    pub lengths: usize,
}

impl Widths {
    /// Bytes one stored element's descriptor takes.
    pub fn descriptor(&self) -> usize {
        4 + self.offsets + 4
    }

    /// The collection's header, padded to a multiple of 8 (libhdf5's `H5HG_SIZEOF_HDR`).
    fn collection_header(&self) -> usize {
        (8 + self.lengths).next_multiple_of(8)
    }

    fn object_header(&self) -> usize {
        8 + self.lengths
    }
}

/// Reads a little-endian unsigned integer of 1 to 8 bytes.
fn uint(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .rev()
        .fold(0u64, |n, &b| (n << 8) | u64::from(b))
}

/// The widths from the superblock at the start of `head` (the file's first bytes; 48 are
/// enough for every superblock version).
pub(crate) fn superblock_widths(head: &[u8]) -> Result<Widths, String> {
    if head.len() < 9 || &head[..8] != super::SIGNATURE {
        return Err("no HDF5 superblock at the start of the file".into());
    }
    // Version 0 and 1: sizes at bytes 13 and 14. Version 2 and 3: at 9 and 10.
    let (offsets_at, lengths_at) = match head[8] {
        0 | 1 => (13, 14),
        2 | 3 => (9, 10),
        v => return Err(format!("superblock version {v} is not one libhdf5 writes")),
    };
    let width = |at: usize, what: &str| -> Result<usize, String> {
        match head.get(at) {
            Some(&w @ (2 | 4 | 8)) => Ok(usize::from(w)),
            Some(w) => Err(format!(
                "the superblock's size of {what} is {w}, not 2, 4 or 8"
            )),
            None => Err("the superblock is cut short".into()),
        }
    };
    Ok(Widths {
        offsets: width(offsets_at, "offsets")?,
        lengths: width(lengths_at, "lengths")?,
    })
}

/// Where one element's bytes are: its length and the global heap object holding them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeapId {
    /// The element's length in bytes (elements of `uint8`).
    pub len: u32,
    /// The collection's address (0: none, a null element).
    pub collection: u64,
    /// The object's index in its collection.
    pub object: u32,
}

impl HeapId {
    /// An element never written: empty.
    pub const EMPTY: HeapId = HeapId {
        len: 0,
        collection: 0,
        object: 0,
    };
}

/// Parses the stored descriptors of consecutive elements (`bytes` holds whole descriptors).
pub(crate) fn parse_descriptors(bytes: &[u8], widths: &Widths) -> Vec<HeapId> {
    let o = widths.offsets;
    bytes
        .chunks_exact(widths.descriptor())
        .map(|d| HeapId {
            len: uint(&d[..4]) as u32,
            collection: uint(&d[4..4 + o]),
            object: uint(&d[4 + o..]) as u32,
        })
        .collect()
}

/// The range of object `object`'s bytes inside `collection` (a whole collection, its header
/// included), after checking the header and every object header walked past.
pub(crate) fn find_object(
    collection: &[u8],
    widths: &Widths,
    object: u32,
) -> Result<std::ops::Range<usize>, String> {
    let size = collection_size(collection, widths)?;
    if collection.len() < size {
        return Err(format!(
            "the global heap collection is {size} bytes but only {} were read",
            collection.len()
        ));
    }
    let collection = &collection[..size];
    let header = widths.object_header();
    let mut at = widths.collection_header();
    while at + header <= size {
        let index = uint(&collection[at..at + 2]);
        if index == 0 {
            break; // the free space: no object follows
        }
        let len = uint(&collection[at + 8..at + header]);
        let start = at + header;
        let end = (start as u64)
            .checked_add(len)
            .filter(|&end| end <= size as u64)
            .ok_or_else(|| {
                format!(
                    "global heap object {index} at byte {at} of its collection claims {len} \
                     bytes, past the collection's {size}"
                )
            })? as usize;
        if index == u64::from(object) {
            return Ok(start..end);
        }
        // The next object follows the data padded to a multiple of 8 (past the end: the loop
        // stops).
        at = start + (end - start).next_multiple_of(8);
    }
    Err(format!(
        "global heap object {object} is not in its collection"
    ))
}

/// The collection size its header declares, checked to hold at least the header.
fn collection_size(collection: &[u8], widths: &Widths) -> Result<usize, String> {
    let header = widths.collection_header();
    if collection.len() < 8 + widths.lengths {
        return Err("the global heap collection's header is cut short".into());
    }
    if &collection[..4] != b"GCOL" {
        return Err("no global heap collection at the element's address (bad signature)".into());
    }
    if collection[4] != 1 {
        return Err(format!(
            "global heap collection version {}, not 1",
            collection[4]
        ));
    }
    let size = uint(&collection[8..8 + widths.lengths]);
    if size < header as u64 {
        return Err(format!(
            "the global heap collection declares {size} bytes, less than its header"
        ));
    }
    usize::try_from(size).map_err(|_| format!("the global heap collection declares {size} bytes"))
}

/// What a first read of a collection takes: collections libhdf5 writes are at least 4 KiB, and
/// most of those holding small images are exactly that, so one `pread` usually gets all of it.
const FIRST_READ: usize = 4096;

/// One worker's reader of global heap objects, keeping the last collection it read (elements
/// written one after another share collections, so neighbouring records often need no read).
pub(crate) struct HeapReader {
    widths: Widths,
    file_len: u64,
    /// The absolute address of the collection in `collection`, when it holds one.
    cached: Option<u64>,
    collection: Vec<u8>,
}

impl HeapReader {
    pub fn new(widths: Widths, file_len: u64) -> HeapReader {
        HeapReader {
            widths,
            file_len,
            cached: None,
            collection: Vec::new(),
        }
    }

    /// Element `id`'s bytes, read from `file` with `pread` and checked (the tests' and the
    /// fuzz target's way in; the reader uses [`locate`](Self::locate)).
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn read<'a>(&'a mut self, file: &fs::File, id: &HeapId) -> Result<&'a [u8], String> {
        let range = self.locate(file, id)?;
        Ok(self.bytes(range))
    }

    /// Where element `id`'s bytes lie in [`bytes`](Self::bytes), its collection read (or kept
    /// from the last read) with `pread` and checked: the reader hands them out from there,
    /// without a copy.
    pub fn locate(
        &mut self,
        file: &fs::File,
        id: &HeapId,
    ) -> Result<std::ops::Range<usize>, String> {
        // No length, or no collection (libhdf5's "null" element): empty, as the library
        // reads it.
        if id.len == 0 || id.collection == 0 {
            return Ok(0..0);
        }
        let address = id.collection;
        if address >= self.file_len {
            return Err(format!(
                "its global heap collection address {address} is past the end of the {}-byte \
                 file",
                self.file_len
            ));
        }
        if self.cached != Some(address) {
            self.cached = None;
            self.load(file, address)?;
            self.cached = Some(address);
        }
        let range = find_object(&self.collection, &self.widths, id.object)?;
        if range.len() != id.len as usize {
            return Err(format!(
                "its descriptor says {} bytes but global heap object {} holds {}",
                id.len,
                id.object,
                range.len()
            ));
        }
        Ok(range)
    }

    /// The bytes at `range` of the collection last read ([`locate`](Self::locate)).
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.collection[range]
    }

    /// Reads the whole collection at `address` into `self.collection`.
    fn load(&mut self, file: &fs::File, address: u64) -> Result<(), String> {
        let available = self.file_len - address;
        let first = (FIRST_READ as u64).min(available) as usize;
        self.collection.resize(first, 0);
        read_at(file, &mut self.collection, address)?;
        let size = collection_size(&self.collection, &self.widths)?;
        if size as u64 > available {
            return Err(format!(
                "its global heap collection at byte {address} declares {size} bytes, past the \
                 end of the {}-byte file",
                self.file_len
            ));
        }
        if size > first {
            self.collection.resize(size, 0);
            read_at(file, &mut self.collection[first..], address + first as u64)?;
        }
        Ok(())
    }
}

/// Fills `buffer` from `file` at `offset` with `pread`, or says why it could not (a file cut
/// short names the bytes missing).
pub(crate) fn read_at(file: &fs::File, buffer: &mut [u8], offset: u64) -> Result<(), String> {
    file.read_exact_at(buffer, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!(
                "bytes {offset}..{} are past the end of the file (truncated?)",
                offset + buffer.len() as u64
            )
        } else {
            format!("read failed: {e}")
        }
    })
}

/// The fuzz target's body (`fuzzing::hdf5_global_heap`): `collection` in a file at byte 8, sizes
/// of lengths 2, 4 or 8 by `selector`; what [`find_object`] finds lies inside the collection, and
/// [`HeapReader`] hands out exactly those bytes or an error.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz(path: &std::path::Path, selector: u8, object: u32, len: u32, collection: &[u8]) {
    let widths = Widths {
        offsets: 8,
        lengths: [2, 4, 8][usize::from(selector) % 3],
    };
    let found = find_object(collection, &widths, object);
    if let Ok(range) = &found {
        assert!(range.start <= range.end && range.end <= collection.len());
    }
    // The collection at byte 8 of the file (address 0 means "no collection").
    let mut bytes = vec![0u8; 8];
    bytes.extend_from_slice(collection);
    std::fs::write(path, &bytes).expect("scratch file");
    let file = fs::File::open(path).expect("scratch file");
    let mut reader = HeapReader::new(widths, bytes.len() as u64);
    let id = HeapId {
        len,
        collection: 8,
        object,
    };
    if let Ok(bytes) = reader.read(&file, &id) {
        assert_eq!(bytes.len(), len as usize);
        if len > 0 {
            let range = found.expect("the reader found what find_object did not");
            assert_eq!(bytes, &collection[range]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Widths = Widths {
        offsets: 8,
        lengths: 8,
    };

    /// A collection of `size` bytes holding `objects` as (index, bytes), then free space.
    fn collection(size: usize, objects: &[(u16, &[u8])]) -> Vec<u8> {
        let mut c = b"GCOL\x01\0\0\0".to_vec();
        c.extend_from_slice(&(size as u64).to_le_bytes());
        for (index, data) in objects {
            c.extend_from_slice(&index.to_le_bytes());
            c.extend_from_slice(&1u16.to_le_bytes());
            c.extend_from_slice(&[0; 4]);
            c.extend_from_slice(&(data.len() as u64).to_le_bytes());
            c.extend_from_slice(data);
            c.resize(c.len().next_multiple_of(8), 0);
        }
        c.resize(size, 0);
        c
    }

    #[test]
    fn objects_are_found_by_index_past_padding() {
        let c = collection(4096, &[(1, b"abc"), (2, b"0123456789"), (7, b"")]);
        assert_eq!(&c[find_object(&c, &W, 1).unwrap()], b"abc");
        assert_eq!(&c[find_object(&c, &W, 2).unwrap()], b"0123456789");
        assert_eq!(find_object(&c, &W, 7).unwrap().len(), 0);
        assert!(find_object(&c, &W, 3).is_err());
        // Index 0 is the free space, never an object.
        assert!(find_object(&c, &W, 0).is_err());
    }

    #[test]
    fn four_byte_lengths_follow_libhdf5s_padding() {
        // Sizes of lengths 4: the collection header (12 bytes) is padded to 16, object headers
        // are 12 bytes, and each object's data is padded to a multiple of 8, so object 2
        // starts at 16 + 12 + 8 = 36, not on a multiple of 8.
        let w = Widths {
            offsets: 8,
            lengths: 4,
        };
        let mut c = b"GCOL\x01\0\0\0".to_vec();
        c.extend_from_slice(&64u32.to_le_bytes());
        c.resize(16, 0);
        c.extend_from_slice(&[1, 0, 1, 0, 0, 0, 0, 0, 3, 0, 0, 0]);
        c.extend_from_slice(b"abc\0\0\0\0\0");
        assert_eq!(c.len(), 36);
        c.extend_from_slice(&[2, 0, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0]);
        c.extend_from_slice(b"xy");
        c.resize(64, 0);
        assert_eq!(&c[find_object(&c, &w, 1).unwrap()], b"abc");
        assert_eq!(&c[find_object(&c, &w, 2).unwrap()], b"xy");
    }

    #[test]
    fn damaged_collections_are_refused_never_read_past() {
        let good = collection(64, &[(1, b"abcdefgh"), (2, b"xy")]);
        let mut bad_signature = good.clone();
        bad_signature[0] = b'X';
        assert!(find_object(&bad_signature, &W, 1).is_err());
        let mut bad_version = good.clone();
        bad_version[4] = 2;
        assert!(find_object(&bad_version, &W, 1).is_err());
        // An object size running past the collection.
        let mut too_long = good.clone();
        too_long[16 + 8..16 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(find_object(&too_long, &W, 2).is_err());
        // A declared size larger than what was read.
        let mut larger = good.clone();
        larger[8..16].copy_from_slice(&1_000_000u64.to_le_bytes());
        assert!(find_object(&larger, &W, 1).is_err());
        // A declared size smaller than the header.
        let mut tiny = good.clone();
        tiny[8..16].copy_from_slice(&3u64.to_le_bytes());
        assert!(find_object(&tiny, &W, 1).is_err());
        // Every byte flipped alone: an error or a range inside the collection, never a panic.
        for at in 0..good.len() {
            for bit in 0..8 {
                let mut c = good.clone();
                c[at] ^= 1 << bit;
                for object in 0..4 {
                    if let Ok(range) = find_object(&c, &W, object) {
                        assert!(range.end <= c.len());
                    }
                }
            }
        }
    }

    #[test]
    fn the_reader_reads_objects_from_the_file_and_null_elements_as_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("heap.bin");
        let mut file = vec![0u8; 8];
        file.extend(collection(64, &[(1, b"abc"), (2, b"xy")]));
        std::fs::write(&path, &file).unwrap();
        let handle = fs::File::open(&path).unwrap();
        let mut reader = HeapReader::new(W, file.len() as u64);
        let id = |len, collection, object| HeapId {
            len,
            collection,
            object,
        };
        assert_eq!(reader.read(&handle, &id(3, 8, 1)).unwrap(), b"abc");
        assert_eq!(reader.read(&handle, &id(2, 8, 2)).unwrap(), b"xy");
        // libhdf5's null element (no collection) and an empty one read as empty.
        assert!(reader.read(&handle, &id(3, 0, 1)).unwrap().is_empty());
        assert!(reader.read(&handle, &id(0, 999, 1)).unwrap().is_empty());
        // A length that is not the object's, an address past the file, or no collection there.
        assert!(reader.read(&handle, &id(4, 8, 1)).is_err());
        assert!(reader.read(&handle, &id(3, 72, 1)).is_err());
        assert!(reader.read(&handle, &id(3, 16, 1)).is_err());
        // A collection declared larger than what is left of the file.
        let mut cut = file.clone();
        cut[16..24].copy_from_slice(&4096u64.to_le_bytes());
        std::fs::write(&path, &cut).unwrap();
        let handle = fs::File::open(&path).unwrap();
        let mut reader = HeapReader::new(W, cut.len() as u64);
        assert!(reader.read(&handle, &id(3, 8, 1)).is_err());
    }

    #[test]
    fn superblock_widths_by_version() {
        let mut v0 = super::super::SIGNATURE.to_vec();
        v0.resize(48, 0);
        v0[13] = 8;
        v0[14] = 4;
        // A base address field (here 512) is not used: see `Widths`.
        v0[24..32].copy_from_slice(&512u64.to_le_bytes());
        assert_eq!(
            superblock_widths(&v0).unwrap(),
            Widths {
                offsets: 8,
                lengths: 4,
            }
        );
        let mut v2 = super::super::SIGNATURE.to_vec();
        v2.resize(48, 0);
        v2[8] = 2;
        v2[9] = 4;
        v2[10] = 8;
        assert_eq!(
            superblock_widths(&v2).unwrap(),
            Widths {
                offsets: 4,
                lengths: 8,
            }
        );
        let mut odd = v0.clone();
        odd[13] = 3;
        assert!(superblock_widths(&odd).is_err());
        assert!(superblock_widths(&v0[..14]).is_err());
        let mut v9 = v0;
        v9[8] = 9;
        assert!(superblock_widths(&v9).is_err());
    }

    #[test]
    fn descriptors_parse_at_the_file_widths() {
        let mut bytes = Vec::new();
        for (len, addr, index) in [(5u32, 4096u64, 1u32), (0, 0, 0), (9, 1 << 40, 65535)] {
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes.extend_from_slice(&addr.to_le_bytes());
            bytes.extend_from_slice(&index.to_le_bytes());
        }
        let ids = parse_descriptors(&bytes, &W);
        assert_eq!(ids.len(), 3);
        assert_eq!(
            ids[2],
            HeapId {
                len: 9,
                collection: 1 << 40,
                object: 65535
            }
        );
    }
}
