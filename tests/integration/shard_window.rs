//! Shuffling within a window of shards (what shards fetched from object storage need): the
//! epoch reads a bounded set of shards at a time, and every guarantee of the global shuffle
//! holds — bit-identical batches for any worker count, exact resume, each sample once per epoch
//! at any world size, and a state that resumes only a loader with the same window.

use crate::support;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use imagefeed::Error;
use imagefeed::dataset::Dataset;
use imagefeed::format;
use imagefeed::loader::{Loader, LoaderConfig, LoaderState};
use imagefeed::transform::Transform;

/// 60 small JPEGs packed as record shards of about 8 samples each.
fn shards(dir: &Path) -> Arc<dyn Dataset> {
    format::open(support::packed_small_records(dir, "shards.records")).unwrap()
}

fn config(workers: usize, window: Option<usize>) -> LoaderConfig {
    LoaderConfig::default()
        .with_batch_size(5)
        .with_workers(workers)
        .with_seed(11)
        .with_transform(Transform::imagenet_train(8))
        .with_shard_window(window)
}

/// (sample index, batch bytes) of every batch of an epoch, in order.
fn batches(loader: &Loader, epoch: u64) -> Vec<(Vec<usize>, Vec<u8>)> {
    loader
        .epoch(epoch)
        .map(|b| {
            let b = b.unwrap();
            (b.samples.clone(), b.bytes().to_vec())
        })
        .collect()
}

#[test]
fn a_window_bounds_the_shards_read_at_a_time_and_the_stream_is_the_same_for_any_workers() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = shards(dir.path());
    let starts = dataset.shard_starts().unwrap().to_vec();
    assert!(starts.len() > 6, "{starts:?}");
    let shard_of = |i: usize| starts.partition_point(|&s| s <= i) - 1;
    let reference = batches(
        &Loader::new(Arc::clone(&dataset), config(1, Some(2))).unwrap(),
        4,
    );
    for workers in [2, 3] {
        let loader = Loader::new(Arc::clone(&dataset), config(workers, Some(2))).unwrap();
        assert_eq!(batches(&loader, 4), reference, "{workers} workers");
    }
    // Every sample once, and the order walks the shards two at a time.
    let order: Vec<usize> = reference.iter().flat_map(|b| b.0.clone()).collect();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..dataset.len()).collect::<Vec<_>>());
    let mut open: Vec<usize> = Vec::new();
    let mut switches = 0;
    for &i in &order {
        let shard = shard_of(i);
        if !open.contains(&shard) {
            if open.len() == 2 {
                open.clear();
                switches += 1;
            }
            open.push(shard);
        }
    }
    assert_eq!(
        switches,
        (starts.len() - 1).div_ceil(2) - 1,
        "windows of two shards"
    );
    // The global shuffle reaches many shards in its first ten samples; the window, two.
    let global = batches(
        &Loader::new(Arc::clone(&dataset), config(1, None)).unwrap(),
        4,
    );
    let first: HashSet<usize> = global
        .iter()
        .flat_map(|b| b.0.clone())
        .take(10)
        .map(shard_of)
        .collect();
    assert!(first.len() > 2, "{first:?}");
}

#[test]
fn a_windowed_epoch_resumes_exactly_and_at_another_world_size_gives_each_sample_once() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = shards(dir.path());
    let full = batches(
        &Loader::new(Arc::clone(&dataset), config(2, Some(3))).unwrap(),
        1,
    );
    for stop_after in [1, 4, full.len() - 1] {
        let loader = Loader::new(Arc::clone(&dataset), config(2, Some(3))).unwrap();
        let mut epoch = loader.epoch(1);
        for _ in 0..stop_after {
            epoch.next().unwrap().unwrap();
        }
        let state: LoaderState =
            serde_json::from_str(&serde_json::to_string(&epoch.state()).unwrap()).unwrap();
        assert_eq!(state.shard_window, Some(3));
        let again = Loader::new(Arc::clone(&dataset), config(1, Some(3))).unwrap();
        let rest: Vec<(Vec<usize>, Vec<u8>)> = again
            .resume(&state)
            .unwrap()
            .map(|b| {
                let b = b.unwrap();
                (b.samples.clone(), b.bytes().to_vec())
            })
            .collect();
        assert_eq!(rest, full[stop_after..], "after {stop_after}");
        // Another window, or none, is another stream: refused, naming the setting.
        for other in [None, Some(2)] {
            let loader = Loader::new(Arc::clone(&dataset), config(1, other)).unwrap();
            assert!(matches!(
                loader.resume(&state),
                Err(Error::StateMismatch {
                    setting: "shard_window",
                    ..
                })
            ));
        }
    }
    // Two ranks for two batches, then three ranks for the rest: each sample once (plus less
    // than one sample of padding per rank).
    let at = |rank, world| config(2, Some(3)).with_rank(rank, world);
    let mut before = Vec::new();
    let mut state = None;
    for rank in 0..2 {
        let loader = Loader::new(Arc::clone(&dataset), at(rank, 2)).unwrap();
        let mut epoch = loader.epoch(1);
        for batch in epoch.by_ref().take(2) {
            before.extend(batch.unwrap().samples);
        }
        if rank == 0 {
            state = Some(epoch.state());
        }
    }
    let state = state.unwrap();
    let mut after = Vec::new();
    let mut counts = HashSet::new();
    for rank in 0..3 {
        let loader = Loader::new(Arc::clone(&dataset), at(rank, 3)).unwrap();
        let stream = loader.resume(&state).unwrap();
        counts.insert(stream.remaining());
        for batch in stream {
            after.extend(batch.unwrap().samples);
        }
    }
    assert_eq!(counts.len(), 1, "equal batch counts per rank");
    let seen: HashMap<usize, usize> =
        before
            .iter()
            .chain(&after)
            .fold(HashMap::new(), |mut m, &i| {
                *m.entry(i).or_default() += 1;
                m
            });
    assert_eq!(seen.len(), dataset.len(), "every sample delivered");
    let repeated = seen.values().filter(|&&n| n > 1).count();
    assert!(
        repeated < 3,
        "padding beyond one sample per rank: {repeated}"
    );
}

#[test]
fn a_zero_window_is_a_configuration_error_and_non_shard_datasets_ignore_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = shards(dir.path());
    assert!(matches!(
        Loader::new(Arc::clone(&dataset), config(1, Some(0))),
        Err(Error::Config(_))
    ));
    let folder = format::open(dir.path().join("src")).unwrap();
    assert!(folder.shard_starts().is_none());
    let windowed = batches(
        &Loader::new(Arc::clone(&folder), config(1, Some(2))).unwrap(),
        0,
    );
    let global = batches(&Loader::new(folder, config(1, None)).unwrap(), 0);
    assert_eq!(windowed, global);
}
