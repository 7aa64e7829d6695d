//! Shared-state synchronisation (`sync_shared_state`): every member ends with the same
//! named tensors (G5), fetched in checked chunks from the members that hold the chosen
//! content.
//!
//! | file | job |
//! |---|---|
//! | `mod.rs` | the API, digests, and what a member must fetch |
//! | `wait.rs` | waiting for the frames of one sync round |
//! | `serve.rs` | a source answering chunk requests |
//! | `fetch.rs` | a receiver fetching from several sources at once |

mod fetch;
mod serve;
mod wait;

use eccl_protocol::PeerId;
use futures::future::{BoxFuture, FutureExt};

/// One named tensor of the shared state, as raw bytes borrowed from the caller.
pub struct SharedTensor<'a> {
    pub name: String,
    pub data: &'a mut [u8],
    /// The caller's promise that `data` (same address and length) holds what it held when
    /// this communicator's last sync of the tensor ended: its digest is then not computed
    /// again. A false promise makes this member report stale content (G5 no longer holds
    /// for it), as a wrong buffer would in any collective.
    pub unchanged: bool,
}

impl<'a> SharedTensor<'a> {
    pub fn new<T: crate::Element>(name: impl Into<String>, data: &'a mut [T]) -> SharedTensor<'a> {
        SharedTensor::bytes(name, bytemuck::cast_slice_mut(data))
    }
    pub fn bytes(name: impl Into<String>, data: &'a mut [u8]) -> SharedTensor<'a> {
        SharedTensor {
            name: name.into(),
            data,
            unchanged: false,
        }
    }
    /// See [`SharedTensor::unchanged`].
    pub fn unchanged(mut self, unchanged: bool) -> SharedTensor<'a> {
        self.unchanged = unchanged;
        self
    }
}

/// A tensor's digest as of the end of this communicator's last sync of it, with the
/// memory it described: reused for a tensor promised [`SharedTensor::unchanged`].
#[derive(Clone, Debug)]
pub(crate) struct KnownDigest {
    addr: usize,
    len: usize,
    digest: TensorDigest,
}

/// Which content a member accepts and offers (the wire type itself).
pub use eccl_protocol::SyncStrategy;

/// What `sync_shared_state` did.
#[derive(Clone, Debug)]
pub struct SyncInfo {
    pub epoch: u64,
    /// The revision every member now holds.
    pub revision: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Peers this member fetched chunks from.
    pub sources: Vec<PeerId>,
    /// Names of the tensors that were replaced.
    pub updated: Vec<String>,
    /// blake3 digest of the whole state after the sync (equal on every member, G5).
    pub hash: [u8; 32],
    /// Where the call's time went, in milliseconds: hashing this member's tensors, the
    /// master's plan (a round trip, waiting for every member), and serving or fetching.
    pub hash_ms: f64,
    pub plan_ms: f64,
    pub transfer_ms: f64,
    /// Bytes hashed by this call (tensors promised unchanged are not).
    pub hashed_bytes: u64,
}

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_protocol::{
    Algo, CollectiveKind, DType, Descriptor, MasterReply, PeerRequest, ReduceOp, TensorDigest,
    STATE_CHUNK,
};

use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::master_client::reply_error;

/// blake3 per chunk, and over the tensor: its length and the chunk hashes. Chunks are
/// hashed on the reduction threads where there are several (`ECCL_REDUCE_THREADS`).
pub(crate) fn digest(name: &str, data: &[u8]) -> TensorDigest {
    let chunks: Vec<[u8; 32]> =
        eccl_algorithms::kernels::map_chunks(data, STATE_CHUNK, |c| *blake3::hash(c).as_bytes());
    TensorDigest {
        name: name.to_string(),
        len: data.len() as u64,
        hash: tensor_hash(data.len() as u64, &chunks),
        chunks,
    }
}

fn tensor_hash(len: u64, chunks: &[[u8; 32]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&len.to_le_bytes());
    for c in chunks {
        h.update(c);
    }
    *h.finalize().as_bytes()
}

/// The digest of a whole state, from its tensors' digests in name order.
pub fn state_hash<'a>(tensors: impl IntoIterator<Item = &'a TensorDigest>) -> [u8; 32] {
    let mut ts: Vec<&TensorDigest> = tensors.into_iter().collect();
    ts.sort_by(|a, b| a.name.cmp(&b.name));
    let mut h = blake3::Hasher::new();
    for t in ts {
        h.update(&(t.name.len() as u64).to_le_bytes());
        h.update(t.name.as_bytes());
        h.update(&t.hash);
    }
    *h.finalize().as_bytes()
}

fn state_header(kind: FrameKind, epoch: u64, round: u64, tensor: u32, chunk: u64) -> FrameHeader {
    FrameHeader {
        kind,
        epoch,
        seq: round,
        index: tensor,
        len: 0,
        desc: Descriptor {
            kind: CollectiveKind::Barrier,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            algo: Algo::Direct,
            root: 0,
            count: 0,
        },
        offset: chunk,
        tag: 0,
    }
}

/// Byte range of chunk `c` in a tensor of `len` bytes.
fn chunk_range(len: u64, c: u64) -> Option<std::ops::Range<usize>> {
    let start = c.checked_mul(STATE_CHUNK as u64)?;
    if start >= len {
        return None;
    }
    Some(start as usize..(start + STATE_CHUNK as u64).min(len) as usize)
}

impl Communicator {
    /// Brings every member's shared state to the same content (G5): each member reports
    /// a blake3 hash per tensor (and per 1 MiB chunk) and its `revision`; the master
    /// picks the content most members hold at the highest revision (send-only members'
    /// content first; receive-only members' content never); members that differ fetch
    /// the differing chunks from every member that holds the chosen content at once,
    /// check each chunk against its hash, and replace a source that dies or stalls by
    /// another. A newcomer calls it with revision 0 to catch up.
    ///
    /// Collective: every member of the epoch calls it with tensors of the same names and
    /// sizes. The caller's tensors change only when every chunk has arrived and matched,
    /// so a failed sync leaves them as they were, except a newcomer's: called with
    /// revision 0 (it holds nothing yet), each chunk lands in its tensors as it arrives
    /// and matches, and a failed sync leaves them partly written (its next sync fetches
    /// what differs).
    pub fn sync_shared_state<'a, 't: 'a>(
        &'a mut self,
        revision: u64,
        tensors: &'a mut [SharedTensor<'t>],
        strategy: SyncStrategy,
    ) -> BoxFuture<'a, Result<SyncInfo>> {
        async move {
            let peer_id = self.peer_id();
            let (epoch, round) = {
                let c = self.cur.as_mut().ok_or_else(|| {
                    Error::InvalidArgument("no world yet: call update_topology() first".into())
                })?;
                c.sync_round += 1;
                (c.world.epoch, c.sync_round)
            };
            // A call that is wrong on its own says so, even if the epoch is already broken.
            let mut names = HashSet::new();
            for t in tensors.iter() {
                if !names.insert(t.name.as_str()) {
                    return Err(Error::InvalidArgument(format!(
                        "shared state has two tensors named {:?}",
                        t.name
                    )));
                }
            }
            if let Some(e) = self.abort.check(epoch) {
                return Err(e);
            }
            let started = std::time::Instant::now();
            let mut hashed_bytes = 0u64;
            // A receive-only newcomer (revision 0: it holds nothing yet) hashes nothing:
            // its content never counts, and it fetches every chunk whatever it holds.
            let holds_nothing = strategy == SyncStrategy::ReceiveOnly && revision == 0;
            let local: Vec<TensorDigest> = tensors
                .iter()
                .map(|t| {
                    if holds_nothing {
                        return TensorDigest {
                            name: t.name.clone(),
                            len: t.data.len() as u64,
                            hash: [0; 32],
                            chunks: Vec::new(),
                        };
                    }
                    let known = self.state_digests.get(&t.name).filter(|k| {
                        t.unchanged && k.addr == t.data.as_ptr() as usize && k.len == t.data.len()
                    });
                    match known {
                        Some(k) => k.digest.clone(),
                        None => {
                            hashed_bytes += t.data.len() as u64;
                            digest(&t.name, t.data)
                        }
                    }
                })
                .collect();
            let hash_ms = started.elapsed().as_secs_f64() * 1e3;
            let planned = std::time::Instant::now();
            let req = PeerRequest::SyncState {
                peer_id,
                epoch,
                round,
                revision,
                strategy,
                tensors: local.clone(),
            };
            let reply = self.master.request(req, self.cfg.join_timeout).await?;
            let plan_ms = planned.elapsed().as_secs_f64() * 1e3;
            let moved = std::time::Instant::now();
            let (plan_revision, target, sources, receivers) = match reply {
                MasterReply::SyncPlan {
                    revision,
                    target,
                    sources,
                    receivers,
                } => (revision, target, sources, receivers),
                other => return Err(reply_error(&self.cfg.master, epoch, other)),
            };
            match self
                .carry_out_sync(
                    epoch,
                    round,
                    tensors,
                    strategy,
                    &local,
                    revision,
                    plan_revision,
                    target,
                    sources,
                    receivers,
                )
                .await
            {
                Ok(mut info) => {
                    info.hash_ms = hash_ms;
                    info.plan_ms = plan_ms;
                    info.transfer_ms = moved.elapsed().as_secs_f64() * 1e3;
                    info.hashed_bytes = hashed_bytes;
                    tracing::info!(
                        target: "eccl::coll",
                        "epoch {epoch}: shared-state sync took {:.1} ms hashing {} B, {:.1} ms \
                         for the plan, {:.1} ms moving chunks",
                        info.hash_ms,
                        info.hashed_bytes,
                        info.plan_ms,
                        info.transfer_ms
                    );
                    Ok(info)
                }
                // The others may already be in the next collective: break the epoch so that
                // they fail promptly instead of waiting for this member.
                Err(e) => {
                    let desc = state_header(FrameKind::Abort, epoch, 0, 0, 0).desc;
                    Err(self.fail(epoch, u64::MAX, desc, e).await)
                }
            }
        }
        .boxed()
    }

    #[allow(clippy::too_many_arguments)]
    async fn carry_out_sync(
        &mut self,
        epoch: u64,
        round: u64,
        tensors: &mut [SharedTensor<'_>],
        strategy: SyncStrategy,
        local: &[TensorDigest],
        own_revision: u64,
        revision: u64,
        target: Vec<TensorDigest>,
        sources: Vec<PeerId>,
        receivers: Vec<PeerId>,
    ) -> Result<SyncInfo> {
        let peer_id = self.peer_id();
        let mut info = SyncInfo {
            epoch,
            revision,
            bytes_sent: 0,
            bytes_received: 0,
            sources: Vec::new(),
            updated: Vec::new(),
            hash: state_hash(local),
            hash_ms: 0.0,
            plan_ms: 0.0,
            transfer_ms: 0.0,
            hashed_bytes: 0,
        };
        let receiving = receivers.contains(&peer_id);
        if sources.contains(&peer_id) {
            info.bytes_sent = self
                .serve_state(epoch, round, tensors, &target, &receivers)
                .await?;
        } else if receivers.contains(&peer_id) {
            let plan = match_target(tensors, local, &target, strategy);
            // A newcomer (revision 0: it holds nothing yet) takes each chunk straight into
            // its tensors; a member with a state of its own keeps it until every chunk
            // has arrived (G2).
            let in_place = own_revision == 0;
            let (fetched, to_local) = match plan {
                Ok(need) => {
                    let to_local: HashMap<u32, usize> =
                        need.iter().map(|(l, t, _)| (*t as u32, *l)).collect();
                    let f = self
                        .fetch_state(epoch, round, tensors, &target, &sources, need, in_place)
                        .await;
                    (f, to_local)
                }
                Err(e) => (Err(e), HashMap::new()),
            };
            // Sources serve until every receiver is done, also one that failed.
            self.send_done(epoch, round, &sources).await;
            let (chunks, bytes, used) = match fetched {
                Ok(f) => f,
                Err(e) => {
                    if in_place {
                        // Partly written: no digest of an earlier sync describes these
                        // tensors now, whatever the next call promises.
                        self.state_digests.clear();
                    }
                    return Err(e);
                }
            };
            // Every chunk arrived and matched: only now do the caller's tensors change
            // (those a newcomer took in place have already).
            let mut updated: Vec<usize> = to_local.values().copied().collect();
            for ((t, ch), data) in chunks {
                let local = to_local[&t];
                let range = chunk_range(tensors[local].data.len() as u64, ch)
                    .expect("a fetched chunk lies within its tensor");
                tensors[local].data[range].copy_from_slice(&data);
            }
            updated.sort_unstable();
            updated.dedup();
            info.updated = updated
                .into_iter()
                .map(|i| tensors[i].name.clone())
                .collect();
            info.bytes_received = bytes;
            info.sources = used;
            info.hash = state_hash(&target);
        }
        tracing::info!(
            target: "eccl::coll",
            "epoch {epoch}: shared state at revision {revision}; sent {} B, received {} B from {:?}",
            info.bytes_sent,
            info.bytes_received,
            info.sources
        );
        // What each tensor holds now, for the next call's `unchanged` promise: the chosen
        // content where this member received it, else its own.
        self.state_digests.clear();
        for (t, own) in tensors.iter().zip(local) {
            let now = receiving
                .then(|| target.iter().find(|d| d.name == t.name))
                .flatten()
                .unwrap_or(own);
            self.state_digests.insert(
                t.name.clone(),
                KnownDigest {
                    addr: t.data.as_ptr() as usize,
                    len: t.data.len(),
                    digest: now.clone(),
                },
            );
        }
        Ok(info)
    }

    async fn send_done(&mut self, epoch: u64, round: u64, sources: &[PeerId]) {
        let Some(c) = self.cur.as_mut() else { return };
        for s in sources {
            let Some(r) = c.world.rank_of(*s) else {
                continue;
            };
            if let Some(l) = c.links[r.idx()].as_mut() {
                let h = state_header(FrameKind::StateDone, epoch, round, 0, 0);
                let _ = l.tx.send_frame(h, &[], Duration::from_millis(500)).await;
            }
        }
    }
}

/// Which chunks of which tensors this member must fetch: `(local index, target index,
/// chunks)`. Errors if the tensors cannot take the target's content.
fn match_target(
    tensors: &[SharedTensor<'_>],
    local: &[TensorDigest],
    target: &[TensorDigest],
    strategy: SyncStrategy,
) -> Result<Vec<(usize, usize, Vec<u64>)>> {
    if strategy == SyncStrategy::SendOnly {
        return Err(Error::InvalidArgument(
            "this send-only member's shared state differs from the one chosen (another send-only member holds different content or a higher revision)".into(),
        ));
    }
    let by_name: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    if tensors.len() != target.len() {
        return Err(Error::InvalidArgument(format!(
            "shared state has {} tensors here and {} in the chosen state",
            tensors.len(),
            target.len()
        )));
    }
    let mut need = Vec::new();
    for (ti, t) in target.iter().enumerate() {
        let Some(&li) = by_name.get(t.name.as_str()) else {
            return Err(Error::InvalidArgument(format!(
                "the chosen shared state has a tensor {:?} that this member lacks",
                t.name
            )));
        };
        let l = &local[li];
        if l.len != t.len {
            return Err(Error::InvalidArgument(format!(
                "shared tensor {:?} has {} bytes here and {} in the chosen state",
                t.name, l.len, t.len
            )));
        }
        if l.hash == t.hash {
            continue;
        }
        let chunks: Vec<u64> = (0..t.chunks.len())
            .filter(|c| l.chunks.get(*c) != t.chunks.get(*c))
            .map(|c| c as u64)
            .collect();
        need.push((li, ti, chunks));
    }
    Ok(need)
}
