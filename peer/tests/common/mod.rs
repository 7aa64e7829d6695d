//! Helpers for end-to-end tests: a real `eccl-master` process and real peer processes,
//! each stopped by PID when the test ends, also when it fails.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const SECRET: &str = "e2e-test-secret-0123456789abcdef";

/// A peer's configuration for in-process communicators against `master`, with deadlines
/// short enough that a hang fails the test instead of stalling it.
pub fn peer_cfg(master: &str) -> eccl::Config {
    eccl::Config {
        master: master.to_string(),
        secret: Some(eccl::Secret::new(SECRET).unwrap()),
        timeout: Duration::from_secs(8),
        connect_timeout: Duration::from_secs(5),
        join_timeout: Duration::from_secs(20),
        ..Default::default()
    }
}

/// `n` in-process communicators in their first world, sorted by rank.
pub async fn world(master: &str, n: u32) -> Vec<eccl::Communicator> {
    world_with(master, n, |_| {}).await
}

/// [`world`], with `tune` applied to each peer's configuration first.
pub async fn world_with(
    master: &str,
    n: u32,
    tune: impl Fn(&mut eccl::Config) + Copy,
) -> Vec<eccl::Communicator> {
    let mut comms = futures::future::join_all((0..n).map(|r| async move {
        let mut c = peer_cfg(master);
        tune(&mut c);
        c.rank_hint = Some(r);
        c.min_world = n;
        let mut comm = eccl::Communicator::connect(c).await.expect("connect");
        comm.update_topology().await.expect("first world");
        comm
    }))
    .await;
    comms.sort_by_key(|c| c.rank());
    comms
}

pub fn bench_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_eccl-bench"))
}

pub fn master_bin() -> PathBuf {
    let p = bench_bin().with_file_name("eccl-master");
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --release --workspace` first",
        p.display()
    );
    p
}

/// A loopback port nothing listens on now, for a process started later (a master whose
/// address the others must know first, or a restarted one that must get its port back):
/// below the ephemeral range, see [`eccl::port_to_listen_later`].
pub fn free_port() -> u16 {
    eccl::port_to_listen_later([127, 0, 0, 1].into()).expect("a free loopback port")
}

/// A child process killed and reaped on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub struct Master {
    pub addr: String,
    pub proc: Proc,
}

/// Reads the client address an `eccl-master` child prints on its first line.
pub fn master_addr(child: &mut Child) -> String {
    read_master_addr(child).unwrap_or_else(|e| panic!("{e}"))
}

/// The client address an `eccl-master` child prints on its first line, or why there is
/// none (it exited first: its status says how).
pub fn read_master_addr(child: &mut Child) -> Result<String, String> {
    let line = BufReader::new(child.stdout.take().expect("the master's stdout is piped"))
        .lines()
        .next();
    let Some(Ok(line)) = line else {
        let status = child.wait();
        return Err(format!(
            "eccl-master ended before it printed its address ({status:?})"
        ));
    };
    line.strip_prefix("eccl-master listening on ")
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_string)
        .ok_or_else(|| format!("eccl-master said {line:?}"))
}

pub fn start_master(extra: &[&str]) -> Master {
    let mut child = Command::new(master_bin())
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .env("ECCL_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start eccl-master");
    let addr = master_addr(&mut child);
    Master {
        addr,
        proc: Proc(child),
    }
}

/// Runs `n` eccl-bench peers against `master` and returns their exit codes and output.
pub fn run_bench(
    master: &str,
    n: u32,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> Vec<(Option<i32>, String)> {
    run_bench_ranks(
        master,
        n,
        args,
        |_| {
            env.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        },
        limit,
    )
}

/// As [`run_bench`], with each rank's own environment.
pub fn run_bench_ranks(
    master: &str,
    n: u32,
    args: &[&str],
    env: impl Fn(u32) -> Vec<(String, String)>,
    limit: Duration,
) -> Vec<(Option<i32>, String)> {
    let mut procs: Vec<Proc> = (0..n)
        .map(|r| {
            let mut c = Command::new(bench_bin());
            c.args(args)
                .args([
                    "--master",
                    master,
                    "--world-size",
                    &n.to_string(),
                    "--rank-hint",
                    &r.to_string(),
                ])
                .env("ECCL_SECRET", SECRET)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env(r) {
                c.env(k, v);
            }
            Proc(c.spawn().expect("start eccl-bench"))
        })
        .collect();
    let start = Instant::now();
    let mut codes: Vec<Option<Option<i32>>> = vec![None; procs.len()];
    while codes.iter().any(Option::is_none) && start.elapsed() < limit {
        for (i, p) in procs.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Ok(Some(st)) = p.0.try_wait() {
                    codes[i] = Some(st.code());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    procs
        .iter_mut()
        .zip(codes)
        .map(|(p, c)| {
            let _ = p.0.kill();
            let out = p.0.wait_with_output_ref();
            (
                c.flatten().or(if c.is_none() { Some(-999) } else { None }),
                out,
            )
        })
        .collect()
}

trait OutputRef {
    fn wait_with_output_ref(&mut self) -> String;
}

impl OutputRef for Child {
    fn wait_with_output_ref(&mut self) -> String {
        use std::io::Read;
        let _ = self.wait();
        let mut s = String::new();
        if let Some(o) = self.stdout.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        if let Some(e) = self.stderr.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    }
}

/// Asks every member of `comms`, together (`are_peers_pending` is a collective of the
/// world), until the master holds a newcomer for them, up to `within`; panics if it
/// never does. A test that means to admit a newcomer waits for it so, not for a fixed
/// time: on a busy host the newcomer may take longer to register.
pub async fn until_peers_pending(comms: &mut [eccl::Communicator], within: Duration) {
    let end = Instant::now() + within;
    loop {
        let r = futures::future::join_all(comms.iter_mut().map(|c| c.are_peers_pending())).await;
        if r.iter().all(|x| matches!(x, Ok(true))) {
            return;
        }
        assert!(Instant::now() < end, "no newcomer became pending: {r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
