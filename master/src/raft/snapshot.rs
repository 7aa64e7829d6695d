//! The state machine's content and its snapshot encoding: what a leader sends a
//! follower and what the data directory keeps. Free of the server's dependencies, so
//! that the fuzzers (fuzz/, `default-features = false`) build it alone.

use openraft::{AnyError, LogId, StorageError, StorageIOError, StoredMembership};
use serde::{Deserialize, Serialize};

use super::types::{MasterId, MasterNode};
use crate::registry::Registry;

/// What the state machine holds; also the content of a snapshot.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SmData {
    pub registry: Registry,
    pub last_applied: Option<LogId<MasterId>>,
    pub membership: StoredMembership<MasterId, MasterNode>,
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
}

pub fn encode_snapshot(data: &SmData) -> Result<Vec<u8>, StorageError<MasterId>> {
    bincode::serde::encode_to_vec(data, bincode_config())
        .map_err(|e| StorageError::from(StorageIOError::write_snapshot(None, AnyError::new(&e))))
}

/// A snapshot's bytes as the state machine reads them (one a leader sent, or one from the
/// data directory), refused whole if they do not decode exactly.
pub fn decode_snapshot(bytes: &[u8]) -> Result<SmData, StorageIOError<MasterId>> {
    let (data, used): (SmData, usize) = eccl_protocol::codec::decode_slice(bytes)
        .map_err(|e| StorageIOError::read_snapshot(None, AnyError::new(&e)))?;
    if used != bytes.len() {
        return Err(StorageIOError::read_snapshot(
            None,
            AnyError::error(format!("{} trailing bytes in snapshot", bytes.len() - used)),
        ));
    }
    Ok(data)
}
