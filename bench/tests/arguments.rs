//! `imagefeed-bench` refuses counts it cannot honour, naming the flag, where it spawned threads
//! until the system refused (`read --threads 1000000`) or counted epochs past u64 and ran none
//! (`load --warmup 2^64-1 --epochs 2`, found by a hostile try).

use std::process::Command;

fn bench(args: &[&str]) -> (bool, String) {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/imagefolder");
    let o = Command::new(env!("CARGO_BIN_EXE_imagefeed-bench"))
        .args(
            args.iter()
                .map(|a| if *a == "FIXTURES" { fixtures } else { a }),
        )
        .output()
        .expect("imagefeed-bench runs");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn thread_and_epoch_counts_past_what_can_run_are_errors_naming_the_flag() {
    for (args, says) in [
        (
            &["read", "FIXTURES", "--threads", "1000000"][..],
            "--threads 1000000: 1 to 1024",
        ),
        (
            &["read", "FIXTURES", "--threads", "0"],
            "--threads 0: 1 to 1024",
        ),
        (
            &[
                "load",
                "FIXTURES",
                "--warmup",
                "18446744073709551615",
                "--epochs",
                "2",
            ],
            "more epochs than can be counted",
        ),
    ] {
        let (ok, stderr) = bench(args);
        assert!(!ok && stderr.contains(says), "{args:?}: {stderr}");
    }
    let (ok, stderr) = bench(&["read", "FIXTURES", "--threads", "2", "--max-bad", "none"]);
    assert!(ok, "{stderr}");
    // `load --workers 0` builds batches in the calling thread (it was refused as "prefetch
    // 0"); a worker count past any machine is refused by the loader, not an overflow.
    let (ok, stderr) = bench(&["load", "FIXTURES", "--workers", "0", "--max-bad", "none"]);
    assert!(ok, "{stderr}");
    let (ok, stderr) = bench(&["load", "FIXTURES", "--workers", "9223372036854775808"]);
    assert!(!ok && stderr.contains("workers"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
