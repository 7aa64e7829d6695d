//! Links of every transport end to end, in one test binary: round trips, limits and
//! refusals (`transports`, the verbs ones with `--features verbs`), and a proxy that
//! flips bits on the wire (`tamper`).

#[path = "../common/mod.rs"]
mod common;

mod tamper;
mod transports;
