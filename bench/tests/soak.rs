//! `imagefeed-bench soak`, short: a dozen epochs over a tree holding broken files, with the
//! determinism and resume checks every 4 epochs (`make soak` runs the 100-epoch version).

use std::process::Command;

use imagefeed::synthetic::{self, SyntheticSpec};

fn soak(tree: &str, extra: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_imagefeed-bench"))
        .args(["soak", tree, "--workers", "4", "--batch-size", "16"])
        .args(extra)
        .output()
        .expect("imagefeed-bench runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

#[test]
fn a_short_soak_with_bad_samples_keeps_memory_pool_and_stream() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    let spec = SyntheticSpec {
        classes: 3,
        per_class: 20,
        width: 32,
        height: 32,
        edge_cases: true,
        ..SyntheticSpec::default()
    };
    synthetic::write_image_folder(&root, &spec).unwrap();
    let tree = root.to_str().unwrap();
    let (ok, text) = soak(tree, &["--epochs", "12", "--check-every", "4"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("3 determinism and resume checks passed"),
        "{text}"
    );
    // The four broken files are met, and replaced, every epoch (a replacement that is itself
    // broken counts too).
    let bad: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("epoch "))
        .map(|l| l.split(", bad ").nth(1).unwrap().split(',').next().unwrap())
        .collect();
    assert_eq!(bad.len(), 12);
    assert!(
        bad.iter().all(|b| b.parse::<usize>().unwrap() >= 4),
        "{bad:?}"
    );

    // The checks can fail: an impossible memory bound is reported as such.
    let (ok, text) = soak(
        tree,
        &[
            "--epochs",
            "3",
            "--check-every",
            "1",
            "--max-rss-growth=-100",
        ],
    );
    assert!(!ok && text.contains("resident memory grew"), "{text}");
}
