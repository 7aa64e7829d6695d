//! Authenticated connections between eccl processes.
//!
//! - [`handshake`]: the HMAC challenge-response every connection runs first.
//! - [`control`]: length-prefixed control messages (peer <-> master, master <-> master).
//! - [`link`]: data links between two peers; [`tcp`] is the default backend.
//!
//! A link is split into a sending half ([`LinkTx`]) that the caller drives directly, and
//! a receiving half whose reader task always reads the socket, so that an `Abort` frame
//! or a closed socket is noticed even while the caller waits on another link.

pub mod control;
pub mod error;
pub mod handshake;
pub mod link;
pub mod logging;
pub mod pool;
pub mod tcp;

pub use error::TransportError;
pub use link::{Incoming, LinkEvent, LinkRx, LinkTx};
