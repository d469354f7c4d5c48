//! The decode ceiling: how fast libjpeg-turbo decodes the dataset's own payloads, full size,
//! nothing else, payloads already in memory. Loader throughput is quoted as a fraction of the
//! one-thread rate × threads (the ideal), and of the rate N threads really reach together on
//! this machine (which is lower where cores are shared, e.g. hyper-threads of a small VM).

use std::time::Instant;

use anyhow::Result;
use imagefeed::Dataset;
use imagefeed::decode::Decoder;

/// The first `samples` payloads (all of them when `None`).
pub fn payloads(dataset: &dyn Dataset, samples: Option<usize>) -> Result<Vec<Vec<u8>>> {
    let n = samples.unwrap_or(dataset.len()).min(dataset.len());
    let mut reader = dataset.open_reader()?;
    (0..n)
        .map(|i| Ok(reader.read(i)?.payload.to_vec()))
        .collect()
}

/// Each measurement decodes for at least this long (whole passes over the payloads), so small
/// images are not timed over a few milliseconds.
const MIN_SECONDS: f64 = 0.5;

/// Images per second of `threads` threads decoding the payloads at the same time, each thread
/// making whole passes until [`MIN_SECONDS`] have gone by (after an untimed warm-up over the
/// first 64).
pub fn decode_rate(payloads: &[Vec<u8>], threads: usize) -> Result<f64> {
    let threads = threads.max(1);
    let barrier = std::sync::Barrier::new(threads);
    let start = std::sync::OnceLock::new();
    let decoded: Vec<Result<usize>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let (barrier, start) = (&barrier, &start);
                scope.spawn(move || -> Result<usize> {
                    let mut decoder = Decoder::new();
                    let mut rgb = Vec::new();
                    for p in payloads.iter().take(64) {
                        let _ = decoder.decode_rgb(p, &mut rgb);
                    }
                    barrier.wait();
                    let started = *start.get_or_init(Instant::now);
                    let mut decoded = 0usize;
                    loop {
                        for (i, p) in payloads.iter().enumerate() {
                            if decoder.decode_rgb(p, &mut rgb).is_ok() {
                                decoded += 1;
                            } else if decoded == 0 && i > 64 {
                                anyhow::bail!("no payload decodes");
                            }
                        }
                        if decoded == 0 || started.elapsed().as_secs_f64() >= MIN_SECONDS {
                            break;
                        }
                    }
                    Ok(decoded)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("decode thread panicked"))
            .collect()
    });
    // Every thread ran whole passes past the minimum; the wall time is until the last one
    // stopped.
    let secs = start.get().map_or(f64::NAN, |s| s.elapsed().as_secs_f64());
    let mut total = 0;
    for d in decoded {
        total += d?;
    }
    Ok(total as f64 / secs)
}

/// Both decode references at one moment: one thread alone, and `threads` threads at once.
#[derive(Debug, Clone, Copy)]
pub struct References {
    /// Images/s of one thread.
    pub one_thread: f64,
    /// Images/s of `threads` threads together (the one-thread rate when `threads` is 1).
    pub n_threads: f64,
}

impl References {
    /// Measures both, one after the other.
    pub fn measure(payloads: &[Vec<u8>], threads: usize) -> Result<References> {
        let one_thread = decode_rate(payloads, 1)?;
        let n_threads = if threads > 1 {
            decode_rate(payloads, threads)?
        } else {
            one_thread
        };
        Ok(References {
            one_thread,
            n_threads,
        })
    }
}
