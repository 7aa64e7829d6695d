//! `eccl-chaos master`: an embedded eccl master in its own process, so that the
//! orchestrator needs no other binary. It prints its address on the first line of stdout
//! and serves until its stdin closes.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use eccl_master::{MasterOptions, Timing};

use crate::fleet::MASTER_READY;

#[derive(clap::Args, Debug)]
pub struct MasterArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    #[arg(long, default_value_t = 2000)]
    lease_ms: u64,
    #[arg(long, default_value_t = 250)]
    heartbeat_ms: u64,
}

pub fn main(args: MasterArgs) -> anyhow::Result<()> {
    eccl::logging::init();
    let secret = eccl::config::secret_from_env()?
        .context("no job secret: the orchestrator passes one in ECCL_SECRET")?;
    let mut opts = MasterOptions::new(args.listen, secret);
    opts.timing = Timing {
        lease: Duration::from_millis(args.lease_ms),
        heartbeat: Duration::from_millis(args.heartbeat_ms),
    };
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
        tokio::io::copy(&mut tokio::io::stdin(), &mut tokio::io::sink()).await?;
        master.shutdown().await;
        Ok(())
    })
}
