//! Which algorithm a collective uses, and why (NCCL's tuner, in miniature).
//!
//! Latency dominates small messages, so the fewest rounds win there: direct while the
//! world is small enough that `n-1` simultaneous messages per rank are cheap, a tree
//! beyond. Bandwidth dominates large messages, and the ring moves the fewest bytes per
//! link. A forced algorithm (`ECCL_ALGO`, or an API argument) wins when the collective
//! has it; otherwise the default is used and the reason says so, as NCCL does.

use eccl_protocol::{Algo, CollectiveKind, Tuned};

/// Messages up to this size are latency-bound on TCP: 64 KiB is a few socket-buffer
/// round trips, below which the ring's `2(n-1)` hops cost more than the extra bytes of
/// direct or tree.
pub const SMALL_MSG_BYTES: usize = 64 << 10;

/// all_gather and reduce_scatter move a whole `count * world` buffer; direct sends each
/// block once straight to its destination, so it stays ahead of the ring up to a larger
/// total than all_reduce does (where direct sends `n-1` copies of everything).
pub const GATHER_SMALL_BYTES: usize = 256 << 10;

/// Largest world in which direct is the small-message default: beyond it, `n-1`
/// concurrent messages per rank (and for barrier, `n-1` wake-ups) cost more than the
/// `⌈log2 n⌉` rounds of a tree.
pub const DIRECT_MAX_WORLD: u32 = 4;

/// The algorithm chosen for one call and a sentence saying why, for `ECCL_DEBUG=INFO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub algo: Algo,
    pub reason: String,
}

/// Algorithms [`crate::build`] implements for `kind`; the first is listed first only by
/// convention. Empty for send/recv, which is not a schedule.
pub fn available_algos(kind: CollectiveKind) -> &'static [Algo] {
    use CollectiveKind::*;
    match kind {
        AllReduce | Broadcast | Reduce => &[Algo::Ring, Algo::Direct, Algo::Tree],
        AllGather | ReduceScatter => &[Algo::Ring, Algo::Direct],
        // all_to_all's ring is chosen, never picked: it relays (see its builder).
        AllToAll => &[Algo::Direct, Algo::Ring],
        Scatter | Gather => &[Algo::Direct],
        Barrier => &[Algo::Direct, Algo::Tree],
        SendRecv => &[],
    }
}

/// Picks the algorithm for a call of `kind` moving `bytes` in a world of `world` ranks.
///
/// `bytes` is `desc.count * dtype.size()`, in the descriptor's (NCCL's) count
/// convention: the buffer for all_reduce, broadcast and reduce; one rank's block for
/// all_gather and reduce_scatter (their whole buffer is `bytes * world`).
pub fn choose_algo(kind: CollectiveKind, bytes: usize, world: u32, forced: Option<Algo>) -> Choice {
    choose_algo_in(kind, bytes, world, forced, None)
}

/// [`choose_algo`] in a world whose links were measured: `tuned` is what the master's
/// model of those links chose for this kind and size ([`eccl_protocol::World::tuned_algo`]:
/// it plays every algorithm's schedule on the measured latencies and bandwidths, see
/// [`crate::model`]). An algorithm the kind lacks, or a world of two or fewer, is ignored.
pub fn choose_algo_in(
    kind: CollectiveKind,
    bytes: usize,
    world: u32,
    forced: Option<Algo>,
    tuned: Option<Tuned>,
) -> Choice {
    let default = match tuned {
        Some(t) if world > 2 && available_algos(kind).contains(&t.algo) => {
            let upto = match t.up_to {
                u64::MAX => "any size".to_string(),
                n => format!("up to {n} B"),
            };
            Choice {
                algo: t.algo,
                reason: format!(
                    "{kind}: {} (the master's model of the measured links, {upto})",
                    t.algo
                ),
            }
        }
        _ => default_algo(kind, bytes, world),
    };
    match forced {
        Some(algo) if available_algos(kind).contains(&algo) => Choice {
            algo,
            reason: format!("{kind}: {algo} forced (default would be {})", default.algo),
        },
        Some(algo) => Choice {
            algo: default.algo,
            reason: format!(
                "{kind}: forced {algo} is not available, falling back to {}",
                default.reason
            ),
        },
        None => default,
    }
}

fn default_algo(kind: CollectiveKind, bytes: usize, world: u32) -> Choice {
    use CollectiveKind::*;
    let small_world = world <= DIRECT_MAX_WORLD;
    let pick = |algo: Algo, why: String| Choice {
        algo,
        reason: format!("{kind}: {algo} ({why})"),
    };
    let latency_bound = |what: &str| {
        if small_world {
            pick(
                Algo::Direct,
                format!(
                    "{bytes} B <= {SMALL_MSG_BYTES} B {what}, world {world} <= {DIRECT_MAX_WORLD}"
                ),
            )
        } else {
            pick(
                Algo::Tree,
                format!(
                    "{bytes} B <= {SMALL_MSG_BYTES} B {what}, world {world} > {DIRECT_MAX_WORLD}"
                ),
            )
        }
    };
    match kind {
        AllReduce if world <= 1 => pick(Algo::Direct, "world of one, a local copy".into()),
        AllReduce | Broadcast | Reduce => {
            if bytes <= SMALL_MSG_BYTES {
                latency_bound("latency-bound")
            } else {
                pick(
                    Algo::Ring,
                    format!("{bytes} B > {SMALL_MSG_BYTES} B, bandwidth-bound"),
                )
            }
        }
        AllGather | ReduceScatter => {
            let total = bytes.saturating_mul(world as usize);
            if total <= GATHER_SMALL_BYTES {
                pick(
                    Algo::Direct,
                    format!("{total} B in all <= {GATHER_SMALL_BYTES} B"),
                )
            } else {
                pick(
                    Algo::Ring,
                    format!("{total} B in all > {GATHER_SMALL_BYTES} B, bandwidth-bound"),
                )
            }
        }
        Scatter | Gather => pick(Algo::Direct, "the only algorithm".into()),
        AllToAll => pick(
            Algo::Direct,
            "every block straight to its rank (ECCL_ALGO=ring relays around the ring)".into(),
        ),
        Barrier if small_world => {
            pick(Algo::Direct, format!("world {world} <= {DIRECT_MAX_WORLD}"))
        }
        Barrier => pick(
            Algo::Tree,
            format!("dissemination, world {world} > {DIRECT_MAX_WORLD}"),
        ),
        SendRecv => pick(Algo::Direct, "point-to-point, not a schedule".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CollectiveKind::*;

    #[test]
    fn a_tuned_algorithm_wins_over_the_default_where_the_kind_has_it() {
        let t = |kind, algo| {
            Some(Tuned {
                kind,
                up_to: u64::MAX,
                algo,
            })
        };
        let c = |k, b, w, f, tuned| choose_algo_in(k, b, w, f, tuned);
        let ch = c(AllReduce, 8, 4, None, t(AllReduce, Algo::Ring));
        assert_eq!(ch.algo, Algo::Ring);
        assert!(
            ch.reason.contains("model") && ch.reason.contains("any size"),
            "{}",
            ch.reason
        );
        assert_eq!(
            c(AllToAll, 1 << 20, 4, None, t(AllToAll, Algo::Ring)).algo,
            Algo::Ring
        );
        // An algorithm the kind lacks is ignored; forced still wins; two ranks have no
        // links off the ring.
        assert_eq!(
            c(Scatter, 1 << 20, 4, None, t(Scatter, Algo::Ring)).algo,
            Algo::Direct
        );
        assert_eq!(
            c(AllGather, 8, 4, None, t(AllGather, Algo::Tree)).algo,
            Algo::Direct
        );
        assert_eq!(
            c(
                AllReduce,
                1 << 30,
                4,
                Some(Algo::Tree),
                t(AllReduce, Algo::Ring)
            )
            .algo,
            Algo::Tree
        );
        assert_eq!(
            c(AllReduce, 8, 2, None, t(AllReduce, Algo::Ring)).algo,
            choose_algo(AllReduce, 8, 2, None).algo
        );
        assert_eq!(
            c(AllReduce, 8, 4, None, None),
            choose_algo(AllReduce, 8, 4, None)
        );
    }

    #[test]
    fn defaults_follow_size_and_world() {
        let c = |k, b, w| choose_algo(k, b, w, None).algo;
        assert_eq!(c(AllReduce, 1 << 30, 1), Algo::Direct);
        assert_eq!(c(AllReduce, SMALL_MSG_BYTES, 4), Algo::Direct);
        assert_eq!(c(AllReduce, SMALL_MSG_BYTES, 5), Algo::Tree);
        assert_eq!(c(AllReduce, SMALL_MSG_BYTES + 1, 2), Algo::Ring);
        for k in [Broadcast, Reduce] {
            assert_eq!(c(k, 100, 2), Algo::Direct);
            assert_eq!(c(k, 100, 16), Algo::Tree);
            assert_eq!(c(k, 1 << 20, 16), Algo::Ring);
        }
        for k in [AllGather, ReduceScatter] {
            assert_eq!(c(k, GATHER_SMALL_BYTES / 8, 8), Algo::Direct);
            assert_eq!(c(k, GATHER_SMALL_BYTES / 8 + 1, 8), Algo::Ring);
            assert_eq!(c(k, usize::MAX, 8), Algo::Ring);
        }
        for k in [Scatter, Gather, AllToAll] {
            assert_eq!(c(k, 1 << 30, 64), Algo::Direct);
        }
        assert_eq!(c(Barrier, 0, 4), Algo::Direct);
        assert_eq!(c(Barrier, 0, 5), Algo::Tree);
    }

    #[test]
    fn every_default_is_available() {
        for k in CollectiveKind::ALL.into_iter().filter(|k| *k != SendRecv) {
            for w in [1, 2, 4, 5, 64] {
                for b in [0, 1 << 10, 1 << 16, 1 << 17, 1 << 30] {
                    let ch = choose_algo(k, b, w, None);
                    assert!(available_algos(k).contains(&ch.algo), "{k} {b} {w}: {ch:?}");
                    assert!(ch.reason.starts_with(k.name()));
                }
            }
        }
    }

    #[test]
    fn forced_algo_wins_only_when_available() {
        let ch = choose_algo(AllReduce, 1 << 30, 8, Some(Algo::Tree));
        assert_eq!(ch.algo, Algo::Tree);
        assert!(ch.reason.contains("forced"), "{}", ch.reason);

        let ch = choose_algo(Scatter, 1 << 30, 8, Some(Algo::Ring));
        assert_eq!(ch.algo, Algo::Direct);
        assert!(ch.reason.contains("not available"), "{}", ch.reason);

        let ch = choose_algo(AllGather, 1 << 30, 8, Some(Algo::Tree));
        assert_eq!(ch.algo, Algo::Ring);
        assert!(ch.reason.contains("falling back"), "{}", ch.reason);
    }
}
