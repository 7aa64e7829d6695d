//! The processes of a run: the masters ([`MasterSet`]) and the workers, all started from
//! this binary's hidden subcommands. One thread per worker reads its stdout and sends each event over a
//! channel; the end of a worker's stdout is the first sign that it died. Every process
//! started here is stopped when the [`Fleet`] is dropped, also when the run fails or
//! panics.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};

use crate::event::PeerId;
use anyhow::Context;

use crate::event::{now_ms, Event};
use crate::masters::MasterSet;
use crate::netns::Lab;

/// What the reader threads send.
pub enum Msg {
    Event {
        slot: usize,
        event: Event,
    },
    /// The worker's stdout closed at `t`: its process is exiting.
    Closed {
        slot: usize,
        t: f64,
    },
    /// A master's view of the leader changed.
    Master(crate::master::MasterReport),
}

/// How a worker is doing, as far as the orchestrator is concerned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fate {
    Running,
    /// SIGSTOPped (by us, or by itself through `ECCL_FAULT_INJECT`), or cut off the
    /// network, until `resume_at`.
    Stopped {
        since: f64,
        resume_at: f64,
        /// Cut off the network (a partition) rather than SIGSTOPped: healed, not
        /// continued, at `resume_at`.
        cut: bool,
    },
    /// SIGSTOPped for less than half a lease (a slow peer) until `resume_at`.
    Slowed {
        since: f64,
        resume_at: f64,
    },
    /// Killed by the orchestrator.
    Killed,
    /// Asked to leave.
    Leaving,
    /// Told to stop at a revision.
    Finishing,
    Exited,
}

pub struct Worker {
    pub pid: u32,
    pub spawned: f64,
    /// The latest peer id it registered under.
    pub peer: Option<PeerId>,
    /// Its `ECCL_FAULT_INJECT`, if any.
    pub inject: Option<String>,
    pub fate: Fate,
    child: Child,
    stdin: Option<ChildStdin>,
}

/// How to start workers.
pub struct WorkerSpec {
    pub state_mb: u32,
    pub elements: usize,
    /// All-reduces in flight per step.
    pub in_flight: u32,
    pub step_ms: u64,
    /// Let children write their logs to our stderr.
    pub verbose: bool,
    /// `--transport`: `tls` is TCP with ECCL_TLS=1.
    pub transport: String,
}

pub struct Fleet {
    /// The masters' client addresses, comma-separated.
    pub master_addr: String,
    pub workers: Vec<Worker>,
    pub masters: MasterSet,
    exe: PathBuf,
    secret: String,
    spec: WorkerSpec,
    tx: Sender<Msg>,
    /// Where workers run with `--faults partition` (dropped after the workers are
    /// stopped: fields drop after [`Fleet`]'s own `Drop`).
    pub lab: Option<Lab>,
}

/// The line `eccl-chaos master` prints first; the address follows it.
pub const MASTER_READY: &str = "eccl-chaos master listening on ";

impl Fleet {
    /// Starts `masters` masters with a fresh secret and waits for their addresses.
    /// With a `lab`, every worker runs in a network namespace of its own and the masters
    /// listen on the lab's bridge.
    pub fn start(
        masters: usize,
        lease_ms: u64,
        heartbeat_ms: u64,
        spec: WorkerSpec,
        lab: Option<Lab>,
    ) -> anyhow::Result<(Fleet, Receiver<Msg>)> {
        let exe = std::env::current_exe().context("cannot find this executable")?;
        let secret = eccl_master::secret::generate();
        let (tx, rx) = mpsc::channel();
        let host = lab.as_ref().map_or("127.0.0.1".into(), Lab::master_ip);
        let masters = MasterSet::start(
            masters,
            &host,
            exe.clone(),
            secret.clone(),
            lease_ms,
            heartbeat_ms,
            spec.verbose,
            &[],
            tx.clone(),
        )?;
        let fleet = Fleet {
            master_addr: masters.list(),
            workers: Vec::new(),
            masters,
            exe,
            secret,
            spec,
            tx,
            lab,
        };
        Ok((fleet, rx))
    }

    /// Starts a worker in the next slot and returns the slot.
    pub fn spawn(&mut self, min_world: u32, inject: Option<String>) -> anyhow::Result<usize> {
        let slot = self.workers.len();
        let mut cmd = match &mut self.lab {
            Some(lab) => crate::netns::inside(&lab.host(slot)?, &self.exe),
            None => Command::new(&self.exe),
        };
        cmd.args(["worker", "--master", &self.master_addr])
            .args(["--state-mb", &self.spec.state_mb.to_string()])
            .args(["--elements", &self.spec.elements.to_string()])
            .args(["--in-flight", &self.spec.in_flight.to_string()])
            .args(["--step-ms", &self.spec.step_ms.to_string()])
            .args(["--min-world", &min_world.to_string()])
            .env("ECCL_SECRET", &self.secret)
            .env(
                "ECCL_TRANSPORT",
                if self.spec.transport == "tls" {
                    "tcp"
                } else {
                    &self.spec.transport
                },
            )
            .env(
                "ECCL_TLS",
                if self.spec.transport == "tls" {
                    "1"
                } else {
                    "0"
                },
            )
            .env_remove("ECCL_FAULT_INJECT")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(child_stderr(self.spec.verbose));
        if let Some(spec) = &inject {
            cmd.env("ECCL_FAULT_INJECT", spec);
        }
        let spawned = now_ms();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start worker {slot}"))?;
        let stdout = child.stdout.take().context("worker stdout")?;
        let tx = self.tx.clone();
        std::thread::Builder::new()
            .name(format!("worker-{slot}"))
            .spawn(move || read_events(slot, stdout, tx))
            .context("cannot start a reader thread")?;
        self.workers.push(Worker {
            pid: child.id(),
            spawned,
            peer: None,
            inject,
            fate: Fate::Running,
            stdin: child.stdin.take(),
            child,
        });
        Ok(slot)
    }

    /// Sends a command line to a worker's stdin; false if the worker is gone.
    pub fn tell(&mut self, slot: usize, line: &str) -> bool {
        let w = &mut self.workers[slot];
        w.stdin
            .as_mut()
            .is_some_and(|stdin| writeln!(stdin, "{line}").is_ok())
    }

    /// Sends `sig` to a worker unless it has exited (a reaped child's pid may name
    /// another process by now); false if it had.
    pub fn signal(&mut self, slot: usize, sig: libc::c_int) -> anyhow::Result<bool> {
        let w = &mut self.workers[slot];
        if w.child.try_wait()?.is_some() {
            return Ok(false);
        }
        signal(w.pid, sig)
            .with_context(|| format!("cannot signal worker {slot} (pid {})", w.pid))?;
        Ok(true)
    }

    /// Waits for a worker whose stdout has closed, and marks it exited.
    pub fn reap(&mut self, slot: usize) -> anyhow::Result<ExitStatus> {
        let w = &mut self.workers[slot];
        w.fate = Fate::Exited;
        w.stdin = None;
        w.child
            .wait()
            .with_context(|| format!("cannot wait for worker {slot}"))
    }

    /// Whether a running worker has stopped itself (state `T` in `/proc/PID/stat`).
    pub fn stopped_itself(&self, slot: usize) -> bool {
        let w = &self.workers[slot];
        w.fate == Fate::Running && proc_state(w.pid) == Some('T')
    }

    /// Processes not yet exited, in spawn order.
    pub fn live(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots_where(|f| f != Fate::Exited)
    }

    /// Workers that are running: neither stopped, nor leaving, nor exiting.
    pub fn running(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots_where(|f| f == Fate::Running)
    }

    fn slots_where(&self, f: fn(Fate) -> bool) -> impl Iterator<Item = usize> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter(move |(_, w)| f(w.fate))
            .map(|(slot, _)| slot)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for w in &mut self.workers {
            stop_child(&mut w.child);
        }
        self.masters.stop_all();
    }
}

/// SIGCONT (a stopped process would otherwise keep its sockets) and SIGKILL a child that
/// has not been reaped, then reap it.
pub fn stop_child(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        let _ = signal(child.id(), libc::SIGCONT);
        let _ = signal(child.id(), libc::SIGKILL);
        let _ = child.wait();
    }
}

pub fn signal(pid: u32, sig: libc::c_int) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: kill(2) has no memory effects; the caller names a child it has not reaped.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

pub fn child_stderr(verbose: bool) -> Stdio {
    if verbose {
        Stdio::inherit()
    } else {
        Stdio::null()
    }
}

fn read_events(slot: usize, stdout: std::process::ChildStdout, tx: Sender<Msg>) {
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        match serde_json::from_str(&line) {
            Ok(event) => {
                if tx.send(Msg::Event { slot, event }).is_err() {
                    return;
                }
            }
            Err(_) => eprintln!("worker {slot}: {line}"),
        }
    }
    let _ = tx.send(Msg::Closed { slot, t: now_ms() });
}

/// The state letter of `/proc/PID/stat` (R, S, D, T, Z, ...). The command name before it
/// may hold spaces and parentheses, so the state is read after the last `)`.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_state(&stat)
}

fn parse_state(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_follows_the_last_parenthesis() {
        assert_eq!(parse_state("1234 (eccl-chaos) T 1 1234"), Some('T'));
        assert_eq!(parse_state("99 (a) b (c)) S 1 2"), Some('S'));
        assert_eq!(parse_state("garbage"), None);
    }
}
