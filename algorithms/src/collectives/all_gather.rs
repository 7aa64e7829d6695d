//! all_gather: every rank ends with every rank's input, block `j` from rank `j`.

use super::{Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Ring: `n-1` steps; in step `s` rank `r` passes block `r-s` right and receives block
/// `r-s-1` from the left, each block travelling once around the ring.
pub(crate) fn ring(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let block = |b: usize| Region::output(b * c, c);
    let mut plan = Plan::new(n - 1);
    plan.push(
        0,
        Prim::Copy {
            src: Region::input(0, c),
            dst: block(r),
        },
    );
    for s in 0..n - 1 {
        let src = if s == 0 {
            Region::input(0, c)
        } else {
            block(cx.sub(r, s))
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
            Prim::Recv {
                peer: cx.left(),
                dst: block(cx.sub(r, s + 1)),
            },
        );
    }
    plan.finish(0)
}

/// Direct: one step, every rank sends its input to every other rank.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let mut plan = Plan::new(1);
    plan.push(
        0,
        Prim::Copy {
            src: Region::input(0, c),
            dst: Region::output(r * c, c),
        },
    );
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
                dst: Region::output(j * c, c),
            },
        );
    }
    plan.finish(0)
}
