//! Shared-state synchronisation (`sync_shared_state`): see the module functions below.

use eccl_protocol::PeerId;

/// One named tensor of the shared state, as raw bytes borrowed from the caller.
pub struct SharedTensor<'a> {
    pub name: String,
    pub data: &'a mut [u8],
}

impl<'a> SharedTensor<'a> {
    pub fn new<T: crate::Element>(name: impl Into<String>, data: &'a mut [T]) -> SharedTensor<'a> {
        SharedTensor {
            name: name.into(),
            data: bytemuck::cast_slice_mut(data),
        }
    }
    pub fn bytes(name: impl Into<String>, data: &'a mut [u8]) -> SharedTensor<'a> {
        SharedTensor {
            name: name.into(),
            data,
        }
    }
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
}

// ---- implementation ----------------------------------------------------------------

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_protocol::{
    Algo, CollectiveKind, DType, Descriptor, MasterReply, PeerRequest, ReduceOp, TensorDigest,
    STATE_CHUNK,
};
use eccl_transport::link::{Incoming, LinkEvent};
use futures::future::{select_all, FutureExt};

use crate::communicator::{reply_error, Communicator, Current};
use crate::error::{Error, Result};
use crate::fault;

/// Requests a receiver keeps outstanding at each source.
const INFLIGHT_PER_SOURCE: usize = 4;

/// blake3 per chunk, and over the tensor: its length and the chunk hashes.
pub(crate) fn digest(name: &str, data: &[u8]) -> TensorDigest {
    let chunks: Vec<[u8; 32]> = data
        .chunks(STATE_CHUNK)
        .map(|c| *blake3::hash(c).as_bytes())
        .collect();
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
        step: tensor,
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

/// What the next frame from any of `ranks` was, or why none came.
enum Wake {
    Frame(u32, Incoming),
    LinkDown(u32, String),
    /// The abort state changed (an epoch aborted, a peer evicted).
    Abort,
    Tick,
}

/// Waits for a frame of this sync round from any of `ranks`; other frames go to their
/// link's stash for the collectives that follow.
async fn next_event(
    cur: &mut Current,
    ranks: &HashSet<u32>,
    abort: &mut tokio::sync::watch::Receiver<Option<crate::abort::AbortInfo>>,
    epoch: u64,
    round: u64,
    tick: Duration,
) -> Wake {
    // Early arrivals first: a fast peer's request may already sit in the stash.
    for (r, l) in cur.links.iter_mut().enumerate() {
        let Some(l) = l else { continue };
        if !ranks.contains(&(r as u32)) {
            continue;
        }
        if let Some(i) =
            l.rx.stash
                .iter()
                .position(|f| is_ours(&f.header, epoch, round))
        {
            let f = l.rx.stash.remove(i).expect("index from position");
            return Wake::Frame(r as u32, f);
        }
    }
    loop {
        let futs: Vec<_> = cur
            .links
            .iter_mut()
            .enumerate()
            .filter(|(r, l)| l.is_some() && ranks.contains(&(*r as u32)))
            .map(|(r, l)| {
                let rx = &mut l.as_mut().expect("filtered").rx.link;
                async move { (r as u32, rx.next().await) }.boxed()
            })
            .collect();
        let got = if futs.is_empty() {
            tokio::select! {
                _ = abort.changed() => return Wake::Abort,
                _ = tokio::time::sleep(tick) => return Wake::Tick,
            }
        } else {
            // Biased: frames that are there are handled before wake-ups.
            tokio::select! {
                biased;
                ((r, ev), _, _) = select_all(futs) => (r, ev),
                _ = abort.changed() => return Wake::Abort,
                _ = tokio::time::sleep(tick) => return Wake::Tick,
            }
        };
        match got {
            (r, None) => return Wake::LinkDown(r, "closed".into()),
            (r, Some(LinkEvent::Failed(e))) => return Wake::LinkDown(r, e.to_string()),
            (r, Some(LinkEvent::Frame(f))) => {
                if is_ours(&f.header, epoch, round) {
                    return Wake::Frame(r, f);
                }
                let stale_state = matches!(
                    f.header.kind,
                    FrameKind::StateReq | FrameKind::StateData | FrameKind::StateDone
                );
                if !stale_state && f.header.epoch >= epoch {
                    if let Some(l) = cur.links[r as usize].as_mut() {
                        l.rx.stash.push_back(f);
                    }
                }
            }
        }
    }
}

fn is_ours(h: &FrameHeader, epoch: u64, round: u64) -> bool {
    h.epoch == epoch
        && h.seq == round
        && matches!(
            h.kind,
            FrameKind::StateReq | FrameKind::StateData | FrameKind::StateDone
        )
}

struct Source {
    peer: PeerId,
    rank: u32,
    inflight: Vec<(u32, u64)>,
    last_progress: Instant,
    used: bool,
    failed: bool,
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
    /// so a failed sync leaves them as they were.
    pub async fn sync_shared_state(
        &mut self,
        revision: u64,
        tensors: &mut [SharedTensor<'_>],
        strategy: SyncStrategy,
    ) -> Result<SyncInfo> {
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
        let local: Vec<TensorDigest> = tensors.iter().map(|t| digest(&t.name, t.data)).collect();
        let req = PeerRequest::SyncState {
            peer_id,
            epoch,
            revision,
            strategy,
            tensors: local.clone(),
        };
        let reply = self.master.request(req, self.cfg.join_timeout).await?;
        let (revision, target, sources, receivers) = match reply {
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
                epoch, round, tensors, strategy, &local, revision, target, sources, receivers,
            )
            .await
        {
            Ok(info) => Ok(info),
            // The others may already be in the next collective: break the epoch so that
            // they fail promptly instead of waiting for this member.
            Err(e) => {
                let desc = state_header(FrameKind::Abort, epoch, 0, 0, 0).desc;
                Err(self.fail(epoch, u64::MAX, desc, e).await)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn carry_out_sync(
        &mut self,
        epoch: u64,
        round: u64,
        tensors: &mut [SharedTensor<'_>],
        strategy: SyncStrategy,
        local: &[TensorDigest],
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
        };
        if sources.contains(&peer_id) {
            info.bytes_sent = self
                .serve_state(epoch, round, tensors, &target, &receivers)
                .await?;
        } else if receivers.contains(&peer_id) {
            let plan = match_target(tensors, local, &target, strategy);
            let fetched = match plan {
                Ok(need) => {
                    self.fetch_state(epoch, round, tensors, &target, &sources, need)
                        .await
                }
                Err(e) => Err(e),
            };
            // Sources serve until every receiver is done, also one that failed.
            self.send_done(epoch, round, &sources).await;
            let (mut staged, bytes, used) = fetched?;
            staged.sort_by_key(|(i, _)| *i);
            for (i, data) in staged {
                tensors[i].data.copy_from_slice(&data);
                info.updated.push(tensors[i].name.clone());
            }
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
        Ok(info)
    }

    async fn send_done(&mut self, epoch: u64, round: u64, sources: &[PeerId]) {
        let Some(c) = self.cur.as_mut() else { return };
        for s in sources {
            let Some(r) = c.world.rank_of(*s) else {
                continue;
            };
            if let Some(l) = c.links[r as usize].as_mut() {
                let h = state_header(FrameKind::StateDone, epoch, round, 0, 0);
                let _ = l.tx.send_frame(h, &[], Duration::from_millis(500)).await;
            }
        }
    }

    /// Answers chunk requests until every receiver is done, gone or unreachable.
    async fn serve_state(
        &mut self,
        epoch: u64,
        round: u64,
        tensors: &[SharedTensor<'_>],
        target: &[TensorDigest],
        receivers: &[PeerId],
    ) -> Result<u64> {
        let by_name: HashMap<&str, usize> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i))
            .collect();
        let abort = self.abort.clone();
        let mut watch = abort.subscribe();
        let (timeout, tick) = (self.cfg.timeout, Duration::from_millis(50));
        let c = self.cur.as_mut().expect("world checked by the caller");
        let mut waiting: HashMap<u32, PeerId> = receivers
            .iter()
            .filter_map(|p| c.world.rank_of(*p).map(|r| (r, *p)))
            .filter(|(r, _)| c.links.get(*r as usize).is_some_and(Option::is_some))
            .collect();
        let mut sent = 0u64;
        let mut first = true;
        let mut last_progress = Instant::now();
        while !waiting.is_empty() {
            waiting.retain(|_, p| !abort.is_gone(*p));
            if waiting.is_empty() {
                break;
            }
            if last_progress.elapsed() > timeout {
                return Err(Error::Timeout {
                    what: format!(
                        "serving the shared state to peers {:?}",
                        waiting.values().collect::<Vec<_>>()
                    ),
                    ms: timeout.as_millis() as u64,
                });
            }
            let ranks: HashSet<u32> = waiting.keys().copied().collect();
            match next_event(c, &ranks, &mut watch, epoch, round, tick).await {
                Wake::Abort | Wake::Tick => {}
                Wake::LinkDown(r, why) => {
                    tracing::info!(target: "eccl::coll", "shared-state receiver at rank {r} is gone ({why})");
                    waiting.remove(&r);
                }
                Wake::Frame(r, f) => {
                    last_progress = Instant::now();
                    let h = f.header;
                    match h.kind {
                        FrameKind::StateDone => {
                            waiting.remove(&r);
                        }
                        FrameKind::StateReq => {
                            let chunk = target
                                .get(h.step as usize)
                                .and_then(|t| by_name.get(t.name.as_str()))
                                .and_then(|i| {
                                    let d = &tensors[*i].data;
                                    chunk_range(d.len() as u64, h.offset).map(|rg| &d[rg])
                                });
                            let Some(bytes) = chunk else {
                                tracing::warn!(target: "eccl::coll", "rank {r} asked for chunk {} of tensor {} that does not exist", h.offset, h.step);
                                waiting.remove(&r);
                                continue;
                            };
                            let reply =
                                state_header(FrameKind::StateData, epoch, round, h.step, h.offset);
                            let link = c.links[r as usize]
                                .as_mut()
                                .expect("rank of a waiting receiver");
                            match link.tx.send_frame(reply, bytes, timeout).await {
                                Ok(()) => sent += bytes.len() as u64,
                                Err(e) => {
                                    tracing::info!(target: "eccl::coll", "cannot send shared state to rank {r}: {e}");
                                    waiting.remove(&r);
                                }
                            }
                            if first {
                                first = false;
                                fault::hit(fault::Point::SyncServe);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(sent)
    }

    /// Fetches the chunks in `need` from `sources`, several at once, each checked
    /// against the target's chunk hash. Returns the replaced tensors (index, bytes), the
    /// bytes received and the sources used.
    #[allow(clippy::type_complexity)]
    async fn fetch_state(
        &mut self,
        epoch: u64,
        round: u64,
        tensors: &[SharedTensor<'_>],
        target: &[TensorDigest],
        sources: &[PeerId],
        need: Vec<(usize, usize, Vec<u64>)>,
    ) -> Result<(Vec<(usize, Vec<u8>)>, u64, Vec<PeerId>)> {
        let abort = self.abort.clone();
        let mut watch = abort.subscribe();
        let (stall, tick) = (self.cfg.timeout, Duration::from_millis(50));
        let c = self.cur.as_mut().expect("world checked by the caller");
        // Staging copies: a chunk lands in the caller's tensor only once all have arrived.
        let mut staged: HashMap<usize, Vec<u8>> = HashMap::new();
        let mut to_local: HashMap<u32, usize> = HashMap::new();
        let mut queue: VecDeque<(u32, u64)> = VecDeque::new();
        for (local, t, chunks) in need {
            staged.insert(t, tensors[local].data.to_vec());
            to_local.insert(t as u32, local);
            queue.extend(chunks.into_iter().map(|ch| (t as u32, ch)));
        }
        let mut srcs: Vec<Source> = sources
            .iter()
            .filter_map(|p| {
                let r = c.world.rank_of(*p)?;
                c.links.get(r as usize)?.as_ref()?;
                Some(Source {
                    peer: *p,
                    rank: r,
                    inflight: Vec::new(),
                    last_progress: Instant::now(),
                    used: false,
                    failed: false,
                })
            })
            .collect();
        let mut received = 0u64;
        let mut first = true;
        let mut next_src = 0usize;
        loop {
            // Sources the master evicted, or that stalled, give their chunks back.
            let mut lost = Vec::new();
            srcs.retain_mut(|s| {
                let dead = s.failed
                    || abort.is_gone(s.peer)
                    || (!s.inflight.is_empty() && s.last_progress.elapsed() > stall);
                if dead {
                    lost.push(s.peer);
                    queue.extend(s.inflight.drain(..));
                }
                !dead
            });
            for p in lost {
                tracing::info!(target: "eccl::coll", "shared-state source {p} is gone; its chunks go to the others");
            }
            if queue.is_empty() && srcs.iter().all(|s| s.inflight.is_empty()) {
                break;
            }
            if srcs.is_empty() {
                return Err(Error::Aborted {
                    epoch,
                    cause: format!(
                        "every source of the shared state failed with {} chunks missing",
                        queue.len()
                    ),
                });
            }
            // Spread the requests round robin, a few outstanding at each source.
            let n = srcs.len();
            let mut idle_rounds = 0;
            while !queue.is_empty() && idle_rounds < n {
                let s = &mut srcs[next_src % n];
                next_src += 1;
                if s.inflight.len() >= INFLIGHT_PER_SOURCE {
                    idle_rounds += 1;
                    continue;
                }
                idle_rounds = 0;
                let (t, ch) = queue.pop_front().expect("checked non-empty");
                let h = state_header(FrameKind::StateReq, epoch, round, t, ch);
                let link = c.links[s.rank as usize]
                    .as_mut()
                    .expect("source has a link");
                if s.inflight.is_empty() {
                    s.last_progress = Instant::now();
                }
                match link.tx.send_frame(h, &[], stall).await {
                    Ok(()) => s.inflight.push((t, ch)),
                    Err(e) => {
                        // Given back with the source's other chunks at the top of the loop.
                        tracing::info!(target: "eccl::coll", "cannot ask shared-state source {} for chunks: {e}", s.peer);
                        s.inflight.push((t, ch));
                        s.failed = true;
                        break;
                    }
                }
            }
            let ranks: HashSet<u32> = srcs.iter().map(|s| s.rank).collect();
            match next_event(c, &ranks, &mut watch, epoch, round, tick).await {
                Wake::Abort | Wake::Tick => {}
                Wake::LinkDown(r, why) => {
                    if let Some(i) = srcs.iter().position(|s| s.rank == r) {
                        let s = srcs.remove(i);
                        tracing::info!(target: "eccl::coll", "shared-state source {} failed ({why}); its chunks go to the others", s.peer);
                        queue.extend(s.inflight);
                    }
                }
                Wake::Frame(r, f) => {
                    let h = f.header;
                    if h.kind != FrameKind::StateData {
                        continue;
                    }
                    let Some(si) = srcs.iter().position(|s| s.rank == r) else {
                        continue;
                    };
                    let key = (h.step, h.offset);
                    let Some(pos) = srcs[si].inflight.iter().position(|k| *k == key) else {
                        continue;
                    };
                    let t = &target[h.step as usize];
                    let range = chunk_range(t.len, h.offset);
                    let good = range.as_ref().is_some_and(|rg| rg.len() == f.payload.len())
                        && t.chunks.get(h.offset as usize)
                            == Some(blake3::hash(f.payload.as_bytes()).as_bytes());
                    let s = &mut srcs[si];
                    s.inflight.swap_remove(pos);
                    if !good {
                        // A source that sends what it did not promise is not asked again.
                        tracing::warn!(target: "eccl::coll", "shared-state chunk {} of {:?} from peer {} does not match its hash; dropping that source", h.offset, t.name, s.peer);
                        let s = srcs.remove(si);
                        queue.push_back(key);
                        queue.extend(s.inflight);
                        continue;
                    }
                    s.last_progress = Instant::now();
                    s.used = true;
                    let rg = range.expect("checked above");
                    received += rg.len() as u64;
                    staged
                        .get_mut(&(h.step as usize))
                        .expect("requested tensors are staged")[rg]
                        .copy_from_slice(f.payload.as_bytes());
                    if first {
                        first = false;
                        fault::hit(fault::Point::SyncFetch);
                    }
                }
            }
        }
        let mut used: Vec<PeerId> = srcs.iter().filter(|s| s.used).map(|s| s.peer).collect();
        used.sort_unstable();
        let staged = staged
            .into_iter()
            .map(|(t, data)| (to_local[&(t as u32)], data))
            .collect();
        Ok((staged, received, used))
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
