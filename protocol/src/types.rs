//! The vocabulary shared by every crate: element types, reduction operators, collective
//! kinds, algorithms and the descriptor that names one collective call.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
    I8 = 4,
    U8 = 5,
    I32 = 6,
    I64 = 7,
}

impl DType {
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 => 1,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The name nccl-tests prints in its `type` column.
    pub const fn nccl_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }

    /// Short Rust-style name (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    pub fn from_u8(v: u8) -> Option<DType> {
        DType::ALL.get(v as usize).copied()
    }

    /// Parses the names users type: `f32`, `float`, `float32`, `half`, `bfloat16`, ...
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => DType::F32,
            "f64" | "double" | "float64" => DType::F64,
            "f16" | "half" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i8" | "int8" | "char" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" => DType::I64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Prod = 1,
    Min = 2,
    Max = 3,
    /// Sum divided by the number of members; floating types only.
    Avg = 4,
    BAnd = 5,
    BOr = 6,
    BXor = 7,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    pub fn from_u8(v: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(v as usize).copied()
    }

    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    pub fn parse(s: &str) -> Option<ReduceOp> {
        Some(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            "band" | "and" => ReduceOp::BAnd,
            "bor" | "or" => ReduceOp::BOr,
            "bxor" | "xor" => ReduceOp::BXor,
            _ => return None,
        })
    }

    /// Whether this operator is defined for `dtype`: avg needs a floating type, the
    /// bitwise operators an integer type.
    pub const fn valid_for(self, dtype: DType) -> bool {
        match self {
            ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Min | ReduceOp::Max => true,
            ReduceOp::Avg => dtype.is_float(),
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !dtype.is_float(),
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which collective a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum CollectiveKind {
    Broadcast = 0,
    Reduce = 1,
    AllReduce = 2,
    Scatter = 3,
    Gather = 4,
    AllGather = 5,
    ReduceScatter = 6,
    AllToAll = 7,
    Barrier = 8,
    /// Tagged point-to-point transfer.
    SendRecv = 9,
}

impl CollectiveKind {
    pub const ALL: [CollectiveKind; 10] = [
        CollectiveKind::Broadcast,
        CollectiveKind::Reduce,
        CollectiveKind::AllReduce,
        CollectiveKind::Scatter,
        CollectiveKind::Gather,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Barrier,
        CollectiveKind::SendRecv,
    ];

    pub fn from_u8(v: u8) -> Option<CollectiveKind> {
        CollectiveKind::ALL.get(v as usize).copied()
    }

    pub const fn name(self) -> &'static str {
        match self {
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Reduce => "reduce",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Scatter => "scatter",
            CollectiveKind::Gather => "gather",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::SendRecv => "sendrecv",
        }
    }

    pub fn parse(s: &str) -> Option<CollectiveKind> {
        let s = s.to_ascii_lowercase().replace('-', "_");
        let s = s.trim_end_matches("_perf");
        CollectiveKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == s || k.name().replace('_', "") == s)
    }

    /// Whether the collective has a root rank.
    pub const fn is_rooted(self) -> bool {
        matches!(
            self,
            CollectiveKind::Broadcast
                | CollectiveKind::Reduce
                | CollectiveKind::Scatter
                | CollectiveKind::Gather
        )
    }

    /// Whether the collective reduces (and so takes a [`ReduceOp`]).
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            CollectiveKind::Reduce | CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
        )
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a collective moves its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Algo {
    /// Chunks travel around the ring; bandwidth-optimal for large messages.
    Ring = 0,
    /// One hop from every rank to every rank; fewest rounds for small messages and worlds.
    Direct = 1,
    /// Binomial tree (or dissemination for barrier): log-depth for small messages at
    /// larger worlds.
    Tree = 2,
}

impl Algo {
    pub const ALL: [Algo; 3] = [Algo::Ring, Algo::Direct, Algo::Tree];

    pub fn from_u8(v: u8) -> Option<Algo> {
        Algo::ALL.get(v as usize).copied()
    }

    pub const fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Direct => "direct",
            Algo::Tree => "tree",
        }
    }

    pub fn parse(s: &str) -> Option<Algo> {
        Algo::ALL
            .iter()
            .copied()
            .find(|a| a.name().eq_ignore_ascii_case(s.trim()))
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that must agree across ranks for one collective call. It travels in every
/// data frame so that ranks that called different collectives fail with `Mismatch`
/// instead of exchanging garbage.
///
/// `count` follows NCCL's convention: the element count of the buffer for broadcast,
/// reduce and all_reduce; the count each rank contributes (all_gather, gather) or
/// receives (reduce_scatter, scatter); the count of one block for all_to_all; the count
/// of the message for send/recv. For send/recv `root` carries the tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Descriptor {
    pub kind: CollectiveKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub algo: Algo,
    pub root: u32,
    pub count: u64,
}

impl Descriptor {
    pub const WIRE_LEN: usize = 16;

    pub fn encode(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0] = self.kind as u8;
        b[1] = self.dtype as u8;
        b[2] = self.op as u8;
        b[3] = self.algo as u8;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..16].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    /// Decodes a descriptor; `None` for an unknown kind, type, operator or algorithm.
    pub fn decode(b: &[u8; Self::WIRE_LEN]) -> Option<Descriptor> {
        Some(Descriptor {
            kind: CollectiveKind::from_u8(b[0])?,
            dtype: DType::from_u8(b[1])?,
            op: ReduceOp::from_u8(b[2])?,
            algo: Algo::from_u8(b[3])?,
            root: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            count: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        })
    }
}

impl fmt::Display for Descriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}(count={}, dtype={}, op={}, root={}, algo={})",
            self.kind, self.count, self.dtype, self.op, self.root, self.algo
        )
    }
}

/// Identity of a peer, assigned by the master's registry at registration. Never reused.
pub type PeerId = u64;

/// One member of a world.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub peer_id: PeerId,
    pub rank: u32,
    /// Address where the peer accepts links from other peers.
    pub addr: String,
    /// Host identity (peers on the same host sit next to each other in the ring).
    pub host: String,
}

/// The world of one epoch: who is in it, their ranks and the ring order. Every member
/// of an epoch receives the same `World`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct World {
    pub epoch: u64,
    /// Members sorted by rank; `members[r].rank == r`.
    pub members: Vec<Member>,
}

impl World {
    pub fn size(&self) -> usize {
        self.members.len()
    }

    pub fn rank_of(&self, peer: PeerId) -> Option<u32> {
        self.members
            .iter()
            .find(|m| m.peer_id == peer)
            .map(|m| m.rank)
    }

    pub fn peer_ids(&self) -> Vec<PeerId> {
        self.members.iter().map(|m| m.peer_id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trips_and_rejects_unknown_codes() {
        let d = Descriptor {
            kind: CollectiveKind::ReduceScatter,
            dtype: DType::BF16,
            op: ReduceOp::Max,
            algo: Algo::Tree,
            root: 7,
            count: u64::MAX - 3,
        };
        assert_eq!(Descriptor::decode(&d.encode()), Some(d));
        for i in 0..4 {
            let mut b = d.encode();
            b[i] = 200;
            assert_eq!(Descriptor::decode(&b), None);
        }
    }

    #[test]
    fn op_validity_follows_dtype_class() {
        assert!(ReduceOp::Avg.valid_for(DType::BF16));
        assert!(!ReduceOp::Avg.valid_for(DType::I32));
        assert!(ReduceOp::BXor.valid_for(DType::U8));
        assert!(!ReduceOp::BOr.valid_for(DType::F64));
        for d in DType::ALL {
            assert!(ReduceOp::Sum.valid_for(d) && ReduceOp::Max.valid_for(d));
            assert_eq!(DType::parse(d.name()), Some(d));
            assert_eq!(DType::parse(d.nccl_name()), Some(d));
        }
    }

    #[test]
    fn collective_names_parse_like_nccl_tests() {
        assert_eq!(
            CollectiveKind::parse("all_reduce"),
            Some(CollectiveKind::AllReduce)
        );
        assert_eq!(
            CollectiveKind::parse("all_reduce_perf"),
            Some(CollectiveKind::AllReduce)
        );
        assert_eq!(
            CollectiveKind::parse("allreduce"),
            Some(CollectiveKind::AllReduce)
        );
        assert_eq!(
            CollectiveKind::parse("alltoall"),
            Some(CollectiveKind::AllToAll)
        );
        assert_eq!(CollectiveKind::parse("nope"), None);
    }
}
