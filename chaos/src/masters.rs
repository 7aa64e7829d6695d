//! The masters of a run: one (a lone master, as `eccl-chaos master` starts it), or a
//! cluster of `--masters N` with data directories, which the orchestrator kills and
//! restarts, or stops and continues. Each master's [`MasterReport`] lines go to the
//! orchestrator's channel; every master process is stopped when the set is dropped.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Sender;

use anyhow::Context;

use crate::fleet::{child_stderr, signal, stop_child, Msg, MASTER_READY};
use crate::master::{MasterReport, CLUSTER_SECRET_ENV, MASTER_REPORT};

struct MasterProc {
    client: String,
    child: Option<Child>,
    /// Closing it ends the master.
    stdin: Option<ChildStdin>,
    stopped: bool,
}

pub struct MasterSet {
    exe: PathBuf,
    secret: String,
    cluster_secret: String,
    /// `--masters` for a cluster; `None` for a lone master.
    spec: Option<String>,
    dir: PathBuf,
    lease_ms: u64,
    heartbeat_ms: u64,
    verbose: bool,
    /// CPUs the masters' threads are pinned to (`eccl-chaos load --master-cpus`); empty:
    /// wherever the scheduler puts them.
    cpus: Vec<usize>,
    tx: Sender<Msg>,
    procs: Vec<MasterProc>,
}

/// A port free on `host`, for a master started later and restarted on the same port after
/// each kill: below the ephemeral range, where no peer's connection can take it while its
/// master is down (see [`eccl::port_to_listen_later`]).
fn free_port(host: &str) -> anyhow::Result<u16> {
    use std::net::ToSocketAddrs;
    let ip = (host, 0)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {host}"))?
        .next()
        .with_context(|| format!("{host} has no address"))?
        .ip();
    Ok(eccl::port_to_listen_later(ip)?)
}

impl MasterSet {
    /// Starts `n` masters and waits until each listens.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        n: usize,
        host: &str,
        exe: PathBuf,
        secret: String,
        lease_ms: u64,
        heartbeat_ms: u64,
        verbose: bool,
        cpus: &[usize],
        tx: Sender<Msg>,
    ) -> anyhow::Result<MasterSet> {
        let dir = std::env::temp_dir().join(format!("eccl-chaos-masters-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let mut set = MasterSet {
            exe,
            secret,
            cluster_secret: eccl_master::secret::generate(),
            spec: None,
            dir,
            lease_ms,
            heartbeat_ms,
            verbose,
            cpus: cpus.to_vec(),
            tx,
            procs: Vec::new(),
        };
        if n > 1 {
            let mut entries = Vec::new();
            for i in 0..n {
                // Peers reach the client address (on a lab's bridge, with --faults
                // partition); the raft listener stays on loopback.
                let (c, r) = (free_port(host)?, free_port("127.0.0.1")?);
                entries.push(format!("{}={host}:{c}/127.0.0.1:{r}", i + 1));
                set.procs.push(MasterProc {
                    client: format!("{host}:{c}"),
                    child: None,
                    stdin: None,
                    stopped: false,
                });
            }
            set.spec = Some(entries.join(","));
        } else {
            set.procs.push(MasterProc {
                client: format!("{host}:0"),
                child: None,
                stdin: None,
                stopped: false,
            });
        }
        for i in 0..n {
            set.spawn(i)?;
        }
        Ok(set)
    }

    pub fn len(&self) -> usize {
        self.procs.len()
    }

    /// The masters' client addresses, comma-separated, as workers are given them.
    pub fn list(&self) -> String {
        self.procs
            .iter()
            .map(|p| p.client.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Node id of master `i`.
    pub fn node(i: usize) -> u64 {
        i as u64 + 1
    }

    /// Starts master `i` (again: a cluster member restarts from its data directory).
    pub fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let node = Self::node(i);
        let mut cmd = Command::new(&self.exe);
        cmd.args(["master", "--listen", &self.procs[i].client])
            .args(["--lease-ms", &self.lease_ms.to_string()])
            .args(["--heartbeat-ms", &self.heartbeat_ms.to_string()])
            .args(["--node-id", &node.to_string()])
            .env("ECCL_SECRET", &self.secret)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(child_stderr(self.verbose));
        if !self.cpus.is_empty() {
            let list: Vec<String> = self.cpus.iter().map(|c| c.to_string()).collect();
            cmd.args(["--cpus", &list.join(",")]);
        }
        if let Some(spec) = &self.spec {
            cmd.args(["--masters", spec])
                .arg("--data-dir")
                .arg(self.dir.join(format!("m{node}")))
                .env(CLUSTER_SECRET_ENV, &self.cluster_secret);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start master {node}"))?;
        let stdout = child.stdout.take().context("master stdout")?;
        let stdin = child.stdin.take();
        // Owned from here on, so that an error below stops it.
        self.procs[i].child = Some(child);
        self.procs[i].stdin = stdin;
        self.procs[i].stopped = false;
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .transpose()
            .context("cannot read the master's address")?
            .unwrap_or_default();
        let addr = first
            .trim()
            .strip_prefix(MASTER_READY)
            .with_context(|| format!("master {node} did not start (it said {first:?})"))?
            .to_string();
        if self.spec.is_none() {
            self.procs[i].client = addr;
        }
        let tx = self.tx.clone();
        std::thread::Builder::new()
            .name(format!("master-{node}"))
            .spawn(move || {
                for line in lines {
                    let Ok(line) = line else { break };
                    let report = line
                        .strip_prefix(MASTER_REPORT)
                        .and_then(|j| serde_json::from_str::<MasterReport>(j).ok());
                    match report {
                        Some(r) => {
                            if tx.send(Msg::Master(r)).is_err() {
                                return;
                            }
                        }
                        None => eprintln!("master {node}: {line}"),
                    }
                }
            })
            .context("cannot start a reader thread")?;
        Ok(())
    }

    /// SIGKILLs master `i`; false if it was not running.
    pub fn kill(&mut self, i: usize) -> bool {
        let p = &mut self.procs[i];
        p.stdin = None;
        p.stopped = false;
        match p.child.take() {
            Some(mut c) => {
                stop_child(&mut c);
                true
            }
            None => false,
        }
    }

    /// SIGSTOPs (`stop`) or SIGCONTs master `i`.
    pub fn pause(&mut self, i: usize, stop: bool) -> anyhow::Result<()> {
        let p = &mut self.procs[i];
        let child = p.child.as_ref().context("the master is not running")?;
        signal(child.id(), if stop { libc::SIGSTOP } else { libc::SIGCONT })?;
        p.stopped = stop;
        Ok(())
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.procs[i].child.as_ref().map(Child::id)
    }

    pub fn stop_all(&mut self) {
        for p in &mut self.procs {
            // Closing stdin asks for a clean exit; the kill makes sure.
            if let Some(mut s) = p.stdin.take() {
                let _ = s.flush();
            }
            if let Some(mut c) = p.child.take() {
                stop_child(&mut c);
            }
        }
    }
}

impl Drop for MasterSet {
    fn drop(&mut self) {
        self.stop_all();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
