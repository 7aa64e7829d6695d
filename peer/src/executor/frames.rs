//! Receiving: the next frame a primitive waits for (early arrivals wait in the link's
//! stash; a frame that can never be right fails the call with `Mismatch`), and whole
//! messages assembled from frames at their offsets, each byte covered exactly once.

use std::collections::BTreeMap;

use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_protocol::{CollectiveKind, Descriptor};
use eccl_transport::link::{Incoming, LinkEvent, Payload};

use super::{Running, SPLIT_OP};
use crate::error::{Error, Result};
use crate::links::PeerRx;

/// Frames a link may hold for later steps before we call the peer runaway.
const MAX_STASH: usize = 4096;

/// What a receive waits for.
#[derive(Clone, Copy)]
pub(crate) struct Want {
    pub kind: FrameKind,
    pub seq: u64,
    pub index: u32,
    pub desc: Descriptor,
    /// Point-to-point only: the message's tag.
    pub tag: u32,
}

impl Want {
    fn names(&self, h: &FrameHeader) -> bool {
        h.kind == self.kind
            && h.seq == self.seq
            && if self.kind == FrameKind::P2p {
                h.tag == self.tag
            } else {
                h.index == self.index
            }
    }
}

/// Next frame from `rank` that `want` names, taking early arrivals from the stash.
pub(crate) async fn next_frame(
    op: &Running<'_>,
    rx: &mut PeerRx,
    rank: u32,
    want: Want,
) -> Result<Incoming> {
    if let Some(i) = rx.stash.iter().position(|f| want.names(&f.header)) {
        let f = rx.stash.remove(i).expect("index from position");
        return check_desc(op, rank, want, f);
    }
    // Frames kept while a send waited for room (`stash_arrivals`) were not judged when
    // they came: one that can never be right for this call fails it now, as it would
    // have on arrival.
    for f in rx.stash.iter().filter(|f| f.header.epoch == op.epoch) {
        judge(op, rank, want, &f.header)?;
    }
    loop {
        let f = match tokio::time::timeout(op.timeout, rx.link.next()).await {
            Err(_) => {
                op.blame(rank);
                return Err(op.timeout_err(format!(
                    "waiting for rank {rank} in {} ({})",
                    want.desc,
                    waited_for(&want, rx)
                )));
            }
            Ok(None) => return Err(op.link_err(rank, "closed")),
            Ok(Some(LinkEvent::Failed(e))) => return Err(op.link_err(rank, e)),
            Ok(Some(LinkEvent::Frame(f))) => f,
        };
        let h = f.header;
        tracing::trace!(target: "eccl::coll", "from rank {rank}: {:?} #{} message {} at {} ({} B), waiting for {:?} #{} message {}", h.kind, h.seq, h.index, h.offset, h.len, want.kind, want.seq, want.index);
        if h.epoch < op.epoch
            || matches!(
                h.kind,
                FrameKind::StateReq | FrameKind::StateData | FrameKind::StateDone
            )
        {
            // Left over from an earlier epoch, or from a shared-state sync that is over
            // (a late answer to a request that another source already served).
            continue;
        }
        if h.epoch > op.epoch {
            return Err(Error::Aborted {
                epoch: op.epoch,
                cause: format!("rank {rank} is already in epoch {}", h.epoch),
            });
        }
        if want.names(&h) {
            return check_desc(op, rank, want, f);
        }
        judge(op, rank, want, &h)?;
        if rx.stash.len() >= MAX_STASH {
            return Err(op.mismatch(
                rank,
                Some(h.desc),
                format!("rank {rank} ran more than {MAX_STASH} frames ahead"),
            ));
        }
        // Kept in memory of its own: a slot or pool permit held here could be the one the
        // sender needs to deliver the frame we wait for.
        rx.stash.push_back(Incoming {
            header: f.header,
            payload: f.payload.detach(),
        });
    }
}

/// A frame of this epoch from `rank` that `want` does not name: fine if it belongs to a
/// later step, call or message (it waits in the stash); a `Mismatch` if it can never be
/// right (another descriptor for this call, or a step this call has passed).
fn judge(op: &Running<'_>, rank: u32, want: Want, h: &FrameHeader) -> Result<()> {
    let collective = matches!(h.kind, FrameKind::Data | FrameKind::Check);
    // (`want.desc`: the call's descriptor, or for split sizes the pair's.)
    if collective && h.seq == op.seq && h.desc != want.desc && want.kind != FrameKind::P2p {
        return Err(op.mismatch(
            rank,
            Some(h.desc),
            format!(
                "rank {rank} called {} where this rank called {}",
                h.desc, want.desc
            ),
        ));
    }
    let later = match h.kind {
        FrameKind::P2p => true,
        FrameKind::Data | FrameKind::Check if want.kind == FrameKind::P2p => true,
        FrameKind::Data | FrameKind::Check => {
            h.seq > want.seq
                || (h.kind == FrameKind::Data
                    && (want.kind == FrameKind::Check || h.index > want.index))
        }
        _ => false,
    };
    if !later {
        return Err(op.mismatch(
            rank,
            Some(h.desc),
            format!("rank {rank} sent {:?} frame (collective #{}, message {}) where this rank expected collective #{} message {}", h.kind, h.seq, h.index, want.seq, want.index),
        ));
    }
    Ok(())
}

/// Bytes of frames the drain below keeps per link before it leaves that link alone (its
/// sender then waits for room, as it would without the drain).
const MAX_DRAINED_BYTES: usize = 256 << 20;

/// Moves every frame that arrives on `rxs` to its link's stash (in memory of its own),
/// for the receives queued after the call that waits meanwhile. Never returns: the call
/// that waits decides how it ends. A link that closes or fails, sends a frame of a later
/// epoch (kept in the stash for that epoch, as the shared-state wait keeps it), or holds
/// more than [`MAX_DRAINED_BYTES`] or [`MAX_STASH`] frames is left alone from then on;
/// what it means is for the receive that waits on it to say.
pub(crate) async fn stash_arrivals(
    op: &Running<'_>,
    rxs: &mut Vec<(u32, &mut PeerRx)>,
) -> std::convert::Infallible {
    use futures::future::{select_all, FutureExt};
    let mut drained = vec![0usize; rxs.len()];
    loop {
        if rxs.is_empty() {
            return std::future::pending().await;
        }
        let (i, ev) = {
            let futs = rxs
                .iter_mut()
                .enumerate()
                .map(|(i, (_, rx))| async move { (i, rx.link.next().await) }.boxed())
                .collect::<Vec<_>>();
            select_all(futs).await.0
        };
        let f = match ev {
            Some(LinkEvent::Frame(f)) => f,
            // Closed or failed: the end of the stream; a receive from it will see it.
            _ => {
                rxs.swap_remove(i);
                drained.swap_remove(i);
                continue;
            }
        };
        let h = f.header;
        if h.epoch < op.epoch
            || matches!(
                h.kind,
                FrameKind::StateReq | FrameKind::StateData | FrameKind::StateDone
            )
        {
            continue; // as `next_frame` drops them
        }
        let rx = &mut rxs[i].1;
        drained[i] += f.payload.len();
        rx.stash.push_back(Incoming {
            header: h,
            payload: f.payload.detach(),
        });
        if h.epoch > op.epoch || drained[i] >= MAX_DRAINED_BYTES || rx.stash.len() >= MAX_STASH {
            rxs.swap_remove(i);
            drained.swap_remove(i);
        }
    }
}

/// What a receive that timed out waited for, and what had come from that rank instead
/// (for the error: a peer that sent nothing looks different from one that is ahead).
fn waited_for(want: &Want, rx: &PeerRx) -> String {
    let what = match want.kind {
        FrameKind::Check => "its descriptor check".to_string(),
        FrameKind::P2p => format!("a message with tag {}", want.tag),
        _ => format!("message {} of collective #{}", want.index, want.seq),
    };
    if rx.stash.is_empty() {
        return format!("{what}; nothing else from it was waiting");
    }
    let early: Vec<String> = rx
        .stash
        .iter()
        .take(4)
        .map(|f| {
            format!(
                "{:?} #{} message {}",
                f.header.kind, f.header.seq, f.header.index
            )
        })
        .collect();
    format!(
        "{what}; {} frame(s) from it were waiting: {}{}",
        rx.stash.len(),
        early.join(", "),
        if rx.stash.len() > 4 { ", ..." } else { "" }
    )
}

fn check_desc(op: &Running<'_>, rank: u32, want: Want, f: Incoming) -> Result<Incoming> {
    let h = f.header.desc;
    // A split-sizes all_to_all's frames carry the high half of their sender's block
    // back in the tag (`pair_descs`).
    let tags_differ = op.uneven && want.kind == FrameKind::Data && f.header.tag != want.tag;
    if h != want.desc || tags_differ {
        let ours = want.desc;
        let split = |d: &Descriptor| d.kind == CollectiveKind::AllToAll && d.op == SPLIT_OP;
        let back = |d: &Descriptor, tag: u32| (u64::from(tag) << 32) | u64::from(d.root);
        let detail = match (split(&h), split(&ours)) {
            (true, true) if Descriptor { count: 0, root: 0, ..h } == Descriptor { count: 0, root: 0, ..ours } => format!(
                "all_to_all split sizes differ: rank {rank} sends this rank {} elements and expects {} back, where this rank expects {} from it and sends it {}",
                h.count,
                back(&h, f.header.tag),
                ours.count,
                back(&ours, want.tag)
            ),
            (true, false) => format!("rank {rank} called all_to_all with split sizes where this rank called {ours}"),
            (false, true) => format!("rank {rank} called {h} where this rank called all_to_all with split sizes"),
            _ => format!("rank {rank} called {h} where this rank called {ours}"),
        };
        return Err(op.mismatch(rank, Some(h), detail));
    }
    Ok(f)
}

/// Receives one message of `total` bytes from `rank`, handing each frame's payload to
/// `piece` with its byte offset; `first`: a frame of it the caller already took.
pub(crate) async fn recv_msg<F>(
    op: &Running<'_>,
    rx: &mut PeerRx,
    rank: u32,
    want: Want,
    total: usize,
    mut first: Option<Incoming>,
    mut piece: F,
) -> Result<()>
where
    F: FnMut(usize, Payload) -> Result<()>,
{
    let elem = want.desc.dtype.size();
    let mut covered = Coverage::default();
    while !covered.complete(total) {
        let f = match first.take() {
            Some(f) => f,
            None => next_frame(op, rx, rank, want).await?,
        };
        let (off, len) = (f.header.offset as usize, f.header.len as usize);
        let aligned = off % elem == 0 && len % elem == 0;
        if !aligned || !covered.add(off, len, total) {
            return Err(op.mismatch(
                rank,
                Some(f.header.desc),
                format!("rank {rank} sent {len} bytes at offset {off} of a {total}-byte message, overlapping or outside what it sent before"),
            ));
        }
        piece(off, f.payload)?;
    }
    Ok(())
}

/// The byte ranges of a message received so far. A range that overlaps one received
/// before is refused, so duplicate frames can never make a message with gaps look
/// complete.
#[derive(Default)]
struct Coverage {
    /// start -> end of each range received.
    ranges: BTreeMap<usize, usize>,
    bytes: usize,
    frames: usize,
}

impl Coverage {
    /// Records `off..off + len` of a `total`-byte message; false if it is outside the
    /// message or overlaps a range already received. An empty message is one empty
    /// frame at offset 0.
    fn add(&mut self, off: usize, len: usize, total: usize) -> bool {
        let Some(end) = off.checked_add(len).filter(|e| *e <= total) else {
            return false;
        };
        if len == 0 {
            let ok = total == 0 && off == 0 && self.frames == 0;
            self.frames += ok as usize;
            return ok;
        }
        let before = self.ranges.range(..end).next_back();
        if before.is_some_and(|(_, e)| *e > off) {
            return false;
        }
        self.ranges.insert(off, end);
        self.bytes += len;
        self.frames += 1;
        true
    }

    fn complete(&self, total: usize) -> bool {
        self.frames > 0 && self.bytes == total
    }
}

#[cfg(test)]
mod tests {
    use super::Coverage;

    #[test]
    fn duplicates_and_overlaps_never_complete_a_message() {
        let mut c = Coverage::default();
        assert!(c.add(0, 4, 8));
        assert!(!c.add(0, 4, 8), "the same frame twice");
        assert!(!c.add(2, 4, 8), "an overlap");
        assert!(!c.complete(8));
        assert!(!c.add(6, 4, 8), "past the end");
        assert!(c.add(4, 4, 8));
        assert!(c.complete(8));
        let mut e = Coverage::default();
        assert!(!e.complete(0));
        assert!(e.add(0, 0, 0) && e.complete(0));
        assert!(!e.add(0, 0, 0), "a second empty frame");
        let mut r = Coverage::default();
        assert!(r.add(8, 8, 16) && r.add(0, 8, 16) && r.complete(16));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(
            std::env::var("ECCL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000)
        ))]

        /// Any sequence of frame offsets a peer may send, against a byte map: a frame is
        /// taken exactly when it lies inside the message and touches no byte already
        /// received, and the message is complete exactly when every byte is covered.
        #[test]
        fn coverage_matches_a_byte_map(
            total in 0usize..200,
            frames in proptest::collection::vec((0usize..220, 0usize..220), 0..40),
        ) {
            let mut c = Coverage::default();
            let mut map = vec![false; total];
            let mut empty_seen = false;
            for (off, len) in frames {
                let expect = if len == 0 {
                    total == 0 && off == 0 && !empty_seen
                } else {
                    off + len <= total && !map[off..off + len].iter().any(|b| *b)
                };
                proptest::prop_assert_eq!(c.add(off, len, total), expect, "frame {}+{} of {}", off, len, total);
                if expect {
                    if len == 0 {
                        empty_seen = true;
                    }
                    map[off..off + len].iter_mut().for_each(|b| *b = true);
                }
                let full = if total == 0 { empty_seen } else { map.iter().all(|b| *b) };
                proptest::prop_assert_eq!(c.complete(total), full);
            }
        }

        /// A message cut into frames that arrive in any order, some of them twice: the
        /// repeats are refused, and it completes with the last new piece, not before.
        #[test]
        fn shuffled_frames_with_repeats_complete_once(
            cuts in proptest::collection::btree_set(1usize..4096, 0..20),
            order in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..60),
        ) {
            let total = 4096;
            let mut bounds: Vec<usize> = std::iter::once(0).chain(cuts).chain(std::iter::once(total)).collect();
            bounds.dedup();
            let pieces: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1] - w[0])).collect();
            let mut c = Coverage::default();
            let mut got = vec![false; pieces.len()];
            let seq = order.iter().map(|i| i.index(pieces.len())).chain(0..pieces.len());
            for i in seq {
                let (off, len) = pieces[i];
                proptest::prop_assert_eq!(c.add(off, len, total), !got[i]);
                got[i] = true;
                proptest::prop_assert_eq!(c.complete(total), got.iter().all(|g| *g));
            }
            proptest::prop_assert!(c.complete(total));
        }
    }
}
