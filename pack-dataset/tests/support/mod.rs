//! Helpers shared by the `pack-dataset` integration tests (cli.rs, kill_loop.rs).
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `pack-dataset` binary under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pack-dataset"))
}

/// Where a pack of `out` is staged while it runs (`OUT.partial`).
pub fn partial(out: &Path) -> PathBuf {
    imagefeed::format::staging::partial_path(out)
}

/// Copies `src` to `dst`: a file, or a directory with everything under it.
pub fn copy_path(src: &Path, dst: &Path) {
    if !src.is_dir() {
        std::fs::copy(src, dst).unwrap();
        return;
    }
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        copy_path(&entry.path(), &dst.join(entry.file_name()));
    }
}
