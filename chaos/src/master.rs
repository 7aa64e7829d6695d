//! `eccl-chaos master`: an embedded eccl master in its own process, alone or one member of
//! a cluster (`--masters`), so that the orchestrator needs no other binary. It prints its
//! address on the first line of stdout, then one [`MasterReport`] line each time its view
//! of the leader or the term changes, and serves until its stdin closes.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use eccl_master::{ClusterOptions, MasterOptions, Timing};
use serde::{Deserialize, Serialize};

use crate::event::now_ms;
use crate::fleet::MASTER_READY;

/// The environment variable that carries the cluster secret to a master of a cluster.
pub const CLUSTER_SECRET_ENV: &str = "ECCL_CHAOS_CLUSTER_SECRET";
/// What starts a [`MasterReport`] line.
pub const MASTER_REPORT: &str = "MASTER ";

/// A master's view of its cluster at `t`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MasterReport {
    pub node: u64,
    pub t: f64,
    pub leader: Option<u64>,
    pub term: u64,
}

#[derive(clap::Args, Debug)]
pub struct MasterArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    #[arg(long, default_value_t = 800)]
    lease_ms: u64,
    #[arg(long, default_value_t = 200)]
    heartbeat_ms: u64,
    #[arg(long, default_value_t = 1)]
    node_id: u64,
    /// The cluster, as `eccl-master --masters` takes it.
    #[arg(long)]
    masters: Option<String>,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// CPUs this master's threads run on (comma-separated); default: anywhere.
    #[arg(long, value_delimiter = ',')]
    cpus: Vec<usize>,
}

/// Pins this thread, and every thread it starts afterwards, to `cpus`.
fn pin(cpus: &[usize]) -> anyhow::Result<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside it and
    // CPU_ISSET reads inside it for an index below CPU_SETSIZE (checked first);
    // sched_setaffinity only reads the set, sched_getaffinity writes one of that size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            anyhow::ensure!(c < libc::CPU_SETSIZE as usize, "no CPU {c}");
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            anyhow::bail!(
                "cannot pin the master to CPUs {cpus:?}: {}",
                std::io::Error::last_os_error()
            );
        }
        // The kernel keeps only the CPUs this process may use and that are online:
        // refuse rather than run on fewer than asked.
        let mut got: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut got) == 0 {
            if let Some(c) = cpus.iter().find(|&&c| !libc::CPU_ISSET(c, &got)) {
                anyhow::bail!("CPU {c} is not one this master may run on");
            }
        }
    }
    Ok(())
}

pub fn main(args: MasterArgs) -> anyhow::Result<()> {
    eccl::logging::init();
    eccl::limits::raise_open_files();
    if !args.cpus.is_empty() {
        pin(&args.cpus)?;
    }
    let secret = eccl::config::secret_from_env()?
        .context("no job secret: the orchestrator passes one in ECCL_SECRET")?;
    let mut opts = MasterOptions::new(args.listen, secret);
    opts.node_id = args.node_id;
    opts.data_dir = args.data_dir;
    opts.timing = Timing::new(
        Duration::from_millis(args.lease_ms),
        Duration::from_millis(args.heartbeat_ms),
    );
    if let Some(spec) = &args.masters {
        let members = eccl_master::parse_masters(spec).map_err(anyhow::Error::msg)?;
        let me = members
            .get(&args.node_id)
            .context("--masters does not list --node-id")?;
        let cluster = std::env::var(CLUSTER_SECRET_ENV)
            .with_context(|| format!("no cluster secret in {CLUSTER_SECRET_ENV}"))?;
        opts.cluster = Some(ClusterOptions {
            raft_listen: me.raft.clone(),
            secret: eccl::Secret::new(cluster).map_err(|e| anyhow::anyhow!("{e}"))?,
            members: members.clone(),
            join: false,
        });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let master = eccl_master::start(opts).await?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{MASTER_READY}{}", master.addr)?;
        out.flush()?;
        drop(out);
        let node = args.node_id;
        let mut metrics = master.coordinator.raft.raft.metrics();
        let watch = tokio::spawn(async move {
            let mut last = None;
            loop {
                let (leader, term) = {
                    let m = metrics.borrow_and_update();
                    (m.current_leader, m.current_term)
                };
                if last != Some((leader, term)) {
                    last = Some((leader, term));
                    let r = MasterReport {
                        node,
                        t: now_ms(),
                        leader,
                        term,
                    };
                    if let Ok(line) = serde_json::to_string(&r) {
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "{MASTER_REPORT}{line}");
                        let _ = out.flush();
                    }
                }
                if metrics.changed().await.is_err() {
                    return;
                }
            }
        });
        tokio::io::copy(&mut tokio::io::stdin(), &mut tokio::io::sink()).await?;
        watch.abort();
        master.shutdown().await;
        Ok(())
    })
}
