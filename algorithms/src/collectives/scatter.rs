//! scatter: rank `r` ends with block `r` of the root's input.

use super::{Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Direct: the root sends block `j` to rank `j` in one step. Every block leaves the
/// root's uplink exactly once in any algorithm, so relaying would only add latency.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let mut plan = Plan::new(1);
    if cx.is_root() {
        let r = cx.rank;
        plan.push(
            0,
            Prim::Copy {
                src: Region::input(r * c, c),
                dst: Region::output(0, c),
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
