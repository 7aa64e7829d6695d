//! Link keys: what each member of an epoch proves and checks when members dial each
//! other, derived by the masters from their link key ([`LinkKeys`] for one member,
//! [`WorldKeys`] for a whole world at once).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// What a member needs to prove, per epoch, that it is the member the master admitted
/// when it dials another, and to check who dials it. Only masters hold the key these
/// come from, and each member gets only its own, over its TLS control connection: a
/// process that holds the job secret but is not a member of the epoch (an evicted peer,
/// a stranger that registered) cannot pass for one, and a member can only forge links
/// to itself.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkKeys {
    /// Checks the proofs of members that dial this one.
    pub accept: [u8; 32],
    /// This member's proof for each member it dials (those with a larger peer id). On
    /// the wire one byte string (peer id and proof, 40 bytes each), not 32 elements per
    /// proof: a member of a thousand gets about 500.
    #[serde(with = "dial_wire")]
    pub dial: Vec<(crate::PeerId, [u8; 32])>,
}

impl LinkKeys {
    /// The acceptor key of member `acceptor` in `epoch`, from the masters' link key.
    pub fn accept_key(master_key: &[u8; 32], epoch: u64, acceptor: crate::PeerId) -> [u8; 32] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(master_key).expect("any key length");
        m.update(b"eccl-link-accept-v1");
        m.update(&epoch.to_le_bytes());
        m.update(&acceptor.0.to_le_bytes());
        m.finalize().into_bytes().into()
    }

    fn proof_mac(
        accept: &[u8; 32],
        from: crate::PeerId,
        to: crate::PeerId,
        epoch: u64,
    ) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(accept).expect("any key length");
        m.update(b"eccl-link-dial-v1");
        m.update(&from.0.to_le_bytes());
        m.update(&to.0.to_le_bytes());
        m.update(&epoch.to_le_bytes());
        m
    }

    /// The proof that `from` may open a link to `to` in `epoch`, under `to`'s acceptor
    /// key.
    pub fn dial_proof(
        accept: &[u8; 32],
        from: crate::PeerId,
        to: crate::PeerId,
        epoch: u64,
    ) -> [u8; 32] {
        Self::proof_mac(accept, from, to, epoch)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Constant-time check of a dialer's proof against this member's acceptor key.
    pub fn verify(&self, from: crate::PeerId, to: crate::PeerId, epoch: u64, proof: &[u8]) -> bool {
        Self::proof_mac(&self.accept, from, to, epoch)
            .verify_slice(proof)
            .is_ok()
    }

    /// The keys the masters give member `me` of `world` (for one member; a master that
    /// answers every member of a world makes [`WorldKeys`] once).
    pub fn for_member(master_key: &[u8; 32], world: &crate::World, me: crate::PeerId) -> LinkKeys {
        WorldKeys::new(master_key, world).for_member(me)
    }

    /// This member's proof for dialing `to`.
    pub fn proof_for(&self, to: crate::PeerId) -> Option<[u8; 32]> {
        self.dial.iter().find(|(p, _)| *p == to).map(|(_, t)| *t)
    }
}

/// [`LinkKeys::dial`] as one byte string.
mod dial_wire {
    use serde::de::{Error, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    use crate::PeerId;

    const ENTRY: usize = 8 + 32;

    pub fn serialize<S: Serializer>(v: &[(PeerId, [u8; 32])], s: S) -> Result<S::Ok, S::Error> {
        let mut b = Vec::with_capacity(v.len() * ENTRY);
        for (p, proof) in v {
            b.extend_from_slice(&p.0.to_le_bytes());
            b.extend_from_slice(proof);
        }
        s.serialize_bytes(&b)
    }

    fn parse<E: Error>(b: &[u8]) -> Result<Vec<(PeerId, [u8; 32])>, E> {
        if !b.len().is_multiple_of(ENTRY) {
            return Err(E::custom(format!(
                "link proofs of {} bytes (not a multiple of {ENTRY})",
                b.len()
            )));
        }
        Ok(b.chunks_exact(ENTRY)
            .map(|e| {
                let (id, proof) = e.split_at(8);
                (
                    PeerId(u64::from_le_bytes(id.try_into().expect("8 bytes"))),
                    proof.try_into().expect("32 bytes"),
                )
            })
            .collect())
    }

    struct Bytes;

    impl<'de> Visitor<'de> for Bytes {
        type Value = Vec<(PeerId, [u8; 32])>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("link proofs as bytes")
        }

        fn visit_bytes<E: Error>(self, b: &[u8]) -> Result<Self::Value, E> {
            parse(b)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            // Self-describing formats (JSON) write bytes as a list of numbers.
            let mut b = Vec::new();
            while let Some(x) = seq.next_element::<u8>()? {
                b.push(x);
            }
            parse(&b)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<(PeerId, [u8; 32])>, D::Error> {
        d.deserialize_bytes(Bytes)
    }
}

/// Every member's acceptor key of one world, keyed once: the link keys of all its members
/// cost one HMAC per pair that dials (a proof), not three (two acceptor keys and the
/// proof, each keyed afresh), which at a thousand members is most of what an epoch change
/// costs the master.
pub struct WorldKeys {
    master_key: [u8; 32],
    epoch: u64,
    /// (member, its acceptor key, an HMAC already keyed with it), by peer id.
    members: Vec<(crate::PeerId, [u8; 32], Hmac<Sha256>)>,
}

impl WorldKeys {
    pub fn new(master_key: &[u8; 32], world: &crate::World) -> WorldKeys {
        let epoch = world.epoch;
        let mut members: Vec<_> = world
            .members
            .iter()
            .map(|m| {
                let accept = LinkKeys::accept_key(master_key, epoch, m.peer_id);
                let mac = <Hmac<Sha256> as Mac>::new_from_slice(&accept).expect("any key length");
                (m.peer_id, accept, mac)
            })
            .collect();
        members.sort_unstable_by_key(|(p, _, _)| *p);
        WorldKeys {
            master_key: *master_key,
            epoch,
            members,
        }
    }

    /// Member `me`'s keys: its acceptor key and its proof for each member with a larger
    /// peer id, which it dials.
    pub fn for_member(&self, me: crate::PeerId) -> LinkKeys {
        let start = self.members.partition_point(|(p, _, _)| *p <= me);
        let accept = match start.checked_sub(1).map(|i| &self.members[i]) {
            Some((p, key, _)) if *p == me => *key,
            _ => LinkKeys::accept_key(&self.master_key, self.epoch, me),
        };
        LinkKeys {
            accept,
            dial: self.members[start..]
                .iter()
                .map(|(to, _, mac)| {
                    let mut m = mac.clone();
                    m.update(b"eccl-link-dial-v1");
                    m.update(&me.0.to_le_bytes());
                    m.update(&to.0.to_le_bytes());
                    m.update(&self.epoch.to_le_bytes());
                    (*to, m.finalize().into_bytes().into())
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn world_keys_are_the_per_member_keys() {
        let master = [7u8; 32];
        // Peer ids out of rank order, as after joins and leaves.
        let ids = [40u64, 3, 17, 99, 8];
        let world = crate::World {
            epoch: 12,
            members: ids
                .iter()
                .enumerate()
                .map(|(r, id)| crate::Member {
                    peer_id: crate::PeerId(*id),
                    rank: crate::Rank(r as u32),
                    addr: String::new(),
                    host: String::new(),
                    quic: None,
                    shm: None,
                })
                .collect(),
            ring: vec![],
            stripes: vec![],
            tuned: vec![],
        };
        let all = WorldKeys::new(&master, &world);
        for me in ids.iter().copied().chain([1, 50]).map(crate::PeerId) {
            let k = all.for_member(me);
            assert_eq!(k.accept, LinkKeys::accept_key(&master, 12, me));
            let mut want: Vec<_> = ids
                .iter()
                .copied()
                .map(crate::PeerId)
                .filter(|p| *p > me)
                .collect();
            want.sort();
            assert_eq!(k.dial.iter().map(|(p, _)| *p).collect::<Vec<_>>(), want);
            for (to, proof) in &k.dial {
                assert_eq!(
                    *proof,
                    LinkKeys::dial_proof(&LinkKeys::accept_key(&master, 12, *to), me, *to, 12)
                );
                // The member it dials accepts the proof, and only from `me`, in epoch 12.
                let theirs = all.for_member(*to);
                assert!(theirs.verify(me, *to, 12, proof));
                assert!(!theirs.verify(crate::PeerId(me.0 + 1000), *to, 12, proof));
                assert!(!theirs.verify(me, *to, 13, proof));
            }
            // Through the wire codec and JSON: the same keys; proofs cut short are an
            // error.
            let bytes = crate::codec::encode(&k).unwrap();
            assert_eq!(crate::codec::decode::<LinkKeys>(&bytes[4..]).unwrap(), k);
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(serde_json::from_str::<LinkKeys>(&json).unwrap(), k);
            if !k.dial.is_empty() {
                let cut = &bytes[4..bytes.len() - 1];
                assert!(crate::codec::decode::<LinkKeys>(cut).is_err());
            }
        }
    }
}
