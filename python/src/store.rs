//! `eccl._eccl.StoreClient`: a session in the master's key-value store, with blocking
//! methods (the GIL released while they wait). `eccl.store.EcclStore` makes it a
//! `torch.distributed.Store`; `eccl.rendezvous` builds torchrun's backend on it.

use std::time::Duration;

use eccl::{Secret, StoreClient as Client};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{invalid, OrRaise};
use crate::runtime::runtime;

#[pyclass(module = "eccl._eccl", frozen)]
pub(crate) struct StoreClient {
    client: Client,
    #[pyo3(get)]
    masters: String,
}

fn secret(given: Option<String>) -> PyResult<Secret> {
    match given {
        Some(s) => Secret::new(s).map_err(|e| invalid(format!("secret: {e}"))),
        None => eccl::config::secret_from_env().or_raise()?.ok_or_else(|| {
            invalid("no job secret: pass secret= or set ECCL_SECRET or ECCL_SECRET_FILE")
        }),
    }
}

fn bytes(py: Python<'_>, v: Vec<u8>) -> Py<PyBytes> {
    PyBytes::new(py, &v).unbind()
}

/// Keys and values cross as `bytes` (the Python layer encodes `str`).
type B<'py> = Bound<'py, PyBytes>;

fn v(b: &B<'_>) -> Vec<u8> {
    b.as_bytes().to_vec()
}

fn vs(b: &[B<'_>]) -> Vec<Vec<u8>> {
    b.iter().map(v).collect()
}

impl StoreClient {
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl std::future::Future<Output = eccl::Result<T>> + Send,
    ) -> PyResult<T> {
        py.detach(|| runtime().block_on(f)).or_raise()
    }
}

#[pymethods]
impl StoreClient {
    /// Opens a session in `scope` on `masters` (comma-separated client addresses of the
    /// master or its cluster). `timeout_s` bounds finding a leader and each request.
    #[new]
    #[pyo3(signature = (masters, scope, secret=None, timeout_s=30.0))]
    fn new(
        py: Python<'_>,
        masters: String,
        scope: String,
        secret: Option<String>,
        timeout_s: f64,
    ) -> PyResult<StoreClient> {
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(invalid(format!(
                "timeout_s must be positive, not {timeout_s}"
            )));
        }
        let s = self::secret(secret)?;
        let timeout = Duration::from_secs_f64(timeout_s);
        let client = py
            .detach(|| runtime().block_on(Client::open(&masters, &s, &scope, timeout)))
            .or_raise()?;
        Ok(StoreClient { client, masters })
    }

    #[getter]
    fn scope(&self) -> String {
        self.client.scope().to_string()
    }

    #[getter]
    fn session(&self) -> u64 {
        self.client.session()
    }

    #[pyo3(signature = (key, value, ephemeral=false))]
    fn set(&self, py: Python<'_>, key: B<'_>, value: B<'_>, ephemeral: bool) -> PyResult<()> {
        let (key, value) = (v(&key), v(&value));
        let c = self.client.clone();
        self.run(py, async move {
            if ephemeral {
                c.set_ephemeral(&key, &value).await
            } else {
                c.set(&key, &value).await
            }
        })
    }

    /// The values of `keys` now: bytes, or None for a missing key.
    fn get(&self, py: Python<'_>, keys: Vec<B<'_>>) -> PyResult<Vec<Option<Py<PyBytes>>>> {
        let keys = vs(&keys);
        let c = self.client.clone();
        let v = self.run(py, async move { c.get(keys).await })?;
        Ok(v.into_iter().map(|v| v.map(|v| bytes(py, v))).collect())
    }

    /// Waits (at most `timeout_s`) for `keys`, then returns their values.
    fn wait_get(
        &self,
        py: Python<'_>,
        keys: Vec<B<'_>>,
        timeout_s: f64,
    ) -> PyResult<Vec<Py<PyBytes>>> {
        let keys = vs(&keys);
        let c = self.client.clone();
        let t = Duration::from_secs_f64(timeout_s.max(0.0));
        let v = self.run(py, async move { c.wait_get(keys, t).await })?;
        v.into_iter()
            .map(|v| {
                v.map(|v| bytes(py, v))
                    .ok_or_else(|| invalid("a key was deleted while it was read"))
            })
            .collect()
    }

    fn multi_set(&self, py: Python<'_>, pairs: Vec<(B<'_>, B<'_>)>) -> PyResult<()> {
        let pairs: Vec<_> = pairs.iter().map(|(k, x)| (v(k), v(x))).collect();
        let c = self.client.clone();
        self.run(py, async move { c.multi_set(pairs).await })
    }

    fn add(&self, py: Python<'_>, key: B<'_>, delta: i64) -> PyResult<i64> {
        let key = v(&key);
        let c = self.client.clone();
        self.run(py, async move { c.add(&key, delta).await })
    }

    fn append(&self, py: Python<'_>, key: B<'_>, value: B<'_>) -> PyResult<()> {
        let (key, value) = (v(&key), v(&value));
        let c = self.client.clone();
        self.run(py, async move { c.append(&key, &value).await })
    }

    fn compare_set(
        &self,
        py: Python<'_>,
        key: B<'_>,
        expected: B<'_>,
        desired: B<'_>,
    ) -> PyResult<Py<PyBytes>> {
        let (key, expected, desired) = (v(&key), v(&expected), v(&desired));
        let c = self.client.clone();
        let v = self.run(
            py,
            async move { c.compare_set(&key, &expected, &desired).await },
        )?;
        Ok(bytes(py, v))
    }

    fn delete_key(&self, py: Python<'_>, key: B<'_>) -> PyResult<bool> {
        let key = v(&key);
        let c = self.client.clone();
        self.run(py, async move { c.delete(&key).await })
    }

    fn check(&self, py: Python<'_>, keys: Vec<B<'_>>) -> PyResult<bool> {
        let keys = vs(&keys);
        let c = self.client.clone();
        self.run(py, async move { c.check(keys).await })
    }

    /// Returns once every key exists; `eccl.EcclTimeoutError` (a `TimeoutError`) after `timeout_s`.
    fn wait(&self, py: Python<'_>, keys: Vec<B<'_>>, timeout_s: f64) -> PyResult<()> {
        let keys = vs(&keys);
        let c = self.client.clone();
        let t = Duration::from_secs_f64(timeout_s.max(0.0));
        self.run(py, async move { c.wait(keys, t).await })
    }

    fn num_keys(&self, py: Python<'_>) -> PyResult<u64> {
        let c = self.client.clone();
        self.run(py, async move { c.num_keys().await })
    }

    /// The keys that start with `prefix`, with their values, in key order.
    fn list(&self, py: Python<'_>, prefix: B<'_>) -> PyResult<Vec<(Py<PyBytes>, Py<PyBytes>)>> {
        let prefix = v(&prefix);
        let c = self.client.clone();
        let l = self.run(py, async move { c.list(&prefix).await })?;
        Ok(l.into_iter()
            .map(|(k, v)| (bytes(py, k), bytes(py, v)))
            .collect())
    }

    /// Ends the session (its ephemeral keys go; the scope's keys too if it was the last
    /// session of the scope).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.client.clone();
        self.run(py, async move { c.close().await })
    }
}
