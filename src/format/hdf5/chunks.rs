//! Chunked datasets read chunk by chunk with checked code: libhdf5 only finds a chunk in the
//! dataset's index and hands over its stored bytes (`H5Dread_chunk`); undoing the filters
//! (fletcher32, deflate, lzf, shuffle) and copying a sample out of its chunks happens here.
//!
//! libhdf5 trusts what a file says about its chunks when it reads them: a damaged chunk
//! dimension made it copy past its buffers (SIGSEGV, `make corrupt`), and only the records the
//! trial open reached were covered. Here every size is checked before it sizes an allocation or
//! a copy: the stored size against the file, each filter's output against the chunk's size, and
//! every copy against the chunk and the sample it fills. Damage becomes a bad sample naming the
//! record. The decompression also runs outside the process-wide HDF5 lock, so workers inflate
//! in parallel instead of taking turns.
//!
//! Filters other than those four (szip, n-bit, scale-offset, Blosc and plugins) are left to
//! the library, record by record, as before.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::time::Instant;

use hdf5_sys::h5::{HADDR_UNDEF, hsize_t};

use super::filters::{Filter, check_fletcher32, inflate, pipeline, unlzf, unshuffle};
use super::gate::{self, Gated};
use crate::error::{Error, Result};

/// How a dataset's chunks lie: the dataset's shape, the chunk shape, the element size, what
/// the chunks pass through and what unwritten storage reads as.
#[derive(Debug)]
pub(super) struct ChunkLayout {
    grid: ChunkGrid,
    element: usize,
    /// The filters in the order they were applied when writing.
    filters: Vec<Filter>,
    /// One element's fill value: what a chunk never written holds.
    fill: Vec<u8>,
    /// The file's size: no stored chunk is larger.
    file_len: u64,
}

/// The most dimensions of a dataset read here (`N×H×W×C` pixel arrays), so that chunk
/// coordinates live on the stack on the per-sample path.
const MAX_RANK: usize = 4;

/// A chunk's coordinates, in elements; the first `ChunkGrid::dims.len()` are used.
type Origin = [hsize_t; MAX_RANK];

/// What each chunk of a cached row costs beyond its bytes: its slot in the row.
const SLOT_BYTES: usize = std::mem::size_of::<Option<Vec<u8>>>();

/// How much larger than its stored bytes a chunk can decompress to: deflate's limit is about
/// 1032:1, LZF's far lower.
const MAX_RATIO: usize = 1100;

impl ChunkLayout {
    /// The chunk layout of `dataset` when its chunks can be read here: chunked, every filter
    /// one of ours. `None` when the library must read it (contiguous, compact, or a filter of
    /// its own). The chunk shape must already have been checked (`storage::check_stored`).
    /// `fill` is one element's fill value. Runs inside the HDF5 gate.
    pub(super) fn of(
        path: &Path,
        dataset: &hdf5::Dataset,
        name: &str,
        element: usize,
        fill: Vec<u8>,
        file_len: u64,
    ) -> Result<Option<ChunkLayout>> {
        let Some(grid) = ChunkGrid::of(dataset) else {
            return Ok(None);
        };
        if fill.len() != element {
            return Ok(None);
        }
        let dcpl = dataset
            .dcpl()
            .map_err(|e| gate::error(path, &format!("reading the filters of {name:?}"), e))?;
        let Some(filters) = pipeline(dcpl.id()) else {
            return Ok(None);
        };
        let chunks = grid
            .dims
            .iter()
            .zip(&grid.chunk)
            .try_fold(1usize, |n, (&d, &c)| n.checked_mul(d.div_ceil(c)));
        if filters.is_empty() && chunks.is_none_or(|n| n > MAX_UNFILTERED_CHUNKS) {
            return Ok(None);
        }
        Ok(Some(ChunkLayout {
            grid,
            element,
            filters,
            fill,
            file_len,
        }))
    }

    /// The bytes of one decoded chunk (checked at open to be at most 4 GiB).
    fn chunk_bytes(&self) -> usize {
        self.grid.chunk.iter().product::<usize>() * self.element
    }

    /// The bytes of one element row: everything of one index along the first dimension.
    pub(super) fn row_bytes(&self) -> usize {
        self.grid.dims[1..].iter().product::<usize>() * self.element
    }

    /// How many chunks cover one element row.
    fn chunks_per_row(&self) -> usize {
        self.grid.chunks_per_row()
    }

    /// The origin, in elements, of chunk `number` (in row-major order) of the chunk row that
    /// starts at `first`.
    fn origin(&self, first: usize, number: usize) -> Origin {
        self.grid.origin(first, number)
    }

    /// Fills `out` with `len` bytes of the fill value: what a chunk never written holds.
    fn fill(&self, out: &mut Vec<u8>, len: usize) {
        out.extend(self.fill.iter().copied().cycle().take(len));
    }

    /// Undoes the filters on a chunk's `stored` bytes (`skipped`: the filters the writer left
    /// out for this chunk, one bit each), leaving the chunk's decoded bytes in `stored`.
    fn decode(
        &self,
        stored: &mut Vec<u8>,
        skipped: u32,
        scratch: &mut Vec<u8>,
    ) -> std::result::Result<(), String> {
        let want = self.chunk_bytes();
        for (position, filter) in self.filters.iter().enumerate().rev() {
            if position < 32 && skipped & (1 << position) != 0 {
                continue;
            }
            match *filter {
                Filter::Fletcher32 => check_fletcher32(stored)?,
                Filter::Deflate | Filter::Lzf if stored.len().saturating_mul(MAX_RATIO) < want => {
                    // No allocation of the declared size for a few stored bytes.
                    return Err(format!(
                        "a chunk of {} stored bytes cannot decompress to the {want} of its shape",
                        stored.len()
                    ));
                }
                Filter::Deflate => {
                    inflate(stored, want, scratch)?;
                    std::mem::swap(stored, scratch);
                }
                Filter::Lzf => {
                    unlzf(stored, want, scratch)?;
                    std::mem::swap(stored, scratch);
                }
                Filter::Shuffle { size } => {
                    unshuffle(stored, size, scratch);
                    std::mem::swap(stored, scratch);
                }
            }
        }
        if stored.len() != want {
            return Err(format!(
                "a chunk decodes to {} bytes, not the {want} of its shape {:?}",
                stored.len(),
                self.grid.chunk
            ));
        }
        Ok(())
    }
}

/// How a chunked dataset's chunks lie: its shape and the chunk shape. Part of a
/// [`ChunkLayout`]; alone, for a pixel array libhdf5 reads itself (a filter of its own, or too
/// many unfiltered chunks for [`ChunkLayout`]), enough to ask its index, before a sample is
/// read, whether the chunks holding it were ever stored. libhdf5 reads the fill value where
/// they were not, which for an image array is an unfinished write, not black images.
#[derive(Debug)]
pub(super) struct ChunkGrid {
    dims: Vec<usize>,
    chunk: Vec<usize>,
}

impl ChunkGrid {
    /// The grid of `dataset`; `None` when it is not chunked in a shape read here.
    pub(super) fn of(dataset: &hdf5::Dataset) -> Option<ChunkGrid> {
        let chunk = dataset.chunk()?;
        let dims = dataset.shape();
        let usable = chunk.len() == dims.len()
            && !dims.is_empty()
            && dims.len() <= MAX_RANK
            && chunk.iter().all(|&c| c > 0);
        usable.then_some(ChunkGrid { dims, chunk })
    }

    /// How many chunks cover one element row.
    fn chunks_per_row(&self) -> usize {
        self.dims[1..]
            .iter()
            .zip(&self.chunk[1..])
            .map(|(&d, &c)| d.div_ceil(c))
            .product()
    }

    /// The origin, in elements, of chunk `number` (in row-major order) of the chunk row that
    /// starts at `first`.
    fn origin(&self, first: usize, number: usize) -> Origin {
        let mut origin = [0; MAX_RANK];
        origin[0] = first as hsize_t;
        let mut rest = number;
        for d in (1..self.dims.len()).rev() {
            let across = self.dims[d].div_ceil(self.chunk[d]);
            origin[d] = ((rest % across) * self.chunk[d]) as hsize_t;
            rest /= across;
        }
        origin
    }

    /// `Ok` when every chunk holding element row `index` is stored; otherwise why the row is
    /// not to be read. One index lookup per chunk of the row (`H5Dget_chunk_storage_size`,
    /// which fails, or gives 0 bytes, for a chunk never written). Runs inside the gate.
    pub(super) fn check_row_stored(
        &self,
        dataset: &hdf5::Dataset,
        index: usize,
    ) -> std::result::Result<(), String> {
        debug_assert!(gate::held());
        let first = index - index % self.chunk[0];
        for number in 0..self.chunks_per_row() {
            let origin = self.origin(first, number);
            let mut size: hsize_t = 0;
            // SAFETY: the dataset id is valid while `dataset` lives; `origin` has a coordinate
            // for each of its dimensions; `size` is a valid out-pointer.
            let status =
                unsafe { H5Dget_chunk_storage_size(dataset.id(), origin.as_ptr(), &mut size) };
            if status < 0 || size == 0 {
                return Err(format!(
                    "its pixels lie in a chunk of the array the file's writer never stored (at \
                     {:?}: an unfinished write?); h5py would read the fill value",
                    &origin[..self.dims.len()]
                ));
            }
        }
        Ok(())
    }
}

unsafe extern "C" {
    /// The stored size of the chunk at `offset` (libhdf5 1.10.2 on; `hdf5-sys` does not bind
    /// it). Links to the libhdf5 `hdf5-sys` links.
    fn H5Dget_chunk_storage_size(
        dset_id: hdf5_sys::h5i::hid_t,
        offset: *const hsize_t,
        chunk_bytes: *mut hsize_t,
    ) -> hdf5_sys::h5::herr_t;
}

/// The index entry of the chunk at `origin`: its file address (`None`: never written) and
/// stored size. Walks the whole index in libhdf5 1.10 (see [`MAX_UNFILTERED_CHUNKS`]).
fn index_entry(
    dataset: &hdf5::Dataset,
    origin: &[hsize_t],
) -> std::result::Result<(Option<u64>, u64), String> {
    let (mut mask, mut address, mut bytes) = (0, 0, 0);
    // SAFETY: the dataset id is valid while `dataset` lives; `origin` has one coordinate per
    // dimension; the out-pointers are valid.
    let found = unsafe {
        hdf5_sys::h5d::H5Dget_chunk_info_by_coord(
            dataset.id(),
            origin.as_ptr(),
            &mut mask,
            &mut address,
            &mut bytes,
        )
    };
    if found < 0 {
        return Err(format!(
            "libhdf5 could not find the chunk at {origin:?} in the dataset's index"
        ));
    }
    Ok(((address != HADDR_UNDEF).then_some(address), bytes))
}

/// The most chunks an unfiltered chunked dataset may have to be read here: each chunk's size
/// is then taken from its own index entry, which libhdf5 1.10 finds by walking the whole index
/// (time growing with the square of the chunk count); larger ones are read through the library.
const MAX_UNFILTERED_CHUNKS: usize = 4096;

/// Reads the stored bytes of the chunk at `origin` into `stored`, returning the filters the
/// writer skipped for it, or `None` when the chunk was never written. Runs inside the gate.
///
/// The buffer must hold what `H5Dread_chunk` writes, which is the size in the chunk's index
/// entry. For a filtered dataset `H5Dget_chunk_storage_size` reports that size; for an
/// unfiltered one it reports the chunk's nominal size whatever the entry says (a damaged entry
/// of 196 bytes for a 96-byte chunk made libhdf5 1.10 write past a 96-byte buffer), so there the
/// entry itself is read and must hold exactly the nominal size.
fn read_stored(
    dataset: &hdf5::Dataset,
    origin: &Origin,
    layout: &ChunkLayout,
    stored: &mut Vec<u8>,
) -> std::result::Result<Option<u32>, String> {
    debug_assert!(gate::held());
    let origin = &origin[..layout.grid.dims.len()];
    let file_len = layout.file_len;
    let size = if layout.filters.is_empty() {
        let (address, size) = index_entry(dataset, origin)?;
        let Some(address) = address else {
            return Ok(None);
        };
        let want = layout.chunk_bytes() as u64;
        if size != want {
            return Err(format!(
                "the index gives the unfiltered chunk at {origin:?} {size} bytes, not the {want} \
                 of its shape"
            ));
        }
        if address.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(format!(
                "the chunk at {origin:?} lies at bytes {address}..+{size}, past the end of the \
                 {file_len}-byte file"
            ));
        }
        size
    } else {
        let mut size: hsize_t = 0;
        // SAFETY: as in `index_entry`; `size` is a valid out-pointer.
        let status = unsafe { H5Dget_chunk_storage_size(dataset.id(), origin.as_ptr(), &mut size) };
        if status < 0 || size == 0 {
            // libhdf5 1.10 fails for a chunk never written: ask the index whether it holds one.
            return match index_entry(dataset, origin)? {
                (None, _) => Ok(None),
                (Some(_), _) => Err(format!(
                    "libhdf5 could not find the chunk at {origin:?} in the dataset's index"
                )),
            };
        }
        if size > file_len {
            return Err(format!(
                "the index says the chunk at {origin:?} holds {size} bytes, more than the \
                 {file_len}-byte file"
            ));
        }
        size
    };
    let size = size as usize;
    stored.clear();
    stored
        .try_reserve_exact(size)
        .map_err(|_| format!("no memory for a {size}-byte chunk"))?;
    stored.resize(size, 0);
    let mut skipped = 0u32;
    // SAFETY: `stored` holds the `size` bytes the chunk's index entry gives (read from the
    // entry itself for an unfiltered dataset, see above), which is what libhdf5 writes; the
    // other pointers are valid.
    #[cfg(not(hdf5_read_chunk2))]
    let status = unsafe {
        hdf5_sys::h5d::H5Dread_chunk1(
            dataset.id(),
            hdf5_sys::h5p::H5P_DEFAULT,
            origin.as_ptr(),
            &mut skipped,
            stored.as_mut_ptr().cast(),
        )
    };
    // libhdf5 2 takes the buffer's size and reports the chunk's: a chunk of another size is not
    // read (and must not pass as the zeros left in the buffer).
    #[cfg(hdf5_read_chunk2)]
    let mut capacity = size;
    // SAFETY: as above; libhdf5 writes at most `capacity` bytes.
    #[cfg(hdf5_read_chunk2)]
    let status = unsafe {
        hdf5_sys::h5d::H5Dread_chunk2(
            dataset.id(),
            hdf5_sys::h5p::H5P_DEFAULT,
            origin.as_ptr(),
            &mut skipped,
            stored.as_mut_ptr().cast(),
            &mut capacity,
        )
    };
    if status < 0 {
        return Err(format!("libhdf5 could not read the chunk at {origin:?}"));
    }
    #[cfg(hdf5_read_chunk2)]
    if capacity != size {
        return Err(format!(
            "libhdf5 gives the chunk at {origin:?} {capacity} bytes where its index gave {size}"
        ));
    }
    Ok(Some(skipped))
}

/// Looks up every chunk of the dataset in its index, as reading would, until `deadline`: run
/// in the trial child (`probe`), so that a damaged index crashes or stalls the trial, refusing
/// the file, rather than a worker mid-epoch (the lookups of a read walk the same nodes).
/// Errors are ignored: reads meet them again as bad samples. Runs inside the gate.
pub(super) fn walk_index(layout: &ChunkLayout, dataset: &hdf5::Dataset, deadline: Instant) {
    let per_row = layout.chunks_per_row();
    for first in (0..layout.grid.dims[0]).step_by(layout.grid.chunk[0]) {
        for number in 0..per_row {
            let origin = layout.origin(first, number);
            let mut size: hsize_t = 0;
            // SAFETY: as in `read_stored`.
            unsafe { H5Dget_chunk_storage_size(dataset.id(), origin.as_ptr(), &mut size) };
            // The clock every 4,096 lookups: a row of millions of tiny chunks stops in time.
            if number % 4096 == 4095 && Instant::now() > deadline {
                return;
            }
        }
        if Instant::now() > deadline {
            return;
        }
    }
}

/// A worker's reader of one chunked dataset: keeps the decoded chunks of the chunk rows it read
/// last (a chunk row holds the chunks of indices `first..first + chunk[0]`), up to
/// [`cache_budget`] bytes, so that indices sharing a chunk row (h5py's default chunks hold
/// hundreds of samples) decode it once while it stays in the cache, in any order. The oldest
/// row goes first.
pub(super) struct ChunkReader {
    /// Each cached row's decoded chunks, by its first index, in row-major order (`None`: not
    /// read yet).
    rows: HashMap<usize, Vec<Option<Vec<u8>>>>,
    /// The cached rows' first indices, oldest first.
    order: VecDeque<usize>,
    /// Bytes of decoded chunks in `rows`.
    held: usize,
    budget: usize,
    stored: Vec<u8>,
    scratch: Vec<u8>,
}

/// The bytes of decoded chunks each reader keeps: `IMAGEFEED_HDF5_CHUNK_CACHE_MIB`, default 64
/// (the CIFAR-10 test set as h5py's gzip array decodes to 31 MB: all of it). libhdf5's own
/// chunk cache is 1 MiB per dataset, too little for one of h5py's default chunk rows.
///
/// # Errors
/// A value that is not a number of MiB: checked at each open ([`super::probe`]); a reader made
/// later takes the default for it.
pub(super) fn cache_budget() -> crate::error::Result<usize> {
    Ok(
        super::probe::env_number::<usize>("IMAGEFEED_HDF5_CHUNK_CACHE_MIB")?
            .unwrap_or(64)
            .saturating_mul(1 << 20),
    )
}

impl ChunkReader {
    pub(super) fn new() -> ChunkReader {
        ChunkReader::with_budget(cache_budget().unwrap_or(64 << 20))
    }

    fn with_budget(budget: usize) -> ChunkReader {
        ChunkReader {
            rows: HashMap::new(),
            order: VecDeque::new(),
            held: 0,
            budget,
            stored: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Makes room for the chunk row starting at `first` (`row_bytes` when all of it is
    /// decoded) unless it is cached already, evicting the oldest rows.
    fn use_row(&mut self, first: usize, per_row: usize, row_bytes: usize) {
        if self.rows.contains_key(&first) {
            return;
        }
        while self.held + row_bytes > self.budget {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            let evicted = self.rows.remove(&oldest).expect("ordered rows are cached");
            self.held -= evicted.len() * SLOT_BYTES;
            self.held -= evicted.iter().flatten().map(Vec::len).sum::<usize>();
        }
        let mut chunks = Vec::with_capacity(per_row);
        chunks.resize_with(per_row, || None);
        self.held += per_row * SLOT_BYTES;
        self.rows.insert(first, chunks);
        self.order.push_back(first);
    }

    /// Reads element row `index` (every element of that index along the first dimension)
    /// into `out`, reading through `dataset` (the library's handle, used inside the gate).
    pub(super) fn read_row(
        &mut self,
        layout: &ChunkLayout,
        dataset: &Gated<hdf5::Dataset>,
        index: usize,
        out: &mut Vec<u8>,
    ) -> std::result::Result<(), String> {
        let first = index - index % layout.grid.chunk[0];
        let per_row = layout.chunks_per_row();
        // What a cached row costs: its decoded chunks and a slot for each (tiny chunks make the
        // slots the larger part).
        let row_bytes = per_row.saturating_mul(layout.chunk_bytes().saturating_add(SLOT_BYTES));
        // A row larger than the whole cache is decoded chunk by chunk and kept in none.
        let keep = row_bytes <= self.budget;
        if keep {
            self.use_row(first, per_row, row_bytes);
        }
        out.clear();
        out.try_reserve_exact(layout.row_bytes())
            .map_err(|_| format!("no memory for a {}-byte sample", layout.row_bytes()))?;
        out.resize(layout.row_bytes(), 0);
        for number in 0..per_row {
            let origin = layout.origin(first, number);
            let mut row = if keep {
                self.rows.get_mut(&first)
            } else {
                None
            };
            if row.as_ref().is_none_or(|row| row[number].is_none()) {
                let skipped =
                    dataset.with(|d| read_stored(d, &origin, layout, &mut self.stored))?;
                match skipped {
                    Some(skipped) => layout.decode(&mut self.stored, skipped, &mut self.scratch)?,
                    // h5py reads the fill value there (black images), but an image array
                    // with chunks never written is one whose writer stopped early (it made
                    // the array at its full size, then died filling it): a bad sample, never
                    // a black image with a label. (A hostile try found 188 of 300 so.)
                    None => {
                        return Err(format!(
                            "its pixels lie in a chunk of the array the file's writer never \
                             stored (at element {first}: an unfinished write?); h5py would \
                             read the fill value"
                        ));
                    }
                }
                if let Some(row) = row.as_mut() {
                    self.held += self.stored.len();
                    row[number] = Some(std::mem::take(&mut self.stored));
                }
            }
            let chunk = match row {
                Some(row) => row[number].as_deref().expect("decoded above"),
                None => &self.stored,
            };
            copy_part(layout, chunk, index - first, &origin, out);
        }
        Ok(())
    }
}

/// Copies the part of element row `plane` of a decoded chunk whose coordinates start at
/// `origin` (the first, the chunk row's, is not used) into `out`, the whole element row.
fn copy_part(layout: &ChunkLayout, chunk: &[u8], plane: usize, origin: &Origin, out: &mut [u8]) {
    let dims = &layout.grid.dims[1..];
    let shape = &layout.grid.chunk[1..];
    let element = layout.element;
    let rank = dims.len();
    // How far the chunk reaches into the dataset along each dimension (edge chunks reach
    // past it: their extra elements are not the dataset's).
    let (mut start, mut extent) = ([0usize; MAX_RANK], [0usize; MAX_RANK]);
    for d in 0..rank {
        start[d] = origin[d + 1] as usize;
        extent[d] = shape[d].min(dims[d] - start[d]);
    }
    // Copies run along the last dimension; the others are walked like an odometer.
    let (run, outer) = match rank {
        0 => (1, 0),
        rank => (extent[rank - 1], rank - 1),
    };
    let mut position = [0usize; MAX_RANK];
    loop {
        let (mut from, mut to) = (plane, 0);
        for d in 0..rank {
            let at = if d < outer { position[d] } else { 0 };
            from = from * shape[d] + at;
            to = to * dims[d] + start[d] + at;
        }
        out[to * element..(to + run) * element]
            .copy_from_slice(&chunk[from * element..(from + run) * element]);
        let mut d = outer;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            position[d] += 1;
            if position[d] < extent[d] {
                break;
            }
            position[d] = 0;
        }
    }
}

/// Every element of a chunked one-dimensional dataset, read chunk by chunk (h5py's
/// variable-length descriptors). Runs inside the gate.
pub(super) fn read_all(
    path: &Path,
    name: &str,
    layout: &ChunkLayout,
    dataset: &hdf5::Dataset,
) -> Result<Vec<u8>> {
    debug_assert_eq!(layout.grid.dims.len(), 1);
    let n = layout.grid.dims[0];
    let damaged = |reason: String| Error::not_a_dataset(path, format!("{name:?}: {reason}"));
    let mut all = Vec::new();
    all.try_reserve_exact(n * layout.element)
        .map_err(|_| damaged(format!("no memory for {n} element descriptors")))?;
    let (mut stored, mut scratch) = (Vec::new(), Vec::new());
    for first in (0..n).step_by(layout.grid.chunk[0]) {
        let origin = layout.origin(first, 0);
        let count = layout.grid.chunk[0].min(n - first);
        match read_stored(dataset, &origin, layout, &mut stored).map_err(damaged)? {
            Some(skipped) => {
                layout
                    .decode(&mut stored, skipped, &mut scratch)
                    .map_err(|reason| damaged(format!("the chunk at element {first}: {reason}")))?;
                all.extend_from_slice(&stored[..count * layout.element]);
            }
            None => layout.fill(&mut all, count * layout.element),
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dims: &[usize], chunk: &[usize], filters: Vec<Filter>) -> ChunkLayout {
        ChunkLayout {
            grid: ChunkGrid {
                dims: dims.to_vec(),
                chunk: chunk.to_vec(),
            },
            element: 1,
            filters,
            fill: vec![0],
            file_len: u64::MAX,
        }
    }

    #[test]
    fn rows_are_assembled_from_chunks_that_split_every_dimension() {
        // A 5x5x4x3 array in chunks of 2x2x3x2: edge chunks reach past every dimension.
        let dims = [5, 5, 4, 3];
        let shape = [2, 2, 3, 2];
        let value = |i: usize, y: usize, x: usize, c: usize| (i * 60 + y * 12 + x * 3 + c) as u8;
        let l = layout(&dims, &shape, Vec::new());
        assert_eq!(l.chunks_per_row(), 3 * 2 * 2);
        for index in 0..dims[0] {
            let first = index - index % shape[0];
            let mut out = vec![0u8; l.row_bytes()];
            for number in 0..l.chunks_per_row() {
                let origin = l.origin(first, number);
                let o: Vec<usize> = origin.iter().map(|&v| v as usize).collect();
                // The chunk as libhdf5 stores it: full size, padding past the edges.
                let mut chunk = vec![0xeeu8; l.chunk_bytes()];
                for (k, byte) in chunk.iter_mut().enumerate() {
                    let c = k % shape[3];
                    let x = k / shape[3] % shape[2];
                    let y = k / (shape[3] * shape[2]) % shape[1];
                    let i = k / (shape[3] * shape[2] * shape[1]);
                    let (i, y, x, c) = (o[0] + i, o[1] + y, o[2] + x, o[3] + c);
                    if i < dims[0] && y < dims[1] && x < dims[2] && c < dims[3] {
                        *byte = value(i, y, x, c);
                    }
                }
                copy_part(&l, &chunk, index - first, &origin, &mut out);
            }
            let want: Vec<u8> = (0..dims[1])
                .flat_map(|y| {
                    (0..dims[2]).flat_map(move |x| (0..dims[3]).map(move |c| value(index, y, x, c)))
                })
                .collect();
            assert_eq!(out, want, "row {index}");
        }
    }

    #[test]
    fn the_row_cache_keeps_the_rows_read_last_within_its_budget() {
        // Rows of two 50-byte chunks and their two slots: three fit.
        let slot = SLOT_BYTES;
        let row = 100 + 2 * slot;
        let mut reader = ChunkReader::with_budget(3 * row);
        let fill = |reader: &mut ChunkReader, first: usize| {
            reader
                .rows
                .insert(first, vec![Some(vec![0; 50]), Some(vec![0; 50])]);
            reader.held += 100;
        };
        for first in [0, 10, 20] {
            reader.use_row(first, 2, row);
            fill(&mut reader, first);
        }
        assert_eq!(reader.held, 3 * row);
        // A row cached already keeps its chunks.
        reader.use_row(10, 2, row);
        assert!(reader.rows[&10].iter().all(Option::is_some));
        assert_eq!(reader.order, [0, 10, 20]);
        // A new row evicts the oldest to make room, slots included.
        reader.use_row(30, 2, row);
        assert_eq!(reader.order, [10, 20, 30]);
        assert!(!reader.rows.contains_key(&0));
        assert_eq!(reader.held, 2 * row + 2 * slot);
        assert!(reader.rows[&30].iter().all(Option::is_none));
    }

    #[test]
    fn skipped_filters_are_not_undone() {
        // A chunk the writer could not compress (LZF is optional: the chunk is stored as is,
        // its bit set in the mask) reads as stored.
        let l = layout(&[4, 3], &[2, 3], vec![Filter::Lzf]);
        let mut stored = vec![1, 2, 3, 4, 5, 6];
        l.decode(&mut stored, 1, &mut Vec::new()).unwrap();
        assert_eq!(stored, [1, 2, 3, 4, 5, 6]);
        // Not skipped: the same bytes are no LZF block of 6 bytes.
        let mut stored = vec![1, 2, 3, 4, 5, 6];
        assert!(l.decode(&mut stored, 0, &mut Vec::new()).is_err());
        // Too few stored bytes for the chunk's size: refused before anything is allocated.
        let mut big = layout(&[4, 1 << 20], &[1, 1 << 20], vec![Filter::Deflate]);
        big.file_len = 1 << 30;
        let mut scratch = Vec::new();
        assert!(
            big.decode(&mut vec![0x78, 0x9c, 0, 0], 0, &mut scratch)
                .is_err()
        );
        assert_eq!(scratch.capacity(), 0);
        // No filter, wrong size: refused.
        let plain = layout(&[4, 3], &[2, 3], Vec::new());
        assert!(plain.decode(&mut vec![0; 5], 0, &mut Vec::new()).is_err());
    }
}
