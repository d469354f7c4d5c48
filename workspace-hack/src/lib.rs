//! Nothing to use: this crate exists for its manifest (see `Cargo.toml`), which makes the
//! library's no-default-features test build ask for the dependency features the workspace's
//! build enables, so that it compiles none of those dependencies again.
