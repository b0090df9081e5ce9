//! Inference-engine model (radix prefix cache, continuous batching) and its OpenAI-compatible emulator server
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
