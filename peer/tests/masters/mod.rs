//! A cluster of real `eccl-master` processes on local ports, each with its own data
//! directory and log, for the fail-over tests. Every process is killed by PID when the
//! cluster is dropped, also when a test fails.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use eccl::Communicator;
use futures::future::join_all;

use crate::common::{free_port, master_bin, peer_cfg, read_master_addr, Proc, SECRET};

pub struct Cluster {
    pub dir: PathBuf,
    /// Client addresses, by index (master id = index + 1).
    pub clients: Vec<String>,
    pub rafts: Vec<String>,
    /// The --masters spec the three founding masters share.
    spec: String,
    procs: Vec<Option<Proc>>,
    stopped: Vec<bool>,
}

impl Cluster {
    /// Three masters that form a cluster.
    pub fn start(name: &str) -> Cluster {
        let dir = std::env::temp_dir().join(format!("eccl-masters-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("cluster-secret");
        std::fs::write(&secret, "cluster-test-secret-0123456789abcdef\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut cl = Cluster {
            dir,
            clients: Vec::new(),
            rafts: Vec::new(),
            spec: String::new(),
            procs: Vec::new(),
            stopped: Vec::new(),
        };
        for _ in 0..3 {
            cl.allocate();
        }
        cl.spec = (0..3)
            .map(|i| format!("{}={}/{}", i + 1, cl.clients[i], cl.rafts[i]))
            .collect::<Vec<_>>()
            .join(",");
        for i in 0..3 {
            cl.start_node(i);
        }
        cl
    }

    fn allocate(&mut self) -> usize {
        // free_port() never hands out a port twice.
        let ports = [free_port(), free_port()];
        self.clients.push(format!("127.0.0.1:{}", ports[0]));
        self.rafts.push(format!("127.0.0.1:{}", ports[1]));
        self.procs.push(None);
        self.stopped.push(false);
        self.clients.len() - 1
    }

    /// Starts one more master with `--join`: it waits to be added. Returns its index.
    pub fn start_joiner(&mut self) -> usize {
        let i = self.allocate();
        self.start_node(i);
        i
    }

    pub fn cluster_secret(&self) -> PathBuf {
        self.dir.join("cluster-secret")
    }

    pub fn log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("m{}.log", i + 1))
    }

    /// Starts master `i` (0-based) from its data directory; its log is appended to.
    pub fn start_node(&mut self, i: usize) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log(i))
            .unwrap();
        let mut cmd = Command::new(master_bin());
        cmd.args(["--node-id", &(i + 1).to_string()])
            .args(["--listen", &self.clients[i]]);
        if i < 3 {
            cmd.args(["--masters", &self.spec]);
        } else {
            let own = format!("{}={}/{}", i + 1, self.clients[i], self.rafts[i]);
            cmd.args(["--masters", &own, "--join"]);
        }
        let mut child = cmd
            .arg("--cluster-secret-file")
            .arg(self.cluster_secret())
            .arg("--data-dir")
            .arg(self.dir.join(format!("m{}", i + 1)))
            .env("ECCL_SECRET", SECRET)
            .env("ECCL_DEBUG", "INFO")
            .env("ECCL_DEBUG_SUBSYS", "MASTER")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start eccl-master");
        if let Err(e) = read_master_addr(&mut child) {
            let log = std::fs::read_to_string(self.log(i)).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "master {}: {e}; the end of its log:\n{}",
                i + 1,
                tail.join("\n")
            );
        }
        self.procs[i] = Some(Proc(child));
        self.stopped[i] = false;
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.procs[i].take() {
            if self.stopped[i] {
                self.signal(&p, "CONT");
            }
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
        self.stopped[i] = false;
    }

    fn signal(&self, p: &Proc, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &p.0.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{sig} failed");
    }

    /// SIGSTOP master `i`.
    pub fn stop(&mut self, i: usize) {
        let p = self.procs[i].as_ref().expect("a running master");
        self.signal(p, "STOP");
        self.stopped[i] = true;
    }

    /// SIGCONT master `i`.
    pub fn cont(&mut self, i: usize) {
        let p = self.procs[i].as_ref().expect("a running master");
        self.signal(p, "CONT");
        self.stopped[i] = false;
    }

    /// The client addresses of every master, comma-separated.
    pub fn list(&self) -> String {
        self.clients.join(",")
    }

    /// How often master `i`'s log says it took over, and stepped down.
    pub fn leadership_lines(&self, i: usize) -> (usize, usize) {
        let text = std::fs::read_to_string(self.log(i)).unwrap_or_default();
        (
            text.matches("leading now").count(),
            text.matches("no longer the leader").count(),
        )
    }

    /// The running (not stopped) master that says it leads, waiting up to `limit`.
    pub fn leader(&self, limit: Duration) -> Option<usize> {
        self.leader_other_than(None, limit)
    }

    /// Like [`Cluster::leader`], ignoring master `not`.
    pub fn leader_other_than(&self, not: Option<usize>, limit: Duration) -> Option<usize> {
        let start = Instant::now();
        while start.elapsed() < limit {
            for i in 0..self.procs.len() {
                if self.procs[i].is_none() || self.stopped[i] || Some(i) == not {
                    continue;
                }
                let (up, down) = self.leadership_lines(i);
                if up > down {
                    return Some(i);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Runs `eccl-master cluster ARGS` against `list` with the job secret.
    pub fn cli(&self, list: &str, args: &[&str]) -> Output {
        Command::new(master_bin())
            .arg("cluster")
            .args(args)
            .args(["--master", list])
            .env("ECCL_SECRET", SECRET)
            .output()
            .expect("run eccl-master cluster")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.procs.len() {
            self.kill(i);
        }
        if std::thread::panicking() {
            eprintln!("masters' logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A peer's configuration for a list of masters, with a connect deadline that a
/// fail-over fits in.
pub fn cfg(list: &str) -> eccl::Config {
    let mut c = peer_cfg(list);
    c.connect_timeout = Duration::from_secs(4);
    c
}

/// `n` communicators in their first world, sorted by rank.
pub async fn members(list: &str, n: u32) -> Vec<Communicator> {
    let mut comms = join_all((0..n).map(|r| async move {
        let mut c = cfg(list);
        c.rank_hint = Some(r);
        c.min_world = n;
        let mut comm = Communicator::connect(c).await.expect("connect");
        comm.update_topology().await.expect("first world");
        comm
    }))
    .await;
    comms.sort_by_key(|c| c.rank());
    comms
}
