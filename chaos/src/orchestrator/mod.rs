//! The run: start the master and the workers, wait for the first world, inject the
//! schedule's faults one at a time (each measured until it has played out, then a pause),
//! notice the faults workers inflict on themselves through `ECCL_FAULT_INJECT`, and at the
//! end stop every worker at one revision and hand the event log to the report.

use anyhow::Context;
use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use crate::event::{now_ms, Event, Op};
use crate::fleet::{Fate, Fleet, Msg, WorkerSpec};
use crate::master_faults::{MasterFault, MasterOutcome, MasterView};

mod masters;
use crate::measure::{Fault, Measurement, Outcome};
use crate::report::{self, Report, RunLog};
use crate::resources::Sampler;
use crate::schedule::{self, FaultKind, InjectTarget, Planned};
use crate::RunArgs;

/// How often children are polled for self-inflicted stops.
const POLL: Duration = Duration::from_millis(10);
/// A fault that has not played out this long after it struck (after the victim resumed,
/// for a hang) is a hang.
const MEASURE_TIMEOUT_MS: f64 = 15_000.0;
/// No fault is injected this close to the end, so that the last one plays out.
const QUIET_BEFORE_END_MS: f64 = 3_000.0;
/// A call may take the lease plus this before it counts as a hang.
const HANG_MARGIN_MS: f64 = 1_000.0;
const FORMATION_TIMEOUT_MS: f64 = 60_000.0;
/// How long workers have to reach the stop revision and exit.
const FINISH_TIMEOUT_MS: f64 = 30_000.0;
/// How often the masters' and workers' memory and descriptors are sampled (at most).
const SAMPLE_MS: f64 = 5_000.0;
/// Runs at least this long print a summary line every minute.
const MINUTE_LINES_FROM_MS: f64 = 120_000.0;

pub fn run(args: &RunArgs) -> anyhow::Result<Report> {
    let seed = args.seed.unwrap_or_else(rand::random);
    let span = args.duration_ms() - QUIET_BEFORE_END_MS;
    let plan = if args.churn {
        schedule::plan_churn(seed, &args.faults, span, args.churn_ms)
    } else {
        schedule::plan(seed, &args.faults, span, args.interval_ms as f64)
    };
    // Partitions need every worker in a network namespace of its own; where none can be
    // made, they are left out of this run and the run says so.
    let mut kinds = args.faults.clone();
    let lab = if args.netns {
        // Asked for: no namespaces, no run.
        Some(
            crate::netns::Lab::shaped(
                args.link_rate.clone(),
                args.slow_links.clone().map_or_else(Vec::new, |p| p.0),
                args.slow_rate.clone(),
            )
            .context("--netns")?,
        )
    } else if kinds.contains(&FaultKind::Partition) {
        match crate::netns::Lab::new(None) {
            Ok(lab) => Some(lab),
            Err(e) => {
                println!("# partition: skipped: network namespaces cannot be made here ({e:#})");
                kinds.retain(|k| *k != FaultKind::Partition);
                None
            }
        }
    } else {
        None
    };
    let plan = if kinds.len() == args.faults.len() {
        plan
    } else if args.churn {
        schedule::plan_churn(seed, &kinds, span, args.churn_ms)
    } else {
        schedule::plan(seed, &kinds, span, args.interval_ms as f64)
    };
    let (fleet, rx) = Fleet::start(
        args.masters as usize,
        args.lease_ms,
        args.heartbeat_ms,
        WorkerSpec {
            state_mb: args.state_mb,
            elements: args.elements,
            in_flight: args.in_flight,
            step_ms: args.step_ms,
            verbose: args.verbose,
            transport: args.transport.clone(),
        },
        lab,
    )?;
    let faults: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
    println!(
        "# eccl-chaos: seed {seed}, {} peers, {:.0} s, faults {}, lease {} ms, state {} MiB, {} elements{}, transport {}, {} {}",
        args.peers,
        args.duration_ms() / 1e3,
        if faults.is_empty() { "none".into() } else { faults.join(",") },
        args.lease_ms,
        args.state_mb,
        args.elements,
        if args.in_flight > 1 {
            format!(" × {} in flight", args.in_flight)
        } else {
            String::new()
        },
        args.transport,
        if args.masters > 1 { "masters" } else { "master" },
        fleet.master_addr
    );
    let mut run = Run::new(args, fleet, rx);
    for k in 0..args.peers {
        let inject = args
            .inject
            .iter()
            .find(|i| i.target == InjectTarget::Initial(k))
            .map(|i| i.spec.clone());
        run.fleet.spawn(args.peers, inject)?;
    }
    run.wait_for_world()?;
    let end = run.t0 + args.duration_ms();
    if args.churn {
        run.inject_on_a_clock(plan, end - QUIET_BEFORE_END_MS)?;
    } else {
        run.inject(plan, end - QUIET_BEFORE_END_MS)?;
    }
    while now_ms() < end || run.busy() {
        run.pump()?;
    }
    let finishers = run.finish()?;
    Ok(run.report(finishers, seed))
}

struct Run<'a> {
    args: &'a RunArgs,
    fleet: Fleet,
    rx: Receiver<Msg>,
    t0: f64,
    hang_ms: f64,
    events: Vec<(usize, Event)>,
    open: Vec<Measurement>,
    faults: Vec<(FaultKind, Outcome)>,
    stopped: Vec<(usize, f64, f64)>,
    /// Slow faults played: (slot, from, to).
    slowed: Vec<(usize, f64, f64)>,
    violations: Vec<String>,
    hangs: u64,
    max_revision: u64,
    /// Workers that have committed at least once.
    committed: BTreeSet<usize>,
    /// Workers that reported `left` or `final`: their exit is expected.
    done: BTreeSet<usize>,
    /// Workers told of their eviction that have not registered again: no fault strikes
    /// them until they have (under `--churn` one could; a fault measured on a peer that
    /// is already out would wait for an eviction it was told of before).
    between_lives: BTreeSet<usize>,
    /// `ECCL_FAULT_INJECT` for the first newcomer, until it is started.
    newcomer_inject: Option<String>,
    masters: MasterView,
    master_open: Option<MasterFault>,
    master_faults: Vec<(FaultKind, MasterOutcome)>,
    /// When each master fault played out (from the strike to its close).
    master_windows: Vec<(f64, f64)>,
    /// Memory and descriptors of the masters and workers.
    sampler: Sampler,
    /// The next minute line (runs of two minutes or more).
    next_minute: f64,
}

impl<'a> Run<'a> {
    fn new(args: &'a RunArgs, fleet: Fleet, rx: Receiver<Msg>) -> Run<'a> {
        Run {
            args,
            fleet,
            rx,
            t0: now_ms(),
            hang_ms: args.hang_ms() as f64,
            events: Vec::new(),
            open: Vec::new(),
            faults: Vec::new(),
            stopped: Vec::new(),
            slowed: Vec::new(),
            violations: Vec::new(),
            hangs: 0,
            max_revision: 0,
            committed: BTreeSet::new(),
            done: BTreeSet::new(),
            between_lives: BTreeSet::new(),
            newcomer_inject: args
                .inject
                .iter()
                .find(|i| i.target == InjectTarget::FirstNewcomer)
                .map(|i| i.spec.clone()),
            masters: MasterView::default(),
            master_open: None,
            master_faults: Vec::new(),
            master_windows: Vec::new(),
            // At least twenty samples a run, so that its start and end windows hold some.
            sampler: Sampler::new(now_ms(), SAMPLE_MS.min(args.duration_ms() / 20.0)),
            next_minute: if args.duration_ms() >= MINUTE_LINES_FROM_MS {
                now_ms() + 60_000.0
            } else {
                f64::INFINITY
            },
        }
    }

    /// Samples the masters' and live workers' memory and descriptors when due, and
    /// prints the minute line of a long run.
    fn sample(&mut self) {
        let now = now_ms();
        let masters = (0..self.fleet.masters.len())
            .filter_map(|i| Some((format!("master {i}"), self.fleet.masters.pid(i)?)));
        let workers = self.fleet.live().map(|s| {
            let w = &self.fleet.workers[s];
            (format!("worker {s}"), w.pid)
        });
        let procs: Vec<(String, u32)> = masters.chain(workers).collect();
        self.sampler.tick(now, procs);
        if now < self.next_minute {
            return;
        }
        self.next_minute += 60_000.0;
        let (mut master_rss, mut worker_rss, mut fds) = (0u64, 0u64, 0u64);
        for (name, s) in self.sampler.latest() {
            if name.starts_with("master") {
                master_rss = master_rss.max(s.rss_kib);
            } else {
                worker_rss = worker_rss.max(s.rss_kib);
            }
            fds = fds.max(s.fds);
        }
        let minute = ((now - self.t0) / 60_000.0).round();
        let line = format!(
            "minute {minute:.0}: {} steps, {} faults, {} workers live, {} violations; largest RSS: master {} MiB, worker {} MiB; most fds {fds}",
            self.max_revision,
            self.faults.len() + self.master_faults.len(),
            self.fleet.live().count(),
            self.violations.len(),
            master_rss >> 10,
            worker_rss >> 10,
        );
        // Printed even with --quiet: a soak's only sign of life.
        println!("[{:>7.2}s] {line}", (now - self.t0) / 1e3);
    }

    /// A fault is still playing out.
    fn busy(&self) -> bool {
        !self.open.is_empty()
            || self.master_open.is_some()
            || self
                .fleet
                .workers
                .iter()
                .any(|w| matches!(w.fate, Fate::Slowed { .. }))
    }

    /// Prints one line stamped with the run time of `at`.
    fn say(&self, at: f64, line: &str) {
        if !self.args.quiet {
            println!("[{:>7.2}s] {line}", (at - self.t0) / 1e3);
        }
    }

    fn violation(&mut self, at: f64, text: String) {
        self.say(at, &format!("VIOLATION {text}"));
        self.violations.push(text);
    }

    /// Handles what arrived within one poll interval, then looks after stops, resumes and
    /// measurements.
    fn pump(&mut self) -> anyhow::Result<()> {
        let first = match self.rx.recv_timeout(POLL) {
            Ok(msg) => Some(msg),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => anyhow::bail!("the event channel closed"),
        };
        let msgs: Vec<Msg> = first.into_iter().chain(self.rx.try_iter()).collect();
        for msg in msgs {
            match msg {
                Msg::Event { slot, event } => self.on_event(slot, event),
                Msg::Closed { slot, t } => self.on_exit(slot, t)?,
                Msg::Master(r) => {
                    self.masters.observe(r);
                    if let Some(m) = &mut self.master_open {
                        m.observe_report(&r);
                    }
                }
            }
        }
        self.notice_self_stops();
        self.resume_due()?;
        self.close_measurements();
        self.master_fault_due()?;
        self.sample();
        Ok(())
    }

    fn on_event(&mut self, slot: usize, event: Event) {
        match &event {
            Event::Registered { peer, .. } => {
                self.fleet.workers[slot].peer = Some(*peer);
                self.between_lives.remove(&slot);
            }
            Event::Evicted { .. } => {
                self.between_lives.insert(slot);
            }
            Event::Commit { revision, .. } => {
                self.max_revision = self.max_revision.max(*revision);
                self.committed.insert(slot);
            }
            Event::Left { .. } | Event::Final { .. } => {
                self.done.insert(slot);
            }
            _ => {}
        }
        for m in &mut self.open {
            m.observe(slot, &event);
        }
        if let (Some(m), Some(c)) = (&mut self.master_open, event.call()) {
            m.observe_call(slot, c);
        }
        self.events.push((slot, event));
    }

    /// A worker's stdout closed at `t`: reap it and decide whether that was a fault, an
    /// expected exit, or a violation.
    fn on_exit(&mut self, slot: usize, t: f64) -> anyhow::Result<()> {
        let fate = self.fleet.workers[slot].fate;
        let status = self.fleet.reap(slot)?;
        for m in &mut self.open {
            m.drop_survivor(slot);
            if m.fault.victim == slot {
                m.victim_exited();
            }
        }
        if fate == Fate::Killed || (status.success() && self.done.contains(&slot)) {
            return Ok(());
        }
        if status.signal() == Some(libc::SIGKILL) {
            let injected = self.fleet.workers[slot].inject.clone();
            self.open_fault(FaultKind::Kill, slot, t, injected);
        } else {
            let w = &self.fleet.workers[slot];
            let text = format!(
                "{} (worker {slot}, pid {}) exited unexpectedly: {status}",
                name(slot, w.peer),
                w.pid
            );
            self.violation(t, text);
        }
        Ok(())
    }

    fn notice_self_stops(&mut self) {
        let now = now_ms();
        let stopped: Vec<usize> = self
            .fleet
            .running()
            .filter(|&slot| self.fleet.stopped_itself(slot))
            .collect();
        for slot in stopped {
            let injected = self.fleet.workers[slot].inject.clone();
            self.stop(slot, now, injected);
        }
    }

    /// Records that `slot` stopped (or was cut off the network) at `at` and opens its
    /// hang (partition).
    fn stop(&mut self, slot: usize, at: f64, injected: Option<String>) {
        self.silence(FaultKind::Hang, slot, at, injected)
    }

    fn silence(&mut self, kind: FaultKind, slot: usize, at: f64, injected: Option<String>) {
        self.fleet.workers[slot].fate = Fate::Stopped {
            since: at,
            resume_at: at + self.hang_ms,
            cut: kind == FaultKind::Partition,
        };
        for m in &mut self.open {
            m.drop_survivor(slot);
        }
        self.open_fault(kind, slot, at, injected);
        if self.master_open.is_some() {
            // A leader elected from now on grants every peer a fresh lease.
            if let Some(m) = self.open.last_mut() {
                m.lease_renewed = true;
            }
        }
    }

    fn resume_due(&mut self) -> anyhow::Result<()> {
        let now = now_ms();
        for slot in 0..self.fleet.workers.len() {
            if let Fate::Slowed { since, resume_at } = self.fleet.workers[slot].fate {
                if now >= resume_at {
                    self.fleet.signal(slot, libc::SIGCONT)?;
                    self.fleet.workers[slot].fate = Fate::Running;
                    self.slowed.push((slot, since, now));
                    let peer = self.fleet.workers[slot].peer;
                    self.say(
                        since,
                        &format!(
                            "slow  {} (pid {}) stopped {:.0} ms, under half a lease",
                            name(slot, peer),
                            self.fleet.workers[slot].pid,
                            now - since
                        ),
                    );
                }
                continue;
            }
            let Fate::Stopped {
                since,
                resume_at,
                cut,
            } = self.fleet.workers[slot].fate
            else {
                continue;
            };
            if now < resume_at {
                continue;
            }
            if cut {
                let lab = self.fleet.lab.as_ref().expect("a partition needs the lab");
                lab.cut(slot, false)?;
            } else {
                // A victim that died while stopped is handled by its exit.
                self.fleet.signal(slot, libc::SIGCONT)?;
            }
            self.fleet.workers[slot].fate = Fate::Running;
            self.stopped.push((slot, since, now));
            for m in &mut self.open {
                if m.fault.victim == slot {
                    m.resumed(now);
                }
            }
        }
        Ok(())
    }

    fn open_fault(&mut self, kind: FaultKind, slot: usize, at: f64, injected: Option<String>) {
        let w = &self.fleet.workers[slot];
        let fault = Fault {
            kind,
            victim: slot,
            peer: w.peer,
            pid: w.pid,
            at,
            injected,
        };
        let resume = if matches!(kind, FaultKind::Hang | FaultKind::Partition) {
            self.hang_ms
        } else {
            0.0
        };
        let survivors: Vec<usize> = self.fleet.running().collect();
        self.open.push(Measurement::new(
            fault,
            survivors,
            at + resume + MEASURE_TIMEOUT_MS,
        ));
    }

    fn close_measurements(&mut self) {
        let now = now_ms();
        let (closed, open): (Vec<_>, Vec<_>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|m| m.is_done() || now > m.deadline);
        self.open = open;
        for m in closed {
            let outcome = m.outcome();
            self.say(m.fault.at, &self.describe(&m.fault, &outcome));
            if !m.is_done() {
                self.hangs += 1;
                let text = format!(
                    "hang: the {} of {} at {:.2} s had not played out {:.0} s later: {}",
                    m.fault.kind.name(),
                    name(m.fault.victim, m.fault.peer),
                    (m.fault.at - self.t0) / 1e3,
                    (now - m.fault.at) / 1e3,
                    m.pending()
                );
                self.violation(now, text);
            }
            self.faults.push((m.fault.kind, outcome));
        }
    }

    /// One line per fault, e.g. `kill  peer 3 (pid 1234): survivors aborted in 12 ms,
    /// recovered in 85 ms (epoch 7, 3 members)`.
    fn describe(&self, f: &Fault, o: &Outcome) -> String {
        let who = match f.kind {
            FaultKind::Join => name(f.victim, self.fleet.workers[f.victim].peer),
            _ => name(f.victim, f.peer),
        };
        let mut head = format!("{:<5} {who} (pid {}", f.kind.name(), f.pid);
        if let Some(spec) = &f.injected {
            head += &format!(", ECCL_FAULT_INJECT={spec}");
        }
        head += ")";
        let aborted = match o.abort_ms {
            Some(ms) => format!("survivors aborted in {ms:.0} ms"),
            None => "not every survivor noticed".into(),
        };
        let recovered = match (o.recovery_ms, o.recovery) {
            (Some(ms), Some(r)) => format!(
                "recovered in {ms:.0} ms (epoch {}, {} members)",
                r.epoch, r.members
            ),
            _ => "did not recover".into(),
        };
        match f.kind {
            FaultKind::Kill => format!("{head}: {aborted}, {recovered}"),
            FaultKind::Hang | FaultKind::Partition => format!(
                "{head} {} {}: {}, {aborted}, {recovered}",
                if f.kind == FaultKind::Hang {
                    "stopped"
                } else {
                    "cut off the network"
                },
                o.stopped_ms
                    .map_or("until it exited".into(), |ms| format!("{:.1} s", ms / 1e3)),
                if o.evicted { "evicted" } else { "not evicted" }
            ),
            FaultKind::Join if o.died_joining => format!("{head}: died before it joined"),
            FaultKind::Join => match o.join_ms {
                Some(ms) => format!(
                    "{head}: first synced all_reduce after {ms:.0} ms (fetched {:.1} MiB from peers {:?})",
                    o.fetched as f64 / (1u64 << 20) as f64,
                    o.sources
                ),
                None => format!("{head}: did not join"),
            },
            // Described by `MasterFault::describe`, and a slow peer when it wakes.
            FaultKind::Leave
            | FaultKind::LeaveDuringSync
            | FaultKind::MasterKill
            | FaultKind::MasterHang
            | FaultKind::Slow => head,
        }
    }

    /// Waits until every initial worker has committed a step (or died trying), so that
    /// no scheduled fault strikes before the first world exists.
    fn wait_for_world(&mut self) -> anyhow::Result<()> {
        let deadline = now_ms() + FORMATION_TIMEOUT_MS;
        loop {
            self.pump()?;
            let formed = (0..self.args.peers as usize).all(|slot| {
                self.committed.contains(&slot) || self.fleet.workers[slot].fate == Fate::Exited
            });
            if formed {
                break;
            }
            anyhow::ensure!(
                now_ms() < deadline,
                "the first world did not form within {:.0} s: workers {:?} never committed a step (run with --verbose to see their logs)",
                FORMATION_TIMEOUT_MS / 1e3,
                (0..self.args.peers as usize)
                    .filter(|s| !self.committed.contains(s))
                    .collect::<Vec<_>>()
            );
        }
        let world = self.events.iter().rev().find_map(|(_, e)| {
            e.call()
                .filter(|c| c.op == Op::AllReduce && c.ok)
                .map(|c| (c.epoch, c.members.len()))
        });
        if let Some((epoch, n)) = world {
            self.say(
                now_ms(),
                &format!("world formed: epoch {epoch}, {n} members"),
            );
        }
        Ok(())
    }

    /// Injects the planned faults until `quiet_from`, each after the previous one has
    /// played out and the planned pause has passed.
    fn inject(&mut self, plan: Vec<Planned>, quiet_from: f64) -> anyhow::Result<()> {
        let mut plan = plan.into_iter();
        let mut next: Option<(f64, Planned)> = None;
        loop {
            self.pump()?;
            let now = now_ms();
            if self.busy() {
                continue;
            }
            if now >= quiet_from {
                return Ok(());
            }
            match next {
                None => next = plan.next().map(|p| (now + p.gap_ms, p)),
                Some((at, p)) if now >= at => {
                    self.strike(p)?;
                    next = None;
                }
                Some(_) => {}
            }
        }
    }

    /// `--churn`: injects the planned faults until `quiet_from`, each at its time from
    /// the previous strike, whatever is still playing out (PCCL's churn). A master fault
    /// whose predecessor is still open is skipped: the cluster is measured one fault at a
    /// time (and a second leader loss at once would be a majority fault).
    fn inject_on_a_clock(&mut self, plan: Vec<Planned>, quiet_from: f64) -> anyhow::Result<()> {
        let mut at = now_ms();
        for p in plan {
            at += p.gap_ms;
            if at >= quiet_from {
                break;
            }
            while now_ms() < at {
                self.pump()?;
            }
            if p.kind.is_master() && self.master_open.is_some() {
                continue;
            }
            self.strike(p)?;
        }
        while now_ms() < quiet_from {
            self.pump()?;
        }
        Ok(())
    }

    /// Injects one planned fault, adjusted so that --min-live running peers remain and the world
    /// stays within --peers + 2. A victim that died in the meantime escapes it.
    fn strike(&mut self, p: Planned) -> anyhow::Result<()> {
        let running: Vec<usize> = self
            .fleet
            .running()
            .filter(|s| !self.between_lives.contains(s))
            .collect();
        let live = self.fleet.live().count();
        let kind = schedule::adjust(
            p.kind,
            running.len(),
            live,
            self.args.peers as usize + 2,
            self.args.min_live as usize,
        );
        let victim = || running[p.victim as usize % running.len()];
        let now = now_ms();
        match kind {
            FaultKind::MasterKill | FaultKind::MasterHang => self.strike_master(kind, p.victim)?,
            FaultKind::Join => {
                let inject = self.newcomer_inject.take();
                let slot = self.fleet.spawn(1, inject.clone())?;
                let spawned = self.fleet.workers[slot].spawned;
                self.open_fault(FaultKind::Join, slot, spawned, inject);
            }
            FaultKind::Kill => {
                let v = victim();
                if self.fleet.signal(v, libc::SIGKILL)? {
                    self.fleet.workers[v].fate = Fate::Killed;
                    self.open_fault(kind, v, now, None);
                }
            }
            FaultKind::Hang => {
                let v = victim();
                if self.fleet.signal(v, libc::SIGSTOP)? {
                    self.stop(v, now, None);
                }
            }
            FaultKind::Partition => {
                let v = victim();
                let lab = self
                    .fleet
                    .lab
                    .as_ref()
                    .expect("partitions run with the lab");
                lab.cut(v, true)?;
                self.silence(kind, v, now, None);
            }
            FaultKind::Slow => {
                let v = victim();
                if self.fleet.signal(v, libc::SIGSTOP)? {
                    self.fleet.workers[v].fate = Fate::Slowed {
                        since: now,
                        resume_at: now + self.args.slow_ms() as f64,
                    };
                }
            }
            FaultKind::Leave => {
                let v = victim();
                if self.fleet.tell(v, "leave") {
                    self.fleet.workers[v].fate = Fate::Leaving;
                    self.open_fault(kind, v, now, None);
                }
            }
            FaultKind::LeaveDuringSync => {
                // A newcomer, whose catch-up is the sync the member is to leave from.
                let v = victim();
                let slot = self.fleet.spawn(1, None)?;
                let spawned = self.fleet.workers[slot].spawned;
                self.open_fault(FaultKind::Join, slot, spawned, None);
                if self.fleet.tell(v, "leave-in-sync") {
                    self.fleet.workers[v].fate = Fate::Leaving;
                    self.open_fault(kind, v, now, None);
                }
            }
        }
        Ok(())
    }

    /// Tells every live worker to stop two steps past the newest revision, and waits for
    /// them to report their final state and exit. Returns the workers told.
    fn finish(&mut self) -> anyhow::Result<BTreeSet<usize>> {
        let stop_at = self.max_revision + 3;
        let finishers: BTreeSet<usize> = self
            .fleet
            .live()
            .filter(|&s| !matches!(self.fleet.workers[s].fate, Fate::Killed | Fate::Leaving))
            .collect();
        for &slot in &finishers {
            // One that cannot be told has died, and its exit is handled as such.
            self.fleet.tell(slot, &format!("stop-at {stop_at}"));
            if self.fleet.workers[slot].fate == Fate::Running {
                self.fleet.workers[slot].fate = Fate::Finishing;
            }
        }
        self.say(
            now_ms(),
            &format!("stopping {} workers at revision {stop_at}", finishers.len()),
        );
        let deadline = now_ms() + self.hang_ms + FINISH_TIMEOUT_MS;
        while now_ms() < deadline
            && finishers
                .iter()
                .any(|&s| self.fleet.workers[s].fate != Fate::Exited)
        {
            self.pump()?;
        }
        let finals: BTreeSet<usize> = self
            .events
            .iter()
            .filter(|(_, e)| matches!(e, Event::Final { .. }))
            .map(|(slot, _)| *slot)
            .collect();
        for &slot in &finishers {
            let w = &self.fleet.workers[slot];
            let name = format!("{} (worker {slot}, pid {})", name(slot, w.peer), w.pid);
            if w.fate != Fate::Exited {
                self.hangs += 1;
                self.violation(
                    now_ms(),
                    format!(
                        "hang: {name} did not reach revision {stop_at} and exit within {:.0} s",
                        (self.hang_ms + FINISH_TIMEOUT_MS) / 1e3
                    ),
                );
            } else if !finals.contains(&slot) {
                self.violation(now_ms(), format!("{name} exited without a final state"));
            }
        }
        Ok(finishers)
    }

    /// Stops every process and judges the run.
    fn report(self, finishers: BTreeSet<usize>, seed: u64) -> Report {
        let duration_s = (now_ms() - self.t0) / 1e3;
        drop(self.fleet);
        let usage = self
            .sampler
            .usage(self.t0, self.t0 + self.args.duration_ms());
        let mut report = report::analyse(&RunLog {
            events: self.events,
            faults: self.faults,
            master_faults: self.master_faults,
            stopped: self.stopped,
            slowed: self.slowed,
            lease_ms: self.args.lease_ms as f64,
            master_windows: self.master_windows,
            initial: self.args.peers as usize,
            finishers,
            violations: self.violations,
            hangs: self.hangs,
            hang_limit_ms: self.args.lease_ms as f64 + HANG_MARGIN_MS,
            state_bytes: self.args.state_mb as f64 * (1 << 20) as f64,
            seed,
            peers: self.args.peers,
            duration_s,
            transport: self.args.transport.clone(),
            in_flight: self.args.in_flight,
            t0: self.t0,
            max_stall_ms: self.args.churn.then_some(self.args.max_stall_ms as f64),
        });
        for u in usage.iter().filter(|u| u.grew) {
            report.violations.push(format!(
                "resources: {} (pid {}) grew over the run: RSS {} -> {} MiB, {} -> {} file descriptors (allowed: 5 % and a little)",
                u.name,
                u.pid,
                u.rss_kib_start >> 10,
                u.rss_kib_end >> 10,
                u.fds_start,
                u.fds_end
            ));
        }
        report.resources = usage;
        report
    }
}

/// `peer 7`, or `worker 5` for one that has not registered.
fn name(slot: usize, peer: Option<crate::event::PeerId>) -> String {
    peer.map_or(format!("worker {slot}"), |p| format!("peer {p}"))
}
