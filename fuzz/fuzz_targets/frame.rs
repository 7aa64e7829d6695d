//! The data-link frame header, read from every peer link before anything else: 64 bytes
//! from the wire. An accepted header is within the payload bound and encodes back to
//! itself.
#![no_main]

use eccl_protocol::frame::{FrameHeader, FRAME_HEADER_LEN};
use eccl_protocol::MAX_FRAME_PAYLOAD;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; FRAME_HEADER_LEN];
    let n = data.len().min(FRAME_HEADER_LEN);
    b[..n].copy_from_slice(&data[..n]);
    if let Ok(h) = FrameHeader::decode(&b) {
        assert!(h.len as usize <= MAX_FRAME_PAYLOAD);
        assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
    }
});
