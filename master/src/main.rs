//! `eccl-master`: the registry of an eccl job.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use eccl_master::{secret, ClusterOptions, MasterNode, MasterOptions, RaftTiming, Timing};
use eccl_protocol::auth::Secret;

/// The master of an eccl job: admits peers, commits epochs, evicts the dead.
///
/// One master is a one-node raft cluster; start three with the same --masters list to
/// survive the loss of one. Peers and clients connect to the client listener with the
/// job secret; masters speak raft to each other on their raft listeners with a cluster
/// secret of their own, which the client listener never accepts. Every connection is
/// TLS with the secret bound to the session.
#[derive(Parser, Debug)]
#[command(name = "eccl-master", version)]
struct Args {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// Client listener: peers, the command line, stores.
    #[arg(long, default_value = "127.0.0.1:48148", env = "ECCL_MASTER_LISTEN")]
    listen: String,
    /// The client address other masters give clients for this one (default: this
    /// master's client address in --masters, or what --listen bound).
    #[arg(long)]
    advertise: Option<String>,
    /// File holding the job secret; created with a new random secret if missing, and
    /// refused if its group or others may read it. Ignored when ECCL_SECRET is set.
    /// Default: ~/.eccl/secret.
    #[arg(long, env = "ECCL_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    /// Keep the store of another job too, as NAME=SECRET_FILE (repeat it for each):
    /// clients holding that job's secret open that job's own scopes (torchrun's
    /// rendezvous of several jobs on shared masters) and nothing else. The file must
    /// exist and be readable by its owner only.
    #[arg(long = "store-job", value_name = "NAME=SECRET_FILE")]
    store_jobs: Vec<String>,
    /// This master's raft node id (with --masters).
    #[arg(long, default_value_t = 1)]
    node_id: u64,
    /// Every master of a replicated cluster (this one included) as id=CLIENT/RAFT
    /// entries separated by commas: the client address peers use and the raft address
    /// masters use, e.g. 1=10.0.0.1:48148/10.0.0.1:48149,2=10.0.0.2:48148/10.0.0.2:48149.
    /// The raft address may be just :PORT on the client address's host.
    #[arg(long, value_parser = eccl_master::parse_masters)]
    masters: Option<BTreeMap<u64, MasterNode>>,
    /// Raft listener (default: this master's raft address in --masters).
    #[arg(long)]
    raft_listen: Option<String>,
    /// File holding the cluster secret that masters share (and peers never see); needed
    /// with --masters, created with a new random secret if missing (copy it to every
    /// master). Default: ~/.eccl/cluster-secret.
    #[arg(long, env = "ECCL_CLUSTER_SECRET_FILE")]
    cluster_secret_file: Option<PathBuf>,
    /// Keep the raft log, vote and snapshots in this directory (fsynced before they are
    /// acknowledged), so that a master that restarts rejoins with its log. Without it
    /// the raft state is in memory only.
    #[arg(long, env = "ECCL_MASTER_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Start as a new master of a running cluster: form nothing, wait for
    /// `eccl-master cluster add` (--masters then needs to list only this master).
    #[arg(long)]
    join: bool,
    /// Lease on each peer in milliseconds: a peer silent for this long is evicted.
    #[arg(long, env = "ECCL_LEASE_MS", default_value_t = 800)]
    lease_ms: u64,
    /// How often peers renew their lease, in milliseconds.
    #[arg(long, env = "ECCL_HEARTBEAT_MS", default_value_t = 200)]
    heartbeat_ms: u64,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Show or change a running master cluster.
    Cluster {
        #[command(subcommand)]
        op: ClusterOp,
        /// The masters' client addresses, comma-separated (any of them will do).
        #[arg(
            long,
            env = "ECCL_MASTER",
            global = true,
            default_value = "127.0.0.1:48148"
        )]
        master: String,
        /// The job secret (default: $ECCL_SECRET, else ~/.eccl/secret).
        #[arg(long, env = "ECCL_SECRET_FILE", global = true)]
        secret_file: Option<PathBuf>,
        /// The cluster secret, which add and remove are signed with (default:
        /// ~/.eccl/cluster-secret).
        #[arg(long, env = "ECCL_CLUSTER_SECRET_FILE", global = true)]
        cluster_secret_file: Option<PathBuf>,
        /// How long add and remove may take (adding waits for the new master to catch up).
        #[arg(long, global = true, default_value_t = 30)]
        timeout_s: u64,
    },
}

#[derive(Subcommand, Debug)]
enum ClusterOp {
    /// Leader, term, masters (voters and learners) and live peers.
    Status,
    /// Add a master started with --join: it catches up as a learner, then votes.
    Add {
        #[arg(long)]
        id: u64,
        /// Its client address (peers and clients).
        #[arg(long)]
        client: String,
        /// Its raft address (other masters).
        #[arg(long)]
        raft: String,
    },
    /// Remove a master (dead or alive) from the cluster.
    Remove {
        #[arg(long)]
        id: u64,
    },
}

fn main() {
    let args = Args::parse();
    eccl_transport::logging::init();
    let code = match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("eccl-master: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

/// The job secret: $ECCL_SECRET, else the secret file (created if missing).
fn job_secret(file: Option<&PathBuf>) -> anyhow::Result<(Secret, String)> {
    match std::env::var("ECCL_SECRET")
        .ok()
        .filter(|s| !s.trim().is_empty())
    {
        Some(s) => Ok((
            Secret::new(s).map_err(|e| anyhow::anyhow!("ECCL_SECRET: {e}"))?,
            "$ECCL_SECRET".to_string(),
        )),
        None => {
            let path = file.cloned().unwrap_or_else(secret::default_secret_file);
            Ok((secret::load_or_create(&path)?, path.display().to_string()))
        }
    }
}

fn cluster_command(cmd: Cmd) -> anyhow::Result<()> {
    let Cmd::Cluster {
        op,
        master,
        secret_file,
        cluster_secret_file,
        timeout_s,
    } = cmd;
    let masters: Vec<String> = master
        .split(',')
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect();
    if masters.is_empty() {
        anyhow::bail!("--master lists no address");
    }
    let (secret, _) = job_secret(secret_file.as_ref())?;
    let change = match op {
        ClusterOp::Status => None,
        ClusterOp::Add { id, client, raft } => {
            Some(eccl_protocol::ClusterChange::Add { id, client, raft })
        }
        ClusterOp::Remove { id } => Some(eccl_protocol::ClusterChange::Remove { id }),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let status = rt.block_on(async {
        match change {
            None => eccl_master::cluster_cli::status(&masters, &secret).await,
            Some(change) => {
                let path = cluster_secret_file.unwrap_or_else(|| {
                    secret::default_secret_file().with_file_name("cluster-secret")
                });
                // Never created here: a new random secret could sign nothing.
                let cluster =
                    Secret::read_file(&path).map_err(|e| anyhow::anyhow!("cluster secret: {e}"))?;
                eccl_master::cluster_cli::change(
                    &masters,
                    &secret,
                    &cluster,
                    change,
                    Duration::from_secs(timeout_s),
                )
                .await
            }
        }
    })?;
    print!("{}", eccl_master::cluster_cli::render(&status));
    Ok(())
}

fn run(mut args: Args) -> anyhow::Result<()> {
    if let Some(cmd) = args.command.take() {
        return cluster_command(cmd);
    }
    if args.lease_ms == 0 || args.heartbeat_ms == 0 || args.heartbeat_ms >= args.lease_ms {
        anyhow::bail!(
            "--heartbeat-ms ({}) must be positive and below --lease-ms ({})",
            args.heartbeat_ms,
            args.lease_ms
        );
    }
    // A connection per peer and store client.
    eccl_transport::limits::raise_open_files();
    let (secret, source) = job_secret(args.secret_file.as_ref())?;
    let mut opts = MasterOptions::new(args.listen.clone(), secret);
    for spec in &args.store_jobs {
        let Some((name, file)) = spec.split_once('=') else {
            anyhow::bail!("--store-job {spec:?}: give NAME=SECRET_FILE");
        };
        eccl_master::store::check_job_name(name)
            .map_err(|e| anyhow::anyhow!("--store-job: {e}"))?;
        let s = Secret::read_file(std::path::Path::new(file))
            .map_err(|e| anyhow::anyhow!("--store-job {name}: {e}"))?;
        opts.store_jobs.push((name.to_string(), s));
    }
    opts.node_id = args.node_id;
    opts.advertise = args.advertise.clone();
    if let Some(m) = &args.masters {
        let Some(me) = m.get(&args.node_id) else {
            anyhow::bail!(
                "--masters does not list this master's --node-id {}",
                args.node_id
            );
        };
        let path = args
            .cluster_secret_file
            .clone()
            .unwrap_or_else(|| secret::default_secret_file().with_file_name("cluster-secret"));
        let cluster_secret = secret::load_or_create(&path)?;
        opts.cluster = Some(ClusterOptions {
            raft_listen: args.raft_listen.clone().unwrap_or_else(|| me.raft.clone()),
            secret: cluster_secret,
            members: m.clone(),
            join: args.join,
        });
    } else if args.raft_listen.is_some() || args.cluster_secret_file.is_some() || args.join {
        anyhow::bail!("--raft-listen, --cluster-secret-file and --join go with --masters");
    }
    opts.timing = Timing::new(
        Duration::from_millis(args.lease_ms),
        Duration::from_millis(args.heartbeat_ms),
    );
    opts.raft_timing = RaftTiming::default();
    opts.data_dir = args.data_dir.clone();
    if opts.data_dir.is_none() {
        eprintln!("eccl-master: no --data-dir: the raft log is kept in memory only, so a master that restarts rejoins empty");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let master = eccl_master::start(opts).await?;
        // Tools (eccl-bench --local, eccl-chaos) read this line to find the port.
        match master.raft_addr {
            Some(r) => println!(
                "eccl-master listening on {} (secret: {source}; raft on {r})",
                master.addr
            ),
            None => println!(
                "eccl-master listening on {} (secret: {source})",
                master.addr
            ),
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        master.shutdown().await;
        Ok(())
    })
}
