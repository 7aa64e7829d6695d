//! `ECCL_DEBUG` (WARN, INFO, DEBUG, TRACE; default WARN, so eccl is quiet) and
//! `ECCL_DEBUG_SUBSYS` (a comma list of INIT, COLL, NET, MASTER; default all), like
//! NCCL's variables. Subsystems are tracing targets: `eccl::init`, `eccl::coll`,
//! `eccl::net`, `eccl::master`.

use tracing_subscriber::filter::{LevelFilter, Targets};

/// The filter these variables describe: per-target levels, matched as prefixes of the
/// event's target (tracing-subscriber's `Targets`; eccl reads no `RUST_LOG`-style
/// directives, so it needs no regex engine).
pub fn filter_from_env() -> Targets {
    let level = std::env::var("ECCL_DEBUG")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let level = match level.as_str() {
        "" | "warn" | "version" => LevelFilter::WARN,
        "info" => LevelFilter::INFO,
        "debug" => LevelFilter::DEBUG,
        "trace" => LevelFilter::TRACE,
        "error" | "none" => LevelFilter::ERROR,
        _ => LevelFilter::INFO,
    };
    let subsys = std::env::var("ECCL_DEBUG_SUBSYS").unwrap_or_default();
    // openraft reports its own shutdown (an embedded master stopping with peers still
    // connected) as errors; eccl logs what matters of raft itself, so openraft speaks
    // only when eccl is asked for its full detail.
    let raft = if level == LevelFilter::TRACE {
        LevelFilter::DEBUG
    } else {
        LevelFilter::OFF
    };
    let mut filter = Targets::new()
        .with_default(LevelFilter::WARN)
        .with_target("openraft", raft);
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
            filter = filter.with_target(t, level);
        }
    } else {
        for s in chosen {
            filter = filter.with_target(format!("eccl::{s}"), level);
        }
    }
    filter
}

/// Installs a stderr subscriber once per process; later calls do nothing.
pub fn init() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_target(true),
        )
        .with(filter_from_env())
        .try_init();
}

/// Lines a site may log per second before it is held back.
const LINES_PER_SECOND: u32 = 5;

/// Whether a line of `site` may be logged now: at most a few a second per site, so that
/// a flood of refused strangers does not become a flood of log lines. `Some(n)` lets it
/// through, `n` being how many lines of the site were held back since the last one.
pub fn limit(site: &'static str) -> Option<u64> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};
    static SITES: Mutex<Option<HashMap<&'static str, (Instant, u32, u64)>>> = Mutex::new(None);
    let mut sites = SITES.lock().unwrap_or_else(|e| e.into_inner());
    let entry = sites
        .get_or_insert_with(HashMap::new)
        .entry(site)
        .or_insert((Instant::now(), 0, 0));
    if entry.0.elapsed() >= Duration::from_secs(1) {
        entry.0 = Instant::now();
        entry.1 = 0;
    }
    if entry.1 < LINES_PER_SECOND {
        entry.1 += 1;
        Some(std::mem::take(&mut entry.2))
    } else {
        entry.2 += 1;
        None
    }
}

/// The note a line let through by [`limit`] ends with: how many were held back.
pub fn held_note(held: u64) -> String {
    if held == 0 {
        String::new()
    } else {
        format!(" ({held} more like it not shown)")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_variables_pick_levels_per_subsystem() {
        // One test sets the variables: the others of this binary do not read them.
        std::env::set_var("ECCL_DEBUG", "INFO");
        std::env::set_var("ECCL_DEBUG_SUBSYS", "COLL,net");
        let f = super::filter_from_env();
        std::env::remove_var("ECCL_DEBUG");
        std::env::remove_var("ECCL_DEBUG_SUBSYS");
        let at = |target: &str, level| f.would_enable(target, &level);
        assert!(at("eccl::coll", tracing::Level::INFO));
        assert!(at("eccl::net::quic", tracing::Level::INFO));
        assert!(!at("eccl::init", tracing::Level::INFO));
        assert!(at("eccl::init", tracing::Level::WARN));
        assert!(!at("openraft::core", tracing::Level::ERROR));
        let quiet = super::filter_from_env();
        assert!(!quiet.would_enable("eccl::coll", &tracing::Level::INFO));
        assert!(quiet.would_enable("eccl_master::raft", &tracing::Level::WARN));
    }

    #[test]
    fn a_flood_of_lines_is_held_back_and_counted() {
        let let_through = (0..100)
            .filter(|_| super::limit("test flood").is_some())
            .count();
        assert_eq!(let_through, super::LINES_PER_SECOND as usize);
    }
}
