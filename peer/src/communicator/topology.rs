//! `optimize_topology()`: the members measure their links to each other and the master
//! solves the ring from the measurements (see `eccl_algorithms::topology`).
//!
//! Every pair is measured once per direction, over the links the world already has
//! (whatever transport each uses: shared memory between members on one host, TCP, TLS
//! or QUIC between hosts). The pairs go in the rounds of a round-robin tournament (the
//! circle method): in each round every member talks to exactly one other, so all pairs
//! are measured concurrently and no member's NIC carries two measurements at once.
//!
//! For each direction the sender first measures the round-trip time with small
//! messages, then sends a probe and times it to the receiver's acknowledgement:
//! bandwidth = bytes / (time - round trip). A probe of 256 KiB that returns within
//! 20 ms is repeated at 4 MiB, so fast links are measured over more than their latency
//! and slow ones do not take seconds.

use std::time::{Duration, Instant};

use eccl_protocol::{DType, LinkMeasure, MasterReply, PeerRequest, Rank};
use futures::future::{BoxFuture, FutureExt};

use super::Communicator;
use crate::error::{Error, Result};
use crate::master_client::reply_error;

/// The point-to-point tag the probes travel under (reserved: an application's messages
/// with this tag would be taken for probes).
pub const PROBE_TAG: u32 = 0xecc1_7090;
const SMALL_PROBE: usize = 256 << 10;
const LARGE_PROBE: usize = 4 << 20;
const LARGE_IF_UNDER: Duration = Duration::from_millis(20);
const PINGS: usize = 3;
/// A path with at least this round trip is probed for [`LONG_PATH_TRIPS`] round trips
/// (doubling the probe, up to [`MAX_PROBE`]): long enough for a TCP connection to leave
/// slow start, so that what bounds it (its window or the path) shows.
const LONG_PATH_RTT: Duration = Duration::from_millis(1);
const LONG_PATH_TRIPS: u32 = 8;
const MAX_PROBE: usize = 64 << 20;
/// A link whose connections spent more than this share of the probe held back by the
/// TCP window (not the path) asks for [`STRIPE_STEP`] times its connections.
const WINDOW_BOUND: f64 = 0.5;
const STRIPE_STEP: u16 = 4;

/// The connections a link asks for after a probe: `share` of its `connections`' busy
/// time was window-limited, the path `congested` or not (a retransmit or a queue:
/// [`WindowStats::congested_since`](eccl_transport::link::tcp_info::WindowStats::congested_since)),
/// its round trip `rtt`. On a long path, more (up to the master's cap) where the window
/// bound the connections or nothing showed the path full (the connections were held
/// back by their own congestion windows: slow start, which every idle connection starts
/// over, is many round trips there; a busy host made the first verdict, the window's
/// share alone, miss a long fat path two times in six). That second reason stripes a
/// single connection only: a striped link grows further only when its windows bound it
/// (idle connections start slow on every probe, so "no congestion" alone would take
/// every long path to the cap). As many as it has otherwise: a congested path is full,
/// and on a short one a full window means a receiver slower than the path, which more
/// connections do not cure.
pub(crate) fn stripes_wanted(connections: u16, share: f64, congested: bool, rtt: Duration) -> u16 {
    if (share > WINDOW_BOUND || (!congested && connections == 1)) && rtt >= LONG_PATH_RTT {
        connections
            .saturating_mul(STRIPE_STEP)
            .min(eccl_protocol::MAX_STRIPES)
    } else {
        connections
    }
}

/// What `optimize_topology()` measured and the world it led to.
#[derive(Clone, Debug)]
pub struct TopologyUpdate {
    /// The new epoch: same members and ranks, the ring solved from the measurements.
    pub epoch: u64,
    /// Ranks around the ring, each sending to the next (empty: rank order).
    pub ring: Vec<u32>,
    /// This member's measurements of its links to the others, by their rank.
    pub links: Vec<(Rank, LinkMeasure)>,
    /// The algorithms the master chose for this world from everyone's measurements
    /// ([`eccl_protocol::World::tuned`]; empty: the tuner's defaults).
    pub tuned: Vec<eccl_protocol::Tuned>,
}

/// The partner of `me` in round `round` of a round-robin tournament of `n` players
/// (`n` rounded up to even; a partner at `n` or beyond is a bye).
pub fn partner(me: usize, round: usize, n: usize) -> usize {
    let m = n + n % 2;
    if me == m - 1 {
        round
    } else if me == round {
        m - 1
    } else {
        (2 * round + (m - 1) - me) % (m - 1)
    }
}

/// Rounds of the tournament for `n` players.
pub fn rounds(n: usize) -> usize {
    (n + n % 2).saturating_sub(1)
}

impl Communicator {
    /// Measures the links to every other member and has the master solve the ring order
    /// from every member's measurements; returns at the new epoch that uses it (same
    /// members and ranks, so nothing above changes but the speed). A collective call:
    /// every member of the world makes it. A member lost meanwhile fails it for all
    /// (aborted, like any collective); call `update_topology()` and try again.
    pub fn optimize_topology<'a>(&'a mut self) -> BoxFuture<'a, Result<TopologyUpdate>> {
        async move {
            let c = self.ready()?;
            let (epoch, me, n) = (c.world.epoch, c.rank.0 as usize, c.size() as usize);
            let members = c.members.clone();
            let mut links = Vec::with_capacity(n.saturating_sub(1));
            for round in 0..rounds(n) {
                let p = partner(me, round, n);
                if p >= n {
                    continue;
                }
                let m = self.measure_pair(me, p).await?;
                links.push((
                    Rank(p as u32),
                    LinkMeasure {
                        to: members[p],
                        ..m
                    },
                ));
            }
            for (r, m) in &links {
                tracing::info!(
                    target: "eccl::topology",
                    "epoch {epoch}: link to rank {r}: {:.3} GB/s, {:.1} us",
                    m.bytes_per_s as f64 / 1e9,
                    m.latency_ns as f64 / 1e3
                );
            }
            let req = PeerRequest::Topology {
                peer_id: self.peer_id,
                epoch,
                links: links.iter().map(|(_, m)| *m).collect(),
            };
            let (world, keys) = match self.master.request(req, self.cfg.join_timeout).await? {
                MasterReply::World { world, keys, .. } => (world.into_world(), keys),
                other => return Err(reply_error(&self.cfg.master, epoch, other)),
            };
            self.install(world, keys, true, &[]).await?;
            let c = self.cur.as_ref().ok_or_else(|| Error::Aborted {
                epoch,
                cause: "no world".into(),
            })?;
            tracing::info!(target: "eccl::topology", "epoch {}: ring {:?}; algorithms {}", c.world.epoch, c.world.ring,
                eccl_algorithms::model::describe(&c.world.tuned));
            Ok(TopologyUpdate {
                epoch: c.world.epoch,
                ring: c.world.ring.clone(),
                links,
                tuned: c.world.tuned.clone(),
            })
        }
        .boxed()
    }

    /// Both directions between this member and rank `p`: the lower rank sends first.
    /// Returns this member's measurement towards `p` (its `to` is filled in by the
    /// caller).
    async fn measure_pair(&mut self, me: usize, p: usize) -> Result<LinkMeasure> {
        let peer = Rank(p as u32);
        if me < p {
            let m = self.probe_send(peer).await?;
            self.probe_serve(peer).await?;
            Ok(m)
        } else {
            self.probe_serve(peer).await?;
            self.probe_send(peer).await
        }
    }

    /// The sending side of one direction: round trips, then probes until one is long
    /// enough; a header of 0 bytes ends it.
    async fn probe_send(&mut self, peer: Rank) -> Result<LinkMeasure> {
        let mut word = [0u8; 8];
        let mut rtt = Duration::MAX;
        for _ in 0..PINGS {
            let t = Instant::now();
            self.send_bytes(DType::U8, &u64::MAX.to_le_bytes(), peer, PROBE_TAG)
                .await?;
            self.recv_bytes(DType::U8, &mut word, peer, PROBE_TAG)
                .await?;
            rtt = rtt.min(t.elapsed());
        }
        let mut size = SMALL_PROBE;
        let (bytes_per_s, window) = loop {
            // A probe goes in two halves, the window counters read between them: the
            // verdict is the second half's, after the connection left slow start (on a
            // long path the first round trips of every probe are spent there, idle
            // connections starting over, and would dilute the share).
            let payload = vec![0x5au8; size / 2];
            let t = Instant::now();
            self.send_bytes(DType::U8, &(size as u64).to_le_bytes(), peer, PROBE_TAG)
                .await?;
            self.send_bytes(DType::U8, &payload, peer, PROBE_TAG)
                .await?;
            let before = self.window_stats(peer);
            self.send_bytes(DType::U8, &payload, peer, PROBE_TAG)
                .await?;
            self.recv_bytes(DType::U8, &mut word, peer, PROBE_TAG)
                .await?;
            let took = t.elapsed();
            if size == SMALL_PROBE && took < LARGE_IF_UNDER {
                size = LARGE_PROBE;
                continue;
            }
            let window = before.zip(self.window_stats(peer));
            if window.is_some()
                && rtt >= LONG_PATH_RTT
                && took < rtt * LONG_PATH_TRIPS
                && size < MAX_PROBE
            {
                size *= 2;
                continue;
            }
            let wire = took.saturating_sub(rtt).max(Duration::from_micros(1));
            break ((size as f64 / wire.as_secs_f64()) as u64, window);
        };
        self.send_bytes(DType::U8, &0u64.to_le_bytes(), peer, PROBE_TAG)
            .await?;
        // TCP links only: how much of the last probe's second half the window held back.
        let streams = window.map_or(0, |(b, a)| {
            let share = b.limited_share(&a).unwrap_or(0.0);
            let congested = b.congested_since(&a);
            let want = stripes_wanted(a.connections, share, congested, rtt);
            tracing::info!(
                target: "eccl::topology",
                "link to rank {peer}: {} connection(s) spent {:.0} % of the probe held back by \
                 the TCP window, the path {} ({} retransmits, smoothed round trip {:.1} ms over \
                 a minimum of {:.1}): asks for {want}",
                a.connections,
                share * 100.0,
                if congested { "congested" } else { "not congested" },
                a.retransmits.saturating_sub(b.retransmits),
                f64::from(a.rtt_us) / 1e3,
                f64::from(a.min_rtt_us) / 1e3
            );
            want
        });
        Ok(LinkMeasure {
            to: eccl_protocol::PeerId(0),
            bytes_per_s: bytes_per_s.max(1),
            latency_ns: (rtt.as_nanos() / 2) as u64,
            streams,
        })
    }

    /// The TCP counters of our link to `peer`, if it is a TCP or TLS link.
    fn window_stats(&self, peer: Rank) -> Option<eccl_transport::link::tcp_info::WindowStats> {
        let c = self.cur.as_ref()?;
        c.links.get(peer.idx())?.as_ref()?.tx.window_stats()
    }

    /// The receiving side of one direction: answers the round trips, takes each probe
    /// and acknowledges it, until the sender's header of 0 bytes.
    async fn probe_serve(&mut self, peer: Rank) -> Result<()> {
        let mut word = [0u8; 8];
        for _ in 0..PINGS {
            self.recv_bytes(DType::U8, &mut word, peer, PROBE_TAG)
                .await?;
            self.send_bytes(DType::U8, &word, peer, PROBE_TAG).await?;
        }
        loop {
            self.recv_bytes(DType::U8, &mut word, peer, PROBE_TAG)
                .await?;
            let size = u64::from_le_bytes(word) as usize;
            if size == 0 {
                return Ok(());
            }
            if size > MAX_PROBE || !size.is_multiple_of(2) {
                return Err(Error::InvalidArgument(format!(
                    "rank {peer} announced a probe of {size} bytes (an even count up to \
                     {MAX_PROBE})"
                )));
            }
            // In two halves (see `probe_send`).
            let mut payload = vec![0u8; size / 2];
            for _ in 0..2 {
                self.recv_bytes(DType::U8, &mut payload, peer, PROBE_TAG)
                    .await?;
            }
            self.send_bytes(DType::U8, &word, peer, PROBE_TAG).await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_path_held_back_by_windows_asks_for_more_connections_and_nothing_else_does() {
        let long = Duration::from_millis(100);
        let short = Duration::from_micros(50);
        for congested in [true, false] {
            assert_eq!(stripes_wanted(1, 0.9, congested, long), 4);
            assert_eq!(stripes_wanted(4, 0.9, congested, long), 16);
            assert_eq!(
                stripes_wanted(16, 0.9, congested, long),
                eccl_protocol::MAX_STRIPES
            );
            assert_eq!(
                stripes_wanted(1, 0.9, congested, short),
                1,
                "a slow receiver on a short path"
            );
            assert_eq!(stripes_wanted(1, 0.2, congested, short), 1);
        }
        assert_eq!(stripes_wanted(1, 0.2, true, long), 1, "a full path");
        assert_eq!(
            stripes_wanted(4, 0.2, true, long),
            4,
            "a striped link on a full path keeps its count"
        );
        assert_eq!(
            stripes_wanted(1, 0.2, false, long),
            4,
            "held back by its congestion window on a path with room"
        );
        assert_eq!(
            stripes_wanted(4, 0.2, false, long),
            4,
            "a striped link grows only when its windows bound it"
        );
    }

    #[test]
    fn every_pair_meets_once_and_nobody_twice_in_a_round() {
        for n in 2..=17 {
            let mut met = std::collections::HashSet::new();
            for r in 0..rounds(n) {
                let mut busy = std::collections::HashSet::new();
                for me in 0..n {
                    let p = partner(me, r, n);
                    assert_ne!(p, me, "n {n} round {r}");
                    if p >= n {
                        continue;
                    }
                    assert_eq!(partner(p, r, n), me, "n {n} round {r}: not mutual");
                    assert!(busy.insert(me), "n {n} round {r}: {me} twice");
                    met.insert((me.min(p), me.max(p)));
                }
            }
            assert_eq!(met.len(), n * (n - 1) / 2, "n {n}");
        }
    }
}
