//! What this module's calls leave behind on a caller's thread: its current CUDA context as it
//! was (see the module docs of [`crate::gpu`]).

use std::mem::ManuallyDrop;

use cudarc::driver::{DriverError, result, sys};

/// Puts back, when dropped, the context that was current on this thread when it was made (or
/// none). The calls this module makes on a caller's thread that are not followed by the
/// caller's own CUDA work (opening a device, allocating and freeing page-locked memory) leave
/// the thread's current context, and so the CUDA runtime's current device (PyTorch's
/// `torch.cuda.current_device()`), as they found it: opening device 1 from a process working
/// on device 0 does not move that process's later work to device 1.
pub(super) struct RestoreCurrentContext {
    previous: Option<sys::CUcontext>,
}

impl RestoreCurrentContext {
    /// Remembers this thread's current context (the driver must be initialized).
    pub(super) fn remember() -> std::result::Result<Self, DriverError> {
        Ok(RestoreCurrentContext {
            previous: result::ctx::get_current()?,
        })
    }
}

impl Drop for RestoreCurrentContext {
    fn drop(&mut self) {
        let current = result::ctx::get_current().ok().flatten();
        if current != self.previous {
            // SAFETY: `previous` was current on this thread moments ago, inside a call of this
            // module that destroys no context (contexts are primary contexts, retained by
            // their owners); null makes no context current, as before.
            let _ =
                unsafe { result::ctx::set_current(self.previous.unwrap_or(std::ptr::null_mut())) };
        }
    }
}

/// A value whose drop leaves this thread's current context as it was. cudarc's `CudaContext`
/// and `CudaModule` make their context current to release or unload it, and the last
/// reference may be dropped on a caller's thread (a Python loader deleted on the main thread).
pub(super) struct RestoringDrop<T>(ManuallyDrop<T>);

impl<T> RestoringDrop<T> {
    pub(super) fn new(value: T) -> Self {
        RestoringDrop(ManuallyDrop::new(value))
    }
}

impl<T> std::ops::Deref for RestoringDrop<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> Drop for RestoringDrop<T> {
    fn drop(&mut self) {
        let _restore = RestoreCurrentContext::remember().ok();
        // SAFETY: the value is dropped exactly once, here, and the wrapper is never used again.
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}
