//! Control messages, as a job member sends them to a master (every request, store
//! requests included) and as a master sends them to peers (replies, worlds): the first
//! byte picks the type, the rest is the body after the length prefix. What a decoder
//! accepts encodes back to the same value; a world that validates is consistent.
#![no_main]

use std::fmt::Debug;

use eccl_protocol::store::StoreRequest;
use eccl_protocol::{codec, MasterMessage, MasterReply, RegisterRequest, Request, World};
use libfuzzer_sys::fuzz_target;
use serde::{de::DeserializeOwned, Serialize};

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(body: &[u8]) -> Option<T> {
    let m = codec::decode::<T>(body).ok()?;
    let again = codec::encode(&m).expect("an accepted message encodes");
    let back: T = codec::decode(&again[4..]).expect("its encoding decodes");
    assert_eq!(back, m);
    Some(m)
}

fn check_world(w: &World) {
    if w.validate().is_ok() {
        for m in &w.members {
            assert_eq!(w.member(m.rank).map(|x| x.peer_id), Some(m.peer_id));
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let _ = codec::check_len(body.get(..4).and_then(|p| p.try_into().ok()).unwrap_or([0; 4]));
    match which % 5 {
        0 => {
            round_trip::<Request>(body);
        }
        1 => {
            if let Some(MasterMessage::Reply {
                body: MasterReply::World { world, .. },
                ..
            }) = round_trip::<MasterMessage>(body)
            {
                check_world(&world);
            }
        }
        2 => {
            round_trip::<RegisterRequest>(body);
        }
        3 => {
            round_trip::<StoreRequest>(body);
        }
        _ => {
            if let Some(w) = round_trip::<World>(body) {
                check_world(&w);
            }
        }
    }
});
