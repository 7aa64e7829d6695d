//! Wire types of eccl: what peers and masters say to each other, the header of every
//! data frame, the authentication handshake and the size limits.
//!
//! This crate knows nothing of sockets or tokio. Every decoder takes bytes that came
//! from the network and returns a typed error for anything it does not like; none of
//! them panics, whatever the input.

#[cfg(feature = "wire")]
pub mod auth;
#[cfg(feature = "wire")]
pub mod codec;
#[cfg(feature = "wire")]
pub mod frame;
#[cfg(feature = "wire")]
pub mod link_keys;
#[cfg(feature = "wire")]
pub mod msg;
#[cfg(feature = "wire")]
pub mod seal;
#[cfg(feature = "wire")]
pub mod shared_world;
#[cfg(feature = "wire")]
pub mod store;
pub mod types;

#[cfg(feature = "wire")]
pub use frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
#[cfg(feature = "wire")]
pub use msg::*;
#[cfg(feature = "wire")]
pub use store::{StoreLimits, StoreReply, StoreRequest, StoreWrite};
pub use types::*;

/// Size of the chunks that shared state is hashed and moved in.
pub const STATE_CHUNK: usize = 1 << 20;

/// Version of the wire protocol. Peers and masters with a different version refuse each
/// other during the handshake instead of misreading each other's bytes.
/// 2: typed point-to-point tags in the frame header.
/// 3: a member's link proofs as one byte string; the world in a master's answer as one
/// byte string holding its encoding.
/// 4: the world names the algorithms the master chose from measured links
/// (`World::tuned`) where it said only whether to keep to the ring.
pub const PROTOCOL_VERSION: u16 = 4;

/// Largest payload of one data frame. A header announcing more closes the link.
pub const MAX_FRAME_PAYLOAD: usize = 64 << 20;

/// Largest control message (peer <-> master, master <-> master). The largest real ones
/// are a shared-state report (32 bytes per MiB of state: 3 MiB for 100 GiB) and a world
/// of thousands of members; receivers read bodies as the bytes arrive, so an announced
/// length costs nothing until it is sent.
pub const MAX_CONTROL_MSG: usize = 16 << 20;

/// Largest world eccl accepts. Ranks are u32 on the wire; this bounds memory a hostile
/// message can make us allocate.
pub const MAX_WORLD_SIZE: usize = 4096;
