//! Changing the master cluster at runtime (`eccl-master cluster add|remove|status`).
//!
//! Requests arrive on the client listener (the job secret's TLS connection), and a
//! change carries an HMAC under a key derived from the cluster secret, which only
//! masters and their operators hold: a peer can read the status but cannot change the
//! cluster. Adding a master is openraft's two steps: it joins as a learner and is caught
//! up, then the voters are changed by joint consensus. Removing one is a single change
//! of the voters that also drops the node.

use std::collections::BTreeSet;

use eccl_protocol::{ClusterChange, ClusterStatus, ErrorCode, MasterInfo};
use openraft::error::{ClientWriteError, RaftError};
use openraft::ChangeMembers;

use super::{MasterId, MasterNode, RaftRegistry};

/// Why a cluster change was not made.
#[derive(Debug)]
pub enum AdminError {
    /// Not the leader; the leader's client address if known.
    NotLeader(Option<String>),
    Refused(ErrorCode, String),
}

impl RaftRegistry {
    /// The cluster as this master sees it.
    pub fn status(&self) -> ClusterStatus {
        let m = self.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<MasterId> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(id, n)| MasterInfo {
                id: *id,
                client: n.client.clone(),
                raft: n.raft.clone(),
                voter: voters.contains(id),
            })
            .collect();
        let (peers, epoch) = self.read(|r| (r.live_peers().len() as u64, r.epoch()));
        ClusterStatus {
            me: self.node_id,
            leader: m.current_leader,
            term: m.current_term,
            membership: Self::membership_index(&m),
            members,
            peers,
            epoch,
        }
    }

    /// The log index of the membership in effect (0 before the first one): every change
    /// to the cluster moves it on.
    fn membership_index(m: &openraft::RaftMetrics<MasterId, MasterNode>) -> u64 {
        m.membership_config.log_id().map_or(0, |l| l.index)
    }

    /// Makes `change` if `proof` is its HMAC under the cluster's admin key for the
    /// membership in effect now (`membership`, as the signer saw it); returns the status
    /// once the change is committed. A proof for any other membership is refused: either
    /// the request is a replay of one already made, or the cluster changed since it was
    /// signed (the CLI then asks again).
    pub async fn change(
        &self,
        change: &ClusterChange,
        membership: u64,
        proof: &[u8; 32],
    ) -> Result<ClusterStatus, AdminError> {
        if self.node.raft.is_empty() {
            return Err(AdminError::Refused(
                ErrorCode::InvalidArgument,
                "this master runs alone (no --masters): it has no cluster to change".into(),
            ));
        }
        let metrics = self.raft.metrics().borrow().clone();
        if metrics.current_leader != Some(self.node_id) {
            return Err(AdminError::NotLeader(
                metrics.current_leader.and_then(|id| self.addr_of(id)),
            ));
        }
        let expected = change.proof(&self.admin_key, membership);
        // blake3::Hash compares in constant time.
        if blake3::Hash::from(expected) != blake3::Hash::from(*proof) {
            return Err(AdminError::Refused(
                ErrorCode::InvalidArgument,
                "the change is not signed with this cluster's secret".into(),
            ));
        }
        let now = Self::membership_index(&metrics);
        if membership != now {
            return Err(AdminError::Refused(
                ErrorCode::InvalidArgument,
                format!(
                    "the change was signed for membership {membership} of the cluster, which is at \
                     {now} now: a replay of a change already made, or the cluster changed since \
                     it was signed (ask again)"
                ),
            ));
        }
        let voters: BTreeSet<MasterId> =
            metrics.membership_config.membership().voter_ids().collect();
        match change {
            ClusterChange::Add { id, client, raft } => {
                if voters.contains(id) {
                    return Err(AdminError::Refused(
                        ErrorCode::InvalidArgument,
                        format!("master {id} is already a voter"),
                    ));
                }
                tracing::info!(target: "eccl::master", "adding master {id} ({client}, raft {raft}) as a learner");
                let node = MasterNode::new(client.clone(), raft.clone());
                self.raft
                    .add_learner(*id, node, true)
                    .await
                    .map_err(|e| self.admin_error(e))?;
                tracing::info!(target: "eccl::master", "master {id} caught up; making it a voter");
                self.raft
                    .change_membership(ChangeMembers::AddVoterIds([*id].into()), false)
                    .await
                    .map_err(|e| self.admin_error(e))?;
            }
            ClusterChange::Remove { id } => {
                if !voters.contains(id) && !self.is_master(*id) {
                    return Err(AdminError::Refused(
                        ErrorCode::InvalidArgument,
                        format!("master {id} is not in the cluster"),
                    ));
                }
                if voters.len() == 1 && voters.contains(id) {
                    return Err(AdminError::Refused(
                        ErrorCode::InvalidArgument,
                        format!("master {id} is the last voter"),
                    ));
                }
                tracing::info!(target: "eccl::master", "removing master {id}");
                let change = if voters.contains(id) {
                    ChangeMembers::RemoveVoters([*id].into())
                } else {
                    ChangeMembers::RemoveNodes([*id].into())
                };
                self.raft
                    .change_membership(change, false)
                    .await
                    .map_err(|e| self.admin_error(e))?;
            }
        }
        Ok(self.status())
    }

    fn admin_error(
        &self,
        e: RaftError<MasterId, ClientWriteError<MasterId, MasterNode>>,
    ) -> AdminError {
        match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => AdminError::NotLeader(
                f.leader_node
                    .map(|n| n.client)
                    .or_else(|| f.leader_id.and_then(|id| self.addr_of(id))),
            ),
            RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
                AdminError::Refused(ErrorCode::InvalidArgument, e.to_string())
            }
            RaftError::Fatal(f) => AdminError::Refused(ErrorCode::Internal, f.to_string()),
        }
    }
}
