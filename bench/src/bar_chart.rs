//! `imagefeed-bench bar-chart`: labelled values as a PNG of horizontal bars, for the benchmark
//! scripts that measure outside `compare` (bench/object_storage.sh). Each bar is annotated
//! with its value; bars of one colour group share a colour.

use std::path::Path;

use anyhow::{Context as _, Result, anyhow, bail};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::thousands;

/// One bar: its label, its value, and its colour group.
pub struct Bar {
    pub label: String,
    pub value: f64,
    pub group: String,
}

impl Bar {
    /// Parses `GROUP:LABEL=VALUE` (or `LABEL=VALUE`, group empty).
    pub fn parse(text: &str) -> Result<Bar> {
        let (name, value) = text
            .rsplit_once('=')
            .ok_or_else(|| anyhow!("{text:?}: a bar is LABEL=VALUE or GROUP:LABEL=VALUE"))?;
        let value: f64 = value
            .trim()
            .parse()
            .with_context(|| format!("{text:?}: the value is not a number"))?;
        if !value.is_finite() || value < 0.0 {
            bail!("{text:?}: the value must be a finite number >= 0");
        }
        let (group, label) = name.split_once(':').unwrap_or(("", name));
        Ok(Bar {
            label: label.to_string(),
            value,
            group: group.to_string(),
        })
    }
}

const PALETTE: [RGBColor; 4] = [
    RGBColor(140, 140, 140),
    RGBColor(31, 119, 180),
    RGBColor(148, 103, 189),
    RGBColor(238, 76, 44),
];

/// Draws `bars` top to bottom under `title`, the axis named `unit`, into `path`.
pub fn draw(title: &str, unit: &str, bars: &[Bar], path: &Path) -> Result<()> {
    if bars.is_empty() {
        bail!("no bars to draw");
    }
    let mut groups: Vec<&str> = Vec::new();
    for bar in bars {
        if !groups.contains(&bar.group.as_str()) {
            groups.push(&bar.group);
        }
    }
    let highest = bars.iter().map(|b| b.value).fold(0.0, f64::max).max(1.0);
    let n = bars.len();
    let height = 90 + 28 * n as u32;
    crate::png_canvas::draw_png(path, (900, height), |root| {
        let mut chart = ChartBuilder::on(root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(300)
            .build_cartesian_2d(0f64..highest * 1.18, (0..n).into_segmented())
            .map_err(|e| anyhow!("{e}"))?;
        // Bar i is drawn at row n - 1 - i, so the first bar is at the top.
        let label_of = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(row) if *row < n => bars[n - 1 - row].label.clone(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n)
            .y_label_formatter(&label_of)
            .x_desc(unit)
            .x_label_formatter(&|v| thousands(*v))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        for (i, bar) in bars.iter().enumerate() {
            let row = n - 1 - i;
            let group = groups.iter().position(|g| *g == bar.group).unwrap_or(0);
            let color = PALETTE[group % PALETTE.len()];
            chart
                .draw_series(std::iter::once({
                    let mut rectangle = Rectangle::new(
                        [
                            (0.0, SegmentValue::Exact(row)),
                            (bar.value, SegmentValue::Exact(row + 1)),
                        ],
                        color.filled(),
                    );
                    rectangle.set_margin(4, 4, 0, 0);
                    rectangle
                }))
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!(" {}", thousands(bar.value)),
                    (bar.value, SegmentValue::CenterOf(row)),
                    ("sans-serif", 14)
                        .into_font()
                        .color(&BLACK)
                        .pos(Pos::new(HPos::Left, VPos::Center)),
                )))
                .map_err(|e| anyhow!("{e}"))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_parse_with_and_without_a_group_and_refuse_bad_values() {
        let bar = Bar::parse("s3 50 ms:global, epochs 1-4=1796.5").unwrap();
        assert_eq!(
            (bar.group.as_str(), bar.label.as_str(), bar.value),
            ("s3 50 ms", "global, epochs 1-4", 1796.5)
        );
        assert_eq!(Bar::parse("local=10").unwrap().group, "");
        for bad in ["no value", "x=abc", "x=-1", "x=inf", "x=NaN"] {
            assert!(Bar::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn draws_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bars.png");
        let bars: Vec<Bar> = ["local:global=1800", "s3:global=1750", "s3:window=0"]
            .iter()
            .map(|t| Bar::parse(t).unwrap())
            .collect();
        draw("test", "images/s", &bars, &path).unwrap();
        let png = image::open(&path).unwrap().to_rgb8();
        assert_eq!(png.dimensions(), (900, 90 + 28 * 3));
        // Each group's bars are drawn in its colour: "local" the first, "s3" the second.
        for RGBColor(r, g, b) in &PALETTE[..2] {
            assert!(png.pixels().any(|p| p.0 == [*r, *g, *b]), "{r},{g},{b}");
        }
        assert!(!png.pixels().any(|p| p.0 == [238, 76, 44]));
        assert!(draw("empty", "images/s", &[], &path).is_err());
    }
}
