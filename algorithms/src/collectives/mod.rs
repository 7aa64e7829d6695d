//! One file per collective, one function per algorithm, as Gloo lays them out.
//!
//! Every function builds one rank's steps. Two rules hold across all of them and are
//! what make the peer's job simple:
//! - Step `s` of a rank sends to a peer only what step `s` of that peer receives, so a
//!   frame is named by its step; every rank of a world has the same number of steps
//!   (idle ranks get empty ones).
//! - Every element of a reduced result is either computed by exactly one rank and copied
//!   to the others, or computed by every rank with the same expression in rank order
//!   (guarantee G3).
//!
//! The ring is rank order: rank `r` sends to `r + 1` and receives from `r - 1` (mod the
//! world). The master assigns ranks in its chosen ring order, so this is the fast ring.

pub(crate) mod all_gather;
pub(crate) mod all_reduce;
pub(crate) mod all_to_all;
pub(crate) mod barrier;
pub(crate) mod broadcast;
pub(crate) mod gather;
pub(crate) mod reduce;
pub(crate) mod reduce_scatter;
pub(crate) mod scatter;

use crate::schedule::{Prim, Region, Step};

/// What every builder needs to know about the call and this rank.
pub(crate) struct Ctx {
    pub rank: usize,
    pub world: usize,
    pub root: usize,
    /// Elements, in the descriptor's (NCCL's) convention.
    pub count: usize,
    /// Whether reduced results need a [`Prim::Finalize`] (only `avg` does).
    pub finalize: bool,
}

impl Ctx {
    /// The rank `d` places after `from` around the ring.
    pub fn add(&self, from: usize, d: usize) -> usize {
        (from + d % self.world) % self.world
    }
    /// The rank `d` places before `from` around the ring.
    pub fn sub(&self, from: usize, d: usize) -> usize {
        (from + self.world - d % self.world) % self.world
    }
    pub fn right(&self) -> u32 {
        self.add(self.rank, 1) as u32
    }
    pub fn left(&self) -> u32 {
        self.sub(self.rank, 1) as u32
    }
    /// This rank's distance from the root: trees and chains are built on it, so any root
    /// reuses the root-0 shape.
    pub fn rel(&self) -> usize {
        self.sub(self.rank, self.root)
    }
    /// The rank at distance `v` from the root.
    pub fn abs(&self, v: usize) -> u32 {
        self.add(self.root, v) as u32
    }
    pub fn is_root(&self) -> bool {
        self.rank == self.root
    }
}

/// A rank's steps and the scratch they use; [`crate::build`] adds the buffer lengths.
pub(crate) struct Body {
    pub steps: Vec<Step>,
    pub scratch_len: usize,
}

/// Steps under construction, addressed by index so that ranks stay aligned.
pub(crate) struct Plan {
    steps: Vec<Step>,
}

impl Plan {
    /// A plan with `n` steps, all empty to begin with.
    pub fn new(n: usize) -> Plan {
        Plan {
            steps: vec![Step::default(); n],
        }
    }

    pub fn push(&mut self, step: usize, prim: Prim) {
        if self.steps.len() <= step {
            self.steps.resize(step + 1, Step::default());
        }
        self.steps[step].prims.push(prim);
    }

    pub fn finish(self, scratch_len: usize) -> Body {
        Body {
            steps: self.steps,
            scratch_len,
        }
    }
}

/// Offset and length of part `i` of `count` elements split into `parts` near-equal
/// parts; the first `count % parts` parts are one element longer. Parts are empty when
/// `count < parts`, and still travel (as zero-length frames) so every rank's steps keep
/// the same shape.
pub(crate) fn chunk(count: usize, parts: usize, i: usize) -> (usize, usize) {
    let (base, extra) = (count / parts, count % parts);
    (i * base + i.min(extra), base + usize::from(i < extra))
}

/// ceil(log2(n)): rounds of a binomial tree or a dissemination barrier over n ranks.
pub(crate) fn rounds(n: usize) -> usize {
    let mut k = 0;
    while (1usize << k) < n {
        k += 1;
    }
    k
}

/// Index of rank `j`'s slot in a scratch area that holds one block from every rank but
/// `me`.
pub(crate) fn slot(j: usize, me: usize) -> usize {
    if j < me {
        j
    } else {
        j - 1
    }
}

/// Local primitives computing `x_0 ⊕ x_1 ⊕ ... ⊕ x_{n-1}` left to right into `dst`,
/// where `x_me` is `own` and every other `x_j` sits in scratch slot `slot(j, me)` of
/// `len` elements, followed by the finalize if the operator needs one. Every rank that
/// runs this for the same element evaluates the same expression, so the bits agree.
pub(crate) fn fold_in_rank_order(cx: &Ctx, own: Region, dst: Region, plan: &mut Plan, step: usize) {
    let len = dst.len;
    let x = |j: usize| {
        if j == cx.rank {
            own
        } else {
            Region::scratch(slot(j, cx.rank) * len, len)
        }
    };
    plan.push(step, Prim::Copy { src: x(0), dst });
    for j in 1..cx.world {
        plan.push(step, Prim::Reduce { src: x(j), dst });
    }
    if cx.finalize {
        plan.push(step, Prim::Finalize { region: dst });
    }
}

/// A world of one: every collective is a copy of the input (plus the finalize of a
/// reduction, which divides by one). Buffers of a one-rank world all hold `count`
/// elements, whatever the kind.
pub(crate) fn local(cx: &Ctx, barrier: bool) -> Body {
    let mut plan = Plan::new(0);
    if !barrier {
        let c = cx.count;
        plan.push(
            0,
            Prim::Copy {
                src: Region::input(0, c),
                dst: Region::output(0, c),
            },
        );
        if cx.finalize {
            plan.push(
                0,
                Prim::Finalize {
                    region: Region::output(0, c),
                },
            );
        }
    }
    plan.finish(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_buffer() {
        for count in 0..40 {
            for parts in 1..10 {
                let mut next = 0;
                for i in 0..parts {
                    let (off, len) = chunk(count, parts, i);
                    assert_eq!(off, next);
                    assert!(len == count / parts || len == count / parts + 1);
                    next = off + len;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn rounds_is_ceil_log2() {
        let want = [0, 0, 1, 2, 2, 3, 3, 3, 3, 4];
        for (n, w) in want.iter().enumerate() {
            assert_eq!(rounds(n), *w, "n={n}");
        }
    }
}
