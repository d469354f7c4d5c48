//! `bench/gpu-check.sh`, the packaged GPU check, without a GPU: it finds a CUDA 13 or 12
//! cuBLAS where cudarc would not, a failing step is reported while every later step still
//! runs and the summary is printed, and `PART` splits the run in two.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Output};

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu-check.sh")
}

fn run(args: &[&str], cwd: &Path) -> Output {
    run_part(args, cwd, None)
}

fn run_part(args: &[&str], cwd: &Path, part: Option<&str>) -> Output {
    let mut command = Command::new("bash");
    command
        .arg(script())
        .args(args)
        .current_dir(cwd)
        .env("TORCH_PYTHON", "/nonexistent/python")
        .env_remove("PART")
        .env_remove("LOAD_WORKERS");
    if let Some(part) = part {
        command.env("PART", part);
    }
    command.output().expect("bash runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn find_cublas_links_the_newest_cuda_13_or_12_cublas_under_an_unversioned_name() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("site/nvidia");
    let cu12 = root.join("cublas/lib");
    let cu13 = root.join("cu13/lib");
    fs::create_dir_all(&cu12).unwrap();
    fs::write(cu12.join("libcublas.so.12"), b"12").unwrap();
    fs::write(cu12.join("libcublasLt.so.12"), b"12").unwrap();
    let out = dir.path().join("links");
    let find = |root: &Path| {
        run(
            &["find-cublas", out.to_str().unwrap(), root.to_str().unwrap()],
            dir.path(),
        )
    };
    let o = find(&root);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        fs::read_link(out.join("libcublas.so")).unwrap(),
        cu12.join("libcublas.so.12")
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        cu12.to_str().unwrap()
    );
    // With CUDA 13's beside it, 13 wins (cudarc never looks for .so.13 itself).
    fs::create_dir_all(&cu13).unwrap();
    fs::write(cu13.join("libcublas.so.13"), b"13").unwrap();
    fs::write(cu13.join("libcublasLt.so.13"), b"13").unwrap();
    let o = find(&root);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        fs::read_link(out.join("libcublas.so")).unwrap(),
        cu13.join("libcublas.so.13")
    );
    assert_eq!(
        fs::read_link(out.join("libcublasLt.so")).unwrap(),
        cu13.join("libcublasLt.so.13")
    );
    // Nothing there: an error naming where it looked.
    let empty = dir.path().join("empty");
    fs::create_dir_all(&empty).unwrap();
    let o = find(&empty);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("no libcublas.so.13 or .so.12 under") && text(&o).contains("empty"),
        "{}",
        text(&o)
    );
}

/// A packaged check in `dir/gpu-check` whose binaries are stand-ins: the GPU unit tests and
/// the training example fail, everything else prints a line.
fn stand_in_package(dir: &Path) {
    let check = dir.join("gpu-check");
    let bin = check.join("payload/bin");
    fs::create_dir_all(&bin).unwrap();
    // Stand-ins for the packaged binaries: the GPU tests fail, everything else prints a line.
    let stub = |name: &str, body: &str| {
        let path = bin.join(name);
        fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    };
    stub(
        "test-imagefeed",
        "echo 'test result: FAILED. 1 passed; 1 failed'; exit 101",
    );
    stub("test-gpu", "echo 'test result: ok. 3 passed'");
    // With --json, one epoch of 30 ms: what bench/cold_warm.sh reads.
    stub(
        "imagefeed-bench",
        "echo \"bench $*\"; case \"$*\" in *--json*) echo '{\"event\": \"epoch\", \"seconds\": 0.03}';; esac",
    );
    stub("pack-dataset", "echo \"pack $*\"");
    stub("train_cifar_gpu", "echo 'epoch 0: mean loss 2.0'; exit 1");
    fs::write(check.join("payload/glibc-built-with"), "2.0\n").unwrap();
    fs::write(check.join("payload/torch_baseline.py"), "").unwrap();
    fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("cold_warm.sh"),
        check.join("payload/cold_warm.sh"),
    )
    .unwrap();
    let tar = |args: &[&str]| {
        let status = Command::new("tar")
            .args(args)
            .current_dir(&check)
            .status()
            .unwrap();
        assert!(status.success());
    };
    tar(&["-cJf", "payload.tar.xz", "payload"]);
    fs::remove_dir_all(check.join("payload")).unwrap();
    fs::create_dir_all(check.join("data/cifar10-test/a")).unwrap();
    fs::write(check.join("data/cifar10-test/a/0.jpg"), b"x").unwrap();
    tar(&[
        "-C",
        "data",
        "-czf",
        "data/cifar10-test.tar.gz",
        "cifar10-test",
    ]);
    fs::remove_dir_all(check.join("data/cifar10-test")).unwrap();
}

#[test]
fn a_failing_step_is_reported_and_every_later_step_still_runs() {
    let dir = tempfile::tempdir().unwrap();
    stand_in_package(dir.path());
    let o = run(&["run", "gpu-check"], dir.path());
    let out = text(&o);
    assert!(!o.status.success(), "a failed step fails the run:\n{out}");
    // The first failure did not stop the run: every later step ran ...
    for later in [
        "== GPU tests (tests/gpu.rs)",
        "bench gpu --batch 128 --step-ms 2",
        "== training example",
        "bench load work/cifar.lmdb --batch-size 256 --workers 16",
    ] {
        assert!(out.contains(later), "missing {later:?}:\n{out}");
    }
    // ... and the summary lists what failed and what each part printed, or that it printed
    // nothing, instead of aborting at the first pattern that matched nothing.
    let summary = out.split("== summary").nth(1).expect("a summary");
    assert!(
        summary.contains("failed: GPU unit tests (exit 101)"),
        "{summary}"
    );
    assert!(summary.contains("failed: training example"), "{summary}");
    assert!(
        summary.contains("tests: test result: ok. 3 passed"),
        "{summary}"
    );
    assert!(summary.contains("bandwidth: (no output"), "{summary}");
    // Without torch no Python step ran: cargo's "3 passed" is not reported as Python's.
    assert!(summary.contains("python: (no output"), "{summary}");
    assert!(
        summary.contains("training: epoch 0: mean loss 2.0"),
        "{summary}"
    );
    assert!(out.contains("the PyTorch comparisons are skipped"), "{out}");
}

#[test]
fn part_gpu_and_part_load_split_the_run_and_a_wrong_part_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    stand_in_package(dir.path());
    let gpu = run_part(&["run", "gpu-check"], dir.path(), Some("gpu"));
    let out = text(&gpu);
    assert!(out.contains("== GPU tests (tests/gpu.rs)"), "{out}");
    assert!(out.contains("== training example"), "{out}");
    assert!(
        !out.contains("bench load"),
        "PART=gpu runs no loading step:\n{out}"
    );
    assert!(!out.contains("== cold against warm"), "{out}");

    let load = run_part(&["run", "gpu-check"], dir.path(), Some("load"));
    let out = text(&load);
    assert!(
        load.status.success(),
        "the stand-in loading steps all pass:\n{out}"
    );
    assert!(
        out.contains("bench load work/cifar.lmdb --batch-size 256 --workers 16"),
        "{out}"
    );
    // Issue 34's cold target: warm, reopened and cold epochs of both CIFAR-10 packs, in the
    // summary with their median epoch in ms.
    assert!(
        out.contains(
            "pack imagefolder2lmdb work/cifar10-test work/cifar-shared.lmdb --shared-headers"
        ),
        "{out}"
    );
    let summary = out.split("== summary").nth(1).expect("a summary");
    for line in [
        "cold: 1 cifar.lmdb warm 30.0",
        "cold: 3 cifar-shared.lmdb reopen 30.0",
        "cold: 3 cifar-shared.lmdb cold 30.0",
    ] {
        assert!(summary.contains(line), "missing {line:?}:\n{summary}");
    }
    assert!(
        !out.contains("== GPU"),
        "PART=load runs no GPU step:\n{out}"
    );
    assert!(!out.contains("== training example"), "{out}");

    let wrong = run_part(&["run", "gpu-check"], dir.path(), Some("gpus"));
    assert_eq!(wrong.status.code(), Some(2), "{}", text(&wrong));
    assert!(text(&wrong).contains("PART is all, gpu or load, not gpus"));
}
