//! The filters h5py writes, undone by checked code: fletcher32, deflate (flate2), LZF (liblzf)
//! and shuffle, each output checked against the size the chunk must have before anything is
//! allocated or copied. [`super::chunks`] reads the stored chunks and runs them through these.

/// One filter of a dataset's pipeline that imagefeed undoes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Filter {
    /// Bytes regrouped by their position in each `size`-byte element (HDF5 filter 2).
    Shuffle { size: usize },
    /// zlib (HDF5 filter 1).
    Deflate,
    /// h5py's LZF (filter 32000).
    Lzf,
    /// A 4-byte checksum after the data (HDF5 filter 3).
    Fletcher32,
}

/// The filters of the pipeline in dataset creation property list `dcpl`, when every one is
/// ours to undo.
pub(super) fn pipeline(dcpl: hdf5_sys::h5i::hid_t) -> Option<Vec<Filter>> {
    use hdf5_sys::h5p::{H5Pget_filter2, H5Pget_nfilters};
    // SAFETY: `dcpl` is a valid property list id while its owner lives.
    let count = unsafe { H5Pget_nfilters(dcpl) };
    let mut filters = Vec::with_capacity(usize::try_from(count).ok()?);
    for index in 0..count as u32 {
        let mut flags = 0;
        let mut values = [0u32; 8];
        let mut n_values = values.len();
        let mut config = 0;
        // SAFETY: the out-pointers are valid; `n_values` says how many values fit; no name
        // is asked for (length 0, null buffer).
        let id = unsafe {
            H5Pget_filter2(
                dcpl,
                index,
                &mut flags,
                &mut n_values,
                values.as_mut_ptr(),
                0,
                std::ptr::null_mut(),
                &mut config,
            )
        };
        filters.push(match id {
            1 => Filter::Deflate,
            2 => Filter::Shuffle {
                size: (n_values >= 1)
                    .then_some(values[0] as usize)
                    .filter(|&s| s > 0)?,
            },
            3 => Filter::Fletcher32,
            32000 => Filter::Lzf,
            _ => return None,
        });
    }
    Some(filters)
}

/// Checks and removes the fletcher32 checksum at the end of `data`. libhdf5 accepts the sum
/// in either byte order (files of old versions stored it byte-swapped).
pub(super) fn check_fletcher32(data: &mut Vec<u8>) -> std::result::Result<(), String> {
    let Some(len) = data.len().checked_sub(4) else {
        return Err("a chunk is too short to hold its fletcher32 checksum".into());
    };
    let stored = u32::from_le_bytes(data[len..].try_into().expect("4 bytes"));
    let computed = fletcher32(&data[..len]);
    if stored != computed && stored != computed.swap_bytes() {
        return Err(format!(
            "a chunk's fletcher32 checksum is {stored:#010x}, its bytes give {computed:#010x}"
        ));
    }
    data.truncate(len);
    Ok(())
}

/// HDF5's Fletcher-32: big-endian 16-bit words (an odd last byte as the high half), both sums
/// folded to 16 bits as they go.
fn fletcher32(data: &[u8]) -> u32 {
    let fold = |s: u32| (s & 0xffff) + (s >> 16);
    let (mut low, mut high) = (0u32, 0u32);
    let whole = data.len() & !1;
    // 360 words keep both sums below 2^32 before they are folded.
    for block in data[..whole].chunks(720) {
        for word in block.chunks_exact(2) {
            low += u32::from(u16::from_be_bytes([word[0], word[1]]));
            high += low;
        }
        low = fold(low);
        high = fold(high);
    }
    if let Some(&last) = data.get(whole) {
        low += u32::from(last) << 8;
        high += low;
        low = fold(low);
        high = fold(high);
    }
    (fold(high) << 16) | fold(low)
}

/// `output` as `want` zeroed bytes, its memory taken fallibly (a chunk's size comes from the
/// file).
fn sized_output(output: &mut Vec<u8>, want: usize) -> std::result::Result<(), String> {
    output.clear();
    output
        .try_reserve_exact(want)
        .map_err(|_| format!("no memory for a {want}-byte chunk"))?;
    output.resize(want, 0);
    Ok(())
}

/// Inflates the zlib stream `input` into `output`, which must come to exactly `want` bytes.
pub(super) fn inflate(
    input: &[u8],
    want: usize,
    output: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    sized_output(output, want)?;
    let mut inflater = flate2::Decompress::new(true);
    let status = inflater
        .decompress(input, output, flate2::FlushDecompress::Finish)
        .map_err(|e| format!("a chunk's deflate stream is damaged: {e}"))?;
    let written = inflater.total_out() as usize;
    if status != flate2::Status::StreamEnd || written != want {
        return Err(format!(
            "a chunk's deflate stream gives {}{written} bytes, not {want}",
            if status == flate2::Status::StreamEnd {
                ""
            } else {
                "more than "
            }
        ));
    }
    Ok(())
}

/// Decompresses the LZF block `input` into `output`, which must come to exactly `want` bytes
/// (h5py's filter compresses each chunk as one block).
pub(super) fn unlzf(
    input: &[u8],
    want: usize,
    output: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    sized_output(output, want)?;
    if input.is_empty() || want == 0 {
        return Err("a chunk's LZF block is empty".into());
    }
    let in_len = u32::try_from(input.len()).map_err(|_| "a chunk's LZF block is over 4 GiB")?;
    let out_len = u32::try_from(want).map_err(|_| "a chunk is over 4 GiB")?;
    // SAFETY: liblzf reads at most `in_len` bytes of `input` and writes at most `out_len`
    // bytes into `output` (its input and output checks are compiled in: CHECK_INPUT, and the
    // output bound is always checked), returning 0 when either would be exceeded.
    let written = unsafe {
        lzf_sys::lzf_decompress(
            input.as_ptr().cast(),
            in_len,
            output.as_mut_ptr().cast(),
            out_len,
        )
    };
    if written as usize != want {
        return Err(format!(
            "a chunk's LZF block is damaged (it gives {written} bytes, not {want})"
        ));
    }
    Ok(())
}

/// Undoes the shuffle filter: `input` holds byte 0 of every `size`-byte element, then byte 1
/// of every element, and so on; bytes past the last whole element are left as they are.
pub(super) fn unshuffle(input: &[u8], size: usize, output: &mut Vec<u8>) {
    output.clear();
    output.resize(input.len(), 0);
    let elements = input.len() / size;
    if size <= 1 || elements <= 1 {
        output.copy_from_slice(input);
        return;
    }
    for (byte, plane) in input[..elements * size].chunks_exact(elements).enumerate() {
        for (element, &value) in plane.iter().enumerate() {
            output[element * size + byte] = value;
        }
    }
    let whole = elements * size;
    output[whole..].copy_from_slice(&input[whole..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fletcher32_matches_the_reference_values() {
        // Fletcher-32 over big-endian 16-bit words, as HDF5 computes it, against the
        // definition: both sums modulo 65535. (The exact values libhdf5 writes are checked by
        // tests/integration/hdf5_filters.rs on h5py's files.)
        assert_eq!(fletcher32(b""), 0);
        let words = |s: &[u8]| {
            // The definition, computed directly.
            let (mut a, mut b) = (0u64, 0u64);
            for w in s.chunks(2) {
                let v = (u64::from(w[0]) << 8) | w.get(1).map_or(0, |&x| u64::from(x));
                a = (a + v) % 65535;
                b = (b + a) % 65535;
            }
            ((b << 16) | a) as u32
        };
        let long: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for data in [&b"abcde"[..], b"abcdef", b"\xff\xff\xff\xff\xff", &long] {
            let (ours, direct) = (fletcher32(data), words(data));
            // 0xffff and 0 are the same residue mod 65535; the folded sums may use either.
            let norm = |x: u32| [x & 0xffff, x >> 16].map(|h| if h == 0xffff { 0 } else { h });
            assert_eq!(norm(ours), norm(direct), "{data:?}");
        }
    }

    #[test]
    fn a_damaged_fletcher32_chunk_is_refused_and_a_good_one_stripped() {
        let mut data = b"pixels of a chunk".to_vec();
        let sum = fletcher32(&data);
        data.extend_from_slice(&sum.to_le_bytes());
        let mut good = data.clone();
        check_fletcher32(&mut good).unwrap();
        assert_eq!(good, b"pixels of a chunk");
        // The byte-swapped sum of old files is accepted too.
        let mut swapped = b"pixels of a chunk".to_vec();
        swapped.extend_from_slice(&sum.swap_bytes().to_le_bytes());
        check_fletcher32(&mut swapped).unwrap();
        data[3] ^= 1;
        assert!(check_fletcher32(&mut data).is_err());
        assert!(check_fletcher32(&mut vec![1, 2]).is_err());
    }

    #[test]
    fn unshuffle_regroups_bytes_and_keeps_a_tail() {
        // Three 4-byte elements, then 2 tail bytes.
        let elements = [[1u8, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]];
        let mut shuffled: Vec<u8> = (0..4)
            .flat_map(|b| elements.iter().map(move |e| e[b]))
            .collect();
        shuffled.extend([99, 98]);
        let mut out = Vec::new();
        unshuffle(&shuffled, 4, &mut out);
        assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 99, 98]);
    }

    #[test]
    fn inflate_and_unlzf_refuse_wrong_sizes_and_damage() {
        use std::io::Write as _;
        let data: Vec<u8> = (0..4000u32).map(|i| (i / 7) as u8).collect();
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&data).unwrap();
        let z = z.finish().unwrap();
        let mut out = Vec::new();
        inflate(&z, data.len(), &mut out).unwrap();
        assert_eq!(out, data);
        assert!(inflate(&z, data.len() - 1, &mut out).is_err());
        assert!(inflate(&z, data.len() + 1, &mut out).is_err());
        assert!(inflate(&z[..z.len() / 2], data.len(), &mut out).is_err());

        let mut packed = vec![0u8; data.len()];
        // SAFETY: both buffers are as long as the lengths given.
        let len = unsafe {
            lzf_sys::lzf_compress(
                data.as_ptr().cast(),
                data.len() as u32,
                packed.as_mut_ptr().cast(),
                packed.len() as u32,
            )
        } as usize;
        assert!(len > 0);
        unlzf(&packed[..len], data.len(), &mut out).unwrap();
        assert_eq!(out, data);
        assert!(unlzf(&packed[..len], data.len() - 1, &mut out).is_err());
        assert!(unlzf(&packed[..len / 2], data.len(), &mut out).is_err());
        // Every single-byte change of the block either decodes to the right size or is
        // refused; none reads or writes outside the buffers (run under the sanitizers of the
        // fuzz build as well).
        for at in 0..len {
            let mut damaged = packed[..len].to_vec();
            damaged[at] ^= 0xa5;
            let _ = unlzf(&damaged, data.len(), &mut out);
        }
    }
}
