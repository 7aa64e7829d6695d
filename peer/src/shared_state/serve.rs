//! A source of the chosen state: answers chunk requests until every receiver is done,
//! gone or unreachable.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use eccl_protocol::frame::FrameKind;
use eccl_protocol::{PeerId, TensorDigest};

use super::wait::{next_event, Wake};
use super::{chunk_range, state_header, SharedTensor};
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::fault;

impl Communicator {
    /// Answers chunk requests until every receiver is done, gone or unreachable.
    pub(super) async fn serve_state(
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
            .filter_map(|p| c.world.rank_of(*p).map(|r| (r.0, *p)))
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
                                .get(h.index as usize)
                                .and_then(|t| by_name.get(t.name.as_str()))
                                .and_then(|i| {
                                    let d = &tensors[*i].data;
                                    chunk_range(d.len() as u64, h.offset).map(|rg| &d[rg])
                                });
                            let Some(bytes) = chunk else {
                                tracing::warn!(target: "eccl::coll", "rank {r} asked for chunk {} of tensor {} that does not exist", h.offset, h.index);
                                waiting.remove(&r);
                                continue;
                            };
                            let reply =
                                state_header(FrameKind::StateData, epoch, round, h.index, h.offset);
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
}
