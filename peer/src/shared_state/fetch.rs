//! A receiver of the chosen state: fetches the chunks it lacks from every source at
//! once, checks each against its hash, and replaces a source that dies, stalls or lies.
//!
//! Each arrived chunk is checked (and, unless it goes straight into a newcomer's tensor,
//! copied out of the link's buffer) on a blocking thread while the loop goes on asking
//! and receiving: on a host with a core to spare (the sources mostly wait on requests)
//! hashing and copying no longer hold up the transfer.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::task::JoinHandle;

use eccl_protocol::frame::FrameKind;
use eccl_protocol::{PeerId, TensorDigest};

use super::wait::{next_event, Wake};
use super::{chunk_range, state_header, SharedTensor};
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::fault;
use eccl_transport::link::Payload;

/// Requests a receiver keeps outstanding at each source.
const INFLIGHT_PER_SOURCE: usize = 4;

/// A chunk that arrived, after its check: its bytes if they matched the promised hash.
struct Checked {
    key: (u32, u64),
    rank: u32,
    bytes: Option<Arrived>,
}

/// A checked chunk's bytes: copied out already (to be written into the caller's tensor
/// once every chunk has arrived), or in a buffer of this process only (the link's own,
/// or a copy of bytes the link lent where their sender can still write them), written
/// straight into the tensor.
enum Arrived {
    Staged(Vec<u8>),
    Direct(Payload),
}

impl Arrived {
    fn bytes(&self) -> &[u8] {
        match self {
            Arrived::Staged(b) => b,
            Arrived::Direct(p) => p.as_bytes(),
        }
    }
}

/// Chunks fetched, by (target tensor index, chunk index), each checked.
pub(super) type Fetched = HashMap<(u32, u64), Vec<u8>>;

struct Source {
    peer: PeerId,
    rank: u32,
    inflight: Vec<(u32, u64)>,
    last_progress: Instant,
    used: bool,
    failed: bool,
}

impl Communicator {
    /// Fetches the chunks in `need` (local tensor, target tensor, chunks) from
    /// `sources`, several at once, each checked against the target's chunk hash.
    /// `in_place`: each chunk is written into the caller's tensor as it arrives (a
    /// newcomer's, which holds nothing yet); otherwise nothing is written here and the
    /// chunks come back, for the caller's tensors to change only once every chunk has
    /// arrived. Returns those chunks, the bytes received and the sources used.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    pub(super) async fn fetch_state(
        &mut self,
        epoch: u64,
        round: u64,
        tensors: &mut [SharedTensor<'_>],
        target: &[TensorDigest],
        sources: &[PeerId],
        need: Vec<(usize, usize, Vec<u64>)>,
        in_place: bool,
    ) -> Result<(Fetched, u64, Vec<PeerId>)> {
        let abort = self.abort.clone();
        let mut watch = abort.subscribe();
        let (stall, tick) = (self.cfg.timeout, Duration::from_millis(50));
        let c = self.cur.as_mut().expect("world checked by the caller");
        let mut fetched: Fetched = HashMap::new();
        let mut checks: FuturesUnordered<JoinHandle<Checked>> = FuturesUnordered::new();
        // Checks on blocking threads at once: a newcomer to a world of hundreds has
        // hundreds of chunks arriving, and a thread each could exhaust the host's.
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(threads));
        let mut queue: VecDeque<(u32, u64)> = VecDeque::new();
        let mut to_local: HashMap<u32, usize> = HashMap::new();
        for (local, t, chunks) in need {
            to_local.insert(t as u32, local);
            queue.extend(chunks.into_iter().map(|ch| (t as u32, ch)));
        }
        let mut srcs: Vec<Source> = sources
            .iter()
            .filter_map(|p| {
                let r = c.world.rank_of(*p)?.0;
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
            if queue.is_empty() && checks.is_empty() && srcs.iter().all(|s| s.inflight.is_empty()) {
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
            let wake = tokio::select! {
                biased;
                Some(done) = checks.next(), if !checks.is_empty() => {
                    let done = done.map_err(|e| Error::Aborted {
                        epoch,
                        cause: format!("checking a shared-state chunk failed: {e}"),
                    })?;
                    let si = srcs.iter().position(|s| s.rank == done.rank);
                    match done.bytes {
                        Some(b) => {
                            received += b.bytes().len() as u64;
                            if let Some(si) = si {
                                srcs[si].used = true;
                            }
                            match b {
                                Arrived::Staged(b) => {
                                    fetched.insert(done.key, b);
                                }
                                Arrived::Direct(p) => {
                                    let data = &mut tensors[to_local[&done.key.0]].data;
                                    let rg = chunk_range(data.len() as u64, done.key.1)
                                        .expect("checked against the target's length");
                                    data[rg].copy_from_slice(p.as_bytes());
                                }
                            }
                        }
                        None => {
                            let t = &target[done.key.0 as usize];
                            queue.push_back(done.key);
                            if let Some(si) = si {
                                // A source that sends what it did not promise is not asked again.
                                let s = srcs.remove(si);
                                tracing::warn!(target: "eccl::coll", "shared-state chunk {} of {:?} from peer {} does not match its hash; dropping that source", done.key.1, t.name, s.peer);
                                queue.extend(s.inflight);
                            }
                        }
                    }
                    continue;
                }
                w = next_event(c, &ranks, &mut watch, epoch, round, tick) => w,
            };
            match wake {
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
                    let key = (h.index, h.offset);
                    let Some(pos) = srcs[si].inflight.iter().position(|k| *k == key) else {
                        continue;
                    };
                    let s = &mut srcs[si];
                    s.inflight.swap_remove(pos);
                    s.last_progress = Instant::now();
                    let t = &target[h.index as usize];
                    let want_len = chunk_range(t.len, h.offset).map(|rg| rg.len());
                    let want_hash = t.chunks.get(h.offset as usize).copied();
                    let payload = f.payload;
                    // Never closed, so acquiring cannot fail.
                    let permit = gate.clone().acquire_owned().await;
                    // Checked and copied out of the link's buffer beside this loop; the
                    // buffer goes back to the link when the copy is done.
                    checks.push(tokio::task::spawn_blocking(move || {
                        let _permit = permit;
                        // What is checked is what is kept: bytes a link lends where
                        // they lie (a shared-memory slot) can still be written by their
                        // sender, so they are detached into memory of this process first.
                        let arrived = if !in_place {
                            Arrived::Staged(payload.as_bytes().to_vec())
                        } else if matches!(payload, Payload::Lent(_)) {
                            Arrived::Direct(payload.detach())
                        } else {
                            Arrived::Direct(payload)
                        };
                        let b = arrived.bytes();
                        let good = want_len == Some(b.len())
                            && want_hash.as_ref() == Some(blake3::hash(b).as_bytes());
                        let bytes = good.then_some(arrived);
                        Checked {
                            key,
                            rank: r,
                            bytes,
                        }
                    }));
                    if first {
                        first = false;
                        fault::hit(fault::Point::SyncFetch);
                    }
                }
            }
        }
        let mut used: Vec<PeerId> = srcs.iter().filter(|s| s.used).map(|s| s.peer).collect();
        used.sort_unstable();
        Ok((fetched, received, used))
    }
}
