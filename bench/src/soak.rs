//! `imagefeed-bench soak`: many epochs of one loader over a dataset holding bad samples, checking
//! what a week-long run relies on (issue: reliability):
//!
//! - resident memory stays flat: the last epoch's RSS within 5% of the RSS after the first
//!   checked epoch (by then every path, including a reference loader and a resumed one, has run
//!   once and the allocator holds its working set; a leak shows as growth after it);
//! - bounded batch memory: the pool never holds more buffers than `prefetch` (the loader's
//!   default, 4), the most batches in flight when each batch is dropped before the next is asked
//!   for, as here; a buffer that never went back would push it past the bound within a few
//!   epochs. (How many of those it reaches, and in which epoch, depends on thread timing: an
//!   early epoch whose workers never got ahead may use 2 and a later one 4.)
//! - determinism: every `--check-every` epochs, the epoch's digest equals that of the same epoch
//!   from a one-worker, prefetch-1 loader;
//! - exact resume: at the same epochs, a new loader resumed from the state saved before a random
//!   batch delivers exactly the rest of the stream.
//!
//! Prints one line per epoch (RSS, pool buffers, bad samples, digest) and exits with an error
//! naming the first broken promise.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Result, bail};
use imagefeed::batch::Batch;
use imagefeed::loader::{BadSamplePolicy, Loader, LoaderConfig};
use imagefeed::rng::SampleRng;
use imagefeed::transform::Transform;
use sha2::{Digest as _, Sha256};

/// Arguments of `soak`.
#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    /// The dataset (any format imagefeed reads).
    pub dataset: PathBuf,
    /// Epochs to run.
    #[arg(long, default_value_t = 100)]
    pub epochs: u64,
    /// Worker threads.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Batch size.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Seed of the loader and of the resume points.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Check determinism and resume every this many epochs.
    #[arg(long, default_value_t = 10)]
    pub check_every: u64,
    /// Largest allowed growth of resident memory from the first to the last epoch, in percent.
    #[arg(long, default_value_t = 5.0)]
    pub max_rss_growth: f64,
}

fn hash_batch(hasher: &mut Sha256, batch: &Batch) {
    for d in batch.shape {
        hasher.update((d as u64).to_le_bytes());
    }
    hasher.update(batch.bytes());
    for (&label, &sample) in batch.labels.iter().zip(&batch.samples) {
        hasher.update(label.to_le_bytes());
        hasher.update((sample as u64).to_le_bytes());
    }
}

fn hex(hasher: Sha256) -> String {
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The digest of every batch of `epoch` from `loader`.
fn epoch_digest(loader: &Loader, epoch: u64) -> Result<String> {
    let mut hasher = Sha256::new();
    for batch in loader.epoch(epoch) {
        hash_batch(&mut hasher, &batch?);
    }
    Ok(hex(hasher))
}

/// Runs the soak; see the module docs.
pub fn soak(args: &SoakArgs) -> Result<()> {
    let dataset = imagefeed::format::open(&args.dataset)?;
    let config = LoaderConfig::default()
        .with_batch_size(args.batch_size)
        .with_workers(args.workers)
        .with_seed(args.seed)
        .with_shuffle(true)
        .with_transform(Transform::cifar())
        .with_bad_samples(BadSamplePolicy::Replace)
        .with_max_bad(None);
    let loader = Loader::new(Arc::clone(&dataset), config.clone())?;
    let reference = Loader::new(
        Arc::clone(&dataset),
        config.clone().with_workers(1).with_prefetch(1),
    )?;
    // A second loader of the same configuration, reused for every resume check (a new one each
    // time would be what a restarted trainer does, but would add its startup to the RSS curve).
    let resumed = Loader::new(Arc::clone(&dataset), config.clone())?;
    let batches = loader.batches_per_epoch();
    let mut points = SampleRng::new(args.seed, 0, 0x50a4);
    let (mut first_rss, mut last_rss) = (0.0f64, 0.0f64);
    let pool_bound = config.prefetch as u64;
    let mut pool_most = 0u64;
    let mut checks = 0;
    println!(
        "soak: {} ({} samples), {} epochs, {} workers, batch {}, replace policy",
        args.dataset.display(),
        dataset.len(),
        args.epochs,
        args.workers,
        args.batch_size
    );
    for epoch in 0..args.epochs {
        let check = args.check_every > 0 && epoch % args.check_every == args.check_every - 1;
        let resume_at = points.below(batches.max(1) as u64) as usize;
        let (mut all, mut rest) = (Sha256::new(), Sha256::new());
        let mut saved = None;
        let mut bad = 0;
        let mut iter = loader.epoch(epoch);
        let mut n = 0;
        loop {
            if check && n == resume_at {
                saved = Some(iter.state());
            }
            let Some(batch) = iter.next() else { break };
            let batch = batch?;
            bad += batch.bad.len();
            hash_batch(&mut all, &batch);
            if n >= resume_at {
                hash_batch(&mut rest, &batch);
            }
            n += 1;
        }
        let digest = hex(all);
        let mut checked = String::new();
        if check {
            let want = epoch_digest(&reference, epoch)?;
            if want != digest {
                bail!(
                    "epoch {epoch}: {} workers gave digest {digest}, 1 worker {want}",
                    args.workers
                );
            }
            let state = saved.expect("resume point inside the epoch");
            let mut hasher = Sha256::new();
            for batch in resumed.resume(&state)? {
                hash_batch(&mut hasher, &batch?);
            }
            if hex(hasher) != hex(rest) {
                bail!("epoch {epoch}: resuming before batch {resume_at} gave another stream");
            }
            checks += 1;
            checked = format!(", checked (resume at batch {resume_at})");
        }
        let rss = crate::memory_mb().0;
        let pool = loader.pool().allocations();
        pool_most = pool_most.max(pool);
        if check && first_rss == 0.0 {
            first_rss = rss;
        }
        last_rss = rss;
        println!(
            "epoch {epoch}: rss {rss:.1} MB, pool buffers {pool}, bad {bad}, digest {}{checked}",
            &digest[..16]
        );
        if pool > pool_bound {
            bail!(
                "epoch {epoch}: the pool allocated {pool} buffers, over its bound of {pool_bound} \
                 (prefetch)"
            );
        }
    }
    let growth = if first_rss > 0.0 {
        (last_rss - first_rss) / first_rss * 100.0
    } else {
        0.0
    };
    println!(
        "soak: rss {first_rss:.1} MB after the first check, {last_rss:.1} MB at the end ({growth:+.1}%); \
         pool {pool_most} buffers at most (bound {pool_bound}); {checks} determinism and resume checks passed"
    );
    if growth > args.max_rss_growth {
        bail!(
            "resident memory grew {growth:.1}% (over {}%)",
            args.max_rss_growth
        );
    }
    Ok(())
}
