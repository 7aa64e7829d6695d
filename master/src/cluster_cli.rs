//! The client side of `eccl-master cluster status|add|remove`: asks the masters on their
//! client listeners (the job secret's TLS), follows a follower's answer to the leader, and
//! signs changes with the cluster secret's admin key.

use futures::future::{BoxFuture, FutureExt};
use std::time::{Duration, Instant};

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::{
    ClusterChange, ClusterStatus, MasterMessage, MasterReply, PeerRequest, Request,
};
use eccl_transport::control;

/// How long one master may take to connect and answer a status request.
const DIAL: Duration = Duration::from_secs(2);

/// Asks the masters at `masters` (client addresses) for the cluster's status: the first
/// that answers.
pub fn status<'a>(
    masters: &'a [String],
    secret: &'a Secret,
) -> BoxFuture<'a, anyhow::Result<ClusterStatus>> {
    async move {
        let mut errors = Vec::new();
        for addr in masters {
            match ask(addr, secret, PeerRequest::ClusterStatus, DIAL).await {
                Ok(MasterReply::Cluster(s)) => return Ok(s),
                Ok(other) => errors.push(format!("{addr}: unexpected answer {other:?}")),
                Err(e) => errors.push(format!("{addr}: {e:#}")),
            }
        }
        anyhow::bail!("no master answered: {}", errors.join("; "))
    }
    .boxed()
}

/// Makes `change`, signed with `cluster_secret`, through whichever master leads; waits up
/// to `deadline` (adding a master waits for it to catch up). Each try asks the master for
/// the cluster's membership first and signs the change for it, so the request is good
/// for this one change only.
pub fn change<'a>(
    masters: &'a [String],
    secret: &'a Secret,
    cluster_secret: &'a Secret,
    change: ClusterChange,
    deadline: Duration,
) -> BoxFuture<'a, anyhow::Result<ClusterStatus>> {
    async move {
        let key = cluster_secret.derive(ClusterChange::KEY_LABEL);
        let end = Instant::now() + deadline;
        let mut candidates: Vec<String> = masters.to_vec();
        let mut errors: Vec<String> = Vec::new();
        while Instant::now() < end {
            let Some(addr) = candidates.first().cloned() else {
                // Nobody knew a leader: an election may be running; ask everyone again.
                tokio::time::sleep(Duration::from_millis(200)).await;
                candidates = masters.to_vec();
                continue;
            };
            candidates.remove(0);
            let left = end.saturating_duration_since(Instant::now());
            let membership =
                match ask(&addr, secret, PeerRequest::ClusterStatus, DIAL.min(left)).await {
                    Ok(MasterReply::Cluster(s)) => s.membership,
                    Ok(other) => {
                        errors.push(format!("{addr}: unexpected answer {other:?}"));
                        continue;
                    }
                    Err(e) => {
                        errors.push(format!("{addr}: {e:#}"));
                        continue;
                    }
                };
            let body = signed(&change, membership, &key);
            let left = end.saturating_duration_since(Instant::now());
            match ask(&addr, secret, body, left).await {
                Ok(MasterReply::Cluster(s)) => return Ok(s),
                Ok(MasterReply::NotLeader { leader: Some(l) }) if l != addr => {
                    candidates.insert(0, l)
                }
                Ok(MasterReply::NotLeader { .. }) => {}
                Ok(MasterReply::Error { code, message }) => {
                    anyhow::bail!("master {addr} refused the change ({code:?}): {message}")
                }
                Ok(other) => errors.push(format!("{addr}: unexpected answer {other:?}")),
                Err(e) => errors.push(format!("{addr}: {e:#}")),
            }
        }
        anyhow::bail!(
            "the change was not made within {deadline:?}: {}",
            if errors.is_empty() {
                "no leader".to_string()
            } else {
                errors.join("; ")
            }
        )
    }
    .boxed()
}

/// The request that makes `change` to the cluster at `membership`, signed with the
/// cluster's admin key `key` (`derive(ClusterChange::KEY_LABEL)` of the cluster secret).
pub fn signed(change: &ClusterChange, membership: u64, key: &[u8; 32]) -> PeerRequest {
    PeerRequest::ClusterChange {
        change: change.clone(),
        membership,
        proof: change.proof(key, membership),
    }
}

/// Sends one request to the master at `addr` (a client address) with the job secret and
/// returns its answer, waiting at most `wait`.
pub fn ask<'a>(
    addr: &'a str,
    secret: &'a Secret,
    body: PeerRequest,
    wait: Duration,
) -> BoxFuture<'a, anyhow::Result<MasterReply>> {
    async move {
        let exchange = async {
            let mut conn =
                control::connect(addr, secret, Role::PeerToMaster, DIAL.min(wait)).await?;
            conn.send(&Request { id: 1, body }).await?;
            loop {
                match conn.recv::<MasterMessage>().await? {
                    MasterMessage::Reply { id: 1, body } => return Ok(body),
                    _ => continue,
                }
            }
        };
        tokio::time::timeout(wait, exchange)
            .await
            .map_err(|_| anyhow::anyhow!("no answer within {wait:?}"))?
    }
    .boxed()
}

/// Prints a status as `eccl-master cluster status` shows it.
pub fn render(s: &ClusterStatus) -> String {
    let mut out = format!(
        "leader: {}\nterm: {}\nmembership: {}\npeers: {} live, epoch {}\nmasters (as master {} sees them):\n",
        s.leader.map_or("none".to_string(), |l| l.to_string()),
        s.term,
        s.membership,
        s.peers,
        s.epoch,
        s.me
    );
    for m in &s.members {
        out += &format!(
            "  {:>3}  {:<8} client {}  raft {}{}\n",
            m.id,
            if m.voter { "voter" } else { "learner" },
            m.client,
            m.raft,
            if Some(m.id) == s.leader {
                "  (leader)"
            } else {
                ""
            }
        );
    }
    out
}
