//! The same-host collectives' logic on the host-memory device: ranks are threads, the
//! exchange is an in-memory all_gather. Results are compared with the CPU kernels, bit for
//! bit, for every dtype and op, world sizes 1 to 8 and counts that do not divide evenly;
//! all_gather, reduce_scatter and broadcast in and out of place, with a GPU per rank and
//! with ranks sharing GPUs.

use std::sync::{Arc, Condvar, Mutex};

use eccl_algorithms::kernels;
use eccl_cuda::ipc::{chunk, Exchange, IpcComm, IpcError};
use eccl_cuda::{Device, HostDevice};
use eccl_protocol::{DType, ReduceOp};

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

#[derive(Default)]
struct Round {
    gen: u64,
    slots: Vec<Option<Vec<u8>>>,
    done: Option<Vec<Vec<u8>>>,
    dead: bool,
}

/// An all_gather among `world` threads; `kill` makes every later round fail, as a dead
/// peer makes eccl's collectives fail.
#[derive(Clone)]
struct Mem {
    world: usize,
    state: Arc<(Mutex<Round>, Condvar)>,
}

impl Mem {
    fn new(world: usize) -> Mem {
        Mem {
            world,
            state: Arc::new((
                Mutex::new(Round {
                    slots: vec![None; world],
                    ..Round::default()
                }),
                Condvar::new(),
            )),
        }
    }

    fn kill(&self) {
        self.state.0.lock().unwrap().dead = true;
        self.state.1.notify_all();
    }
}

struct Rank {
    mem: Mem,
    rank: usize,
    /// Fail this rank's n-th exchange (0-based), as if its peer died then.
    fail_at: Option<usize>,
    calls: usize,
    /// The world's epoch (one unless a test moves it).
    epoch: u64,
}

impl Exchange for Rank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.mem.world
    }
    fn epoch(&self) -> u64 {
        self.epoch
    }
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BoxErr> {
        let n = self.calls;
        self.calls += 1;
        if self.fail_at == Some(n) {
            self.mem.kill();
            return Err("the peer died".into());
        }
        let (lock, cv) = &*self.mem.state;
        let mut s = lock.lock().unwrap();
        if s.dead {
            return Err("a peer died".into());
        }
        let gen = s.gen;
        s.slots[self.rank] = Some(mine.to_vec());
        if s.slots.iter().all(|x| x.is_some()) {
            let all: Vec<Vec<u8>> = s.slots.iter_mut().map(|x| x.take().unwrap()).collect();
            s.done = Some(all.clone());
            s.gen += 1;
            cv.notify_all();
            return Ok(all);
        }
        loop {
            s = cv.wait(s).unwrap();
            if s.gen != gen {
                return Ok(s.done.clone().unwrap());
            }
            if s.dead {
                return Err("a peer died".into());
            }
        }
    }
}

fn values(dtype: DType, count: usize, rank: usize) -> Vec<u8> {
    // Small varied values: exact sums and products for integers, and for floats values
    // whose rounding differs with the order of operations.
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        let v = ((i * 7 + rank * 13) % 11) as f64 - 4.0 + 0.1 * rank as f64;
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
            DType::I8 => out.push((v as i8) as u8),
            DType::U8 => out.push((v as i64 as u8).wrapping_add(200)),
            DType::I32 => out.extend_from_slice(&(v as i32 * 1_000_003).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(v as i64 * 7_000_000_019).to_le_bytes()),
        }
    }
    out
}

fn expected(dtype: DType, op: ReduceOp, count: usize, world: usize) -> Vec<u8> {
    let mut acc = values(dtype, count, 0);
    for r in 1..world {
        kernels::reduce_inplace(dtype, op, &mut acc, &values(dtype, count, r));
    }
    kernels::finalize(dtype, op, &mut acc, world);
    acc
}

/// Runs one all_reduce on `world` threads, each on a GPU of its own; returns each rank's
/// buffer after the call and its result.
fn run(
    world: usize,
    dtype: DType,
    op: ReduceOp,
    count: usize,
    keep: bool,
    fail: Option<(usize, usize)>,
    per_rank: impl Fn(usize) -> (usize, DType, ReduceOp) + Sync,
) -> Vec<(Vec<u8>, Result<(), IpcError>, usize)> {
    run_on(&|_| None, world, dtype, op, count, keep, fail, per_rank)
        .into_iter()
        .map(|(out, res, mapped, _)| (out, res, mapped))
        .collect()
}

/// `run` with rank r on simulated GPU `gpu_of(r)` (`None`: one of its own); also returns
/// how many kernels each rank ran.
#[allow(clippy::too_many_arguments)]
fn run_on(
    gpu_of: &(dyn Fn(usize) -> Option<u32> + Sync),
    world: usize,
    dtype: DType,
    op: ReduceOp,
    count: usize,
    keep: bool,
    fail: Option<(usize, usize)>,
    per_rank: impl Fn(usize) -> (usize, DType, ReduceOp) + Sync,
) -> Vec<(Vec<u8>, Result<(), IpcError>, usize, (u64, u64))> {
    let mem = Mem::new(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let mem = mem.clone();
                let per_rank = &per_rank;
                s.spawn(move || {
                    let dev = Arc::new(match gpu_of(rank) {
                        Some(g) => HostDevice::on_gpu(g),
                        None => HostDevice::new(),
                    });
                    let (n, d, o) = per_rank(rank);
                    let n = if n == usize::MAX { count } else { n };
                    let data = values(d, n, rank);
                    let buf = dev.alloc(data.len()).unwrap();
                    unsafe { dev.upload(buf, &data).unwrap() };
                    let mut ex = Rank {
                        mem,
                        rank,
                        fail_at: fail.filter(|f| f.0 == rank).map(|f| f.1),
                        calls: 0,
                        epoch: 1,
                    };
                    let mut comm = IpcComm::new(dev.clone());
                    let res = unsafe { comm.all_reduce(&mut ex, buf, n, d, o, keep) };
                    let mut out = vec![0u8; data.len()];
                    unsafe { dev.download(&mut out, buf).unwrap() };
                    let mapped = comm.mappings();
                    drop(comm);
                    assert_eq!(
                        dev.open_mappings(),
                        0,
                        "dropping the comm unmaps everything"
                    );
                    let _ = (dtype, op);
                    (out, res, mapped, (dev.reductions(), dev.copies()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn same(_: usize) -> (usize, DType, ReduceOp) {
    (usize::MAX, DType::F32, ReduceOp::Sum)
}

#[test]
fn every_dtype_and_op_matches_the_cpu_bit_for_bit() {
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            if !op.valid_for(dtype) {
                continue;
            }
            for (world, count) in [(2, 37), (3, 64), (5, 1000)] {
                for keep in [false, true] {
                    let res = run(world, dtype, op, count, keep, None, |_| {
                        (usize::MAX, dtype, op)
                    });
                    let want = expected(dtype, op, count, world);
                    for (r, (out, res, _)) in res.iter().enumerate() {
                        res.as_ref().unwrap();
                        assert_eq!(
                            out, &want,
                            "{dtype} {op:?} world {world} rank {r} keep {keep}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn world_sizes_one_to_eight_and_ragged_counts() {
    for world in 1..=8 {
        for count in [0, 1, 3, world * 4 + 1, 4096 + 3] {
            let res = run(
                world,
                DType::F32,
                ReduceOp::Sum,
                count,
                world % 2 == 0,
                None,
                same,
            );
            let want = expected(DType::F32, ReduceOp::Sum, count, world);
            for (out, res, _) in res {
                res.unwrap();
                assert_eq!(out, want, "world {world} count {count}");
            }
        }
    }
}

#[test]
fn chunks_cover_the_buffer_once_in_whole_vectors() {
    for world in 1..=8 {
        for count in [0usize, 1, 5, 17, 4096, 100_003] {
            for dtype in [DType::F32, DType::BF16, DType::I8, DType::F64] {
                let mut next = 0;
                for r in 0..world {
                    let (s, e) = chunk(count, world, dtype, r);
                    assert_eq!(s, next);
                    assert!(e >= s);
                    if e < count {
                        assert_eq!(s * dtype.size() % 16, 0);
                    }
                    next = e;
                }
                assert_eq!(next, count);
            }
        }
    }
}

#[test]
fn ranks_that_disagree_get_the_same_typed_error_and_keep_their_data() {
    // Rank 1 asks for a different count: nobody touches anything.
    let res = run(3, DType::F32, ReduceOp::Sum, 64, false, None, |r| {
        (if r == 1 { 65 } else { 64 }, DType::F32, ReduceOp::Sum)
    });
    for (r, (out, res, _)) in res.into_iter().enumerate() {
        let n = if r == 1 { 65 } else { 64 };
        assert_eq!(out, values(DType::F32, n, r));
        match res {
            Err(IpcError::Mismatch(m)) => assert!(m.contains("rank 1"), "{m}"),
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // A dtype mismatch likewise.
    let res = run(2, DType::F32, ReduceOp::Sum, 16, true, None, |r| {
        (
            16,
            if r == 0 { DType::F32 } else { DType::I32 },
            ReduceOp::Sum,
        )
    });
    assert!(res
        .iter()
        .all(|(_, r, _)| matches!(r, Err(IpcError::Mismatch(_)))));
}

#[test]
fn an_undefined_op_is_refused_before_anything_is_exchanged() {
    let dev = Arc::new(HostDevice::new());
    let buf = dev.alloc(64).unwrap();
    let mut ex = Rank {
        mem: Mem::new(2),
        rank: 0,
        fail_at: None,
        calls: 0,
        epoch: 1,
    };
    let mut comm = IpcComm::new(dev);
    let r = unsafe { comm.all_reduce(&mut ex, buf, 16, DType::F32, ReduceOp::BXor, true) };
    assert!(matches!(r, Err(IpcError::Invalid(_))), "{r:?}");
    assert_eq!(ex.calls, 0);
}

#[test]
fn a_peer_dying_before_the_status_exchange_leaves_keep_buffers_untouched() {
    // Rank 2 "dies" at its second exchange (after every rank reduced its chunk into its
    // scratch): with keep, every survivor's buffer is as it was (G2), and the mappings of
    // the failed call are released.
    let res = run(4, DType::F32, ReduceOp::Sum, 1000, true, Some((2, 1)), same);
    for (r, (out, res, mapped)) in res.into_iter().enumerate() {
        assert!(res.is_err(), "rank {r} must fail");
        assert_eq!(
            out,
            values(DType::F32, 1000, r),
            "rank {r}'s buffer changed"
        );
        assert_eq!(mapped, 0, "rank {r} kept a dead world's mappings");
    }
}

#[test]
fn a_peer_dying_at_the_first_exchange_fails_everyone_without_a_hang() {
    for keep in [false, true] {
        let res = run(3, DType::F32, ReduceOp::Sum, 100, keep, Some((0, 0)), same);
        for (r, (out, res, _)) in res.into_iter().enumerate() {
            assert!(
                matches!(res, Err(IpcError::Exchange(_))),
                "rank {r}: {res:?}"
            );
            assert_eq!(out, values(DType::F32, 100, r));
        }
    }
}

#[test]
fn repeated_calls_reuse_mappings() {
    let mem = Mem::new(2);
    std::thread::scope(|s| {
        for rank in 0..2 {
            let mem = mem.clone();
            s.spawn(move || {
                let dev = Arc::new(HostDevice::new());
                let buf = dev.alloc(4 * 256).unwrap();
                let mut ex = Rank {
                    mem,
                    rank,
                    fail_at: None,
                    calls: 0,
                    epoch: 1,
                };
                let mut comm = IpcComm::new(dev.clone());
                for i in 0..5 {
                    let data = values(DType::F32, 256, rank + i);
                    unsafe { dev.upload(buf, &data).unwrap() };
                    unsafe {
                        comm.all_reduce(&mut ex, buf, 256, DType::F32, ReduceOp::Max, true)
                            .unwrap()
                    };
                    // The peer's buffer and scratch: two mappings, whatever the call count.
                    assert_eq!(comm.mappings(), 2);
                }
            });
        }
    });
}

#[test]
fn ranks_sharing_a_gpu_run_one_kernel_per_gpu() {
    // Processes on one GPU take turns running kernels, so only the first rank on each GPU
    // reduces (its chunk, or everything when all share one GPU); the result is the same.
    let layouts: [(&str, &(dyn Fn(usize) -> Option<u32> + Sync), u64); 3] = [
        ("one GPU", &|_| Some(7), 1),
        ("two GPUs, two ranks each", &|r| Some(r as u32 / 2), 2),
        ("interleaved", &|r| Some(r as u32 % 2), 2),
    ];
    for (what, gpu_of, gpus) in layouts {
        for keep in [false, true] {
            for (dtype, op) in [(DType::F32, ReduceOp::Sum), (DType::BF16, ReduceOp::Avg)] {
                let count = 1003;
                let res = run_on(gpu_of, 4, dtype, op, count, keep, None, |_| {
                    (usize::MAX, dtype, op)
                });
                let want = expected(dtype, op, count, 4);
                let mut kernels = 0;
                for (r, (out, res, _, (k, copies))) in res.into_iter().enumerate() {
                    res.unwrap();
                    assert_eq!(out, want, "{what} keep {keep} {dtype} rank {r}");
                    kernels += k;
                    if k == 0 {
                        assert_eq!(copies, 0, "{what}: rank {r} shares a GPU, queues nothing");
                    }
                }
                // With keep, each GPU's owner also writes every chunk into the buffers of
                // the ranks on its GPU, one kernel per chunk for all of them at once.
                let per_gpu = 1 + if keep { gpus } else { 0 };
                assert_eq!(kernels, gpus * per_gpu, "{what}: kernels per GPU");
            }
        }
    }
    // A rank that shares a GPU and dies before the status exchange: with keep, nobody's
    // buffer changed.
    let res = run_on(
        &|_| Some(3),
        3,
        DType::F32,
        ReduceOp::Sum,
        100,
        true,
        Some((1, 1)),
        same,
    );
    for (r, (out, res, mapped, _)) in res.into_iter().enumerate() {
        assert!(res.is_err(), "rank {r} must fail");
        assert_eq!(out, values(DType::F32, 100, r), "rank {r}'s buffer changed");
        assert_eq!(mapped, 0);
    }
}

/// Runs `f` on `world` threads, rank r on simulated GPU `gpu_of(r)` (`None`: its own),
/// each with its device, communicator and exchange; returns what each returned.
fn each_rank<R: Send>(
    world: usize,
    gpu_of: &(dyn Fn(usize) -> Option<u32> + Sync),
    fail: Option<(usize, usize)>,
    f: &(dyn Fn(usize, &HostDevice, &mut IpcComm<HostDevice>, &mut Rank) -> R + Sync),
) -> Vec<R> {
    let make = |rank| match gpu_of(rank) {
        Some(g) => HostDevice::on_gpu(g),
        None => HostDevice::new(),
    };
    each_rank_on(world, &make, fail, f)
}

/// [`each_rank`] with rank r's device made by `make(r)`.
fn each_rank_on<R: Send>(
    world: usize,
    make: &(dyn Fn(usize) -> HostDevice + Sync),
    fail: Option<(usize, usize)>,
    f: &(dyn Fn(usize, &HostDevice, &mut IpcComm<HostDevice>, &mut Rank) -> R + Sync),
) -> Vec<R> {
    let mem = Mem::new(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let mem = mem.clone();
                s.spawn(move || {
                    let dev = Arc::new(make(rank));
                    let mut ex = Rank {
                        mem,
                        rank,
                        fail_at: fail.filter(|f| f.0 == rank).map(|f| f.1),
                        calls: 0,
                        epoch: 1,
                    };
                    let mut comm = IpcComm::new(dev.clone());
                    let out = f(rank, &dev, &mut comm, &mut ex);
                    drop(comm);
                    assert_eq!(
                        dev.open_mappings(),
                        0,
                        "dropping the comm unmaps everything"
                    );
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn upload(dev: &HostDevice, data: &[u8]) -> u64 {
    let p = dev.alloc(data.len().max(1)).unwrap();
    unsafe { dev.upload(p, data).unwrap() };
    p
}

fn download(dev: &HostDevice, p: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    unsafe { dev.download(&mut out, p).unwrap() };
    out
}

const LAYOUTS: [(&str, &(dyn Fn(usize) -> Option<u32> + Sync)); 3] = [
    ("a GPU each", &|_| None),
    ("one GPU", &|_| Some(1)),
    ("two GPUs", &|r| Some(r as u32 % 2)),
];

#[test]
fn all_gather_gives_every_rank_every_input_in_rank_order() {
    for (what, gpu_of) in LAYOUTS {
        for world in 1..=5 {
            for (dtype, count) in [(DType::F32, 37), (DType::BF16, 8), (DType::I8, 0)] {
                for in_place in [false, true] {
                    let res = each_rank(world, gpu_of, None, &|rank, dev, comm, ex| {
                        let size = dtype.size();
                        let recv = dev.alloc((world * count * size).max(1)).unwrap();
                        let send = if in_place {
                            let p = recv + (rank * count * size) as u64;
                            unsafe { dev.upload(p, &values(dtype, count, rank)).unwrap() };
                            p
                        } else {
                            upload(dev, &values(dtype, count, rank))
                        };
                        unsafe { comm.all_gather(ex, send, recv, count, dtype) }.unwrap();
                        assert_eq!(
                            download(dev, send, count * size),
                            values(dtype, count, rank)
                        );
                        download(dev, recv, world * count * size)
                    });
                    let want: Vec<u8> = (0..world).flat_map(|r| values(dtype, count, r)).collect();
                    for (r, out) in res.iter().enumerate() {
                        assert_eq!(
                            out, &want,
                            "{what} world {world} {dtype} in place {in_place} rank {r}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_leaves_each_rank_its_slice_of_the_cpu_result() {
    for (what, gpu_of) in LAYOUTS {
        for world in 1..=5 {
            for (dtype, op) in [
                (DType::F32, ReduceOp::Sum),
                (DType::BF16, ReduceOp::Avg),
                (DType::F16, ReduceOp::Max),
                (DType::I32, ReduceOp::BXor),
            ] {
                for in_place in [false, true] {
                    let count = 19;
                    let size = dtype.size();
                    let res = each_rank(world, gpu_of, None, &|rank, dev, comm, ex| {
                        let send = upload(dev, &values(dtype, world * count, rank));
                        let recv = if in_place {
                            send + (rank * count * size) as u64
                        } else {
                            dev.alloc(count * size).unwrap()
                        };
                        unsafe { comm.reduce_scatter(ex, send, recv, count, dtype, op) }.unwrap();
                        download(dev, recv, count * size)
                    });
                    let want = expected(dtype, op, world * count, world);
                    for (r, out) in res.iter().enumerate() {
                        assert_eq!(
                            out,
                            &want[r * count * size..(r + 1) * count * size],
                            "{what} world {world} {dtype} {op:?} in place {in_place} rank {r}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn broadcast_copies_the_roots_buffer_and_never_writes_it() {
    for (what, gpu_of) in LAYOUTS {
        for world in 1..=4 {
            for root in 0..world {
                let count = 33;
                let res = each_rank(world, gpu_of, None, &|rank, dev, comm, ex| {
                    let buf = upload(dev, &values(DType::F64, count, rank));
                    unsafe { comm.broadcast(ex, buf, count, DType::F64, root) }.unwrap();
                    download(dev, buf, count * 8)
                });
                for (r, out) in res.iter().enumerate() {
                    assert_eq!(
                        out,
                        &values(DType::F64, count, root),
                        "{what} root {root} rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn overlapping_buffers_and_disagreeing_ranks_fail_everywhere_and_touch_nothing() {
    // Rank 1's all_gather input overlaps its output at another rank's slot: every rank
    // fails with the same kind of error, and no buffer changed.
    let (count, size) = (16, 4);
    let res = each_rank(3, &|_| Some(0), None, &|rank, dev, comm, ex| {
        let recv = upload(dev, &vec![0xAB; 3 * count * size]);
        let send = if rank == 1 {
            recv + 4 // inside slot 0, not its own
        } else {
            upload(dev, &values(DType::F32, count, rank))
        };
        let r = unsafe { comm.all_gather(ex, send, recv, count, DType::F32) };
        (r, download(dev, recv, 3 * count * size))
    });
    for (r, (res, out)) in res.into_iter().enumerate() {
        match res {
            Err(IpcError::Invalid(m)) => assert!(m.contains("overlap"), "rank {r}: {m}"),
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            out.iter().all(|&b| b == 0xAB),
            "rank {r}'s output was written"
        );
    }
    // Rank 0 calls all_gather, the others reduce_scatter: a mismatch on every rank.
    let res = each_rank(3, &|_| None, None, &|rank, dev, comm, ex| {
        let send = upload(dev, &values(DType::F32, 3 * count, rank));
        let recv = dev.alloc(3 * count * size).unwrap();
        if rank == 0 {
            unsafe { comm.all_gather(ex, send, recv, count, DType::F32) }
        } else {
            unsafe { comm.reduce_scatter(ex, send, recv, count, DType::F32, ReduceOp::Sum) }
        }
    });
    for (r, res) in res.into_iter().enumerate() {
        match res {
            Err(IpcError::Mismatch(m)) => assert!(m.contains("AllGather"), "rank {r}: {m}"),
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // A broadcast from a root outside the world.
    let res = each_rank(2, &|_| None, None, &|_, dev, comm, ex| {
        let buf = upload(dev, &values(DType::F32, 4, 0));
        unsafe { comm.broadcast(ex, buf, 4, DType::F32, 2) }
    });
    assert!(
        res.iter().all(|r| matches!(r, Err(IpcError::Invalid(_)))),
        "{res:?}"
    );
}

#[test]
fn a_peer_dying_fails_every_collective_without_a_hang() {
    for at in [0, 1] {
        let res = each_rank(3, &|_| Some(0), Some((2, at)), &|rank, dev, comm, ex| {
            let send = upload(dev, &values(DType::F32, 30, rank));
            let recv = dev.alloc(30 * 4).unwrap();
            let a = unsafe { comm.reduce_scatter(ex, send, recv, 10, DType::F32, ReduceOp::Sum) };
            (a.is_err(), comm.mappings())
        });
        for (r, (failed, mapped)) in res.into_iter().enumerate() {
            assert!(failed, "exchange {at}: rank {r} must fail");
            assert_eq!(
                mapped, 0,
                "exchange {at}: rank {r} kept a dead world's mappings"
            );
        }
    }
}

#[test]
fn gpus_that_cannot_reach_each_other_fail_alike_before_anything_is_written() {
    // Every GPU's owner reads every rank's buffer, so one GPU that cannot map another's
    // memory (no peer access, or hidden by CUDA_VISIBLE_DEVICES) rules the path out for
    // the whole world: every rank says so, from the same records, and nothing is written.
    type Make = dyn Fn(usize) -> HostDevice + Sync;
    let cases: [(&str, &Make, bool); 4] = [
        (
            "no peer access",
            &|r| HostDevice::on_gpu(r as u32 % 2).reaching(&[]),
            false,
        ),
        (
            "peer access one way only",
            &|r| {
                if r % 2 == 0 {
                    HostDevice::on_gpu(0).reaching(&[1])
                } else {
                    HostDevice::on_gpu(1).reaching(&[])
                }
            },
            false,
        ),
        (
            "peer access both ways",
            &|r| HostDevice::on_gpu(r as u32 % 2).reaching(&[(r as u32 + 1) % 2]),
            true,
        ),
        (
            "one GPU, no peers",
            &|_| HostDevice::on_gpu(5).reaching(&[]),
            true,
        ),
    ];
    let count = 100;
    for (what, make, reachable) in cases {
        for keep in [false, true] {
            let res = each_rank_on(3, make, None, &|rank, dev, comm, ex| {
                let data = values(DType::F32, count, rank);
                let buf = upload(dev, &data);
                let first =
                    unsafe { comm.all_reduce(ex, buf, count, DType::F32, ReduceOp::Sum, keep) };
                let out = download(dev, buf, data.len());
                let before = ex.calls;
                let recv = dev.alloc(3 * data.len()).unwrap();
                let second = unsafe { comm.all_gather(ex, buf, recv, count, DType::F32) };
                (first, out, second, ex.calls - before, data)
            });
            for (r, (first, out, second, exchanges, data)) in res.into_iter().enumerate() {
                if reachable {
                    first.unwrap();
                    second.unwrap();
                    assert_eq!(out, expected(DType::F32, ReduceOp::Sum, count, 3), "{what}");
                    continue;
                }
                assert!(
                    matches!(&first, Err(IpcError::NoPeerAccess(why)) if why.contains("cannot map")),
                    "{what} keep {keep}: rank {r}: {first:?}"
                );
                assert_eq!(out, data, "{what}: rank {r}'s buffer was written");
                // Every call asks again from its own records: one exchange, no status.
                assert!(
                    matches!(second, Err(IpcError::NoPeerAccess(_))),
                    "{what}: {second:?}"
                );
                assert_eq!(exchanges, 1, "{what}: rank {r}");
            }
        }
    }
}

/// Elements rank `s` sends rank `t` in the uneven all_to_all tests (zero for some pairs).
fn block(s: usize, t: usize, uneven: bool) -> usize {
    if uneven {
        ((s * 3 + t * 5 + 1) % 4) * 7
    } else {
        9
    }
}

#[test]
fn all_to_all_moves_every_block_to_its_rank_with_equal_and_uneven_splits() {
    for (what, gpu_of) in LAYOUTS {
        for world in 1..=5 {
            for uneven in [false, true] {
                let dtype = DType::I32;
                let size = dtype.size();
                let res = each_rank(world, gpu_of, None, &|rank, dev, comm, ex| {
                    let sends: Vec<usize> = (0..world).map(|t| block(rank, t, uneven)).collect();
                    let recvs: Vec<usize> = (0..world).map(|s| block(s, rank, uneven)).collect();
                    let (ns, nr) = (sends.iter().sum::<usize>(), recvs.iter().sum::<usize>());
                    let input = values(dtype, ns, rank);
                    let send = upload(dev, &input);
                    let recv = upload(dev, &vec![0xAB; nr * size]);
                    unsafe { comm.all_to_all(ex, send, recv, &sends, &recvs, dtype) }.unwrap();
                    assert_eq!(
                        download(dev, send, ns * size),
                        input,
                        "send is never written"
                    );
                    download(dev, recv, nr * size)
                });
                for (t, out) in res.iter().enumerate() {
                    let want: Vec<u8> = (0..world)
                        .flat_map(|s| {
                            let all: usize = (0..world).map(|u| block(s, u, uneven)).sum();
                            let from: usize = (0..t).map(|u| block(s, u, uneven)).sum();
                            values(dtype, all, s)[from * size..(from + block(s, t, uneven)) * size]
                                .to_vec()
                        })
                        .collect();
                    assert_eq!(out, &want, "{what} world {world} uneven {uneven} rank {t}");
                }
            }
        }
    }
}

#[test]
fn all_to_all_counts_that_disagree_or_buffers_that_overlap_fail_everywhere_untouched() {
    // Rank 1 expects 5 elements from rank 0, which sends it 4.
    let res = each_rank(3, &|r| Some(r as u32 % 2), None, &|rank, dev, comm, ex| {
        let sends = vec![4; 3];
        let mut recvs = vec![4; 3];
        if rank == 1 {
            recvs[0] = 5;
        }
        let send = upload(dev, &values(DType::F32, 12, rank));
        let n: usize = recvs.iter().sum();
        let recv = upload(dev, &vec![0xAB; n * 4]);
        let r = unsafe { comm.all_to_all(ex, send, recv, &sends, &recvs, DType::F32) };
        (r, download(dev, recv, n * 4))
    });
    for (r, (res, out)) in res.into_iter().enumerate() {
        match res {
            Err(IpcError::Mismatch(m)) => assert!(
                m.contains("rank 0 sends 4 elements to rank 1, which expects 5"),
                "rank {r}: {m}"
            ),
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            out.iter().all(|&b| b == 0xAB),
            "rank {r}'s output was written"
        );
    }
    // Rank 2's output overlaps its input; then, apart, rank 0 passes counts for another
    // world size: each alone fails every rank.
    for case in ["overlap", "world"] {
        let res = each_rank(3, &|_| Some(0), None, &|rank, dev, comm, ex| {
            let send = upload(dev, &values(DType::F32, 12, rank));
            let recv = if case == "overlap" && rank == 2 {
                send + 8
            } else {
                dev.alloc(12 * 4).unwrap()
            };
            let counts = if case == "world" && rank == 0 {
                vec![6; 2]
            } else {
                vec![4; 3]
            };
            unsafe { comm.all_to_all(ex, send, recv, &counts, &counts, DType::F32) }
        });
        for (r, res) in res.into_iter().enumerate() {
            match res {
                Err(IpcError::Invalid(m)) => {
                    let own = if case == "overlap" {
                        "overlaps"
                    } else {
                        "for a world of 3"
                    };
                    assert!(
                        m.contains(own) || m.contains("refused its arguments"),
                        "{case}: rank {r}: {m}"
                    );
                }
                other => panic!("{case}: rank {r}: {other:?}"),
            }
        }
    }
}

#[test]
fn gather_and_scatter_move_blocks_to_and_from_every_root() {
    for (what, gpu_of) in LAYOUTS {
        for world in 1..=4 {
            for root in 0..world {
                for in_place in [false, true] {
                    let (dtype, count) = (DType::F16, 21);
                    let size = dtype.size();
                    let res = each_rank(world, gpu_of, None, &|rank, dev, comm, ex| {
                        // Gather: the root's input may be its own slice of its output.
                        let is_root = rank == root;
                        let recv = if is_root {
                            upload(dev, &vec![0u8; world * count * size])
                        } else {
                            0
                        };
                        let send = if is_root && in_place {
                            let p = recv + (rank * count * size) as u64;
                            unsafe { dev.upload(p, &values(dtype, count, rank)).unwrap() };
                            p
                        } else {
                            upload(dev, &values(dtype, count, rank))
                        };
                        unsafe { comm.gather(ex, send, recv, count, dtype, root) }.unwrap();
                        let gathered = if is_root {
                            download(dev, recv, world * count * size)
                        } else {
                            vec![]
                        };
                        // Scatter: the root's output may be its own slice of its input.
                        let send = if is_root {
                            upload(dev, &values(dtype, world * count, 100))
                        } else {
                            0
                        };
                        let recv = if is_root && in_place {
                            send + (rank * count * size) as u64
                        } else {
                            upload(dev, &vec![0u8; count * size])
                        };
                        unsafe { comm.scatter(ex, send, recv, count, dtype, root) }.unwrap();
                        if is_root {
                            assert_eq!(
                                download(dev, send, world * count * size),
                                values(dtype, world * count, 100),
                                "the root's input is not written"
                            );
                        }
                        (gathered, download(dev, recv, count * size))
                    });
                    let all: Vec<u8> = (0..world).flat_map(|r| values(dtype, count, r)).collect();
                    let scattered = values(dtype, world * count, 100);
                    for (r, (gathered, part)) in res.iter().enumerate() {
                        let case = format!(
                            "{what} world {world} root {root} in place {in_place} rank {r}"
                        );
                        if r == root {
                            assert_eq!(gathered, &all, "{case}");
                        }
                        assert_eq!(
                            part,
                            &scattered[r * count * size..(r + 1) * count * size],
                            "{case}"
                        );
                    }
                }
            }
        }
    }
    // A root outside the world, or a root without its buffer: every rank fails alike.
    for (root, null) in [(3, false), (1, true)] {
        let res = each_rank(3, &|_| None, None, &|rank, dev, comm, ex| {
            let send = upload(dev, &values(DType::F32, 4, rank));
            let recv = if rank == root && !null {
                dev.alloc(12 * 4).unwrap()
            } else {
                0
            };
            unsafe { comm.gather(ex, send, recv, 4, DType::F32, root) }
        });
        for (r, res) in res.into_iter().enumerate() {
            assert!(
                matches!(res, Err(IpcError::Invalid(_))),
                "root {root} rank {r}: {res:?}"
            );
        }
    }
}

/// The copy lanes of the host double run a queued copy only when its mark (or a later
/// one of its lane) is waited for: a staged pipeline that read a download's buffer early,
/// or reused an upload's, would see stale bytes here.
#[test]
fn queued_copies_land_when_their_mark_is_waited_for_and_not_before() {
    let dev = HostDevice::new();
    let d = dev.alloc(64).unwrap();
    unsafe { dev.upload(d, &[7u8; 64]).unwrap() };
    let h = dev.host_alloc(64).unwrap();
    let m = unsafe { dev.download_queued(h, d, 64) }.unwrap();
    assert_eq!(unsafe { *h }, 0, "a download is not there before its mark");
    dev.wait_copy(m).unwrap();
    assert_eq!(unsafe { std::slice::from_raw_parts(h, 64) }, &[7u8; 64][..]);
    unsafe { std::ptr::write_bytes(h, 9, 64) };
    let a = unsafe { dev.upload_queued(d, h, 32) }.unwrap();
    let b = unsafe { dev.upload_queued(d + 32, h, 32) }.unwrap();
    assert_eq!((a.lane, b.lane, b.seq), (1, 1, a.seq + 1));
    let mut back = [0u8; 64];
    unsafe { dev.download(&mut back, d).unwrap() };
    assert_eq!(back, [7u8; 64], "uploads are not there before their marks");
    dev.wait_copy(b).unwrap();
    unsafe { dev.download(&mut back, d).unwrap() };
    assert_eq!(
        back, [9u8; 64],
        "a later mark covers the lane's earlier copies"
    );
    // Host memory host_alloc did not give, and ranges past either buffer, are refused.
    let mut plain = [0u8; 8];
    assert!(unsafe { dev.download_queued(plain.as_mut_ptr(), d, 8) }.is_err());
    assert!(unsafe { dev.download_queued(h, d + 32, 64) }.is_err());
    assert!(unsafe { dev.upload_queued(d, h.wrapping_add(32), 64) }.is_err());
    // Synchronize runs whatever is queued.
    let m = unsafe { dev.download_queued(h, d, 64) }.unwrap();
    dev.synchronize().unwrap();
    dev.wait_copy(m).unwrap();
    assert_eq!(dev.queued_copies(), 4, "the refused ones are not queued");
    unsafe { dev.host_free(h, 64) };
    // A device failing its copies after the first two.
    let dev = HostDevice::new().failing_copies_after(2);
    let h = dev.host_alloc(64).unwrap();
    let d = dev.alloc(64).unwrap();
    for k in 0..3 {
        let r = unsafe { dev.download_queued(h, d, 64) };
        assert_eq!(r.is_ok(), k < 2, "copy {k}: {r:?}");
    }
    dev.synchronize().unwrap();
    unsafe { dev.host_free(h, 64) };
}

/// One end of a point-to-point call between two threads: messages in order over a
/// channel each way; `die_after` fails this end's sends from its n-th on (and drops its
/// channel, as a dead process's link closes).
struct Pair {
    peer: usize,
    tx: Option<std::sync::mpsc::Sender<Vec<u8>>>,
    rx: std::sync::mpsc::Receiver<Vec<u8>>,
    die_after: Option<usize>,
    sent: usize,
}

impl eccl_cuda::ipc::PairLink for Pair {
    fn peer(&self) -> usize {
        self.peer
    }
    fn send(&mut self, bytes: &[u8]) -> Result<(), BoxErr> {
        if self.die_after == Some(self.sent) {
            self.tx = None;
            return Err("this rank died".into());
        }
        self.sent += 1;
        let tx = self.tx.as_ref().ok_or("the link is closed")?;
        tx.send(bytes.to_vec())
            .map_err(|_| "the peer is gone".into())
    }
    fn recv(&mut self, out: &mut [u8]) -> Result<(), BoxErr> {
        let m = self
            .rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .map_err(|_| "the peer is gone")?;
        if m.len() != out.len() {
            return Err(format!("a message of {} bytes, {} expected", m.len(), out.len()).into());
        }
        out.copy_from_slice(&m);
        Ok(())
    }
}

fn pair() -> (Pair, Pair) {
    let (t0, r1) = std::sync::mpsc::channel();
    let (t1, r0) = std::sync::mpsc::channel();
    let end = |peer, tx, rx| Pair {
        peer,
        tx: Some(tx),
        rx,
        die_after: None,
        sent: 0,
    };
    (end(1, t0, r0), end(0, t1, r1))
}

struct P2p {
    send: Result<(), IpcError>,
    recv: Result<(), IpcError>,
    /// The receiver's buffer after the call, and the sender's.
    got: Vec<u8>,
    src: Vec<u8>,
    /// Copies each side queued on its copy lanes.
    queued: (u64, u64),
    /// Copies each side left queued, not run, when its call returned.
    pending: (usize, usize),
}

/// `sends` (bytes, dtype) from one rank to another in order, then the receives
/// (`recvs`), stage chunks of 1 KiB: the last call's outcomes and buffers.
fn p2p(ends: (Pair, Pair), sends: &[(usize, DType)], recvs: &[(usize, DType)]) -> P2p {
    let (mut s_end, mut r_end) = ends;
    let (sdev, rdev) = (Arc::new(HostDevice::new()), Arc::new(HostDevice::new()));
    let data = |n: usize| -> Vec<u8> { (0..n).map(|i| (i * 7 + 3) as u8).collect() };
    let srcs: Vec<_> = sends
        .iter()
        .map(|&(n, _)| upload(&sdev, &data(n)))
        .collect();
    let dsts: Vec<_> = recvs
        .iter()
        .map(|&(n, _)| upload(&rdev, &vec![0xEE; n]))
        .collect();
    let (s2, r2) = (sdev.clone(), rdev.clone());
    let (send, recv) = std::thread::scope(|sc| {
        let hs = sc.spawn(|| {
            let mut ipc = IpcComm::new(s2);
            ipc.set_stage_bytes(1024);
            let mut last = Ok(());
            for (&(n, dtype), &p) in sends.iter().zip(&srcs) {
                last = unsafe { ipc.send_to(&mut s_end, p, n, dtype) };
            }
            // Before the comm's drop, which waits for whatever is queued.
            (last, sdev.pending_copies())
        });
        let hr = sc.spawn(|| {
            let mut ipc = IpcComm::new(r2);
            ipc.set_stage_bytes(1024);
            let mut last = Ok(());
            for (&(n, dtype), &p) in recvs.iter().zip(&dsts) {
                last = unsafe { ipc.recv_from(&mut r_end, p, n, dtype) };
            }
            (last, rdev.pending_copies())
        });
        (hs.join().unwrap(), hr.join().unwrap())
    });
    let ((send, s_pending), (recv, r_pending)) = (send, recv);
    let pending = (s_pending, r_pending);
    let (&(sn, _), &(rn, _)) = (sends.last().unwrap(), recvs.last().unwrap());
    P2p {
        pending,
        send,
        recv,
        got: download(&rdev, *dsts.last().unwrap(), rn),
        src: download(&sdev, *srcs.last().unwrap(), sn),
        queued: (sdev.queued_copies(), rdev.queued_copies()),
    }
}

#[test]
fn a_device_send_moves_its_chunks_through_host_memory_in_order() {
    let data = |n: usize| -> Vec<u8> { (0..n).map(|i| (i * 7 + 3) as u8).collect() };
    // Ten chunks of 1 KiB, the last one short; one chunk; nothing.
    for (bytes, chunks) in [(10_000, 10), (1000, 1), (0, 0)] {
        let r = p2p(pair(), &[(bytes, DType::U8)], &[(bytes, DType::U8)]);
        assert!(
            r.send.is_ok() && r.recv.is_ok(),
            "{bytes}: {:?} {:?}",
            r.send,
            r.recv
        );
        assert_eq!(r.got, data(bytes), "{bytes}");
        assert_eq!(
            r.src,
            data(bytes),
            "{bytes}: the sender's buffer is never written"
        );
        assert_eq!(
            r.queued,
            (chunks, chunks),
            "{bytes}: one copy per chunk on each side"
        );
    }
}

#[test]
fn device_sends_are_eager_so_a_rank_may_send_before_its_peer_receives() {
    // Three sends complete before the receiver takes any (each hands its chunks to the
    // link and returns), as host sends do: a ring of send-then-receive cannot wait for
    // itself.
    let (s_end, r_end) = pair();
    let sdev = Arc::new(HostDevice::new());
    let src = upload(&sdev, &[5u8; 3000]);
    let mut s = IpcComm::new(sdev);
    s.set_stage_bytes(1024);
    let mut s_end = s_end;
    for _ in 0..3 {
        unsafe { s.send_to(&mut s_end, src, 3000, DType::U8) }.unwrap();
    }
    let rdev = Arc::new(HostDevice::new());
    let dst = upload(&rdev, &[0u8; 3000]);
    let mut r = IpcComm::new(rdev.clone());
    let mut r_end = r_end;
    for _ in 0..3 {
        unsafe { r.recv_from(&mut r_end, dst, 3000, DType::U8) }.unwrap();
        assert_eq!(download(&rdev, dst, 3000), vec![5u8; 3000]);
    }
}

#[test]
fn a_receive_of_another_size_or_dtype_fails_naming_both_and_the_next_one_is_whole() {
    // The first receive expects 4000 bytes of 4096 sent: a Mismatch, nothing written;
    // the sender's chunks are taken, so the second receive gets the second send.
    let r = p2p(
        pair(),
        &[(4096, DType::U8), (2048, DType::U8)],
        &[(4000, DType::U8), (2048, DType::U8)],
    );
    assert!(
        r.send.is_ok() && r.recv.is_ok(),
        "{:?} {:?}",
        r.send,
        r.recv
    );
    assert_eq!(r.got, r.src);
    let r = p2p(pair(), &[(4096, DType::U8)], &[(4000, DType::U8)]);
    match &r.recv {
        Err(IpcError::Mismatch(m)) => {
            assert!(
                m.contains("sent 4096 bytes") && m.contains("receives 4000"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(r.got.iter().all(|&b| b == 0xEE), "nothing was written");
    // The same size, another dtype.
    let r = p2p(pair(), &[(16, DType::F32)], &[(16, DType::I32)]);
    assert!(
        matches!(&r.recv, Err(IpcError::Mismatch(m)) if m.contains("4 elements of float32") && m.contains("4 elements of int32")),
        "{:?}",
        r.recv
    );
}

#[test]
fn a_sender_dying_mid_transfer_fails_the_receiver_without_a_hang() {
    let (mut a, b) = pair();
    a.die_after = Some(3); // the header and two chunks, then it dies
    let t = std::time::Instant::now();
    let r = p2p((a, b), &[(8192, DType::U8)], &[(8192, DType::U8)]);
    assert!(matches!(r.send, Err(IpcError::Exchange(_))), "{:?}", r.send);
    assert!(matches!(r.recv, Err(IpcError::Exchange(_))), "{:?}", r.recv);
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    // Two chunks arrived before the sender died; the rest of the buffer is as it was.
    assert!(r.got[2048..].iter().all(|&b| b == 0xEE));
    // Neither side returned with copies still queued: the receiver's uploads into its
    // buffer and the sender's download into a stage buffer landed before the calls
    // returned, not after their callers reused the memory.
    assert_eq!(r.pending, (0, 0));
    assert_eq!(
        r.got[..2048],
        (0..2048).map(|i| (i * 7 + 3) as u8).collect::<Vec<_>>()[..]
    );
}

/// A sender whose device fails before the send (its synchronize) says so in its header
/// and sends nothing else: the receiver fails at once with an error naming it, its
/// buffer as it was, instead of waiting for chunks until its link's timeout (10 s here).
#[test]
fn a_sender_whose_device_fails_before_the_send_fails_the_receiver_at_once() {
    let (mut s_end, mut r_end) = pair();
    let (sdev, rdev) = (
        Arc::new(HostDevice::new().failing_synchronize()),
        Arc::new(HostDevice::new()),
    );
    let src = upload(&sdev, &[7u8; 4096]);
    let dst = upload(&rdev, &[0xEE; 4096]);
    let t = std::time::Instant::now();
    let (send, recv) = std::thread::scope(|sc| {
        let hs = sc.spawn(|| {
            let mut ipc = IpcComm::new(sdev.clone());
            ipc.set_stage_bytes(1024);
            unsafe { ipc.send_to(&mut s_end, src, 4096, DType::U8) }
        });
        let hr = sc.spawn(|| {
            let mut ipc = IpcComm::new(rdev.clone());
            ipc.set_stage_bytes(1024);
            unsafe { ipc.recv_from(&mut r_end, dst, 4096, DType::U8) }
        });
        (hs.join().unwrap(), hr.join().unwrap())
    });
    assert!(
        matches!(&send, Err(IpcError::Device(e)) if e.to_string().contains("illegal memory access")),
        "{send:?}"
    );
    match &recv {
        Err(IpcError::Peer { rank: 0, msg }) => {
            assert!(msg.contains("before the send, nothing sent"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(download(&rdev, dst, 4096), vec![0xEE; 4096]);
    // Nothing else was sent: the next message between the two is the next call's.
    assert!(r_end.rx.try_recv().is_err());
}

/// A call that uses a cached peer mapping (the root's output, the same every call) and
/// opens new ones (fresh inputs every call) after the cache filled: the mapping the call
/// uses is not the one it closes to make room (the host double refuses a copy through a
/// closed mapping, as a GPU faults on one).
#[test]
fn a_full_mapping_cache_never_closes_what_the_call_uses() {
    let (world, root, count, dtype) = (3, 1, 16, DType::F32);
    let size = dtype.size();
    let calls = eccl_cuda::ipc::MAX_MAPPINGS / 2 + 8;
    let res = each_rank(world, &|_| Some(1), None, &|rank, dev, comm, ex| {
        let recv = if rank == root {
            dev.alloc(world * count * size).unwrap()
        } else {
            0
        };
        for call in 0..calls {
            let send = upload(dev, &values(dtype, count, rank + call));
            unsafe { comm.gather(ex, send, recv, count, dtype, root) }
                .unwrap_or_else(|e| panic!("rank {rank} call {call}: {e}"));
            if rank == root {
                let want: Vec<u8> = (0..world)
                    .flat_map(|r| values(dtype, count, r + call))
                    .collect();
                assert_eq!(
                    download(dev, recv, world * count * size),
                    want,
                    "call {call}"
                );
            }
            // SAFETY: the call returned; nothing of it is queued.
            unsafe { dev.free(send) };
        }
        comm.mappings()
    });
    assert!(
        res.iter().all(|&m| m <= eccl_cuda::ipc::MAX_MAPPINGS),
        "mappings {res:?}"
    );
    assert!(res[0] > 0, "the owner maps the others' buffers");
}

/// A keep all_reduce of 64 f32 on three ranks, rank `faulty`'s device made faulty by
/// `fault`: each rank's outcome and its buffer after the call. The faulty rank then does
/// to the exchange what a rank that left it does (the harness would otherwise wait for
/// it for ever): a rank still waiting there fails now, and not by its record.
fn keep_all_reduce_with_a_faulty_rank(
    faulty: usize,
    fault: fn(HostDevice) -> HostDevice,
) -> Vec<(Result<(), IpcError>, Vec<u8>)> {
    each_rank_on(
        3,
        &|r| {
            let dev = HostDevice::new();
            if r == faulty {
                fault(dev)
            } else {
                dev
            }
        },
        None,
        &|rank, dev, comm, ex| {
            let buf = upload(dev, &values(DType::F32, 64, rank));
            let r = unsafe { comm.all_reduce(ex, buf, 64, DType::F32, ReduceOp::Sum, true) };
            if rank == faulty {
                ex.mem.kill();
            }
            (r, download(dev, buf, 64 * 4))
        },
    )
}

/// A rank whose buffer CUDA IPC cannot export (memory from another allocator) sends the
/// call through host memory on every rank: the same typed verdict everywhere, at once.
#[test]
fn a_buffer_that_cannot_be_exported_sends_every_rank_to_host_memory() {
    let res = keep_all_reduce_with_a_faulty_rank(2, HostDevice::failing_exports);
    for (rank, (r, after)) in res.into_iter().enumerate() {
        match r {
            Err(IpcError::NoPeerAccess(why)) => {
                assert!(why.contains("rank 2"), "rank {rank}: {why}")
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        assert_eq!(after, values(DType::F32, 64, rank), "rank {rank}'s buffer");
    }
}

/// A rank whose device fails before the call (here its synchronize) says so in its
/// record: every rank fails the call with a typed error naming that rank, at once,
/// and nobody's buffer changes. Before, that rank returned before the records exchange
/// and the others waited in it for a record that never came.
#[test]
fn a_device_that_fails_before_the_call_fails_every_rank_together() {
    let res = keep_all_reduce_with_a_faulty_rank(1, HostDevice::failing_synchronize);
    for (rank, (r, after)) in res.into_iter().enumerate() {
        match (rank, r) {
            (1, Err(IpcError::Device(e))) => {
                assert!(e.to_string().contains("illegal memory access"), "{e}")
            }
            (0 | 2, Err(IpcError::Peer { rank: 1, msg })) => {
                assert!(msg.contains("before the call, nothing touched"), "{msg}")
            }
            (_, other) => panic!("rank {rank}: {other:?}"),
        }
        assert_eq!(after, values(DType::F32, 64, rank), "rank {rank}'s buffer");
    }
}

#[test]
fn something_other_than_a_device_send_is_refused_by_name() {
    let (mut a, mut b) = pair();
    eccl_cuda::ipc::PairLink::send(&mut a, &[0u8; eccl_cuda::ipc::P2P_HEADER_BYTES]).unwrap();
    let dev = Arc::new(HostDevice::new());
    let dst = upload(&dev, &[0u8; 64]);
    let e = unsafe { IpcComm::new(dev).recv_from(&mut b, dst, 64, DType::U8) }.unwrap_err();
    assert!(
        e.to_string().contains("something other than a device send"),
        "{e}"
    );
}

/// A keep all_reduce that outgrows its scratch chunk leaves the old one allocated while
/// peers may hold it mapped (CUDA leaves freeing mapped memory undefined), and frees it
/// at the first call of a later world, whose ranks released their mappings first.
#[test]
fn an_outgrown_scratch_chunk_is_freed_only_in_a_later_world() {
    let live = each_rank(2, &|_| None, None, &|rank, dev, comm, ex| {
        let mut live = Vec::new();
        // f32: 1 MiB (a scratch chunk of 1 MiB), then 4 MiB twice (2 MiB), then a new world.
        for (epoch, count) in [(1, 1 << 18), (1, 1 << 20), (1, 1 << 20), (2, 1 << 20)] {
            ex.epoch = epoch;
            let buf = upload(dev, &values(DType::F32, count, rank));
            unsafe { comm.all_reduce(ex, buf, count, DType::F32, ReduceOp::Sum, true) }.unwrap();
            assert_eq!(
                download(dev, buf, count * 4),
                expected(DType::F32, ReduceOp::Sum, count, 2)
            );
            // SAFETY: the call returned; nothing of it is queued.
            unsafe { dev.free(buf) };
            live.push(dev.live_allocations());
        }
        live
    });
    for (rank, l) in live.iter().enumerate() {
        assert_eq!(
            l,
            &[1, 2, 2, 1],
            "rank {rank}: its allocations after each call"
        );
    }
}
