//! Point-to-point messages: `send` and `recv` with a tag. Messages between two ranks
//! with one tag arrive in the order they were sent; messages with other tags do not
//! wait for them (the tag travels in the frame header, and each (peer, tag) pair counts
//! its own messages).

use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, Rank, ReduceOp};

use super::{Communicator, OpInfo};
use crate::error::{Error, Result};
use crate::executor::{self, Op};

enum Direction<'a> {
    Send(&'a [u8]),
    Recv(&'a mut [u8]),
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
        self.p2p(dtype, data.len(), peer, tag, Direction::Send(data))
            .await
    }

    /// Receives exactly `out.len()` bytes from rank `peer` with tag `tag`.
    pub async fn recv_bytes(
        &mut self,
        dtype: DType,
        out: &mut [u8],
        peer: Rank,
        tag: u32,
    ) -> Result<OpInfo> {
        let n = out.len();
        self.p2p(dtype, n, peer, tag, Direction::Recv(out)).await
    }

    async fn p2p(
        &mut self,
        dtype: DType,
        nbytes: usize,
        peer: Rank,
        tag: u32,
        dir: Direction<'_>,
    ) -> Result<OpInfo> {
        let (timeout, frame_bytes) = (self.cfg.timeout, self.cfg.buffsize);
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
        if nbytes % dtype.size() != 0 {
            return Err(Error::InvalidArgument(format!(
                "{nbytes} bytes is not a whole number of {dtype} elements"
            )));
        }
        if peer.0 >= world || peer == rank {
            return Err(Error::InvalidArgument(format!(
                "peer rank {peer} is not another rank of this world of {world}"
            )));
        }
        let members = c.members.clone();
        let counter = match dir {
            Direction::Send(_) => &mut c.p2p_sent,
            Direction::Recv(_) => &mut c.p2p_recvd,
        }
        .entry((peer, tag))
        .or_insert(0);
        let seq = *counter;
        *counter += 1;
        let link = c.links[peer.idx()]
            .as_mut()
            .ok_or_else(|| Error::InvalidArgument(format!("no link to rank {peer}")))?;
        let op = Op {
            epoch,
            seq,
            desc,
            world,
            timeout,
            frame_bytes,
            abort: &self.abort,
            suspect: &self.suspect,
        };
        let r = match dir {
            Direction::Send(d) => executor::send_p2p(&op, link, peer.0, tag, d).await,
            Direction::Recv(o) => executor::recv_p2p(&op, link, peer.0, tag, o).await,
        };
        match r {
            Ok(()) => Ok(OpInfo {
                epoch,
                seq,
                rank,
                world_size: world,
                members,
                algo: Algo::Direct,
            }),
            Err(e) => Err(self.fail(epoch, seq, desc, e).await),
        }
    }
}
