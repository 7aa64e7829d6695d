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
}

/// Runs `ip` with `args`; the error names the command and what `ip` said.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("cannot run `ip` (iproute2)")?;
    anyhow::ensure!(
        out.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

impl Lab {
    /// Makes the bridge, or says why namespaces cannot be made here (not root, no
    /// iproute2, a kernel without them).
    pub fn new() -> anyhow::Result<Lab> {
        let tag = std::process::id();
        let lab = Lab {
            tag,
            bridge: format!("ecb{}", tag % 1_000_000),
            // 10.100.0.0/16 .. 10.227.0.0/16: runs with different pids rarely share one.
            net: 100 + (tag % 128) as u8,
            hosts: Vec::new(),
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
