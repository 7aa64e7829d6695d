//! Device collectives (`eccl::device::run`) against a real master, three in-process
//! ranks on the host double (`eccl_cuda::HostDevice`): where the ranks' GPUs reach each
//! other's memory the calls go GPU to GPU (IPC); where they cannot (no peer access, or a
//! GPU hidden by `CUDA_VISIBLE_DEVICES`), every kind of call goes through host memory
//! over the world's links instead, with the same results, and no device kernel runs.

use std::sync::Arc;

use crate::common::*;
use eccl::device::{Device, DeviceCall, IpcComm};
use eccl::{DType, ReduceOp};
use eccl_cuda::HostDevice;

const N: usize = 3;
const COUNT: usize = 1000;

fn values(n: usize, rank: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 3 + rank * 7) % 41) as f32 * 0.5 - 4.0)
        .collect()
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `v` in a new allocation of `dev`.
fn put(dev: &HostDevice, v: &[f32]) -> u64 {
    let b = to_bytes(v);
    let p = dev.alloc(b.len()).unwrap();
    unsafe { dev.upload(p, &b).unwrap() };
    p
}

/// `n` values at `p` on `dev`.
fn get(dev: &HostDevice, p: u64, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    unsafe { dev.download(&mut b, p).unwrap() };
    to_f32(&b)
}

/// A device send (`send`) or receive of `count` f32 at `buf` to or from rank `peer`.
fn f32_p2p(buf: u64, count: usize, peer: usize, tag: u32, send: bool) -> eccl::device::DeviceP2p {
    eccl::device::DeviceP2p {
        buf,
        count,
        dtype: DType::F32,
        peer: eccl::Rank(peer as u32),
        tag,
        send,
    }
}

/// A rank on simulated GPU `gpu` that reaches no other GPU, in the double's eager mode
/// (downloads at once) or not.
fn unreaching(gpu: usize, eager: bool) -> HostDevice {
    let d = HostDevice::on_gpu(gpu as u32).reaching(&[]);
    if eager {
        d.with_eager_downloads()
    } else {
        d
    }
}

/// A world of `N` whose ranks each run on a host of their own (through host memory,
/// whatever their GPUs reach).
async fn hosts_apart(addr: &str) -> Vec<eccl::Communicator> {
    static HOST: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    world_with(addr, N as u32, |c| {
        c.host = format!(
            "staged-host-{}",
            HOST.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )
    })
    .await
}

/// Rank `r`'s device in a staged test: across hosts every rank on one simulated GPU
/// (which IPC would serve on one host), else GPUs that reach no other.
fn staged_device(r: usize, cross: bool, eager: bool) -> HostDevice {
    match cross {
        true if eager => HostDevice::on_gpu(7).with_eager_downloads(),
        true => HostDevice::on_gpu(7),
        false => unreaching(r, eager),
    }
}

/// Each rank's results of all_reduce, all_gather, reduce_scatter, broadcast (root 1), an
/// uneven all_to_all, gather (root 2) and scatter (root 0), and the kernels and device
/// copies its device ran.
type Outcome = (Vec<Vec<f32>>, u64);

fn every_call(
    comms: Vec<eccl::Communicator>,
    make: &(dyn Fn(usize) -> HostDevice + Sync),
) -> Vec<Outcome> {
    each(comms, make, &|rank, dev, comm, ipc, rt| {
        let put = |v: &[f32]| put(dev, v);
        let get = |p: u64, n: usize| get(dev, p, n);
        let (dtype, count) = (DType::F32, COUNT);
        let mut run = |call: DeviceCall| unsafe {
            eccl::device::run(comm, rt.clone(), ipc, &call)
                .unwrap_or_else(|e| panic!("rank {rank}: {call:?}: {e}"))
        };
        let buf = put(&values(COUNT, rank));
        run(DeviceCall::AllReduce {
            buf,
            count,
            dtype,
            op: ReduceOp::Sum,
            keep: true,
        });
        let reduced = get(buf, COUNT);
        let send = put(&values(COUNT, rank));
        let recv = put(&vec![0.0; N * COUNT]);
        run(DeviceCall::AllGather {
            send,
            recv,
            count,
            dtype,
        });
        let gathered = get(recv, N * COUNT);
        let send = put(&values(N * COUNT, rank));
        let recv = put(&vec![0.0; COUNT]);
        run(DeviceCall::ReduceScatter {
            send,
            recv,
            count,
            dtype,
            op: ReduceOp::Sum,
        });
        let scattered = get(recv, COUNT);
        let buf = put(&values(COUNT, rank));
        run(DeviceCall::Broadcast {
            buf,
            count,
            dtype,
            root: 1,
        });
        let broadcast = get(buf, COUNT);
        // Uneven blocks: rank s sends rank t `block(s, t)` values.
        let send_counts: Vec<usize> = (0..N).map(|t| block(rank, t)).collect();
        let recv_counts: Vec<usize> = (0..N).map(|s| block(s, rank)).collect();
        let total = |c: &[usize]| c.iter().sum::<usize>();
        let send = put(&values(total(&send_counts), rank));
        let recv = put(&vec![0.0; total(&recv_counts)]);
        run(DeviceCall::AllToAll {
            send,
            recv,
            send_counts: send_counts.clone(),
            recv_counts: recv_counts.clone(),
            dtype,
        });
        let exchanged = get(recv, total(&recv_counts));
        // Gather to rank 2 (the others have no output), scatter from 0.
        let send = put(&values(COUNT, rank));
        let recv = if rank == 2 {
            put(&vec![0.0; N * COUNT])
        } else {
            0
        };
        run(DeviceCall::Gather {
            send,
            recv,
            count,
            dtype,
            root: 2,
        });
        let gathered_at_root = if rank == 2 {
            get(recv, N * COUNT)
        } else {
            vec![]
        };
        let send = if rank == 0 {
            put(&values(N * COUNT, 0))
        } else {
            0
        };
        let recv = put(&vec![0.0; COUNT]);
        run(DeviceCall::Scatter {
            send,
            recv,
            count,
            dtype,
            root: 0,
        });
        let from_root = get(recv, COUNT);
        (
            vec![
                reduced,
                gathered,
                scattered,
                broadcast,
                exchanged,
                gathered_at_root,
                from_root,
            ],
            dev.reductions() + dev.copies(),
        )
    })
}

/// The all_to_all's block from rank `s` to rank `t` (some empty).
fn block(s: usize, t: usize) -> usize {
    [[5, 0, 17], [9, 3, 0], [0, 11, 2]][s][t]
}

fn expected(rank: usize) -> Vec<Vec<f32>> {
    let sum = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (0..N).map(|r| values(n, r)[i]).sum())
            .collect()
    };
    // Rank s's input is values(its total, s); its block to t starts after those to
    // ranks before t.
    let exchanged = (0..N)
        .flat_map(|s| {
            let from: usize = (0..rank).map(|t| block(s, t)).sum();
            let all: usize = (0..N).map(|t| block(s, t)).sum();
            values(all, s)[from..from + block(s, rank)].to_vec()
        })
        .collect();
    vec![
        sum(COUNT),
        (0..N).flat_map(|r| values(COUNT, r)).collect(),
        sum(N * COUNT)[rank * COUNT..(rank + 1) * COUNT].to_vec(),
        values(COUNT, 1),
        exchanged,
        if rank == 2 {
            (0..N).flat_map(|r| values(COUNT, r)).collect()
        } else {
            vec![]
        },
        values(N * COUNT, 0)[rank * COUNT..(rank + 1) * COUNT].to_vec(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_that_cannot_reach_each_other_run_every_device_call_through_host_memory() {
    let m = start_master(&[]);
    // Each rank on a GPU of its own, none reaching another's: through host memory.
    let comms = world(&m.addr, N as u32).await;
    let staged = every_call(comms, &|r| HostDevice::on_gpu(r as u32).reaching(&[]));
    for (r, (results, kernels)) in staged.iter().enumerate() {
        assert_eq!(results, &expected(r), "rank {r}, through host memory");
        assert_eq!(
            *kernels, 0,
            "rank {r}: no device kernel or copy runs on that path"
        );
    }
    // The same world with peer access everywhere: GPU to GPU, the same results.
    let comms = world(&m.addr, N as u32).await;
    let direct = every_call(comms, &|r| HostDevice::on_gpu(r as u32));
    for (r, (results, _)) in direct.iter().enumerate() {
        assert_eq!(results, &expected(r), "rank {r}, GPU to GPU");
    }
    assert!(
        direct.iter().map(|(_, k)| k).sum::<u64>() > 0,
        "the direct path ran kernels"
    );
}

/// Runs `f(rank, device, comm, ipc, rt)` on one thread per communicator.
fn each<R: Send>(
    comms: Vec<eccl::Communicator>,
    make: &(dyn Fn(usize) -> HostDevice + Sync),
    f: &(dyn Fn(
        usize,
        &HostDevice,
        &mut eccl::Communicator,
        &mut IpcComm<HostDevice>,
        tokio::runtime::Handle,
    ) -> R
          + Sync),
) -> Vec<R> {
    let rt = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| {
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut comm| {
                    let rt = rt.clone();
                    s.spawn(move || {
                        let rank = comm.rank().unwrap().idx();
                        let dev = Arc::new(make(rank));
                        let mut ipc = IpcComm::new(dev.clone());
                        let out = f(rank, &dev, &mut comm, &mut ipc, rt.clone());
                        // Leaving, not dropping: a rank whose part of the last call ended
                        // first must not look like a dead one to those still finishing it.
                        let _ = rt.block_on(comm.leave());
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_memory_all_to_all_moves_blocks_larger_than_a_link_holds_and_checks_counts() {
    let m = start_master(&[]);
    let unreachable = |r: usize| HostDevice::on_gpu(r as u32).reaching(&[]);
    // Blocks of up to 12 MiB, uneven, some empty: more than a link buffers (8 frames of
    // 1 MiB over shared memory), so whole-block sends from every rank at once would
    // wait for each other.
    let big = |s: usize, t: usize| {
        [
            [0, 3 << 20, 1 << 20],
            [(3 << 20) - 5, 7, 0],
            [1, 0, 2 << 20],
        ][s][t]
    };
    let comms = world(&m.addr, N as u32).await;
    let res = each(comms, &unreachable, &|rank, dev, comm, ipc, rt| {
        let sends: Vec<usize> = (0..N).map(|t| big(rank, t)).collect();
        let recvs: Vec<usize> = (0..N).map(|s| big(s, rank)).collect();
        let (ns, nr) = (sends.iter().sum::<usize>(), recvs.iter().sum::<usize>());
        let send = dev.alloc(ns * 4).unwrap();
        unsafe { dev.upload(send, &to_bytes(&values(ns, rank))).unwrap() };
        let recv = dev.alloc(nr * 4).unwrap();
        let call = DeviceCall::AllToAll {
            send,
            recv,
            send_counts: sends,
            recv_counts: recvs,
            dtype: DType::F32,
        };
        unsafe { eccl::device::run(comm, rt, ipc, &call) }
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let mut b = vec![0u8; nr * 4];
        unsafe { dev.download(&mut b, recv).unwrap() };
        (to_f32(&b), dev.reductions() + dev.copies())
    });
    for (t, (out, kernels)) in res.iter().enumerate() {
        let want: Vec<f32> = (0..N)
            .flat_map(|s| {
                let all: usize = (0..N).map(|u| big(s, u)).sum();
                let from: usize = (0..t).map(|u| big(s, u)).sum();
                values(all, s)[from..from + big(s, t)].to_vec()
            })
            .collect();
        assert!(out == &want, "rank {t}: the blocks it received differ");
        assert_eq!(*kernels, 0, "rank {t}: through host memory, no device work");
    }
    // Rank 2 expects 4 elements from rank 0, which sends it 3: the same mismatch on
    // every rank, and no output written.
    let comms = world(&m.addr, N as u32).await;
    let res = each(comms, &unreachable, &|rank, dev, comm, ipc, rt| {
        let sends = vec![3; N];
        let mut recvs = vec![3; N];
        if rank == 2 {
            recvs[0] = 4;
        }
        let nr: usize = recvs.iter().sum();
        let send = dev.alloc(3 * N * 4).unwrap();
        let recv = dev.alloc(nr * 4).unwrap();
        unsafe { dev.upload(recv, &vec![0xAB; nr * 4]).unwrap() };
        let call = DeviceCall::AllToAll {
            send,
            recv,
            send_counts: sends,
            recv_counts: recvs,
            dtype: DType::F32,
        };
        let r = unsafe { eccl::device::run(comm, rt, ipc, &call) };
        let mut b = vec![0u8; nr * 4];
        unsafe { dev.download(&mut b, recv).unwrap() };
        (r, b)
    });
    for (r, (res, out)) in res.into_iter().enumerate() {
        match res {
            Err(eccl::Error::Mismatch { detail, .. }) => assert!(
                detail.contains("rank 0 sends 3 elements to rank 2, which expects 4"),
                "rank {r}: {detail}"
            ),
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(
            out.iter().all(|&b| b == 0xAB),
            "rank {r}'s output was written"
        );
    }
}

/// What one rank of a staged all_reduce saw: the call's outcome, its buffer after it,
/// the copies it queued on its lanes, and its kernels and device copies.
type Staged = (Result<(), eccl::Error>, Vec<f32>, u64, u64);

/// An all_reduce of `count` f32 through host memory, its smallest chunk 1 KiB (a call
/// is cut into about four chunks of 1 to 16 KiB).
fn staged_all_reduce(
    comms: Vec<eccl::Communicator>,
    make: &(dyn Fn(usize) -> HostDevice + Sync),
    count: usize,
    keep: bool,
) -> Vec<Staged> {
    each(comms, make, &|rank, dev, comm, ipc, rt| {
        ipc.set_stage_bytes(1024);
        let buf = put(dev, &values(count, rank));
        let call = DeviceCall::AllReduce {
            buf,
            count,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            keep,
        };
        let r = unsafe { eccl::device::run(comm, rt, ipc, &call) };
        (
            r,
            get(dev, buf, count),
            dev.queued_copies(),
            dev.reductions() + dev.copies(),
        )
    })
}

/// Where the GPUs cannot reach each other, and in a world across hosts, an all_reduce
/// goes through host memory as a pipeline of chunks over the copy lanes. The host
/// double runs a copy only when it is waited for (so a chunk read before its download
/// shows as a wrong result) or, in its other mode, a download at once (so a buffer
/// refilled before its upload ran does): exact results on every rank in both, with and
/// without G2's scratch buffer, a ragged last chunk, and no reduction on the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_all_reduce_runs_as_a_pipeline_of_chunks() {
    let m = start_master(&[]);
    let count = 50_000; // 200,000 bytes: 12 chunks of 16 KiB and one of 3,392 bytes
    let chunks = 13;
    let inputs: Vec<Vec<f32>> = (0..N).map(|r| values(count, r)).collect();
    let want: Vec<f32> = (0..count)
        .map(|i| inputs.iter().map(|v| v[i]).sum())
        .collect();
    for (keep, eager) in [(true, false), (false, false), (true, true), (false, true)] {
        let comms = world(&m.addr, N as u32).await;
        let res = staged_all_reduce(comms, &|r| unreaching(r, eager), count, keep);
        for (r, (res, out, queued, device)) in res.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("keep {keep} eager {eager} rank {r}: {e}"));
            assert!(
                out == want,
                "keep {keep} eager {eager} rank {r}: wrong result"
            );
            assert_eq!(
                queued,
                2 * chunks,
                "keep {keep} eager {eager} rank {r}: a download and an upload per chunk"
            );
            // keep: one device copy, scratch over the buffer; no reduction either way.
            assert_eq!(
                device,
                u64::from(keep),
                "keep {keep} eager {eager} rank {r}"
            );
        }
    }
    // Every rank on one simulated GPU, which IPC would serve on one host; each rank on a
    // host of its own: through host memory.
    let comms = hosts_apart(&m.addr).await;
    let res = staged_all_reduce(comms, &|_| HostDevice::on_gpu(9), count, false);
    for (r, (res, out, queued, device)) in res.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("across hosts, rank {r}: {e}"));
        assert!(out == want, "across hosts, rank {r}: wrong result");
        assert_eq!(queued, 2 * chunks, "across hosts, rank {r}");
        assert_eq!(device, 0, "across hosts, rank {r}: no device work");
    }
}

/// A world of more ranks than one kernel reads (9 > 8) on one host, every GPU reaching
/// every other: its calls go through host memory (the all_reduce as the pipeline), where
/// they failed before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_world_of_more_ranks_than_a_kernel_reads_goes_through_host_memory() {
    let m = start_master(&[]);
    let n = 9;
    let count = 5000;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| values(count, r)).collect();
    let want: Vec<f32> = (0..count)
        .map(|i| inputs.iter().map(|v| v[i]).sum())
        .collect();
    let comms = world(&m.addr, n as u32).await;
    let res = staged_all_reduce(comms, &|_| HostDevice::on_gpu(3), count, true);
    for (r, (res, out, queued, _)) in res.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r} of {n}: {e}"));
        assert!(out == want, "rank {r} of {n}: wrong result");
        assert_eq!(queued, 8, "rank {r}: four chunks down and up");
    }
}

/// A rank whose device fails a copy in the middle of a staged all_reduce aborts the
/// epoch: the others fail at once (not at their collective timeout) with their buffers
/// as they were (G2, `keep`), and the failing rank's error names its device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_fault_in_a_staged_all_reduce_aborts_the_others_with_their_buffers_kept() {
    let m = start_master(&[]);
    let count = 5000;
    let comms = world(&m.addr, N as u32).await;
    let t = std::time::Instant::now();
    let res = staged_all_reduce(
        comms,
        &|r| {
            let d = HostDevice::on_gpu(r as u32).reaching(&[]);
            // Rank 2's seventh copy fails: three chunks reduced, the pipeline under way.
            if r == 2 {
                d.failing_copies_after(6)
            } else {
                d
            }
        },
        count,
        true,
    );
    let took = t.elapsed();
    for (r, (res, out, _, _)) in res.into_iter().enumerate() {
        match res {
            Err(eccl::Error::Aborted { cause, .. }) => {
                assert!(
                    cause.contains("a simulated copy failure"),
                    "rank {r}: {cause}"
                );
                if r == 2 {
                    assert!(cause.contains("staged all_reduce"), "rank {r}: {cause}");
                }
            }
            other => panic!("rank {r}: {other:?}"),
        }
        if r < 2 {
            assert!(out == values(count, r), "rank {r}: its buffer changed (G2)");
        }
    }
    assert!(
        took < std::time::Duration::from_secs(6),
        "the others waited {took:?}: the abort did not reach them (collective timeout 8 s)"
    );
}

/// all_gather and reduce_scatter through host memory as pipelines too: each chunk takes
/// the same slice of every rank's block (one copy down and one per rank up for the
/// gather, but its own in place, the other way round for the scatter), out of place and in NCCL's in-place
/// forms, with the host double's copies run late and (second mode) downloads at once:
/// exact results, a ragged last chunk, the copies each chunk needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_all_gather_and_reduce_scatter_run_as_pipelines() {
    let m = start_master(&[]);
    let count = 5001; // a block of 20,004 bytes: 4 chunks, 5,004 bytes of each block, the last 4,992
    let chunks = 4u64;
    let whole: Vec<Vec<f32>> = (0..N).map(|s| values(N * count, s)).collect();
    for (in_place, eager, cross) in [
        (false, false, false),
        (true, false, false),
        (false, true, false),
        (true, true, false),
        (true, false, true),
    ] {
        // cross: every rank on one simulated GPU (IPC would serve it), each on a host of
        // its own.
        let comms = if cross {
            hosts_apart(&m.addr).await
        } else {
            world(&m.addr, N as u32).await
        };
        let make = |r: usize| staged_device(r, cross, eager);
        let res = each(comms, &make, &|rank, dev, comm, ipc, rt| {
            ipc.set_stage_bytes(1024);
            let put = |v: &[f32]| put(dev, v);
            let get = |p: u64, n: usize| get(dev, p, n);
            let nb = (count * 4) as u64;
            let mut run = |call: DeviceCall| unsafe {
                eccl::device::run(comm, rt.clone(), ipc, &call)
                    .unwrap_or_else(|e| panic!("rank {rank}: {call:?}: {e}"))
            };
            // all_gather
            let mine = values(count, rank);
            let (send, recv) = if in_place {
                let mut init = vec![0.0; N * count];
                init[rank * count..(rank + 1) * count].copy_from_slice(&mine);
                let recv = put(&init);
                (recv + rank as u64 * nb, recv)
            } else {
                (put(&mine), put(&vec![0.0; N * count]))
            };
            let q0 = dev.queued_copies();
            run(DeviceCall::AllGather {
                send,
                recv,
                count,
                dtype: DType::F32,
            });
            let gathered = (get(recv, N * count), dev.queued_copies() - q0);
            // reduce_scatter
            let send = put(&whole[rank]);
            let recv = if in_place {
                send + rank as u64 * nb
            } else {
                put(&vec![0.0; count])
            };
            let q0 = dev.queued_copies();
            run(DeviceCall::ReduceScatter {
                send,
                recv,
                count,
                dtype: DType::F32,
                op: ReduceOp::Sum,
            });
            let scattered = (get(recv, count), dev.queued_copies() - q0);
            (gathered, scattered, dev.reductions() + dev.copies())
        });
        let all: Vec<f32> = (0..N).flat_map(|s| values(count, s)).collect();
        for (r, ((g, gq), (sc, sq), device)) in res.into_iter().enumerate() {
            let case = format!("in place {in_place} eager {eager} across hosts {cross} rank {r}");
            assert!(g == all, "{case}: all_gather");
            let want: Vec<f32> = (r * count..(r + 1) * count)
                .map(|i| whole.iter().map(|v| v[i]).sum())
                .collect();
            assert!(sc == want, "{case}: reduce_scatter");
            // In place, a rank's own slice does not come back up onto itself.
            let own_up = u64::from(!in_place);
            assert_eq!(
                gq,
                chunks * (N as u64 + own_up),
                "{case}: all_gather's copies"
            );
            assert_eq!(
                sq,
                chunks * (1 + N as u64),
                "{case}: reduce_scatter's copies"
            );
            assert_eq!(device, 0, "{case}: no device work");
        }
    }
}

/// An all_to_all through host memory runs as a pipeline (the same slice of every block
/// per chunk, one copy per rank each way), in both of the double's modes, on GPUs that
/// cannot reach each other and across hosts: even blocks, blocks one element longer
/// from one rank (the chunks cut from the widest, the others' padded: the same eight
/// chunks, every slice copied), and blocks of very different sizes, some empty (only
/// the bytes a block holds are copied): exact blocks each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_all_to_all_runs_as_a_pipeline_even_or_not() {
    let m = start_master(&[]);
    // Blocks of 20,004 bytes: a slot holds every block's slice in and out, so chunks are
    // cut from twice the 60,012 bytes: 8 chunks, 2,504 bytes of each block, the last 2,476.
    let count = 5001;
    let chunks = 8u64;
    // What rank s sends rank t in each case (elements).
    let even = |_: usize, _: usize| count;
    let longer = |s: usize, _: usize| count + usize::from(s == 1);
    let skewed = |s: usize, t: usize| block(s, t) * 300;
    let cases: [&(dyn Fn(usize, usize) -> usize + Sync); 3] = [&even, &longer, &skewed];
    for (eager, cross) in [(false, false), (true, false), (false, true)] {
        let comms = if cross {
            hosts_apart(&m.addr).await
        } else {
            world(&m.addr, N as u32).await
        };
        let make = |r: usize| staged_device(r, cross, eager);
        let res = each(comms, &make, &|rank, dev, comm, ipc, rt| {
            ipc.set_stage_bytes(1024);
            let mut run = |block: &dyn Fn(usize, usize) -> usize| {
                let sends: Vec<usize> = (0..N).map(|t| block(rank, t)).collect();
                let recvs: Vec<usize> = (0..N).map(|s| block(s, rank)).collect();
                let (ns, nr) = (sends.iter().sum::<usize>(), recvs.iter().sum::<usize>());
                let send = put(dev, &values(ns, rank));
                let recv = put(dev, &vec![0.0; nr]);
                let q0 = dev.queued_copies();
                let call = DeviceCall::AllToAll {
                    send,
                    recv,
                    send_counts: sends,
                    recv_counts: recvs,
                    dtype: DType::F32,
                };
                unsafe { eccl::device::run(comm, rt.clone(), ipc, &call) }
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                (get(dev, recv, nr), dev.queued_copies() - q0)
            };
            let out: Vec<_> = cases.iter().map(|b| run(*b)).collect();
            (out, dev.reductions() + dev.copies())
        });
        for (t, (out, device)) in res.into_iter().enumerate() {
            for (c, (block, (got, copies))) in cases.iter().zip(out).enumerate() {
                let case = format!("eager {eager} across hosts {cross} rank {t} case {c}");
                // Rank s's values: its blocks back to back, the one for t after those
                // for ranks before it.
                let want: Vec<f32> = (0..N)
                    .flat_map(|s| {
                        let at: usize = (0..t).map(|u| block(s, u)).sum();
                        let all: usize = (0..N).map(|u| block(s, u)).sum();
                        values(all, s)[at..at + block(s, t)].to_vec()
                    })
                    .collect();
                assert!(got == want, "{case}: the blocks it received differ");
                if c < 2 {
                    assert_eq!(
                        copies,
                        chunks * 2 * N as u64,
                        "{case}: the pipeline's copies"
                    );
                } else {
                    assert!(copies > chunks, "{case}: the pipeline's copies: {copies}");
                }
            }
            assert_eq!(
                device, 0,
                "eager {eager} across hosts {cross} rank {t}: no device work"
            );
        }
    }
}

/// gather and scatter through host memory as pipelines: each chunk takes the same slice
/// of every rank's block at the root (one copy per rank up for the gather, down for the
/// scatter) and of its own block elsewhere, in both of the double's modes, on GPUs that
/// reach no other and across hosts, with the root's block in place for the gather (its
/// `send` the root's slice of `recv`): exact results, the copies each chunk needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_gather_and_scatter_run_as_pipelines() {
    let m = start_master(&[]);
    let count = 5001; // 4 chunks of a block, as the all_gather's
    let chunks = 4u64;
    let root = 2;
    for (eager, cross) in [(false, false), (true, false), (false, true)] {
        let comms = if cross {
            hosts_apart(&m.addr).await
        } else {
            world(&m.addr, N as u32).await
        };
        let make = |r: usize| staged_device(r, cross, eager);
        let res = each(comms, &make, &|rank, dev, comm, ipc, rt| {
            ipc.set_stage_bytes(1024);
            let nb = (count * 4) as u64;
            let mut run = |call: DeviceCall| unsafe {
                eccl::device::run(comm, rt.clone(), ipc, &call)
                    .unwrap_or_else(|e| panic!("rank {rank}: {call:?}: {e}"))
            };
            let mine = values(count, rank);
            let (send, recv) = if rank == root {
                let mut init = vec![0.0; N * count];
                init[rank * count..(rank + 1) * count].copy_from_slice(&mine);
                let recv = put(dev, &init);
                (recv + rank as u64 * nb, recv)
            } else {
                (put(dev, &mine), 0)
            };
            let q0 = dev.queued_copies();
            run(DeviceCall::Gather {
                send,
                recv,
                count,
                dtype: DType::F32,
                root,
            });
            let gathered = match rank == root {
                true => get(dev, recv, N * count),
                false => Vec::new(),
            };
            let gq = dev.queued_copies() - q0;
            let send = match rank == root {
                true => put(dev, &values(N * count, rank)),
                false => 0,
            };
            let recv = put(dev, &vec![0.0; count]);
            let q0 = dev.queued_copies();
            run(DeviceCall::Scatter {
                send,
                recv,
                count,
                dtype: DType::F32,
                root,
            });
            let scattered = get(dev, recv, count);
            let sq = dev.queued_copies() - q0;
            (
                (gathered, gq),
                (scattered, sq),
                dev.reductions() + dev.copies(),
            )
        });
        let all: Vec<f32> = (0..N).flat_map(|s| values(count, s)).collect();
        let whole = values(N * count, root);
        for (r, ((g, gq), (sc, sq), device)) in res.into_iter().enumerate() {
            let case = format!("eager {eager} across hosts {cross} rank {r}");
            let at_root = if r == root { N as u64 } else { 0 };
            if r == root {
                assert!(g == all, "{case}: gather");
            }
            // The root's block in place: its own slice does not come back up onto itself.
            let own = u64::from(r == root);
            assert_eq!(gq, chunks * (1 + at_root - own), "{case}: gather's copies");
            assert!(sc == whole[r * count..(r + 1) * count], "{case}: scatter");
            assert_eq!(sq, chunks * (1 + at_root), "{case}: scatter's copies");
            assert_eq!(device, 0, "{case}: no device work");
        }
    }
}

/// A broadcast through host memory as a pipeline: the root's chunks go down and the
/// others' come up (nothing else moves), in both of the double's modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_broadcast_runs_as_a_pipeline() {
    let m = start_master(&[]);
    let count = 50_000; // 13 chunks, as the all_reduce's
    let root = 1;
    for eager in [false, true] {
        let comms = world(&m.addr, N as u32).await;
        let make = |r: usize| unreaching(r, eager);
        let res = each(comms, &make, &|rank, dev, comm, ipc, rt| {
            ipc.set_stage_bytes(1024);
            let init = if rank == root {
                values(count, root)
            } else {
                vec![0.0; count]
            };
            let buf = put(dev, &init);
            let call = DeviceCall::Broadcast {
                buf,
                count,
                dtype: DType::F32,
                root,
            };
            unsafe { eccl::device::run(comm, rt, ipc, &call) }
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            (get(dev, buf, count), dev.queued_copies())
        });
        for (r, (out, queued)) in res.into_iter().enumerate() {
            assert!(
                out == values(count, root),
                "eager {eager} rank {r}: wrong result"
            );
            assert_eq!(
                queued, 13,
                "eager {eager} rank {r}: one copy per chunk, down or up"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_sends_and_receives_go_around_a_ring_through_host_memory_and_check_sizes() {
    let m = start_master(&[]);
    let count = 50_000; // 49 chunks of 4 KiB
    let comms = world(&m.addr, N as u32).await;
    let make = |_| HostDevice::new();
    let res = each(comms, &make, &|rank, dev, comm, ipc, rt| {
        ipc.set_stage_bytes(4096);
        let (next, prev) = ((rank + 1) % N, (rank + N - 1) % N);
        let src = put(dev, &values(count, rank));
        let dst = put(dev, &vec![0.0; count]);
        let one = put(dev, &[0.0]);
        let p2p = f32_p2p;
        // An all_reduce of one 1.0 per rank: the world is usable, and every rank is past
        // what came before. After an abort, every rank first forms the next epoch.
        let sum_ones = |comm: &mut eccl::Communicator, ipc: &mut IpcComm<HostDevice>| {
            unsafe { dev.upload(one, &1f32.to_le_bytes()).unwrap() };
            let call = DeviceCall::AllReduce {
                buf: one,
                count: 1,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                keep: true,
            };
            if unsafe { eccl::device::run(comm, rt.clone(), ipc, &call) }.is_err() {
                rt.block_on(comm.update_topology())
                    .unwrap_or_else(|e| panic!("rank {rank} next epoch: {e}"));
                unsafe { dev.upload(one, &1f32.to_le_bytes()).unwrap() };
                unsafe { eccl::device::run(comm, rt.clone(), ipc, &call) }
                    .unwrap_or_else(|e| panic!("rank {rank} after: {e}"));
            }
            get(dev, one, 1)[0]
        };
        // Every rank sends first, then receives: sends are eager, so the ring does not
        // wait for itself.
        unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(src, count, next, 5, true)) }
            .unwrap_or_else(|e| panic!("rank {rank} send: {e}"));
        unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(dst, count, prev, 5, false)) }
            .unwrap_or_else(|e| panic!("rank {rank} receive: {e}"));
        let got = get(dev, dst, count);
        let sums = vec![sum_ones(comm, ipc)];
        // Rank 1 receives fewer elements than rank 0 sends it: a Mismatch naming both,
        // which ends the epoch on every rank (as a host receive of another size does);
        // the sender's part was eager.
        let mismatch = match rank {
            0 => unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(src, 100, 1, 6, true)) }
                .err(),
            1 => unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(dst, 99, 0, 6, false)) }
                .err(),
            _ => None,
        };
        let sums = [sums, vec![sum_ones(comm, ipc)]].concat();
        // A host send where a device receive waits: refused by name, not taken as data.
        let stranger = match rank {
            0 => {
                let bytes = vec![0u8; eccl_cuda::ipc::P2P_HEADER_BYTES];
                rt.block_on(comm.send_bytes(DType::U8, &bytes, eccl::Rank(2), 7))
                    .err()
            }
            2 => unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(dst, 10, 0, 7, false)) }
                .err(),
            _ => None,
        };
        let sums = [sums, vec![sum_ones(comm, ipc)]].concat();
        (
            got,
            mismatch.map(|e| e.to_string()),
            stranger.map(|e| e.to_string()),
            sums,
        )
    });
    for (r, (got, mismatch, stranger, sums)) in res.into_iter().enumerate() {
        assert!(
            got == values(count, (r + N - 1) % N),
            "rank {r}: wrong data"
        );
        match r {
            1 => {
                let m = mismatch.expect("rank 1 must fail");
                assert!(
                    m.contains("sent 400 bytes") && m.contains("receives 396"),
                    "{m}"
                );
            }
            _ => assert!(mismatch.is_none(), "rank {r}: {mismatch:?}"),
        }
        match r {
            2 => {
                let s = stranger.expect("rank 2 must refuse it");
                assert!(s.contains("something other than a device send"), "{s}");
            }
            _ => assert!(stranger.is_none(), "rank {r}: {stranger:?}"),
        }
        assert_eq!(sums, [N as f32; 3], "rank {r}");
    }
}

/// A ring of device sends larger than a link holds (24 MiB each, in the default chunks,
/// as `test_cuda.py`'s `batch_isend_irecv` ring sends them), every rank sending before
/// it receives: a send is eager, so the ring does not wait for itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_of_device_sends_larger_than_a_link_holds_does_not_wait_for_itself() {
    let m = start_master(&[]);
    let count = 6 << 20;
    let comms = world(&m.addr, N as u32).await;
    let make = |_| HostDevice::new();
    let res = each(comms, &make, &|rank, dev, comm, ipc, rt| {
        let (next, prev) = ((rank + 1) % N, (rank + N - 1) % N);
        let src = put(dev, &values(count, rank));
        let dst = put(dev, &vec![0.0; count]);
        let p2p = |buf, peer, send| f32_p2p(buf, count, peer, 9, send);
        unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(src, next, true)) }
            .unwrap_or_else(|e| panic!("rank {rank} send: {e}"));
        unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(dst, prev, false)) }
            .unwrap_or_else(|e| panic!("rank {rank} receive: {e}"));
        get(dev, dst, count)
    });
    for (r, got) in res.into_iter().enumerate() {
        assert!(
            got == values(count, (r + N - 1) % N),
            "rank {r}: wrong data"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_fails_in_the_middle_of_a_receive_ends_the_epoch_everywhere() {
    // Rank 1's device fails its fifth queued copy, in the middle of a receive of twenty
    // chunks from rank 0: the rest of the transfer must not be taken for a later call,
    // so the epoch ends on every rank (rank 0's eager send had returned), and the world
    // goes on in the next one.
    let m = start_master(&[]);
    let count = 20 * 1024; // twenty chunks of 4 KiB
    let comms = world(&m.addr, N as u32).await;
    let make = |r: usize| {
        if r == 1 {
            HostDevice::new().failing_copies_after(4)
        } else {
            HostDevice::new()
        }
    };
    let res = each(comms, &make, &|rank, dev, comm, ipc, rt| {
        ipc.set_stage_bytes(4096);
        let epoch = comm.epoch();
        let buf = put(dev, &values(count, rank));
        let p2p = |peer, send| f32_p2p(buf, count, peer, 9, send);
        let failed = match rank {
            0 => unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(1, true)) }.err(),
            1 => unsafe { eccl::device::p2p(comm, rt.clone(), ipc, &p2p(0, false)) }.err(),
            _ => None,
        };
        // A host all_reduce (rank 1's device copies fail from now on): the first one
        // fails with the abort, every rank forms the next epoch, the next one works.
        let mut x = [1f32];
        let first = rt.block_on(comm.all_reduce(&mut x, ReduceOp::Sum));
        if first.is_err() {
            rt.block_on(comm.update_topology())
                .unwrap_or_else(|e| panic!("rank {rank} next epoch: {e}"));
            x = [1.0];
            rt.block_on(comm.all_reduce(&mut x, ReduceOp::Sum))
                .unwrap_or_else(|e| panic!("rank {rank} after: {e}"));
        }
        (
            failed.map(|e| e.to_string()),
            first.is_err(),
            comm.epoch() > epoch,
            x[0],
        )
    });
    for (r, (failed, first_failed, next_epoch, sum)) in res.into_iter().enumerate() {
        match r {
            1 => {
                let e = failed.expect("rank 1's receive must fail");
                assert!(e.contains("copy"), "rank 1: {e}");
            }
            // The sender may still be handing chunks to the link when the abort comes:
            // then its send fails with rank 1's cause.
            0 => assert!(
                failed
                    .as_ref()
                    .is_none_or(|e| e.contains("rank 1") && e.contains("copy")),
                "rank 0: {failed:?}"
            ),
            _ => assert!(failed.is_none(), "rank {r}: {failed:?}"),
        }
        assert!(
            first_failed && next_epoch,
            "rank {r}: the epoch did not end"
        );
        assert_eq!(sum, N as f32, "rank {r}");
    }
}
