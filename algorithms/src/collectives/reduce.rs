//! reduce: the root ends with the reduction of every rank's input; other ranks have no
//! output.

use super::{fold_in_rank_order, rounds, slot, Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Ring: a chain root+1 -> root+2 -> ... -> root in one step. Middle ranks use
/// `RecvReduceSend` without storing (they have no output), so the peer pipelines the
/// chain piece by piece. The partial grows as `((x_{root+1} ⊕ x_{root+2}) ⊕ ...) ⊕ x_root`
/// and only the root holds the result.
pub(crate) fn ring(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let v = cx.rel();
    let inp = Region::input(0, c);
    let mut plan = Plan::new(1 + usize::from(cx.finalize));
    if v == 1 {
        plan.push(
            0,
            Prim::Send {
                peer: cx.abs(2 % n),
                src: inp,
            },
        );
    } else if v > 1 {
        plan.push(
            0,
            Prim::RecvReduceSend {
                from: cx.abs(v - 1),
                to: cx.abs((v + 1) % n),
                local: inp,
                dst: None,
            },
        );
    } else {
        plan.push(
            0,
            Prim::RecvReduce {
                peer: cx.abs(n - 1),
                local: inp,
                dst: Region::output(0, c),
            },
        );
        if cx.finalize {
            plan.push(
                1,
                Prim::Finalize {
                    region: Region::output(0, c),
                },
            );
        }
    }
    plan.finish(0)
}

/// Direct: every rank sends its input to the root, which reduces them in rank order.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let mut plan = Plan::new(2);
    if !cx.is_root() {
        plan.push(
            0,
            Prim::Send {
                peer: cx.root as u32,
                src: Region::input(0, c),
            },
        );
        return plan.finish(0);
    }
    for j in (0..n).filter(|&j| j != cx.rank) {
        plan.push(
            0,
            Prim::Recv {
                peer: j as u32,
                dst: Region::scratch(slot(j, cx.rank) * c, c),
            },
        );
    }
    fold_in_rank_order(cx, Region::input(0, c), Region::output(0, c), &mut plan, 1);
    plan.finish((n - 1) * c)
}

/// Tree: binomial reduce toward the root, `⌈log2 n⌉` steps. Inner ranks accumulate in
/// scratch (only the root has an output); the root finalizes after the last step.
pub(crate) fn tree(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let v = cx.rel();
    let levels = rounds(n);
    let inp = Region::input(0, c);
    let acc_region = if v == 0 {
        Region::output(0, c)
    } else {
        Region::scratch(0, c)
    };
    let mut plan = Plan::new(levels + usize::from(cx.finalize));
    let mut acc = false;
    for k in 0..levels {
        let d = 1usize << k;
        if v.is_multiple_of(2 * d) && v + d < n {
            let local = if acc { acc_region } else { inp };
            plan.push(
                k,
                Prim::RecvReduce {
                    peer: cx.abs(v + d),
                    local,
                    dst: acc_region,
                },
            );
            acc = true;
        } else if v % (2 * d) == d {
            plan.push(
                k,
                Prim::Send {
                    peer: cx.abs(v - d),
                    src: if acc { acc_region } else { inp },
                },
            );
        }
    }
    if v == 0 && cx.finalize {
        plan.push(levels, Prim::Finalize { region: acc_region });
    }
    let scratch = if acc && v != 0 { c } else { 0 };
    plan.finish(scratch)
}
