//! The master's client listener: every connection runs TLS and authenticates with the
//! job secret, or a store job's, first (at most [`MAX_PENDING`] at once, see
//! `eccl_transport::admission`), and is then served by [`crate::connection`]. Raft
//! between masters has a listener and a secret of its own and is refused here.

use std::sync::Arc;

use eccl_protocol::auth::{Role, Secret};
use eccl_transport::admission::Admission;
use eccl_transport::control;
use eccl_transport::logging;
use tokio::net::TcpListener;

use crate::coordinator::Coordinator;

pub use eccl_transport::admission::MAX_PENDING;

/// The credentials the client listener takes: the job's (its peers and its store), and
/// those of other jobs whose stores these masters keep too, each opening only its own
/// job's scopes.
#[derive(Clone)]
pub struct Jobs {
    /// The job's secret first, then each store job's, in [`Jobs::names`]' order.
    secrets: Arc<Vec<Secret>>,
    names: Arc<Vec<String>>,
}

/// Store jobs one master set keeps at most.
pub const MAX_STORE_JOBS: usize = 64;

impl Jobs {
    pub fn new(job: Secret, store_jobs: Vec<(String, Secret)>) -> anyhow::Result<Jobs> {
        if store_jobs.len() > MAX_STORE_JOBS {
            anyhow::bail!("{} store jobs (at most {MAX_STORE_JOBS})", store_jobs.len());
        }
        let mut names = Vec::new();
        let id = |s: &Secret| s.derive(b"eccl-distinct-jobs");
        let mut ids = vec![id(&job)];
        let mut secrets = vec![job];
        for (name, secret) in store_jobs {
            if ids.contains(&id(&secret)) {
                anyhow::bail!(
                    "store job {name:?} has the secret of another job: give each its own"
                );
            }
            ids.push(id(&secret));
            crate::store::check_job_name(&name).map_err(|e| anyhow::anyhow!(e))?;
            if names.contains(&name) {
                anyhow::bail!("store job {name:?} is named twice");
            }
            names.push(name);
            secrets.push(secret);
        }
        Ok(Jobs {
            secrets: Arc::new(secrets),
            names: Arc::new(names),
        })
    }

    /// The store job a connection authenticated with secret `i` belongs to (`None`: the
    /// job whose peers these masters serve).
    fn of(&self, i: usize) -> Option<String> {
        i.checked_sub(1).and_then(|j| self.names.get(j).cloned())
    }
}

/// Bytes of large control messages (past 64 KiB) the client listener's connections may be
/// reading at once, together: many connections sending large messages cannot make the
/// master hold more (a message past it ends its connection).
pub const MAX_BODY_BYTES_READING: usize = 128 << 20;

/// Accepts connections until the task is aborted.
pub async fn serve(listener: TcpListener, coord: Arc<Coordinator>, jobs: Jobs) {
    let pending = Admission::new(MAX_PENDING);
    let bodies = Arc::new(tokio::sync::Semaphore::new(MAX_BODY_BYTES_READING / 1024));
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(target: "eccl::master", "accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let (coord, jobs, bodies) = (coord.clone(), jobs.clone(), bodies.clone());
        pending.admit(
            async move {
                match control::accept_any(stream, &jobs.secrets).await {
                    Ok((Role::PeerToMaster, i, mut conn)) => {
                        conn.rx.share_body_budget(bodies);
                        Some((conn, jobs.of(i)))
                    }
                    Ok((role, _, _)) => {
                        if let Some(held) = logging::limit("master: wrong role") {
                            tracing::warn!(target: "eccl::master", "refused a {role:?} connection from {remote} on the client listener{}", logging::held_note(held));
                        }
                        None
                    }
                    // Nothing but TLS and a random nonce was sent; the connection never
                    // reaches the registry.
                    Err(e) => {
                        if let Some(held) = logging::limit("master: refused") {
                            tracing::warn!(target: "eccl::master", "refused connection from {remote}: {e}{}", logging::held_note(held));
                        }
                        None
                    }
                }
            },
            move |(conn, job)| async move {
                if let Err(e) = crate::connection::serve(conn, remote, coord, job).await {
                    tracing::warn!(target: "eccl::master", "connection from {remote}: {e}");
                }
            },
        );
    }
}
