//! Nothing to build: the build-dependencies in `Cargo.toml` are here for the features they ask
//! for on the host (see there).

fn main() {}
