//! The one request record every trace format reads into.

use gorgo_core::HashChain;
use serde::{Deserialize, Serialize};

/// Prefix block ids of a request's prompt, as the trace spells them.
///
/// Ids are chained by the trace producer: a shared id at position `i` implies an
/// identical prompt prefix up to block `i`, so they map one to one onto a
/// [`HashChain`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(
    untagged,
    expecting = "must be a list of block ids: all integers in [0, 2^64), or all strings"
)]
pub enum BlockIds {
    /// The trace carries no prefix information (Azure).
    #[default]
    None,
    /// Integer ids (Mooncake, the generator).
    Int(Vec<u64>),
    /// Hex-string ids (ART-Chat-2.5M).
    Hex(Vec<String>),
}

impl BlockIds {
    /// Number of blocks listed.
    pub fn len(&self) -> usize {
        match self {
            BlockIds::None => 0,
            BlockIds::Int(v) => v.len(),
            BlockIds::Hex(v) => v.len(),
        }
    }

    /// True when no block is listed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A 64-bit key for block `i`, equal across requests exactly when the ids are
    /// equal: what statistics and caches index by.
    pub fn key(&self, i: usize) -> u64 {
        match self {
            BlockIds::None => 0,
            BlockIds::Int(v) => v[i],
            BlockIds::Hex(v) => gorgo_core::hash::hash_bytes(v[i].as_bytes()),
        }
    }

    /// The bytes that identify block `i`: what [`HashChain`] and prompt synthesis
    /// hash, so both agree on block identity.
    pub fn id_bytes(&self, i: usize) -> Vec<u8> {
        match self {
            BlockIds::None => Vec::new(),
            BlockIds::Int(v) => v[i].to_le_bytes().to_vec(),
            BlockIds::Hex(v) => v[i].as_bytes().to_vec(),
        }
    }
}

/// One request of a trace, whatever format it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in ms from the trace's origin (window start or first row).
    pub timestamp_ms: u64,
    /// Prompt length in tokens.
    pub input_tokens: u64,
    /// Tokens generated (the replay's `max_tokens`).
    pub output_tokens: u32,
    /// Prefix block ids of the prompt.
    pub blocks: BlockIds,
    /// Tokens per block of `blocks` (Mooncake 512, ART-Chat 256).
    pub tokens_per_block: u32,
    /// Who sent it, when the trace says (ART `token_hash`, generator `user`).
    pub user: Option<String>,
    /// Conversation within the user, when the trace says.
    pub session: Option<String>,
    /// The region the client sits in, when the trace says.
    pub home_region: Option<String>,
    /// The trace's own request id, when it has one.
    pub request_id: Option<String>,
    /// ART-Chat's `system_prompt_hash`, kept for analysis.
    pub system_prompt_hash: Option<String>,
}

#[cfg(test)]
impl TraceRequest {
    /// A one-token request at `timestamp_ms` with no prefix, for tests of what is
    /// done to a trace's timing.
    pub(crate) fn at_ms(timestamp_ms: u64) -> Self {
        TraceRequest {
            timestamp_ms,
            input_tokens: 1,
            output_tokens: 1,
            blocks: BlockIds::None,
            tokens_per_block: 256,
            user: None,
            session: None,
            home_region: None,
            request_id: None,
            system_prompt_hash: None,
        }
    }
}

impl TraceRequest {
    /// The request's prompt as a hash chain, built from the block ids so that it equals
    /// what every other consumer (node, simulator) derives for the same ids.
    pub fn chain(&self) -> HashChain {
        match &self.blocks {
            BlockIds::None => HashChain::default(),
            BlockIds::Int(ids) => {
                HashChain::from_int_block_ids(ids, self.tokens_per_block, self.input_tokens)
            }
            BlockIds::Hex(ids) => HashChain::from_block_ids(
                ids.iter().map(|s| s.as_bytes()),
                self.tokens_per_block,
                self.input_tokens,
            ),
        }
    }
}
