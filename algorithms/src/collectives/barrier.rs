//! barrier: no rank leaves before every rank has entered. Carries zero-length frames.

use super::{rounds, Body, Ctx, Plan};
use crate::schedule::{Prim, Region};

const EMPTY_SRC: Region = Region::input(0, 0);
const EMPTY_DST: Region = Region::output(0, 0);

/// Direct: one step, every rank tells every other rank it has arrived.
pub(crate) fn direct(cx: &Ctx) -> Body {
    let mut plan = Plan::new(1);
    for j in (0..cx.world).filter(|&j| j != cx.rank) {
        plan.push(
            0,
            Prim::Send {
                peer: j as u32,
                src: EMPTY_SRC,
            },
        );
        plan.push(
            0,
            Prim::Recv {
                peer: j as u32,
                dst: EMPTY_DST,
            },
        );
    }
    plan.finish(0)
}

/// Tree: the dissemination barrier, `⌈log2 n⌉` rounds; in round `k` rank `r` signals
/// `r + 2^k` and waits for `r - 2^k`. After the last round every rank has heard,
/// transitively, from every other, with 2 messages per rank per round instead of `n`.
pub(crate) fn tree(cx: &Ctx) -> Body {
    let levels = rounds(cx.world);
    let mut plan = Plan::new(levels);
    for k in 0..levels {
        let d = 1usize << k;
        plan.push(
            k,
            Prim::Send {
                peer: cx.add(cx.rank, d) as u32,
                src: EMPTY_SRC,
            },
        );
        plan.push(
            k,
            Prim::Recv {
                peer: cx.sub(cx.rank, d) as u32,
                dst: EMPTY_DST,
            },
        );
    }
    plan.finish(0)
}
