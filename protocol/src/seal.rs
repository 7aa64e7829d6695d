//! Sealing a short secret to one reader through a channel others can read (the torch
//! rendezvous store): the reader publishes an X25519 public key, the writer answers with
//! the secret encrypted to it, and a process that only reads the channel learns nothing.
//!
//! ```text
//! reader: k <- random X25519 key, publishes K = k·G                      (32 bytes)
//! writer: e <- random X25519 key, key = HKDF-SHA256(salt = E ‖ K, ikm = e·K, info = context)
//!         publishes E ‖ ChaCha20-Poly1305(key, nonce 0, aad = context, secret)
//! reader: key = HKDF(E ‖ K, k·E, context), opens it
//! ```
//!
//! Every key is used once, so the fixed nonce is safe. The context (for example
//! "eccl/torch rank 3") binds a sealed box to its purpose and recipient: one meant for
//! rank 1 does not open as rank 3's. What this does not do is authenticate the reader:
//! whoever publishes a public key under a name gets the box for that name, so the
//! channel must stop a second writer of the same name (the torch backend publishes with
//! `compare_set` and fails loudly when its key was not the one stored).

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use ring::agreement::{self, EphemeralPrivateKey, UnparsedPublicKey, X25519};
use ring::hkdf;
use ring::rand::SystemRandom;

pub const PUBLIC_LEN: usize = 32;
/// Bytes a sealed box adds to its contents: the writer's public key and the tag.
pub const OVERHEAD: usize = PUBLIC_LEN + 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    #[error("the public key is {0} bytes, not {PUBLIC_LEN}")]
    BadPublicKey(usize),
    #[error("the sealed box is too short to be one")]
    Short,
    #[error("the sealed box does not open with this key and context (tampered with, or meant for another reader)")]
    Refused,
    #[error("this key has already opened a box; keys are single-use")]
    Used,
    #[error("the system's random source failed")]
    Random,
}

/// A reader's one-use key.
pub struct OpenKey {
    private: Option<EphemeralPrivateKey>,
    public: [u8; PUBLIC_LEN],
}

impl OpenKey {
    pub fn generate() -> Result<OpenKey, SealError> {
        let private = EphemeralPrivateKey::generate(&X25519, &SystemRandom::new())
            .map_err(|_| SealError::Random)?;
        let public = public_bytes(&private)?;
        Ok(OpenKey {
            private: Some(private),
            public,
        })
    }

    pub fn public(&self) -> [u8; PUBLIC_LEN] {
        self.public
    }

    /// Opens a box sealed to this key under `context`. The key is spent either way.
    pub fn open(&mut self, sealed: &[u8], context: &[u8]) -> Result<Vec<u8>, SealError> {
        let private = self.private.take().ok_or(SealError::Used)?;
        if sealed.len() < OVERHEAD {
            return Err(SealError::Short);
        }
        let (theirs, body) = sealed.split_at(PUBLIC_LEN);
        let key = box_key(private, theirs, theirs, &self.public, context)?;
        let mut buf = body.to_vec();
        let plain = key
            .open_in_place(
                Nonce::assume_unique_for_key([0; 12]),
                Aad::from(context),
                &mut buf,
            )
            .map_err(|_| SealError::Refused)?
            .len();
        buf.truncate(plain);
        Ok(buf)
    }
}

/// Seals `plain` to the reader whose public key is `public`, under `context`.
pub fn seal(public: &[u8], plain: &[u8], context: &[u8]) -> Result<Vec<u8>, SealError> {
    if public.len() != PUBLIC_LEN {
        return Err(SealError::BadPublicKey(public.len()));
    }
    let mine = EphemeralPrivateKey::generate(&X25519, &SystemRandom::new())
        .map_err(|_| SealError::Random)?;
    let my_public = public_bytes(&mine)?;
    let key = box_key(mine, public, &my_public, public, context)?;
    let mut out = my_public.to_vec();
    let mut body = plain.to_vec();
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key([0; 12]),
        Aad::from(context),
        &mut body,
    )
    .map_err(|_| SealError::Refused)?;
    out.extend_from_slice(&body);
    Ok(out)
}

fn public_bytes(k: &EphemeralPrivateKey) -> Result<[u8; PUBLIC_LEN], SealError> {
    let p = k.compute_public_key().map_err(|_| SealError::Random)?;
    p.as_ref()
        .try_into()
        .map_err(|_| SealError::BadPublicKey(p.as_ref().len()))
}

/// The box key from our private key and their public key, salted with the writer's
/// and the reader's public keys (in that order, whoever computes it).
fn box_key(
    mine: EphemeralPrivateKey,
    theirs: &[u8],
    writer: &[u8],
    reader: &[u8],
    context: &[u8],
) -> Result<LessSafeKey, SealError> {
    let mut salt = Vec::with_capacity(2 * PUBLIC_LEN);
    salt.extend_from_slice(writer);
    salt.extend_from_slice(reader);
    let info = [context];
    agreement::agree_ephemeral(mine, &UnparsedPublicKey::new(&X25519, theirs), |shared| {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(shared);
        let okm = prk
            .expand(&info, &CHACHA20_POLY1305)
            .map_err(|_| SealError::Refused)?;
        Ok(LessSafeKey::new(UnboundKey::from(okm)))
    })
    .map_err(|_| SealError::Refused)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_box_opens_once_for_its_reader_and_context() {
        let mut k = OpenKey::generate().unwrap();
        let sealed = seal(&k.public(), b"the job secret", b"eccl/torch rank 1").unwrap();
        assert_eq!(sealed.len(), b"the job secret".len() + OVERHEAD);
        assert!(!sealed.windows(6).any(|w| w == b"secret"));
        assert_eq!(
            k.open(&sealed, b"eccl/torch rank 1").unwrap(),
            b"the job secret"
        );
        assert_eq!(k.open(&sealed, b"eccl/torch rank 1"), Err(SealError::Used));
    }

    #[test]
    fn wrong_context_other_reader_and_tampering_are_refused() {
        let k = OpenKey::generate().unwrap();
        let sealed = seal(&k.public(), b"s3cret", b"rank 1").unwrap();
        let mut a = OpenKey::generate().unwrap();
        assert_eq!(
            a.open(&sealed, b"rank 1"),
            Err(SealError::Refused),
            "another reader"
        );
        let mut k2 = OpenKey::generate().unwrap();
        let s2 = seal(&k2.public(), b"s3cret", b"rank 1").unwrap();
        assert_eq!(
            k2.open(&s2, b"rank 3"),
            Err(SealError::Refused),
            "another context"
        );
        for i in 0..s2.len() {
            let mut k3 = OpenKey::generate().unwrap();
            let mut s3 = seal(&k3.public(), b"s3cret", b"rank 1").unwrap();
            s3[i] ^= 1;
            assert_eq!(
                k3.open(&s3, b"rank 1"),
                Err(SealError::Refused),
                "bit {i} flipped"
            );
        }
        let mut k4 = OpenKey::generate().unwrap();
        assert_eq!(k4.open(&[0; OVERHEAD - 1], b""), Err(SealError::Short));
        assert_eq!(seal(&[0; 31], b"x", b""), Err(SealError::BadPublicKey(31)));
    }
}
