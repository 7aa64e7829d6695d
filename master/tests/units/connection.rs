//! Unit tests of `eccl_master::connection`.

use eccl_master::connection::*;
use eccl_master::registry::Command;
use eccl_protocol::{RegisterRequest, PROTOCOL_VERSION};
use std::net::SocketAddr;

fn request(advertise_host: Option<&str>) -> RegisterRequest {
    RegisterRequest {
        listen_port: 4000,
        quic_port: Some(4001),
        shm_name: Some("eccl-1".into()),
        advertise_host: advertise_host.map(str::to_string),
        host: "h1".into(),
        rank_hint: Some(2),
        protocol_version: PROTOCOL_VERSION,
    }
}

#[test]
fn a_peer_is_reached_where_it_says_or_where_it_came_from() {
    let remote: SocketAddr = "10.0.0.7:55555".parse().unwrap();
    let addrs = |r: &RegisterRequest| match registration(r, remote, [0; 32]) {
        Command::Register { addr, quic, .. } => (addr, quic),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        addrs(&request(None)),
        ("10.0.0.7:4000".into(), Some("10.0.0.7:4001".into()))
    );
    assert_eq!(
        addrs(&request(Some("192.168.1.9"))),
        ("192.168.1.9:4000".into(), Some("192.168.1.9:4001".into()))
    );
    assert_eq!(
        addrs(&request(Some("::1"))),
        ("[::1]:4000".into(), Some("[::1]:4001".into()))
    );
    assert_eq!(
        addrs(&request(Some("node-3.cluster"))),
        (
            "node-3.cluster:4000".into(),
            Some("node-3.cluster:4001".into())
        )
    );
}

#[test]
fn registrations_with_huge_or_odd_names_are_refused() {
    assert!(bad_registration(&request(None)).is_none());
    let mut r = request(None);
    r.host = "x".repeat(257);
    assert!(bad_registration(&r).is_some());
    let mut r = request(None);
    r.shm_name = Some("../../etc".into());
    assert!(bad_registration(&r).is_some());
    let mut r = request(Some(&"y".repeat(300)));
    r.host = "h".into();
    assert!(bad_registration(&r).is_some());
}
