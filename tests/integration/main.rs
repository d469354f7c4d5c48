//! The integration tests, one module per feature, linked into one test binary.
//!
//! Each file of `tests/` is its own executable that links the whole library (object_store,
//! libhdf5, libjpeg-turbo): one binary instead of thirteen saves thirteen links per build
//! configuration and about 1.5 GB of disk per `make test` (a CI run once ran out of disk while
//! linking them). Run one feature with `cargo test --test integration loader::`.
//!
//! Kept as executables of their own, because they need a process to themselves: `corrupt`
//! (its own harness, a child process per damaged copy), `hdf5_fork` (forks while other threads
//! hold libhdf5) and `gpu` (one thread, on whatever CUDA driver the process loads).

#[path = "../support/mod.rs"]
mod support;

mod compat;
mod decode;
mod fixtures;
mod formats;
mod hdf5_filters;
mod loader;
mod mapped_files;
mod memory_limit;
mod object_storage;
mod pack;
mod readers;
mod shard_sets;
mod shard_window;
mod value_bounds;
mod webdataset;
