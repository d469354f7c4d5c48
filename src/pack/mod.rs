//! Packing an ImageFolder tree into a dataset file: the work behind `pack-dataset`.
//!
//! The pipeline: scan the tree ([`ImageFolder`]) → read and check files in parallel (rayon), a
//! chunk at a time → hand each chunk, in source order, to the format's writer, which commits it
//! atomically together with a progress record → mark the output complete and rename it into
//! place.
//!
//! Every file is fully decoded once while packing, so a truncated or corrupt image is *rejected*
//! (its path and reason are listed in the summary and the report) instead of being stored for a
//! training run to trip over. Rejection does not stop the run unless [`PackOptions::strict`].
//!
//! Crash safety comes from two rules: the output is built under `OUT.partial` and only renamed
//! to `OUT` once complete, and each chunk is committed with the count of source files consumed.
//! [`StartMode::resume`] picks up from that count; the plan check makes sure a resumed run uses
//! the same source tree and options. Both are the writers' work ([`format::writer`],
//! [`format::staging`]): this module reads and checks, and hands them records.
//!
//! [`format::writer`]: crate::format::writer
//! [`format::staging`]: crate::format::staging

use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;

use crate::dataset::{Dataset, PartInfo, PayloadKind};
use crate::error::{Error, IoContext as _, Result};
use crate::format::folder::ImageFolder;
use crate::format::parts::JoinedParts;
use crate::format::staging::{partial_path, write_file_atomically};
use crate::format::writer::{DatasetWriter, PackPlan, PackProgress, PackedRecord, start_writer};

// What pack's own signatures use, where they are defined.
pub use crate::format::writer::{PackFormat, Rejection, StartMode};

mod options;
mod unchanged;
mod worker;

use options::refuse_foreign_report;
pub(crate) use options::refuse_source_as_output;
pub use options::{
    NoProgress, PackObserver, PackOptions, PackSummary, Part, disk_bytes, report_path,
    source_fingerprint,
};
use worker::{Checked, Fetched, PackWorker, Source, Unfetched};

/// Packs the ImageFolder tree at `source` into `out`.
///
/// Returns the summary (also written to [`report_path`]`(out)`). Rejected files are listed there;
/// with `options.strict` the first one is an [`Error::Rejected`] and no output remains.
pub fn pack_image_folder(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    let folder = ImageFolder::open(source)?;
    pack_source(
        &Source::Folder(&folder),
        source,
        out,
        format,
        options,
        observer,
    )
}

/// Rewrites any dataset this library reads (an imagefeed LMDB, a Python folder2lmdb LMDB, an
/// ImageFolder tree) into `out`, with the same checks, options, crash safety and report as
/// [`pack_image_folder`]. Records keep their keys, labels and order; classes are the source's.
pub fn convert(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    convert_with(
        source,
        out,
        format,
        options,
        &crate::format::OpenOptions::default(),
        observer,
    )
}

/// [`convert`], with options for reading a source other tools wrote (h5py dataset names,
/// TFRecord label base).
pub fn convert_with(
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    input: &crate::format::OpenOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    if source.is_dir()
        && !source.join("data.mdb").is_file()
        && !crate::format::tfrecord::looks_like_records(source)
        && !crate::format::webdataset::looks_like_webdataset(source)
        && !crate::format::mds::looks_like_mds(source)
    {
        return pack_image_folder(source, out, format, options, observer);
    }
    let dataset = crate::format::open_with(source, input)?;
    refuse_incomplete_source(dataset.as_ref(), input.allow_missing_shards)?;
    pack_source(
        &Source::Records(dataset.as_ref()),
        source,
        out,
        format,
        options,
        observer,
    )
}

/// Refuses a source that `inspect` would not call complete: a conversion or join publishes a
/// whole dataset, and records that cannot be copied would be missing from it, or each a
/// rejection of an output that says "complete" (hostile tries: a set with a 0-byte member
/// converted with exit 0; a part with a shard cut short joined into 9,203 samples). With
/// `on_purpose` (`--allow-missing-shards`), other tools' shards found cut at their end are
/// converted as they are, each cut record a rejection (a tar written without its end block
/// reads so, and could not be converted at all).
fn refuse_incomplete_source(dataset: &dyn Dataset, on_purpose: bool) -> Result<()> {
    let incomplete = |reason: String| {
        Err(Error::Incomplete {
            path: dataset.path().to_path_buf(),
            reason,
        })
    };
    let empty = dataset.suspect_empty_shards();
    if empty > 0 {
        return incomplete(format!(
            "{empty} member(s) of its shard set hold no sample while the others do (a copy cut \
             short, or a file never written; `inspect` names them): their records would be \
             missing from the output"
        ));
    }
    let at_end = if on_purpose {
        Vec::new()
    } else {
        dataset.shards_cut_at_end()
    };
    let cut = dataset.cut_shards() + at_end.len();
    if cut > 0 {
        let named = crate::dataset::first_names(at_end.iter().map(|(_, path)| *path));
        let named = if named.is_empty() {
            String::new()
        } else {
            format!(
                " ({})",
                crate::dataset::missing_list(&named, at_end.len() as u64)
            )
        };
        return incomplete(format!(
            "{cut} of its shard(s) end cut short{named}, shorter than their records (`inspect` \
             names them): the records past each cut cannot be copied, and the output would be \
             missing them; restore the shards, or convert what is left of other tools' shards \
             on purpose with --allow-missing-shards"
        ));
    }
    Ok(())
}

/// The pack pipeline ([`pack_steps`]); a full disk, whichever file met it, is an error that
/// says what to do ([`full_disk_advice`]).
fn pack_source(
    items: &Source<'_>,
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    pack_steps(items, source, out, format, options, observer).map_err(full_disk_advice)
}

/// A pack's error for a full disk (`StorageFull`) says that the pack can go on once there is
/// room: every format's, as the LMDB writer's did.
fn full_disk_advice(error: Error) -> Error {
    match error {
        Error::Io { path, source } if source.kind() == std::io::ErrorKind::StorageFull => {
            Error::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!(
                        "{source}; free some space and rerun with --resume: it goes on from \
                         the last chunk written"
                    ),
                ),
            }
        }
        other => other,
    }
}

/// The pack pipeline, in its steps: check the options and the share of the source this run
/// packs ([`part_range`]), make the plan the writer records ([`plan_for`]), start the writer
/// (which resumes where an interrupted run stopped), check and commit the items chunk by chunk
/// ([`write_chunks`]), seal and publish the output, and write the report ([`report`]).
fn pack_steps(
    items: &Source<'_>,
    source: &Path,
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    if let Some(text) = out.to_str()
        && crate::remote::is_url(text)
    {
        return pack_to_url(items, source, text, format, options, observer);
    }
    let started = Instant::now();
    options.validate()?;
    // A source whose JPEGs were rewritten with restart markers keeps them: files copied as they
    // are still hold them, so resized (re-encoded) ones get them too, and the output says so.
    let inherited;
    let options = if items.restart_markers() && !options.raw && !options.restart_markers {
        inherited = options.clone().with_restart_markers(true);
        &inherited
    } else {
        options
    };
    if options.shared_headers && format != PackFormat::Lmdb {
        return Err(Error::Config(format!(
            "--shared-headers: only LMDB output stores shared JPEG headers, not {}",
            format.name()
        )));
    }
    // A label base asked of another format was dropped without a word (a hostile try's
    // `label_base=1` packed 0-based LMDB labels). (A shard size changes nothing another format
    // stores, so scripts may pass one to every format.)
    if format != PackFormat::Records && options.label_base != 0 {
        return Err(Error::Config(format!(
            "--label-base {}: only record shards store labels with a base, not {} (its labels \
             are class indices from 0)",
            options.label_base,
            format.name()
        )));
    }
    let (part, range) = part_range(items, options)?;
    refuse_source_as_output(out, &items.paths())?;
    if let Some(class) = items.classes().iter().find(|c| c.contains('\0')) {
        return Err(Error::not_a_dataset(
            source,
            format!("class name {class:?} holds a NUL byte, which no output can store"),
        ));
    }
    // Before the staging output exists (a pattern source may match it).
    let source_files = unchanged::SourceFiles::of(items, out)?;
    let plan = plan_for(items, options, part, range.len(), &source_files)?;
    refuse_foreign_report(&std::path::absolute(out).at(out)?)?;
    let (mut writer, mut progress) = start_writer(format, out, &plan, &options.writer_options())?;
    check_progress(out, &progress, range.len())?;
    check_rejections(out, &progress, items, range.start)?;
    let resumed_from = progress.sources_done;
    observer.started(range.len(), resumed_from);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(options.threads.unwrap_or(0))
        .thread_name(|i| format!("pack-{i}"))
        .build()
        .map_err(|e| Error::io(source, std::io::Error::other(e)))?;
    let todo: Vec<usize> = (range.start + resumed_from..range.end).collect();
    let outcome = write_chunks(
        items,
        &pool,
        &todo,
        range.len(),
        out,
        options,
        observer,
        &mut progress,
        writer.as_mut(),
    );
    if let Err(err) = outcome {
        if options.strict {
            writer.abandon();
        }
        return Err(err);
    }
    // A part of a split may hold nothing but rejected files (its range all broken): written,
    // empty, it lets the split be joined, where refusing it left no run that could complete
    // the split (a hostile try). A whole pack of nothing is refused.
    if progress.samples_written == 0 && options.part.is_none() {
        writer.abandon();
        return Err(Error::BadImageFolder {
            path: source.to_path_buf(),
            reason: format!("all {} files were rejected; nothing to pack", range.len()),
        });
    }
    let mut info = plan.dataset_info(format.kind(), progress.samples_written);
    // A joined dataset counts what its parts rejected too.
    let earlier = match items {
        Source::Joined(j) => j.info().rejected_at_pack.unwrap_or(0),
        Source::Folder(_) | Source::Records(_) => 0,
    };
    info.rejected_at_pack = Some(progress.rejected.len() + earlier);
    // The source read must be the one opened, or the output is not a copy of it.
    source_files.check()?;
    writer.finish(&info, &progress)?;
    report(
        items,
        source,
        out,
        format,
        &plan,
        progress,
        resumed_from,
        started,
    )
}

/// Refuses to resume from a progress record that does not add up: every source done is one
/// sample written or one file rejected, and no more are done than the run has. A hostile try
/// edited `sources_done` in a staged pack: past the end (10^18), the resume published a
/// "complete" dataset missing half its sources, that plain `verify` passed; at 0, it packed
/// every source again after the ones stored, a "complete" dataset of duplicates.
fn check_progress(out: &Path, progress: &PackProgress, sources: usize) -> Result<()> {
    let accounted = progress
        .samples_written
        .checked_add(progress.rejected.len());
    if accounted == Some(progress.sources_done) && progress.sources_done <= sources {
        return Ok(());
    }
    Err(Error::ResumeMismatch {
        path: partial_path(out),
        reason: format!(
            "its progress record says {} of {sources} source files are done, but {} samples \
             were written and {} files rejected (damaged or edited?): pack again with --force",
            progress.sources_done,
            progress.samples_written,
            progress.rejected.len()
        ),
    })
}

/// Refuses to resume from a progress record whose rejected files are not among the sources
/// done, or are named twice: a hostile try added invented rejections (keys in no source) to a
/// record that then added up, and the resume published a "complete" dataset missing the
/// sources they stood in for. The keys of a tree's files, and of a dataset's records where it
/// lists them, are known without reading anything; an unreadable record is rejected under its
/// number.
fn check_rejections(
    out: &Path,
    progress: &PackProgress,
    items: &Source<'_>,
    first: usize,
) -> Result<()> {
    if progress.rejected.is_empty() {
        return Ok(());
    }
    let done = first..first + progress.sources_done;
    let stray = |rejection: &Rejection, why: &str| Error::ResumeMismatch {
        path: partial_path(out),
        reason: format!(
            "its progress record rejects {:?}, {why} (damaged or edited?): pack again with \
             --force",
            rejection.key
        ),
    };
    // Each rejected key once; then the done sources' keys cross off the ones they name.
    let mut unmatched: std::collections::HashMap<&str, &Rejection> = Default::default();
    for rejection in &progress.rejected {
        if unmatched
            .insert(rejection.key.as_str(), rejection)
            .is_some()
        {
            return Err(stray(rejection, "twice"));
        }
    }
    let mut cross_off = |key: &str| {
        unmatched.remove(key);
    };
    match items {
        Source::Folder(folder) => {
            for entry in &folder.entries()[done] {
                cross_off(&entry.key);
            }
        }
        Source::Records(_) | Source::Joined(_) => {
            let dataset = items.dataset().expect("a dataset-backed source");
            for index in done {
                match dataset.listed(index) {
                    Some((key, _)) => cross_off(key),
                    // Keys only a read would give: nothing to check them against.
                    None => return Ok(()),
                }
                cross_off(&index.to_string());
            }
        }
    }
    match unmatched.values().next() {
        None => Ok(()),
        Some(rejection) => Err(stray(rejection, "which is none of the source files done")),
    }
}

/// [`pack_source`] into object storage: packed into a local staging copy (crash-safe and
/// resumable as any pack), then uploaded ([`crate::format::upload`]).
fn pack_to_url(
    items: &Source<'_>,
    source: &Path,
    url: &str,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    let url = crate::remote::RemoteUrl::parse(url)?.with_options(&options.storage_options);
    options::refuse_remote_source_as_output(&url, &items.paths())?;
    #[cfg(feature = "remote")]
    {
        options.validate()?;
        crate::format::upload::check_target(&url, options.mode)?;
        let cache = match &options.cache {
            Some(cache) => cache.clone(),
            None => crate::cache::Cache::from_env()?,
        };
        let staging = crate::format::upload::staging_for(&url, &cache);
        if let Some(parent) = staging.parent() {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        // The staging copy is ours to replace whatever the remote mode says: a fresh pack
        // starts it again, a resumed one continues it.
        let local = PackOptions {
            mode: StartMode {
                resume: options.mode.resume,
                force: true,
            },
            ..options.clone()
        };
        // A resumed run whose local pack had finished (the upload was cut short) only uploads.
        let finished = (options.mode.resume && staging.exists())
            .then(|| std::fs::read(report_path(&staging)).ok())
            .flatten()
            .and_then(|text| serde_json::from_slice::<PackSummary>(&text).ok());
        let mut summary = match finished {
            Some(summary) => summary,
            // (pack_steps: the advice for a full disk is added once, by the outer pack_source.)
            None => pack_steps(items, source, &staging, format, &local, observer)?,
        };
        crate::format::upload::publish(&staging, &url, options.mode)?;
        let report = report_path(&staging);
        let _ = crate::remote::store::upload(
            &report,
            &url.with_key(&format!(
                "{}{}",
                url.key().trim_end_matches('/'),
                crate::format::shards::REPORT_SUFFIX
            )),
            false,
        );
        let _ = std::fs::remove_file(&report);
        summary.output = PathBuf::from(url.to_string());
        Ok(summary)
    }
    #[cfg(not(feature = "remote"))]
    {
        let _ = (items, source, format, options, observer);
        Err(Error::FeatureDisabled {
            path: PathBuf::from(url.to_string()),
            what: "writing to object storage",
            feature: "remote",
        })
    }
}

/// The part of the source listing this run packs (`--num-parts`/`--part-index`), checked,
/// and the range of items it covers (all of them without a part).
fn part_range(
    items: &Source<'_>,
    options: &PackOptions,
) -> Result<(Option<PartInfo>, std::ops::Range<usize>)> {
    let Some(Part { index, count }) = options.part else {
        return Ok((None, 0..items.len()));
    };
    if count == 0 || index >= count {
        return Err(Error::Config(format!(
            "part {index} of {count}: a part's index must be below the number of parts"
        )));
    }
    // More parts than files leaves some parts empty, which are refused: so is every part of
    // such a split (a hostile try packed the parts that held a file, and no join could ever
    // take them).
    if count > items.len() {
        return Err(Error::Config(format!(
            "{count} parts are more than the {} source files: some parts would hold none; \
             split into at most {} parts",
            items.len(),
            items.len().max(1)
        )));
    }
    let range = PartInfo::range(items.len(), index, count);
    let part = PartInfo {
        index,
        count,
        source_fingerprint: items.fingerprint()?,
        source_items: items.len(),
        quality: (options.resize_short_side.is_some() && !options.raw).then_some(options.quality),
    };
    Ok((Some(part), range))
}

/// What the writer is asked to produce from `num_sources` items of `items`: recorded in the
/// staging output, so that a resumed run can check it packs the same thing.
fn plan_for(
    items: &Source<'_>,
    options: &PackOptions,
    part: Option<PartInfo>,
    num_sources: usize,
    files: &unchanged::SourceFiles,
) -> Result<PackPlan> {
    let source_raw = items.payload() == PayloadKind::RawRgb8;
    Ok(PackPlan {
        // The source's own fingerprint, and its files' identities: a resume refuses a
        // source rewritten in place between the runs (a hostile try's resume mixed two
        // versions of a WebDataset set, the same sizes throughout).
        source_fingerprint: format!("{} files {}", items.fingerprint()?, files.digest()),
        num_sources,
        classes: items.classes().to_vec(),
        payload: if options.raw || (source_raw && options.resize_short_side.is_none()) {
            PayloadKind::RawRgb8
        } else {
            PayloadKind::Encoded
        },
        resize_short_side: items.resized_short_side().or(options.resize_short_side),
        quality: options.quality,
        part,
        restart_markers: options.restart_markers,
        shared_headers: options.shared_headers,
        max_pixels: Some(options.max_pixels),
    })
}

/// Checks the items `todo` on a thread pool a chunk at a time, and commits each chunk, in
/// source order, through `writer` with the progress so far. A producer thread checks chunk
/// k+1 while this thread commits chunk k. Stops at the first rejection when strict, at the
/// first item the source as a whole failed on (before committing its chunk), or when the
/// observer asks (after a commit, so the work done is kept for `--resume`).
#[allow(clippy::too_many_arguments)]
fn write_chunks(
    items: &Source<'_>,
    pool: &rayon::ThreadPool,
    todo: &[usize],
    total: usize,
    out: &Path,
    options: &PackOptions,
    observer: &dyn PackObserver,
    progress: &mut PackProgress,
    writer: &mut dyn DatasetWriter,
) -> Result<()> {
    let chunk_size = options.chunk_size.max(1);
    let (sender, receiver) = crossbeam_channel::bounded::<Vec<Fetched>>(1);
    std::thread::scope(|scope| -> Result<()> {
        scope.spawn(move || {
            for chunk in todo.chunks(chunk_size) {
                let results: Vec<_> = pool.install(|| {
                    chunk
                        .par_iter()
                        .map_init(
                            || PackWorker::new(options.max_pixels),
                            |worker, &index| worker.prepare(items, index, options),
                        )
                        .collect()
                });
                if sender.send(results).is_err() {
                    break; // the committing side stopped (error or strict rejection)
                }
            }
        });
        let result = (|| {
            for (chunk, results) in todo.chunks(chunk_size).zip(receiver.iter()) {
                // An item the source as a whole failed on stops the pack before this chunk.
                let results = results
                    .into_iter()
                    .map(Unfetched::checked)
                    .collect::<Result<Vec<Checked>>>()?;
                let records = accept_chunk(items, chunk, &results, options, observer, progress)?;
                writer.write_chunk(&records, progress)?;
                observer.advanced(progress.sources_done, progress.payload_bytes);
                if observer.should_stop() && progress.sources_done < total {
                    return Err(Error::Interrupted {
                        path: out.to_path_buf(),
                        reason: format!(
                            "stopped after {} of {total} files; the part done is kept in {}: \
                             rerun with --resume to finish",
                            progress.sources_done,
                            partial_path(out).display()
                        ),
                    });
                }
            }
            Ok(())
        })();
        drop(receiver); // unblocks the producer if we stopped early
        result
    })
}

/// Turns one checked chunk into the records to write, counting them and the rejections into
/// `progress`; the first rejection is an error when strict.
fn accept_chunk<'r>(
    items: &Source<'_>,
    chunk: &[usize],
    results: &'r [Checked],
    options: &PackOptions,
    observer: &dyn PackObserver,
    progress: &mut PackProgress,
) -> Result<Vec<PackedRecord<'r>>> {
    let mut records = Vec::with_capacity(chunk.len());
    for (&index, result) in chunk.iter().zip(results) {
        match result {
            Ok((key, label, payload)) => {
                records.push(PackedRecord {
                    label: *label,
                    key,
                    payload,
                });
                progress.payload_bytes += payload.len() as u64;
            }
            Err((key, reason)) => {
                if options.strict {
                    return Err(Error::Rejected {
                        path: items.locate(index, key),
                        reason: reason.clone(),
                    });
                }
                let rejection = Rejection {
                    key: key.clone(),
                    reason: reason.clone(),
                };
                observer.rejected(&rejection);
                progress.rejected.push(rejection);
            }
        }
    }
    progress.samples_written += records.len();
    progress.sources_done += chunk.len();
    Ok(records)
}

/// The summary of a finished pack, also written to [`report_path`]`(out)` (replaced with a
/// rename: an earlier report's path is never followed or written through).
#[allow(clippy::too_many_arguments)]
fn report(
    items: &Source<'_>,
    source: &Path,
    out: &Path,
    format: PackFormat,
    plan: &PackPlan,
    progress: PackProgress,
    resumed_from: usize,
    started: Instant,
) -> Result<PackSummary> {
    let seconds = started.elapsed().as_secs_f64();
    let processed = plan.num_sources - resumed_from;
    let summary = PackSummary {
        source: source.to_path_buf(),
        output: out.to_path_buf(),
        format: format.kind().name().into(),
        samples: progress.samples_written,
        classes: plan.classes.len(),
        payload_bytes: progress.payload_bytes,
        file_bytes: disk_bytes(out),
        dropped_records: match items {
            Source::Folder(_) => 0,
            Source::Records(_) | Source::Joined(_) => progress.rejected.len(),
        },
        rejected: progress.rejected,
        skipped_non_images: match items {
            Source::Folder(f) => f.skipped_files(),
            Source::Records(_) | Source::Joined(_) => 0,
        },
        resumed_from,
        notices: items
            .dataset()
            .map(|d| d.notices().to_vec())
            .unwrap_or_default(),
        seconds,
        images_per_sec: processed as f64 / seconds.max(1e-9),
    };
    write_file_atomically(
        &report_path(out),
        &serde_json::to_vec_pretty(&summary).expect("summary serializes"),
    )?;
    Ok(summary)
}

/// Joins the parts of a split conversion (`--num-parts N --part-index i` runs, in any order)
/// into one dataset at `out`, identical to what an unsplit conversion would have written.
/// Payloads are copied without being decoded again (each part checked its own when packed);
/// `options` supplies the output side (resume/force, threads, shard size, label base).
pub fn join(
    parts: &[PathBuf],
    out: &Path,
    format: PackFormat,
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary> {
    format.require(out)?;
    let joined = JoinedParts::open(parts)?;
    for part in joined.parts() {
        refuse_incomplete_source(part.as_ref(), false)?;
    }
    if options.raw
        || options.resize_short_side.is_some()
        || options.part.is_some()
        || options.restart_markers
    {
        return Err(Error::Config(
            "join copies the parts as they are: --raw, --resize, --restart-markers and \
             --part-index do not apply"
                .into(),
        ));
    }
    pack_source(
        &Source::Joined(&joined),
        joined.path(),
        out,
        format,
        options,
        observer,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_says_how_to_go_on_and_other_errors_stay_as_they_are() {
        let full = Error::io(
            "out.records.partial/shard-00000.tfrecord",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        match full_disk_advice(full) {
            Error::Io { path, source } => {
                assert_eq!(path, Path::new("out.records.partial/shard-00000.tfrecord"));
                assert_eq!(source.kind(), std::io::ErrorKind::StorageFull);
                assert!(source.to_string().contains("--resume"), "{source}");
            }
            other => panic!("{other:?}"),
        }
        let denied = Error::io("out.h5", std::io::Error::from_raw_os_error(libc::EACCES));
        match full_disk_advice(denied) {
            Error::Io { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied);
                assert!(!source.to_string().contains("--resume"));
            }
            other => panic!("{other:?}"),
        }
    }
}
