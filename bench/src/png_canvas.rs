//! A drawing area in memory that is written out as a PNG: the charts draw with plotters into
//! an RGB buffer and the `image` crate (which the library already builds) encodes it, so the
//! bench does not compile plotters' own encoder and the older `image` release it depends on.

use std::path::Path;

use anyhow::{Context as _, Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;

/// Calls `draw` on a white `width` × `height` canvas, then writes the canvas to `path` as a
/// PNG.
pub fn draw_png(
    path: &Path,
    (width, height): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()>,
) -> Result<()> {
    let mut pixels = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        draw(&root)?;
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    image::save_buffer_with_format(
        path,
        &pixels,
        width,
        height,
        image::ExtendedColorType::Rgb8,
        image::ImageFormat::Png,
    )
    .with_context(|| format!("writing {}", path.display()))
}
