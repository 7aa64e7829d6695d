//! Challenge-response authentication with the job's secret (HMAC-SHA256), run on every
//! connection before any other byte is trusted.
//!
//! ```text
//! acceptor -> dialer : ServerHello { magic, version, nonce_a }                (42 bytes)
//! dialer -> acceptor : ClientAuth  { magic, version, role, nonce_d,
//!                                    proof_d = HMAC(secret, "d" role nonce_a nonce_d) } (75 bytes)
//! acceptor -> dialer : ServerAuth  { proof_a = HMAC(secret, "a" role nonce_d nonce_a) } (32 bytes)
//! ```
//!
//! The dialer proves itself first, so a connection without the secret learns nothing
//! but a random nonce before it is dropped. The acceptor then proves itself, so a peer
//! never sends data to an impostor. Both proofs bind the role and both nonces, so a
//! recorded exchange cannot be replayed. The secret itself never crosses the wire.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
const MAGIC: [u8; 8] = *b"ECCLAUTH";

pub const SERVER_HELLO_LEN: usize = 8 + 2 + NONCE_LEN;
pub const CLIENT_AUTH_LEN: usize = 8 + 2 + 1 + NONCE_LEN + PROOF_LEN;
pub const SERVER_AUTH_LEN: usize = PROOF_LEN;

/// What the dialer wants to be on this connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// A peer's control connection to a master.
    PeerToMaster = 1,
    /// A data link between two peers.
    PeerLink = 2,
    /// Raft traffic between masters.
    MasterToMaster = 3,
}

impl Role {
    pub fn from_u8(v: u8) -> Option<Role> {
        Some(match v {
            1 => Role::PeerToMaster,
            2 => Role::PeerLink,
            3 => Role::MasterToMaster,
            _ => return None,
        })
    }
}

/// The job's shared secret. Its bytes never appear in logs or on the wire.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Random bytes in a key that is used as it is: what `eccl-master`, `eccl.Master` and
    /// the torch backend make (32 random bytes, written as [`Self::KEY_HEX`] hex digits).
    pub const KEY_LEN: usize = 32;
    /// Hex digits of such a key.
    pub const KEY_HEX: usize = 2 * Self::KEY_LEN;
    /// Shortest passphrase taken. Every secret that is not a key as eccl makes them is
    /// stretched with PBKDF2, so that guessing it offline (from a handshake seen on a
    /// plain-TCP link) costs [`Self::KDF_ROUNDS`] HMACs a try, however long it is.
    pub const MIN_LEN: usize = 16;
    pub const KDF_ROUNDS: u32 = 100_000;

    /// The job secret from what a user gave: a key as eccl makes them (at least
    /// [`Self::KEY_HEX`] hex digits) is used as it is; any other passphrase of at least
    /// [`Self::MIN_LEN`] bytes is stretched with PBKDF2-HMAC-SHA256; shorter than that is
    /// refused. Surrounding whitespace (a file's newline) is ignored.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret, AuthError> {
        let bytes: Vec<u8> = bytes.into();
        let trimmed: Vec<u8> = {
            let s = bytes.as_slice();
            let start = s
                .iter()
                .position(|b| !b.is_ascii_whitespace())
                .unwrap_or(s.len());
            let end = s
                .iter()
                .rposition(|b| !b.is_ascii_whitespace())
                .map_or(start, |e| e + 1);
            s[start..end].to_vec()
        };
        if trimmed.len() < Self::MIN_LEN {
            return Err(AuthError::WeakSecret(trimmed.len()));
        }
        if trimmed.len() >= Self::KEY_HEX && trimmed.iter().all(u8::is_ascii_hexdigit) {
            return Ok(Secret(trimmed));
        }
        let mut key = [0u8; 32];
        pbkdf2::pbkdf2_hmac::<Sha256>(
            &trimmed,
            b"eccl-job-passphrase-v1",
            Self::KDF_ROUNDS,
            &mut key,
        );
        Ok(Secret(key.to_vec()))
    }

    /// This secret tied to one TLS or QUIC session, from the session's exported keying
    /// material: both ends of one session derive the same key, and a man in the middle,
    /// who holds two sessions with different material, cannot relay proofs between them.
    pub fn bind(&self, session: &[u8]) -> Secret {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(b"eccl-session-binding-v1");
        m.update(session);
        Secret(m.finalize().into_bytes().to_vec())
    }

    fn mac(
        &self,
        label: &[u8],
        role: Role,
        n1: &[u8; NONCE_LEN],
        n2: &[u8; NONCE_LEN],
    ) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        // The protocol version is inside the proof, so a connection cannot be talked down
        // to an older version without the secret.
        m.update(b"eccl-auth-v2");
        m.update(&crate::PROTOCOL_VERSION.to_le_bytes());
        m.update(label);
        m.update(&[role as u8]);
        m.update(n1);
        m.update(n2);
        m
    }

    pub fn dialer_proof(
        &self,
        role: Role,
        acceptor_nonce: &[u8; NONCE_LEN],
        dialer_nonce: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        self.mac(b"d", role, acceptor_nonce, dialer_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    pub fn acceptor_proof(
        &self,
        role: Role,
        dialer_nonce: &[u8; NONCE_LEN],
        acceptor_nonce: &[u8; NONCE_LEN],
    ) -> [u8; PROOF_LEN] {
        self.mac(b"a", role, dialer_nonce, acceptor_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Constant-time check of a dialer's proof.
    pub fn verify_dialer(
        &self,
        role: Role,
        acceptor_nonce: &[u8; NONCE_LEN],
        dialer_nonce: &[u8; NONCE_LEN],
        proof: &[u8],
    ) -> bool {
        self.mac(b"d", role, acceptor_nonce, dialer_nonce)
            .verify_slice(proof)
            .is_ok()
    }

    /// Constant-time check of an acceptor's proof.
    pub fn verify_acceptor(
        &self,
        role: Role,
        dialer_nonce: &[u8; NONCE_LEN],
        acceptor_nonce: &[u8; NONCE_LEN],
        proof: &[u8],
    ) -> bool {
        self.mac(b"a", role, dialer_nonce, acceptor_nonce)
            .verify_slice(proof)
            .is_ok()
    }
}

impl Secret {
    /// Reads a secret file, as ssh reads a private key: a file that its group or others
    /// may read (or write) is refused, since anyone who can read it can join the job.
    pub fn read_file(path: &std::path::Path) -> Result<Secret, String> {
        let bytes = Self::read_file_bytes(path)?;
        Secret::new(bytes).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The bytes of a secret file, refused (with the `chmod` that fixes it) when anyone
    /// but its owner may read or write it. Every reader of secret files goes through
    /// this: the Rust side and, through the native module, the Python one.
    pub fn read_file_bytes(path: &std::path::Path) -> Result<Vec<u8>, String> {
        let shown = path.display();
        let file = std::fs::File::open(path).map_err(|e| format!("{shown}: {e}"))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // The mode of the file opened, not of whatever the path names a moment later.
            let meta = file.metadata().map_err(|e| format!("{shown}: {e}"))?;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(format!(
                    "{shown}: permissions {mode:04o} are too open; the secret file must be readable by its owner only (chmod 600 {shown})"
                ));
            }
        }
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut bytes).map_err(|e| format!("{shown}: {e}"))?;
        Ok(bytes)
    }
}

impl Secret {
    /// A key derived from this secret for one purpose (`label`); the secret itself is
    /// never used for two things.
    pub fn derive(&self, label: &[u8]) -> [u8; 32] {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(b"eccl-derive-v1");
        m.update(label);
        m.finalize().into_bytes().into()
    }
}

pub use crate::link_keys::{LinkKeys, WorldKeys};

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the job secret has {0} bytes: give a key of 64 hex digits (eccl-master makes such a file) or a passphrase of at least 16 characters")]
    WeakSecret(usize),
    #[error("not an eccl handshake (bad magic)")]
    BadMagic,
    #[error("protocol version {theirs} is not this build's version {ours}")]
    Version { ours: u16, theirs: u16 },
    #[error("unknown connection role {0}")]
    BadRole(u8),
    #[error("the other side did not prove it holds the job secret")]
    BadProof,
    #[error("the other side refused our proof: the job secret differs")]
    Rejected,
    #[error("expected role {expected:?}, the dialer asked for {got:?}")]
    WrongRole { expected: Role, got: Role },
}

pub struct ServerHello {
    pub version: u16,
    pub nonce: [u8; NONCE_LEN],
}

impl ServerHello {
    pub fn encode(&self) -> [u8; SERVER_HELLO_LEN] {
        let mut b = [0u8; SERVER_HELLO_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8; SERVER_HELLO_LEN]) -> Result<ServerHello, AuthError> {
        if b[..8] != MAGIC {
            return Err(AuthError::BadMagic);
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[10..]);
        Ok(ServerHello {
            version: u16::from_le_bytes([b[8], b[9]]),
            nonce,
        })
    }
}

pub struct ClientAuth {
    pub version: u16,
    pub role: Role,
    pub nonce: [u8; NONCE_LEN],
    pub proof: [u8; PROOF_LEN],
}

impl ClientAuth {
    pub fn encode(&self) -> [u8; CLIENT_AUTH_LEN] {
        let mut b = [0u8; CLIENT_AUTH_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10] = self.role as u8;
        b[11..11 + NONCE_LEN].copy_from_slice(&self.nonce);
        b[11 + NONCE_LEN..].copy_from_slice(&self.proof);
        b
    }

    pub fn decode(b: &[u8; CLIENT_AUTH_LEN]) -> Result<ClientAuth, AuthError> {
        if b[..8] != MAGIC {
            return Err(AuthError::BadMagic);
        }
        let role = Role::from_u8(b[10]).ok_or(AuthError::BadRole(b[10]))?;
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[11..11 + NONCE_LEN]);
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(&b[11 + NONCE_LEN..]);
        Ok(ClientAuth {
            version: u16::from_le_bytes([b[8], b[9]]),
            role,
            nonce,
            proof,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_secret_role_and_nonces() {
        let s = Secret::new("0123456789abcdef0123").unwrap();
        let other = Secret::new("0123456789abcdef0124").unwrap();
        let (na, nd) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = s.dialer_proof(Role::PeerLink, &na, &nd);
        assert!(s.verify_dialer(Role::PeerLink, &na, &nd, &p));
        assert!(!other.verify_dialer(Role::PeerLink, &na, &nd, &p));
        assert!(!s.verify_dialer(Role::PeerToMaster, &na, &nd, &p));
        assert!(!s.verify_dialer(Role::PeerLink, &nd, &na, &p));
        // The acceptor's proof is not the dialer's (no reflection attack).
        assert!(!s.verify_acceptor(Role::PeerLink, &na, &nd, &p));
        let q = s.acceptor_proof(Role::PeerLink, &nd, &na);
        assert!(s.verify_acceptor(Role::PeerLink, &nd, &na, &q));
    }

    #[test]
    fn weak_and_padded_secrets() {
        assert!(matches!(
            Secret::new("short"),
            Err(AuthError::WeakSecret(5))
        ));
        // 15 bytes: one short of the documented 16.
        assert!(matches!(
            Secret::new("0123456789abcde"),
            Err(AuthError::WeakSecret(15))
        ));
        // A long passphrase is stretched too (only eccl's own hex keys are used as they
        // are): its bytes are not the key.
        let phrase = "correct horse battery staple, twice over";
        assert_ne!(Secret::new(phrase).unwrap().0, phrase.as_bytes());
        let key = "ab".repeat(32);
        assert_eq!(Secret::new(key.as_str()).unwrap().0, key.as_bytes());
        let a = Secret::new("  0123456789abcdef\n").unwrap();
        let b = Secret::new("0123456789abcdef").unwrap();
        let n = [0u8; NONCE_LEN];
        assert_eq!(
            a.dialer_proof(Role::PeerLink, &n, &n),
            b.dialer_proof(Role::PeerLink, &n, &n)
        );
        assert!(!format!("{a:?}").contains("0123"));
    }

    #[test]
    fn handshake_messages_round_trip() {
        let h = ServerHello {
            version: 1,
            nonce: [7; NONCE_LEN],
        };
        let d = ServerHello::decode(&h.encode()).unwrap();
        assert_eq!((d.version, d.nonce), (1, [7; NONCE_LEN]));
        let c = ClientAuth {
            version: 1,
            role: Role::MasterToMaster,
            nonce: [3; NONCE_LEN],
            proof: [4; PROOF_LEN],
        };
        let e = c.encode();
        let d = ClientAuth::decode(&e).unwrap();
        assert_eq!(
            (d.role, d.nonce, d.proof),
            (Role::MasterToMaster, [3; NONCE_LEN], [4; PROOF_LEN])
        );
        let mut bad = e;
        bad[10] = 9;
        assert!(matches!(
            ClientAuth::decode(&bad),
            Err(AuthError::BadRole(9))
        ));
        bad[0] = b'X';
        assert!(matches!(ClientAuth::decode(&bad), Err(AuthError::BadMagic)));
    }
}
