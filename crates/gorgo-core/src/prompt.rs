//! Canonical prompt rendering and its hash chain.
//!
//! Two requests share an engine prefix-cache entry when their prompts share a prefix.
//! GORGO never sees the engine's token stream, so it renders each OpenAI request body to
//! canonical bytes and hashes those ([`crate::hash::HashChain`]). The rendering is a
//! plain concatenation, message by message, so a conversation extended by one turn
//! renders to bytes that start with the previous turn's rendering and its blocks hash
//! identically.
//!
//! Rendering (stable: summaries of different nodes must agree):
//! - `chat/completions`: for each message `<|{role}|>\n{content}\n`, where content is
//!   the string, or the concatenation of an array's parts: `text` parts give their
//!   text; any other part gives `<|{type}:{hash}|>` (hash of the part's JSON, 16 hex
//!   digits) so different images never look alike; `null`/missing content gives
//!   nothing. A message's `tool_calls`, when present, follow the content as
//!   `<|tool_calls:{json}|>`. A non-empty `tools` array comes first, as
//!   `<|tools|>\n{json}\n` (engines put tool definitions at the start of the prompt).
//! - `completions`: a `prompt` string as is; an array of strings concatenated with
//!   `\n` after each; token ids (array of integers, or array of such arrays) as 4
//!   little-endian bytes per id, so the default 4-bytes-per-token estimate is exact
//!   for them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::CoreError;
use crate::hash::{HashChain, BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES};

/// Which OpenAI endpoint a request came to; decides how its body is rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

impl Endpoint {
    /// The HTTP path of the endpoint.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }

    /// The endpoint served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completions),
            _ => None,
        }
    }
}

/// What, beside its length, decides how many tokens an engine's template adds to a
/// prompt: its endpoint, and for chat whether tool definitions come first (templates
/// put a long preamble before them). A node without a tokenizer learns one
/// [`crate::token_ratio::TokenRatio`] per shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptShape {
    /// A chat request without tools.
    Chat,
    /// A chat request with a non-empty `tools` array.
    ChatTools,
    /// A completions request.
    Completions,
}

impl PromptShape {
    /// Every shape, in the order of [`PromptShape::index`].
    pub const ALL: [PromptShape; 3] = [
        PromptShape::Chat,
        PromptShape::ChatTools,
        PromptShape::Completions,
    ];

    /// The shape of a request to `endpoint` whose canonical prompt is `canonical`
    /// (tools render first, as `<|tools|>`).
    pub fn of(endpoint: Endpoint, canonical: &[u8]) -> Self {
        match endpoint {
            Endpoint::Completions => PromptShape::Completions,
            Endpoint::Chat if canonical.starts_with(TOOLS_TAG) => PromptShape::ChatTools,
            Endpoint::Chat => PromptShape::Chat,
        }
    }

    /// Position in [`PromptShape::ALL`], for per-shape arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A canonical prompt's size and shape: what a token estimate is made and learned from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanonicalSize {
    /// Canonical prompt bytes.
    pub bytes: u64,
    /// The prompt's shape.
    pub shape: PromptShape,
}

impl CanonicalSize {
    /// The size and shape of a request to `endpoint` whose canonical prompt is
    /// `canonical`.
    pub fn of(endpoint: Endpoint, canonical: &[u8]) -> Self {
        CanonicalSize {
            bytes: canonical.len() as u64,
            shape: PromptShape::of(endpoint, canonical),
        }
    }
}

/// How a non-empty `tools` array starts the canonical rendering.
const TOOLS_TAG: &[u8] = b"<|tools|>\n";

/// Counts the tokens of prompt bytes.
///
/// Why a trait: without a tokenizer the node counts with the ratio it learns from the
/// engine ([`crate::token_ratio::TokenRatio`]), tests and tools with a fixed
/// [`BytesPerToken`]; the block hashes are the same whatever counts. (With a tokenizer
/// the chain is over token ids instead: [`HashChain::from_token_ids`].)
pub trait TokenCounter: Send + Sync {
    /// Tokens in `text` (a block of canonical prompt bytes).
    fn count(&self, text: &[u8]) -> u64;
}

/// The estimate used without a tokenizer: one token per `n` bytes, rounded up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BytesPerToken(pub u32);

impl Default for BytesPerToken {
    /// 4 bytes per token, docs/design.md's token model.
    fn default() -> Self {
        BytesPerToken(BYTES_PER_TOKEN as u32)
    }
}

impl TokenCounter for BytesPerToken {
    fn count(&self, text: &[u8]) -> u64 {
        (text.len() as u64).div_ceil(self.0.max(1) as u64)
    }
}

/// Renders the canonical prompt of an already parsed request body.
pub fn canonicalize(endpoint: Endpoint, body: &Value) -> Result<Vec<u8>, CoreError> {
    let mut out = Vec::new();
    match endpoint {
        Endpoint::Chat => render_chat(body, &mut out)?,
        Endpoint::Completions => render_completions(body, &mut out)?,
    }
    Ok(out)
}

/// Parses a request body (JSON bytes) and renders its canonical prompt.
pub fn canonicalize_body(endpoint: Endpoint, body: &[u8]) -> Result<Vec<u8>, CoreError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("body is not JSON: {e}")))?;
    canonicalize(endpoint, &value)
}

fn invalid(msg: impl Into<String>) -> CoreError {
    CoreError::InvalidRequest(msg.into())
}

fn render_chat(body: &Value, out: &mut Vec<u8>) -> Result<(), CoreError> {
    let obj = body
        .as_object()
        .ok_or_else(|| invalid("body must be a JSON object"))?;
    let messages = obj
        .get("messages")
        .ok_or_else(|| invalid("missing `messages`"))?;
    let messages = messages
        .as_array()
        .ok_or_else(|| invalid("`messages` must be an array"))?;
    if messages.is_empty() {
        return Err(invalid("`messages` must not be empty"));
    }
    // Engines render tool definitions into the start of the prompt, so they are part
    // of the cached prefix: a different tool set is a different prefix.
    match obj.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(tools)) if tools.is_empty() => {}
        Some(tools @ Value::Array(_)) => {
            out.extend_from_slice(TOOLS_TAG);
            out.extend_from_slice(tools.to_string().as_bytes());
            out.push(b'\n');
        }
        Some(_) => return Err(invalid("`tools` must be an array")),
    }
    for (i, m) in messages.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| invalid(format!("`messages[{i}]` must be an object")))?;
        let role = m
            .get("role")
            .ok_or_else(|| invalid(format!("missing `messages[{i}].role`")))?
            .as_str()
            .ok_or_else(|| invalid(format!("`messages[{i}].role` must be a string")))?;
        out.extend_from_slice(b"<|");
        out.extend_from_slice(role.as_bytes());
        out.extend_from_slice(b"|>\n");
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    render_part(part, out)
                        .map_err(|e| invalid(format!("`messages[{i}].content[{j}]` {e}")))?;
                }
            }
            Some(_) => {
                return Err(invalid(format!(
                    "`messages[{i}].content` must be a string, an array or null"
                )))
            }
        }
        if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
            out.extend_from_slice(b"<|tool_calls:");
            out.extend_from_slice(calls.to_string().as_bytes());
            out.extend_from_slice(b"|>");
        }
        out.push(b'\n');
    }
    Ok(())
}

fn render_part(part: &Value, out: &mut Vec<u8>) -> Result<(), &'static str> {
    out.extend_from_slice(content_part_text(part)?.as_bytes());
    Ok(())
}

/// The text a chat message's content part stands for: a `text` part's text, any other
/// part `<|{type}:{hash}|>` (hash of the part's JSON, 16 hex digits) so that two
/// different images never look alike. `Err` says what is wrong with the part, for a
/// message that names where it is.
///
/// Public so that the tokenizer crate, which joins a message's parts into one string
/// as vLLM does before the template, reads a part exactly as the canonical rendering
/// does.
pub fn content_part_text(part: &Value) -> Result<std::borrow::Cow<'_, str>, &'static str> {
    let obj = part.as_object().ok_or("must be an object")?;
    let kind = obj
        .get("type")
        .and_then(Value::as_str)
        .ok_or("needs a string `type`")?;
    if kind == "text" {
        let text = obj
            .get("text")
            .and_then(Value::as_str)
            .ok_or("needs a string `text`")?;
        Ok(text.into())
    } else {
        let digest = crate::hash::hash_bytes(part.to_string().as_bytes());
        Ok(format!("<|{kind}:{digest:016x}|>").into())
    }
}

fn render_completions(body: &Value, out: &mut Vec<u8>) -> Result<(), CoreError> {
    match CompletionsPrompt::of_body(body)? {
        CompletionsPrompt::Text(s) => out.extend_from_slice(s.as_bytes()),
        CompletionsPrompt::TextBatch(prompts) => {
            for s in prompts {
                out.extend_from_slice(s.as_bytes());
                out.push(b'\n');
            }
        }
        CompletionsPrompt::TokenIds(ids) => render_token_ids(&ids, out),
        CompletionsPrompt::TokenIdBatch(prompts) => {
            for ids in prompts {
                render_token_ids(&ids, out);
            }
        }
    }
    Ok(())
}

fn render_token_ids(ids: &[u32], out: &mut Vec<u8>) {
    out.reserve(ids.len() * 4);
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
}

/// A completions request's `prompt`, in the four forms the OpenAI API takes (vLLM and
/// SGLang take the same).
///
/// Why one type: the canonical rendering here and the tokenizer crate's count (which
/// cannot be reached without passing here first on a node, but is the emulator's only
/// reading) read the same field, and must accept the same bodies with the same errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompletionsPrompt<'a> {
    /// A string: one prompt.
    Text(&'a str),
    /// An array of strings: a batch, each string a prompt of its own.
    TextBatch(Vec<&'a str>),
    /// An array of token ids: one prompt.
    TokenIds(Vec<u32>),
    /// An array of token-id arrays: a batch, each array a prompt of its own.
    TokenIdBatch(Vec<Vec<u32>>),
}

impl<'a> CompletionsPrompt<'a> {
    /// The `prompt` of a completions request body (a JSON object).
    pub fn of_body(body: &'a Value) -> Result<Self, CoreError> {
        let obj = body
            .as_object()
            .ok_or_else(|| invalid("body must be a JSON object"))?;
        let prompt = obj
            .get("prompt")
            .ok_or_else(|| invalid("missing `prompt`"))?;
        const WRONG: &str = "`prompt` must be a string, an array of strings, an array of token ids or an array of token-id arrays";
        match prompt {
            Value::String(s) => Ok(CompletionsPrompt::Text(s)),
            // Engines refuse a batch of no prompts, and a prompt of no token ids: an
            // error here, where it costs the engine nothing.
            Value::Array(items) if items.is_empty() => Err(invalid("`prompt` is an empty array")),
            Value::Array(items)
                if items
                    .iter()
                    .any(|i| i.as_array().is_some_and(Vec::is_empty)) =>
            {
                Err(invalid("`prompt` holds an empty token-id array"))
            }
            Value::Array(items) if items.iter().all(Value::is_string) => Ok(
                CompletionsPrompt::TextBatch(items.iter().filter_map(Value::as_str).collect()),
            ),
            Value::Array(items) if items.iter().all(Value::is_number) => {
                Ok(CompletionsPrompt::TokenIds(token_ids(items)?))
            }
            Value::Array(items) if items.iter().all(Value::is_array) => items
                .iter()
                .filter_map(Value::as_array)
                .map(|ids| {
                    if !ids.iter().all(Value::is_number) {
                        return Err(invalid(WRONG));
                    }
                    token_ids(ids)
                })
                .collect::<Result<_, _>>()
                .map(CompletionsPrompt::TokenIdBatch),
            _ => Err(invalid(WRONG)),
        }
    }
}

impl CompletionsPrompt<'_> {
    /// How many prompts: 1 for a single prompt, the batch's length for a batch (0 for
    /// an empty one).
    pub fn len(&self) -> usize {
        match self {
            CompletionsPrompt::Text(_) | CompletionsPrompt::TokenIds(_) => 1,
            CompletionsPrompt::TextBatch(prompts) => prompts.len(),
            CompletionsPrompt::TokenIdBatch(prompts) => prompts.len(),
        }
    }

    /// Whether this is a batch of no prompts (which engines refuse).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each prompt's canonical bytes, as a request of that prompt alone renders them
    /// (a string's bytes, 4 per token id). An engine serves a batch as one sequence
    /// per prompt (vLLM and SGLang do), so the emulator prefills, caches and checks
    /// each prompt on its own.
    pub fn each_canonical(&self) -> Vec<Vec<u8>> {
        let ids = |ids: &[u32]| {
            let mut out = Vec::new();
            render_token_ids(ids, &mut out);
            out
        };
        match self {
            CompletionsPrompt::Text(s) => vec![s.as_bytes().to_vec()],
            CompletionsPrompt::TextBatch(prompts) => {
                prompts.iter().map(|s| s.as_bytes().to_vec()).collect()
            }
            CompletionsPrompt::TokenIds(one) => vec![ids(one)],
            CompletionsPrompt::TokenIdBatch(prompts) => prompts.iter().map(|p| ids(p)).collect(),
        }
    }

    /// For a batch, the canonical bytes of its longest prompt (a string's bytes, 4 per
    /// token id); `None` for one prompt, whose size is its whole canonical rendering.
    /// Engines check a batch against the context prompt by prompt (vLLM does), so a
    /// node without a tokenizer estimates that check's count from this.
    pub fn longest_batch_prompt_bytes(&self) -> Option<u64> {
        match self {
            CompletionsPrompt::Text(_) | CompletionsPrompt::TokenIds(_) => None,
            CompletionsPrompt::TextBatch(prompts) => prompts.iter().map(|s| s.len() as u64).max(),
            CompletionsPrompt::TokenIdBatch(prompts) => {
                prompts.iter().map(|ids| 4 * ids.len() as u64).max()
            }
        }
    }
}

fn token_ids(ids: &[Value]) -> Result<Vec<u32>, CoreError> {
    ids.iter()
        .map(|id| {
            id.as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| invalid("token ids must be integers in [0, 2^32)"))
        })
        .collect()
}

/// Turns canonical prompt bytes into a [`HashChain`]: fixed-size blocks, chained
/// hashes, and per-block token counts from a [`TokenCounter`].
pub struct PromptHasher {
    block_bytes: usize,
    counter: Box<dyn TokenCounter>,
}

impl std::fmt::Debug for PromptHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptHasher")
            .field("block_bytes", &self.block_bytes)
            .finish_non_exhaustive()
    }
}

impl Default for PromptHasher {
    /// 256-byte blocks, 4 bytes per token.
    fn default() -> Self {
        PromptHasher {
            block_bytes: DEFAULT_BLOCK_BYTES,
            counter: Box::new(BytesPerToken::default()),
        }
    }
}

impl PromptHasher {
    /// A hasher with `block_bytes`-byte blocks counting tokens with `counter`.
    ///
    /// Every node of a cluster must use the same block size, or their summaries do not
    /// match. Errors when `block_bytes` is 0.
    pub fn new(block_bytes: usize, counter: Box<dyn TokenCounter>) -> Result<Self, CoreError> {
        if block_bytes == 0 {
            return Err(CoreError::InvalidConfig {
                field: "block_bytes".into(),
                reason: "must be at least 1".into(),
            });
        }
        Ok(PromptHasher {
            block_bytes,
            counter,
        })
    }

    /// The block size in bytes.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Hash canonical prompt bytes.
    pub fn chain(&self, canonical: &[u8]) -> HashChain {
        self.chain_counted(canonical, &*self.counter)
    }

    /// Hash canonical prompt bytes, counting each block's tokens with `counter` (a
    /// per-request rate, e.g. the ratio learned for the prompt's shape).
    pub fn chain_counted(&self, canonical: &[u8], counter: &dyn TokenCounter) -> HashChain {
        // The hashes are those of `HashChain::from_bytes` (one hashing scheme for live
        // prompts and traces); only the token counts come from the counter.
        let mut chain = HashChain::from_bytes(canonical, self.block_bytes, 1);
        for (tokens, block) in chain
            .block_tokens
            .iter_mut()
            .zip(canonical.chunks(self.block_bytes))
        {
            *tokens = counter.count(block).min(u32::MAX as u64) as u32;
        }
        chain
    }

    /// Render a request body and hash it: the node's ingress path in one call.
    pub fn chain_body(&self, endpoint: Endpoint, body: &[u8]) -> Result<HashChain, CoreError> {
        Ok(self.chain(&canonicalize_body(endpoint, body)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_renders_in_order() {
        let body = json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        ]});
        let out = canonicalize(Endpoint::Chat, &body).unwrap();
        assert_eq!(out, b"<|system|>\nbe brief\n<|user|>\nhi there\n");
    }

    #[test]
    fn non_text_parts_get_stable_distinct_placeholders() {
        let img = |url: &str| {
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}
            ]}]})
        };
        let a = canonicalize(Endpoint::Chat, &img("a.png")).unwrap();
        assert_eq!(a, canonicalize(Endpoint::Chat, &img("a.png")).unwrap());
        assert_ne!(a, canonicalize(Endpoint::Chat, &img("b.png")).unwrap());
        assert!(a.starts_with(b"<|user|>\n<|image_url:"));
    }

    #[test]
    fn extended_conversation_extends_bytes_and_chain() {
        let turn1 = json!({"messages": [
            {"role": "system", "content": "x".repeat(700)},
            {"role": "user", "content": "question one"},
        ]});
        let mut turn2 = turn1.clone();
        let msgs = turn2["messages"].as_array_mut().unwrap();
        msgs.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]}));
        msgs.push(json!({"role": "user", "content": "question two"}));
        let a = canonicalize(Endpoint::Chat, &turn1).unwrap();
        let b = canonicalize(Endpoint::Chat, &turn2).unwrap();
        assert!(b.starts_with(&a));
        let h = PromptHasher::default();
        let (ca, cb) = (h.chain(&a), h.chain(&b));
        let full = a.len() / 256;
        assert_eq!(ca.hashes[..full], cb.hashes[..full]);
        // Same construction as the trace path: one hashing scheme everywhere.
        assert_eq!(ca, HashChain::from_bytes(&a, 256, 4));
    }

    #[test]
    fn tools_prefix_the_prompt() {
        let with = |tools: Value| {
            let body = json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools});
            canonicalize(Endpoint::Chat, &body).unwrap()
        };
        assert_eq!(with(json!([])), b"<|user|>\nhi\n");
        let a = with(json!([{"type": "function", "function": {"name": "f"}}]));
        assert!(a.starts_with(b"<|tools|>\n[{"));
        assert!(a.ends_with(b"<|user|>\nhi\n"));
        assert_ne!(
            a,
            with(json!([{"type": "function", "function": {"name": "g"}}]))
        );
    }

    #[test]
    fn shapes_follow_endpoint_and_tools() {
        let chat = |body: Value| canonicalize(Endpoint::Chat, &body).unwrap();
        let plain = chat(json!({"messages": [{"role": "user", "content": "hi"}]}));
        let tools = chat(json!({"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}));
        assert_eq!(PromptShape::of(Endpoint::Chat, &plain), PromptShape::Chat);
        assert_eq!(
            PromptShape::of(Endpoint::Chat, &tools),
            PromptShape::ChatTools
        );
        assert_eq!(
            PromptShape::of(Endpoint::Completions, b"x"),
            PromptShape::Completions
        );
        for (i, s) in PromptShape::ALL.iter().enumerate() {
            assert_eq!(s.index(), i);
        }
    }

    #[test]
    fn completions_forms() {
        let s = canonicalize(Endpoint::Completions, &json!({"prompt": "abc"})).unwrap();
        assert_eq!(s, b"abc");
        let v = canonicalize(Endpoint::Completions, &json!({"prompt": ["a", "b"]})).unwrap();
        assert_eq!(v, b"a\nb\n");
        let t = canonicalize(Endpoint::Completions, &json!({"prompt": [1, 258]})).unwrap();
        assert_eq!(t, [1, 0, 0, 0, 2, 1, 0, 0]);
        assert_eq!(h_tokens(&t), 2);
        let tt = canonicalize(Endpoint::Completions, &json!({"prompt": [[1], [2, 3]]})).unwrap();
        assert_eq!(tt.len(), 12);
        // What engines refuse: a batch of no prompts, a prompt of no token ids (`[]` was
        // read as an empty batch of strings, and routed).
        for empty in [json!([]), json!([[]]), json!([[1], []])] {
            let e = canonicalize(Endpoint::Completions, &json!({"prompt": empty}));
            assert!(e.unwrap_err().to_string().contains("empty"), "{empty}");
        }
    }

    #[test]
    fn a_batch_knows_its_longest_prompt() {
        let longest = |prompt: Value| {
            let body = json!({ "prompt": prompt });
            CompletionsPrompt::of_body(&body)
                .unwrap()
                .longest_batch_prompt_bytes()
        };
        assert_eq!(longest(json!("abc")), None);
        assert_eq!(longest(json!([1, 2, 3])), None);
        assert_eq!(longest(json!(["ab", "abcd", "a"])), Some(4));
        assert_eq!(longest(json!([[1], [2, 3]])), Some(8));
    }

    /// Each prompt of a batch renders as it would alone.
    #[test]
    fn a_batch_renders_prompt_by_prompt() {
        let each = |prompt: Value| {
            let body = json!({ "prompt": prompt });
            let p = CompletionsPrompt::of_body(&body).unwrap();
            assert_eq!(p.len(), p.each_canonical().len());
            p.each_canonical()
        };
        let alone = |prompt: Value| {
            canonicalize(Endpoint::Completions, &json!({ "prompt": prompt })).unwrap()
        };
        assert_eq!(each(json!("abc")), [alone(json!("abc"))]);
        assert_eq!(
            each(json!(["ab", "c"])),
            [alone(json!("ab")), alone(json!("c"))]
        );
        assert_eq!(
            each(json!([[1], [2, 3]])),
            [alone(json!([1])), alone(json!([2, 3]))]
        );
        // No prompt at all is refused (`completions_forms`).
        assert!(CompletionsPrompt::of_body(&json!({"prompt": []})).is_err());
    }

    fn h_tokens(bytes: &[u8]) -> u64 {
        PromptHasher::default().chain(bytes).total_tokens()
    }

    #[test]
    fn bad_bodies_are_errors() {
        let cases = [
            (Endpoint::Chat, json!({})),
            (Endpoint::Chat, json!({"messages": "hi"})),
            (Endpoint::Chat, json!({"messages": []})),
            (Endpoint::Chat, json!({"messages": [1]})),
            (Endpoint::Chat, json!({"messages": [{"content": "x"}]})),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": 3, "content": "x"}]}),
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": 5}]}),
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": [{"text": "a"}]}]}),
            ),
            (Endpoint::Chat, json!([])),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user"}], "tools": {}}),
            ),
            (Endpoint::Completions, json!({})),
            (Endpoint::Completions, json!({"prompt": 5})),
            (Endpoint::Completions, json!({"prompt": ["a", 1]})),
            (Endpoint::Completions, json!({"prompt": [-1]})),
            (Endpoint::Completions, json!({"prompt": [1.5]})),
            (Endpoint::Completions, json!({"prompt": [[1], ["a"]]})),
        ];
        for (ep, body) in cases {
            match canonicalize(ep, &body) {
                Err(CoreError::InvalidRequest(_)) => {}
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(canonicalize_body(Endpoint::Chat, b"{not json").is_err());
        assert!(PromptHasher::new(0, Box::new(BytesPerToken(4))).is_err());
    }

    #[test]
    fn token_counter_plugs_in() {
        struct Words;
        impl TokenCounter for Words {
            fn count(&self, text: &[u8]) -> u64 {
                text.split(|&b| b == b' ').filter(|w| !w.is_empty()).count() as u64
            }
        }
        let h = PromptHasher::new(8, Box::new(Words)).unwrap();
        let c = h.chain(b"aa bb cc dd ee");
        assert_eq!(c.block_tokens, vec![3, 2]);
        assert_eq!(BytesPerToken(4).count(b"12345"), 2);
    }
}
