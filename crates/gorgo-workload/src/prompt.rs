//! Prompt text synthesised from block ids, and the OpenAI chat body that carries it.
//!
//! Each block id maps to the same text everywhere (a pure function of the id), at
//! [`BYTES_PER_TOKEN`] ASCII bytes per token, so two requests that share a block-id
//! prefix share a byte prefix: the node's byte-level hash chain then sees exactly the
//! prefix sharing the trace describes.

use gorgo_core::hash::{hash_bytes, BYTES_PER_TOKEN};
use serde_json::{json, Value};

use crate::record::{BlockIds, TraceRequest};

/// Syllables the pseudo-words are made of: readable in logs, ASCII, no escaping needed.
const SYLLABLES: [&str; 32] = [
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ba", "de", "fi", "go", "hu", "je", "ko", "la",
    "ma", "no", "pe", "qui", "ra", "se", "to", "un", "ve", "wa", "xi", "yo", "zu", "an", "el",
    "or",
];

/// A small deterministic generator seeded from a hash; prompt text must not depend on
/// any library's RNG stream staying stable across versions.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Append exactly `len` bytes of pseudo-words derived from `seed` to `out`.
fn push_words(out: &mut String, seed: u64, len: usize) {
    let start = out.len();
    let mut rng = SplitMix64(seed);
    while out.len() - start < len {
        let r = rng.next();
        let syllables = 1 + (r & 3) as usize;
        for k in 0..syllables {
            out.push_str(SYLLABLES[((r >> (8 + 5 * k)) & 31) as usize]);
        }
        out.push(if (r >> 40).is_multiple_of(11) {
            '.'
        } else {
            ' '
        });
    }
    out.truncate(start + len);
}

/// The full text of one block: `tokens * BYTES_PER_TOKEN` ASCII bytes, a pure function
/// of the block id's bytes.
pub fn block_text(id_bytes: &[u8], tokens: u32) -> String {
    let mut s = String::with_capacity(tokens as usize * BYTES_PER_TOKEN);
    push_words(
        &mut s,
        hash_bytes(id_bytes),
        tokens as usize * BYTES_PER_TOKEN,
    );
    s
}

/// The request's prompt: the concatenated text of its blocks, the last one cut to the
/// request's remaining tokens, `input_tokens * BYTES_PER_TOKEN` bytes in all.
///
/// Tokens beyond the listed blocks (or all of them, for traces without block ids) get
/// text seeded from the request itself, so they are shared with no other request. A
/// prompt is at most [`crate::read::MAX_INPUT_TOKENS`] tokens (what a trace row may
/// have; a request built otherwise is cut there rather than exhaust memory).
pub fn synthesize_prompt(req: &TraceRequest) -> String {
    let total = req.input_tokens.min(crate::read::MAX_INPUT_TOKENS) as usize * BYTES_PER_TOKEN;
    let block_bytes = req.tokens_per_block.max(1) as usize * BYTES_PER_TOKEN;
    let mut out = String::with_capacity(total);
    for i in 0..req.blocks.len() {
        let left = total - out.len();
        if left == 0 {
            break;
        }
        push_words(
            &mut out,
            hash_bytes(&req.blocks.id_bytes(i)),
            left.min(block_bytes),
        );
    }
    let left = total - out.len();
    if left > 0 {
        push_words(&mut out, unshared_seed(req), left);
    }
    out
}

/// Seed for text no other request shares: the last listed block (so it stays a suffix of
/// the shared part) folded with what is unique to this request.
fn unshared_seed(req: &TraceRequest) -> u64 {
    let mut key = Vec::new();
    if !req.blocks.is_empty() {
        key.extend_from_slice(&req.blocks.id_bytes(req.blocks.len() - 1));
    }
    key.extend_from_slice(&req.timestamp_ms.to_le_bytes());
    key.extend_from_slice(&req.input_tokens.to_le_bytes());
    for s in [&req.request_id, &req.user, &req.session]
        .into_iter()
        .flatten()
    {
        key.extend_from_slice(s.as_bytes());
    }
    if matches!(req.blocks, BlockIds::None) {
        key.push(0xff);
    }
    hash_bytes(&key)
}

/// An OpenAI chat-completions body for the request: the synthesised prompt as the one
/// (hence last) user message, streaming with usage, `max_tokens` = the trace's output
/// length, at least 1 (engines refuse 0, and the simulator serves such a row one
/// token: a live replay must send what it simulates). Keeping the content the last part of the rendering is what makes byte-prefix
/// equality of prompts prefix equality of the node's canonical rendering.
pub fn chat_body(req: &TraceRequest, model: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": synthesize_prompt(req)}],
        "max_tokens": req.output_tokens.max(1),
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: Vec<u64>, input: u64) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            input_tokens: input,
            output_tokens: 8,
            blocks: BlockIds::Int(ids),
            tokens_per_block: 16,
            user: None,
            session: None,
            home_region: None,
            request_id: None,
            system_prompt_hash: None,
        }
    }

    #[test]
    fn equal_block_prefixes_give_equal_byte_prefixes() {
        let a = synthesize_prompt(&req(vec![1, 2, 3], 40));
        let b = synthesize_prompt(&req(vec![1, 2, 4], 48));
        assert_eq!(a.len(), 160);
        assert_eq!(b.len(), 192);
        assert!(a.is_ascii());
        assert_eq!(a[..128], b[..128]);
        assert_ne!(a[128..160], b[128..160]);
        // Truncation of the last block is a prefix of the full block text.
        assert_eq!(&a[128..], &block_text(&3u64.to_le_bytes(), 16)[..32]);
    }

    #[test]
    fn chat_body_has_the_openai_shape() {
        let body = chat_body(&req(vec![7], 10), "m");
        assert_eq!(body["model"], "m");
        assert_eq!(body["max_tokens"], 8);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["messages"][0]["content"].as_str().unwrap().len(), 40);
        // A row of no output asks for one token, as the simulator serves it.
        let mut none = req(vec![7], 10);
        none.output_tokens = 0;
        assert_eq!(chat_body(&none, "m")["max_tokens"], 1);
    }

    proptest::proptest! {
        #[test]
        fn prompt_length_is_exact(ids in proptest::collection::vec(0u64..50, 0..6), input in 0u64..200) {
            let p = synthesize_prompt(&req(ids, input));
            proptest::prop_assert_eq!(p.len(), input as usize * BYTES_PER_TOKEN);
            proptest::prop_assert!(p.is_ascii());
        }
    }
}
