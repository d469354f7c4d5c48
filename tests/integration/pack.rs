//! Packing an ImageFolder tree, one suite over every format a pack writes (LMDB, HDF5, record
//! shards): rejection of broken files, strict mode, overwrite rules, interruption and resume,
//! raw and resized payloads, and verify catching mismatches. What only LMDB has (its map
//! growing, its single staging file) is tested for LMDB.

use crate::support;

use std::fs;
use std::path::{Path, PathBuf};

use imagefeed::dataset::PayloadKind;
use imagefeed::decode::{Decoder, RawImage};
use imagefeed::pack::{self, NoProgress, PackFormat, PackOptions, PackSummary, Part, StartMode};
use imagefeed::{Error, Result, format, inspect, verify};
use support::{
    BROKEN, Crash, copy_tree, fixture_records_without_broken, fixture_root, records, small_options,
};

/// Every format a pack writes in this build, each with an output path `DIR/STEM.EXT`.
fn outputs(dir: &Path, stem: &str) -> Vec<(PackFormat, PathBuf)> {
    support::writable([
        (PackFormat::Lmdb, "lmdb"),
        (PackFormat::Hdf5, "h5"),
        (PackFormat::Records, "records"),
    ])
    .into_iter()
    .map(|(format, ext)| (format, dir.join(format!("{stem}.{ext}"))))
    .collect()
}

fn try_pack(
    src: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
) -> Result<PackSummary> {
    pack::pack_image_folder(src, out, format, options, &NoProgress)
}

fn pack(src: &Path, out: &Path, format: PackFormat, options: &PackOptions) -> PackSummary {
    try_pack(src, out, format, options).unwrap_or_else(|e| panic!("{format:?}: {e}"))
}

/// (key, label, payload) of every record of the dataset at `path`.
fn all_records(path: &Path) -> Vec<support::Row> {
    records(format::open(path).unwrap().as_ref())
}

fn resuming() -> PackOptions {
    small_options().with_mode(StartMode {
        resume: true,
        force: false,
    })
}

#[test]
fn broken_files_are_rejected_by_path_and_the_run_completes() {
    let dir = tempfile::tempdir().unwrap();
    for (format, out) in outputs(dir.path(), "fixtures") {
        let summary = pack(&fixture_root(), &out, format, &small_options());
        assert_eq!(summary.samples, 16, "{format:?}");
        assert_eq!(summary.classes, 3);
        assert_eq!(summary.skipped_non_images, 1);
        let rejected: Vec<&str> = summary.rejected.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(rejected, BROKEN, "{format:?}");
        let reason = |key: &str| {
            &summary
                .rejected
                .iter()
                .find(|r| r.key == key)
                .unwrap()
                .reason
        };
        assert!(reason("class01/bad-empty.jpg").contains("empty file"));
        assert!(reason("class01/bad-text.jpg").contains("not a recognized image format"));
        assert!(reason("class01/bad-truncated.jpg").contains("Premature end of JPEG file"));
        assert!(reason("class01/bad-bomb.jpg").contains("60000x60000"));

        // The machine-readable report says the same.
        let report: PackSummary =
            serde_json::from_slice(&fs::read(pack::report_path(&out)).unwrap()).unwrap();
        assert_eq!(report.rejected, summary.rejected);
        assert_eq!(report.samples, 16);

        // Records: the source listing in ImageFolder order, minus the rejected files, bytes
        // unchanged.
        assert_eq!(
            all_records(&out),
            fixture_records_without_broken(),
            "{format:?}"
        );
        let report = verify::verify(&out, Some(&fixture_root())).unwrap();
        assert!(report.is_ok(), "{format:?}: {:?}", report.problems);
        assert_eq!((report.checked, report.source_rejects), (16, 4));
    }
    // No leftovers beside the outputs: each one and its report.
    let mut names: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want: Vec<String> = outputs(dir.path(), "fixtures")
        .iter()
        .flat_map(|(_, out)| {
            let name = out.file_name().unwrap().to_string_lossy().into_owned();
            [format!("{name}.report.json"), name]
        })
        .collect();
    want.sort();
    assert_eq!(names, want);
}

#[test]
fn strict_mode_fails_on_the_first_broken_file_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (format, out) in outputs(dir.path(), "strict") {
        let options = small_options().with_strict(true);
        let err = try_pack(&fixture_root(), &out, format, &options).unwrap_err();
        match &err {
            Error::Rejected { path, reason } => {
                assert!(path.ends_with("class01/bad-bomb.jpg"), "{}", path.display());
                assert!(reason.contains("decompression-bomb"), "{reason}");
            }
            other => panic!("{format:?}: expected a rejection, got {other}"),
        }
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            0,
            "{format:?}: strict failure left files behind"
        );
    }
}

#[test]
fn existing_output_is_kept_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    for (format, out) in outputs(dir.path(), "out") {
        let src = dir.path().join(format!("src-{format:?}"));
        copy_tree(&fixture_root(), &src);
        pack(&src, &out, format, &small_options());
        let before = support::tree_contents(dir.path());

        let err = try_pack(&src, &out, format, &small_options()).unwrap_err();
        assert!(
            matches!(err, Error::AlreadyExists { .. }),
            "{format:?}: {err}"
        );
        assert!(err.to_string().contains("--force"), "{err}");
        assert!(
            support::tree_contents(dir.path()) == before,
            "{format:?}: a refused pack modified the output"
        );

        // Forced, with a different source: the output is replaced.
        fs::remove_dir_all(src.join("class02")).unwrap();
        let forced = small_options().with_mode(StartMode {
            force: true,
            resume: false,
        });
        let summary = pack(&src, &out, format, &forced);
        assert_eq!(summary.classes, 2);
        assert_eq!(
            format::open(&out).unwrap().classes(),
            ["class00", "class01"]
        );
    }
}

fn crash_after(src: &Path, out: &Path, format: PackFormat, options: &PackOptions, chunks: usize) {
    let crash = Crash::after(chunks);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pack::pack_image_folder(src, out, format, options, &crash)
    }));
    assert!(
        result.is_err(),
        "{format:?}: the pack finished before the simulated crash"
    );
}

#[test]
fn an_interrupted_pack_is_never_accepted_and_resume_completes_it() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_root();
    for ((format, out), (_, clean)) in outputs(dir.path(), "resumed")
        .into_iter()
        .zip(outputs(dir.path(), "clean"))
    {
        // chunk_size 4: chunks 0..4 hold files 0..16, so after 3 chunks some rejected files
        // are done.
        crash_after(&src, &out, format, &small_options(), 3);

        assert!(!out.exists(), "{format:?}");
        let err = format::open(&out).unwrap_err();
        assert!(
            matches!(err, Error::Incomplete { .. }) && err.to_string().contains("--resume"),
            "{format:?}: {err}"
        );
        let err = format::open(format::staging::partial_path(&out)).unwrap_err();
        assert!(matches!(err, Error::Incomplete { .. }), "{format:?}: {err}");

        // Without --resume the partial output is not silently discarded.
        let err = try_pack(&src, &out, format, &small_options()).unwrap_err();
        assert!(
            matches!(err, Error::AlreadyExists { .. }) && err.to_string().contains("--resume"),
            "{format:?}: {err}"
        );

        // Other options: refused, the partial output untouched.
        let raw_resume = resuming().with_raw(true);
        let err = try_pack(&src, &out, format, &raw_resume).unwrap_err();
        assert!(
            matches!(err, Error::ResumeMismatch { .. }),
            "{format:?}: {err}"
        );

        let summary = pack(&src, &out, format, &resuming());
        assert_eq!(
            summary.resumed_from, 12,
            "{format:?}: 3 chunks of 4 files were committed"
        );
        assert_eq!(summary.samples, 16);
        let rejected: Vec<&str> = summary.rejected.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(
            rejected, BROKEN,
            "{format:?}: rejections from before the crash are kept"
        );
        assert!(!format::staging::partial_path(&out).exists());

        // Identical to a pack that was never interrupted.
        pack(&src, &clean, format, &small_options());
        assert!(all_records(&out) == all_records(&clean), "{format:?}");
        assert!(verify::verify(&out, Some(&src)).unwrap().is_ok());
    }
    // LMDB's partial output is a file inspect reads: it says what was committed.
    let lmdb = dir.path().join("seen.lmdb");
    crash_after(&src, &lmdb, PackFormat::Lmdb, &small_options(), 3);
    let seen = inspect::inspect(&lmdb).unwrap();
    assert!(!seen.complete);
    assert!(
        seen.num_samples > 0 && seen.num_samples < 16,
        "{}",
        seen.num_samples
    );
}

/// Rewrites the progress record of `out`'s staged pack (in `OUT.partial`, a file for LMDB, and
/// in a directory's `progress.json` for the others) through `edit`.
fn edit_progress(out: &Path, format: PackFormat, edit: impl Fn(&mut serde_json::Value)) {
    let partial = format::staging::partial_path(out);
    if format == PackFormat::Lmdb {
        support::edit_lmdb_meta(&partial, "pack-progress", edit);
    } else {
        let file = partial.join("progress.json");
        let mut staged: serde_json::Value =
            serde_json::from_slice(&fs::read(&file).unwrap()).unwrap();
        edit(&mut staged["progress"]);
        fs::write(&file, staged.to_string()).unwrap();
    }
}

#[test]
fn a_progress_record_that_does_not_add_up_is_never_resumed() {
    // A hostile try edited `sources_done`: past the end, the resume published a "complete"
    // dataset missing the sources after the stored ones (plain `verify` passed it); at 0, it
    // packed every source again after them, a "complete" dataset of duplicates.
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_root();
    for (format, out) in outputs(dir.path(), "edited") {
        crash_after(&src, &out, format, &small_options(), 3);
        for done in [1u64 << 60, 0, 11, 13] {
            edit_progress(&out, format, |p| p["sources_done"] = done.into());
            let err = try_pack(&src, &out, format, &resuming()).unwrap_err();
            assert!(
                matches!(&err, Error::ResumeMismatch { reason, .. }
                    if reason.contains(&format!("says {done} of 20 source files are done"))),
                "{format:?} {done}: {err}"
            );
            assert!(!out.exists(), "{format:?}");
        }
        // Records that add up but are not true: an invented rejection standing in for a
        // source (a hostile try's resume then published a dataset missing it), a rejection
        // named twice, and samples counted that were never staged.
        type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
        let forged: [(Edit<'_>, &str); 3] = [
            (
                &|p| {
                    p["sources_done"] = 13.into();
                    let rejected = p["rejected"].as_array_mut().unwrap();
                    rejected.push(serde_json::json!({"key": "nowhere/fake.jpg", "reason": "x"}));
                },
                "rejects \"nowhere/fake.jpg\", which is none of the source files done",
            ),
            (
                &|p| {
                    p["sources_done"] = 13.into();
                    let rejected = p["rejected"].as_array_mut().unwrap();
                    let again = rejected[0].clone();
                    rejected.push(again);
                },
                "twice",
            ),
            (
                &|p| {
                    p["sources_done"] = 14.into();
                    p["samples_written"] = (p["samples_written"].as_u64().unwrap() + 2).into();
                },
                "but the progress record says",
            ),
        ];
        let truth = std::cell::RefCell::new(serde_json::Value::Null);
        edit_progress(&out, format, |p| {
            p["sources_done"] = 12.into();
            *truth.borrow_mut() = p.clone();
        });
        for (edit, says) in forged {
            edit_progress(&out, format, |p| {
                *p = truth.borrow().clone();
                edit(p);
            });
            let err = try_pack(&src, &out, format, &resuming()).unwrap_err();
            assert!(
                matches!(&err, Error::ResumeMismatch { reason, .. } if reason.contains(says)),
                "{format:?} {says}: {err}"
            );
        }
        // Put back as it was, the staged pack resumes: nothing was lost by refusing.
        edit_progress(&out, format, |p| *p = truth.borrow().clone());
        let summary = pack(&src, &out, format, &resuming());
        assert_eq!(
            (summary.resumed_from, summary.samples),
            (12, 16),
            "{format:?}"
        );
        assert!(verify::verify(&out, Some(&src)).unwrap().is_ok());
    }
}

/// A resume with other pack options is refused, naming the options that differ.
#[test]
fn resume_with_other_options_is_refused_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    for (format, out) in outputs(dir.path(), "changed-options") {
        crash_after(&fixture_root(), &out, format, &small_options(), 1);
        let default_pixels = small_options().max_pixels;
        for (changed, flags) in [
            (
                resuming().with_restart_markers(true),
                vec!["--restart-markers (false then, true now)".to_string()],
            ),
            (
                resuming().with_quality(50).with_resize_short_side(Some(8)),
                vec![
                    "--resize (none then, 8 now)".to_string(),
                    format!("--quality ({} then, 50 now)", small_options().quality),
                ],
            ),
            (
                resuming().with_max_pixels(1 << 20),
                vec![format!("--max-pixels ({default_pixels} then, 1048576 now)")],
            ),
        ] {
            match try_pack(&fixture_root(), &out, format, &changed) {
                Err(Error::ResumeMismatch { reason, .. }) => {
                    for flag in &flags {
                        assert!(reason.contains(flag.as_str()), "{format:?}: {reason}")
                    }
                }
                other => panic!("{format:?}: {other:?}"),
            }
        }
        pack(&fixture_root(), &out, format, &resuming());
    }
}

#[test]
fn resume_refuses_a_changed_source_tree() {
    let dir = tempfile::tempdir().unwrap();
    for (format, out) in outputs(dir.path(), "out") {
        let src = dir.path().join(format!("src-{format:?}"));
        copy_tree(&fixture_root(), &src);
        crash_after(&src, &out, format, &small_options(), 1);
        fs::write(src.join("class02/img00000.jpg"), b"changed").unwrap();
        let err = try_pack(&src, &out, format, &resuming()).unwrap_err();
        assert!(
            matches!(&err, Error::ResumeMismatch { reason, .. }
                if reason.contains("the source is not the interrupted run's")),
            "{format:?}: {err}"
        );
    }
}

#[test]
fn raw_payloads_hold_the_decoded_pixels() {
    let dir = tempfile::tempdir().unwrap();
    for (format, out) in outputs(dir.path(), "raw") {
        let options = small_options().with_raw(true);
        let summary = pack(&fixture_root(), &out, format, &options);
        assert_eq!(summary.samples, 16);
        let dataset = format::open(&out).unwrap();
        assert_eq!(dataset.info().payload, PayloadKind::RawRgb8, "{format:?}");
        let mut reader = dataset.open_reader().unwrap();
        let record = reader.read(0).unwrap();
        let (w, h, pixels) = RawImage::parse(record.payload).unwrap();
        let mut expected = Vec::new();
        Decoder::new()
            .decode_rgb(
                &fs::read(fixture_root().join(record.key)).unwrap(),
                &mut expected,
            )
            .unwrap();
        assert_eq!((w, h), (40, 32));
        assert_eq!(pixels, expected.as_slice(), "{format:?}");
        assert!(verify::verify(&out, Some(&fixture_root())).unwrap().is_ok());
    }
}

#[test]
fn resize_shrinks_the_shorter_side_and_verifies() {
    let dir = tempfile::tempdir().unwrap();
    for raw in [false, true] {
        for (format, out) in outputs(dir.path(), &format!("resized-{raw}")) {
            let options = small_options()
                .with_resize_short_side(Some(16))
                .with_raw(raw);
            pack(&fixture_root(), &out, format, &options);
            let seen = inspect::inspect(&out).unwrap();
            // 40x32 -> shorter side 16 -> 20x16 (torchvision: int(16 * 40 / 32) = 20).
            assert_eq!(
                (seen.width.max, seen.height.max),
                (20, 16),
                "{format:?} raw={raw}"
            );
            assert_eq!(seen.resized_short_side, Some(16), "{format:?}");
            let report = verify::verify(&out, Some(&fixture_root())).unwrap();
            assert!(
                report.is_ok(),
                "{format:?} raw={raw}: {:?}",
                report.problems
            );
        }
    }
}

/// `restart_markers`: every format stores the JPEGs rewritten with restart markers (other
/// bytes, the same pixels) and says so; `verify --against` the source passes, and one changed
/// pixel fails it; and a RandomResizedCrop loader, which decodes only the segments around each
/// crop, gives batches bit-identical to a plain pack's.
#[test]
fn restart_markers_keep_the_pixels_and_the_loaders_batches() {
    use imagefeed::loader::{Loader, LoaderConfig};
    use sha2::{Digest as _, Sha256};
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let spec = imagefeed::synthetic::SyntheticSpec {
        classes: 2,
        per_class: 6,
        width: 240,
        height: 176,
        ..Default::default()
    };
    imagefeed::synthetic::write_image_folder(&src, &spec).unwrap();
    let digest = |path: &Path| {
        let config = LoaderConfig::default()
            .with_batch_size(5)
            .with_workers(2)
            .with_seed(3)
            .with_transform(imagefeed::transform::Transform::imagenet_train(64));
        let loader = Loader::new(format::open(path).unwrap(), config).unwrap();
        let mut hash = Sha256::new();
        for epoch in 0..3 {
            for batch in loader.epoch(epoch) {
                hash.update(batch.unwrap().bytes());
            }
        }
        hash.finalize()
    };
    let mut decoder = Decoder::new();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for ((format, plain), (_, segmented)) in outputs(dir.path(), "plain")
        .into_iter()
        .zip(outputs(dir.path(), "segmented"))
    {
        pack(&src, &plain, format, &small_options());
        pack(
            &src,
            &segmented,
            format,
            &small_options().with_restart_markers(true),
        );
        assert!(format::open(&segmented).unwrap().info().restart_markers);
        assert!(inspect::inspect(&segmented).unwrap().restart_markers);
        assert!(!inspect::inspect(&plain).unwrap().restart_markers);
        let report = verify::verify(&segmented, Some(&src)).unwrap();
        assert!(report.is_ok(), "{format:?}: {:?}", report.problems);
        let (rows, plain_rows) = (all_records(&segmented), all_records(&plain));
        assert_eq!(rows.len(), plain_rows.len());
        for ((key, label, payload), (plain_key, plain_label, plain_payload)) in
            rows.iter().zip(&plain_rows)
        {
            assert_eq!((key, label), (plain_key, plain_label));
            assert_ne!(payload, plain_payload, "{format:?} {key}: not rewritten");
            decoder.decode_rgb(payload, &mut a).unwrap();
            decoder.decode_rgb(plain_payload, &mut b).unwrap();
            assert!(a == b, "{format:?} {key}: pixels differ");
        }
        assert_eq!(digest(&segmented), digest(&plain), "{format:?}");
    }
    // A conversion keeps the markers, resized (160) or not (200 is above the images' 176): the
    // files it keeps hold them, the ones it re-encodes get them, and verify passes (a hostile
    // try found resized conversions dropping the flag while kept files still held markers, and
    // verify then failing on them).
    let (_, segmented) = outputs(dir.path(), "segmented").remove(0);
    for resize in [None, Some(160), Some(200)] {
        let converted = dir.path().join(format!("converted-{resize:?}.records"));
        pack::convert(
            &segmented,
            &converted,
            PackFormat::Records,
            &small_options().with_resize_short_side(resize),
            &NoProgress,
        )
        .unwrap();
        let dataset = format::open(&converted).unwrap();
        assert!(dataset.info().restart_markers, "{resize:?}");
        let rows = all_records(&converted);
        assert!(
            rows.iter()
                .all(|(_, _, p)| imagefeed::decode::has_restart_segments(p))
        );
        let report = verify::verify(&converted, Some(&src)).unwrap();
        assert!(report.is_ok(), "{resize:?}: {:?}", report.problems);
    }
    // verify compares pixels, not bytes: a source file changed by one pixel is reported.
    let (format, segmented) = outputs(dir.path(), "segmented").remove(0);
    let changed = &rows_source_path(&src, &all_records(&segmented)[0].0);
    let mut pixels = Vec::new();
    let header = decoder
        .decode_rgb(&fs::read(changed).unwrap(), &mut pixels)
        .unwrap();
    pixels[0] = pixels[0].wrapping_add(128);
    let mut encoder =
        imagefeed::decode::JpegEncoder::new(100, imagefeed::decode::ChromaSubsampling::Full)
            .unwrap();
    fs::write(
        changed,
        encoder
            .encode_rgb(&pixels, header.width, header.height)
            .unwrap(),
    )
    .unwrap();
    let report = verify::verify(&segmented, Some(&src)).unwrap();
    assert!(!report.is_ok(), "{format:?}: a changed source passed");
}

/// The source file of a record key (a path relative to the tree).
fn rows_source_path(src: &Path, key: &str) -> PathBuf {
    src.join(key)
}

#[test]
fn verify_reports_changed_missing_and_relabelled_samples() {
    let dir = tempfile::tempdir().unwrap();
    for (format, out) in outputs(dir.path(), "out") {
        let src = dir.path().join(format!("src-{format:?}"));
        copy_tree(&fixture_root(), &src);
        pack(&src, &out, format, &small_options());
        assert!(verify::verify(&out, Some(&src)).unwrap().is_ok());
        verify_finds_what_changed(&src, &out, dir.path(), format);
    }
}

fn verify_finds_what_changed(src: &Path, out: &Path, dir: &Path, format: PackFormat) {
    // A changed file, a file only in the dataset, a new decodable file only in the source.
    fs::copy(
        src.join("class02/img00001.jpg"),
        src.join("class02/img00000.jpg"),
    )
    .unwrap();
    fs::remove_file(src.join("class02/img00003.jpg")).unwrap();
    fs::copy(
        src.join("class02/img00001.jpg"),
        src.join("class02/img00009.jpg"),
    )
    .unwrap();
    let report = verify::verify(out, Some(src)).unwrap();
    let found: Vec<(String, &str)> = report
        .problems
        .iter()
        .map(|p| (p.key.clone(), p.problem.split(' ').next().unwrap()))
        .collect();
    assert_eq!(
        found,
        [
            ("class02/img00000.jpg".to_string(), "payload"),
            ("class02/img00003.jpg".to_string(), "no"),
            ("class02/img00009.jpg".to_string(), "decodable"),
        ],
        "{format:?}: {:?}",
        report.problems
    );

    // Classes renamed: labels no longer match the source's classes.
    let renamed = dir.join(format!("renamed-{format:?}"));
    copy_tree(&fixture_root(), &renamed);
    fs::rename(renamed.join("class00"), renamed.join("zzz")).unwrap();
    let report = verify::verify(out, Some(&renamed)).unwrap();
    assert!(
        report.problems.iter().any(|p| p.key == "classes"),
        "{:?}",
        report.problems
    );
}

#[test]
fn a_tree_of_only_broken_files_packs_nothing_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(src.join("a")).unwrap();
    fs::write(src.join("a/x.jpg"), b"").unwrap();
    for (format, out) in outputs(dir.path(), "out") {
        let err = try_pack(&src, &out, format, &small_options()).unwrap_err();
        assert!(
            matches!(err, Error::BadImageFolder { .. })
                && err.to_string().contains("all 1 files were rejected"),
            "{format:?}: {err}"
        );
        assert!(!out.exists() && !format::staging::partial_path(&out).exists());
    }
}

#[test]
fn a_corrupt_huffman_table_never_costs_the_good_files_after_it() {
    // Regression: one corrupt JPEG left libjpeg-turbo's handle mid-header, and every good file
    // the same thread checked after it was rejected with "Bogus Huffman table definition".
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let bad = support::tree_with_bad_huffman_tables(&src, 30, &[5, 17]);
    for threads in [1, 2] {
        for (format, out) in outputs(dir.path(), &format!("t{threads}")) {
            let options = small_options().with_threads(Some(threads));
            let summary = pack(&src, &out, format, &options);
            let rejected: Vec<&str> = summary.rejected.iter().map(|r| r.key.as_str()).collect();
            assert_eq!(rejected, bad, "{format:?}, {threads} threads");
            assert!(
                summary
                    .rejected
                    .iter()
                    .all(|r| r.reason.contains("Bogus Huffman table"))
            );
            assert_eq!(summary.samples, 30, "{format:?}, {threads} threads");
            let report = verify::verify(&out, Some(&src)).unwrap();
            assert!(report.is_ok(), "{format:?}: {:?}", report.problems);
            assert_eq!(report.checked, 30);
        }
    }
}

#[test]
fn a_file_name_that_is_not_utf8_is_rejected_by_its_lossy_path() {
    // Regression: one non-UTF-8 file name aborted the whole pack.
    use std::os::unix::ffi::OsStrExt as _;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    copy_tree(&fixture_root(), &src);
    let good = fs::read(fixture_root().join("class02/img00000.jpg")).unwrap();
    let name = std::ffi::OsStr::from_bytes(b"bad-\xff-name.jpg");
    fs::write(src.join("class02").join(name), &good).unwrap();
    let nested = src
        .join("class02")
        .join(std::ffi::OsStr::from_bytes(b"sub-\xfe"));
    fs::create_dir(&nested).unwrap();
    fs::write(nested.join("inside.jpg"), &good).unwrap();
    for (format, out) in outputs(dir.path(), "o") {
        let summary = pack(&src, &out, format, &small_options());
        assert_eq!(
            summary.samples, 16,
            "{format:?}: the good files are all packed"
        );
        utf8_rejections_name_lossy_paths(&summary);
    }
}

fn utf8_rejections_name_lossy_paths(summary: &PackSummary) {
    let bad: Vec<(&str, &str)> = summary
        .rejected
        .iter()
        .filter(|r| r.reason.contains("not valid UTF-8"))
        .map(|r| (r.key.as_str(), r.reason.as_str()))
        .collect();
    let keys: Vec<&str> = bad.iter().map(|b| b.0).collect();
    assert_eq!(
        keys,
        [
            "class02/bad-\u{FFFD}-name.jpg",
            "class02/sub-\u{FFFD}/inside.jpg"
        ],
        "{:?}",
        summary.rejected
    );
    assert_eq!(summary.rejected.len(), 4 + 2);
}

#[test]
fn impossible_pack_options_are_refused_as_configuration_errors_not_loader_settings() {
    // Regression: packer errors were worded "invalid loader configuration".
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.lmdb");
    for options in [
        small_options().with_threads(Some(0)),
        small_options().with_threads(Some(100_000)),
        small_options().with_resize_short_side(Some(0)),
        small_options().with_part(Some(Part { index: 3, count: 2 })),
        small_options().with_raw(true).with_restart_markers(true),
    ] {
        let err = try_pack(&fixture_root(), &out, PackFormat::Lmdb, &options).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        assert!(
            err.to_string().starts_with("invalid configuration: "),
            "{err}"
        );
        assert!(!out.exists() && !format::staging::partial_path(&out).exists());
    }
}

/// Asks the pack to stop once `chunks` chunks are committed (what Ctrl-C does in Python).
struct StopAfter {
    chunks: usize,
    seen: std::sync::atomic::AtomicUsize,
}

impl pack::PackObserver for StopAfter {
    fn advanced(&self, _done: usize, _payload_bytes: u64) {
        self.seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    fn should_stop(&self) -> bool {
        self.seen.load(std::sync::atomic::Ordering::Relaxed) >= self.chunks
    }
}

#[test]
fn a_pack_asked_to_stop_keeps_what_it_committed_and_resume_finishes_it() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_root();
    for ((format, out), (_, whole)) in outputs(dir.path(), "stopped")
        .into_iter()
        .zip(outputs(dir.path(), "whole"))
    {
        let stop = StopAfter {
            chunks: 2,
            seen: Default::default(),
        };
        let err = pack::pack_image_folder(&src, &out, format, &small_options(), &stop).unwrap_err();
        assert!(
            matches!(err, Error::Interrupted { .. }) && err.to_string().contains("8 of 20"),
            "{format:?}: {err}"
        );
        assert!(!out.exists() && format::staging::partial_path(&out).exists());
        let summary = pack(&src, &out, format, &resuming());
        assert_eq!(
            (summary.resumed_from, summary.samples),
            (8, 16),
            "{format:?}"
        );
        assert!(verify::verify(&out, Some(&src)).unwrap().is_ok());

        // A request that comes with the last chunk changes nothing: the pack completes.
        let last = StopAfter {
            chunks: 5,
            seen: Default::default(),
        };
        pack::pack_image_folder(&src, &whole, format, &small_options(), &last).unwrap();
        assert!(all_records(&whole) == all_records(&out), "{format:?}");
    }
}

#[test]
fn a_foreign_report_file_is_refused_before_force_discards_an_interrupted_pack() {
    // Regression: with --force, the interrupted run's OUT.partial was deleted before the
    // foreign OUT.report.json was noticed and the pack refused.
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_root();
    let out = dir.path().join("stopped.lmdb");
    let stop = StopAfter {
        chunks: 1,
        seen: Default::default(),
    };
    pack::pack_image_folder(&src, &out, PackFormat::Lmdb, &small_options(), &stop).unwrap_err();
    let partial = format::staging::partial_path(&out);
    let staged = fs::read(&partial).unwrap();
    let report = pack::report_path(&out);
    fs::write(&report, "my own notes").unwrap();
    let force = small_options().with_mode(StartMode {
        resume: false,
        force: true,
    });
    let err = pack::pack_image_folder(&src, &out, PackFormat::Lmdb, &force, &pack::NoProgress)
        .unwrap_err();
    assert!(
        matches!(&err, Error::NotReplaceable { path, .. } if *path == report),
        "{err}"
    );
    assert_eq!(
        fs::read(&partial).unwrap(),
        staged,
        "the interrupted pack was touched"
    );
    assert_eq!(fs::read_to_string(&report).unwrap(), "my own notes");
}

/// A map smaller than the data (here 1 MiB, as a process under `ulimit -v` may get) grows as
/// the chunks come: the pack completes and reads back whole.
#[test]
fn a_map_smaller_than_the_data_grows_as_it_fills() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let spec = imagefeed::synthetic::SyntheticSpec {
        classes: 3,
        per_class: 60,
        width: 96,
        height: 64,
        ..imagefeed::synthetic::SyntheticSpec::default()
    };
    imagefeed::synthetic::write_image_folder(&src, &spec).unwrap();
    let out = dir.path().join("grown.lmdb");
    let options = small_options().with_lmdb_map_size(1 << 20);
    let summary = support::pack_as(&src, &out, PackFormat::Lmdb, &options);
    let file_len = std::fs::metadata(&out).unwrap().len();
    assert!(
        file_len > 1 << 20,
        "{file_len} bytes: more than the first map"
    );
    let ds = format::open(&out).unwrap();
    assert_eq!(ds.len(), summary.samples);
    assert!(verify::verify(&out, Some(&src)).unwrap().is_ok());
}

/// `--shared-headers`: the LMDB holds each header shared by several files once, and reads
/// back every source file byte for byte, whatever the files are (the fixtures: grayscale,
/// CMYK, progressive, PNG) and across an interrupted and resumed pack.
#[test]
fn shared_headers_make_a_smaller_lmdb_that_reads_back_the_source_files() {
    let dir = tempfile::tempdir().unwrap();
    let shared = small_options().with_shared_headers(true);

    // Same-size JPEGs of one encoder: each header stored once.
    let src = support::small_tree(dir.path());
    let (plain_out, shared_out) = (
        dir.path().join("plain.lmdb"),
        dir.path().join("shared.lmdb"),
    );
    pack(&src, &plain_out, PackFormat::Lmdb, &small_options());
    pack(&src, &shared_out, PackFormat::Lmdb, &shared);
    assert!(all_records(&shared_out) == all_records(&plain_out));
    assert!(verify::verify(&shared_out, Some(&src)).unwrap().is_ok());
    let (plain_len, shared_len) = (
        fs::metadata(&plain_out).unwrap().len(),
        fs::metadata(&shared_out).unwrap().len(),
    );
    assert!(
        shared_len * 10 < plain_len * 8,
        "{shared_len} bytes with shared headers, {plain_len} without"
    );

    // Every kind of file, interrupted after 2 chunks and resumed: the headers stored before
    // the crash are referred to after it.
    let fixtures = fixture_root();
    let (resumed, whole) = (
        dir.path().join("resumed.lmdb"),
        dir.path().join("whole.lmdb"),
    );
    crash_after(&fixtures, &resumed, PackFormat::Lmdb, &shared, 2);
    let err = try_pack(&fixtures, &resumed, PackFormat::Lmdb, &resuming()).unwrap_err();
    assert!(
        matches!(&err, Error::ResumeMismatch { reason, .. } if reason.contains("--shared-headers")),
        "{err}"
    );
    // One header stored twice (each copy checked under its own number): the resumed pack's
    // dictionary came out a number short and its next header collided with a stored one
    // ("MDB_KEYEXIST", a hostile try). Refused, naming them; the staged pack is kept.
    let doubled = dir.path().join("doubled.lmdb");
    fs::copy(
        format::staging::partial_path(&resumed),
        format::staging::partial_path(&doubled),
    )
    .unwrap();
    let mut stored = 0;
    support::edit_lmdb(&format::staging::partial_path(&doubled), |env, wtxn| {
        let meta: heed::Database<heed::types::Str, heed::types::Str> =
            env.open_database(wtxn, Some("meta")).unwrap().unwrap();
        let headers: heed::Database<heed::types::Bytes, heed::types::Bytes> =
            env.open_database(wtxn, Some("headers")).unwrap().unwrap();
        stored = meta
            .get(wtxn, "pack-headers")
            .unwrap()
            .unwrap()
            .parse::<u32>()
            .unwrap();
        let first = headers.get(wtxn, &1u32.to_be_bytes()).unwrap().unwrap()[4..].to_vec();
        let key = (stored + 1).to_be_bytes();
        let sum = crc32c::crc32c_append(crc32c::crc32c(&key), &first);
        let value = [&sum.to_le_bytes()[..], &first].concat();
        headers.put(wtxn, &key, &value).unwrap();
        meta.put(wtxn, "pack-headers", &(stored + 1).to_string())
            .unwrap();
    });
    let err = try_pack(
        &fixtures,
        &doubled,
        PackFormat::Lmdb,
        &resuming().with_shared_headers(true),
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::ResumeMismatch { reason, .. }
            if reason.contains(&format!("one shared header twice, as headers 1 and {}", stored + 1))),
        "{err}"
    );
    assert!(format::staging::partial_path(&doubled).exists());
    let summary = pack(
        &fixtures,
        &resumed,
        PackFormat::Lmdb,
        &resuming().with_shared_headers(true),
    );
    assert_eq!(summary.resumed_from, 8);
    pack(&fixtures, &whole, PackFormat::Lmdb, &small_options());
    assert!(all_records(&resumed) == all_records(&whole));
    assert!(verify::verify(&resumed, Some(&fixtures)).unwrap().is_ok());

    // Only LMDB stores them; raw payloads have none.
    for (format, options) in [
        (PackFormat::Records, shared.clone()),
        (PackFormat::Lmdb, shared.clone().with_raw(true)),
    ] {
        let out = dir.path().join("refused");
        let err = try_pack(&src, &out, format, &options).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{format:?}: {err}");
        assert!(!out.exists() && !format::staging::partial_path(&out).exists());
    }
}

#[test]
fn a_label_base_is_refused_for_formats_that_store_class_indices() {
    // A hostile try's `label_base=1` packed LMDB and HDF5 labels from 0 without a word.
    let dir = tempfile::tempdir().unwrap();
    let options = small_options().with_label_base(1);
    for (format, out) in outputs(dir.path(), "based") {
        let result = try_pack(&fixture_root(), &out, format, &options);
        if format == PackFormat::Records {
            result.unwrap();
            continue;
        }
        let err = result.unwrap_err();
        assert!(
            matches!(&err, Error::Config(m) if m.starts_with("--label-base 1: only record shards")),
            "{format:?}: {err}"
        );
        assert!(!out.exists() && !format::staging::partial_path(&out).exists());
    }
}

/// Runs `change` once the first chunk is committed: a source changed while it is read
/// (another job rewriting it, a copy still being written, a tree moved away).
struct AfterFirstChunk<F: Fn() + Sync> {
    change: F,
    done: std::sync::atomic::AtomicBool,
}

impl<F: Fn() + Sync> AfterFirstChunk<F> {
    fn new(change: F) -> Self {
        AfterFirstChunk {
            change,
            done: Default::default(),
        }
    }
}

impl<F: Fn() + Sync> pack::PackObserver for AfterFirstChunk<F> {
    fn advanced(&self, _done: usize, _payload_bytes: u64) {
        if !self.done.swap(true, std::sync::atomic::Ordering::SeqCst) {
            (self.change)();
        }
    }
}

/// Flips the byte `numerator / denominator` of the way into `file`, in place (the same inode
/// and size), with a later modification time: a file rewritten where it lies.
fn flip_a_byte_in_place(file: &Path, numerator: u64, denominator: u64) {
    use std::os::unix::fs::FileExt as _;
    let at = fs::metadata(file).unwrap().len() * numerator / denominator;
    let handle = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let mut byte = [0u8];
    handle.read_at(&mut byte, at).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20)); // a later mtime
    handle.write_all_at(&[byte[0] ^ 0xff], at).unwrap();
}

fn largest_file(path: &Path) -> PathBuf {
    if path.is_file() {
        return path.to_path_buf();
    }
    let mut files: Vec<(u64, PathBuf)> = fs::read_dir(path)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (fs::metadata(&p).unwrap().len(), p))
        .collect();
    files.sort();
    files.pop().unwrap().1
}

#[test]
fn a_source_cut_short_while_it_is_converted_stops_the_conversion() {
    // Found by a hostile try: a 10,000-image LMDB cut to a third during a conversion gave a
    // published output of 3,324 samples that opened and inspected as complete, the other
    // 6,676 "rejected" as if each image were unusable.
    let dir = tempfile::tempdir().unwrap();
    for (format, src) in outputs(dir.path(), "src") {
        pack(&fixture_root(), &src, format, &small_options());
        let cut = largest_file(&src);
        let out = dir.path().join(format!("from-{format:?}.lmdb"));
        let observer = AfterFirstChunk::new(|| {
            let file = fs::OpenOptions::new().write(true).open(&cut).unwrap();
            file.set_len(file.metadata().unwrap().len() / 3).unwrap();
        });
        let result = pack::convert(&src, &out, PackFormat::Lmdb, &small_options(), &observer);
        let err = match result {
            Err(err) => err,
            Ok(summary) => panic!(
                "{format:?}: published {} samples, {} rejected: {:?}",
                summary.samples,
                summary.rejected.len(),
                summary.rejected.first()
            ),
        };
        assert!(
            matches!(err, Error::FileChanged { .. } | Error::Io { .. }),
            "{format:?}: {err}"
        );
        assert!(
            err.to_string()
                .contains(&*cut.file_name().unwrap().to_string_lossy()),
            "{format:?}: {err}"
        );
        assert!(!out.exists(), "{format:?}: a part published as the whole");
        assert!(format::staging::partial_path(&out).exists(), "{format:?}");
    }
}

#[test]
fn a_source_rewritten_in_place_or_moved_away_while_packed_is_never_published() {
    // Found by a hostile re-try: a source rewritten in place (the same size or larger) while
    // converted had every record after it "rejected" (checksum mismatches) and the rest
    // published as complete; an image folder moved away mid-pack, every later file rejected,
    // exit 0.
    let dir = tempfile::tempdir().unwrap();
    for (format, src) in outputs(dir.path(), "src") {
        pack(&fixture_root(), &src, format, &small_options());
        let file = largest_file(&src);
        let out = dir.path().join(format!("rewritten-{format:?}.lmdb"));
        let observer = AfterFirstChunk::new(|| flip_a_byte_in_place(&file, 3, 4));
        let err = pack::convert(&src, &out, PackFormat::Lmdb, &small_options(), &observer)
            .expect_err("a rewritten source is not published");
        assert!(
            matches!(err, Error::FileChanged { .. }),
            "{format:?}: {err}"
        );
        assert!(!out.exists() && format::staging::partial_path(&out).exists());
    }

    // A class directory moved away mid-pack: its files are gone, not each a rejection.
    let classes = dir.path().join("classes");
    copy_tree(&fixture_root(), &classes);
    let out = dir.path().join("from-classes.lmdb");
    let observer = AfterFirstChunk::new(|| {
        fs::rename(classes.join("class02"), dir.path().join("class02-moved")).unwrap()
    });
    let err = pack::pack_image_folder(
        &classes,
        &out,
        PackFormat::Lmdb,
        &small_options(),
        &observer,
    )
    .expect_err("a class moved away is not published");
    assert!(matches!(err, Error::FileChanged { .. }), "{err}");
    assert!(!out.exists());

    let tree = dir.path().join("tree");
    copy_tree(&fixture_root(), &tree);
    let moved = dir.path().join("moved");
    let out = dir.path().join("from-moved-tree.lmdb");
    let observer = AfterFirstChunk::new(|| fs::rename(&tree, &moved).unwrap());
    let err = pack::pack_image_folder(&tree, &out, PackFormat::Lmdb, &small_options(), &observer)
        .expect_err("a tree moved away is not published");
    assert!(
        matches!(&err, Error::FileChanged { path, change }
            if path.starts_with(&tree) && change.contains("gone")),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn a_source_with_a_shard_cut_short_is_refused_before_it_is_converted_or_joined() {
    // Found by a hostile re-try: a records part with a shard cut short converted into 2,536
    // samples and joined into 9,203, each output inspecting "complete", the lost records
    // listed as rejections.
    let dir = tempfile::tempdir().unwrap();
    let cut_100_bytes = |path: &Path| {
        let shard = largest_file(path);
        let len = fs::metadata(&shard).unwrap().len();
        fs::OpenOptions::new()
            .write(true)
            .open(&shard)
            .unwrap()
            .set_len(len - 100)
            .unwrap();
    };
    let src = dir.path().join("src.records");
    pack(&fixture_root(), &src, PackFormat::Records, &small_options());
    cut_100_bytes(&src);
    let out = dir.path().join("out.lmdb");
    let err = pack::convert(&src, &out, PackFormat::Lmdb, &small_options(), &NoProgress)
        .expect_err("a cut source is refused");
    assert!(
        matches!(&err, Error::Incomplete { path, reason } if *path == src && reason.contains("cut short")),
        "{err}"
    );
    assert!(!out.exists() && !format::staging::partial_path(&out).exists());
    let parts: Vec<PathBuf> = (0..2)
        .map(|index| {
            let part = dir.path().join(format!("part{index}.records"));
            let options = small_options().with_part(Some(Part { index, count: 2 }));
            pack(&fixture_root(), &part, PackFormat::Records, &options);
            part
        })
        .collect();
    cut_100_bytes(&parts[1]);
    let err = pack::join(
        &parts,
        &out,
        PackFormat::Lmdb,
        &small_options(),
        &NoProgress,
    )
    .expect_err("a cut part is refused");
    assert!(
        matches!(&err, Error::Incomplete { path, .. } if *path == parts[1]),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn resume_refuses_a_source_rewritten_in_place_between_the_runs() {
    // Found by a hostile try: a WebDataset set rewritten in place (the same sizes) between an
    // interrupted conversion and its resume was accepted, and the output mixed both versions.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.records");
    pack(&fixture_root(), &src, PackFormat::Records, &small_options());
    let out = dir.path().join("out.lmdb");
    let stop = StopAfter {
        chunks: 1,
        seen: Default::default(),
    };
    pack::convert(&src, &out, PackFormat::Lmdb, &small_options(), &stop).unwrap_err();
    flip_a_byte_in_place(&largest_file(&src), 1, 2);
    let err = pack::convert(&src, &out, PackFormat::Lmdb, &resuming(), &NoProgress).unwrap_err();
    assert!(
        matches!(&err, Error::ResumeMismatch { reason, .. }
            if reason.contains("the source is not the interrupted run's")),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn a_directory_source_holding_its_output_or_links_back_up_converts() {
    // Found by a hostile try: the output inside a directory source was taken for a source file
    // that changed (refused after all the work, and its resume refused too), and two links
    // back up in the source made the check's walk endless.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.records");
    pack(&fixture_root(), &src, PackFormat::Records, &small_options());
    std::os::unix::fs::symlink(".", src.join("current")).unwrap();
    std::os::unix::fs::symlink("..", src.join("up")).unwrap();
    let inside = src.join("inside").join("out.lmdb");
    fs::create_dir(src.join("inside")).unwrap();
    let summary = pack::convert(
        &src,
        &inside,
        PackFormat::Lmdb,
        &small_options(),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(summary.samples, all_records(&src).len());
    assert!(all_records(&inside) == all_records(&src));
}
