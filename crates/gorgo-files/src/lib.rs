//! The workspace's two file helpers, in one crate every other may use (it depends on
//! nothing of the workspace): a read with a size cap, for the files an operator names
//! (a tokenizer, learned weights, configs, profiles, certificates), and a replacement
//! that is whole or nothing, for the files a crash must not leave half written
//! (reports, sweeps, learned weights, `pids.json`). `gorgo-core` does no IO, so they
//! cannot live there.

mod atomic;
mod read;

pub use atomic::{remove_stale, stage, write_atomic, AtomicFile};
pub use read::{read_capped, read_capped_bytes, MAX_CONFIG_FILE_BYTES};
