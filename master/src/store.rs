//! The key-value store's replicated state (see `eccl_protocol::store`): sessions, scopes
//! and their keys. Part of the [`crate::registry::Registry`], changed only by applying
//! raft commands, so every master holds the same store. Deterministic: no clocks, no
//! randomness (the leader chooses tokens before it proposes).

use std::collections::{BTreeMap, VecDeque};

use eccl_protocol::{StoreLimits, StoreReply, StoreWrite};
use serde::{Deserialize, Serialize};

/// Bytes of keys and values all scopes of one store job hold together (see
/// [`job_scope`]), and sessions one job may have open: one job cannot take the store's
/// whole room from the others.
pub const MAX_JOB_BYTES: u64 = 64 << 20;
pub const MAX_JOB_SESSIONS: usize = 1024;

/// Why `name` cannot name a store job: 1 to 64 of `[A-Za-z0-9_-]`.
pub fn check_job_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} cannot name a store job (1 to 64 of A-Z a-z 0-9 _ -)"
        ))
    }
}

/// The scope a store job's client means by `scope`: the job's scopes are kept apart from
/// every other job's (and from those of the job whose peers the masters serve, `None`,
/// which keep their plain names) by a prefix that no client-given name can hold (`#` is
/// not allowed in one).
pub fn job_scope(job: Option<&str>, scope: &str) -> String {
    match job {
        None => scope.to_string(),
        Some(j) => format!("{j}#{scope}"),
    }
}

/// The store job a scope belongs to (see [`job_scope`]).
pub fn job_of_scope(scope: &str) -> Option<&str> {
    scope.split_once('#').map(|(j, _)| j)
}

/// Writes a session remembers, so that one sent again after a fail-over is answered,
/// not applied twice.
const REMEMBERED_WRITES: usize = 64;

/// What a resent write needs of the first one's answer: a few bytes, never a value (so
/// the memory of every session is bounded by a few KiB whatever it wrote). Only writes
/// that changed the store are remembered: one that was refused or changed nothing (a
/// compare-and-set that did not match, a delete of no key) is simply done again when
/// resent, which is as if the first had never arrived, since nobody saw its effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Remembered {
    Done,
    Int(i64),
    Bool(bool),
    /// A compare-and-set that set its `desired` value: the answer is that value, which
    /// the resent write carries again.
    Desired,
}

impl Remembered {
    /// What to remember of `answer` to `op`, if it changed the store.
    fn of(op: &StoreWrite, answer: &Result<StoreReply, String>) -> Option<Remembered> {
        match (op, answer) {
            (_, Err(_)) => None,
            (StoreWrite::CompareSet { desired, .. }, Ok(StoreReply::Value(v))) => {
                // Value(desired): it set them, or it found them there already (and the
                // resend gets the same answer either way). Any other value: it changed
                // nothing.
                (v == desired).then_some(Remembered::Desired)
            }
            (StoreWrite::Delete { .. }, Ok(StoreReply::Bool(true))) => Some(Remembered::Bool(true)),
            (StoreWrite::Delete { .. }, Ok(_)) => None,
            (_, Ok(StoreReply::Done)) => Some(Remembered::Done),
            (_, Ok(StoreReply::Int(i))) => Some(Remembered::Int(*i)),
            (_, Ok(StoreReply::Bool(b))) => Some(Remembered::Bool(*b)),
            (_, Ok(_)) => None,
        }
    }

    /// The answer to `op` sent again.
    fn answer(self, op: &StoreWrite) -> StoreReply {
        match (self, op) {
            (Remembered::Done, _) => StoreReply::Done,
            (Remembered::Int(i), _) => StoreReply::Int(i),
            (Remembered::Bool(b), _) => StoreReply::Bool(b),
            (Remembered::Desired, StoreWrite::CompareSet { desired, .. }) => {
                StoreReply::Value(desired.clone())
            }
            // The same seq with another kind of write: the client's own confusion; the
            // first write was done, and this one is not.
            (Remembered::Desired, _) => StoreReply::Done,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub scope: String,
    pub token: [u8; 32],
    /// (seq, what the answer needs) of its last writes that changed the store, oldest
    /// first.
    recent: VecDeque<(u64, Remembered)>,
}

/// A key as an error message shows it: its first 64 bytes.
fn shown(key: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(&key[..key.len().min(64)])
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    value: Vec<u8>,
    /// The session an ephemeral key belongs to.
    owner: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scope {
    keys: BTreeMap<Vec<u8>, Entry>,
    /// Bytes of keys and values.
    bytes: u64,
}

impl Scope {
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.keys.get(key).map(|e| e.value.as_slice())
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The keys under `prefix` and their values, or (copying nothing) how many bytes
    /// they come to once that passes `max`.
    pub fn list(&self, prefix: &[u8], max: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>, usize> {
        let under = || {
            self.keys
                .range(prefix.to_vec()..)
                .take_while(|(k, _)| k.starts_with(prefix))
        };
        let mut bytes = 0usize;
        for (k, e) in under() {
            bytes += k.len() + e.value.len() + 2 * 5;
            if bytes > max {
                return Err(bytes);
            }
        }
        Ok(under().map(|(k, e)| (k.clone(), e.value.clone())).collect())
    }

    /// Sets `key`, or says why the scope cannot hold it (and changes nothing). `limit`:
    /// the most the scope may hold now (its own bound, or less where the other scopes
    /// leave less of the store's).
    fn put(
        &mut self,
        key: &[u8],
        value: Vec<u8>,
        owner: Option<u64>,
        limit: u64,
    ) -> Result<(), String> {
        self.bytes = self.fits(key, value.len(), limit)?;
        self.keys.insert(key.to_vec(), Entry { value, owner });
        Ok(())
    }

    /// The scope's bytes once `key` holds a value of `len` bytes, or why it cannot.
    fn fits(&self, key: &[u8], len: usize, limit: u64) -> Result<u64, String> {
        let old = self
            .keys
            .get(key)
            .map(|e| (key.len() + e.value.len()) as u64);
        let new = (key.len() + len) as u64;
        if old.is_none() && self.keys.len() >= StoreLimits::MAX_KEYS {
            return Err(format!(
                "the scope holds {} keys already (at most {})",
                self.keys.len(),
                StoreLimits::MAX_KEYS
            ));
        }
        let bytes = self.bytes - old.unwrap_or(0) + new;
        if bytes > limit {
            return Err(format!(
                "the scope would hold {bytes} bytes (at most {} now: {} per scope, {} in \
                 all scopes of the store)",
                limit,
                StoreLimits::MAX_SCOPE_BYTES,
                StoreLimits::MAX_STORE_BYTES
            ));
        }
        Ok(bytes)
    }

    /// Why `op` would be refused here (nothing changes), as [`Scope::apply`] decides:
    /// the leader asks before it proposes, so that a write the log would only carry to
    /// be refused is never proposed.
    fn check_write(&self, op: &StoreWrite, limit: u64) -> Result<(), String> {
        op.check()?;
        match op {
            StoreWrite::Set { key, value, .. } => self.fits(key, value.len(), limit).map(drop),
            StoreWrite::MultiSet { pairs } => self.multi_set_size(pairs, limit).map(drop),
            StoreWrite::Add { key, delta } => {
                let sum = self.added(key, *delta)?;
                self.fits(key, sum.to_string().len(), limit).map(drop)
            }
            StoreWrite::Append { key, value } => {
                let len = self.get(key).map_or(0, <[u8]>::len) + value.len();
                if len > StoreLimits::MAX_VALUE {
                    return StoreLimits::check_value_len(key, len);
                }
                self.fits(key, len, limit).map(drop)
            }
            StoreWrite::CompareSet {
                key,
                expected,
                desired,
            } => match self.get(key) {
                None if expected.is_empty() => self.fits(key, desired.len(), limit).map(drop),
                Some(v) if v == expected.as_slice() => {
                    self.fits(key, desired.len(), limit).map(drop)
                }
                _ => Ok(()),
            },
            StoreWrite::Delete { .. } => Ok(()),
        }
    }

    /// The scope's (bytes, keys) after a multi-set of `pairs` (the last value of a key
    /// repeated in it wins), or why it cannot hold them.
    fn multi_set_size(&self, pairs: &[(Vec<u8>, Vec<u8>)], limit: u64) -> Result<u64, String> {
        let last: BTreeMap<&[u8], &Vec<u8>> =
            pairs.iter().map(|(k, v)| (k.as_slice(), v)).collect();
        let (mut bytes, mut keys) = (self.bytes, self.keys.len());
        for (k, v) in &last {
            match self.keys.get(*k) {
                Some(e) => bytes -= (k.len() + e.value.len()) as u64,
                None => keys += 1,
            }
            bytes += (k.len() + v.len()) as u64;
        }
        if keys > StoreLimits::MAX_KEYS {
            return Err(format!(
                "the scope would hold {keys} keys (at most {})",
                StoreLimits::MAX_KEYS
            ));
        }
        if bytes > limit {
            return Err(format!(
                "the scope would hold {bytes} bytes (at most {limit} now)"
            ));
        }
        Ok(bytes)
    }

    /// The value of `key` after adding `delta`, or why it cannot be added.
    fn added(&self, key: &[u8], delta: i64) -> Result<i64, String> {
        let now = match self.get(key) {
            None => 0i64,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| {
                    format!("add on key {:?}, whose value is not an integer", shown(key))
                })?,
        };
        now.checked_add(delta)
            .ok_or_else(|| format!("add of {delta} to {now} at key {:?} overflows", shown(key)))
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        match self.keys.remove(key) {
            Some(e) => {
                self.bytes -= (key.len() + e.value.len()) as u64;
                true
            }
            None => false,
        }
    }

    /// Applies `op` in full or not at all, holding at most `limit` bytes.
    fn apply(&mut self, session: u64, op: &StoreWrite, limit: u64) -> Result<StoreReply, String> {
        op.check()?;
        match op {
            StoreWrite::Set {
                key,
                value,
                ephemeral,
            } => {
                self.put(key, value.clone(), ephemeral.then_some(session), limit)?;
                Ok(StoreReply::Done)
            }
            StoreWrite::MultiSet { pairs } => {
                // All or none: the scope's size after the batch is checked before any
                // key changes.
                let bytes = self.multi_set_size(pairs, limit)?;
                let last: BTreeMap<&[u8], &Vec<u8>> =
                    pairs.iter().map(|(k, v)| (k.as_slice(), v)).collect();
                for (k, v) in last {
                    let value = v.clone();
                    self.keys.insert(k.to_vec(), Entry { value, owner: None });
                }
                self.bytes = bytes;
                Ok(StoreReply::Done)
            }
            StoreWrite::Add { key, delta } => {
                let sum = self.added(key, *delta)?;
                let owner = self.keys.get(key.as_slice()).and_then(|e| e.owner);
                self.put(key, sum.to_string().into_bytes(), owner, limit)?;
                Ok(StoreReply::Int(sum))
            }
            StoreWrite::Append { key, value } => {
                let mut v = self.get(key).map(<[u8]>::to_vec).unwrap_or_default();
                v.extend_from_slice(value);
                StoreLimits::check_value(key, &v)?;
                let owner = self.keys.get(key.as_slice()).and_then(|e| e.owner);
                self.put(key, v, owner, limit)?;
                Ok(StoreReply::Done)
            }
            StoreWrite::CompareSet {
                key,
                expected,
                desired,
            } => match self.get(key) {
                None if expected.is_empty() => {
                    self.put(key, desired.clone(), None, limit)?;
                    Ok(StoreReply::Value(desired.clone()))
                }
                None => Ok(StoreReply::Value(expected.clone())),
                Some(v) if v == expected.as_slice() => {
                    let owner = self.keys.get(key.as_slice()).and_then(|e| e.owner);
                    self.put(key, desired.clone(), owner, limit)?;
                    Ok(StoreReply::Value(desired.clone()))
                }
                Some(v) => Ok(StoreReply::Value(v.to_vec())),
            },
            StoreWrite::Delete { key } => Ok(StoreReply::Bool(self.remove(key))),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreCommand {
    /// Opens session (the next id) in `scope`, with the credential the leader chose.
    Open { scope: String, token: [u8; 32] },
    /// Ends `session`: its ephemeral keys go, and its scope if no session is left in it.
    Close { session: u64, reason: String },
    /// A change in `session`'s scope; `seq` makes a resent write an answer, not a change.
    Write {
        session: u64,
        seq: u64,
        op: StoreWrite,
    },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Store {
    next_session: u64,
    // Public for the unit tests (tests/units/store.rs), which compare stores part by part.
    #[doc(hidden)]
    pub sessions: BTreeMap<u64, Session>,
    scopes: BTreeMap<String, Scope>,
}

impl Store {
    /// Applies `cmd`; `Ok` carries the answer for the client, `Err` why it was refused
    /// (nothing changed).
    pub fn apply(&mut self, cmd: &StoreCommand) -> Result<StoreReply, String> {
        match cmd {
            StoreCommand::Open { scope, token } => {
                let job = job_of_scope(scope);
                let (job_name, plain) = match scope.split_once('#') {
                    Some((j, s)) => (Some(j), s),
                    None => (None, scope.as_str()),
                };
                StoreLimits::check_scope(plain)?;
                if let Some(j) = job_name {
                    check_job_name(j)?;
                }
                let of_job = self
                    .sessions
                    .values()
                    .filter(|s| job_of_scope(&s.scope) == job)
                    .count();
                if of_job >= MAX_JOB_SESSIONS {
                    return Err(format!(
                        "{of_job} store sessions of this job are open (at most {MAX_JOB_SESSIONS})"
                    ));
                }
                if self.sessions.len() >= StoreLimits::MAX_SESSIONS {
                    return Err(format!(
                        "{} store sessions are open (at most {})",
                        self.sessions.len(),
                        StoreLimits::MAX_SESSIONS
                    ));
                }
                let id = self.next_session.max(1);
                self.next_session = id + 1;
                self.sessions.insert(
                    id,
                    Session {
                        scope: scope.clone(),
                        token: *token,
                        recent: VecDeque::new(),
                    },
                );
                self.scopes.entry(scope.clone()).or_default();
                Ok(StoreReply::Session {
                    session: id,
                    token: *token,
                    lease_ms: 0,
                })
            }
            StoreCommand::Close { session, .. } => {
                let Some(s) = self.sessions.remove(session) else {
                    return Ok(StoreReply::Bool(false));
                };
                let last = !self.sessions.values().any(|o| o.scope == s.scope);
                if last {
                    self.scopes.remove(&s.scope);
                } else if let Some(scope) = self.scopes.get_mut(&s.scope) {
                    let mine: Vec<Vec<u8>> = scope
                        .keys
                        .iter()
                        .filter(|(_, e)| e.owner == Some(*session))
                        .map(|(k, _)| k.clone())
                        .collect();
                    for k in mine {
                        scope.remove(&k);
                    }
                }
                Ok(StoreReply::Bool(true))
            }
            StoreCommand::Write { session, seq, op } => {
                let Some(s) = self.sessions.get_mut(session) else {
                    return Err(format!("store session {session} has ended"));
                };
                if let Some((_, first)) = s.recent.iter().find(|(q, _)| q == seq) {
                    return Ok(first.answer(op));
                }
                let limit = Self::limit_for(&self.scopes, &s.scope);
                let scope = self.scopes.entry(s.scope.clone()).or_default();
                let answer = scope.apply(*session, op, limit);
                if let Some(r) = Remembered::of(op, &answer) {
                    s.recent.push_back((*seq, r));
                    if s.recent.len() > REMEMBERED_WRITES {
                        s.recent.pop_front();
                    }
                }
                answer
            }
        }
    }

    /// The most the scope `name` may hold now: its own bound, or less where the other
    /// scopes leave less of the store's.
    fn limit_for(scopes: &BTreeMap<String, Scope>, name: &str) -> u64 {
        let others: u64 = scopes
            .iter()
            .filter(|(n, _)| n.as_str() != name)
            .map(|(_, sc)| sc.bytes)
            .sum();
        // The job's other scopes: a job's scopes together hold at most MAX_JOB_BYTES.
        let job = job_of_scope(name);
        let same_job: u64 = scopes
            .iter()
            .filter(|(n, _)| n.as_str() != name && job_of_scope(n) == job)
            .map(|(_, sc)| sc.bytes)
            .sum();
        StoreLimits::MAX_SCOPE_BYTES
            .min(StoreLimits::MAX_STORE_BYTES.saturating_sub(others))
            .min(MAX_JOB_BYTES.saturating_sub(same_job))
    }

    /// Why a write would be refused if proposed now (the session has ended, or the
    /// scope cannot take it): the leader asks before it proposes, so the log never
    /// carries writes that change nothing. A resent write is not refused (it is answered).
    pub fn precheck(&self, session: u64, seq: u64, op: &StoreWrite) -> Result<(), String> {
        let Some(s) = self.sessions.get(&session) else {
            return Err(format!("store session {session} has ended"));
        };
        if s.recent.iter().any(|(q, _)| *q == seq) {
            return Ok(());
        }
        let limit = Self::limit_for(&self.scopes, &s.scope);
        match self.scopes.get(&s.scope) {
            Some(scope) => scope.check_write(op, limit),
            None => Scope::default().check_write(op, limit),
        }
    }

    pub fn session(&self, id: u64) -> Option<&Session> {
        self.sessions.get(&id)
    }

    /// The bytes every scope's keys and values hold together.
    pub fn bytes(&self) -> u64 {
        self.scopes.values().map(|sc| sc.bytes).sum()
    }

    pub fn sessions(&self) -> impl Iterator<Item = u64> + '_ {
        self.sessions.keys().copied()
    }

    /// The scope `session` acts in.
    pub fn scope_of(&self, session: u64) -> Option<&Scope> {
        self.sessions
            .get(&session)
            .and_then(|s| self.scopes.get(&s.scope))
    }

    pub fn scope(&self, name: &str) -> Option<&Scope> {
        self.scopes.get(name)
    }

    /// Checks what every change must keep true: each scope's byte count is the sum of its
    /// keys and values, every value and key is within its bound, every scope, job and
    /// the whole store within theirs, and so are the sessions (run after every step by
    /// the tests and the store fuzzer).
    pub fn check_bounds(&self) -> Result<(), String> {
        let mut total = 0u64;
        let mut of_job: BTreeMap<Option<&str>, u64> = BTreeMap::new();
        for (name, scope) in &self.scopes {
            let mut bytes = 0u64;
            for (k, e) in &scope.keys {
                StoreLimits::check_key(k)?;
                StoreLimits::check_value(k, &e.value)?;
                bytes += (k.len() + e.value.len()) as u64;
            }
            if bytes != scope.bytes {
                return Err(format!(
                    "scope {name} counts {} bytes but holds {bytes}",
                    scope.bytes
                ));
            }
            if bytes > StoreLimits::MAX_SCOPE_BYTES || scope.keys.len() > StoreLimits::MAX_KEYS {
                return Err(format!(
                    "scope {name} holds {bytes} bytes in {} keys",
                    scope.keys.len()
                ));
            }
            total += bytes;
            *of_job.entry(job_of_scope(name)).or_default() += bytes;
        }
        if total > StoreLimits::MAX_STORE_BYTES {
            return Err(format!("the store holds {total} bytes"));
        }
        if let Some((job, bytes)) = of_job.iter().find(|(_, b)| **b > MAX_JOB_BYTES) {
            return Err(format!("job {job:?} holds {bytes} bytes"));
        }
        if self.sessions.len() > StoreLimits::MAX_SESSIONS {
            return Err(format!("{} sessions", self.sessions.len()));
        }
        for (id, s) in &self.sessions {
            if !self.scopes.contains_key(&s.scope) {
                return Err(format!("session {id} is in scope {} that is gone", s.scope));
            }
            if s.recent.len() > REMEMBERED_WRITES {
                return Err(format!("session {id} remembers {} writes", s.recent.len()));
            }
        }
        Ok(())
    }
}
