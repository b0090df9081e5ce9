//! Live replay client, metrics, reports and policy comparison
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
