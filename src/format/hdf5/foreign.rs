//! The layouts h5py users already have (see the parent module): encoded images in a
//! variable-length `uint8` dataset, whose element descriptors are read here for `heap`, and
//! fixed-shape pixel arrays; labels of any integer or enum type; class names from a `classes`
//! attribute or dataset, or the labels' enum members.

use std::fs;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::sync::Arc;

use hdf5::types::TypeDescriptor;

use super::Hdf5Names;
use super::chunks::{self, ChunkGrid, ChunkLayout};
use super::class_names;
use super::gate;
use super::heap::{self, HeapId};
use super::reader::{Layout, PixelStorage, Shared};
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
    let (images, labels_ds) = open_datasets(path, file, names)?;
    let label_type = check_label_type(path, &labels_ds, &names.labels)?;
    check_stored(path, &labels_ds, &names.labels, file_len)?;
    check_stored(path, &images, &names.images, file_len)?;
    // One integer per image: (N,), or a column or row of them. A 2-D array of N values in
    // another shape was flattened (a hostile try's (20, 2) labels for 40 images read as 40
    // labels), and a one-hot (N, C) array was "has N*C labels".
    let label_shape = labels_ds.shape();
    if label_shape.len() > 2 || (label_shape.len() == 2 && !label_shape.contains(&1)) {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{:?} has shape {label_shape:?}: labels are one integer per image, of shape \
                 (N,), (N, 1) or (1, N) (one-hot or multi-label arrays are not read; store \
                 the class numbers)",
                names.labels
            ),
        ));
    }
    let labels = read_labels(path, &labels_ds, &names.labels, &label_type)?;
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
        .map_err(|e| gate::error(path, &format!("reading the type of {:?}", names.images), e))?;
    let (layout, payload) = match (&dtype, shape.len()) {
        (TypeDescriptor::VarLenArray(inner), 1)
            if **inner == TypeDescriptor::Unsigned(hdf5::types::IntSize::U1) =>
        {
            (
                var_len_layout(path, &images, &names.images, n, plain, file_len)?,
                PayloadKind::Encoded,
            )
        }
        (TypeDescriptor::Unsigned(hdf5::types::IntSize::U1), 3 | 4) => (
            pixel_layout(path, &images, &names.images, &shape, file_len)?,
            PayloadKind::RawRgb8,
        ),
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
    let classes = class_names::of_file(
        path,
        file,
        names,
        [&labels_ds, &images],
        (&label_type, &labels),
        file_len,
        &mut notices,
    );
    // Every record bad (all labels negative, say) would open and fail at the first batch.
    if let Some(&first) = labels.first()
        && !labels
            .iter()
            .any(|&l| usize::try_from(l).is_ok_and(|l| l < classes.len()))
    {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "no label in {:?} is a class number in 0..{} (the first is {first}): every \
                 record would be bad",
                names.labels,
                // (Without class names, the most a file may have.)
                if classes.is_empty() {
                    crate::dataset::MAX_CLASSES
                } else {
                    classes.len()
                }
            ),
        ));
    }
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
            restart_markers: false,
        },
        labels,
        layout,
        notices,
        opened: None,
        identity: None,
    })
}

/// The images and labels datasets `names` names, or an error listing what the file has.
fn open_datasets(
    path: &Path,
    file: &hdf5::File,
    names: &Hdf5Names,
) -> Result<(hdf5::Dataset, hdf5::Dataset)> {
    for name in [&names.images, &names.labels] {
        if !file.link_exists(name) {
            let members = file.member_names().unwrap_or_default();
            return Err(Error::not_a_dataset(
                path,
                format!(
                    "HDF5 file without imagefeed's layout and without a dataset {name:?} (it has \
                     {}); name the images and labels datasets",
                    if members.is_empty() {
                        "no datasets".to_string()
                    } else {
                        members.join(", ")
                    }
                ),
            ));
        }
    }
    let open = |name: &str| {
        file.dataset(name)
            .map_err(|e| gate::error(path, &format!("opening {name:?}"), e))
    };
    Ok((open(&names.images)?, open(&names.labels)?))
}

/// The labels' type, refused unless they are integers (class indices), booleans (classes 0
/// and 1) or an enum of integers (h5py's `enum_dtype`: its values are the classes): other
/// types would be cut silently.
fn check_label_type(path: &Path, labels: &hdf5::Dataset, name: &str) -> Result<TypeDescriptor> {
    let label_type = labels
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(|e| gate::error(path, &format!("reading the type of {name:?}"), e))?;
    if !matches!(
        label_type,
        TypeDescriptor::Integer(_)
            | TypeDescriptor::Unsigned(_)
            | TypeDescriptor::Boolean
            | TypeDescriptor::Enum(_)
    ) {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{name:?} holds {label_type} values; labels must be integers (class indices), \
                 and non-integer ones would be cut silently"
            ),
        ));
    }
    Ok(label_type)
}

/// The labels as integers. A `uint64` label past `i64::MAX` is an error naming it: read as
/// `i64`, libhdf5 clips it to `i64::MAX`, which messages then quoted as the label (a hostile
/// try wrote 2^64 - 1).
fn read_labels(
    path: &Path,
    labels: &hdf5::Dataset,
    name: &str,
    label_type: &TypeDescriptor,
) -> Result<Vec<i64>> {
    let reading = |e| gate::error(path, &format!("reading {name:?} as integers"), e);
    // h5py's bool (an HDF5 enum of FALSE and TRUE): classes 0 and 1. Read as the enum's
    // integers (never into Rust `bool`s, which a stored 2 would make invalid), any value but 0
    // being true, as h5py reads it.
    if *label_type == TypeDescriptor::Boolean {
        let flags: Vec<i8> = labels.read_raw().map_err(reading)?;
        return Ok(flags.into_iter().map(|flag| i64::from(flag != 0)).collect());
    }
    // An enum's values are read as its base integer type's (h5py reads them so too).
    let base = match label_type {
        TypeDescriptor::Enum(enumerated) => enumerated.base_type(),
        other => other.clone(),
    };
    if base != TypeDescriptor::Unsigned(hdf5::types::IntSize::U8) {
        return labels.read_raw::<i64>().map_err(reading);
    }
    let wide: Vec<u64> = labels.read_raw().map_err(reading)?;
    wide.iter()
        .enumerate()
        .map(|(row, &label)| {
            i64::try_from(label).map_err(|_| {
                Error::not_a_dataset(
                    path,
                    format!("{name:?}[{row}] is {label}, too large for a class number"),
                )
            })
        })
        .collect()
}

/// How an `N×H×W×C` (or `N×H×W`) `uint8` pixel array is read: with `pread` when contiguous,
/// chunk by chunk (`chunks`) when every filter is ours, else through the library.
fn pixel_layout(
    path: &Path,
    images: &hdf5::Dataset,
    name: &str,
    shape: &[usize],
    file_len: u64,
) -> Result<Layout> {
    let (n, height, width) = (shape[0], shape[1], shape[2]);
    let channels = shape.get(3).copied().unwrap_or(1);
    if !matches!(channels, 1 | 3 | 4) {
        return Err(Error::not_a_dataset(
            path,
            format!("{name:?} has {channels} channels; pixel arrays need 1, 3 or 4"),
        ));
    }
    let pixels = (height as u64).saturating_mul(width as u64);
    if pixels == 0 || pixels > crate::decode::DEFAULT_MAX_PIXELS {
        return Err(Error::not_a_dataset(
            path,
            format!(
                "{name:?} holds {height}x{width} images; each must have 1..={} pixels",
                crate::decode::DEFAULT_MAX_PIXELS
            ),
        ));
    }
    // Fits in u64: check_stored accepted the whole array's size.
    let len = n as u64 * pixels * channels as u64;
    let storage = match contiguous_offset(images, len) {
        Some(offset) => {
            check_inside_file(path, offset, len, file_len)?;
            PixelStorage::Contiguous(offset)
        }
        None => {
            // What a chunk never written holds: the fill value (0 unless set). With the fill
            // time "never" libhdf5 leaves a reader's buffer as it was, which h5py zeroes.
            let fill = images
                .dcpl()
                .ok()
                .filter(|dcpl| dcpl.fill_time() != hdf5::dataset::FillTime::Never)
                .and_then(|dcpl| dcpl.fill_value_as::<u8>())
                .unwrap_or(0);
            match ChunkLayout::of(path, images, name, 1, vec![fill], file_len)? {
                Some(layout) => PixelStorage::Chunked(Arc::new(layout)),
                None => PixelStorage::Library(ChunkGrid::of(images).map(Arc::new)),
            }
        }
    };
    Ok(Layout::Pixels {
        images: name.to_string(),
        rank: shape.len(),
        height,
        width,
        channels,
        storage,
    })
}

/// How h5py's variable-length images are read: each element's descriptor (its global heap ID)
/// is read here, so that records are read with `pread` (`heap`) and never through the library:
/// from where the library says the dataset's raw data lies when it is contiguous, chunk by
/// chunk (`chunks`, filters undone by checked code) when it is chunked. Descriptors the library
/// must read itself (compact, virtual, external, a filter of its own) are read through it, one
/// element at a time.
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
    let Some(plain) = plain else {
        return Ok(through_library);
    };
    let mut head = [0u8; 48];
    let got = plain.read_at(&mut head, 0).at(path)?;
    let widths = heap::superblock_widths(&head[..got])
        .map_err(|reason| Error::not_a_dataset(path, reason))?;
    let size = widths.descriptor() as u64;
    let bytes = match descriptor_storage(path, images, name, n, widths.descriptor(), file_len)? {
        DescriptorStorage::Contiguous(None) => {
            // Storage never written: the elements are empty, as the library reads them.
            return Ok(Layout::VarLen {
                images: name.to_string(),
                widths,
                ids: vec![HeapId::EMPTY; n],
            });
        }
        DescriptorStorage::Contiguous(Some(address)) => {
            let len = n as u64 * size;
            if address.checked_add(len).is_none_or(|end| end > file_len) {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "{name:?}'s element descriptors lie at bytes {address}..+{len}, past the \
                         end of the {file_len}-byte file (truncated?)"
                    ),
                ));
            }
            let mut bytes = vec![0; len as usize];
            plain.read_exact_at(&mut bytes, address).at(path)?;
            bytes
        }
        DescriptorStorage::Chunked(layout) => chunks::read_all(path, name, &layout, images)?,
        DescriptorStorage::Library => return Ok(through_library),
    };
    let ids = heap::parse_descriptors(&bytes, &widths);
    debug_assert_eq!(ids.len(), n);
    Ok(Layout::VarLen {
        images: name.to_string(),
        widths,
        ids,
    })
}

/// Where the element descriptors of a one-dimensional variable-length dataset lie.
enum DescriptorStorage {
    /// At one file offset (`None`: storage never written, every element empty).
    Contiguous(Option<u64>),
    /// In chunks this build reads (see `chunks`).
    Chunked(ChunkLayout),
    /// Only the library can read them: compact (in the object header), virtual, in external
    /// files, or through a filter of its own.
    Library,
}

fn descriptor_storage(
    path: &Path,
    dataset: &hdf5::Dataset,
    name: &str,
    n: usize,
    descriptor: usize,
    file_len: u64,
) -> Result<DescriptorStorage> {
    let filtered = !readable_filters(path, dataset, name)?.is_empty();
    let dcpl = dataset
        .dcpl()
        .map_err(|e| gate::error(path, &format!("reading the layout of {name:?}"), e))?;
    Ok(match dcpl.layout() {
        hdf5::dataset::Layout::Contiguous if dcpl.external().is_empty() && !filtered => {
            match dataset.offset() {
                // No elements, or storage never written: every element (if any) is empty.
                _ if n == 0 => DescriptorStorage::Contiguous(None),
                Some(address) => DescriptorStorage::Contiguous(Some(address)),
                None if dataset.storage_size() == 0 => DescriptorStorage::Contiguous(None),
                None => DescriptorStorage::Library,
            }
        }
        hdf5::dataset::Layout::Chunked => {
            // A never-written element reads as empty: an all-zero descriptor.
            match ChunkLayout::of(
                path,
                dataset,
                name,
                descriptor,
                vec![0; descriptor],
                file_len,
            )? {
                Some(layout) => DescriptorStorage::Chunked(layout),
                None => DescriptorStorage::Library,
            }
        }
        _ => DescriptorStorage::Library,
    })
}
