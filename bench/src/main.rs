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
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Read {
            dataset,
            threads,
            decode,
            epochs,
        } => {
            let ds = imagefeed::format::open(&dataset)
                .with_context(|| format!("opening {}", dataset.display()))?;
            let n = ds.len();
            let threads = threads.max(1);
            for epoch in 0..epochs {
                let bytes = AtomicU64::new(0);
                let bad = AtomicU64::new(0);
                let start = Instant::now();
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
                    "read{} {} epoch {epoch}: {n} samples ({} bad), {mb:.1} MB in {secs:.3} s: {:.0} images/s, {:.1} MB/s ({threads} threads)",
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
