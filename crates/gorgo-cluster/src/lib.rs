//! Cluster layer: QUIC transport with mutual TLS, foca SWIM membership, gossip of summaries and queue stats
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
