//! eccl's exceptions: `EcclError` and one subclass per [`eccl::ErrorKind`], made once at
//! import from the Rust list (`AbortedError`, `EvictedError`, ...), so a new kind of
//! error needs no edit here or in Python. Each instance carries the error's fields as
//! attributes (`epoch`, `cause`, `rank`, ...) plus `retryable` and `hint`; they live in
//! the instance's `__dict__`, which `BaseException.__reduce__` pickles, and the classes
//! live in the `eccl` module, where unpickling finds them.

use std::ffi::CString;

use eccl::{Error, ErrorKind};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};

// A RuntimeError, as torch.distributed's own errors are (DistError, DistBackendError):
// torch code and torch's tests catch failed collectives and reconfigures as RuntimeError.
create_exception!(
    eccl,
    EcclError,
    PyRuntimeError,
    "Base class of every eccl error (a RuntimeError, as torch.distributed's errors are); `retryable` says whether update_topology() and the same call can succeed, `hint` what to do."
);

static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// The Python name of the class for `kind`: `KindError`, or `EcclKindError` where
/// `KindError` is a Python builtin (`TimeoutError`), which eccl's must not shadow.
pub(crate) fn class_name(py: Python<'_>, kind: ErrorKind) -> PyResult<String> {
    let plain = format!("{}Error", kind.name());
    Ok(if py.import("builtins")?.hasattr(plain.as_str())? {
        format!("Eccl{plain}")
    } else {
        plain
    })
}

/// The exception classes, in the order of [`ErrorKind::ALL`]. A class whose plain name
/// is a builtin's also derives from that builtin (`EcclTimeoutError` is a
/// `TimeoutError`), so `except TimeoutError` catches it as Python code expects.
/// `RevokedError` derives from `AbortedError`: a revoked epoch is an aborted one, and
/// code that retries after an abort retries after a revoke too.
pub(crate) fn classes(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    CLASSES.get_or_try_init(py, || {
        let eccl_error = py.get_type::<EcclError>();
        let builtins = py.import("builtins")?;
        let mut made: Vec<(ErrorKind, Py<PyType>)> = Vec::new();
        // Every parent comes before its children in ErrorKind::ALL.
        ErrorKind::ALL
            .iter()
            .map(|k| {
                let base = match k.parent() {
                    Some(p) => made
                        .iter()
                        .find(|(m, _)| *m == p)
                        .map(|(_, t)| t.bind(py).clone())
                        .expect("a parent kind comes first"),
                    None => eccl_error.clone(),
                };
                let t = make_class(py, *k, &base, &builtins)?;
                // On the class as well as on each instance: an error raised by Python
                // code (`eccl.AbortedError("...")`, as ElasticDDP raises after its
                // retries) says whether it is retryable as the library's own do.
                t.bind(py).setattr("retryable", k.is_retryable())?;
                t.bind(py).setattr("hint", k.hint())?;
                made.push((*k, t.clone_ref(py)));
                Ok(t)
            })
            .collect()
    })
}

/// The class of kind `k`, deriving from `base` (and from the builtin of its plain name,
/// if there is one).
fn make_class(
    py: Python<'_>,
    k: ErrorKind,
    base: &Bound<'_, PyType>,
    builtins: &Bound<'_, pyo3::types::PyModule>,
) -> PyResult<Py<PyType>> {
    let name = class_name(py, k)?;
    let doc = format!("{}. Hint: {}.", k.name(), k.hint());
    let plain = format!("{}Error", k.name());
    if name != plain {
        // type(name, (base, builtin), {...}): both bases.
        let builtin = builtins.getattr(plain.as_str())?;
        let dict = pyo3::types::PyDict::new(py);
        dict.set_item("__doc__", doc)?;
        dict.set_item("__module__", "eccl")?;
        let t = py
            .get_type::<PyType>()
            .call1((name, (base.clone(), builtin), dict))?;
        return Ok(t.cast_into::<PyType>()?.unbind());
    }
    let name = CString::new(format!("eccl.{name}"))?;
    let doc = CString::new(doc)?;
    PyErr::new_type(py, &name, Some(&doc), Some(base), None)
}

fn class(py: Python<'_>, kind: ErrorKind) -> PyResult<Bound<'_, PyType>> {
    let all = classes(py)?;
    let i = ErrorKind::ALL
        .iter()
        .position(|k| *k == kind)
        .expect("every kind is in ErrorKind::ALL");
    Ok(all[i].bind(py).clone())
}

/// The Python exception for `e`: its kind's class, its message and hint, its fields.
pub(crate) fn to_py(e: &Error) -> PyErr {
    Python::attach(|py| build(py, e).unwrap_or_else(|err| err))
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let cls = class(py, e.kind())?;
    let inst = cls.call1(PyTuple::new(py, [format!("{e} (hint: {})", e.hint())])?)?;
    inst.setattr("retryable", e.is_retryable())?;
    inst.setattr("hint", e.hint())?;
    match e {
        Error::Aborted { epoch, cause } => {
            inst.setattr("epoch", epoch)?;
            inst.setattr("cause", cause)?;
        }
        Error::Revoked { epoch, cause } => {
            inst.setattr("epoch", epoch)?;
            inst.setattr("cause", cause)?;
        }
        Error::Evicted { reason } => inst.setattr("reason", reason)?,
        Error::Mismatch { rank, detail, .. } => {
            inst.setattr("rank", rank)?;
            inst.setattr("detail", detail)?;
        }
        Error::Timeout { what, ms } => {
            inst.setattr("what", what)?;
            inst.setattr("ms", ms)?;
        }
        Error::MasterUnavailable { addr, reason } => {
            inst.setattr("addr", addr)?;
            inst.setattr("reason", reason)?;
        }
        Error::InvalidArgument(detail) => inst.setattr("detail", detail)?,
        Error::TooFewPeers { have, need } => {
            inst.setattr("have", have)?;
            inst.setattr("need", need)?;
        }
    }
    Ok(PyErr::from_value(inst))
}

/// `InvalidArgumentError(msg)`: a call that is wrong on its own.
pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(&Error::InvalidArgument(msg.into()))
}

/// Converts eccl's results into Python's.
pub(crate) trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for eccl::Result<T> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(|e| to_py(&e))
    }
}
