//! The per-thread work of a pack: read a file or record, check that it decodes, resize and
//! re-encode it when asked.

use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::dataset::{Dataset, PayloadKind, RecordReader, hex};
use crate::decode::{ChromaSubsampling, Decoder, JpegEncoder, PayloadFormat, RawImage};
use crate::error::{Error, IoContext as _, Result};
use crate::format::folder::ImageFolder;
use crate::format::parts::JoinedParts;
use crate::resize::{RgbResizer, short_side_size};

use super::{PackOptions, source_fingerprint};

/// What a pack reads: the files of an ImageFolder tree, or the records of any dataset.
pub(super) enum Source<'a> {
    Folder(&'a ImageFolder),
    Records(&'a dyn Dataset),
    /// The parts of a split conversion, in part order; their payloads were checked when the
    /// parts were packed and are copied as they are.
    Joined(&'a JoinedParts),
}

impl Source<'_> {
    /// The records of a dataset-backed source.
    pub(super) fn dataset(&self) -> Option<&dyn Dataset> {
        match self {
            Source::Folder(_) => None,
            Source::Records(d) => Some(*d),
            Source::Joined(j) => Some(*j),
        }
    }

    pub(super) fn len(&self) -> usize {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.len(),
            (_, Some(d)) => d.len(),
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }

    pub(super) fn classes(&self) -> &[String] {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.classes(),
            (_, Some(d)) => d.classes(),
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }

    pub(super) fn payload(&self) -> PayloadKind {
        self.dataset()
            .map_or(PayloadKind::Encoded, |d| d.info().payload)
    }

    pub(super) fn resized_short_side(&self) -> Option<u32> {
        self.dataset().and_then(|d| d.info().resized_short_side)
    }

    /// Whether the source's JPEGs were rewritten with restart markers when it was packed.
    pub(super) fn restart_markers(&self) -> bool {
        self.dataset().is_some_and(|d| d.info().restart_markers)
    }

    /// What changes when the source does: the listing for a tree; path, size, modification
    /// time and sample count for a dataset file.
    pub(super) fn fingerprint(&self) -> Result<String> {
        match self {
            Source::Folder(f) => source_fingerprint(f),
            Source::Joined(j) => {
                let mut hasher = Sha256::new();
                for part in j.parts() {
                    hasher.update(Source::Records(part.as_ref()).fingerprint()?.as_bytes());
                }
                Ok(hex(&hasher.finalize()))
            }
            Source::Records(d) => {
                let mut hasher = Sha256::new();
                // A source named by a pattern or a URL is no one file: its name, size and
                // classes stand for it.
                let text = d.path().to_string_lossy();
                if crate::remote::is_url(&text) || crate::format::shards::is_pattern(d.path()) {
                    hasher.update(text.as_bytes());
                    hasher.update((d.len() as u64).to_le_bytes());
                    for class in &d.info().classes {
                        hasher.update(class.as_bytes());
                        hasher.update([0]);
                    }
                    return Ok(hex(&hasher.finalize()));
                }
                let meta = fs::metadata(d.path()).at(d.path())?;
                hasher.update(
                    fs::canonicalize(d.path())
                        .at(d.path())?
                        .as_os_str()
                        .as_encoded_bytes(),
                );
                hasher.update(meta.len().to_le_bytes());
                let mtime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                hasher.update(mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
                hasher.update((d.len() as u64).to_le_bytes());
                Ok(hex(&hasher.finalize()))
            }
        }
    }

    /// The files or directories the items are read from.
    pub(super) fn paths(&self) -> Vec<&Path> {
        match self {
            Source::Folder(f) => vec![f.path()],
            Source::Records(d) => vec![d.path()],
            Source::Joined(j) => j.parts().iter().map(|p| p.path()).collect(),
        }
    }

    /// Where a rejected item lives, for strict mode's error.
    pub(super) fn locate(&self, index: usize, key: &str) -> PathBuf {
        match (self, self.dataset()) {
            (Source::Folder(f), _) => f.file_path(index),
            (_, Some(d)) => {
                PathBuf::from(format!("{}: record {index} ({key})", d.path().display()))
            }
            _ => unreachable!("a non-folder source has a dataset"),
        }
    }
}

/// One checked item: (key, label, payload to store), or (key, rejection reason).
pub(super) type Checked = std::result::Result<(String, u32, Vec<u8>), (String, String)>;

/// One fetched item: what to store, or why not.
pub(super) type Fetched = std::result::Result<(String, u32, Vec<u8>), Unfetched>;

/// Why an item was not fetched.
pub(super) enum Unfetched {
    /// The item itself is unusable: rejected by its key, with the reason, and the pack goes on.
    Rejected(String, String),
    /// The source dataset as a whole cannot be read on: it changed or was cut short since it
    /// was opened, or the object store failed ([`is_source_wide`]). The pack stops with this
    /// error (the
    /// chunks committed so far kept for `--resume`): rejecting every item after it would
    /// publish a complete-looking part of the source. (A hostile try cut a 10,000-image LMDB
    /// to a third while it was converted: the output was published with 3,324 samples and
    /// 6,676 "rejected" images.)
    Source(Error),
}

impl Unfetched {
    /// A fetched item as a checked one, or the error that stops the pack.
    pub(super) fn checked(fetched: Fetched) -> Result<Checked> {
        match fetched {
            Ok(item) => Ok(Ok(item)),
            Err(Unfetched::Rejected(key, reason)) => Ok(Err((key, reason))),
            Err(Unfetched::Source(error)) => Err(error),
        }
    }
}

/// Whether a dataset reader's error stops the pack rather than rejecting the record: the
/// dataset's own ([`Error::is_dataset_wide`], as for a loader), and, since a rejection is
/// permanent where a loader's bad sample lasts an epoch, a read that failed for a reason that
/// is not the record's (the object store after its retries, memory).
fn is_source_wide(error: &Error) -> bool {
    #[cfg(feature = "remote")]
    if matches!(error, Error::Remote { .. }) {
        return true;
    }
    error.is_dataset_wide() || matches!(error, Error::OutOfMemory { .. } | Error::Cancelled)
}

/// Per-thread state for checking and transforming files.
pub(super) struct PackWorker {
    reader: Option<Box<dyn RecordReader>>,
    decoder: Decoder,
    rgb: Vec<u8>,
    resized: Vec<u8>,
    resizer: Option<RgbResizer>,
    encoder: Option<JpegEncoder>,
}

impl PackWorker {
    pub(super) fn new(max_pixels: u64) -> Self {
        PackWorker {
            reader: None,
            decoder: Decoder::new().with_max_pixels(max_pixels),
            rgb: Vec::new(),
            resized: Vec::new(),
            resizer: None,
            encoder: None,
        }
    }

    /// Fetches source item `index`: its key, label and bytes, or (key, reason) when it cannot
    /// be read.
    pub(super) fn fetch(&mut self, source: &Source<'_>, index: usize) -> Fetched {
        match source {
            Source::Folder(folder) => {
                let entry = &folder.entries()[index];
                let mut bytes = Vec::new();
                match folder.read_file(index, &mut bytes) {
                    Ok(()) => Ok((entry.key.clone(), entry.label, bytes)),
                    Err(Error::RefusedFile { reason, .. }) => {
                        Err(Unfetched::Rejected(entry.key.clone(), reason))
                    }
                    // Listed, and now nothing at all at its path (a dangling link is still
                    // there, and rejected): the tree changed while it was packed, as when a
                    // class directory is moved away (a hostile try's pack "rejected" every
                    // file after that and published the rest, exit 0).
                    Err(Error::Io { path, source })
                        if source.kind() == std::io::ErrorKind::NotFound
                            && fs::symlink_metadata(&path).is_err() =>
                    {
                        Err(Unfetched::Source(Error::FileChanged {
                            path,
                            change: "it was listed, and is gone: the tree changed while it was \
                                     packed"
                                .into(),
                        }))
                    }
                    Err(e) => Err(Unfetched::Rejected(
                        entry.key.clone(),
                        format!("cannot read: {e}"),
                    )),
                }
            }
            Source::Records(_) | Source::Joined(_) => {
                let dataset = source.dataset().expect("a dataset-backed source");
                let reader = match &mut self.reader {
                    Some(reader) => reader,
                    // A reader that cannot be opened reads no item: the source's error.
                    slot @ None => slot.insert(dataset.open_reader().map_err(Unfetched::Source)?),
                };
                match reader.read(index) {
                    Ok(r) => Ok((r.key.to_string(), r.label, r.payload.to_vec())),
                    Err(e) if is_source_wide(&e) => Err(Unfetched::Source(e)),
                    Err(e) => Err(Unfetched::Rejected(index.to_string(), e.to_string())),
                }
            }
        }
    }

    /// Fetches and checks one item; returns what to store, or the rejection.
    pub(super) fn prepare(
        &mut self,
        source: &Source<'_>,
        index: usize,
        options: &PackOptions,
    ) -> Fetched {
        let (key, label, bytes) = self.fetch(source, index)?;
        if key.contains('\0') {
            // A key is a path relative to the source root, which cannot hold a NUL; HDF5's
            // strings cannot store one either.
            return Err(Unfetched::Rejected(
                key.replace('\0', "\\0"),
                "its key holds a NUL byte".into(),
            ));
        }
        if let Source::Joined(_) = source {
            return Ok((key, label, bytes));
        }
        match self.prepare_bytes(bytes, options) {
            Ok(payload) => Ok((key, label, payload)),
            Err(reason) => Err(Unfetched::Rejected(key, reason)),
        }
    }

    /// Checks (and with --raw/--resize/--restart-markers, transforms) one image's bytes.
    pub(super) fn prepare_bytes(
        &mut self,
        bytes: Vec<u8>,
        options: &PackOptions,
    ) -> std::result::Result<Vec<u8>, String> {
        let payload = self.checked_or_transformed(bytes, options)?;
        if !options.restart_markers
            || PayloadFormat::sniff(&payload) != Some(PayloadFormat::Jpeg)
            || crate::decode::has_restart_segments(&payload)
        {
            return Ok(payload);
        }
        // A file the rewrite refuses (lossless or 12-bit JPEG, a subsampling crops cannot use)
        // is kept as it is: its pixels are the same either way, only its crops decode whole.
        Ok(crate::decode::add_restart_markers(&payload).unwrap_or(payload))
    }

    /// Checks (and with --raw/--resize, transforms) one image's bytes.
    fn checked_or_transformed(
        &mut self,
        bytes: Vec<u8>,
        options: &PackOptions,
    ) -> std::result::Result<Vec<u8>, String> {
        if !options.raw && options.resize_short_side.is_none() {
            // Stored as is: only check that it decodes (the cheap way).
            self.decoder.validate(&bytes).map_err(|e| e.to_string())?;
            return Ok(bytes);
        }
        let header = self
            .decoder
            .decode_rgb(&bytes, &mut self.rgb)
            .map_err(|e| e.to_string())?;
        let (w, h) = (header.width, header.height);
        let target = options
            .resize_short_side
            .filter(|&s| w.min(h) > s)
            .map(|s| short_side_size(w, h, s));
        let (pixels, pw, ph) = match target {
            Some((tw, th)) => {
                self.resized.resize(tw as usize * th as usize * 3, 0);
                self.resizer.get_or_insert_with(RgbResizer::new).resize(
                    &self.rgb,
                    w,
                    h,
                    &mut self.resized,
                    tw,
                    th,
                );
                (&self.resized, tw, th)
            }
            None if !options.raw => return Ok(bytes),
            None => (&self.rgb, w, h),
        };
        if options.raw {
            return Ok(RawImage::encode(pw, ph, pixels));
        }
        let encoder = match &mut self.encoder {
            Some(encoder) => encoder,
            slot @ None => slot.insert(
                JpegEncoder::new(options.quality, ChromaSubsampling::Half)
                    .map_err(|e| e.to_string())?,
            ),
        };
        encoder
            .encode_rgb(pixels, pw, ph)
            .map_err(|e| e.to_string())
    }
}
