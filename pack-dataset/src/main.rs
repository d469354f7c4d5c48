//! The `pack-dataset` binary: the command line of the `pack_dataset` library.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(pack_dataset::main_with(std::env::args_os().collect()))
}
