//! The PNG chart of a [`Report`]: images/s per configuration as bars on
//! a log scale, one panel per page-cache state, grouped by worker count, with the decode ceiling
//! (one thread × workers) drawn across each group.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::compare::{Cache, Report, Subject};
use crate::report::thousands;

const SUBJECTS: [Subject; 5] = [
    Subject::Folder,
    Subject::Lmdb,
    Subject::Hdf5,
    Subject::Records,
    Subject::Pytorch,
];

fn color(subject: Subject) -> RGBColor {
    match subject {
        Subject::Folder => RGBColor(140, 140, 140),
        Subject::Lmdb => RGBColor(31, 119, 180),
        Subject::Hdf5 => RGBColor(44, 160, 44),
        Subject::Records => RGBColor(148, 103, 189),
        Subject::Pytorch => RGBColor(238, 76, 44),
    }
}

/// Powers of ten around `[lo, hi]`.
fn log_bounds(lo: f64, hi: f64) -> (f64, f64) {
    let lo = 10f64.powf(lo.max(1e-3).log10().floor());
    let hi = 10f64.powf((hi * 1.5).max(lo * 10.0).log10().ceil());
    (lo, hi)
}

pub fn draw(report: &Report, path: &Path) -> Result<()> {
    let caches: Vec<Cache> = [Cache::Warm, Cache::Cold]
        .into_iter()
        .filter(|c| report.results.iter().any(|r| r.cache == *c))
        .collect();
    if caches.is_empty() {
        return Err(anyhow!("no results to draw"));
    }
    let subjects: Vec<Subject> = SUBJECTS
        .into_iter()
        .filter(|s| report.results.iter().any(|r| r.subject == *s))
        .collect();
    let mut workers: Vec<usize> = report.results.iter().map(|r| r.workers).collect();
    workers.sort_unstable();
    workers.dedup();
    let ceiling = |w: usize| report.ceiling_per_thread_used * w as f64;
    let lowest = report
        .results
        .iter()
        .map(|r| r.min)
        .fold(f64::MAX, f64::min);
    let highest = report
        .results
        .iter()
        .map(|r| r.max)
        .chain(workers.iter().map(|&w| ceiling(w)))
        .fold(0.0, f64::max);
    let (y_lo, y_hi) = log_bounds(lowest / 1.5, highest);

    let width = 520 * caches.len() as u32 + 40;
    // Legend entries, wrapped to rows that fit the width.
    let mut legend = Vec::new();
    let (mut x, mut y) = (50, 8);
    for &subject in &subjects {
        let step = 32 + 8 * subject.label().len() as i32;
        if x > 50 && x + step > width as i32 - 10 {
            (x, y) = (50, y + 24);
        }
        legend.push((subject, x, y));
        x += step;
    }
    let height = 40 + 470 + y as u32 + 30;
    crate::png_canvas::draw_png(path, (width, height), |root| {
        let title = format!(
            "{}: {} images, transform {}, batch {}",
            report.source.file_name().map_or_else(
                || report.source.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            thousands(report.samples as f64),
            match report.transform {
                crate::compare::CompareTransform::Cifar => "cifar",
                crate::compare::CompareTransform::CifarTrain => "RandomCrop 32 pad 4",
                crate::compare::CompareTransform::Imagenet => "RandomResizedCrop 224",
                crate::compare::CompareTransform::ImagenetRef => "reference recipe (RRC 176 + TA)",
                crate::compare::CompareTransform::ImagenetTimm => "timm recipe (RRC 224 + timm RA)",
            },
            report.batch_size
        );
        let (top, body) = root.split_vertically(40);
        top.titled(&title, ("sans-serif", 22))
            .map_err(|e| anyhow!("{e}"))?;
        let (panels_area, legend_area) = body.split_vertically(470);
        let panels = panels_area.split_evenly((1, caches.len()));
        let groups = workers.len() as f64;
        let slot = 1.0 / (subjects.len() as f64 + 1.0);
        for (panel, cache) in panels.iter().zip(&caches) {
            let mut chart = ChartBuilder::on(panel)
                .caption(format!("{} page cache", cache.name()), ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(70)
                .build_cartesian_2d(0f64..groups, (y_lo..y_hi).log_scale())
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .disable_x_axis()
                .y_desc("images/s (log scale)")
                .y_label_formatter(&|v| thousands(*v))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            for (g, &w) in workers.iter().enumerate() {
                let x0 = g as f64;
                for (k, &subject) in subjects.iter().enumerate() {
                    let Some(r) = report.find(subject, w, *cache) else {
                        continue;
                    };
                    let left = x0 + slot * (k as f64 + 0.5) + 0.02 * slot;
                    let right = left + 0.96 * slot;
                    chart
                        .draw_series(std::iter::once(Rectangle::new(
                            [(left, y_lo), (right, r.median.max(y_lo))],
                            color(subject).filled(),
                        )))
                        .map_err(|e| anyhow!("{e}"))?;
                    // The range of the epochs, as a thin whisker.
                    let mid = (left + right) / 2.0;
                    chart
                        .draw_series(std::iter::once(PathElement::new(
                            vec![(mid, r.min.max(y_lo)), (mid, r.max.max(y_lo))],
                            BLACK.stroke_width(1),
                        )))
                        .map_err(|e| anyhow!("{e}"))?;
                    let label = if r.median >= 10_000.0 {
                        format!("{:.0}k", r.median / 1e3)
                    } else {
                        thousands(r.median)
                    };
                    chart
                        .draw_series(std::iter::once(Text::new(
                            label,
                            (mid, r.max.max(r.median) * 1.04),
                            ("sans-serif", 12)
                                .into_font()
                                .color(&BLACK)
                                .pos(Pos::new(HPos::Center, VPos::Bottom)),
                        )))
                        .map_err(|e| anyhow!("{e}"))?;
                }
                // The ceiling across the group.
                let c = ceiling(w);
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(x0 + 0.03, c), (x0 + 0.97, c)],
                        BLACK.stroke_width(2),
                    )))
                    .map_err(|e| anyhow!("{e}"))?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        format!("decode ceiling {}", thousands(c)),
                        (x0 + 0.05, c * 1.04),
                        ("sans-serif", 12)
                            .into_font()
                            .color(&BLACK)
                            .pos(Pos::new(HPos::Left, VPos::Bottom)),
                    )))
                    .map_err(|e| anyhow!("{e}"))?;
                // What `w` threads decoding at once really reach here (dashed, grey).
                let measured = report.measured_decode_rate(w);
                if w > 1 && measured < c * 0.98 {
                    let grey = RGBColor(110, 110, 110);
                    let dashes = (0..24).map(|i| {
                        let a = x0 + 0.03 + 0.94 * i as f64 / 24.0;
                        PathElement::new(
                            vec![(a, measured), (a + 0.94 / 48.0, measured)],
                            grey.stroke_width(2),
                        )
                    });
                    chart.draw_series(dashes).map_err(|e| anyhow!("{e}"))?;
                    // Labelled at the group's right end, under the line (the PyTorch bar's place,
                    // far below).
                    chart
                        .draw_series(std::iter::once(Text::new(
                            format!("{w} threads at once {}", thousands(measured)),
                            (x0 + 0.97, measured / 1.04),
                            ("sans-serif", 11)
                                .into_font()
                                .color(&grey)
                                .pos(Pos::new(HPos::Right, VPos::Top)),
                        )))
                        .map_err(|e| anyhow!("{e}"))?;
                }
                // The group's name under the axis, in pixels below the plot's bottom edge.
                let (px, py) = chart.backend_coord(&(x0 + 0.5, y_lo));
                let text = format!("{w} worker{}", if w == 1 { "" } else { "s" });
                root.draw(&Text::new(
                    text,
                    (px - 30, py + 8),
                    ("sans-serif", 15).into_font().color(&BLACK),
                ))
                .map_err(|e| anyhow!("{e}"))?;
            }
        }
        // Legend: one swatch per loader.
        for &(subject, x, y) in &legend {
            legend_area
                .draw(&Rectangle::new(
                    [(x, y), (x + 16, y + 16)],
                    color(subject).filled(),
                ))
                .map_err(|e| anyhow!("{e}"))?;
            legend_area
                .draw(&Text::new(
                    subject.label(),
                    (x + 22, y),
                    ("sans-serif", 15).into_font().color(&BLACK),
                ))
                .map_err(|e| anyhow!("{e}"))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_bounds_are_powers_of_ten_around_the_data() {
        assert_eq!(log_bounds(3_400.0, 95_000.0), (1_000.0, 1_000_000.0));
        assert_eq!(log_bounds(250.0, 1_100.0), (100.0, 10_000.0));
    }
}
