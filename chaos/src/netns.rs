//! Workers in network namespaces, for `partition` faults: each worker in a namespace of
//! its own (a host of its own to eccl, so its links are TCP, TLS or QUIC, never shared
//! memory), joined by a veth pair to a bridge in this namespace, where the masters
//! listen on the bridge's address. A partition takes the worker's veth down on the
//! bridge's side: its links and its master connection go silent while both processes
//! live, as when a switch port or a route fails; healing brings it back up.
//!
//! Every namespace and link made here is removed when the [`Lab`] is dropped (the
//! bridge's removal takes the veths with it), also when the run fails.

use std::process::{Command, Stdio};

use anyhow::Context;

pub struct Lab {
    /// Names carry this run's pid, so two runs on one host do not collide.
    tag: u32,
    bridge: String,
    /// The second octet of this run's 10.x.0.0/16.
    net: u8,
    /// The namespace of each worker slot that has one.
    hosts: Vec<Option<String>>,
    /// `--link-rate`: what each worker's link is shaped to, both ways.
    rate: Option<String>,
    /// `--slow-links` and `--slow-rate`: pairs of slots joined by a slower link.
    slow: Vec<(usize, usize)>,
    slow_rate: String,
}

/// `--slow-links`: pairs of worker slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pairs(pub Vec<(usize, usize)>);

/// Parses `--slow-links`: `A-B` pairs of worker slots, comma-separated, each of two
/// different slots.
pub fn parse_pairs(s: &str) -> Result<Pairs, String> {
    let pair = |p: &str| -> Option<(usize, usize)> {
        let (a, b) = p.trim().split_once('-')?;
        let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        (a != b).then_some((a, b))
    };
    s.split(',')
        .map(|p| {
            pair(p).ok_or_else(|| {
                format!(
                    "{p:?}: name each slow link as two different worker slots joined by a dash \
                     (0-1), pairs separated by commas"
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Pairs)
}

/// Runs `program` (iproute2's `ip` or `tc`) with `args`; the error names the command
/// and what it said.
fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{program}` (iproute2)"))?;
    anyhow::ensure!(
        out.status.success(),
        "`{program} {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    run("ip", args)
}

/// Parses `--link-rate`: a `tc` rate such as `1gbit`, `200mbit` or `500kbit`.
pub fn parse_rate(s: &str) -> Result<String, String> {
    let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &s[digits.len()..];
    let ok = !digits.is_empty()
        && digits.parse::<u64>().is_ok_and(|n| n > 0)
        && ["kbit", "mbit", "gbit"].contains(&unit);
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?}: give a rate as tc takes it: a positive number and kbit, mbit or gbit (200mbit)"
        ))
    }
}

impl Lab {
    /// Makes the bridge, or says why namespaces cannot be made here (not root, no
    /// iproute2, a kernel without them). With `rate`, every worker's link is shaped to it
    /// both ways.
    pub fn new(rate: Option<String>) -> anyhow::Result<Lab> {
        Lab::shaped(rate, Vec::new(), String::new())
    }

    /// As [`Lab::new`], and each of the `slow` pairs of worker slots joined by a link of
    /// `slow_rate` both ways (what each of the two sends the other, on its own side:
    /// `tc ... htb` with a filter on the other's address), the lab's scenarios.
    pub fn shaped(
        rate: Option<String>,
        slow: Vec<(usize, usize)>,
        slow_rate: String,
    ) -> anyhow::Result<Lab> {
        let tag = std::process::id();
        let lab = Lab {
            tag,
            bridge: format!("ecb{}", tag % 1_000_000),
            // 10.100.0.0/16 .. 10.227.0.0/16: runs with different pids rarely share one.
            net: 100 + (tag % 128) as u8,
            hosts: Vec::new(),
            rate,
            slow,
            slow_rate,
        };
        ip(&["link", "add", &lab.bridge, "type", "bridge"])?;
        // From here on, Drop removes the bridge.
        ip(&[
            "addr",
            "add",
            &format!("{}/16", lab.addr_of(None)),
            "dev",
            &lab.bridge,
        ])?;
        ip(&["link", "set", &lab.bridge, "up"])?;
        Ok(lab)
    }

    /// The bridge's address (`None`: where the masters listen) or a worker slot's.
    fn addr_of(&self, slot: Option<usize>) -> String {
        let h = slot.map_or(1, |s| s + 2);
        format!("10.{}.{}.{}", self.net, h / 256, h % 256)
    }

    /// Where the masters listen: the bridge's address.
    pub fn master_ip(&self) -> String {
        self.addr_of(None)
    }

    fn veth(&self, slot: usize) -> String {
        format!("ec{}w{slot}", self.tag % 100_000)
    }

    /// The namespace worker `slot` runs in, made on first use.
    pub fn host(&mut self, slot: usize) -> anyhow::Result<String> {
        anyhow::ensure!(slot < 60_000, "too many workers for one lab");
        if let Some(Some(ns)) = self.hosts.get(slot) {
            return Ok(ns.clone());
        }
        let ns = format!("eccl-chaos-{}-w{slot}", self.tag);
        ip(&["netns", "add", &ns])?;
        if self.hosts.len() <= slot {
            self.hosts.resize(slot + 1, None);
        }
        self.hosts[slot] = Some(ns.clone());
        let veth = self.veth(slot);
        ip(&[
            "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ])?;
        ip(&["link", "set", &veth, "master", &self.bridge, "up"])?;
        let addr = format!("{}/16", self.addr_of(Some(slot)));
        ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        let tc_inside = |args: &[&str]| {
            let mut a = vec!["netns", "exec", &ns, "tc"];
            a.extend(args);
            ip(&a)
        };
        let partners: Vec<usize> = self
            .slow
            .iter()
            .filter_map(|&(a, b)| match slot {
                s if s == a => Some(b),
                s if s == b => Some(a),
                _ => None,
            })
            .collect();
        if !partners.is_empty() {
            // What the worker sends: to its slow partners at the slow rate, to everyone
            // else at the link's rate (or unshaped).
            let fast = self.rate.as_deref().unwrap_or("100gbit");
            tc_inside(&[
                "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10",
            ])?;
            for (class, rate) in [("1:10", fast), ("1:20", self.slow_rate.as_str())] {
                tc_inside(&[
                    "class", "add", "dev", "eth0", "parent", "1:", "classid", class, "htb", "rate",
                    rate,
                ])?;
            }
            for &p in &partners {
                let dst = format!("{}/32", self.addr_of(Some(p)));
                tc_inside(&[
                    "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                    "u32", "match", "ip", "dst", &dst, "flowid", "1:20",
                ])?;
            }
        }
        if let Some(rate) = &self.rate {
            // What the worker sends (its eth0, unless shaped per partner above) and what
            // it is sent (the bridge's side).
            let tbf = [
                "root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms",
            ];
            if partners.is_empty() {
                let mut inside = vec!["qdisc", "add", "dev", "eth0"];
                inside.extend(tbf);
                tc_inside(&inside)?;
            }
            let mut outside = vec!["qdisc", "add", "dev", &veth];
            outside.extend(tbf);
            run("tc", &outside)?;
        }
        Ok(ns)
    }

    /// Cuts worker `slot` off the network (`cut`), or heals it.
    pub fn cut(&self, slot: usize, cut: bool) -> anyhow::Result<()> {
        let state = if cut { "down" } else { "up" };
        ip(&["link", "set", &self.veth(slot), state])
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self.hosts.iter().flatten() {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// `command` run inside namespace `ns` (`ip netns exec` execs it: the pid is the
/// command's own, so signals reach it).
pub fn inside(ns: &str, command: &std::path::Path) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).arg(command);
    c
}

#[cfg(test)]
mod tests {
    use super::{parse_pairs, Pairs};

    #[test]
    fn slow_links_are_pairs_of_two_different_slots() {
        assert_eq!(parse_pairs("0-1"), Ok(Pairs(vec![(0, 1)])));
        assert_eq!(parse_pairs("0-1, 3-2"), Ok(Pairs(vec![(0, 1), (3, 2)])));
        for bad in ["1-1", "0", "0-x", "0-1,", "-1", ""] {
            assert!(parse_pairs(bad).is_err(), "{bad:?}");
        }
    }
}
