//! The GORGO router daemon: HTTP ingress, engine adapter, forwarding, admin API, metrics.
//!
//! One node runs per region beside the region's inference engine. For each request it
//! asks the sans-IO core where the request is cheapest to serve (locally or at a peer)
//! and moves the bytes accordingly. Everything that decides lives in `gorgo-core`; this
//! crate only drives sockets and clocks.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod config;
pub mod engine;
pub mod error;
pub mod route;

pub use config::NodeConfig;
pub use error::NodeError;
