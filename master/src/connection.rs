//! One authenticated client connection of the master (a peer's control connection, a
//! store client's, or the cluster command's): its reader loop, its writer task, and what
//! each request does, one method per kind of request. What the connection speaks for
//! (a registered peer, a store session) is its state; a request in another's name is
//! refused.

use std::net::SocketAddr;
use std::sync::Arc;

use eccl_protocol::store::StoreRequest;
use eccl_protocol::{
    ErrorCode, MasterMessage, MasterReply, PeerId, PeerRequest, RegisterRequest, Request,
    PROTOCOL_VERSION,
};
use eccl_transport::control::{ControlConn, ControlTx};
use eccl_transport::TransportError;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use crate::coordinator::{Coordinator, Outbox, Outgoing, ReplyTo};
use crate::registry::Command;

/// Requests one connection may have in progress at once on tasks of their own (store
/// reads and writes, waits, votes, reconfigures, cluster changes, sync reports): past
/// that, a request is refused at once, so one client cannot make the master run an
/// unbounded number of tasks. Store keep-alives and heartbeats are never bounded.
const MAX_TASKS_PER_CONN: usize = 64;

/// Serves one authenticated connection until it closes, is idle for too long, or fails;
/// then removes the peer it registered (if any) and ends its store session (if any).
/// `job`: the store job whose secret the connection proved (`None`: the job these
/// masters serve).
pub async fn serve(
    conn: ControlConn,
    remote: SocketAddr,
    coord: Arc<Coordinator>,
    job: Option<String>,
) -> anyhow::Result<()> {
    let ControlConn { mut rx, tx, .. } = conn;
    let (out, writer) = spawn_writer(tx, remote);
    let mut c = Connection {
        coord,
        remote,
        job,
        out,
        tasks: Arc::new(Semaphore::new(MAX_TASKS_PER_CONN)),
        me: None,
        store_session: None,
    };
    // One idle timer for the connection's life, moved on only when it fires (a timer
    // armed and dropped around every message cost the master's heartbeat work a few
    // per cent: at thousands of peers it is the work a master does most).
    let mut idle = c.idle();
    let timer = tokio::time::sleep(idle);
    tokio::pin!(timer);
    let mut last = tokio::time::Instant::now();
    let result: Result<(), TransportError> = loop {
        let next = {
            // Kept across the timer's early wake-ups, so that no read is dropped midway.
            let recv = rx.recv::<Request>();
            tokio::pin!(recv);
            loop {
                tokio::select! {
                    biased;
                    r = &mut recv => break Some(r),
                    () = &mut timer => {
                        let due = last + idle;
                        if tokio::time::Instant::now() >= due {
                            break None;
                        }
                        timer.as_mut().reset(due);
                    }
                }
            }
        };
        match next {
            Some(Ok(req)) => {
                last = tokio::time::Instant::now();
                c.dispatch(req).await;
                // A store session on this connection keeps it longer (its lease).
                idle = c.idle();
            }
            Some(Err(e)) => break Err(e),
            None => {
                tracing::debug!(target: "eccl::master", remote = ?c.remote, "closing a connection idle for {idle:?}");
                break Ok(());
            }
        }
    };
    c.gone().await;
    let _ = writer.await;
    match result {
        Ok(()) | Err(TransportError::Closed { .. }) => Ok(()),
        // A peer process that exits without closing its socket resets it: a departure,
        // already handled above, not a fault of the connection.
        Err(TransportError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::ConnectionReset =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// The task that writes the connection's replies and events in order; what a message
/// holds of the master's reply budget is released once it is written.
fn spawn_writer(mut tx: ControlTx, remote: SocketAddr) -> (Outbox, JoinHandle<()>) {
    let (out, mut out_rx) = mpsc::channel::<Outgoing>(crate::coordinator::OUTBOX);
    let writer = tokio::spawn(async move {
        while let Some(o) = out_rx.recv().await {
            match tx.send(&o.msg).await {
                Ok(()) => {}
                // A reply that cannot be encoded (the store bounds its replies well under
                // the limit, so only a bug gets here) is answered with an error: the
                // connection and the replies behind it go on.
                Err(TransportError::Codec { source, .. }) => {
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
            drop(o.held);
        }
    });
    (out, writer)
}

fn invalid(message: impl Into<String>) -> MasterReply {
    MasterReply::Error {
        code: ErrorCode::InvalidArgument,
        message: message.into(),
    }
}

struct Connection {
    coord: Arc<Coordinator>,
    remote: SocketAddr,
    job: Option<String>,
    out: Outbox,
    /// Requests of this connection running on tasks of their own, bounded.
    tasks: Arc<Semaphore>,
    /// The peer this connection registered (or attached) as.
    me: Option<PeerId>,
    /// The store session this connection speaks for, if it is a store client.
    store_session: Option<u64>,
}

impl Connection {
    /// How long this connection may say nothing: longer once it holds a store session
    /// (its lease).
    fn idle(&self) -> std::time::Duration {
        if self.store_session.is_some() {
            self.coord.timing.store_idle_timeout()
        } else {
            self.coord.timing.idle_timeout()
        }
    }

    /// Answers `req`, or starts the task that will: first what any master answers, then
    /// what only the leader does, then what the connection's credential allows.
    async fn dispatch(&mut self, req: Request) {
        let reply = ReplyTo {
            conn: self.out.clone(),
            id: req.id,
        };
        if matches!(req.body, PeerRequest::ClusterStatus) {
            // Any master answers: the status is how an operator finds the leader.
            reply.send(MasterReply::Cluster(self.coord.raft.status()));
            return;
        }
        if !self.coord.raft.is_leader() {
            let leader = self.coord.raft.leader().map(|(_, a)| a);
            reply.send(MasterReply::NotLeader { leader });
            return;
        }
        if let Some(name) = &self.job {
            if !matches!(req.body, PeerRequest::Store(_)) {
                reply.send(invalid(format!(
                    "the secret of store job {name:?} opens that job's store on these masters, nothing else"
                )));
                return;
            }
        }
        match req.body {
            PeerRequest::ClusterStatus => unreachable!("answered above"),
            PeerRequest::Store(sreq) => self.store(sreq, reply).await,
            PeerRequest::Register(r) => self.register(r, reply).await,
            PeerRequest::Attach { peer_id, token } => self.attach(peer_id, token, reply).await,
            PeerRequest::ClusterChange {
                change,
                membership,
                proof,
            } => {
                let coord = self.coord.clone();
                self.spawn(reply.clone(), async move {
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
            member => self.member(member, reply).await,
        }
    }

    /// Runs `task` on a task of its own if the connection has fewer than
    /// [`MAX_TASKS_PER_CONN`] running; else answers `refuse_to` at once.
    fn spawn(
        &self,
        refuse_to: ReplyTo,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        match self.tasks.clone().try_acquire_owned() {
            Ok(permit) => {
                tokio::spawn(async move {
                    task.await;
                    drop(permit);
                });
            }
            Err(_) => refuse_to.send(invalid(format!(
                "{MAX_TASKS_PER_CONN} requests are in progress on this connection (at most that many)"
            ))),
        }
    }

    async fn store(&mut self, sreq: StoreRequest, reply: ReplyTo) {
        use StoreRequest as S;
        if self.me.is_some() {
            reply.send(invalid("a peer's connection is not a store client's"));
            return;
        }
        match sreq {
            // These change whom the connection speaks for: in order, here.
            S::Open { .. } | S::Attach { .. } | S::Close => {
                self.coord
                    .store_request(&mut self.store_session, self.job.as_deref(), sreq, reply)
                    .await
            }
            // A write may wait on raft (an election): never in the way of the keep-alives
            // behind it, which are quick and never bounded.
            S::KeepAlive => {
                let (coord, mut session, job) =
                    (self.coord.clone(), self.store_session, self.job.clone());
                tokio::spawn(async move {
                    coord
                        .store_request(&mut session, job.as_deref(), S::KeepAlive, reply)
                        .await
                });
            }
            sreq => {
                let (coord, mut session, job) =
                    (self.coord.clone(), self.store_session, self.job.clone());
                self.spawn(reply.clone(), async move {
                    coord
                        .store_request(&mut session, job.as_deref(), sreq, reply)
                        .await
                });
            }
        }
    }

    async fn register(&mut self, r: RegisterRequest, reply: ReplyTo) {
        if r.protocol_version != PROTOCOL_VERSION {
            reply.send(MasterReply::Error {
                code: ErrorCode::VersionMismatch,
                message: format!(
                    "peer speaks protocol {}, master {}",
                    r.protocol_version, PROTOCOL_VERSION
                ),
            });
            return;
        }
        if self.me.is_some() || self.store_session.is_some() {
            reply.send(invalid("already registered on this connection"));
            return;
        }
        if let Some(why) = bad_registration(&r) {
            reply.send(invalid(why));
            return;
        }
        let token: [u8; 32] = rand::random();
        let reg = registration(&r, self.remote, token);
        match self.coord.register(reg, self.out.clone()).await {
            Ok(id) => {
                self.me = Some(id);
                reply.send(MasterReply::Registered {
                    peer_id: id,
                    lease_ms: self.coord.timing.lease.as_millis() as u64,
                    heartbeat_ms: self.coord.timing.heartbeat.as_millis() as u64,
                    token,
                });
            }
            Err(r) => reply.send(r),
        }
    }

    async fn attach(&mut self, peer_id: PeerId, token: [u8; 32], reply: ReplyTo) {
        if self.me.is_some() {
            reply.send(invalid("already registered on this connection"));
            return;
        }
        match self.coord.attach(peer_id, &token, self.out.clone()).await {
            Ok(()) => {
                self.me = Some(peer_id);
                reply.send(MasterReply::Ok);
            }
            Err(r) => reply.send(r),
        }
    }

    /// A request a registered peer makes in its own name: a connection speaks only for
    /// the peer it registered, so no one can vote, leave or report in another's name.
    async fn member(&mut self, body: PeerRequest, reply: ReplyTo) {
        let Some(claimed) = body.member() else {
            unreachable!("dispatch answers every request that names no member")
        };
        if self.me != Some(claimed) {
            reply.send(MasterReply::Error {
                code: ErrorCode::UnknownPeer,
                message: format!("this connection is not peer {claimed}"),
            });
            return;
        }
        let coord = self.coord.clone();
        match body {
            PeerRequest::UpdateTopology { min_world, .. }
                if min_world as usize > eccl_protocol::MAX_WORLD_SIZE =>
            {
                reply.send(invalid(format!(
                    "min_world {min_world} is larger than any world ({})",
                    eccl_protocol::MAX_WORLD_SIZE
                )));
            }
            PeerRequest::UpdateTopology { fresh, .. }
                if fresh.len() > eccl_protocol::MAX_WORLD_SIZE =>
            {
                reply.send(invalid(format!(
                    "a vote names {} links to connect again, more than any world has",
                    fresh.len()
                )));
            }
            PeerRequest::UpdateTopology {
                epoch,
                min_world,
                aborted,
                fresh,
                ..
            } => self.spawn(reply.clone(), async move {
                coord
                    .vote(claimed, epoch, min_world, aborted, fresh, reply)
                    .await
            }),
            PeerRequest::Reconfigure {
                uuid,
                members,
                ordered,
                ..
            } => self.spawn(reply.clone(), async move {
                coord
                    .reconfigure(claimed, uuid, members, ordered, reply)
                    .await
            }),
            PeerRequest::Topology { epoch, links, .. } => self.spawn(reply.clone(), async move {
                coord.topology(claimed, epoch, links, reply).await
            }),
            PeerRequest::ArePeersPending { epoch, .. } => self.spawn(reply.clone(), async move {
                coord.pending_query(claimed, epoch, reply).await
            }),
            PeerRequest::Heartbeat { .. } => {
                coord.heartbeat(claimed);
                // The answer tells the peer this master is alive and leads; a peer that
                // gets none in time looks for the next leader.
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
                self.spawn(reply, async move {
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
                self.spawn(reply.clone(), async move {
                    coord.sync_report(claimed, epoch, report, reply).await
                });
            }
            PeerRequest::Leave { .. } => {
                coord.remove(claimed, "left", true).await;
                self.me = None;
                reply.send(MasterReply::Ok);
            }
            PeerRequest::Register(_)
            | PeerRequest::Attach { .. }
            | PeerRequest::ClusterStatus
            | PeerRequest::ClusterChange { .. }
            | PeerRequest::Store(_) => unreachable!("these name no member"),
        }
    }

    /// The connection is gone: the process died or left. A member that vanishes is
    /// evicted so that the others do not wait for it; a store client's session ends at
    /// once, so its ephemeral keys say "alive" no longer.
    async fn gone(self) {
        if let Some(id) = self.me {
            self.coord.connection_closed(id, &self.out).await;
        }
        if let Some(id) = self.store_session {
            self.coord.close_session(id, "lost its connection").await;
        }
    }
}

/// What the registry records of a registering peer: its addresses as others reach them
/// (the advertised host, else the address the connection came from; a host name stays a
/// name) and its credential.
pub fn registration(r: &RegisterRequest, remote: SocketAddr, token: [u8; 32]) -> Command {
    let host = r
        .advertise_host
        .clone()
        .unwrap_or_else(|| remote.ip().to_string());
    let ip = host.parse::<std::net::IpAddr>().ok();
    let at = |port: u16| match ip {
        Some(ip) => SocketAddr::new(ip, port).to_string(),
        None => format!("{host}:{port}"),
    };
    Command::Register {
        addr: at(r.listen_port),
        quic: r.quic_port.map(at),
        shm: r.shm_name.clone(),
        host: r.host.clone(),
        rank_hint: r.rank_hint,
        token,
    }
}

/// Why a registration's fields cannot be taken as they are: names that would make every
/// world message huge, or a shm socket name that is not a plain token.
pub fn bad_registration(r: &RegisterRequest) -> Option<String> {
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
