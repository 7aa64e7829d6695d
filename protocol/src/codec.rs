//! Length-prefixed bincode 2 encoding of control messages (peer <-> master, master <->
//! master). A message is a little-endian `u32` length followed by that many bytes.

use serde::{de::DeserializeOwned, Serialize};

use crate::MAX_CONTROL_MSG;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("control message of {0} bytes or more exceeds the limit of {MAX_CONTROL_MSG} bytes")]
    TooLarge(usize),
    #[error("malformed control message: {0}")]
    Malformed(String),
    #[error("control message has {0} trailing bytes")]
    Trailing(usize),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_CONTROL_MSG>()
}

/// A buffer that refuses to grow past the limit: a message too large to send fails as
/// soon as it passes it, instead of after all of it was encoded (bincode's limit applies
/// only to decoding).
struct Limited {
    out: Vec<u8>,
}

impl std::io::Write for Limited {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() - 4 + buf.len() > MAX_CONTROL_MSG {
            return Err(std::io::Error::other(TOO_LARGE));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const TOO_LARGE: &str = "eccl: past the control-message limit";

/// Encodes `msg` with its length prefix, or says it is too large to send (after encoding
/// no more than the limit).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    let mut w = Limited { out: vec![0u8; 4] };
    match bincode::serde::encode_into_std_write(msg, &mut w, config()) {
        Ok(_) => {}
        Err(bincode::error::EncodeError::Io { inner, .. }) if inner.to_string() == TOO_LARGE => {
            return Err(CodecError::TooLarge(MAX_CONTROL_MSG + 1))
        }
        Err(e) => return Err(CodecError::Malformed(e.to_string())),
    }
    let mut out = w.out;
    let len = out.len() - 4;
    out[0..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Checks a length prefix before the body is read, so a hostile peer cannot make us
/// allocate more than the limit.
pub fn check_len(prefix: [u8; 4]) -> Result<usize, CodecError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_CONTROL_MSG {
        return Err(CodecError::TooLarge(len));
    }
    Ok(len)
}

/// Decodes a `T` from the start of `bytes` with bincode's standard configuration and a
/// limit that follows from the input's own length: returns it and the bytes used.
///
/// bincode allocates a string's buffer from its length prefix before it reads the
/// string, so without a limit a few bytes claiming a string of 2^60 bytes panic
/// ("capacity overflow") and smaller claims allocate what they claim. Everything a value
/// claims is in the input, at most 16 times over (bincode counts a primitive's size in
/// memory, a varint is one byte or more), so the limit is the first of 64 KiB, 1 MiB,
/// 16 MiB, 256 MiB, 4 GiB that is at least 16 times the input: no valid encoding is
/// refused, and no input makes the decoder allocate more than 16 times its length (or 64
/// KiB).
pub fn decode_slice<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<(T, usize), bincode::error::DecodeError> {
    use bincode::config::standard;
    let claims = bytes.len().saturating_mul(16);
    macro_rules! within {
        ($($limit:expr),*) => {
            $(
                if claims <= $limit {
                    return bincode::serde::decode_from_slice(bytes, standard().with_limit::<{ $limit }>());
                }
            )*
        };
    }
    within!(64 << 10, 1 << 20, 16 << 20, 256 << 20);
    bincode::serde::decode_from_slice(bytes, standard().with_limit::<{ 4 << 30 }>())
}

/// Decodes a message body (without its prefix). Every byte must be used.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, CodecError> {
    if body.len() > MAX_CONTROL_MSG {
        return Err(CodecError::TooLarge(body.len()));
    }
    let (msg, used) = decode_slice(body).map_err(|e| CodecError::Malformed(e.to_string()))?;
    if used != body.len() {
        return Err(CodecError::Trailing(body.len() - used));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::*;

    /// A message past the limit fails after at most the limit was encoded, with a size.
    #[test]
    fn too_large_to_send_is_refused_while_encoding() {
        let big = vec![7u8; MAX_CONTROL_MSG + 10];
        assert!(matches!(encode(&big), Err(CodecError::TooLarge(n)) if n > MAX_CONTROL_MSG));
        let fits = vec![7u8; MAX_CONTROL_MSG - 8];
        let bytes = encode(&fits).unwrap();
        assert_eq!(decode::<Vec<u8>>(&bytes[4..]).unwrap(), fits);
    }

    /// A length prefix that claims more than the input holds is refused before anything
    /// is allocated: 2^62 bytes once panicked ("capacity overflow"), and 15 MiB from a
    /// ten-byte body allocated 15 MiB.
    #[test]
    fn a_string_longer_than_the_input_is_refused_before_it_is_allocated() {
        for claimed in [1u64 << 62, 15 << 20, 100] {
            // bincode's varint: 253 then a u64.
            let mut body = vec![253u8];
            body.extend_from_slice(&claimed.to_le_bytes());
            body.push(b'x');
            assert!(matches!(
                decode::<String>(&body),
                Err(CodecError::Malformed(_))
            ));
            assert!(decode_slice::<(String, String)>(&body).is_err());
        }
        // Strings as long as the input allows still decode, at every size.
        for len in [0usize, 1, 4 << 10, 70 << 10, 3 << 20] {
            let s = "y".repeat(len);
            let bytes = encode(&s).unwrap();
            assert_eq!(decode::<String>(&bytes[4..]).unwrap(), s);
        }
    }

    #[test]
    fn round_trip_and_garbage() {
        let m = PeerRequest::Register(RegisterRequest {
            listen_port: 4000,
            quic_port: Some(4001),
            shm_name: Some("eccl-1-2".into()),
            advertise_host: Some("10.0.0.1".into()),
            host: "node-a".into(),
            rank_hint: Some(3),
            protocol_version: crate::PROTOCOL_VERSION,
        });
        let bytes = encode(&m).unwrap();
        let len = check_len(bytes[0..4].try_into().unwrap()).unwrap();
        assert_eq!(len, bytes.len() - 4);
        let back: PeerRequest = decode(&bytes[4..]).unwrap();
        assert_eq!(back, m);
        // Every truncation and a few corruptions are errors, never panics.
        for cut in 0..bytes.len() - 4 {
            assert!(decode::<PeerRequest>(&bytes[4..4 + cut]).is_err());
        }
        let mut bad = bytes[4..].to_vec();
        bad[0] = 0xff;
        assert!(decode::<PeerRequest>(&bad).is_err());
        assert!(check_len(u32::MAX.to_le_bytes()).is_err());
        // A length-prefixed vector claiming 2^60 elements must not allocate.
        let huge = [0xffu8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f];
        assert!(decode::<Vec<u64>>(&huge).is_err());
    }
}
