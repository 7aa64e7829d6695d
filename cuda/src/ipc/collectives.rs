//! The collectives of [`IpcComm`]: all_reduce (with and without `keep`), all_gather,
//! reduce_scatter, broadcast, all_to_all, gather and scatter, each as the steps the
//! module above describes (its records, the work of each GPU's owner, the status).

use eccl_protocol::{DType, ReduceOp};

use super::*;

impl<D: Device> IpcComm<D> {
    /// All-reduces `count` elements at `buf` in place across the exchange's ranks, all on
    /// this host. `keep`: leave `buf` as it was if the call fails (G2), at the cost of a
    /// scratch chunk and a second pass.
    ///
    /// # Safety
    /// `buf` is `count` elements of device memory on this rank's device, not used by
    /// anything else until the call returns.
    pub unsafe fn all_reduce(
        &mut self,
        ex: &mut dyn Exchange,
        buf: DevPtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        keep: bool,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        if !op.valid_for(dtype) {
            return Err(IpcError::Invalid(format!(
                "{op:?} is not defined for {dtype}"
            )));
        }
        let size = dtype.size();
        let bytes = count * size;
        let call = Call {
            kind: IpcKind::AllReduce,
            dtype,
            op,
            keep,
            root: 0,
            count: count as u64,
        };
        let metas = self.begin(ex, call, (buf, bytes), (0, 0), None)?;
        if world == 1 || bytes == 0 {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let owners = owners(&metas.iter().map(|m| m.gpu).collect::<Vec<_>>());
        let mine = owners.iter().position(|&o| o == rank);
        let local = match mine {
            Some(k) => self.reduce_phase(&metas, rank, buf, chunk(count, owners.len(), dtype, k)),
            None => Ok(NO_MEM),
        };
        self.phases.reduce += t.elapsed();
        let statuses = self.settle(ex, local)?;
        let t = std::time::Instant::now();
        if !keep {
            return Ok(());
        }
        let copied = match mine {
            Some(_) => self.keep_copies(&metas, &statuses, &owners, rank, buf),
            None => Ok(()),
        };
        // No rank returns before its buffer is written, and no owner frees or rewrites
        // its scratch while another still copies from it; an owner whose copies failed
        // says so, and every rank fails alike.
        let all = self.exchange(ex, &[u8::from(copied.is_err())])?;
        self.phases.copy += t.elapsed();
        copied?;
        match all.iter().position(|s| s[0] != 0) {
            Some(r) => Err(IpcError::Peer {
                rank: r,
                msg: "its copies of the result into its GPU's buffers failed".into(),
            }),
            None => Ok(()),
        }
    }

    /// An owner's copies of every reduced chunk into the buffers of the ranks on its GPU
    /// (`all_reduce` with `keep`), waited for also when one fails part-way.
    unsafe fn keep_copies(
        &mut self,
        metas: &[Meta],
        statuses: &[Vec<u8>],
        owners: &[usize],
        rank: usize,
        buf: DevPtr,
    ) -> Result<(), IpcError> {
        let Call {
            dtype, op, count, ..
        } = metas[rank].call;
        let count = count as usize;
        let size = dtype.size();
        let bytes = count * size;
        let queued = (|| {
            // The owner of each GPU writes the result into the buffers of the ranks on its
            // GPU (its own among them), so ranks that share a GPU queue nothing.
            let here = Self::targets(metas, rank);
            for (k, &o) in owners.iter().enumerate() {
                let (start, end) = chunk(count, owners.len(), dtype, k);
                if end == start {
                    continue;
                }
                let len = (end - start) * size;
                let src = if o == rank {
                    self.scratch.as_ref().expect("reduce_phase made it").0
                } else {
                    let m = get_mem(&statuses[o][1..1 + MEM_BYTES]);
                    self.open(&m, len as u64)?
                };
                // One pass over the chunk writes every target (a copy per target would
                // read it once each: on one H200, 256 MiB to two ranks, 268 µs in two
                // copies for a single read's worth of the GPU's bandwidth more).
                let mut dsts = Vec::with_capacity(here.len());
                for &t in &here {
                    let dst = self.at(metas, rank, t, buf, |m| m.send, bytes)?;
                    dsts.push(dst + (start * size) as u64);
                }
                if let [dst] = dsts[..] {
                    self.dev.copy(dst, src, len)?;
                } else {
                    self.dev.reduce(dtype, op, &[src], &dsts, end - start, 0)?;
                }
            }
            Ok(())
        })();
        self.landed(queued)
    }

    /// Elements `[start, end)` from every rank's `buf`, combined (the call is
    /// `metas[rank]`, which every rank's record matches), written into every rank's buffer
    /// or, with `keep`, into this rank's scratch chunk, whose handle it returns.
    unsafe fn reduce_phase(
        &mut self,
        metas: &[Meta],
        rank: usize,
        buf: DevPtr,
        (start, end): (usize, usize),
    ) -> Result<IpcMem, IpcError> {
        let Call {
            dtype,
            op,
            keep,
            count,
            ..
        } = metas[rank].call;
        let count = count as usize;
        let size = dtype.size();
        let world = metas.len();
        let scratch = if keep {
            self.ensure_scratch((end - start) * size)?
        } else {
            NO_MEM
        };
        if end > start {
            let mut bases = Vec::with_capacity(world);
            for s in 0..world {
                bases.push(self.at(metas, rank, s, buf, |m| m.send, count * size)?);
            }
            let off = (start * size) as u64;
            let ins: Vec<DevPtr> = bases.iter().map(|b| b + off).collect();
            let outs: Vec<DevPtr> = if keep {
                vec![self.scratch.as_ref().expect("made above").0]
            } else {
                ins.clone()
            };
            self.dev
                .reduce(dtype, op, &ins, &outs, end - start, world as u32)?;
        }
        self.dev.synchronize()?;
        Ok(scratch)
    }

    /// Gathers `count` elements from every rank's `send` into every rank's `recv`
    /// (`world × count` elements, in rank order). `send` may be `recv`'s own slice at this
    /// rank's offset (NCCL's in-place form); any other overlap is refused on every rank.
    /// After a failed call `recv` is undefined (what torch's backends promise); `send` is
    /// never written.
    ///
    /// # Safety
    /// `send` is `count` elements and `recv` `world × count` elements of device memory on
    /// this rank's device, not used by anything else until the call returns.
    pub unsafe fn all_gather(
        &mut self,
        ex: &mut dyn Exchange,
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        let bytes = count * dtype.size();
        let own = recv + (rank * bytes) as u64;
        let refused = (send != own && overlap(send, bytes, recv, world * bytes)).then(|| {
            "all_gather: the input overlaps the output other than as its own slice at this \
             rank's offset"
                .to_string()
        });
        let call = Call {
            kind: IpcKind::AllGather,
            dtype,
            op: ReduceOp::Sum,
            keep: false,
            root: 0,
            count: count as u64,
        };
        let metas = self.begin(ex, call, (send, bytes), (recv, world * bytes), refused)?;
        if bytes == 0 {
            return Ok(());
        }
        self.owners_work(ex, &metas, rank, |this, t| {
            let recv_t = this.at(&metas, rank, t, recv, |m| m.recv, world * bytes)?;
            for s in 0..world {
                let src = this.at(&metas, rank, s, send, |m| m.send, bytes)?;
                let dst = recv_t + (s * bytes) as u64;
                if src != dst {
                    this.dev.copy(dst, src, bytes)?;
                }
            }
            Ok(())
        })
    }

    /// Reduces every rank's `send` (`world × count` elements) with `op` and leaves slice
    /// `r` of the result in rank `r`'s `recv` (`count` elements), combined in rank order
    /// (the same bits on every rank). `recv` may be `send`'s own slice at this rank's
    /// offset (NCCL's in-place form); any other overlap is refused on every rank. After a
    /// failed call `recv` is undefined; `send` is written only where it is `recv`.
    ///
    /// # Safety
    /// As [`IpcComm::all_gather`], with the sizes swapped.
    pub unsafe fn reduce_scatter(
        &mut self,
        ex: &mut dyn Exchange,
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        if !op.valid_for(dtype) {
            return Err(IpcError::Invalid(format!(
                "{op:?} is not defined for {dtype}"
            )));
        }
        let size = dtype.size();
        let bytes = count * size;
        let own = send + (rank * bytes) as u64;
        let refused = (recv != own && overlap(recv, bytes, send, world * bytes)).then(|| {
            "reduce_scatter: the output overlaps the input other than as its own slice at \
             this rank's offset"
                .to_string()
        });
        let call = Call {
            kind: IpcKind::ReduceScatter,
            dtype,
            op,
            keep: false,
            root: 0,
            count: count as u64,
        };
        let metas = self.begin(ex, call, (send, world * bytes), (recv, bytes), refused)?;
        if bytes == 0 {
            return Ok(());
        }
        self.owners_work(ex, &metas, rank, |this, t| {
            let out = this.at(&metas, rank, t, recv, |m| m.recv, bytes)?;
            let mut ins = Vec::with_capacity(world);
            for s in 0..world {
                let base = this.at(&metas, rank, s, send, |m| m.send, world * bytes)?;
                ins.push(base + (t * bytes) as u64);
            }
            if world == 1 {
                if out != ins[0] {
                    this.dev.copy(out, ins[0], bytes)?;
                }
            } else {
                this.dev
                    .reduce(dtype, op, &ins, &[out], count, world as u32)?;
            }
            Ok(())
        })
    }

    /// Copies `count` elements of rank `root`'s `buf` into every other rank's `buf`.
    /// After a failed call a non-root `buf` is undefined; the root's is never written.
    ///
    /// # Safety
    /// `buf` is `count` elements of device memory on this rank's device, not used by
    /// anything else until the call returns.
    pub unsafe fn broadcast(
        &mut self,
        ex: &mut dyn Exchange,
        buf: DevPtr,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        let bytes = count * dtype.size();
        let refused =
            (root >= world).then(|| format!("broadcast from rank {root} of a world of {world}"));
        let call = Call {
            kind: IpcKind::Broadcast,
            dtype,
            op: ReduceOp::Sum,
            keep: false,
            root: root as u32,
            count: count as u64,
        };
        let metas = self.begin(ex, call, (buf, bytes), (0, 0), refused)?;
        if bytes == 0 || world == 1 {
            return Ok(());
        }
        self.owners_work(ex, &metas, rank, |this, t| {
            if t != root {
                let src = this.at(&metas, rank, root, buf, |m| m.send, bytes)?;
                let dst = this.at(&metas, rank, t, buf, |m| m.send, bytes)?;
                this.dev.copy(dst, src, bytes)?;
            }
            Ok(())
        })
    }
    /// Sends `send_counts[t]` elements of `send` (blocks in rank order) to rank t, and
    /// receives `recv_counts[s]` elements from rank s into `recv` (blocks in rank order):
    /// torch's `all_to_all_single` with its split sizes (equal splits are one case of
    /// it). The counts travel in a second record after the first, and every rank checks
    /// that what each sends to each is what that one expects, so a disagreement is the
    /// same `Mismatch` everywhere before anything is written. `send` and `recv` must not
    /// overlap (NCCL's all-to-all has no in-place form either); where they do, every rank
    /// fails. After a failed call `recv` is undefined; `send` is never written.
    ///
    /// # Safety
    /// `send` holds the sum of `send_counts` and `recv` the sum of `recv_counts` elements
    /// of device memory on this rank's device, not used by anything else until the call
    /// returns.
    pub unsafe fn all_to_all(
        &mut self,
        ex: &mut dyn Exchange,
        send: DevPtr,
        recv: DevPtr,
        send_counts: &[usize],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        let size = dtype.size();
        let send_bytes = send_counts.iter().sum::<usize>() * size;
        let recv_bytes = recv_counts.iter().sum::<usize>() * size;
        let refused = if send_counts.len() != world || recv_counts.len() != world {
            Some(format!(
                "all_to_all: {} send and {} receive counts for a world of {world}",
                send_counts.len(),
                recv_counts.len()
            ))
        } else if overlap(send, send_bytes, recv, recv_bytes) {
            Some("all_to_all: the input overlaps the output".to_string())
        } else {
            None
        };
        let call = Call {
            kind: IpcKind::AllToAll,
            dtype,
            op: ReduceOp::Sum,
            keep: false,
            root: 0,
            count: 0,
        };
        let metas = self.begin(ex, call, (send, send_bytes), (recv, recv_bytes), refused)?;
        let records = self.exchange(ex, &counts_record(send_counts, recv_counts))?;
        // sends[s][t]: what rank s sends rank t, which is also what t expects from s.
        let sends = count_table(&records)?;
        if sends.iter().flatten().all(|&c| c == 0) {
            return Ok(());
        }
        let bytes = |n: usize| (n * size) as u64;
        self.owners_work(ex, &metas, rank, |this, t| {
            let into_t: usize = sends.iter().map(|of_s| of_s[t]).sum();
            if into_t == 0 {
                return Ok(());
            }
            let recv_t = this.at(&metas, rank, t, recv, |m| m.recv, into_t * size)?;
            let mut dst = recv_t;
            for (s, of_s) in sends.iter().enumerate() {
                let n = of_s[t];
                if n > 0 {
                    let from_s = of_s.iter().sum::<usize>() * size;
                    let send_s = this.at(&metas, rank, s, send, |m| m.send, from_s)?;
                    let src = send_s + bytes(of_s[..t].iter().sum());
                    this.dev.copy(dst, src, n * size)?;
                }
                dst += bytes(n);
            }
            Ok(())
        })
    }

    /// Copies every rank's `send` (`count` elements) into rank `root`'s `recv` (`world ×
    /// count`, rank order); ranks other than the root pass no `recv` (0). The root's
    /// `send` may be its own slice of `recv`; any other overlap, a root outside the world
    /// or a root without `recv` fails on every rank. After a failed call the root's
    /// `recv` is undefined; `send` is never written.
    ///
    /// # Safety
    /// `send` is `count` elements, and on the root `recv` is `world × count` elements, of
    /// device memory on this rank's device, not used by anything else until the call
    /// returns.
    pub unsafe fn gather(
        &mut self,
        ex: &mut dyn Exchange,
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        let bytes = count * dtype.size();
        let Some(metas) =
            self.begin_rooted(ex, IpcKind::Gather, (send, recv), count, dtype, root)?
        else {
            return Ok(());
        };
        self.owners_work(ex, &metas, rank, |this, t| {
            if t != root {
                return Ok(());
            }
            let out = this.at(&metas, rank, root, recv, |m| m.recv, world * bytes)?;
            for s in 0..world {
                let src = this.at(&metas, rank, s, send, |m| m.send, bytes)?;
                let dst = out + (s * bytes) as u64;
                if src != dst {
                    this.dev.copy(dst, src, bytes)?;
                }
            }
            Ok(())
        })
    }

    /// Copies block t of rank `root`'s `send` (`world × count` elements) into rank t's
    /// `recv` (`count`); ranks other than the root pass no `send` (0). The root's `recv`
    /// may be its own slice of `send`; any other overlap, a root outside the world or a
    /// root without `send` fails on every rank. After a failed call `recv` is undefined;
    /// `send` is never written.
    ///
    /// # Safety
    /// `recv` is `count` elements, and on the root `send` is `world × count` elements, of
    /// device memory on this rank's device, not used by anything else until the call
    /// returns.
    pub unsafe fn scatter(
        &mut self,
        ex: &mut dyn Exchange,
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        let bytes = count * dtype.size();
        let Some(metas) =
            self.begin_rooted(ex, IpcKind::Scatter, (send, recv), count, dtype, root)?
        else {
            return Ok(());
        };
        self.owners_work(ex, &metas, rank, |this, t| {
            let input = this.at(&metas, rank, root, send, |m| m.send, world * bytes)?;
            let src = input + (t * bytes) as u64;
            let dst = this.at(&metas, rank, t, recv, |m| m.recv, bytes)?;
            if src != dst {
                this.dev.copy(dst, src, bytes)?;
            }
            Ok(())
        })
    }

    /// The start every gather and scatter shares: the call's own refusal (a root outside
    /// the world, the root's whole buffer missing or overlapping its part other than as
    /// its own slice), its record (the root's whole buffer `world × count` elements, the
    /// others' none) and the exchange that checks it with every rank's; `None` when
    /// there is nothing to move.
    fn begin_rooted(
        &mut self,
        ex: &mut dyn Exchange,
        kind: IpcKind,
        (send, recv): (DevPtr, DevPtr),
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<Option<Vec<Meta>>, IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        let bytes = count * dtype.size();
        let whole = if rank == root { world * bytes } else { 0 };
        let gather = kind == IpcKind::Gather;
        let refused = if gather {
            rooted_refusal(
                ("gather", "to"),
                (rank, root, world, bytes),
                ("output", recv),
                ("input", send),
            )
        } else {
            rooted_refusal(
                ("scatter", "from"),
                (rank, root, world, bytes),
                ("input", send),
                ("output", recv),
            )
        };
        let call = Call {
            kind,
            dtype,
            op: ReduceOp::Sum,
            keep: false,
            root: root as u32,
            count: count as u64,
        };
        let (send_bytes, recv_bytes) = if gather {
            (bytes, whole)
        } else {
            (whole, bytes)
        };
        let metas = self.begin(ex, call, (send, send_bytes), (recv, recv_bytes), refused)?;
        Ok((bytes > 0).then_some(metas))
    }
}
