//! What a verbs work completion's status means, as a link failure. Pure Rust (the codes
//! are `enum ibv_wc_status` of rdma-core's `verbs.h`, stable since its first release), so
//! it is built and tested everywhere, with or without the `verbs` feature or a device.

use crate::TransportError;

/// `IBV_WC_SUCCESS`.
pub const WC_SUCCESS: u32 = 0;
/// `IBV_WC_WR_FLUSH_ERR`: the queue pair went to the error state; every outstanding work
/// request completes with this after the first real error.
pub const WC_WR_FLUSH_ERR: u32 = 5;

/// rdma-core's name for a completion status and what it means for the link.
pub fn describe(status: u32) -> (&'static str, &'static str) {
    match status {
        0 => ("IBV_WC_SUCCESS", "success"),
        1 => (
            "IBV_WC_LOC_LEN_ERR",
            "a message longer than the receive buffer",
        ),
        2 => (
            "IBV_WC_LOC_QP_OP_ERR",
            "an internal queue pair consistency error",
        ),
        3 => ("IBV_WC_LOC_EEC_OP_ERR", "an internal EE context error"),
        4 => (
            "IBV_WC_LOC_PROT_ERR",
            "a local buffer outside its memory region",
        ),
        5 => (
            "IBV_WC_WR_FLUSH_ERR",
            "flushed: the queue pair had already failed",
        ),
        6 => ("IBV_WC_MW_BIND_ERR", "a memory window bind failed"),
        7 => (
            "IBV_WC_BAD_RESP_ERR",
            "an unexpected transport response from the peer",
        ),
        8 => (
            "IBV_WC_LOC_ACCESS_ERR",
            "a local protection error on an incoming write",
        ),
        9 => (
            "IBV_WC_REM_INV_REQ_ERR",
            "the peer found the request invalid",
        ),
        10 => (
            "IBV_WC_REM_ACCESS_ERR",
            "the peer refused access to its memory",
        ),
        11 => (
            "IBV_WC_REM_OP_ERR",
            "the peer could not complete the operation",
        ),
        12 => (
            "IBV_WC_RETRY_EXC_ERR",
            "transport retries exhausted: the peer is gone or unreachable",
        ),
        13 => (
            "IBV_WC_RNR_RETRY_EXC_ERR",
            "receiver-not-ready retries exhausted: the peer stopped posting receives",
        ),
        14 => (
            "IBV_WC_LOC_RDD_VIOL_ERR",
            "a reliable datagram domain violation",
        ),
        15 => (
            "IBV_WC_REM_INV_RD_REQ_ERR",
            "an invalid reliable datagram request",
        ),
        16 => ("IBV_WC_REM_ABORT_ERR", "the peer aborted the operation"),
        17 => ("IBV_WC_INV_EECN_ERR", "an invalid EE context number"),
        18 => ("IBV_WC_INV_EEC_STATE_ERR", "an invalid EE context state"),
        19 => ("IBV_WC_FATAL_ERR", "a fatal error of the device"),
        20 => ("IBV_WC_RESP_TIMEOUT_ERR", "the response timed out"),
        21 => ("IBV_WC_GENERAL_ERR", "a general error of the device"),
        22 => ("IBV_WC_TM_ERR", "a tag matching error"),
        23 => (
            "IBV_WC_TM_RNDV_INCOMPLETE",
            "a tag matching rendezvous did not complete",
        ),
        _ => ("unknown status", "a status this build does not know"),
    }
}

/// The link failure a completion with `status` (not success) stands for: the executor
/// sees it as any other failed link and aborts the epoch.
pub fn completion_failure(peer: &str, status: u32, vendor_err: u32, what: &str) -> TransportError {
    let (name, meaning) = describe(status);
    TransportError::Verbs {
        peer: peer.to_string(),
        reason: format!(
            "{what} completed with {name} ({status}: {meaning}; vendor error {vendor_err:#x})"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_has_a_name_and_unknown_ones_say_so() {
        for s in 0..=23 {
            let (name, meaning) = describe(s);
            assert!(name.starts_with("IBV_WC_"), "{s}: {name}");
            assert!(!meaning.is_empty());
        }
        assert_eq!(describe(24).0, "unknown status");
        assert_eq!(describe(WC_WR_FLUSH_ERR).0, "IBV_WC_WR_FLUSH_ERR");
        assert_eq!(describe(WC_SUCCESS).0, "IBV_WC_SUCCESS");
    }

    #[test]
    fn a_failed_completion_is_a_link_failure_naming_peer_and_cause() {
        let e = completion_failure("peer 3 (10.0.0.2:4000)", 12, 0x81, "send of frame 7");
        let text = e.to_string();
        assert!(matches!(e, TransportError::Verbs { .. }));
        assert!(text.contains("peer 3 (10.0.0.2:4000)"), "{text}");
        assert!(text.contains("IBV_WC_RETRY_EXC_ERR"), "{text}");
        assert!(text.contains("gone or unreachable"), "{text}");
        assert!(text.contains("0x81"), "{text}");
        assert!(text.contains("send of frame 7"), "{text}");
    }
}
