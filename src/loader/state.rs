//! [`LoaderState`]: where an epoch stands, serializable, with everything that decides its stream.

use serde::{Deserialize, Serialize};

use super::BadSamplePolicy;
#[cfg(doc)]
use super::Loader;
use crate::sampler::Uneven;
#[cfg(doc)]
use crate::{dataset::fingerprint, sampler::Sampling};

/// The version of [`LoaderState`]'s layout; a state of another version is refused.
pub const LOADER_STATE_VERSION: u32 = 2;

/// Where an epoch stands, with everything that decides its stream: enough to resume it exactly,
/// and to refuse a loader that would give a different stream. Serializable (serde).
///
/// [`Loader::resume`] checks `version`, `seed`, `shuffle`, `drop_last`, `uneven`,
/// `bad_sample_policy`, `transform` and `dataset` against the loader. `rank`, `world_size` and
/// `batch_size` may differ: every rank of a job stands at the same batch of an epoch, so any
/// rank's state resumes any rank, and a state saved at another world size or batch size
/// continues the epoch with exactly the samples no rank has been given yet ([`Loader::resume`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// [`LOADER_STATE_VERSION`] when saved.
    pub version: u32,
    /// The loader's seed.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// Samples per batch.
    pub batch_size: usize,
    /// Whether epochs are shuffled.
    pub shuffle: bool,
    /// The shard window shuffled within ([`Sampling::shard_window`]); absent: a global
    /// shuffle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_window: Option<usize>,
    /// Whether a final short batch is dropped.
    pub drop_last: bool,
    /// Padding or dropping between ranks.
    pub uneven: Uneven,
    /// The rank that saved the state.
    pub rank: usize,
    /// The world size the epoch was running at.
    pub world_size: usize,
    /// [`fingerprint`] of the dataset.
    pub dataset: String,
    /// [`listing_digest`](crate::dataset::listing_digest) of the dataset, where it has one
    /// (imagefeed's packs, image folders): compared on resume when both sides have it. Absent
    /// in states saved before it existed, which resume on the fingerprint alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset_listing: Option<String>,
    /// Samples of the epoch's order given out before the current world size took over: 0,
    /// unless the epoch was resumed at another world size.
    pub start: usize,
    /// The next batch to deliver, counted from `start`.
    pub next_batch: usize,
    /// Sample slots this rank had consumed when the part beginning at `start` began (what a
    /// `max_bad` fraction counts the part's samples on top of).
    pub samples_before_start: u64,
    /// The bad-sample policy (`replace` changes which samples a batch holds).
    pub bad_sample_policy: BadSamplePolicy,
    /// A digest of the transform and the pixel limit (they decide the pixels, and which
    /// samples are bad).
    pub transform: String,
    /// Bad samples met so far in this epoch by the rank that saved the state (what `max_bad`
    /// applies to).
    pub bad_samples: u64,
    /// Sample slots of this epoch this rank has consumed so far.
    pub samples_seen: u64,
}
