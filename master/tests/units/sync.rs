//! Unit tests of `eccl_master::sync`.

use eccl_master::sync::*;
use eccl_protocol::{PeerId, SyncStrategy, TensorDigest};

fn rep(peer: u64, revision: u64, role: SyncStrategy, h: u8) -> Report {
    Report {
        peer: PeerId(peer),
        round: 1,
        revision,
        role,
        tensors: vec![TensorDigest {
            name: "w".into(),
            len: 4,
            hash: [h; 32],
            chunks: vec![[h; 32]],
        }],
    }
}
use eccl_protocol::SyncStrategy::*;

fn ids(v: &[u64]) -> Vec<PeerId> {
    v.iter().map(|p| PeerId(*p)).collect()
}

#[test]
fn highest_revision_then_most_popular() {
    let p = plan(&[
        rep(1, 3, EnforcePopular, 1),
        rep(2, 4, EnforcePopular, 2),
        rep(3, 4, EnforcePopular, 3),
        rep(4, 4, EnforcePopular, 3),
        rep(5, 0, EnforcePopular, 0),
    ])
    .unwrap();
    assert_eq!(p.revision, 4);
    assert_eq!(p.target[0].hash, [3; 32]);
    assert_eq!(p.sources, ids(&[3, 4]));
    assert_eq!(p.receivers, ids(&[1, 2, 5]));
}

#[test]
fn ties_go_to_the_smallest_peer_id() {
    let p = plan(&[rep(7, 1, EnforcePopular, 7), rep(2, 1, EnforcePopular, 2)]).unwrap();
    assert_eq!(p.target[0].hash, [2; 32]);
    assert_eq!(p.sources, ids(&[2]));
    assert_eq!(p.receivers, ids(&[7]));
}

#[test]
fn receive_only_never_wins_nor_serves() {
    let p = plan(&[
        rep(1, 9, ReceiveOnly, 9),
        rep(2, 1, EnforcePopular, 1),
        rep(3, 1, ReceiveOnly, 1),
    ])
    .unwrap();
    assert_eq!(p.revision, 1);
    assert_eq!(p.sources, ids(&[2]));
    assert_eq!(p.receivers, ids(&[1]));
}

#[test]
fn send_only_is_authoritative() {
    let p = plan(&[
        rep(1, 1, SendOnly, 5),
        rep(2, 7, EnforcePopular, 2),
        rep(3, 7, EnforcePopular, 2),
    ])
    .unwrap();
    assert_eq!(p.target[0].hash, [5; 32]);
    assert_eq!(p.sources, ids(&[1]));
    assert_eq!(p.receivers, ids(&[2, 3]));
}

#[test]
fn everyone_receive_only_still_agrees() {
    let p = plan(&[rep(1, 0, ReceiveOnly, 1), rep(2, 0, ReceiveOnly, 1)]).unwrap();
    assert!(p.sources.is_empty() && p.receivers.is_empty());
    assert!(plan(&[]).is_none());
}
