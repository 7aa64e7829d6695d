//! `eccl-bench`: nccl-tests for eccl. One binary for every collective, nccl-tests'
//! flags, its table (time, algbw, busbw, #wrong) and its bus-bandwidth factors.
//!
//! `--local N` starts an embedded master and N peer processes on this host;
//! `--master ADDR` makes this process one peer of a job (start one per rank).

mod check;
mod cuda_probe;
mod delay;
mod device;
mod local;
mod plot;
mod probe;
mod topology;

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use eccl::config::parse_size;
use std::sync::LazyLock;

use device::{device_arg, DeviceArg, OnDevice};
use eccl::{CollArgs, CollectiveKind, Communicator, Config, DType, ReduceOp};
use plot::{Report, Row};

/// Benchmark and check an eccl collective, the way nccl-tests does.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "eccl-bench",
    version,
    after_help = "Sizes take K, M, G suffixes (powers of 1024). Example:\n  eccl-bench all_reduce --local 4 -b 1K -e 64M -f 4 -c"
)]
struct Args {
    /// all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather,
    /// scatter, sendrecv or barrier.
    collective: String,
    /// Start an embedded master and this many peer processes on this host.
    #[arg(long, conflicts_with = "master")]
    local: Option<u32>,
    /// Join the job of the master at this address (one process per rank).
    #[arg(long, env = "ECCL_MASTER")]
    master: Option<String>,
    /// With --master: wait until this many peers are present before the first world.
    #[arg(long, default_value_t = 1)]
    world_size: u32,
    /// Smallest size in bytes.
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = size)]
    minbytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = size)]
    maxbytes: usize,
    /// Multiply the size by this factor between rows.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    stepfactor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: u32,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: u32,
    /// Check every element of the result (1) or not (0); `-c` alone means 1.
    #[arg(short = 'c', long = "check", default_value_t = 0, num_args = 0..=1, default_missing_value = "1")]
    check: u8,
    #[arg(short = 'd', long = "datatype", default_value = "float", value_parser = dtypes, help = DTYPE_HELP.as_str())]
    dtypes: Picks<DType>,
    #[arg(short = 'o', long = "op", default_value = "sum", value_parser = ops, help = OP_HELP.as_str())]
    ops: Picks<ReduceOp>,
    /// Root rank of rooted collectives.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: u32,
    /// Run in place (out of place by default).
    #[arg(long)]
    inplace: bool,
    /// With --inplace, what a failed call may leave in the buffer: "unchanged" (G2: the
    /// call works in scratch and copies the result back) or "undefined" (it works in the
    /// buffer itself where its schedule allows, as NCCL does).
    #[arg(long, default_value = "unchanged", value_parser = on_abort)]
    on_abort: eccl::OnAbort,
    /// Run on device memory: `cuda` (each rank on GPU rank % devices) or `cuda:N`. For
    /// all_reduce among ranks of one host, over CUDA IPC (`--on-abort` picks the G2 mode);
    /// host memory by default.
    #[arg(long, value_parser = device_arg)]
    device: Option<DeviceArg>,
    /// all_reduce with 8-bit values on the wire: `int8` or `fp8` (f32, f16 or bf16; sum
    /// or avg).
    /// The results are not exact, so `-c` does not go with it.
    #[arg(long, value_parser = quantize_arg)]
    quantize: Option<eccl::Quantize>,
    /// Before the benchmark, measure every link and have the master solve the ring
    /// (`optimize_topology()`); print the measured matrix, the ring and its bottleneck
    /// against rank order's.
    #[arg(long)]
    show_topology: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<String>,
    /// Also draw the results (bus bandwidth and time against size, log axes) into this
    /// SVG file. `eccl-bench plot OUT.svg A.json B.json...` draws several --json results
    /// in one picture.
    #[arg(long)]
    plot: Option<String>,
    /// Rank this process asks for (set by --local for its children).
    #[arg(long, hide = true)]
    rank_hint: Option<u32>,
}

fn quantize_arg(s: &str) -> Result<eccl::Quantize, String> {
    eccl::Quantize::parse(s).ok_or_else(|| format!("{s:?} is not a quantization (int8, fp8)"))
}

fn size(s: &str) -> Result<usize, String> {
    parse_size(s).ok_or_else(|| format!("{s:?} is not a size (like 8, 64K, 128M)"))
}
/// The names `-d` and `-o` take, from eccl's tables.
fn dtype_names() -> String {
    DType::ALL.map(|d| d.nccl_name()).join(", ")
}
fn op_names() -> String {
    ReduceOp::ALL.map(|o| o.name()).join(", ")
}
static DTYPE_HELP: LazyLock<String> = LazyLock::new(|| {
    format!(
        "Element type: {}; a comma-separated list or `all` runs each in turn in one world",
        dtype_names()
    )
});
static OP_HELP: LazyLock<String> = LazyLock::new(|| {
    format!(
        "Reduction: {}; a comma-separated list or `all` runs each in turn in one world",
        op_names()
    )
});

/// What `-d` or `-o` named: a list of values, or `all` (nccl-tests' `-d all -o all`), where
/// the pairs that are not defined (avg on integers, bitwise ops on floats) are left out
/// instead of refused.
#[derive(Debug, Clone)]
struct Picks<T> {
    values: Vec<T>,
    all: bool,
}

fn picks<T: Copy>(
    s: &str,
    every: &[T],
    parse: impl Fn(&str) -> Option<T>,
    what: &str,
    names: fn() -> String,
) -> Result<Picks<T>, String> {
    if s == "all" {
        return Ok(Picks {
            values: every.to_vec(),
            all: true,
        });
    }
    let values = s
        .split(',')
        .map(|p| {
            parse(p.trim())
                .ok_or_else(|| format!("unknown {what} {p:?} (have {}, or all)", names()))
        })
        .collect::<Result<Vec<T>, String>>()?;
    Ok(Picks { values, all: false })
}
fn dtypes(s: &str) -> Result<Picks<DType>, String> {
    picks(s, &DType::ALL, DType::parse, "datatype", dtype_names)
}
fn ops(s: &str) -> Result<Picks<ReduceOp>, String> {
    picks(s, &ReduceOp::ALL, ReduceOp::parse, "op", op_names)
}

/// The (dtype, op) pairs one run measures, in the order given: every dtype with every op
/// for a reduction, every dtype alone (the first op, unused) otherwise.
fn combinations(args: &Args, kind: CollectiveKind) -> Result<Vec<(DType, ReduceOp)>, String> {
    let mut out = Vec::new();
    for &d in &args.dtypes.values {
        if !kind.reduces() {
            out.push((d, args.ops.values[0]));
            continue;
        }
        for &o in &args.ops.values {
            if o.valid_for(d) {
                out.push((d, o));
            } else if !(args.dtypes.all || args.ops.all) {
                return Err(format!("op {o} is not defined for {d} (avg needs a floating type; band, bor, bxor an integer type)"));
            }
        }
    }
    if out.is_empty() {
        return Err("no datatype and op named here go together".into());
    }
    Ok(out)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("probe") {
        eccl::logging::init();
        return probe::main(&argv[2..]);
    }
    if argv.get(1).map(String::as_str) == Some("delay-link") {
        return delay::main(&argv[2..]);
    }
    if argv.get(1).map(String::as_str) == Some("plot") {
        return plot::main(&argv[2..]);
    }
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            if e.use_stderr() {
                let msg = e.to_string();
                let first = msg.lines().next().unwrap_or("bad arguments");
                eprintln!("{first}\nUsage: eccl-bench <COLLECTIVE> (--local N | --master ADDR) [-b MIN] [-e MAX] [-f F] [-n N] [-w N] [-c] [-d TYPE] [-o OP] [-r ROOT] [--json FILE] [--plot FILE]\n       eccl-bench plot OUT.svg RESULT.json...\nFor more information, try '--help'.");
                return ExitCode::from(2);
            }
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    eccl::logging::init();
    let Some(kind) = CollectiveKind::parse(&args.collective) else {
        eprintln!("eccl-bench: unknown collective {:?} (all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather, scatter, sendrecv, barrier)", args.collective);
        return ExitCode::from(2);
    };
    if args.stepfactor < 2 && args.minbytes != args.maxbytes {
        eprintln!("eccl-bench: -f must be at least 2");
        return ExitCode::from(2);
    }
    if let Some(q) = args.quantize {
        let why = if kind != CollectiveKind::AllReduce {
            Some(format!("quantizes all_reduce only, not {kind}"))
        } else if args.device.is_some() {
            Some("runs on host memory only, not with --device".into())
        } else {
            None
        };
        if let Some(why) = why {
            eprintln!("eccl-bench: --quantize {} {why}", q.name());
            return ExitCode::from(2);
        }
    }
    if args.minbytes > args.maxbytes {
        eprintln!(
            "eccl-bench: -b {} is larger than -e {}",
            args.minbytes, args.maxbytes
        );
        return ExitCode::from(2);
    }
    let combos = match combinations(&args, kind) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("eccl-bench: {e}");
            return ExitCode::from(2);
        }
    };
    match (args.local, &args.master) {
        (Some(n), _) => local::run(n),
        (None, Some(m)) => {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("eccl-bench: cannot start runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(run_peer(&args, kind, &combos, m.clone())) {
                Ok(0) => ExitCode::SUCCESS,
                Ok(_) => ExitCode::from(3),
                Err(e) => {
                    eprintln!("eccl-bench: {e} (hint: {})", e.hint());
                    ExitCode::FAILURE
                }
            }
        }
        (None, None) => {
            eprintln!("eccl-bench: give --local N or --master ADDR");
            ExitCode::from(2)
        }
    }
}

fn busbw_factor(kind: CollectiveKind, n: f64) -> f64 {
    match kind {
        CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollectiveKind::ReduceScatter
        | CollectiveKind::AllGather
        | CollectiveKind::AllToAll
        | CollectiveKind::Gather
        | CollectiveKind::Scatter => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Element count of one call for a row of `bytes` (nccl-tests' convention: the size is
/// the whole buffer, so collectives that split it by rank count per rank).
fn count_for(kind: CollectiveKind, bytes: usize, elem: usize, n: usize) -> usize {
    let total = bytes / elem;
    match kind {
        CollectiveKind::AllGather
        | CollectiveKind::ReduceScatter
        | CollectiveKind::AllToAll
        | CollectiveKind::Gather
        | CollectiveKind::Scatter => total / n,
        CollectiveKind::Barrier => 0,
        _ => total,
    }
}

async fn run_peer(
    args: &Args,
    kind: CollectiveKind,
    combos: &[(DType, ReduceOp)],
    master: String,
) -> eccl::Result<u64> {
    let mut cfg = Config::from_env()?;
    cfg.master = master;
    cfg.rank_hint = args.rank_hint.or(cfg.rank_hint);
    cfg.min_world = args.world_size.max(cfg.min_world);
    let quiet = std::env::var_os("ECCL_BENCH_QUIET").is_some();
    let mut comm = Communicator::connect(cfg).await?;
    let topo = comm.update_topology().await?;
    let (rank, n) = (topo.rank.idx(), topo.world_size as usize);
    if args.root as usize >= n && kind.is_rooted() {
        return Err(eccl::Error::InvalidArgument(format!(
            "root {} is not a rank of the {n}-rank world",
            args.root
        )));
    }
    if kind == CollectiveKind::SendRecv && n % 2 == 1 && n > 1 {
        return Err(eccl::Error::InvalidArgument(
            "sendrecv pairs ranks 0-1, 2-3, ...: use an even world".into(),
        ));
    }
    let show = rank == 0 && !quiet;
    if args.show_topology && n > 1 {
        topology::show_topology(&mut comm, rank, n, show).await?;
    }
    let join = |f: fn(&(DType, ReduceOp)) -> &'static str| {
        let mut names: Vec<&str> = combos.iter().map(f).collect();
        names.dedup();
        names.join(",")
    };
    let (dtype_list, op_list) = (join(|c| c.0.nccl_name()), join(|c| c.1.name()));
    let json_dtypes = join(|c| c.0.name());
    if show {
        println!(
            "# eccl-bench {}: {n} ranks, dtype {dtype_list}, op {op_list}, root {}, transport {}, {}",
            kind,
            args.root,
            comm.transport_summary(),
            match (args.quantize, args.inplace, args.on_abort) {
                (Some(eccl::Quantize::Int8), ..) => "in place, int8 on the wire",
                (Some(eccl::Quantize::Fp8), ..) => "in place, fp8 on the wire",
                (None, false, _) => "out of place",
                (None, true, eccl::OnAbort::Unchanged) => "in place",
                (None, true, eccl::OnAbort::Undefined) => "in place, undefined on abort",
            }
        );
        println!(
            "# epoch {} members {:?}",
            comm.epoch(),
            comm.world().map(|w| w.peer_ids()).unwrap_or_default()
        );
        println!("#");
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}",
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
        );
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
        );
    }
    let mut device = match args.device {
        Some(_) if kind != CollectiveKind::AllReduce => {
            return Err(eccl::Error::InvalidArgument(format!(
                "--device runs all_reduce only so far, not {kind}"
            )))
        }
        Some(d) => Some(OnDevice::open(d, rank)?),
        None => None,
    };
    if show {
        if let Some(d) = &device {
            println!("# device memory: {}, GPU to GPU over CUDA IPC on one host, else a pipeline through host memory", d.describe());
        }
    }
    let mut rows = Vec::new();
    for &(dtype, op) in combos {
        let at = (rank, n);
        sweep(
            &mut comm,
            args,
            kind,
            dtype,
            op,
            at,
            show,
            &mut rows,
            device.as_mut(),
        )
        .await?;
    }
    let total_wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    if show {
        let avg = rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len().max(1) as f64;
        println!(
            "# Out of bounds values : {} {}",
            total_wrong,
            if total_wrong == 0 { "OK" } else { "WRONG" }
        );
        println!("# Avg bus bandwidth    : {avg:.3}");
    }
    if rank == 0 && std::env::var_os("ECCL_BENCH_NO_JSON").is_none() {
        let report = Report {
            collective: kind.name().into(),
            world_size: n as u32,
            dtype: json_dtypes,
            op: op_list,
            transport: comm.transport_summary(),
            quantize: args.quantize.map(|q| q.name().into()),
            label: None,
            rows,
        };
        if let Some(path) = &args.json {
            let text = serde_json::to_string_pretty(&report)
                .map_err(|e| eccl::Error::InvalidArgument(e.to_string()))?;
            std::fs::write(path, text)
                .map_err(|e| eccl::Error::InvalidArgument(format!("cannot write {path}: {e}")))?;
        }
        if let Some(path) = &args.plot {
            plot::figure(std::slice::from_ref(&report))
                .write_svg(std::path::Path::new(path))
                .map_err(|e| eccl::Error::InvalidArgument(e.to_string()))?;
        }
    }
    comm.leave().await?;
    Ok(total_wrong)
}

/// One (dtype, op) pair over every size from `-b` to `-e`: a table row each, appended to
/// `rows`, with the slowest rank's time and (with `-c`) the wrong elements of every rank.
#[allow(clippy::too_many_arguments)]
async fn sweep(
    comm: &mut Communicator,
    args: &Args,
    kind: CollectiveKind,
    dtype: DType,
    op: ReduceOp,
    (rank, n): (usize, usize),
    show: bool,
    rows: &mut Vec<Row>,
    mut device: Option<&mut OnDevice>,
) -> eccl::Result<()> {
    let elem = dtype.size();
    let mut bytes = args.minbytes.max(if kind == CollectiveKind::Barrier {
        0
    } else {
        elem
    });
    loop {
        let count = count_for(kind, bytes, elem, n);
        let call = check::Call {
            kind,
            dtype,
            op,
            root: args.root as usize,
            count,
            world: n,
            rank,
        };
        let (in_len, out_len) = if kind == CollectiveKind::SendRecv {
            (count, count)
        } else {
            eccl::buffer_lens(kind, count, n as u32, rank as u32, args.root)
        };
        let mut input = vec![0u8; in_len * elem];
        let mut output = vec![0u8; out_len * elem];
        if args.quantize.is_some() {
            check::fill_quantized_input(&call, &mut input);
        } else {
            check::fill_input(&call, &mut input);
        }
        let cargs = CollArgs {
            kind,
            dtype,
            op,
            root: eccl::Rank(args.root),
            count,
        };
        let run = Run {
            a: cargs,
            quantize: args.quantize,
            inplace: args.inplace,
            on_abort: args.on_abort,
            rank,
            n,
        };
        // What in-place calls work in: the input (sized for the output where that is
        // longer). Timed calls run in it as they find it, as nccl-tests' in-place runs do,
        // so that the time is the collective's alone; the checked call starts afresh.
        let work_len = input.len().max(output.len());
        let fresh = |work: &mut Vec<u8>| {
            work.clear();
            work.extend_from_slice(&input);
            work.resize(work_len, 0);
        };
        let mut work = Vec::new();
        fresh(&mut work);
        // --device: the buffer lives on the device; every call works in it in place.
        if let Some(d) = device.as_deref_mut() {
            d.load(&input)?;
        }
        comm.barrier().await?;
        for _ in 0..args.warmup {
            any_one(
                comm,
                device.as_deref_mut(),
                &run,
                &input,
                &mut output,
                &mut work,
            )
            .await?;
        }
        comm.barrier().await?;
        if let Some(d) = device.as_deref_mut() {
            d.reset_phases();
        }
        let t0 = Instant::now();
        for _ in 0..args.iters {
            any_one(
                comm,
                device.as_deref_mut(),
                &run,
                &input,
                &mut output,
                &mut work,
            )
            .await?;
        }
        let mut time_us = [t0.elapsed().as_secs_f64() * 1e6 / args.iters.max(1) as f64];
        if let (true, Some(d)) = (show, device.as_deref()) {
            println!("{}", d.phases_line(bytes));
        }
        // nccl-tests reports the slowest rank.
        comm.all_reduce(&mut time_us, ReduceOp::Max).await?;
        let mut wrong = [0i64];
        // A quantized call's error against the exact result (`-c`), said after its row.
        let mut quality = None;
        if args.check != 0 {
            output.iter_mut().for_each(|b| *b = 0xA5);
            fresh(&mut work);
            if let Some(d) = device.as_deref_mut() {
                d.load(&input)?;
                any_one(comm, Some(&mut *d), &run, &input, &mut output, &mut work).await?;
                d.read(&mut output)?;
            } else if one(comm, &run, &input, &mut output, &mut work).await? {
                let n = output.len().min(work.len());
                output[..n].copy_from_slice(&work[..n]);
            }
            if let Some(q) = args.quantize {
                // Within the documented bound, not exact: elements past it are wrong, and
                // so is every element of a rank whose bits differ from another's (G3).
                let (got, line) =
                    quantized_check(comm, &call, q, &output[..out_len * elem]).await?;
                wrong[0] = got;
                quality = Some(line);
            } else {
                let want = if kind == CollectiveKind::SendRecv {
                    sendrecv_expected(&call, rank, n)
                } else {
                    check::expected(&call, out_len)
                };
                wrong[0] = check::count_wrong(dtype, &output[..out_len * elem], &want) as i64;
            }
            comm.all_reduce(&mut wrong, ReduceOp::Sum).await?;
        }
        if let Some(d) = device.as_deref_mut() {
            d.release();
        }
        let t = time_us[0];
        let algbw = if t > 0.0 { bytes as f64 / t / 1e3 } else { 0.0 };
        let busbw = algbw * busbw_factor(kind, n as f64);
        let root_col: i64 = if kind.is_rooted() {
            args.root as i64
        } else {
            -1
        };
        let redop = if kind.reduces() { op.name() } else { "none" };
        if show {
            let wrong_col = if args.check != 0 {
                wrong[0].to_string()
            } else {
                "N/A".into()
            };
            println!(
                "  {:>10} {:>12} {:>8} {:>6} {:>6} {:>10.2} {:>8.3} {:>8.3} {:>6}",
                bytes,
                count,
                dtype.nccl_name(),
                redop,
                root_col,
                t,
                algbw,
                busbw,
                wrong_col
            );
            if let Some(line) = &quality {
                println!("{line}");
            }
        }
        rows.push(Row {
            dtype: dtype.name().into(),
            op: redop.into(),
            bytes,
            count,
            time_us: t,
            algbw_gbps: algbw,
            busbw_gbps: busbw,
            wrong: wrong[0] as u64,
        });
        let next = if bytes == 0 {
            1
        } else {
            bytes.saturating_mul(args.stepfactor)
        };
        if next > args.maxbytes || next == bytes {
            return Ok(());
        }
        bytes = next;
    }
}

fn on_abort(s: &str) -> Result<eccl::OnAbort, String> {
    match s {
        "unchanged" => Ok(eccl::OnAbort::Unchanged),
        "undefined" => Ok(eccl::OnAbort::Undefined),
        _ => Err(format!("{s:?}: expected unchanged or undefined")),
    }
}

/// One call as the benchmark repeats it.
struct Run {
    a: CollArgs,
    quantize: Option<eccl::Quantize>,
    inplace: bool,
    on_abort: eccl::OnAbort,
    rank: usize,
    n: usize,
}

/// Runs the collective once, on the device buffer with `--device` (which `--on-abort`
/// governs as it does in-place calls), else as [`one`] does.
async fn any_one(
    comm: &mut Communicator,
    device: Option<&mut OnDevice>,
    run: &Run,
    input: &[u8],
    output: &mut [u8],
    work: &mut [u8],
) -> eccl::Result<bool> {
    match device {
        Some(d) => d
            .all_reduce(comm, &run.a, run.on_abort == eccl::OnAbort::Unchanged)
            .map(|_| false),
        None => one(comm, run, input, output, work).await,
    }
}

/// Runs the collective once: in place in `work` (returns true) or from `input` into
/// `output`.
async fn one(
    comm: &mut Communicator,
    run: &Run,
    input: &[u8],
    output: &mut [u8],
    work: &mut [u8],
) -> eccl::Result<bool> {
    let a = run.a;
    if let Some(q) = run.quantize {
        // In place in the work buffer, as an in-place all_reduce runs.
        let w = &mut work[..input.len()];
        comm.all_reduce_quantized_bytes(a.dtype, w, a.op, q).await?;
        return Ok(true);
    }
    if a.kind == CollectiveKind::SendRecv {
        // Pairs (0,1), (2,3), ...: the even rank sends first, the odd one receives first.
        if run.n == 1 {
            output.copy_from_slice(input);
            return Ok(false);
        }
        let peer = eccl::Rank((run.rank ^ 1) as u32);
        if run.rank.is_multiple_of(2) {
            comm.send_bytes(a.dtype, input, peer, 7).await?;
            comm.recv_bytes(a.dtype, output, peer, 7).await?;
        } else {
            comm.recv_bytes(a.dtype, output, peer, 7).await?;
            comm.send_bytes(a.dtype, input, peer, 7).await?;
        }
        return Ok(false);
    }
    let inplace_kind = matches!(
        a.kind,
        CollectiveKind::AllReduce
            | CollectiveKind::Broadcast
            | CollectiveKind::Reduce
            | CollectiveKind::AllToAll
    );
    if run.inplace && inplace_kind {
        comm.collective_inplace_with(a, work, run.on_abort).await?;
        return Ok(true);
    }
    comm.collective(a, input, output).await.map(|_| false)
}

/// A quantized all_reduce's result against the exact one: this rank's elements past
/// the documented bound (all of them if its bits differ from another rank's), and a
/// line saying the world's largest error relative to the largest exact value, the
/// largest error over its bound, and whether every rank has the same bits.
async fn quantized_check(
    comm: &mut Communicator,
    call: &check::Call,
    q: eccl::Quantize,
    got: &[u8],
) -> eccl::Result<(i64, String)> {
    let (exact, bound) = check::quantized_bounds(call, q == eccl::Quantize::Fp8);
    let (mut past, mut worst_err, mut largest, mut worst_ratio) = (0i64, 0f64, 0f64, 0f64);
    for (k, (&e, &b)) in exact.iter().zip(&bound).enumerate() {
        let err = (check::get_float(call.dtype, got, k) - e).abs();
        // A NaN result is past any bound.
        if err.is_nan() || err > b {
            past += 1;
        }
        worst_err = worst_err.max(err);
        largest = largest.max(e.abs());
        worst_ratio = worst_ratio.max(err / b);
    }
    // The same bits on every rank: the largest and the smallest hash of them agree.
    let hash = got.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    }) as i64;
    let (mut hi, mut lo) = ([hash], [hash]);
    comm.all_reduce(&mut hi, ReduceOp::Max).await?;
    comm.all_reduce(&mut lo, ReduceOp::Min).await?;
    let same = hi == lo;
    if !same {
        past = exact.len() as i64;
    }
    let mut world = [worst_err / largest.max(f64::MIN_POSITIVE), worst_ratio];
    comm.all_reduce(&mut world, ReduceOp::Max).await?;
    let line = format!(
        "# {}: max relative error {:.3e} (largest error over the largest exact value), largest error over its bound {:.3}, identical on every rank: {}",
        q.name(),
        world[0],
        world[1],
        if same { "yes" } else { "no" }
    );
    Ok((past, line))
}

fn sendrecv_expected(c: &check::Call, rank: usize, n: usize) -> Vec<u8> {
    let peer = if n == 1 { rank } else { rank ^ 1 };
    let mut e = vec![0u8; c.count * c.dtype.size()];
    for i in 0..c.count {
        check::put(
            c.dtype,
            &mut e,
            i,
            check::input_value(c.kind, c.op, peer, i),
        );
    }
    e
}
