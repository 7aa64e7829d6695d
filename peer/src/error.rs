//! The errors a collective returns. Each says whether retrying over a new world can
//! succeed ([`Error::is_retryable`]) and what to do about it ([`Error::hint`]).

use eccl_protocol::Descriptor;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The epoch was aborted (a peer died, hung, or failed this collective). The caller's
    /// input is as it was before the call (G2); call `update_topology()` and retry.
    #[error("collective aborted in epoch {epoch}: {cause}")]
    Aborted { epoch: u64, cause: String },
    /// This peer was removed from the job. It may register again as a new peer.
    #[error("this peer was evicted: {reason}")]
    Evicted { reason: String },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error("collective mismatch{}: {detail}", rank.map(|r| format!(" with rank {r}")).unwrap_or_default())]
    Mismatch {
        rank: Option<u32>,
        ours: Option<Descriptor>,
        theirs: Option<Descriptor>,
        detail: String,
    },
    /// No progress within the deadline.
    #[error("timed out after {ms} ms: {what}")]
    Timeout { what: String, ms: u64 },
    /// The master could not be reached or stopped answering.
    #[error("master at {addr} is unavailable: {reason}")]
    MasterUnavailable { addr: String, reason: String },
    /// The call is wrong on its own (bad buffer length, operator for the type, root...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Fewer peers remain than the caller asked for.
    #[error("too few peers: {have} remain, at least {need} required")]
    TooFewPeers { have: usize, need: usize },
}

impl Error {
    /// Whether `update_topology()` followed by the same call can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Aborted { .. } | Error::Timeout { .. })
    }

    /// The variant's name, for logs and reports (`"Aborted"`, `"Evicted"`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Aborted { .. } => "Aborted",
            Error::Evicted { .. } => "Evicted",
            Error::Mismatch { .. } => "Mismatch",
            Error::Timeout { .. } => "Timeout",
            Error::MasterUnavailable { .. } => "MasterUnavailable",
            Error::InvalidArgument(_) => "InvalidArgument",
            Error::TooFewPeers { .. } => "TooFewPeers",
        }
    }

    pub fn hint(&self) -> &'static str {
        match self {
            Error::Aborted { .. } | Error::Timeout { .. } => "call update_topology() and retry the collective",
            Error::Evicted { .. } => "create a new Communicator to register again",
            Error::Mismatch { .. } => "make every rank call the same collectives in the same order with the same count, dtype, op and root; then update_topology()",
            Error::MasterUnavailable { .. } => "check ECCL_MASTER / --master and that eccl-master is running and reachable",
            Error::InvalidArgument(_) => "fix the arguments; then update_topology() before the next collective",
            Error::TooFewPeers { .. } => "wait for peers to join or lower the minimum",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_retryability() {
        let aborted = Error::Aborted {
            epoch: 3,
            cause: "peer 4 died".into(),
        };
        assert_eq!((aborted.kind(), aborted.is_retryable()), ("Aborted", true));
        let bad = Error::InvalidArgument("x".into());
        assert_eq!((bad.kind(), bad.is_retryable()), ("InvalidArgument", false));
        let few = Error::TooFewPeers { have: 1, need: 2 };
        assert_eq!((few.kind(), few.is_retryable()), ("TooFewPeers", false));
        assert_eq!(
            few.to_string(),
            "too few peers: 1 remain, at least 2 required"
        );
    }
}
