//! The GPU feed (feature `cuda`): page-locked batch memory, asynchronous double-buffered
//! host-to-device copies on a copy stream, and normalization on the GPU.
//!
//! ```text
//! loader workers ─▶ u8 NHWC batch in page-locked memory (PinnedAllocator, via the pool)
//!   ─▶ copy stream: wait(slot released) · memcpy H2D · normalize kernel → f32/f16 NCHW/NHWC
//!      · record(slot ready)
//!   ─▶ trainer's stream: wait(slot ready) · the training step · record(slot released)
//! ```
//!
//! Guarantees:
//! - the trainer's stream waits only for the copy and conversion of the batch it is given
//!   (an event), never for the whole device;
//! - a device slot is overwritten only after the trainer's stream has finished the step that
//!   used it (an event recorded when the next batch is asked for);
//! - a host batch returns to the pool only after its copy has completed;
//! - PCIe carries `u8` (4× fewer bytes than `f32`); the GPU converts, with the same arithmetic
//!   as the CPU [`SlotWriter`](crate::transform::SlotWriter), rounded the same way (a rounded
//!   multiply, then a rounded add; no fused multiply-add), so the batches are meant to be
//!   bit-identical (asserted by the GPU tests, which have not yet run on a GPU);
//! - what this module does on a caller's thread without being asked to work there (opening a
//!   device, allocating and freeing page-locked memory, dropping a [`Gpu`] or a
//!   [`PinnedAllocator`]) leaves the thread's current CUDA context as it was, so PyTorch's
//!   current device does not move. cudarc's safe calls make the context current themselves;
//!   code making raw driver calls makes it current first (`gpu.context().bind_to_thread()`).
//!
//! CUDA is loaded at run time (cudarc's dynamic loading): on a machine without the driver or a
//! device, [`Gpu::open`] returns [`Error::Cuda`] saying which, and nothing panics.
//!
//! The kernels ship as PTX (`src/gpu/kernels.ptx`, ISA 8.0 for compute_70, made from
//! `kernels.cu` by `scripts/make_ptx.py` with NVRTC): no CUDA compiler at build or run time;
//! the driver (525 or newer) compiles it for the GPU it finds.

use cudarc::driver::DriverError;

use crate::error::Error;

/// The cudarc this module is built on, for code that drives the same context (streams,
/// kernels) without a version mismatch.
pub use cudarc;

pub mod blas;
mod context;
mod device;
mod pinned;
mod prefetch;

pub use device::{Gpu, device_count, unavailable_reason};
pub use pinned::{PinnedAllocator, PinnedBuffer};
pub use prefetch::{DeviceBatch, DeviceOutput, PrefetchStats, Prefetcher};

/// The kernels, as PTX text.
pub const PTX: &str = include_str!("kernels.ptx");

/// Maps a failed driver call to [`Error::Cuda`] saying what was being done.
fn cuda(what: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::cuda_call(what, e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys;

    #[test]
    fn a_failed_call_keeps_the_driver_error_as_source() {
        let driver = DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE);
        let err = cuda("copying a batch to the device")(driver);
        let source = std::error::Error::source(&err).expect("the driver's error is kept");
        // (Not formatted here: cudarc formats a DriverError by asking the driver, which this
        // machine may not have.)
        assert_eq!(source.downcast_ref::<DriverError>(), Some(&driver));
        let Error::Cuda { doing, .. } = &err else {
            panic!("not Error::Cuda")
        };
        assert_eq!(doing, "copying a batch to the device");
        // The message is what was done, then the library's error, each said once.
        let err = Error::cuda_call(
            "SGEMM",
            std::io::Error::other("CUBLAS_STATUS_EXECUTION_FAILED"),
        );
        assert_eq!(
            err.to_string(),
            "CUDA: SGEMM: CUBLAS_STATUS_EXECUTION_FAILED"
        );
        assert_eq!(crate::error::display_chain(&err), err.to_string());
        // CUDA that cannot be used at all has no library error behind it.
        let none = Error::cuda_unavailable("no CUDA device");
        assert!(std::error::Error::source(&none).is_none());
        assert_eq!(none.to_string(), "CUDA: no CUDA device");
    }

    #[test]
    fn the_ptx_has_every_kernel_and_targets_compute_70() {
        assert!(PTX.contains(".target sm_70"), "compute_70 PTX");
        // Rounded like the CPU: a multiply and an add, each rounded, never one fused FMA.
        assert!(
            !PTX.contains("fma."),
            "the conversion must not fuse the multiply-add"
        );
        assert!(PTX.contains("mul.rn.f32") && PTX.contains("add.rn.f32"));
        assert!(PTX.contains(".version 8.0"), "PTX ISA 8.0 (driver 525+)");
        for kernel in ["u8_nhwc_to_f32", "u8_nhwc_to_f16"] {
            assert!(
                PTX.contains(&format!(".visible .entry {kernel}(")),
                "{kernel} missing from kernels.ptx: run scripts/make_ptx.py"
            );
        }
    }
}
