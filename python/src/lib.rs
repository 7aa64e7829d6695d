//! `eccl._eccl`: the native half of the Python package. The Python half
//! (`python/eccl/`) re-exports it and adds what is easier in Python (the torch backend,
//! `Master.spawn`).
//!
//! | file | job |
//! |---|---|
//! | `buffer.rs` | Python objects -> memory the native side may read or write (the one `unsafe` place) |
//! | `communicator.rs` | `eccl.Communicator`: arguments -> calls on the communicator's queue |
//! | `call.rs` | the calls, and the task that runs one communicator's calls in order |
//! | `work.rs` | `eccl.Work`: waiting for a call's outcome |
//! | `results.rs` | `OpInfo`, `WorldUpdate`, `SyncInfo` |
//! | `errors.rs` | `EcclError` and one class per `eccl::ErrorKind` |
//! | `master.rs` | an embedded master |
//! | `store.rs` | `StoreClient`: a session in the master's key-value store |
//! | `seal.rs` | sealing the job secret to one rank (the torch store handoff) |
//! | `runtime.rs` | the process's tokio runtime, and the stop at exit |

mod buffer;
mod call;
mod communicator;
mod direct;
mod errors;
mod master;
mod results;
mod runtime;
mod seal;
mod shared;
mod store;
mod work;

use eccl::{DType, ReduceOp, SyncStrategy};
use pyo3::prelude::*;

/// The element type of `obj` (a numpy array, torch tensor or buffer) as eccl reads it:
/// the code of its `eccl.DType`, or `InvalidArgumentError` saying why eccl cannot use it.
#[pyfunction]
fn dtype_of(obj: &Bound<'_, PyAny>) -> PyResult<u8> {
    Ok(buffer::HostBuffer::extract(obj, "the object")?.dtype() as u8)
}

/// The text of the secret file at `path`, stripped, as the Rust side reads it: refused
/// with `InvalidArgumentError` (naming the `chmod` that fixes it) when others may read
/// or write the file.
#[pyfunction]
fn read_secret_file(path: std::path::PathBuf) -> PyResult<String> {
    let bytes = eccl_protocol::auth::Secret::read_file_bytes(&path).map_err(errors::invalid)?;
    let text = String::from_utf8(bytes).map_err(|_| {
        errors::invalid(format!("{}: the secret is not UTF-8 text", path.display()))
    })?;
    Ok(text.trim().to_string())
}

/// The job secret of the file at `path` (`~/.eccl/secret` when `None`), as
/// `eccl-master` reads it: the file is created with a fresh random secret, readable by
/// its owner only, when it does not exist; refused like [`read_secret_file`] when
/// others may read it.
#[pyfunction]
#[pyo3(signature = (path=None))]
fn load_or_create_secret_file(path: Option<std::path::PathBuf>) -> PyResult<String> {
    let path = path.unwrap_or_else(eccl_master::secret::default_secret_file);
    eccl_master::secret::load_or_create(&path).map_err(|e| errors::invalid(format!("{e:#}")))?;
    read_secret_file(path)
}

#[pymodule]
fn _eccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<communicator::Communicator>()?;
    m.add_class::<work::Work>()?;
    m.add_class::<results::PyOpInfo>()?;
    m.add_class::<results::PyWorldUpdate>()?;
    m.add_class::<results::PySyncInfo>()?;
    m.add_class::<master::Master>()?;
    m.add_class::<store::StoreClient>()?;
    m.add_class::<shared::SharedMemory>()?;
    m.add_function(wrap_pyfunction!(runtime::_shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_of, m)?)?;
    m.add_function(wrap_pyfunction!(read_secret_file, m)?)?;
    m.add_function(wrap_pyfunction!(load_or_create_secret_file, m)?)?;
    m.add_class::<seal::OpenKey>()?;
    m.add_function(wrap_pyfunction!(seal::seal, m)?)?;
    // The single lists, which the Python package turns into its enums and exceptions.
    let dtypes: Vec<_> = DType::ALL
        .iter()
        .map(|d| {
            (
                d.name().to_ascii_uppercase(),
                *d as u8,
                d.long_name(),
                d.size(),
            )
        })
        .collect();
    m.add("DTYPES", dtypes)?;
    // Every ECCL_* variable: (name, default, read by, meaning), from the one list.
    let variables: Vec<_> = eccl::variables::VARIABLES
        .iter()
        .map(|v| (v.name, v.default, v.read_by, v.meaning))
        .collect();
    m.add("VARIABLES", variables)?;
    let ops: Vec<_> = ReduceOp::ALL
        .iter()
        .map(|o| {
            let domain = match o.domain() {
                eccl::OpDomain::All => "all",
                eccl::OpDomain::Floats => "floats",
                eccl::OpDomain::Integers => "integers",
            };
            (
                o.name().to_ascii_uppercase(),
                *o as u8,
                o.torch_name(),
                domain,
            )
        })
        .collect();
    m.add("REDUCE_OPS", ops)?;
    let strategies: Vec<_> = SyncStrategy::ALL.iter().map(|s| s.name()).collect();
    m.add("SYNC_STRATEGIES", strategies)?;
    m.add("EcclError", py.get_type::<errors::EcclError>())?;
    let classes = errors::classes(py)?;
    for (kind, cls) in eccl::ErrorKind::ALL.iter().zip(classes) {
        m.add(errors::class_name(py, *kind)?.as_str(), cls.clone_ref(py))?;
    }
    let errors: Vec<_> = classes.iter().map(|c| c.clone_ref(py)).collect();
    m.add("ERRORS", errors)?;
    Ok(())
}
