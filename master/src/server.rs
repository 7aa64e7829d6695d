//! The master's client listener: every connection runs TLS and authenticates with the
//! job secret first (at most [`MAX_PENDING`] at once, see
//! `eccl_transport::admission`), and is then a peer's control connection. Raft between
//! masters has a listener and a secret of its own and is refused here.

use std::net::SocketAddr;
use std::sync::Arc;

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::{
    ErrorCode, MasterMessage, MasterReply, PeerId, PeerRequest, Request, PROTOCOL_VERSION,
};
use eccl_transport::admission::Admission;
use eccl_transport::control::{self, ControlConn};
use eccl_transport::logging;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::coordinator::{Coordinator, Outgoing, ReplyTo};
use crate::registry::Command;

pub use eccl_transport::admission::MAX_PENDING;

/// Accepts connections until the task is aborted.
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
                if let Err(e) = serve_peer(conn, remote, coord, job).await {
                    tracing::warn!(target: "eccl::master", "connection from {remote}: {e}");
                }
            },
        );
    }
}

/// Requests one connection may have in progress at once on tasks of their own (store
/// reads and writes, waits, votes, reconfigures, cluster changes, sync reports): past
/// that, a request is refused at once, so one client cannot make the master run an
/// unbounded number of tasks. Store keep-alives and heartbeats are never bounded.
const MAX_TASKS_PER_CONN: usize = 64;

/// Runs `task` on a task of its own if the connection has fewer than
/// [`MAX_TASKS_PER_CONN`] running; else answers `refuse_to` at once.
fn spawn_bounded(
    tasks: &Arc<tokio::sync::Semaphore>,
    refuse_to: ReplyTo,
    task: impl std::future::Future<Output = ()> + Send + 'static,
) {
    match tasks.clone().try_acquire_owned() {
        Ok(permit) => {
            tokio::spawn(async move {
                task.await;
                drop(permit);
            });
        }
        Err(_) => refuse_to.send(MasterReply::Error {
            code: ErrorCode::InvalidArgument,
            message: format!(
                "{MAX_TASKS_PER_CONN} requests are in progress on this connection (at most that many)"
            ),
        }),
    }
}

/// How long an authenticated connection may say nothing before the master closes it.
/// Every real client speaks far more often (peers heartbeat every lease / 4, store
/// clients keep their session alive as often, the CLI asks once and leaves), so only a
/// connection that holds a slot for nothing is closed: without this, a job member could
/// keep any number of them open.
pub fn idle_timeout(lease: std::time::Duration) -> std::time::Duration {
    (lease * 10).max(std::time::Duration::from_secs(2))
}

async fn serve_peer(
    conn: ControlConn,
    remote: SocketAddr,
    coord: Arc<Coordinator>,
    job: Option<String>,
) -> anyhow::Result<()> {
    let ControlConn { mut rx, mut tx, .. } = conn;
    let (out, mut out_rx) = mpsc::channel::<Outgoing>(crate::coordinator::OUTBOX);
    let writer = tokio::spawn(async move {
        while let Some(o) = out_rx.recv().await {
            match tx.send(&o.msg).await {
                Ok(()) => {}
                // A reply that cannot be encoded (the store bounds its replies well under
                // the limit, so only a bug gets here) is answered with an error: the
                // connection and the replies behind it go on.
                Err(eccl_transport::TransportError::Codec { source, .. }) => {
                    tracing::warn!(target: "eccl::master", ?remote, "a reply could not be sent: {source}");
                    if let MasterMessage::Reply { id, .. } = o.msg {
                        let body = MasterReply::Error {
                            code: ErrorCode::Internal,
                            message: format!("the reply could not be sent: {source}"),
                        };
                        if tx.send(&MasterMessage::Reply { id, body }).await.is_err() {
                            break;
                        }
                    }
                }
                Err(_) => break,
            }
            // What the message held of the master's reply budget is released here.
            drop(o.held);
        }
    });
    // Requests of this connection running on tasks of their own, bounded.
    let tasks = Arc::new(tokio::sync::Semaphore::new(MAX_TASKS_PER_CONN));
    let mut me: Option<PeerId> = None;
    // The store session this connection speaks for, if it is a store client.
    let mut store_session: Option<u64> = None;
    let idle = idle_timeout(coord.timing.lease);
    let result: Result<(), eccl_transport::TransportError> = loop {
        let req: Request = match tokio::time::timeout(idle, rx.recv()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => break Err(e),
            Err(_) => {
                tracing::debug!(target: "eccl::master", ?remote, "closing a connection idle for {idle:?}");
                break Ok(());
            }
        };
        let reply = ReplyTo {
            conn: out.clone(),
            id: req.id,
        };
        if matches!(req.body, PeerRequest::ClusterStatus) {
            // Any master answers: the status is how an operator finds the leader.
            reply.send(MasterReply::Cluster(coord.raft.status()));
            continue;
        }
        if !coord.raft.is_leader() {
            let leader = coord.raft.leader().map(|(_, a)| a);
            reply.send(MasterReply::NotLeader { leader });
            continue;
        }
        if let Some(name) = &job {
            if !matches!(req.body, PeerRequest::Store(_)) {
                reply.send(MasterReply::Error {
                    code: ErrorCode::InvalidArgument,
                    message: format!(
                        "the secret of store job {name:?} opens that job's store on these masters, nothing else"
                    ),
                });
                continue;
            }
        }
        match req.body {
            PeerRequest::Store(sreq) => {
                use eccl_protocol::StoreRequest as S;
                if me.is_some() {
                    reply.send(MasterReply::Error {
                        code: ErrorCode::InvalidArgument,
                        message: "a peer's connection is not a store client's".into(),
                    });
                    continue;
                }
                match sreq {
                    // These change whom the connection speaks for: in order, here.
                    S::Open { .. } | S::Attach { .. } | S::Close => {
                        coord
                            .store_request(&mut store_session, job.as_deref(), sreq, reply)
                            .await
                    }
                    // A write may wait on raft (an election): never in the way of the
                    // keep-alives behind it, which are quick and never bounded.
                    S::KeepAlive => {
                        let (coord, mut session, job) = (coord.clone(), store_session, job.clone());
                        tokio::spawn(async move {
                            coord
                                .store_request(&mut session, job.as_deref(), S::KeepAlive, reply)
                                .await
                        });
                    }
                    sreq => {
                        let (coord, mut session, job) = (coord.clone(), store_session, job.clone());
                        spawn_bounded(&tasks, reply.clone(), async move {
                            coord
                                .store_request(&mut session, job.as_deref(), sreq, reply)
                                .await
                        });
                    }
                }
            }
            PeerRequest::Register(r) => {
                if r.protocol_version != PROTOCOL_VERSION {
                    reply.send(MasterReply::Error {
                        code: ErrorCode::VersionMismatch,
                        message: format!(
                            "peer speaks protocol {}, master {}",
                            r.protocol_version, PROTOCOL_VERSION
                        ),
                    });
                    continue;
                }
                if me.is_some() || store_session.is_some() {
                    reply.send(MasterReply::Error {
                        code: ErrorCode::InvalidArgument,
                        message: "already registered on this connection".into(),
                    });
                    continue;
                }
                let host = r
                    .advertise_host
                    .clone()
                    .unwrap_or_else(|| remote.ip().to_string());
                let addr = SocketAddr::new(
                    match host.parse() {
                        Ok(ip) => ip,
                        Err(_) => remote.ip(),
                    },
                    r.listen_port,
                );
                let at = |port: u16| {
                    if host.parse::<std::net::IpAddr>().is_ok() {
                        SocketAddr::new(addr.ip(), port).to_string()
                    } else {
                        format!("{host}:{port}")
                    }
                };
                let token: [u8; 32] = rand::random();
                let reg = Command::Register {
                    addr: at(r.listen_port),
                    quic: r.quic_port.map(at),
                    shm: r.shm_name.clone(),
                    host: r.host.clone(),
                    rank_hint: r.rank_hint,
                    token,
                };
                if let Some(why) = bad_registration(&r) {
                    reply.send(MasterReply::Error {
                        code: ErrorCode::InvalidArgument,
                        message: why,
                    });
                    continue;
                }
                match coord.register(reg, out.clone()).await {
                    Ok(id) => {
                        me = Some(id);
                        reply.send(MasterReply::Registered {
                            peer_id: id,
                            lease_ms: coord.timing.lease.as_millis() as u64,
                            heartbeat_ms: coord.timing.heartbeat.as_millis() as u64,
                            token,
                        });
                    }
                    Err(r) => reply.send(r),
                }
            }
            PeerRequest::Attach { peer_id, token } => {
                if me.is_some() {
                    reply.send(MasterReply::Error {
                        code: ErrorCode::InvalidArgument,
                        message: "already registered on this connection".into(),
                    });
                    continue;
                }
                match coord.attach(peer_id, &token, out.clone()).await {
                    Ok(()) => {
                        me = Some(peer_id);
                        reply.send(MasterReply::Ok);
                    }
                    Err(r) => reply.send(r),
                }
            }
            PeerRequest::ClusterChange {
                change,
                membership,
                proof,
            } => {
                let coord = coord.clone();
                spawn_bounded(&tasks, reply.clone(), async move {
                    use crate::raft::admin::AdminError;
                    reply.send(match coord.raft.change(&change, membership, &proof).await {
                        Ok(status) => MasterReply::Cluster(status),
                        Err(AdminError::NotLeader(leader)) => MasterReply::NotLeader { leader },
                        Err(AdminError::Refused(code, message)) => {
                            tracing::warn!(target: "eccl::master", "cluster change {change:?} refused: {message}");
                            MasterReply::Error { code, message }
                        }
                    })
                });
            }
            body => {
                let claimed = match &body {
                    PeerRequest::UpdateTopology { peer_id, .. }
                    | PeerRequest::ArePeersPending { peer_id, .. }
                    | PeerRequest::Heartbeat { peer_id }
                    | PeerRequest::ReportFault { peer_id, .. }
                    | PeerRequest::Leave { peer_id }
                    | PeerRequest::Reconfigure { peer_id, .. }
                    | PeerRequest::SyncState { peer_id, .. } => *peer_id,
                    PeerRequest::Register(_)
                    | PeerRequest::Attach { .. }
                    | PeerRequest::ClusterStatus
                    | PeerRequest::ClusterChange { .. }
                    | PeerRequest::Store(_) => {
                        unreachable!("handled above")
                    }
                };
                // A connection speaks only for the peer it registered: no one can vote,
                // leave or report in another peer's name.
                if me != Some(claimed) {
                    reply.send(MasterReply::Error {
                        code: ErrorCode::UnknownPeer,
                        message: format!("this connection is not peer {claimed}"),
                    });
                    continue;
                }
                let coord = coord.clone();
                match body {
                    PeerRequest::UpdateTopology { min_world, .. }
                        if min_world as usize > eccl_protocol::MAX_WORLD_SIZE =>
                    {
                        reply.send(MasterReply::Error {
                            code: ErrorCode::InvalidArgument,
                            message: format!(
                                "min_world {min_world} is larger than any world ({})",
                                eccl_protocol::MAX_WORLD_SIZE
                            ),
                        });
                    }
                    PeerRequest::UpdateTopology {
                        epoch,
                        min_world,
                        aborted,
                        ..
                    } => {
                        spawn_bounded(&tasks, reply.clone(), async move {
                            coord.vote(claimed, epoch, min_world, aborted, reply).await
                        });
                    }
                    PeerRequest::Reconfigure {
                        uuid,
                        members,
                        ordered,
                        ..
                    } => {
                        spawn_bounded(&tasks, reply.clone(), async move {
                            coord
                                .reconfigure(claimed, uuid, members, ordered, reply)
                                .await
                        });
                    }
                    PeerRequest::ArePeersPending { epoch, .. } => {
                        spawn_bounded(&tasks, reply.clone(), async move {
                            coord.pending_query(claimed, epoch, reply).await
                        });
                    }
                    PeerRequest::Heartbeat { .. } => {
                        coord.heartbeat(claimed);
                        // The answer tells the peer this master is alive and leads; a
                        // peer that gets none in time looks for the next leader.
                        reply.send(MasterReply::Ok);
                    }
                    PeerRequest::ReportFault {
                        suspect,
                        reason,
                        epoch,
                        ..
                    } => {
                        tracing::info!(target: "eccl::master", "peer {claimed} reports a fault in epoch {epoch} (suspect {suspect:?}): {reason}");
                        let answer = reply.clone();
                        spawn_bounded(&tasks, reply, async move {
                            answer.send(MasterReply::Ok);
                            coord.report_fault(claimed, epoch, suspect, reason).await
                        });
                    }
                    PeerRequest::SyncState {
                        epoch,
                        round,
                        revision,
                        strategy,
                        tensors,
                        ..
                    } => {
                        let report = crate::sync::Report {
                            peer: claimed,
                            round,
                            revision,
                            role: strategy,
                            tensors,
                        };
                        spawn_bounded(&tasks, reply.clone(), async move {
                            coord.sync_report(claimed, epoch, report, reply).await
                        });
                    }
                    PeerRequest::Leave { .. } => {
                        coord.remove(claimed, "left", true).await;
                        me = None;
                        reply.send(MasterReply::Ok);
                    }
                    PeerRequest::Register(_)
                    | PeerRequest::Attach { .. }
                    | PeerRequest::ClusterStatus
                    | PeerRequest::ClusterChange { .. }
                    | PeerRequest::Store(_) => {
                        unreachable!("handled above")
                    }
                }
            }
        }
    };
    // The control connection is gone: the process died or left. A member that vanishes
    // is evicted so that the others do not wait for it.
    if let Some(id) = me {
        coord.remove(id, "lost its master connection", false).await;
    }
    // A store client that vanished (its process died) ends its session at once: its
    // ephemeral keys say "alive" no longer.
    if let Some(id) = store_session {
        coord.close_session(id, "lost its connection").await;
    }
    drop(out);
    let _ = writer.await;
    match result {
        Ok(()) => Ok(()),
        Err(eccl_transport::TransportError::Closed { .. }) => Ok(()),
        // A peer process that exits without closing its socket resets it: a departure,
        // already handled above, not a fault of the connection.
        Err(eccl_transport::TransportError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::ConnectionReset =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Why a registration's fields cannot be taken as they are: names that would make every
/// world message huge, or a shm socket name that is not a plain token.
fn bad_registration(r: &eccl_protocol::RegisterRequest) -> Option<String> {
    let token = |s: &str| {
        s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
    };
    if r.host.len() > 256 || !token(&r.host) {
        return Some("host identity must be at most 256 characters of [A-Za-z0-9-_.:]".into());
    }
    if r.advertise_host.as_ref().is_some_and(|h| h.len() > 256) {
        return Some("advertised host must be at most 256 characters".into());
    }
    if r.shm_name
        .as_ref()
        .is_some_and(|n| n.len() > 100 || !token(n))
    {
        return Some("shm socket name must be at most 100 characters of [A-Za-z0-9-_.:]".into());
    }
    None
}
