//! Authenticated connections between eccl processes.
//!
//! | module | job |
//! |---|---|
//! | [`handshake`] | the HMAC challenge-response every connection runs first |
//! | [`tls`] | TLS 1.3 and the binding of the job secret to a TLS or QUIC session |
//! | [`control`] | length-prefixed control messages (peer <-> master, master <-> master) |
//! | [`link`] | a data link to one peer, as the executor sees it, over any transport |
//! | [`mesh`] | finished links to peers over any transport: dial one, or assemble what was accepted |
//! | [`connect`], [`listen`] | dialing and accepting data connections over TCP, TLS, shm and QUIC |
//! | [`shm`] | the shared-memory transport (rings in a sealed memfd) |
//! | [`quic`] | QUIC endpoints and links (quinn) |
//! | [`pool`] | receive buffers |
//! | [`admission`] | how many connections may be authenticating at once |
//!
//! A link is split into a sending half ([`LinkTx`]) that the caller drives directly and a
//! receiving half ([`LinkRx`]); an `Abort` frame or a dead peer is noticed even while the
//! caller waits on another link (stream links have reader tasks, shm links a watcher on
//! their unix socket).

pub mod admission;
pub mod connect;
pub mod control;
pub mod error;
pub mod handshake;
pub mod limits;
pub mod link;
pub mod listen;
pub mod logging;
pub mod mesh;
pub mod pool;
pub mod quic;
pub mod shm;
pub mod spin;
pub mod tls;
pub mod verbs;

pub use error::TransportError;
pub use link::{Incoming, LinkEvent, LinkRx, LinkTx, Payload, Transport};
