//! Checking a dataset: `pack-dataset verify DATASET [--against SRC_DIR]`.
//!
//! Without a source, every record must read and decode. With `--against`, the dataset must also
//! be exactly what packing the source produces:
//! - the same classes, in the same order;
//! - every record's key names a source file, with the source's label, in source order;
//! - payloads equal the source: byte for byte for stored files; pixel for pixel (after the same
//!   pack-time resize) for raw datasets and for JPEGs rewritten with restart markers; for re-encoded (resized) JPEGs, the resized size;
//! - every source file is in the dataset, unless it is not a decodable image (those were
//!   rejected when packing, and are counted separately).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;

use crate::dataset::{Dataset, PayloadKind, par_map_chunks};
use crate::decode::{Decoder, RawImage};
use crate::error::Result;
use crate::format::{self, folder::ImageFolder};
use crate::resize::{RgbResizer, short_side_size};

/// One thing wrong with a dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// Record index, when the problem is about a record.
    pub index: Option<usize>,
    /// Record key or source path (relative), or `classes`.
    pub key: String,
    /// Which kind of problem it is.
    pub kind: ProblemKind,
    /// What is wrong.
    pub problem: String,
}

/// The kinds of [`Problem`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProblemKind {
    /// The record could not be read (damaged, or the disk failed).
    Unreadable,
    /// The record reads, but its image does not decode.
    Undecodable,
    /// The dataset differs from its source tree (`--against`): a record's bytes, size, pixels
    /// or label, the classes, the order, or a source file missing.
    Mismatch,
}

/// The result of [`verify`].
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// The dataset checked.
    #[serde(serialize_with = "crate::file::serialize_lossy")]
    pub dataset: PathBuf,
    /// The source it was compared with.
    #[serde(serialize_with = "crate::file::serialize_lossy_option")]
    pub against: Option<PathBuf>,
    /// Records checked.
    pub checked: usize,
    /// Source files that are not decodable images (expected to be absent from the dataset).
    pub source_rejects: usize,
    /// What is wrong: the first [`LISTED_PROBLEMS`] problems of records, by record, then the
    /// first [`LISTED_PROBLEMS`] of the dataset as a whole (source files missing from it, its
    /// classes, empty shards); empty when the dataset is good.
    pub problems: Vec<Problem>,
    /// How many problems were found in all.
    pub problem_count: usize,
}

impl VerifyReport {
    /// True when nothing is wrong.
    pub fn is_ok(&self) -> bool {
        self.problem_count == 0
    }
}

/// How many problems a [`VerifyReport`] lists; it counts them all
/// ([`VerifyReport::problem_count`]). A dataset packed with the wrong options can have a
/// problem in every one of millions of records.
pub const LISTED_PROBLEMS: usize = 1000;

/// The problems found so far: the first [`LISTED_PROBLEMS`] of records and of the dataset as a
/// whole (a list full of records' problems would leave out a source file missing), and how
/// many in all.
#[derive(Default)]
struct Found {
    of_records: Vec<Problem>,
    of_dataset: Vec<Problem>,
    count: usize,
}

impl Found {
    fn push(&mut self, problem: Problem) {
        self.count += 1;
        let listed = match problem.index {
            Some(_) => &mut self.of_records,
            None => &mut self.of_dataset,
        };
        if listed.len() < LISTED_PROBLEMS {
            listed.push(problem);
        }
    }
}

/// Verifies the dataset at `path`, optionally against the ImageFolder tree it was packed from.
/// Returns `Err` only when the dataset or source cannot be opened at all; everything found inside
/// them is a [`Problem`] in the report.
pub fn verify(path: impl AsRef<Path>, against: Option<&Path>) -> Result<VerifyReport> {
    verify_with(path, against, &format::OpenOptions::default())
}

/// [`verify`] with reading options (files other tools wrote, shard sets).
pub fn verify_with(
    path: impl AsRef<Path>,
    against: Option<&Path>,
    options: &format::OpenOptions,
) -> Result<VerifyReport> {
    let path = path.as_ref();
    let dataset = format::open_with(path, options)?;
    verify_dataset(path, dataset.as_ref(), against)
}

/// [`verify`] for a list of shard files read as one dataset ([`format::open_files`]).
pub fn verify_files(
    files: &[PathBuf],
    against: Option<&Path>,
    options: &format::OpenOptions,
) -> Result<VerifyReport> {
    let dataset = format::open_files(files, options)?;
    let label = files.first().map_or(Path::new(""), PathBuf::as_path);
    verify_dataset(label, dataset.as_ref(), against)
}

/// Checks an opened dataset; `path` names it in the report.
fn verify_dataset(
    path: &Path,
    dataset: &dyn Dataset,
    against: Option<&Path>,
) -> Result<VerifyReport> {
    let source = against.map(ImageFolder::open).transpose()?;
    let mut problems = Found::default();
    // Records that are not there cannot fail a check: a member of a shard set holding none
    // while the others hold some (a copy cut short, a file never written) is a problem of its
    // own, as `inspect` calls such a set incomplete.
    let empty = dataset.suspect_empty_shards();
    if empty > 0 {
        problems.push(Problem {
            index: None,
            key: "shards".into(),
            kind: ProblemKind::Unreadable,
            problem: format!(
                "{empty} member(s) of the shard set hold no sample while the others do (a \
                 copy cut short, or a file never written): `inspect` names them"
            ),
        });
    }
    if let Some(source) = &source
        && source.classes() != dataset.classes()
    {
        problems.push(Problem {
            index: None,
            key: "classes".into(),
            kind: ProblemKind::Mismatch,
            problem: format!(
                "dataset has classes {:?}, source has {:?}",
                dataset.classes(),
                source.classes()
            ),
        });
    }
    let by_key: HashMap<&str, usize> = source
        .as_ref()
        .map(|s| {
            s.entries()
                .iter()
                .enumerate()
                .map(|(i, e)| (e.key.as_str(), i))
                .collect()
        })
        .unwrap_or_default();
    let checker = Checker {
        dataset,
        source: source.as_ref(),
        by_key: &by_key,
    };

    // A parallel pass: read, decode, compare. Each result: (source index, problems).
    let mut last_source_index = None;
    let mut in_dataset = vec![false; source.as_ref().map_or(0, |s| s.len())];
    par_map_chunks(
        dataset,
        |decoder, record| checker.check(decoder, record),
        |first, results| {
            for (index, (source_index, found)) in (first..).zip(results) {
                for mut problem in found {
                    problem.index = Some(index);
                    problems.push(problem);
                }
                if let Some(si) = source_index {
                    in_dataset[si] = true;
                    if last_source_index.is_some_and(|last| si <= last) {
                        problems.push(Problem {
                            index: Some(index),
                            kind: ProblemKind::Mismatch,
                            key: source.as_ref().expect("source set").entries()[si]
                                .key
                                .clone(),
                            problem: "out of source order (ImageFolder order differs)".into(),
                        });
                    }
                    last_source_index = Some(si);
                }
            }
        },
    );

    // Source files absent from the dataset must be ones packing rejects.
    let mut source_rejects = 0;
    if let Some(source) = &source {
        let missing: Vec<usize> = (0..source.len()).filter(|&i| !in_dataset[i]).collect();
        let decodable: Vec<bool> = missing
            .par_iter()
            .map_init(Decoder::new, |decoder, &i| {
                let mut bytes = Vec::new();
                source.read_file(i, &mut bytes).is_ok()
                    && decoder.decode_rgb(&bytes, &mut Vec::new()).is_ok()
            })
            .collect();
        for (&i, ok) in missing.iter().zip(decodable) {
            if ok {
                problems.push(Problem {
                    index: None,
                    kind: ProblemKind::Mismatch,
                    key: source.entries()[i].key.clone(),
                    problem: "decodable source file is missing from the dataset".into(),
                });
            } else {
                source_rejects += 1;
            }
        }
    }
    let Found {
        of_records: mut problems,
        of_dataset,
        count: problem_count,
    } = problems;
    problems.sort_by_key(|p| p.index);
    problems.extend(of_dataset);
    Ok(VerifyReport {
        dataset: path.to_path_buf(),
        against: against.map(Path::to_path_buf),
        checked: dataset.len(),
        source_rejects,
        problems,
        problem_count,
    })
}

struct Checker<'a> {
    dataset: &'a dyn Dataset,
    source: Option<&'a ImageFolder>,
    by_key: &'a HashMap<&'a str, usize>,
}

impl Checker<'_> {
    fn check(
        &self,
        decoder: &mut Decoder,
        record: std::result::Result<crate::Record<'_>, crate::dataset::UnreadRecord>,
    ) -> (Option<usize>, Vec<Problem>) {
        let problem = |key: &str, problem: String| Problem {
            index: None,
            key: key.to_string(),
            kind: ProblemKind::Mismatch,
            problem,
        };
        let of_kind = |kind, p: Problem| Problem { kind, ..p };
        let record = match record {
            Ok(r) => r,
            Err(unread) => {
                let p = problem(&unread.key, unread.message);
                return (None, vec![of_kind(ProblemKind::Unreadable, p)]);
            }
        };
        let mut problems = Vec::new();
        let mut pixels = Vec::new();
        let header = match decoder.decode_rgb(record.payload, &mut pixels) {
            Ok(h) => h,
            Err(e) => {
                return (
                    None,
                    vec![of_kind(
                        ProblemKind::Undecodable,
                        problem(record.key, format!("payload does not decode: {e}")),
                    )],
                );
            }
        };
        let Some(source) = self.source else {
            return (None, problems);
        };
        let Some(&si) = self.by_key.get(record.key) else {
            return (
                None,
                vec![problem(
                    record.key,
                    "no such file in the source tree".into(),
                )],
            );
        };
        let expected_label = source.entries()[si].label;
        if record.label != expected_label {
            problems.push(problem(
                record.key,
                format!(
                    "label {} but the source's class gives {expected_label}",
                    record.label
                ),
            ));
        }
        let mut src_bytes = Vec::new();
        if let Err(e) = source.read_file(si, &mut src_bytes) {
            problems.push(problem(record.key, format!("cannot read source: {e}")));
            return (Some(si), problems);
        }
        let stored = (header.width, header.height);
        if let Some(reason) = self.against_source(decoder, &record, stored, &pixels, &src_bytes) {
            problems.push(problem(record.key, reason));
        }
        (Some(si), problems)
    }

    /// Why a record that decodes (to `stored` size and `pixels`) does not hold what its source
    /// file (`src_bytes`) should have become, if it does not: the same bytes when stored as
    /// packed, else the same size and, where the pack kept the pixels, the same pixels.
    fn against_source(
        &self,
        decoder: &mut Decoder,
        record: &crate::Record<'_>,
        (width, height): (u32, u32),
        pixels: &[u8],
        src_bytes: &[u8],
    ) -> Option<String> {
        let info = self.dataset.info();
        let resize = info.resized_short_side;
        match (info.payload, resize) {
            // Stored as packed; JPEGs rewritten with restart markers hold other bytes, the same
            // pixels, and are compared below.
            (PayloadKind::Encoded, None) if !info.restart_markers => {
                if record.payload != src_bytes {
                    return Some(format!(
                        "payload ({} bytes) differs from the source file ({} bytes)",
                        record.payload.len(),
                        src_bytes.len()
                    ));
                }
            }
            (payload, _) => {
                let mut src_rgb = Vec::new();
                let src = match decoder.decode_rgb(src_bytes, &mut src_rgb) {
                    Ok(h) => h,
                    Err(e) => return Some(format!("source does not decode: {e}")),
                };
                let (ew, eh) = match resize {
                    Some(s) if src.width.min(src.height) > s => {
                        short_side_size(src.width, src.height, s)
                    }
                    _ => (src.width, src.height),
                };
                if (width, height) != (ew, eh) {
                    return Some(format!("stored {width}x{height}, expected {ew}x{eh}"));
                } else if payload == PayloadKind::RawRgb8 {
                    let expected = if (ew, eh) == (src.width, src.height) {
                        src_rgb
                    } else {
                        let mut out = vec![0; ew as usize * eh as usize * 3];
                        RgbResizer::new().resize(&src_rgb, src.width, src.height, &mut out, ew, eh);
                        out
                    };
                    if RawImage::parse(record.payload).map(|(_, _, p)| p) != Ok(expected.as_slice())
                    {
                        return Some("raw pixels differ from the decoded source".into());
                    }
                } else if info.restart_markers {
                    // Kept at its size and rewritten losslessly (the same pixels), or resized:
                    // the pixels tell only for the former.
                    if (ew, eh) == (src.width, src.height) && src_rgb != pixels {
                        return Some(
                            "pixels differ from the (unresized) source's; the restart-marker \
                             rewrite is lossless"
                                .into(),
                        );
                    }
                } else if (ew, eh) == (src.width, src.height) && record.payload != src_bytes {
                    return Some("payload differs from the (unresized) source file".into());
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_full_of_records_problems_still_lists_the_datasets() {
        let problem = |index| Problem {
            index,
            key: "k".into(),
            kind: ProblemKind::Mismatch,
            problem: "p".into(),
        };
        let mut found = Found::default();
        for index in 0..LISTED_PROBLEMS + 500 {
            found.push(problem(Some(index)));
        }
        for _ in 0..3 {
            found.push(problem(None));
        }
        assert_eq!(found.count, LISTED_PROBLEMS + 503);
        assert_eq!(found.of_records.len(), LISTED_PROBLEMS);
        assert_eq!(
            found.of_records.last().unwrap().index,
            Some(LISTED_PROBLEMS - 1)
        );
        assert_eq!(found.of_dataset.len(), 3);
    }
}
