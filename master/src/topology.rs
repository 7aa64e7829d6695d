//! The ring order from measured links (the master solves it in its replicated state at
//! every epoch, `crate::registry`): an asymmetric travelling-salesman problem on
//! the matrix of what each link costs.
//!
//! A ring collective moves the same chunk over every link of the ring in each of its
//! steps, and a step ends when its slowest link is done, so the ring runs at the speed
//! of its worst link: the objective is the **bottleneck** (the largest edge cost of the
//! cycle), and among rings with the same bottleneck the one with the smallest **sum**
//! (less total load, and the next-worst links matter once the worst is fixed). An edge's
//! cost is what one step costs on it, `latency + chunk / bandwidth` ([`link_cost`]);
//! the matrix is asymmetric, as real paths are.
//!
//! - Up to [`EXACT_MAX`] members the solution is exact: the smallest threshold under
//!   which a Hamiltonian cycle exists (a subset dynamic programme over bitmasks, tried
//!   at each distinct cost by binary search), then Held and Karp's dynamic programme for
//!   the least sum among cycles under it.
//! - Beyond, a heuristic with a proven bound beside it: the bottleneck assignment (a
//!   permutation of least bottleneck; every ring is one, so its bottleneck is a lower
//!   bound on any ring's, as is the least threshold that connects the members). From
//!   the bound up, each threshold tried gets the least-sum assignment that avoids edges
//!   above it where it can (the Hungarian method), its cycles patched into one (Karp's
//!   patching, from a few starts) and a local search (moving segments of members, orientation
//!   kept) that clears what is left above; the first threshold cleared is the
//!   bottleneck, and the same search then lowers the sum.
//!
//! Everything here is deterministic, with no clock in it: the master solves inside its
//! replicated state machine, where every replica must reach the same ring from the same
//! matrix. Work is bounded by counts, sized so that 64 members solve well under a second.

/// Members up to which [`solve_ring`] is exact.
pub const EXACT_MAX: usize = 12;

/// Members up to which [`solve_ring`] solves at all; a larger world keeps the order it
/// is given (the solver's work grows with the cube of the members, and it runs in the
/// master's state machine at every epoch change).
pub const SOLVE_MAX: usize = 256;

/// Passes of the local search per threshold; each pass tries every move once.
const SEARCH_PASSES: usize = 40;

/// Longest segment the local search moves.
const MAX_SEGMENT: usize = 12;

/// Starts per threshold: the assignment again with its costs under the threshold
/// shuffled a little (deterministically), which gives other cycles to patch.
const STARTS: u64 = 24;

/// What one ring step costs on a link of `bandwidth` bytes per second and `latency`
/// seconds when the step moves `chunk` bytes. A link never measured costs infinity.
pub fn link_cost(bandwidth: f64, latency: f64, chunk: f64) -> f64 {
    if bandwidth > 0.0 && bandwidth.is_finite() && latency >= 0.0 && latency.is_finite() {
        latency + chunk / bandwidth
    } else {
        f64::INFINITY
    }
}

/// Edge costs of a world of `n` members: `cost(i, j)` is what one step costs from `i`
/// to `j` (the diagonal is ignored).
#[derive(Clone, Debug, PartialEq)]
pub struct CostMatrix {
    n: usize,
    c: Vec<f64>,
}

impl CostMatrix {
    /// `costs` row by row (`n * n` values; NaN counts as infinity, the diagonal is
    /// ignored).
    pub fn new(n: usize, costs: Vec<f64>) -> Result<CostMatrix, String> {
        if costs.len() != n * n {
            return Err(format!(
                "{} costs for {n} members (need {})",
                costs.len(),
                n * n
            ));
        }
        let c = costs
            .into_iter()
            .map(|x| {
                if x.is_nan() || x < 0.0 {
                    f64::INFINITY
                } else {
                    x
                }
            })
            .collect();
        Ok(CostMatrix { n, c })
    }

    /// A matrix from a function of the pair.
    pub fn from_fn(n: usize, mut f: impl FnMut(usize, usize) -> f64) -> CostMatrix {
        let mut c = Vec::with_capacity(n * n);
        for i in 0..n {
            for j in 0..n {
                c.push(if i == j { 0.0 } else { f(i, j) });
            }
        }
        CostMatrix::new(n, c).expect("n * n costs")
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn cost(&self, i: usize, j: usize) -> f64 {
        self.c[i * self.n + j]
    }

    /// The bottleneck and the sum of the ring that visits `order` (indices into the
    /// matrix) and closes back to its start.
    pub fn ring_cost(&self, order: &[usize]) -> (f64, f64) {
        let k = order.len();
        if k < 2 {
            return (0.0, 0.0);
        }
        let mut worst = 0.0f64;
        let mut sum = 0.0;
        for i in 0..k {
            let e = self.cost(order[i], order[(i + 1) % k]);
            worst = worst.max(e);
            sum += e;
        }
        (worst, sum)
    }

    /// The least distinct off-diagonal cost under which `holds` does, found by binary
    /// search: `holds` must be monotone in the threshold and hold at the largest cost
    /// (the complete graph).
    fn least_threshold(&self, mut holds: impl FnMut(f64) -> bool) -> f64 {
        let ts = self.thresholds();
        let (mut lo, mut hi) = (0, ts.len() - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if holds(ts[mid]) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        ts[lo]
    }

    /// Distinct off-diagonal costs, ascending (infinity included if present).
    fn thresholds(&self) -> Vec<f64> {
        let mut t: Vec<f64> = (0..self.n)
            .flat_map(|i| (0..self.n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| self.cost(i, j))
            .collect();
        t.sort_by(f64::total_cmp);
        t.dedup();
        t
    }
}

/// A solved ring.
#[derive(Clone, Debug, PartialEq)]
pub struct Ring {
    /// Members in ring order, starting with member 0: each sends to the next, the last
    /// to the first.
    pub order: Vec<usize>,
    /// The cost of its worst link.
    pub bottleneck: f64,
    /// The sum of its links' costs.
    pub sum: f64,
    /// No ring has a smaller bottleneck than this: the ring's own bottleneck when
    /// `exact`, otherwise the larger of the bottleneck assignment's and the least
    /// threshold under which the members are strongly connected.
    pub lower_bound: f64,
    /// Whether `order` is proven optimal (bottleneck first, then sum).
    pub exact: bool,
}

impl Ring {
    /// The ring `order` with its costs; `lower_bound` `None` when `order` is proven
    /// optimal (the bound is then its own bottleneck).
    fn of(m: &CostMatrix, order: Vec<usize>, lower_bound: Option<f64>) -> Ring {
        let (bottleneck, sum) = m.ring_cost(&order);
        let lower_bound = lower_bound.unwrap_or(bottleneck);
        Ring {
            exact: bottleneck <= lower_bound,
            order,
            bottleneck,
            sum,
            lower_bound,
        }
    }
}

/// The best ring through every member of `m` (see the module comment): exact up to
/// [`EXACT_MAX`] members, a heuristic beside a lower bound up to [`SOLVE_MAX`], and
/// member order beyond.
pub fn solve_ring(m: &CostMatrix) -> Ring {
    let n = m.len();
    if n <= 2 {
        return Ring::of(m, (0..n).collect(), None);
    }
    if n <= EXACT_MAX {
        return exact(m);
    }
    if n > SOLVE_MAX {
        return Ring {
            exact: false,
            ..Ring::of(m, (0..n).collect(), Some(degree_bound(m)))
        };
    }
    heuristic(m)
}

fn bits(mut x: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (x != 0).then(|| {
            let b = x.trailing_zeros() as usize;
            x &= x - 1;
            b
        })
    })
}

/// Adjacency bitsets of the edges that cost at most `t`.
fn adjacency(m: &CostMatrix, t: f64) -> Vec<u32> {
    (0..m.len())
        .map(|i| {
            (0..m.len())
                .filter(|&j| j != i && m.cost(i, j) <= t)
                .fold(0u32, |a, j| a | (1 << j))
        })
        .collect()
}

/// Whether the graph of `adj` (at most 32 nodes) has a Hamiltonian cycle: the set of
/// ends of paths from node 0 through exactly `mask`, for every mask.
fn hamiltonian(adj: &[u32]) -> bool {
    let n = adj.len();
    let full = (1usize << n) - 1;
    let mut reach = vec![0u32; 1 << n];
    reach[1] = 1;
    for mask in (1..=full).step_by(2) {
        let ends = reach[mask];
        for v in bits(ends) {
            for w in bits(adj[v] & !(mask as u32)) {
                reach[mask | 1 << w] |= 1 << w;
            }
        }
    }
    bits(reach[full]).any(|v| adj[v] & 1 != 0)
}

fn exact(m: &CostMatrix) -> Ring {
    let n = m.len();
    // The smallest threshold with a Hamiltonian cycle.
    let t = m.least_threshold(|t| hamiltonian(&adjacency(m, t)));
    // Held-Karp under the threshold: best[mask][v] is the least sum of a path from 0
    // through `mask` ending at v.
    let full = (1usize << n) - 1;
    let mut best = vec![f64::INFINITY; (1 << n) * n];
    let mut from = vec![u8::MAX; (1 << n) * n];
    // The path of node 0 alone (mask 1) ends at 0 having cost nothing.
    best[n] = 0.0;
    for mask in (1..=full).step_by(2) {
        for v in bits(mask as u32) {
            let b = best[mask * n + v];
            if b == f64::INFINITY {
                continue;
            }
            for w in 0..n {
                if mask & (1 << w) != 0 {
                    continue;
                }
                let c = m.cost(v, w);
                if c > t {
                    continue;
                }
                let next = mask | 1 << w;
                let s = b + c;
                if s < best[next * n + w] {
                    best[next * n + w] = s;
                    from[next * n + w] = v as u8;
                }
            }
        }
    }
    let mut end = usize::MAX;
    let mut total = f64::INFINITY;
    for v in 1..n {
        let c = m.cost(v, 0);
        if c <= t && best[full * n + v] + c < total {
            total = best[full * n + v] + c;
            end = v;
        }
    }
    if end == usize::MAX {
        // Costs all infinite under the threshold (unmeasured links): any order is
        // as good as another.
        return Ring::of(m, (0..n).collect(), None);
    }
    let mut order = Vec::with_capacity(n);
    let (mut mask, mut v) = (full, end);
    while v != 0 {
        order.push(v);
        let p = from[mask * n + v] as usize;
        mask &= !(1 << v);
        v = p;
    }
    order.push(0);
    order.reverse();
    Ring::of(m, order, None)
}

/// Every member needs a link out and a link in: no ring beats the worst of the
/// members' cheapest.
fn degree_bound(m: &CostMatrix) -> f64 {
    let n = m.len();
    (0..n)
        .map(|i| {
            let out = (0..n)
                .filter(|&j| j != i)
                .map(|j| m.cost(i, j))
                .fold(f64::INFINITY, f64::min);
            let inn = (0..n)
                .filter(|&j| j != i)
                .map(|j| m.cost(j, i))
                .fold(f64::INFINITY, f64::min);
            out.max(inn)
        })
        .fold(0.0, f64::max)
}

/// A perfect matching of sources to targets over edges costing at most `t` (no
/// member to itself), by augmenting paths (Kuhn); `None` if there is none.
fn assignment_under(m: &CostMatrix, t: f64) -> Option<Vec<usize>> {
    let n = m.len();
    let adj: Vec<Vec<usize>> = (0..n)
        .map(|i| (0..n).filter(|&j| j != i && m.cost(i, j) <= t).collect())
        .collect();
    let mut owner = vec![usize::MAX; n]; // target -> source
    let mut succ = vec![usize::MAX; n]; // source -> target
                                        // Greedy start, then augment the rest.
    for i in 0..n {
        if let Some(&j) = adj[i].iter().find(|&&j| owner[j] == usize::MAX) {
            owner[j] = i;
            succ[i] = j;
        }
    }
    let mut seen = vec![0usize; n];
    let mut stamp = 0;
    for i in 0..n {
        if succ[i] != usize::MAX {
            continue;
        }
        stamp += 1;
        if !augment(i, &adj, &mut owner, &mut succ, &mut seen, stamp) {
            return None;
        }
    }
    Some(succ)
}

fn augment(
    i: usize,
    adj: &[Vec<usize>],
    owner: &mut [usize],
    succ: &mut [usize],
    seen: &mut [usize],
    stamp: usize,
) -> bool {
    // Iterative depth-first search (a recursive one could be 256 frames deep).
    let mut stack: Vec<(usize, usize)> = vec![(i, 0)];
    let mut path: Vec<(usize, usize)> = Vec::new(); // (source, target) tried
    while let Some(&mut (u, ref mut k)) = stack.last_mut() {
        if *k >= adj[u].len() {
            stack.pop();
            path.pop();
            continue;
        }
        let j = adj[u][*k];
        *k += 1;
        if seen[j] == stamp {
            continue;
        }
        seen[j] = stamp;
        path.push((u, j));
        if owner[j] == usize::MAX {
            for &(s, t) in &path {
                owner[t] = s;
                succ[s] = t;
            }
            return true;
        }
        stack.push((owner[j], 0));
    }
    false
}

/// Whether the graph of edges costing at most `t` is strongly connected: every member
/// reached from member 0 along the edges and against them.
fn strongly_connected(m: &CostMatrix, t: f64) -> bool {
    let n = m.len();
    [false, true].iter().all(|&back| {
        let mut seen = vec![false; n];
        let mut stack = vec![0];
        seen[0] = true;
        while let Some(v) = stack.pop() {
            for (w, s) in seen.iter_mut().enumerate() {
                let c = if back { m.cost(w, v) } else { m.cost(v, w) };
                if w != v && !*s && c <= t {
                    *s = true;
                    stack.push(w);
                }
            }
        }
        seen.iter().all(|&x| x)
    })
}

/// The least threshold under which the members are strongly connected: a ring is, so
/// none has a smaller bottleneck. It sees what the assignment cannot, that a ring must
/// leave every group of members (a site behind a slow link) at least once.
fn connectivity_bound(m: &CostMatrix) -> f64 {
    m.least_threshold(|t| strongly_connected(m, t))
}

/// The bottleneck assignment's bottleneck: the least threshold with a perfect matching.
fn assignment_bound(m: &CostMatrix) -> f64 {
    m.least_threshold(|t| assignment_under(m, t).is_some())
}

/// Local search on `order`: moves a segment of one to [`MAX_SEGMENT`] members to another place
/// (orientation kept) while that lowers (edges costing more than `t`, sum); returns
/// the count of such edges left. Each pass tries every segment once, moving it to its
/// best place if that is better; passes stop when one moves nothing.
fn improve(m: &CostMatrix, order: &mut Vec<usize>, t: f64) -> usize {
    let n = order.len();
    let bad = |c: f64| i64::from(c > t);
    let mut left: i64 = (0..n)
        .map(|i| bad(m.cost(order[i], order[(i + 1) % n])))
        .sum();
    if n < 4 {
        return left as usize;
    }
    for _ in 0..SEARCH_PASSES {
        let mut moved = false;
        for len in 1..=MAX_SEGMENT.min(n - 3) {
            for i in 0..n {
                // The segment order[i..i+len] (cyclically), between p and q.
                let at = |k: usize| order[(i + k) % n];
                let (first, last) = (at(0), at(len - 1));
                let p = order[(i + n - 1) % n];
                let q = at(len);
                let cut = [m.cost(p, first), m.cost(last, q)];
                let join = m.cost(p, q);
                // The best place: between a = order[j] and b = order[j+1], both outside.
                let mut best: Option<(i64, f64, usize)> = None;
                for k in len..n - 1 {
                    let a = order[(i + k) % n];
                    let b = order[(i + k + 1) % n];
                    let removed = [cut[0], cut[1], m.cost(a, b)];
                    let added = [join, m.cost(a, first), m.cost(last, b)];
                    let d_bad: i64 = added.iter().map(|&c| bad(c)).sum::<i64>()
                        - removed.iter().map(|&c| bad(c)).sum::<i64>();
                    let d_sum = added.iter().sum::<f64>() - removed.iter().sum::<f64>();
                    let better = d_bad < 0 || (d_bad == 0 && d_sum < -1e-9 * (1.0 + d_sum.abs()));
                    if better && best.is_none_or(|(bb, bs, _)| (d_bad, d_sum) < (bb, bs)) {
                        best = Some((d_bad, d_sum, (i + k) % n));
                    }
                }
                if let Some((d_bad, _, j)) = best {
                    let a = order[j];
                    let seg: Vec<usize> = (0..len).map(at).collect();
                    let mut rest: Vec<usize> =
                        order.iter().copied().filter(|v| !seg.contains(v)).collect();
                    let to = rest.iter().position(|&v| v == a).expect("a is outside") + 1;
                    rest.splice(to..to, seg);
                    *order = rest;
                    left += d_bad;
                    moved = true;
                }
            }
        }
        if !moved {
            break;
        }
    }
    left.max(0) as usize
}

/// The least-sum assignment of sources to targets under `w` (`n * n`, row by row; the
/// diagonal must be prohibitive): the Hungarian method with potentials, O(n^3).
fn min_assignment(n: usize, w: &[f64]) -> Vec<usize> {
    // 1-based, column 0 the virtual start (e-maxx's formulation).
    let (mut u, mut v) = (vec![0.0f64; n + 1], vec![0.0f64; n + 1]);
    let mut p = vec![0usize; n + 1]; // column -> row
    let mut way = vec![0usize; n + 1];
    for i in 1..=n {
        p[0] = i;
        let mut j0 = 0;
        let mut minv = vec![f64::INFINITY; n + 1];
        let mut used = vec![false; n + 1];
        loop {
            used[j0] = true;
            let i0 = p[j0];
            let mut delta = f64::INFINITY;
            let mut j1 = 0;
            for j in 1..=n {
                if used[j] {
                    continue;
                }
                let cur = w[(i0 - 1) * n + (j - 1)] - u[i0] - v[j];
                if cur < minv[j] {
                    minv[j] = cur;
                    way[j] = j0;
                }
                if minv[j] < delta {
                    delta = minv[j];
                    j1 = j;
                }
            }
            for j in 0..=n {
                if used[j] {
                    u[p[j]] += delta;
                    v[j] -= delta;
                } else {
                    minv[j] -= delta;
                }
            }
            j0 = j1;
            if p[j0] == 0 {
                break;
            }
        }
        loop {
            let j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    let mut succ = vec![0usize; n];
    for j in 1..=n {
        succ[p[j] - 1] = j - 1;
    }
    succ
}

/// A ring whose edges cost at most `t` where the search finds one: the least-sum
/// assignment that pays a penalty for every edge above `t` (so it uses as few as it
/// can, then the cheapest), its cycles patched (merges that add no such edge first),
/// then the local search. Returns the ring and how many of its edges cost more.
fn ring_under(m: &CostMatrix, t: f64) -> (Vec<usize>, usize) {
    let n = m.len();
    let finite = |c: f64| if c.is_finite() { c } else { f64::MAX / 4.0 };
    let top = (0..n * n)
        .map(|k| m.c[k])
        .filter(|c| c.is_finite())
        .fold(0.0, f64::max);
    // Above any sum of n edges under t: an edge over t always costs more than that.
    let penalty = (top + 1.0) * (n as f64 + 1.0);
    let w: Vec<f64> = (0..n * n)
        .map(|k| {
            let (i, j) = (k / n, k % n);
            let c = m.c[k];
            if i == j {
                penalty * (n as f64 + 2.0)
            } else if c <= t {
                c
            } else {
                penalty + finite(c).min(penalty)
            }
        })
        .collect();
    let mut best: Option<(Vec<usize>, usize)> = None;
    for start in 0..STARTS {
        let mut w = w.clone();
        if start > 0 {
            // Costs under t moved by up to a quarter, from a generator seeded by the start.
            let mut x = start.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for (k, v) in w.iter_mut().enumerate() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if k / n != k % n && m.c[k] <= t {
                    *v *= 0.75 + 0.5 * ((x >> 11) as f64 / (1u64 << 53) as f64);
                }
            }
        }
        let succ = min_assignment(n, &w);
        let mut order = patch_under(m, succ, t);
        let left = improve(m, &mut order, t);
        if best.as_ref().is_none_or(|(_, l)| left < *l) {
            best = Some((order, left));
        }
        if left == 0 {
            break;
        }
    }
    best.expect("at least one start")
}

/// Karp's patching of the cycles of `succ` into one ring: each merge the one whose two
/// new edges add the fewest edges costing more than `t`, then cost least together.
fn patch_under(m: &CostMatrix, mut succ: Vec<usize>, t: f64) -> Vec<usize> {
    let n = m.len();
    loop {
        let mut cycle = vec![usize::MAX; n];
        let mut count = 0;
        for s in 0..n {
            if cycle[s] != usize::MAX {
                continue;
            }
            let mut v = s;
            while cycle[v] == usize::MAX {
                cycle[v] = count;
                v = succ[v];
            }
            count += 1;
        }
        if count == 1 {
            break;
        }
        // a -> succ(b) and b -> succ(a) instead of a -> succ(a) and b -> succ(b).
        let mut best = (usize::MAX, f64::INFINITY, 0, 0);
        for a in 0..n {
            for b in 0..n {
                if cycle[a] >= cycle[b] {
                    continue;
                }
                let (x, y) = (m.cost(a, succ[b]), m.cost(b, succ[a]));
                let key = (usize::from(x > t) + usize::from(y > t), x + y);
                if key.0 < best.0 || (key.0 == best.0 && key.1 < best.1) {
                    best = (key.0, key.1, a, b);
                }
            }
        }
        let (a, b) = (best.2, best.3);
        succ.swap(a, b);
    }
    let mut order = Vec::with_capacity(n);
    let mut v = 0;
    for _ in 0..n {
        order.push(v);
        v = succ[v];
    }
    order
}

/// Thresholds tried above the lower bound before the heuristic settles: the next few,
/// then ever larger steps.
const TRIES: usize = 24;

/// The heuristic alone, whatever the size (what [`solve_ring`] uses beyond
/// [`EXACT_MAX`]): for tests and comparisons against the exact solution.
pub fn heuristic(m: &CostMatrix) -> Ring {
    let lower_bound = assignment_bound(m).max(connectivity_bound(m));
    let ts = m.thresholds();
    let first = ts.partition_point(|&x| x < lower_bound);
    // The least threshold tried under which a ring is found: the bound and the next
    // few distinct costs one by one, then steps that double; the largest always works
    // (every edge is under it).
    let mut tries: Vec<usize> = (first..ts.len()).take(8).collect();
    let mut step = 2;
    while let Some(&last) = tries.last() {
        if tries.len() >= TRIES || last + 1 >= ts.len() {
            break;
        }
        tries.push((last + step).min(ts.len() - 1));
        step *= 2;
    }
    let mut order = Vec::new();
    for &k in &tries {
        let (o, left) = ring_under(m, ts[k]);
        order = o;
        if left == 0 {
            break;
        }
    }
    // Then the sum, the bottleneck kept.
    let bottleneck = m.ring_cost(&order).0;
    improve(m, &mut order, bottleneck);
    // Member 0 first, as the exact solver gives it.
    let z = order
        .iter()
        .position(|&v| v == 0)
        .expect("every member is in the ring");
    order.rotate_left(z);
    Ring::of(m, order, Some(lower_bound))
}
