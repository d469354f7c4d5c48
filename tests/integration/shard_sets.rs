//! TFRecord shards as other tools leave them: sets of `NAME-NNNNN-of-TTTTT` files side by side
//! (never merged without a word), sets with members missing (an error naming them, unless
//! allowed), selection by pattern or list, indexes saved where no pattern picks them up, and
//! GZIP/ZLIB-compressed shards (TensorFlow-written fixtures) read with the same records as
//! uncompressed ones.

use crate::support;

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use imagefeed::Error;
use imagefeed::cache::Cache;
use imagefeed::dataset::Dataset as _;
use imagefeed::format::shards::ShardSetProblem;
use imagefeed::format::{self, OpenOptions};
use imagefeed::loader::{Loader, LoaderConfig};
use imagefeed::pack::PackFormat;
use imagefeed::transform::Transform;
use support::{fixture_root, records, small_options};

/// Packs the fixture tree into record shards of ours at `out`, several shards of a few records.
fn pack_fixture_records(out: &Path) {
    support::pack_as(
        &fixture_root(),
        out,
        PackFormat::Records,
        &small_options().with_shard_bytes(9_000),
    );
}

/// Writes the fixture tree as TFRecord shards named as TensorFlow names them, without the
/// manifest or indexes that would make them ours: `NAME-0000i-of-0000n` in `dir`.
fn foreign_set(dir: &Path, name: &str, shards: usize) -> Vec<PathBuf> {
    let packed = dir.join(format!(".{name}.packed"));
    pack_fixture_records(&packed);
    let mut made: Vec<Vec<u8>> = Vec::new();
    let mut number = 0;
    while let Ok(bytes) = fs::read(packed.join(format!("shard-{number:05}.tfrecord"))) {
        made.push(bytes);
        number += 1;
    }
    assert!(made.len() >= shards, "only {} shards packed", made.len());
    // Merge the packed shards into `shards` files (frames simply concatenate).
    let mut files = Vec::new();
    for i in 0..shards {
        let path = dir.join(format!("{name}-{i:05}-of-{shards:05}"));
        let bytes: Vec<u8> = made
            .iter()
            .enumerate()
            .filter(|(n, _)| n * shards / made.len() == i)
            .flat_map(|(_, b)| b.clone())
            .collect();
        fs::write(&path, bytes).unwrap();
        files.push(path);
    }
    fs::remove_dir_all(&packed).unwrap();
    files
}

/// The frames of a TFRecord shard (length, its CRC, data, the data's CRC), each whole.
fn tfrecord_frames(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        frames.push(bytes[at..at + len + 16].to_vec());
        at += len + 16;
    }
    frames
}

fn shard_set_problem(
    result: imagefeed::Result<std::sync::Arc<dyn imagefeed::Dataset>>,
) -> ShardSetProblem {
    match result {
        Err(Error::ShardSet { problem, .. }) => problem,
        Err(other) => panic!("expected a shard-set error, got {other}"),
        Ok(d) => panic!("expected a shard-set error, opened {} samples", d.len()),
    }
}

#[test]
fn two_sets_in_one_directory_are_refused_and_each_is_read_by_pattern() {
    let dir = tempfile::tempdir().unwrap();
    foreign_set(dir.path(), "train", 3);
    foreign_set(dir.path(), "validation", 2);
    let problem = shard_set_problem(format::open(dir.path()));
    match &problem {
        ShardSetProblem::Mixed { sets, example } => {
            assert_eq!(
                sets,
                &[
                    ("train-NNNNN-of-00003".to_string(), 3),
                    ("validation-NNNNN-of-00002".to_string(), 2)
                ]
            );
            assert_eq!(example, "train-*-of-00003");
        }
        other => panic!("{other:?}"),
    }
    // Each set by a pattern, with every record of the tree once.
    let whole = format::open(fixture_root()).unwrap().len();
    for set in ["train-*", "validation-*-of-00002"] {
        let dataset = format::open(dir.path().join(set)).unwrap();
        // The fixture's broken files were left out when packing.
        assert_eq!(dataset.len(), whole - support::BROKEN.len(), "{set}");
    }
    // The same selection as a list (what a shell makes of an unquoted pattern).
    let mut list: Vec<PathBuf> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("/train-"))
        .collect();
    list.sort();
    let by_list = format::open_files(&list, &OpenOptions::default()).unwrap();
    let by_pattern = format::open(dir.path().join("train-*")).unwrap();
    assert_eq!(records(by_list.as_ref()), records(by_pattern.as_ref()));
    // A pattern that matches nothing says so.
    assert_eq!(
        shard_set_problem(format::open(dir.path().join("test-*"))),
        ShardSetProblem::NoMatch
    );
    // `DIR/*` picks by wildcards alone: like the directory, it must match one set (a hostile
    // try found it read both sets as one, "OK"). A list names both on purpose.
    for pattern in ["*", "*-of-*"] {
        assert!(
            matches!(
                shard_set_problem(format::open(dir.path().join(pattern))),
                ShardSetProblem::Mixed { .. }
            ),
            "{pattern}"
        );
    }
    let mut all: Vec<PathBuf> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("-of-"))
        .collect();
    all.sort();
    let both = format::open_files(&all, &OpenOptions::default()).unwrap();
    assert_eq!(both.len(), 2 * (whole - support::BROKEN.len()));
}

#[test]
fn a_set_with_a_shard_missing_is_refused_naming_it_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let files = foreign_set(dir.path(), "train", 4);
    let whole = records(format::open(dir.path()).unwrap().as_ref());
    let gone = fs::read(&files[2]).unwrap();
    fs::remove_file(&files[2]).unwrap();
    for selection in [dir.path().to_path_buf(), dir.path().join("train-*")] {
        match shard_set_problem(format::open(&selection)) {
            ShardSetProblem::Missing {
                set,
                missing,
                count,
                expected,
                in_their_place,
                ..
            } => {
                assert_eq!(in_their_place, []);
                assert_eq!(set, "train-NNNNN-of-00004");
                assert_eq!(missing, ["train-00002-of-00004"]);
                assert_eq!((count, expected), (1, 4));
            }
            other => panic!("{other:?}"),
        }
    }
    // The last member missing is noticed too: the name says how many there are.
    fs::write(&files[2], &gone).unwrap();
    fs::remove_file(&files[3]).unwrap();
    assert!(matches!(
        shard_set_problem(format::open(dir.path())),
        ShardSetProblem::Missing { count: 1, .. }
    ));
    // Allowed on purpose: the rest reads, and the dataset says what is missing.
    let allowed = OpenOptions::default().with_allow_missing_shards(true);
    let partial = format::open_with(dir.path(), &allowed).unwrap();
    assert_eq!(partial.missing_shards().named, ["train-00003-of-00004"]);
    assert_eq!(partial.missing_shards().count, 1);
    assert!(partial.len() < whole.len());
    assert!(
        partial
            .notices()
            .iter()
            .any(|n| n.contains("train-00003-of-00004")),
        "{:?}",
        partial.notices()
    );
    // inspect reports it incomplete, naming the shard, instead of refusing it.
    let inspection = imagefeed::inspect::inspect(dir.path()).unwrap();
    assert!(!inspection.complete && !inspection.is_whole());
    assert_eq!(inspection.missing_shards, ["train-00003-of-00004"]);
    // One shard opened on its own is a deliberate subset: no check.
    assert!(format::open(&files[0]).is_ok());
}

#[test]
fn a_member_that_is_there_but_unread_is_named_as_what_it_is_not_missing() {
    // A hostile try: a member replaced by a directory, a FIFO, a link to nothing, or the same
    // member compressed (`.xz`) was reported as plainly "missing".
    let dir = tempfile::tempdir().unwrap();
    let files = foreign_set(dir.path(), "train", 4);
    let name = |i: usize| files[i].file_name().unwrap().to_string_lossy().into_owned();
    // The names as they are (what a caller may look for), and in the message what stands there.
    let missing_of = |selection: &Path| match shard_set_problem(format::open(selection)) {
        problem @ ShardSetProblem::Missing { .. } => {
            let ShardSetProblem::Missing {
                missing,
                in_their_place,
                ..
            } = &problem
            else {
                unreachable!()
            };
            assert_eq!(missing.len(), 1);
            let text = problem.to_string();
            match &in_their_place[..] {
                [(n, what)] if n == &missing[0] => {
                    assert!(text.contains(&format!("{n} ({what})")), "{text}");
                    vec![format!("{n} ({what})")]
                }
                [] => missing.clone(),
                other => panic!("{other:?}"),
            }
        }
        other => panic!("{other:?}"),
    };
    let brace = dir.path().join("train-{00000..00003}-of-00004");
    for (replace, says) in [
        (
            &(|p: &Path| fs::create_dir(p).unwrap()) as &dyn Fn(&Path),
            "(a directory, not a regular file)",
        ),
        (
            &|p: &Path| {
                let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            },
            "(a FIFO (named pipe), not a regular file)",
        ),
        (
            &|p: &Path| std::os::unix::fs::symlink("nowhere", p).unwrap(),
            "(a link to nothing)",
        ),
    ] {
        let bytes = fs::read(&files[1]).unwrap();
        fs::remove_file(&files[1]).unwrap();
        replace(&files[1]);
        for selection in [dir.path(), &brace] {
            assert_eq!(
                missing_of(selection),
                [format!("{} {says}", name(1))],
                "{selection:?}"
            );
        }
        let _ = fs::remove_dir(&files[1]).or_else(|_| fs::remove_file(&files[1]));
        fs::write(&files[1], bytes).unwrap();
    }
    // The member compressed under another name.
    let xz = dir.path().join(format!("{}.xz", name(2)));
    fs::rename(&files[2], &xz).unwrap();
    assert_eq!(
        missing_of(&brace),
        [format!("{} ({}.xz is there instead)", name(2), name(2))]
    );
    // Gone for good: the name alone.
    fs::remove_file(&xz).unwrap();
    assert_eq!(missing_of(&brace), [name(2)]);
}

/// A records dataset of ours lists its shards in its manifest: one gone is refused naming it,
/// and read around on purpose with `allow_missing_shards`, as a foreign set is.
#[test]
fn a_shard_missing_from_our_records_is_refused_naming_it_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.records");
    pack_fixture_records(&out);
    let whole = records(format::open(&out).unwrap().as_ref());
    let shard = out.join("shard-00001.tfrecord");
    let in_shard = fs::read_to_string(out.join("shard-00001.index"))
        .unwrap()
        .lines()
        .count();
    assert!(in_shard > 0 && out.join("shard-00002.tfrecord").exists());
    fs::remove_file(&shard).unwrap();
    match shard_set_problem(format::open(&out)) {
        ShardSetProblem::Missing {
            missing,
            count,
            expected,
            ..
        } => {
            assert_eq!(missing, ["shard-00001.tfrecord"]);
            assert_eq!(count, 1);
            assert!(expected >= 3, "{expected}");
        }
        other => panic!("{other:?}"),
    }
    let allowed = OpenOptions::default().with_allow_missing_shards(true);
    let partial = format::open_with(&out, &allowed).unwrap();
    assert_eq!(partial.missing_shards().named, ["shard-00001.tfrecord"]);
    assert_eq!(partial.len(), whole.len() - in_shard);
    // Every record left reads, and they are the whole dataset's less the missing shard's.
    let left = records(partial.as_ref());
    assert!(left.iter().all(|row| whole.contains(row)));
    assert!(partial.notices().iter().any(|n| n.contains("shard-00001")));
    let inspection = imagefeed::inspect::inspect(&out).unwrap();
    assert!(!inspection.complete);
    assert_eq!(inspection.missing_shards, ["shard-00001.tfrecord"]);
    assert_eq!(inspection.num_samples, left.len());
    // Any other failure to open a listed shard is not "missing": it stays an error.
    fs::create_dir(&shard).unwrap();
    assert!(format::open_with(&out, &allowed).is_err());
}

#[test]
fn a_pattern_over_our_records_is_checked_against_the_manifest() {
    // A hostile try: with the last shards of a pack of ours gone, `DIR/shard-*` read the rest
    // as a whole dataset (inspect "complete: yes"), where the directory was refused.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.records");
    pack_fixture_records(&out);
    let last = (0..)
        .take_while(|n| out.join(format!("shard-{n:05}.tfrecord")).exists())
        .last()
        .unwrap();
    assert!(last >= 2, "{last}");
    let pattern = out.join("shard-*");
    let whole = format::open(&pattern).unwrap().len();
    fs::remove_file(out.join(format!("shard-{last:05}.tfrecord"))).unwrap();
    match shard_set_problem(format::open(&pattern)) {
        ShardSetProblem::Missing { missing, count, .. } => {
            assert_eq!(missing, [format!("shard-{last:05}.tfrecord")]);
            assert_eq!(count, 1);
        }
        other => panic!("{other:?}"),
    }
    let allowed = OpenOptions::default().with_allow_missing_shards(true);
    let partial = format::open_with(&pattern, &allowed).unwrap();
    assert!(partial.len() < whole);
    assert_eq!(partial.missing_shards().count, 1);
    assert!(!imagefeed::inspect::inspect(&pattern).unwrap().complete);
    // A subset picked on purpose is not missing anything.
    let first_two = out.join("shard-0000[01].tfrecord");
    assert!(format::open(&first_two).unwrap().len() < whole);
    // Its manifest named instead of its directory says so (it read as "neither a directory
    // nor a dataset file").
    assert!(matches!(
        format::open(out.join(format::tfrecord::MANIFEST)),
        Err(Error::NotADataset { reason, .. }) if reason.contains("name its directory")
    ));
    // The staging directory of a pack that did not finish is refused by pattern too.
    let staging = dir.path().join("staged.records.partial");
    fs::rename(&out, &staging).unwrap();
    fs::remove_file(staging.join(format::tfrecord::MANIFEST)).unwrap();
    assert!(matches!(
        format::open(staging.join("shard-*")),
        Err(Error::Incomplete { .. })
    ));
}

/// Shards of ours picked by a pattern read as the dataset's own: its classes (not those of the
/// labels the pick happens to hold), its label base, how the pack stored the images.
#[test]
fn a_pattern_over_our_records_keeps_what_the_manifest_says() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.records");
    support::pack_as(
        &fixture_root(),
        &out,
        PackFormat::Records,
        &small_options()
            .with_shard_bytes(9_000)
            .with_label_base(1)
            .with_resize_short_side(Some(24))
            .with_restart_markers(true),
    );
    let whole = format::open(&out).unwrap();
    let first = format::open(out.join("shard-00000.tfrecord")).unwrap();
    let picked = format::open(out.join("shard-0000[01].tfrecord")).unwrap();
    for opened in [&first, &picked] {
        let info = opened.info();
        assert_eq!(info.classes, whole.info().classes);
        assert_eq!(info.resized_short_side, Some(24));
        assert!(info.restart_markers);
        // Read with the pack's label base 1: the whole dataset's records, labels and all.
        let rows = records(opened.as_ref());
        assert!(!rows.is_empty());
        assert_eq!(rows, records(whole.as_ref())[..rows.len()]);
    }
    // inspect counts the bytes of the files picked (it said 0 B on disk).
    let size = |n: u32| {
        fs::metadata(out.join(format!("shard-{n:05}.tfrecord")))
            .unwrap()
            .len()
    };
    let inspection = imagefeed::inspect::inspect(out.join("shard-0000[01].tfrecord")).unwrap();
    assert_eq!(inspection.file_bytes, size(0) + size(1));
    assert_eq!(inspection.classes.len(), whole.info().classes.len());
}

/// Shards picked by a pattern or named alone are checked against what the manifest lists for
/// them, as the directory's are: a shard (or an index) copied in from another pack of the same
/// classes is refused, not read as this pack's.
#[test]
fn a_picked_shard_that_is_not_the_one_the_manifest_lists_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.records");
    pack_fixture_records(&out);
    let other = dir.path().join("other.records");
    support::pack_as(
        &fixture_root(),
        &other,
        PackFormat::Records,
        &small_options().with_shard_bytes(5_000),
    );
    let refused = |opened: imagefeed::Result<std::sync::Arc<dyn imagefeed::Dataset>>| match opened {
        Err(Error::NotADataset { path, .. }) => path.to_string_lossy().contains("shard-00001."),
        Err(other) => panic!("{other:?}"),
        Ok(dataset) => panic!("opened, {} records", dataset.len()),
    };
    for (what, files) in [
        (
            "shard and index",
            &["shard-00001.tfrecord", "shard-00001.index"][..],
        ),
        ("index", &["shard-00001.index"][..]),
    ] {
        for file in files {
            fs::copy(other.join(file), out.join(file)).unwrap();
        }
        assert!(format::open(&out).is_err(), "{what}: the directory opened");
        assert!(
            refused(format::open(out.join("shard-*"))),
            "{what}: pattern"
        );
        assert!(
            refused(format::open(out.join("shard-00001.tfrecord"))),
            "{what}: alone"
        );
        fs::remove_dir_all(&out).unwrap();
        pack_fixture_records(&out);
    }
    // A shard the manifest no longer lists (an edited manifest): not read as another tool's,
    // its classes inferred from its own labels.
    let manifest_path = out.join(format::tfrecord::MANIFEST);
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(&manifest_path).unwrap()).unwrap();
    let entry = manifest["shards"].as_array_mut().unwrap().remove(1);
    let edited = serde_json::to_vec(&manifest).unwrap();
    // Left so, its count no longer adds up: the manifest itself is refused, naming it.
    fs::write(&manifest_path, &edited).unwrap();
    let err = format::open(&out).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { path, reason }
            if *path == manifest_path && reason.contains("shards' counts add up to")),
        "{err:?}"
    );
    // Counts past any sum (2^63 each; a missing shard had them summed, and overflow).
    let mut huge = manifest.clone();
    for entry in huge["shards"].as_array_mut().unwrap() {
        entry["records"] = (1u64 << 63).into();
    }
    fs::write(&manifest_path, serde_json::to_vec(&huge).unwrap()).unwrap();
    let err = format::open(&out).unwrap_err();
    assert!(
        matches!(&err, Error::NotADataset { reason, .. }
            if reason.contains("counts add up to more than any count")),
        "{err:?}"
    );
    // Its count made to agree too.
    let count = manifest["num_samples"].as_u64().unwrap() - entry["records"].as_u64().unwrap();
    manifest["num_samples"] = count.into();
    fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    assert!(refused(format::open(out.join("shard-0000[12].tfrecord"))));
    assert!(refused(format::open(out.join("shard-00001.tfrecord"))));
}

#[test]
fn saved_indexes_are_out_of_the_sets_pattern_and_found_again() {
    let dir = tempfile::tempdir().unwrap();
    foreign_set(dir.path(), "train", 2);
    let opened = format::tfrecord::Records::open(dir.path()).unwrap();
    let saved = opened.save_missing_indexes().unwrap();
    assert_eq!(saved.len(), 2);
    for index in &saved {
        assert_eq!(index.parent().unwrap(), dir.path().join("index"));
    }
    // TensorFlow's glob("DIR/train-*") sees only the shards.
    let matched: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("train-"))
        .collect();
    assert_eq!(matched.len(), 2, "{matched:?}");
    let again = format::tfrecord::Records::open(dir.path()).unwrap();
    assert!(again.notices().is_empty(), "{:?}", again.notices());
    assert_eq!(records(&again), records(&opened));
}

#[test]
fn a_set_picked_by_pattern_converts() {
    // Found by a hostile review: convert opened the pattern, then failed to stat it as a file.
    let dir = tempfile::tempdir().unwrap();
    foreign_set(dir.path(), "train", 2);
    foreign_set(dir.path(), "val", 1);
    let pattern = dir.path().join("train-*");
    let out = dir.path().join("train.lmdb");
    imagefeed::pack::convert(
        &pattern,
        &out,
        PackFormat::Lmdb,
        &small_options(),
        &imagefeed::pack::NoProgress,
    )
    .unwrap();
    let source = format::open(&pattern).unwrap();
    assert_eq!(
        records(format::open(&out).unwrap().as_ref()),
        records(source.as_ref())
    );
}

#[test]
fn index_files_and_pack_reports_are_never_read_as_shards() {
    // Found by a hostile review: `DIR/index/*` opened as an empty, complete dataset.
    let dir = tempfile::tempdir().unwrap();
    foreign_set(dir.path(), "train", 2);
    format::tfrecord::Records::open(dir.path())
        .unwrap()
        .save_missing_indexes()
        .unwrap();
    let only_indexes = format::open(dir.path().join("index/*"));
    assert_eq!(shard_set_problem(only_indexes), ShardSetProblem::NoMatch);
    // Nor is a pack's report beside the shards data (a hostile try's `re*` read one as a
    // damaged shard); named in a list, it is refused saying what it is.
    let whole = format::open(dir.path()).unwrap().len();
    let report = dir.path().join("train.report.json");
    fs::write(&report, b"{\"packed\": 16}").unwrap();
    let matched = format::open(dir.path().join("train*")).unwrap();
    assert_eq!(matched.len(), whole);
    assert!(matched.notices().iter().all(|n| !n.contains("report")));
    let listed = vec![dir.path().join("train-00000-of-00002"), report];
    assert!(matches!(
        format::open_files(&listed, &OpenOptions::default()),
        Err(Error::NotADataset { reason, .. }) if reason.contains("report")
    ));
}

#[test]
fn an_empty_member_among_full_ones_is_reported_and_inspect_says_incomplete() {
    // Found by a hostile review: a zero-byte member (a copy cut short) read as a whole set.
    let dir = tempfile::tempdir().unwrap();
    let files = foreign_set(dir.path(), "train", 3);
    fs::write(&files[1], b"").unwrap();
    let opened = format::open(dir.path()).unwrap();
    let notice = opened
        .notices()
        .iter()
        .find(|n| n.contains("hold no sample"))
        .expect("a notice for the empty member");
    assert!(notice.contains("train-00001-of-00003"), "{notice}");
    let inspection = imagefeed::inspect::inspect(dir.path()).unwrap();
    assert_eq!(inspection.empty_shards, 1);
    assert!(!inspection.complete && !inspection.is_whole());
    // verify fails too (a hostile try found it printing the notice, then "OK", exit 0).
    let report = imagefeed::verify::verify(dir.path(), None).unwrap();
    assert!(!report.is_ok());
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == imagefeed::verify::ProblemKind::Unreadable && p.key == "shards"),
        "{:?}",
        report.problems
    );
    // convert refuses it, writing nothing (a hostile try's convert exited 0 with an output
    // that said "complete: yes", the member's records gone).
    let out = dir.path().join("converted.lmdb");
    let convert = |src: &Path| {
        imagefeed::pack::convert(
            src,
            &out,
            PackFormat::Lmdb,
            &small_options(),
            &imagefeed::pack::NoProgress,
        )
    };
    let err = convert(dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::Incomplete { reason, .. } if reason.contains("1 member(s)")),
        "{err}"
    );
    assert!(!out.exists());
    // A whole set has no such notice.
    let whole = tempfile::tempdir().unwrap();
    foreign_set(whole.path(), "train", 3);
    let opened = format::open(whole.path()).unwrap();
    assert!(
        !opened
            .notices()
            .iter()
            .any(|n| n.contains("hold no sample"))
    );
    assert!(
        imagefeed::verify::verify(whole.path(), None)
            .unwrap()
            .is_ok()
    );
    let converted = convert(whole.path()).unwrap();
    assert_eq!(converted.samples, opened.len());
}

#[test]
fn a_shard_cut_short_counts_its_lost_tail_against_the_bad_sample_limit() {
    // Found by a hostile try: a member of a TFRecord set cut to a tenth read as one bad record
    // at its end, so the epoch ended under the 1% limit with a fifth of the data gone.
    let dir = tempfile::tempdir().unwrap();
    let files = foreign_set(dir.path(), "train", 4);
    let whole = format::open(dir.path()).unwrap();
    let counts: Vec<usize> = whole
        .shard_starts()
        .unwrap()
        .windows(2)
        .map(|w| w[1] - w[0])
        .collect();
    assert!(whole.shards_cut_at_end().is_empty());
    let bytes = fs::read(&files[1]).unwrap();
    fs::write(&files[1], &bytes[..bytes.len() / 10 + 7]).unwrap();

    let cut = format::open(dir.path()).unwrap();
    let named: Vec<usize> = cut.shards_cut_at_end().iter().map(|(i, _)| *i).collect();
    assert_eq!(named, [1]);
    let held = cut.shard_starts().unwrap()[2] - cut.shard_starts().unwrap()[1];
    assert!(held < counts[1], "{held} of {}", counts[1]);
    // Estimated by the whole shards that are not the last (a writer leaves that one short):
    // the median of 0 and 2.
    let loss = imagefeed::dataset::cut_loss(cut.as_ref()).unwrap();
    let lost = (counts[0].max(counts[2]) - held) as u64;
    assert_eq!((loss.lost, loss.empty), (Some(lost), 0));

    // The loader refuses it under the default limit, naming the shard and the estimate ...
    match Loader::new(cut.clone(), LoaderConfig::default()) {
        Err(Error::ShardSet {
            problem:
                ShardSetProblem::CutShort {
                    shards,
                    count,
                    lost: said,
                    ..
                },
            ..
        }) => {
            assert_eq!(shards, ["train-00001-of-00004"]);
            assert_eq!((count, said), (1, Some(lost)));
        }
        Err(other) => panic!("expected a cut-short error, got {other}"),
        Ok(_) => panic!("a set missing {lost} records was loaded under the 1% limit"),
    }
    // ... reads what is left when the limit is lifted, or is high enough ...
    let config = LoaderConfig::default().with_batch_size(4).with_seed(1);
    for max_bad in [None, Some(imagefeed::loader::MaxBad::Count(lost + 1))] {
        let loader = Loader::new(cut.clone(), config.clone().with_max_bad(max_bad)).unwrap();
        let samples: usize = loader.epoch(0).map(|b| b.unwrap().len()).sum();
        assert_eq!(samples, cut.len() - 1, "max_bad {max_bad:?}");
    }
    // ... and inspect calls the set incomplete.
    let inspection = imagefeed::inspect::inspect(dir.path()).unwrap();
    assert_eq!(inspection.cut_shards, 1);
    assert!(!inspection.complete);

    // Damage at a shard's end that cuts nothing off (its last record's data) is no cut.
    let mut flipped = fs::read(&files[2]).unwrap();
    fs::write(&files[1], &bytes).unwrap();
    let at = flipped.len() - 10;
    flipped[at] ^= 0x40;
    fs::write(&files[2], &flipped).unwrap();
    let damaged = format::open(dir.path()).unwrap();
    assert!(damaged.shards_cut_at_end().is_empty());
    assert_eq!(imagefeed::dataset::cut_loss(damaged.as_ref()), None);
    Loader::new(damaged, LoaderConfig::default()).unwrap();
}

#[test]
fn a_shard_cut_between_two_records_is_named_when_it_holds_under_half_the_others() {
    // Found by a hostile try: a middle TFRecord shard cut exactly between two records reads
    // as whole (its framing cannot tell), and inspect said "complete: yes" without a word.
    let dir = tempfile::tempdir().unwrap();
    let files = foreign_set(dir.path(), "train", 4);
    // Shards of 40 records each (the fixture's frames over again), so each has a typical count.
    let frames: Vec<Vec<u8>> = files
        .iter()
        .flat_map(|file| tfrecord_frames(&fs::read(file).unwrap()))
        .collect();
    for (i, file) in files.iter().enumerate() {
        let bytes: Vec<u8> = (0..40)
            .flat_map(|n| frames[(i * 40 + n) % frames.len()].clone())
            .collect();
        fs::write(file, bytes).unwrap();
    }
    let whole = format::open(dir.path()).unwrap();
    assert_eq!(whole.short_shards(), 0);
    assert!(
        whole
            .notices()
            .iter()
            .all(|n| !n.contains("fewer than half"))
    );

    // Shard 1 cut exactly after its tenth record.
    let keep: Vec<u8> = tfrecord_frames(&fs::read(&files[1]).unwrap())[..10].concat();
    fs::write(&files[1], keep).unwrap();
    let keep = 10;

    let cut = format::open(dir.path()).unwrap();
    assert!(cut.shards_cut_at_end().is_empty(), "the framing is whole");
    assert_eq!(
        cut.shard_starts().unwrap()[2] - cut.shard_starts().unwrap()[1],
        keep
    );
    assert_eq!(cut.short_shards(), 1);
    let notice = cut
        .notices()
        .iter()
        .find(|n| n.contains("fewer than half"))
        .expect("a notice naming the short shard");
    assert!(notice.contains("train-00001-of-00004"), "{notice}");
    let inspection = imagefeed::inspect::inspect(dir.path()).unwrap();
    assert_eq!(inspection.short_shards, 1);
    // Uneven shards are legal: the set is still read, and not called incomplete.
    assert!(inspection.complete);
    Loader::new(cut, LoaderConfig::default()).unwrap();

    // The same shards listed with a shard of another set are not compared.
    let other = dir.path().join("extra-00000-of-00001");
    fs::copy(&files[0], &other).unwrap();
    let mut listed = files.clone();
    listed.push(other);
    let mixed = format::open_files(&listed, &OpenOptions::default()).unwrap();
    assert_eq!(mixed.short_shards(), 0);
}

/// The loader's refusal of `dataset` under the default bad-sample limit: the cut and empty
/// shards it counted and its estimate.
fn cut_short_refusal(
    dataset: std::sync::Arc<dyn imagefeed::Dataset>,
) -> (usize, usize, Option<u64>) {
    match Loader::new(dataset, LoaderConfig::default()) {
        Err(Error::ShardSet {
            problem:
                ShardSetProblem::CutShort {
                    count, empty, lost, ..
                },
            ..
        }) => (count, empty, lost),
        Err(other) => panic!("expected a cut-short error, got {other}"),
        Ok(_) => panic!("a set with shards cut short was loaded under the 1% limit"),
    }
}

#[test]
fn shards_cut_with_nothing_to_compare_with_or_emptied_are_refused_too() {
    // Found by a hostile try of the estimate: each of these read "1 bad" per shard or nothing.
    let dir = tempfile::tempdir().unwrap();
    let cut = |path: &Path, keep: f64| {
        let bytes = fs::read(path).unwrap();
        fs::write(path, &bytes[..(bytes.len() as f64 * keep) as usize + 3]).unwrap();
    };
    // Two shards, the first cut: the only whole one is the last, which a writer leaves short.
    let two = dir.path().join("two");
    fs::create_dir(&two).unwrap();
    let files = foreign_set(&two, "train", 2);
    cut(&files[0], 0.5);
    assert_eq!(cut_short_refusal(format::open(&two).unwrap()), (1, 0, None));
    // Every shard cut.
    let all = dir.path().join("all");
    fs::create_dir(&all).unwrap();
    for file in foreign_set(&all, "train", 3) {
        cut(&file, 0.85);
    }
    assert_eq!(cut_short_refusal(format::open(&all).unwrap()), (3, 0, None));
    // A member cut to nothing among whole ones: the estimate counts what it held.
    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let files = foreign_set(&empty, "train", 4);
    let held = format::open(&empty).unwrap().shard_starts().unwrap()[2];
    fs::write(&files[1], b"").unwrap();
    let (count, emptied, lost) = cut_short_refusal(format::open(&empty).unwrap());
    assert_eq!((count, emptied), (0, 1));
    assert!(lost.is_some_and(|l| l > 0 && l <= held as u64), "{lost:?}");
    // The last member empty is how a writer with fewer records than shards leaves a set.
    let files = foreign_set(&empty, "last", 3);
    fs::write(&files[2], b"").unwrap();
    Loader::new(
        format::open(empty.join("last-*")).unwrap(),
        LoaderConfig::default(),
    )
    .unwrap();
    // One shard cut in a set of one: nothing to estimate from either.
    let one = dir.path().join("one");
    fs::create_dir(&one).unwrap();
    let files = foreign_set(&one, "train", 1);
    cut(&files[0], 0.3);
    assert_eq!(
        cut_short_refusal(format::open(&files[0]).unwrap()),
        (1, 0, None)
    );
    // Lifting the limit reads what is left.
    let config = LoaderConfig::default().with_max_bad(None);
    Loader::new(format::open(&all).unwrap(), config).unwrap();
}

fn compat(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/compat")
        .join(name)
}

/// The first 8 files of the fixture tree as TensorFlow's script stores them (see
/// scripts/make_tensorflow_fixtures.py): key, label, bytes.
fn first_eight() -> Vec<support::Row> {
    let source = imagefeed::format::folder::ImageFolder::open(fixture_root()).unwrap();
    (0..8)
        .map(|i| {
            let entry = &source.entries()[i];
            (
                entry.key.clone(),
                entry.label,
                fs::read(source.file_path(i)).unwrap(),
            )
        })
        .collect()
}

fn cached(dir: &Path) -> OpenOptions {
    OpenOptions::default()
        .with_label_base(1)
        .with_cache(Cache::at(dir.join("cache"), None))
}

#[test]
fn tensorflow_gzip_and_zlib_shards_read_like_their_source() {
    let dir = tempfile::tempdir().unwrap();
    let options = cached(dir.path());
    let want = first_eight();
    for path in [
        compat("tfrecord-gzip"),
        compat("tfrecord-gzip/train-*"),
        compat("tfrecord-zlib/val-00000-of-00001"),
    ] {
        let dataset = format::open_with(&path, &options).unwrap();
        assert_eq!(records(dataset.as_ref()), want, "{}", path.display());
        // Class names are the synsets the records carry, the label base taken off.
        assert_eq!(dataset.classes(), ["class00"], "{}", path.display());
        assert!(
            dataset
                .notices()
                .iter()
                .all(|n| !n.contains("no record has label 0"))
        );
    }
    // Without the label base: a notice suggests it, and class 0 is empty.
    let base0 = format::open_with(
        compat("tfrecord-zlib"),
        &OpenOptions::default().with_cache(Cache::at(dir.path().join("cache"), None)),
    )
    .unwrap();
    assert!(
        base0
            .notices()
            .iter()
            .any(|n| n.contains("no record has label 0") && n.contains("--input-label-base 1")),
        "{:?}",
        base0.notices()
    );
    assert_eq!(base0.classes(), ["0", "class00"]);
    // A list naming part of a set: the rest is named as there, only not given.
    let err = format::open_files(
        &[
            compat("tfrecord-gzip/train-00000-of-00002.tfrecord.gz"),
            compat("tfrecord-zlib/val-00000-of-00001"),
        ],
        &options,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("train-00001-of-00002.tfrecord.gz (there, but not among the files given)"),
        "{err}"
    );
    // A list mixing both: one notice for the copies, naming both compressions.
    let mixed = format::open_files(
        &[
            compat("tfrecord-gzip/train-00000-of-00002.tfrecord.gz"),
            compat("tfrecord-gzip/train-00001-of-00002.tfrecord.gz"),
            compat("tfrecord-zlib/val-00000-of-00001"),
        ],
        &OpenOptions::default().with_cache(Cache::at(dir.path().join("mixed"), None)),
    )
    .unwrap();
    let said = decompression_notices(mixed.as_ref());
    assert!(
        matches!(&said[..], [one] if one.contains("3 shards of 3 compressed (GZIP and ZLIB;")),
        "{said:?}"
    );
}

/// The notices of `dataset` telling of shards decompressed into the cache.
fn decompression_notices(dataset: &dyn imagefeed::Dataset) -> Vec<&String> {
    (dataset.notices().iter())
        .filter(|n| n.contains("decompressed once"))
        .collect()
}

#[test]
fn compressed_shards_give_the_same_stream_as_uncompressed_ones_and_are_decompressed_once() {
    let dir = tempfile::tempdir().unwrap();
    // The GZIP set decompressed by hand into plain shards beside it.
    let plain = dir.path().join("plain");
    fs::create_dir(&plain).unwrap();
    for n in 0..2 {
        let name = format!("train-0000{n}-of-00002");
        let compressed = fs::read(compat(&format!("tfrecord-gzip/{name}.tfrecord.gz"))).unwrap();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::MultiGzDecoder::new(&compressed[..]),
            &mut bytes,
        )
        .unwrap();
        fs::write(plain.join(format!("{name}.tfrecord")), bytes).unwrap();
    }
    let options = cached(dir.path());
    let digest = |path: &Path| {
        use sha2::{Digest as _, Sha256};
        let loader = Loader::new(
            format::open_with(path, &options).unwrap(),
            LoaderConfig::default()
                .with_batch_size(3)
                .with_seed(7)
                .with_transform(Transform::cifar())
                .with_max_bad(None),
        )
        .unwrap();
        let mut hash = Sha256::new();
        for batch in loader.epoch(1) {
            let batch = batch.unwrap();
            hash.update(batch.bytes());
            for label in &batch.labels {
                hash.update(label.to_le_bytes());
            }
        }
        hash.finalize().to_vec()
    };
    assert_eq!(digest(&compat("tfrecord-gzip")), digest(&plain));
    // Decompressed once: the cache holds one copy per shard, which later opens reuse.
    let copies = || {
        fs::read_dir(dir.path().join("cache/decompressed"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with(".lock"))
            .count()
    };
    assert_eq!(copies(), 2);
    // One notice for the set, not one per shard (a set of 1,024 said it 1,024 times).
    let fresh = format::open_with(
        compat("tfrecord-gzip"),
        &OpenOptions::default().with_cache(Cache::at(dir.path().join("cache2"), None)),
    )
    .unwrap();
    let said = decompression_notices(fresh.as_ref());
    assert!(
        matches!(&said[..], [one] if one.contains("2 shards of 2 compressed (GZIP; the first: ")
            && one.contains("cache2/decompressed for random access")),
        "{said:?}"
    );
    let again = format::open_with(compat("tfrecord-gzip"), &options).unwrap();
    assert!(
        again
            .notices()
            .iter()
            .all(|n| !n.contains("decompressed once")),
        "{:?}",
        again.notices()
    );
    assert_eq!(copies(), 2);
}

#[test]
fn a_damaged_compressed_shard_reads_what_it_can_and_reports_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("cut");
    fs::create_dir(&shards).unwrap();
    let whole = fs::read(compat("tfrecord-zlib/val-00000-of-00001")).unwrap();
    // Cut in the middle: the records before the cut read; the rest is one bad record.
    fs::write(shards.join("val-00000-of-00001"), &whole[..whole.len() / 2]).unwrap();
    let options = cached(dir.path());
    let dataset = format::open_with(&shards, &options).unwrap();
    let last = dataset.len() - 1;
    let mut reader = dataset.open_reader().unwrap();
    let err = reader.read(last).unwrap_err();
    assert!(
        matches!(&err, Error::CorruptRecord { reason, .. } if reason.contains("ZLIB stream is cut short")),
        "{err}"
    );
    let want = first_eight();
    for (index, (_, _, bytes)) in want.iter().enumerate().take(last) {
        let record = reader.read(index).unwrap();
        assert_eq!(record.payload, bytes.as_slice());
    }
    assert!(last < want.len());
    // Nothing damaged was cached.
    let cache = dir.path().join("cache/decompressed");
    let kept = fs::read_dir(&cache)
        .map(|d| {
            d.filter(|e| {
                !e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".lock")
            })
            .count()
        })
        .unwrap_or(0);
    assert_eq!(kept, 0);
    // The loader's default cap refuses a set whose one shard lost an unknown part of itself.
    let refused = Loader::new(dataset, LoaderConfig::default().with_batch_size(2)).err();
    assert!(
        matches!(
            refused,
            Some(Error::ShardSet {
                problem: ShardSetProblem::CutShort { lost: None, .. },
                ..
            })
        ),
        "{refused:?}"
    );
}

#[test]
fn a_cache_too_small_for_the_decompressed_shards_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let options = OpenOptions::default()
        .with_label_base(1)
        .with_cache(Cache::at(dir.path().join("tiny"), Some(1000)));
    match format::open_with(compat("tfrecord-gzip"), &options) {
        Err(Error::CacheFull { dir: at, limit, .. }) => {
            assert_eq!(at, dir.path().join("tiny"));
            assert_eq!(limit, Some(1000));
        }
        other => panic!("expected CacheFull, got {other:?}"),
    }
}

#[test]
fn a_gzip_shard_written_by_hand_is_told_by_content_whatever_its_name() {
    // A byte-exact GZIP TFRecord (what TFRecordWriter with GZIP writes: frames, then gzip),
    // named like an uncompressed shard.
    let dir = tempfile::tempdir().unwrap();
    let tfrecords = dir.path().join("set");
    fs::create_dir(&tfrecords).unwrap();
    let plain = foreign_set(&tfrecords, "x", 1).remove(0);
    let bytes = fs::read(&plain).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&bytes).unwrap();
    fs::write(&plain, gz.finish().unwrap()).unwrap();
    let options = OpenOptions::default().with_cache(Cache::at(dir.path().join("cache"), None));
    let dataset = format::open_with(&tfrecords, &options).unwrap();
    let whole = format::open(fixture_root()).unwrap().len() - support::BROKEN.len();
    assert_eq!(dataset.len(), whole);
    assert!(
        dataset
            .notices()
            .iter()
            .any(|n| n.contains("GZIP-compressed; decompressed once")),
        "{:?}",
        dataset.notices()
    );
}

#[test]
fn several_paths_that_are_not_shards_are_named_as_what_they_are() {
    // Found by a hostile try: `verify a.lmdb b.lmdb` called both damaged TFRecord shards.
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.lmdb");
    let b = dir.path().join("b.lmdb");
    for out in [&a, &b] {
        support::pack_as(&fixture_root(), out, PackFormat::Lmdb, &small_options());
    }
    let shards = foreign_set(dir.path(), "train", 2);
    for (list, named, what) in [
        (vec![a.clone(), b.clone()], &a, "an LMDB file"),
        (vec![shards[0].clone(), b.clone()], &b, "an LMDB file"),
        (
            vec![shards[0].clone(), dir.path().to_path_buf()],
            &dir.path().to_path_buf(),
            "a directory",
        ),
    ] {
        match format::open_files(&list, &OpenOptions::default()) {
            Err(Error::NotADataset { path, reason }) => {
                assert_eq!(&path, named, "{reason}");
                assert!(reason.starts_with(what), "{reason}");
            }
            Err(other) => panic!("{list:?}: expected NotADataset, got {other}"),
            Ok(d) => panic!("{list:?}: opened {} samples", d.len()),
        }
    }
    // What a shell makes of `DIR/*` over our records directory, and a TFRecord shard beside a
    // tar: named, not read as damaged TFRecord shards.
    let ours = dir.path().join("ours.records");
    support::pack_as(
        &fixture_root(),
        &ours,
        PackFormat::Records,
        &small_options(),
    );
    let mut everything: Vec<PathBuf> = fs::read_dir(&ours)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    everything.sort();
    match format::open_files(&everything, &OpenOptions::default()) {
        Err(Error::NotADataset { reason, .. }) => assert!(
            reason.starts_with("a shard's index file")
                || reason.starts_with("a file of an imagefeed records dataset"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    let tar = dir.path().join("x-000000.tar");
    fs::write(&tar, b"").unwrap();
    match format::open_files(&[shards[0].clone(), tar.clone()], &OpenOptions::default()) {
        Err(Error::NotADataset { path, reason }) => {
            assert_eq!(path, shards[0]);
            assert!(reason.contains("not a WebDataset shard"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // The set's own shards, listed, still read as one dataset.
    let set = format::open_files(&shards, &OpenOptions::default()).unwrap();
    assert_eq!(
        set.len(),
        format::open(dir.path().join("train-*")).unwrap().len()
    );
}

#[test]
fn a_shard_named_twice_through_a_link_is_refused_not_read_twice() {
    // A hostile try read a 60-record shard and a symlink to it, listed together, as 120
    // samples; naming the same path twice was already refused.
    let dir = tempfile::tempdir().unwrap();
    let files = foreign_set(dir.path(), "train", 2);
    let symlink = dir.path().join("alias.tfrecord");
    std::os::unix::fs::symlink(&files[0], &symlink).unwrap();
    let hard = dir.path().join("copy.tfrecord");
    fs::hard_link(&files[1], &hard).unwrap();
    let options = OpenOptions::default();
    for (list, linked) in [
        (vec![files[0].clone(), symlink.clone()], &symlink),
        (
            vec![files[1].clone(), files[0].clone(), hard.clone()],
            &hard,
        ),
    ] {
        match shard_set_problem(format::open_files(&list, &options)) {
            ShardSetProblem::Inconsistent { file, reason } => {
                assert_eq!(file, linked.display().to_string());
                assert!(reason.contains("same file"), "{reason}");
            }
            other => panic!("{list:?}: {other:?}"),
        }
    }
    // One path named twice is said to be so (it was called "a link to it").
    match shard_set_problem(format::open_files(
        &[files[0].clone(), files[0].clone()],
        &options,
    )) {
        ShardSetProblem::Inconsistent { reason, .. } => {
            assert!(reason.contains("is named twice"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // The set alone, and in a directory holding a link beside it, as one set by pattern.
    let whole = format::open_files(&files, &options).unwrap().len();
    let pattern = dir.path().join("train-*");
    assert_eq!(format::open_with(&pattern, &options).unwrap().len(), whole);
    // A link named as a member of the set is refused by a directory read too.
    fs::remove_file(&symlink).unwrap();
    fs::remove_file(&hard).unwrap();
    let member = dir.path().join("train-00001-of-00002");
    fs::remove_file(&member).unwrap();
    std::os::unix::fs::symlink(&files[0], &member).unwrap();
    assert!(matches!(
        shard_set_problem(format::open_with(dir.path(), &options)),
        ShardSetProblem::Inconsistent { .. }
    ));
}

#[test]
fn webdataset_tars_beside_tfrecord_shards_are_another_set_not_passed_over() {
    // A hostile try read a directory of TFRecord shards and WebDataset tars as the TFRecords
    // alone, "complete: yes".
    let dir = tempfile::tempdir().unwrap();
    let files = foreign_set(dir.path(), "train", 2);
    fs::write(dir.path().join("shard-000000.tar"), vec![0u8; 1024]).unwrap();
    let options = OpenOptions::default();
    match shard_set_problem(format::open_with(dir.path(), &options)) {
        ShardSetProblem::Mixed { sets, example } => {
            assert_eq!(sets.len(), 2, "{sets:?}");
            assert!(sets[1].0.starts_with("WebDataset"), "{sets:?}");
            assert_eq!(example, "train-*-of-00002");
        }
        other => panic!("{other:?}"),
    }
    // The pattern the error suggests reads the TFRecords.
    let picked = format::open_with(dir.path().join("train-*-of-00002"), &options).unwrap();
    assert_eq!(
        picked.len(),
        format::open_files(&files, &options).unwrap().len()
    );
}
