//! Prompt tokens on the node: exact with the engine's tokenizer, learned without.
//!
//! With `engine.tokenizer` the node renders and tokenises each request as the engine
//! of its `engine.kind` does ([`gorgo_tokenizer::EngineTokenizer`], whose rules for
//! vLLM and SGLang differ: [`EngineTokenizer::for_engine`]) and hashes the token ids in blocks of
//! `routing.block_tokens` ([`HashChain::from_token_ids`]): exact prompt-token counts for
//! the context check and the cost model, and blocks on the engine's KV page
//! boundaries. Without it the chain stays over canonical bytes (`NodeState::hasher`)
//! and its token counts come from a [`TokenRatio`] per [`PromptShape`] (chat, chat
//! with tools, completions: their templates add different overheads) learned from
//! the engine's `usage.prompt_tokens`: each block at the learned bytes per token, the
//! fitted overhead on the first block (the template puts it at the start). The hashes
//! do not move with the estimate. Every node of a
//! cluster must hash the same way (both with the same tokenizer and `block_tokens`, or
//! both without and the same `block_bytes`), or their prefix summaries never match.

use std::sync::Arc;

use bytes::Bytes;
use gorgo_core::prompt::{CanonicalSize, PromptShape};
use gorgo_core::{Endpoint, HashChain, TokenRatio};
use gorgo_tokenizer::{EngineTokenizer, TokenizerError};
use parking_lot::RwLock;
use serde::Serialize;

use crate::config::ValidatedConfig;
use crate::error::NodeError;
use crate::NodeState;

/// Bodies larger than this are tokenised off the async workers (a long prompt takes
/// milliseconds).
const INLINE_TOKENIZE_BYTES: usize = 64 * 1024;

/// How this node counts prompt tokens (see the module docs).
#[derive(Debug)]
pub struct PromptTokens {
    tokenizer: Option<EngineTokenizer>,
    block_tokens: usize,
    /// One learner per shape, by [`PromptShape::index`].
    ratios: [RwLock<TokenRatio>; 3],
}

/// What `/admin/state` shows under `tokens`.
#[derive(Debug, Clone, Serialize)]
pub struct TokensView {
    /// `tokenizer` (exact counts) or `ratio` (learned from the engine).
    pub counting: &'static str,
    /// The `tokenizer.json` in use.
    pub tokenizer: Option<String>,
    /// Block size of the chain over token ids, with a tokenizer.
    pub block_tokens: Option<usize>,
    /// Block size of the chain over canonical bytes, without.
    pub block_bytes: Option<usize>,
    /// The learned estimate of each prompt shape, without a tokenizer.
    pub shapes: Vec<ShapeView>,
}

/// The learned estimate of one prompt shape.
#[derive(Debug, Clone, Serialize)]
pub struct ShapeView {
    /// `chat`, `chat_tools` or `completions`.
    pub shape: PromptShape,
    /// Bytes per token of the canonical text.
    pub bytes_per_token: f64,
    /// Tokens the engine's template adds to each prompt beyond its canonical text.
    pub overhead_tokens: u64,
    /// Engine counts learned from.
    pub samples: u64,
    /// The ratio it started from (`routing.bytes_per_token`).
    pub seed_bytes_per_token: f64,
}

impl PromptTokens {
    /// Load the tokenizer (errors name `engine.tokenizer` / `engine.chat_template`) or
    /// seed the ratio from `routing.bytes_per_token`.
    pub fn new(config: &ValidatedConfig) -> Result<Self, NodeError> {
        let tokenizer = match &config.shared_engine().tokenizer {
            None => None,
            Some(path) => Some(
                EngineTokenizer::load(
                    path,
                    config.shared_engine().chat_template.as_deref(),
                    config.shared_engine().chat_add_special_tokens,
                )
                .map_err(|e| match e {
                    TokenizerError::Config { field, reason } => {
                        NodeError::Config(format!("invalid `engine.{field}`: {reason}"))
                    }
                    other => NodeError::Config(format!("invalid `engine.tokenizer`: {other}")),
                })?
                // vLLM and SGLang build a chat prompt each its own way: counted as the
                // engine of `engine.kind` builds it (the first engine's, for all).
                .for_engine(config.shared_engine().kind),
            ),
        };
        let ratio = TokenRatio::new(config.routing.bytes_per_token as f64)
            .map_err(|e| NodeError::Config(format!("invalid `routing.bytes_per_token`: {e}")))?;
        Ok(PromptTokens {
            tokenizer,
            block_tokens: config.routing.block_tokens,
            ratios: PromptShape::ALL.map(|_| RwLock::new(ratio.clone())),
        })
    }

    /// Whether counts are exact (a tokenizer is configured).
    pub fn exact(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// The learned bytes per token of chat prompts without tools (the common shape):
    /// the `gorgo_bytes_per_token` gauge.
    pub fn bytes_per_token(&self) -> f64 {
        self.ratios[PromptShape::Chat.index()]
            .read()
            .bytes_per_token()
    }

    /// The chain of a request whose canonical prompt is `canonical`: over token ids with
    /// a tokenizer, over the canonical bytes (hashed by `byte_chains`) without, counted
    /// with the estimate learned for the prompt's shape. `batch_longest_bytes`: for a
    /// completions batch, its longest prompt's canonical bytes
    /// ([`gorgo_core::prompt::CompletionsPrompt::longest_batch_prompt_bytes`]);
    /// `truncated_to`, vLLM's `truncate_prompt_tokens` (the engine keeps the last N
    /// tokens), which the tokenizer reads from the body itself.
    ///
    /// The tokenizer parses `body` again rather than take the ingress's parsed
    /// `serde_json::Value`: that one (serde_json here has no `preserve_order`) has its
    /// objects' keys sorted, and a template prints a tool's `parameters` schema with
    /// `tojson` in the client's order, as the engines (Python dicts) print it; sorted,
    /// the same request renders to other text, whose ids hash to another chain.
    fn count(
        &self,
        byte_chains: &gorgo_core::PromptHasher,
        endpoint: Endpoint,
        body: &[u8],
        canonical: &[u8],
        batch_longest_bytes: Option<u64>,
        truncated_to: Option<u64>,
    ) -> Result<CountedPrompt, TokenizerError> {
        if let Some(t) = &self.tokenizer {
            let prompt = t.tokenize_prompt(endpoint, body)?;
            return Ok(CountedPrompt {
                chain: HashChain::from_token_ids(&prompt.ids, self.block_tokens),
                longest_prompt_tokens: prompt.longest_prompt_tokens as u64,
            });
        }
        let shape = PromptShape::of(endpoint, canonical);
        let (rate, bytes_per_token, overhead, longest) = {
            let ratio = self.ratios[shape.index()].read();
            (
                ratio.per_byte(),
                ratio.bytes_per_token(),
                ratio.overhead_tokens(),
                batch_longest_bytes.map(|bytes| ratio.tokens(bytes)),
            )
        };
        let mut chain = byte_chains.chain_counted(canonical, &rate);
        if let Some(first) = chain.block_tokens.first_mut() {
            *first = first.saturating_add(overhead.min(u32::MAX as u64) as u32);
        }
        // A truncated prompt is its last N tokens: priced as those, and hashed from the
        // bytes they are estimated to span, so it matches no untruncated prompt's cache
        // (the engine's cache holds the kept tokens from their own start). A batch's
        // prompts are truncated one by one, which bytes cannot follow: its chain stays
        // whole, its longest prompt is held to N.
        if let Some(n) =
            truncated_to.filter(|&n| batch_longest_bytes.is_none() && n < chain.total_tokens())
        {
            let kept = ((n as f64 * bytes_per_token).ceil() as usize).min(canonical.len());
            chain = byte_chains.chain_counted(&canonical[canonical.len() - kept..], &rate);
        }
        let total = chain.total_tokens();
        let longest = longest.map_or(total, |n| n.min(total));
        Ok(CountedPrompt {
            chain,
            // One prompt of a batch is never more than all of them.
            longest_prompt_tokens: truncated_to.map_or(longest, |n| n.min(longest)),
        })
    }

    /// Learn from the engine's `usage.prompt_tokens` for a request this node counted
    /// as `node_tokens` (`canonical`: its canonical size, `None` when a peer rendered
    /// it): the relative error of the node's count is recorded, and without a
    /// tokenizer the shape's estimate learns.
    pub fn observe(
        &self,
        metrics: &crate::metrics::NodeMetrics,
        canonical: Option<CanonicalSize>,
        node_tokens: u64,
        engine_tokens: u64,
    ) {
        if engine_tokens > 0 {
            let error = (node_tokens as f64 - engine_tokens as f64).abs() / engine_tokens as f64;
            metrics.prompt_token_error.observe(error);
        }
        if let (None, Some(size)) = (&self.tokenizer, canonical) {
            self.ratios[size.shape.index()]
                .write()
                .observe(size.bytes, engine_tokens);
            metrics.bytes_per_token.set(self.bytes_per_token());
        }
    }

    /// The `tokens` object of `/admin/state`.
    pub fn view(&self, block_bytes: usize) -> TokensView {
        match &self.tokenizer {
            Some(t) => TokensView {
                counting: "tokenizer",
                tokenizer: Some(t.source().display().to_string()),
                block_tokens: Some(self.block_tokens),
                block_bytes: None,
                shapes: Vec::new(),
            },
            None => TokensView {
                counting: "ratio",
                tokenizer: None,
                block_tokens: None,
                block_bytes: Some(block_bytes),
                shapes: PromptShape::ALL
                    .iter()
                    .map(|&shape| {
                        let r = self.ratios[shape.index()].read();
                        ShapeView {
                            shape,
                            bytes_per_token: r.bytes_per_token(),
                            overhead_tokens: r.overhead_tokens(),
                            samples: r.samples(),
                            seed_bytes_per_token: r.seed(),
                        }
                    })
                    .collect(),
            },
        }
    }

    /// How the count in a context-length refusal was made, for its message.
    pub fn how_counted(&self) -> &'static str {
        match &self.tokenizer {
            Some(_) => "counted with the engine's tokenizer",
            None => "estimated from its bytes, at the rate learned from the engine",
        }
    }
}

/// A request's prompt as the node counts it ([`request_chain`]).
#[derive(Debug, Clone)]
pub struct CountedPrompt {
    /// The chain of the whole prompt, a completions batch's prompts one after the
    /// other: what the prefix index matches and the cost model prices (the engine
    /// prefills all of it, and its `usage.prompt_tokens` counts all of it).
    pub chain: HashChain,
    /// Tokens of the longest prompt: the chain's total but for a batch. The engine
    /// checks a batch against its context prompt by prompt (vLLM does), so this is what
    /// the context check compares.
    pub longest_prompt_tokens: u64,
}

/// The chain of a request at the ingress: `canonical` is its canonical prompt
/// (`gorgo_core::prompt::canonicalize`, which also validated it), `batch_longest_bytes`
/// the size of a completions batch's longest prompt
/// ([`gorgo_core::prompt::CompletionsPrompt::longest_batch_prompt_bytes`]). Long bodies
/// are tokenised on a blocking thread. A body the template cannot render is the
/// client's error ([`NodeError::Tokenize`], a 400); a tokenizer that panicked is the
/// node's ([`NodeError::Internal`], a 500). `held` (the request's concurrency slot)
/// goes with the work and comes back with its result: a client that goes away while
/// its long body is tokenised on a blocking thread, which runs on, does not free its
/// slot before the work ends (it did, and `max_concurrency` stopped bounding the
/// tokenising, each run holding about 20 times the prompt).
pub async fn request_chain<K: Send + 'static>(
    state: &Arc<NodeState>,
    endpoint: Endpoint,
    body: &Bytes,
    canonical: Vec<u8>,
    batch_longest_bytes: Option<u64>,
    truncated_to: Option<u64>,
    held: K,
) -> Result<(CountedPrompt, K), NodeError> {
    if !state.tokens.exact() || body.len() <= INLINE_TOKENIZE_BYTES {
        // Inline, a panic would unwind the connection's task: the client would see a
        // reset, not the 500 a long body gets from the blocking thread.
        let counted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            state.tokens.count(
                &state.hasher,
                endpoint,
                body,
                &canonical,
                batch_longest_bytes,
                truncated_to,
            )
        }))
        .map_err(|_| NodeError::Internal("tokenizing failed: the tokenizer panicked".into()))?;
        return Ok((counted?, held));
    }
    let st = state.clone();
    let body = body.clone();
    let (counted, held) = tokio::task::spawn_blocking(move || {
        let counted = st.tokens.count(
            &st.hasher,
            endpoint,
            &body,
            &canonical,
            batch_longest_bytes,
            truncated_to,
        );
        (counted, held)
    })
    .await
    .map_err(|e| NodeError::Internal(format!("tokenizing failed: {e}")))?;
    Ok((counted?, held))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a tokenizer, a prompt truncated to its last N tokens (vLLM's
    /// `truncate_prompt_tokens`) is priced as about N tokens, not the whole prompt, and
    /// shares no block with the whole prompt's chain: the engine caches the kept tokens
    /// from their own start, so the whole prompt's cached prefix is no hit for it.
    #[test]
    fn a_truncated_prompt_is_priced_and_hashed_as_its_kept_tokens() {
        let tokens = PromptTokens {
            tokenizer: None,
            block_tokens: 64,
            ratios: PromptShape::ALL.map(|_| RwLock::new(TokenRatio::new(4.0).unwrap())),
        };
        let hasher =
            gorgo_core::PromptHasher::new(256, Box::new(gorgo_core::BytesPerToken(4))).unwrap();
        let canonical = "the quick brown fox jumps over the lazy dog. ".repeat(200);
        let count = |truncated_to| {
            tokens
                .count(
                    &hasher,
                    Endpoint::Completions,
                    b"{}",
                    canonical.as_bytes(),
                    None,
                    truncated_to,
                )
                .unwrap()
        };
        let whole = count(None);
        assert_eq!(whole.chain.total_tokens(), 2250);
        let kept = count(Some(500));
        assert_eq!(kept.chain.total_tokens(), 500);
        assert_eq!(kept.longest_prompt_tokens, 500);
        assert!(kept
            .chain
            .hashes
            .iter()
            .all(|h| !whole.chain.hashes.contains(h)));
        // A bound above the prompt keeps all of it.
        assert_eq!(count(Some(5000)).chain.hashes, whole.chain.hashes);
        // A batch's chain stays whole; its longest prompt is held to N.
        let batch = tokens
            .count(
                &hasher,
                Endpoint::Completions,
                b"{}",
                canonical.as_bytes(),
                Some(4000),
                Some(500),
            )
            .unwrap();
        assert_eq!(batch.chain.hashes, whole.chain.hashes);
        assert_eq!(batch.longest_prompt_tokens, 500);
    }
}
