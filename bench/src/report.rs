//! The Markdown table of a [`Report`].

use std::fmt::Write as _;

use crate::compare::{Cache, Report, RunResult, Subject};

/// `12,345`.
pub fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ms(seconds: f64) -> String {
    format!("{:.0}", seconds * 1e3)
}

/// imagefeed's median over PyTorch's, for the same workers and cache.
fn versus_pytorch(report: &Report, r: &RunResult) -> Option<f64> {
    if r.subject == Subject::Pytorch {
        return None;
    }
    let torch = report.find(Subject::Pytorch, r.workers, r.cache)?;
    (torch.median > 0.0).then(|| r.median / torch.median)
}

pub fn markdown(report: &Report) -> String {
    let mut md = String::new();
    let mean_kb = report.mean_payload_bytes() / 1e3;
    let _ = writeln!(
        md,
        "### {}: {} images ({:.1} MB, {mean_kb:.1} KB each), transform `{}`, batch {}, f32 NCHW\n",
        report.source.display(),
        thousands(report.samples as f64),
        report.payload_bytes as f64 / 1e6,
        match report.transform {
            crate::compare::CompareTransform::Cifar => "cifar (flip + normalize)",
            crate::compare::CompareTransform::CifarTrain =>
                "cifar-train (RandomCrop 32 padding 4 + flip + normalize)",
            crate::compare::CompareTransform::ImagenetRef =>
                "imagenet-ref (RandomResizedCrop 176 + flip + TrivialAugmentWide + normalize + \
                 RandomErasing 0.1, then MixUp 0.2 / CutMix 1.0 on the batch)",
            crate::compare::CompareTransform::Imagenet =>
                "imagenet (RandomResizedCrop 224 + flip + normalize)",
            crate::compare::CompareTransform::ImagenetTimm =>
                "imagenet-timm (RandomResizedCrop 224 + flip + timm RandAugment \
                 rand-m9-mstd0.5-inc1 + normalize)",
        },
        report.batch_size,
    );
    let _ = writeln!(
        md,
        "{}; {}. Median of {} timed epochs after one warm-up epoch (range in brackets). \
         Decode ceiling: {} images/s per thread (libjpeg-turbo, full size; measured before and \
         after the runs: {}; the higher is used) × workers. Measured with N threads decoding \
         at once: {}.\n",
        report.machine,
        report.date,
        report.epochs,
        thousands(report.ceiling_per_thread_used),
        report
            .ceiling_per_thread
            .iter()
            .map(|v| thousands(*v))
            .collect::<Vec<_>>()
            .join(" / "),
        report
            .measured_decode
            .iter()
            .filter(|m| m.threads > 1)
            .map(|m| format!("{} threads {}", m.threads, thousands(m.used)))
            .collect::<Vec<_>>()
            .join(", "),
    );
    let _ = writeln!(md, "```sh\n{}\n```\n", report.command);
    let _ = writeln!(
        md,
        "| loader | workers | cache | images/s (median) | range | MB/s | of ceiling | of N-thread decode | vs PyTorch | read / decode / transform / collate ms per epoch | waited ms | peak memory MB (anon) |"
    );
    let _ = writeln!(
        md,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for r in &report.results {
        let stages = r.stages.as_ref().map_or("–".into(), |s| {
            format!(
                "{} / {} / {} / {}",
                ms(s.read),
                ms(s.decode),
                ms(s.transform),
                s.collate.map_or("–".into(), ms)
            )
        });
        let waited = r.stages.as_ref().map_or("–".into(), |s| ms(s.wait));
        let _ = writeln!(
            md,
            "| {} | {} | {} | **{}** | {}–{} | {:.1} | {:.0}% | {:.0}% | {} | {} | {} | {:.0} ({:.0}) |",
            r.subject.label(),
            r.workers,
            r.cache.name(),
            thousands(r.median),
            thousands(r.min),
            thousands(r.max),
            r.mb_per_s,
            100.0 * r.ceiling_share,
            100.0 * r.measured_share,
            versus_pytorch(report, r).map_or("–".into(), |x| format!("{x:.1}×")),
            stages,
            waited,
            r.peak_pss_mb,
            r.peak_anon_mb,
        );
    }
    for (what, why) in &report.failures {
        let _ = writeln!(md, "| {what}: **failed** ({why}) | | | | | | | | | | | |");
    }
    // Packed formats against the raw folder, cold and warm.
    let mut ratios = Vec::new();
    for cache in [Cache::Warm, Cache::Cold] {
        for r in report.results.iter().filter(|r| r.cache == cache) {
            if matches!(r.subject, Subject::Folder | Subject::Pytorch) {
                continue;
            }
            if let Some(folder) = report.find(Subject::Folder, r.workers, cache)
                && folder.median > 0.0
            {
                ratios.push(format!(
                    "{} / raw folder, {} workers, {}: {:.1}×",
                    r.subject.name(),
                    r.workers,
                    cache.name(),
                    r.median / folder.median
                ));
            }
        }
    }
    if !ratios.is_empty() {
        let _ = writeln!(
            md,
            "\nPacked vs raw folder (imagefeed both): {}.",
            ratios.join("; ")
        );
    }
    let _ = writeln!(
        md,
        "\nStage times are summed over workers, per epoch. PyTorch's are measured inside \
         `__getitem__` (read = the file read, decode = PIL open + convert to RGB, transform = \
         the torchvision transforms); its collate is not split out. Peak memory is the \
         proportional set size of the loader's process and all its worker processes, sampled \
         every 50 ms (for imagefeed, at least its own peak RSS); for imagefeed it includes the \
         mapped pages of the dataset file, which the kernel can drop."
    );
    for note in &report.notes {
        let _ = writeln!(md, "\nNote: {note}");
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(1234567.0), "1,234,567");
    }
}
