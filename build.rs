//! Build-time configuration:
//! - which generation of libhdf5's API the HDF5 reader is built against: libhdf5 2 replaced
//!   `H5Dread_chunk` (and leaves the old one out unless built with deprecated symbols, as the
//!   Python wheel's bundled copy is). `hdf5-metno-sys` reports the version it found as
//!   `DEP_HDF5_VERSION_*` build metadata.
//! - `guarded_touch`: targets where `mapguard` has its assembly routine and SIGBUS handler
//!   (Linux on x86-64 and AArch64).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(hdf5_read_chunk2)");
    println!("cargo::rerun-if-env-changed=DEP_HDF5_VERSION_2_0_0");
    if std::env::var_os("DEP_HDF5_VERSION_2_0_0").is_some() {
        println!("cargo::rustc-cfg=hdf5_read_chunk2");
    }
    println!("cargo::rustc-check-cfg=cfg(guarded_touch)");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if os == "linux" && (arch == "x86_64" || arch == "aarch64") {
        println!("cargo::rustc-cfg=guarded_touch");
    }
}
