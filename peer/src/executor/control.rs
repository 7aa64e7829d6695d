//! Frames outside the schedule: the descriptor check before rooted collectives, abort
//! notices, and point-to-point messages.

use std::time::Duration;

use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_protocol::Descriptor;
use eccl_transport::link::Incoming;
use futures::future::try_join_all;

use super::frames::{next_frame, recv_msg, Want};
use super::Running;
use crate::error::Result;
use crate::links::PeerLink;

/// The check that precedes rooted collectives: every rank sends its descriptor to every
/// other rank and waits for theirs, so that ranks that disagree on the root (and so would
/// not exchange any data with each other) still fail with `Mismatch` instead of passing.
pub(crate) async fn check_round(op: &Running<'_>, links: &mut [Option<PeerLink>]) -> Result<()> {
    let h = op.header(FrameKind::Check, op.seq, 0, op.desc);
    let want = Want {
        kind: FrameKind::Check,
        seq: op.seq,
        index: 0,
        desc: op.desc,
        tag: 0,
    };
    let futs = links
        .iter_mut()
        .enumerate()
        .filter_map(|(r, l)| l.as_mut().map(|l| (r as u32, l)))
        .map(|(r, l)| async move {
            let PeerLink { tx, rx } = l;
            let send = async {
                tracing::trace!(target: "eccl::coll", "to rank {r}: check #{}", h.seq);
                tx.send_frame(h, &[], op.timeout)
                    .await
                    .map_err(|e| op.link_err(r, e))
            };
            let recv = async { next_frame(op, rx, r, want).await.map(|_| ()) };
            tokio::try_join!(send, recv).map(|_| ())
        });
    let all = try_join_all(futs);
    tokio::select! {
        biased;
        r = all => r.map(|_| ()),
        e = op.aborted() => Err(e),
    }
}

/// Tells every peer that this rank aborted collective `seq` (best effort, briefly
/// bounded: the peers may be gone).
pub(crate) async fn broadcast_abort(
    epoch: u64,
    seq: u64,
    desc: Descriptor,
    cause: eccl_protocol::frame::AbortCause,
    reason: &str,
    links: &mut [Option<PeerLink>],
) {
    let h = FrameHeader {
        kind: FrameKind::Abort,
        epoch,
        seq,
        index: cause as u32,
        len: 0,
        desc,
        offset: 0,
        tag: 0,
    };
    let reason = reason.as_bytes();
    let reason = &reason[..reason.len().min(1024)];
    let futs = links
        .iter_mut()
        .flatten()
        .filter(|l| !l.tx.is_poisoned())
        .map(|l| l.tx.send_frame(h, reason, Duration::from_millis(200)));
    let _ = futures::future::join_all(futs).await;
}

/// A point-to-point message with tag `tag`.
/// Sends a message to rank `rank`. While the link has no room for it, what the other
/// ranks send this one goes to their links' stashes: two ranks that send each other
/// more than a link holds before receiving (a symmetric `isend`/`irecv`, torch's
/// `batch_isend_irecv`, a ring of exchanges) would otherwise each wait for the other to
/// read, until the timeout.
pub(crate) async fn send_p2p(
    op: &Running<'_>,
    links: &mut [Option<PeerLink>],
    rank: u32,
    tag: u32,
    data: &[u8],
) -> Result<()> {
    let mut h = op.header(FrameKind::P2p, op.seq, 0, op.desc);
    h.tag = tag;
    let mut tx = None;
    let mut rxs = Vec::new();
    for (r, l) in links.iter_mut().enumerate() {
        if let Some(PeerLink { tx: t, rx }) = l.as_mut() {
            if r as u32 == rank {
                tx = Some(t);
            }
            rxs.push((r as u32, rx));
        }
    }
    let tx = tx.ok_or_else(|| op.link_err(rank, "no link"))?;
    let send = tx.send_region(h, data, op.frame_bytes, op.elem(), op.timeout);
    tokio::select! {
        biased;
        r = send => r.map_err(|e| op.link_err(rank, e)),
        e = op.aborted() => Err(e),
        never = super::frames::stash_arrivals(op, &mut rxs) => match never {},
    }
}

/// Receives a message (the rest of it, after the `first` frame `probe_p2p` took).
pub(crate) async fn recv_p2p(
    op: &Running<'_>,
    link: &mut PeerLink,
    rank: u32,
    tag: u32,
    first: Option<Incoming>,
    out: &mut [u8],
) -> Result<()> {
    let want = Want {
        kind: FrameKind::P2p,
        seq: op.seq,
        index: 0,
        desc: op.desc,
        tag,
    };
    let total = out.len();
    let recv = recv_msg(op, &mut link.rx, rank, want, total, first, |off, b| {
        out[off..off + b.len()].copy_from_slice(b.as_bytes());
        Ok(())
    });
    tokio::select! {
        biased;
        r = recv => r,
        e = op.aborted() => Err(e),
    }
}

/// Waits for the first frame of the next message with tag `tag` from rank `from`, or
/// from any rank when `from` is `None` (receive from any source), and returns the
/// sender with that frame, for `recv_p2p`. `seq_of(r)` is the number of rank r's next
/// message on this tag. Already stashed messages win, lowest rank first. Nothing is
/// consumed before a message is there, so a timeout here is the caller's alone: no rank
/// is blamed and the world can go on. Dropping the other links' waits loses nothing:
/// `next_frame` stashes what it reads before its next await, and only the wait that
/// returns has taken a frame of the message.
pub(crate) async fn probe_p2p(
    op: &Running<'_>,
    links: &mut [Option<PeerLink>],
    from: Option<u32>,
    tag: u32,
    seq_of: impl Fn(u32) -> u64,
) -> Result<(u32, Incoming)> {
    let want = |r: usize| Want {
        kind: FrameKind::P2p,
        seq: seq_of(r as u32),
        index: 0,
        desc: op.desc,
        tag,
    };
    let idle = Running {
        // The per-frame bound would blame whichever rank it ran out on.
        timeout: Duration::from_secs(365 * 24 * 3600),
        ..*op
    };
    let idle = &idle;
    let futs: Vec<_> = links
        .iter_mut()
        .enumerate()
        .filter(|(r, _)| from.is_none_or(|f| f as usize == *r))
        .filter_map(|(r, l)| l.as_mut().map(|l| (r, l)))
        .map(|(r, l)| {
            Box::pin(async move {
                next_frame(idle, &mut l.rx, r as u32, want(r))
                    .await
                    .map(|f| (r as u32, f))
            })
        })
        .collect();
    if futs.is_empty() {
        return Err(crate::error::Error::InvalidArgument(match from {
            Some(r) => format!("no link to rank {r}"),
            None => "receive from any source in a world of one rank: there is no other rank".into(),
        }));
    }
    // select_all polls in rank order: a message already stashed from a lower rank wins.
    let first = futures::future::select_all(futs);
    let waited = async {
        match tokio::time::timeout(op.timeout, first).await {
            Ok((r, _, _)) => r,
            Err(_) => Err(op.timeout_err(match from {
                Some(r) => format!("waiting for a message with tag {tag} from rank {r}"),
                None => format!("waiting for a message with tag {tag} from any rank"),
            })),
        }
    };
    tokio::select! {
        biased;
        r = waited => r,
        e = op.aborted() => Err(e),
    }
}

/// The header of the frame that closes a link on purpose.
pub(crate) fn close_header(epoch: u64) -> FrameHeader {
    FrameHeader {
        kind: FrameKind::Close,
        epoch,
        seq: 0,
        index: 0,
        len: 0,
        desc: Descriptor {
            kind: eccl_protocol::CollectiveKind::Barrier,
            dtype: eccl_protocol::DType::U8,
            op: eccl_protocol::ReduceOp::Sum,
            algo: eccl_protocol::Algo::Direct,
            root: 0,
            count: 0,
        },
        offset: 0,
        tag: 0,
    }
}
