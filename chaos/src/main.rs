//! `eccl-chaos`: runs a master and N worker peers as separate processes, kills, hangs,
//! starts and retires peers at times drawn from a seed, and checks that every result
//! stays exact: no wrong all_reduce, no hang, no divergent state, no lost step, no ghost
//! member. The same seed replays the same fault schedule.
//!
//! The master and the workers are hidden subcommands of this binary, so a run needs
//! nothing else: `master.rs` and `worker.rs` are the child processes, `fleet.rs` starts
//! and signals them, `schedule.rs` draws the faults, `measure.rs` times each one,
//! `orchestrator.rs` drives the run and `report.rs` judges it.

mod event;
mod fleet;
mod load;
mod master;
mod master_faults;
mod masters;
mod measure;
mod members;
mod netns;
mod orchestrator;
mod report;
mod resources;
mod schedule;
mod timeline;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

use schedule::{FaultKind, Inject, InjectTarget};

/// Kill, hang, join and retire peers of a running eccl job and check that every result
/// stays exact.
#[derive(Parser, Debug)]
#[command(
    name = "eccl-chaos",
    version,
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  eccl-chaos --peers 4 --duration 60 --seed 7\n  eccl-chaos --peers 4 --duration 10 --faults none --inject 1=mid-ring:kill@5\n\nThe exit status is 1 if the run found a violation, 2 for bad flags."
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    run: RunArgs,
}

/// The child processes of a run.
#[derive(Subcommand, Debug)]
enum Role {
    #[command(hide = true)]
    Master(master::MasterArgs),
    #[command(hide = true)]
    Worker(worker::WorkerArgs),
    /// How many peers a master holds: simulated peers (registration, heartbeats, epoch
    /// changes; no links) in steps, against real masters.
    Load(load::LoadArgs),
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Worker peers at the start; joins may add up to two more.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=1024))]
    pub peers: u32,
    /// Length of the run in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// A soak run: --duration 600.
    #[arg(long, conflicts_with = "duration")]
    pub soak: bool,
    /// A soak of N minutes (--duration N*60), with a summary every minute. Every run
    /// samples the masters' and workers' memory and file descriptors; a run of a minute
    /// or more fails if a process that lived through it grew by more than 5 %.
    #[arg(long, value_name = "N", conflicts_with_all = ["duration", "soak"], value_parser = clap::value_parser!(u64).range(1..))]
    pub soak_minutes: Option<u64>,
    /// Faults to inject: a comma list of kill, hang, join, leave, slow, master-kill,
    /// master-hang (these two need --masters 3), partition (every peer then runs in a
    /// network namespace of its own, which needs root; where none can be made the run
    /// says so and leaves partitions out), leave-during-sync (a newcomer starts and a
    /// member leaves from the middle of a shared-state sync), or `none`.
    // The full path keeps clap from reading the list as a repeated flag.
    #[arg(long, default_value = "kill,hang,join,leave", value_parser = schedule::parse_faults)]
    pub faults: ::std::vec::Vec<FaultKind>,
    /// Masters: 1 (a lone master) or a raft cluster of this many, each with a data
    /// directory.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=7))]
    pub masters: u32,
    /// Seed of the fault schedule (default: random, printed at the start).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Mean pause between one fault playing out and the next, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    pub interval_ms: u64,
    /// Churn, as PCCL's long test: faults drawn on a clock, one every --churn-ms
    /// whatever the job is doing (kills land during recoveries, joins during syncs, two
    /// faults may hit one epoch), instead of each after the previous one played out.
    /// The run then also fails if no new step is committed for --max-stall-ms.
    #[arg(long)]
    pub churn: bool,
    /// The pause between two churn faults, drawn uniformly: MIN-MAX milliseconds.
    #[arg(long, default_value = "500-2000", value_parser = schedule::parse_range_ms)]
    pub churn_ms: (u64, u64),
    /// Peers kept running whatever the schedule draws: a kill, hang or leave that would
    /// leave fewer becomes a join.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..))]
    pub min_live: u32,
    /// With --churn, the longest the job may go without committing a new step, in
    /// milliseconds (PCCL's criterion is 5 minutes). Every run reports its longest stall.
    #[arg(long, default_value_t = 5000)]
    pub max_stall_ms: u64,
    /// How long a hung peer stays stopped, and a partitioned one cut off, in milliseconds
    /// (default: lease + 1500).
    #[arg(long)]
    pub hang_ms: Option<u64>,
    /// How long a slow peer (`--faults slow`) stays stopped, in milliseconds (default:
    /// two fifths of the lease; it must be under half of it).
    #[arg(long)]
    pub slow_ms: Option<u64>,
    /// The master's lease on each peer, in milliseconds.
    #[arg(long, default_value_t = 800)]
    pub lease_ms: u64,
    /// How often peers renew their lease, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub heartbeat_ms: u64,
    /// Size of the shared state each worker keeps in sync, in MiB.
    #[arg(long, default_value_t = 16)]
    pub state_mb: u32,
    /// i64 elements all-reduced per step (per call with --in-flight).
    #[arg(long, default_value_t = 4096)]
    pub elements: usize,
    /// All-reduces in flight per step: each worker submits K calls of --elements before
    /// the first finishes (a fault must end every one of them, none may hang).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub in_flight: u32,
    /// Pause after each step, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub step_ms: u64,
    /// Set ECCL_FAULT_INJECT=SPEC on initial worker K (0-based), or with K=join on the
    /// first newcomer. SPEC is point:action[@n]: point first-chunk, mid-ring,
    /// update-topology, connect, sync-serve or sync-fetch; action kill or stop; n the occurrence
    /// that fires (default 1). Repeatable.
    #[arg(long, value_name = "K=SPEC", value_parser = schedule::parse_inject)]
    pub inject: Vec<Inject>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also draw the run into this SVG file: members per epoch, steps per second, each
    /// fault with its abort and recovery, master leader changes.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Print only the start line and the summary, not one line per fault.
    #[arg(long)]
    pub quiet: bool,
    /// Let the master and the workers log to stderr (ECCL_DEBUG sets the level).
    #[arg(long)]
    pub verbose: bool,
    /// Run every worker in a network namespace of its own (a host of its own to eccl:
    /// no shared memory between workers), joined to the masters by a bridge; needs root.
    /// `--faults partition` implies it.
    #[arg(long)]
    pub netns: bool,
    /// With --netns, shape every worker's link to the bridge to this rate, both ways
    /// (`tc ... tbf`), e.g. `1gbit` or `200mbit`.
    #[arg(long, requires = "netns", value_parser = netns::parse_rate)]
    pub link_rate: Option<String>,
    /// With --netns, pairs of worker slots joined only by a slow link (the lab's
    /// scenarios, `examples/netlab.sh`): `0-1,2-3` shapes what worker 0 sends worker 1
    /// and what 1 sends 0 (and 2 and 3 likewise) to --slow-rate, the other links keeping
    /// --link-rate. Slots are the initial workers 0 to --peers - 1 in rank order, then
    /// each newcomer the next.
    #[arg(long, requires = "netns", value_parser = netns::parse_pairs)]
    pub slow_links: Option<netns::Pairs>,
    /// The rate of --slow-links, both ways (`tc ... htb`).
    #[arg(long, requires = "slow_links", default_value = "10mbit", value_parser = netns::parse_rate)]
    pub slow_rate: String,
    /// Transport of the workers' links: auto, tcp, tls (TCP with TLS), shm or quic.
    #[arg(long, env = "ECCL_TRANSPORT", default_value = "auto", value_parser = ["auto", "tcp", "tls", "shm", "quic"])]
    pub transport: String,
}

impl RunArgs {
    pub fn duration_ms(&self) -> f64 {
        if let Some(m) = self.soak_minutes {
            m as f64 * 60_000.0
        } else if self.soak {
            600_000.0
        } else {
            self.duration * 1e3
        }
    }

    pub fn hang_ms(&self) -> u64 {
        self.hang_ms.unwrap_or(self.lease_ms + 1500)
    }

    pub fn slow_ms(&self) -> u64 {
        self.slow_ms.unwrap_or(self.lease_ms * 2 / 5)
    }

    /// Checks that flags which parse on their own also make sense together.
    fn check(&self) -> Result<(), String> {
        let duration = self.duration_ms();
        if duration.is_nan() || duration <= 0.0 {
            return Err(format!("--duration {} must be positive", self.duration));
        }
        if self.heartbeat_ms == 0 || self.heartbeat_ms >= self.lease_ms {
            return Err(format!(
                "--heartbeat-ms {} must be positive and below --lease-ms {}",
                self.heartbeat_ms, self.lease_ms
            ));
        }
        if self.hang_ms() <= self.lease_ms {
            return Err(format!(
                "--hang-ms {} must exceed --lease-ms {}: a shorter stop is not a fault the master can see",
                self.hang_ms(),
                self.lease_ms
            ));
        }
        if self.slow_ms() == 0 || self.slow_ms() * 2 >= self.lease_ms {
            return Err(format!(
                "--slow-ms {} must be positive and under half of --lease-ms {}: a longer stop is a hang",
                self.slow_ms(),
                self.lease_ms
            ));
        }
        if self.min_live > self.peers {
            return Err(format!(
                "--min-live {} is more than --peers {}: the run would start below it",
                self.min_live, self.peers
            ));
        }
        if self.masters < 3 && self.faults.iter().any(|f| f.is_master()) {
            return Err(format!(
                "master-kill and master-hang need a cluster that survives them: --masters 3 or more (not {})",
                self.masters
            ));
        }
        if self.transport == "shm" && (self.netns || self.faults.contains(&FaultKind::Partition)) {
            return Err(
                "partition runs every peer in a network namespace of its own (a host of its own, so no shared memory): use --transport auto, tcp, tls or quic with it"
                    .into(),
            );
        }
        if let Some(p) = &self.plot {
            if p.extension().and_then(|e| e.to_str()) != Some("svg") {
                return Err(format!(
                    "--plot {}: the picture is an SVG file; name it *.svg",
                    p.display()
                ));
            }
        }
        if self.elements == 0 || self.state_mb == 0 {
            return Err("--elements and --state-mb must be positive".into());
        }
        for i in &self.inject {
            if let InjectTarget::Initial(k) = i.target {
                if k >= self.peers {
                    return Err(format!(
                        "--inject {k}={}: there are only {} initial workers (0 to {})",
                        i.spec,
                        self.peers,
                        self.peers - 1
                    ));
                }
            }
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.role {
        Some(Role::Master(args)) => master::main(args).map(|()| ExitCode::SUCCESS),
        Some(Role::Worker(args)) => worker::main(args).map(|()| ExitCode::SUCCESS),
        Some(Role::Load(args)) => load::main(args).map(|()| ExitCode::SUCCESS),
        None => run(&cli.run),
    };
    result.unwrap_or_else(|e| {
        eprintln!("eccl-chaos: {e:#}");
        ExitCode::FAILURE
    })
}

fn run(args: &RunArgs) -> anyhow::Result<ExitCode> {
    if let Err(msg) = args.check() {
        Cli::command()
            .error(clap::error::ErrorKind::ValueValidation, msg)
            .exit();
    }
    let report = orchestrator::run(args)?;
    print!("{}", report::summary(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "eccl-chaos: {} peers, {}, seed {}, {} faults, {} violations",
            report.peers,
            report.transport,
            report.seed,
            report.timeline.faults.len(),
            report.violations.len()
        );
        timeline::figure(&report.timeline, title).write_svg(path)?;
    }
    Ok(if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
