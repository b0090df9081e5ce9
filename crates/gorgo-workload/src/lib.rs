//! Trace formats, the session-based workload generator and prompt synthesis from block ids
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
