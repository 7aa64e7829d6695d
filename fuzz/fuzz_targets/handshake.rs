//! What a stranger can send before it holds the secret: the handshake's fixed-size
//! messages, then (once authenticated) a link's hello and a verbs hello. Each decoder
//! refuses or accepts a value that encodes back to itself.
#![no_main]

use eccl_protocol::auth::{ClientAuth, ServerHello, CLIENT_AUTH_LEN, SERVER_HELLO_LEN};
use eccl_protocol::{codec, LinkHello, VerbsHello};
use libfuzzer_sys::fuzz_target;

fn fixed<const N: usize>(data: &[u8]) -> [u8; N] {
    let mut b = [0u8; N];
    let n = data.len().min(N);
    b[..n].copy_from_slice(&data[..n]);
    b
}

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = ServerHello::decode(&fixed::<SERVER_HELLO_LEN>(data)) {
        let again = ServerHello::decode(&m.encode()).expect("its encoding decodes");
        assert_eq!(again.nonce, m.nonce);
    }
    if let Ok(m) = ClientAuth::decode(&fixed::<CLIENT_AUTH_LEN>(data)) {
        let again = ClientAuth::decode(&m.encode()).expect("its encoding decodes");
        assert_eq!(again.nonce, m.nonce);
    }
    if let Ok(h) = codec::decode::<LinkHello>(data) {
        let b = codec::encode(&h).expect("an accepted hello encodes");
        assert_eq!(codec::decode::<LinkHello>(&b[4..]).ok(), Some(h));
    }
    if let Ok(h) = codec::decode::<VerbsHello>(data) {
        if h.validate().is_ok() {
            assert!(h.qp_num >= 2 && h.qp_num < 1 << 24 && h.recv_slots > 0);
        }
        let b = codec::encode(&h).expect("an accepted hello encodes");
        assert_eq!(codec::decode::<VerbsHello>(&b[4..]).ok(), Some(h));
    }
});
