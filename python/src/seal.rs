//! `eccl._eccl.OpenKey` and `seal`: handing the job secret to one rank through torch's
//! store without a store reader learning it (see `eccl_protocol::seal`).

use eccl_protocol::seal as sealing;
use eccl_protocol::seal::SealError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::invalid;

fn to_py(e: SealError) -> PyErr {
    invalid(e.to_string())
}

/// A one-use X25519 key: publish `public`, then `open` the box sealed to it.
#[pyclass(module = "eccl._eccl")]
pub struct OpenKey(sealing::OpenKey);

#[pymethods]
impl OpenKey {
    #[new]
    fn new() -> PyResult<Self> {
        sealing::OpenKey::generate().map(OpenKey).map_err(to_py)
    }

    #[getter]
    fn public<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.public())
    }

    /// The contents of `sealed`, a box sealed to this key under `context`.
    fn open<'py>(
        &mut self,
        py: Python<'py>,
        sealed: &[u8],
        context: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let plain = self.0.open(sealed, context).map_err(to_py)?;
        Ok(PyBytes::new(py, &plain))
    }
}

/// `plain` sealed to the holder of the key whose public half is `public`, under `context`.
#[pyfunction]
pub fn seal<'py>(
    py: Python<'py>,
    public: &[u8],
    plain: &[u8],
    context: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let sealed = sealing::seal(public, plain, context).map_err(to_py)?;
    Ok(PyBytes::new(py, &sealed))
}
