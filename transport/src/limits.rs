//! Process limits that a server of many connections needs raised.

/// Raises this process's soft limit on open files to its hard limit, as Go's runtime does
/// at start: a master holds a connection per peer (and a load generator one per
/// simulated peer), and the usual soft limit of 1,024 would refuse the 1,021st. Returns
/// the soft limit before and after, or `None` where it could not be read or raised (the
/// process goes on with what it has).
pub fn raise_open_files() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    let old = lim.rlim_cur;
    if old >= lim.rlim_max {
        return Some((old, old));
    }
    // An unlimited hard limit is not a valid soft one for open files (Linux caps it at
    // fs.nr_open): then a million, the kernel's default cap.
    for want in [lim.rlim_max, lim.rlim_max.min(1 << 20)] {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads `raised`; raising a soft limit up to the hard one needs
        // no privilege.
        if want > old && unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            tracing::info!(target: "eccl::init", "open-files limit raised from {old} to {want}");
            return Some((old, want));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_limit_ends_at_the_hard_one() {
        let (before, after) = super::raise_open_files().expect("readable here");
        assert!(after >= before);
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into `lim`.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(lim.rlim_cur, after);
        assert!(lim.rlim_cur == lim.rlim_max || lim.rlim_cur == 1 << 20);
    }
}
