//! What the ranks of a same-host collective exchange: each rank's fixed-size record (the
//! call, its buffers' IPC handles, its GPU and the GPUs it reaches), the status that ends
//! a call, and an all_to_all's counts; how each is written and read.

use eccl_protocol::{DType, ReduceOp};

use super::IpcError;
use crate::device::{IpcMem, Reach, GPU_ID_BYTES, IPC_HANDLE_BYTES, MAX_REACH};

pub(super) const MAGIC: &[u8; 4] = b"ECIP";
pub(super) const VERSION: u8 = 6;
/// Bytes of one rank's record.
pub(super) const META_BYTES: usize = 4 + 1 + 5 + 4 + 8 + 2 * MEM_BYTES + GPU_ID_BYTES + REACH_BYTES;
/// A [`Reach`]: every GPU or not (1), how many ids (1), the ids.
pub(super) const REACH_BYTES: usize = 2 + MAX_REACH * GPU_ID_BYTES;
pub(super) const MEM_BYTES: usize = IPC_HANDLE_BYTES + 8 + 8;
/// Bytes of one rank's status: ok flag, an owner's scratch chunk (keep), a message.
pub(super) const STATUS_BYTES: usize = 1 + MEM_BYTES + STATUS_MSG_BYTES;
pub(super) const STATUS_MSG_BYTES: usize = 240;

/// The collectives of this module, as their records name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpcKind {
    AllReduce = 0,
    AllGather = 1,
    ReduceScatter = 2,
    Broadcast = 3,
    AllToAll = 4,
    Gather = 5,
    Scatter = 6,
}

impl IpcKind {
    pub(super) fn from_u8(b: u8) -> Option<IpcKind> {
        [
            IpcKind::AllReduce,
            IpcKind::AllGather,
            IpcKind::ReduceScatter,
            IpcKind::Broadcast,
            IpcKind::AllToAll,
            IpcKind::Gather,
            IpcKind::Scatter,
        ]
        .into_iter()
        .find(|k| *k as u8 == b)
    }
}

/// What every rank must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Call {
    pub(super) kind: IpcKind,
    pub(super) dtype: DType,
    pub(super) op: ReduceOp,
    pub(super) keep: bool,
    pub(super) root: u32,
    pub(super) count: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Meta {
    pub(super) call: Call,
    /// This rank refused its own arguments (buffers that overlap other than in NCCL's
    /// in-place form): every rank fails the call, none touches anything.
    pub(super) refused: bool,
    /// This rank's device failed before the call (its synchronize, its id or its
    /// reach): every rank fails the call, none touches anything.
    pub(super) failed: bool,
    /// This rank keeps this call off CUDA IPC (`ECCL_CUDA_IPC=0`, a world across hosts,
    /// more ranks than a kernel reads, or a buffer CUDA IPC cannot export): every rank
    /// then takes the host-memory path.
    pub(super) host_only: bool,
    /// The buffer the call reads (all_reduce and broadcast: their one buffer).
    pub(super) send: IpcMem,
    /// The buffer it writes, where that is another one (all_gather, reduce_scatter).
    pub(super) recv: IpcMem,
    /// The physical GPU the rank runs on ([`Device::gpu_id`]).
    pub(super) gpu: [u8; GPU_ID_BYTES],
    /// The GPUs whose memory its kernels reach ([`Device::reach`]).
    pub(super) reach: Reach,
}

pub(super) fn put_mem(out: &mut Vec<u8>, m: &IpcMem) {
    out.extend_from_slice(&m.handle);
    out.extend_from_slice(&m.offset.to_le_bytes());
    out.extend_from_slice(&m.alloc_len.to_le_bytes());
}

pub(super) fn get_mem(b: &[u8]) -> IpcMem {
    let mut handle = [0u8; IPC_HANDLE_BYTES];
    handle.copy_from_slice(&b[..IPC_HANDLE_BYTES]);
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    IpcMem {
        handle,
        offset: u(IPC_HANDLE_BYTES),
        alloc_len: u(IPC_HANDLE_BYTES + 8),
    }
}

pub(super) const NO_MEM: IpcMem = IpcMem {
    handle: [0; IPC_HANDLE_BYTES],
    offset: 0,
    alloc_len: 0,
};

impl Meta {
    pub(super) fn encode(&self) -> Vec<u8> {
        let c = &self.call;
        let mut out = Vec::with_capacity(META_BYTES);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&[
            c.kind as u8,
            c.dtype as u8,
            c.op as u8,
            c.keep as u8,
            self.refused as u8 | (self.host_only as u8) << 1 | (self.failed as u8) << 2,
        ]);
        out.extend_from_slice(&c.root.to_le_bytes());
        out.extend_from_slice(&c.count.to_le_bytes());
        put_mem(&mut out, &self.send);
        put_mem(&mut out, &self.recv);
        out.extend_from_slice(&self.gpu);
        let mut reach = [0u8; REACH_BYTES];
        match &self.reach {
            Reach::Every => reach[0] = 1,
            Reach::Only(ids) => {
                let ids = &ids[..ids.len().min(MAX_REACH)];
                reach[1] = ids.len() as u8;
                for (slot, id) in reach[2..].chunks_mut(GPU_ID_BYTES).zip(ids) {
                    slot.copy_from_slice(id);
                }
            }
        }
        out.extend_from_slice(&reach);
        out
    }

    pub(super) fn decode(b: &[u8]) -> Result<Meta, String> {
        if b.len() != META_BYTES || &b[..4] != MAGIC {
            return Err("not an eccl IPC record".into());
        }
        if b[4] != VERSION {
            return Err(format!("IPC record version {} (this is {VERSION})", b[4]));
        }
        let kind = IpcKind::from_u8(b[5]).ok_or("an unknown collective")?;
        let dtype = DType::from_u8(b[6]).ok_or("an unknown dtype")?;
        let op = ReduceOp::from_u8(b[7]).ok_or("an unknown op")?;
        let m = 22;
        Ok(Meta {
            call: Call {
                kind,
                dtype,
                op,
                keep: b[8] != 0,
                root: u32::from_le_bytes(b[10..14].try_into().expect("4 bytes")),
                count: u64::from_le_bytes(b[14..22].try_into().expect("8 bytes")),
            },
            refused: b[9] & 1 != 0,
            host_only: b[9] & 2 != 0,
            failed: b[9] & 4 != 0,
            send: get_mem(&b[m..m + MEM_BYTES]),
            recv: get_mem(&b[m + MEM_BYTES..m + 2 * MEM_BYTES]),
            gpu: b[m + 2 * MEM_BYTES..m + 2 * MEM_BYTES + GPU_ID_BYTES]
                .try_into()
                .expect("GPU_ID_BYTES"),
            reach: {
                let r = &b[m + 2 * MEM_BYTES + GPU_ID_BYTES..];
                match (r[0], r[1] as usize) {
                    (1, _) => Reach::Every,
                    (0, n) if n <= MAX_REACH => Reach::Only(
                        r[2..2 + n * GPU_ID_BYTES]
                            .chunks(GPU_ID_BYTES)
                            .map(|c| c.try_into().expect("GPU_ID_BYTES"))
                            .collect(),
                    ),
                    _ => return Err("a malformed list of reachable GPUs".into()),
                }
            },
        })
    }
}

/// Every rank's all_to_all counts as one exchange record: what it sends to each rank,
/// then what it expects from each (u64 each).
pub fn counts_record(send_counts: &[usize], recv_counts: &[usize]) -> Vec<u8> {
    send_counts
        .iter()
        .chain(recv_counts)
        .flat_map(|c| (*c as u64).to_le_bytes())
        .collect()
}

/// From every rank's [`counts_record`], what rank s sends rank t (`[s][t]`), once every
/// rank expects what it is sent; otherwise the same `Mismatch` on every rank, naming the
/// first pair that disagrees.
pub fn count_table(records: &[Vec<u8>]) -> Result<Vec<Vec<usize>>, IpcError> {
    let world = records.len();
    let at = |r: usize, i: usize| {
        u64::from_le_bytes(records[r][i * 8..i * 8 + 8].try_into().expect("8 bytes")) as usize
    };
    for s in 0..world {
        for t in 0..world {
            let (sent, expected) = (at(s, t), at(t, world + s));
            if sent != expected {
                return Err(IpcError::Mismatch(format!(
                    "all_to_all: rank {s} sends {sent} elements to rank {t}, which expects \
                     {expected} from it"
                )));
            }
        }
    }
    Ok((0..world)
        .map(|s| (0..world).map(|t| at(s, t)).collect())
        .collect())
}
