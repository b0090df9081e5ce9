//! Discrete-event simulator on virtual time: engines, network, gossip staleness, policies and tuning
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
