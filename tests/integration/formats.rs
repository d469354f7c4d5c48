//! What only the HDF5 and record-shard formats have: staged crash-safe writing and resume,
//! corrupt files (bad CRCs, offsets past the end, truncation) reported by file and record, and
//! split conversions joined back together.

use crate::support;

use std::fs;
use std::path::{Path, PathBuf};

use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig};
use imagefeed::pack::{self, NoProgress, PackFormat, PackOptions, Part, StartMode};
use imagefeed::transform::Transform;
use imagefeed::{Error, format, verify};
use support::{
    BROKEN, Crash, Row, fixture_root, pack_as, records, small_options, small_resume_options,
    writable,
};

fn all_records(path: &Path) -> Vec<Row> {
    records(format::open(path).unwrap().as_ref())
}

fn append_garbage(path: &Path) {
    use std::io::Write as _;
    let mut file = fs::OpenOptions::new().append(true).open(path).unwrap();
    file.write_all(b"half-written chunk that was never committed")
        .unwrap();
}

#[test]
fn resume_drops_what_a_crash_wrote_past_the_last_commit_of_staged_shards() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_root();
    for (format, name) in writable([
        (PackFormat::Hdf5, "resumed.h5"),
        (PackFormat::Records, "resumed.records"),
    ]) {
        let out = dir.path().join(name);
        let options = small_options().with_shard_bytes(8 << 10);
        let crash = Crash::after(2);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pack::pack_image_folder(&src, &out, format, &options, &crash)
        }));
        assert!(result.is_err(), "{name}: finished before the crash");
        assert!(
            !out.exists(),
            "{name}: a partial output under the final name"
        );
        let partial = format::staging::partial_path(&out);
        for path in [&out, &partial] {
            let err = format::open(path).unwrap_err();
            assert!(
                matches!(err, Error::Incomplete { .. }) && err.to_string().contains("--resume"),
                "{name}: {}: {err}",
                path.display()
            );
        }
        // What a crash in the middle of the next chunk leaves: bytes past the last commit.
        let staged: Vec<PathBuf> = fs::read_dir(&partial)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.extension()
                    .is_some_and(|x| x == "bin" || x == "tfrecord" || x == "index")
            })
            .collect();
        assert!(!staged.is_empty(), "{name}: nothing staged");
        for path in &staged {
            append_garbage(path);
        }
        // Without --resume the partial output is left alone.
        let err = pack::pack_image_folder(&src, &out, format, &options, &NoProgress).unwrap_err();
        assert!(
            matches!(err, Error::AlreadyExists { .. }) && err.to_string().contains("--resume"),
            "{name}: {err}"
        );

        let resume = options.clone().with_mode(StartMode {
            resume: true,
            force: false,
        });
        let summary = pack::pack_image_folder(&src, &out, format, &resume, &NoProgress).unwrap();
        assert_eq!(
            summary.resumed_from, 8,
            "{name}: 2 chunks of 4 were committed"
        );
        assert_eq!(summary.samples, 16);
        let rejected: Vec<&str> = summary.rejected.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(rejected, BROKEN, "{name}");
        assert!(!partial.exists(), "{name}: staging left behind");

        let clean = dir.path().join(format!("clean-{name}"));
        pack_as(&src, &clean, format, &options);
        assert!(all_records(&out) == all_records(&clean), "{name}: differs");
        let report = verify::verify(&out, Some(&src)).unwrap();
        assert!(report.is_ok(), "{name}: {:?}", report.problems);
    }
}

#[cfg(feature = "hdf5")]
#[test]
fn hdf5_offsets_past_the_data_and_truncated_files_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad-offsets.h5");
    pack_as(&fixture_root(), &path, PackFormat::Hdf5, &small_options());
    {
        let file = hdf5::File::open_rw(&path).unwrap();
        let offsets = file.dataset("offsets").unwrap();
        offsets.write_slice(&[u64::MAX / 2][..], 4..5).unwrap();
    }
    let dataset = format::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    assert!(reader.read(2).is_ok());
    for index in [3, 4] {
        let err = reader.read(index).unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, Error::CorruptRecord { .. })
                && message.contains("bad-offsets.h5")
                && message.contains(&format!("record {index} ("))
                && message.contains("outside the"),
            "{message}"
        );
    }

    let cut = dir.path().join("cut.h5");
    pack_as(&fixture_root(), &cut, PackFormat::Hdf5, &small_options());
    let bytes = fs::read(&cut).unwrap();
    fs::write(&cut, &bytes[..bytes.len() * 3 / 4]).unwrap();
    let err = format::open(&cut).unwrap_err();
    assert!(matches!(err, Error::Hdf5 { .. }), "{err:?}");
    let err = err.to_string();
    assert!(err.contains("cut.h5"), "{err}");

    // Cut short after it was opened: the file changed, as LMDB and record shards say, not one
    // bad record after another.
    let shrinking = dir.path().join("shrinking.h5");
    pack_as(
        &fixture_root(),
        &shrinking,
        PackFormat::Hdf5,
        &small_options(),
    );
    let dataset = format::open(&shrinking).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    let last = dataset.len() - 1;
    assert!(reader.read(last).is_ok());
    let len = fs::metadata(&shrinking).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&shrinking)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = reader.read(last).unwrap_err();
    assert!(
        matches!(&err, Error::FileChanged { path, change }
            if *path == shrinking && change.contains(&format!("from {len} to {}", len / 2))),
        "{err:?}"
    );

    let garbage = dir.path().join("garbage.h5");
    let mut fake = imagefeed::format::hdf5::SIGNATURE.to_vec();
    fake.extend_from_slice(&[0u8; 600]);
    fs::write(&garbage, fake).unwrap();
    let err = format::open(&garbage).unwrap_err();
    // The library's message is kept as the source (an `Hdf5Message`, read inside the HDF5
    // gate), beside what imagefeed was doing.
    assert!(
        matches!(&err, Error::Hdf5 { source, .. } if std::error::Error::source(&err)
            .is_some_and(|s| s.to_string() == source.to_string())),
        "{err:?}"
    );
    let err = err.to_string();
    assert!(err.contains("garbage.h5") && err.contains("HDF5"), "{err}");
}

/// Where record `index` lies in its shard: (shard path, offset, length), from the indexes.
fn locate(dir: &Path, index: usize) -> (PathBuf, u64, u64) {
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(dir.join("imagefeed-records.json")).unwrap()).unwrap();
    let mut left = index;
    for shard in manifest["shards"].as_array().unwrap() {
        let n = shard["records"].as_u64().unwrap() as usize;
        if left < n {
            let index_text =
                fs::read_to_string(dir.join(shard["index"].as_str().unwrap())).unwrap();
            let line = index_text.lines().nth(left).unwrap();
            let (offset, len) = line.split_once(' ').unwrap();
            return (
                dir.join(shard["file"].as_str().unwrap()),
                offset.parse().unwrap(),
                len.parse().unwrap(),
            );
        }
        left -= n;
    }
    panic!("no record {index}");
}

/// Our manifest is a text file a flipped byte or an edit can change: a label base, class
/// names or a payload kind that no longer match the records make bad records (each names its
/// class or format), never labels shifted or renamed, or JPEGs read as raw pixels, without a
/// word.
#[test]
fn a_records_manifest_changed_since_packing_makes_bad_records_not_other_labels() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edited.records");
    pack_as(
        &fixture_root(),
        &path,
        PackFormat::Records,
        &small_options(),
    );
    let whole = records(format::open(&path).unwrap().as_ref());
    let manifest_path = path.join("imagefeed-records.json");
    let original: serde_json::Value =
        serde_json::from_slice(&fs::read(&manifest_path).unwrap()).unwrap();
    let classes = original["classes"].as_array().unwrap().clone();
    assert!(classes.len() >= 2);
    // Each edit, and the packed labels whose records it leaves wrong.
    type Edit = (
        &'static str,
        Box<dyn Fn(&mut serde_json::Value)>,
        fn(u32) -> bool,
    );
    let edits: [Edit; 4] = [
        (
            "label base",
            Box::new(|m| m["label_base"] = 1.into()),
            |_| true,
        ),
        (
            "payload kind",
            Box::new(|m| m["payload"] = "raw-rgb8".into()),
            |_| true,
        ),
        (
            "classes swapped",
            Box::new(|m| m["classes"].as_array_mut().unwrap().swap(0, 1)),
            |label| label < 2,
        ),
        (
            "class renamed",
            Box::new(|m| m["classes"][0] = "renamed".into()),
            |label| label == 0,
        ),
    ];
    for (what, edit, wrong) in edits {
        let mut manifest = original.clone();
        edit(&mut manifest);
        fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
        let dataset = format::open(&path).unwrap();
        let mut reader = dataset.open_reader().unwrap();
        for (index, (key, label, _)) in whole.iter().enumerate() {
            match reader.read(index) {
                Ok(record) => assert!(
                    !wrong(*label) && record.label == *label,
                    "{what}: {key} read as label {} (packed: {label})",
                    record.label
                ),
                Err(err) => assert!(
                    wrong(*label)
                        && matches!(&err, Error::CorruptRecord { key: k, .. } if k == key),
                    "{what}: {key} (label {label}): {err}"
                ),
            }
        }
        let report = imagefeed::verify::verify(&path, None).unwrap();
        assert!(!report.is_ok(), "{what}: verify passed");
    }
}

#[test]
fn corrupt_and_truncated_shards_are_bad_samples_naming_shard_and_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.records");
    let options = small_options().with_shard_bytes(8 << 10);
    pack_as(&fixture_root(), &path, PackFormat::Records, &options);
    // Flip one byte inside record 5's data.
    let (shard, offset, len) = locate(&path, 5);
    let mut bytes = fs::read(&shard).unwrap();
    bytes[(offset + len / 2) as usize] ^= 0x55;
    fs::write(&shard, bytes).unwrap();
    // Cut the last shard short, in the middle of its last record.
    let (last_shard, last_offset, last_len) = locate(&path, 15);
    let bytes = fs::read(&last_shard).unwrap();
    fs::write(&last_shard, &bytes[..(last_offset + last_len / 2) as usize]).unwrap();

    let dataset = format::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    let err = reader.read(5).unwrap_err();
    assert!(matches!(err, Error::CorruptRecord { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains(&shard.file_name().unwrap().to_string_lossy().to_string())
            && err.contains("record 5 (")
            && err.contains("CRC"),
        "{err}"
    );
    let err = reader.read(15).unwrap_err();
    assert!(matches!(err, Error::CorruptRecord { .. }), "{err:?}");
    assert!(err.to_string().contains("truncated"), "{err}");
    assert!(reader.read(4).is_ok() && reader.read(6).is_ok());

    // The loader skips both and reports them by index; the epoch completes (2 of 16 is over
    // the default cap, so it is lifted here).
    let config = LoaderConfig::default()
        .with_batch_size(4)
        .with_workers(2)
        .with_transform(Transform::none())
        .with_bad_samples(BadSamplePolicy::Skip)
        .with_max_bad(None);
    let loader = Loader::new(dataset, config).unwrap();
    let mut bad = Vec::new();
    let mut delivered = 0;
    for batch in loader.epoch(0) {
        let batch = batch.unwrap();
        delivered += batch.len();
        bad.extend(batch.bad.iter().map(|b| b.index));
    }
    bad.sort();
    assert_eq!(bad, [5, 15]);
    assert_eq!(delivered, 14);

    // The cut shard is named when the dataset opens, and inspect does not call it complete
    // (the flipped byte alone leaves it complete, with a bad record).
    let dataset = format::open(&path).unwrap();
    assert_eq!(dataset.cut_shards(), 1);
    let name = last_shard
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains(&name) && n.contains("cut short") && n.contains("last 1 of")),
        "{:?}",
        dataset.notices()
    );
    let inspection = imagefeed::inspect::inspect(&path).unwrap();
    assert!(!inspection.complete);
    assert_eq!(inspection.cut_shards, 1);
    assert_eq!(inspection.bad_records.len(), 2);
    fs::write(&last_shard, &bytes).unwrap();
    let inspection = imagefeed::inspect::inspect(&path).unwrap();
    assert!(inspection.complete, "the shard made whole again");
    assert_eq!(inspection.cut_shards, 0);
    assert_eq!(inspection.bad_records.len(), 1);
}

#[test]
fn a_split_conversion_joins_into_exactly_the_unsplit_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_root();
    // Four parts of the tree with its broken files: each part rejects its own.
    let mut rejected = Vec::new();
    let parts: Vec<PathBuf> = (0..4)
        .rev()
        .map(|i| {
            let part = dir.path().join(format!("part-{i}.lmdb"));
            let options = small_options().with_part(Some(Part { index: i, count: 4 }));
            let summary = pack_as(&src, &part, PackFormat::Lmdb, &options);
            rejected.extend(summary.rejected.into_iter().map(|r| r.key));
            part
        })
        .collect();
    rejected.sort();
    assert_eq!(rejected, BROKEN);
    let part_info = format::open(&parts[0])
        .unwrap()
        .info()
        .part
        .clone()
        .unwrap();
    assert_eq!((part_info.index, part_info.count), (3, 4));

    let whole = dir.path().join("whole.records");
    pack_as(&src, &whole, PackFormat::Records, &small_options());
    for (format, name) in [
        (PackFormat::Records, "joined.records"),
        (PackFormat::Lmdb, "joined.lmdb"),
    ] {
        let joined = dir.path().join(name);
        let summary = pack::join(&parts, &joined, format, &small_options(), &NoProgress).unwrap();
        assert_eq!(summary.samples, 16);
        assert!(all_records(&joined) == all_records(&whole), "{name}");
        assert!(format::open(&joined).unwrap().info().part.is_none());
        assert!(verify::verify(&joined, Some(&src)).unwrap().is_ok());
    }

    // Missing and repeated parts, parts of another conversion, and whole datasets are refused.
    let out = dir.path().join("never.lmdb");
    let join = |parts: &[PathBuf]| {
        pack::join(parts, &out, PackFormat::Lmdb, &small_options(), &NoProgress).unwrap_err()
    };
    let err = join(&parts[..3]);
    assert!(
        matches!(err, Error::Config(_)) && err.to_string().contains("missing: [0]"),
        "{err:?}"
    );
    let err = join(&[
        parts[0].clone(),
        parts[0].clone(),
        parts[1].clone(),
        parts[2].clone(),
    ]);
    assert!(
        matches!(err, Error::Config(_)) && err.to_string().contains("given twice: [3]"),
        "{err:?}"
    );
    let other = dir.path().join("other-part.lmdb");
    let other_src = dir.path().join("other-src");
    support::copy_tree(&src, &other_src);
    fs::remove_file(other_src.join("class02/img00003.jpg")).unwrap();
    pack_as(
        &other_src,
        &other,
        PackFormat::Lmdb,
        &small_options().with_part(Some(Part { index: 0, count: 4 })),
    );
    let mixed = [parts[0].clone(), parts[1].clone(), parts[2].clone(), other];
    // Readable parts, only not of one conversion: the caller's mistake, named as such (it was
    // "not a readable dataset").
    let err = join(&mixed);
    assert!(
        matches!(&err, Error::Config(m) if m.contains("parts of different conversions")),
        "{err:?}"
    );
    let err = join(std::slice::from_ref(&whole));
    assert!(
        matches!(err, Error::NotADataset { .. })
            && err.to_string().contains("not a part of a split conversion"),
        "{err:?}"
    );
    // Part numbers no split writes, every part agreeing (a hostile try: a count of 10^12 had
    // the join list the parts it wanted, allocate 8 TB and abort).
    let with_info = |from: &Path, name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let to = dir.path().join(name);
        fs::copy(from, &to).unwrap();
        support::edit_lmdb_meta(&to, "info", edit);
        to
    };
    let huge: Vec<PathBuf> = parts
        .iter()
        .enumerate()
        .map(|(i, part)| {
            with_info(part, &format!("huge-{i}.lmdb"), &|info| {
                info["part"]["count"] = (1u64 << 40).into();
            })
        })
        .collect();
    let past = [with_info(&parts[0], "past.lmdb", &|info| {
        info["part"]["index"] = 4.into();
    })];
    for hostile in [&huge[..], &past[..]] {
        let err = join(hostile);
        assert!(
            matches!(&err, Error::NotADataset { reason, .. }
                if reason.contains("which no split conversion writes")),
            "{err:?}"
        );
    }
    // Numbers whose range overflowed u64 (2^40 items, the last of 2^40 parts): a part that
    // does not hold its range, not a panic.
    let vast = [with_info(&parts[0], "vast.lmdb", &|info| {
        info["part"]["index"] = ((1u64 << 40) - 1).into();
        info["part"]["count"] = (1u64 << 40).into();
        info["part"]["source_items"] = (1u64 << 40).into();
    })];
    let err = join(&vast);
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("where its part of the listing has 1:")),
        "{err:?}"
    );
    // Parts that do not hold their range (each item one sample or one rejected file): a count
    // of rejections past any sum (it overflowed the join's), and one too many.
    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let edits: [(&str, Edit<'_>); 2] = [
        ("overflow", &|info| {
            info["rejected_at_pack"] = u64::MAX.into()
        }),
        ("one-more", &|info| {
            let was = info["rejected_at_pack"].as_u64().unwrap();
            info["rejected_at_pack"] = (was + 1).into();
        }),
    ];
    for (name, edit) in edits {
        let mut edited = parts.clone();
        edited[0] = with_info(&parts[0], &format!("{name}.lmdb"), edit);
        let err = join(&edited);
        assert!(
            matches!(&err, Error::NotADataset { reason, path }
                if path.ends_with(format!("{name}.lmdb"))
                    && reason.contains("files, where its part of the listing has 5")),
            "{err:?}"
        );
    }
    // Many parts of a split missing: the first ten named, the rest counted.
    let tree = support::small_tree(dir.path());
    let many: Vec<PathBuf> = [0, 4, 19]
        .into_iter()
        .map(|index| {
            let part = dir.path().join(format!("many-{index}.lmdb"));
            let options = small_options().with_part(Some(Part { index, count: 20 }));
            pack_as(&tree, &part, PackFormat::Lmdb, &options);
            part
        })
        .collect();
    let err = join(&many);
    assert!(
        matches!(&err, Error::Config(m)
            if m.contains("missing: [1, 2, 3, 5, 6, 7, 8, 9, 10, 11 and 7 more]")),
        "{err:?}"
    );
    // Parts resized alike but re-encoded at different qualities (a hostile try joined 90, 50
    // and 90 into one dataset whose plan said 90).
    let resized: Vec<PathBuf> = [90, 50]
        .into_iter()
        .enumerate()
        .map(|(i, quality)| {
            let part = dir.path().join(format!("resized-{i}.lmdb"));
            let options = small_options()
                .with_resize_short_side(Some(8))
                .with_quality(quality)
                .with_part(Some(Part { index: i, count: 2 }));
            pack_as(&src, &part, PackFormat::Lmdb, &options);
            part
        })
        .collect();
    let err = join(&resized);
    assert!(
        matches!(&err, Error::Config(m) if m.contains("--quality")),
        "{err:?}"
    );
    assert!(!out.exists());

    // A part index past the count is a configuration error, not a panic.
    let err = pack::pack_image_folder(
        &src,
        &dir.path().join("x.lmdb"),
        PackFormat::Lmdb,
        &small_options().with_part(Some(Part { index: 4, count: 4 })),
        &NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::Config(_)) && err.to_string().contains("part 4 of 4"),
        "{err}"
    );
}

#[cfg(feature = "hdf5")]
#[test]
fn convert_writes_every_format_from_an_h5py_file() {
    let dir = tempfile::tempdir().unwrap();
    let h5py = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat/h5py-vlen.h5");
    let source = records(format::open(&h5py).unwrap().as_ref());
    for (format, name) in [
        (PackFormat::Lmdb, "c.lmdb"),
        (PackFormat::Hdf5, "c.h5"),
        (PackFormat::Records, "c.records"),
    ] {
        let out = dir.path().join(name);
        let summary = pack::convert(&h5py, &out, format, &small_options(), &NoProgress).unwrap();
        // The broken files h5py stored unchecked are rejected by key.
        assert_eq!(summary.rejected.len(), BROKEN.len(), "{name}");
        let kept: Vec<Row> = source
            .iter()
            .filter(|r| !summary.rejected.iter().any(|x| x.key == r.0))
            .cloned()
            .collect();
        assert!(all_records(&out) == kept, "{name}");
        let dataset = format::open(&out).unwrap();
        assert_eq!(dataset.classes(), ["class00", "class01", "class02"]);
    }
}

#[test]
fn a_records_staging_directory_is_never_taken_for_a_dataset() {
    // Regression: a records OUT.partial left by a kill opened as foreign shards, verified "OK"
    // and inspected as "complete: yes".
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cut.records");
    let options = small_options().with_shard_bytes(8 << 10);
    let crash = Crash::after(2);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pack::pack_image_folder(&fixture_root(), &out, PackFormat::Records, &options, &crash)
    }));
    assert!(result.is_err());
    let partial = format::staging::partial_path(&out);
    assert!(partial.join("shard-00000.tfrecord").is_file());
    for path in [&partial, &out] {
        let err = format::open(path).unwrap_err();
        assert!(
            matches!(err, Error::Incomplete { .. }) && err.to_string().contains("--resume"),
            "{}: {err}",
            path.display()
        );
        let err = imagefeed::inspect::inspect(path).unwrap_err();
        assert!(matches!(err, Error::Incomplete { .. }), "{err}");
        let err = verify::verify(path, None).unwrap_err();
        assert!(matches!(err, Error::Incomplete { .. }), "{err}");
    }
    // The same directory under another name (a copy, a rename) is still refused: its
    // progress record says what it is.
    let copy = dir.path().join("renamed");
    support::copy_tree(&partial, &copy);
    let err = format::open(&copy).unwrap_err();
    assert!(matches!(err, Error::Incomplete { .. }), "{err}");
}

#[test]
fn a_records_dataset_whose_deletion_was_interrupted_is_never_a_dataset_and_force_replaces_it() {
    // A kill while `--force` deleted an old records directory left it a third deleted; it then
    // "verified OK" with the records left. The deletion marks the directory first (on disk:
    // the file `format::staging::DELETING` holding `{"magic": "imagefeed-deleting"}`) and drops the
    // manifest next, so what is left is refused by every reader and still recognised as ours.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("old.records");
    let options = small_options().with_shard_bytes(8 << 10);
    pack_as(&fixture_root(), &out, PackFormat::Records, &options);
    // Where an interrupted deletion stops: marked, manifest gone, shards left.
    fs::write(
        out.join(format::staging::DELETING),
        "{\"magic\": \"imagefeed-deleting\"}\n",
    )
    .unwrap();
    fs::remove_file(out.join(format::tfrecord::MANIFEST)).unwrap();
    assert!(out.join("shard-00001.tfrecord").is_file());
    let err = format::open(&out).unwrap_err();
    assert!(matches!(err, Error::Incomplete { .. }), "{err}");
    let err = verify::verify(&out, None).unwrap_err();
    assert!(matches!(err, Error::Incomplete { .. }), "{err}");
    assert!(format::staging::is_own_output(&out));

    // The same shards without the mark (someone's copy of them) are not ours to delete.
    let copy = dir.path().join("copy");
    support::copy_tree(&out, &copy);
    fs::remove_file(copy.join(format::staging::DELETING)).unwrap();
    assert!(!format::staging::is_own_output(&copy));
    // Nor is a mark holding anything else.
    fs::write(
        copy.join(format::staging::DELETING),
        "{\"magic\": \"other\"}",
    )
    .unwrap();
    assert!(!format::staging::is_own_output(&copy));

    // --force replaces what is left with a complete dataset.
    let forced = options.clone().with_mode(StartMode {
        force: true,
        resume: false,
    });
    pack_as(&fixture_root(), &out, PackFormat::Records, &forced);
    assert!(!out.join(format::staging::DELETING).exists());
    let clean = dir.path().join("clean.records");
    pack_as(&fixture_root(), &clean, PackFormat::Records, &options);
    assert!(all_records(&out) == all_records(&clean));
}

#[test]
fn a_complete_dataset_under_a_partial_name_is_never_opened_and_resume_says_to_force() {
    // Regression: a kill between an LMDB's `complete: true` and its rename, or right after a
    // records replacement swapped the directories, left a complete dataset at OUT.partial
    // (the old one, in the records case) that verify and the loader accepted as the dataset;
    // `--resume` on the records one said only "not a partial records directory".
    let dir = tempfile::tempdir().unwrap();
    for format in PackFormat::available() {
        let out = dir.path().join(format!("k.{}", format.name()));
        pack_as(&fixture_root(), &out, format, &small_options());
        let partial = format::staging::partial_path(&out);
        fs::rename(&out, &partial).unwrap();
        for path in [&partial, &out] {
            let err = format::open(path).map(|_| ()).unwrap_err();
            assert!(
                matches!(err, Error::Incomplete { .. }),
                "{}: {err}",
                path.display()
            );
            let err = verify::verify(path, None).unwrap_err();
            assert!(matches!(err, Error::Incomplete { .. }), "{err}");
            // inspect describes an unfinished LMDB as such; the others it refuses.
            match imagefeed::inspect::inspect(path) {
                Ok(seen) => assert!(!seen.complete && format == PackFormat::Lmdb),
                Err(err) => assert!(matches!(err, Error::Incomplete { .. }), "{err}"),
            }
        }
        assert!(
            format::open(&partial)
                .map(|_| ())
                .unwrap_err()
                .to_string()
                .contains("*.partial")
        );
        // Nothing is written under such a name either.
        let named_partial = dir.path().join(format!("mine.{}.partial", format.name()));
        let err = pack::pack_image_folder(
            &fixture_root(),
            &named_partial,
            format,
            &small_options(),
            &NoProgress,
        )
        .unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        assert!(!named_partial.exists());
        assert!(!format::staging::partial_path(&named_partial).exists());
    }
    // --resume on the records one has nothing to resume and says what to do.
    let out = dir.path().join("k.records");
    let resume = small_resume_options();
    let err = pack::pack_image_folder(
        &fixture_root(),
        &out,
        PackFormat::Records,
        &resume,
        &NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::ResumeMismatch { .. }) && err.to_string().contains("--force"),
        "{err}"
    );
    let force = small_options().with_mode(StartMode {
        force: true,
        resume: false,
    });
    pack_as(&fixture_root(), &out, PackFormat::Records, &force);
    assert!(format::open(&out).is_ok());
    assert!(!format::staging::partial_path(&out).exists());

    // The LMDB one, as a writer of ours leaves it when killed between its last commit and
    // its rename (the kill loop found that window): complete, with its lock file still there.
    // Without the lock file it is a copy put there, and refused (the hostile-review test
    // `resume_and_concurrent_runs_never_write_outside_their_own_staging_output`); with it,
    // --resume with the same plan publishes it, nothing packed again.
    let out = dir.path().join("k.lmdb");
    let partial = format::staging::partial_path(&out);
    let mut lock = partial.clone().into_os_string();
    lock.push("-lock");
    let resume_lmdb = |options: &PackOptions| {
        pack::pack_image_folder(
            &fixture_root(),
            &out,
            PackFormat::Lmdb,
            options,
            &NoProgress,
        )
    };
    let err = resume_lmdb(&resume).unwrap_err();
    assert!(matches!(err, Error::ResumeMismatch { .. }), "{err}");
    assert!(partial.is_file() && !out.exists());
    fs::write(&lock, b"").unwrap();
    let summary = resume_lmdb(&resume).unwrap();
    assert_eq!(
        summary.resumed_from,
        summary.samples + summary.rejected.len()
    );
    assert!(!partial.exists() && !Path::new(&lock).exists());
    assert!(verify::verify(&out, Some(&fixture_root())).unwrap().is_ok());
    // With another plan it is still refused, and left as it was.
    fs::rename(&out, &partial).unwrap();
    fs::write(&lock, b"").unwrap();
    let err = resume_lmdb(&resume.clone().with_raw(true)).unwrap_err();
    assert!(matches!(err, Error::ResumeMismatch { .. }), "{err}");
    assert!(partial.is_file() && !out.exists());
}

#[test]
fn a_records_pack_stopped_at_its_rename_is_finished_by_resume_not_packed_again() {
    // Regression: the records writer removed its progress record before its final rename, so
    // a run stopped between the two left a complete dataset at OUT.partial with nothing to say
    // it was this pack's, and `--resume` refused it ("use --force to pack again"). The kill loop
    // found the kill; here the rename is refused instead: something was put at OUT meanwhile.
    struct PutsAFileAtOut<'a>(&'a Path);
    impl pack::PackObserver for PutsAFileAtOut<'_> {
        fn advanced(&self, _done: usize, _payload_bytes: u64) {
            let _ = fs::create_dir(self.0);
            let _ = fs::write(self.0.join("notes.txt"), "mine");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("k.records");
    let partial = format::staging::partial_path(&out);
    let err = pack::pack_image_folder(
        &fixture_root(),
        &out,
        PackFormat::Records,
        &small_options(),
        &PutsAFileAtOut(&out),
    )
    .unwrap_err();
    assert!(matches!(err, Error::NotReplaceable { .. }), "{err}");
    assert_eq!(fs::read(out.join("notes.txt")).unwrap(), b"mine");
    assert!(partial.join(format::tfrecord::MANIFEST).is_file());

    // The user moves their file away and resumes: the staged dataset is published as it is.
    fs::remove_dir_all(&out).unwrap();
    let resume = small_resume_options();
    let summary = pack::pack_image_folder(
        &fixture_root(),
        &out,
        PackFormat::Records,
        &resume,
        &NoProgress,
    )
    .unwrap();
    assert_eq!(
        summary.resumed_from,
        summary.samples + summary.rejected.len()
    );
    assert!(!partial.exists());
    assert!(!out.join("progress.json").exists());
    assert!(verify::verify(&out, Some(&fixture_root())).unwrap().is_ok());
}

#[test]
fn a_manifest_naming_paths_outside_its_directory_or_a_shard_twice_is_refused() {
    // Regression: the manifest's shard and index names were joined to the directory as given,
    // so a manifest naming "../x" or "/etc/x" read files outside the dataset, and one naming a
    // shard twice served its records twice.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("k.records");
    let options = small_options().with_shard_bytes(8 << 10);
    pack_as(&fixture_root(), &out, PackFormat::Records, &options);
    let manifest_path = out.join(format::tfrecord::MANIFEST);
    let original: serde_json::Value =
        serde_json::from_slice(&fs::read(&manifest_path).unwrap()).unwrap();
    assert!(original["shards"].as_array().unwrap().len() >= 2);
    let outside = dir.path().join("outside.tfrecord");
    fs::copy(out.join("shard-00001.tfrecord"), &outside).unwrap();
    let first_shard = original["shards"][0]["file"].clone();
    for (field, name, expected) in [
        (
            "file",
            serde_json::json!("../outside.tfrecord"),
            "as a path",
        ),
        (
            "file",
            serde_json::json!(outside.to_str().unwrap()),
            "as a path",
        ),
        (
            "index",
            serde_json::json!("sub/shard-00001.index"),
            "as a path",
        ),
        ("file", first_shard, "twice"),
    ] {
        let mut forged = original.clone();
        forged["shards"][1][field] = name.clone();
        fs::write(&manifest_path, serde_json::to_vec(&forged).unwrap()).unwrap();
        let err = format::open(&out).map(|_| ()).unwrap_err();
        assert!(
            matches!(err, Error::NotADataset { .. }) && err.to_string().contains(expected),
            "{name}: {err}"
        );
        assert!(err.to_string().contains("imagefeed-records.json"), "{err}");
    }
    fs::write(&manifest_path, serde_json::to_vec(&original).unwrap()).unwrap();
    assert!(format::open(&out).is_ok());
}

/// Packs the fixture tree into `out` and crashes after `chunks` committed chunks, leaving
/// `OUT.partial` behind.
fn crash_pack(out: &Path, format: PackFormat, options: &PackOptions, chunks: usize) {
    let crash = support::Crash::after(chunks);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pack::pack_image_folder(&fixture_root(), out, format, options, &crash)
    }));
    assert!(result.is_err(), "the pack finished before the crash");
    assert!(format::staging::partial_path(out).exists());
}

/// Every file under `dir` (not following links) with its bytes.
fn contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut all: Vec<_> = walkdir(dir)
        .into_iter()
        .map(|p| {
            let bytes = fs::read(&p).unwrap_or_default();
            (p, bytes)
        })
        .collect();
    all.sort();
    all
}

fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            out.extend(walkdir(&entry.path()));
        } else {
            out.push(entry.path());
        }
    }
    out
}

#[test]
fn resume_and_concurrent_runs_never_write_outside_their_own_staging_output() {
    // Regressions found by a hostile review: `--resume` followed a progress record naming
    // "../victim.bin" and overwrote it; followed an OUT.partial that was a link (or a hard link)
    // to another dataset, and links inside a staging directory; resumed a complete LMDB in
    // place; two `--force` runs to one records OUT deleted each other's staging files; a file
    // hard-linked at the LMDB lock path was overwritten; `--force` deleted a user's file named
    // like a shard inside a dataset of ours.
    let dir = tempfile::tempdir().unwrap();
    let victims = dir.path().join("victims");
    fs::create_dir(&victims).unwrap();
    fs::write(victims.join("victim.bin"), vec![7u8; 100_000]).unwrap();
    let keep = victims.join("keep.lmdb");
    pack_as(&fixture_root(), &keep, PackFormat::Lmdb, &small_options());
    let before = contents(&victims);
    let work = dir.path().join("work");
    fs::create_dir(&work).unwrap();
    let small_shards = small_options().with_shard_bytes(8 << 10);
    let resume = |options: &PackOptions| {
        options.clone().with_mode(StartMode {
            force: false,
            resume: true,
        })
    };
    let force = |options: &PackOptions| {
        options.clone().with_mode(StartMode {
            force: true,
            resume: false,
        })
    };
    let run = |out: &Path, format: PackFormat, options: &PackOptions| {
        pack::pack_image_folder(&fixture_root(), out, format, options, &NoProgress)
    };

    // A progress record naming a file outside the staging directory.
    let out = work.join("named.records");
    crash_pack(&out, PackFormat::Records, &small_shards, 2);
    let progress_path = format::staging::partial_path(&out).join("progress.json");
    let mut progress: serde_json::Value =
        serde_json::from_slice(&fs::read(&progress_path).unwrap()).unwrap();
    progress["shards"][0][0]["file"] = serde_json::json!("../../victims/victim.bin");
    fs::write(&progress_path, serde_json::to_vec(&progress).unwrap()).unwrap();
    let err = run(&out, PackFormat::Records, &resume(&small_shards)).unwrap_err();
    assert!(matches!(err, Error::ResumeMismatch { .. }), "{err}");
    assert!(
        err.to_string().contains("not a progress record of ours"),
        "{err}"
    );

    // A link inside a staging directory.
    let out = work.join("linked.records");
    crash_pack(&out, PackFormat::Records, &small_shards, 2);
    let shard = format::staging::partial_path(&out).join("shard-00000.tfrecord");
    fs::remove_file(&shard).unwrap();
    std::os::unix::fs::symlink(victims.join("victim.bin"), &shard).unwrap();
    let err = run(&out, PackFormat::Records, &resume(&small_shards)).unwrap_err();
    assert!(
        matches!(err, Error::NotReplaceable { .. }) && err.to_string().contains("--resume"),
        "{err}"
    );

    // OUT.partial as a link, or a hard link, to a finished dataset; or a copy of one.
    for (name, make) in [
        (
            "symlink.lmdb",
            &(|p: &Path| std::os::unix::fs::symlink(&keep, p).unwrap()) as &dyn Fn(&Path),
        ),
        ("hardlink.lmdb", &|p: &Path| {
            fs::hard_link(&keep, p).unwrap()
        }),
        ("copy.lmdb", &|p: &Path| {
            fs::copy(&keep, p).unwrap();
        }),
    ] {
        let out = work.join(name);
        make(&format::staging::partial_path(&out));
        let err = run(&out, PackFormat::Lmdb, &resume(&small_options())).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotReplaceable { .. } | Error::ResumeMismatch { .. }
            ),
            "{name}: {err}"
        );
        assert!(!out.exists(), "{name}");
    }

    // Another run holding the staging output: --force and --resume both wait their turn.
    for format in PackFormat::available() {
        let out = work.join(format!("busy.{}", format.name()));
        crash_pack(&out, format, &small_shards, 2);
        let partial = format::staging::partial_path(&out);
        let holder = fs::File::open(&partial).unwrap();
        use std::os::fd::AsRawFd as _;
        // Retried for a while: a child forked by another test's HDF5 open trial may hold a
        // copy of the crashed run's descriptor for the moment before it closes it (the same
        // wait `lock_staging` makes).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let locked = loop {
            // SAFETY: flock on a descriptor this test owns.
            let locked = unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if locked == 0 || std::time::Instant::now() > deadline {
                break locked;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(locked, 0);
        let staged = contents(&work);
        for options in [force(&small_shards), resume(&small_shards)] {
            let err = run(&out, format, &options).unwrap_err();
            assert!(
                err.to_string()
                    .contains("another pack-dataset run is writing it"),
                "{err}"
            );
            assert!(
                contents(&work) == staged,
                "{}: staging changed",
                format.name()
            );
        }
        drop(holder);
        run(&out, format, &resume(&small_shards)).unwrap();
        assert!(format::open(&out).is_ok());
    }

    // Something that is not an LMDB lock file at the LMDB writer's lock path.
    let out = work.join("lockpath.lmdb");
    let mut lock = format::staging::partial_path(&out).into_os_string();
    lock.push("-lock");
    fs::hard_link(victims.join("victim.bin"), &lock).unwrap();
    let err = run(&out, PackFormat::Lmdb, &small_options()).unwrap_err();
    assert!(matches!(err, Error::NotReplaceable { .. }), "{err}");
    fs::remove_file(&lock).unwrap();
    fs::write(&lock, "my notes").unwrap();
    let err = run(&out, PackFormat::Lmdb, &small_options()).unwrap_err();
    assert!(matches!(err, Error::NotReplaceable { .. }), "{err}");
    assert_eq!(fs::read(&lock).unwrap(), b"my notes");
    // A file of zeros with a non-zero byte in it is not a lock file either.
    let mut almost = vec![0u8; 8192];
    almost[100] = 1;
    fs::write(&lock, &almost).unwrap();
    let err = run(&out, PackFormat::Lmdb, &small_options()).unwrap_err();
    assert!(matches!(err, Error::NotReplaceable { .. }), "{err}");
    // But a lock file liblmdb sized and never got to write (a kill between its ftruncate and
    // its header: all zeros) is one, and the pack goes on. Regression: found by the CLI's
    // killed --force replacement test, which then failed on the next --force.
    fs::write(&lock, vec![0u8; 8192]).unwrap();
    run(&out, PackFormat::Lmdb, &small_options()).unwrap();
    assert!(format::open(&out).is_ok());

    // A file named like a shard that the manifest does not list is not ours to delete.
    let out = work.join("extra.records");
    pack_as(&fixture_root(), &out, PackFormat::Records, &small_shards);
    fs::write(out.join("shard-00099.tfrecord"), "precious").unwrap();
    let err = run(&out, PackFormat::Records, &force(&small_shards)).unwrap_err();
    assert!(
        matches!(err, Error::NotReplaceable { .. }) && err.to_string().contains("shard-00099"),
        "{err}"
    );
    assert_eq!(
        fs::read(out.join("shard-00099.tfrecord")).unwrap(),
        b"precious"
    );

    assert!(
        contents(&victims) == before,
        "a file outside the outputs changed"
    );
}

/// A single TFRecord shard of `n` records from the fixture tree (no manifest, no index), and
/// the payloads it holds in order.
fn foreign_shard(dir: &Path, n: usize) -> (PathBuf, Vec<Vec<u8>>) {
    let packed = dir.join("packed.records");
    let options = small_options().with_shard_bytes(u64::MAX);
    pack_as(&fixture_root(), &packed, PackFormat::Records, &options);
    let payloads: Vec<Vec<u8>> = all_records(&packed).into_iter().map(|r| r.2).collect();
    assert_eq!(payloads.len(), n);
    let shard = dir.join("train-00000-of-00001");
    fs::copy(packed.join("shard-00000.tfrecord"), &shard).unwrap();
    (shard, payloads)
}

#[test]
fn an_unindexed_shard_damaged_anywhere_keeps_every_good_record_and_saves_no_index() {
    // Regression: a shard without an index whose length CRC was corrupt, whose declared length
    // was huge, or which was cut, was indexed up to the damage, the rest silently dropped, and
    // the short index saved so that later opens were silent too.
    let dir = tempfile::tempdir().unwrap();
    let (pristine, payloads) = foreign_shard(dir.path(), 16);
    let bytes = fs::read(&pristine).unwrap();
    let scan = imagefeed::format::tfrecord::scan_shard(&bytes);
    assert!(scan.damaged.is_empty());
    let offsets = scan.records;
    let (at, _) = offsets[5];
    let at = at as usize;
    let mut bad_crc = bytes.clone();
    bad_crc[at + 9] ^= 0x40;
    let mut huge = bytes.clone();
    let len = (1u64 << 50).to_le_bytes();
    huge[at..at + 8].copy_from_slice(&len);
    huge[at + 8..at + 12]
        .copy_from_slice(&imagefeed::format::tfrecord::masked_crc(&len).to_le_bytes());
    let (last, last_len) = offsets[15];
    let cut = bytes[..(last + last_len / 2) as usize].to_vec();
    for (what, damaged, bad_index, total) in [
        ("bad length CRC", bad_crc, 5, 16),
        ("huge length", huge, 5, 16),
        ("cut short", cut, 15, 16),
    ] {
        let case = dir.path().join(what.replace(' ', "-"));
        fs::create_dir(&case).unwrap();
        let shard = case.join("train-00000-of-00001");
        fs::write(&shard, &damaged).unwrap();
        for open in 0..2 {
            let dataset = format::open(&case).unwrap();
            assert_eq!(
                dataset.len(),
                total,
                "{what}: every record is still counted"
            );
            assert!(
                dataset
                    .notices()
                    .iter()
                    .any(|n| n.contains("not saved: the shard is damaged"))
                    && dataset
                        .notices()
                        .iter()
                        .any(|n| n.contains(&format!("record {bad_index} is damaged"))),
                "{what} (open {open}): {:?}",
                dataset.notices()
            );
            let mut reader = dataset.open_reader().unwrap();
            for (i, payload) in payloads.iter().enumerate() {
                match reader.read(i) {
                    Ok(r) => {
                        assert_ne!(i, bad_index, "{what}");
                        assert_eq!(r.payload, payload.as_slice(), "{what}: record {i}");
                    }
                    Err(e) => {
                        assert_eq!(i, bad_index, "{what}: {e}");
                        assert!(matches!(e, Error::CorruptRecord { .. }), "{what}: {e:?}");
                        let message = e.to_string();
                        assert!(
                            message.contains("train-00000-of-00001")
                                && message.contains("not a TFRecord frame"),
                            "{what}: {message}"
                        );
                    }
                }
            }
            let saved = imagefeed::format::tfrecord::Records::open(&case)
                .unwrap()
                .save_missing_indexes()
                .unwrap();
            assert!(saved.is_empty(), "{what}: {saved:?}");
            assert!(
                !imagefeed::format::tfrecord::index_path_for(&shard).exists(),
                "{what}: a damaged shard's index was saved"
            );
            let report = verify::verify(&case, None).unwrap();
            assert_eq!(report.problems.len(), 1, "{what}: {:?}", report.problems);
        }
    }
    // A clean shard's index is saved on request, and an index that stops short of its shard is
    // refused.
    let clean = dir.path().join("clean");
    fs::create_dir(&clean).unwrap();
    let shard = clean.join("train-00000-of-00001");
    fs::copy(&pristine, &shard).unwrap();
    let index = imagefeed::format::tfrecord::saved_index_path(&shard);
    assert_eq!(index, clean.join("index/train-00000-of-00001.index"));
    let opened = imagefeed::format::tfrecord::Records::open(&clean).unwrap();
    assert_eq!(imagefeed::Dataset::len(&opened), 16);
    assert!(!index.exists(), "opening wrote an index");
    assert_eq!(
        opened.save_missing_indexes().unwrap(),
        std::slice::from_ref(&index)
    );
    let text = fs::read_to_string(&index).unwrap();
    let short: String = text.lines().take(5).map(|l| format!("{l}\n")).collect();
    fs::write(&index, short).unwrap();
    let err = format::open(&clean).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("train-00000-of-00001.index") && err.contains("delete the index"),
        "{err}"
    );
}

#[test]
fn bytes_appended_to_a_shard_of_ours_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ours.records");
    pack_as(
        &fixture_root(),
        &path,
        PackFormat::Records,
        &small_options(),
    );
    let shard = path.join("shard-00000.tfrecord");
    // Bytes appended: the manifest no longer describes the shard.
    append_garbage(&shard);
    let err = format::open(&path).unwrap_err();
    assert!(matches!(err, Error::NotADataset { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("shard-00000.index") && err.contains("was changed"),
        "{err}"
    );
}

#[test]
fn a_deleted_index_of_ours_is_replaced_by_a_scan_that_must_match_the_manifest() {
    // A damaged index's error says to delete it to have it rebuilt; a hostile try found the
    // dataset then unreadable ("No such file or directory").
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ours.records");
    pack_as(
        &fixture_root(),
        &path,
        PackFormat::Records,
        &small_options(),
    );
    let before = records(format::open(&path).unwrap().as_ref());
    let index = path.join("shard-00000.index");
    fs::remove_file(&index).unwrap();
    let opened = format::open(&path).unwrap();
    assert!(
        opened
            .notices()
            .iter()
            .any(|n| n.contains("shard-00000.index") && n.contains("scanned")),
        "{:?}",
        opened.notices()
    );
    assert_eq!(records(opened.as_ref()), before);
    drop(opened);
    // A shard that no longer holds what the manifest lists cannot stand in for its index.
    append_garbage(&path.join("shard-00000.tfrecord"));
    let err = format::open(&path).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { path, reason } if path == &index && reason.contains("cannot stand in")),
        "{err:?}"
    );
}

#[test]
fn a_staging_directory_killed_before_its_first_record_is_replaced_by_force_and_nothing_else_is() {
    let dir = tempfile::tempdir().unwrap();
    let forced = small_options().with_mode(StartMode {
        force: true,
        resume: false,
    });
    for (format, name) in writable([
        (PackFormat::Hdf5, "d.h5"),
        (PackFormat::Records, "d.records"),
    ]) {
        let out = dir.path().join(name);
        let partial = format::staging::partial_path(&out);
        // A pack killed between writing its progress record's temporary file and renaming it.
        fs::create_dir(&partial).unwrap();
        fs::write(partial.join("progress.json.tmp"), "{\"magic\": \"imag").unwrap();
        assert!(format::staging::is_own_output(&partial), "{name}");
        pack::pack_image_folder(
            &support::fixture_root(),
            &out,
            format,
            &forced,
            &pack::NoProgress,
        )
        .unwrap();
        assert!(
            verify::verify(&out, Some(&support::fixture_root()))
                .unwrap()
                .is_ok(),
            "{name}"
        );
    }
    // A .tmp file beside anything else, or named like nothing of ours, is not ours.
    let other = dir.path().join("other.partial");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("progress.json.tmp"), "x").unwrap();
    fs::write(other.join("notes.txt"), "mine").unwrap();
    assert!(!format::staging::is_own_output(&other));
    fs::remove_file(other.join("notes.txt")).unwrap();
    fs::write(other.join("thesis.tmp"), "mine").unwrap();
    assert!(!format::staging::is_own_output(&other));
}

#[test]
fn resume_after_a_kill_before_the_first_progress_record_starts_afresh() {
    // Regression (kill loop): SIGKILL between creating the staging directory and renaming its
    // first progress record into place left a directory `--resume` refused ("not a partial
    // imagefeed HDF5 (no readable progress.json)"), although the error told the user to resume;
    // likewise an LMDB killed before its first commit ("meta/info is missing").
    let dir = tempfile::tempdir().unwrap();
    let resume_lmdb = small_resume_options();
    let out = dir.path().join("d.lmdb");
    let partial = format::staging::partial_path(&out);
    {
        let mut options = heed::EnvOpenOptions::new();
        options.max_dbs(3);
        // SAFETY: test-only; nothing else has this file open. Nothing is committed.
        let env = unsafe { options.flags(heed::EnvFlags::NO_SUB_DIR).open(&partial) }.unwrap();
        env.prepare_for_closing().wait();
    }
    let _ = fs::remove_file(dir.path().join("d.lmdb.partial-lock"));
    pack::pack_image_folder(
        &fixture_root(),
        &out,
        PackFormat::Lmdb,
        &resume_lmdb,
        &NoProgress,
    )
    .unwrap();
    assert!(verify::verify(&out, Some(&fixture_root())).unwrap().is_ok());
    let resume = small_resume_options();
    for (format, name) in writable([
        (PackFormat::Hdf5, "d.h5"),
        (PackFormat::Records, "d.records"),
    ]) {
        let out = dir.path().join(name);
        let partial = format::staging::partial_path(&out);
        fs::create_dir(&partial).unwrap();
        fs::write(partial.join("progress.json.tmp"), "{\"magic\": \"imag").unwrap();
        pack::pack_image_folder(&fixture_root(), &out, format, &resume, &NoProgress)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            verify::verify(&out, Some(&fixture_root())).unwrap().is_ok(),
            "{name}"
        );
        assert!(!partial.exists(), "{name}");
        // Anything not ours in such a directory is never deleted: resume refuses.
        fs::create_dir(&partial).unwrap();
        fs::write(partial.join("thesis.tmp"), "mine").unwrap();
        let err = pack::pack_image_folder(&fixture_root(), &out, format, &resume, &NoProgress)
            .unwrap_err();
        assert!(partial.join("thesis.tmp").exists(), "{name}: {err}");
        fs::remove_dir_all(&partial).unwrap();
    }
}

/// Flips one byte at `at` in every copy of `needle` in the file at `path` (LMDB may keep an
/// old copy in a free page beside the live one).
fn flip_inside(path: &Path, needle: &[u8], at: usize) {
    let mut bytes = fs::read(path).unwrap();
    let found: Vec<usize> = bytes
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect();
    assert!(
        !found.is_empty(),
        "{}: the payload is stored",
        path.display()
    );
    for start in found {
        bytes[start + at] ^= 0x10;
    }
    fs::write(path, bytes).unwrap();
}

#[test]
fn a_byte_changed_in_a_stored_payload_or_label_is_a_bad_record_in_every_format() {
    // Regression (corruption harness, tests/corrupt.rs): a byte flipped inside a JPEG's entropy
    // data still decodes, to different pixels; LMDB and HDF5 handed those out as good samples.
    // Version-2 layouts store a CRC-32C per record, checked on every read.
    let dir = tempfile::tempdir().unwrap();
    let key = "class02/img00001.jpg";
    let payload = fs::read(fixture_root().join(key)).unwrap();
    for (format, name) in writable([
        (PackFormat::Lmdb, "flip.lmdb"),
        (PackFormat::Hdf5, "flip.h5"),
        (PackFormat::Records, "flip.records"),
    ]) {
        let path = dir.path().join(name);
        pack_as(&fixture_root(), &path, format, &small_options());
        let index = all_records(&path)
            .iter()
            .position(|row| row.0 == key)
            .unwrap();
        // Inside the entropy-coded data: the JPEG still decodes, to other pixels.
        let file = if path.is_dir() {
            locate(&path, index).0
        } else {
            path.clone()
        };
        flip_inside(&file, &payload, payload.len() / 2);
        let mut changed = payload.clone();
        changed[payload.len() / 2] ^= 0x10;
        assert!(
            imagefeed::decode::Decoder::new()
                .decode_rgb(&changed, &mut Vec::new())
                .is_ok(),
            "the changed JPEG must still decode for this test to mean anything"
        );
        let dataset = format::open(&path).unwrap();
        let mut reader = dataset.open_reader().unwrap();
        let err = reader.read(index).unwrap_err();
        let message = err.to_string();
        // A TFRecord's key is inside its (now unreadable) data: it is named by shard and index
        // (`shard#N`), never `?`.
        let named = if format == PackFormat::Records {
            format!("shard-00000.tfrecord#{index})")
        } else {
            key.to_string()
        };
        assert!(
            matches!(err, Error::CorruptRecord { .. }) && message.contains(&named),
            "{name}: {message}"
        );
        assert!(
            reader.read(index + 1).is_ok(),
            "{name}: the next record is fine"
        );
        let report = verify::verify(&path, None).unwrap();
        assert_eq!(report.problems.len(), 1, "{name}: {:?}", report.problems);
        assert_eq!(report.problems[0].index, Some(index), "{name}");
        // A record its checksum refuses cannot be read: not a mismatch with any source.
        assert_eq!(
            report.problems[0].kind,
            verify::ProblemKind::Unreadable,
            "{name}"
        );
        if format != PackFormat::Records {
            assert_eq!(report.problems[0].key, key, "{name}");
        }
    }

    // A label changed in an LMDB value (the 4 bytes before the key's length) is caught too.
    let path = dir.path().join("label.lmdb");
    pack_as(&fixture_root(), &path, PackFormat::Lmdb, &small_options());
    let mut bytes = fs::read(&path).unwrap();
    let copies: Vec<usize> = bytes
        .windows(key.len())
        .enumerate()
        .filter(|(at, w)| *w == key.as_bytes() && bytes[at - 4] == key.len() as u8)
        .map(|(at, _)| at)
        .collect();
    assert!(!copies.is_empty());
    for at in copies {
        assert_eq!(bytes[at - 8], 2, "class02's label");
        bytes[at - 8] = 1;
    }
    fs::write(&path, bytes).unwrap();
    let dataset = format::open(&path).unwrap();
    let mut reader = dataset.open_reader().unwrap();
    let bad: Vec<String> = (0..dataset.len())
        .filter_map(|i| reader.read(i).err().map(|e| e.to_string()))
        .collect();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0].contains(key) && bad[0].contains("checksum mismatch"),
        "{}",
        bad[0]
    );
}

#[test]
fn version_1_lmdb_and_hdf5_files_without_checksums_still_read() {
    // Files packed before checksums (layout version 1) open and read as before, unchecked, and
    // say so in a notice. A file whose metadata says version 1 while it holds checksums had its
    // metadata edited (one digit would switch the checks off): that is refused.
    let dir = tempfile::tempdir().unwrap();
    let lmdb = dir.path().join("v1.lmdb");
    pack_as(&fixture_root(), &lmdb, PackFormat::Lmdb, &small_options());
    let want = all_records(&lmdb);
    let edited = dir.path().join("v1-edited.lmdb");
    fs::copy(&lmdb, &edited).unwrap();
    set_lmdb_version_1(&edited, false);
    let Err(err) = format::open(&edited) else {
        panic!("a contradiction is refused")
    };
    assert!(matches!(err, Error::NotADataset { .. }), "{err}");
    assert!(err.to_string().contains("v1-edited.lmdb"), "{err}");
    assert!(err.to_string().contains("checksums database"), "{err}");
    set_lmdb_version_1(&lmdb, true);
    let _ = fs::remove_file(dir.path().join("v1.lmdb-lock"));
    assert_eq!(all_records(&lmdb), want);
    let notices = format::open(&lmdb).unwrap().notices().to_vec();
    assert!(
        notices.iter().any(|n| n.contains("no checksums")),
        "{notices:?}"
    );

    #[cfg(feature = "hdf5")]
    version_1_hdf5_files_still_read(dir.path());
}

/// Rewrites an imagefeed LMDB's info record to say layout version 1, and with `drop_checksums`
/// removes its checksums database too (what a real version-1 file looks like).
fn set_lmdb_version_1(lmdb: &Path, drop_checksums: bool) {
    support::edit_lmdb(lmdb, |env, wtxn| {
        let meta: heed::Database<heed::types::Str, heed::types::Str> =
            env.open_database(wtxn, Some("meta")).unwrap().unwrap();
        let info = meta.get(wtxn, "info").unwrap().unwrap().to_string();
        assert!(info.contains(r#""version":2"#), "{info}");
        meta.put(
            wtxn,
            "info",
            &info.replace(r#""version":2"#, r#""version":1"#),
        )
        .unwrap();
        if drop_checksums {
            let sums: heed::Database<heed::types::Bytes, heed::types::Bytes> =
                env.open_database(wtxn, Some("checksums")).unwrap().unwrap();
            // SAFETY: test-only; no other handle to this database is open.
            unsafe { sums.remove(wtxn) }.unwrap();
        }
    });
}

#[cfg(feature = "hdf5")]
fn version_1_hdf5_files_still_read(dir: &Path) {
    let h5 = dir.join("v1.h5");
    pack_as(&fixture_root(), &h5, PackFormat::Hdf5, &small_options());
    let want = all_records(&h5);
    {
        let file = hdf5::File::open_rw(&h5).unwrap();
        file.unlink("checksums").unwrap();
        let attr = file.attr("imagefeed").unwrap();
        let json: hdf5::types::VarLenUnicode = attr.read_scalar().unwrap();
        let json = json.as_str().replace(r#""version":2"#, r#""version":1"#);
        attr.write_scalar(&json.parse::<hdf5::types::VarLenUnicode>().unwrap())
            .unwrap();
    }
    assert_eq!(all_records(&h5), want);
    let notices = format::open(&h5).unwrap().notices().to_vec();
    assert!(
        notices.iter().any(|n| n.contains("no checksums")),
        "{notices:?}"
    );
    // Version 1 in the attribute of a file that holds checksums is refused.
    let edited = dir.join("v1-edited.h5");
    pack_as(&fixture_root(), &edited, PackFormat::Hdf5, &small_options());
    {
        let file = hdf5::File::open_rw(&edited).unwrap();
        let attr = file.attr("imagefeed").unwrap();
        let json: hdf5::types::VarLenUnicode = attr.read_scalar().unwrap();
        let json = json.as_str().replace(r#""version":2"#, r#""version":1"#);
        attr.write_scalar(&json.parse::<hdf5::types::VarLenUnicode>().unwrap())
            .unwrap();
    }
    let Err(err) = format::open(&edited) else {
        panic!("a contradiction is refused")
    };
    assert!(matches!(err, Error::NotADataset { .. }), "{err}");
    assert!(err.to_string().contains("checksums dataset"), "{err}");
    // And a version-2 file whose checksums went missing is refused, naming the file.
    let no_sums = dir.join("v2-no-sums.h5");
    pack_as(
        &fixture_root(),
        &no_sums,
        PackFormat::Hdf5,
        &small_options(),
    );
    hdf5::File::open_rw(&no_sums)
        .unwrap()
        .unlink("checksums")
        .unwrap();
    let err = format::open(&no_sums).unwrap_err();
    assert!(matches!(err, Error::Hdf5 { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("v2-no-sums.h5") && err.contains("checksums"),
        "{err}"
    );
}

#[cfg(not(feature = "hdf5"))]
#[test]
fn without_the_hdf5_feature_hdf5_is_recognized_and_refused_naming_path_and_feature() {
    // A build for trainers that read LMDB: HDF5 input and output are a clear error, never
    // "not a dataset" and never a half-written output.
    let dir = tempfile::tempdir().unwrap();
    let disabled = |err: Error, name: &str| {
        let message = err.to_string();
        assert!(
            matches!(
                err,
                Error::FeatureDisabled {
                    feature: "hdf5",
                    ..
                }
            ) && message.contains(name)
                && message.contains("`hdf5` feature"),
            "{message}"
        );
    };
    assert!(!PackFormat::Hdf5.is_available());
    assert_eq!(
        PackFormat::available().collect::<Vec<_>>(),
        [PackFormat::Lmdb, PackFormat::Records]
    );

    let out = dir.path().join("out.h5");
    let err = pack::pack_image_folder(
        &fixture_root(),
        &out,
        PackFormat::Hdf5,
        &small_options(),
        &NoProgress,
    )
    .unwrap_err();
    disabled(err, "out.h5");
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing written"
    );

    // A file h5py wrote.
    let h5 = dir.path().join("theirs.h5");
    fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat/h5py-vlen.h5"),
        &h5,
    )
    .unwrap();
    let bytes = fs::read(&h5).unwrap();
    disabled(format::open(&h5).unwrap_err(), "theirs.h5");
    disabled(
        pack::convert(
            &h5,
            &dir.path().join("c.lmdb"),
            PackFormat::Lmdb,
            &small_options(),
            &NoProgress,
        )
        .unwrap_err(),
        "theirs.h5",
    );
    disabled(verify::verify(&h5, None).unwrap_err(), "theirs.h5");
    disabled(imagefeed::inspect::inspect(&h5).unwrap_err(), "theirs.h5");
    assert!(!dir.path().join("c.lmdb").exists());
    assert!(!format::staging::partial_path(&dir.path().join("c.lmdb")).exists());
    // Joining: an HDF5 part, or HDF5 output (refused before the parts are opened).
    let joined = dir.path().join("j.lmdb");
    disabled(
        pack::join(
            std::slice::from_ref(&h5),
            &joined,
            PackFormat::Lmdb,
            &small_options(),
            &NoProgress,
        )
        .unwrap_err(),
        "theirs.h5",
    );
    disabled(
        pack::join(
            std::slice::from_ref(&h5),
            &out,
            PackFormat::Hdf5,
            &small_options(),
            &NoProgress,
        )
        .unwrap_err(),
        "out.h5",
    );
    assert!(!joined.exists() && !out.exists());
    // --force onto an HDF5 file: whether it is ours takes libhdf5 to tell, so it is refused
    // as such (not called foreign) and left as it was.
    let force = small_options().with_mode(StartMode {
        force: true,
        resume: false,
    });
    disabled(
        pack::pack_image_folder(&fixture_root(), &h5, PackFormat::Lmdb, &force, &NoProgress)
            .unwrap_err(),
        "theirs.h5",
    );
    assert_eq!(fs::read(&h5).unwrap(), bytes, "the HDF5 file is untouched");
    // An interrupted HDF5 pack: resuming it, or opening its output, says what is missing, and
    // the staging directory is kept for a build that has HDF5.
    let staged = dir.path().join("d.h5");
    let partial = format::staging::partial_path(&staged);
    fs::create_dir(&partial).unwrap();
    fs::write(
        partial.join("progress.json"),
        r#"{"magic":"imagefeed-hdf5"}"#,
    )
    .unwrap();
    let resume = small_resume_options();
    disabled(
        pack::pack_image_folder(
            &fixture_root(),
            &staged,
            PackFormat::Hdf5,
            &resume,
            &NoProgress,
        )
        .unwrap_err(),
        "d.h5",
    );
    disabled(format::open(&staged).unwrap_err(), "d.h5");
    assert!(partial.join("progress.json").exists());

    // LMDB and records work as in every build.
    let lmdb = dir.path().join("ok.lmdb");
    pack_as(&fixture_root(), &lmdb, PackFormat::Lmdb, &small_options());
    assert_eq!(format::open(&lmdb).unwrap().len(), all_records(&lmdb).len());
}

#[cfg(feature = "hdf5")]
#[test]
fn an_hdf5_file_replaced_under_an_open_dataset_is_never_read_as_a_mix() {
    // Hostile finding (#30): `mv new.h5 train.h5` while a Loader read train.h5 made workers
    // that opened lazily read the new file through the old index (748 of 1,500 samples came
    // from the new file). Readers of our layout now share the descriptor opened with the
    // dataset (they go on reading the file that was indexed); readers the library opens by
    // path check the file is the same one, or fail naming it.
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("train.h5");
    pack_as(&fixture_root(), &ours, PackFormat::Hdf5, &small_options());
    let dataset = format::open(&ours).unwrap();
    let want = records(dataset.as_ref());
    let other = dir.path().join("other.h5");
    let mut options = small_options();
    options.resize_short_side = Some(16);
    pack_as(&fixture_root(), &other, PackFormat::Hdf5, &options);
    assert_ne!(all_records(&other), want, "the replacement differs");
    fs::rename(&other, &ours).unwrap();
    assert_eq!(
        records(dataset.as_ref()),
        want,
        "a reader opened after the rename"
    );

    // h5py's variable-length layout is read with pread too: a reader opened after the rename
    // reads the file that was indexed.
    let compat = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/compat");
    let vlen = dir.path().join("vlen.h5");
    fs::copy(compat.join("h5py-vlen.h5"), &vlen).unwrap();
    let dataset = format::open(&vlen).unwrap();
    let want = records(dataset.as_ref());
    fs::copy(compat.join("h5py-gray.h5"), dir.path().join("new.h5")).unwrap();
    fs::rename(dir.path().join("new.h5"), &vlen).unwrap();
    assert_eq!(
        records(dataset.as_ref()),
        want,
        "a variable-length reader opened after the rename"
    );

    // A chunked, compressed pixel array is read through libhdf5, which opens the path again:
    // replaced, then rewritten in place, it is refused naming the file.
    let names = imagefeed::format::hdf5::Hdf5Names {
        images: "pixels".into(),
        labels: "targets".into(),
    };
    let pixels = dir.path().join("pixels.h5");
    fs::copy(compat.join("h5py-pixels.h5"), &pixels).unwrap();
    let open = || -> std::sync::Arc<dyn imagefeed::Dataset> {
        std::sync::Arc::new(imagefeed::format::hdf5::Hdf5::open_with(&pixels, &names).unwrap())
    };
    let dataset = open();
    assert!(dataset.open_reader().is_ok());
    fs::copy(compat.join("h5py-vlen.h5"), dir.path().join("new.h5")).unwrap();
    fs::rename(dir.path().join("new.h5"), &pixels).unwrap();
    let Err(err) = dataset.open_reader() else {
        panic!("a reader of a replaced file opened")
    };
    assert!(
        matches!(&err, Error::FileChanged { path, .. } if path == &pixels),
        "{err}"
    );
    assert!(err.to_string().contains("another file"), "{err}");
    // A loader's workers open their readers the same way: the epoch fails naming the file,
    // never a run of bad samples skipped under the default policy (found by review).
    let loader = Loader::new(
        std::sync::Arc::clone(&dataset),
        LoaderConfig::default()
            .with_batch_size(2)
            .with_workers(1)
            .with_transform(Transform::none()),
    )
    .unwrap();
    let first = loader.epoch(0).next().expect("a batch or an error");
    assert!(
        matches!(first, Err(Error::FileChanged { .. })),
        "{:?}",
        first.err()
    );
    fs::copy(compat.join("h5py-pixels.h5"), &pixels).unwrap();
    let dataset = open();
    append_garbage(&pixels);
    let Err(err) = dataset.open_reader() else {
        panic!("a reader of a rewritten file opened")
    };
    assert!(matches!(err, Error::FileChanged { .. }), "{err}");
}

#[test]
fn an_mds_index_whose_keys_are_not_sorted_is_read_as_mds() {
    // Found by a hostile try: `{"version": 2, "shards": []}` (written by hand, keys unsorted)
    // was refused as an ImageFolder without class directories.
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("index.json"),
        r#"{"version": 2, "shards": []}"#,
    )
    .unwrap();
    match format::open(dir.path()) {
        Err(Error::NotADataset { path, reason }) => {
            assert!(path.ends_with("index.json"), "{}", path.display());
            assert!(reason.contains("no shards"), "{reason}");
        }
        Err(other) => panic!("expected the MDS index refused, got {other}"),
        Ok(d) => panic!("opened {} samples", d.len()),
    }
}

#[test]
fn a_part_of_nothing_but_rejected_files_is_written_and_joins() {
    // The fixture split in 5: part 2 is exactly its four broken files. It was refused ("all 4
    // files were rejected; nothing to pack") and no join of that split could ever run.
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_root();
    let whole = dir.path().join("whole.records");
    pack_as(&src, &whole, PackFormat::Records, &small_options());
    for format in support::writable([
        (PackFormat::Lmdb, ()),
        (PackFormat::Hdf5, ()),
        (PackFormat::Records, ()),
    ])
    .into_iter()
    .map(|(f, _)| f)
    {
        let parts: Vec<PathBuf> = (0..5)
            .map(|index| {
                let part = dir.path().join(format!("part-{index}-{format:?}"));
                let options = small_options().with_part(Some(Part { index, count: 5 }));
                let summary = pack_as(&src, &part, format, &options);
                if index == 2 {
                    assert_eq!((summary.samples, summary.rejected.len()), (0, 4));
                    let empty = format::open(&part).unwrap();
                    assert_eq!(empty.len(), 0);
                    assert_eq!(empty.info().rejected_at_pack, Some(4));
                }
                part
            })
            .collect();
        let joined = dir.path().join(format!("joined-{format:?}.lmdb"));
        let summary = pack::join(
            &parts,
            &joined,
            PackFormat::Lmdb,
            &small_options(),
            &NoProgress,
        )
        .unwrap();
        assert_eq!(summary.samples, 16, "{format:?}");
        assert!(all_records(&joined) == all_records(&whole), "{format:?}");
    }
    // A whole pack of nothing is still refused.
    let broken = dir.path().join("broken");
    fs::create_dir_all(broken.join("a")).unwrap();
    fs::write(broken.join("a/x.jpg"), b"not an image").unwrap();
    let err = pack::pack_image_folder(
        &broken,
        &dir.path().join("never.lmdb"),
        PackFormat::Lmdb,
        &small_options(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(matches!(err, Error::BadImageFolder { .. }), "{err}");
}
