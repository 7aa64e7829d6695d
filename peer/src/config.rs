//! Configuration: an explicit setting beats the `ECCL_*` variable, the variable beats
//! the default, and the defaults are the fast and safe choice.

use std::time::Duration;

use eccl_protocol::auth::Secret;
use eccl_protocol::Algo;
pub use eccl_transport::mesh::TransportChoice;
pub use eccl_transport::Transport;

use crate::error::{Error, Result};

/// Default port of `eccl-master`.
pub const DEFAULT_MASTER_PORT: u16 = 48148;

#[derive(Clone, Debug)]
pub struct Config {
    /// Master address `host:port` (`ECCL_MASTER`).
    pub master: String,
    /// The job's secret (`ECCL_SECRET`, or the contents of `ECCL_SECRET_FILE`).
    pub secret: Option<Secret>,
    /// A collective fails with `Timeout` if it makes no progress for this long
    /// (`ECCL_TIMEOUT_MS`, default 30 s).
    pub timeout: Duration,
    /// How long to keep trying to reach the master before `MasterUnavailable`
    /// (`ECCL_CONNECT_TIMEOUT_MS`, default 10 s).
    pub connect_timeout: Duration,
    /// How long `update_topology()` waits for the other members to vote
    /// (`ECCL_JOIN_TIMEOUT_MS`, default 300 s).
    pub join_timeout: Duration,
    /// Bytes per frame (`ECCL_BUFFSIZE`, default 1 MiB): a smaller frame pipelines
    /// chains sooner, a larger one costs fewer headers and wake-ups.
    pub frame_bytes: usize,
    /// TCP connections per link (`ECCL_NSTREAMS=N`), or with `stripe_from_measure`
    /// (`ECCL_NSTREAMS=auto`, the default) per link where unmeasured.
    pub nstreams: usize,
    /// `ECCL_NSTREAMS=auto` (the default): a TCP or TLS link has the connections the
    /// master striped it over from its measurement (`optimize_topology()`: more than one
    /// where one connection's window, not the path, bounded the probe), else `nstreams`.
    pub stripe_from_measure: bool,
    /// Force an algorithm (`ECCL_ALGO`: ring, direct, tree).
    pub algo: Option<Algo>,
    /// `ECCL_TOPOLOGY=optimize`: whenever the world changes (it forms, someone joins or
    /// leaves), `update_topology()` goes on to `optimize_topology()` (every member must
    /// have it set alike). Default off: rank order.
    pub optimize_topology: bool,
    /// Which transport links use (`ECCL_TRANSPORT`: auto, tcp, shm, quic; default auto).
    pub transport: TransportChoice,
    /// TLS 1.3 on TCP links (`ECCL_TLS=1`); this peer then refuses plaintext links.
    pub tls: bool,
    /// Interface to listen on for links (`ECCL_SOCKET_IFNAME`); default: all interfaces,
    /// advertised with the address the master sees.
    pub socket_ifname: Option<String>,
    /// Host identity (`ECCL_HOST_ID`; default: the hostname, the boot id and the network
    /// namespace): peers with the same one can share memory. Two containers that share a
    /// hostname but not a network namespace get different identities.
    pub host: String,
    /// Preferred rank at admission (`ECCL_RANK_HINT`, or torchrun's `RANK`).
    pub rank_hint: Option<u32>,
    /// Smallest first world to form (`ECCL_MIN_WORLD`, torchrun's `WORLD_SIZE`).
    pub min_world: u32,
    /// Threads one large reduction may use (`ECCL_REDUCE_THREADS`); default: the host's
    /// cores over the ranks on it, at most 4.
    pub reduce_threads: Option<usize>,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn env_parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match env(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| Error::InvalidArgument(format!("{name}={v:?} is not a valid value"))),
    }
}

/// Reads the job secret from `ECCL_SECRET` or the file named by `ECCL_SECRET_FILE`.
pub fn secret_from_env() -> Result<Option<Secret>> {
    if let Some(s) = env("ECCL_SECRET") {
        return Secret::new(s)
            .map(Some)
            .map_err(|e| Error::InvalidArgument(format!("ECCL_SECRET: {e}")));
    }
    if let Some(path) = env("ECCL_SECRET_FILE") {
        return Secret::read_file(std::path::Path::new(&path))
            .map(Some)
            .map_err(|e| Error::InvalidArgument(format!("ECCL_SECRET_FILE {e}")));
    }
    Ok(None)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| env("HOSTNAME"))
        .unwrap_or_else(|| "localhost".into())
}

/// Who can share memory with whom: shm links need the two processes to reach each other's
/// abstract unix socket, which lives in a network namespace, on one running kernel.
fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| {
            s.trim()
                .replace('-', "")
                .chars()
                .take(12)
                .collect::<String>()
        })
        .unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| {
            p.to_string_lossy()
                .chars()
                .filter(char::is_ascii_digit)
                .collect::<String>()
        })
        .unwrap_or_default();
    let name: String = hostname()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    format!("{name}:{boot}:{netns}")
}

impl Default for Config {
    fn default() -> Self {
        Config {
            master: format!("127.0.0.1:{DEFAULT_MASTER_PORT}"),
            secret: None,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            join_timeout: Duration::from_secs(300),
            frame_bytes: 1 << 20,
            nstreams: 1,
            stripe_from_measure: true,
            algo: None,
            optimize_topology: false,
            transport: TransportChoice::Auto,
            tls: false,
            socket_ifname: None,
            host: host_identity(),
            rank_hint: None,
            min_world: 1,
            reduce_threads: None,
        }
    }
}

impl Config {
    /// Defaults overridden by the `ECCL_*` variables.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        if let Some(m) = env("ECCL_MASTER") {
            c.master = m;
        }
        c.secret = secret_from_env()?;
        if let Some(ms) = env_parse::<u64>("ECCL_TIMEOUT_MS")? {
            c.timeout = Duration::from_millis(ms.max(1));
        }
        if let Some(ms) = env_parse::<u64>("ECCL_CONNECT_TIMEOUT_MS")? {
            c.connect_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = env_parse::<u64>("ECCL_JOIN_TIMEOUT_MS")? {
            c.join_timeout = Duration::from_millis(ms);
        }
        if let Some(b) = env("ECCL_BUFFSIZE") {
            c.frame_bytes = parse_size(&b).ok_or_else(|| {
                Error::InvalidArgument(format!("ECCL_BUFFSIZE={b:?} is not a size"))
            })?;
        }
        if let Some(n) = env_parse::<usize>("ECCL_REDUCE_THREADS")? {
            if n == 0 {
                return Err(Error::InvalidArgument(
                    "ECCL_REDUCE_THREADS=0: at least one thread reduces".into(),
                ));
            }
            c.reduce_threads = Some(n);
        }
        match env("ECCL_NSTREAMS") {
            Some(v) if v.trim().eq_ignore_ascii_case("auto") => c.stripe_from_measure = true,
            Some(_) => {
                if let Some(n) = env_parse::<usize>("ECCL_NSTREAMS")? {
                    c.nstreams = n;
                    c.stripe_from_measure = false;
                }
            }
            None => {}
        }
        if let Some(a) = env("ECCL_ALGO") {
            c.algo = Some(Algo::parse(&a).ok_or_else(|| {
                Error::InvalidArgument(format!("ECCL_ALGO={a:?}: expected ring, direct or tree"))
            })?);
        }
        if let Some(t) = env("ECCL_TOPOLOGY") {
            c.optimize_topology = match t.to_ascii_lowercase().as_str() {
                "optimize" => true,
                "" | "off" | "rank" => false,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "ECCL_TOPOLOGY={t:?}: expected optimize or off"
                    )))
                }
            };
        }
        if let Some(t) = env("ECCL_TRANSPORT") {
            c.transport = TransportChoice::parse(&t).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "ECCL_TRANSPORT={t:?}: expected auto, tcp, shm or quic"
                ))
            })?;
        }
        if let Some(t) = env("ECCL_TLS") {
            c.tls = match t.trim() {
                "1" | "true" | "yes" | "on" => true,
                "0" | "false" | "no" | "off" => false,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "ECCL_TLS={t:?}: expected 1 or 0"
                    )))
                }
            };
        }
        if let Some(h) = env("ECCL_HOST_ID") {
            c.host = h;
        }
        c.socket_ifname = env("ECCL_SOCKET_IFNAME");
        c.rank_hint = env_parse("ECCL_RANK_HINT")?;
        if let Some(w) = env_parse::<u32>("ECCL_MIN_WORLD")? {
            c.min_world = w;
        }
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<()> {
        if self.nstreams == 0 || self.nstreams > 64 {
            return Err(Error::InvalidArgument(format!(
                "ECCL_NSTREAMS={} must be auto or between 1 and 64",
                self.nstreams
            )));
        }
        if self.frame_bytes < 4096 || self.frame_bytes > eccl_protocol::MAX_FRAME_PAYLOAD {
            return Err(Error::InvalidArgument(format!(
                "ECCL_BUFFSIZE={} must be between 4096 and {}",
                self.frame_bytes,
                eccl_protocol::MAX_FRAME_PAYLOAD
            )));
        }
        let max = eccl_protocol::MAX_WORLD_SIZE;
        if self.min_world as usize > max {
            return Err(Error::InvalidArgument(format!(
                "min_world (ECCL_MIN_WORLD) = {} is more than a world can hold ({max})",
                self.min_world
            )));
        }
        if let Some(r) = self.rank_hint.filter(|&r| r as usize >= max) {
            return Err(Error::InvalidArgument(format!(
                "rank_hint (ECCL_RANK_HINT) = {r} is past any world (at most {max} members)"
            )));
        }
        let token = |s: &str| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
        };
        if self.host.is_empty() || self.host.len() > 256 || !token(&self.host) {
            return Err(Error::InvalidArgument(format!(
                "ECCL_HOST_ID={:?} must be 1 to 256 characters of [A-Za-z0-9-_.:]",
                self.host
            )));
        }
        Ok(())
    }
}

/// Parses sizes the way nccl-tests does: `8`, `64K`, `128M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()?.to_ascii_uppercase() {
        'K' => (&s[..s.len() - 1], 1usize << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8"), Some(8));
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("128m"), Some(128 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("K"), None);
    }
}
