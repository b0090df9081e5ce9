//! The inference-engine model and its OpenAI-compatible emulator server.
//!
//! [`Engine`] is a sans-IO model of an SGLang-like engine (radix prefix cache over a KV
//! token capacity, continuous batching with chunked prefill, FCFS admission), driven by
//! `step(now)`, so the emulator (real clock) and the simulator (virtual time) run the
//! same code. [`Profile`] holds the costs and limits of one GPU + model. The
//! [`server`] module drives one `Engine` behind `/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`, `/health` and `/metrics`, passing for SGLang or
//! vLLM ([`EmulatedKind`]): that engine's metric names, API defaults and error bodies.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod cache;
pub mod error;
pub mod kind;
pub mod kv_events;
pub mod metrics;
pub mod model;
pub mod openai;
pub mod profile;
pub mod server;

pub use cache::RadixCache;
pub use error::EngineError;
pub use kind::EmulatedKind;
pub use model::{CacheChange, Engine, EngineEvent, EngineRequest, EngineStats, RejectReason};
pub use profile::{Profile, Schedule};
pub use server::{serve, serve_with_kv_events, EmulatorConfig};
