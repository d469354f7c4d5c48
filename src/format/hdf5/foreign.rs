//! The layouts h5py users already have (see the parent module): encoded images in a
//! variable-length `uint8` dataset, whose element descriptors are read here for `heap`, and
//! fixed-shape pixel arrays; labels of any integer or enum type; class names from a `classes`
//! attribute or dataset, or the labels' enum members.

use std::fs;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::sync::Arc;

use hdf5::types::{TypeDescriptor, VarLenUnicode};

use super::CLASSES_ATTR;
use super::Hdf5Names;
use super::chunks::{self, ChunkGrid, ChunkLayout};
use super::gate;
use super::heap::{self, HeapId};
use super::reader::{Layout, PixelStorage, Shared, checked_str};
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
    let named = chosen_class_names(
        path,
        file,
        names,
        [&labels_ds, &images],
        &label_type,
        file_len,
        &mut notices,
    );
    let classes = match named {
        // Two classes of one name: a name-to-class table (Python's `class_to_idx`) would keep
        // only one of them (found by a hostile try).
        Some(listed)
            if crate::dataset::first_repeat(listed.iter().map(String::as_str)).is_some() =>
        {
            crate::dataset::notice(
                &mut notices,
                format!(
                    "{}: its {CLASSES_ATTR:?} attribute names two classes alike: classes are \
                     named by number",
                    path.display()
                ),
            );
            inferred_classes(&names.labels, &labels, &mut notices)
        }
        Some(listed) => listed,
        None => inferred_classes(&names.labels, &labels, &mut notices),
    };
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

/// The class names h5py users store, from the first of these places that has them: a `classes`
/// attribute on the root, on the labels dataset or on the images dataset, else a `classes`
/// dataset in the root (`f["classes"] = names`, which was ignored without a word). A notice for
/// each place that holds something not read, and for names that differ from the ones read.
fn chosen_class_names(
    path: &Path,
    file: &hdf5::File,
    names: &Hdf5Names,
    [labels, images]: [&hdf5::Dataset; 2],
    label_type: &TypeDescriptor,
    file_len: u64,
    notices: &mut Vec<String>,
) -> Option<Vec<String>> {
    let mut places = vec![
        (
            format!("the file's {CLASSES_ATTR:?} attribute"),
            attribute_names(file, file_len),
        ),
        (
            format!(
                "the {:?} dataset's {CLASSES_ATTR:?} attribute",
                names.labels
            ),
            attribute_names(labels, file_len),
        ),
        (
            format!(
                "the {:?} dataset's {CLASSES_ATTR:?} attribute",
                names.images
            ),
            attribute_names(images, file_len),
        ),
    ];
    // A root dataset of that name, unless it is the labels or images themselves.
    if ![&names.labels, &names.images]
        .iter()
        .any(|n| n.trim_start_matches('/') == CLASSES_ATTR)
        && file.link_exists(CLASSES_ATTR)
    {
        let place = format!("the {CLASSES_ATTR:?} dataset");
        match file.dataset(CLASSES_ATTR) {
            Ok(dataset) => places.push((place, strings_of(&dataset, file_len))),
            // A group of that name, say.
            Err(_) => places.push((
                format!("the root's {CLASSES_ATTR:?} member"),
                ClassNames::Unread("is no dataset".into()),
            )),
        }
    }
    if let TypeDescriptor::Enum(enumerated) = label_type {
        places.push((
            format!("the {:?} dataset's enum type", names.labels),
            enum_names(enumerated),
        ));
    }
    let mut found: Vec<(String, Vec<String>)> = Vec::new();
    for (place, listed) in places {
        match listed {
            ClassNames::Absent => {}
            ClassNames::Names(listed) => found.push((place, listed)),
            ClassNames::Unread(reason) => crate::dataset::notice(
                notices,
                format!("{}: {place} {reason}: it is not read", path.display()),
            ),
        }
    }
    let mut found = found.into_iter();
    let (first, read) = found.next()?;
    for (other, listed) in found {
        if listed != read {
            crate::dataset::notice(
                notices,
                format!(
                    "{}: {first} and {other} name different classes ({} and {}): {first} are \
                     read",
                    path.display(),
                    shown_names(&read),
                    shown_names(&listed)
                ),
            );
        }
    }
    Some(read)
}

/// The member names of an enum label type as class names, when its values are exactly the
/// classes `0..N` (h5py's `enum_dtype({"cat": 0, "dog": 1})`).
fn enum_names(enumerated: &hdf5::types::EnumType) -> ClassNames {
    let count = enumerated.members.len();
    let mut named = vec![None; count];
    for member in &enumerated.members {
        // A signed enum's negative values are stored sign-extended: past any class.
        let slot = usize::try_from(member.value)
            .ok()
            .and_then(|value| named.get_mut(value));
        match slot {
            Some(slot @ None) => *slot = Some(member.name.clone()),
            _ => {
                return ClassNames::Unread(format!(
                    "numbers its {count} members otherwise than 0..{count} ({:?} is {})",
                    member.name, member.value as i64
                ));
            }
        }
    }
    match named.into_iter().collect::<Option<Vec<String>>>() {
        Some(names) if !names.is_empty() => ClassNames::Names(names),
        _ => ClassNames::Unread("names no class".into()),
    }
}

/// Up to the first five of `names`, for a message: `"a", "b", ... (1000 names)`.
fn shown_names(names: &[String]) -> String {
    let first: Vec<String> = names.iter().take(5).map(|n| format!("{n:?}")).collect();
    if names.len() > 5 {
        format!("{}, ... ({} names)", first.join(", "), names.len())
    } else {
        first.join(", ")
    }
}

/// Class names for a file without a `classes` attribute: `"0"..="max label"`, with a notice
/// when labels are left out.
fn inferred_classes(name: &str, labels: &[i64], notices: &mut Vec<String>) -> Vec<String> {
    let mut inference = crate::dataset::ClassInference::default();
    for (index, &label) in labels.iter().enumerate() {
        inference.see(|| format!("{name}[{index}]"), Some(label));
    }
    let (classes, notice) = inference.classes();
    notices.extend(notice);
    classes
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

/// What a `classes` attribute gave.
#[derive(Debug)]
pub(super) enum ClassNames {
    /// There is no such attribute.
    Absent,
    /// One name per class.
    Names(Vec<String>),
    /// An attribute that is no list of names imagefeed reads, and why: classes are then named
    /// by number, with a notice (a hostile try's `(N, 2)` array of synsets and names was read
    /// as 2N classes, every class but the first misnamed).
    Unread(String),
}

/// The `classes` attribute of `location`, read by [`strings_of`].
pub(super) fn attribute_names(location: &hdf5::Location, file_len: u64) -> ClassNames {
    match location.attr(CLASSES_ATTR) {
        Ok(attr) => strings_of(&attr, file_len),
        Err(_) => ClassNames::Absent,
    }
}

/// An attribute's or dataset's strings as class names: a one-dimensional array of strings,
/// variable-length or fixed-length (up to 1,024 bytes), each UTF-8. One declaring more strings
/// than the file can hold is not read (libhdf5 would allocate and convert them all: a damaged
/// dimension took gigabytes and minutes).
fn strings_of(list: &hdf5::Container, file_len: u64) -> ClassNames {
    let shape = list.shape();
    let [strings] = shape[..] else {
        return ClassNames::Unread(format!(
            "has shape {shape:?}, not a list of names (one dimension)"
        ));
    };
    if strings == 0 {
        return ClassNames::Unread("names no class".into());
    }
    let Ok(descriptor) = list.dtype().and_then(|t| t.to_descriptor()) else {
        return ClassNames::Unread("has a type this build cannot read".into());
    };
    // Each string's stored element (a variable-length string's descriptor, or a fixed-length
    // string's bytes) is at least 10 bytes, or the size its type declares.
    let element = list.dtype().map_or(0, |t| t.size()).max(10) as u64;
    if (strings as u64).saturating_mul(element) > file_len {
        return ClassNames::Unread(format!(
            "declares {strings} names, more than the file can hold"
        ));
    }
    let names: Option<Vec<String>> = match descriptor {
        TypeDescriptor::VarLenUnicode => read_names::<VarLenUnicode>(list, |s| s.as_bytes()),
        TypeDescriptor::VarLenAscii => {
            read_names::<hdf5::types::VarLenAscii>(list, |s| s.as_bytes())
        }
        // Fixed-length strings (`np.array(names, dtype="S")`, h5py's default for a list of
        // bytes): read into the smallest of a few widths that holds the declared one, which
        // libhdf5 converts to without cutting a name.
        TypeDescriptor::FixedAscii(width) | TypeDescriptor::FixedUnicode(width) => {
            let unicode = matches!(descriptor, TypeDescriptor::FixedUnicode(_));
            match width {
                0..=16 => fixed_strings::<16>(list, unicode),
                17..=64 => fixed_strings::<64>(list, unicode),
                65..=256 => fixed_strings::<256>(list, unicode),
                257..=1024 => fixed_strings::<1024>(list, unicode),
                _ => {
                    return ClassNames::Unread(format!(
                        "holds names of {width} bytes, more than the 1,024 imagefeed reads"
                    ));
                }
            }
        }
        other => return ClassNames::Unread(format!("is {other}, not strings")),
    };
    match names {
        Some(names) => ClassNames::Names(names),
        None => ClassNames::Unread("holds a name that is not UTF-8".into()),
    }
}

/// An attribute or dataset of fixed-length strings at most `N` bytes each (UTF-8 where
/// `unicode`, else ASCII), as strings.
fn fixed_strings<const N: usize>(list: &hdf5::Container, unicode: bool) -> Option<Vec<String>> {
    if unicode {
        read_names::<hdf5::types::FixedUnicode<N>>(list, |s| s.as_bytes())
    } else {
        read_names::<hdf5::types::FixedAscii<N>>(list, |s| s.as_bytes())
    }
}

/// The strings of `list` read as `T`, each UTF-8 (`bytes` gives a string's bytes); `None` when
/// the read fails or one is not UTF-8.
fn read_names<T: hdf5::H5Type>(
    list: &hdf5::Container,
    bytes: impl Fn(&T) -> &[u8],
) -> Option<Vec<String>> {
    list.read_raw::<T>()
        .ok()?
        .iter()
        .map(|s| checked_str(bytes(s)).map(str::to_owned))
        .collect()
}
