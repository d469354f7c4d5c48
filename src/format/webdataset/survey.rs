//! What the open learns from every sample's members when it reads their labels for the classes
//! (`--num-classes` skips it): the classes, the ways the set is read that its user should hear
//! of (a second image beside the one read, label fields that disagree, labels that are no
//! integer, a key met again later in its shard, two shards starting with one key), and the
//! refusal of a set in which no sample holds both an image and a label, saying what the samples
//! hold instead.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::members::{IMAGE_FIELDS, LABEL_FIELDS, Members};
use crate::dataset::{ClassInference, MAX_CLASSES, notice};
use crate::error::{Error, Result};

/// How many samples showed a trait, and the first of them, described.
#[derive(Default)]
struct Tally {
    count: usize,
    first: Option<String>,
}

impl Tally {
    fn add(&mut self, first: impl FnOnce() -> String) {
        self.count += 1;
        if self.first.is_none() {
            self.first = Some(first());
        }
    }
}

/// Every sample's members, seen one shard after another ([`Survey::shard`], then
/// [`Survey::sample`] or [`Survey::unread`] for each of its samples).
pub(super) struct Survey {
    label_base: u32,
    inference: ClassInference,
    samples: usize,
    /// Samples with an image and a label the classes count.
    usable: usize,
    repeated: Tally,
    no_label: Tally,
    no_image: Tally,
    not_integer: Tally,
    out_of_range: Tally,
    several_images: Tally,
    differing_labels: Tally,
    key_again: Tally,
    /// The current shard, and where in it each key was first met.
    shard: PathBuf,
    keys: HashMap<String, usize>,
    /// Each shard's first key, and the shard.
    first_keys: HashMap<String, PathBuf>,
    same_start: Tally,
}

impl Survey {
    pub(super) fn new(label_base: u32) -> Self {
        Survey {
            label_base,
            inference: ClassInference::default(),
            samples: 0,
            usable: 0,
            repeated: Tally::default(),
            no_label: Tally::default(),
            no_image: Tally::default(),
            not_integer: Tally::default(),
            out_of_range: Tally::default(),
            several_images: Tally::default(),
            differing_labels: Tally::default(),
            key_again: Tally::default(),
            shard: PathBuf::new(),
            keys: HashMap::new(),
            first_keys: HashMap::new(),
            same_start: Tally::default(),
        }
    }

    /// The samples that follow are the shard at `path`'s.
    pub(super) fn shard(&mut self, path: &Path) {
        self.shard = path.to_path_buf();
        self.keys.clear();
    }

    /// A sample whose members could not be parsed (damaged, unreadable): a bad record when
    /// read, counted here only.
    pub(super) fn unread(&mut self) {
        self.samples += 1;
    }

    /// Sample `number` of the current shard.
    pub(super) fn sample(&mut self, number: usize, members: &Members<'_>) {
        self.samples += 1;
        let shard = &self.shard;
        let record = || format!("{} sample {number} ({})", shard.display(), members.key);
        if let Some(earlier) = self.keys.get(&members.key) {
            self.key_again.add(|| {
                format!(
                    "{:?}, samples {earlier} and {number} of {}",
                    members.key,
                    shard.display()
                )
            });
        } else {
            if self.keys.is_empty() {
                match self.first_keys.get(&members.key) {
                    Some(other) => self.same_start.add(|| {
                        format!(
                            "{} and {} both start with {:?}",
                            other.display(),
                            shard.display(),
                            members.key
                        )
                    }),
                    None => {
                        self.first_keys.insert(members.key.clone(), shard.clone());
                    }
                }
            }
            self.keys.insert(members.key.clone(), number);
        }
        if members.repeated.is_some() {
            self.repeated.add(record);
            return;
        }
        let images: Vec<&str> = members.image_fields().collect();
        if images.len() > 1 {
            self.several_images.add(|| {
                let read = members.image_field().map_or("", |(field, _)| field);
                format!(
                    "{} holds .{}; .{read} is read",
                    record(),
                    images.join(", .")
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
        if !class.is_some_and(|c| (0..MAX_CLASSES as i64).contains(&c)) {
            self.out_of_range
                .add(|| format!("{} holds {label}", record()));
        }
        self.inference.see(record, class);
        if images.is_empty() {
            self.no_image
                .add(|| format!("{}, holding {}", record(), members.described()));
        } else if class.is_some_and(|c| (0..MAX_CLASSES as i64).contains(&c)) {
            self.usable += 1;
        }
    }

    /// The classes `0..=largest label`, and the notices; an error when samples there are but
    /// none holds both an image and a label the classes count.
    pub(super) fn finish(self, name: &Path, notices: &mut Vec<String>) -> Result<Vec<String>> {
        let samples = self.samples;
        if samples > 0 && self.usable == 0 {
            return Err(Error::not_a_dataset(name, self.nothing_to_read()));
        }
        let shown = name.display();
        let said = [
            (
                &self.several_images,
                format!(
                    "hold more than one image; each sample's one image is read (the first of \
                     .{}), the others are not",
                    IMAGE_FIELDS.join(", .")
                ),
            ),
            (
                &self.differing_labels,
                "hold label fields that differ; the first of .cls, .class, .label, .target is \
                 read"
                    .to_string(),
            ),
            (
                &self.not_integer,
                "hold a label that is not an integer; they are bad records when read".into(),
            ),
            (
                &self.no_label,
                "hold no label field; they are bad records when read".into(),
            ),
            (
                &self.no_image,
                "hold a label and no image; they are bad records when read".into(),
            ),
            (
                &self.key_again,
                "have a key met earlier in their shard, each read as a sample of its own (the \
                 webdataset package reads them so too); a tar whose members are not grouped by \
                 sample is not read as its writer meant"
                    .into(),
            ),
        ];
        for (tally, what) in said {
            if let Some(first) = &tally.first {
                notice(
                    notices,
                    format!(
                        "{shown}: {} of {samples} samples {what} (the first, {first})",
                        tally.count
                    ),
                );
            }
        }
        if let Some(first) = &self.same_start.first {
            notice(
                notices,
                format!(
                    "{shown}: {} shard(s) start with the key another starts with ({first}): a \
                     copy of a shard would be read twice",
                    self.same_start.count
                ),
            );
        }
        let (classes, notice_text) = self.inference.classes();
        notices.extend(notice_text);
        Ok(classes)
    }

    /// Why no sample can be read: what the samples hold instead.
    fn nothing_to_read(&self) -> String {
        let samples = self.samples;
        let labels = LABEL_FIELDS
            .iter()
            .map(|f| format!(".{f}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut parts = Vec::new();
        if self.repeated.count > 0 {
            parts.push(format!(
                "{} repeat their key in consecutive members (two .jpg under one key: which image \
                 goes with which label is unknown)",
                self.repeated.count
            ));
        }
        let counted = [
            (&self.no_label, format!("have no label field ({labels})")),
            (
                &self.not_integer,
                "hold a label that is not an integer".into(),
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
        ];
        for (tally, what) in counted {
            if let Some(first) = &tally.first {
                parts.push(format!("{} {what} (the first, {first})", tally.count));
            }
        }
        if let Some(first) = &self.key_again.first {
            parts.push(format!(
                "keys are met again later in their shard (the first, {first}): a tar whose \
                 members are not grouped by sample (all images, then all labels), where \
                 WebDataset needs each sample's members one after another"
            ));
        }
        format!(
            "no sample has both an image and a label (an integer in {}..{} in {labels}); \
             imagefeed reads labelled image samples. Of {samples} samples, {}",
            self.label_base,
            i64::from(self.label_base) + MAX_CLASSES as i64,
            if parts.is_empty() {
                "none could be read".to_string()
            } else {
                parts.join("; ")
            }
        )
    }
}
