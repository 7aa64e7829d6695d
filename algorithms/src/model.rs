//! How long a collective takes on measured links, and which algorithm each call should
//! take in a world whose links were measured.
//!
//! The master measures every link (`optimize_topology()`) and solves the ring; then it
//! asks [`tune`] which algorithm each collective should use at each size, and where the
//! root of the rootless trees should sit ([`rotate_for_trees`]). The model knows no
//! algorithm by name: it builds every rank's real schedule ([`crate::build_in_ring`])
//! and plays it on the links' latencies and bandwidths (the alpha-beta model), so
//! whatever a builder does is what is modelled.
//!
//! Playing a schedule: a rank's steps run one after another, as the peer runs them. A
//! message takes its bytes over the link's bandwidth, shared with the step's other
//! messages on its sender's uplink or its receiver's downlink (whichever carries more),
//! after the messages of earlier steps there have left, and arrives one latency later; a
//! rank's step ends when its sends have left and its receives have arrived. A forwarding
//! primitive (`RecvCopySend`, `RecvReduceSend`) passes each piece on as it lands: what it
//! forwards arrives one piece and one latency after what it received (or after its own
//! uplink is free). Local copies and reductions cost nothing here: the model ranks
//! algorithms by what the links cost them, and every algorithm does about the same local
//! work per byte.
//!
//! Everything here is arithmetic on its arguments (no clock, no randomness), so every
//! master replica that applies the same log reaches the same table.

use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, ReduceOp, Tuned};

use crate::schedule::{Prim, Schedule};
#[cfg(test)]
use crate::tuner::GATHER_SMALL_BYTES;
use crate::tuner::{available_algos, choose_algo};

/// Measured links of a world of `n` ranks: bandwidth (bytes per second) and one-way
/// latency (seconds) of each ordered pair, row: from.
#[derive(Clone, Debug)]
pub struct Links {
    n: usize,
    bandwidth: Vec<f64>,
    latency: Vec<f64>,
}

impl Links {
    /// `f(from, to)` gives `(bytes per second, one-way latency in seconds)` for every
    /// ordered pair of distinct ranks. A bandwidth that is not positive and finite, or a
    /// latency that is negative or not finite, makes the link unusable: anything sent
    /// over it takes forever.
    pub fn from_fn(n: usize, f: impl Fn(usize, usize) -> (f64, f64)) -> Links {
        let mut bandwidth = vec![f64::INFINITY; n * n];
        let mut latency = vec![0.0; n * n];
        for i in 0..n {
            for j in (0..n).filter(|&j| j != i) {
                let (bw, lat) = f(i, j);
                let usable = bw > 0.0 && bw.is_finite() && lat >= 0.0 && lat.is_finite();
                bandwidth[i * n + j] = if usable { bw } else { 0.0 };
                latency[i * n + j] = if usable { lat } else { f64::INFINITY };
            }
        }
        Links {
            n,
            bandwidth,
            latency,
        }
    }

    /// Ranks in the world.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The same world on uniform links, each with the median bandwidth and the median
    /// latency of the usable ones; `None` if none is usable.
    fn typical(&self) -> Option<Links> {
        let usable = |i: usize| i / self.n != i % self.n && self.bandwidth[i] > 0.0;
        let median = |v: &[f64]| {
            let mut v: Vec<f64> = (0..v.len()).filter(|&i| usable(i)).map(|i| v[i]).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied()
        };
        let (bw, lat) = (median(&self.bandwidth)?, median(&self.latency)?);
        Some(Links::from_fn(self.n, |_, _| (bw, lat)))
    }

    fn latency(&self, from: usize, to: usize) -> f64 {
        self.latency[from * self.n + to]
    }

    /// Seconds `bytes` take on the link from `from` to `to`, latency aside.
    fn transfer(&self, from: usize, to: usize, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        match self.bandwidth[from * self.n + to] {
            bw if bw > 0.0 => bytes / bw,
            _ => f64::INFINITY,
        }
    }
}

/// Bytes a forwarding primitive receives before it passes them on: the peer's frame.
pub const PIECE_BYTES: f64 = (1u64 << 20) as f64;

/// Sizes the master models, in bytes (the tuner's convention, `count * dtype size`):
/// 256 B to 1 GiB by factors of 4, and for each kind the sizes where the tuner's
/// default changes in the world at hand ([`samples`]), so that the default is one
/// algorithm over each band between two of them.
pub const TUNE_SIZES: [u64; 12] = [
    1 << 8,
    1 << 10,
    1 << 12,
    1 << 14,
    1 << 16,
    1 << 18,
    1 << 20,
    1 << 22,
    1 << 24,
    1 << 26,
    1 << 28,
    1 << 30,
];

/// How much faster than the tuner's default the model must find another algorithm
/// before the table names it: the defaults were measured, the model is a model, so on
/// links where the two are close the measured choice stays.
pub const MODEL_MARGIN: f64 = 1.25;

/// Largest world the master models (each table plays a few hundred schedules of every
/// rank, in the master's state machine at every epoch change).
pub const MODEL_MAX_WORLD: usize = 64;

/// Seconds a call of `kind` with `algo` moving `bytes` (the tuner's convention) takes
/// on `links`, in a world of `links.len()` ranks ordered around `ring` as
/// [`crate::build_in_ring`] orders it, with `root` for rooted kinds; `None` where the
/// algorithm is not built for the call.
pub fn call_time(
    kind: CollectiveKind,
    algo: Algo,
    bytes: u64,
    root: u32,
    ring: Option<&[u32]>,
    links: &Links,
) -> Option<f64> {
    let count = bytes / DType::F32.size() as u64;
    let schedules = schedules(kind, algo, count, root, ring, links.len())?;
    Some(play(&schedules, DType::F32.size() as f64, links))
}

/// Every rank's schedule of a call of `count` f32 values.
fn schedules(
    kind: CollectiveKind,
    algo: Algo,
    count: u64,
    root: u32,
    ring: Option<&[u32]>,
    world: usize,
) -> Option<Vec<Schedule>> {
    let world = u32::try_from(world).ok()?;
    let desc = Descriptor {
        kind,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        algo,
        root,
        count,
    };
    (0..world)
        .map(|r| crate::build_in_ring(&desc, r, world, ring).ok())
        .collect()
}

/// The count [`tune`] builds its schedules for, played at every size by scaling the
/// bytes of an element (a schedule's shape does not change with its size, and at this
/// count the chunks of any world the model plays differ by at most one element in
/// about 16,000).
const TUNE_COUNT: u64 = 1 << 20;

/// The model's time of the schedules (one per rank) on `links`.
fn play(schedules: &[Schedule], elem: f64, links: &Links) -> f64 {
    let n = schedules.len();
    let steps = schedules.iter().map(|s| s.steps.len()).max().unwrap_or(0);
    let mut now = vec![0.0f64; n];
    // When each rank's uplink and downlink are free again.
    let (mut up, mut down) = (vec![0.0f64; n], vec![0.0f64; n]);
    // Per step, indexed `from * n + to`; only the pairs a step sends over are set, and
    // they are cleared after it (a ring's 2(n-1) steps would otherwise clear n^2 each).
    let mut sends: Vec<Option<&Prim>> = vec![None; n * n];
    let mut arrivals = vec![f64::NAN; n * n];
    let mut pairs: Vec<usize> = Vec::new();
    let (mut sending, mut receiving) = (vec![0u32; n], vec![0u32; n]);
    for k in 0..steps {
        let prims: Vec<&[Prim]> = schedules
            .iter()
            .map(|s| s.steps.get(k).map_or(&[][..], |s| &s.prims[..]))
            .collect();
        // How many messages of this step leave and reach each rank: they share its
        // uplink and downlink.
        sending.fill(0);
        receiving.fill(0);
        for (r, &mine) in prims.iter().enumerate() {
            for p in mine {
                if let Some(to) = p.sends_to() {
                    sending[r] += 1;
                    receiving[to as usize] += 1;
                    sends[r * n + to as usize] = Some(p);
                    pairs.push(r * n + to as usize);
                }
            }
        }
        let mut step = Step {
            prims: &prims,
            sends: &sends,
            elem,
            links,
            now: &now,
            up: &up,
            down: &down,
            sending: &sending,
            receiving: &receiving,
            arrivals: &mut arrivals,
            done: now.clone(),
        };
        for (r, &mine) in prims.iter().enumerate() {
            for p in mine {
                if let Some(from) = p.recvs_from() {
                    let t = step.arrival(from as usize, r, 0);
                    step.done[r] = step.done[r].max(t);
                }
                if let Some(to) = p.sends_to() {
                    step.arrival(r, to as usize, 0);
                }
            }
        }
        now = step.done;
        for i in pairs.drain(..) {
            let (from, to) = (i / n, i % n);
            let end = arrivals[i] - links.latency(from, to);
            up[from] = up[from].max(end);
            down[to] = down[to].max(end);
            arrivals[i] = f64::NAN;
            sends[i] = None;
        }
    }
    now.into_iter().fold(0.0, f64::max)
}

/// One step of every rank, played.
struct Step<'a> {
    prims: &'a [&'a [Prim]],
    /// Each rank's message to each other rank in this step.
    sends: &'a [Option<&'a Prim>],
    elem: f64,
    links: &'a Links,
    /// When each rank began the step.
    now: &'a [f64],
    /// When each rank's uplink and downlink are free of earlier steps' messages.
    up: &'a [f64],
    down: &'a [f64],
    /// This step's messages from and to each rank.
    sending: &'a [u32],
    receiving: &'a [u32],
    /// When `to` has the whole message `from` sends it in this step (`from * n + to`;
    /// NaN: not played yet).
    arrivals: &'a mut [f64],
    /// When each rank is done with the step so far.
    done: Vec<f64>,
}

impl Step<'_> {
    /// When `to` has the whole message `from` sends it in this step. It shares the
    /// sender's uplink and the receiver's downlink with the step's other messages there
    /// (its bytes take as many times longer as the busier of the two carries), and
    /// waits for earlier steps' messages to leave them.
    fn arrival(&mut self, from: usize, to: usize, depth: usize) -> f64 {
        let at = from * self.prims.len() + to;
        if !self.arrivals[at].is_nan() {
            return self.arrivals[at];
        }
        let Some(p) = self.sends[at] else {
            // Nothing to wait for (a built schedule always matches its receives).
            return self.now[to];
        };
        let share = self.sending[from].max(self.receiving[to]).max(1) as f64;
        let bytes = p.len() as f64 * self.elem * share;
        let links = self.links;
        let ready = self.now[from].max(self.up[from]).max(self.down[to]);
        let end = match p.recvs_from() {
            // A forward starts once its first piece has come and ends no sooner than a
            // piece after its last (a chain is at most the world long; anything longer
            // would be a cycle, where nothing waits).
            Some(src) if depth < self.prims.len() => {
                let src = src as usize;
                let incoming = self.arrival(src, from, depth + 1);
                let first = incoming - links.transfer(src, from, (bytes - PIECE_BYTES).max(0.0));
                (ready.max(first) + links.transfer(from, to, bytes))
                    .max(incoming + links.transfer(from, to, bytes.min(PIECE_BYTES)))
            }
            _ => ready + links.transfer(from, to, bytes),
        };
        self.done[from] = self.done[from].max(end);
        let t = end + links.latency(from, to);
        self.arrivals[at] = t;
        t
    }
}

/// Roots a rooted kind is modelled from: a table holds one algorithm per kind and size,
/// whoever the root, so it is chosen on a few roots spread over the world.
fn roots(kind: CollectiveKind, world: usize) -> Vec<u32> {
    if !kind.is_rooted() {
        return vec![0];
    }
    let mut r: Vec<u32> = [0, world / 3, 2 * world / 3]
        .into_iter()
        .map(|x| x as u32)
        .collect();
    r.dedup();
    r
}

/// The sizes [`tune`] models `kind` at in a world of `world`: [`TUNE_SIZES`], and the
/// last size before each change of the tuner's default (all_gather's and
/// reduce_scatter's depend on the world: 256 KiB in all), so that the default is one
/// algorithm over every band `(previous, size]` (the first from 0).
fn samples(kind: CollectiveKind, world: u32) -> Vec<u64> {
    let default = |b: u64| choose_algo(kind, b as usize, world, None).algo;
    let mut s = TUNE_SIZES.to_vec();
    let (mut i, mut lo) = (0, 0u64);
    while i < s.len() {
        let hi = s[i];
        let first = default(lo);
        if default(hi) != first {
            // The last size of the band with the band's first algorithm: bisection
            // (the default is a step function of the size).
            let (mut a, mut b) = (lo, hi);
            while b - a > 1 {
                let m = a + (b - a) / 2;
                match default(m) == first {
                    true => a = m,
                    false => b = m,
                }
            }
            s.insert(i, a);
        }
        lo = s[i] + 1;
        i += 1;
    }
    s
}

/// The algorithm each collective should take at each size on `links` with the ring
/// `ring` (a world of three to [`MODEL_MAX_WORLD`] ranks; empty otherwise): for every
/// kind with more than one algorithm and every size of [`TUNE_SIZES`] (barrier: once),
/// the fastest one where it beats the tuner's default by [`MODEL_MARGIN`] more than it
/// would on uniform links (the median link everywhere), the default otherwise. The
/// defaults were measured on uniform links and the model does not know everything they
/// saw (the cores a rank's processes share, the cost of a piece): it is trusted for what
/// the measured links' differences change, so on uniform links nothing changes; consecutive sizes with one algorithm are one entry, and a kind's last
/// entry covers every larger call ([`eccl_protocol::World::tuned`]).
pub fn tune(ring: Option<&[u32]>, links: &Links) -> Vec<Tuned> {
    let n = links.len();
    if !(3..=MODEL_MAX_WORLD).contains(&n) {
        return Vec::new();
    }
    let Some(uniform) = links.typical() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for kind in CollectiveKind::ALL {
        let algos = available_algos(kind);
        if algos.len() < 2 {
            continue;
        }
        let sizes = match kind {
            CollectiveKind::Barrier => vec![0],
            _ => samples(kind, n as u32),
        };
        let built: Vec<(Algo, Vec<Vec<Schedule>>)> = algos
            .iter()
            .map(|&a| {
                let each = roots(kind, n)
                    .into_iter()
                    .filter_map(|root| schedules(kind, a, TUNE_COUNT, root, ring, n))
                    .collect();
                (a, each)
            })
            .collect();
        let mut entries: Vec<Tuned> = Vec::new();
        for size in sizes {
            let elem = size as f64 / TUNE_COUNT as f64;
            let time = |algo: Algo, links: &Links| match built.iter().find(|b| b.0 == algo) {
                Some((_, each)) if !each.is_empty() => {
                    each.iter().map(|s| play(s, elem, links)).sum::<f64>()
                }
                _ => f64::INFINITY,
            };
            let default = choose_algo(kind, size as usize, n as u32, None).algo;
            let t_default = time(default, links);
            let (best, t_best) = algos
                .iter()
                .map(|&a| (a, time(a, links)))
                .fold((default, t_default), |b, c| if c.1 < b.1 { c } else { b });
            // What the model would say on uniform links, where the default was measured
            // to be right: only a gain beyond that is the measured links' doing.
            let bias = match best == default {
                true => 1.0,
                false => (time(default, &uniform) / time(best, &uniform)).max(1.0),
            };
            let algo = match t_best * MODEL_MARGIN * bias < t_default {
                true => best,
                false => default,
            };
            match entries.last_mut() {
                Some(last) if last.algo == algo => last.up_to = size,
                _ => entries.push(Tuned {
                    kind,
                    up_to: size,
                    algo,
                }),
            }
        }
        if let Some(last) = entries.last_mut() {
            last.up_to = u64::MAX;
        }
        out.extend(entries);
    }
    out
}

/// Every kind with a ring algorithm and another one takes the ring at every size: the
/// table of a world too large to model whose links off the ring are much slower than
/// its own ([`eccl_protocol::KEEP_TO_RING`]).
pub fn keep_to_ring() -> Vec<Tuned> {
    CollectiveKind::ALL
        .into_iter()
        .filter(|&k| {
            let algos = available_algos(k);
            algos.len() > 1 && algos.contains(&Algo::Ring)
        })
        .map(|kind| Tuned {
            kind,
            up_to: u64::MAX,
            algo: Algo::Ring,
        })
        .collect()
}

/// The call the rootless trees are placed by: all_reduce's tree reduces to the rank at
/// the ring's first place and broadcasts from it (barrier's dissemination has no root).
const TREE_BYTES: u64 = 64 << 10;

/// `ring` turned so that the rootless trees (all_reduce's, rooted at the ring's first
/// place) are fastest on `links`: the ring's own links are the same in every turn, but
/// a tree's are not, and its root sits where its edges are fastest. The order as given
/// unless a turn is faster by more than 1 % (a world of three to [`MODEL_MAX_WORLD`]).
pub fn rotate_for_trees(ring: &[u32], links: &Links) -> Vec<u32> {
    let n = ring.len();
    if !(3..=MODEL_MAX_WORLD).contains(&n) || links.len() != n {
        return ring.to_vec();
    }
    let time = |order: &[u32]| {
        call_time(
            CollectiveKind::AllReduce,
            Algo::Tree,
            TREE_BYTES,
            0,
            Some(order),
            links,
        )
        .unwrap_or(f64::INFINITY)
    };
    let given = time(ring);
    let mut best = (given, ring.to_vec());
    for turn in 1..n {
        let mut order = ring.to_vec();
        order.rotate_left(turn);
        let t = time(&order);
        if t < best.0 {
            best = (t, order);
        }
    }
    match best.0 < given * 0.99 {
        true => best.1,
        false => ring.to_vec(),
    }
}

/// A world's tuned algorithms ([`eccl_protocol::World::tuned`]) in one line, for
/// `ECCL_DEBUG=INFO` and `eccl-bench --show-topology`: each kind's algorithms by size.
pub fn describe(tuned: &[Tuned]) -> String {
    if tuned.is_empty() {
        return "as without measurements".into();
    }
    let mut out: Vec<String> = Vec::new();
    for t in tuned {
        let size = match t.up_to {
            u64::MAX => "beyond".to_string(),
            n => format!("<= {n} B"),
        };
        match out.last_mut() {
            Some(last) if last.starts_with(&format!("{}:", t.kind)) => {
                last.push_str(&format!(", {} {size}", t.algo))
            }
            _ => out.push(format!("{}: {} {size}", t.kind, t.algo)),
        }
    }
    out.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use CollectiveKind::*;

    /// `n` ranks on links of `bw` bytes/s and `lat` seconds, but those between `slow`
    /// pairs (both ways) at `bw / factor`.
    fn links(n: usize, bw: f64, lat: f64, slow: &[(usize, usize)], factor: f64) -> Links {
        Links::from_fn(n, |i, j| {
            let s = slow.contains(&(i, j)) || slow.contains(&(j, i));
            (if s { bw / factor } else { bw }, lat)
        })
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
    }

    #[test]
    fn a_ring_all_reduce_costs_its_steps_on_the_slowest_ring_link() {
        let (bw, lat) = (1e9, 10e-6);
        let bytes = 4u64 << 20;
        let l = links(4, bw, lat, &[], 1.0);
        let t = call_time(AllReduce, Algo::Ring, bytes, 0, None, &l).unwrap();
        // 2(n-1) steps of count/n each.
        let step = lat + (bytes / 4) as f64 / bw;
        assert!(close(t, 6.0 * step), "{t} vs {}", 6.0 * step);
        // One slow link in the ring (1 -> 2) sets every step's pace: rank 1 sends over
        // it step after step (its sends do not wait for rank 2), and rank 2 ends one
        // latency after its last chunk.
        let slow = links(4, bw, lat, &[(1, 2)], 10.0);
        let t = call_time(AllReduce, Algo::Ring, bytes, 0, None, &slow).unwrap();
        let want = 6.0 * (bytes / 4) as f64 / (bw / 10.0) + lat;
        assert!(close(t, want), "{t} vs {want}");
        // ... and a ring that avoids it does not see it.
        let t = call_time(AllReduce, Algo::Ring, bytes, 0, Some(&[0, 1, 3, 2]), &slow).unwrap();
        let step = lat + (bytes / 4) as f64 / bw;
        assert!(close(t, 6.0 * step), "{t} vs {}", 6.0 * step);
    }

    #[test]
    fn direct_shares_the_uplink_and_a_chain_pipelines_its_pieces() {
        let (bw, lat) = (1e9, 10e-6);
        let l = links(4, bw, lat, &[], 1.0);
        // Direct all_reduce: three copies of the buffer leave each rank in one step.
        let bytes = 1u64 << 20;
        let t = call_time(AllReduce, Algo::Direct, bytes, 0, None, &l).unwrap();
        assert!(close(t, 3.0 * bytes as f64 / bw + lat), "{t}");
        // A broadcast chain of 16 MiB: the buffer once, then a piece and a latency per
        // further hop.
        let bytes = 16u64 << 20;
        let t = call_time(Broadcast, Algo::Ring, bytes, 0, None, &l).unwrap();
        let want = bytes as f64 / bw + lat + 2.0 * (PIECE_BYTES / bw + lat);
        assert!(close(t, want), "{t} vs {want}");
    }

    #[test]
    fn unusable_links_take_forever() {
        let l = Links::from_fn(3, |i, j| {
            if (i, j) == (0, 1) {
                (0.0, 1e-6)
            } else {
                (1e9, 1e-6)
            }
        });
        let t = call_time(AllReduce, Algo::Direct, 1024, 0, None, &l).unwrap();
        assert!(t.is_infinite());
        assert!(call_time(Scatter, Algo::Ring, 1024, 0, None, &l).is_none());
    }

    #[test]
    fn on_uniform_fast_links_the_table_keeps_the_measured_defaults() {
        // Loopback-like: 3 GB/s, 20 us. Every size, not only the modelled ones: a band
        // must not carry its upper end's choice over a change of the default inside it
        // (all_gather's at 256 KiB in all: 32 KiB blocks at 8 ranks, 85 KiB at 3).
        let mut sizes: Vec<u64> = vec![0, 1, 255, 256, 257];
        let mut b = 1.0f64;
        while b < 4e9 {
            sizes.extend([b as u64, b as u64 + 1]);
            b *= 1.07;
        }
        for n in [3u32, 4, 5, 8, 12] {
            sizes.extend([
                GATHER_SMALL_BYTES as u64 / n as u64,
                GATHER_SMALL_BYTES as u64 / n as u64 + 1,
            ]);
            let l = links(n as usize, 3e9, 20e-6, &[], 1.0);
            let ring: Vec<u32> = (0..n).collect();
            let world = eccl_protocol::World {
                epoch: 1,
                members: Vec::new(),
                ring: ring.clone(),
                stripes: Vec::new(),
                tuned: tune(Some(&ring), &l),
            };
            assert!(!world.tuned.is_empty());
            for kind in CollectiveKind::ALL {
                for &size in &sizes {
                    let Some(t) = world.tuned_algo(kind, size) else {
                        continue;
                    };
                    let default = choose_algo(kind, size as usize, n, None).algo;
                    assert_eq!(t.algo, default, "{n} ranks, {kind} of {size} B: {t:?}");
                }
            }
        }
    }

    #[test]
    fn slow_links_off_the_ring_send_small_calls_around_it() {
        // Four ranks on 1 Gbit/s links, but 0-2 and 1-3 are 100x slower: the ring
        // 0 1 2 3 keeps to fast links, and every call that sends straight across
        // crosses a slow one.
        let l = links(4, 125e6, 50e-6, &[(0, 2), (1, 3)], 100.0);
        let ring = [0, 1, 2, 3];
        let table = tune(Some(&ring), &l);
        let at = |kind, bytes: u64| {
            table
                .iter()
                .find(|t| t.kind == kind && bytes <= t.up_to)
                .map(|t| t.algo)
        };
        // 64 KiB all_reduce: direct (the default) would send 192 KiB over a 1.25 MB/s
        // link; the ring moves 96 KiB over fast ones.
        assert_eq!(at(AllReduce, 64 << 10), Some(Algo::Ring));
        assert_eq!(at(AllToAll, 1 << 20), Some(Algo::Ring));
        assert_eq!(at(AllGather, 1 << 10), Some(Algo::Ring));
        // Large calls were the ring's already.
        assert_eq!(at(AllReduce, 1 << 30), Some(Algo::Ring));
        // Entries grow within a kind and the last covers everything.
        for k in CollectiveKind::ALL {
            let of: Vec<_> = table.iter().filter(|t| t.kind == k).collect();
            assert!(of
                .windows(2)
                .all(|w| w[0].up_to < w[1].up_to && w[0].algo != w[1].algo));
            if let Some(last) = of.last() {
                assert_eq!(last.up_to, u64::MAX);
            }
        }
        assert!(table
            .iter()
            .all(|t| available_algos(t.kind).contains(&t.algo)));
        let line = describe(&table);
        assert!(line.contains("all_reduce: ring beyond"), "{line}");
        assert!(line.contains("all_to_all: ring beyond"), "{line}");
        assert_eq!(describe(&[]), "as without measurements");
        // Too small or too large a world: no table.
        assert!(tune(None, &links(2, 1e9, 1e-6, &[], 1.0)).is_empty());
        assert!(tune(None, &links(MODEL_MAX_WORLD + 1, 1e9, 1e-6, &[], 1.0)).is_empty());
    }

    #[test]
    fn the_largest_modelled_world_is_tuned_by_size() {
        // Two sites of 32 ranks each, 10 Gbit/s inside, 100 Mbit/s and 5 ms between.
        let n = MODEL_MAX_WORLD;
        let l = Links::from_fn(n, |i, j| match (i < n / 2) == (j < n / 2) {
            true => (1.25e9, 20e-6),
            false => (12.5e6, 5e-3),
        });
        let ring: Vec<u32> = (0..n as u32).collect();
        let started = std::time::Instant::now();
        let table = tune(Some(&ring), &l);
        eprintln!(
            "tune({n} ranks): {:?}: {}",
            started.elapsed(),
            describe(&table)
        );
        // A small all_reduce keeps its tree, which crosses between the sites once per
        // level that does: the ring's 126 steps would each wait for the 5 ms link.
        let small = table
            .iter()
            .find(|t| t.kind == AllReduce && 1024 <= t.up_to)
            .unwrap();
        assert_eq!(small.algo, Algo::Tree);
        assert!(table
            .iter()
            .all(|t| available_algos(t.kind).contains(&t.algo)));
    }

    #[test]
    fn the_rootless_tree_is_turned_to_sit_on_fast_links() {
        // Eight ranks; rank 2 reaches everyone slowly but its ring neighbours. In rank
        // order the tree joins places 0 and 2 (a slow edge); turned by one, rank 2 sits
        // at a leaf whose one edge goes to its ring neighbour.
        let n = 8;
        let slow: Vec<(usize, usize)> = (0..n)
            .filter(|&j| ![1, 2, 3].contains(&j))
            .map(|j| (2, j))
            .collect();
        let l = links(n, 1e9, 10e-6, &slow, 50.0);
        let ring: Vec<u32> = (0..n as u32).collect();
        let turned = rotate_for_trees(&ring, &l);
        let time = |order: &[u32]| {
            call_time(AllReduce, Algo::Tree, TREE_BYTES, 0, Some(order), &l).unwrap()
        };
        assert!(time(&turned) < time(&ring) / 10.0, "{turned:?}");
        // Every turn is as fast or slower than the one chosen, and it is a turn.
        for k in 0..n {
            let mut o = ring.clone();
            o.rotate_left(k);
            assert!(time(&turned) <= time(&o) + 1e-12);
        }
        let k = turned.iter().position(|&r| r == 0).unwrap();
        let mut back = turned.clone();
        back.rotate_left(k);
        assert_eq!(back, ring);
        // On uniform links nothing is turned.
        assert_eq!(
            rotate_for_trees(&ring, &links(n, 1e9, 10e-6, &[], 1.0)),
            ring
        );
    }
}
