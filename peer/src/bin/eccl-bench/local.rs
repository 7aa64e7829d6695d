//! `eccl-bench --local N`: starts an eccl-master and N peer processes on this host, waits
//! for them, and stops every one of them (by PID) whatever happens.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// Kills and reaps the processes it holds when dropped, also on early returns.
struct Reaper(Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in self.0.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `--local N`: an embedded master and N peer processes of this binary, each given the
/// same arguments; rank 0 prints the table and writes `--json` and `--plot`.
pub fn run(n: u32) -> ExitCode {
    if n == 0 || n as usize > eccl::MAX_WORLD_SIZE {
        eprintln!(
            "eccl-bench: --local needs between 1 and {} peers",
            eccl::MAX_WORLD_SIZE
        );
        return ExitCode::from(2);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("eccl-bench: cannot find myself: {e}");
            return ExitCode::FAILURE;
        }
    };
    let master_bin = std::env::var_os("ECCL_MASTER_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| exe.with_file_name("eccl-master"));
    // One fresh secret per run, handed to the children only through their environment.
    let secret = {
        use rand::RngCore;
        let mut b = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut b);
        hex::encode(b)
    };
    let mut master = match Command::new(&master_bin)
        .args(["--listen", "127.0.0.1:0"])
        .env("ECCL_SECRET", &secret)
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(m) => m,
        Err(e) => {
            eprintln!("eccl-bench: cannot start {}: {e} (build it with `cargo build --release`, or set ECCL_MASTER_BIN)", master_bin.display());
            return ExitCode::FAILURE;
        }
    };
    let line = master
        .stdout
        .take()
        .and_then(|out| BufReader::new(out).lines().next())
        .and_then(Result::ok);
    let mut reaper = Reaper(vec![master]);
    let Some(addr) = line
        .as_deref()
        .and_then(|l| l.strip_prefix("eccl-master listening on "))
        .and_then(|l| l.split_whitespace().next())
    else {
        eprintln!("eccl-bench: the embedded master did not start (said {line:?})");
        return ExitCode::FAILURE;
    };
    let mut passthrough: Vec<String> = std::env::args().skip(1).collect();
    // Drop `--local N` / `--local=N` from the children's arguments.
    if let Some(i) = passthrough.iter().position(|a| a == "--local") {
        passthrough.drain(i..(i + 2).min(passthrough.len()));
    }
    passthrough.retain(|a| !a.starts_with("--local="));
    let mut peers = Vec::new();
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(&passthrough)
            .args([
                "--master",
                addr,
                "--world-size",
                &n.to_string(),
                "--rank-hint",
                &r.to_string(),
            ])
            .env("ECCL_SECRET", &secret);
        if r != 0 {
            cmd.env("ECCL_BENCH_QUIET", "1");
            // Only rank 0 writes the JSON file.
            cmd.env("ECCL_BENCH_NO_JSON", "1");
        }
        match cmd.spawn() {
            Ok(c) => peers.push(c),
            Err(e) => {
                eprintln!("eccl-bench: cannot start peer {r}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut code = 0u8;
    let mut done = vec![false; peers.len()];
    let mut first_failure: Option<Instant> = None;
    while done.iter().any(|d| !d) {
        for (i, p) in peers.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            if let Ok(Some(st)) = p.try_wait() {
                done[i] = true;
                if !st.success() {
                    code = code.max(st.code().unwrap_or(1).clamp(1, 255) as u8);
                    first_failure.get_or_insert_with(Instant::now);
                }
            }
        }
        // One failed peer should not leave the others waiting out their timeouts.
        if first_failure.is_some_and(|t| t.elapsed() > Duration::from_secs(10)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    reaper.0.extend(peers);
    drop(reaper);
    ExitCode::from(code)
}
