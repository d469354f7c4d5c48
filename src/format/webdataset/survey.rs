//! What the open learns from the samples: whatever the classes, how the set is laid out (a key
//! met again later in its shard, a shard that is a copy of another: [`structure_notices`]);
//! and from every sample's members when it reads their labels for the classes (`--num-classes`
//! skips that: [`Survey`]), the classes, the ways the set is read that its user should hear of
//! (a second image beside the one read, label fields that disagree, labels that are no
//! integer), and the refusal of a set whose samples are (almost) all unreadable for a reason
//! the set shows, saying what the samples hold instead.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::members::{IMAGE_FIELDS, LABEL_FIELDS, Members, Tally, hash_of};
use crate::dataset::{ClassInference, MAX_CLASSES, notice, plural};
use crate::error::{Error, Result};

/// A shard's first sample, to tell a copy of a shard: its key, the hash of its bytes and the
/// shard's length.
#[derive(PartialEq, Eq, Hash)]
struct ShardStart {
    key: String,
    bytes: u64,
    shard_len: u64,
}

/// Every sample's members, seen one shard after another ([`Survey::shard`], then
/// [`Survey::sample`] or [`Survey::unread`] for each of its samples).
pub(super) struct Survey {
    label_base: u32,
    inference: ClassInference,
    samples: usize,
    /// Samples with an image and a label the classes count.
    usable: usize,
    /// Samples whose members could not be parsed (unreadable).
    unparsed: usize,
    /// Samples the walk or the decompression found damaged, and the first's reason.
    damaged: Tally,
    /// Samples repeating their key in consecutive members.
    repeated: usize,
    no_label: Tally,
    no_image: Tally,
    not_integer: Tally,
    out_of_range: Tally,
    several_images: Tally,
    differing_labels: Tally,
    /// Samples whose key an earlier sample of their shard has (the walk counts them).
    key_again: Tally,
    /// The current shard.
    shard: PathBuf,
}

/// The label fields, dotted, for messages (`.cls, .class, .label, .target`).
fn label_fields() -> String {
    dotted(LABEL_FIELDS)
}

fn dotted(fields: &[&str]) -> String {
    fields
        .iter()
        .map(|f| format!(".{f}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The notices about how the set is laid out, given whether the classes are read or not: keys
/// met again later in their shard (each read as a sample of its own), and shards whose length
/// and first sample are another's (a copy, read twice). Returns the keys met again, for the
/// [`Survey`]'s refusal of a tar not grouped by sample.
pub(super) fn structure_notices(
    name: &Path,
    shards: &[super::Shard],
    notices: &mut Vec<String>,
) -> Tally {
    let samples: usize = shards.iter().map(|s| s.samples.len()).sum();
    let mut again = Tally::default();
    let mut starts: HashMap<ShardStart, &Path> = HashMap::new();
    let mut copies = Tally::default();
    for shard in shards {
        if let Some(first) = &shard.key_again.first {
            again.count += shard.key_again.count;
            again
                .first
                .get_or_insert_with(|| format!("{first} of {}", shard.path.display()));
        }
        // A shard whose first sample is another's, byte for byte, and of the other's length:
        // a copy. (Shards written one writer per worker all start with key "000000".) Read
        // through the map's guard, as the members are.
        let Some(mapped) = shard.data.get_if_resident() else {
            continue;
        };
        let Some(bytes) = shard
            .samples
            .first()
            .filter(|_| !shard.damaged.contains_key(&0))
            .and_then(|span| super::slice(mapped.bytes(), *span))
        else {
            continue;
        };
        let Ok(members) = super::members(bytes) else {
            continue;
        };
        if crate::mapguard::fault_in(bytes).is_err() {
            continue;
        }
        let start = ShardStart {
            key: members.key.clone(),
            bytes: hash_of(bytes),
            shard_len: mapped.bytes().len() as u64,
        };
        match starts.get(&start) {
            Some(other) => copies.add(|| {
                format!(
                    "{} and {}, both {} bytes starting with the same sample {:?}",
                    other.display(),
                    shard.path.display(),
                    start.shard_len,
                    start.key
                )
            }),
            None => {
                starts.insert(start, &shard.path);
            }
        }
    }
    let shown = name.display();
    if let Some(first) = &again.first {
        notice(
            notices,
            format!(
                "{shown}: {} of {samples} samples have a key met earlier in their shard, each \
                 read as a sample of its own (as the webdataset package reads them); a tar whose \
                 members are not grouped by sample is not read as its writer meant (the first, \
                 {first})",
                again.count
            ),
        );
    }
    if let Some(first) = &copies.first {
        notice(
            notices,
            format!(
                "{shown}: {} like a copy of another (the first, {first}): a copied shard's \
                 samples are read twice",
                plural(copies.count, "shard looks", "shards look")
            ),
        );
    }
    again
}

impl Survey {
    /// A survey of a set whose samples met `key_again` ([`structure_notices`]).
    pub(super) fn new(label_base: u32, key_again: Tally) -> Self {
        Survey {
            label_base,
            inference: ClassInference::default(),
            samples: 0,
            usable: 0,
            unparsed: 0,
            damaged: Tally::default(),
            repeated: 0,
            no_label: Tally::default(),
            no_image: Tally::default(),
            not_integer: Tally::default(),
            out_of_range: Tally::default(),
            several_images: Tally::default(),
            differing_labels: Tally::default(),
            key_again,
            shard: PathBuf::new(),
        }
    }

    /// The samples that follow are those of the shard at `path`.
    pub(super) fn shard(&mut self, path: &Path) {
        self.shard = path.to_path_buf();
    }

    /// A sample whose members could not be parsed (unreadable): a bad record when read,
    /// counted here only.
    pub(super) fn unread(&mut self) {
        self.samples += 1;
        self.unparsed += 1;
    }

    /// Sample `number` of the current shard, damaged for `reason` (its bytes, or its shard's
    /// compressed stream): a bad record when read, its notice already given.
    pub(super) fn damaged(&mut self, number: usize, reason: &str) {
        self.samples += 1;
        let shard = &self.shard;
        self.damaged
            .add(|| format!("{} sample {number}: {reason}", shard.display()));
    }

    /// Sample `number` of the current shard: its members.
    pub(super) fn sample(&mut self, number: usize, members: &Members<'_>) {
        self.samples += 1;
        let shard = &self.shard;
        let record = || format!("{} sample {number} ({})", shard.display(), members.key);
        if members.repeated.is_some() {
            self.repeated += 1;
            return;
        }
        let images = members.image_fields().count();
        if images > 1 {
            self.several_images.add(|| {
                let read = members.image_field().map_or("", |(field, _)| field);
                let fields: Vec<&str> = members.image_fields().collect();
                format!(
                    "{} holds .{}; .{read} is read",
                    record(),
                    fields.join(", .")
                )
            });
        }
        if let Some(differing) = members.differing_labels() {
            self.differing_labels
                .add(|| format!("{} holds {differing}", record()));
        }
        let label = match members.label() {
            Some(Ok(label)) => label,
            Some(Err(reason)) => {
                self.not_integer.add(|| format!("{}: {reason}", record()));
                return;
            }
            None => {
                self.no_label
                    .add(|| format!("{}, holding {}", record(), members.described()));
                return;
            }
        };
        let class = label.checked_sub(i64::from(self.label_base));
        let is_class = self.inference.see(record, class);
        if !is_class {
            self.out_of_range
                .add(|| format!("{} holds {label}", record()));
        }
        if images == 0 {
            self.no_image
                .add(|| format!("{}, holding {}", record(), members.described()));
        } else if is_class {
            self.usable += 1;
        }
    }

    /// The classes `0..=largest label`, and the notices. An error where samples there are but
    /// none holds both an image and a label the classes count, and where at least half of the
    /// keys come back later in their shard while fewer than half the samples are whole (a tar
    /// in the order a directory listing gave, one file at a time; a tar holding each whole
    /// sample twice is read, with a notice).
    pub(super) fn finish(self, name: &Path, notices: &mut Vec<String>) -> Result<Vec<String>> {
        let samples = self.samples;
        let again = self.key_again.count;
        let scattered = again * 2 >= samples.saturating_sub(again) && self.usable * 2 < samples;
        if samples > 0 && (self.usable == 0 || scattered) {
            return Err(Error::not_a_dataset(name, self.nothing_to_read()));
        }
        let shown = name.display();
        let said = [
            (
                &self.several_images,
                format!(
                    "hold more than one image; one is read: a field named exactly {} (the first \
                     of them in that order), else the first in the tar whose name ends in one",
                    dotted(IMAGE_FIELDS)
                ),
            ),
            (
                &self.differing_labels,
                format!(
                    "hold label fields that differ; the first of {} is read",
                    label_fields()
                ),
            ),
            (
                &self.not_integer,
                "hold a label that is no integer class number: bad records when read".into(),
            ),
            (
                &self.no_label,
                "hold no label field: bad records when read".into(),
            ),
            (
                &self.no_image,
                "hold a label and no image: bad records when read".into(),
            ),
        ];
        for (tally, what) in said {
            if let Some(first) = &tally.first {
                notice(
                    notices,
                    format!(
                        "{shown}: {} of {samples} samples {what} (the first, {first})",
                        tally.count,
                    ),
                );
            }
        }
        let (classes, notice_text) = self.inference.classes();
        notices.extend(notice_text);
        Ok(classes)
    }

    /// Why the set cannot be read: what its samples hold instead.
    fn nothing_to_read(&self) -> String {
        let mut parts = Vec::new();
        if self.repeated > 0 {
            parts.push(format!(
                "{} repeat their key in consecutive members (two .jpg under one key: which image \
                 goes with which label is unknown)",
                self.repeated
            ));
        }
        let counts = [
            (
                &self.no_label,
                format!("have no label field ({})", label_fields()),
            ),
            (
                &self.not_integer,
                "hold a label that is no integer class number".into(),
            ),
            (
                &self.out_of_range,
                format!(
                    "hold a label outside {}..{}",
                    self.label_base,
                    i64::from(self.label_base) + MAX_CLASSES as i64
                ),
            ),
            (&self.no_image, "hold a label and no image".into()),
            (
                &self.key_again,
                "have a key met earlier in their shard".into(),
            ),
        ];
        for (tally, what) in counts {
            if let Some(first) = &tally.first {
                parts.push(format!("{} {what} (the first, {first})", tally.count));
            }
        }
        if let Some(first) = &self.damaged.first {
            parts.push(format!(
                "{} are damaged (the first, {first})",
                self.damaged.count
            ));
        }
        if self.unparsed > 0 {
            parts.push(format!("{} could not be parsed", self.unparsed));
        }
        let mut reason = format!(
            "{}: of {} samples, {}",
            if self.usable == 0 {
                format!(
                    "no sample has both an image and a label (an integer in {}..{} in {}); \
                     imagefeed reads labelled image samples",
                    self.label_base,
                    i64::from(self.label_base) + MAX_CLASSES as i64,
                    label_fields()
                )
            } else {
                format!(
                    "only {} of the samples have both an image and a label",
                    self.usable
                )
            },
            self.samples,
            parts.join("; ")
        );
        if self.key_again.count > 0 {
            reason.push_str(
                ". Keys met again later in their shard mean a tar whose members are not grouped \
                 by sample (all images, then all labels; or a directory's listing order), where \
                 WebDataset needs each sample's members one after another: write it with \
                 `tar --sort=name` or the webdataset package's TarWriter",
            );
        }
        reason
    }
}
