//! One reader suite run over every backend: the raw folder, LMDB, HDF5 and record shards, each
//! with encoded payloads and with raw pixels, and a dataset joined from the parts of a split
//! conversion, must present the same samples (keys, labels, pixels), per worker handle, from any
//! number of threads. Then the error paths every packed format shares.

use crate::support;

use std::fs;
use std::path::Path;
use std::sync::Arc;

use imagefeed::dataset::{Dataset, LazyReader, PayloadKind};
use imagefeed::decode::Decoder;
use imagefeed::format::folder::ImageFolder;
use imagefeed::format::lmdb::Lmdb;
use imagefeed::format::writer::{
    PackFormat, PackPlan, PackProgress, PackedRecord, WriterOptions, start_writer,
};
use imagefeed::pack::{self, NoProgress, Part};
use imagefeed::{Error, format};
use support::{BROKEN, copy_tree, fixture_root, pack_as, pack_lmdb, small_options, writable};

/// A copy of the fixture tree without the broken files, so every backend holds the same samples.
fn clean_tree(dir: &Path) -> std::path::PathBuf {
    let src = dir.join("src");
    copy_tree(&fixture_root(), &src);
    for key in BROKEN {
        fs::remove_file(src.join(key)).unwrap();
    }
    src
}

/// Every backend over the same samples, by name (HDF5 only in builds with the `hdf5` feature).
fn backends(dir: &Path) -> Vec<(&'static str, Arc<dyn Dataset>)> {
    let src = clean_tree(dir);
    pack_lmdb(&src, &dir.join("encoded.lmdb"), &small_options());
    let raw = small_options().with_raw(true);
    // Small shards, so samples span several of them.
    let sharded = small_options().with_shard_bytes(8 << 10);
    pack_lmdb(&src, &dir.join("raw.lmdb"), &raw);
    pack_as(
        &src,
        &dir.join("encoded.records"),
        PackFormat::Records,
        &sharded,
    );
    pack_as(
        &src,
        &dir.join("raw.records"),
        PackFormat::Records,
        &sharded.with_raw(true),
    );
    // Three parts of a split conversion (written out of order), joined into one file: HDF5 when
    // the build has it, else LMDB.
    let joined_format = support::hdf5_else_lmdb();
    let joined = dir.join(format!("joined.{}", joined_format.name()));
    let parts: Vec<std::path::PathBuf> = [2, 0, 1]
        .iter()
        .map(|&i| {
            let part = dir.join(format!("part{i}.records"));
            let options = small_options().with_part(Some(Part { index: i, count: 3 }));
            pack_as(&src, &part, PackFormat::Records, &options);
            part
        })
        .collect();
    pack::join(
        &parts,
        &joined,
        joined_format,
        &small_options(),
        &NoProgress,
    )
    .unwrap();
    let mut backends: Vec<(&'static str, Arc<dyn Dataset>)> = vec![
        ("folder", format::open(&src).unwrap()),
        ("lmdb", format::open(dir.join("encoded.lmdb")).unwrap()),
        ("lmdb-raw", format::open(dir.join("raw.lmdb")).unwrap()),
        (
            "records",
            format::open(dir.join("encoded.records")).unwrap(),
        ),
        (
            "records-raw",
            format::open(dir.join("raw.records")).unwrap(),
        ),
        ("joined", format::open(&joined).unwrap()),
    ];
    if PackFormat::Hdf5.is_available() {
        pack_as(
            &src,
            &dir.join("encoded.h5"),
            PackFormat::Hdf5,
            &small_options(),
        );
        pack_as(&src, &dir.join("raw.h5"), PackFormat::Hdf5, &raw);
        backends.push(("hdf5", format::open(dir.join("encoded.h5")).unwrap()));
        backends.push(("hdf5-raw", format::open(dir.join("raw.h5")).unwrap()));
    }
    backends
}

/// (key, label, decoded RGB) of every sample, read through one handle.
fn read_all(
    dataset: &dyn Dataset,
    order: impl Iterator<Item = usize>,
) -> Vec<(usize, String, u32, Vec<u8>)> {
    let mut reader = dataset.open_reader().unwrap();
    let mut decoder = Decoder::new();
    let mut out: Vec<_> = order
        .map(|i| {
            let record = reader.read(i).unwrap();
            assert_eq!(record.index, i);
            let mut rgb = Vec::new();
            decoder.decode_rgb(record.payload, &mut rgb).unwrap();
            (i, record.key.to_string(), record.label, rgb)
        })
        .collect();
    out.sort_by_key(|s| s.0);
    out
}

#[test]
fn every_backend_presents_the_same_samples() {
    let dir = tempfile::tempdir().unwrap();
    let backends = backends(dir.path());
    let listing = ImageFolder::open(dir.path().join("src")).unwrap();
    let expected: Vec<(String, u32)> = listing
        .entries()
        .iter()
        .map(|e| (e.key.clone(), e.label))
        .collect();
    let reference = read_all(backends[0].1.as_ref(), 0..expected.len());
    for (name, dataset) in &backends {
        assert_eq!(dataset.len(), 16, "{name}");
        assert_eq!(dataset.classes(), listing.classes(), "{name}");
        let samples = read_all(dataset.as_ref(), 0..dataset.len());
        let got: Vec<(String, u32)> = samples.iter().map(|s| (s.1.clone(), s.2)).collect();
        assert_eq!(got, expected, "{name}: keys and labels");
        // The listing Python's `samples`/`targets` come from: the folder's without reading a
        // file, every other backend's by reading its records.
        assert_eq!(
            imagefeed::dataset::keys_and_labels(dataset.as_ref()).unwrap(),
            expected,
            "{name}: keys_and_labels"
        );
        assert_eq!(dataset.listed(0).is_some(), *name == "folder", "{name}");
        // Raw pixels were decoded with the same decoder, so pixels match exactly.
        assert!(
            samples == reference,
            "{name}: decoded pixels differ from the folder's"
        );
    }
    for (name, dataset) in &backends {
        let raw = name.ends_with("-raw");
        assert_eq!(
            dataset.info().payload == PayloadKind::RawRgb8,
            raw,
            "{name}: payload kind"
        );
    }
}

#[test]
fn per_thread_handles_read_the_same_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    for (name, dataset) in backends(dir.path()) {
        let n = dataset.len();
        let forward = read_all(dataset.as_ref(), 0..n);
        let results: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|t| {
                    let dataset = &dataset;
                    // Each thread reads everything in its own order (rotated, reversed for odd t).
                    scope.spawn(move || {
                        let order: Vec<usize> = (0..n).map(|i| (i + t * 5) % n).collect();
                        if t % 2 == 1 {
                            read_all(dataset.as_ref(), order.into_iter().rev())
                        } else {
                            read_all(dataset.as_ref(), order.into_iter())
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            assert!(r == forward, "{name}: a thread read different samples");
        }
    }
}

/// One handle reading every record over and over (LMDB then serves repeats from its table of
/// values already found), in shuffled orders, with a prefetch hint for the next record before
/// each read (and hints past the end, which must be ignored), sees exactly what a fresh handle
/// sees.
#[test]
fn rereads_and_prefetch_hints_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (name, dataset) in backends(dir.path()) {
        let n = dataset.len();
        let fresh: Vec<(String, u32, Vec<u8>)> = {
            let mut reader = dataset.open_reader().unwrap();
            (0..n)
                .map(|i| {
                    let r = reader.read(i).unwrap();
                    (r.key.to_string(), r.label, r.payload.to_vec())
                })
                .collect()
        };
        let mut reader = LazyReader::new(Arc::clone(&dataset));
        reader.prefetch(0); // not open yet: nothing to do
        for pass in 0..3u64 {
            let mut order: Vec<usize> = (0..n).collect();
            let mut rng = imagefeed::rng::SampleRng::new(pass, 0, 0);
            for i in (1..n).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            for (position, &i) in order.iter().enumerate() {
                reader.prefetch(order.get(position + 1).copied().unwrap_or(n + 7));
                let r = reader.read(i).unwrap();
                assert_eq!(
                    (r.key, r.label, r.payload),
                    (fresh[i].0.as_str(), fresh[i].1, fresh[i].2.as_slice()),
                    "{name}: pass {pass}, record {i}"
                );
            }
        }
    }
}

#[test]
fn lazy_reader_opens_on_first_read() {
    let dir = tempfile::tempdir().unwrap();
    for (name, dataset) in backends(dir.path()) {
        let mut lazy = LazyReader::new(Arc::clone(&dataset));
        assert!(!lazy.is_open(), "{name}");
        let key = lazy.read(3).unwrap().key.to_string();
        assert!(lazy.is_open(), "{name}");
        assert_eq!(key, dataset.open_reader().unwrap().read(3).unwrap().key);
    }
}

#[test]
fn out_of_range_reads_panic_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    for (name, dataset) in backends(dir.path()) {
        let n = dataset.len();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = dataset.open_reader().unwrap().read(n);
        }));
        assert!(
            result.is_err(),
            "{name}: reading index {n} of {n} did not panic"
        );
    }
}

#[test]
fn the_same_lmdb_can_be_opened_twice_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let src = clean_tree(dir.path());
    let path = dir.path().join("twice.lmdb");
    pack_lmdb(&src, &path, &small_options());
    let a = Lmdb::open(&path).unwrap();
    let b = Lmdb::open(&path).unwrap();
    let key_a = a.open_reader().unwrap().read(5).unwrap().key.to_string();
    drop(a);
    assert_eq!(b.open_reader().unwrap().read(5).unwrap().key, key_a);
    drop(b);
    // And again after every handle is gone.
    assert_eq!(Lmdb::open(&path).unwrap().len(), 16);
}

/// Writes a dataset by hand through a format's writer interface, with whatever records we like.
fn write_with(format: PackFormat, path: &Path, classes: &[&str], records: &[PackedRecord<'_>]) {
    let plan = PackPlan {
        source_fingerprint: "test".into(),
        num_sources: records.len(),
        classes: classes.iter().map(|c| c.to_string()).collect(),
        payload: PayloadKind::Encoded,
        resize_short_side: None,
        quality: 90,
        part: None,
        restart_markers: false,
        shared_headers: false,
        max_pixels: None,
    };
    let options = WriterOptions {
        lmdb_map_size: 16 << 20,
        shard_bytes: 1 << 20,
        label_base: 0,
        ..small_options().writer_options()
    };
    let (mut writer, _) = start_writer(format, path, &plan, &options).unwrap();
    let progress = PackProgress {
        sources_done: records.len(),
        samples_written: records.len(),
        ..PackProgress::default()
    };
    writer.write_chunk(records, &progress).unwrap();
    writer
        .finish(&plan.dataset_info(format.kind(), records.len()), &progress)
        .unwrap();
}

fn write_lmdb(path: &Path, classes: &[&str], records: &[PackedRecord<'_>]) {
    write_with(PackFormat::Lmdb, path, classes, records);
}

#[test]
fn label_out_of_range_is_an_error_naming_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let jpeg = fs::read(fixture_root().join("class00/img00000.jpg")).unwrap();
    let record = |label, key| PackedRecord {
        label,
        key,
        payload: &jpeg,
    };
    for (format, name) in writable([
        (PackFormat::Lmdb, "bad-label.lmdb"),
        (PackFormat::Hdf5, "bad-label.h5"),
        (PackFormat::Records, "bad-label.records"),
    ]) {
        let path = dir.path().join(name);
        write_with(
            format,
            &path,
            &["a", "b", "c"],
            &[record(2, "c/ok.jpg"), record(7, "c/bad.jpg")],
        );
        let dataset = format::open(&path).unwrap();
        let mut reader = dataset.open_reader().unwrap();
        assert_eq!(reader.read(0).unwrap().label, 2, "{name}");
        let err = reader.read(1).unwrap_err();
        assert!(
            matches!(err, Error::CorruptRecord { index: 1, .. }),
            "{name}: {err}"
        );
        let message = err.to_string();
        assert!(
            message.contains(name) && message.contains("c/bad.jpg"),
            "{message}"
        );
        assert!(message.contains("label 7 is outside 0..3"), "{message}");
        // Listing every label (Python's `targets`) stops at that record, naming it.
        // (Named once: the reason was the whole message, dataset and record again.)
        let err = imagefeed::dataset::keys_and_labels(dataset.as_ref()).unwrap_err();
        assert!(
            matches!(&err, Error::CorruptRecord { index: 1, key, reason, .. }
                if key == "c/bad.jpg" && reason.starts_with("label 7")),
            "{name}: {err}"
        );
        assert_eq!(err.to_string().matches("c/bad.jpg").count(), 1, "{err}");
    }
}

#[test]
fn files_that_are_not_datasets_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.lmdb");
    fs::write(&garbage, vec![0x42u8; 10_000]).unwrap();
    let err = format::open(&garbage).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("garbage.lmdb") && err.contains("neither a directory"),
        "{err}"
    );
    // Told apart by the magic number, not by an error's text: an LMDB cut short still has it,
    // and gets the truncation error rather than "not a dataset file".
    assert!(!format::lmdb::has_magic(&garbage).unwrap());
    // A file under a staging name is an interrupted pack's, whatever it holds (a writer killed
    // before its first page): incomplete, not "not a dataset".
    let staging = dir.path().join("killed.lmdb.partial");
    fs::write(&staging, b"").unwrap();
    let err = format::open(&staging).unwrap_err();
    assert!(matches!(err, Error::Incomplete { .. }), "{err}");
    let cut = dir.path().join("cut.lmdb");
    pack_lmdb(&fixture_root(), &cut, &small_options());
    assert!(format::lmdb::has_magic(&cut).unwrap());
    let bytes = fs::read(&cut).unwrap();
    fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    assert!(format::lmdb::has_magic(&cut).unwrap());
    let err = format::open(&cut).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("cut.lmdb") && err.contains("truncated"),
        "{err}"
    );

    let tiny = dir.path().join("tiny.lmdb");
    fs::write(&tiny, b"").unwrap();
    assert!(matches!(Lmdb::open(&tiny), Err(Error::NotADataset { .. })));
    let err = format::open(&tiny).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. } if reason.contains("empty (0 bytes)")),
        "{err:?}"
    );

    let missing = dir.path().join("missing.lmdb");
    let err = format::open(&missing).unwrap_err();
    assert!(
        matches!(err, Error::Io { .. }) && err.to_string().contains("missing.lmdb"),
        "{err}"
    );

    let no_classes = dir.path().join("empty-dir");
    fs::create_dir(&no_classes).unwrap();
    let err = format::open(&no_classes).unwrap_err();
    assert!(matches!(err, Error::BadImageFolder { .. }), "{err}");
}

#[test]
fn a_file_whose_start_cannot_be_read_is_an_io_error_not_another_format() {
    // A sysfs attribute says it is 4,096 bytes long and reads one line: the short read a
    // failing network filesystem gives. The format sniffers see too few bytes for any magic.
    let attr = Path::new("/sys/kernel/mm/transparent_hugepage/enabled");
    if !fs::metadata(attr).is_ok_and(|m| m.len() > 64) {
        eprintln!(
            "skipped: no sysfs attribute at {} to read short",
            attr.display()
        );
        return;
    }
    let err = format::open(attr).unwrap_err();
    assert!(
        matches!(&err, Error::Io { path, source }
            if path == attr && source.kind() == std::io::ErrorKind::UnexpectedEof),
        "{err:?}"
    );
}

#[test]
fn a_truncated_lmdb_is_an_error_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let src = clean_tree(dir.path());
    let path = dir.path().join("cut.lmdb");
    pack_lmdb(&src, &path, &small_options());
    let full = fs::read(&path).unwrap();
    fs::write(&path, &full[..full.len() / 2]).unwrap();
    let err = Lmdb::open(&path).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("cut.lmdb") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn a_sample_whose_key_is_gone_is_a_bad_record_and_its_neighbours_still_read() {
    // A fresh reader finds values by cursor runs over many samples at once (the LMDB reader's
    // `sample_value`): a key that is missing, or one past the last sample, must neither shift
    // the samples after it nor stop them from being found.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gap.lmdb");
    let jpeg = fs::read(fixture_root().join("class00/img00000.jpg")).unwrap();
    let keys: Vec<String> = (0..150).map(|i| format!("a/{i:03}.jpg")).collect();
    let records: Vec<PackedRecord<'_>> = keys
        .iter()
        .map(|key| PackedRecord {
            label: 0,
            key,
            payload: &jpeg,
        })
        .collect();
    write_lmdb(&path, &["a"], &records);
    let gone = 70u64;
    support::edit_lmdb(&path, |env, wtxn| {
        let samples: heed::Database<heed::types::Bytes, heed::types::Bytes> =
            env.open_database(wtxn, Some("samples")).unwrap().unwrap();
        // Sample 70's value moves under the key of sample 1000: the count stays 150.
        let value = samples
            .get(wtxn, &gone.to_be_bytes())
            .unwrap()
            .unwrap()
            .to_vec();
        assert!(samples.delete(wtxn, &gone.to_be_bytes()).unwrap());
        samples.put(wtxn, &1000u64.to_be_bytes(), &value).unwrap();
    });
    let dataset = Lmdb::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    // Runs start at 0 (up to 63), 65 (past the gap) and 130 (up to the stray key); 70 is read
    // after a run went over it, 64 is found by a run of its own, and all again once known.
    for index in [0, 65, 71, 70, 130, 149, 64, 69, 0, 70, 149] {
        match reader.read(index) {
            Ok(record) => {
                assert_ne!(index, gone as usize);
                assert_eq!(record.key, keys[index], "sample {index}");
                assert_eq!(record.payload, &jpeg[..], "sample {index}");
            }
            Err(err) => {
                assert_eq!(index, gone as usize, "{err}");
                assert!(
                    matches!(err, Error::CorruptRecord { index: 70, .. }),
                    "{err:?}"
                );
            }
        }
    }
}

#[test]
fn an_lmdb_from_a_newer_layout_is_refused() {
    // Simulate a future writer by rewriting meta/info's version through heed directly.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("future.lmdb");
    let jpeg = fs::read(fixture_root().join("class00/img00000.jpg")).unwrap();
    write_lmdb(
        &path,
        &["a"],
        &[PackedRecord {
            label: 0,
            key: "a/x.jpg",
            payload: &jpeg,
        }],
    );
    support::edit_lmdb_meta(&path, "info", |info| {
        assert!(info["version"].as_u64().unwrap() <= imagefeed::format::lmdb::VERSION as u64);
        info["version"] = 99.into();
    });
    let err = Lmdb::open(&path).unwrap_err();
    assert!(
        matches!(err, Error::NotADataset { .. })
            && err.to_string().contains("layout version 99 is newer"),
        "{err:?}"
    );
}

#[test]
fn an_lmdb_pack_fills_its_leaf_pages() {
    // Keys only rise, so each leaf is left full: a file barely larger than its values (a plain
    // put splits every full leaf in half, and a dataset's file came out ~1.5 times its values).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("full.lmdb");
    let keys: Vec<String> = (0..2000).map(|i| format!("c/{i:05}.jpg")).collect();
    let payload = vec![7u8; 900];
    let records: Vec<PackedRecord<'_>> = keys
        .iter()
        .map(|key| PackedRecord {
            label: 0,
            key,
            payload: &payload,
        })
        .collect();
    write_with(PackFormat::Lmdb, &path, &["c"], &records);
    let values = 2000 * (900 + 12);
    let len = fs::metadata(&path).unwrap().len() as usize;
    assert!(
        len < values * 125 / 100,
        "{len} bytes for {values} bytes of values"
    );
    let dataset = Lmdb::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    for i in [0, 999, 1999] {
        assert_eq!(reader.read(i).unwrap().payload, &payload[..]);
    }
}

#[test]
fn a_class_list_of_ours_naming_one_class_twice_is_refused() {
    // A hostile try's `["cat", "cat", "cat"]` in an LMDB's metadata passed `verify`, and
    // Python's `class_to_idx` came out `{"cat": 2}`; a records manifest took one too.
    let dir = tempfile::tempdir().unwrap();
    let repeat = |classes: &mut serde_json::Value| {
        classes[2] = classes[0].clone();
    };
    let lmdb = dir.path().join("twice.lmdb");
    pack_lmdb(&fixture_root(), &lmdb, &small_options());
    support::edit_lmdb_meta(&lmdb, "info", |info| repeat(&mut info["classes"]));
    let records = dir.path().join("twice.records");
    pack_as(
        &fixture_root(),
        &records,
        pack::PackFormat::Records,
        &small_options(),
    );
    let manifest = records.join(format::tfrecord::MANIFEST);
    let mut listed: serde_json::Value =
        serde_json::from_slice(&fs::read(&manifest).unwrap()).unwrap();
    repeat(&mut listed["classes"]);
    fs::write(&manifest, listed.to_string()).unwrap();
    for path in [&lmdb, &records] {
        let err = format::open(path).unwrap_err();
        assert!(
            matches!(&err, Error::NotADataset { reason, .. }
                if reason.contains("names classes 0 and 2 alike (\"class00\")")),
            "{path:?}: {err}"
        );
    }
}

#[cfg(feature = "hdf5")]
#[test]
fn an_hdf5_of_ours_whose_two_class_lists_differ_says_so_or_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("classes.h5");
    pack_as(
        &fixture_root(),
        &path,
        pack::PackFormat::Hdf5,
        &small_options(),
    );
    let vlen = support::vlen_strings;
    // The `classes` attribute h5py users read, edited: read by the metadata, with a notice.
    {
        let file = hdf5::File::open_rw(&path).unwrap();
        file.attr("classes")
            .unwrap()
            .write(&vlen(&["class00", "class02", "class01"]))
            .unwrap();
    }
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.classes(), ["class00", "class01", "class02"]);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("names other classes than its metadata")),
        "{:?}",
        dataset.notices()
    );
    // The metadata naming one class twice: refused.
    {
        let file = hdf5::File::open_rw(&path).unwrap();
        let attr = file.attr("imagefeed").unwrap();
        let text: hdf5::types::VarLenUnicode = attr.read_scalar().unwrap();
        let edited = text.as_str().replacen("\"class02\"", "\"class00\"", 1);
        assert_ne!(edited, text.as_str());
        attr.write_scalar(&edited.parse::<hdf5::types::VarLenUnicode>().unwrap())
            .unwrap();
    }
    let err = format::open(&path).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. } if reason.contains("alike (\"class00\")")),
        "{err}"
    );
}

#[test]
fn inspect_and_verify_list_the_first_thousand_problems_and_count_them_all() {
    // 65,536 good records (one pass of the parallel reading), then 1,500 that are no image:
    // `inspect` and `verify` held every record's result at once, with every message (a hostile
    // set of three million phantom records took 2 GB to inspect). The bad ones all fall in the
    // second pass, which must number them from where it starts.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("junk.lmdb");
    let mut tiny = Vec::new();
    image::codecs::jpeg::JpegEncoder::new(&mut tiny)
        .encode(&[128, 64, 32], 1, 1, image::ExtendedColorType::Rgb8)
        .unwrap();
    const GOOD: usize = 1 << 16;
    const BAD: usize = 1_500;
    let keys: Vec<String> = (0..GOOD + BAD).map(|i| format!("c/{i:05}.jpg")).collect();
    let records: Vec<PackedRecord<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| PackedRecord {
            label: (i % 2) as u32,
            key,
            payload: if i < GOOD { &tiny } else { b"not an image" },
        })
        .collect();
    write_lmdb(&path, &["a", "b"], &records);
    let seen = imagefeed::inspect::inspect(&path).unwrap();
    assert_eq!(seen.bad_record_count, BAD);
    assert!(!seen.is_whole());
    let listed: Vec<usize> = seen.bad_records.iter().map(|b| b.index).collect();
    let first: Vec<usize> = (GOOD..GOOD + imagefeed::inspect::LISTED_BAD_RECORDS).collect();
    assert_eq!(listed, first);
    let counted: Vec<usize> = seen.classes.iter().map(|c| c.count).collect();
    assert_eq!(counted, [(GOOD + BAD) / 2; 2]);
    let report = imagefeed::verify::verify(&path, None).unwrap();
    assert_eq!((report.checked, report.problem_count), (GOOD + BAD, BAD));
    assert!(!report.is_ok());
    let listed: Vec<usize> = report.problems.iter().filter_map(|p| p.index).collect();
    assert_eq!(listed, first);
}
