//! `eccl-chaos load`: how many peers one master (or a raft cluster of them) holds.
//! Simulated peers ([`eccl::sim::SimPeer`]: registration, heartbeats at the master's
//! interval, epoch changes; no links), thousands in this one process, are added in steps
//! (`--peers 1000,2000,5000,10000`); at each step the tool measures, against real
//! masters started as `eccl-chaos master` processes:
//!
//! - registration: how long the step's new peers took to register, all at once;
//! - epoch commits: every peer reconfigures into worlds of at most `--world` members
//!   (a world holds at most 4096), all at once; the time until each world's last member
//!   has its answer (p50 and max over the worlds);
//! - heartbeats: the leader's CPU time over `--steady-s` seconds of heartbeats alone,
//!   per second and per heartbeat, and whether every peer kept its lease (the next
//!   epoch change finds every one of them);
//! - memory: the leader's resident memory, and its growth per peer since it started.
//!
//! The simulated peers share the machine's cores with the masters unless the masters
//! are pinned (`--master-cpus`) and the tool runs on the other cores (taskset): on a
//! small machine the latencies include that contention; the CPU figures are the
//! master's own. Each step also counts the simulated peers' heartbeats that ran a
//! quarter lease late (`late_beats`: the generator fell behind) and the generator's own
//! CPU, and the evicted peers, of which those with no late heartbeat are the master's
//! false evictions.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use eccl::sim::SimPeer;
use eccl::Secret;
use serde::Serialize;
use tokio::task::JoinSet;

use crate::masters::MasterSet;

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// Peer counts to step through (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1000,2000,5000,10000")]
    peers: Vec<usize>,
    /// Masters: 1 (a lone master) or a raft cluster of this many.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=7))]
    masters: u32,
    /// The master's lease on each peer, in milliseconds.
    #[arg(long, default_value_t = 800)]
    lease_ms: u64,
    /// How often peers renew their lease, in milliseconds.
    #[arg(long, default_value_t = 200)]
    heartbeat_ms: u64,
    /// Members per world: the peers are split into worlds of at most this many.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=4096))]
    world: u64,
    /// Seconds of heartbeats alone measured at each step.
    #[arg(long, default_value_t = 10.0)]
    steady_s: f64,
    /// Registrations in flight at once.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Also write the table as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Let the masters log to stderr (ECCL_DEBUG sets the level).
    #[arg(long)]
    verbose: bool,
    /// CPUs the masters run on, comma-separated (their threads pinned there; run the
    /// load generator on the others, e.g. under taskset); default: anywhere.
    #[arg(long, value_delimiter = ',')]
    master_cpus: Vec<usize>,
    /// Threads of the load generator's runtime (the simulated peers); default: one per
    /// CPU this process may run on (e.g. under taskset), at most 16.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
    threads: Option<u64>,
}

/// One step's figures.
#[derive(Debug, Serialize)]
pub struct Step {
    pub peers: usize,
    pub worlds: usize,
    pub register_s: f64,
    pub commit_ms_p50: f64,
    pub commit_ms_max: f64,
    /// An update_topology() round of every member with nothing to change (what an
    /// elastic job's members send at each step boundary): per world, from the start to
    /// its last member's answer.
    pub vote_ms_p50: f64,
    pub vote_ms_max: f64,
    /// The leader's CPU time per second of heartbeats alone.
    pub leader_cpu_pct: f64,
    /// The leader's CPU time per heartbeat, in microseconds.
    pub us_per_heartbeat: f64,
    pub leader_rss_mib: f64,
    /// The leader's resident memory growth per peer since it started.
    pub kib_per_peer: f64,
    /// Peers whose next epoch change failed (a lost lease, a refused vote).
    pub lost: usize,
    /// Heartbeats of the simulated peers that ran a quarter lease or more after their
    /// time during the step (the generator starved): lost leases with none of these are
    /// the master's; with them, they may be the generator's.
    pub late_beats: u64,
    /// The load generator's own CPU time per second of the heartbeats-alone window
    /// (100 = one core).
    pub generator_cpu_pct: f64,
    /// Peers the master evicted during the step (their calls failed `Evicted`; a world
    /// that named one fails its other members' calls too, counted in `lost`).
    pub evicted: usize,
    /// Of them, those with no late heartbeat in the step: their heartbeats left in time,
    /// so the master lost their lease (false evictions).
    pub false_evictions: usize,
}

/// The peers the master evicted, told apart by whether their own heartbeats ran late.
#[derive(Default)]
struct Evictions {
    /// Every peer found evicted so far (each counted once).
    seen: HashSet<eccl::PeerId>,
    /// Each peer's late heartbeats when the step began.
    late_at_start: HashMap<eccl::PeerId, u64>,
    /// This step's evicted peers, and of them those with no late heartbeat in the step.
    evicted: usize,
    false_evictions: usize,
}

impl Evictions {
    fn start_step(&mut self, peers: &[SimPeer]) {
        self.late_at_start = peers
            .iter()
            .map(|p| (p.peer_id, p.late_heartbeats()))
            .collect();
        self.evicted = 0;
        self.false_evictions = 0;
    }

    /// The heartbeats `peers` ran late since the step began.
    fn late_in_step(&self, peers: &[SimPeer]) -> u64 {
        peers
            .iter()
            .map(|p| {
                let before = self.late_at_start.get(&p.peer_id).copied().unwrap_or(0);
                p.late_heartbeats() - before
            })
            .sum()
    }

    /// `p`'s call failed with `err`: counts it if it says `p` itself was evicted.
    fn note(&mut self, p: &SimPeer, err: &eccl::Error) {
        if matches!(err, eccl::Error::Evicted { .. }) && self.seen.insert(p.peer_id) {
            self.evicted += 1;
            let before = self.late_at_start.get(&p.peer_id).copied().unwrap_or(0);
            if p.late_heartbeats() == before {
                self.false_evictions += 1;
            }
        }
    }
}

pub fn main(args: LoadArgs) -> anyhow::Result<()> {
    // The simulated peers' own log (quiet unless ECCL_DEBUG says otherwise).
    eccl::logging::init();
    // A connection per simulated peer.
    eccl::limits::raise_open_files();
    let mut counts = args.peers.clone();
    counts.sort_unstable();
    counts.dedup();
    anyhow::ensure!(
        counts.first().is_some_and(|&n| n > 0),
        "--peers needs counts above 0"
    );
    // Checked here too: a master that cannot pin itself says so on a stderr that is
    // only shown with --verbose.
    // SAFETY: sysconf only reads its argument.
    let configured = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as usize;
    if let Some(c) = args.master_cpus.iter().find(|&&c| c >= configured) {
        anyhow::bail!(
            "--master-cpus: this host has CPUs 0 to {}, not {c}",
            configured - 1
        );
    }
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let secret = eccl_master::secret::generate();
    let (tx, rx) = mpsc::channel();
    // The masters' reports (leader changes) are not needed here.
    std::thread::spawn(move || while rx.recv().is_ok() {});
    let mut masters = MasterSet::start(
        args.masters as usize,
        "127.0.0.1",
        exe,
        secret.clone(),
        args.lease_ms,
        args.heartbeat_ms,
        args.verbose,
        &args.master_cpus,
        tx,
    )?;
    let list = masters.list();
    let threads = match args.threads {
        Some(n) => n as usize,
        // The CPUs this process may run on (its affinity: taskset's list).
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .min(16),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    let secret = Secret::new(secret.into_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
    println!(
        "# eccl-chaos load: {} master(s) at {list}, lease {} ms, heartbeat {} ms, worlds of {}, {threads} generator thread(s){}",
        args.masters,
        args.lease_ms,
        args.heartbeat_ms,
        args.world,
        if args.master_cpus.is_empty() {
            String::new()
        } else {
            format!(", masters on CPUs {:?}", args.master_cpus)
        }
    );
    println!(
        "# {:>6} {:>6} {:>10} {:>11} {:>11} {:>9} {:>9} {:>8} {:>9} {:>8} {:>8} {:>5} {:>10} {:>7} {:>7} {:>6}",
        "peers",
        "worlds",
        "register_s",
        "commit_p50",
        "commit_max",
        "vote_p50",
        "vote_max",
        "cpu_%",
        "us/beat",
        "rss_mib",
        "kib/peer",
        "lost",
        "late_beats",
        "gen_%",
        "evicted",
        "false"
    );
    let steps = rt.block_on(drive(&args, &counts, &list, &secret, &masters))?;
    masters.stop_all();
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&steps)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

async fn drive(
    args: &LoadArgs,
    counts: &[usize],
    list: &str,
    secret: &Secret,
    masters: &MasterSet,
) -> anyhow::Result<Vec<Step>> {
    let timeout = Duration::from_secs(120);
    let pids: Vec<u32> = (0..masters.len()).filter_map(|i| masters.pid(i)).collect();
    // The largest master's resident memory (the leader's, in a cluster).
    let rss = || {
        pids.iter()
            .filter_map(|&p| crate::resources::read(p))
            .map(|(r, _)| r)
            .max()
            .unwrap_or(0)
    };
    // The masters' CPU time together (a cluster's followers replicate every commit).
    let cpu = || -> Option<u64> { pids.iter().map(|&p| cpu_ticks(p)).sum() };
    // Idle, before any peer: what growth per peer is measured from.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss0 = rss();
    let mut peers: Vec<SimPeer> = Vec::new();
    let mut uuid = 1u64;
    let mut steps = Vec::new();
    let mut ev = Evictions::default();
    for &n in counts {
        // Registration of the step's new peers, `--concurrency` at a time.
        ev.start_step(&peers);
        let t = Instant::now();
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
        let mut joining = JoinSet::new();
        for i in peers.len()..n {
            let (gate, list, secret) = (gate.clone(), list.to_string(), secret.clone());
            joining.spawn(async move {
                let _turn = gate.acquire_owned().await;
                SimPeer::register(&list, &secret, &format!("sim-{}", i / 64), timeout)
                    .await
                    .map_err(|e| anyhow::anyhow!("peer {i} could not register: {e}"))
            });
        }
        while let Some(p) = joining.join_next().await {
            peers.push(p??);
        }
        let register_s = t.elapsed().as_secs_f64();

        // An epoch change for everyone: worlds of --world members, all at once.
        let (commits, lost);
        (peers, commits, lost) =
            epoch_change(peers, args.world as usize, &mut uuid, timeout, &mut ev).await;
        let (votes, vote_lost);
        (peers, votes, vote_lost) = vote_round(peers, args.world as usize, timeout, &mut ev).await;

        // Heartbeats alone: the leader's CPU over --steady-s.
        let (cpu0, gen0) = (cpu(), cpu_ticks(std::process::id()));
        let t = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(args.steady_s)).await;
        let secs = t.elapsed().as_secs_f64();
        let cpu_s = match (cpu0, cpu()) {
            (Some(a), Some(b)) => b.saturating_sub(a) as f64 / ticks_per_second(),
            _ => f64::NAN,
        };
        let gen_s = match (gen0, cpu_ticks(std::process::id())) {
            (Some(a), Some(b)) => b.saturating_sub(a) as f64 / ticks_per_second(),
            _ => f64::NAN,
        };
        let beats = peers.len() as f64 * secs * 1e3 / args.heartbeat_ms as f64;
        let rss_now = rss();
        // The next epoch change finds every peer that kept its lease.
        let lost_after;
        (peers, _, lost_after) =
            epoch_change(peers, args.world as usize, &mut uuid, timeout, &mut ev).await;

        let mut sorted = commits.clone();
        sorted.sort_by(f64::total_cmp);
        let mut vsorted = votes.clone();
        vsorted.sort_by(f64::total_cmp);
        let step = Step {
            peers: peers.len(),
            worlds: commits.len(),
            register_s,
            commit_ms_p50: sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN),
            commit_ms_max: sorted.last().copied().unwrap_or(f64::NAN),
            vote_ms_p50: vsorted.get(vsorted.len() / 2).copied().unwrap_or(f64::NAN),
            vote_ms_max: vsorted.last().copied().unwrap_or(f64::NAN),
            leader_cpu_pct: 100.0 * cpu_s / secs,
            us_per_heartbeat: cpu_s * 1e6 / beats,
            leader_rss_mib: rss_now as f64 / 1024.0,
            kib_per_peer: rss_now.saturating_sub(rss0) as f64 / peers.len() as f64,
            lost: lost + vote_lost + lost_after,
            late_beats: ev.late_in_step(&peers),
            generator_cpu_pct: 100.0 * gen_s / secs,
            evicted: ev.evicted,
            false_evictions: ev.false_evictions,
        };
        println!(
            "  {:>6} {:>6} {:>10.2} {:>11.1} {:>11.1} {:>9.1} {:>9.1} {:>8.1} {:>9.1} {:>8.1} {:>8.1} {:>5} {:>10} {:>7.1} {:>7} {:>6}",
            step.peers,
            step.worlds,
            step.register_s,
            step.commit_ms_p50,
            step.commit_ms_max,
            step.vote_ms_p50,
            step.vote_ms_max,
            step.leader_cpu_pct,
            step.us_per_heartbeat,
            step.leader_rss_mib,
            step.kib_per_peer,
            step.lost,
            step.late_beats,
            step.generator_cpu_pct,
            step.evicted,
            step.false_evictions
        );
        steps.push(step);
    }
    for p in peers {
        let _ = p.leave(Duration::from_secs(5)).await;
    }
    Ok(steps)
}

/// Every peer reconfigures into worlds of at most `world` members (a fresh uuid each),
/// all at once. Returns the peers, each world's commit time (ms, from the start to its
/// last member's answer) and how many peers' calls failed.
async fn epoch_change(
    mut peers: Vec<SimPeer>,
    world: usize,
    uuid: &mut u64,
    timeout: Duration,
    ev: &mut Evictions,
) -> (Vec<SimPeer>, Vec<f64>, usize) {
    let n = peers.len();
    peers.sort_by_key(|p| p.peer_id);
    let worlds: Vec<Vec<eccl::PeerId>> = peers
        .chunks(world)
        .map(|g| g.iter().map(|p| p.peer_id).collect())
        .collect();
    let first_uuid = *uuid + 1;
    *uuid += worlds.len() as u64;
    let t = Instant::now();
    let mut calls = JoinSet::new();
    for (i, mut p) in peers.into_iter().enumerate() {
        let w = i / world;
        let (id, members) = (first_uuid + w as u64, worlds[w].clone());
        calls.spawn(async move {
            let r = p.reconfigure(id, members, timeout).await;
            (p, w, r.err(), t.elapsed().as_secs_f64() * 1e3)
        });
    }
    finish_round(calls, worlds.len(), n, "epoch changes", ev).await
}

/// One call per peer, spawned as (peer, its world, the error if any, ms since the
/// round began): waits for them all. Returns the peers, each world's time to its last
/// member's answer and how many calls failed (the first failure is printed).
async fn finish_round(
    mut calls: JoinSet<(SimPeer, usize, Option<eccl::Error>, f64)>,
    worlds: usize,
    n: usize,
    what: &str,
    ev: &mut Evictions,
) -> (Vec<SimPeer>, Vec<f64>, usize) {
    let mut done = vec![0.0f64; worlds];
    let (mut failed, mut first, mut back) = (0, None::<String>, Vec::with_capacity(n));
    while let Some(r) = calls.join_next().await {
        let Ok((p, w, err, ms)) = r else {
            failed += 1;
            continue;
        };
        done[w] = done[w].max(ms);
        if let Some(e) = err {
            failed += 1;
            ev.note(&p, &e);
            first.get_or_insert_with(|| format!("peer {}: {e}", p.peer_id));
        }
        back.push(p);
    }
    if let Some(e) = first {
        println!("#   {failed} of {n} {what} failed; the first: {e}");
    }
    (back, done, failed)
}

/// Every peer that has a world votes in update_topology() at once, in the worlds the
/// last epoch change made (nothing to change: the master answers each world once all its
/// members voted). A peer that never got a world (its epoch change failed) sits the round
/// out: its vote would be a newcomer's, admitted only at the next epoch its world's members
/// vote for, and none comes in this round (an overloaded run's 120-second "vote" was that
/// wait). Returns the peers, each world's time to its last member's answer (ms) and how
/// many peers' votes failed.
async fn vote_round(
    peers: Vec<SimPeer>,
    world: usize,
    timeout: Duration,
    ev: &mut Evictions,
) -> (Vec<SimPeer>, Vec<f64>, usize) {
    let (mut peers, idle): (Vec<SimPeer>, Vec<SimPeer>) =
        peers.into_iter().partition(|p| p.epoch > 0);
    if !idle.is_empty() {
        println!(
            "#   {} peers without a world (their epoch change failed) sit the vote round out",
            idle.len()
        );
    }
    let n = peers.len();
    let worlds = n.div_ceil(world.max(1));
    let t = Instant::now();
    let mut calls = JoinSet::new();
    peers.sort_by_key(|p| p.peer_id);
    for (i, mut p) in peers.into_iter().enumerate() {
        calls.spawn(async move {
            let r = p.update_topology(1, timeout).await;
            (
                p,
                i / world.max(1),
                r.err(),
                t.elapsed().as_secs_f64() * 1e3,
            )
        });
    }
    let (mut back, done, failed) =
        finish_round(calls, worlds, n, "update_topology() votes", ev).await;
    back.extend(idle);
    (back, done, failed)
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces) end at ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions; it reads a constant of the system.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_has_cpu_ticks() {
        assert!(super::cpu_ticks(std::process::id()).is_some());
    }
}
