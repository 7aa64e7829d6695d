//! The master's key-value store: what torchrun's rendezvous and `torch.distributed`
//! stores keep in the replicated master instead of in one agent's TCPStore.
//!
//! A client opens a **session** in a **scope** (torchrun's `--rdzv-id`); every key lives
//! in one scope, and a scope lives as long as any session of it does: when the last one
//! closes (or its lease lapses), the scope's keys are removed, so a finished job leaves
//! nothing behind and a job started again under the same id reads no stale addresses.
//! A key set `ephemeral` belongs to its session and goes with it (etcd's leases,
//! ZooKeeper's ephemeral nodes): that is how live agents are known.
//!
//! Values are bytes with torch's semantics: `add` keeps a decimal integer, `compare_set`
//! with an empty `expected` means "only if absent". Sizes are bounded
//! ([`StoreLimits`]); a request past a bound is refused whole and changes nothing.

use serde::{Deserialize, Serialize};

/// Bounds on what one scope and one request may hold.
pub struct StoreLimits;

impl StoreLimits {
    /// Bytes of one key.
    pub const MAX_KEY: usize = 4096;
    /// Bytes of one value.
    pub const MAX_VALUE: usize = 1 << 20;
    /// Keys in one scope.
    pub const MAX_KEYS: usize = 1 << 16;
    /// Bytes of keys and values in one scope.
    pub const MAX_SCOPE_BYTES: u64 = 64 << 20;
    /// Bytes of keys and values in all scopes of a master together: what a holder of
    /// the job secret can make the masters hold, however many sessions it opens.
    pub const MAX_STORE_BYTES: u64 = 256 << 20;
    /// Bytes of the keys one `wait`, `get` or `check` names.
    pub const MAX_KEYS_BYTES: usize = 256 << 10;
    /// `wait` requests pending on one master at once.
    pub const MAX_WAITS: usize = 1024;
    /// Keys in one request (`multi_get`, `multi_set`, `wait`, `check`).
    pub const MAX_BATCH: usize = 4096;
    /// Bytes of a scope's name.
    pub const MAX_SCOPE_NAME: usize = 256;
    /// Sessions open at once on one master.
    pub const MAX_SESSIONS: usize = 4096;
    /// Longest `wait`.
    pub const MAX_WAIT_MS: u64 = 24 * 3600 * 1000;
    /// Bytes of keys and values one write carries (a `multi_set` counted whole): what one
    /// entry of the masters' replicated log holds at most, so that every entry fits in
    /// one message between masters with room to spare.
    pub const MAX_WRITE_BYTES: usize = 4 << 20;
    /// Bytes of keys and values one reply carries (`get`, `multi_get`, `list`): a
    /// request whose answer would be larger is refused before anything is copied. Well
    /// under the control-message limit, so every answer can be sent.
    pub const MAX_REPLY_BYTES: usize = 8 << 20;

    /// Why `key` cannot be a key: empty, or longer than [`Self::MAX_KEY`].
    pub fn check_key(key: &[u8]) -> Result<(), String> {
        if key.is_empty() {
            return Err("an empty key".into());
        }
        if key.len() > Self::MAX_KEY {
            return Err(format!(
                "a key of {} bytes (at most {})",
                key.len(),
                Self::MAX_KEY
            ));
        }
        Ok(())
    }

    pub fn check_value(key: &[u8], value: &[u8]) -> Result<(), String> {
        Self::check_value_len(key, value.len())
    }

    /// Why a value of `len` bytes cannot be stored at `key`.
    pub fn check_value_len(key: &[u8], len: usize) -> Result<(), String> {
        if len > Self::MAX_VALUE {
            return Err(format!(
                "a value of {} bytes for key {:?} (at most {})",
                len,
                String::from_utf8_lossy(&key[..key.len().min(64)]),
                Self::MAX_VALUE
            ));
        }
        Ok(())
    }

    /// Why `scope` cannot name a scope: empty, too long, or not `[A-Za-z0-9-_.:/]`.
    pub fn check_scope(scope: &str) -> Result<(), String> {
        let ok = !scope.is_empty()
            && scope.len() <= Self::MAX_SCOPE_NAME
            && scope
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.:/".contains(c));
        if ok {
            Ok(())
        } else {
            Err(format!(
                "scope {:?} must be 1 to {} characters of [A-Za-z0-9-_.:/]",
                &scope[..scope.len().min(64)],
                Self::MAX_SCOPE_NAME
            ))
        }
    }
}

/// What a store client asks on its control connection. `Open` or `Attach` comes first;
/// every other request acts in that session's scope.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreRequest {
    /// Opens a session in `scope`: answered with [`StoreReply::Session`].
    Open { scope: String },
    /// This connection speaks for `session` again (the client lost its master).
    Attach { session: u64, token: [u8; 32] },
    /// Renews the session's lease.
    KeepAlive,
    /// Ends the session (its ephemeral keys go; the scope too if it was the last).
    Close,
    /// A change, applied once: a client that sends `seq` again (after a fail-over) gets
    /// the first answer, not a second change.
    Write { seq: u64, op: StoreWrite },
    /// The values of `keys` (`None` for a missing one); answered at once.
    Get { keys: Vec<Vec<u8>> },
    /// Whether all of `keys` exist.
    Check { keys: Vec<Vec<u8>> },
    /// Answered `Ok` once all of `keys` exist, or `Error{Timeout}` after `timeout_ms`.
    Wait { keys: Vec<Vec<u8>>, timeout_ms: u64 },
    /// How many keys the scope holds.
    NumKeys,
    /// The keys (and values) that start with `prefix`, in order.
    List { prefix: Vec<u8> },
}

/// A change to a scope.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreWrite {
    /// Sets `key`; an ephemeral key is removed when this session ends.
    Set {
        key: Vec<u8>,
        value: Vec<u8>,
        ephemeral: bool,
    },
    /// Sets several keys at once (all or none).
    MultiSet { pairs: Vec<(Vec<u8>, Vec<u8>)> },
    /// Adds `delta` to the decimal integer at `key` (0 if absent); answers the sum.
    Add { key: Vec<u8>, delta: i64 },
    /// Appends to the value at `key` (creating it).
    Append { key: Vec<u8>, value: Vec<u8> },
    /// torch's compare-and-set: sets `desired` if the value is `expected` (empty
    /// `expected`: if the key is absent); answers the value now held (for an absent key
    /// and a non-empty `expected`, `expected` itself, as TCPStore does).
    CompareSet {
        key: Vec<u8>,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    /// Removes `key`; answers whether it existed.
    Delete { key: Vec<u8> },
}

impl StoreWrite {
    /// Bytes of keys and values this write carries.
    pub fn bytes(&self) -> usize {
        match self {
            StoreWrite::Set { key, value, .. } | StoreWrite::Append { key, value } => {
                key.len() + value.len()
            }
            StoreWrite::MultiSet { pairs } => pairs.iter().map(|(k, v)| k.len() + v.len()).sum(),
            StoreWrite::Add { key, .. } | StoreWrite::Delete { key } => key.len(),
            StoreWrite::CompareSet {
                key,
                expected,
                desired,
            } => key.len() + expected.len() + desired.len(),
        }
    }

    /// Why this change cannot be made whatever the scope holds (sizes, empty keys).
    pub fn check(&self) -> Result<(), String> {
        let bytes = self.bytes();
        if bytes > StoreLimits::MAX_WRITE_BYTES {
            return Err(format!(
                "one write of {bytes} bytes of keys and values (at most {}): split it",
                StoreLimits::MAX_WRITE_BYTES
            ));
        }
        match self {
            StoreWrite::Set { key, value, .. } | StoreWrite::Append { key, value } => {
                StoreLimits::check_key(key)?;
                StoreLimits::check_value(key, value)
            }
            StoreWrite::MultiSet { pairs } => {
                if pairs.len() > StoreLimits::MAX_BATCH {
                    return Err(format!(
                        "{} keys in one request (at most {})",
                        pairs.len(),
                        StoreLimits::MAX_BATCH
                    ));
                }
                for (k, v) in pairs {
                    StoreLimits::check_key(k)?;
                    StoreLimits::check_value(k, v)?;
                }
                Ok(())
            }
            StoreWrite::Add { key, .. } | StoreWrite::Delete { key } => StoreLimits::check_key(key),
            StoreWrite::CompareSet {
                key,
                expected,
                desired,
            } => {
                StoreLimits::check_key(key)?;
                StoreLimits::check_value(key, expected)?;
                StoreLimits::check_value(key, desired)
            }
        }
    }
}

/// The master's answer to a [`StoreRequest`] (inside `MasterReply::Store`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreReply {
    /// A session, and the credential to attach to it after a fail-over.
    Session {
        session: u64,
        token: [u8; 32],
        lease_ms: u64,
    },
    Done,
    Value(Vec<u8>),
    Values(Vec<Option<Vec<u8>>>),
    Int(i64),
    Bool(bool),
    Count(u64),
    Pairs(Vec<(Vec<u8>, Vec<u8>)>),
}
