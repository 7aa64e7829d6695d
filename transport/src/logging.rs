//! `ECCL_DEBUG` (WARN, INFO, DEBUG, TRACE; default WARN, so eccl is quiet) and
//! `ECCL_DEBUG_SUBSYS` (a comma list of INIT, COLL, NET, MASTER; default all), like
//! NCCL's variables. Subsystems are tracing targets: `eccl::init`, `eccl::coll`,
//! `eccl::net`, `eccl::master`.

use tracing_subscriber::EnvFilter;

/// The filter these variables describe.
pub fn filter_from_env() -> EnvFilter {
    let level = std::env::var("ECCL_DEBUG")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let level = match level.as_str() {
        "" | "warn" | "version" => "warn",
        "info" => "info",
        "debug" => "debug",
        "trace" => "trace",
        "error" | "none" => "error",
        _ => "info",
    };
    let subsys = std::env::var("ECCL_DEBUG_SUBSYS").unwrap_or_default();
    // openraft reports its own shutdown (an embedded master stopping with peers still
    // connected) as errors; eccl logs what matters of raft itself, so openraft speaks
    // only when eccl is asked for its full detail.
    let raft = if level == "trace" {
        "openraft=debug"
    } else {
        "openraft=off"
    };
    let mut directives = vec!["warn".to_string(), raft.to_string()];
    let chosen: Vec<String> = subsys
        .split(',')
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty() && s != "all")
        .collect();
    if chosen.is_empty() {
        for t in [
            "eccl",
            "eccl_transport",
            "eccl_master",
            "eccl_chaos",
            "eccl_bench",
        ] {
            directives.push(format!("{t}={level}"));
        }
    } else {
        for s in chosen {
            directives.push(format!("eccl::{s}={level}"));
        }
    }
    EnvFilter::new(directives.join(","))
}

/// Installs a stderr subscriber once per process; later calls do nothing.
pub fn init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter_from_env())
        .with_writer(std::io::stderr)
        .with_target(true)
        .try_init();
}
