//! Simulated peers, for loading a master (`eccl-chaos load`): each registers, keeps its
//! lease with heartbeats at the master's interval and votes for epochs or reconfigures,
//! exactly as a [`crate::Communicator`] does, but opens no links and moves no data, so
//! that thousands fit in one process. Not for training: a world that holds simulated
//! peers cannot run a collective.

use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::Secret;
use eccl_protocol::{MasterReply, PeerId, PeerRequest, RegisterRequest, PROTOCOL_VERSION};
use tokio::sync::mpsc;

use crate::error::Result;
use crate::master_client::{reply_error, MasterClient};

/// One simulated peer.
pub struct SimPeer {
    master: Arc<MasterClient>,
    list: String,
    pub peer_id: PeerId,
    /// The epoch of the last world it was given.
    pub epoch: u64,
    /// That world's size.
    size: u32,
    heartbeat: tokio::task::JoinHandle<()>,
}

impl SimPeer {
    /// Registers with the masters in `list` (comma-separated) under `host`, and starts
    /// its heartbeats.
    pub async fn register(
        list: &str,
        secret: &Secret,
        host: &str,
        timeout: Duration,
    ) -> Result<SimPeer> {
        let (etx, mut erx) = mpsc::unbounded_channel();
        // Master events (aborts, evictions) are not acted on; they are drained.
        tokio::spawn(async move { while erx.recv().await.is_some() {} });
        let master = MasterClient::connect(list, secret, timeout, etx).await?;
        let req = RegisterRequest {
            // Never dialed: a simulated peer opens no links.
            listen_port: 9,
            quic_port: None,
            shm_name: None,
            advertise_host: None,
            host: host.to_string(),
            rank_hint: None,
            protocol_version: PROTOCOL_VERSION,
        };
        let (peer_id, heartbeat_ms, lease_ms) = master.register(req, list, timeout).await?;
        let master = Arc::new(master);
        let heartbeat = master.spawn_heartbeats(peer_id, heartbeat_ms, lease_ms);
        Ok(SimPeer {
            master,
            list: list.to_string(),
            peer_id,
            epoch: 0,
            size: 0,
            heartbeat,
        })
    }

    /// `update_topology()`'s vote: returns the size of the world every live member of
    /// the job agreed on (their number, once all of them have voted).
    pub async fn update_topology(&mut self, min_world: u32, timeout: Duration) -> Result<u32> {
        let req = PeerRequest::UpdateTopology {
            peer_id: self.peer_id,
            epoch: self.epoch,
            min_world,
            aborted: false,
            fresh: vec![],
        };
        self.world(req, timeout).await
    }

    /// `reconfigure(uuid, members)`: the world of exactly `members` (list order).
    pub async fn reconfigure(
        &mut self,
        uuid: u64,
        members: Vec<PeerId>,
        timeout: Duration,
    ) -> Result<u32> {
        let req = PeerRequest::Reconfigure {
            peer_id: self.peer_id,
            uuid,
            members,
            ordered: true,
        };
        self.world(req, timeout).await
    }

    async fn world(&mut self, req: PeerRequest, timeout: Duration) -> Result<u32> {
        match self.master.request(req, timeout).await? {
            MasterReply::World { world, .. } => {
                self.epoch = world.epoch;
                self.size = world.size() as u32;
                Ok(self.size)
            }
            MasterReply::Unchanged { epoch } if epoch == self.epoch => Ok(self.size),
            other => Err(reply_error(&self.list, self.epoch, other)),
        }
    }

    /// How many of this peer's heartbeats ran a quarter lease or more after their time
    /// (this process starved of CPU): an eviction with none of them was the master's.
    pub fn late_heartbeats(&self) -> u64 {
        self.master.late_heartbeats()
    }

    /// Leaves the job (and stops the heartbeats).
    pub async fn leave(self, timeout: Duration) -> Result<()> {
        self.heartbeat.abort();
        let req = PeerRequest::Leave {
            peer_id: self.peer_id,
        };
        match self.master.request(req, timeout).await? {
            MasterReply::Ok => Ok(()),
            other => Err(reply_error(&self.list, self.epoch, other)),
        }
    }
}

impl Drop for SimPeer {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}
