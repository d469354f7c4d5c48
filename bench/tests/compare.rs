//! `imagefeed-bench compare` end to end on a small generated tree: every format, warm and cold,
//! the table, JSON and chart; packed datasets reused while the tree is unchanged; error paths;
//! and the PyTorch baseline where a Python with torch is at hand.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use imagefeed::synthetic::{self, SyntheticSpec};
use serde_json::Value;

fn compare(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imagefeed-bench"));
    cmd.arg("compare");
    for a in args {
        cmd.arg(a);
    }
    cmd.output().expect("imagefeed-bench runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn succeeded(o: &Output) {
    assert!(
        o.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
}

/// A tree of 3 classes × 12 small JPEGs plus the edge-case files (some of them undecodable).
fn tree(dir: &Path) -> (PathBuf, usize) {
    let root = dir.join("tree");
    let spec = SyntheticSpec {
        classes: 3,
        per_class: 12,
        width: 32,
        height: 32,
        edge_cases: true,
        ..SyntheticSpec::default()
    };
    let written = synthetic::write_image_folder(&root, &spec).expect("tree written");
    let invalid = written.edge_cases.iter().filter(|e| !e.valid).count();
    assert!(invalid > 0, "the edge cases include undecodable files");
    (root, invalid)
}

fn results(out: &Path) -> Value {
    let json = std::fs::read_to_string(out.join("results.json")).expect("results.json written");
    serde_json::from_str(&json).expect("results.json parses")
}

#[test]
fn every_format_warm_and_cold_with_table_json_and_chart() {
    let dir = tempfile::tempdir().unwrap();
    let (src, invalid) = tree(dir.path());
    let out = dir.path().join("out");
    let o = compare(&[
        &src,
        &"--workers",
        &"1,2",
        &"--epochs",
        &"2",
        &"--cold",
        &"--no-torch",
        &"--batch-size",
        &"8",
        &"--ceiling-samples",
        &"20",
        &"--out",
        &out,
    ]);
    succeeded(&o);
    let report = results(&out);
    let runs = report["results"].as_array().unwrap();
    assert_eq!(
        runs.len(),
        4 * 2 * 2,
        "4 formats × 2 worker counts × warm and cold"
    );
    for subject in ["folder", "lmdb", "hdf5", "records"] {
        for workers in [1, 2] {
            for cache in ["warm", "cold"] {
                let run = runs
                    .iter()
                    .find(|r| {
                        r["subject"] == subject && r["workers"] == workers && r["cache"] == cache
                    })
                    .unwrap_or_else(|| panic!("no {subject} {workers} {cache} run"));
                let rates: Vec<f64> = run["epoch_rates"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect();
                assert_eq!(rates.len(), 2, "one rate per timed epoch");
                let (min, median, max) = (
                    run["min"].as_f64().unwrap(),
                    run["median"].as_f64().unwrap(),
                    run["max"].as_f64().unwrap(),
                );
                assert!(min > 0.0 && min <= median && median <= max, "{run}");
                assert!(run["peak_pss_mb"].as_f64().unwrap() > 0.0, "{run}");
                assert!(run["stages"]["decode"].as_f64().unwrap() > 0.0, "{run}");
                // The raw folder holds the undecodable files; the packers rejected them.
                let expected_bad = if subject == "folder" { 2 * invalid } else { 0 };
                assert_eq!(run["bad"].as_u64().unwrap(), expected_bad as u64, "{run}");
            }
        }
    }
    let ceilings = report["ceiling_per_thread"].as_array().unwrap();
    assert_eq!(ceilings.len(), 2, "measured before and after");
    assert!(report["ceiling_per_thread_used"].as_f64().unwrap() > 0.0);
    let measured: Vec<u64> = report["measured_decode"]
        .as_array()
        .unwrap()
        .iter()
        .inspect(|m| assert!(m["used"].as_f64().unwrap() > 0.0, "{m}"))
        .map(|m| m["threads"].as_u64().unwrap())
        .collect();
    assert_eq!(
        measured,
        [1, 2],
        "decode measured with 1 thread and with each worker count"
    );
    assert!(
        runs.iter()
            .all(|r| r["measured_share"].as_f64().unwrap() > 0.0)
    );

    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| imagefeed, LMDB | 2 | cold |"), "{md}");
    assert!(md.contains("lmdb / raw folder, 1 workers, cold:"), "{md}");
    assert!(!md.contains("PyTorch DataLoader"), "--no-torch: {md}");
    assert_eq!(
        md,
        text(&o.stdout).trim_end_matches('\n').to_string() + "\n"
    );
    let png = std::fs::read(out.join("chart.png")).expect("chart written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG file");

    // A second run reuses the packs; a changed tree, or --restart-markers, is packed again.
    let again_with = |expect_reuse: bool, restart_markers: bool| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
            &src,
            &"--formats",
            &"lmdb",
            &"--workers",
            &"1",
            &"--epochs",
            &"1",
            &"--no-torch",
            &"--out",
            &out,
        ];
        if restart_markers {
            args.push(&"--restart-markers");
        }
        let o = compare(&args);
        succeeded(&o);
        let err = text(&o.stderr);
        assert_eq!(
            err.contains("packed earlier from the same tree"),
            expect_reuse,
            "{err}"
        );
        assert_eq!(err.contains("packing "), !expect_reuse, "{err}");
        let packed: Vec<PathBuf> = walk(&out.join("packed"))
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "lmdb"))
            .collect();
        assert!(!packed.is_empty());
        for path in packed {
            let info = imagefeed::format::open(&path).unwrap().info().clone();
            assert_eq!(info.restart_markers, restart_markers, "{}", path.display());
        }
    };
    let again = |expect_reuse: bool| again_with(expect_reuse, false);
    again(true);
    again_with(false, true);
    again_with(true, true);
    again(false);
    let class = std::fs::read_dir(&src)
        .unwrap()
        .flatten()
        .find(|e| e.path().is_dir())
        .unwrap()
        .path();
    let first = std::fs::read_dir(&class)
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    std::fs::copy(&first, class.join("added-copy.jpg")).unwrap();
    again(false);
}

#[test]
fn bad_arguments_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-tree");
    let o = compare(&[&missing, &"--no-torch"]);
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(
        err.contains("no-such-tree") && err.contains("not a directory"),
        "{err}"
    );

    let (src, _) = tree(dir.path());
    for (args, expected) in [
        (vec!["--no-warm"], "leaves nothing to run"),
        (vec!["--drop-caches"], "add --cold"),
        (vec!["--workers", "0"], "at least 1"),
        (vec!["--epochs", "0"], "at least 1"),
    ] {
        let mut all: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&src, &"--no-torch"];
        all.extend(args.iter().map(|a| a as &dyn AsRef<std::ffi::OsStr>));
        let o = compare(&all);
        assert!(!o.status.success(), "{args:?} accepted");
        let err = text(&o.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

#[test]
fn a_python_without_torch_leaves_the_baseline_out_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = tree(dir.path());
    let out = dir.path().join("out");
    let o = compare(&[
        &src,
        &"--formats",
        &"folder",
        &"--workers",
        &"1",
        &"--epochs",
        &"1",
        &"--python",
        &"/nonexistent/python3",
        &"--out",
        &out,
    ]);
    succeeded(&o);
    let err = text(&o.stderr);
    assert!(
        err.contains("PyTorch baseline left out")
            && err.contains("/nonexistent/python3 cannot import torch"),
        "{err}"
    );
    let report = results(&out);
    assert_eq!(report["results"].as_array().unwrap().len(), 1);
    assert!(report["notes"][0].as_str().unwrap().contains("left out"));
}

/// A Python with torch and torchvision: `IMAGEFEED_TORCH_PYTHON`, else the workspace's
/// `.venv-torch` (made by `compare --with-torch`).
fn torch_python() -> Option<PathBuf> {
    let candidate = std::env::var_os("IMAGEFEED_TORCH_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-torch/bin/python"));
    let ok = Command::new(&candidate)
        .args(["-c", "import torch, torchvision"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(candidate)
}

#[test]
fn the_pytorch_baseline_runs_beside_imagefeed() {
    let Some(python) = torch_python() else {
        eprintln!(
            "skipped: no Python with torch and torchvision (set IMAGEFEED_TORCH_PYTHON, or run \
             `imagefeed-bench compare --with-torch` once to create .venv-torch)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (src, invalid) = tree(dir.path());
    // torchvision's ImageFolder crashes on an undecodable file (vision#138): give it only the
    // valid ones.
    for entry in walk(&src) {
        if imagefeed::decode::Decoder::new()
            .decode_rgb(&std::fs::read(&entry).unwrap(), &mut Vec::new())
            .is_err()
        {
            std::fs::remove_file(&entry).unwrap();
        }
    }
    assert!(invalid > 0);
    let out = dir.path().join("out");
    let o = compare(&[
        &src,
        &"--formats",
        &"lmdb",
        &"--workers",
        &"1",
        &"--epochs",
        &"1",
        &"--batch-size",
        &"8",
        &"--python",
        &python,
        &"--out",
        &out,
    ]);
    succeeded(&o);
    let report = results(&out);
    let runs = report["results"].as_array().unwrap();
    let torch = runs
        .iter()
        .find(|r| r["subject"] == "pytorch")
        .expect("a PyTorch run");
    assert!(torch["median"].as_f64().unwrap() > 0.0);
    assert!(torch["detail"]["torch"].as_str().is_some(), "{torch}");
    assert_eq!(
        torch["detail"]["samples"].as_u64(),
        runs.iter().find(|r| r["subject"] == "lmdb").unwrap()["detail"]["samples"].as_u64(),
        "both loaders see the same images"
    );
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| PyTorch DataLoader | 1 | warm |"), "{md}");
    assert!(
        md.lines()
            .any(|l| l.starts_with("| imagefeed, LMDB") && l.contains('×')),
        "{md}"
    );
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
