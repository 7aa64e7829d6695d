use eccl_protocol::auth::AuthError;
use eccl_protocol::codec::CodecError;
use eccl_protocol::frame::HeaderError;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("i/o error talking to {peer}: {source}")]
    Io {
        peer: String,
        #[source]
        source: std::io::Error,
    },
    #[error("authentication with {peer} failed: {source}")]
    Auth {
        peer: String,
        #[source]
        source: AuthError,
    },
    #[error("connection to {0} timed out")]
    Timeout(String),
    #[error("bad control message from {peer}: {source}")]
    Codec {
        peer: String,
        #[source]
        source: CodecError,
    },
    #[error("bad frame header from {peer}: {source}")]
    Header {
        peer: String,
        #[source]
        source: HeaderError,
    },
    #[error("{peer} closed the connection")]
    Closed { peer: String },
    #[error("link to {peer} is unusable: a previous send was interrupted mid-frame")]
    Poisoned { peer: String },
    #[error("bad link hello from {peer}: {reason}")]
    BadHello { peer: String, reason: String },
    #[error("TLS with {peer} failed: {reason}")]
    Tls { peer: String, reason: String },
    #[error("QUIC with {peer} failed: {reason}")]
    Quic { peer: String, reason: String },
    /// An RDMA verbs link failed: a work completion with an error status, or the device
    /// could not set the link up.
    #[error("RDMA link with {peer} failed: {reason}")]
    Verbs { peer: String, reason: String },
    /// The link cannot be made over the transport asked for: the peer (or this process)
    /// has no address for it.
    #[error("cannot reach {peer}: {reason}")]
    Unavailable { peer: String, reason: String },
}

impl TransportError {
    pub fn io(peer: impl ToString, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::UnexpectedEof {
            return TransportError::Closed {
                peer: peer.to_string(),
            };
        }
        TransportError::Io {
            peer: peer.to_string(),
            source,
        }
    }
}
