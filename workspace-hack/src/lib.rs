//! Nothing to use: see this crate's Cargo.toml for why it exists.
#![no_std]
