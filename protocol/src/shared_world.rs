//! [`SharedWorld`]: the world a master sends to every member of an epoch, encoded once.
//!
//! A master answers each of a world's members with the same world (a thousand members:
//! a thousand answers of about 100 KB each). The world travels as one length-prefixed
//! byte string holding its own bincode encoding, which the first answer encodes and the
//! others copy; a member decodes it as any other part of the message (same limits, every
//! byte used).

use std::sync::{Arc, OnceLock};

use serde::de::{Error, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::types::World;

struct Inner {
    world: World,
    /// The world's encoding, made by the first answer that needs it.
    wire: OnceLock<Vec<u8>>,
}

/// A [`World`] shared by the answers of one epoch; reads as the world it holds.
#[derive(Clone)]
pub struct SharedWorld(Arc<Inner>);

impl SharedWorld {
    pub fn new(world: World) -> SharedWorld {
        SharedWorld(Arc::new(Inner {
            world,
            wire: OnceLock::new(),
        }))
    }

    /// The world, without a copy where this is its only holder (a decoded answer).
    pub fn into_world(self) -> World {
        match Arc::try_unwrap(self.0) {
            Ok(inner) => inner.world,
            Err(shared) => shared.world.clone(),
        }
    }
}

impl From<World> for SharedWorld {
    fn from(world: World) -> SharedWorld {
        SharedWorld::new(world)
    }
}

impl std::ops::Deref for SharedWorld {
    type Target = World;

    fn deref(&self) -> &World {
        &self.0.world
    }
}

impl PartialEq for SharedWorld {
    fn eq(&self, other: &SharedWorld) -> bool {
        self.0.world == other.0.world
    }
}

impl Eq for SharedWorld {}

impl std::fmt::Debug for SharedWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.world.fmt(f)
    }
}

impl Serialize for SharedWorld {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let wire = match self.0.wire.get() {
            Some(w) => w,
            None => {
                let mut w = crate::codec::encode(&self.0.world)
                    .map_err(|e| serde::ser::Error::custom(e.to_string()))?;
                // The codec's length prefix: the byte string has its own.
                w.drain(..4);
                self.0.wire.get_or_init(|| w)
            }
        };
        s.serialize_bytes(wire)
    }
}

struct Bytes;

impl<'de> Visitor<'de> for Bytes {
    type Value = SharedWorld;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an encoded world")
    }

    fn visit_bytes<E: Error>(self, b: &[u8]) -> Result<SharedWorld, E> {
        crate::codec::decode::<World>(b)
            .map(SharedWorld::new)
            .map_err(|e| E::custom(format!("the world: {e}")))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SharedWorld, A::Error> {
        // Self-describing formats (JSON) write bytes as a list of numbers.
        let mut b = Vec::new();
        while let Some(x) = seq.next_element::<u8>()? {
            b.push(x);
        }
        self.visit_bytes(&b)
    }
}

impl<'de> Deserialize<'de> for SharedWorld {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SharedWorld, D::Error> {
        d.deserialize_bytes(Bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};
    use crate::{Member, PeerId, Rank, Tuned};

    fn world(n: u32) -> World {
        World {
            epoch: 9,
            members: (0..n)
                .map(|r| Member {
                    peer_id: PeerId(100 + r as u64),
                    rank: Rank(r),
                    addr: format!("10.0.0.{r}:4000"),
                    host: format!("host-{}", r / 2),
                    quic: (r % 2 == 0).then(|| format!("10.0.0.{r}:4001")),
                    shm: None,
                })
                .collect(),
            ring: (0..n).rev().collect(),
            stripes: vec![(PeerId(100), PeerId(101), 4)],
            tuned: vec![Tuned {
                kind: crate::CollectiveKind::AllReduce,
                up_to: u64::MAX,
                algo: crate::Algo::Ring,
            }],
        }
    }

    #[test]
    fn encoded_once_and_read_back_whole() {
        let w = SharedWorld::new(world(5));
        let a = encode(&(w.clone(), 1u8)).unwrap();
        // A clone (another member's answer) gives the same bytes from the same encoding.
        let again = w.clone();
        assert!(again.0.wire.get().is_some());
        assert_eq!(encode(&(again, 1u8)).unwrap(), a);
        let (back, one): (SharedWorld, u8) = decode(&a[4..]).unwrap();
        assert_eq!((back.into_world(), one), (world(5), 1));
        // JSON, for completeness.
        let json = serde_json::to_string(&w).unwrap();
        assert_eq!(
            *serde_json::from_str::<SharedWorld>(&json).unwrap(),
            world(5)
        );
        // Every truncation of the message is an error, not a panic.
        for cut in 0..a.len() - 4 {
            assert!(decode::<(SharedWorld, u8)>(&a[4..4 + cut]).is_err());
        }
        // A world with bytes of its own left over inside its string is refused.
        let mut inner = encode(&world(2)).unwrap();
        inner.drain(..4);
        inner.push(0);
        let bytes = encode(&serde_bytes_of(&inner)).unwrap();
        assert!(decode::<SharedWorld>(&bytes[4..]).is_err());
    }

    /// A byte string as serde writes one.
    fn serde_bytes_of(b: &[u8]) -> impl Serialize + '_ {
        struct B<'a>(&'a [u8]);
        impl Serialize for B<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
        B(b)
    }
}
