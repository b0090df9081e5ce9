//! The GORGO router daemon: HTTP ingress, engine adapter, forwarding, admin API, metrics
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
