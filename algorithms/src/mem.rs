//! An in-memory executor: runs every rank's schedule of one collective in one thread,
//! with a FIFO queue per ordered pair of ranks standing in for links.
//!
//! It checks what the peer relies on: schedules validate, every frame arrives in the
//! step that receives it (frames are named by step), lengths agree, nothing deadlocks
//! and nothing is left unreceived. Tests in this crate and others use it as the
//! reference run of a schedule; [`reference`] says what the answer should be.

use std::collections::VecDeque;

use eccl_protocol::{CollectiveKind, DType, Descriptor, ReduceOp};

use crate::kernels;
use crate::schedule::{Buf, Prim, Region, Schedule};

/// One frame on a simulated link: the sender's step and the payload.
struct Msg {
    step: usize,
    data: Vec<u8>,
}

/// Builds every rank's schedule for `desc`, validates each, runs them together and
/// returns each rank's output (`output_len * dtype.size()` bytes). `inputs[r]` is rank
/// `r`'s input and must have exactly its schedule's `input_len` elements (see
/// [`crate::buffer_lens`]).
pub fn run_all(desc: &Descriptor, world: u32, inputs: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, String> {
    if world == 0 {
        return Err("world of 0 ranks".into());
    }
    let schedules = (0..world)
        .map(|r| crate::build(desc, r, world).map_err(|e| format!("rank {r}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    run_schedules(desc.dtype, desc.op, &schedules, inputs)
}

/// Runs `schedules[r]` as rank `r` of a world of `schedules.len()` ranks. Steps advance
/// round-robin across ranks; a step finishes once every one of its receives has a frame.
pub fn run_schedules(
    dtype: DType,
    op: ReduceOp,
    schedules: &[Schedule],
    inputs: &[Vec<u8>],
) -> Result<Vec<Vec<u8>>, String> {
    run_seeded(dtype, op, schedules, inputs, &vec![None; schedules.len()])
}

/// Runs a world where rank `r` calls in place: with `in_place[r]` (its schedule's
/// [`Schedule::in_place`]) on its buffer `bufs[r]` alone where there is one, otherwise
/// the way the peer does without one, `schedules[r]` from `inputs[r]` into a separate
/// output copied over the front of `bufs[r]` afterwards. Returns each rank's buffer.
pub fn run_mixed(
    dtype: DType,
    op: ReduceOp,
    schedules: &[Schedule],
    in_place: &[Option<Schedule>],
    inputs: &[Vec<u8>],
    bufs: &[Vec<u8>],
) -> Result<Vec<Vec<u8>>, String> {
    let n = schedules.len();
    if in_place.len() != n || bufs.len() != n {
        return Err(format!(
            "{} schedules, {} in place, {} buffers",
            n,
            in_place.len(),
            bufs.len()
        ));
    }
    let run: Vec<Schedule> = (0..n)
        .map(|r| in_place[r].clone().unwrap_or_else(|| schedules[r].clone()))
        .collect();
    let ins: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            if in_place[r].is_some() {
                Vec::new()
            } else {
                inputs[r].clone()
            }
        })
        .collect();
    let seeds: Vec<Option<Vec<u8>>> = (0..n)
        .map(|r| in_place[r].as_ref().map(|_| bufs[r].clone()))
        .collect();
    let outs = run_seeded(dtype, op, &run, &ins, &seeds)?;
    Ok(outs
        .into_iter()
        .enumerate()
        .map(|(r, out)| {
            if in_place[r].is_some() {
                return out;
            }
            let mut b = bufs[r].clone();
            b[..out.len()].copy_from_slice(&out);
            b
        })
        .collect())
}

/// [`run_schedules`], with rank `r`'s output starting as `seeds[r]` where given (it must
/// have the schedule's `output_len` elements) instead of zeros.
fn run_seeded(
    dtype: DType,
    op: ReduceOp,
    schedules: &[Schedule],
    inputs: &[Vec<u8>],
    seeds: &[Option<Vec<u8>>],
) -> Result<Vec<Vec<u8>>, String> {
    let n = schedules.len();
    if inputs.len() != n || seeds.len() != n {
        return Err(format!("{} inputs for a world of {n}", inputs.len()));
    }
    let world = u32::try_from(n).map_err(|_| format!("world of {n} ranks"))?;
    let size = dtype.size();
    let mut ranks = Vec::with_capacity(n);
    for (r, (s, input)) in schedules.iter().zip(inputs).enumerate() {
        s.validate_for(r as u32, world)
            .map_err(|e| format!("rank {r}: invalid schedule: {e}"))?;
        let bytes = |elems: usize| {
            elems
                .checked_mul(size)
                .ok_or_else(|| format!("rank {r}: buffer too large"))
        };
        if input.len() != bytes(s.input_len)? {
            return Err(format!(
                "rank {r}: input has {} bytes, schedule reads {} elements of {dtype}",
                input.len(),
                s.input_len
            ));
        }
        let output = match &seeds[r] {
            Some(seed) if seed.len() != bytes(s.output_len)? => {
                return Err(format!("rank {r}: a seed of {} bytes", seed.len()));
            }
            Some(seed) => seed.clone(),
            None => vec![0; bytes(s.output_len)?],
        };
        ranks.push(Rank {
            input,
            output,
            scratch: vec![0; bytes(s.scratch_len)?],
            step: 0,
            started: false,
            pending: Vec::new(),
        });
    }
    let mut links: Vec<VecDeque<Msg>> = (0..n * n).map(|_| VecDeque::new()).collect();
    let ex = Exec {
        dtype,
        op,
        size,
        world: n,
    };

    loop {
        let mut progress = false;
        for (r, (st, s)) in ranks.iter_mut().zip(schedules).enumerate() {
            let Some(step) = s.steps.get(st.step) else {
                continue;
            };
            let si = st.step;
            let at = |e: String| format!("rank {r} step {si}: {e}");
            if !st.started {
                for p in step.prims.iter().filter(|p| p.is_local()) {
                    ex.local(st, p).map_err(at)?;
                }
                for p in &step.prims {
                    if let Prim::Send { peer, src } = p {
                        let data = st.read(*src, size).map_err(at)?.to_vec();
                        links[r * n + *peer as usize].push_back(Msg {
                            step: st.step,
                            data,
                        });
                    }
                }
                st.pending = (0..step.prims.len())
                    .filter(|&i| step.prims[i].recvs_from().is_some())
                    .collect();
                st.started = true;
                progress = true;
            }
            let mut i = 0;
            while i < st.pending.len() {
                let p = &step.prims[st.pending[i]];
                let from = p.recvs_from().unwrap_or(0) as usize;
                match links[from * n + r].pop_front() {
                    Some(msg) => {
                        if msg.step != st.step {
                            return Err(format!(
                                "rank {r} step {} received a frame rank {from} sent in step {}",
                                st.step, msg.step
                            ));
                        }
                        if let Some((to, data)) = ex
                            .receive(st, p, msg.data)
                            .map_err(|e| format!("rank {r} step {}: {e}", st.step))?
                        {
                            links[r * n + to as usize].push_back(Msg {
                                step: st.step,
                                data,
                            });
                        }
                        st.pending.swap_remove(i);
                        progress = true;
                    }
                    None => i += 1,
                }
            }
            if st.pending.is_empty() {
                st.step += 1;
                st.started = false;
                progress = true;
            }
        }
        if ranks
            .iter()
            .zip(schedules)
            .all(|(st, s)| st.step >= s.steps.len())
        {
            break;
        }
        if !progress {
            let waiting: Vec<String> = ranks
                .iter()
                .zip(schedules)
                .enumerate()
                .filter(|(_, (st, s))| st.step < s.steps.len())
                .map(|(r, (st, s))| {
                    let from: Vec<u32> = st
                        .pending
                        .iter()
                        .filter_map(|&i| s.steps[st.step].prims[i].recvs_from())
                        .collect();
                    format!("rank {r} in step {} waits for {from:?}", st.step)
                })
                .collect();
            return Err(format!("deadlock: {}", waiting.join("; ")));
        }
    }
    for (i, q) in links.iter().enumerate() {
        if let Some(m) = q.front() {
            return Err(format!(
                "rank {} sent rank {} a frame in step {} that was never received",
                i / n,
                i % n,
                m.step
            ));
        }
    }
    Ok(ranks.into_iter().map(|st| st.output).collect())
}

struct Rank<'a> {
    input: &'a [u8],
    output: Vec<u8>,
    scratch: Vec<u8>,
    step: usize,
    started: bool,
    /// Indices of the current step's receiving primitives still waiting for a frame.
    pending: Vec<usize>,
}

impl Rank<'_> {
    fn range(r: Region, size: usize) -> Result<std::ops::Range<usize>, String> {
        let start = r
            .offset
            .checked_mul(size)
            .ok_or("region offset overflows")?;
        let len = r.len.checked_mul(size).ok_or("region length overflows")?;
        Ok(start..start.checked_add(len).ok_or("region end overflows")?)
    }

    fn read(&self, r: Region, size: usize) -> Result<&[u8], String> {
        let buf: &[u8] = match r.buf {
            Buf::Input => self.input,
            Buf::Output => &self.output,
            Buf::Scratch => &self.scratch,
        };
        buf.get(Self::range(r, size)?)
            .ok_or_else(|| format!("{r:?} out of bounds"))
    }

    fn write(&mut self, r: Region, size: usize) -> Result<&mut [u8], String> {
        let buf: &mut [u8] = match r.buf {
            Buf::Input => return Err(format!("{r:?}: the input is read-only")),
            Buf::Output => &mut self.output,
            Buf::Scratch => &mut self.scratch,
        };
        buf.get_mut(Self::range(r, size)?)
            .ok_or_else(|| format!("{r:?} out of bounds"))
    }
}

struct Exec {
    dtype: DType,
    op: ReduceOp,
    size: usize,
    world: usize,
}

impl Exec {
    fn local(&self, st: &mut Rank<'_>, p: &Prim) -> Result<(), String> {
        match p {
            Prim::Copy { src, dst } => {
                let data = st.read(*src, self.size)?.to_vec();
                copy(st.write(*dst, self.size)?, &data)
            }
            Prim::Reduce { src, dst } => {
                let data = st.read(*src, self.size)?.to_vec();
                kernels::reduce_inplace(self.dtype, self.op, st.write(*dst, self.size)?, &data);
                Ok(())
            }
            Prim::Finalize { region } => {
                kernels::finalize(
                    self.dtype,
                    self.op,
                    st.write(*region, self.size)?,
                    self.world,
                );
                Ok(())
            }
            other => Err(format!("{other:?} is not local")),
        }
    }

    /// Applies one received frame; returns what to forward, and to whom, if anything.
    fn receive(
        &self,
        st: &mut Rank<'_>,
        p: &Prim,
        data: Vec<u8>,
    ) -> Result<Option<(u32, Vec<u8>)>, String> {
        let want = p.len() * self.size;
        if data.len() != want {
            return Err(format!(
                "{p:?} expects {want} bytes, the frame has {}",
                data.len()
            ));
        }
        match p {
            Prim::Recv { dst, .. } => {
                copy(st.write(*dst, self.size)?, &data)?;
                Ok(None)
            }
            Prim::RecvCopySend { to, dst, .. } => {
                copy(st.write(*dst, self.size)?, &data)?;
                Ok(Some((*to, data)))
            }
            Prim::RecvReduce { local, dst, .. } => {
                let combined = self.combine(st, &data, *local)?;
                copy(st.write(*dst, self.size)?, &combined)?;
                Ok(None)
            }
            Prim::RecvReduceSend { to, local, dst, .. } => {
                let combined = self.combine(st, &data, *local)?;
                if let Some(dst) = dst {
                    copy(st.write(*dst, self.size)?, &combined)?;
                }
                Ok(Some((*to, combined)))
            }
            other => Err(format!("{other:?} receives nothing")),
        }
    }

    /// `incoming ⊕ local`, the operand order of every receive-reduce primitive.
    fn combine(&self, st: &Rank<'_>, incoming: &[u8], local: Region) -> Result<Vec<u8>, String> {
        let local = st.read(local, self.size)?;
        let mut out = vec![0; incoming.len()];
        kernels::reduce_to(self.dtype, self.op, &mut out, incoming, local);
        Ok(out)
    }
}

fn copy(dst: &mut [u8], src: &[u8]) -> Result<(), String> {
    if dst.len() != src.len() {
        return Err(format!("copy of {} bytes into {}", src.len(), dst.len()));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// What every rank's output should be, computed naively on one machine: reductions fold
/// the ranks' contributions left to right in rank order, then finalize. With inputs for
/// which the operator is associative and commutative in practice (integers, floats
/// holding small integers), any correct schedule matches it bit for bit.
///
/// Inputs shorter than [`crate::buffer_lens`] says are read as if zero-padded, so this
/// never panics.
pub fn reference(desc: &Descriptor, world: u32, inputs: &[Vec<u8>]) -> Vec<Vec<u8>> {
    use CollectiveKind::*;
    let n = world as usize;
    let size = desc.dtype.size();
    let c = usize::try_from(desc.count)
        .unwrap_or(usize::MAX)
        .saturating_mul(size);
    let root = desc.root as usize;
    let (dtype, op) = (desc.dtype, desc.op);
    // Bytes [off, off+len) of rank r's input, zero-padded.
    let part = |r: usize, off: usize, len: usize| -> Vec<u8> {
        let mut v = vec![0u8; len];
        let src = inputs.get(r).map(|v| v.as_slice()).unwrap_or(&[]);
        let have = src
            .get(off..)
            .map(|s| &s[..s.len().min(len)])
            .unwrap_or(&[]);
        v[..have.len()].copy_from_slice(have);
        v
    };
    let fold = |off: usize| -> Vec<u8> {
        let mut acc = part(0, off, c);
        for r in 1..n {
            kernels::reduce_inplace(dtype, op, &mut acc, &part(r, off, c));
        }
        kernels::finalize(dtype, op, &mut acc, n);
        acc
    };
    let concat =
        |blocks: &mut dyn Iterator<Item = Vec<u8>>| -> Vec<u8> { blocks.flatten().collect() };
    (0..n)
        .map(|r| match desc.kind {
            Broadcast => part(root, 0, c),
            Reduce if r == root => fold(0),
            AllReduce => fold(0),
            Scatter => part(root, r * c, c),
            Gather if r == root => concat(&mut (0..n).map(|j| part(j, 0, c))),
            AllGather => concat(&mut (0..n).map(|j| part(j, 0, c))),
            ReduceScatter => fold(r * c),
            AllToAll => concat(&mut (0..n).map(|j| part(j, r * c, c))),
            Reduce | Gather | Barrier | SendRecv => Vec::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Step;
    use eccl_protocol::Algo;

    fn one_step(prims: Vec<Prim>) -> Schedule {
        Schedule {
            algo: Algo::Direct,
            steps: vec![Step { prims }],
            input_len: 4,
            output_len: 4,
            scratch_len: 0,
        }
    }

    fn run(s: Vec<Schedule>) -> Result<Vec<Vec<u8>>, String> {
        let inputs = vec![vec![1u8; 4]; s.len()];
        run_schedules(DType::U8, ReduceOp::Sum, &s, &inputs)
    }

    #[test]
    fn detects_deadlock() {
        let s = (0..2)
            .map(|r| {
                one_step(vec![Prim::Recv {
                    peer: 1 - r,
                    dst: Region::output(0, 4),
                }])
            })
            .collect();
        assert!(run(s).unwrap_err().contains("deadlock"));
    }

    #[test]
    fn detects_length_mismatch() {
        let s = vec![
            one_step(vec![Prim::Send {
                peer: 1,
                src: Region::input(0, 2),
            }]),
            one_step(vec![Prim::Recv {
                peer: 0,
                dst: Region::output(0, 3),
            }]),
        ];
        assert!(run(s).unwrap_err().contains("expects 3 bytes"));
    }

    #[test]
    fn detects_frames_received_in_another_step() {
        let s = vec![
            one_step(vec![Prim::Send {
                peer: 1,
                src: Region::input(0, 2),
            }]),
            Schedule {
                steps: vec![
                    Step::default(),
                    Step {
                        prims: vec![Prim::Recv {
                            peer: 0,
                            dst: Region::output(0, 2),
                        }],
                    },
                ],
                ..one_step(vec![])
            },
        ];
        assert!(run(s).unwrap_err().contains("sent in step 0"));
    }

    #[test]
    fn detects_unreceived_frames_and_bad_inputs() {
        let s = vec![
            one_step(vec![Prim::Send {
                peer: 1,
                src: Region::input(0, 2),
            }]),
            one_step(vec![]),
        ];
        assert!(run(s).unwrap_err().contains("never received"));
        let s = vec![one_step(vec![])];
        assert!(run_schedules(DType::F32, ReduceOp::Sum, &s, &[vec![0; 4]])
            .unwrap_err()
            .contains("input has"));
    }

    #[test]
    fn runs_a_pipelined_chain() {
        // 0 -> 1 -> 2, with a reduce-and-forward in the middle.
        let s = vec![
            one_step(vec![Prim::Send {
                peer: 1,
                src: Region::input(0, 4),
            }]),
            one_step(vec![Prim::RecvReduceSend {
                from: 0,
                to: 2,
                local: Region::input(0, 4),
                dst: Some(Region::output(0, 4)),
            }]),
            one_step(vec![Prim::RecvCopySend {
                from: 1,
                to: 0,
                dst: Region::output(0, 4),
            }]),
        ];
        // Rank 0 never receives what rank 2 forwards.
        assert!(run(s.clone()).unwrap_err().contains("never received"));
        let mut s = s;
        s[2] = one_step(vec![Prim::Recv {
            peer: 1,
            dst: Region::output(0, 4),
        }]);
        let out = run(s).unwrap();
        assert_eq!(out, vec![vec![0; 4], vec![2; 4], vec![2; 4]]);
    }
}
