//! `imagefeed-bench load` with decode references: measured around every timed epoch, each
//! epoch quoted against the measurements just before and after it.

use std::process::Command;

use imagefeed::synthetic::{self, SyntheticSpec};
use serde_json::Value;

/// `imagefeed-bench load ARGS`, which must succeed: its stdout.
fn load(args: &[&str]) -> String {
    load_with_stderr(args).0
}

/// `imagefeed-bench load ARGS`, which must succeed: its stdout and stderr.
fn load_with_stderr(args: &[&str]) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_imagefeed-bench"))
        .arg("load")
        .args(args)
        .output()
        .expect("imagefeed-bench runs");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    (stdout, stderr)
}

#[test]
fn decode_references_bracket_every_timed_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    let spec = SyntheticSpec {
        classes: 2,
        per_class: 8,
        width: 32,
        height: 32,
        ..SyntheticSpec::default()
    };
    synthetic::write_image_folder(&root, &spec).unwrap();
    let tree = root.to_str().unwrap();
    let common = [
        tree,
        "--workers",
        "2",
        "--batch-size",
        "4",
        "--warmup",
        "1",
        "--epochs",
        "2",
        "--ceiling-samples",
        "16",
    ];

    let json = load(&[&common[..], &["--json"]].concat());
    let epochs: Vec<Value> = json
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["event"] == "epoch")
        .collect();
    assert_eq!(epochs.len(), 2, "{json}");
    let mut previous_after = None;
    for e in &epochs {
        let refs = &e["decode_references"];
        for key in ["one_thread", "n_threads"] {
            let pair = refs[key].as_array().unwrap_or_else(|| panic!("{key}: {e}"));
            assert_eq!(pair.len(), 2, "before and after: {e}");
            assert!(pair.iter().all(|r| r.as_f64().unwrap() > 0.0), "{e}");
        }
        // The measurement after one epoch is the one before the next.
        let before = refs["one_thread"][0].as_f64().unwrap();
        if let Some(after) = previous_after {
            assert_eq!(before, after, "{json}");
        }
        previous_after = refs["one_thread"][1].as_f64();
    }

    let text = load(&common);
    assert!(
        text.contains("measured before each timed epoch and after the last"),
        "{text}"
    );
    let quoted = text
        .lines()
        .filter(|l| l.starts_with("epoch ") && l.contains("% of ceiling"))
        .filter(|l| l.contains("% of 2 threads decoding at once"))
        .count();
    assert_eq!(quoted, 2, "{text}");
    assert!(text.contains("median over the timed epochs:"), "{text}");

    // Without references, no ratios.
    let plain = load(&common[..common.len() - 2]);
    assert!(!plain.contains("of ceiling"), "{plain}");
}

#[test]
fn an_epoch_with_bad_samples_names_the_first_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    let spec = SyntheticSpec {
        classes: 2,
        per_class: 4,
        width: 32,
        height: 32,
        ..SyntheticSpec::default()
    };
    synthetic::write_image_folder(&root, &spec).unwrap();
    let class = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap();
    std::fs::write(class.join("zz-broken.jpg"), b"\xff\xd8\xff not a JPEG").unwrap();
    let args = [
        root.to_str().unwrap(),
        "--workers",
        "1",
        "--batch-size",
        "4",
        "--warmup",
        "0",
        "--epochs",
        "1",
        "--transform",
        "cifar",
        "--max-bad",
        "none",
    ];
    let (text, errors) = load_with_stderr(&args);
    assert!(text.contains(", 1 bad,"), "{text}");
    let first = errors
        .lines()
        .find(|l| l.contains("first bad sample of epoch 0: "))
        .unwrap_or_else(|| panic!("{errors}"));
    assert!(first.contains("zz-broken.jpg"), "{first}");
    let json = load(&[&args[..], &["--json"]].concat());
    let epoch: Value = json
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["event"] == "epoch")
        .unwrap();
    assert_eq!(epoch["bad"], 1, "{epoch}");
    assert!(
        epoch["first_bad"]
            .as_str()
            .unwrap()
            .contains("zz-broken.jpg"),
        "{epoch}"
    );
}

#[test]
fn the_datasets_notices_are_printed_once_each() {
    // A hostile try found every notice (an empty shard, a wrong count) invisible in `load`.
    // A class folder named in bytes that are not UTF-8 makes one; `--reopen` opens the
    // dataset every epoch, and the notice is printed once.
    use std::os::unix::ffi::OsStrExt as _;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    let spec = SyntheticSpec {
        classes: 2,
        per_class: 4,
        width: 32,
        height: 32,
        ..SyntheticSpec::default()
    };
    synthetic::write_image_folder(&root, &spec).unwrap();
    let odd = root.join(std::ffi::OsStr::from_bytes(b"\xf5"));
    std::fs::create_dir(&odd).unwrap();
    std::fs::copy(root.join("class00/img00000.jpg"), odd.join("a.jpg")).unwrap();
    let (_, stderr) = load_with_stderr(&[
        root.to_str().unwrap(),
        "--workers",
        "1",
        "--batch-size",
        "4",
        "--warmup",
        "0",
        "--epochs",
        "2",
        "--reopen",
        // (The odd class's files fail to read: bad samples, allowed here.)
        "--max-bad",
        "none",
    ]);
    let notes: Vec<&str> = stderr.lines().filter(|l| l.starts_with("note: ")).collect();
    assert_eq!(notes.len(), 1, "{stderr}");
    assert!(notes[0].contains("UTF-8"), "{stderr}");
}
