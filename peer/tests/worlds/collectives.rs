//! Every collective over real processes and real TCP, checked element by element
//! against closed-form results by `eccl-bench -c`, for world sizes 1 to 8, every dtype
//! class and every operator.

use std::time::Duration;

use crate::common::*;

/// Runs `eccl-bench` with `n` ranks and returns rank 0's table once every rank exited 0
/// and the table says no element was wrong.
fn check(master: &Master, n: u32, args: &[&str], env: &[(&str, &str)]) -> String {
    let res = run_bench(&master.addr, n, args, env, Duration::from_secs(60));
    let failed: Vec<String> = res
        .iter()
        .enumerate()
        .filter(|(_, (code, _))| *code != Some(0))
        .map(|(r, (code, out))| format!("--- rank {r} exited {code:?}:\n{out}"))
        .collect();
    assert!(
        failed.is_empty(),
        "n={n} {args:?} {env:?}:\n{}",
        failed.join("\n")
    );
    let table = &res[0].1;
    assert!(
        table.contains("Out of bounds values : 0 OK"),
        "n={n} {args:?}:\n{table}"
    );
    table.clone()
}

/// Sizes 4 B .. 48 KiB by 7x: counts 1, 7, 49, 343, 2401 (and 0 where split by rank).
const SMALL: [&str; 6] = ["-b", "4", "-e", "48K", "-f", "7"];

/// Every (dtype, op) pair that is defined (`-d all -o all`) in one world per size and
/// collective: the pairs run one after another over the same links, as a training job's
/// calls do, so a world is started 12 times rather than once per pair.
#[test]
fn reductions_every_dtype_and_op() {
    let m = start_master(&[]);
    for n in [1u32, 2, 3, 5] {
        for coll in ["all_reduce", "reduce", "reduce_scatter"] {
            let root = if n > 1 { "1" } else { "0" };
            let mut a = vec![
                coll, "-c", "-n", "1", "-w", "0", "-d", "all", "-o", "all", "-r", root,
            ];
            a.extend(SMALL);
            let table = check(&m, n, &a, &[]);
            // Every pair the tables define ran, at each of SMALL's 5 sizes.
            for d in eccl::DType::ALL {
                for o in eccl::ReduceOp::ALL.into_iter().filter(|o| o.valid_for(d)) {
                    let rows = table
                        .lines()
                        .filter(|l| {
                            let cols: Vec<&str> = l.split_whitespace().collect();
                            cols.get(2) == Some(&d.nccl_name()) && cols.get(3) == Some(&o.name())
                        })
                        .count();
                    assert_eq!(rows, 5, "n={n} {coll} {d} {o}:\n{table}");
                }
            }
        }
    }
}

#[test]
fn data_movement_collectives() {
    let m = start_master(&[]);
    for n in [1u32, 2, 3, 4, 7] {
        for coll in [
            "broadcast",
            "all_gather",
            "all_to_all",
            "gather",
            "scatter",
            "barrier",
        ] {
            let root = (n - 1).to_string();
            let mut a = vec![
                coll,
                "-c",
                "-n",
                "1",
                "-w",
                "0",
                "-d",
                "float,int8,bfloat16,int64",
                "-r",
                &root,
            ];
            a.extend(SMALL);
            check(&m, n, &a, &[]);
        }
        if n % 2 == 0 {
            let mut a = vec!["sendrecv", "-c", "-n", "2", "-w", "0", "-d", "int32"];
            a.extend(SMALL);
            check(&m, n, &a, &[]);
        }
    }
}

#[test]
fn every_algorithm_large_messages_and_streams() {
    let m = start_master(&[]);
    for n in [2u32, 4, 6, 8] {
        for algo in ["ring", "direct", "tree"] {
            for coll in ["all_reduce", "broadcast", "reduce"] {
                let a = [
                    coll, "-c", "-n", "1", "-w", "0", "-b", "12", "-e", "3M", "-f", "17",
                ];
                check(&m, n, &a, &[("ECCL_ALGO", algo)]);
            }
        }
        // Several streams per link and frames smaller than a chunk.
        for coll in ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"] {
            let a = [
                coll,
                "-c",
                "-n",
                "2",
                "-w",
                "0",
                "-b",
                "1M",
                "-e",
                "5M",
                "-f",
                "5",
                "--inplace",
            ];
            check(
                &m,
                n,
                &a,
                &[("ECCL_NSTREAMS", "3"), ("ECCL_BUFFSIZE", "64K")],
            );
        }
    }
}
