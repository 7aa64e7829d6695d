//! `eccl-bench probe memcpy|quic -b SIZE [-n ITERS] [--nstreams N]`: the baselines that
//! transport figures are judged against, measured on the same machine in the same run.
//!
//! - `memcpy`: one core copying SIZE bytes (`copy_from_slice`), best of `-n`: the bound
//!   a shared-memory hop can approach.
//! - `quic`: one quinn connection between two processes, configured as eccl's own
//!   (`eccl_transport::quic`: same windows, socket buffers, packet size and stream
//!   count), moving SIZE bytes one way per iteration; the receiver acknowledges each.
//!   With `--both`, both ends send SIZE at once, as the link of a two-rank all_reduce
//!   is used; the figure is then per direction.
//!
//! - `reduce`: the reduction kernel `dst = dst ⊕ src` over SIZE bytes on one core, for
//!   every dtype and operator eccl defines (or those `-d`/`-o` name), best of `-n`; a
//!   kernel that keeps up with memcpy moves three buffers' worth of memory (read two,
//!   write one) per pass against memcpy's two.
//!
//! - `cuda`: the device layer on a GPU (`cuda_probe.rs`): every kernel against the CPU,
//!   and the GPU's copy and reduction rates.
//!
//! Prints one line `probe <what> bytes <SIZE> gbps <best> median <median>` per size
//! (`probe reduce <dtype> <op> ...` per kernel; gbps counts SIZE bytes of `dst`).

use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use eccl::config::parse_size;
use eccl_transport::quic;
use tokio::io::{AsyncBufReadExt, BufReader};

struct Opts {
    bytes: usize,
    /// `reduce`: the dtypes and operators to time (all when empty).
    dtypes: Vec<eccl::DType>,
    ops: Vec<eccl::ReduceOp>,
    iters: usize,
    nstreams: usize,
    /// Both ends send at once (as an all_reduce of two ranks uses a link).
    both: bool,
    /// `cuda`: the GPU's ordinal.
    device: usize,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        bytes: 64 << 20,
        dtypes: Vec::new(),
        ops: Vec::new(),
        iters: 5,
        nstreams: std::env::var("ECCL_NSTREAMS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
        both: false,
        device: 0,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "-b" | "-e" => o.bytes = parse_size(&val()?).ok_or("-b takes a size")?,
            "-n" => o.iters = val()?.parse().map_err(|_| "-n takes a number")?,
            "--nstreams" => o.nstreams = val()?.parse().map_err(|_| "--nstreams takes a number")?,
            "--both" => o.both = true,
            "--device" => o.device = val()?.parse().map_err(|_| "--device takes a GPU number")?,
            "-d" => {
                for d in val()?.split(',') {
                    o.dtypes
                        .push(eccl::DType::parse(d).ok_or(format!("unknown dtype {d}"))?);
                }
            }
            "-o" => {
                for op in val()?.split(',') {
                    o.ops
                        .push(eccl::ReduceOp::parse(op).ok_or(format!("unknown op {op}"))?);
                }
            }
            other => return Err(format!("unknown probe flag {other}")),
        }
    }
    if o.iters == 0 || o.nstreams == 0 || o.nstreams > 64 {
        return Err("-n and --nstreams must be positive (streams at most 64)".into());
    }
    Ok(o)
}

fn report(what: &str, bytes: usize, mut secs: Vec<f64>) {
    secs.sort_by(f64::total_cmp);
    let gbps = |s: f64| bytes as f64 / s / 1e9;
    println!(
        "probe {what} bytes {bytes} gbps {:.3} median {:.3}",
        gbps(secs[0]),
        gbps(secs[secs.len() / 2])
    );
}

/// Entry point: `args` follow the word `probe`.
pub fn main(args: &[String]) -> ExitCode {
    let Some((what, rest)) = args.split_first() else {
        eprintln!(
            "usage: eccl-bench probe memcpy|quic|reduce|cuda -b SIZE [-n ITERS] [--nstreams N] [-d TYPES] [-o OPS] [--device N]"
        );
        return ExitCode::from(2);
    };
    let opts = match parse(rest) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("eccl-bench probe: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("eccl-bench probe: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = match what.as_str() {
        "memcpy" => {
            memcpy(&opts);
            Ok(())
        }
        "reduce" => {
            reduce(&opts);
            Ok(())
        }
        "cuda" => crate::cuda_probe::run(opts.bytes, opts.iters, opts.device),
        "quic" => rt.block_on(quic_send(&opts)),
        "quic-sink" => rt.block_on(quic_sink(&opts)),
        other => Err(format!(
            "unknown probe {other:?}: memcpy, quic, reduce or cuda"
        )),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("eccl-bench probe: {e}");
            ExitCode::FAILURE
        }
    }
}

fn memcpy(o: &Opts) {
    let src = vec![1u8; o.bytes];
    let mut dst = vec![0u8; o.bytes];
    dst.copy_from_slice(&src); // touch every page before timing
    let secs = (0..o.iters.max(5))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    report("memcpy", o.bytes, secs);
}

fn reduce(o: &Opts) {
    // The peer's choice is per world; here the variable alone decides (1 without it).
    let threads = std::env::var("ECCL_REDUCE_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(1);
    eccl_algorithms::kernels::set_threads(threads);
    println!("# reductions on {threads} thread(s) (ECCL_REDUCE_THREADS)");
    let dtypes = if o.dtypes.is_empty() {
        eccl::DType::ALL.to_vec()
    } else {
        o.dtypes.clone()
    };
    let ops = if o.ops.is_empty() {
        eccl::ReduceOp::ALL.to_vec()
    } else {
        o.ops.clone()
    };
    // Ones everywhere: every dtype's sum, product, min and max stay finite.
    let ones = |d: eccl::DType| -> Vec<u8> {
        let one: Vec<u8> = match d {
            eccl::DType::F32 => 1f32.to_le_bytes().to_vec(),
            eccl::DType::F64 => 1f64.to_le_bytes().to_vec(),
            eccl::DType::F16 => half::f16::ONE.to_le_bytes().to_vec(),
            eccl::DType::BF16 => half::bf16::ONE.to_le_bytes().to_vec(),
            eccl::DType::I8 | eccl::DType::U8 => vec![1],
            eccl::DType::I32 => 1i32.to_le_bytes().to_vec(),
            eccl::DType::I64 => 1i64.to_le_bytes().to_vec(),
        };
        one.iter()
            .copied()
            .cycle()
            .take(o.bytes / d.size() * d.size())
            .collect()
    };
    for &d in &dtypes {
        let src = ones(d);
        let mut dst = src.clone();
        for &op in ops.iter().filter(|op| op.valid_for(d)) {
            let secs = (0..o.iters.max(5))
                .map(|_| {
                    let t = Instant::now();
                    eccl_algorithms::kernels::reduce_inplace(
                        d,
                        op,
                        &mut dst,
                        std::hint::black_box(&src),
                    );
                    std::hint::black_box(&dst);
                    t.elapsed().as_secs_f64()
                })
                .collect();
            report(&format!("reduce {d} {op}"), dst.len(), secs);
        }
    }
}

/// The sending side: starts the sink in a child process, connects, and times each
/// iteration until the sink acknowledges it.
async fn quic_send(o: &Opts) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["probe", "quic-sink", "-b", &o.bytes.to_string(), "-n"])
        .arg(o.iters.to_string())
        .args(["--nstreams", &o.nstreams.to_string()])
        .args(if o.both { &["--both"][..] } else { &[][..] })
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the sink: {e}"))?;
    let result = async {
        let out = child.stdout.take().ok_or("no sink output")?;
        let mut lines =
            BufReader::new(tokio::process::ChildStdout::from_std(out).map_err(|e| e.to_string())?)
                .lines();
        let line = lines
            .next_line()
            .await
            .map_err(|e| e.to_string())?
            .ok_or("the sink said nothing")?;
        let addr: SocketAddr = line
            .strip_prefix("sink ")
            .and_then(|a| a.parse().ok())
            .ok_or(format!("bad sink line {line:?}"))?;
        let ep =
            quic::endpoint("127.0.0.1:0".parse().expect("literal")).map_err(|e| e.to_string())?;
        let conn = ep
            .connect_with(
                quic::client_config("sink").map_err(|e| e.to_string())?,
                addr,
                "eccl",
            )
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        let mut streams = Vec::new();
        for _ in 0..o.nstreams {
            streams.push(conn.open_bi().await.map_err(|e| e.to_string())?);
        }
        let data = vec![7u8; o.bytes];
        let mut inbox: Vec<Vec<u8>> = parts(o).iter().map(|n| vec![0u8; *n]).collect();
        let mut secs = Vec::new();
        for _ in 0..o.iters + 1 {
            let t = Instant::now();
            exchange(&mut streams, &data, &mut inbox, true, o.both).await?;
            let mut ack = [0u8; 1];
            streams[0]
                .1
                .read_exact(&mut ack)
                .await
                .map_err(|e| e.to_string())?;
            secs.push(t.elapsed().as_secs_f64());
        }
        secs.remove(0); // the first one warms the path up (MTU discovery, windows)
        report(if o.both { "quic-both" } else { "quic" }, o.bytes, secs);
        conn.close(0u32.into(), b"done");
        Ok::<(), String>(())
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// The receiving side: prints its address, reads each iteration's bytes from every
/// stream and acknowledges on the first.
async fn quic_sink(o: &Opts) -> Result<(), String> {
    let ep = quic::endpoint("127.0.0.1:0".parse().expect("literal")).map_err(|e| e.to_string())?;
    let addr = ep.local_addr().map_err(|e| e.to_string())?;
    println!("sink {addr}");
    let incoming = ep.accept().await.ok_or("the endpoint closed")?;
    let conn = incoming.await.map_err(|e| e.to_string())?;
    // The probe has no eccl handshake: grant what an authenticated link gets.
    quic::authenticated(&conn, o.nstreams as u16);
    let mut streams = Vec::new();
    for _ in 0..o.nstreams {
        let (w, r) = conn.accept_bi().await.map_err(|e| e.to_string())?;
        streams.push((w, r));
    }
    let data = vec![9u8; o.bytes];
    let mut inbox: Vec<Vec<u8>> = parts(o).iter().map(|n| vec![0u8; *n]).collect();
    for _ in 0..o.iters + 1 {
        exchange(&mut streams, &data, &mut inbox, o.both, true).await?;
        streams[0]
            .0
            .write_all(&[1])
            .await
            .map_err(|e| e.to_string())?;
    }
    let _ = conn.closed().await;
    Ok(())
}

/// How SIZE bytes are dealt across the streams.
fn parts(o: &Opts) -> Vec<usize> {
    let part = o.bytes.div_ceil(o.nstreams);
    (0..o.nstreams)
        .map(|i| part.min(o.bytes.saturating_sub(i * part)))
        .collect()
}

/// One iteration on every stream (`(send, recv)` halves at both ends): write this
/// side's part if it `sends`, read the other's if it `receives`.
async fn exchange(
    streams: &mut [(quic::SendStream, quic::RecvStream)],
    data: &[u8],
    inbox: &mut [Vec<u8>],
    sends: bool,
    receives: bool,
) -> Result<(), String> {
    let part = inbox.first().map_or(1, Vec::len).max(1);
    let work = streams
        .iter_mut()
        .zip(data.chunks(part))
        .zip(inbox.iter_mut())
        .map(|(((w, r), chunk), b)| async move {
            let write = async {
                if sends {
                    w.write_all(chunk).await.map_err(|e| e.to_string())?;
                }
                Ok::<(), String>(())
            };
            let read = async {
                if receives {
                    r.read_exact(b).await.map_err(|e| e.to_string())?;
                }
                Ok::<(), String>(())
            };
            tokio::try_join!(write, read).map(|_| ())
        });
    futures::future::try_join_all(work).await.map(|_| ())
}
