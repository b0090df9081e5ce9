//! Chained block hashing: the one hashing function of GORGO.
//!
//! `h_i = xxh3(h_{i-1} || block_i)`. Because every hash folds in its predecessor, a
//! shared hash at position `i` implies an identical prefix up to and including block
//! `i`, so prefix matching is a walk along the chain, never a byte comparison.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

/// Default block size over prompt bytes: 256 bytes, about 64 tokens.
pub const DEFAULT_BLOCK_BYTES: usize = 256;

/// Default bytes-per-token estimate when no tokenizer is configured.
pub const BYTES_PER_TOKEN: usize = 4;

/// Default block size over token ids when a tokenizer is configured: 64 tokens, the
/// size of the default byte block (256 bytes at 4 bytes per token) and a multiple of
/// the engines' KV page sizes (vLLM 16, SGLang 1 to 64, llama.cpp per token), so block
/// boundaries fall on page boundaries.
pub const DEFAULT_BLOCK_TOKENS: usize = 64;

/// Seed of the chain: the "previous hash" of block 0.
pub(crate) const CHAIN_SEED: u64 = 0x6f72_676f_6772_6f67;

/// Hash arbitrary bytes. Every other hash in the project goes through here.
#[inline]
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Extend a chain by one block: `xxh3(prev || block)`.
#[inline]
pub fn chain_step(prev: u64, block: &[u8]) -> u64 {
    // One-shot xxh3 over `prev || block` in a stack buffer is several times faster than
    // the streaming hasher for the small blocks we use; both give the same hash.
    const STACK: usize = 512;
    if block.len() <= STACK - 8 {
        let mut buf = [0u8; STACK];
        buf[..8].copy_from_slice(&prev.to_le_bytes());
        buf[8..8 + block.len()].copy_from_slice(block);
        return xxh3_64(&buf[..8 + block.len()]);
    }
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    hasher.update(&prev.to_le_bytes());
    hasher.update(block);
    hasher.digest()
}

/// The 32-bit fingerprint of a chained hash, as gossiped in summaries.
#[inline]
pub fn fingerprint(hash: u64) -> u32 {
    // Fold both halves so that neither half alone decides collisions.
    ((hash >> 32) as u32) ^ (hash as u32)
}

/// A prompt as a chain of block hashes with the tokens each block holds.
///
/// Built from prompt bytes (live requests) or from trace block ids (replays and the
/// simulator); both give the same structure, so every consumer is agnostic of origin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashChain {
    /// `hashes[i]` identifies the prefix made of blocks `0..=i`.
    pub hashes: Vec<u64>,
    /// `block_tokens[i]`: tokens in block `i` (the last block may be partial).
    pub block_tokens: Vec<u32>,
}

impl HashChain {
    /// Hash prompt bytes in blocks of `block_bytes`, counting `bytes_per_token` bytes
    /// per token (the estimate used when no tokenizer is configured).
    ///
    /// A trailing partial block is included: its hash still identifies the whole prompt,
    /// and an engine caches partial pages too.
    pub fn from_bytes(bytes: &[u8], block_bytes: usize, bytes_per_token: usize) -> Self {
        let block_bytes = block_bytes.max(1);
        let bytes_per_token = bytes_per_token.max(1);
        let n = bytes.len().div_ceil(block_bytes);
        let mut hashes = Vec::with_capacity(n);
        let mut block_tokens = Vec::with_capacity(n);
        let mut prev = CHAIN_SEED;
        for block in bytes.chunks(block_bytes) {
            prev = chain_step(prev, block);
            hashes.push(prev);
            block_tokens.push(block.len().div_ceil(bytes_per_token) as u32);
        }
        HashChain {
            hashes,
            block_tokens,
        }
    }

    /// Hash a prompt's token ids in blocks of `block_tokens` ids, each block hashed as
    /// its ids' little-endian bytes (4 per id) by [`chain_step`]: the chain a node with a
    /// tokenizer builds, aligned with the engine's KV pages, and the one an engine's own
    /// block events (token ids per block) can be hashed into by the same function.
    ///
    /// A trailing partial block is included, as in [`HashChain::from_bytes`].
    pub fn from_token_ids(ids: &[u32], block_tokens: usize) -> Self {
        let block_tokens = block_tokens.max(1);
        let n = ids.len().div_ceil(block_tokens);
        let mut hashes = Vec::with_capacity(n);
        let mut counts = Vec::with_capacity(n);
        let mut bytes = Vec::with_capacity(block_tokens * 4);
        let mut prev = CHAIN_SEED;
        for block in ids.chunks(block_tokens) {
            bytes.clear();
            for id in block {
                bytes.extend_from_slice(&id.to_le_bytes());
            }
            prev = chain_step(prev, &bytes);
            hashes.push(prev);
            counts.push(block.len() as u32);
        }
        HashChain {
            hashes,
            block_tokens: counts,
        }
    }

    /// Build a chain from trace block ids (already prefix-chained by the trace), each
    /// block holding `tokens_per_block` tokens except the last, which holds what is left
    /// of `total_tokens`.
    pub fn from_block_ids<I, B>(ids: I, tokens_per_block: u32, total_tokens: u64) -> Self
    where
        I: IntoIterator<Item = B>,
        B: AsRef<[u8]>,
    {
        let mut hashes = Vec::new();
        let mut block_tokens = Vec::new();
        let mut prev = CHAIN_SEED;
        let mut left = total_tokens;
        for id in ids {
            prev = chain_step(prev, id.as_ref());
            hashes.push(prev);
            let t = left.min(tokens_per_block as u64);
            // A trace may list more blocks than its input length strictly needs; keep
            // the block (it is part of the identity) with at least one token.
            block_tokens.push(t.max(1) as u32);
            left -= t;
        }
        HashChain {
            hashes,
            block_tokens,
        }
    }

    /// Build a chain from integer block ids (Mooncake traces).
    pub fn from_int_block_ids(ids: &[u64], tokens_per_block: u32, total_tokens: u64) -> Self {
        Self::from_block_ids(
            ids.iter().map(|id| id.to_le_bytes()),
            tokens_per_block,
            total_tokens,
        )
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// True when the prompt is empty.
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Total tokens of the prompt.
    pub fn total_tokens(&self) -> u64 {
        self.block_tokens.iter().map(|&t| t as u64).sum()
    }

    /// Tokens in the first `blocks` blocks.
    pub fn prefix_tokens(&self, blocks: usize) -> u64 {
        self.block_tokens[..blocks.min(self.block_tokens.len())]
            .iter()
            .map(|&t| t as u64)
            .sum()
    }

    /// The 32-bit fingerprint of block `i`'s chained hash.
    pub fn fingerprint(&self, i: usize) -> u32 {
        fingerprint(self.hashes[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_shares_hashes_until_divergence() {
        let a = vec![b'a'; 1000];
        let mut b = a.clone();
        b[600] = b'b';
        let ca = HashChain::from_bytes(&a, 256, 4);
        let cb = HashChain::from_bytes(&b, 256, 4);
        assert_eq!(ca.len(), 4);
        assert_eq!(ca.hashes[..2], cb.hashes[..2]);
        assert_ne!(ca.hashes[2], cb.hashes[2]);
        // Divergence is sticky: every later hash differs too.
        assert_ne!(ca.hashes[3], cb.hashes[3]);
        assert_eq!(ca.total_tokens(), 250);
        assert_eq!(ca.block_tokens, vec![64, 64, 64, 58]);
    }

    #[test]
    fn one_shot_and_streaming_steps_agree() {
        let small = [7u8; 100];
        let big = vec![9u8; 2000];
        for block in [&small[..], &big[..]] {
            let mut h = xxhash_rust::xxh3::Xxh3Default::new();
            h.update(&42u64.to_le_bytes());
            h.update(block);
            assert_eq!(chain_step(42, block), h.digest());
        }
    }

    #[test]
    fn token_id_chains_share_prefixes_and_count_ids() {
        let a: Vec<u32> = (0..150).collect();
        let mut b = a.clone();
        b[140] = 7;
        let (ca, cb) = (
            HashChain::from_token_ids(&a, 64),
            HashChain::from_token_ids(&b, 64),
        );
        assert_eq!(ca.block_tokens, vec![64, 64, 22]);
        assert_eq!(ca.hashes[..2], cb.hashes[..2]);
        assert_ne!(ca.hashes[2], cb.hashes[2]);
        // Each block is its ids' little-endian bytes through the one chain step.
        let first: Vec<u8> = a[..64].iter().flat_map(|id| id.to_le_bytes()).collect();
        assert_eq!(ca.hashes[0], chain_step(CHAIN_SEED, &first));
        assert!(HashChain::from_token_ids(&[], 64).is_empty());
    }

    #[test]
    fn block_ids_give_token_counts() {
        let c = HashChain::from_int_block_ids(&[0, 1, 2], 512, 1100);
        assert_eq!(c.block_tokens, vec![512, 512, 76]);
        assert_eq!(c.total_tokens(), 1100);
        assert_eq!(c.prefix_tokens(2), 1024);
        let d = HashChain::from_int_block_ids(&[0, 1, 3], 512, 1100);
        assert_eq!(c.hashes[..2], d.hashes[..2]);
        assert_ne!(c.hashes[2], d.hashes[2]);
    }
}
