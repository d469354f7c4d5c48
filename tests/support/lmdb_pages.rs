//! The bytes that hold an LMDB file together, found by reading its pages as liblmdb lays them
//! out (64-bit): for the structure-flip tests, which damage each of them in turn.
#![allow(dead_code)]

const PAGE_HEADER: usize = 16;
const NODE_HEADER: usize = 8;

fn u16_at(bytes: &[u8], at: usize) -> usize {
    u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize
}

/// The page size a meta page of `file` gives.
pub fn page_size(file: &[u8]) -> usize {
    u32::from_le_bytes(file[40..44].try_into().unwrap()) as usize
}

/// The root page of the main database, as the live meta page (the later transaction) gives it.
pub fn main_root(file: &[u8]) -> usize {
    let size = page_size(file);
    let u64_at = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().unwrap());
    let meta = if u64_at(size + 144) > u64_at(144) {
        size
    } else {
        0
    };
    u64_at(meta + 128) as usize
}

/// Offsets of every structure byte of the LMDB file `file`: both meta pages up to `mm_txnid`;
/// on each branch and leaf page the header, the node table and each node's header and key (and
/// a named database's record); on each overflow page its header. Values are left out.
pub fn structure_bytes(file: &[u8]) -> Vec<usize> {
    let size = page_size(file);
    let mut out = Vec::new();
    for number in 0..file.len() / size {
        let page = &file[number * size..(number + 1) * size];
        let base = number * size;
        if number < 2 {
            out.extend(base..base + 152);
            continue;
        }
        let flags = u16_at(page, 10);
        if flags & 0x04 != 0 {
            out.extend(base..base + PAGE_HEADER);
            continue;
        }
        if flags & 0x03 == 0 {
            continue; // free or never-written pages: nothing reads them
        }
        out.extend(base..base + PAGE_HEADER);
        let (lower, upper) = (u16_at(page, 12), u16_at(page, 14));
        if lower < PAGE_HEADER || lower > upper || upper > size {
            continue;
        }
        out.extend(base + PAGE_HEADER..base + lower);
        for i in 0..(lower - PAGE_HEADER) / 2 {
            let node = u16_at(page, PAGE_HEADER + 2 * i);
            if node + NODE_HEADER > size {
                continue;
            }
            let key_end = (node + NODE_HEADER + u16_at(page, node + 6)).min(size);
            let mut end = key_end;
            let node_flags = u16_at(page, node + 4);
            if flags & 0x02 != 0 && node_flags == 0x01 {
                end = (key_end + 8).min(size); // the overflow page number
            } else if flags & 0x02 != 0 && node_flags == 0x02 {
                end = (key_end + 48).min(size); // a named database's record
            }
            out.extend(base + node..base + end);
        }
    }
    out
}

/// Offsets of the flags of every node on the leaf pages of `file` (each node's `mn_flags`).
pub fn leaf_node_flags(file: &[u8]) -> Vec<usize> {
    let size = page_size(file);
    let mut out = Vec::new();
    for number in 2..file.len() / size {
        let page = &file[number * size..(number + 1) * size];
        if u16_at(page, 10) & 0x02 == 0 {
            continue;
        }
        let lower = u16_at(page, 12);
        for i in 0..lower.saturating_sub(PAGE_HEADER) / 2 {
            out.push(number * size + u16_at(page, PAGE_HEADER + 2 * i) + 4);
        }
    }
    out
}
