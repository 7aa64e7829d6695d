//! Raft RPCs between masters over control connections (TLS, authenticated with the
//! cluster's secret for `Role::MasterToMaster`), as length-prefixed bincode [`RaftRpc`]
//! / [`RaftRpcReply`]. Each connection starts with a [`RaftHello`] naming the master
//! that dials; the server takes connections only from masters of the cluster and
//! requests only in that master's name, with sane terms.
//!
//! Client side: one pool of idle connections per target master. Openraft asks for a
//! new client for every heartbeat round and every election, and it cancels an RPC that
//! overruns its timeout (the heartbeat interval for append-entries) by dropping the
//! future. So:
//! - an RPC takes a connection out of the pool and puts it back only after a complete
//!   request/reply exchange; a cancelled or failed exchange drops the connection (its
//!   stream position is unknown);
//! - dialing runs in a spawned task, so a dial that outlives the RPC that asked for it
//!   still lands in the pool for the next RPC; dials to one target are serialized and a
//!   target that just failed to dial is reported unreachable without dialing again for
//!   a short while (no pile-up of dials to a dead master).
//!
//! Server side: [`serve_raft_conn`] answers requests on one connection in order.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eccl_protocol::auth::{Role, Secret};
use eccl_transport::control::{self, ControlConn};
use openraft::error::{
    Fatal, InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{Backoff, RPCOption};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{RaftNetwork, RaftNetworkFactory};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use super::types::{MasterId, MasterNode, RaftHello, RaftNode, RaftRpc, RaftRpcReply, TypeConfig};

/// Bound on dialing a master: TCP connect plus handshake.
const DIAL_TIMEOUT: Duration = Duration::from_secs(1);
/// After a failed dial, RPCs to that master fail fast for this long.
const DIAL_RETRY_AFTER: Duration = Duration::from_millis(100);
/// Idle connections kept per target (a replication stream, a heartbeat, a snapshot).
const MAX_IDLE_PER_TARGET: usize = 4;

#[derive(Debug, Clone, thiserror::Error)]
enum NetError {
    #[error("master {target} at {addr} is unreachable: {msg}")]
    Unreachable {
        target: MasterId,
        addr: String,
        msg: String,
    },
    #[error("raft rpc {rpc} to master {target} at {addr} failed: {msg}")]
    Io {
        rpc: &'static str,
        target: MasterId,
        addr: String,
        msg: String,
    },
    #[error("master {target} at {addr} is shut down: {msg}")]
    Stopped {
        target: MasterId,
        addr: String,
        msg: String,
    },
}

impl NetError {
    fn into_rpc<E: std::error::Error>(self) -> RPCError<MasterId, MasterNode, E> {
        match self {
            e @ (NetError::Unreachable { .. } | NetError::Stopped { .. }) => {
                RPCError::Unreachable(Unreachable::new(&e))
            }
            e @ NetError::Io { .. } => RPCError::Network(NetworkError::new(&e)),
        }
    }
}

/// Connections to one target master.
struct PeerConns {
    target: MasterId,
    /// The target's raft listener.
    addr: String,
    secret: Secret,
    /// This master's id, announced on every connection.
    me: MasterId,
    idle: Mutex<Vec<ControlConn>>,
    /// Serializes dials; holds the time and reason of the last failed dial.
    dial: tokio::sync::Mutex<Option<(Instant, String)>>,
}

impl PeerConns {
    fn take_idle(&self) -> Option<ControlConn> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    fn put_back(&self, conn: ControlConn) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE_PER_TARGET {
            idle.push(conn);
        }
    }

    fn unreachable(&self, msg: String) -> NetError {
        NetError::Unreachable {
            target: self.target,
            addr: self.addr.clone(),
            msg,
        }
    }

    async fn dial(&self) -> Result<ControlConn, NetError> {
        let mut last_failure = self.dial.lock().await;
        // Someone else may have dialed while we waited.
        if let Some(c) = self.take_idle() {
            return Ok(c);
        }
        if let Some((at, msg)) = last_failure.as_ref() {
            if at.elapsed() < DIAL_RETRY_AFTER {
                return Err(self.unreachable(msg.clone()));
            }
        }
        let dial = async {
            let mut c =
                control::connect(&self.addr, &self.secret, Role::MasterToMaster, DIAL_TIMEOUT)
                    .await?;
            c.send(&RaftHello { from: self.me }).await?;
            Ok::<_, eccl_transport::TransportError>(c)
        };
        let res = tokio::time::timeout(DIAL_TIMEOUT, dial).await;
        let err = match res {
            Ok(Ok(conn)) => {
                *last_failure = None;
                return Ok(conn);
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("dial timed out after {DIAL_TIMEOUT:?}"),
        };
        tracing::debug!(target_master = self.target, addr = %self.addr, error = %err, "raft dial failed");
        *last_failure = Some((Instant::now(), err.clone()));
        Err(self.unreachable(err))
    }

    /// An idle connection, or a new one. The bool says whether it was reused (and so
    /// may have gone stale since its last use).
    async fn acquire(self: &Arc<Self>) -> Result<(ControlConn, bool), NetError> {
        if let Some(c) = self.take_idle() {
            return Ok((c, true));
        }
        let (tx, rx) = oneshot::channel();
        let me = self.clone();
        tokio::spawn(async move {
            let res = me.dial().await;
            // The asking RPC was cancelled: keep the connection for the next one.
            if let Err(Ok(conn)) = tx.send(res) {
                me.put_back(conn);
            }
        });
        match rx.await {
            Ok(res) => res.map(|c| (c, false)),
            Err(_) => Err(self.unreachable("dial task ended".into())),
        }
    }

    /// One request/reply exchange. A failure on a reused connection is retried once on
    /// a fresh one (the target may have restarted since that connection was opened).
    async fn call(self: &Arc<Self>, req: &RaftRpc) -> Result<RaftRpcReply, NetError> {
        for attempt in 0..2 {
            let (mut conn, reused) = self.acquire().await?;
            let res = async {
                conn.send(req).await?;
                conn.recv::<RaftRpcReply>().await
            }
            .await;
            match res {
                Ok(reply) => {
                    self.put_back(conn);
                    return Ok(reply);
                }
                Err(e) => {
                    drop(conn);
                    if reused && attempt == 0 {
                        continue;
                    }
                    return Err(NetError::Io {
                        rpc: req.kind(),
                        target: self.target,
                        addr: self.addr.clone(),
                        msg: e.to_string(),
                    });
                }
            }
        }
        Err(NetError::Io {
            rpc: req.kind(),
            target: self.target,
            addr: self.addr.clone(),
            msg: "retries exhausted".into(),
        })
    }
}

/// Creates [`MasterClient`]s; holds the connection pools, keyed by target id and
/// address (a master that moved gets a new pool).
#[derive(Clone)]
pub struct MasterNetwork {
    secret: Secret,
    me: MasterId,
    pools: Arc<Mutex<BTreeMap<(MasterId, String), Arc<PeerConns>>>>,
}

impl MasterNetwork {
    pub fn new(secret: Secret, me: MasterId) -> MasterNetwork {
        MasterNetwork {
            secret,
            me,
            pools: Arc::new(Mutex::new(BTreeMap::new())),
        }
    }

    fn pool(&self, target: MasterId, addr: &str) -> Arc<PeerConns> {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .entry((target, addr.to_string()))
            .or_insert_with(|| {
                Arc::new(PeerConns {
                    target,
                    addr: addr.to_string(),
                    secret: self.secret.clone(),
                    me: self.me,
                    idle: Mutex::new(Vec::new()),
                    dial: tokio::sync::Mutex::new(None),
                })
            })
            .clone()
    }

    /// Drops all idle connections (on shutdown).
    pub fn close_all(&self) {
        let pools = std::mem::take(&mut *self.pools.lock().unwrap_or_else(|e| e.into_inner()));
        for p in pools.values() {
            p.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }
}

impl fmt::Debug for MasterNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MasterNetwork").finish_non_exhaustive()
    }
}

impl RaftNetworkFactory<TypeConfig> for MasterNetwork {
    type Network = MasterClient;

    async fn new_client(&mut self, target: MasterId, node: &MasterNode) -> MasterClient {
        MasterClient {
            target,
            node: node.clone(),
            conns: self.pool(target, &node.raft),
        }
    }
}

/// Sends raft RPCs to one master.
pub struct MasterClient {
    target: MasterId,
    node: MasterNode,
    conns: Arc<PeerConns>,
}

impl MasterClient {
    fn mismatch<E: std::error::Error>(
        &self,
        rpc: &'static str,
    ) -> RPCError<MasterId, MasterNode, E> {
        NetError::Io {
            rpc,
            target: self.target,
            addr: self.node.raft.clone(),
            msg: "reply does not match the request".into(),
        }
        .into_rpc()
    }

    fn stopped<E: std::error::Error>(
        &self,
        fatal: Fatal<MasterId>,
    ) -> RPCError<MasterId, MasterNode, E> {
        NetError::Stopped {
            target: self.target,
            addr: self.node.raft.clone(),
            msg: fatal.to_string(),
        }
        .into_rpc()
    }
}

impl RaftNetwork<TypeConfig> for MasterClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<MasterId>, RPCError<MasterId, MasterNode, RaftError<MasterId>>>
    {
        match self
            .conns
            .call(&RaftRpc::AppendEntries(rpc))
            .await
            .map_err(NetError::into_rpc)?
        {
            RaftRpcReply::AppendEntries(Ok(r)) => Ok(r),
            RaftRpcReply::AppendEntries(Err(f)) => Err(self.stopped(f)),
            _ => Err(self.mismatch("append_entries")),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<MasterId>,
        RPCError<MasterId, MasterNode, RaftError<MasterId, InstallSnapshotError>>,
    > {
        match self
            .conns
            .call(&RaftRpc::InstallSnapshot(rpc))
            .await
            .map_err(NetError::into_rpc)?
        {
            RaftRpcReply::InstallSnapshot(Ok(r)) => Ok(r),
            RaftRpcReply::InstallSnapshot(Err(RaftError::Fatal(f))) => Err(self.stopped(f)),
            RaftRpcReply::InstallSnapshot(Err(e)) => Err(RPCError::RemoteError(
                RemoteError::new_with_node(self.target, self.node.clone(), e),
            )),
            _ => Err(self.mismatch("install_snapshot")),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<MasterId>,
        _option: RPCOption,
    ) -> Result<VoteResponse<MasterId>, RPCError<MasterId, MasterNode, RaftError<MasterId>>> {
        match self
            .conns
            .call(&RaftRpc::Vote(rpc))
            .await
            .map_err(NetError::into_rpc)?
        {
            RaftRpcReply::Vote(Ok(r)) => Ok(r),
            RaftRpcReply::Vote(Err(f)) => Err(self.stopped(f)),
            _ => Err(self.mismatch("vote")),
        }
    }

    fn backoff(&self) -> Backoff {
        // After an unreachable target: retry soon, a restarted master rejoins quickly.
        Backoff::new(std::iter::repeat(Duration::from_millis(200)))
    }
}

fn fatal_of(e: RaftError<MasterId>) -> Fatal<MasterId> {
    match e {
        RaftError::Fatal(f) => f,
        RaftError::APIError(never) => match never {},
    }
}

/// Serves raft RPCs from master `from` on `conn` (authenticated with the cluster secret
/// and introduced by its hello) until the connection closes or `raft` shuts down. A
/// request in another master's name, or with an absurd term, ends the connection
/// unanswered.
pub async fn serve_raft_conn(raft: RaftNode, mut conn: ControlConn, from: MasterId) {
    let peer = conn.peer_addr;
    loop {
        // A master's pooled connection that said nothing this long is closed (the pool
        // dials again when it needs one): idle authenticated connections hold nothing.
        let req: RaftRpc = match tokio::time::timeout(RAFT_IDLE, conn.recv()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::trace!(?peer, error = %e, "raft connection closed");
                return;
            }
            Err(_) => {
                tracing::trace!(?peer, "raft connection idle for {RAFT_IDLE:?}: closed");
                return;
            }
        };
        if let Some(why) = req.refuse(from) {
            tracing::warn!(target: "eccl::master", "refused raft request from master {from} ({peer:?}): {why}");
            return;
        }
        let (reply, stopped) = match req {
            RaftRpc::AppendEntries(r) => {
                let res = raft.append_entries(r).await.map_err(fatal_of);
                let stopped = res.is_err();
                (RaftRpcReply::AppendEntries(res), stopped)
            }
            RaftRpc::Vote(r) => {
                let res = raft.vote(r).await.map_err(fatal_of);
                let stopped = res.is_err();
                (RaftRpcReply::Vote(res), stopped)
            }
            RaftRpc::InstallSnapshot(r) => {
                let res = raft.install_snapshot(r).await;
                let stopped = matches!(res, Err(RaftError::Fatal(_)));
                (RaftRpcReply::InstallSnapshot(res), stopped)
            }
        };
        if conn.send(&reply).await.is_err() || stopped {
            // A stopped raft node answers nothing more; closing tells the sender so.
            return;
        }
    }
}

/// Accepts other masters' connections on `listener` (this master's raft listener):
/// TLS, the handshake with the cluster's `secret` for `Role::MasterToMaster`, and a
/// hello from a master that `is_master` knows; then serves them with
/// [`serve_raft_conn`]. Anything else is dropped. Runs until the task is aborted.
///
/// At most [`MAX_PENDING_RAFT`] connections authenticate at once; past that the oldest
/// handshake in progress is cancelled (as on the client listener), so connections that
/// never speak cannot keep another master out: a real one finishes within milliseconds.
pub async fn serve_raft_listener(
    listener: TcpListener,
    raft: RaftNode,
    secret: Secret,
    is_master: Arc<dyn Fn(MasterId) -> bool + Send + Sync>,
) {
    let pending = eccl_transport::admission::Admission::new(MAX_PENDING_RAFT);
    loop {
        let (stream, from_addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "raft listener accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (raft, secret, is_master) = (raft.clone(), secret.clone(), is_master.clone());
        let handshake = async move {
            let start = async {
                let (role, mut conn) = control::accept(stream, &secret).await?;
                if role != Role::MasterToMaster {
                    anyhow::bail!("a {role:?} connection on the raft listener");
                }
                let hello: RaftHello = tokio::time::timeout(DIAL_TIMEOUT, conn.recv())
                    .await
                    .map_err(|_| anyhow::anyhow!("no hello"))??;
                if !is_master(hello.from) {
                    anyhow::bail!("master {} is not a member of this cluster", hello.from);
                }
                Ok::<_, anyhow::Error>((conn, hello.from))
            };
            match start.await {
                Ok(started) => Some(started),
                Err(e) => {
                    if let Some(held) = eccl_transport::logging::limit("raft: refused") {
                        tracing::warn!(target: "eccl::master", "refused raft connection from {from_addr}: {e}{}", eccl_transport::logging::held_note(held))
                    }
                    None
                }
            }
        };
        pending.admit(handshake, move |(conn, from)| {
            serve_raft_conn(raft, conn, from)
        });
    }
}

/// Raft connections that may be authenticating at once.
const MAX_PENDING_RAFT: usize = 16;

/// How long a raft connection may carry nothing before it is closed.
const RAFT_IDLE: Duration = Duration::from_secs(60);
