//! User-space WAN emulation: UDP and TCP relays with delay, jitter, loss and rate from a topology file
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]
