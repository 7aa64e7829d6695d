//! What the kernel knows of a TCP connection's sending: how long it had data in flight,
//! and how much of that time the TCP window (the receiver's, or our own send buffer)
//! held it back rather than the path (`TCP_INFO`'s `tcpi_busy_time`,
//! `tcpi_rwnd_limited` and `tcpi_sndbuf_limited`, Linux 4.10 and later). A connection
//! that spends most of a long send window-limited is on a path whose bandwidth-delay
//! product exceeds its window: more connections carry more.

use std::os::fd::RawFd;

/// A link's connections' sending time, summed over them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowStats {
    /// Connections counted (a link's streams).
    pub connections: u16,
    /// Microseconds with data in flight.
    pub busy_us: u64,
    /// Of those, microseconds the receive window or the send buffer held sending back.
    pub window_limited_us: u64,
    /// Segments retransmitted over the connections' lives.
    pub retransmits: u64,
    /// The largest smoothed round trip and the smallest minimum round trip among them,
    /// in microseconds (a smoothed round trip well over the minimum is a queue).
    pub rtt_us: u32,
    pub min_rtt_us: u32,
}

impl WindowStats {
    /// The share of busy time between `self` and a later snapshot `after` that the
    /// window held sending back; `None` if the connections were not busy in between.
    pub fn limited_share(&self, after: &WindowStats) -> Option<f64> {
        let busy = after.busy_us.checked_sub(self.busy_us)?;
        let limited = after
            .window_limited_us
            .checked_sub(self.window_limited_us)?;
        (busy > 0).then(|| (limited as f64 / busy as f64).min(1.0))
    }

    /// Whether the path showed congestion between `self` and a later snapshot `after`:
    /// a segment retransmitted, or a queue on the path (a smoothed round trip a quarter
    /// or more over the minimum). A connection held back neither by its window nor by a
    /// congested path is held back by its own congestion window (slow start, which an
    /// idle connection starts over): more connections carry more there too.
    pub fn congested_since(&self, after: &WindowStats) -> bool {
        after.retransmits > self.retransmits
            || u64::from(after.rtt_us) * 4 >= u64::from(after.min_rtt_us) * 5
    }
}

/// Byte offsets in `struct tcp_info` (include/uapi/linux/tcp.h) of the three counters,
/// each a `__u64` in microseconds, and the length that holds them.
const BUSY_TIME: usize = 168;
const RWND_LIMITED: usize = 176;
const SNDBUF_LIMITED: usize = 184;
const NEEDED: usize = 192;
const RTT: usize = 68;
const TOTAL_RETRANS: usize = 100;
const MIN_RTT: usize = 148;

/// The connection `fd`'s counters, or `None` where the kernel does not report them.
pub(crate) fn read(fd: RawFd) -> Option<WindowStats> {
    let mut buf = [0u8; 256];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: TCP_INFO writes at most `len` bytes into `buf`, which outlives the call,
    // and sets `len` to what it wrote; `fd` is a socket the caller's link holds open.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 || (len as usize) < NEEDED {
        return None;
    }
    let at = |off: usize| u64::from_ne_bytes(buf[off..off + 8].try_into().expect("8 bytes"));
    let at32 = |off: usize| u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4 bytes"));
    Some(WindowStats {
        connections: 1,
        busy_us: at(BUSY_TIME),
        window_limited_us: at(RWND_LIMITED).saturating_add(at(SNDBUF_LIMITED)),
        retransmits: u64::from(at32(TOTAL_RETRANS)),
        rtt_us: at32(RTT),
        min_rtt_us: at32(MIN_RTT),
    })
}

/// The counters of every connection in `fds`, summed; `None` if any is unreadable.
pub(crate) fn read_all(fds: &[RawFd]) -> Option<WindowStats> {
    if fds.is_empty() {
        return None;
    }
    fds.iter().try_fold(WindowStats::default(), |acc, &fd| {
        let s = read(fd)?;
        Some(WindowStats {
            connections: acc.connections + 1,
            busy_us: acc.busy_us + s.busy_us,
            window_limited_us: acc.window_limited_us + s.window_limited_us,
            retransmits: acc.retransmits + s.retransmits,
            rtt_us: acc.rtt_us.max(s.rtt_us),
            min_rtt_us: if acc.connections == 0 {
                s.min_rtt_us
            } else {
                acc.min_rtt_us.min(s.min_rtt_us)
            },
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    /// A connection that sent is busy for some time; one that did not is not; a
    /// descriptor that is not a TCP socket has no counters.
    #[test]
    fn a_connection_that_sent_was_busy() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let before = read(c.as_raw_fd()).expect("TCP_INFO on a TCP socket");
        assert_eq!(before.busy_us, 0, "{before:?}");
        let data = vec![7u8; 8 << 20];
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; 8 << 20];
            s.read_exact(&mut got).unwrap();
        });
        c.write_all(&data).unwrap();
        reader.join().unwrap();
        let after = read_all(&[c.as_raw_fd()]).expect("counters");
        assert_eq!(after.connections, 1);
        assert!(after.busy_us > 0, "{after:?}");
        assert!(before.limited_share(&after).is_some());
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert_eq!(read(file.as_raw_fd()), None);
    }

    #[test]
    fn the_share_is_of_the_busy_time_in_between() {
        let a = WindowStats {
            connections: 2,
            busy_us: 1000,
            window_limited_us: 100,
            ..WindowStats::default()
        };
        let b = WindowStats {
            connections: 2,
            busy_us: 3000,
            window_limited_us: 1700,
            ..WindowStats::default()
        };
        assert_eq!(a.limited_share(&b), Some(0.8));
        assert_eq!(a.limited_share(&a), None);
    }

    #[test]
    fn a_retransmit_or_a_queue_is_congestion() {
        let at = |retransmits, rtt_us, min_rtt_us| WindowStats {
            connections: 1,
            retransmits,
            rtt_us,
            min_rtt_us,
            ..WindowStats::default()
        };
        let before = at(3, 100_000, 100_000);
        assert!(!before.congested_since(&at(3, 103_000, 100_000)));
        assert!(
            before.congested_since(&at(4, 103_000, 100_000)),
            "a retransmit"
        );
        assert!(before.congested_since(&at(3, 130_000, 100_000)), "a queue");
    }
}
