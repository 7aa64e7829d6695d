//! Unit tests of `eccl_master::coordinator::store`: the bound docs/security.md and the
//! README give for what one job member can make a master hold is the sum of the limits
//! in the code; change a limit and this fails until the pages say the new number.

use eccl_master::coordinator::store::{MAX_REPLY_BYTES_QUEUED, MAX_WRITE_BYTES_IN_FLIGHT};
use eccl_master::raft::log_store::REFUSE_WRITES_AT_BYTES;
use eccl_master::server::MAX_BODY_BYTES_READING;
use eccl_protocol::StoreLimits;

#[test]
fn the_documented_memory_bound_is_the_sum_of_the_limits() {
    let store = StoreLimits::MAX_STORE_BYTES as usize;
    // The store and the copy a snapshot of it makes; replies queued for slow readers;
    // the raft log before writes are refused; large messages being read; store writes
    // on their way through raft.
    let sum = 2 * store
        + MAX_REPLY_BYTES_QUEUED
        + REFUSE_WRITES_AT_BYTES
        + MAX_BODY_BYTES_READING
        + MAX_WRITE_BYTES_IN_FLIGHT;
    let gib = format!("{:.1} GiB", sum as f64 / (1u64 << 30) as f64);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for page in ["docs/security.md", "README.md"] {
        let text = std::fs::read_to_string(root.join(page)).unwrap();
        assert!(
            text.contains(&format!("about **{gib}**")),
            "{page} should give the bound as 'about **{gib}**' ({sum} bytes)"
        );
    }
}
