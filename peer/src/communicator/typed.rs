//! The typed API: every collective on slices of an [`Element`] type, in place (`buf`)
//! and out of place (`*_into`). Each is one line over [`Communicator::typed`] or
//! [`Communicator::typed_inplace`], which derive the dtype from the type and the count
//! from the slices ([`CollArgs::for_buffers`]).

use eccl_protocol::{CollectiveKind, Rank, ReduceOp};

use super::{CollArgs, Communicator, OpInfo};
use crate::error::Result;
use crate::Element;

use CollectiveKind::*;

impl Communicator {
    /// Any collective, out of place, on typed slices.
    pub async fn typed<T: Element>(
        &mut self,
        kind: CollectiveKind,
        op: ReduceOp,
        root: Rank,
        input: &[T],
        output: &mut [T],
    ) -> Result<OpInfo> {
        let world = self.world_size();
        let args = CollArgs::for_buffers(
            kind,
            T::DTYPE,
            op,
            root,
            Some(input.len()),
            Some(output.len()),
            world,
        );
        self.collective(
            args,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }

    /// Any collective, out of place, with each side a list of typed slices read as one,
    /// back to back ([`Communicator::collective_lists`]): `all_gather` into one slice per
    /// rank, `scatter` from one per rank, and so on, each read or written where it lies.
    pub async fn typed_lists<T: Element>(
        &mut self,
        kind: CollectiveKind,
        op: ReduceOp,
        root: Rank,
        inputs: &[&[T]],
        outputs: &mut [&mut [T]],
    ) -> Result<OpInfo> {
        let world = self.world_size();
        let args = CollArgs::for_buffers(
            kind,
            T::DTYPE,
            op,
            root,
            (!inputs.is_empty()).then(|| inputs.iter().map(|b| b.len()).sum()),
            (!outputs.is_empty()).then(|| outputs.iter().map(|b| b.len()).sum()),
            world,
        );
        let ins: Vec<&[u8]> = inputs.iter().map(|b| bytemuck::cast_slice(b)).collect();
        let mut outs: Vec<&mut [u8]> = outputs
            .iter_mut()
            .map(|b| bytemuck::cast_slice_mut(b))
            .collect();
        self.collective_lists(args, &ins, &mut outs).await
    }

    /// All_reduce, broadcast or reduce in place on a typed slice; it changes only if the
    /// call succeeds.
    pub async fn typed_inplace<T: Element>(
        &mut self,
        kind: CollectiveKind,
        op: ReduceOp,
        root: Rank,
        buf: &mut [T],
    ) -> Result<OpInfo> {
        let world = self.world_size();
        let n = Some(buf.len());
        let args = CollArgs::for_buffers(kind, T::DTYPE, op, root, n, n, world);
        self.collective_inplace(args, bytemuck::cast_slice_mut(buf))
            .await
    }

    pub async fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<OpInfo> {
        self.typed_inplace(AllReduce, op, Rank(0), buf).await
    }

    pub async fn all_reduce_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<OpInfo> {
        self.typed(AllReduce, op, Rank(0), input, output).await
    }

    pub async fn broadcast<T: Element>(&mut self, buf: &mut [T], root: Rank) -> Result<OpInfo> {
        self.typed_inplace(Broadcast, ReduceOp::Sum, root, buf)
            .await
    }

    /// Only the root's `input` is read; every rank's `output` gets it.
    pub async fn broadcast_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: Rank,
    ) -> Result<OpInfo> {
        self.typed(Broadcast, ReduceOp::Sum, root, input, output)
            .await
    }

    /// Reduces into `buf` on `root`; other ranks' `buf` is left unchanged.
    pub async fn reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<OpInfo> {
        self.typed_inplace(Reduce, op, root, buf).await
    }

    /// The result lands in the root's `output` only.
    pub async fn reduce_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<OpInfo> {
        self.typed(Reduce, op, root, input, output).await
    }

    /// `output` has `world_size * input.len()` elements; block r is rank r's input.
    pub async fn all_gather_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<OpInfo> {
        self.typed(AllGather, ReduceOp::Sum, Rank(0), input, output)
            .await
    }

    /// `input` has `world_size * output.len()` elements; rank r gets the reduction of
    /// block r.
    pub async fn reduce_scatter_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<OpInfo> {
        self.typed(ReduceScatter, op, Rank(0), input, output).await
    }

    /// Block j of `input` goes to rank j; block j of `output` comes from rank j.
    pub async fn all_to_all_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<OpInfo> {
        self.typed(AllToAll, ReduceOp::Sum, Rank(0), input, output)
            .await
    }

    /// [`Communicator::all_to_all_v`] on typed slices: `send_counts[j]` elements of
    /// `input` go to rank j, `recv_counts[j]` elements of `output` come from it.
    pub async fn all_to_all_v_into<T: Element>(
        &mut self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<OpInfo> {
        self.all_to_all_v(
            T::DTYPE,
            bytemuck::cast_slice(input),
            send_counts,
            bytemuck::cast_slice_mut(output),
            recv_counts,
        )
        .await
    }

    /// Root's `input` has `world_size * output.len()` elements; rank r gets block r.
    pub async fn scatter_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: Rank,
    ) -> Result<OpInfo> {
        self.typed(Scatter, ReduceOp::Sum, root, input, output)
            .await
    }

    /// Root's `output` has `world_size * input.len()` elements; block r is rank r's input.
    pub async fn gather_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: Rank,
    ) -> Result<OpInfo> {
        self.typed(Gather, ReduceOp::Sum, root, input, output).await
    }

    pub async fn barrier(&mut self) -> Result<OpInfo> {
        self.typed::<u8>(Barrier, ReduceOp::Sum, Rank(0), &[], &mut [])
            .await
    }

    pub async fn send<T: Element>(&mut self, data: &[T], peer: Rank, tag: u32) -> Result<OpInfo> {
        self.send_bytes(T::DTYPE, bytemuck::cast_slice(data), peer, tag)
            .await
    }

    pub async fn recv<T: Element>(
        &mut self,
        out: &mut [T],
        peer: Rank,
        tag: u32,
    ) -> Result<OpInfo> {
        self.recv_bytes(T::DTYPE, bytemuck::cast_slice_mut(out), peer, tag)
            .await
    }

    /// Receives from whichever rank's message with `tag` comes first; the sender is
    /// `OpInfo::peer`.
    pub async fn recv_any<T: Element>(&mut self, out: &mut [T], tag: u32) -> Result<OpInfo> {
        self.recv_any_bytes(T::DTYPE, bytemuck::cast_slice_mut(out), tag)
            .await
    }
}
