//! What a master reads on its raft listener once a peer master authenticated: the hello
//! naming the sender, then RPCs (append entries with registry commands, votes, snapshot
//! chunks, whose data is a registry snapshot). Decoding never panics or allocates
//! without bound, `refuse` judges any decoded RPC, and a snapshot's data decodes or is
//! refused as such.
#![no_main]

use eccl_master::raft::snapshot::decode_snapshot;
use eccl_master::raft::types::{RaftHello, RaftRpc};
use eccl_protocol::codec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            let _ = codec::decode::<RaftHello>(body);
        }
        1 => {
            if let Ok(rpc) = codec::decode::<RaftRpc>(body) {
                let _ = rpc.refuse(1);
                let _ = rpc.refuse(2);
                if let RaftRpc::InstallSnapshot(r) = &rpc {
                    let _ = decode_snapshot(&r.data);
                }
            }
        }
        _ => {
            let _ = decode_snapshot(body);
        }
    }
});
