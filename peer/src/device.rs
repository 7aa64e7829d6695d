//! Device memory collectives on eccl's worlds: the same-host all_reduce of
//! [`eccl_cuda::ipc`] with its handle exchange and status rounds carried by this
//! communicator's collectives (so only members of the world, over authenticated links,
//! ever see a handle, and a dead peer fails the call as any collective fails).

pub use eccl_cuda::{self as cuda, DevPtr, Device, DeviceError, IpcComm, IpcError};

use eccl_protocol::{CollectiveKind, DType, Rank, ReduceOp};

use crate::{CollArgs, Communicator};

/// [`eccl_cuda::Exchange`] over a communicator, for code that runs on a tokio worker
/// thread of a multi-threaded runtime (each round blocks that thread on the collective;
/// run device calls in `tokio::task::block_in_place`) or outside any runtime with a
/// handle to one.
pub struct CommExchange<'a> {
    comm: &'a mut Communicator,
    rt: tokio::runtime::Handle,
}

impl<'a> CommExchange<'a> {
    pub fn new(comm: &'a mut Communicator, rt: tokio::runtime::Handle) -> CommExchange<'a> {
        CommExchange { comm, rt }
    }
}

impl eccl_cuda::Exchange for CommExchange<'_> {
    fn rank(&self) -> usize {
        self.comm.rank().map_or(0, |r| r.idx())
    }

    fn world(&self) -> usize {
        self.comm.world_size() as usize
    }

    fn epoch(&self) -> u64 {
        self.comm.epoch()
    }

    fn all_gather(
        &mut self,
        mine: &[u8],
    ) -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error + Send + Sync>> {
        let world = self.world();
        let mut out = vec![0u8; mine.len() * world];
        let args = CollArgs {
            kind: CollectiveKind::AllGather,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            root: Rank(0),
            count: mine.len(),
        };
        self.rt
            .block_on(self.comm.collective(args, mine, &mut out))
            .map_err(Box::new)?;
        Ok(out
            .chunks(mine.len().max(1))
            .map(<[u8]>::to_vec)
            .take(world)
            .collect())
    }
}
