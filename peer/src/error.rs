//! The errors a collective returns. Each says whether retrying over a new world can
//! succeed ([`Error::is_retryable`]) and what to do about it ([`Error::hint`]).

use eccl_protocol::Descriptor;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The epoch was aborted (a peer died, hung, or failed this collective). The caller's
    /// input is as it was before the call (G2); call `update_topology()` and retry.
    #[error("collective aborted in epoch {epoch}: {cause}")]
    Aborted { epoch: u64, cause: String },
    /// The epoch was revoked (`revoke()`, here or on another rank): its calls fail as on
    /// an abort, and the world waits for its members to form the next one themselves
    /// (`update_topology()`; in torch, `dist._reconfigure` or a shrink).
    #[error("collective revoked in epoch {epoch}: {cause}")]
    Revoked { epoch: u64, cause: String },
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

/// A schedule or buffer the algorithms crate refused: the call's arguments are wrong.
impl From<eccl_algorithms::BuildError> for Error {
    fn from(e: eccl_algorithms::BuildError) -> Error {
        match e {
            eccl_algorithms::BuildError::InvalidArgument(m) => Error::InvalidArgument(m),
            other => Error::InvalidArgument(other.to_string()),
        }
    }
}

/// Defines [`ErrorKind`] from one table: each row names a variant of [`Error`], whether a
/// retry over a new world can succeed, and what to do about it. The Python package makes
/// one exception class per row (`AbortedError`, ...), so a new kind of error is one row
/// here, one variant above and one arm in [`Error::kind`] (the compiler asks for it).
macro_rules! error_kinds {
    ($($v:ident, retryable: $retry:literal, hint: $hint:literal;)*) => {
        /// The kind of an [`Error`], without its details.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ErrorKind {
            $($v,)*
        }

        impl ErrorKind {
            pub const ALL: [ErrorKind; [$($retry),*].len()] = [$(ErrorKind::$v),*];

            /// The variant's name (`"Aborted"`, `"Evicted"`, ...).
            pub const fn name(self) -> &'static str {
                match self { $(ErrorKind::$v => stringify!($v),)* }
            }

            /// Whether `update_topology()` followed by the same call can succeed.
            pub const fn is_retryable(self) -> bool {
                match self { $(ErrorKind::$v => $retry,)* }
            }

            /// What the caller should do about it.
            pub const fn hint(self) -> &'static str {
                match self { $(ErrorKind::$v => $hint,)* }
            }
        }
    };
}

error_kinds! {
    Aborted, retryable: true, hint: "call update_topology() and retry the collective";
    Revoked, retryable: true, hint: "form the next world (update_topology(), or in torch a reconfigure or shrink) and retry";
    Evicted, retryable: false, hint: "create a new Communicator to register again";
    Mismatch, retryable: false, hint: "make every rank call the same collectives in the same order with the same count, dtype, op and root; then update_topology()";
    Timeout, retryable: true, hint: "call update_topology() and retry the collective";
    MasterUnavailable, retryable: false, hint: "check ECCL_MASTER / --master and that eccl-master is running and reachable";
    InvalidArgument, retryable: false, hint: "fix the arguments; then update_topology() before the next collective";
    TooFewPeers, retryable: false, hint: "wait for peers to join or lower the minimum";
}

impl ErrorKind {
    /// The kind this one is a special case of, if any (a revoke is an abort): the
    /// Python class of `Revoked` derives from that of `Aborted`. Parents come first in
    /// [`ErrorKind::ALL`].
    pub const fn parent(self) -> Option<ErrorKind> {
        match self {
            ErrorKind::Revoked => Some(ErrorKind::Aborted),
            _ => None,
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Error {
    pub const fn kind(&self) -> ErrorKind {
        match self {
            Error::Aborted { .. } => ErrorKind::Aborted,
            Error::Revoked { .. } => ErrorKind::Revoked,
            Error::Evicted { .. } => ErrorKind::Evicted,
            Error::Mismatch { .. } => ErrorKind::Mismatch,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::MasterUnavailable { .. } => ErrorKind::MasterUnavailable,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::TooFewPeers { .. } => ErrorKind::TooFewPeers,
        }
    }

    /// Whether `update_topology()` followed by the same call can succeed.
    pub const fn is_retryable(&self) -> bool {
        self.kind().is_retryable()
    }

    pub const fn hint(&self) -> &'static str {
        self.kind().hint()
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
        assert_eq!(
            (aborted.kind().name(), aborted.is_retryable()),
            ("Aborted", true)
        );
        let bad = Error::InvalidArgument("x".into());
        assert_eq!(
            (bad.kind().name(), bad.is_retryable()),
            ("InvalidArgument", false)
        );
        let few = Error::TooFewPeers { have: 1, need: 2 };
        assert_eq!(
            (few.kind().name(), few.is_retryable()),
            ("TooFewPeers", false)
        );
        assert_eq!(
            few.to_string(),
            "too few peers: 1 remain, at least 2 required"
        );
    }
}
