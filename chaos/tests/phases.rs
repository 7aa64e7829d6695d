//! End to end: each run makes one worker fault itself at an exact phase of the protocol
//! (`--inject`, which sets `ECCL_FAULT_INJECT`), or runs a short random schedule, and
//! requires a report with no violation and the fault measured.
//!
//! Runs go one at a time: two at once on a small machine slow each other's calls past
//! the hang limit. Each run paces its workers (`--step-ms 20`, and a shared state of one
//! to four MiB instead of 16): a fault injected at an exact phase fires within the first
//! steps, and what the run checks (the abort, the recovery, exact results after) does not
//! need the workers to spin at full speed for its whole duration, which cost the test
//! command two cores for a minute (7.3 CPU seconds a 4-second run; 1.5 paced).

use std::process::Command;
use std::sync::Mutex;

use serde_json::{json, Value};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs eccl-chaos with `args` (split at spaces), requires a clean run, and returns its
/// JSON report.
fn chaos(name: &str, args: &str) -> Value {
    let _turn = turn();
    chaos_in_turn(name, args)
}

/// This test's turn: no other eccl-chaos run of this binary goes on until it is dropped.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs eccl-chaos with `args` (split at spaces) and `--json FILE`: its exit status,
/// what it printed, and the JSON it wrote (if it did).
fn run_with_json(
    name: &str,
    args: &str,
) -> (std::process::ExitStatus, String, std::io::Result<String>) {
    run_with_json_env(name, args, &[])
}

/// [`run_with_json`] with `envs` set for eccl-chaos and its workers.
fn run_with_json_env(
    name: &str,
    args: &str,
    envs: &[(&str, &str)],
) -> (std::process::ExitStatus, String, std::io::Result<String>) {
    let path = std::env::temp_dir().join(format!("eccl-chaos-{}-{name}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_eccl-chaos"))
        .envs(envs.iter().copied())
        .args(args.split_whitespace())
        .arg("--json")
        .arg(&path)
        .output()
        .expect("eccl-chaos starts");
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&path);
    let _ = std::fs::remove_file(&path);
    (out.status, log, text)
}

/// [`chaos`] for a caller that already holds its [`turn`].
fn chaos_in_turn(name: &str, args: &str) -> Value {
    chaos_in_turn_env(name, args, &[])
}

/// [`chaos_in_turn`] with `envs` set for eccl-chaos and its workers.
fn chaos_in_turn_env(name: &str, args: &str, envs: &[(&str, &str)]) -> Value {
    let (status, log, text) = run_with_json_env(name, args, envs);
    let text = text.unwrap_or_else(|e| panic!("{name}: no report ({e}); {status}\n{log}"));
    let report: Value = serde_json::from_str(&text).expect("the report is JSON");
    assert_eq!(report["violations"], json!([]), "{name}:\n{log}");
    assert!(status.success(), "{name}: {status}\n{log}");
    report
}

fn recorded(report: &Value, path: &[&str]) -> f64 {
    let v = path.iter().fold(report, |v, key| &v[key]);
    v.as_f64()
        .unwrap_or_else(|| panic!("{path:?} not recorded in {report:#}"))
}

/// One kill of initial worker 1 at `spec`, on a world of four with ring-sized buffers
/// (links on the default transport: shared memory, all workers being on this host).
fn one_kill(name: &str, spec: &str) -> Value {
    one_kill_over(name, spec, "auto")
}

fn one_kill_over(name: &str, spec: &str, transport: &str) -> Value {
    let args = format!(
        "--peers 4 --duration 4 --faults none --seed 1 --elements 65536 --state-mb 1 --step-ms 20 --transport {transport} --inject 1={spec}"
    );
    let r = chaos(name, &args);
    assert_eq!(r["faults"]["kill"], 1, "{r:#}");
    recorded(&r, &["abort_latency_ms", "kill", "max"]);
    recorded(&r, &["recovery_ms", "kill", "max"]);
    r
}

#[test]
fn kill_during_the_first_chunk_of_a_collective() {
    one_kill("first-chunk", "first-chunk:kill@5");
}

#[test]
fn kill_in_the_middle_of_a_ring() {
    one_kill("mid-ring", "mid-ring:kill@5");
}

#[test]
fn kill_during_update_topology() {
    one_kill("update-topology", "update-topology:kill@3");
}

#[test]
fn kill_a_source_while_a_newcomer_fetches_the_shared_state() {
    let r = chaos(
        "sync-serve",
        "--peers 3 --duration 8 --faults join --interval-ms 2000 --seed 1 --state-mb 4 --step-ms 20 --inject 0=sync-serve:kill",
    );
    assert_eq!(r["faults"]["kill"], 1, "{r:#}");
    assert!(r["faults"]["join"].as_u64() >= Some(1), "{r:#}");
    recorded(&r, &["join_ms", "max"]);
    recorded(&r, &["recovery_ms", "kill", "max"]);
}

#[test]
fn kill_a_newcomer_while_it_joins() {
    let r = chaos(
        "sync-fetch",
        "--peers 3 --duration 8 --faults join --interval-ms 2000 --seed 1 --state-mb 4 --step-ms 20 --inject join=sync-fetch:kill",
    );
    assert_eq!(r["faults"]["kill"], 1, "{r:#}");
    assert!(r["faults"]["join"].as_u64() >= Some(1), "{r:#}");
    recorded(&r, &["recovery_ms", "kill", "max"]);
}

#[test]
fn a_stopped_peer_holding_its_sockets_is_evicted_within_the_lease() {
    let r = chaos(
        "mid-ring-stop",
        "--peers 3 --duration 4 --faults none --seed 1 --lease-ms 1000 --elements 65536 --state-mb 1 --step-ms 20 --inject 1=mid-ring:stop@5",
    );
    assert_eq!(r["faults"]["hang"], 1, "{r:#}");
    let abort = recorded(&r, &["abort_latency_ms", "hang", "max"]);
    assert!(
        abort <= 1500.0,
        "survivors waited {abort} ms for a peer stopped under a 1000 ms lease"
    );
    recorded(&r, &["recovery_ms", "hang", "max"]);
}

/// A peer cut off the network while its process runs (its veth taken down; every
/// worker in a network namespace of its own): its links and its master connection go
/// silent, the master evicts it when its lease runs out, the survivors recover as for a
/// kill, and once healed it learns of its eviction and registers again. Needs root for
/// the namespaces; without them the run says so and this test only checks that it did.
#[test]
fn a_partitioned_peer_is_evicted_within_the_lease_and_the_others_go_on() {
    let _turn = turn();
    let (status, log, text) = run_with_json(
        "partition",
        "--peers 3 --duration 9 --faults partition --seed 2 --lease-ms 1000 --interval-ms 1000 --state-mb 1",
    );
    if log.contains("partition: skipped") {
        eprintln!("partition not tested: {log}");
        return;
    }
    let r: Value = serde_json::from_str(&text.expect("a report")).expect("JSON");
    assert_eq!(r["violations"], json!([]), "{log}");
    assert!(status.success(), "{status}\n{log}");
    assert!(r["faults"]["partition"].as_u64() >= Some(1), "{r:#}");
    let abort = recorded(&r, &["abort_latency_ms", "partition", "max"]);
    assert!(
        abort <= 1500.0,
        "survivors waited {abort} ms for a peer cut off under a 1000 ms lease\n{log}"
    );
    recorded(&r, &["recovery_ms", "partition", "max"]);
    assert!(
        log.contains("cut off the network") && log.contains(": evicted"),
        "{log}"
    );
}

/// Members leave from the middle of a shared-state sync (dropping the call while the
/// master plans it or while they serve a newcomer's catch-up), each beside a newcomer:
/// the newcomer's fetch goes on from the other sources, and every result stays exact.
#[test]
fn members_leave_in_the_middle_of_a_sync_and_newcomers_still_catch_up() {
    let r = chaos(
        "leave-in-sync",
        "--peers 4 --duration 10 --faults leave-during-sync --seed 2 --interval-ms 1500 --state-mb 16",
    );
    assert!(
        r["faults"]["leave_during_sync"].as_u64() >= Some(1),
        "{r:#}"
    );
    assert!(r["faults"]["join"].as_u64() >= Some(1), "{r:#}");
    recorded(&r, &["join_ms", "max"]);
}

/// The same kill and stop in the middle of a ring, with links over TCP and over QUIC
/// (the default run above uses shared memory).
#[test]
fn kill_and_stop_mid_ring_over_tcp_and_quic() {
    for t in ["tcp", "quic"] {
        let r = one_kill_over(&format!("mid-ring-{t}"), "mid-ring:kill@5", t);
        assert_eq!(r["transport"], t, "{r:#}");
        let r = chaos(
            &format!("mid-ring-stop-{t}"),
            &format!("--peers 3 --duration 4 --faults none --seed 1 --lease-ms 1000 --elements 65536 --state-mb 1 --step-ms 20 --transport {t} --inject 1=mid-ring:stop@5"),
        );
        assert_eq!(r["faults"]["hang"], 1, "{t}: {r:#}");
        let abort = recorded(&r, &["abort_latency_ms", "hang", "max"]);
        assert!(
            abort <= 1500.0,
            "{t}: survivors waited {abort} ms under a 1000 ms lease"
        );
    }
}

/// Striped links (four TCP connections each, `ECCL_NSTREAMS=4`: frames dealt across
/// them and put back in order) under a kill and a stop in the middle of a ring: exact
/// results, no divergence, and the survivors go on as over one connection.
#[test]
fn striped_links_keep_every_guarantee_under_a_kill_and_a_stop() {
    let _turn = turn();
    let striped = [("ECCL_NSTREAMS", "4")];
    let r = chaos_in_turn_env(
        "striped-kill",
        "--peers 4 --duration 4 --faults none --seed 1 --elements 65536 --state-mb 1 --step-ms 20 --transport tcp --inject 1=mid-ring:kill@5",
        &striped,
    );
    assert_eq!(r["faults"]["kill"], 1, "{r:#}");
    recorded(&r, &["recovery_ms", "kill", "max"]);
    let r = chaos_in_turn_env(
        "striped-stop",
        "--peers 3 --duration 4 --faults none --seed 1 --lease-ms 1000 --elements 65536 --state-mb 1 --step-ms 20 --transport tcp --inject 1=mid-ring:stop@5",
        &striped,
    );
    assert_eq!(r["faults"]["hang"], 1, "{r:#}");
    let abort = recorded(&r, &["abort_latency_ms", "hang", "max"]);
    assert!(
        abort <= 1500.0,
        "survivors waited {abort} ms under a 1000 ms lease"
    );
}

/// `ECCL_TOPOLOGY=optimize`: every world change is followed by a measurement of the links
/// and a world at the next epoch whose collectives follow the solved ring; kills, joins
/// and leaves land during those measurements too. Every result stays exact, nothing
/// diverges or hangs.
/// Whether network namespaces can be made here (root, iproute2, a kernel with them).
fn namespaces_possible() -> bool {
    let ns = format!("eccl-phases-probe-{}", std::process::id());
    let made = Command::new("ip")
        .args(["netns", "add", &ns])
        .output()
        .is_ok_and(|o| o.status.success());
    if made {
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
    }
    made
}

/// Kills, joins and leaves while every world change measures the links again
/// (`ECCL_TOPOLOGY=optimize`), in the lab's slow-pair scenario where namespaces can be
/// made: every worker a host of its own, and the links between workers 0 and 1 and
/// between 2 and 3 slower than the rest (`--slow-links`), so the measured matrix
/// differs per link and the solved ring leaves rank order.
#[test]
fn faults_while_the_links_are_measured_again_at_every_world_change() {
    let _turn = turn();
    let mut args =
        "--peers 4 --duration 8 --seed 11 --faults kill,join,leave --transport tcp --interval-ms 1500"
            .to_string();
    if namespaces_possible() {
        args += " --netns --slow-links 0-1,2-3 --slow-rate 50mbit";
    } else {
        eprintln!("the lab's slow links not tested: network namespaces cannot be made here");
    }
    let r = chaos_in_turn_env("optimize-faults", &args, &[("ECCL_TOPOLOGY", "optimize")]);
    let faults: u64 = ["kill", "join", "leave"]
        .iter()
        .map(|k| r["faults"][k].as_u64().unwrap_or(0))
        .sum();
    assert!(faults >= 2, "{r:#}");
}

/// The report's timeline holds the run (epochs with their members, steps per second,
/// every fault where the counts say) and the picture draws it.
fn check_timeline(r: &Value, svg: &str) {
    let t = &r["timeline"];
    let members = t["members"].as_array().expect("members");
    assert!(members.len() >= 2, "a kill makes a new epoch: {t:#}");
    for m in members {
        let (at, n) = (m[0].as_f64().unwrap(), m[2].as_u64().unwrap());
        assert!(
            (0.0..=r["duration_s"].as_f64().unwrap()).contains(&at) && (2..=6).contains(&n),
            "{m}"
        );
    }
    let rate = t["steps_per_s"].as_array().expect("steps_per_s");
    let bin = t["bin_s"].as_f64().unwrap();
    let steps: f64 = rate.iter().map(|p| p[1].as_f64().unwrap() * bin).sum();
    assert_eq!(
        steps.round() as u64,
        r["steps"].as_u64().unwrap(),
        "every step in one bin: {t:#}"
    );
    let faults = t["faults"].as_array().unwrap();
    for kind in ["kill", "hang", "join"] {
        let counted = r["faults"][kind].as_u64().unwrap();
        let listed = faults.iter().filter(|f| f["kind"] == kind).count() as u64;
        assert_eq!(listed, counted, "{kind}: {t:#}");
    }
    let kill = faults.iter().find(|f| f["kind"] == "kill").unwrap();
    assert!(
        kill["abort_ms"].as_f64().is_some() && kill["recovery_ms"].as_f64().is_some(),
        "{kill}"
    );
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for text in [
        "members of the epoch",
        "steps per second",
        "seconds since the start",
        "kill",
        "abort",
        "recovery",
    ] {
        assert!(svg.contains(text), "the picture has no {text:?}");
    }
}

/// Shared memory leaves nothing behind: after a run with kills and hangs, /dev/shm holds
/// what it held before and no process of the run is left.
#[test]
fn nothing_is_left_behind_after_kills_over_shm() {
    let listing = || {
        let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    // The turn is held from the first listing to the last scan, so that another test's
    // run cannot add to either.
    let _turn = turn();
    let before = listing();
    // The run also draws its picture (--plot), checked below against its timeline.
    let svg = std::env::temp_dir().join(format!("eccl-chaos-{}-shm.svg", std::process::id()));
    let r = chaos_in_turn(
        "shm-residue",
        &format!("--peers 4 --duration 12 --faults kill,hang,join --interval-ms 1500 --seed 3 --state-mb 4 --step-ms 20 --transport shm --plot {}", svg.display()),
    );
    assert!(r["faults"]["kill"].as_u64() >= Some(1), "{r:#}");
    assert_eq!(listing(), before, "/dev/shm changed");
    let picture = std::fs::read_to_string(&svg).expect("--plot wrote its file");
    let _ = std::fs::remove_file(&svg);
    check_timeline(&r, &picture);
    let exe = env!("CARGO_BIN_EXE_eccl-chaos");
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.starts_with(exe) && (c.contains(" worker ") || c.contains(" master ")))
        .collect();
    assert!(left.is_empty(), "processes of the run are left: {left:?}");
}

#[test]
#[ignore = "the test command's chaos pass plays the same faults on 4 peers for longer, with a fresh seed each run; run with --ignored for seed 7"]
fn a_short_random_run_stays_exact() {
    let r = chaos(
        "random",
        "--peers 4 --duration 10 --interval-ms 1000 --faults kill,hang,join,leave --seed 7",
    );
    let faults: u64 = ["kill", "hang", "join", "leave"]
        .iter()
        .filter_map(|k| r["faults"][k].as_u64())
        .sum();
    assert!(faults >= 2, "{r:#}");
    assert!(r["steps"].as_u64() > Some(10), "{r:#}");
}

/// Found by `--churn`: a member that stops right after an epoch's commit, while the
/// others connect their links to it, held them in update_topology() until it woke (or
/// until the collective timeout: 30 s of a world without progress). The master's abort
/// of that epoch at the stopped member's lease now ends the connect.
#[test]
fn a_member_stopped_while_the_links_of_its_epoch_connect_is_left_behind_at_its_lease() {
    // Occurrence 1 is the world's formation, 2 the epoch that admits the newcomer.
    let r = chaos(
        "connect-stop",
        "--peers 3 --duration 7 --faults join --interval-ms 1500 --seed 1 --lease-ms 1000 --state-mb 1 --step-ms 20 --inject 1=connect:stop@2",
    );
    assert_eq!(r["faults"]["hang"], 1, "{r:#}");
    let abort = recorded(&r, &["abort_latency_ms", "hang", "max"]);
    assert!(
        abort <= 1800.0,
        "survivors waited {abort} ms for a peer stopped under a 1000 ms lease"
    );
    // The stopped peer stays stopped for lease + 1.5 s: the others went on before.
    assert!(recorded(&r, &["longest_stall_ms"]) < 2_500.0, "{r:#}");
}

#[test]
fn churn_strikes_on_a_clock_and_every_result_stays_exact() {
    // PCCL's churn, CI-sized: a fault every 0.3-0.9 s whatever is playing out, so kills
    // land during recoveries and joins during syncs. One at a time (each after the last
    // played out, ~1 s apart here) would fit about half as many into the run. Each step
    // has three all_reduces in flight, as PCCL's test keeps several: a fault must end
    // every one of them.
    let r = chaos(
        "churn",
        "--peers 6 --duration 10 --churn --churn-ms 300-900 --faults kill,hang,join,leave --seed 3 --quiet \
         --in-flight 3",
    );
    assert_eq!(r["in_flight"], 3, "{r:#}");
    let per_commit = recorded(&r, &["all_reduces_per_commit"]);
    assert!((3.0..3.5).contains(&per_commit), "{r:#}");
    let faults: u64 = ["kill", "hang", "join", "leave"]
        .iter()
        .filter_map(|k| r["faults"][k].as_u64())
        .sum();
    assert!(faults >= 8, "{faults} faults in 7 s at 0.3-0.9 s: {r:#}");
    let stall = recorded(&r, &["longest_stall_ms"]);
    assert!(stall > 0.0 && stall < 5_000.0, "{r:#}");
    assert!(r["steps"].as_u64() > Some(15), "{r:#}");
}

#[test]
fn bad_flags_exit_with_status_2_and_a_reason() {
    for (args, reason) in [
        ("--peers many", "many"),
        ("--faults kill,explode", "explode"),
        (
            "--peers 3 --inject 3=mid-ring:kill",
            "only 3 initial workers",
        ),
        ("--inject 1=mid-air:kill", "mid-air"),
        ("--lease-ms 2000 --hang-ms 1500", "--hang-ms"),
        ("--faults kill,master-kill", "--masters 3"),
        ("--plot run.png", "*.svg"),
        ("--churn --churn-ms 2000-500", "at most MAX"),
        ("--churn --churn-ms fast", "MIN-MAX"),
        ("--peers 4 --min-live 5", "--min-live 5"),
        ("--faults partition --transport shm", "no shared memory"),
        ("--netns --link-rate fast", "kbit, mbit or gbit"),
        ("--link-rate 1gbit", "--netns"),
        ("--netns --slow-links 1-1", "two different worker slots"),
        ("--slow-links 0-1", "--netns"),
        (
            "--netns --slow-links 0-1 --slow-rate slow",
            "kbit, mbit or gbit",
        ),
        ("--bogus", "--bogus"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_eccl-chaos"))
            .args(args.split_whitespace())
            .output()
            .expect("eccl-chaos starts");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args}: {err}");
        assert!(err.contains(reason), "{args}: {err}");
    }
}

/// Ten minutes of every fault; opt in with `cargo test --release -p eccl-chaos -- --ignored`.
#[test]
#[ignore = "a ten-minute soak"]
fn a_soak_stays_exact() {
    chaos(
        "soak",
        "--soak --peers 4 --faults kill,hang,join,leave --seed 11 --quiet",
    );
}

/// 256 worker processes on one host form a world, step, and take joins and leaves
/// (clean epoch changes, links kept). Before, the first world never formed: every member
/// dialed every other at once (32,640 handshakes), handshakes timed out or were turned
/// away and read as a wrong secret, and each shared-memory dial waited on a thread of its
/// own until the host ran out of threads (a panic in tokio). Leases of 4 s: 256
/// processes share two cores here. Opt in: about a minute and a half.
#[test]
#[ignore = "256 processes for a minute and a half"]
fn two_hundred_fifty_six_peers_form_a_world_and_take_joins_and_leaves() {
    let r = chaos(
        "peers256",
        "--peers 256 --duration 30 --seed 1 --state-mb 1 --elements 64 --faults join,leave --step-ms 100 --lease-ms 4000 --heartbeat-ms 1000 --quiet",
    );
    assert!(recorded(&r, &["steps"]) >= 10.0, "{r:#}");
    assert!(r["faults"]["join"].as_u64() >= Some(1), "{r:#}");
}

/// `eccl-chaos load`: 300 simulated peers register at once with one master, more than
/// it lets authenticate at once (64): every one gets in (the master closes newcomers
/// unheard while the handshakes in progress are young, and they retry; before, it
/// cancelled real peers' handshakes halfway and 25 of 200 failed with "the job secret
/// differs"), forms a world, and keeps its lease through a second of heartbeats.
#[test]
fn a_master_takes_a_storm_of_registrations_and_keeps_every_lease() {
    let _turn = turn();
    let (status, log, text) =
        run_with_json("load", "load --peers 300 --steady-s 1 --concurrency 300");
    assert!(status.success(), "{status}\n{log}");
    let steps: Value = serde_json::from_str(&text.expect("the table as JSON")).expect("JSON");
    assert_eq!(steps[0]["peers"], json!(300), "{log}");
    assert_eq!(steps[0]["worlds"], json!(1), "{log}");
    assert_eq!(steps[0]["lost"], json!(0), "{log}");
    assert_eq!(steps[0]["evicted"], json!(0), "{log}");
    assert_eq!(steps[0]["false_evictions"], json!(0), "{log}");
    assert!(recorded(&steps[0], &["us_per_heartbeat"]) > 0.0, "{log}");
}

/// `eccl-chaos load --masters 3`: 1,000 simulated peers form a world through a raft
/// cluster. The leader, busy building the world's answers, saw its followers'
/// acknowledgements come after openraft's per-RPC limit, failed its leadership check and
/// answered requests "not the leader" while naming itself; the peers that left it were
/// evicted for their closed connections, and every epoch change of this test failed. A
/// leader now checks again while it still leads (`Coordinator::caught_up`).
#[test]
fn a_busy_leader_of_three_masters_keeps_a_thousand_peers() {
    let _turn = turn();
    let (status, log, text) = run_with_json("load3", "load --masters 3 --peers 1000 --steady-s 1");
    assert!(status.success(), "{status}\n{log}");
    let steps: Value = serde_json::from_str(&text.expect("the table as JSON")).expect("JSON");
    assert_eq!(steps[0]["peers"], json!(1000), "{log}");
    assert_eq!(steps[0]["lost"], json!(0), "{log}");
    assert_eq!(steps[0]["false_evictions"], json!(0), "{log}");
}
