//! cuBLAS's single-precision matrix product, loaded at run time, for the programs that run a
//! training step on the feed's batches: the training example and `imagefeed-bench gpu`.
//!
//! cudarc's own cuBLAS loader (built for the CUDA 12 API) looks for `libcublas.so`,
//! `libcublas.so.12` and older names only. This one also finds CUDA 13's `libcublas.so.13` and
//! the copies pip installs with PyTorch (`nvidia-cublas-cu12`, `nvidia-cublas` for CUDA 13)
//! under the active virtual environment or conda prefix; `IMAGEFEED_CUBLAS=/path/to/libcublas.so.N`
//! names one outright. The four entry points used (`cublasCreate_v2`, `cublasSetStream_v2`,
//! `cublasSgemm_v2`, `cublasDestroy_v2`) have kept their signatures from CUDA 10 to 13.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::error::{Error, Result};

type Handle = *mut c_void;
type Create = unsafe extern "C" fn(*mut Handle) -> c_int;
type Destroy = unsafe extern "C" fn(Handle) -> c_int;
type SetStream = unsafe extern "C" fn(Handle, *mut c_void) -> c_int;
#[allow(clippy::type_complexity)]
type Sgemm = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    *const f32,
    *mut f32,
    c_int,
) -> c_int;

/// A cuBLAS handle bound to one stream: every product it computes is queued there.
pub struct Blas {
    handle: Handle,
    sgemm: Sgemm,
    destroy: Destroy,
    library: String,
    _stream: Arc<CudaStream>,
    // Last: the library stays loaded until the handle is destroyed.
    _lib: libloading::Library,
}

// SAFETY: a cuBLAS handle may be used from any thread, one call at a time (`&mut`-free API
// here, but cuBLAS serializes nothing: `Blas` is Send, not Sync).
unsafe impl Send for Blas {}

impl Blas {
    /// Loads cuBLAS (see the module docs) and makes a handle whose work goes on `stream`. A
    /// library that loads but cannot make a handle (CUDA 13's cuBLAS on an older driver) is
    /// passed over for the next one; the error names every library tried.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
        // cuBLAS works in the current context: the stream's.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda_call("binding the context for cuBLAS", e))?;
        let mut failures = Vec::new();
        for candidate in candidates() {
            // SAFETY: loading cuBLAS runs its initializers, which have no preconditions.
            let Ok(lib) = (unsafe { libloading::Library::new(&candidate) }) else {
                failures.push(format!("{candidate}: not found"));
                continue;
            };
            match Blas::with_library(lib, candidate.clone(), stream) {
                Ok(blas) => return Ok(blas),
                Err(e) => failures.push(format!("{candidate}: {e}")),
            }
        }
        Err(Error::cuda_unavailable(format!(
            "no usable cuBLAS ({}): install it (the CUDA toolkit, or pip's nvidia-cublas-cu12) \
             or name it with IMAGEFEED_CUBLAS=/path/to/libcublas.so.N",
            failures.join("; ")
        )))
    }

    fn with_library(
        lib: libloading::Library,
        library: String,
        stream: &Arc<CudaStream>,
    ) -> Result<Blas> {
        // SAFETY: the symbols have these C signatures in every cuBLAS since CUDA 10.
        let (create, destroy, set_stream, sgemm) = unsafe {
            let symbol = |name: &[u8]| -> Result<*const c_void> {
                lib.get::<*const c_void>(name)
                    .map(|s| *s)
                    .map_err(|e| Error::cuda_unavailable(e.to_string()))
            };
            (
                std::mem::transmute::<*const c_void, Create>(symbol(b"cublasCreate_v2")?),
                std::mem::transmute::<*const c_void, Destroy>(symbol(b"cublasDestroy_v2")?),
                std::mem::transmute::<*const c_void, SetStream>(symbol(b"cublasSetStream_v2")?),
                std::mem::transmute::<*const c_void, Sgemm>(symbol(b"cublasSgemm_v2")?),
            )
        };
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` is a valid out-pointer.
        status(unsafe { create(&mut handle) }, "cublasCreate_v2")?;
        let blas = Blas {
            handle,
            sgemm,
            destroy,
            library,
            _stream: Arc::clone(stream),
            _lib: lib,
        };
        // SAFETY: a live handle and a live stream (kept alive by `blas`).
        let code = unsafe { set_stream(handle, stream.cu_stream().cast()) };
        status(code, "cublasSetStream_v2")?;
        Ok(blas)
    }

    /// The library file or name loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// `c = alpha · op(a) · op(b) + beta · c` in cuBLAS's column-major terms: `op(a)` is
    /// `m × k`, `op(b)` `k × n`, `c` `m × n`; `transpose_*` transposes that operand as stored.
    ///
    /// # Safety
    /// `a`, `b` and `c` must be live device allocations holding the matrices their shapes and
    /// leading dimensions describe, and their last writes must be ordered before the handle's
    /// stream reaches this product.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgemm(
        &self,
        transpose_a: bool,
        transpose_b: bool,
        (m, n, k): (i32, i32, i32),
        alpha: f32,
        (a, lda): (u64, i32),
        (b, ldb): (u64, i32),
        beta: f32,
        (c, ldc): (u64, i32),
    ) -> Result<()> {
        // SAFETY: the caller's contract; alpha and beta are host values read during the call.
        status(
            unsafe {
                (self.sgemm)(
                    self.handle,
                    c_int::from(transpose_a),
                    c_int::from(transpose_b),
                    m,
                    n,
                    k,
                    &alpha,
                    a as *const f32,
                    lda,
                    b as *const f32,
                    ldb,
                    &beta,
                    c as *mut f32,
                    ldc,
                )
            },
            "cublasSgemm_v2",
        )
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle is live and destroyed once.
        let _ = unsafe { (self.destroy)(self.handle) };
    }
}

fn status(code: c_int, call: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let name = match code {
        1 => "CUBLAS_STATUS_NOT_INITIALIZED",
        3 => "CUBLAS_STATUS_ALLOC_FAILED",
        7 => "CUBLAS_STATUS_INVALID_VALUE",
        8 => "CUBLAS_STATUS_ARCH_MISMATCH",
        11 => "CUBLAS_STATUS_MAPPING_ERROR",
        13 => "CUBLAS_STATUS_EXECUTION_FAILED",
        14 => "CUBLAS_STATUS_INTERNAL_ERROR",
        15 => "CUBLAS_STATUS_NOT_SUPPORTED",
        _ => "an unknown cuBLAS status",
    };
    Err(Error::cuda_call(
        call.to_string(),
        std::io::Error::other(format!("{name} ({code})")),
    ))
}

/// Where cuBLAS may be, in the order tried (see the module docs).
pub fn candidates() -> Vec<String> {
    let mut out = Vec::new();
    if let Some(path) = std::env::var_os("IMAGEFEED_CUBLAS") {
        out.push(PathBuf::from(path).display().to_string());
    }
    for name in [
        "libcublas.so.13",
        "libcublas.so.12",
        "libcublas.so",
        "libcublas.so.11",
    ] {
        out.push(name.to_string());
    }
    for prefix in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        let Some(prefix) = std::env::var_os(prefix) else {
            continue;
        };
        let prefix = PathBuf::from(prefix);
        for pattern in [
            "lib/python3*/site-packages/nvidia/cu13/lib/libcublas.so.13",
            "lib/python3*/site-packages/nvidia/cublas/lib/libcublas.so.1[23]",
        ] {
            let pattern = prefix.join(pattern).display().to_string();
            if let Ok(paths) = glob::glob(&pattern) {
                out.extend(paths.flatten().map(|p| p.display().to_string()));
            }
        }
    }
    out
}
