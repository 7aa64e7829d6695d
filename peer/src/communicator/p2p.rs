//! Point-to-point messages: `send` and `recv` with a tag. Messages between two ranks
//! with one tag arrive in the order they were sent; messages with other tags do not
//! wait for them (the tag travels in the frame header, and each (peer, tag) pair counts
//! its own messages).

use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, Rank, ReduceOp};
use futures::future::{BoxFuture, FutureExt};

use super::{Communicator, OpInfo};
use crate::error::{Error, Result};
use crate::executor::{self, Running};

enum Direction<'a> {
    Send(&'a [u8], Rank),
    /// From one rank, or from whichever rank's message comes first (`None`).
    Recv(&'a mut [u8], Option<Rank>),
}

impl Communicator {
    /// Sends `data` to rank `peer`, matched by the receiver's `recv` from this rank with
    /// the same tag. Returns when the message is handed to the link (eager send, like
    /// Gloo's).
    pub async fn send_bytes(
        &mut self,
        dtype: DType,
        data: &[u8],
        peer: Rank,
        tag: u32,
    ) -> Result<OpInfo> {
        self.p2p(dtype, data.len(), tag, Direction::Send(data, peer))
            .await
    }

    /// Receives exactly `out.len()` bytes from rank `peer` with tag `tag`. If the message
    /// does not start arriving within the configured timeout, the call fails with
    /// `Timeout` on this rank alone and the world goes on; the message, if it comes
    /// later, is the next receive's.
    pub async fn recv_bytes(
        &mut self,
        dtype: DType,
        out: &mut [u8],
        peer: Rank,
        tag: u32,
    ) -> Result<OpInfo> {
        let n = out.len();
        self.p2p(dtype, n, tag, Direction::Recv(out, Some(peer)))
            .await
    }

    /// Receives exactly `out.len()` bytes with tag `tag` from whichever rank's message
    /// comes first (MPI's `MPI_ANY_SOURCE`, torch's `recv(src=None)`); the sender is
    /// `OpInfo::peer`. Messages from one rank on one tag still arrive in order.
    pub async fn recv_any_bytes(
        &mut self,
        dtype: DType,
        out: &mut [u8],
        tag: u32,
    ) -> Result<OpInfo> {
        let n = out.len();
        self.p2p(dtype, n, tag, Direction::Recv(out, None)).await
    }

    fn p2p<'a>(
        &'a mut self,
        dtype: DType,
        nbytes: usize,
        tag: u32,
        dir: Direction<'a>,
    ) -> BoxFuture<'a, Result<OpInfo>> {
        async move {
            let (timeout, frame_bytes) = (self.cfg.timeout, self.cfg.frame_bytes);
            self.ready()?;
            let c = self.cur.as_mut().expect("checked by ready()");
            let (epoch, rank, world) = (c.world.epoch, c.rank, c.size());
            let desc = Descriptor {
                kind: CollectiveKind::SendRecv,
                dtype,
                op: ReduceOp::Sum,
                algo: Algo::Direct,
                root: 0,
                count: (nbytes / dtype.size()) as u64,
            };
            // A rank-local mistake: nothing was sent, the other side has not been touched.
            if !nbytes.is_multiple_of(dtype.size()) {
                return Err(Error::InvalidArgument(format!(
                    "{nbytes} bytes is not a whole number of {dtype} elements"
                )));
            }
            let named = match &dir {
                Direction::Send(_, to) => Some(*to),
                Direction::Recv(_, from) => *from,
            };
            if let Some(peer) = named.filter(|p| p.0 >= world || *p == rank) {
                return Err(Error::InvalidArgument(format!(
                    "peer rank {peer} is not another rank of this world of {world}"
                )));
            }
            let members = c.members.clone();
            let op = Running {
                epoch,
                seq: 0,
                desc,
                world,
                timeout,
                frame_bytes,
                abort: &self.abort,
                suspect: &self.suspect,
                uneven: false,
            };
            // A receive first waits for its message's first frame, consuming nothing before
            // it: if none comes within the timeout the call fails on this rank alone (as a
            // receive that times out in Gloo or MPI does) and the next receive from that
            // rank with that tag gets its next message.
            let (peer, first) = match &dir {
                Direction::Send(_, to) => (*to, None),
                Direction::Recv(_, from) => {
                    let recvd = &c.p2p_recvd;
                    let seq_of = |r: u32| recvd.get(&(Rank(r), tag)).copied().unwrap_or(0);
                    let from = from.map(|p| p.0);
                    match executor::probe_p2p(&op, &mut c.links, from, tag, seq_of).await {
                        Ok((r, f)) => (Rank(r), Some(f)),
                        Err(e @ Error::Timeout { .. }) => return Err(e),
                        Err(e) => return Err(self.fail(epoch, 0, desc, e).await),
                    }
                }
            };
            let counter = match dir {
                Direction::Send(..) => &mut c.p2p_sent,
                Direction::Recv(..) => &mut c.p2p_recvd,
            }
            .entry((peer, tag))
            .or_insert(0);
            let seq = *counter;
            *counter += 1;
            if c.links[peer.idx()].is_none() {
                return Err(Error::InvalidArgument(format!("no link to rank {peer}")));
            }
            let op = Running { seq, ..op };
            let r = match dir {
                Direction::Send(d, _) => {
                    executor::send_p2p(&op, &mut c.links, peer.0, tag, d).await
                }
                Direction::Recv(o, _) => {
                    let link = c.links[peer.idx()].as_mut().expect("checked above");
                    executor::recv_p2p(&op, link, peer.0, tag, first, o).await
                }
            };
            match r {
                Ok(()) => Ok(OpInfo {
                    epoch,
                    seq,
                    rank,
                    world_size: world,
                    members,
                    algo: Algo::Direct,
                    peer: Some(peer),
                }),
                Err(e) => Err(self.fail(epoch, seq, desc, e).await),
            }
        }
        .boxed()
    }
}
