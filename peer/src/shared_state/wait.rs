//! Waiting for the frames of one sync round on the links of the members involved; the
//! frames of anything else wait in their link's stash for the collectives that follow.

use std::collections::HashSet;
use std::time::Duration;

use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_transport::link::{Incoming, LinkEvent};
use futures::future::{select_all, FutureExt};

use crate::communicator::Current;

/// What the next frame from any of `ranks` was, or why none came.
pub(super) enum Wake {
    Frame(u32, Incoming),
    LinkDown(u32, String),
    /// The abort state changed (an epoch aborted, a peer evicted).
    Abort,
    Tick,
}

/// Waits for a frame of this sync round from any of `ranks`; other frames go to their
/// link's stash for the collectives that follow.
pub(super) async fn next_event(
    cur: &mut Current,
    ranks: &HashSet<u32>,
    abort: &mut crate::abort::AbortWatch,
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
