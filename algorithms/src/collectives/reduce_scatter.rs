//! reduce_scatter: rank `r` ends with the reduction of block `r` of every rank's input
//! (blocks of `count` elements).

use super::{fold_in_rank_order, slot, Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Ring: `n-1` steps; in step `s` rank `r` sends its partial of block `r-s-1` right and
/// folds block `r-s-2` arriving from the left (`incoming ⊕ own input`). Block `b` starts
/// at rank `b+1` and completes at rank `b`, its owner.
///
/// Partials in flight live in two scratch slots used alternately: the slot a step sends
/// from is never the one it receives into, so the two can run concurrently.
pub(crate) fn ring(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let block = |b: usize| Region::input(b * c, c);
    let slot_of = |s: usize| Region::scratch((s % 2) * c, c);
    let mut plan = Plan::new(n - 1 + usize::from(cx.finalize));
    for s in 0..n - 1 {
        let send = cx.sub(r, s + 1);
        let recv = cx.sub(r, s + 2);
        let src = if s == 0 { block(send) } else { slot_of(s - 1) };
        let dst = if s == n - 2 {
            Region::output(0, c)
        } else {
            slot_of(s)
        };
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
                local: block(recv),
                dst,
            },
        );
    }
    if cx.finalize {
        plan.push(
            n - 1,
            Prim::Finalize {
                region: Region::output(0, c),
            },
        );
    }
    plan.finish((n - 2).min(2) * c)
}

/// Direct: every rank sends block `j` to rank `j` and reduces the `n` copies of its own
/// block in rank order.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let mut plan = Plan::new(2);
    for j in (0..n).filter(|&j| j != r) {
        plan.push(
            0,
            Prim::Send {
                peer: j as u32,
                src: Region::input(j * c, c),
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
    fold_in_rank_order(
        cx,
        Region::input(r * c, c),
        Region::output(0, c),
        &mut plan,
        1,
    );
    plan.finish((n - 1) * c)
}
