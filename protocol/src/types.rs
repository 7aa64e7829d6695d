//! The vocabulary shared by every crate: element types, reduction operators, collective
//! kinds, algorithms and the descriptor that names one collective call.

use serde::{Deserialize, Serialize};
use std::fmt;

/// What kind of number a [`DType`] holds; decides which operators are defined for it and
/// how a foreign buffer format (numpy's, Python's buffer protocol) maps onto it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NumClass {
    /// IEEE 754 binary floating point (`f16`, `f32`, `f64`).
    Float,
    /// bfloat16: a float with f32's exponent, no buffer-protocol format of its own.
    BFloat,
    Signed,
    Unsigned,
}

impl NumClass {
    pub const fn is_float(self) -> bool {
        matches!(self, NumClass::Float | NumClass::BFloat)
    }
}

/// Defines [`DType`] from one table. Each row: variant = wire code, bytes, class, short
/// name, nccl-tests' name, numpy's and torch's name, extra spellings users type. Adding
/// an element type is one row here, an [`Element`](../../eccl_algorithms) impl and its
/// kernel arm (the compiler points at both).
macro_rules! dtypes {
    ($($v:ident = $code:literal, $size:literal, $class:ident, $name:literal, $nccl:literal, $long:literal, [$($alias:literal),*];)*) => {
        /// Element type of a buffer.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[repr(u8)]
        pub enum DType {
            $($v = $code,)*
        }

        impl DType {
            pub const ALL: [DType; [$($code),*].len()] = [$(DType::$v),*];

            /// Bytes per element.
            pub const fn size(self) -> usize {
                match self { $(DType::$v => $size,)* }
            }

            pub const fn class(self) -> NumClass {
                match self { $(DType::$v => NumClass::$class,)* }
            }

            /// Short Rust-style name (`f32`, `bf16`, ...).
            pub const fn name(self) -> &'static str {
                match self { $(DType::$v => $name,)* }
            }

            /// The name nccl-tests prints in its `type` column.
            pub const fn nccl_name(self) -> &'static str {
                match self { $(DType::$v => $nccl,)* }
            }

            /// numpy's and torch's name (`float32`, `bfloat16`, ...).
            pub const fn long_name(self) -> &'static str {
                match self { $(DType::$v => $long,)* }
            }

            pub const fn from_u8(v: u8) -> Option<DType> {
                match v { $($code => Some(DType::$v),)* _ => None }
            }

            /// Parses every name of the table, case-insensitively: `f32`, `float`,
            /// `float32`, `half`, `bfloat16`, ...
            pub fn parse(s: &str) -> Option<DType> {
                let s = s.trim().to_ascii_lowercase();
                let s = s.strip_prefix("torch.").unwrap_or(&s);
                $(if s == $name || s == $nccl || s == $long $(|| s == $alias)* {
                    return Some(DType::$v);
                })*
                None
            }
        }
    };
}

dtypes! {
    F32 = 0, 4, Float, "f32", "float", "float32", [];
    F64 = 1, 8, Float, "f64", "double", "float64", [];
    F16 = 2, 2, Float, "f16", "half", "float16", [];
    BF16 = 3, 2, BFloat, "bf16", "bfloat16", "bfloat16", [];
    I8 = 4, 1, Signed, "i8", "int8", "int8", ["char"];
    U8 = 5, 1, Unsigned, "u8", "uint8", "uint8", [];
    I32 = 6, 4, Signed, "i32", "int32", "int32", ["int"];
    I64 = 7, 8, Signed, "i64", "int64", "int64", [];
}

impl DType {
    pub const fn is_float(self) -> bool {
        self.class().is_float()
    }

    /// The dtype with this class and size, if eccl has one (how a buffer-protocol format
    /// such as numpy's `'<f4'` or `'q'` is read).
    pub fn from_class(class: NumClass, size: usize) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.class() == class && d.size() == size)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which element types an operator is defined for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpDomain {
    All,
    Floats,
    Integers,
}

/// Defines [`ReduceOp`] from one table. Each row: variant = wire code, name, the name of
/// torch's `ReduceOp` member it implements, the element types it is defined for, extra
/// spellings. Adding an operator is one row here and its arm in the kernels.
macro_rules! reduce_ops {
    ($($(#[doc = $doc:literal])* $v:ident = $code:literal, $name:literal, $torch:literal, $domain:ident, [$($alias:literal),*];)*) => {
        /// Reduction operator.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[repr(u8)]
        pub enum ReduceOp {
            $($(#[doc = $doc])* $v = $code,)*
        }

        impl ReduceOp {
            pub const ALL: [ReduceOp; [$($code),*].len()] = [$(ReduceOp::$v),*];

            pub const fn name(self) -> &'static str {
                match self { $(ReduceOp::$v => $name,)* }
            }

            /// The member of `torch.distributed.ReduceOp` this operator implements.
            pub const fn torch_name(self) -> &'static str {
                match self { $(ReduceOp::$v => $torch,)* }
            }

            pub const fn domain(self) -> OpDomain {
                match self { $(ReduceOp::$v => OpDomain::$domain,)* }
            }

            pub const fn from_u8(v: u8) -> Option<ReduceOp> {
                match v { $($code => Some(ReduceOp::$v),)* _ => None }
            }

            /// Parses the name, torch's name or an alias, case-insensitively.
            pub fn parse(s: &str) -> Option<ReduceOp> {
                let s = s.trim().to_ascii_lowercase();
                let s = s.strip_prefix("reduceop.").unwrap_or(&s);
                $(if s == $name || s.eq_ignore_ascii_case($torch) $(|| s == $alias)* {
                    return Some(ReduceOp::$v);
                })*
                None
            }
        }
    };
}

reduce_ops! {
    Sum = 0, "sum", "SUM", All, ["add"];
    Prod = 1, "prod", "PRODUCT", All, ["product", "mul"];
    Min = 2, "min", "MIN", All, [];
    Max = 3, "max", "MAX", All, [];
    /// Sum divided by the number of members; floating types only.
    Avg = 4, "avg", "AVG", Floats, ["mean"];
    BAnd = 5, "band", "BAND", Integers, ["and"];
    BOr = 6, "bor", "BOR", Integers, ["or"];
    BXor = 7, "bxor", "BXOR", Integers, ["xor"];
}

impl DType {
    /// The element type of a Python buffer (PEP 3118) with struct format `format` and
    /// items of `itemsize` bytes, in native byte order; `None` where eccl has none (a
    /// bool, a complex number, a struct of several fields).
    pub fn from_buffer_format(format: &str, itemsize: usize) -> Option<DType> {
        let f = if cfg!(target_endian = "little") {
            format.trim_start_matches(['@', '=', '<'])
        } else {
            format.trim_start_matches(['@', '=', '>', '!'])
        };
        let class = match f {
            "e" | "f" | "d" => NumClass::Float,
            "b" | "h" | "i" | "l" | "q" | "n" => NumClass::Signed,
            "B" | "H" | "I" | "L" | "Q" | "N" => NumClass::Unsigned,
            _ => return None,
        };
        DType::from_class(class, itemsize)
    }
}

impl ReduceOp {
    /// Whether this operator is defined for `dtype`: avg needs a floating type, the
    /// bitwise operators an integer type.
    pub const fn valid_for(self, dtype: DType) -> bool {
        match self.domain() {
            OpDomain::All => true,
            OpDomain::Floats => dtype.is_float(),
            OpDomain::Integers => !dtype.is_float(),
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Defines [`CollectiveKind`] from one table. Each row: variant = wire code, name, whether
/// it has a root, whether it reduces.
macro_rules! collective_kinds {
    ($($(#[doc = $doc:literal])* $v:ident = $code:literal, $name:literal, rooted: $rooted:literal, reduces: $reduces:literal;)*) => {
        /// Which collective a frame belongs to.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[repr(u8)]
        pub enum CollectiveKind {
            $($(#[doc = $doc])* $v = $code,)*
        }

        impl CollectiveKind {
            pub const ALL: [CollectiveKind; [$($code),*].len()] = [$(CollectiveKind::$v),*];

            pub const fn name(self) -> &'static str {
                match self { $(CollectiveKind::$v => $name,)* }
            }

            /// Whether the collective has a root rank.
            pub const fn is_rooted(self) -> bool {
                match self { $(CollectiveKind::$v => $rooted,)* }
            }

            /// Whether the collective reduces (and so takes a [`ReduceOp`]).
            pub const fn reduces(self) -> bool {
                match self { $(CollectiveKind::$v => $reduces,)* }
            }

            pub const fn from_u8(v: u8) -> Option<CollectiveKind> {
                match v { $($code => Some(CollectiveKind::$v),)* _ => None }
            }
        }
    };
}

collective_kinds! {
    Broadcast = 0, "broadcast", rooted: true, reduces: false;
    Reduce = 1, "reduce", rooted: true, reduces: true;
    AllReduce = 2, "all_reduce", rooted: false, reduces: true;
    Scatter = 3, "scatter", rooted: true, reduces: false;
    Gather = 4, "gather", rooted: true, reduces: false;
    AllGather = 5, "all_gather", rooted: false, reduces: false;
    ReduceScatter = 6, "reduce_scatter", rooted: false, reduces: true;
    AllToAll = 7, "all_to_all", rooted: false, reduces: false;
    Barrier = 8, "barrier", rooted: false, reduces: false;
    /// Tagged point-to-point transfer.
    SendRecv = 9, "sendrecv", rooted: false, reduces: false;
}

impl CollectiveKind {
    /// Parses nccl-tests' spellings: `all_reduce`, `allreduce`, `all_reduce_perf`, ...
    pub fn parse(s: &str) -> Option<CollectiveKind> {
        let s = s.to_ascii_lowercase().replace('-', "_");
        let s = s.trim_end_matches("_perf");
        CollectiveKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == s || k.name().replace('_', "") == s)
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
/// of the message for send/recv (whose tag travels in the frame header).
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

/// Identity of a peer, assigned by the master's registry at registration. Never reused,
/// and not a rank: a peer keeps its id across epochs while its rank may change.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct PeerId(pub u64);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A member's position in the world of one epoch, `0..world_size`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Rank(pub u32);

impl Rank {
    /// The rank as an index into per-rank tables.
    pub const fn idx(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One member of a world.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub peer_id: PeerId,
    pub rank: Rank,
    /// Address where the peer accepts TCP (and TLS) links from other peers.
    pub addr: String,
    /// Host identity: peers with the same one can share memory (and sit next to each
    /// other in the ring).
    pub host: String,
    /// The peer's QUIC endpoint, if it has one.
    pub quic: Option<String>,
    /// The peer's abstract unix socket for shm links, if it has one.
    pub shm: Option<String>,
}

/// The world of one epoch: who is in it, their ranks and the ring order. Every member
/// of an epoch receives the same `World`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct World {
    pub epoch: u64,
    /// Members sorted by rank; `members[r].rank == r`.
    pub members: Vec<Member>,
    /// The ring order the master solved from measured links (`optimize_topology()`):
    /// the ranks around the ring, each sending to the next. Empty: rank order.
    pub ring: Vec<u32>,
    /// Links striped over more than one connection, solved from measured links
    /// (`optimize_topology()`): `(smaller peer id, larger, connections)`, sorted; a pair
    /// not named has one. Both ends of a link read the same count here.
    pub stripes: Vec<(PeerId, PeerId, u16)>,
    /// The algorithm each collective takes at each size in this world, chosen by the
    /// master from the measured links (it plays every algorithm's schedule on them):
    /// for each kind, entries by growing [`Tuned::up_to`]; a kind not named, or a world
    /// without them, takes the tuner's defaults. Empty without a solved ring.
    pub tuned: Vec<Tuned>,
}

/// One entry of [`World::tuned`]: calls of `kind` moving at most `up_to` bytes (the
/// tuner's count convention: `count * dtype size`), and more than the kind's entry
/// before, take `algo`; the kind's last entry also takes every larger call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuned {
    pub kind: CollectiveKind,
    pub up_to: u64,
    pub algo: Algo,
}

/// Most entries of [`World::tuned`] (a kind has at most one per size the master models).
pub const MAX_TUNED: usize = 128;

/// How much slower than the solved ring's slowest link a link must be for collectives
/// to keep to the ring in a world too large for the master to model every algorithm
/// (every kind with a ring algorithm takes it at every size).
pub const KEEP_TO_RING: f64 = 4.0;

/// Most connections the master stripes one link over.
pub const MAX_STRIPES: u16 = 16;

/// What one member measured of its link to another (`optimize_topology()`): bytes per
/// second one way, the one-way latency, and the connections it asks the link to have
/// (more than it has when its connections spent most of the probe waiting for the TCP
/// window, not the path; 0: no opinion, a transport without connections to count).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkMeasure {
    pub to: PeerId,
    pub bytes_per_s: u64,
    pub latency_ns: u64,
    pub streams: u16,
}

impl World {
    pub fn size(&self) -> usize {
        self.members.len()
    }

    pub fn rank_of(&self, peer: PeerId) -> Option<Rank> {
        self.members
            .iter()
            .find(|m| m.peer_id == peer)
            .map(|m| m.rank)
    }

    pub fn member(&self, rank: Rank) -> Option<&Member> {
        self.members.get(rank.idx())
    }

    /// Checks what a peer relies on before indexing by rank: at most
    /// [`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE) members, `members[r].rank == r`, no
    /// peer twice. A world from the network is used only after this.
    pub fn validate(&self) -> Result<(), String> {
        if self.members.len() > crate::MAX_WORLD_SIZE {
            return Err(format!(
                "{} members (at most {})",
                self.members.len(),
                crate::MAX_WORLD_SIZE
            ));
        }
        if !self.ring.is_empty() {
            let n = self.members.len();
            let mut placed = vec![false; n];
            let ok = self.ring.len() == n
                && self.ring.iter().all(|&r| {
                    (r as usize) < n && !std::mem::replace(&mut placed[r as usize], true)
                });
            if !ok {
                return Err(format!(
                    "the ring {:?} is not an order of the {n} ranks",
                    &self.ring[..self.ring.len().min(16)]
                ));
            }
        } else if !self.tuned.is_empty() {
            return Err("algorithms tuned without a solved ring".into());
        }
        if self.tuned.len() > MAX_TUNED {
            return Err(format!(
                "{} tuned algorithms (at most {MAX_TUNED})",
                self.tuned.len()
            ));
        }
        let mut last: Vec<(CollectiveKind, u64)> = Vec::new();
        for t in &self.tuned {
            match last.iter_mut().find(|(k, _)| *k == t.kind) {
                Some((_, up_to)) if *up_to >= t.up_to => {
                    return Err(format!(
                        "tuned algorithms for {} are not by growing size",
                        t.kind
                    ));
                }
                Some((_, up_to)) => *up_to = t.up_to,
                None => last.push((t.kind, t.up_to)),
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, m) in self.members.iter().enumerate() {
            if m.rank.idx() != i {
                return Err(format!("member {i} says it is rank {}", m.rank));
            }
            if !seen.insert(m.peer_id) {
                return Err(format!("peer {} appears twice", m.peer_id));
            }
        }
        for w in self.stripes.windows(2) {
            if (w[0].0, w[0].1) >= (w[1].0, w[1].1) {
                return Err("stripes are not sorted by pair".into());
            }
        }
        for &(a, b, n) in &self.stripes {
            if a >= b || !seen.contains(&a) || !seen.contains(&b) || !(2..=MAX_STRIPES).contains(&n)
            {
                return Err(format!("stripes ({a}, {b}, {n}): not a pair of members with 2 to {MAX_STRIPES} connections"));
            }
        }
        Ok(())
    }

    /// The algorithm [`World::tuned`] names for a call of `kind` moving `bytes`; `None`
    /// where it names none for the kind.
    pub fn tuned_algo(&self, kind: CollectiveKind, bytes: u64) -> Option<Tuned> {
        let mut of_kind = self.tuned.iter().filter(|t| t.kind == kind);
        let mut last = None;
        for t in of_kind.by_ref() {
            if bytes <= t.up_to {
                return Some(*t);
            }
            last = Some(*t);
        }
        last
    }

    /// Connections the master striped the link between `a` and `b` over; `None`: not
    /// striped.
    pub fn stripes_between(&self, a: PeerId, b: PeerId) -> Option<u16> {
        let key = (a.min(b), a.max(b));
        self.stripes
            .binary_search_by(|&(x, y, _)| (x, y).cmp(&key))
            .ok()
            .map(|i| self.stripes[i].2)
    }

    pub fn peer_ids(&self) -> Vec<PeerId> {
        self.members.iter().map(|m| m.peer_id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_name_sorted_pairs_of_members_with_two_to_the_cap_connections() {
        let member = |r: u32| Member {
            peer_id: PeerId(10 + r as u64),
            rank: Rank(r),
            addr: String::new(),
            host: String::new(),
            quic: None,
            shm: None,
        };
        let world = |stripes| World {
            epoch: 1,
            members: (0..3).map(member).collect(),
            ring: vec![],
            stripes,
            tuned: vec![],
        };
        let (a, b, c) = (PeerId(10), PeerId(11), PeerId(12));
        let w = world(vec![(a, b, 4), (a, c, 2)]);
        assert_eq!(w.validate(), Ok(()));
        // Tuned algorithms need a ring, and come by growing size within a kind.
        let tuned = |kind, up_to, algo| Tuned { kind, up_to, algo };
        let mut k = world(vec![]);
        k.tuned = vec![
            tuned(CollectiveKind::AllReduce, 1024, Algo::Direct),
            tuned(CollectiveKind::AllReduce, 65536, Algo::Tree),
            tuned(CollectiveKind::Broadcast, 16, Algo::Ring),
        ];
        assert!(k.validate().is_err());
        k.ring = vec![2, 0, 1];
        assert_eq!(k.validate(), Ok(()));
        let algo = |kind, bytes| k.tuned_algo(kind, bytes).map(|t| t.algo);
        assert_eq!(algo(CollectiveKind::AllReduce, 0), Some(Algo::Direct));
        assert_eq!(algo(CollectiveKind::AllReduce, 1024), Some(Algo::Direct));
        assert_eq!(algo(CollectiveKind::AllReduce, 1025), Some(Algo::Tree));
        assert_eq!(algo(CollectiveKind::AllReduce, 1 << 40), Some(Algo::Tree));
        assert_eq!(algo(CollectiveKind::Broadcast, 1 << 20), Some(Algo::Ring));
        assert_eq!(algo(CollectiveKind::AllGather, 8), None);
        k.tuned.swap(0, 1);
        assert!(k.validate().is_err());
        // Not only neighbours: a kind's entries grow wherever they are.
        k.tuned.swap(0, 1);
        k.tuned
            .push(tuned(CollectiveKind::AllReduce, 512, Algo::Ring));
        assert!(k.validate().is_err());
        assert_eq!(w.stripes_between(c, a), Some(2));
        assert_eq!(w.stripes_between(b, c), None);
        for bad in [
            vec![(a, c, 2), (a, b, 4)],
            vec![(b, a, 4)],
            vec![(a, PeerId(99), 4)],
            vec![(a, b, 1)],
            vec![(a, b, MAX_STRIPES + 1)],
        ] {
            assert!(world(bad.clone()).validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn buffer_formats_map_through_the_dtype_table() {
        assert_eq!(DType::from_buffer_format("f", 4), Some(DType::F32));
        assert_eq!(DType::from_buffer_format("<d", 8), Some(DType::F64));
        assert_eq!(DType::from_buffer_format("e", 2), Some(DType::F16));
        assert_eq!(DType::from_buffer_format("l", 8), Some(DType::I64));
        assert_eq!(DType::from_buffer_format("q", 8), Some(DType::I64));
        assert_eq!(DType::from_buffer_format("B", 1), Some(DType::U8));
        assert_eq!(DType::from_buffer_format("b", 1), Some(DType::I8));
        assert_eq!(DType::from_buffer_format("H", 2), None);
        assert_eq!(DType::from_buffer_format("?", 1), None);
        assert_eq!(DType::from_buffer_format("Zf", 8), None);
    }

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
    fn every_table_is_one_list_with_unique_codes_and_names() {
        for v in 0..=u8::MAX {
            if let Some(d) = DType::from_u8(v) {
                assert_eq!(d as u8, v);
                assert!(DType::ALL.contains(&d));
            }
            if let Some(o) = ReduceOp::from_u8(v) {
                assert_eq!(o as u8, v);
                assert!(ReduceOp::ALL.contains(&o));
            }
            if let Some(k) = CollectiveKind::from_u8(v) {
                assert_eq!(k as u8, v);
                assert!(CollectiveKind::ALL.contains(&k));
            }
        }
        for d in DType::ALL {
            for n in [d.name(), d.nccl_name(), d.long_name()] {
                assert_eq!(DType::parse(n), Some(d), "{n}");
            }
            assert_eq!(DType::from_class(d.class(), d.size()), Some(d));
        }
        assert_eq!(DType::parse("torch.bfloat16"), Some(DType::BF16));
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::parse(o.name()), Some(o));
            assert_eq!(ReduceOp::parse(o.torch_name()), Some(o));
        }
        assert_eq!(ReduceOp::parse("ReduceOp.PRODUCT"), Some(ReduceOp::Prod));
        for k in CollectiveKind::ALL {
            assert_eq!(CollectiveKind::parse(k.name()), Some(k));
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
