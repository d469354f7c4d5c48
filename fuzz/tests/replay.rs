//! Replays every fuzz target's seeds, committed corpus and regression inputs, so CI checks that
//! none of them panics, and none allocates past the harness's bound, without running a fuzzer.

use imagefeed::fuzzing::{TARGETS, seeds};
use imagefeed_fuzz::{BoundedAlloc, inputs};

#[global_allocator]
static ALLOCATOR: BoundedAlloc = BoundedAlloc;

#[test]
fn every_seed_corpus_and_regression_input_runs_clean() {
    let mut failures = Vec::new();
    let mut counts = Vec::new();
    for &(name, target) in TARGETS {
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "target {name} has no seeds");
        let files: Vec<_> = ["corpus", "regressions"]
            .iter()
            .flat_map(|kind| inputs(kind, name))
            .collect();
        counts.push(format!(
            "{name}: {} seeds, {} files",
            seeds.len(),
            files.len()
        ));
        for (i, seed) in seeds.iter().enumerate() {
            if std::panic::catch_unwind(|| target(seed)).is_err() {
                failures.push(format!("{name}: seed {i}"));
            }
        }
        for file in files {
            let data = std::fs::read(&file).unwrap();
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                failures.push(file.display().to_string());
            }
        }
    }
    eprintln!("{}", counts.join("\n"));
    assert!(
        failures.is_empty(),
        "failing inputs:\n{}",
        failures.join("\n")
    );

    // The file-level seeds are datasets whose records decode: a seed refused at open would
    // leave the fuzzer outside the record path.
    for name in [
        "records_dataset",
        "hdf5_dataset",
        "lmdb_file",
        "webdataset_shard",
        "mds_dataset",
    ] {
        let before = imagefeed::fuzzing::records_decoded();
        let Some(target) = imagefeed::fuzzing::target(name) else {
            // Only a build without the `hdf5` feature lacks a target.
            assert!(
                name == "hdf5_dataset" && cfg!(not(feature = "hdf5")),
                "{name}"
            );
            continue;
        };
        for seed in seeds(name) {
            target(&seed);
        }
        let decoded = imagefeed::fuzzing::records_decoded() - before;
        assert!(decoded >= 2, "{name}: its seeds decoded {decoded} records");
    }
    imagefeed::fuzzing::remove_scratch_dir();
}
