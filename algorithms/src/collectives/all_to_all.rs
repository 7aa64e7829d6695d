//! all_to_all: rank `r`'s output block `j` is rank `j`'s input block `r`.

use super::{Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Direct: one step, every pair exchanges its blocks. Each block has a single
/// destination, so there is nothing to gain from relaying.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let mut plan = Plan::new(1);
    plan.push(
        0,
        Prim::Copy {
            src: Region::input(r * c, c),
            dst: Region::output(r * c, c),
        },
    );
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
                dst: Region::output(j * c, c),
            },
        );
    }
    plan.finish(0)
}
