//! Tells the HDF5 reader which generation of libhdf5's API it is built against: libhdf5 2
//! replaced `H5Dread_chunk` (and leaves the old one out unless built with deprecated symbols,
//! as the Python wheel's bundled copy is). `hdf5-metno-sys` reports the version it found as
//! `DEP_HDF5_VERSION_*` build metadata.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(hdf5_read_chunk2)");
    println!("cargo::rerun-if-env-changed=DEP_HDF5_VERSION_2_0_0");
    if std::env::var_os("DEP_HDF5_VERSION_2_0_0").is_some() {
        println!("cargo::rustc-cfg=hdf5_read_chunk2");
    }
}
