//! The HDF5 writer ([`Hdf5Writer`]): payloads and an index staged in `OUT.partial/`, one
//! sequential pass into the HDF5 file at the end (the layout and why are in the parent module).

use std::fs;
use std::io::{BufReader, Read as _};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use hdf5::types::VarLenUnicode;
use serde::{Deserialize, Serialize};

use super::gate::{self, Gated};
use super::{
    CHECKSUMS, CLASSES_ATTR, IMAGES, INFO_ATTR, KEYS, LABELS, MAGIC, OFFSETS, STAGED_HDF5,
    STAGED_INDEX, STAGED_PAYLOADS, STAGED_PROGRESS, VERSION,
};
use crate::dataset::DatasetInfo;
use crate::error::{Error, IoContext as _, Result};
use crate::format::InfoRecord;
use crate::format::staging;
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, PackedRecord, WriterOptions};

/// Bytes copied per HDF5 write when the staged payloads are moved into the file.
const COPY_BLOCK: usize = 32 << 20;

/// What `OUT.partial/progress.json` holds: enough to resume, and the staged files' lengths at
/// the last commit (anything past them is a chunk that was in flight and is discarded).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct StagedProgress {
    magic: String,
    plan: PackPlan,
    progress: PackProgress,
    payload_bytes: u64,
    index_bytes: u64,
}

/// Writes an HDF5 dataset: stages chunks in `OUT.partial/`, then writes `OUT` in one pass.
pub struct Hdf5Writer {
    partial: PathBuf,
    /// Held while writing: see [`staging::lock_staging`].
    _lock: fs::File,
    out: PathBuf,
    plan: PackPlan,
    payloads: fs::File,
    index: fs::File,
    payload_bytes: u64,
    index_bytes: u64,
}

impl Hdf5Writer {
    fn save_progress(&mut self, progress: &PackProgress) -> Result<()> {
        save_staged_progress(
            &self.partial,
            &self.plan,
            progress,
            self.payload_bytes,
            self.index_bytes,
        )
    }

    /// Writes the final HDF5 file from the staged data.
    fn write_hdf5(&self, path: &Path, info: &DatasetInfo) -> Result<()> {
        let h5 = |doing: &str| {
            let doing = doing.to_string();
            move |e: hdf5::Error| gate::error(path, &doing, e)
        };
        // Read the staged index back: (payload end, label, key) per sample.
        let mut index_bytes = Vec::with_capacity(self.index_bytes as usize);
        let index_path = self.partial.join(STAGED_INDEX);
        (&self.index)
            .read_to_end(&mut index_bytes)
            .at(&index_path)?;
        let (ends, labels, keys) =
            parse_staged_index(&index_bytes).map_err(|reason| Error::Incomplete {
                path: index_path.clone(),
                reason,
            })?;
        if keys.len() != info.num_samples {
            return Err(Error::Incomplete {
                path: index_path,
                reason: format!(
                    "{} samples staged but {} were committed",
                    keys.len(),
                    info.num_samples
                ),
            });
        }
        let mut offsets = Vec::with_capacity(ends.len() + 1);
        offsets.push(0u64);
        offsets.extend_from_slice(&ends);

        // Every library call runs inside the HDF5 gate (see `gate`); the payloads are copied
        // one block per entry, so a fork elsewhere in the process waits for one block at most.
        let file = gate::run(|| {
            hdf5::File::with_options()
                .with_fapl(|fapl| fapl.file_locking(false))
                .create(path)
                .map(Gated::new)
                .map_err(h5("creating the file"))
        })?;
        let images = file.with(|file| {
            file.new_dataset::<u8>()
                .no_chunk()
                .shape(self.payload_bytes as usize)
                .create(IMAGES)
                .map(Gated::new)
                .map_err(h5("creating the images dataset"))
        })?;
        let staged_path = self.partial.join(STAGED_PAYLOADS);
        let mut staged = BufReader::with_capacity(1 << 20, &self.payloads);
        use std::io::Seek as _;
        staged.seek(std::io::SeekFrom::Start(0)).at(&staged_path)?;
        let mut block = vec![0u8; COPY_BLOCK];
        let mut done = 0usize;
        let mut checksums = RecordChecksums::new(&offsets, &labels, &keys);
        while (done as u64) < self.payload_bytes {
            let n = COPY_BLOCK.min(self.payload_bytes as usize - done);
            staged.read_exact(&mut block[..n]).at(&staged_path)?;
            checksums.update(done as u64, &block[..n]);
            images.with(|images| {
                images
                    .write_slice(&block[..n], done..done + n)
                    .map_err(h5("writing the images dataset"))
            })?;
            done += n;
        }
        drop(images);
        let checksums = checksums.finish();
        let text = |what: &str, s: &str| -> Result<VarLenUnicode> {
            s.parse().map_err(|_| {
                Error::hdf5(
                    path,
                    &format!("writing {what} {s:?}"),
                    "it holds a NUL byte, which HDF5 cannot store".into(),
                )
            })
        };
        let keys: Vec<VarLenUnicode> =
            keys.iter().map(|k| text("key", k)).collect::<Result<_>>()?;
        let classes: Vec<VarLenUnicode> = info
            .classes
            .iter()
            .map(|c| text("class name", c))
            .collect::<Result<_>>()?;
        let record = InfoRecord::new(MAGIC, VERSION, true, info.clone());
        let json: VarLenUnicode = serde_json::to_string(&record)
            .expect("info serializes")
            .parse()
            .expect("JSON has no NUL");
        file.with(|file| -> Result<()> {
            file.new_dataset_builder()
                .with_data(checksums.as_slice())
                .create(CHECKSUMS)
                .map_err(h5("writing checksums"))?;
            file.new_dataset_builder()
                .with_data(offsets.as_slice())
                .create(OFFSETS)
                .map_err(h5("writing offsets"))?;
            file.new_dataset_builder()
                .with_data(labels.as_slice())
                .create(LABELS)
                .map_err(h5("writing labels"))?;
            file.new_dataset_builder()
                .with_data(keys.as_slice())
                .create(KEYS)
                .map_err(h5("writing keys"))?;
            file.new_attr_builder()
                .with_data(classes.as_slice())
                .create(CLASSES_ATTR)
                .map_err(h5("writing the classes attribute"))?;
            file.new_attr::<VarLenUnicode>()
                .create(INFO_ATTR)
                .and_then(|a| a.write_scalar(&json))
                .map_err(h5("writing the imagefeed attribute"))?;
            Ok(())
        })?;
        file.finish(|file| file.close().map_err(h5("closing the file")))?;
        fs::File::open(path).and_then(|f| f.sync_all()).at(path)
    }
}

/// Writes an HDF5 file in imagefeed's layout from raw parts, none of them checked: the
/// `imagefeed` attribute's bytes, offsets, labels, keys and image bytes. For fuzzing the reader.
#[cfg(feature = "fuzzing")]
pub(crate) fn write_raw_parts(
    path: &Path,
    info_json: &[u8],
    offsets: &[u64],
    labels: &[i64],
    keys: &[Vec<u8>],
    images: &[u8],
    checksums: Option<&[u32]>,
) -> std::result::Result<(), String> {
    // The library's error is read inside the gate (see `gate`).
    gate::run(|| {
        write_raw_parts_in_gate(path, info_json, offsets, labels, keys, images, checksums)
            .map_err(|e| e.to_string())
    })
}

#[cfg(feature = "fuzzing")]
fn write_raw_parts_in_gate(
    path: &Path,
    info_json: &[u8],
    offsets: &[u64],
    labels: &[i64],
    keys: &[Vec<u8>],
    images: &[u8],
    checksums: Option<&[u32]>,
) -> hdf5::Result<()> {
    let file = hdf5::File::with_options()
        .with_fapl(|fapl| fapl.file_locking(false))
        .create(path)?;
    file.new_dataset_builder()
        .with_data(images)
        .create(IMAGES)?;
    file.new_dataset_builder()
        .with_data(offsets)
        .create(OFFSETS)?;
    file.new_dataset_builder()
        .with_data(labels)
        .create(LABELS)?;
    // The bytes as text, with NULs (which HDF5 strings cannot hold) and invalid UTF-8 replaced:
    // a non-UTF-8 key is tested in tests/integration/value_bounds.rs.
    let text = |bytes: &[u8]| -> VarLenUnicode {
        String::from_utf8_lossy(bytes)
            .replace('\0', "\u{FFFD}")
            .parse()
            .expect("no NUL left")
    };
    let keys: Vec<VarLenUnicode> = keys.iter().map(|k| text(k)).collect();
    file.new_dataset_builder()
        .with_data(keys.as_slice())
        .create(KEYS)?;
    if let Some(checksums) = checksums {
        file.new_dataset_builder()
            .with_data(checksums)
            .create(CHECKSUMS)?;
    }
    file.new_attr::<VarLenUnicode>()
        .create(INFO_ATTR)?
        .write_scalar(&text(info_json))?;
    file.close()
}

/// Computes each record's [`record_checksum`](crate::format::record_checksum) while the
/// payloads stream past in blocks: record `i`'s payload is bytes `offsets[i]..offsets[i + 1]`.
struct RecordChecksums<'a> {
    offsets: &'a [u64],
    labels: &'a [i64],
    keys: &'a [String],
    /// The record being summed, and its CRC so far.
    current: usize,
    crc: u32,
    done: Vec<u32>,
}

impl<'a> RecordChecksums<'a> {
    fn new(offsets: &'a [u64], labels: &'a [i64], keys: &'a [String]) -> Self {
        let mut sums = RecordChecksums {
            offsets,
            labels,
            keys,
            current: 0,
            crc: 0,
            done: Vec::with_capacity(keys.len()),
        };
        sums.start_record();
        sums
    }

    fn start_record(&mut self) {
        if let Some(key) = self.keys.get(self.current) {
            self.crc = crate::format::checksum_start(self.labels[self.current] as u32, key);
        }
    }

    /// Ends every record whose payload ends at or before `position`.
    fn close_up_to(&mut self, position: u64) {
        while self.current < self.keys.len() && self.offsets[self.current + 1] <= position {
            self.done.push(self.crc);
            self.current += 1;
            self.start_record();
        }
    }

    /// Adds `block`, the payload bytes starting at `at`.
    fn update(&mut self, at: u64, block: &[u8]) {
        let end = at + block.len() as u64;
        let mut position = at;
        while position < end {
            self.close_up_to(position);
            let Some(&stop) = self.offsets.get(self.current + 1) else {
                break;
            };
            let stop = stop.min(end);
            let piece = &block[(position - at) as usize..(stop - at) as usize];
            self.crc = crc32c::crc32c_append(self.crc, piece);
            position = stop;
        }
    }

    fn finish(mut self) -> Vec<u32> {
        self.close_up_to(u64::MAX);
        self.done
    }
}

/// The staged index, one entry per sample.
type StagedIndex = (Vec<u64>, Vec<i64>, Vec<String>);

/// Appends one `index.bin` entry (the layout [`parse_staged_index`] reads).
pub(crate) fn push_staged_entry(index: &mut Vec<u8>, payload_end: u64, label: u32, key: &str) {
    index.extend_from_slice(&payload_end.to_le_bytes());
    index.extend_from_slice(&label.to_le_bytes());
    index.extend_from_slice(&(key.len() as u32).to_le_bytes());
    index.extend_from_slice(key.as_bytes());
}

/// Parses `index.bin`: per sample `u64 LE payload end | u32 LE label | u32 LE key length | key`;
/// returns (payload ends, labels, keys).
pub(crate) fn parse_staged_index(bytes: &[u8]) -> std::result::Result<StagedIndex, String> {
    let (mut ends, mut labels, mut keys) = (Vec::new(), Vec::new(), Vec::new());
    let mut rest = bytes;
    while !rest.is_empty() {
        if rest.len() < 16 {
            return Err("index.bin ends inside an entry".into());
        }
        let end = u64::from_le_bytes(rest[0..8].try_into().expect("8 bytes"));
        let label = u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes"));
        let key_len = u32::from_le_bytes(rest[12..16].try_into().expect("4 bytes")) as usize;
        let key = rest
            .get(16..16 + key_len)
            .ok_or("index.bin ends inside a key")?;
        let key = std::str::from_utf8(key).map_err(|_| "a staged key is not UTF-8")?;
        ends.push(end);
        labels.push(i64::from(label));
        keys.push(key.to_string());
        rest = &rest[16 + key_len..];
    }
    Ok((ends, labels, keys))
}

impl DatasetWriter for Hdf5Writer {
    fn start(out: &Path, plan: &PackPlan, options: &WriterOptions) -> Result<(Self, PackProgress)> {
        let mode = options.mode;
        let partial = staging::prepare_output(out, mode)?;
        let out = std::path::absolute(out).at(out)?;
        let created = !partial.exists();
        if created {
            fs::create_dir(&partial).at(&partial)?;
        }
        let lock = staging::lock_staging(&partial)?;
        // A run killed before its first progress record committed nothing: start afresh.
        if created || staging::nothing_committed(&partial, STAGED_PROGRESS) {
            staging::clear_uncommitted(&partial)?;
            // The progress record goes in before any other file, so a staging directory is
            // recognised as ours (and never taken for anything else) from its first entry on.
            let progress = PackProgress::default();
            save_staged_progress(&partial, plan, &progress, 0, 0)?;
            let writer = Hdf5Writer {
                _lock: lock,
                payloads: staging::open_staged_file(&partial, STAGED_PAYLOADS, true)?,
                index: staging::open_staged_file(&partial, STAGED_INDEX, true)?,
                partial,
                out,
                plan: plan.clone(),
                payload_bytes: 0,
                index_bytes: 0,
            };
            return Ok((writer, progress));
        }
        let staged: StagedProgress =
            staging::read_staged_progress(&partial, STAGED_PROGRESS, "imagefeed HDF5")?;
        staged.plan.check_resumable(plan, &partial)?;
        let payloads = staging::open_staged_file(&partial, STAGED_PAYLOADS, false)?;
        let index = staging::open_staged_file(&partial, STAGED_INDEX, false)?;
        staging::cut_to_committed(
            &payloads,
            &partial.join(STAGED_PAYLOADS),
            staged.payload_bytes,
        )?;
        staging::cut_to_committed(&index, &partial.join(STAGED_INDEX), staged.index_bytes)?;
        // (Read through a handle of its own: finishing reads `index` from where it stands.)
        let index_path = partial.join(STAGED_INDEX);
        let index_bytes = fs::read(&index_path).at(&index_path)?;
        let staged_samples = parse_staged_index(&index_bytes)
            .map_err(|reason| Error::ResumeMismatch {
                path: partial.clone(),
                reason,
            })?
            .2
            .len();
        staging::check_staged_samples(&partial, staged_samples as u64, &staged.progress)?;
        let writer = Hdf5Writer {
            _lock: lock,
            partial,
            out,
            plan: staged.plan,
            payloads,
            index,
            payload_bytes: staged.payload_bytes,
            index_bytes: staged.index_bytes,
        };
        Ok((writer, staged.progress))
    }

    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()> {
        let mut index = Vec::with_capacity(records.len() * 48);
        let mut end = self.payload_bytes;
        for record in records {
            self.payloads
                .write_all_at(record.payload, end)
                .at(self.partial.join(STAGED_PAYLOADS))?;
            end += record.payload.len() as u64;
            push_staged_entry(&mut index, end, record.label, record.key);
        }
        self.index
            .write_all_at(&index, self.index_bytes)
            .at(self.partial.join(STAGED_INDEX))?;
        self.payloads
            .sync_data()
            .at(self.partial.join(STAGED_PAYLOADS))?;
        self.index.sync_data().at(self.partial.join(STAGED_INDEX))?;
        self.payload_bytes = end;
        self.index_bytes += index.len() as u64;
        self.save_progress(progress)
    }

    fn finish(mut self: Box<Self>, info: &DatasetInfo, progress: &PackProgress) -> Result<()> {
        self.save_progress(progress)?;
        let staged_h5 = self.partial.join(STAGED_HDF5);
        let _ = fs::remove_file(&staged_h5);
        self.write_hdf5(&staged_h5, info)?;
        staging::publish(&staged_h5, &self.out)?;
        // The dataset is in place; the staging directory is only scratch now. Deleted as
        // every output of ours is (marked first): a kill part-way leaves a directory `--force`
        // still knows as ours, not one it must refuse (the kill loop found that).
        let _ = staging::remove_own_output(&self.partial);
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        let _ = staging::remove_own_output(&self.partial);
    }
}

/// Replaces the progress record in the staging directory `partial`.
pub(super) fn save_staged_progress(
    partial: &Path,
    plan: &PackPlan,
    progress: &PackProgress,
    payload_bytes: u64,
    index_bytes: u64,
) -> Result<()> {
    let staged = StagedProgress {
        magic: MAGIC.into(),
        plan: plan.clone(),
        progress: progress.clone(),
        payload_bytes,
        index_bytes,
    };
    staging::write_file_atomically(
        &partial.join(STAGED_PROGRESS),
        &serde_json::to_vec(&staged).expect("progress serializes"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_checksums_match_whatever_the_block_boundaries() {
        // Payloads of 0, 1, 5, 0 and 9 bytes; the stream is cut into blocks of every size from
        // 1 byte to all of it, so boundaries fall inside, at the start and at the end of records.
        let payloads: [&[u8]; 5] = [b"", b"a", b"bcdef", b"", b"ghijklmno"];
        let labels = [0i64, 1, 2, 1, 0];
        let keys: Vec<String> = (0..5).map(|i| format!("c/{i}.jpg")).collect();
        let mut offsets = vec![0u64];
        for p in payloads {
            offsets.push(offsets.last().unwrap() + p.len() as u64);
        }
        let stream: Vec<u8> = payloads.concat();
        let want: Vec<u32> = (0..5)
            .map(|i| crate::format::record_checksum(labels[i] as u32, &keys[i], payloads[i]))
            .collect();
        for block in 1..=stream.len() {
            let mut sums = RecordChecksums::new(&offsets, &labels, &keys);
            for (n, chunk) in stream.chunks(block).enumerate() {
                sums.update((n * block) as u64, chunk);
            }
            assert_eq!(sums.finish(), want, "blocks of {block}");
        }
        // Zero records.
        assert!(RecordChecksums::new(&[0], &[], &[]).finish().is_empty());
    }

    #[test]
    fn staged_index_round_trips_and_rejects_cut_entries() {
        let mut bytes = Vec::new();
        for (end, label, key) in [(10u64, 2u32, "a/x.jpg"), (25, 0, "b/ü.png")] {
            push_staged_entry(&mut bytes, end, label, key);
        }
        let (ends, labels, keys) = parse_staged_index(&bytes).unwrap();
        assert_eq!(ends, [10, 25]);
        assert_eq!(labels, [2, 0]);
        assert_eq!(keys, ["a/x.jpg", "b/ü.png"]);
        assert!(
            parse_staged_index(&bytes[..bytes.len() - 1])
                .unwrap_err()
                .contains("inside a key")
        );
        assert!(
            parse_staged_index(&bytes[..20])
                .unwrap_err()
                .contains("inside")
        );
    }
}
