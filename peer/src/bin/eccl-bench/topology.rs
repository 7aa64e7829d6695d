//! `eccl-bench --show-topology`: `optimize_topology()` before the benchmark, and on rank 0
//! the measured matrix, the solved ring with its bottleneck, the striped links, and
//! whether the world keeps to the ring.

use eccl::{Communicator, ReduceOp};

/// `--show-topology`: measures, has the ring solved, gathers every rank's measurements
/// (an all_reduce of a matrix each rank fills its row of) and prints them on rank 0.
pub async fn show_topology(
    comm: &mut Communicator,
    rank: usize,
    n: usize,
    show: bool,
) -> eccl::Result<()> {
    let t = comm.optimize_topology().await?;
    let mut m = vec![0i64; n * n * 2];
    for (to, l) in &t.links {
        let at = (rank * n + to.idx()) * 2;
        m[at] = l.bytes_per_s as i64;
        m[at + 1] = l.latency_ns as i64;
    }
    comm.all_reduce(&mut m, ReduceOp::Sum).await?;
    if !show {
        return Ok(());
    }
    let bw = |i: usize, j: usize| m[(i * n + j) * 2] as f64;
    let lat = |i: usize, j: usize| m[(i * n + j) * 2 + 1] as f64 / 1e3;
    println!(
        "# topology at epoch {}: measured links, GB/s and us one way (row: from, column: to)",
        t.epoch
    );
    print!("# {:>6}", "");
    for j in 0..n {
        print!(" {:>15}", format!("to {j}"));
    }
    println!();
    for i in 0..n {
        print!("# {:>6}", format!("from {i}"));
        for j in 0..n {
            if i == j {
                print!(" {:>15}", "-");
            } else {
                print!(
                    " {:>15}",
                    format!("{:.3} / {:.0}", bw(i, j) / 1e9, lat(i, j))
                );
            }
        }
        println!();
    }
    let rank_order: Vec<usize> = (0..n).collect();
    let ring: Vec<usize> = if t.ring.is_empty() {
        rank_order.clone()
    } else {
        t.ring.iter().map(|&r| r as usize).collect()
    };
    // A ring step ends when its slowest link is done: the ring's bandwidth is its
    // slowest link's.
    let slowest = |order: &[usize]| {
        (0..order.len())
            .map(|k| (order[k], order[(k + 1) % order.len()]))
            .min_by(|a, b| bw(a.0, a.1).total_cmp(&bw(b.0, b.1)))
            .expect("two ranks or more")
    };
    let (a, b) = slowest(&ring);
    let (c, d) = slowest(&rank_order);
    println!(
        "# ring {:?}: bottleneck {a}->{b} at {:.3} GB/s (rank order {c}->{d} at {:.3} GB/s: {:.2}x)",
        ring,
        bw(a, b) / 1e9,
        bw(c, d) / 1e9,
        bw(a, b) / bw(c, d).max(1.0)
    );
    if let Some(w) = comm.world() {
        for &(x, y, k) in &w.stripes {
            if let (Some(rx), Some(ry)) = (w.rank_of(x), w.rank_of(y)) {
                let (a, b) = (rx.min(ry), rx.max(ry));
                println!(
                    "# striped: rank {a} <-> rank {b} over {k} connections (one was held back by its windows)"
                );
            }
        }
        if !w.tuned.is_empty() {
            println!(
                "# algorithms from the measured links: {}",
                eccl_algorithms::model::describe(&w.tuned)
            );
        }
    }
    Ok(())
}
