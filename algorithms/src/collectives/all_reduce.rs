//! all_reduce: every rank ends with the reduction of every rank's input.

use super::{chunk, fold_in_rank_order, rounds, slot, Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Ring: a reduce-scatter over `n` chunks, then an all-gather of the reduced chunks;
/// `2(n-1)` steps, each moving `count/n` elements per link, which is bandwidth-optimal.
///
/// In reduce-scatter step `s`, rank `r` sends chunk `r-s` right and folds chunk `r-s-1`
/// arriving from the left into its output (`incoming ⊕ own input`). Chunk `j` starts at
/// rank `j` and finishes at rank `j-1`, which alone computes it (and finalizes it) before
/// the all-gather carries the bits around unchanged.
pub(crate) fn ring(cx: &Ctx) -> Body {
    let (n, r) = (cx.world, cx.rank);
    let part = |i: usize| chunk(cx.count, n, i);
    let out = |i: usize| {
        let (o, l) = part(i);
        Region::output(o, l)
    };
    let inp = |i: usize| {
        let (o, l) = part(i);
        Region::input(o, l)
    };
    let mut plan = Plan::new(2 * (n - 1));
    for s in 0..n - 1 {
        let send = cx.sub(r, s);
        let recv = cx.sub(r, s + 1);
        // Step 0 sends our own input; later steps forward what the last step reduced.
        let src = if s == 0 { inp(send) } else { out(send) };
        plan.push(
            s,
            Prim::Send {
                peer: cx.right(),
                src,
            },
        );
        plan.push(
            s,
            Prim::RecvReduce {
                peer: cx.left(),
                local: inp(recv),
                dst: out(recv),
            },
        );
    }
    let owned = cx.add(r, 1);
    if cx.finalize {
        // Local prims run before the step's sends, so the chunk leaves finalized.
        plan.push(n - 1, Prim::Finalize { region: out(owned) });
    }
    for t in 0..n - 1 {
        let step = n - 1 + t;
        plan.push(
            step,
            Prim::Send {
                peer: cx.right(),
                src: out(cx.sub(owned, t)),
            },
        );
        plan.push(
            step,
            Prim::Recv {
                peer: cx.left(),
                dst: out(cx.sub(r, t)),
            },
        );
    }
    plan.finish(0)
}

/// Direct: every rank sends its whole input to every other rank, then each reduces all
/// `n` inputs in rank order itself. Two steps and no forwarding, at `n-1` times the
/// traffic of the ring: the choice for small messages in small worlds.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let mut plan = Plan::new(2);
    for j in (0..n).filter(|&j| j != r) {
        plan.push(
            0,
            Prim::Send {
                peer: j as u32,
                src: Region::input(0, c),
            },
        );
        plan.push(
            0,
            Prim::Recv {
                peer: j as u32,
                dst: Region::scratch(slot(j, r) * c, c),
            },
        );
    }
    fold_in_rank_order(cx, Region::input(0, c), Region::output(0, c), &mut plan, 1);
    plan.finish((n - 1) * c)
}

/// Tree: binomial reduce to rank 0, then binomial broadcast from it; `2⌈log2 n⌉` steps
/// of the whole buffer, so latency grows with log n rather than n. Rank 0 alone holds
/// (and finalizes) the result, which the broadcast copies unchanged.
pub(crate) fn tree(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let levels = rounds(n);
    let all_in = Region::input(0, c);
    let all_out = Region::output(0, c);
    let mut plan = Plan::new(2 * levels);
    // Whether our output holds a partial result yet; until it does we send our input.
    let mut acc = false;
    for k in 0..levels {
        let d = 1usize << k;
        if r % (2 * d) == 0 && r + d < n {
            let local = if acc { all_out } else { all_in };
            plan.push(
                k,
                Prim::RecvReduce {
                    peer: (r + d) as u32,
                    local,
                    dst: all_out,
                },
            );
            acc = true;
        } else if r % (2 * d) == d {
            plan.push(
                k,
                Prim::Send {
                    peer: (r - d) as u32,
                    src: if acc { all_out } else { all_in },
                },
            );
        }
    }
    if r == 0 && cx.finalize {
        plan.push(levels, Prim::Finalize { region: all_out });
    }
    for (i, k) in (0..levels).rev().enumerate() {
        let d = 1usize << k;
        let step = levels + i;
        if r % (2 * d) == 0 && r + d < n {
            plan.push(
                step,
                Prim::Send {
                    peer: (r + d) as u32,
                    src: all_out,
                },
            );
        } else if r % (2 * d) == d {
            plan.push(
                step,
                Prim::Recv {
                    peer: (r - d) as u32,
                    dst: all_out,
                },
            );
        }
    }
    plan.finish(0)
}
