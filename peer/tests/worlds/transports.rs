//! Every collective exact over every transport (`eccl-bench -c`: odd counts, world sizes
//! up to 8), each run checked to have used the transport it asked for, and a world that
//! mixes transports: peers that share a host identity talk over shared memory, the
//! others over TCP.

use std::time::Duration;

use crate::common::*;

fn check(
    master: &Master,
    n: u32,
    args: &[&str],
    env: impl Fn(u32) -> Vec<(String, String)>,
    transport: &str,
) {
    let res = run_bench_ranks(&master.addr, n, args, env, Duration::from_secs(90));
    let failed: Vec<String> = res
        .iter()
        .enumerate()
        .filter(|(_, (code, _))| *code != Some(0))
        .map(|(r, (code, out))| format!("--- rank {r} exited {code:?}:\n{out}"))
        .collect();
    assert!(
        failed.is_empty(),
        "{transport} n={n} {args:?}:\n{}",
        failed.join("\n")
    );
    let table = &res[0].1;
    assert!(
        table.contains("Out of bounds values : 0 OK"),
        "{transport} n={n} {args:?}:\n{table}"
    );
    let want = if n == 1 {
        "local".to_string()
    } else {
        transport.to_string()
    };
    assert!(
        table.contains(&format!("transport {want},")),
        "{transport} n={n}: the run did not use {want}:\n{table}"
    );
}

fn env_of(pairs: &[(&str, &str)]) -> impl Fn(u32) -> Vec<(String, String)> {
    let owned: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |_| owned.clone()
}

const COLLECTIVES: [&str; 9] = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
];

fn every_collective(transport: &str, env: &[(&str, &str)]) {
    let m = start_master(&[]);
    for n in [2u32, 3, 5] {
        for coll in COLLECTIVES {
            let root = (n - 1).to_string();
            // Odd counts from 1 element to 343 Ki elements (past a 1 MiB frame and slot).
            let a = [
                coll, "-c", "-n", "1", "-w", "0", "-d", "int32", "-r", &root, "-b", "4", "-e",
                "1400K", "-f", "7",
            ];
            check(&m, n, &a, env_of(env), transport);
        }
        if n % 2 == 0 {
            let a = [
                "sendrecv", "-c", "-n", "2", "-w", "0", "-b", "4", "-e", "1400K", "-f", "49",
            ];
            check(&m, n, &a, env_of(env), transport);
        }
    }
    for coll in ["all_reduce", "all_to_all", "broadcast"] {
        let a = [
            coll, "-c", "-n", "1", "-w", "0", "-b", "12", "-e", "3M", "-f", "17",
        ];
        check(&m, 8, &a, env_of(env), transport);
    }
}

#[test]
fn every_collective_over_tcp() {
    every_collective("tcp", &[("ECCL_TRANSPORT", "tcp")]);
}

#[test]
fn every_collective_over_tls() {
    every_collective("tls", &[("ECCL_TRANSPORT", "tcp"), ("ECCL_TLS", "1")]);
}

#[test]
fn every_collective_over_shm() {
    every_collective("shm", &[("ECCL_TRANSPORT", "shm")]);
}

#[test]
fn every_collective_over_quic() {
    every_collective("quic", &[("ECCL_TRANSPORT", "quic")]);
}

/// Two "hosts" of two peers each (ECCL_HOST_ID): auto links each pair on one host over
/// shm and the others over TCP, and every collective stays exact.
#[test]
fn a_mixed_world_of_shm_and_tcp_links() {
    let m = start_master(&[]);
    let hosts = |r: u32| {
        vec![
            ("ECCL_TRANSPORT".to_string(), "auto".to_string()),
            ("ECCL_HOST_ID".to_string(), format!("host-{}", r / 2)),
        ]
    };
    for coll in COLLECTIVES {
        let a = [
            coll, "-c", "-n", "1", "-w", "0", "-r", "3", "-b", "4", "-e", "3M", "-f", "9",
        ];
        check(&m, 4, &a, hosts, "shm+tcp");
    }
    // And with ECCL_TRANSPORT=shm the cross-host pairs still get TCP (with a warning).
    let forced = |r: u32| {
        vec![
            ("ECCL_TRANSPORT".to_string(), "shm".to_string()),
            ("ECCL_HOST_ID".to_string(), format!("host-{}", r / 2)),
        ]
    };
    let a = [
        "all_reduce",
        "-c",
        "-n",
        "2",
        "-w",
        "0",
        "-b",
        "1M",
        "-e",
        "1M",
    ];
    check(&m, 4, &a, forced, "shm+tcp");
}
