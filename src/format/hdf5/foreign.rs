//! The layouts h5py users already have (see the parent module): encoded images in a
//! variable-length `uint8` dataset, whose element descriptors are read here for `heap`, and
//! fixed-shape pixel arrays; labels of any integer type; class names from a `classes` attribute.

use std::fs;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use hdf5::types::{TypeDescriptor, VarLenUnicode};

use super::CLASSES_ATTR;
use super::Hdf5Names;
use super::gate;
use super::heap::{self, HeapId};
use super::reader::{Layout, Shared, checked_str};
use super::storage::{check_inside_file, check_stored, contiguous_offset, readable_filters};
use crate::dataset::{DatasetInfo, FormatKind, PayloadKind};
use crate::error::{Error, IoContext as _, Result};

pub(super) fn open_foreign(
    path: &Path,
    file: &hdf5::File,
    names: &Hdf5Names,
    plain: Option<&fs::File>,
    file_len: u64,
) -> Result<Shared> {
    let h5 = |doing: String| move |e: hdf5::Error| gate::error(path, &doing, e);
    let members = file.member_names().unwrap_or_default();
    let missing = |name: &str| {
        Error::not_a_dataset(
            path,
            format!(
                "HDF5 file without imagefeed's layout and without a dataset {name:?} (it has {}); \
                 name the images and labels datasets",
                if members.is_empty() {
                    "no datasets".to_string()
                } else {
                    members.join(", ")
                }
            ),
        )
    };
    if !file.link_exists(&names.images) {
        return Err(missing(&names.images));
    }
    if !file.link_exists(&names.labels) {
        return Err(missing(&names.labels));
    }
    let images = file
        .dataset(&names.images)
        .map_err(h5(format!("opening {:?}", names.images)))?;
    let labels_ds = file
        .dataset(&names.labels)
        .map_err(h5(format!("opening {:?}", names.labels)))?;
    let label_type = labels_ds
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(h5(format!("reading the type of {:?}", names.labels)))?;
    if !matches!(
        label_type,
        TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_)
    ) {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{:?} holds {label_type} values; labels must be integers (class indices), and \
                 non-integer ones would be cut silently",
                names.labels
            ),
        ));
    }
    check_stored(path, &labels_ds, &names.labels, file_len)?;
    check_stored(path, &images, &names.images, file_len)?;
    let labels: Vec<i64> = labels_ds
        .read_raw()
        .map_err(h5(format!("reading {:?} as integers", names.labels)))?;
    let shape = images.shape();
    let n = shape.first().copied().unwrap_or(0);
    if labels.len() != n {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{:?} has {n} images but {:?} has {} labels",
                names.images,
                names.labels,
                labels.len()
            ),
        ));
    }
    let dtype = images
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(h5(format!("reading the type of {:?}", names.images)))?;
    let (layout, payload) = match (&dtype, shape.len()) {
        (TypeDescriptor::VarLenArray(inner), 1)
            if **inner == TypeDescriptor::Unsigned(hdf5::types::IntSize::U1) =>
        {
            (
                var_len_layout(path, &images, &names.images, n, plain, file_len)?,
                PayloadKind::Encoded,
            )
        }
        (TypeDescriptor::Unsigned(hdf5::types::IntSize::U1), 3 | 4) => {
            let (height, width) = (shape[1], shape[2]);
            let channels = shape.get(3).copied().unwrap_or(1);
            if !matches!(channels, 1 | 3 | 4) {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "{:?} has {channels} channels; pixel arrays need 1, 3 or 4",
                        names.images
                    ),
                ));
            }
            let pixels = (height as u64).saturating_mul(width as u64);
            if pixels == 0 || pixels > crate::decode::DEFAULT_MAX_PIXELS {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "{:?} holds {height}x{width} images; each must have 1..={} pixels",
                        names.images,
                        crate::decode::DEFAULT_MAX_PIXELS
                    ),
                ));
            }
            // Fits in u64: check_stored accepted the whole array's size.
            let len = n as u64 * pixels * channels as u64;
            let file_offset = contiguous_offset(&images, len);
            if let Some(offset) = file_offset {
                check_inside_file(path, offset, len, file_len)?;
            }
            (
                Layout::Pixels {
                    images: names.images.clone(),
                    rank: shape.len(),
                    height,
                    width,
                    channels,
                    file_offset,
                },
                PayloadKind::RawRgb8,
            )
        }
        _ => {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "{:?} is {dtype} with shape {shape:?}; expected variable-length uint8 \
                     (encoded images) or an N×H×W×C uint8 array",
                    names.images
                ),
            ));
        }
    };
    let mut notices = Vec::new();
    let classes = match class_names(file, file_len).or_else(|| class_names(&labels_ds, file_len)) {
        Some(classes) => classes,
        None => {
            let mut inference = crate::dataset::ClassInference::default();
            for (index, &label) in labels.iter().enumerate() {
                inference.see(|| format!("{}[{index}]", names.labels), Some(label));
            }
            let (classes, notice) = inference.classes();
            notices.extend(notice);
            classes
        }
    };
    Ok(Shared {
        path: path.to_path_buf(),
        info: DatasetInfo {
            format: FormatKind::Hdf5,
            classes,
            num_samples: n,
            payload,
            resized_short_side: None,
            part: None,
            rejected_at_pack: None,
        },
        labels,
        layout,
        notices,
        opened: None,
        identity: None,
    })
}

/// How h5py's variable-length images are read: each element's descriptor (its global heap ID)
/// is read here, from where the library says the dataset's raw data lies, so that records are
/// read with `pread` (`heap`) and never through the library. Descriptors stored through a
/// filter are read through the library instead. In the trial child (`plain` is `None`) only the
/// library's part runs.
fn var_len_layout(
    path: &Path,
    images: &hdf5::Dataset,
    name: &str,
    n: usize,
    plain: Option<&fs::File>,
    file_len: u64,
) -> Result<Layout> {
    let through_library = Layout::VarLenThroughLibrary {
        images: name.to_string(),
    };
    let Some(runs) = descriptor_runs(path, images, name, n)? else {
        return Ok(through_library);
    };
    let Some(plain) = plain else {
        return Ok(through_library);
    };
    let mut head = [0u8; 48];
    let got = plain.read_at(&mut head, 0).at(path)?;
    let widths = heap::superblock_widths(&head[..got])
        .map_err(|reason| Error::not_a_dataset(path, reason))?;
    let size = widths.descriptor() as u64;
    let mut ids = Vec::with_capacity(n);
    let mut bytes = Vec::new();
    for run in runs {
        let Some(address) = run.address else {
            // Storage never written: the elements are empty, as the library reads them.
            ids.extend(std::iter::repeat_n(HeapId::EMPTY, run.count));
            continue;
        };
        let len = run.count as u64 * size;
        if run.stored.is_some_and(|stored| stored < len) {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "a chunk of {name:?} at byte {address} holds {} bytes, too few for its {} \
                     element descriptors",
                    run.stored.unwrap_or(0),
                    run.count
                ),
            ));
        }
        if address.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "{name:?}'s element descriptors lie at bytes {address}..+{len}, past the end \
                     of the {file_len}-byte file (truncated?)"
                ),
            ));
        }
        bytes.resize(len as usize, 0);
        plain.read_exact_at(&mut bytes, address).at(path)?;
        ids.extend(heap::parse_descriptors(&bytes, &widths));
    }
    debug_assert_eq!(ids.len(), n);
    Ok(Layout::VarLen {
        images: name.to_string(),
        widths,
        ids,
    })
}

/// `count` consecutive element descriptors at file offset `address` (`None`: never written),
/// in storage of `stored` bytes (`None`: as many as the file holds past `address`).
struct DescriptorRun {
    address: Option<u64>,
    count: usize,
    stored: Option<u64>,
}

/// The most chunks whose addresses are looked up one by one: libhdf5 1.10 walks the chunk
/// index for each lookup, so the time grows with the square of their number (64,000 chunks took
/// 26 s). A dataset of more chunks (h5py's `chunks=(1,)`, appended one element at a time) is
/// read through the library.
const MAX_CHUNK_LOOKUPS: usize = 4096;

/// Where the raw data of a one-dimensional variable-length dataset lies, in element order: one
/// run when it is contiguous, one per chunk when it is chunked; `None` when the library must
/// read it: stored through a filter (the bytes on disk are not the descriptors), compact (in the
/// object header), virtual or in external files, or in too many chunks.
fn descriptor_runs(
    path: &Path,
    dataset: &hdf5::Dataset,
    name: &str,
    n: usize,
) -> Result<Option<Vec<DescriptorRun>>> {
    if !readable_filters(path, dataset, name)?.is_empty() {
        return Ok(None);
    }
    if n == 0 {
        return Ok(Some(Vec::new()));
    }
    let dcpl = dataset
        .dcpl()
        .map_err(|e| gate::error(path, &format!("reading the layout of {name:?}"), e))?;
    match dcpl.layout() {
        hdf5::dataset::Layout::Contiguous if dcpl.external().is_empty() => {
            return Ok(match dataset.offset() {
                Some(address) => Some(vec![DescriptorRun {
                    address: Some(address),
                    count: n,
                    stored: None,
                }]),
                // Never written: every element is empty.
                None if dataset.storage_size() == 0 => Some(vec![DescriptorRun {
                    address: None,
                    count: n,
                    stored: None,
                }]),
                None => None,
            });
        }
        hdf5::dataset::Layout::Chunked => {}
        _ => return Ok(None),
    }
    let chunk = dataset
        .chunk()
        .and_then(|c| c.first().copied())
        .filter(|&c| c > 0)
        .ok_or_else(|| {
            Error::not_a_dataset(path, format!("{name:?} is chunked with no chunk shape"))
        })?;
    if n.div_ceil(chunk) > MAX_CHUNK_LOOKUPS {
        return Ok(None);
    }
    let mut runs = Vec::with_capacity(n.div_ceil(chunk));
    for start in (0..n).step_by(chunk) {
        let offset = [start as hdf5_sys::h5::hsize_t];
        let (mut mask, mut address, mut size) = (0, 0, 0);
        // SAFETY: the dataset id is valid while `dataset` lives; `offset` has one coordinate
        // per dimension (the dataset is one-dimensional) and the out-pointers are valid.
        let status = unsafe {
            hdf5_sys::h5d::H5Dget_chunk_info_by_coord(
                dataset.id(),
                offset.as_ptr(),
                &mut mask,
                &mut address,
                &mut size,
            )
        };
        if status < 0 {
            return Err(Error::not_a_dataset(
                path,
                format!("libhdf5 could not locate the chunk of {name:?} at element {start}"),
            ));
        }
        runs.push(DescriptorRun {
            address: (address != hdf5_sys::h5::HADDR_UNDEF).then_some(address),
            count: chunk.min(n - start),
            stored: Some(size),
        });
    }
    Ok(Some(runs))
}

/// The `classes` attribute of `location` as strings, when it has one. An attribute declaring
/// more strings than the file can hold is not read (libhdf5 would allocate and convert them
/// all: a damaged dimension took gigabytes and minutes).
pub(super) fn class_names(location: &hdf5::Location, file_len: u64) -> Option<Vec<String>> {
    let attr = location.attr(CLASSES_ATTR).ok()?;
    // Each string's stored element (a variable-length string's descriptor, or a fixed-length
    // string's bytes) is at least 10 bytes, or the size its type declares.
    let element = attr.dtype().ok()?.size().max(10) as u64;
    let strings = attr
        .shape()
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))?;
    if strings.saturating_mul(element) > file_len {
        return None;
    }
    if let Ok(names) = attr.read_raw::<VarLenUnicode>() {
        return names
            .iter()
            .map(|s| checked_str(s.as_bytes()).map(str::to_owned))
            .collect();
    }
    attr.read_raw::<hdf5::types::VarLenAscii>()
        .ok()
        .and_then(|names| {
            names
                .iter()
                .map(|s| checked_str(s.as_bytes()).map(str::to_owned))
                .collect()
        })
}
