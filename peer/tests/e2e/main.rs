//! The peer's end-to-end tests against real masters (one binary: each test file is a
//! module, so the tests link once). Each module says what it covers.

#[path = "../common/mod.rs"]
mod common;
#[path = "../masters/mod.rs"]
mod masters;

mod all_to_all_v;
mod bad_input;
mod cli;
mod device;
mod elastic;
mod failover;
mod lists;
mod master_cluster;
mod p2p;
mod quantized;
mod reconfigure;
mod security;
mod store;
mod topology;
