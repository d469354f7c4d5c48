//! The parts of a split conversion (`pack-dataset --num-parts N --part-index i`), checked to
//! belong together and read as one dataset: what `pack::join` copies into a single
//! output.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dataset::{Dataset, DatasetInfo, LazyReader, PartInfo, Record, RecordReader};
use crate::error::{Error, Result};

/// The parts of a split conversion, checked to belong together and read as one dataset.
pub struct JoinedParts {
    parts: Vec<Arc<dyn Dataset>>,
    /// Index of each part's first record; a final entry holds the total.
    starts: Vec<usize>,
    info: DatasetInfo,
    path: PathBuf,
    notices: Vec<String>,
}

impl JoinedParts {
    /// Opens `paths` (in any order) and checks that they are all the parts of one split
    /// conversion: each part exactly once, the same source fingerprint, classes and payload.
    pub fn open(paths: &[PathBuf]) -> Result<JoinedParts> {
        let first = paths.first().ok_or_else(|| {
            Error::Config("join needs the parts of a split conversion; none were given".into())
        })?;
        let mut parts: Vec<(PartInfo, Arc<dyn Dataset>)> = Vec::new();
        for path in paths {
            let dataset = crate::format::open(path)?;
            let part = dataset.info().part.clone().ok_or_else(|| {
                Error::not_a_dataset(
                    path,
                    "not a part of a split conversion (packed without --num-parts/--part-index)",
                )
            })?;
            // Written by pack-dataset, which never splits into more parts than files; numbers
            // past that are damage (a hostile file's count of 10^12 had the check below
            // allocate 8 TB and abort).
            if part.index >= part.count || part.count > part.source_items {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "its metadata says it is part {} of {} of a listing of {} items, which \
                         no split conversion writes (damaged?)",
                        part.index, part.count, part.source_items
                    ),
                ));
            }
            // Each item of its range is one sample or one rejected file: a part holding
            // otherwise lost samples, or says it rejected what it never had (a hostile part's
            // `rejected_at_pack` of u64::MAX overflowed the join's sum).
            let range = PartInfo::range(part.source_items, part.index, part.count).len();
            let rejected = dataset.info().rejected_at_pack.unwrap_or(0);
            if dataset.len().checked_add(rejected) != Some(range) {
                return Err(Error::not_a_dataset(
                    path,
                    format!(
                        "it holds {} samples and says it rejected {rejected} files, where its \
                         part of the listing has {range}: not as the split conversion left it",
                        dataset.len()
                    ),
                ));
            }
            parts.push((part, dataset));
        }
        parts.sort_by_key(|(part, _)| part.index);
        let (reference, reference_set) = (&parts[0].0, &parts[0].1);
        // The parts are readable, only not of one conversion: which parts to join is the
        // caller's choice, as a part given twice is.
        let mismatch = |path: &Path, what: &str| {
            Err(Error::Config(format!(
                "cannot join {} with {}: {what} differs: parts of different conversions",
                path.display(),
                reference_set.path().display()
            )))
        };
        for (part, dataset) in &parts[1..] {
            let path = dataset.path();
            if part.source_fingerprint != reference.source_fingerprint
                || part.count != reference.count
            {
                return mismatch(path, "the source listing or the number of parts");
            }
            if dataset.classes() != reference_set.classes() {
                return mismatch(path, "the class list");
            }
            if dataset.info().payload != reference_set.info().payload
                || dataset.info().resized_short_side != reference_set.info().resized_short_side
                || dataset.info().restart_markers != reference_set.info().restart_markers
            {
                return mismatch(path, "the payload kind (--raw/--resize/--restart-markers)");
            }
            if part.quality != reference.quality {
                return mismatch(
                    path,
                    "the JPEG quality images were re-encoded at (--quality)",
                );
            }
        }
        // Sorted: parts 0..count exactly once is each index at its own position.
        let have: Vec<usize> = parts.iter().map(|(p, _)| p.index).collect();
        if have.len() != reference.count || have.iter().enumerate().any(|(i, &p)| i != p) {
            let mut given = have.clone();
            given.dedup();
            // The first few gaps, without listing all of 0..count (any count a file can say).
            let mut missing = Vec::new();
            let mut next = 0;
            for &index in given.iter().chain(std::iter::once(&reference.count)) {
                missing.extend(
                    (next..index)
                        .take(10 - missing.len())
                        .map(|i| i.to_string()),
                );
                next = index + 1;
            }
            let dupes: Vec<String> = have
                .windows(2)
                .filter(|w| w[0] == w[1])
                .map(|w| w[0].to_string())
                .collect();
            return Err(Error::Config(format!(
                "join needs parts 0..{} exactly once; missing: [{}], given twice: [{}]",
                reference.count,
                crate::dataset::missing_list(&missing, (reference.count - given.len()) as u64),
                dupes.join(", ")
            )));
        }
        let mut starts = vec![0];
        for (_, dataset) in &parts {
            starts.push(starts.last().expect("non-empty") + dataset.len());
        }
        let mut info = reference_set.info().clone();
        info.num_samples = *starts.last().expect("non-empty");
        info.part = None;
        info.rejected_at_pack = Some(
            parts
                .iter()
                .map(|(_, d)| d.info().rejected_at_pack.unwrap_or(0))
                .sum(),
        );
        let notices = parts
            .iter()
            .flat_map(|(_, d)| d.notices().iter().cloned())
            .collect();
        Ok(JoinedParts {
            notices,
            parts: parts.into_iter().map(|(_, d)| d).collect(),
            starts,
            info,
            path: first.clone(),
        })
    }
}

impl JoinedParts {
    /// The parts, in part order.
    pub fn parts(&self) -> &[Arc<dyn Dataset>] {
        &self.parts
    }
}

impl Dataset for JoinedParts {
    fn info(&self) -> &DatasetInfo {
        &self.info
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn notices(&self) -> &[String] {
        &self.notices
    }

    fn open_reader(&self) -> Result<Box<dyn RecordReader>> {
        Ok(Box::new(JoinedReader {
            readers: self
                .parts
                .iter()
                .map(|p| LazyReader::new(Arc::clone(p)))
                .collect(),
            starts: self.starts.clone(),
        }))
    }
}

struct JoinedReader {
    readers: Vec<LazyReader>,
    starts: Vec<usize>,
}

impl RecordReader for JoinedReader {
    fn read(&mut self, index: usize) -> Result<Record<'_>> {
        let part = self.starts.partition_point(|&s| s <= index) - 1;
        let mut record = self.readers[part].read(index - self.starts[part])?;
        record.index = index;
        Ok(record)
    }

    /// Passes each part the records of its own, in order (numbered within the part).
    fn plan_reads(&mut self, indices: &[usize]) {
        for (part, reader) in self.readers.iter_mut().enumerate() {
            let (start, end) = (self.starts[part], self.starts[part + 1]);
            let own: Vec<usize> = indices
                .iter()
                .filter(|&&i| i >= start && i < end)
                .map(|&i| i - start)
                .collect();
            if !own.is_empty() {
                reader.plan_reads(&own);
            }
        }
    }

    /// Every part opened so far says so (parts open as they are first read; a batch that
    /// opens one that does not say so is the last one read twice).
    fn rereads_are_cheap(&self) -> bool {
        self.readers
            .iter()
            .filter(|r| r.is_open())
            .all(LazyReader::rereads_are_cheap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{NoProgress, PackFormat, PackOptions, Part, pack_image_folder};
    use crate::synthetic::{SyntheticSpec, write_image_folder};

    #[test]
    fn the_parts_read_as_one_dataset_with_batches_announced_across_them() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let spec = SyntheticSpec {
            classes: 2,
            per_class: 7,
            width: 16,
            height: 16,
            ..SyntheticSpec::default()
        };
        write_image_folder(&src, &spec).unwrap();
        let parts: Vec<PathBuf> = (0..3)
            .map(|index| {
                let out = dir.path().join(format!("part{index}.records"));
                let options = PackOptions::default().with_part(Some(Part { index, count: 3 }));
                pack_image_folder(&src, &out, PackFormat::Records, &options, &NoProgress).unwrap();
                out
            })
            .collect();
        let joined = JoinedParts::open(&parts).unwrap();
        assert_eq!(joined.len(), 14);
        let payloads = |plan: &[usize]| -> Vec<(u32, Vec<u8>)> {
            let mut reader = joined.open_reader().unwrap();
            // (A hint, with records of every part, past the end and repeated: changes nothing.)
            reader.plan_reads(plan);
            (0..joined.len())
                .map(|i| {
                    let record = reader.read(i).unwrap();
                    assert_eq!(record.index, i);
                    (record.label, record.payload.to_vec())
                })
                .collect()
        };
        let plain = payloads(&[]);
        assert_eq!(payloads(&[13, 0, 5, 9, 14, 99, 5, usize::MAX]), plain);
        // Each part's records, in order, as the part itself reads them.
        let mut from_parts = Vec::new();
        for part in &joined.parts {
            let mut reader = part.open_reader().unwrap();
            for i in 0..part.len() {
                let record = reader.read(i).unwrap();
                from_parts.push((record.label, record.payload.to_vec()));
            }
        }
        assert_eq!(from_parts.len(), plain.len());
        let (mut a, mut b) = (from_parts, plain);
        a.sort();
        b.sort();
        assert_eq!(a, b);
    }
}
