//! A blocking facade over [`crate::Communicator`] for code that is not async: it owns a
//! small tokio runtime and waits on each call.

use eccl_protocol::{CollectiveKind, DType, Rank, ReduceOp};

use crate::communicator::{CollArgs, OpInfo, WorldUpdate};
use crate::{Config, Element, Error, Result};

pub struct Communicator {
    rt: tokio::runtime::Runtime,
    inner: crate::Communicator,
}

impl Communicator {
    pub fn connect(cfg: Config) -> Result<Communicator> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("eccl")
            .enable_all()
            .build()
            .map_err(|e| Error::InvalidArgument(format!("cannot start the eccl runtime: {e}")))?;
        let inner = rt.block_on(crate::Communicator::connect(cfg))?;
        Ok(Communicator { rt, inner })
    }

    pub fn inner(&mut self) -> &mut crate::Communicator {
        &mut self.inner
    }
    pub fn rank(&self) -> Option<Rank> {
        self.inner.rank()
    }
    pub fn world_size(&self) -> u32 {
        self.inner.world_size()
    }
    pub fn epoch(&self) -> u64 {
        self.inner.epoch()
    }
    pub fn update_topology(&mut self) -> Result<WorldUpdate> {
        self.rt.block_on(self.inner.update_topology())
    }
    pub fn are_peers_pending(&mut self) -> Result<bool> {
        self.rt.block_on(self.inner.are_peers_pending())
    }
    pub fn collective(
        &mut self,
        args: CollArgs,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<OpInfo> {
        self.rt.block_on(self.inner.collective(args, input, output))
    }
    pub fn collective_inplace(&mut self, args: CollArgs, buf: &mut [u8]) -> Result<OpInfo> {
        self.rt.block_on(self.inner.collective_inplace(args, buf))
    }
    /// Any collective on typed slices (see [`crate::Communicator::typed`]).
    pub fn typed<T: Element>(
        &mut self,
        kind: CollectiveKind,
        op: ReduceOp,
        root: Rank,
        input: &[T],
        output: &mut [T],
    ) -> Result<OpInfo> {
        self.rt
            .block_on(self.inner.typed(kind, op, root, input, output))
    }
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<OpInfo> {
        self.rt.block_on(self.inner.all_reduce(buf, op))
    }
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: Rank) -> Result<OpInfo> {
        self.rt.block_on(self.inner.broadcast(buf, root))
    }
    pub fn barrier(&mut self) -> Result<OpInfo> {
        self.rt.block_on(self.inner.barrier())
    }
    pub fn send_bytes(
        &mut self,
        dtype: DType,
        data: &[u8],
        peer: Rank,
        tag: u32,
    ) -> Result<OpInfo> {
        self.rt
            .block_on(self.inner.send_bytes(dtype, data, peer, tag))
    }
    pub fn recv_bytes(
        &mut self,
        dtype: DType,
        out: &mut [u8],
        peer: Rank,
        tag: u32,
    ) -> Result<OpInfo> {
        self.rt
            .block_on(self.inner.recv_bytes(dtype, out, peer, tag))
    }
    pub fn recv_any_bytes(&mut self, dtype: DType, out: &mut [u8], tag: u32) -> Result<OpInfo> {
        self.rt.block_on(self.inner.recv_any_bytes(dtype, out, tag))
    }
    pub fn leave(self) -> Result<()> {
        let Communicator { rt, inner } = self;
        rt.block_on(inner.leave())
    }
}
