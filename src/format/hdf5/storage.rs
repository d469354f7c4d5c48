//! Where a dataset's bytes lie and whether this build can read them: the filters its chunks
//! pass through (each checked to be one this build can undo), and the checks that a declared
//! size fits what the file or its storage can hold.

use std::path::Path;

use super::gate;
use crate::error::{Error, Result};

/// How much smaller than its data a filtered (compressed) dataset's storage can be: deflate's
/// limit is about 1032:1.
const MAX_COMPRESSION: u64 = 1100;

/// The filters (compression, checksums) a dataset's chunks pass through, each checked to be one
/// this build can undo: libhdf5's own (deflate, shuffle, fletcher32, scale-offset, n-bit, and
/// szip where the library was built with it), h5py's `lzf` and hdf5plugin's Blosc (registered
/// by the hdf5 crate's features), or a plugin libhdf5 loads from `HDF5_PLUGIN_PATH`. Any other
/// is [`Error::Unsupported`] naming the filter and the remedy, at open: otherwise every record
/// would read as a bad sample and the dataset would look like a short one.
pub(super) fn readable_filters(
    path: &Path,
    dataset: &hdf5::Dataset,
    name: &str,
) -> Result<Vec<hdf5::filters::Filter>> {
    let filters = dataset
        .dcpl()
        .and_then(|pipeline| pipeline.get_filters())
        .map_err(|e| gate::error(path, &format!("reading the filters of {name:?}"), e))?;
    for filter in &filters {
        if !filter.decode_enabled() {
            let id = filter.id();
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                what: format!(
                    "dataset {name:?}, stored through the {} filter (HDF5 filter {id}),",
                    filter_name(id)
                ),
                remedy: filter_remedy(id),
            });
        }
    }
    Ok(filters)
}

/// The name people know an HDF5 filter by (the registered ids of libhdf5 and the HDF Group's
/// list of plugins).
fn filter_name(id: i32) -> &'static str {
    match id {
        1 => "deflate (gzip)",
        2 => "shuffle",
        3 => "fletcher32",
        4 => "szip",
        5 => "n-bit",
        6 => "scale-offset",
        32000 => "lzf",
        32001 => "blosc",
        32004 => "lz4",
        32008 => "bitshuffle",
        32013 => "zfp",
        32015 => "zstd",
        32017 => "sz",
        32026 => "blosc2",
        _ => "unknown",
    }
}

/// What to do about a filter this build cannot undo.
fn filter_remedy(id: i32) -> String {
    let rewrite = "or rewrite the file without it (h5py: compression=\"gzip\" or \"lzf\")";
    match id {
        4 => format!(
            "this libhdf5 was built without szip (libaec); use one built with it, {rewrite}"
        ),
        1..=6 => format!("this libhdf5 lacks the filter; {rewrite}"),
        _ => match std::env::var_os("HDF5_PLUGIN_PATH").filter(|p| !p.is_empty()) {
            Some(set) => format!(
                "this build has no decoder for it, and no plugin in HDF5_PLUGIN_PATH ({}) \
                 provides one; point it at a directory that does (hdf5plugin's: python -c \
                 \"import hdf5plugin; print(hdf5plugin.PLUGIN_PATH)\"), {rewrite}",
                set.to_string_lossy()
            ),
            None => format!(
                "this build has no decoder for it; install the plugin (pip install hdf5plugin) \
                 and set HDF5_PLUGIN_PATH to its directory (python -c \"import hdf5plugin; \
                 print(hdf5plugin.PLUGIN_PATH)\"), {rewrite}"
            ),
        },
    }
}

/// The largest chunk libhdf5 writes: 4 GiB.
const MAX_CHUNK_BYTES: u64 = 1 << 32;

/// Refuses a chunked dataset whose chunk shape libhdf5 itself would never have written: a
/// dimension of 0, one larger than the dataset's fixed maximum there, or a chunk over 4 GiB.
/// libhdf5 1.10 trusts the shape it finds when it reads a chunk, and a damaged one (one byte of
/// a dimension) made it copy past its buffers (SIGSEGV), in whatever order records were read.
fn check_chunk_shape(path: &Path, dataset: &hdf5::Dataset, name: &str, element: u64) -> Result<()> {
    let Some(chunk) = dataset.chunk() else {
        return Ok(());
    };
    let maxdims = dataset
        .space()
        .map(|space| space.maxdims())
        .map_err(|e| gate::error(path, &format!("reading the dataspace of {name:?}"), e))?;
    let bytes = chunk
        .iter()
        .try_fold(element, |n, &d| n.checked_mul(d as u64));
    let fits = chunk.len() == maxdims.len()
        && chunk
            .iter()
            .zip(&maxdims)
            .all(|(&c, max)| c >= 1 && max.is_none_or(|max| c <= max.max(1)));
    if !fits || bytes.is_none_or(|b| b > MAX_CHUNK_BYTES) {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "dataset {name:?} is stored in chunks of shape {chunk:?}, which its dimensions \
                 (at most {maxdims:?}) and libhdf5's 4 GiB per chunk cannot have: its layout is \
                 damaged"
            ),
        ));
    }
    Ok(())
}

/// Refuses a dataset whose declared shape needs more bytes than the file can hold, before it is
/// read into memory: a hostile file can declare a shape of 10¹² elements with no storage behind
/// it, and reading it would allocate that much. Unfiltered data must fit in the file; filtered
/// data in what its allocated storage can decompress to. Returns the declared size in bytes.
pub(super) fn check_stored(
    path: &Path,
    dataset: &hdf5::Dataset,
    name: &str,
    file_len: u64,
) -> Result<u64> {
    refuse_data_elsewhere(path, dataset, name)?;
    let shape = dataset.shape();
    let element = dataset.dtype().map(|t| t.size()).unwrap_or(1).max(1) as u64;
    check_chunk_shape(path, dataset, name, element)?;
    let bytes = shape
        .iter()
        .try_fold(element, |n, &d| n.checked_mul(d as u64));
    let filtered = !readable_filters(path, dataset, name)?.is_empty();
    // Chunks never written take no room: an unfiltered chunked array with some (a writer that
    // stopped) declares more than its file holds, and was refused whole where its unwritten
    // rows are bad samples (a hostile try). Its bound is that of a filtered one.
    let chunked = dataset.is_chunked();
    let can_hold = if filtered {
        dataset.storage_size().saturating_mul(MAX_COMPRESSION)
    } else if chunked {
        file_len.max(dataset.storage_size().saturating_mul(MAX_COMPRESSION))
    } else {
        file_len
    };
    match bytes {
        Some(bytes) if bytes <= can_hold => Ok(bytes),
        _ => Err(Error::not_a_dataset(
            path,
            format!(
                "dataset {name:?} declares shape {shape:?} ({} bytes), more than the {} can hold \
                 ({can_hold} bytes)",
                bytes.map_or("over 2^64".to_string(), |b| b.to_string()),
                if filtered || chunked {
                    "storage allocated for it"
                } else {
                    "file"
                }
            ),
        )),
    }
}

/// Refuses a dataset whose bytes live outside the file: a virtual dataset (h5py's
/// `VirtualLayout`, data mapped from other files) or one with external storage (raw files named
/// in its header), as [`Error::Unsupported`] saying so. Read as a plain dataset, its declared
/// shape was measured against this file's size and it was refused as too large for it (a
/// hostile try), which named the wrong reason.
fn refuse_data_elsewhere(path: &Path, dataset: &hdf5::Dataset, name: &str) -> Result<()> {
    use hdf5::plist::dataset_create::Layout;
    let dcpl = dataset
        .dcpl()
        .map_err(|e| gate::error(path, &format!("reading the layout of {name:?}"), e))?;
    let remedy = "imagefeed reads a dataset's bytes from its own file only; copy the data into \
                  one file (h5py: `dst.create_dataset(name, data=src[name][()])`) and open that"
        .to_string();
    if !matches!(
        dcpl.layout(),
        Layout::Compact | Layout::Contiguous | Layout::Chunked
    ) {
        return Err(Error::Unsupported {
            path: path.to_path_buf(),
            what: format!(
                "dataset {name:?} is a virtual dataset (its data is mapped from other files),"
            ),
            remedy,
        });
    }
    let external = dcpl.external();
    if let Some(first) = external.first() {
        return Err(Error::Unsupported {
            path: path.to_path_buf(),
            what: format!(
                "dataset {name:?} keeps its data in {} external file(s) ({:?} first),",
                external.len(),
                first.name
            ),
            remedy,
        });
    }
    Ok(())
}

/// The file offset of a dataset's bytes, when they are one contiguous unfiltered run.
pub(super) fn contiguous_offset(dataset: &hdf5::Dataset, len: u64) -> Option<u64> {
    if dataset.is_chunked() || !dataset.filters().is_empty() {
        return None;
    }
    if len == 0 {
        return Some(0);
    }
    dataset.offset()
}

pub(super) fn check_inside_file(path: &Path, offset: u64, len: u64, file_len: u64) -> Result<()> {
    if offset.saturating_add(len) > file_len {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "truncated: the images data needs bytes {offset}..{} but the file has {file_len}",
                offset.saturating_add(len)
            ),
        ));
    }
    Ok(())
}
