//! Stage times and counts: what the workers add up, and the [`Stats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Time per stage, summed over workers, and counts. A snapshot from [`Loader::stats`](super::Loader::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Reading records (with the sample loop's own work between them, such as the hint that
    /// starts loading the next record).
    pub read: Duration,
    /// Decoding.
    pub decode: Duration,
    /// Resizing and cropping.
    pub transform: Duration,
    /// Writing slots (flip, normalize, layout).
    pub collate: Duration,
    /// Time the consumer spent waiting for the next batch.
    pub waiting: Duration,
    /// Samples delivered.
    pub samples: u64,
    /// Batches delivered.
    pub batches: u64,
    /// Bad samples met.
    pub bad_samples: u64,
    /// Samples whose JPEG was decoded together with others of its batch in one libjpeg-turbo
    /// call (small JPEGs sharing their headers: the same pixels, a fraction of the fixed cost).
    pub stacked: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) read: AtomicU64,
    pub(super) decode: AtomicU64,
    pub(super) transform: AtomicU64,
    pub(super) collate: AtomicU64,
    pub(super) waiting: AtomicU64,
    pub(super) samples: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) bad: AtomicU64,
    pub(super) stacked: AtomicU64,
}

pub(super) fn add(counter: &AtomicU64, d: Duration) {
    counter.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
}

/// Stage times of one batch, kept by its worker and added to the shared [`Counters`] once per
/// batch: per-sample atomic adds on one shared cache line would bounce it between the workers'
/// cores tens of thousands of times a second.
///
/// The stages are timed as one chain of clock readings (`clock`): each stage ends where the
/// next begins, four readings per sample instead of two per stage.
pub(super) struct StageTimes {
    pub(super) read: Duration,
    pub(super) decode: Duration,
    pub(super) transform: Duration,
    pub(super) collate: Duration,
    pub(super) clock: Stopwatch,
}

impl StageTimes {
    /// Zero times, the chain starting now.
    pub(super) fn starting_now() -> StageTimes {
        StageTimes {
            read: Duration::ZERO,
            decode: Duration::ZERO,
            transform: Duration::ZERO,
            collate: Duration::ZERO,
            clock: Stopwatch {
                last: Instant::now(),
            },
        }
    }

    pub(super) fn add_to(&self, counters: &Counters) {
        add(&counters.read, self.read);
        add(&counters.decode, self.decode);
        add(&counters.transform, self.transform);
        add(&counters.collate, self.collate);
    }
}

/// A chain of clock readings.
pub(super) struct Stopwatch {
    /// The last reading: the end of the previous stage.
    pub(super) last: Instant,
}

impl Stopwatch {
    /// Ends the stage that began at `last`: returns its length and starts the next.
    pub(super) fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let stage = now - self.last;
        self.last = now;
        stage
    }
}
