//! Hostile and corrupt files other tools could have written: every count, label, length and
//! memo index read from a file is checked against what the file can hold before anything is
//! allocated, and the error (or bad record) names the file, the record and the value. Before,
//! each of these aborted or panicked every tool (`inspect`, `verify`, `load`, `convert`).

use crate::support;

use std::fs;
use std::path::{Path, PathBuf};

use imagefeed::dataset::MAX_CLASSES;
use imagefeed::format::tfrecord;
use imagefeed::format::{self, OpenOptions, example};
use imagefeed::pack::{self, NoProgress, PackFormat};
use imagefeed::{Error, inspect, verify};
use support::{fixture_root, small_options};

fn jpeg() -> Vec<u8> {
    fs::read(fixture_root().join("class02/img00000.jpg")).unwrap()
}

/// An h5py-layout file at `path`: four copies of [`jpeg`] in a variable-length `uint8` dataset
/// `images`, and whatever `rest` adds (the labels, mostly).
#[cfg(feature = "hdf5")]
fn h5py_file(path: &Path, rest: &dyn Fn(&hdf5::File)) -> PathBuf {
    let file = hdf5::File::create(path).unwrap();
    let image = jpeg();
    let images: Vec<hdf5::types::VarLenArray<u8>> = (0..4)
        .map(|_| hdf5::types::VarLenArray::from_slice(&image))
        .collect();
    file.new_dataset_builder()
        .with_data(images.as_slice())
        .create("images")
        .unwrap();
    rest(&file);
    path.to_path_buf()
}

/// `pickle.dumps((image, label), protocol=4)` with the label as LONG1 (any i64).
fn pickled(image: &[u8], label: i64) -> Vec<u8> {
    let mut out = b"\x80\x04B".to_vec();
    out.extend_from_slice(&(image.len() as u32).to_le_bytes());
    out.extend_from_slice(image);
    out.extend_from_slice(&[0x8a, 8]);
    out.extend_from_slice(&label.to_le_bytes());
    out.extend_from_slice(b"\x86.");
    out
}

/// A folder2lmdb `__keys__` value: a pickled list of keys as short bytes (protocol 4).
fn pickled_keys(keys: &[impl AsRef<str>]) -> Vec<u8> {
    let mut out = b"\x80\x04](".to_vec();
    for key in keys {
        let key = key.as_ref();
        out.push(b'C');
        out.push(key.len() as u8);
        out.extend_from_slice(key.as_bytes());
    }
    out.extend_from_slice(b"e.");
    out
}

/// A pickled int as LONG1.
fn pickled_int(n: i64) -> Vec<u8> {
    let mut out = b"\x80\x04\x8a\x08".to_vec();
    out.extend_from_slice(&n.to_le_bytes());
    out.push(b'.');
    out
}

/// A single-file LMDB in the Python folder2lmdb layout: `entries` in the unnamed database.
fn write_folder2lmdb(path: &Path, entries: &[(Vec<u8>, Vec<u8>)]) {
    let mut options = heed::EnvOpenOptions::new();
    options.map_size(64 << 20);
    // SAFETY: test-only; nothing else has this file open.
    unsafe { options.flags(heed::EnvFlags::NO_SUB_DIR) };
    // SAFETY: as above.
    let env = unsafe { options.open(path) }.unwrap();
    let mut wtxn = env.write_txn().unwrap();
    let db: heed::Database<heed::types::Bytes, heed::types::Bytes> =
        env.create_database(&mut wtxn, None).unwrap();
    for (key, value) in entries {
        db.put(&mut wtxn, key, value).unwrap();
    }
    wtxn.commit().unwrap();
    env.prepare_for_closing().wait();
    let mut lock = path.as_os_str().to_owned();
    lock.push("-lock");
    let _ = fs::remove_file(lock);
}

fn corrupt_record_text(err: &Error) -> String {
    assert!(matches!(err, Error::CorruptRecord { .. }), "{err}");
    err.to_string()
}

#[test]
fn huge_labels_in_a_folder2lmdb_file_are_bad_records_not_a_huge_class_table() {
    // Regression: a label of 2^31-1 or 2^40 made the class table allocate ~50 GB (abort), and
    // 2^63-1 panicked.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostile.lmdb");
    let image = jpeg();
    let labels = [0, (1 << 31) - 1, 2, 1 << 40, i64::MAX, -3, 1];
    let mut entries: Vec<(Vec<u8>, Vec<u8>)> = labels
        .iter()
        .enumerate()
        .map(|(i, &label)| (i.to_string().into_bytes(), pickled(&image, label)))
        .collect();
    entries.push((b"__len__".to_vec(), pickled_int(labels.len() as i64)));
    write_folder2lmdb(&path, &entries);

    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["0", "1", "2"]);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("4 record(s) have a label outside") && n.contains("2147483647")),
        "{:?}",
        dataset.notices()
    );
    let mut reader = dataset.open_reader().unwrap();
    for (i, &label) in labels.iter().enumerate() {
        match reader.read(i) {
            Ok(record) => assert_eq!(i64::from(record.label), label),
            Err(e) => {
                let text = corrupt_record_text(&e);
                assert!(
                    text.contains("hostile.lmdb")
                        && text.contains(&format!("record {i} "))
                        && text.contains(&label.to_string()),
                    "{text}"
                );
                assert!(!(0..3).contains(&label));
            }
        }
    }
    let inspection = inspect::inspect(&path).unwrap();
    assert_eq!(inspection.bad_records.len(), 4);
    let report = verify::verify(&path, None).unwrap();
    assert_eq!(report.problems.len(), 4);
    // Into HDF5 where the build has it (its writer stores labels as int64), else LMDB.
    let to = support::hdf5_else_lmdb();
    let out = dir.path().join(format!("converted.{}", to.name()));
    let summary = pack::convert(&path, &out, to, &small_options(), &NoProgress)
        .expect("convert rejects the hostile records and carries on");
    assert_eq!((summary.samples, summary.rejected.len()), (3, 4));
}

/// A folder2lmdb file none of whose values has a usable label is refused saying what the first
/// holds (a hostile try met only "no value holds a pickled (bytes, label)").
#[test]
fn a_folder2lmdb_file_without_a_usable_label_says_what_the_first_holds() {
    let dir = tempfile::tempdir().unwrap();
    let image = jpeg();
    // (bytes, 3.0): BINFLOAT, 8 bytes big-endian.
    let float = {
        let mut out = b"\x80\x04B".to_vec();
        out.extend_from_slice(&(image.len() as u32).to_le_bytes());
        out.extend_from_slice(&image);
        out.push(b'G');
        out.extend_from_slice(&3.0f64.to_be_bytes());
        out.extend_from_slice(b"\x86.");
        out
    };
    for (name, value, says) in [
        (
            "float.lmdb",
            float,
            "record 0 (key \"0\"): expected a pickled (bytes, label) tuple; its label is a \
             float, not an integer",
        ),
        (
            "negative.lmdb",
            pickled(&image, -4),
            "record 0 (key \"0\"): label -4",
        ),
        (
            "cut.lmdb",
            b"\x80\x04\x95".to_vec(),
            "record 0 (key \"0\"): pickle is truncated",
        ),
    ] {
        let path = dir.path().join(name);
        write_folder2lmdb(
            &path,
            &[
                (b"0".to_vec(), value.clone()),
                (b"1".to_vec(), value),
                (b"__len__".to_vec(), pickled_int(2)),
            ],
        );
        let err = format::open(&path).unwrap_err();
        assert!(
            matches!(&err, Error::NotADataset { reason, .. }
                if reason.contains("no value holds a pickled (bytes, label)") && reason.contains(says)),
            "{name}: {err}"
        );
    }
}

#[test]
fn a_folder2lmdb_len_larger_than_the_file_is_refused_before_listing_keys() {
    // Regression: __len__ of 10^8 or 10^12 with no __keys__ made 10^12 key strings (abort).
    let dir = tempfile::tempdir().unwrap();
    for len in [100_000_000i64, 1_000_000_000_000] {
        let path = dir.path().join(format!("len-{len}.lmdb"));
        write_folder2lmdb(
            &path,
            &[
                (b"0".to_vec(), pickled(&jpeg(), 0)),
                (b"__len__".to_vec(), pickled_int(len)),
            ],
        );
        let err = format::open(&path).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::NotADataset { .. })
                && text.contains(&format!("__len__ is {len}"))
                && text.contains("cannot hold that many samples")
                && text.contains(&path.display().to_string()),
            "{text}"
        );
    }
}

#[test]
fn a_memo_index_near_two_to_the_32_in_a_value_allocates_nothing() {
    // Regression: LONG_BINPUT 0xFFFFFFF0 resized the unpickler's memo to 2^32 entries (137 GB).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("memo.lmdb");
    let image = jpeg();
    let mut value = b"\x80\x04B".to_vec();
    value.extend_from_slice(&(image.len() as u32).to_le_bytes());
    value.extend_from_slice(&image);
    value.extend_from_slice(b"r\xf0\xff\xff\xffK\x01\x86.");
    write_folder2lmdb(
        &path,
        &[
            (b"0".to_vec(), pickled(&image, 0)),
            (b"1".to_vec(), value),
            (b"__len__".to_vec(), pickled_int(2)),
        ],
    );
    let dataset = format::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    let record = reader.read(1).unwrap();
    assert_eq!((record.label, record.payload), (1, image.as_slice()));
}

/// A TFRecord shard of `tf.train.Example`s with the given `(label, filename)`s, each holding the
/// fixture JPEG, in `dir/train-00000-of-00001`.
fn write_shard(dir: &Path, records: &[(i64, &[u8])]) -> PathBuf {
    fs::create_dir_all(dir).unwrap();
    let image = jpeg();
    let mut shard = Vec::new();
    let mut example = Vec::new();
    for &(label, filename) in records {
        example::encode(
            &mut example,
            &[
                (
                    tfrecord::features::ENCODED,
                    example::FeatureValue::Bytes(&image),
                ),
                (
                    tfrecord::features::LABEL,
                    example::FeatureValue::Int64(label),
                ),
                (
                    tfrecord::features::FILENAME,
                    example::FeatureValue::Bytes(filename),
                ),
            ],
        );
        tfrecord::frame(&mut shard, &example);
    }
    let path = dir.join("train-00000-of-00001");
    fs::write(&path, shard).unwrap();
    path
}

#[test]
fn tfrecords_without_an_integer_label_are_refused_saying_what_the_label_is() {
    // A hostile try's float-list labels were "no record has an image/class/label in
    // 0..1048576", which says nothing of what the records hold.
    let dir = tempfile::tempdir().unwrap();
    let image = jpeg();
    let mut shard = Vec::new();
    let mut record = Vec::new();
    for _ in 0..3 {
        example::encode(
            &mut record,
            &[
                (
                    tfrecord::features::ENCODED,
                    example::FeatureValue::Bytes(&image),
                ),
                (
                    tfrecord::features::LABEL,
                    example::FeatureValue::Bytes(b"3.0"),
                ),
            ],
        );
        tfrecord::frame(&mut shard, &record);
    }
    let path = dir.path().join("labels-as-text.tfrecord");
    fs::write(&path, shard).unwrap();
    match format::open(&path) {
        Err(Error::NotADataset { reason, .. }) => assert!(
            reason.contains("the first without")
                && reason.contains("record 0")
                && reason.contains("is not an int64_list"),
            "{reason}"
        ),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("opened"),
    }
}

/// TFRecords whose labels read but whose images the reader never takes opened, every record bad
/// at the first batch (a hostile try's had two values in `image/encoded`; here the image is
/// under another feature name, which fails the same `example::bytes` check): refused at open
/// naming the first, with a notice where only some are so.
#[test]
fn tfrecords_without_an_image_the_reader_takes_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let image = jpeg();
    let write = |name: &str, imageless: &[bool]| {
        let mut shard = Vec::new();
        let mut record = Vec::new();
        for &without in imageless {
            let feature = if without {
                "image/raw"
            } else {
                tfrecord::features::ENCODED
            };
            example::encode(
                &mut record,
                &[
                    (feature, example::FeatureValue::Bytes(&image)),
                    (tfrecord::features::LABEL, example::FeatureValue::Int64(1)),
                ],
            );
            tfrecord::frame(&mut shard, &record);
        }
        let path = dir.path().join(name);
        fs::write(&path, shard).unwrap();
        path
    };
    let none = write("none.tfrecord", &[true, true, true]);
    match format::open(&none) {
        Err(Error::NotADataset { reason, .. }) => assert!(
            reason.contains("no labelled record has an image")
                && reason.contains("record 0: no image/encoded feature"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    let some = write("some.tfrecord", &[false, true, false]);
    let dataset = format::open(&some).unwrap();
    assert_eq!(dataset.len(), 3);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("1 of 3 records have a label and no image")
                && n.contains("record 1: no image/encoded feature")),
        "{:?}",
        dataset.notices()
    );
}

#[test]
fn hostile_tfrecord_labels_and_label_bases_are_bad_records_not_panics() {
    // Regression: a label of 2^63-1 or 2^40 made a huge class table; --input-label-base 1 with
    // a label of 0 or i64::MIN panicked with "capacity overflow".
    let dir = tempfile::tempdir().unwrap();
    let shard_dir = dir.path().join("tf");
    let labels = [1, i64::MAX, 0, i64::MIN, 1 << 40, 3, (1 << 31) - 1];
    let names: Vec<String> = (0..labels.len()).map(|i| format!("n{i}.jpg")).collect();
    let recs: Vec<(i64, &[u8])> = labels
        .iter()
        .zip(&names)
        .map(|(&l, n)| (l, n.as_bytes()))
        .collect();
    write_shard(&shard_dir, &recs);
    let options = OpenOptions::default().with_label_base(1);
    let dataset = format::open_with(&shard_dir, &options).unwrap();
    assert_eq!(dataset.classes(), ["0", "1", "2"]);
    let mut reader = dataset.open_reader().unwrap();
    let good: Vec<usize> = (0..labels.len())
        .filter(|&i| reader.read(i).is_ok())
        .collect();
    assert_eq!(good, [0, 5]);
    let text = corrupt_record_text(&reader.read(3).unwrap_err());
    assert!(
        text.contains("n3.jpg") && text.contains(&i64::MIN.to_string()),
        "{text}"
    );
    let out = dir.path().join("tf.lmdb");
    let summary = pack::convert_with(
        &shard_dir,
        &out,
        PackFormat::Lmdb,
        &small_options(),
        &options,
        &NoProgress,
    )
    .unwrap();
    assert_eq!((summary.samples, summary.rejected.len()), (2, 5));

    // A class count beyond what any dataset has is an options error, not an allocation.
    let huge = OpenOptions::default().with_num_classes(100_000_000_000);
    let err = format::open_with(&shard_dir, &huge).unwrap_err();
    assert!(
        matches!(err, Error::Config(_)) && err.to_string().contains(&MAX_CLASSES.to_string()),
        "{err}"
    );
}

#[cfg(feature = "hdf5")]
#[test]
fn a_nul_in_a_filename_is_a_rejected_record_when_converting_to_hdf5() {
    // Regression: a NUL byte in image/filename panicked the HDF5 writer and left .partial.
    let dir = tempfile::tempdir().unwrap();
    let shard_dir = dir.path().join("tf");
    write_shard(
        &shard_dir,
        &[(0, b"ok.jpg"), (1, b"bad\0name.jpg"), (1, b"fine.jpg")],
    );
    let out = dir.path().join("out.h5");
    let summary = pack::convert(
        &shard_dir,
        &out,
        PackFormat::Hdf5,
        &small_options(),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(summary.samples, 2);
    assert_eq!(summary.rejected.len(), 1);
    assert!(
        summary.rejected[0].reason.contains("NUL"),
        "{:?}",
        summary.rejected
    );
    assert!(!format::staging::partial_path(&out).exists());
    assert!(verify::verify(&out, None).unwrap().is_ok());
}

#[cfg(feature = "hdf5")]
#[test]
fn hostile_h5py_labels_are_bad_records_and_float_labels_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // h5py's layout: `images` (variable-length uint8, one element per sample) and `labels`.
    let make = |name: &str, labels: &dyn Fn(&hdf5::File)| h5py_file(&dir.path().join(name), labels);
    // Labels 2^40 and 2^31-1 beside 0 and 1: classes 0..=1, two bad records.
    let path = make("big.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[0i64, 1 << 40, 1, (1 << 31) - 1][..])
            .create("labels")
            .unwrap();
    });
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["0", "1"]);
    let mut reader = dataset.open_reader().unwrap();
    assert!(reader.read(0).is_ok() && reader.read(2).is_ok());
    let text = corrupt_record_text(&reader.read(1).unwrap_err());
    assert!(
        text.contains("big.h5") && text.contains("1099511627776"),
        "{text}"
    );
    assert_eq!(verify::verify(&path, None).unwrap().problems.len(), 2);

    // h5py's bool labels (an enum of FALSE and TRUE) are classes 0 and 1; they were refused as
    // values "that would be cut silently".
    let path = make("bool.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[false, true, true, false][..])
            .create("labels")
            .unwrap();
    });
    let labels: Vec<u32> = support::records(format::open(&path).unwrap().as_ref())
        .into_iter()
        .map(|(_, label, _)| label)
        .collect();
    assert_eq!(labels, [0, 1, 1, 0]);
    // A stored value that is neither (2, written over a TRUE) is true, as h5py reads it (it was
    // class 2, a hostile try found), never an invalid Rust bool.
    let mut bytes = fs::read(&path).unwrap();
    let at = bytes
        .windows(4)
        .position(|w| w == [0, 1, 1, 0])
        .expect("the labels are stored as they are");
    bytes[at + 1] = 2;
    fs::write(&path, &bytes).unwrap();
    let labels: Vec<u32> = support::records(format::open(&path).unwrap().as_ref())
        .into_iter()
        .map(|(_, label, _)| label)
        .collect();
    assert_eq!(labels, [0, 1, 1, 0]);

    // Labels that name no class at all (all negative; all past the two named classes) opened
    // and failed at the first batch: refused at open, saying what the first is.
    let negative = make("negative.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[-1i64, -2, -1, -7][..])
            .create("labels")
            .unwrap();
    });
    let past_names = make("past-names.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[2i64, 3, 2, 5][..])
            .create("labels")
            .unwrap();
        support::classes_attribute(f, &["cat", "dog"]);
    });
    for (path, says) in [
        (
            negative,
            "is a class number in 0..1048576 (the first is -1)",
        ),
        (past_names, "is a class number in 0..2 (the first is 2)"),
    ] {
        let err = format::open(&path).unwrap_err();
        assert!(
            matches!(&err, Error::NotADataset { reason, .. } if reason.contains(says)),
            "{err}"
        );
    }

    // Float labels were cut to integers silently; now the file is refused, saying why.
    let path = make("float.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[0.0f64, 1.5, 2.0, 0.25][..])
            .create("labels")
            .unwrap();
    });
    let err = format::open(&path).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("float.h5") && err.contains("labels must be integers"),
        "{err}"
    );

    // A labels dataset declaring 10^12 elements with no storage behind them is refused before
    // it is read into memory.
    let path = make("shape.h5", &|f| {
        f.new_dataset::<i64>()
            .shape(1_000_000_000_000usize)
            .create("labels")
            .unwrap();
    });
    let err = format::open(&path).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("shape.h5") && err.contains("declares shape"),
        "{err}"
    );

    // One label per image: (4,), (4, 1) and (1, 4) read alike; (2, 2), four values, was
    // flattened into four labels, and a one-hot (4, 2) is no list of class numbers.
    let shaped = |name: &str, shape: &[usize], values: &[i64]| {
        make(name, &|f| {
            f.new_dataset_builder()
                .with_data(&ndarray::ArrayD::from_shape_vec(shape, values.to_vec()).unwrap())
                .create("labels")
                .unwrap();
        })
    };
    for shape in [&[4usize][..], &[4, 1], &[1, 4]] {
        let path = shaped(&format!("labels-{shape:?}.h5"), shape, &[0, 1, 1, 0]);
        let labels: Vec<u32> = support::records(format::open(&path).unwrap().as_ref())
            .into_iter()
            .map(|(_, label, _)| label)
            .collect();
        assert_eq!(labels, [0, 1, 1, 0], "{shape:?}");
    }
    // Class names from the `classes` attribute, unless two classes share one (a hostile try:
    // `class_to_idx` kept only one of them): then numbers, with a notice.
    for (listed, expected) in [
        (["cat", "dog"], ["cat", "dog"]),
        (["cat", "cat"], ["0", "1"]),
    ] {
        let path = make(&format!("classes-{}.h5", listed.join("-")), &|f| {
            f.new_dataset_builder()
                .with_data(&[0i64, 1, 1, 0][..])
                .create("labels")
                .unwrap();
            support::classes_attribute(f, &listed);
        });
        let dataset = format::open(&path).unwrap();
        assert_eq!(dataset.classes(), expected, "{listed:?}");
        assert_eq!(
            dataset.notices().iter().any(|n| n.contains(
                "the file's \"classes\" attribute names classes 0 and 1 alike (\"cat\")"
            )),
            listed[0] == listed[1],
            "{:?}",
            dataset.notices()
        );
    }
    // Fixed-length names (h5py's `np.array(names, dtype="S")`), ASCII and UTF-8, short and
    // long: a hostile try found them ignored, the classes named by number without a word.
    fn fixed_names<const N: usize>(f: &hdf5::File, listed: &[&str]) {
        let names: Vec<hdf5::types::FixedAscii<N>> = listed
            .iter()
            .map(|n| hdf5::types::FixedAscii::from_ascii(n.as_bytes()).unwrap())
            .collect();
        f.new_attr::<hdf5::types::FixedAscii<N>>()
            .shape(listed.len())
            .create("classes")
            .unwrap()
            .write(&names)
            .unwrap();
    }
    let long = "n".repeat(300);
    for (name, listed) in [
        ("fixed-short.h5", ["cat", "dog"]),
        ("fixed-long.h5", ["a", long.as_str()]),
    ] {
        let path = make(name, &|f| {
            f.new_dataset_builder()
                .with_data(&[0i64, 1, 1, 0][..])
                .create("labels")
                .unwrap();
            if listed[1].len() > 8 {
                fixed_names::<512>(f, &listed);
            } else {
                fixed_names::<8>(f, &listed);
            }
        });
        assert_eq!(format::open(&path).unwrap().classes(), listed, "{name}");
    }
    let path = make("fixed-utf8.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[0i64, 1, 1, 0][..])
            .create("labels")
            .unwrap();
        let names: Vec<hdf5::types::FixedUnicode<12>> = ["chat", "chien é"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        f.new_attr::<hdf5::types::FixedUnicode<12>>()
            .shape(2)
            .create("classes")
            .unwrap()
            .write(&names)
            .unwrap();
    });
    assert_eq!(format::open(&path).unwrap().classes(), ["chat", "chien é"]);
    // An attribute that is no list of names is not read, with a notice: a (3, 2) array of
    // synsets and names was read as six classes (label 1 named "tench"), a scalar string as
    // one class, an empty list gave a refusal about labels.
    let vlen = support::vlen_strings;
    let pairs = vlen(&["n0", "tench", "n1", "goldfish", "n2", "shark"]);
    let labelled = |f: &hdf5::File| {
        f.new_dataset_builder()
            .with_data(&[0i64, 1, 2, 0][..])
            .create("labels")
            .unwrap();
    };
    for (name, shape, names, says) in [
        (
            "pairs.h5",
            vec![3usize, 2],
            pairs.clone(),
            "has shape [3, 2]",
        ),
        ("scalar.h5", vec![], vlen(&["cat,dog,eel"]), "has shape []"),
        ("none.h5", vec![0], vec![], "names no class"),
    ] {
        let path = make(name, &|f| {
            labelled(f);
            f.new_attr::<hdf5::types::VarLenUnicode>()
                .shape(shape.clone())
                .create("classes")
                .unwrap()
                .write_raw(&names)
                .unwrap();
        });
        let dataset = format::open(&path).unwrap();
        assert_eq!(dataset.classes(), ["0", "1", "2"], "{name}");
        assert!(
            dataset
                .notices()
                .iter()
                .any(|n| n.contains("the file's \"classes\" attribute") && n.contains(says)),
            "{name}: {:?}",
            dataset.notices()
        );
    }
    // The file's names and the labels dataset's differ: the file's are read, and a notice says.
    let path = make("two-lists.h5", &|f| {
        labelled(f);
        support::classes_attribute(f, &["a", "b", "c"]);
        support::classes_attribute(&f.dataset("labels").unwrap(), &["x", "y", "z"]);
    });
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["a", "b", "c"]);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("attribute name different classes (\"a\", \"b\", \"c\" and \"x\"")),
        "{:?}",
        dataset.notices()
    );
    // Names in a root `classes` dataset (`f["classes"] = names`) or on the images dataset were
    // ignored without a word (a hostile try): read, the root attribute first, a notice where
    // two places differ.
    let names_dataset = |f: &hdf5::File, names: &[&str]| {
        f.new_dataset_builder()
            .with_data(vlen(names).as_slice())
            .create("classes")
            .unwrap();
    };
    let path = make("names-dataset.h5", &|f| {
        labelled(f);
        names_dataset(f, &["tench", "goldfish", "shark"]);
    });
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["tench", "goldfish", "shark"]);
    assert!(dataset.notices().is_empty(), "{:?}", dataset.notices());
    let path = make("names-on-images.h5", &|f| {
        labelled(f);
        support::classes_attribute(&f.dataset("images").unwrap(), &["p", "q", "r"]);
        names_dataset(f, &["p", "q", "s"]);
    });
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["p", "q", "r"]);
    assert!(
        dataset.notices().iter().any(|n| n.contains(
            "the \"images\" dataset's \"classes\" attribute and the \"classes\" dataset name \
             different classes"
        )),
        "{:?}",
        dataset.notices()
    );
    // A `classes` dataset of numbers is no list of names: a notice, classes by number.
    let path = make("numbers-dataset.h5", &|f| {
        labelled(f);
        f.new_dataset_builder()
            .with_data(&[7i64, 8, 9][..])
            .create("classes")
            .unwrap();
    });
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["0", "1", "2"]);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("the \"classes\" dataset is int64, not strings")),
        "{:?}",
        dataset.notices()
    );
    // The labels dataset itself named `classes` is not taken for names.
    let dir2 = tempfile::tempdir().unwrap();
    let path = h5py_file(&dir2.path().join("labels-named-classes.h5"), &|f| {
        f.new_dataset_builder()
            .with_data(&[0i64, 1, 1, 0][..])
            .create("classes")
            .unwrap();
    });
    let names = imagefeed::format::hdf5::Hdf5Names {
        images: "images".into(),
        labels: "classes".into(),
    };
    let dataset = imagefeed::format::hdf5::Hdf5::open_with(&path, &names).unwrap();
    let dataset: &dyn imagefeed::Dataset = &dataset;
    assert_eq!(dataset.classes(), ["0", "1"]);
    assert!(dataset.notices().is_empty(), "{:?}", dataset.notices());
    for (shape, values) in [
        (&[2usize, 2][..], &[0i64, 1, 1, 0][..]),
        (&[4, 2], &[1, 0, 0, 1, 0, 1, 1, 0]),
        (&[4, 1, 1], &[0, 1, 1, 0]),
    ] {
        let path = shaped(&format!("labels-{shape:?}.h5"), shape, values);
        let err = format::open(&path).unwrap_err();
        assert!(
            matches!(&err, Error::NotADataset { reason, .. } if reason.contains("one integer per image")),
            "{shape:?}: {err}"
        );
    }
}

#[cfg(feature = "hdf5")]
#[test]
fn h5py_enum_labels_are_classes_named_by_their_members() {
    // h5py's `enum_dtype({"cat": 0, "dog": 1, "eel": 2}, basetype="u1")` labels were refused
    // ("holds enum values").
    #[derive(hdf5::H5Type, Clone, Copy)]
    #[repr(u8)]
    enum Animal {
        Cat = 0,
        Dog = 1,
        Eel = 2,
    }
    #[derive(hdf5::H5Type, Clone, Copy)]
    #[repr(i16)]
    enum Gapped {
        Low = 0,
        High = 5,
    }
    let dir = tempfile::tempdir().unwrap();
    let make = |name: &str, labels: &dyn Fn(&hdf5::File)| h5py_file(&dir.path().join(name), labels);
    let labels_of = |dataset: &dyn imagefeed::Dataset| -> Vec<u32> {
        support::records(dataset)
            .into_iter()
            .map(|(_, label, _)| label)
            .collect()
    };
    let path = make("enum.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[Animal::Eel, Animal::Cat, Animal::Dog, Animal::Eel][..])
            .create("labels")
            .unwrap();
    });
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["Cat", "Dog", "Eel"]);
    assert!(dataset.notices().is_empty(), "{:?}", dataset.notices());
    assert_eq!(labels_of(dataset.as_ref()), [2, 0, 1, 2]);

    // Members not numbered 0..N: the values are still the classes, named by number.
    let path = make("gapped.h5", &|f| {
        f.new_dataset_builder()
            .with_data(&[Gapped::High, Gapped::Low, Gapped::Low, Gapped::High][..])
            .create("labels")
            .unwrap();
    });
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["0", "1", "2", "3", "4", "5"]);
    assert_eq!(labels_of(dataset.as_ref()), [5, 0, 0, 5]);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("enum type numbers its 2 members otherwise than 0..2")),
        "{:?}",
        dataset.notices()
    );
}

#[cfg(feature = "hdf5")]
#[test]
fn an_hdf5_key_that_is_not_utf8_is_an_error_naming_its_index_not_an_invalid_string() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("keys.h5");
    pack::pack_image_folder(
        &fixture_root(),
        &out,
        PackFormat::Hdf5,
        &small_options(),
        &NoProgress,
    )
    .unwrap();
    let mut bytes = fs::read(&out).unwrap();
    let key = b"class02/img00001.jpg";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the key is stored as is");
    bytes[at] = 0xFF; // no longer UTF-8
    fs::write(&out, &bytes).unwrap();
    let err = format::open(&out).unwrap_err();
    assert!(
        matches!(err, Error::CorruptRecord { .. }) && err.to_string().contains("not UTF-8"),
        "{err}"
    );
}

/// The places of LMDB nodes `key` (8 bytes) with an inline value: the offsets of their
/// headers (`mn_lo`, `mn_hi`, `mn_flags`, `mn_ksize`, then the key). Copy-on-write leaves
/// earlier versions of a page in the file, so there are several: the live one among them.
fn inline_nodes(file: &[u8], key: &[u8; 8]) -> Vec<usize> {
    let found: Vec<usize> = file
        .windows(16)
        .enumerate()
        .filter(|(_, w)| w[4..6] == [0, 0] && w[6..8] == [8, 0] && &w[8..16] == key)
        .map(|(at, _)| at)
        .collect();
    assert!(!found.is_empty(), "no node with key {key:?}");
    found
}

/// #30's finding 2: a flipped high byte of an LMDB node's value size made liblmdb hand back a
/// slice running gigabytes past the map, and the checksum over it killed the process with
/// SIGSEGV. Every value is now checked against the map first: the record is a bad record
/// saying why, the others read, and `verify` reports it.
#[test]
fn an_lmdb_value_size_past_the_file_is_a_bad_record_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("train.lmdb");
    support::pack_as(&fixture_root(), &out, PackFormat::Lmdb, &small_options());
    let mut bytes = fs::read(&out).unwrap();
    for node in inline_nodes(&bytes, &3u64.to_be_bytes()) {
        bytes[node + 2..node + 4].copy_from_slice(&[0xff, 0x7f]); // mn_hi: ~2 GiB
    }
    fs::write(&out, &bytes).unwrap();

    let ds = format::open(&out).unwrap();
    let mut reader = ds.open_reader().unwrap();
    match reader.read(3) {
        Err(Error::CorruptRecord { index, reason, .. }) => {
            assert_eq!(index, 3);
            assert!(reason.contains("past the file's end"), "{reason}");
        }
        Err(other) => panic!("expected a corrupt record, got {other}"),
        Ok(record) => panic!("read {} bytes past the file", record.payload.len()),
    }
    for index in (0..ds.len()).filter(|&i| i != 3) {
        reader.read(index).unwrap();
    }
    drop((reader, ds));
    let report = verify::verify(&out, None).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(
        report.problems[0].problem.contains("past the file's end"),
        "{:?}",
        report.problems
    );
}

/// Opens `path` and reads every record: an error at open must be `NotADataset` naming the file;
/// an opened file must hand out, for each record it reads, exactly the pristine record.
fn opens_refused_or_reads_true(path: &Path, pristine: &[support::Row], what: &str) -> bool {
    let ds = match format::open(path) {
        Err(Error::NotADataset {
            path: named,
            reason,
        }) => {
            assert_eq!(named, path, "{what}: {reason}");
            return false;
        }
        Err(other) => panic!("{what}: expected not-a-dataset, got {other}"),
        Ok(ds) => ds,
    };
    let mut reader = ds.open_reader().unwrap();
    for (index, want) in pristine.iter().enumerate() {
        if let Ok(record) = reader.read(index) {
            let got = (
                record.key.to_string(),
                record.label,
                record.payload.to_vec(),
            );
            assert_eq!(&got, want, "{what}: record {index} handed out wrong");
        }
    }
    true
}

/// #30's finding 3: a leaf node's flags flipped to "duplicates" (`F_DUPDATA`) sent liblmdb into
/// a sub-cursor over the value's bytes: SIGSEGV in `mdb_xcursor_init1`, for our files and
/// py-lmdb's alike. Every page is now walked with checked code before liblmdb reads the file:
/// the file is refused, naming the page, or (a stale copy-on-write page) reads true.
#[test]
fn lmdb_node_flags_saying_duplicates_are_refused_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("train.lmdb");
    support::pack_as(&fixture_root(), &ours, PackFormat::Lmdb, &small_options());
    let theirs = support::fixture_root()
        .parent()
        .unwrap()
        .join("compat/folder2lmdb.lmdb");
    for pristine_path in [ours, theirs] {
        let pristine_bytes = fs::read(&pristine_path).unwrap();
        let pristine = support::records(&*format::open(&pristine_path).unwrap());
        let flags = support::lmdb_pages::leaf_node_flags(&pristine_bytes);
        assert!(flags.len() > 4, "{}: {flags:?}", pristine_path.display());
        let damaged = dir.path().join("damaged.lmdb");
        // Every leaf node at once: the live tree is hit, so the file is refused.
        let mut bytes = pristine_bytes.clone();
        for &at in &flags {
            bytes[at] = 0x04;
        }
        fs::write(&damaged, &bytes).unwrap();
        match format::open(&damaged) {
            Err(Error::NotADataset { reason, .. }) => {
                assert!(
                    reason.contains("damaged LMDB") && reason.contains("page"),
                    "{reason}"
                )
            }
            Err(other) => panic!("expected not-a-dataset, got {other}"),
            Ok(_) => panic!(
                "{}: opened with every node damaged",
                pristine_path.display()
            ),
        }
        // One node at a time.
        let mut refused = 0;
        for &at in &flags {
            let mut bytes = pristine_bytes.clone();
            bytes[at] = 0x04;
            fs::write(&damaged, &bytes).unwrap();
            let what = format!("{} with the node flags at {at}", pristine_path.display());
            if !opens_refused_or_reads_true(&damaged, &pristine, &what) {
                refused += 1;
            }
        }
        assert!(refused > 0, "{}", pristine_path.display());
    }
}

/// `pickle.dumps` of a list naming one `text` `count` times by memo reference: a few bytes per
/// item, however long the text.
fn pickled_repeated_text(text: &str, count: usize) -> Vec<u8> {
    let mut out = b"\x80\x04X".to_vec();
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(b"q\x00](");
    for _ in 0..count {
        out.extend_from_slice(b"h\x00");
    }
    out.extend_from_slice(b"e.");
    out
}

/// Found by a hostile review: `__keys__` naming one 1 MiB text 100,000 times (a 1.2 MB value)
/// was copied key by key before its length was compared with `__len__`: 100 GB (the review's
/// million names: 1 TB), an abort. Both are checked first now.
#[test]
fn a_folder2lmdb_keys_list_repeating_one_long_text_is_refused_before_copying() {
    let dir = tempfile::tempdir().unwrap();
    let long = "k".repeat(1 << 20);
    for (len, count, expected) in [
        (2, 100_000, "__len__ is 2 but __keys__ lists 100000 keys"),
        (1_000, 1_000, "__keys__ repeats its keys"),
    ] {
        let path = dir.path().join(format!("keys-{len}.lmdb"));
        let mut entries: Vec<(Vec<u8>, Vec<u8>)> = (0..len)
            .map(|i| (i.to_string().into_bytes(), pickled(&jpeg(), 0)))
            .collect();
        entries.push((b"__len__".to_vec(), pickled_int(len as i64)));
        entries.push((b"__keys__".to_vec(), pickled_repeated_text(&long, count)));
        write_folder2lmdb(&path, &entries);
        match format::open(&path) {
            Err(Error::NotADataset { reason, .. }) => {
                assert!(reason.contains(expected), "{reason}")
            }
            Err(other) => panic!("expected not-a-dataset, got {other}"),
            Ok(_) => panic!("opened"),
        }
    }
}

/// Found by a hostile try of the Python package: `__keys__` listing the key "0" twelve times
/// (of twelve records) read as twelve copies of record 0, the other eleven never read, with no
/// error. A key listed twice is refused at open, naming it.
#[test]
fn a_folder2lmdb_keys_list_naming_a_key_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (keys, twice) in [
        (vec!["0", "0", "0"], Some("0")),
        (vec!["0", "1", "2", "1"], Some("1")),
        (vec!["2", "0", "1"], None),
    ] {
        let path = dir.path().join(format!("keys-{}.lmdb", keys.join("")));
        let mut entries: Vec<(Vec<u8>, Vec<u8>)> = (0..keys.len())
            .map(|i| (i.to_string().into_bytes(), pickled(&jpeg(), i as i64)))
            .collect();
        entries.push((b"__len__".to_vec(), pickled_int(keys.len() as i64)));
        entries.push((b"__keys__".to_vec(), pickled_keys(&keys)));
        write_folder2lmdb(&path, &entries);
        match (format::open(&path), twice) {
            (Err(Error::NotADataset { reason, .. }), Some(key)) => {
                assert!(
                    reason.contains(&format!("the key {key:?} more than once")),
                    "{reason}"
                )
            }
            (Ok(dataset), None) => assert_eq!(dataset.len(), keys.len()),
            (Err(other), _) => panic!("{keys:?}: {other}"),
            (Ok(_), Some(_)) => panic!("{keys:?}: opened"),
        }
    }
}

/// Records `__keys__` does not name are not read, as folder2lmdb reads them, and the open says
/// how many (a hostile try's 12 records under 8 keys read as 8 without a word); a listing that
/// names every record says nothing.
#[test]
fn a_folder2lmdb_file_holding_records_its_keys_do_not_name_says_so() {
    let dir = tempfile::tempdir().unwrap();
    for (stored, listed) in [(12usize, 8usize), (5, 5)] {
        let path = dir.path().join(format!("keys-{stored}-{listed}.lmdb"));
        let keys: Vec<String> = (0..listed).map(|i| format!("k{i}")).collect();
        let mut entries: Vec<(Vec<u8>, Vec<u8>)> = (0..stored)
            .map(|i| {
                (
                    format!("k{i}").into_bytes(),
                    pickled(&jpeg(), (i % 2) as i64),
                )
            })
            .collect();
        entries.push((b"__len__".to_vec(), pickled_int(listed as i64)));
        entries.push((b"__keys__".to_vec(), pickled_keys(&keys)));
        write_folder2lmdb(&path, &entries);
        let dataset = format::open(&path).unwrap();
        assert_eq!(dataset.len(), listed);
        let said = dataset.notices().iter().any(|n| {
            n.contains(&format!(
                "holds {} entries that __keys__ does not name",
                stored - listed
            ))
        });
        assert_eq!(said, stored > listed, "{:?}", dataset.notices());
    }
}

/// Values of more than (image, label) are read as folder2lmdb's loader reads them (the first
/// two items), and the open says so rather than take the second of (image, coarse, fine)
/// without a word.
#[test]
fn folder2lmdb_values_longer_than_image_and_label_are_named_in_a_notice() {
    let dir = tempfile::tempdir().unwrap();
    let image = jpeg();
    // (bytes, coarse, fine): TUPLE3.
    let triple = |coarse: u8, fine: u8| {
        let mut out = b"\x80\x04B".to_vec();
        out.extend_from_slice(&(image.len() as u32).to_le_bytes());
        out.extend_from_slice(&image);
        out.extend_from_slice(&[b'K', coarse, b'K', fine, 0x87, b'.']);
        out
    };
    let path = dir.path().join("triples.lmdb");
    write_folder2lmdb(
        &path,
        &[
            (b"0".to_vec(), triple(1, 7)),
            (b"1".to_vec(), triple(0, 3)),
            (b"__len__".to_vec(), pickled_int(2)),
        ],
    );
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["0", "1"]);
    assert!(
        dataset.notices().iter().any(|n| n
            .contains("2 of 2 values are tuples of more than (image, label) (the first, record 0 (key \"0\"), of 3 items)")),
        "{:?}",
        dataset.notices()
    );
    let mut reader = dataset.open_reader().unwrap();
    assert_eq!(reader.read(0).unwrap().label, 1);
}

/// A folder2lmdb file without `__keys__` whose `__len__` is short of its records: they are
/// read as folder2lmdb reads them (keys 0..__len__), with a notice that more are stored (a
/// hostile try's 30 records under `__len__` 20 read as 20 without a word).
#[test]
fn a_folder2lmdb_len_short_of_its_records_is_read_with_a_notice() {
    let dir = tempfile::tempdir().unwrap();
    for (len, stored, noticed) in [(2usize, 3usize, true), (3, 3, false)] {
        let path = dir.path().join(format!("len-{len}-{stored}.lmdb"));
        let mut entries: Vec<(Vec<u8>, Vec<u8>)> = (0..stored)
            .map(|i| (i.to_string().into_bytes(), pickled(&jpeg(), 0)))
            .collect();
        entries.push((b"__len__".to_vec(), pickled_int(len as i64)));
        write_folder2lmdb(&path, &entries);
        let dataset = format::open(&path).unwrap();
        assert_eq!(dataset.len(), len);
        assert_eq!(
            dataset
                .notices()
                .iter()
                .any(|n| n.contains(&format!("under the key \"{len}\", past __len__"))),
            noticed,
            "{:?}",
            dataset.notices()
        );
    }
}

/// The overflow page number and the first key of the live leaf of a folder2lmdb file's main
/// database (one leaf: a small file): (offset of node `i`'s header, of its overflow number).
fn folder2lmdb_leaf_nodes(bytes: &[u8]) -> Vec<(usize, Option<usize>)> {
    let size = support::lmdb_pages::page_size(bytes);
    let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
    let page = support::lmdb_pages::main_root(bytes) * size;
    assert_eq!(u16_at(page + 10) & 0x02, 0x02, "the root is a leaf");
    (0..(u16_at(page + 12) - 16) / 2)
        .map(|i| {
            let node = page + u16_at(page + 16 + 2 * i);
            let data = node + 8 + u16_at(node + 6);
            (node, (u16_at(node + 4) == 0x01).then_some(data))
        })
        .collect()
}

/// Found by a hostile review: in a folder2lmdb file (no checksums), one flipped bit of a
/// value's overflow page number pointed it at its neighbour's value, and a renamed key gave a
/// leaf two equal keys: each handed out another record's image and label as good. The page
/// walk now gives each value's pages to it alone and checks that keys rise.
#[test]
fn a_folder2lmdb_value_on_anothers_pages_or_keys_out_of_order_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f2l.lmdb");
    let image = vec![7u8; 9000]; // three pages: on overflow pages of its own
    let entries: Vec<(Vec<u8>, Vec<u8>)> = (0..4)
        .map(|i| (i.to_string().into_bytes(), pickled(&image, i)))
        .chain([(b"__len__".to_vec(), pickled_int(4))])
        .collect();
    write_folder2lmdb(&path, &entries);
    let pristine = fs::read(&path).unwrap();
    let nodes = folder2lmdb_leaf_nodes(&pristine);
    let overflow: Vec<usize> = nodes.iter().filter_map(|n| n.1).collect();
    assert!(overflow.len() >= 2, "{nodes:?}");

    // Value 1 on value 0's pages.
    let mut bytes = pristine.clone();
    let first = bytes[overflow[0]..overflow[0] + 8].to_vec();
    bytes[overflow[1]..overflow[1] + 8].copy_from_slice(&first);
    fs::write(&path, &bytes).unwrap();
    match format::open(&path) {
        Err(Error::NotADataset { reason, .. }) => assert!(reason.contains("twice"), "{reason}"),
        other => panic!("expected not-a-dataset, got {:?}", other.err()),
    }
    // Key "1" renamed "2": two equal keys on the leaf.
    let mut bytes = pristine.clone();
    let key_at = nodes[1].0 + 8;
    assert_eq!(bytes[key_at], b'1');
    bytes[key_at] = b'2';
    fs::write(&path, &bytes).unwrap();
    match format::open(&path) {
        Err(Error::NotADataset { reason, .. }) => {
            assert!(reason.contains("out of order"), "{reason}")
        }
        other => panic!("expected not-a-dataset, got {:?}", other.err()),
    }
}

/// Found by a hostile review: a branch page with a single child passes liblmdb's release build
/// but aborts its debug build (an assertion in `mdb_page_search_root`, the build tests use).
/// The walk refuses branch pages with fewer than two children.
#[test]
fn an_lmdb_branch_page_with_one_child_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deep.lmdb");
    let entries: Vec<(Vec<u8>, Vec<u8>)> = (0..400)
        .map(|i| (format!("{i:04}").into_bytes(), pickled(&[i as u8; 100], 0)))
        .chain([(b"__len__".to_vec(), pickled_int(400))])
        .collect();
    write_folder2lmdb(&path, &entries);
    let mut bytes = fs::read(&path).unwrap();
    let size = support::lmdb_pages::page_size(&bytes);
    let root = support::lmdb_pages::main_root(&bytes);
    assert_eq!(
        bytes[root * size + 10] & 0x01,
        0x01,
        "400 values need a branch page"
    );
    bytes[root * size + 12..root * size + 14].copy_from_slice(&18u16.to_le_bytes());
    fs::write(&path, &bytes).unwrap();
    match format::open(&path) {
        Err(Error::NotADataset { reason, .. }) => {
            assert!(reason.contains("node table at 16..18"), "{reason}")
        }
        other => panic!("expected not-a-dataset, got {:?}", other.err()),
    }
}
