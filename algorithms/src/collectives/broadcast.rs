//! broadcast: every rank ends with the root's input. Only the root passes an input; the
//! root's output receives a copy too, so every rank's output is the result.

use super::{rounds, Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Ring: a chain root -> root+1 -> ... -> root-1 in one step. Middle ranks use
/// `RecvCopySend`, which forwards each piece as it lands, so the peer pipelines the chain
/// and a large buffer costs about one buffer-time plus `n` piece latencies.
pub(crate) fn ring(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let v = cx.rel();
    let out = Region::output(0, c);
    let mut plan = Plan::new(1);
    if v == 0 {
        plan.push(
            0,
            Prim::Copy {
                src: Region::input(0, c),
                dst: out,
            },
        );
        plan.push(
            0,
            Prim::Send {
                peer: cx.abs(1),
                src: Region::input(0, c),
            },
        );
    } else if v + 1 < n {
        plan.push(
            0,
            Prim::RecvCopySend {
                from: cx.abs(v - 1),
                to: cx.abs(v + 1),
                dst: out,
            },
        );
    } else {
        plan.push(
            0,
            Prim::Recv {
                peer: cx.abs(v - 1),
                dst: out,
            },
        );
    }
    plan.finish(0)
}

/// Direct: the root sends to every rank in one step; the root's uplink carries `n-1`
/// copies, fine for small messages and worlds.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let mut plan = Plan::new(1);
    if cx.is_root() {
        plan.push(
            0,
            Prim::Copy {
                src: Region::input(0, c),
                dst: Region::output(0, c),
            },
        );
        for j in (0..n).filter(|&j| j != cx.rank) {
            plan.push(
                0,
                Prim::Send {
                    peer: j as u32,
                    src: Region::input(0, c),
                },
            );
        }
    } else {
        plan.push(
            0,
            Prim::Recv {
                peer: cx.root as u32,
                dst: Region::output(0, c),
            },
        );
    }
    plan.finish(0)
}

/// Tree: binomial from the root, `⌈log2 n⌉` steps; in the step for distance `2^k`,
/// every rank that already holds the data sends it `2^k` ranks further.
pub(crate) fn tree(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let v = cx.rel();
    let levels = rounds(n);
    let out = Region::output(0, c);
    let mut plan = Plan::new(levels);
    if v == 0 {
        plan.push(
            0,
            Prim::Copy {
                src: Region::input(0, c),
                dst: out,
            },
        );
    }
    // The root sends its input, which needs no ordering against the copy above.
    let src = if v == 0 { Region::input(0, c) } else { out };
    for (step, k) in (0..levels).rev().enumerate() {
        let d = 1usize << k;
        if v.is_multiple_of(2 * d) && v + d < n {
            plan.push(
                step,
                Prim::Send {
                    peer: cx.abs(v + d),
                    src,
                },
            );
        } else if v % (2 * d) == d {
            plan.push(
                step,
                Prim::Recv {
                    peer: cx.abs(v - d),
                    dst: out,
                },
            );
        }
    }
    plan.finish(0)
}
