//! Bad flags print a one-line reason and the usage, and exit with status 2.

use std::process::Command;

use crate::common::*;

fn run(bin: std::path::PathBuf, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(bin)
        .args(args)
        .env("ECCL_SECRET", SECRET)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bench_rejects_bad_flags_with_a_reason() {
    for (args, needle) in [
        (
            &["all_reduce", "--local", "2", "-b", "12Q"][..],
            "not a size",
        ),
        (
            &["all_reduce", "--local", "2", "-d", "float7"][..],
            "unknown datatype",
        ),
        (&["all_reduce", "--local", "2", "--bogus"][..], "--bogus"),
        (&["warp_drive", "--local", "2"][..], "unknown collective"),
        (
            &["all_reduce", "--local", "2", "-d", "int32", "-o", "avg"][..],
            "not defined",
        ),
        (&["all_reduce"][..], "--local N or --master"),
        (
            &["all_reduce", "--local", "2", "-b", "1M", "-e", "1K"][..],
            "larger than",
        ),
    ] {
        let (code, err) = run(bench_bin(), args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn master_rejects_bad_flags_and_unknown_masters() {
    let (code, err) = run(master_bin(), &["--lease-ms", "soon"]);
    assert_eq!(code, Some(2), "{err}");
    let (code, err) = run(
        master_bin(),
        &[
            "--listen",
            "127.0.0.1:0",
            "--lease-ms",
            "100",
            "--heartbeat-ms",
            "200",
        ],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--heartbeat-ms"), "{err}");
    let (code, err) = run(
        master_bin(),
        &[
            "--listen",
            "127.0.0.1:0",
            "--node-id",
            "4",
            "--masters",
            "1=127.0.0.1:1/:2",
        ],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--node-id"), "{err}");
    // Each master has a client and a raft address.
    let (code, err) = run(master_bin(), &["--masters", "1=127.0.0.1:1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("CLIENT/RAFT"), "{err}");
    // The cluster's own flags go with --masters.
    let (code, err) = run(
        master_bin(),
        &["--listen", "127.0.0.1:0", "--raft-listen", "127.0.0.1:0"],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--masters"), "{err}");
    let (code, _) = run(master_bin(), &["--help"]);
    assert_eq!(code, Some(0));
}
