//! The master's unit tests, as one integration test: they link the library the release
//! build made instead of compiling the master (openraft and all) a second time with
//! `cfg(test)`, which took 95 s of the test build on 2 cores. What they need of the
//! internals is public (most of it already was; the rest is `#[doc(hidden)]`). The
//! fuzzing of what a master decodes (`fuzz`) is here too: one test binary links once.

mod connection;
mod coordinator;
mod coordinator_store;
mod fuzz;
mod log_store;
mod raft;
mod registry;
mod state_machine;
mod store;
mod sync;
mod topology;
