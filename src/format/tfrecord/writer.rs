//! The records writer: shards and indexes built in `OUT.partial/`, committed chunk by chunk
//! with `progress.json`, published by renaming the directory once the manifest is written.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::index::push_index_line;
use super::{
    MAGIC, MANIFEST, Manifest, PROGRESS, ShardEntry, VERSION, features, frame, shard_names,
};
use crate::dataset::DatasetInfo;
use crate::decode::{PayloadFormat, RawImage};
use crate::error::{Error, IoContext as _, Result};
use crate::format::example::{self, FeatureValue};
use crate::format::staging;
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, PackedRecord, WriterOptions};

/// What `OUT.partial/progress.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StagedProgress {
    magic: String,
    plan: PackPlan,
    progress: PackProgress,
    label_base: u32,
    shard_bytes: u64,
    /// Committed shards; the last one is the one being written. `bytes` and `records` are the
    /// committed amounts; `index_bytes` the index file's committed length.
    shards: Vec<(ShardEntry, u64)>,
}

/// Writes record shards into `OUT.partial/` and renames the directory when finished.
pub struct RecordsWriter {
    partial: PathBuf,
    /// Held while writing: see [`staging::lock_staging`].
    _lock: fs::File,
    out: PathBuf,
    staged: StagedProgress,
    shard: Option<(fs::File, fs::File)>,
    classes: Vec<String>,
    example: Vec<u8>,
    framed: Vec<u8>,
    index_lines: String,
    decoder: crate::decode::Decoder,
}

impl RecordsWriter {
    fn open_shard_files(&self, entry: &ShardEntry, create: bool) -> Result<(fs::File, fs::File)> {
        let open = |name: &str| staging::open_staged_file(&self.partial, name, create);
        Ok((open(&entry.file)?, open(&entry.index)?))
    }

    fn save_progress(&self) -> Result<()> {
        staging::write_file_atomically(
            &self.partial.join(PROGRESS),
            &serde_json::to_vec(&self.staged).expect("progress serializes"),
        )
    }

    fn sync_open_shard(&self) -> Result<()> {
        if let (Some((shard, index)), Some((entry, _))) = (&self.shard, self.staged.shards.last()) {
            shard.sync_data().at(self.partial.join(&entry.file))?;
            index.sync_data().at(self.partial.join(&entry.index))?;
        }
        Ok(())
    }

    /// Appends one framed record (in `self.framed`) to the open shard, rolling over to a new
    /// shard first when the open one is full.
    fn append(&mut self) -> Result<()> {
        use std::os::unix::fs::FileExt as _;
        let full = self.staged.shards.last().is_none_or(|(entry, _)| {
            entry.records > 0 && entry.bytes + self.framed.len() as u64 > self.staged.shard_bytes
        });
        if full {
            self.sync_open_shard()?;
            let (file, index) = shard_names(self.staged.shards.len());
            let entry = ShardEntry {
                file,
                index,
                records: 0,
                bytes: 0,
            };
            self.shard = Some(self.open_shard_files(&entry, true)?);
            self.staged.shards.push((entry, 0));
        }
        let (entry, index_bytes) = self.staged.shards.last_mut().expect("a shard is open");
        let (shard, index) = self.shard.as_ref().expect("a shard is open");
        shard
            .write_all_at(&self.framed, entry.bytes)
            .at(self.partial.join(&entry.file))?;
        self.index_lines.clear();
        push_index_line(&mut self.index_lines, entry.bytes, self.framed.len() as u64);
        index
            .write_all_at(self.index_lines.as_bytes(), *index_bytes)
            .at(self.partial.join(&entry.index))?;
        entry.bytes += self.framed.len() as u64;
        entry.records += 1;
        *index_bytes += self.index_lines.len() as u64;
        Ok(())
    }
}

impl DatasetWriter for RecordsWriter {
    fn start(out: &Path, plan: &PackPlan, options: &WriterOptions) -> Result<(Self, PackProgress)> {
        let (mode, shard_bytes, label_base) =
            (options.mode, options.shard_bytes, options.label_base);
        let partial = staging::prepare_output(out, mode)?;
        let out = std::path::absolute(out).at(out)?;
        let resuming = partial.exists();
        if !resuming {
            fs::create_dir(&partial).at(&partial)?;
        }
        let lock = staging::lock_staging(&partial)?;
        // A run killed before its first progress record committed nothing: start afresh.
        let resuming = resuming && !staging::nothing_committed(&partial, PROGRESS);
        if !resuming {
            staging::clear_uncommitted(&partial)?;
        }
        let staged = if resuming {
            if !partial.join(PROGRESS).exists() && partial.join(MANIFEST).exists() {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: "it holds a complete records dataset that no interrupted pack \
                             left (the old dataset of an interrupted --force replacement, or a \
                             copy of a finished one), so there is nothing to resume: use --force \
                             to pack again, or rename it yourself if it is the dataset you want"
                        .into(),
                });
            }
            let staged: StagedProgress =
                staging::read_staged_progress(&partial, PROGRESS, "records directory")?;
            staged.plan.check_resumable(plan, &partial)?;
            if (staged.shard_bytes, staged.label_base) != (shard_bytes, label_base) {
                return Err(Error::ResumeMismatch {
                    path: partial,
                    reason: "it was started with another --shard-size or --label-base".into(),
                });
            }
            // The writer names shard i `shard-{i:05}.*` and nothing else: a progress record
            // naming other files (`../x`, an absolute path) is not ours, and is never followed.
            for (number, (entry, _)) in staged.shards.iter().enumerate() {
                let (file, index) = shard_names(number);
                if (entry.file.as_str(), entry.index.as_str()) != (&file, &index) {
                    return Err(Error::ResumeMismatch {
                        path: partial.join(PROGRESS),
                        reason: format!(
                            "shard {number} is recorded as {:?} and {:?}; this writer names it \
                             {file:?} and {index:?}: not a progress record of ours",
                            entry.file, entry.index
                        ),
                    });
                }
            }
            let staged_samples = (staged.shards.iter()).fold(0u64, |sum, (entry, _)| {
                sum.saturating_add(entry.records as u64)
            });
            staging::check_staged_samples(&partial, staged_samples, &staged.progress)?;
            staged
        } else {
            StagedProgress {
                magic: MAGIC.into(),
                plan: plan.clone(),
                progress: PackProgress::default(),
                label_base,
                shard_bytes,
                shards: Vec::new(),
            }
        };
        let mut writer = RecordsWriter {
            _lock: lock,
            partial,
            out,
            classes: plan.classes.clone(),
            staged,
            shard: None,
            example: Vec::new(),
            framed: Vec::new(),
            index_lines: String::new(),
            decoder: crate::decode::Decoder::new(),
        };
        // Cut every listed shard and index back to its committed length (only the last can
        // have grown since, but checking all costs nothing), and reopen the last one.
        for (entry, index_bytes) in writer.staged.shards.clone() {
            let shard = writer.open_shard_files(&entry, false)?;
            staging::cut_to_committed(&shard.0, &writer.partial.join(&entry.file), entry.bytes)?;
            staging::cut_to_committed(&shard.1, &writer.partial.join(&entry.index), index_bytes)?;
            writer.shard = Some(shard);
        }
        // Shards opened after the last commit (a crash right after rollover) are not listed.
        let listed = writer.staged.shards.len();
        for number in listed..listed + 2 {
            let (file, index) = shard_names(number);
            let _ = fs::remove_file(writer.partial.join(file));
            let _ = fs::remove_file(writer.partial.join(index));
        }
        writer.save_progress()?;
        let progress = writer.staged.progress.clone();
        Ok((writer, progress))
    }

    fn write_chunk(&mut self, records: &[PackedRecord<'_>], progress: &PackProgress) -> Result<()> {
        for record in records {
            let (format, width, height) = match PayloadFormat::sniff(record.payload) {
                Some(PayloadFormat::Raw) => {
                    let (w, h, _) =
                        RawImage::parse(record.payload).map_err(|e| Error::Rejected {
                            path: PathBuf::from(record.key),
                            reason: e.to_string(),
                        })?;
                    (super::RAW_FORMAT_NAME, w, h)
                }
                _ => {
                    let header =
                        self.decoder
                            .header(record.payload)
                            .map_err(|e| Error::Rejected {
                                path: PathBuf::from(record.key),
                                reason: e.to_string(),
                            })?;
                    (format_name(header.format), header.width, header.height)
                }
            };
            let label = i64::from(record.label) + i64::from(self.staged.label_base);
            let synset = self
                .classes
                .get(record.label as usize)
                .map_or("", String::as_str);
            example::encode(
                &mut self.example,
                &[
                    (features::ENCODED, FeatureValue::Bytes(record.payload)),
                    (features::LABEL, FeatureValue::Int64(label)),
                    (features::SYNSET, FeatureValue::Bytes(synset.as_bytes())),
                    (features::FORMAT, FeatureValue::Bytes(format.as_bytes())),
                    (
                        features::FILENAME,
                        FeatureValue::Bytes(record.key.as_bytes()),
                    ),
                    (features::HEIGHT, FeatureValue::Int64(height.into())),
                    (features::WIDTH, FeatureValue::Int64(width.into())),
                ],
            );
            self.framed.clear();
            frame(&mut self.framed, &self.example);
            self.append()?;
        }
        self.sync_open_shard()?;
        self.staged.progress = progress.clone();
        self.save_progress()
    }

    fn finish(mut self: Box<Self>, info: &DatasetInfo, progress: &PackProgress) -> Result<()> {
        self.sync_open_shard()?;
        self.staged.progress = progress.clone();
        let manifest = Manifest {
            magic: MAGIC.into(),
            version: VERSION,
            complete: true,
            label_base: self.staged.label_base,
            shards: self.staged.shards.iter().map(|(e, _)| e.clone()).collect(),
            info: info.clone(),
        };
        staging::write_file_atomically(
            &self.partial.join(MANIFEST),
            &serde_json::to_vec_pretty(&manifest).expect("manifest serializes"),
        )?;
        // The progress record goes only once the directory is published: a run killed between
        // the manifest and the rename leaves a complete dataset at OUT.partial that `--resume`
        // can tell is this pack's (the record holds its plan) and finishes by publishing it (the
        // kill loop, pack-dataset/tests/kill_loop.rs, found that window refused when the record
        // went first). A kill after the rename leaves the record beside OUT's manifest, where
        // readers, `--force` and uploads pass it by.
        staging::publish(&self.partial, &self.out)?;
        let _ = fs::remove_file(self.out.join(PROGRESS));
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        let _ = staging::remove_own_output(&self.partial);
    }
}

/// The `image/format` value for a payload format (TensorFlow's ImageNet scripts write `JPEG`).
fn format_name(format: PayloadFormat) -> &'static str {
    match format {
        PayloadFormat::Jpeg => "JPEG",
        PayloadFormat::Png => "PNG",
        PayloadFormat::Bmp => "BMP",
        PayloadFormat::Pnm => "PNM",
        PayloadFormat::Tiff => "TIFF",
        PayloadFormat::WebP => "WEBP",
        PayloadFormat::Raw => super::RAW_FORMAT_NAME,
    }
}
