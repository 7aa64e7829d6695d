//! `eccl-chaos worker`: one peer of a chaos run, running a training-like loop whose every
//! result can be checked exactly.
//!
//! The shared state is `--state-mb` MiB of u64 words, all zero at revision 0; every worker,
//! initial or newcomer, starts there. Each step
//!
//! 1. `update_topology()`;
//! 2. `sync_shared_state(revision, [state], EnforcePopular)`, after which every member
//!    holds the same revision;
//! 3. all_reduce (sum) of `--elements` i64 to which each member contributes
//!    [`contribution`]`(its peer id, revision + 1, k)`; the sum is compared element by
//!    element with the closed form over the members the call reports (with
//!    `--in-flight K`, K such calls over consecutive ranges of k, all submitted before
//!    the first finishes);
//! 4. folds the sum into the state ([`fold`]) and reports the commit with the state's
//!    blake3 before and after, so the orchestrator can walk the history back.
//!
//! A retryable error goes back to 1; `Evicted` registers again under a new peer id,
//! keeping state and revision (the next sync brings them up to date). Every call is
//! reported as an [`Event`] on stdout. Commands arrive on stdin: `leave`,
//! `leave-in-sync` (leave from the middle of the next sync), and
//! `stop-at R` (run until revision R, sync once more, report the final state). The worker
//! exits when stdin closes, so it never outlives its orchestrator.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use eccl::{Communicator, Config, ReduceOp, SharedTensor, SyncStrategy};

use crate::event::PeerId;

use crate::event::{now_ms, Call, Event, Op};

#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// Master address.
    #[arg(long)]
    master: String,
    /// Size of the shared state in MiB.
    #[arg(long, default_value_t = 16)]
    state_mb: usize,
    /// i64 elements all-reduced per step.
    #[arg(long, default_value_t = 4096)]
    elements: usize,
    /// Peers the first world waits for (the initial workers pass the run's --peers).
    #[arg(long, default_value_t = 1)]
    min_world: u32,
    /// Pause after each committed step, in milliseconds.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// All-reduces in flight per step: the step's elements (K times `--elements`) go
    /// as K calls submitted before the first finishes (`Communicator::in_flight`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    in_flight: u32,
}

pub fn main(args: WorkerArgs) -> anyhow::Result<()> {
    eccl::logging::init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let control = Control::listen()?;
    rt.block_on(Worker::new(args, control)?.run())
}

/// What `contribution` adds for `peer` at element `k` of the all_reduce that makes
/// revision `step`. Small values, so that a sum over any world cannot wrap.
pub fn contribution(peer: PeerId, step: u64, k: usize) -> i64 {
    (peer
        .wrapping_mul(1_000_003)
        .wrapping_add(step.wrapping_mul(7919))
        .wrapping_add(k as u64)
        % 1000) as i64
}

/// Elements of `reduced` that differ from the sum of every member's contribution.
pub fn count_wrong(reduced: &[i64], members: &[PeerId], step: u64) -> usize {
    reduced
        .iter()
        .enumerate()
        .filter(|&(k, &got)| {
            got != members
                .iter()
                .map(|&m| contribution(m, step, k))
                .sum::<i64>()
        })
        .count()
}

/// Folds the all_reduce result of `step` into the state. Every word depends on its old
/// value, on the result and on the step, so two histories that differ anywhere end in
/// different hashes.
pub fn fold(state: &mut [u64], reduced: &[i64], step: u64) {
    for (i, w) in state.iter_mut().enumerate() {
        let r = reduced[i % reduced.len()] as u64;
        *w = w.rotate_left(7) ^ r.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step;
    }
}

fn state_hash(state: &[u64]) -> blake3::Hash {
    blake3::hash(bytemuck::cast_slice(state))
}

/// Writes one event line. A write fails only when the orchestrator is gone, and then
/// stdin has closed too and the worker is about to exit.
fn emit(ev: &Event) {
    if let Ok(line) = serde_json::to_string(ev) {
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }
}

/// Commands from the orchestrator, read between steps.
struct Control {
    leave: AtomicBool,
    /// `leave-in-sync`: leave from the middle of the next shared-state sync, dropping
    /// the call [`IN_SYNC_MS`] in (while the master plans it, or while serving a
    /// newcomer's catch-up).
    leave_in_sync: AtomicBool,
    /// Revision to stop at; `u64::MAX` until `stop-at` arrives.
    stop_at: AtomicU64,
}

impl Control {
    /// Reads commands on a plain thread: a blocking read in tokio's pool would keep the
    /// runtime from shutting down when the worker is done.
    fn listen() -> std::io::Result<Arc<Control>> {
        let control = Arc::new(Control {
            leave: AtomicBool::new(false),
            leave_in_sync: AtomicBool::new(false),
            stop_at: AtomicU64::new(u64::MAX),
        });
        let c = control.clone();
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                for line in std::io::stdin().lines() {
                    let Ok(line) = line else { break };
                    let mut words = line.split_whitespace();
                    match (words.next(), words.next().map(str::parse::<u64>)) {
                        (Some("leave"), None) => c.leave.store(true, Ordering::SeqCst),
                        (Some("leave-in-sync"), None) => {
                            c.leave_in_sync.store(true, Ordering::SeqCst)
                        }
                        (Some("stop-at"), Some(Ok(r))) => c.stop_at.store(r, Ordering::SeqCst),
                        _ => eprintln!("eccl-chaos worker: ignoring command {line:?}"),
                    }
                }
                // The orchestrator is gone or done with us.
                std::process::exit(0);
            })?;
        Ok(control)
    }
}

enum Step {
    Continue,
    Finished,
    /// Left in the middle of a sync (`leave-in-sync`).
    LeftInSync,
}

/// How long a sync runs before a worker told `leave-in-sync` leaves from its middle (a
/// sync takes a few milliseconds even with nothing to move: the master's plan waits for
/// every member).
const IN_SYNC_MS: u64 = 1;

struct Worker {
    args: WorkerArgs,
    cfg: Config,
    control: Arc<Control>,
    state: Vec<u64>,
    revision: u64,
    hash: blake3::Hash,
    /// The current peer id; the last one while re-registering.
    peer: PeerId,
}

impl Worker {
    fn new(args: WorkerArgs, control: Arc<Control>) -> anyhow::Result<Worker> {
        anyhow::ensure!(args.elements > 0, "--elements must be positive");
        let mut cfg = Config::from_env()?;
        cfg.master = args.master.clone();
        cfg.min_world = args.min_world;
        let mut state = vec![0u64; args.state_mb << 17];
        // Written once, a word per page, before the worker joins, as a trainer's model
        // is when it is built: memory first written during a newcomer's catch-up costs
        // its page faults there, and the members serving it wait for them (here, with the
        // members busy, 1 GiB of first writes took 2-3 s of the transfer's time).
        state
            .iter_mut()
            .step_by(512)
            .for_each(|w| *w = std::hint::black_box(0));
        let hash = state_hash(&state);
        Ok(Worker {
            args,
            cfg,
            control,
            state,
            revision: 0,
            hash,
            peer: 0,
        })
    }

    async fn run(mut self) -> anyhow::Result<()> {
        let mut comm: Option<Communicator> = None;
        loop {
            if self.control.leave.load(Ordering::SeqCst) {
                self.leave(comm).await;
                return Ok(());
            }
            let c = match comm {
                Some(ref mut c) => c,
                None => match self.connect().await {
                    Some(c) => comm.insert(c),
                    None => continue,
                },
            };
            match self.step(c).await {
                Ok(Step::Continue) => {}
                Ok(Step::Finished) | Ok(Step::LeftInSync) => {
                    self.leave(comm).await;
                    return Ok(());
                }
                Err(eccl::Error::Evicted { reason }) => {
                    emit(&Event::Evicted {
                        peer: self.peer,
                        t: now_ms(),
                        reason,
                    });
                    comm = None;
                }
                Err(e) if e.is_retryable() => {}
                // Mismatch and the like: the epoch is broken for everyone; pause briefly so
                // that a persistent error does not spin, then vote for a new one.
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn connect(&mut self) -> Option<Communicator> {
        match Communicator::connect(self.cfg.clone()).await {
            Ok(c) => {
                self.peer = c.peer_id().0;
                emit(&Event::Registered {
                    peer: self.peer,
                    t: now_ms(),
                });
                Some(c)
            }
            Err(e) => {
                emit(&Event::ConnectFailed {
                    t: now_ms(),
                    err: e.to_string(),
                });
                tokio::time::sleep(Duration::from_millis(200)).await;
                None
            }
        }
    }

    async fn leave(&self, comm: Option<Communicator>) {
        if let Some(comm) = comm {
            let (epoch, members) = world_of(&comm);
            let start = now_ms();
            let r = comm.leave().await;
            self.report(Op::Leave, start, r.as_ref().err(), epoch, members);
        }
        emit(&Event::Left {
            peer: self.peer,
            t: now_ms(),
        });
    }

    /// One step of the loop; see the module comment.
    async fn step(&mut self, comm: &mut Communicator) -> eccl::Result<Step> {
        let start = now_ms();
        let r = comm.update_topology().await;
        self.report_world(comm, Op::UpdateTopology, start, r.as_ref().err());
        r?;

        let start = now_ms();
        let r = {
            let mut tensors = [SharedTensor::bytes(
                "state",
                bytemuck::cast_slice_mut(&mut self.state),
            )];
            let sync =
                comm.sync_shared_state(self.revision, &mut tensors, SyncStrategy::EnforcePopular);
            if self.control.leave_in_sync.load(Ordering::SeqCst) {
                tokio::select! {
                    r = sync => r,
                    _ = tokio::time::sleep(Duration::from_millis(IN_SYNC_MS)) => {
                        // The call is dropped halfway (a newcomer may be fetching from
                        // us): the leave that follows closes our links, and the
                        // newcomer's fetch goes on from the other sources.
                        emit(&Event::LeavingInSync {
                            peer: self.peer,
                            t: now_ms(),
                        });
                        return Ok(Step::LeftInSync);
                    }
                }
            } else {
                sync.await
            }
        };
        if let Ok(info) = &r {
            self.revision = info.revision;
        }
        // Hashed by us whatever the library says it updated, so that a sync that wrote
        // without saying so still shows up as a divergence.
        self.hash = state_hash(&self.state);
        self.report_world(comm, Op::Sync, start, r.as_ref().err());
        let info = r?;
        emit(&Event::Sync {
            peer: self.peer,
            t: now_ms(),
            epoch: info.epoch,
            revision: info.revision,
            hash: self.hash.to_hex().to_string(),
            lib_hash: hex::encode(info.hash),
            bytes_received: info.bytes_received,
            sources: info.sources.iter().map(|p| p.0).collect(),
        });

        if self.revision >= self.control.stop_at.load(Ordering::SeqCst) {
            // Every member synced to the same revision; the barrier makes sure of it
            // before anyone leaves, so no one is left fetching from a departed source.
            let start = now_ms();
            let r = comm.barrier().await;
            self.report_world(comm, Op::Barrier, start, r.as_ref().err());
            r?;
            emit(&Event::Final {
                peer: self.peer,
                t: now_ms(),
                revision: self.revision,
                hash: self.hash.to_hex().to_string(),
            });
            return Ok(Step::Finished);
        }

        let step = self.revision + 1;
        let (reduced, info) = self.all_reduce(comm, step).await?;
        let members: Vec<PeerId> = info.members.iter().map(|p| p.0).collect();
        let wrong = count_wrong(&reduced, &members, step);
        if wrong > 0 {
            emit(&Event::Wrong {
                peer: self.peer,
                t: now_ms(),
                epoch: info.epoch,
                revision: step,
                elements: wrong,
            });
            return Ok(Step::Continue);
        }
        fold(&mut self.state, &reduced, step);
        let prev = std::mem::replace(&mut self.hash, state_hash(&self.state));
        self.revision = step;
        emit(&Event::Commit {
            peer: self.peer,
            t: now_ms(),
            epoch: info.epoch,
            revision: step,
            prev: prev.to_hex().to_string(),
            hash: self.hash.to_hex().to_string(),
        });
        if self.args.step_ms > 0 {
            tokio::time::sleep(Duration::from_millis(self.args.step_ms)).await;
        }
        Ok(Step::Continue)
    }

    /// The step's all_reduce (sum) of `in_flight × elements` contributions: one call, or
    /// `in_flight` calls of `elements` each, all submitted before the first finishes. Each
    /// call is reported with its own start and end; the step fails with the first error.
    async fn all_reduce(
        &self,
        comm: &mut Communicator,
        step: u64,
    ) -> eccl::Result<(Vec<i64>, eccl::OpInfo)> {
        use futures::FutureExt;
        let (n, peer) = (self.args.elements, self.peer);
        let calls = comm
            .in_flight(|q| {
                let queued: Vec<_> = (0..self.args.in_flight as usize)
                    .map(|j| {
                        q.submit(move |c| {
                            async move {
                                let mut part: Vec<i64> = (j * n..(j + 1) * n)
                                    .map(|k| contribution(peer, step, k))
                                    .collect();
                                let start = now_ms();
                                let r = c.all_reduce(&mut part, ReduceOp::Sum).await;
                                let (epoch, world) = world_of(c);
                                if r.is_err() {
                                    // G2: a failed call leaves the buffer as it was.
                                    let touched = (j * n..(j + 1) * n)
                                        .zip(&part)
                                        .filter(|(k, v)| contribution(peer, step, *k) != **v)
                                        .count();
                                    if touched > 0 {
                                        emit(&Event::Touched {
                                            peer,
                                            t: now_ms(),
                                            epoch,
                                            revision: step,
                                            elements: touched,
                                        });
                                    }
                                }
                                (part, r, start, now_ms(), epoch, world)
                            }
                            .boxed()
                        })
                    })
                    .collect();
                futures::future::join_all(queued)
            })
            .await;
        let mut reduced = Vec::with_capacity(n * calls.len());
        let (mut info, mut failed) = (None, None);
        for call in calls {
            let (part, r, start, end, epoch, world) = call?;
            let members = r
                .as_ref()
                .map_or(world, |info| info.members.iter().map(|p| p.0).collect());
            self.report_at(Op::AllReduce, start, end, r.as_ref().err(), epoch, members);
            match r {
                Ok(i) => {
                    info.get_or_insert(i);
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            reduced.extend(part);
        }
        match failed {
            Some(e) => Err(e),
            None => Ok((reduced, info.expect("at least one call"))),
        }
    }

    fn report_world(&self, comm: &Communicator, op: Op, start: f64, err: Option<&eccl::Error>) {
        let (epoch, members) = world_of(comm);
        self.report(op, start, err, epoch, members);
    }

    fn report(
        &self,
        op: Op,
        start: f64,
        err: Option<&eccl::Error>,
        epoch: u64,
        members: Vec<PeerId>,
    ) {
        self.report_at(op, start, now_ms(), err, epoch, members)
    }

    fn report_at(
        &self,
        op: Op,
        start: f64,
        end: f64,
        err: Option<&eccl::Error>,
        epoch: u64,
        members: Vec<PeerId>,
    ) {
        emit(&Event::Call(Call {
            peer: self.peer,
            op,
            start,
            end,
            ok: err.is_none(),
            err: err.map(|e| e.kind().to_string()),
            detail: err.map(|e| e.to_string()),
            epoch,
            members,
            revision: self.revision,
        }));
    }
}

fn world_of(comm: &Communicator) -> (u64, Vec<PeerId>) {
    (
        comm.epoch(),
        comm.world()
            .map(|w| w.members.iter().map(|m| m.peer_id.0).collect())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_correct_sum_has_no_wrong_elements_and_a_changed_one_has_one() {
        let members = [3, 17, 40];
        let mut sum: Vec<i64> = (0..100)
            .map(|k| members.iter().map(|&m| contribution(m, 9, k)).sum())
            .collect();
        assert_eq!(count_wrong(&sum, &members, 9), 0);
        assert_ne!(count_wrong(&sum, &members, 10), 0, "the step must matter");
        sum[42] += 1;
        assert_eq!(count_wrong(&sum, &members, 9), 1);
    }

    #[test]
    fn fold_depends_on_the_result_and_the_step() {
        let fold_from_zero = |reduced: &[i64], step| {
            let mut s = vec![0u64; 64];
            fold(&mut s, reduced, step);
            state_hash(&s)
        };
        let base = fold_from_zero(&[1, 2, 3], 1);
        assert_eq!(base, fold_from_zero(&[1, 2, 3], 1));
        assert_ne!(base, fold_from_zero(&[1, 2, 4], 1));
        assert_ne!(base, fold_from_zero(&[1, 2, 3], 2));
    }
}
