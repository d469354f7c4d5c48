//! `imagefeed-bench`: throughput measurements. For now `read`: read (and optionally decode)
//! every record of a dataset with N threads, each through its own reader handle.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use imagefeed::decode::Decoder;

#[derive(Parser)]
#[command(
    name = "imagefeed-bench",
    version,
    about = "Measure imagefeed throughput"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Read every record of a dataset (a packed file or an ImageFolder directory).
    Read {
        /// The dataset.
        dataset: PathBuf,
        /// Reader threads; records are split between them in contiguous ranges.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Also decode each payload to RGB.
        #[arg(long)]
        decode: bool,
        /// Passes over the dataset; one line each.
        #[arg(long, default_value_t = 1)]
        epochs: usize,
        /// Evict the dataset's pages from the page cache before each pass (posix_fadvise).
        #[arg(long)]
        cold: bool,
    },
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", imagefeed::error::display_chain(err.as_ref()));
            std::process::ExitCode::from(2)
        }
    }
}

fn run() -> Result<()> {
    match Cli::parse().command {
        Command::Read {
            dataset,
            threads,
            decode,
            epochs,
            cold,
        } => {
            let threads = threads.max(1);
            for epoch in 0..epochs {
                let cache = if cold {
                    let stats = imagefeed::pagecache::evict(&dataset)?;
                    format!(
                        ", cold: {:.1}% of {} files resident at start",
                        stats.resident_fraction() * 100.0,
                        stats.files
                    )
                } else {
                    String::new()
                };
                // Opened after eviction, dropped after the pass: the kernel does not evict pages
                // that this process keeps mapped. Opening is timed too (a folder scans its
                // directories; an LMDB may start streaming into the page cache).
                let start = Instant::now();
                let ds = imagefeed::format::open(&dataset)
                    .with_context(|| format!("opening {}", dataset.display()))?;
                let n = ds.len();
                let bytes = AtomicU64::new(0);
                let bad = AtomicU64::new(0);
                std::thread::scope(|scope| -> Result<()> {
                    let workers: Vec<_> = (0..threads)
                        .map(|t| {
                            let (ds, bytes, bad) = (&ds, &bytes, &bad);
                            scope.spawn(move || -> Result<()> {
                                let mut reader = ds.open_reader()?;
                                let mut decoder = Decoder::new();
                                let mut rgb = Vec::new();
                                let mut local = 0u64;
                                for index in (t * n / threads)..((t + 1) * n / threads) {
                                    // A sample that fails to read or decode is counted, not fatal.
                                    let Ok(record) = reader.read(index) else {
                                        bad.fetch_add(1, Ordering::Relaxed);
                                        continue;
                                    };
                                    local += record.payload.len() as u64;
                                    if decode
                                        && decoder.decode_rgb(record.payload, &mut rgb).is_err()
                                    {
                                        bad.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                                bytes.fetch_add(local, Ordering::Relaxed);
                                Ok(())
                            })
                        })
                        .collect();
                    for w in workers {
                        w.join().expect("reader thread panicked")?;
                    }
                    Ok(())
                })?;
                let secs = start.elapsed().as_secs_f64();
                let mb = bytes.load(Ordering::Relaxed) as f64 / 1e6;
                println!(
                    "read{} {} epoch {epoch}: {n} samples ({} bad), {mb:.1} MB in {secs:.3} s: {:.0} images/s, {:.1} MB/s ({threads} threads{cache})",
                    if decode { "+decode" } else { "" },
                    ds.info().format.name(),
                    bad.load(Ordering::Relaxed),
                    n as f64 / secs,
                    mb / secs
                );
            }
            Ok(())
        }
    }
}
