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

/// Direct with blocks of any sizes (MPI's `alltoallv`, torch's `all_to_all_single` with
/// split sizes): `send[j]` elements of the input go to rank `j` and `recv[j]` elements
/// of the output come from it, each block where the ones before it end. Every pair
/// exchanges exactly its own blocks, nothing padded. The executor names each message by
/// its own length (see `peer`'s executor), so a pair whose two ends disagree on their
/// block fails with a mismatch.
pub(crate) fn uneven(rank: usize, world: usize, send: &[usize], recv: &[usize]) -> Body {
    // Where each block starts: prefix sums, once.
    let starts = |counts: &[usize]| -> Vec<usize> {
        counts
            .iter()
            .scan(0, |at, &c| {
                let here = *at;
                *at += c;
                Some(here)
            })
            .collect()
    };
    let (send_at, recv_at) = (starts(send), starts(recv));
    let mut plan = Plan::new(1);
    plan.push(
        0,
        Prim::Copy {
            src: Region::input(send_at[rank], send[rank]),
            dst: Region::output(recv_at[rank], recv[rank]),
        },
    );
    for j in (0..world).filter(|&j| j != rank) {
        plan.push(
            0,
            Prim::Send {
                peer: j as u32,
                src: Region::input(send_at[j], send[j]),
            },
        );
        plan.push(
            0,
            Prim::Recv {
                peer: j as u32,
                dst: Region::output(recv_at[j], recv[j]),
            },
        );
    }
    plan.finish(0)
}

/// Ring: every block travels right around the ring until it reaches its rank, so a
/// rank talks only to its two neighbours (over a solved ring, the fast links) at the
/// cost of more bytes: `n(n-1)/2` blocks per link instead of one per pair. For worlds
/// whose slow links the direct algorithm would cross (the quantized all_reduce's
/// all_to_all over `ECCL_ALGO=ring`).
///
/// Step 0 sends this rank's blocks in ring order (for `r+1, r+2, ..., r-1`) right. In
/// step `k` a rank receives from the left the blocks that rank `r-k-1` sent, still in
/// ring order and starting with its own: it keeps the first (its output block from
/// `r-k-1`, copied out at the start of the next step) and sends the rest on. Two scratch
/// areas of `n-1` blocks take turns: one is sent from while the other is received into.
pub(crate) fn ring(cx: &Ctx) -> Body {
    let (n, r, c) = (cx.world, cx.rank, cx.count);
    let (x, y) = (0, (n - 1) * c);
    // The area that holds what step `k` receives (`n-k-1` blocks); step 0 sends from `y`.
    let area = |k: usize| if k.is_multiple_of(2) { x } else { y };
    let mut plan = Plan::new(n);
    plan.push(
        0,
        Prim::Copy {
            src: Region::input(r * c, c),
            dst: Region::output(r * c, c),
        },
    );
    // This rank's blocks for r+1..n-1, then for 0..r-1: ring order from r+1.
    let after = n - 1 - r;
    if after > 0 {
        plan.push(
            0,
            Prim::Copy {
                src: Region::input((r + 1) * c, after * c),
                dst: Region::scratch(y, after * c),
            },
        );
    }
    if r > 0 {
        plan.push(
            0,
            Prim::Copy {
                src: Region::input(0, r * c),
                dst: Region::scratch(y + after * c, r * c),
            },
        );
    }
    plan.push(
        0,
        Prim::Send {
            peer: cx.right(),
            src: Region::scratch(y, (n - 1) * c),
        },
    );
    for k in 0..n - 1 {
        let blocks = n - 1 - k;
        if k > 0 {
            // What step k-1 received: this rank's block first, the rest goes on.
            let held = area(k - 1);
            plan.push(
                k,
                Prim::Send {
                    peer: cx.right(),
                    src: Region::scratch(held + c, blocks * c),
                },
            );
        }
        plan.push(
            k,
            Prim::Recv {
                peer: cx.left(),
                dst: Region::scratch(area(k), blocks * c),
            },
        );
        // Step k received rank r-k-1's blocks; its block for this rank comes out first
        // thing in step k+1 (local primitives run before the step's sends).
        let from = cx.sub(r, k + 1);
        plan.push(
            k + 1,
            Prim::Copy {
                src: Region::scratch(area(k), c),
                dst: Region::output(from * c, c),
            },
        );
    }
    plan.finish(2 * (n - 1) * c)
}
