//! The worker threads: each builds whole batches, sample by sample, into pooled buffers.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::Receiver;

use super::stats::StageTimes;
use super::{BadSamplePolicy, Job, Shared};
use crate::batch::{BadSample, BadSampleKind, Batch};
use crate::dataset::LazyReader;
use crate::error::{Error, Result};
use crate::pool::PooledBuffer;
use crate::rng::SampleRng;
use crate::transform::Layout;
use crate::transform::SampleTransformer;
use crate::transform::transformer::Source;

/// Domain of the replacement-choice streams (sample streams use 0, the shuffle 1).
const REPLACE_DOMAIN: u64 = 2;
/// The random stream of a batch's MixUp/CutMix draw (the rank in the bits above).
const MIX_DOMAIN: u64 = 6;
/// Candidates tried for one bad sample under `Replace`.
const REPLACE_ATTEMPTS: usize = 16;

/// Batches in a row whose small JPEGs mostly did not decode together after which a worker
/// stops trying for a while (see [`StackTries`]).
const STACK_MISSES: u32 = 3;
/// The batches a worker first leaves unstacked after [`STACK_MISSES`] misses; each miss of a
/// retry doubles it, up to [`STACK_PAUSE_MOST`].
const STACK_PAUSE_LEAST: u32 = 8;
/// The most batches a worker leaves unstacked before it tries again.
const STACK_PAUSE_MOST: u32 = 256;

/// When a worker offers its batches to the decoder's stack ([`Worker::stack_batch`]): not
/// after [`STACK_MISSES`] misses in a row, until a pause of [`STACK_PAUSE_LEAST`] batches has
/// passed (doubling with each retry that misses, up to [`STACK_PAUSE_MOST`]): a dataset whose
/// first batches do not stack (large images first, or a few damaged files) still gets the
/// stacks' speed where later ones do, and one that never stacks pays for a try once in 256
/// batches. Never where records cost a read over the network to read again.
#[derive(Debug, Default)]
struct StackTries {
    /// Misses in a row since the last hit.
    misses: u32,
    /// Batches still to leave unstacked.
    paused: u32,
    /// The length of the last pause.
    pause: u32,
    /// The records cost a fetch to read again: never tried.
    never: bool,
}

impl StackTries {
    /// Whether to offer the next batch to the stack (one call per batch).
    fn next_batch(&mut self) -> bool {
        if self.never {
            return false;
        }
        if self.paused > 0 {
            self.paused -= 1;
            return false;
        }
        true
    }

    /// Counts a batch offered to the stack: `hit` when stacking it paid.
    fn counted(&mut self, hit: bool) {
        if hit {
            *self = StackTries::default();
            return;
        }
        self.misses += 1;
        if self.misses >= STACK_MISSES {
            self.pause = (self.pause * 2).clamp(STACK_PAUSE_LEAST, STACK_PAUSE_MOST);
            self.paused = self.pause;
            // One more miss after the pause starts the next, longer one.
            self.misses = STACK_MISSES - 1;
        }
    }
}

pub(super) fn worker_loop(shared: &Shared, queue: &Receiver<Job>) {
    let mut worker = Worker::new(shared);
    for job in queue.iter() {
        if job.cancel.load(Ordering::Relaxed) {
            continue;
        }
        let result = worker.run(shared, &job);
        let _ = job.reply.send((job.position, result)); // the epoch may be gone
    }
}

/// A worker's private state: its own reader handle and transformer.
pub(super) struct Worker {
    pub(super) reader: LazyReader,
    pub(super) transformer: SampleTransformer,
    /// When stacking small JPEGs is tried.
    stack_tries: StackTries,
    /// The label and key of each sample of the batch that is in the decoder's stack, by
    /// position: [`Self::sample`] takes it from the stack without reading it again.
    stacked: KeptRecords,
}

impl Worker {
    pub(super) fn new(shared: &Shared) -> Worker {
        Worker {
            reader: LazyReader::new(Arc::clone(&shared.dataset)),
            transformer: shared.config.transformer(),
            stack_tries: StackTries::default(),
            stacked: KeptRecords::default(),
        }
    }

    /// Builds `job`'s batch; a panic is an error naming the batch, not the end of the thread.
    pub(super) fn run(&mut self, shared: &Shared, job: &Job) -> Result<Batch> {
        // A SIGBUS handler installed since the last batch (a forked process's) goes behind ours.
        crate::mapguard::claim();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.build(shared, job)))
            .unwrap_or_else(|panic| {
                Err(Error::Panicked {
                    what: format!("a worker building batch {}", job.position),
                    message: crate::error::panic_message(&*panic),
                })
            })
    }
}

/// The label and key of each sample of a batch that is in the decoder's stack, by position
/// in the batch; the keys share one buffer, so keeping them allocates nothing per sample once
/// the buffers have grown.
#[derive(Default)]
struct KeptRecords {
    by_position: Vec<Option<(u32, Range<usize>)>>,
    keys: String,
}

impl KeptRecords {
    fn clear(&mut self) {
        self.by_position.clear();
        self.keys.clear();
    }

    /// Empty, for a batch of `len` samples.
    fn reset(&mut self, len: usize) {
        self.clear();
        self.by_position.resize(len, None);
    }

    fn keep(&mut self, position: usize, label: u32, key: &str) {
        let start = self.keys.len();
        self.keys.push_str(key);
        self.by_position[position] = Some((label, start..self.keys.len()));
    }

    /// The label and key kept for `position`, if any.
    fn get(&self, position: usize) -> Option<(u32, &str)> {
        let (label, key) = self.by_position.get(position)?.as_ref()?;
        Some((*label, &self.keys[key.clone()]))
    }
}

/// How one sample went.
enum Outcome {
    Ok(u32),
    Bad {
        key: String,
        kind: BadSampleKind,
        reason: String,
    },
}

/// The batch being filled: slot memory is taken once the slot size is known.
struct Collator {
    buffer: Option<PooledBuffer>,
    capacity: usize,
    slot_len: usize,
    size: Option<(u32, u32, usize, String)>,
    written: usize,
}

impl Worker {
    fn build(&mut self, shared: &Shared, job: &Job) -> Result<Batch> {
        let config = &shared.config;
        let mut collator = Collator {
            buffer: None,
            // The largest batch's capacity even for the short last batch, so every buffer fits
            // every batch and the pool never needs more than `prefetch` of them (fixed-size
            // outputs); never more than an epoch can fill.
            capacity: shared.largest_batch.max(job.indices.len()),
            slot_len: 0,
            size: None,
            written: 0,
        };
        let mut samples = Vec::with_capacity(job.indices.len());
        let mut labels = Vec::with_capacity(job.indices.len());
        let mut bad = Vec::new();
        let mut times = StageTimes::starting_now();
        // Reads that wait on the network (ranged reads from object storage) start together.
        self.reader.plan_reads(&job.indices);
        // Where the decoder's stack ends: samples from there on go into the next one.
        let mut stack_end = self.stack_batch(job, 0, &mut times);
        let stacked = stack_end.is_some();
        // Images stacked, and taken from a stack, in the batch's stacks before the current one
        // (a batch larger than one stack holds has several).
        let mut earlier_stacks = (0, 0);
        // The samples, in a closure so that the stage times are counted however it ends.
        let mut fill = || -> Result<()> {
            for (position, &index) in job.indices.iter().enumerate() {
                if job.cancel.load(Ordering::Relaxed) {
                    return Err(Error::Cancelled);
                }
                if stack_end == Some(position) {
                    // The stack before is used up: the next stack starts here.
                    let (stacked, used) = self.transformer.stack_counts();
                    earlier_stacks.0 += stacked;
                    earlier_stacks.1 += used;
                    stack_end = self.stack_batch(job, position, &mut times);
                }
                // The next sample's bytes load while this one decodes.
                if let Some(&next) = job.indices.get(position + 1)
                    && self.stacked.get(position + 1).is_none()
                {
                    self.reader.prefetch(next);
                }
                let at = stack_end.is_some().then_some(position);
                match self.sample(shared, job.epoch, index, at, &mut collator, &mut times)? {
                    Outcome::Ok(label) => {
                        samples.push(index);
                        labels.push(label);
                    }
                    Outcome::Bad { key, kind, reason } => {
                        if config.bad_samples == BadSamplePolicy::Error {
                            return Err(Error::BadSample {
                                index,
                                key,
                                kind,
                                reason,
                            });
                        }
                        let mut record = BadSample {
                            index,
                            key,
                            kind,
                            reason,
                            replaced_by: None,
                            while_replacing: None,
                        };
                        if config.bad_samples == BadSamplePolicy::Replace
                            && let Some((candidate, label)) = self.replacement(
                                shared,
                                job.epoch,
                                index,
                                &mut collator,
                                &mut times,
                                &mut bad,
                            )?
                        {
                            samples.push(candidate);
                            labels.push(label);
                            record.replaced_by = Some(candidate);
                        }
                        bad.push(record);
                    }
                }
            }
            Ok(())
        };
        let result = fill();
        times.add_to(&shared.counters);
        if stacked {
            let (last_stacked, last_used) = self.transformer.stack_counts();
            let (stacked, used) = (
                earlier_stacks.0 + last_stacked,
                earlier_stacks.1 + last_used,
            );
            self.stack_result(stacked, used, job.indices.len());
            shared
                .counters
                .stacked
                .fetch_add(used as u64, Ordering::Relaxed);
        }
        result?;
        // A batch left with no sample keeps the transform's size when it has one, so that its
        // shape is still [0, 3, h, w] (only a native-size batch with no image has no size).
        let (width, height) = collator
            .size
            .as_ref()
            .map(|s| (s.0, s.1))
            .or_else(|| config.transform.fixed_size())
            .unwrap_or((0, 0));
        let mut data = collator
            .buffer
            .take()
            .unwrap_or_else(|| shared.pool.take(0));
        data.truncate(collator.written * collator.slot_len);
        let (h, w, n) = (height as usize, width as usize, collator.written);
        let shape = match config.transform.output.layout {
            Layout::Nchw => [n, 3, h, w],
            Layout::Nhwc => [n, h, w, 3],
        };
        let soft_labels = mix_batch(config, job, data.as_mut_slice(), shape, &labels)?;
        Ok(Batch {
            epoch: job.epoch,
            index: job.position,
            samples,
            labels,
            soft_labels,
            bad,
            shape,
            dtype: config.transform.output.dtype,
            layout: config.transform.output.layout,
            data,
        })
    }

    /// Under `Replace`: the first of up to [`REPLACE_ATTEMPTS`] candidates, drawn from
    /// `(seed, epoch, index)`, that loads into the next slot, with its label. Candidates that
    /// are bad themselves are recorded in `bad`.
    fn replacement(
        &mut self,
        shared: &Shared,
        epoch: u64,
        index: usize,
        collator: &mut Collator,
        times: &mut StageTimes,
        bad: &mut Vec<BadSample>,
    ) -> Result<Option<(usize, u32)>> {
        let config = &shared.config;
        let mut rng = SampleRng::keyed(config.sampling.seed, epoch, index as u64, REPLACE_DOMAIN);
        let len = shared.dataset.len() as u64;
        for _ in 0..REPLACE_ATTEMPTS {
            let candidate = rng.below(len) as usize;
            if candidate == index {
                continue;
            }
            match self.sample(shared, epoch, candidate, None, collator, times)? {
                Outcome::Ok(label) => return Ok(Some((candidate, label))),
                Outcome::Bad { key, kind, reason } => bad.push(BadSample {
                    index: candidate,
                    key,
                    kind,
                    reason: format!("{reason} (while replacing sample {index})"),
                    replaced_by: None,
                    while_replacing: Some(index),
                }),
            }
        }
        Ok(None)
    }

    /// Small JPEGs decode several times faster together than one by one (the fixed cost of a
    /// decode is most of a 32×32 image's; `decode::stack`): before a batch's samples are
    /// built, their records are read once and offered to the decoder's stack, which decodes
    /// the ones that can be stacked in one call; [`Self::sample`] then takes their pixels
    /// from there. The pixels are the same either way. Only where reading a record twice
    /// costs little, and a worker whose batches do not stack tries less often ([`StackTries`]).
    ///
    /// The stack takes the batch's samples from position `from` on until it is full; returns
    /// where it ends (the first position it did not consider: the batch's length when it
    /// considered all), from which the next stack starts; `None` when no sample from `from`
    /// on comes from a stack.
    fn stack_batch(&mut self, job: &Job, from: usize, times: &mut StageTimes) -> Option<usize> {
        self.stacked.clear();
        if from == 0 && !self.stack_tries.next_batch() {
            return None;
        }
        self.transformer.stack_clear();
        self.stacked.reset(job.indices.len());
        let mut offered = 0;
        let mut end = job.indices.len();
        for (position, &index) in job.indices.iter().enumerate().skip(from) {
            if self.transformer.stack_is_full() {
                end = position;
                break;
            }
            // Opened by the first read, so asked after it.
            if position == 1 && !self.reader.rereads_are_cheap() {
                self.stack_tries.never = true;
                self.stacked.clear();
                return None;
            }
            if job.cancel.load(Ordering::Relaxed) {
                self.stacked.clear();
                return None;
            }
            match self.reader.read(index) {
                Ok(record) => {
                    if self.transformer.stack_offer(position, record.payload) {
                        self.stacked.keep(position, record.label, record.key);
                        offered += 1;
                    }
                }
                // No room in the cache for the sample's shard: every read waited for room
                // first (seconds), so reading on for the stack cost minutes a batch (a hostile
                // try). No stack for this batch; its own read of the sample says why.
                Err(Error::CacheFull { .. }) => {
                    self.transformer.stack_clear();
                    self.stacked.clear();
                    return None;
                }
                // A sample that cannot be read is the batch's to report, when it gets there.
                Err(_) => {}
            }
            // A dataset of large or unstackable images gives up after a few reads.
            if position == from + 3 && offered == 0 {
                break;
            }
        }
        times.read += times.clock.lap();
        let stacked = self.transformer.stack_decode();
        times.decode += times.clock.lap();
        if stacked == 0 {
            self.stacked.clear();
            if from == 0 {
                self.stack_result(0, 0, job.indices.len());
            }
            return None;
        }
        Some(end)
    }

    /// Counts a batch whose stack held `stacked` of its `len` samples, `used` of them taken
    /// from it. A miss: nothing stacked, fewer than half of the stacked taken (the transform
    /// wanted other decodes), or under an eighth of the batch stacked (then the records read
    /// twice cost about what the stack saves). A batch larger than a stack holds (over 2,000
    /// CIFAR images) counts the images of all its stacks.
    fn stack_result(&mut self, stacked: usize, used: usize, len: usize) {
        let miss = stacked == 0 || used * 2 < stacked || stacked * 8 < len;
        self.stack_tries.counted(!miss);
    }

    /// Reads, decodes and transforms sample `index` into the next free slot (`stacked`: its
    /// position in the batch when the batch was offered to the decoder's stack). A problem with
    /// the sample is an `Outcome::Bad`; only a batch-level problem (mixed sizes) is an `Err`.
    fn sample(
        &mut self,
        shared: &Shared,
        epoch: u64,
        index: usize,
        stacked: Option<usize>,
        collator: &mut Collator,
        times: &mut StageTimes,
    ) -> Result<Outcome> {
        let config = &shared.config;
        // The read stage runs from the end of the previous sample (or the batch's start), so
        // it includes the loop's own work, such as the prefetch hint for this record.
        // A stacked sample was read (and checked) before the batch's stack was decoded: its
        // label and key were kept, and the stack holds its bytes.
        let kept = stacked.and_then(|p| Some((p, self.stacked.get(p)?)));
        let (label, key, source) = match kept {
            Some((position, (label, key))) => {
                times.read += times.clock.lap();
                (label, key, Source::Stacked(position))
            }
            None => {
                let record = self.reader.read(index);
                times.read += times.clock.lap();
                match record {
                    Ok(record) => (record.label, record.key, Source::Payload(record.payload)),
                    // Not the sample's fault: the cache has no room for its shard, or the
                    // dataset's file was replaced or rewritten since it was opened. Every later
                    // sample would be bad too, or another file's; the batch fails, naming the
                    // file and what to do.
                    Err(e) if e.is_dataset_wide() => return Err(e),
                    Err(e) => {
                        return Ok(Outcome::Bad {
                            key: match &e {
                                Error::CorruptRecord { key, .. } => key.clone(),
                                // A listed key (an image folder's file, deleted since the
                                // listing) names it as any other bad sample of the dataset.
                                _ => shared.dataset.listed(index).map_or_else(
                                    || format!("#{index}"),
                                    |(key, _)| key.to_string(),
                                ),
                            },
                            kind: BadSampleKind::of_read_error(&e),
                            reason: e.to_string(),
                        });
                    }
                }
            }
        };
        let mut rng = SampleRng::new(config.sampling.seed, epoch, index as u64);
        let prepared =
            match self
                .transformer
                .apply_to(times.clock.last, &config.transform, source, &mut rng)
            {
                Ok(p) => p,
                Err(e) => {
                    times.decode += times.clock.lap();
                    return Ok(Outcome::Bad {
                        key: key.to_string(),
                        kind: BadSampleKind::of_decode_error(&e),
                        reason: e.to_string(),
                    });
                }
            };
        times.decode += prepared.decode_time;
        times.transform += prepared.transform_time;
        times.clock.last = prepared.finished;
        let (w, h) = (prepared.width, prepared.height);
        match &collator.size {
            None => {
                collator.size = Some((w, h, index, key.to_string()));
                collator.slot_len = config.transform.output.slot_len(w, h);
                let bytes = collator.slot_len * collator.capacity;
                collator.buffer =
                    Some(
                        shared
                            .pool
                            .try_take(bytes)
                            .ok_or_else(|| Error::OutOfMemory {
                                bytes: bytes as u64,
                                what: format!(
                                    "a batch of {} samples (epoch {epoch})",
                                    collator.capacity
                                ),
                            })?,
                    );
            }
            Some((fw, fh, first_index, first_key)) if (*fw, *fh) != (w, h) => {
                return Err(Error::ShapeMismatch {
                    first_index: *first_index,
                    first_key: first_key.clone(),
                    first_size: (*fw, *fh),
                    index,
                    key: key.to_string(),
                    size: (w, h),
                });
            }
            Some(_) => {}
        }
        let at = collator.written * collator.slot_len;
        let buffer = collator.buffer.as_mut().expect("allocated with the size");
        let slot = &mut buffer.as_mut_slice()[at..at + collator.slot_len];
        config
            .transform
            .output
            .write(prepared.pixels, w, h, prepared.flip, slot);
        collator.written += 1;
        times.collate += times.clock.lap();
        Ok(Outcome::Ok(label))
    }
}

/// MixUp/CutMix on a finished batch when the configuration asks for them: the draw comes from
/// the batch's own stream (this rank's batch at this position); returns the soft labels.
fn mix_batch(
    config: &super::LoaderConfig,
    job: &Job,
    data: &mut [u8],
    shape: [usize; 4],
    labels: &[u32],
) -> Result<Option<Vec<f32>>> {
    let Some(mix) = &config.batch_mix else {
        return Ok(None);
    };
    let s = &config.sampling;
    let domain = MIX_DOMAIN | (s.rank as u64) << 8;
    let mut rng = SampleRng::keyed(s.seed, job.epoch, job.position as u64, domain);
    let output = &config.transform.output;
    mix.apply(&mut rng, data, output.dtype, output.layout, shape, labels)
        .map(Some)
        .map_err(|reason| {
            Error::Config(format!(
                "batch {} of epoch {}: {reason}",
                job.position, job.epoch
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of `batches` batches in a row are offered to the stack when each offered one
    /// stacks or not as `hit` says.
    fn offered(tries: &mut StackTries, batches: usize, hit: impl Fn(usize) -> bool) -> Vec<usize> {
        (0..batches)
            .filter(|&batch| {
                let offer = tries.next_batch();
                if offer {
                    tries.counted(hit(batch));
                }
                offer
            })
            .collect()
    }

    #[test]
    fn stacking_pauses_after_misses_longer_each_time_and_resumes_on_a_hit() {
        let mut tries = StackTries::default();
        // Three misses, a pause of 8, a retry that misses, a pause of 16, ...
        let never = offered(&mut tries, 40, |_| false);
        assert_eq!(never, [0, 1, 2, 11, 28]);
        // ... up to pauses of 256 batches.
        let mut tries = StackTries::default();
        let far = offered(&mut tries, 5_000, |_| false);
        let gaps: Vec<usize> = far.windows(2).map(|w| w[1] - w[0] - 1).collect();
        assert_eq!(&gaps[..8], [0, 0, 8, 16, 32, 64, 128, 256]);
        assert!(gaps[8..].iter().all(|&gap| gap == 256), "{gaps:?}");
        // A retry that stacks ends the pauses: every batch is offered again.
        let mut tries = StackTries::default();
        let late = offered(&mut tries, 30, |batch| batch >= 11);
        assert_eq!(
            late,
            [0, 1, 2].into_iter().chain(11..30).collect::<Vec<_>>()
        );
        // A miss among hits pauses nothing.
        let mut tries = StackTries::default();
        assert_eq!(offered(&mut tries, 20, |batch| batch % 3 != 0).len(), 20);
    }

    #[test]
    fn records_read_over_the_network_are_never_stacked() {
        let mut tries = StackTries {
            never: true,
            ..StackTries::default()
        };
        assert!(offered(&mut tries, 1_000, |_| true).is_empty());
    }
}
