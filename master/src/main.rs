//! `eccl-master`: the registry of an eccl job.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use eccl_master::{secret, MasterOptions, RaftTiming, Timing};
use eccl_protocol::auth::Secret;

/// The master of an eccl job: admits peers, commits epochs, evicts the dead.
///
/// One master is a one-node raft cluster; start three with the same --masters list to
/// survive the loss of one. Every connection must prove it holds the job secret.
#[derive(Parser, Debug)]
#[command(name = "eccl-master", version)]
struct Args {
    /// Address to listen on for peers and other masters.
    #[arg(long, default_value = "127.0.0.1:48148", env = "ECCL_MASTER_LISTEN")]
    listen: String,
    /// File holding the job secret; created with a new random secret if missing.
    /// Ignored when ECCL_SECRET is set. Default: ~/.eccl/secret.
    #[arg(long, env = "ECCL_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    /// This master's raft node id (with --masters).
    #[arg(long, default_value_t = 1)]
    node_id: u64,
    /// Every master of a replicated cluster, as id=host:port pairs separated by commas
    /// (this one included), e.g. 1=10.0.0.1:48148,2=10.0.0.2:48148,3=10.0.0.3:48148.
    #[arg(long, value_parser = parse_masters)]
    masters: Option<BTreeMap<u64, String>>,
    /// Lease on each peer in milliseconds: a peer silent for this long is evicted.
    #[arg(long, env = "ECCL_LEASE_MS", default_value_t = 2000)]
    lease_ms: u64,
    /// How often peers renew their lease, in milliseconds.
    #[arg(long, env = "ECCL_HEARTBEAT_MS", default_value_t = 250)]
    heartbeat_ms: u64,
}

fn parse_masters(s: &str) -> Result<BTreeMap<u64, String>, String> {
    let mut m = BTreeMap::new();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not id=host:port"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| format!("{id:?} is not a node id"))?;
        m.insert(id, addr.trim().to_string());
    }
    if m.is_empty() {
        return Err("no masters given".into());
    }
    Ok(m)
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

fn run(args: Args) -> anyhow::Result<()> {
    if args.lease_ms == 0 || args.heartbeat_ms == 0 || args.heartbeat_ms >= args.lease_ms {
        anyhow::bail!(
            "--heartbeat-ms ({}) must be positive and below --lease-ms ({})",
            args.heartbeat_ms,
            args.lease_ms
        );
    }
    let (secret, source) = match std::env::var("ECCL_SECRET")
        .ok()
        .filter(|s| !s.trim().is_empty())
    {
        Some(s) => (
            Secret::new(s).map_err(|e| anyhow::anyhow!("ECCL_SECRET: {e}"))?,
            "$ECCL_SECRET".to_string(),
        ),
        None => {
            let path = args
                .secret_file
                .clone()
                .unwrap_or_else(secret::default_secret_file);
            (secret::load_or_create(&path)?, path.display().to_string())
        }
    };
    let mut opts = MasterOptions::new(args.listen.clone(), secret);
    opts.node_id = args.node_id;
    if let Some(m) = &args.masters {
        if !m.contains_key(&args.node_id) {
            anyhow::bail!(
                "--masters does not list this master's --node-id {}",
                args.node_id
            );
        }
        opts.masters = m.clone();
    }
    opts.timing = Timing {
        lease: Duration::from_millis(args.lease_ms),
        heartbeat: Duration::from_millis(args.heartbeat_ms),
    };
    opts.raft_timing = RaftTiming::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let master = eccl_master::start(opts).await?;
        // Tools (eccl-bench --local, eccl-chaos) read this line to find the port.
        println!(
            "eccl-master listening on {} (secret: {source})",
            master.addr
        );
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
