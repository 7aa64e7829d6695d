//! `eccl-bench delay-link NS_A TUN_A NS_B TUN_B --delay-ms D`: a point-to-point link with
//! a propagation delay, for the network lab where the kernel's netem (and fq, for
//! timestamped departures) is not available. Each namespace has a TUN device (made by
//! the lab with `ip tuntap add`); what one side's kernel sends into its TUN device is
//! read here and written into the other side's after `D/2` ms, so TCP between the two
//! sees a round trip of `D` ms and its window, not the rate, may bound one connection,
//! as on a long fat path. Rates stay the lab's `tc` shaping on the TUN devices. Runs
//! until killed.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: eccl-bench delay-link NS_A TUN_A NS_B TUN_B --delay-ms D";

pub fn main(argv: &[String]) -> ExitCode {
    let (Some(ns_a), Some(tun_a), Some(ns_b), Some(tun_b)) =
        (argv.first(), argv.get(1), argv.get(2), argv.get(3))
    else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let delay_ms = match argv.get(4..6) {
        Some([flag, v]) if flag == "--delay-ms" => match v.parse::<f64>() {
            Ok(d) if d >= 0.0 && d.is_finite() => d,
            _ => {
                eprintln!("eccl-bench delay-link: --delay-ms takes milliseconds, not {v:?}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let open = |ns: &str, dev: &str| {
        open_tun_in(ns, dev).map_err(|e| format!("cannot open TUN device {dev} in {ns}: {e}"))
    };
    let (a, b) = match (open(ns_a, tun_a), open(ns_b, tun_b)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("eccl-bench delay-link: {e}");
            return ExitCode::FAILURE;
        }
    };
    let one_way = Duration::from_secs_f64(delay_ms / 2e3);
    let (a2, b2) = match (a.try_clone(), b.try_clone()) {
        (Ok(a2), Ok(b2)) => (a2, b2),
        _ => {
            eprintln!("eccl-bench delay-link: cannot duplicate the TUN descriptors");
            return ExitCode::FAILURE;
        }
    };
    println!("delay-link: {ns_a}/{tun_a} <-> {ns_b}/{tun_b}, {delay_ms} ms round trip");
    let forward = std::thread::spawn(move || relay(a, b2, one_way));
    let back = std::thread::spawn(move || relay(b, a2, one_way));
    let _ = forward.join();
    let _ = back.join();
    ExitCode::FAILURE
}

/// Moves packets read from `from` into `to`, each `delay` after it was read, in order.
fn relay(mut from: File, mut to: File, delay: Duration) {
    let queue: Arc<(Mutex<VecDeque<(Instant, Vec<u8>)>>, Condvar)> = Arc::default();
    let q = queue.clone();
    std::thread::spawn(move || loop {
        let (due, pkt) = {
            let (lock, cv) = &*q;
            let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(p) = g.pop_front() {
                    break p;
                }
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        // A packet the other side cannot take now is dropped, as a router would.
        let _ = to.write(&pkt);
    });
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match from.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let (lock, cv) = &*queue;
        lock.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((Instant::now() + delay, buf[..n].to_vec()));
        cv.notify_one();
    }
}

/// Opens the persistent TUN device `dev` of network namespace `ns` (as `ip netns`
/// names it), from this thread, which goes back to its own namespace afterwards.
fn open_tun_in(ns: &str, dev: &str) -> std::io::Result<File> {
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    if dev.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::other("device name too long"));
    }
    let own = File::open("/proc/thread-self/ns/net")?;
    let theirs = File::open(format!("/var/run/netns/{ns}"))?;
    let enter = |f: &File| {
        // SAFETY: setns on a namespace file descriptor we hold open; it changes only
        // this thread's network namespace.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    enter(&theirs)?;
    let opened = (|| {
        let tun = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        #[repr(C)]
        struct IfReq {
            name: [u8; libc::IFNAMSIZ],
            flags: libc::c_short,
            _pad: [u8; 22],
        }
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..dev.len()].copy_from_slice(dev.as_bytes());
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `IfReq` lays out
        // (16-byte name, flags, padding to the union's 24 bytes); `req` outlives the call.
        if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &mut req) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(tun)
    })();
    enter(&own)?;
    opened
}
