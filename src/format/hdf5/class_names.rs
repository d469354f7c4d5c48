//! Class names in HDF5 files h5py users wrote: where they may be (`classes` attributes, a
//! `classes` dataset, the labels' enum type), how each is read, and which is taken. Our own
//! layout reads [`attribute_names`] too, to compare the attribute h5py users read with its
//! metadata.

use std::path::Path;

use hdf5::types::{TypeDescriptor, VarLenUnicode};

use super::CLASSES_ATTR;
use super::Hdf5Names;
use super::reader::checked_str;

/// The classes of an h5py file with labels `labels` of type `label_type`: the names it stores
/// ([`chosen`]), unless they name two classes alike (a name-to-class table, Python's
/// `class_to_idx`, would keep only one of them: a hostile try), else `"0"..="max label"`.
pub(super) fn of_file(
    path: &Path,
    file: &hdf5::File,
    names: &Hdf5Names,
    datasets: [&hdf5::Dataset; 2],
    (label_type, labels): (&TypeDescriptor, &[i64]),
    file_len: u64,
    notices: &mut Vec<String>,
) -> Vec<String> {
    match chosen(path, file, names, datasets, label_type, file_len, notices) {
        Some((place, listed)) => match crate::dataset::first_repeat(listed.iter()) {
            None => listed,
            Some((first, second)) => {
                crate::dataset::notice(
                    notices,
                    format!(
                        "{}: {place} names classes {first} and {second} alike ({:?}): classes \
                         are named by number",
                        path.display(),
                        listed[first]
                    ),
                );
                inferred_classes(&names.labels, labels, notices)
            }
        },
        None => inferred_classes(&names.labels, labels, notices),
    }
}

/// The class names h5py users store, and where they were found, from the first of these places
/// that has them: a `classes` attribute on the root, on the labels dataset or on the images
/// dataset, else a `classes` dataset in the root (`f["classes"] = names`, which was ignored
/// without a word), else the labels' enum members. A notice for each place that holds
/// something not read, and for names that differ from the ones read.
fn chosen(
    path: &Path,
    file: &hdf5::File,
    names: &Hdf5Names,
    [labels, images]: [&hdf5::Dataset; 2],
    label_type: &TypeDescriptor,
    file_len: u64,
    notices: &mut Vec<String>,
) -> Option<(String, Vec<String>)> {
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
                    "{}: {first} and {other} name different classes ({} and {}): the first's \
                     are read",
                    path.display(),
                    shown_names(&read),
                    shown_names(&listed)
                ),
            );
        }
    }
    Some((first, read))
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

/// Class names for a file that names none: `"0"..="max label"`, with a notice when labels are
/// left out.
fn inferred_classes(name: &str, labels: &[i64], notices: &mut Vec<String>) -> Vec<String> {
    let mut inference = crate::dataset::ClassInference::default();
    for (index, &label) in labels.iter().enumerate() {
        inference.see(|| format!("{name}[{index}]"), Some(label));
    }
    let (classes, notice) = inference.classes();
    notices.extend(notice);
    classes
}

/// What a place that may hold class names (a `classes` attribute or dataset, an enum type) gave.
#[derive(Debug)]
pub(super) enum ClassNames {
    /// There is no such place.
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
