//! DLPack export: how a batch's memory becomes a NumPy array or a PyTorch tensor without a copy.
//!
//! The DLPack C ABI (dmlc/dlpack `dlpack.h`, versions 0.8 and 1.x) is a handful of plain
//! structs; they are declared here rather than taken from a crate because the bindings need
//! only the export side and the capsule protocol around it, which is tied to the PyO3 version.
//!
//! An exported tensor is one heap block ([`Exported`]) holding the DLPack header, the shape and
//! strides it points at, and a shared handle on the memory ([`HostMemory`]). The consumer calls
//! the header's deleter when its last view is gone; the deleter frees the block, and the memory
//! (a pooled batch buffer) goes back to its pool when the last handle on it is dropped, so a
//! tensor the user keeps is never recycled under them.

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `kDLCPU`.
const DL_CPU: i32 = 1;

/// `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (DLPack < 1.0, capsule name `dltensor`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack >= 1.0, capsule name `dltensor_versioned`).
#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// Element types a batch or an array of ours can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    U8,
    F16,
    Bf16,
    F32,
    I64,
}

impl Element {
    fn dl(self) -> DlDataType {
        // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4.
        let (code, bits) = match self {
            Element::U8 => (1, 8),
            Element::F16 => (2, 16),
            Element::Bf16 => (4, 16),
            Element::F32 => (2, 32),
            Element::I64 => (0, 64),
        };
        DlDataType {
            code,
            bits,
            lanes: 1,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Element::U8 => 1,
            Element::F16 | Element::Bf16 => 2,
            Element::F32 => 4,
            Element::I64 => 8,
        }
    }

    /// NumPy's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Element::U8 => "uint8",
            Element::F16 => "float16",
            Element::Bf16 => "bfloat16",
            Element::F32 => "float32",
            Element::I64 => "int64",
        }
    }
}

/// Memory an exported array views: kept alive by every array and tensor made from it.
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
    /// What owns the bytes (a pooled batch buffer, a vector); dropped last.
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: `ptr` points into `_owner`'s heap block, which is Send + Sync and never moves while
// the owner lives; the pointer itself is only handed to consumers, never dereferenced here
// except in `bytes` under a shared borrow.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Memory owned by `owner`, `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must lie in a heap block `owner` owns and keeps in place until dropped,
    /// valid for reads and writes, and not used by anything else while this lives.
    pub unsafe fn new(ptr: *mut u8, len: usize, owner: Box<dyn Send + Sync>) -> HostMemory {
        HostMemory {
            ptr,
            len,
            _owner: owner,
        }
    }

    /// Memory holding `values`.
    pub fn from_vec<T: Copy + Send + Sync + 'static>(mut values: Vec<T>) -> HostMemory {
        let len = std::mem::size_of_val(values.as_slice());
        let ptr = values.as_mut_ptr().cast::<u8>();
        // SAFETY: the vector's heap block does not move when the Vec value is boxed, and the
        // box owns it exclusively until dropped.
        unsafe { HostMemory::new(ptr, len, Box::new(values)) }
    }

    /// The address of the first byte.
    pub fn address(&self) -> usize {
        self.ptr as usize
    }
}

/// A C-contiguous host array that NumPy and PyTorch take without copying
/// (`numpy.from_dlpack(a)`, `torch.from_dlpack(a)`).
#[pyclass(module = "imagefeed._native", frozen)]
pub struct HostArray {
    memory: Arc<HostMemory>,
    shape: Vec<i64>,
    element: Element,
}

impl HostArray {
    /// An array of `shape` over `memory`, which must hold exactly that many elements.
    pub fn new(memory: Arc<HostMemory>, shape: &[usize], element: Element) -> PyResult<HostArray> {
        let count: usize = shape.iter().product();
        if count * element.size() != memory.len {
            return Err(PyValueError::new_err(format!(
                "an array of shape {shape:?} {} needs {} bytes, the memory holds {}",
                element.name(),
                count * element.size(),
                memory.len
            )));
        }
        Ok(HostArray {
            memory,
            shape: shape.iter().map(|&d| d as i64).collect(),
            element,
        })
    }

    fn strides(&self) -> Vec<i64> {
        let mut strides = vec![1i64; self.shape.len()];
        for d in (0..self.shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * self.shape[d + 1];
        }
        strides
    }
}

/// The block a consumer holds: header, shape, strides and the memory handle, freed together by
/// the deleter.
struct Exported<H> {
    managed: H,
    _shape: Vec<i64>,
    _strides: Vec<i64>,
    _memory: Arc<HostMemory>,
}

/// The two DLPack headers: how each is named in its capsule, made, and tied to its block.
trait Header: Sized {
    /// The capsule name a producer gives it.
    const NAME: &'static CStr;
    /// A header over `tensor`, with `delete::<Self>` as its deleter and no context yet.
    fn new(tensor: DlTensor) -> Self;
    /// The `manager_ctx` field.
    fn context(&mut self) -> &mut *mut c_void;
}

impl Header for DlManagedTensor {
    const NAME: &'static CStr = c"dltensor";
    fn new(tensor: DlTensor) -> Self {
        DlManagedTensor {
            dl_tensor: tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<DlManagedTensor>),
        }
    }
    fn context(&mut self) -> &mut *mut c_void {
        &mut self.manager_ctx
    }
}

impl Header for DlManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";
    fn new(tensor: DlTensor) -> Self {
        DlManagedTensorVersioned {
            version: DlPackVersion { major: 1, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<DlManagedTensorVersioned>),
            flags: 0,
            dl_tensor: tensor,
        }
    }
    fn context(&mut self) -> &mut *mut c_void {
        &mut self.manager_ctx
    }
}

/// The deleter of either header.
unsafe extern "C" fn delete<H: Header>(managed: *mut H) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the header of a `Box<Exported<H>>` leaked by `export` (repr(Rust)
    // puts no guarantee on field order, so the context pointer, not the header address, is what
    // is freed), and the DLPack contract calls the deleter once.
    unsafe {
        let ctx = (*(*managed).context()).cast::<Exported<H>>();
        drop(Box::from_raw(ctx));
    }
}

/// Frees the header a capsule still holds when it was named `H::NAME` (no consumer took it).
///
/// # Safety
/// `capsule` is a live capsule, and the GIL is held.
unsafe fn free_unconsumed<H: Header>(capsule: *mut ffi::PyObject) -> bool {
    // SAFETY: per the contract; a capsule under our name holds a header made by `export::<H>`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, H::NAME.as_ptr()) != 1 {
            return false;
        }
        delete::<H>(ffi::PyCapsule_GetPointer(capsule, H::NAME.as_ptr()).cast());
    }
    true
}

/// Capsule destructor: frees the tensor if no consumer took it (a consumer renames the capsule
/// to `used_dltensor…` and calls the deleter itself when done).
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by CPython with the GIL held on a live capsule. The error state is saved
    // and restored because PyCapsule_IsValid/GetPointer may set one while another is pending.
    unsafe {
        let mut ptype = std::ptr::null_mut();
        let mut pvalue = std::ptr::null_mut();
        let mut ptrace = std::ptr::null_mut();
        ffi::PyErr_Fetch(&mut ptype, &mut pvalue, &mut ptrace);
        let _ = free_unconsumed::<DlManagedTensor>(capsule)
            || free_unconsumed::<DlManagedTensorVersioned>(capsule);
        ffi::PyErr_Restore(ptype, pvalue, ptrace);
    }
}

impl HostArray {
    /// A capsule holding a new `H` header over this array.
    fn export<H: Header>(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mut shape = self.shape.clone();
        let mut strides = self.strides();
        let tensor = DlTensor {
            data: self.memory.ptr.cast(),
            device: DlDevice {
                device_type: DL_CPU,
                device_id: 0,
            },
            ndim: self.shape.len() as i32,
            dtype: self.element.dl(),
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: 0,
        };
        let block = Box::into_raw(Box::new(Exported {
            managed: H::new(tensor),
            _shape: shape,
            _strides: strides,
            _memory: Arc::clone(&self.memory),
        }));
        // SAFETY: `block` was just leaked; the context points back at it for the deleter.
        let header = unsafe {
            *(*block).managed.context() = block.cast();
            &raw mut (*block).managed
        };
        // SAFETY: `header` is a live DLPack header; the name is a static C string; the
        // destructor only frees headers this module made under that name.
        let capsule = unsafe {
            ffi::PyCapsule_New(header.cast(), H::NAME.as_ptr(), Some(capsule_destructor))
        };
        if capsule.is_null() {
            // SAFETY: the header was not handed over; free it like a consumer would.
            unsafe { delete::<H>(header) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: PyCapsule_New returned a new reference.
        Ok(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind())
    }
}

#[pymethods]
impl HostArray {
    /// The DLPack capsule (array API standard): `max_version >= (1, 0)` gets a versioned one.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if let Some(stream) = stream
            && !stream.is_none(py)
        {
            return Err(PyValueError::new_err(
                "a host array takes no stream (stream must be None)",
            ));
        }
        if let Some((device_type, _)) = dl_device
            && device_type != DL_CPU
        {
            return Err(PyBufferError::new_err(
                "an imagefeed host array can only be exported to the CPU",
            ));
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "imagefeed exports without copying (copy=True is not supported)",
            ));
        }
        match max_version {
            Some((major, _)) if major >= 1 => self.export::<DlManagedTensorVersioned>(py),
            _ => self.export::<DlManagedTensor>(py),
        }
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DL_CPU, 0)
    }

    /// Shape, as a tuple.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    /// NumPy's name for the element type.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.element.name()
    }

    /// Address of the first element (what the array's and tensor's data pointer equals).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.memory.address()
    }

    /// Arrays and tensors still viewing this memory, plus this object.
    #[getter]
    fn views(&self) -> usize {
        Arc::strong_count(&self.memory)
    }

    fn __repr__(&self) -> String {
        format!(
            "HostArray(shape={:?}, dtype={}, data_ptr={:#x})",
            self.shape,
            self.element.name(),
            self.memory.address()
        )
    }
}
