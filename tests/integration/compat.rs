//! Datasets other tools made (fixtures/compat, written by py-lmdb through
//! scripts/make_compat_fixtures.py), and other tools reading what we make.

use crate::support;

use std::fs;
use std::path::Path;

use imagefeed::dataset::Dataset as _;
use imagefeed::format::folder::ImageFolder;
use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig};
use imagefeed::transform::Transform;
use imagefeed::{Error, format};
use support::{
    BROKEN, fixture_records_without_broken, fixture_root, pack_lmdb, python_rows, python_with,
    records, run_python_on_fixture_files, small_options,
};

pub(crate) fn compat(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/compat")
        .join(name)
}

#[test]
fn python_folder2lmdb_files_read_like_their_source_tree() {
    let source = ImageFolder::open(fixture_root()).unwrap();
    let expected: Vec<(String, u32, Vec<u8>)> = source
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            (
                i.to_string(),
                e.label,
                fs::read(source.file_path(i)).unwrap(),
            )
        })
        .collect();
    for path in [compat("folder2lmdb.lmdb"), compat("folder2lmdb-dir")] {
        let dataset = format::open(&path).unwrap();
        assert_eq!(dataset.len(), 20, "{}", path.display());
        // No class names are stored: 0..=max label.
        assert_eq!(dataset.classes(), ["0", "1", "2"]);
        assert_eq!(records(dataset.as_ref()), expected, "{}", path.display());
    }
}

#[test]
fn the_loader_reports_the_broken_files_inside_a_python_lmdb() {
    let config = LoaderConfig::default()
        .with_batch_size(5)
        .with_shuffle(false)
        .with_transform(Transform::cifar())
        .with_bad_samples(BadSamplePolicy::Skip);
    // 4 of the 20 files are broken: far over the default cap (1%), so by default the epoch
    // stops with an error instead of ending as if it were complete.
    let capped = Loader::new(
        format::open(compat("folder2lmdb.lmdb")).unwrap(),
        config.clone(),
    )
    .unwrap();
    let stopped = capped.epoch(0).find_map(Result::err);
    assert!(
        matches!(stopped, Some(imagefeed::Error::TooManyBadSamples { .. })),
        "{stopped:?}"
    );
    let loader = Loader::new(
        format::open(compat("folder2lmdb.lmdb")).unwrap(),
        config.with_max_bad(None),
    )
    .unwrap();
    let source = ImageFolder::open(fixture_root()).unwrap();
    let mut bad = Vec::new();
    let mut good = 0;
    for batch in loader.epoch(0) {
        let batch = batch.unwrap();
        good += batch.len();
        bad.extend(
            batch
                .bad
                .iter()
                .map(|b| source.entries()[b.index].key.clone()),
        );
        assert!(
            batch.bad.iter().all(|b| b.key == b.index.to_string()),
            "{:?}",
            batch.bad
        );
    }
    bad.sort();
    assert_eq!(good, 16);
    assert_eq!(bad, BROKEN);
}

/// folder2lmdb files written with every pickle protocol, by the Python 3 scripts and the
/// Python 2 era ones (protocol 2 and 0), with labels as Python ints or NumPy integer scalars
/// (labels taken from a NumPy array): every one reads with the files' bytes and labels.
#[test]
fn folder2lmdb_files_of_every_pickle_protocol_and_numpy_labels_read() {
    let Some(python) = python_with("lmdb, numpy") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import os, pickle, sys
import lmdb, numpy as np
out, files = sys.argv[1], sys.argv[2:]
labels = np.array([int(l) for l in os.environ["LABELS"].split(",")], dtype=np.int64)
for protocol in range(6):
    for numpy_labels in (False, True):
        path = os.path.join(out, f"p{protocol}-{'numpy' if numpy_labels else 'int'}.lmdb")
        db = lmdb.open(path, subdir=False, map_size=1 << 26, readonly=False)
        with db.begin(write=True) as txn:
            for i, f in enumerate(files):
                label = labels[i] if numpy_labels else int(labels[i])
                txn.put(str(i).encode(), pickle.dumps((open(f, "rb").read(), label), protocol=protocol))
            keys = [str(i).encode() for i in range(len(files))]
            txn.put(b"__keys__", pickle.dumps(keys, protocol=protocol))
            txn.put(b"__len__", pickle.dumps(len(keys), protocol=protocol))
        db.sync(); db.close()
        print(path)
"#;
    let expected = fixture_records_without_broken();
    let written = run_python_on_fixture_files(&python, script, dir.path(), &expected);
    assert_eq!(written.len(), 12);
    let want: Vec<(u32, Vec<u8>)> = expected.into_iter().map(|(_, l, b)| (l, b)).collect();
    for path in written {
        let dataset = format::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let got: Vec<(u32, Vec<u8>)> = records(dataset.as_ref())
            .into_iter()
            .map(|(_, l, b)| (l, b))
            .collect();
        assert_eq!(got, want, "{path}");
    }
}

/// The Python used for the cross-reads: $IMAGEFEED_PYTHON (make test points it at a virtual
/// environment with the `lmdb` package), else `python3`. `None`, with the reason printed, when it
/// or its `lmdb` package is missing.
#[test]
fn py_lmdb_reads_our_lmdb_as_the_readme_documents() {
    let Some(python) = python_with("lmdb") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ours.lmdb");
    pack_lmdb(&fixture_root(), &out, &small_options());
    // docs/formats.md's snippet, for every record, printed as "key label payload-hex".
    let script = r#"
import json, lmdb, struct, sys
env = lmdb.open(sys.argv[1], subdir=False, readonly=True, lock=False, max_dbs=2)
meta, samples = env.open_db(b"meta"), env.open_db(b"samples")  # before the transaction
with env.begin() as txn:
    info = json.loads(txn.get(b"info", db=meta))
    for i in range(info["num_samples"]):
        v = txn.get(i.to_bytes(8, "big"), db=samples)
        label, k = struct.unpack_from("<II", v)
        print(v[8:8 + k].decode(), label, v[8 + k:].hex())
"#;
    let got = python_rows(&python, script, &[&out]);
    let expected = fixture_records_without_broken();
    assert_eq!(got, expected);
}

#[test]
fn convert_rewrites_a_python_lmdb_into_ours() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("converted.lmdb");
    let summary = imagefeed::pack::convert(
        &compat("folder2lmdb.lmdb"),
        &out,
        imagefeed::pack::PackFormat::Lmdb,
        &small_options(),
        &imagefeed::pack::NoProgress,
    )
    .unwrap();
    assert_eq!(summary.samples, 16);
    // The broken images stored unchecked by the Python script are rejected by key, with reasons.
    let source = ImageFolder::open(fixture_root()).unwrap();
    let mut rejected: Vec<String> = summary
        .rejected
        .iter()
        .map(|r| {
            source.entries()[r.key.parse::<usize>().unwrap()]
                .key
                .clone()
        })
        .collect();
    rejected.sort();
    assert_eq!(rejected, BROKEN);
    let converted = format::open(&out).unwrap();
    assert_eq!(converted.classes(), ["0", "1", "2"]);
    let python = format::open(compat("folder2lmdb.lmdb")).unwrap();
    let keep: Vec<_> = records(python.as_ref())
        .into_iter()
        .filter(|(key, _, _)| !summary.rejected.iter().any(|r| &r.key == key))
        .collect();
    assert_eq!(records(converted.as_ref()), keep);
    assert!(imagefeed::verify::verify(&out, None).unwrap().is_ok());

    // Refuses to overwrite its own source.
    let err = imagefeed::pack::convert(
        &out,
        &out,
        imagefeed::pack::PackFormat::Lmdb,
        &small_options().with_mode(imagefeed::pack::StartMode {
            force: true,
            resume: false,
        }),
        &imagefeed::pack::NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(err, imagefeed::Error::NotReplaceable { .. })
            && err.to_string().contains("it is the source being packed"),
        "{err}"
    );
}

/// The fixture tree's image files (broken ones included) as (relative key, label, bytes), in
/// ImageFolder order: what the Python scripts wrote into the h5py and tfrecord fixtures.
fn fixture_files() -> Vec<(String, u32, Vec<u8>)> {
    let source = ImageFolder::open(fixture_root()).unwrap();
    source
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            (
                e.key.clone(),
                e.label,
                fs::read(source.file_path(i)).unwrap(),
            )
        })
        .collect()
}

#[cfg(feature = "hdf5")]
#[test]
fn h5py_variable_length_files_read_like_their_source_tree() {
    let dataset = format::open(compat("h5py-vlen.h5")).unwrap();
    let expected = fixture_files();
    assert_eq!(dataset.len(), expected.len());
    // Class names come from the root `classes` attribute h5py wrote.
    assert_eq!(dataset.classes(), ["class00", "class01", "class02"]);
    let got = records(dataset.as_ref());
    for (i, ((key, label, payload), (_, want_label, want_payload))) in
        got.iter().zip(&expected).enumerate()
    {
        assert_eq!(key, &format!("images[{i}]"));
        assert_eq!((label, payload), (want_label, want_payload), "sample {i}");
    }
}

/// The pixel formula the fixture script used.
#[cfg(feature = "hdf5")]
fn fixture_pixel(i: usize, y: usize, x: usize, c: usize) -> u8 {
    ((i * 7 + y * 3 + x * 5 + c) % 256) as u8
}

#[cfg(feature = "hdf5")]
#[test]
fn h5py_pixel_arrays_read_as_raw_images_chunked_or_contiguous() {
    use imagefeed::decode::RawImage;
    use imagefeed::format::hdf5::{Hdf5, Hdf5Names};
    // Chunked + gzip, RGB, custom dataset names, int32 labels: read through the library.
    let names = Hdf5Names {
        images: "pixels".into(),
        labels: "targets".into(),
    };
    let rgb = Hdf5::open_with(compat("h5py-pixels.h5"), &names).unwrap();
    assert_eq!(rgb.len(), 6);
    assert_eq!(rgb.classes(), ["0", "1", "2"]);
    let rows = records(&rgb);
    for (i, (_, label, payload)) in rows.iter().enumerate() {
        assert_eq!(*label as usize, i % 3);
        let (w, h, pixels) = RawImage::parse(payload).unwrap();
        assert_eq!((w, h), (4, 5));
        let want: Vec<u8> = (0..5)
            .flat_map(|y| (0..4).flat_map(move |x| (0..3).map(move |c| fixture_pixel(i, y, x, c))))
            .collect();
        assert_eq!(pixels, want, "sample {i}");
    }
    // Contiguous grey N×H×W with uint8 labels: read with pread, grey replicated to RGB.
    let gray = format::open(compat("h5py-gray.h5")).unwrap();
    let rows = records(gray.as_ref());
    assert_eq!(rows.iter().map(|r| r.1).collect::<Vec<_>>(), [1, 0, 1, 0]);
    let (w, h, pixels) = RawImage::parse(&rows[3].2).unwrap();
    assert_eq!((w, h), (2, 3));
    let want: Vec<u8> = (0..3)
        .flat_map(|y| (0..2).flat_map(move |x| [fixture_pixel(3, y, x, 0); 3]))
        .collect();
    assert_eq!(pixels, want);
    use std::os::unix::fs::FileExt as _;
    // Rewritten in place after it was opened (h5py.File(path, "w") keeps the inode): the
    // file's error, not the new file's pixels under the old file's labels (a hostile try).
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("gray.h5");
    fs::copy(compat("h5py-gray.h5"), &copy).unwrap();
    let opened = format::open(&copy).unwrap();
    let mut reader = opened.open_reader().unwrap();
    assert_eq!(reader.read(3).unwrap().payload, &rows[3].2[..]);
    let mut bytes = fs::read(&copy).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff; // a pixel of the last sample, the size unchanged
    std::thread::sleep(std::time::Duration::from_millis(20)); // a later modification time
    fs::OpenOptions::new()
        .write(true)
        .open(&copy)
        .unwrap()
        .write_all_at(&bytes, 0)
        .unwrap();
    match reader.read(3) {
        Err(Error::FileChanged { path, change }) => {
            assert_eq!(path, copy);
            assert!(
                change.starts_with("its modification time changed"),
                "{change}"
            );
        }
        other => panic!("{:?}", other.map(|r| r.payload.to_vec())),
    }
    // Wrong names are a clear error listing what the file has.
    let err = format::open(compat("h5py-pixels.h5")).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("h5py-pixels.h5") && err.contains("pixels, targets"),
        "{err}"
    );
}

/// What the library logged in this test process, captured by a logger installed on first use.
fn logged() -> Vec<(log::Level, String)> {
    use std::sync::{Mutex, OnceLock};
    struct Capture(Mutex<Vec<(log::Level, String)>>);
    impl log::Log for Capture {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &log::Record<'_>) {
            let entry = (record.level(), record.args().to_string());
            self.0.lock().unwrap().push(entry);
        }
        fn flush(&self) {}
    }
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    let capture = CAPTURE.get_or_init(|| {
        let capture: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        log::set_logger(capture).expect("no other logger in this test binary");
        log::set_max_level(log::LevelFilter::Trace);
        capture
    });
    capture.0.lock().unwrap().clone()
}

#[test]
fn tfrecord_shards_without_an_index_get_one_in_memory_saved_on_request_and_read_like_their_source()
{
    use imagefeed::format::tfrecord::{Records, RecordsOptions};
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("tfrecord");
    support::copy_tree(&compat("tfrecord"), &shards);
    let options = RecordsOptions::default().with_label_base(Some(1));
    logged(); // installs the capturing logger
    let dataset = Records::open_with(&shards, &options).unwrap();
    // One notice for both shards scanned for want of an index (a notice a shard made 1,024
    // lines for a set of 1,024).
    assert_eq!(dataset.notices().len(), 1, "{:?}", dataset.notices());
    // Each notice was also reported through the log facade as it happened.
    let logged: Vec<String> = logged()
        .into_iter()
        .filter(|(level, m)| *level == log::Level::Warn && m.contains(&*shards.to_string_lossy()))
        .map(|(_, m)| m)
        .collect();
    assert_eq!(logged, dataset.notices());
    assert!(
        dataset.notices()[0].contains("2 shards of 2 have no index: built by scanning")
            && dataset.notices()[0].contains("train-00000-of-00002"),
        "{:?}",
        dataset.notices()
    );
    // Opening never writes: the indexes are kept in memory until asked for.
    let index_files = |dir: &std::path::Path| {
        let mut found: Vec<_> = fs::read_dir(dir)
            .into_iter()
            .flatten()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "index"))
            .collect();
        found.sort();
        found
    };
    let saved_in = shards.join(imagefeed::format::tfrecord::INDEX_DIR);
    assert!(
        index_files(&saved_in).is_empty(),
        "{:?}",
        index_files(&saved_in)
    );
    let expected = fixture_files();
    assert_eq!(records(&dataset), expected);
    assert_eq!(dataset.classes(), ["0", "1", "2"]);
    let written = dataset.save_missing_indexes().unwrap();
    assert_eq!(written, index_files(&saved_in));
    assert_eq!(written.len(), 2);
    // Saved in index/, where no `train-*` pattern over the shards picks them up as data.
    assert!(
        index_files(&shards).is_empty(),
        "{:?}",
        index_files(&shards)
    );
    let pattern = format::open(shards.join("train-*")).unwrap();
    assert_eq!(pattern.len(), expected.len());
    assert!(
        dataset.save_missing_indexes().unwrap().is_empty(),
        "written twice"
    );
    // The next open uses the saved indexes and says nothing.
    let again = Records::open_with(&shards, &options).unwrap();
    assert!(again.notices().is_empty());
    assert_eq!(records(&again), expected);
    // With label base 0 the ImageNet-style labels are one higher (and class 0 is unused).
    let base0 = Records::open(&shards).unwrap();
    assert_eq!(base0.classes().len(), 4);
    assert_eq!(records(&base0)[0].1, expected[0].1 + 1);
    // A base above the smallest label makes those records bad samples, with the reason.
    let base2 = RecordsOptions::default()
        .with_label_base(Some(2))
        .with_num_classes(Some(2));
    let base2 = Records::open_with(&shards, &base2).unwrap();
    let mut reader = base2.open_reader().unwrap();
    let first = expected.iter().position(|r| r.1 == 0).unwrap();
    let err = reader.read(first).unwrap_err();
    assert!(matches!(err, Error::CorruptRecord { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("train-00000-of-00002") && err.contains("label 1 is below the label base 2"),
        "{err}"
    );
    assert!(reader.read(expected.len() - 1).is_ok());
}

#[cfg(feature = "hdf5")]
#[test]
fn h5py_reads_our_hdf5_as_the_readme_documents() {
    let Some(python) = python_with("h5py") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ours.h5");
    support::pack_as(
        &fixture_root(),
        &out,
        imagefeed::pack::PackFormat::Hdf5,
        &small_options(),
    );
    let script = r#"
import h5py, json, sys
with h5py.File(sys.argv[1], "r") as f:
    info = json.loads(f.attrs["imagefeed"])
    assert list(f.attrs["classes"]) == info["classes"], "classes attribute"
    o = f["offsets"]
    for i in range(len(f["labels"])):
        image_bytes = f["images"][o[i]:o[i + 1]].tobytes()
        label = int(f["labels"][i])
        print(f["keys"][i].decode(), label, image_bytes.hex())
"#;
    assert_eq!(
        python_rows(&python, script, &[&out]),
        fixture_records_without_broken()
    );
}

#[test]
fn the_tfrecord_package_reads_our_shards_with_and_without_the_index() {
    let Some(python) = python_with("tfrecord") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ours.records");
    support::pack_as(
        &fixture_root(),
        &out,
        imagefeed::pack::PackFormat::Records,
        &small_options().with_shard_bytes(20_000).with_label_base(1),
    );
    // Every shard through tfrecord_loader, once through its index's offsets and once read
    // sequentially; labels are stored with base 1.
    let script = r#"
import json, os, sys
from tfrecord.reader import tfrecord_loader
d = sys.argv[1]
manifest = json.load(open(os.path.join(d, "imagefeed-records.json")))
desc = {"image/encoded": "byte", "image/class/label": "int", "image/filename": "byte",
        "image/height": "int", "image/width": "int", "image/format": "byte"}
def read(shard, index, split):
    if index is None:
        yield from tfrecord_loader(shard, None, desc)
    else:  # the index's offsets, read as two halves (without `shard` it starts at random)
        for half in range(split):
            yield from tfrecord_loader(shard, index, desc, shard=(half, split))
for use_index in (True, False):
    for shard in manifest["shards"]:
        index = os.path.join(d, shard["index"]) if use_index else None
        for r in read(os.path.join(d, shard["file"]), index, 2):
            assert r["image/height"][0] > 0 and r["image/width"][0] > 0
            assert r["image/format"] in (b"JPEG", b"PNG"), r["image/format"]
            print(r["image/filename"].decode(), int(r["image/class/label"][0]) - 1,
                  r["image/encoded"].tobytes().hex() if hasattr(r["image/encoded"], "tobytes")
                  else bytes(r["image/encoded"]).hex())
"#;
    let rows = python_rows(&python, script, &[&out]);
    let expected = fixture_records_without_broken();
    let keys = |rows: &[(String, u32, Vec<u8>)]| -> Vec<(String, u32)> {
        rows.iter().map(|r| (r.0.clone(), r.1)).collect()
    };
    assert_eq!(rows.len(), 2 * expected.len(), "{:?}", keys(&rows));
    let (indexed, sequential) = rows.split_at(expected.len());
    assert_eq!(keys(indexed), keys(&expected), "with the index");
    assert!(indexed == &expected[..], "with the index: payloads differ");
    assert!(sequential == &expected[..], "without the index: differ");
    let shards = fs::read_dir(&out)
        .unwrap()
        .filter(|e| imagefeed::format::tfrecord::is_shard_name(&e.as_ref().unwrap().path()))
        .count();
    assert!(shards >= 2, "only {shards} shard of 20 kB");
}

/// The fixture tree's files as MosaicML Streaming's MDSWriter stored them
/// (scripts/make_mds_fixtures.py): `mds/` the JPEGs PIL opens (keyless: `SHARD#N`), `mds-zstd/`
/// every file zstd-compressed with a `path` column, whose first shard is empty (MDSWriter's
/// own quirk with a small size limit).
#[test]
fn mosaic_mds_datasets_read_like_their_source_tree() {
    let source = ImageFolder::open(fixture_root()).unwrap();
    let files: Vec<(String, u32, Vec<u8>)> = source
        .entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            (
                e.key.clone(),
                e.label,
                fs::read(source.file_path(i)).unwrap(),
            )
        })
        .collect();
    let zstd = format::open(compat("mds-zstd")).unwrap();
    assert_eq!(zstd.info().format, imagefeed::dataset::FormatKind::Mds);
    assert_eq!(zstd.classes(), ["0", "1", "2"]);
    assert!(zstd.notices().is_empty(), "{:?}", zstd.notices());
    assert_eq!(records(zstd.as_ref()), files);
    // The jpeg column holds the JPEG files PIL opens (the truncated one too: PIL opens it
    // lazily; not the bomb, which PIL refuses), byte for byte; keys name shard and place.
    let jpegs: Vec<&str> = files
        .iter()
        .filter(|(key, _, bytes)| bytes.starts_with(&[0xff, 0xd8]) && key != "class01/bad-bomb.jpg")
        .map(|(key, _, _)| key.as_str())
        .collect();
    let plain = format::open(compat("mds")).unwrap();
    let rows = records(plain.as_ref());
    let stored: Vec<&str> = rows
        .iter()
        .map(|(_, label, bytes)| {
            let (key, file_label, _) = files
                .iter()
                .find(|(_, _, file)| file == bytes)
                .expect("every stored image is one of the files");
            assert_eq!(label, file_label, "{key}");
            key.as_str()
        })
        .collect();
    assert_eq!(stored, jpegs);
    assert_eq!(rows[0].0, "shard.00000.mds#0");
    assert_eq!(rows[5].0, "shard.00001.mds#1");
    // Named by its index.json, the same dataset.
    let by_index = format::open(compat("mds/index.json")).unwrap();
    assert_eq!(records(by_index.as_ref()), rows);
    // convert takes the directory as inspect and the loader do (it was read as an image
    // folder: "no class directories").
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("from-mds.lmdb");
    let summary = imagefeed::pack::convert(
        &compat("mds"),
        &out,
        imagefeed::pack::PackFormat::Lmdb,
        &small_options(),
        &imagefeed::pack::NoProgress,
    )
    .unwrap();
    // (The truncated JPEG, which PIL opens lazily, is rejected by convert's full decode.)
    assert_eq!(summary.samples + summary.rejected.len(), rows.len());
    assert_eq!(summary.rejected.len(), 1, "{:?}", summary.rejected);
    let converted = records(format::open(&out).unwrap().as_ref());
    assert_eq!(converted.len(), summary.samples);
    assert!(converted.iter().all(|r| rows.contains(r)));
}

/// Streaming's CIFAR converter stores PIL's raw pixels (`pil`): read as raw RGB payloads, the
/// L images spread over three channels.
#[test]
fn mosaic_mds_pil_pixels_read_as_raw_rgb() {
    let dataset = format::open(compat("mds-pil")).unwrap();
    assert_eq!(
        dataset.info().payload,
        imagefeed::dataset::PayloadKind::RawRgb8
    );
    for (index, (_, label, payload)) in records(dataset.as_ref()).into_iter().enumerate() {
        assert_eq!(label as usize, index % 3);
        let (width, height, pixels) = imagefeed::decode::RawImage::parse(&payload).unwrap();
        assert_eq!((width, height), (5, 4));
        let rgb = index % 2 == 0;
        for y in 0..4 {
            for x in 0..5 {
                for c in 0..3 {
                    let channel = if rgb { c } else { 0 };
                    assert_eq!(
                        pixels[(y * 5 + x) * 3 + c] as usize,
                        (index * 7 + y * 3 + x * 5 + channel) % 256,
                        "sample {index} at {x},{y},{c}"
                    );
                }
            }
        }
    }
}

/// A `pil` column in a mode imagefeed does not read (PIL's `HSV` and `P` here) spoiled every
/// record while the open succeeded (a hostile try): refused at open where every image looked at
/// is so, named in a notice where only some are (one odd image first in a shard had refused a
/// set of RGB images).
#[test]
fn mosaic_mds_pil_pixels_in_another_mode_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let set = copied("mds-pil", dir.path());
    let shard = fs::read(set.join("shard.00000.mds")).unwrap();
    // The fixture's six images alternate RGB and L; `relabelled` renames the modes of the first
    // `limit` of each kind.
    let relabelled = |limit: usize| {
        let mut bytes = shard.clone();
        for (from, to) in [
            (&b"\x03\x00\x00\x00RGB"[..], &b"HSV"[..]),
            (b"\x01\x00\x00\x00L", b"P"),
        ] {
            let mut at = 0;
            let mut done = 0;
            while let Some(found) = bytes[at..].windows(from.len()).position(|w| w == from) {
                if done == limit {
                    break;
                }
                bytes[at + found + 4..at + found + 4 + to.len()].copy_from_slice(to);
                at += found + from.len();
                done += 1;
            }
        }
        assert_ne!(bytes, shard, "the fixture holds RGB and L images");
        bytes
    };
    fs::write(set.join("shard.00000.mds"), relabelled(usize::MAX)).unwrap();
    let err = format::open(&set).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("PIL mode \"HSV\"")
                && reason.contains("every one of the 6 images looked at in column \"x\"")
                && reason.contains("shard.00000.mds#0")),
        "{err}"
    );
    // The first two images odd (HSV, P), the rest RGB and L: read, the notice naming them.
    fs::write(set.join("shard.00000.mds"), relabelled(1)).unwrap();
    let notices = |dataset: &dyn imagefeed::dataset::Dataset| {
        dataset
            .notices()
            .iter()
            .find(|n| n.contains("looked at in column \"x\""))
            .cloned()
            .unwrap_or_default()
    };
    let dataset = format::open(&set).unwrap();
    assert_eq!(dataset.len(), 6);
    let notice = notices(dataset.as_ref());
    assert!(
        notice.contains("2 of 6 images") && notice.contains("mds#0"),
        "{notice}"
    );
    // Every image odd, beside a shard of RGB and L images: read, with the notice.
    fs::write(set.join("shard.00000.mds"), relabelled(usize::MAX)).unwrap();
    fs::write(set.join("shard.00001.mds"), &shard).unwrap();
    let mut index: serde_json::Value =
        serde_json::from_slice(&fs::read(set.join("index.json")).unwrap()).unwrap();
    let mut second = index["shards"][0].clone();
    second["raw_data"]["basename"] = "shard.00001.mds".into();
    index["shards"].as_array_mut().unwrap().push(second);
    fs::write(set.join("index.json"), index.to_string()).unwrap();
    let dataset = format::open(&set).unwrap();
    assert_eq!(dataset.len(), 12);
    let notice = notices(dataset.as_ref());
    assert!(
        notice.contains("6 of 12 images") && notice.contains("HSV"),
        "{notice}"
    );
}

/// A copy of `compat/NAME` to damage.
pub(crate) fn copied(name: &str, into: &Path) -> std::path::PathBuf {
    let to = into.join(name);
    fs::create_dir_all(&to).unwrap();
    for entry in fs::read_dir(compat(name)).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to
}

#[test]
fn a_damaged_mds_shard_reads_as_bad_records_and_a_missing_one_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mds = copied("mds", dir.path());
    let good = records(format::open(&mds).unwrap().as_ref());
    // Shard 1 cut in the middle of its second sample: its first sample still reads, the rest
    // are bad records naming the shard; the other shards are untouched.
    let shard = mds.join("shard.00001.mds");
    let bytes = fs::read(&shard).unwrap();
    let second = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    fs::write(&shard, &bytes[..second + 10]).unwrap();
    let cut = format::open(&mds).unwrap();
    assert!(
        cut.notices().iter().any(|n| n.contains("shard.00001.mds")),
        "{:?}",
        cut.notices()
    );
    let mut reader = cut.open_reader().unwrap();
    assert_eq!(reader.read(4).unwrap().payload, &good[4].2[..]);
    for index in 5..8 {
        match reader.read(index) {
            Err(imagefeed::Error::CorruptRecord { path, key, .. }) => {
                assert_eq!(path, shard);
                assert_eq!(key, format!("shard.00001.mds#{}", index - 4));
            }
            other => panic!("sample {index}: {:?}", other.map(|r| r.key.to_string())),
        }
    }
    assert_eq!(reader.read(8).unwrap().payload, &good[8].2[..]);
    // Every byte of the shard's header flipped: an open and reads that fail or succeed,
    // never a panic.
    for at in 0..40 {
        let mut flipped = bytes.clone();
        flipped[at] ^= 0x5a;
        fs::write(&shard, &flipped).unwrap();
        if let Ok(dataset) = format::open(&mds) {
            let mut reader = dataset.open_reader().unwrap();
            for index in 0..dataset.len() {
                let _ = reader.read(index);
            }
        }
    }
    // An index claiming more samples than its own size for the shard holds offsets for:
    // refused at open, not made into billions of bad records.
    fs::write(&shard, &bytes).unwrap();
    let index = mds.join("index.json");
    let text = fs::read_to_string(&index).unwrap();
    let inflated = text.replacen("\"samples\": 4", "\"samples\": 4000000000", 1);
    assert_ne!(inflated, text);
    fs::write(&index, inflated).unwrap();
    let err = format::open(&mds).unwrap_err();
    assert!(
        matches!(&err, imagefeed::Error::NotADataset { path, reason } if path.ends_with("index.json") && reason.contains("4000000000")),
        "{err}"
    );
    // Consistent with its own sizes but not with the file: refused naming the shard.
    let forged = text
        .replacen("\"samples\": 4", "\"samples\": 4000000000", 1)
        .replacen("\"bytes\": ", "\"bytes\": 160000000", 1);
    fs::write(&index, forged).unwrap();
    let err = format::open(&mds).unwrap_err();
    assert!(
        matches!(&err, imagefeed::Error::NotADataset { path, .. } if path.ends_with("shard.00000.mds")),
        "{err}"
    );
    // An index saying 0 samples for a shard holding 4 (a hostile try found them gone, "OK"):
    // its 4 records read as bad records naming the shard.
    let shard1 = text.find("shard.00001.mds").unwrap();
    let zero_at = shard1 + text[shard1..].find("\"samples\": 4").unwrap();
    let zeroed = format!(
        "{}\"samples\": 0{}",
        &text[..zero_at],
        &text[zero_at + "\"samples\": 4".len()..]
    );
    fs::write(&index, zeroed).unwrap();
    let dataset = format::open(&mds).unwrap();
    assert_eq!(dataset.len(), good.len());
    let mut reader = dataset.open_reader().unwrap();
    for (index, row) in good.iter().enumerate() {
        match (index, reader.read(index)) {
            (4..8, Err(imagefeed::Error::CorruptRecord { path, .. })) => assert_eq!(path, shard),
            (4..8, other) => panic!("sample {index}: {:?}", other.map(|r| r.key.to_string())),
            (_, read) => assert_eq!(read.unwrap().payload, &row.2[..]),
        }
    }
    fs::write(&index, text).unwrap();
    // A shard the index lists that is not there: refused naming it, read around on purpose.
    fs::remove_file(&shard).unwrap();
    let err = format::open(&mds).unwrap_err();
    assert!(
        matches!(
            &err,
            imagefeed::Error::ShardSet {
                problem: imagefeed::format::shards::ShardSetProblem::Missing { missing, count: 1, expected: 4, .. },
                ..
            } if missing == &["shard.00001.mds"]
        ),
        "{err}"
    );
    let allowed = format::OpenOptions::default().with_allow_missing_shards(true);
    let partial = format::open_with(&mds, &allowed).unwrap();
    assert_eq!(partial.missing_shards().named, ["shard.00001.mds"]);
    let left = records(partial.as_ref());
    assert_eq!(left.len(), good.len() - 4);
    assert!(left.iter().all(|row| good.contains(row)));
    assert!(!imagefeed::inspect::inspect(&mds).unwrap().complete);
    // Compressed: a zstd file cut short yields no whole block, so the shard cannot hold the
    // samples the index lists: an error naming it (and a notice saying the stream broke).
    let zstd = copied("mds-zstd", dir.path());
    let options = format::OpenOptions::default()
        .with_cache(imagefeed::cache::Cache::at(dir.path().join("cache"), None));
    let zip = zstd.join("shard.00002.mds.zstd");
    let bytes = fs::read(&zip).unwrap();
    fs::write(&zip, &bytes[..bytes.len() / 2]).unwrap();
    let err = format::open_with(&zstd, &options).unwrap_err();
    assert!(
        matches!(&err, imagefeed::Error::NotADataset { path, .. } if *path == zip),
        "{err}"
    );
    // A zstd bomb in place of a shard: decompression stops just past the size the index gives
    // (2 KB here, not 64 MiB), and the shard is refused naming it.
    let bomb = zstd::encode_all(&vec![0u8; 64 << 20][..], 19).unwrap();
    fs::write(&zip, &bomb).unwrap();
    let cache = dir.path().join("cache");
    let err = format::open_with(&zstd, &options).unwrap_err();
    assert!(
        matches!(&err, imagefeed::Error::NotADataset { path, .. } if *path == zip),
        "{err}"
    );
    let cached: u64 = walk_sizes(&cache);
    assert!(
        cached < 1 << 20,
        "the cache holds {cached} bytes after a bomb"
    );
    // A shard file beside the index that the index does not list is reported, not read.
    fs::write(&zip, &bytes).unwrap();
    fs::copy(
        zstd.join("shard.00003.mds.zstd"),
        zstd.join("shard.00099.mds.zstd"),
    )
    .unwrap();
    let extra = format::open_with(&zstd, &options).unwrap();
    assert!(
        extra
            .notices()
            .iter()
            .any(|n| n.contains("1 shard file(s)")),
        "{:?}",
        extra.notices()
    );
    // A damaged index.json is an error naming it, never an ImageFolder with no classes.
    let index = zstd.join("index.json");
    let text = fs::read(&index).unwrap();
    fs::write(&index, &text[..600]).unwrap();
    let err = format::open_with(&zstd, &options).unwrap_err();
    assert!(
        matches!(&err, imagefeed::Error::NotADataset { path, .. } if *path == index),
        "{err}"
    );
}

fn walk_sizes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| {
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                walk_sizes(&e.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

/// A gzipped MDS shard (`compression="gz"`) whose stream fails its checksum: MDS samples carry
/// no checksums of their own, so each of that shard's samples is a bad record saying the stream
/// is damaged, where they were read as sound with only a notice.
#[test]
fn an_mds_shard_failing_its_gzip_checksum_reads_as_bad_records() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let set = copied("mds-zstd", dir.path());
    let zip = set.join("shard.00002.mds.zstd");
    let raw = zstd::decode_all(&fs::read(&zip).unwrap()[..]).unwrap();
    fs::remove_file(&zip).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&raw).unwrap();
    let mut gzipped = gz.finish().unwrap();
    let at = gzipped.len() - 8; // the CRC-32 in the trailer
    gzipped[at] ^= 0xFF;
    fs::write(set.join("shard.00002.mds.gz"), &gzipped).unwrap();
    let mut index: serde_json::Value =
        serde_json::from_slice(&fs::read(set.join("index.json")).unwrap()).unwrap();
    index["shards"][2]["compression"] = "gz".into();
    index["shards"][2]["zip_data"]["basename"] = "shard.00002.mds.gz".into();
    index["shards"][2]["zip_data"]["bytes"] = gzipped.len().into();
    fs::write(set.join("index.json"), index.to_string()).unwrap();
    let in_shard = index["shards"][2]["samples"].as_u64().unwrap() as usize;
    assert!(in_shard > 0);
    let options = format::OpenOptions::default()
        .with_cache(imagefeed::cache::Cache::at(dir.path().join("cache"), None));
    let dataset = format::open_with(&set, &options).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    let mut untrusted = 0;
    for index in 0..dataset.len() {
        match reader.read(index) {
            Ok(_) => {}
            Err(Error::CorruptRecord { reason, .. })
                if reason.contains("none of its records can be trusted") =>
            {
                untrusted += 1
            }
            Err(other) => panic!("{other}"),
        }
    }
    assert_eq!(untrusted, in_shard);
}
