//! Finding the driver and a device: [`device_count`], [`unavailable_reason`], and [`Gpu`] (a
//! device's context, with the kernels loaded on first use).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, DriverError, sys,
};
use cudarc::nvrtc::Ptx;

use super::context::{RestoreCurrentContext, RestoringDrop};
use super::pinned::PinnedAllocator;
use super::{PTX, cuda};
use crate::error::{Error, Result};

/// Number of CUDA devices, or why CUDA cannot be used here: no driver library, or a driver
/// that fails to initialize (no device, a driver/library mismatch). Never panics.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver library under its known names and closes it.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::cuda_unavailable(
            "no CUDA driver: libcuda.so was not found (this machine has no NVIDIA driver)",
        ));
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(DriverError(sys::cudaError_enum::CUDA_ERROR_STUB_LIBRARY)) => {
            Err(Error::cuda_unavailable(format!(
                "the libcuda.so loaded{} is the CUDA toolkit's stub, not the NVIDIA driver: a \
                 toolkit's lib64/stubs folder on LD_LIBRARY_PATH comes before the driver's \
                 library; take it off the path",
                loaded_driver_path()
                    .map(|p| format!(" ({p})"))
                    .unwrap_or_default()
            )))
        }
        Err(e) => Err(Error::cuda_call("the CUDA driver did not initialize", e)),
    }
}

/// The file the loaded `cuInit` comes from, when the system can say.
fn loaded_driver_path() -> Option<String> {
    for name in [c"libcuda.so", c"libcuda.so.1"] {
        // SAFETY: RTLD_NOLOAD only looks up a library already loaded; the handle is closed.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if handle.is_null() {
                continue;
            }
            let address = libc::dlsym(handle, c"cuInit".as_ptr());
            let mut info: libc::Dl_info = std::mem::zeroed();
            let found = !address.is_null()
                && libc::dladdr(address, &mut info) != 0
                && !info.dli_fname.is_null();
            let path = found.then(|| {
                std::ffi::CStr::from_ptr(info.dli_fname)
                    .to_string_lossy()
                    .into_owned()
            });
            libc::dlclose(handle);
            if path.is_some() {
                return path;
            }
        }
    }
    None
}

/// Why there is no usable GPU here, or `None` when device 0 can be used. For tests and tools
/// that skip GPU work and say why.
pub fn unavailable_reason() -> Option<String> {
    match device_count() {
        Ok(0) => Some("no CUDA device: the driver is present but reports no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// One GPU: its context, and the kernels once something needs them.
pub struct Gpu {
    ctx: RestoringDrop<Arc<CudaContext>>,
    /// Loaded on first use: a program that only wants page-locked memory (the Python
    /// package's CUDA path) never JIT-compiles PTX, so it works with any driver cudarc does.
    module: OnceLock<RestoringDrop<Arc<CudaModule>>>,
}

impl Gpu {
    /// Opens device `ordinal`. The kernels are loaded when first asked for
    /// ([`function`](Self::function), [`Prefetcher::new`](super::Prefetcher::new)).
    ///
    /// cudarc's automatic per-allocation stream tracking is turned off for this context: the
    /// [`Prefetcher`](super::Prefetcher) orders its streams with its own events, and code sharing the context must
    /// order its streams itself.
    ///
    /// The calling thread's current context is left as it was (none, or another device's):
    /// cudarc's calls make this one current when they need it; before a raw driver call, call
    /// `gpu.context().bind_to_thread()`.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let count = device_count()?;
        if count == 0 {
            return Err(Error::cuda_unavailable(
                "no CUDA device: the driver is present but reports no GPU",
            ));
        }
        if ordinal >= count {
            return Err(Error::cuda_unavailable(format!(
                "no device {ordinal}: this machine has {count}"
            )));
        }
        // `CudaContext::new` makes the new context current on this thread.
        let _restore =
            RestoreCurrentContext::remember().map_err(cuda("reading the current context"))?;
        let ctx = CudaContext::new(ordinal).map_err(cuda("creating a context"))?;
        // SAFETY: called before any allocation or stream of this context exists; from here on
        // every cross-stream dependency is an explicit event (see the module docs).
        unsafe { ctx.disable_event_tracking() };
        Ok(Gpu {
            ctx: RestoringDrop::new(ctx),
            module: OnceLock::new(),
        })
    }

    /// The kernels' module, loaded (JIT-compiled by the driver) on first use.
    fn module(&self) -> Result<&Arc<CudaModule>> {
        if let Some(module) = self.module.get() {
            return Ok(module);
        }
        let _restore =
            RestoreCurrentContext::remember().map_err(cuda("reading the current context"))?;
        let module = self.ctx.load_module(Ptx::from_src(PTX)).map_err(cuda(
            "loading the kernels (PTX ISA 8.0 needs driver 525 or newer)",
        ))?;
        // Two threads racing here both load it; one module is kept, the other unloaded.
        Ok(self.module.get_or_init(|| RestoringDrop::new(module)))
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("unknown ({e})"))
    }

    /// A kernel from the shipped PTX (loading the kernels on first use).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let module = self.module()?;
        // cuModuleGetFunction works in the current context, which `open` did not leave bound.
        self.ctx
            .bind_to_thread()
            .map_err(cuda("binding the context"))?;
        module
            .load_function(name)
            .map_err(|e| Error::cuda_call(format!("kernel {name}"), e))
    }

    /// A new stream.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(cuda("creating a stream"))
    }

    /// An event for ordering streams (timing disabled: cheaper to record and wait on). For
    /// the device to wait on: a host thread waiting for it would spin.
    pub fn event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(cuda("creating an event"))
    }

    /// An event that can be timed with [`CudaEvent::elapsed_ms`] (cudarc's `new_event(None)`
    /// disables timing, and `cuEventElapsedTime` then fails). A host thread waiting for it
    /// sleeps rather than spinning a core (blocking synchronization).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(cuda("creating a timing event"))
    }

    /// An allocator of page-locked batch buffers, for [`Loader::with_allocator`](crate::loader::Loader::with_allocator).
    pub fn pinned_allocator(&self) -> Arc<PinnedAllocator> {
        PinnedAllocator::new(&self.ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_open_says_why_instead_of_panicking() {
        match unavailable_reason() {
            Some(reason) => {
                let err = Gpu::open(0).err().expect("no GPU, so open fails");
                let text = err.to_string();
                assert!(text.starts_with("CUDA: no CUDA"), "{text}");
                assert!(reason.contains("no CUDA"), "{reason}");
                eprintln!("no GPU here ({reason}): checked that open fails cleanly");
            }
            None => {
                let gpu = Gpu::open(0).expect("a GPU is present");
                assert!(!gpu.name().is_empty());
                assert!(
                    Gpu::open(usize::MAX).is_err(),
                    "a device that does not exist"
                );
            }
        }
    }
}
