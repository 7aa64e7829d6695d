//! Every collective over real `eccl-bench` processes, checked element by element: over
//! TCP for every dtype, op, algorithm and world size (`collectives`), and over every
//! transport (`transports`). Apart from the e2e binary, so that these process-heavy
//! worlds do not run beside its timing checks.

#[path = "../common/mod.rs"]
mod common;

mod collectives;
mod transports;
