//! The fixed 64-byte header in front of every frame on a peer-to-peer link.
//!
//! Data frames are the hot path, so the header is a fixed little-endian layout rather
//! than a serde encoding: it is written with one vectored write together with the
//! payload, and read with one `read_exact`.
//!
//! ```text
//!  0  magic   u32  "ECF1"
//!  4  kind    u8   FrameKind
//!  5  flags   u8   (0)
//!  6  _pad    u16
//!  8  epoch   u64  epoch of the collective
//! 16  seq     u64  collective number in the epoch (send/recv: per-pair number)
//! 24  index   u32  data: the message's index on the link within the call; abort: the
//!                  cause code; shared-state sync: the tensor
//! 28  len     u32  payload bytes following this header
//! 32  desc    16B  descriptor of the collective
//! 48  offset  u64  byte offset of the payload inside the message's region
//! 56  tag     u32  point-to-point tag (0 for everything else)
//! 60  _pad    u32
//! ```

use crate::types::Descriptor;
use crate::MAX_FRAME_PAYLOAD;

pub const FRAME_HEADER_LEN: usize = 64;
const MAGIC: u32 = u32::from_le_bytes(*b"ECF1");

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Part of a collective's schedule step.
    Data = 1,
    /// A tagged point-to-point message.
    P2p = 2,
    /// The sender aborts collective `seq` of `epoch`; `index` holds an [`AbortCause`]
    /// code and the payload a short UTF-8 reason.
    Abort = 3,
    /// The descriptor check that precedes rooted collectives (no payload).
    Check = 4,
    /// The sender closes the link on purpose.
    Close = 5,
    /// Shared-state sync: a receiver asks for chunk `offset` of tensor `index`; `seq` is
    /// the sync round. No payload.
    StateReq = 6,
    /// Shared-state sync: a source answers a `StateReq` with the chunk's bytes.
    StateData = 7,
    /// Shared-state sync: the receiver needs nothing more from this source.
    StateDone = 8,
}

/// Why a peer aborted a collective, as carried by an `Abort` frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum AbortCause {
    /// Ranks called different collectives (the descriptor in the frame is the sender's).
    Mismatch = 1,
    /// The sender timed out waiting for progress.
    Timeout = 2,
    /// A link of the sender failed.
    LinkFailure = 3,
    /// The master aborted the epoch.
    EpochAborted = 4,
    /// The sender's caller gave an argument the collective refuses.
    InvalidArgument = 5,
    /// The sender revoked the epoch (`revoke()`): its calls fail, and nobody forms the
    /// next world on its own.
    Revoked = 6,
}

impl AbortCause {
    pub fn from_u32(v: u32) -> Option<AbortCause> {
        Some(match v {
            1 => AbortCause::Mismatch,
            2 => AbortCause::Timeout,
            3 => AbortCause::LinkFailure,
            4 => AbortCause::EpochAborted,
            5 => AbortCause::InvalidArgument,
            6 => AbortCause::Revoked,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub epoch: u64,
    pub seq: u64,
    /// Data frames: the message's index on this link within the call (the k-th message
    /// a rank sends a peer is the k-th that peer receives from it; not the schedule's
    /// step, which may hold messages on several links). Abort: an [`AbortCause`] code.
    /// Shared-state sync: the tensor.
    pub index: u32,
    pub len: u32,
    pub desc: Descriptor,
    pub offset: u64,
    /// The tag of a point-to-point message: a receive takes only messages with its tag.
    pub tag: u32,
}

/// Why a header was refused. Any of these closes the link: after a bad header the
/// position in the byte stream can no longer be trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("bad frame magic {0:#010x} (not an eccl link, or the stream lost its place)")]
    BadMagic(u32),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame descriptor has an unknown collective, dtype, op or algorithm")]
    BadDescriptor,
    #[error("frame payload of {0} bytes exceeds the limit of {MAX_FRAME_PAYLOAD} bytes")]
    TooLarge(u32),
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.epoch.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..28].copy_from_slice(&self.index.to_le_bytes());
        b[28..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..48].copy_from_slice(&self.desc.encode());
        b[48..56].copy_from_slice(&self.offset.to_le_bytes());
        b[56..60].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; FRAME_HEADER_LEN]) -> Result<FrameHeader, HeaderError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(HeaderError::BadMagic(magic));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::P2p,
            3 => FrameKind::Abort,
            4 => FrameKind::Check,
            5 => FrameKind::Close,
            6 => FrameKind::StateReq,
            7 => FrameKind::StateData,
            8 => FrameKind::StateDone,
            k => return Err(HeaderError::UnknownKind(k)),
        };
        let len = u32_at(28);
        if len as usize > MAX_FRAME_PAYLOAD {
            return Err(HeaderError::TooLarge(len));
        }
        let mut d = [0u8; Descriptor::WIRE_LEN];
        d.copy_from_slice(&b[32..48]);
        let desc = Descriptor::decode(&d).ok_or(HeaderError::BadDescriptor)?;
        Ok(FrameHeader {
            kind,
            epoch: u64_at(8),
            seq: u64_at(16),
            index: u32_at(24),
            len,
            desc,
            offset: u64_at(48),
            tag: u32_at(56),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::*;

    fn sample() -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            epoch: 3,
            seq: 99,
            index: 4,
            len: 4096,
            desc: Descriptor {
                kind: CollectiveKind::AllReduce,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                algo: Algo::Ring,
                root: 0,
                count: 1 << 20,
            },
            offset: 1 << 33,
            tag: 17,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = sample();
        assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn garbage_never_panics_and_is_refused() {
        // A cheap deterministic fuzz: every single-byte corruption of a valid header and
        // a stream of pseudo-random headers decode to Ok or Err, never a panic.
        let good = sample().encode();
        for i in 0..FRAME_HEADER_LEN {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut b = good;
                b[i] = v;
                let _ = FrameHeader::decode(&b);
            }
        }
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..10_000 {
            let mut b = [0u8; FRAME_HEADER_LEN];
            for byte in b.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *byte = x as u8;
            }
            assert!(
                FrameHeader::decode(&b).is_err(),
                "random bytes must not pass the magic"
            );
        }
        let mut b = good;
        b[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            FrameHeader::decode(&b),
            Err(HeaderError::TooLarge(u32::MAX))
        );
    }
}
