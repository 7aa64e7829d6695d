//! The one place where Python objects become memory that native code reads or writes.
//!
//! A buffer crosses the boundary as an object, never as an address: [`HostBuffer`] reads
//! the address itself (from the buffer protocol, or from a torch tensor's storage) and
//! keeps strong references to whatever owns the memory. A native call holds its buffers
//! until it has stopped touching them, whatever happens to the Python `Work` that
//! started it, so a dropped handle cannot let eccl write into memory Python reused.
//!
//! Exclusivity is the other half of soundness, and it is checked, not assumed: within
//! one call no writable buffer may overlap another buffer ([`check_disjoint`]), one
//! communicator runs one call at a time, and [`Claim`] refuses a call whose buffers
//! overlap those of a call running on another communicator of this process. What no
//! library can prevent is Python code writing into an array while a call that uses it
//! is in flight; that is the caller's side of the contract, as with gloo and NCCL.

use std::ffi::CStr;
use std::ops::Range;
use std::sync::Mutex;

use eccl::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyType};

use crate::errors::invalid;

/// Memory of a Python object that a native call reads, and what keeps it valid.
pub(crate) struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    /// The memoryview that holds the object's buffer export, or the tensor and its
    /// storage. Dropped without the GIL, their references are released by pyo3 the next
    /// time the GIL is taken: memory is freed late, never early.
    _owners: Vec<Py<PyAny>>,
}

// SAFETY: the pointer is to plain bytes owned by the objects in `_owners` (and `Py` is
// Send); nothing in a `HostBuffer` is tied to the thread that made it.
unsafe impl Send for HostBuffer {}

/// A [`HostBuffer`] that a native call may also write.
pub(crate) struct WritableBuffer(HostBuffer);

impl HostBuffer {
    /// Reads `obj` as a buffer to read from. `what` names it in errors ("input", ...).
    pub fn extract(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<HostBuffer> {
        extract(obj, false, what)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements of its dtype.
    pub fn count(&self) -> usize {
        self.len / self.dtype.size()
    }

    fn range(&self) -> Range<usize> {
        self.ptr as usize..self.ptr as usize + self.len
    }

    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr..ptr + len` is memory of the objects in `_owners`, which this value
        // keeps alive (see `extract`), and eccl never writes through a `HostBuffer`; no
        // eccl call writes it meanwhile either (`check_disjoint`, `Claim`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl WritableBuffer {
    /// Reads `obj` as a buffer to write into; read-only objects are refused.
    pub fn extract(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<WritableBuffer> {
        extract(obj, true, what).map(WritableBuffer)
    }

    pub fn read(&self) -> &HostBuffer {
        &self.0
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.0.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `HostBuffer::bytes`, and the object was writable when extracted.
        // This value is the only handle eccl has on these bytes while the call runs: the
        // call's other buffers do not overlap it (`check_disjoint`), its communicator
        // runs one call at a time, and `Claim` keeps calls of other communicators off it.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr, self.0.len) }
    }
}

fn extract(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<HostBuffer> {
    if is_torch_tensor(obj)? {
        from_tensor(obj, what)
    } else {
        from_buffer_protocol(obj, writable, what)
    }
}

/// `torch.Tensor`, once a tensor has been seen (eccl never imports torch itself).
static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Whether `obj` is a `torch.Tensor` (or a subclass, such as `nn.Parameter`), found
/// without importing torch: by its class's MRO until a tensor has been seen, then by one
/// `isinstance` (every call of the torch backend asks; the MRO walk cost microseconds).
fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    if let Some(tensor) = TENSOR.get(py) {
        return obj.is_instance(tensor.bind(py));
    }
    for cls in obj.get_type().getattr("__mro__")?.try_iter()? {
        let cls = cls?;
        let module = cls.getattr("__module__")?;
        let name = cls.getattr("__qualname__")?;
        if module.cast::<PyString>().is_ok_and(|m| m == "torch")
            && name.cast::<PyString>().is_ok_and(|n| n == "Tensor")
        {
            if let Ok(t) = cls.cast_into::<PyType>() {
                let _ = TENSOR.set(py, t.unbind());
            }
            return Ok(true);
        }
    }
    Ok(false)
}

fn supported() -> String {
    DType::ALL
        .iter()
        .map(|d| d.long_name())
        .collect::<Vec<_>>()
        .join(", ")
}

fn from_tensor(t: &Bound<'_, PyAny>, what: &str) -> PyResult<HostBuffer> {
    if !t.getattr("is_cpu")?.extract::<bool>()? {
        let device = t.getattr("device")?;
        return Err(invalid(format!(
            "{what} is a tensor on {device}: eccl moves CPU tensors only so far; move it with .cpu()"
        )));
    }
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(invalid(format!(
            "{what} is not contiguous: pass x.contiguous()"
        )));
    }
    let name = t.getattr("dtype")?.str()?.to_string();
    let dtype = DType::parse(&name).ok_or_else(|| {
        invalid(format!(
            "{what} has dtype {name}; eccl supports {}",
            supported()
        ))
    })?;
    let elem: usize = t.call_method0("element_size")?.extract()?;
    let numel: usize = t.call_method0("numel")?.extract()?;
    if elem != dtype.size() {
        return Err(invalid(format!(
            "{what}: {name} has {elem}-byte elements, eccl's {dtype} has {}",
            dtype.size()
        )));
    }
    let len = numel
        .checked_mul(elem)
        .ok_or_else(|| invalid(format!("{what} is too large")))?;
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    // The storage, not only the tensor: a tensor can be pointed at other memory
    // (`set_`), and its old storage would then be freed under a running call.
    let storage = t.call_method0("untyped_storage")?;
    let base: usize = storage.call_method0("data_ptr")?.extract()?;
    let size: usize = storage.call_method0("nbytes")?.extract()?;
    let inside = ptr >= base
        && ptr
            .checked_add(len)
            .is_some_and(|end| end <= base.saturating_add(size));
    if len > 0 && !inside {
        return Err(invalid(format!(
            "{what}: its memory is not inside its storage"
        )));
    }
    Ok(HostBuffer {
        ptr: ptr as *mut u8,
        len,
        dtype,
        _owners: vec![t.clone().unbind(), storage.unbind()],
    })
}

fn from_buffer_protocol(
    obj: &Bound<'_, PyAny>,
    writable: bool,
    what: &str,
) -> PyResult<HostBuffer> {
    let py = obj.py();
    let not_a_buffer = || {
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        invalid(format!(
            "{what} must be a numpy array, a CPU torch tensor or another object with the buffer protocol, not {ty}"
        ))
    };
    // The memoryview holds the object's buffer export for as long as it lives: numpy
    // refuses to resize an exported array, bytearray refuses to grow, and the memory
    // stays where the address below points while the memoryview is among the owners.
    // SAFETY: `obj` is a live object; the call returns a new reference or NULL with an
    // exception set, which `from_owned_ptr_or_err` turns into an error.
    let view_obj =
        unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyMemoryView_FromObject(obj.as_ptr())) }
            .map_err(|_| not_a_buffer())?;
    let mut view = std::mem::MaybeUninit::<ffi::Py_buffer>::uninit();
    // SAFETY: `view_obj` is a live memoryview and `view` is storage for one Py_buffer,
    // which a zero return fills and which is released exactly once below.
    if unsafe {
        ffi::PyObject_GetBuffer(view_obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_RECORDS_RO)
    } != 0
    {
        let _ = PyErr::take(py);
        return Err(not_a_buffer());
    }
    // SAFETY: filled by the successful call above.
    let mut view = unsafe { view.assume_init() };
    // SAFETY: `view` is a filled Py_buffer; `format` is NUL-terminated when not null.
    let (contiguous, format) = unsafe {
        (
            ffi::PyBuffer_IsContiguous(&view, b'C' as std::ffi::c_char) != 0,
            if view.format.is_null() {
                "B".to_string()
            } else {
                CStr::from_ptr(view.format).to_string_lossy().into_owned()
            },
        )
    };
    let (ptr, len, itemsize, readonly) = (
        view.buf as *mut u8,
        view.len.max(0) as usize,
        view.itemsize.max(0) as usize,
        view.readonly != 0,
    );
    // SAFETY: releases the export taken above; the memoryview keeps its own.
    unsafe { ffi::PyBuffer_Release(&mut view) };
    if !contiguous {
        return Err(invalid(format!(
            "{what} is not C-contiguous: pass numpy.ascontiguousarray(x)"
        )));
    }
    if writable && readonly {
        return Err(invalid(format!(
            "{what} is read-only, and eccl writes into it"
        )));
    }
    let dtype = dtype_of_format(&format, itemsize).ok_or_else(|| {
        // numpy names its dtype; other objects have only the struct format.
        let name = obj
            .getattr("dtype")
            .and_then(|d| d.str())
            .map(|d| d.to_string())
            .unwrap_or_else(|_| format!("of element format {format:?} ({itemsize} bytes)"));
        invalid(format!(
            "{what} has dtype {name}; eccl supports {}",
            supported()
        ))
    })?;
    Ok(HostBuffer {
        ptr,
        len,
        dtype,
        _owners: vec![view_obj.unbind()],
    })
}

/// The dtype of a buffer-protocol format (`struct` module syntax), native or
/// little-endian byte order only.
fn dtype_of_format(format: &str, itemsize: usize) -> Option<DType> {
    DType::from_buffer_format(format, itemsize)
}

/// Refuses a call whose writable buffers overlap any other of its buffers: the native
/// side would hold a `&mut` and another reference to the same bytes.
pub(crate) fn check_disjoint(reads: &[&HostBuffer], writes: &[&WritableBuffer]) -> PyResult<()> {
    let mut all: Vec<(Range<usize>, bool)> = reads
        .iter()
        .map(|b| (b.range(), false))
        .chain(writes.iter().map(|w| (w.0.range(), true)))
        .filter(|(r, _)| !r.is_empty())
        .collect();
    // In order of start (a list form's one buffer per rank: thousands at scale), each
    // range against the furthest end of those before it: a written one may overlap
    // none of them, a read one no written one.
    all.sort_unstable_by_key(|(r, _)| r.start);
    let (mut any_end, mut written_end) = (0usize, 0usize);
    for (r, written) in &all {
        if r.start < written_end || (*written && r.start < any_end) {
            return Err(invalid(
                "buffers of one call overlap, and eccl writes one of them; use the in-place form or separate buffers",
            ));
        }
        any_end = any_end.max(r.end);
        if *written {
            written_end = written_end.max(r.end);
        }
    }
    Ok(())
}

/// The byte ranges of the calls running now in this process, each with whether it is
/// written. One communicator runs one call at a time; this is what keeps two
/// communicators' calls from writing the same bytes concurrently.
static RUNNING: Mutex<Vec<(u64, Range<usize>, bool)>> = Mutex::new(Vec::new());

/// The ranges of one running call; dropped when the call has stopped touching them.
pub(crate) struct Claim(u64);

impl Claim {
    /// Claims the buffers of call `id`, or says which running call holds them.
    pub fn take(id: u64, reads: &[&HostBuffer], writes: &[&WritableBuffer]) -> eccl::Result<Claim> {
        let mine: Vec<(Range<usize>, bool)> = reads
            .iter()
            .map(|b| (b.range(), false))
            .chain(writes.iter().map(|w| (w.0.range(), true)))
            .filter(|(r, _)| !r.is_empty())
            .collect();
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        for (r, w) in &mine {
            if running
                .iter()
                .any(|(_, o, ow)| (*w || *ow) && r.start < o.end && o.start < r.end)
            {
                return Err(eccl::Error::InvalidArgument(
                    "a buffer of this call is used by a call running on another communicator of this process; wait for that call first".into(),
                ));
            }
        }
        running.extend(mine.into_iter().map(|(r, w)| (id, r, w)));
        Ok(Claim(id))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        running.retain(|(id, _, _)| *id != self.0);
    }
}
