//! A receiver of the chosen state: fetches the chunks it lacks from every source at
//! once, checks each against its hash, and replaces a source that dies, stalls or lies.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use eccl_protocol::frame::FrameKind;
use eccl_protocol::{PeerId, TensorDigest};

use super::wait::{next_event, Wake};
use super::{chunk_range, state_header, SharedTensor};
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::fault;

/// Requests a receiver keeps outstanding at each source.
const INFLIGHT_PER_SOURCE: usize = 4;

struct Source {
    peer: PeerId,
    rank: u32,
    inflight: Vec<(u32, u64)>,
    last_progress: Instant,
    used: bool,
    failed: bool,
}

impl Communicator {
    /// Fetches the chunks in `need` from `sources`, several at once, each checked
    /// against the target's chunk hash. Returns the replaced tensors (index, bytes), the
    /// bytes received and the sources used.
    #[allow(clippy::type_complexity)]
    pub(super) async fn fetch_state(
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
                    let key = (h.index, h.offset);
                    let Some(pos) = srcs[si].inflight.iter().position(|k| *k == key) else {
                        continue;
                    };
                    let t = &target[h.index as usize];
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
                        .get_mut(&(h.index as usize))
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
