//! gather: the root ends with every rank's input, block `j` from rank `j`.

use super::{Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

/// Direct: every rank sends its input to the root in one step; as with scatter, the
/// root's link carries every block once whatever the algorithm.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let (n, c) = (cx.world, cx.count);
    let mut plan = Plan::new(1);
    if cx.is_root() {
        let r = cx.rank;
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
                Prim::Recv {
                    peer: j as u32,
                    dst: Region::output(j * c, c),
                },
            );
        }
    } else {
        plan.push(
            0,
            Prim::Send {
                peer: cx.root as u32,
                src: Region::input(0, c),
            },
        );
    }
    plan.finish(0)
}
