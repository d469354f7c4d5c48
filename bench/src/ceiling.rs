//! The decode ceiling: how fast one thread of libjpeg-turbo decodes the dataset's own payloads,
//! full size, nothing else. Loader throughput is quoted as a fraction of this rate × threads.

use std::time::Instant;

use anyhow::Result;
use imagefeed::Dataset;
use imagefeed::decode::Decoder;

/// Images per second for one thread decoding `samples` payloads (all of them when `None`),
/// with the payloads read into memory first so only decoding is timed.
pub fn single_thread_decode_rate(dataset: &dyn Dataset, samples: Option<usize>) -> Result<f64> {
    let n = samples.unwrap_or(dataset.len()).min(dataset.len());
    let mut reader = dataset.open_reader()?;
    let mut payloads = Vec::with_capacity(n);
    for i in 0..n {
        payloads.push(reader.read(i)?.payload.to_vec());
    }
    let mut decoder = Decoder::new();
    let mut rgb = Vec::new();
    // One untimed pass warms caches and the decoder.
    for p in payloads.iter().take(64) {
        let _ = decoder.decode_rgb(p, &mut rgb);
    }
    let start = Instant::now();
    let mut decoded = 0usize;
    for (i, p) in payloads.iter().enumerate() {
        if decoder.decode_rgb(p, &mut rgb).is_ok() {
            decoded += 1;
        } else if decoded == 0 && i > 64 {
            anyhow::bail!("no payload decodes");
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(decoded as f64 / secs)
}
