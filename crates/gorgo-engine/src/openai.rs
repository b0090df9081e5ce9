//! OpenAI request parsing and response shapes for the emulator.
//!
//! Only what an engine needs: the prompt (rendered by `gorgo_core::prompt`, the one
//! canonical rendering), the output budget, streaming flags. Responses copy the shapes
//! SGLang and vLLM produce so routers and benchmarks parse the emulator like the real
//! thing; where the two engines differ (a stray `stream_options`, a `null`
//! `max_tokens`, the context check, the error body), the [`EmulatedKind`]'s way.

use serde_json::{json, Value};

use gorgo_core::prompt::{canonicalize, CompletionsPrompt, Endpoint};

use crate::EmulatedKind;

/// A request validation failure, rendered as OpenAI's error JSON with status 400.
#[derive(Debug, Clone, PartialEq)]
pub struct BadRequest {
    /// Human-readable message.
    pub message: String,
    /// The offending field, if one.
    pub param: Option<&'static str>,
    /// Machine-readable code, if any.
    pub code: Option<&'static str>,
}

impl BadRequest {
    fn new(message: impl Into<String>, param: Option<&'static str>) -> Self {
        BadRequest {
            message: message.into(),
            param,
            code: None,
        }
    }
}

/// `max_tokens` of a `/v1/completions` request that leaves the field out: OpenAI's
/// default, vLLM's and SGLang's (`CompletionRequest.max_tokens = 16` in both).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

/// What the emulator needs from a completion request.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    /// Which endpoint it came to.
    pub endpoint: Endpoint,
    /// Each prompt's canonical bytes (tokens = bytes / 4, rounded up): one, but one
    /// per prompt for a completions batch, each served as a sequence of its own.
    pub prompts: Vec<Vec<u8>>,
    /// Output tokens to produce where the context leaves room for them: the emulator
    /// has no EOS, so this stands for where the model's answer ends
    /// ([`ParsedRequest::budget`] cuts it to the room).
    pub output_tokens: u32,
    /// The output limit the context is checked against, as both engines take it:
    /// `max_tokens` as asked (`max_completion_tokens` on chat); without the field,
    /// [`COMPLETIONS_DEFAULT_MAX_TOKENS`] on completions, and on chat (or, on vLLM, a
    /// `null` on completions) `None`: whatever the context leaves.
    pub max_tokens: Option<u32>,
    /// SSE streaming asked for.
    pub stream: bool,
    /// `stream_options.include_usage`; where `stream_options` leaves it out, the
    /// engine's default (vLLM: true, SGLang: false).
    pub include_usage: bool,
    /// The `model` field, if given.
    pub model: Option<String>,
    /// The engine whose context check [`ParsedRequest::budget`] applies.
    pub kind: EmulatedKind,
}

/// What one prompt of a request gets ([`ParsedRequest::budget`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Output tokens to produce.
    pub output_tokens: u32,
    /// `"length"` when the output reaches the limit (`max_tokens`, or the context's
    /// room without it), else `"stop"`.
    pub finish_reason: &'static str,
}

impl ParsedRequest {
    /// Check a prompt of `prompt_tokens` against a context of `context_length` as the
    /// kind's engine does, and say what it produces.
    ///
    /// With a limit, prompt + limit must fit the context (counted whatever is
    /// produced): within it on vLLM, below it on SGLang (whose tokenizer manager
    /// refuses `input + max_new_tokens >= context_len`). Without one, both let the
    /// output take what the context leaves, so a prompt is refused only when it leaves
    /// no room for one output token, and the output is cut to that room. SGLang
    /// checks the prompt alone first, whatever the limit.
    pub fn budget(&self, prompt_tokens: u64, context_length: u64) -> Result<Budget, BadRequest> {
        let too_long = |message: String| BadRequest {
            message,
            param: Some(prompt_param(self.endpoint)),
            code: Some("context_length_exceeded"),
        };
        if self.kind == EmulatedKind::Sglang && prompt_tokens >= context_length {
            return Err(too_long(format!(
                "The input ({prompt_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
            )));
        }
        let limit = match (self.max_tokens, self.kind) {
            (Some(m), EmulatedKind::Vllm) => {
                let requested = prompt_tokens + u64::from(m);
                if requested > context_length {
                    return Err(too_long(format!(
                        "This model's maximum context length is {context_length} tokens. However, you requested {requested} tokens ({prompt_tokens} in the prompt, {m} for the completion). Please reduce the length of the prompt or completion."
                    )));
                }
                u64::from(m)
            }
            (Some(m), EmulatedKind::Sglang) => {
                let requested = prompt_tokens + u64::from(m);
                if requested >= context_length {
                    return Err(too_long(format!(
                        "Requested token count exceeds the model's maximum context length of {context_length} tokens. You requested a total of {requested} tokens: {prompt_tokens} tokens from the input messages and {m} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit."
                    )));
                }
                u64::from(m)
            }
            (None, _) => {
                if prompt_tokens >= context_length {
                    return Err(too_long(format!(
                        "This model's maximum context length is {context_length} tokens. However, you requested {prompt_tokens} tokens in the prompt, which leaves no room for the completion. Please reduce the length of the prompt."
                    )));
                }
                context_length - prompt_tokens
            }
        };
        // The limit may be past u32 (a context's room): the output is not.
        let output_tokens =
            u32::try_from(limit).map_or(self.output_tokens, |l| self.output_tokens.min(l));
        let finish_reason = if u64::from(output_tokens) >= limit {
            "length"
        } else {
            "stop"
        };
        Ok(Budget {
            output_tokens,
            finish_reason,
        })
    }
}

/// The field holding an `endpoint`'s prompt, named by errors about the prompt.
pub fn prompt_param(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
    }
}

/// Whether Python reads `v` as true (`null`, `false`, `0`, `""`, `[]` and `{}` are
/// false): what vLLM's request checks test, as in `if data.get("stream_options")`.
fn python_truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

fn positive_int(body: &Value, field: &'static str) -> Result<Option<u32>, BadRequest> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        // Beyond u32 no context holds it: refused as such, not clamped into a message
        // that names another number (2^63-1 was told "you requested 4294967296").
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(n), _) => match u32::try_from(n) {
                Ok(n) if n >= 1 => Ok(Some(n)),
                Ok(n) => Err(BadRequest::new(
                    format!("`{field}` must be at least 1, got {n}"),
                    Some(field),
                )),
                Err(_) => Err(BadRequest::new(
                    format!("`{field}` must be at most {}, got {n}", u32::MAX),
                    Some(field),
                )),
            },
            (None, Some(n)) => Err(BadRequest::new(
                format!("`{field}` must be at least 1, got {n}"),
                Some(field),
            )),
            (None, None) => Err(BadRequest::new(
                format!("`{field}` must be an integer"),
                Some(field),
            )),
        },
    }
}

/// Parse and validate a request body for `endpoint` as an engine of `kind` does; a
/// completions batch holds at most `max_prompts` prompts.
///
/// Output length: `gorgo_output_tokens` (an extension, to replay a trace's
/// `output_length`, where the model's answer would end) else the limit, `max_tokens`
/// (`max_completion_tokens` on chat; 16 on completions without the field, as OpenAI,
/// vLLM and SGLang), else, with no limit (chat without it, as both engines let the
/// output take what the context leaves), `default_max_tokens`; never past the limit.
/// The emulator has no EOS, so `ignore_eos` changes nothing. `stream_options`
/// without `stream` is refused on vLLM (its `validate_stream_options`) and ignored on
/// SGLang, which has no such check; a `null` `max_tokens` on completions is vLLM's
/// "no limit" and SGLang's 400 (an `int` field there).
pub fn parse(
    kind: EmulatedKind,
    endpoint: Endpoint,
    body: &[u8],
    default_max_tokens: u32,
    max_prompts: usize,
) -> Result<ParsedRequest, BadRequest> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        BadRequest::new(
            format!("We could not parse the JSON body of your request: {e}"),
            None,
        )
    })?;
    if !value.is_object() {
        return Err(BadRequest::new(
            "the request body must be a JSON object",
            None,
        ));
    }
    match endpoint {
        Endpoint::Chat => match value.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => {}
            Some(Value::Array(_)) => {
                return Err(BadRequest::new(
                    "`messages` must not be empty",
                    Some("messages"),
                ))
            }
            Some(_) => {
                return Err(BadRequest::new(
                    "`messages` must be an array",
                    Some("messages"),
                ))
            }
            None => {
                return Err(BadRequest::new(
                    "Missing required parameter: 'messages'.",
                    Some("messages"),
                ))
            }
        },
        Endpoint::Completions => {
            if value.get("prompt").is_none_or(Value::is_null) {
                return Err(BadRequest::new(
                    "Missing required parameter: 'prompt'.",
                    Some("prompt"),
                ));
            }
        }
    }
    let asked = match endpoint {
        Endpoint::Chat => match positive_int(&value, "max_completion_tokens")? {
            Some(n) => Some(n),
            None => positive_int(&value, "max_tokens")?,
        },
        Endpoint::Completions => {
            if kind == EmulatedKind::Sglang && value.get("max_tokens") == Some(&Value::Null) {
                return Err(BadRequest::new(
                    "`max_tokens` must be an integer, got null",
                    Some("max_tokens"),
                ));
            }
            positive_int(&value, "max_tokens")?
        }
    };
    // One choice per prompt: refuse what asks for more rather than answer with the
    // wrong shape and load.
    for field in ["n", "best_of"] {
        if let Some(n) = positive_int(&value, field)? {
            if n != 1 {
                return Err(BadRequest::new(
                    format!(
                        "`{field}` must be 1: the emulator returns one choice per prompt, got {n}"
                    ),
                    Some(field),
                ));
            }
        }
    }
    let trace_output = positive_int(&value, "gorgo_output_tokens")?;
    // `CompletionRequest.max_tokens` defaults to 16 when the field is absent; an
    // explicit `null` (refused above on SGLang) is vLLM's `None`, as on chat: what
    // the context leaves.
    let max_tokens = match (endpoint, asked) {
        (_, Some(m)) => Some(m),
        (Endpoint::Completions, None) if value.get("max_tokens").is_none() => {
            Some(COMPLETIONS_DEFAULT_MAX_TOKENS)
        }
        (_, None) => None,
    };
    let output_tokens = match (trace_output, max_tokens) {
        (Some(t), Some(m)) => t.min(m),
        (Some(t), None) => t,
        (None, Some(m)) => m,
        (None, None) => default_max_tokens.max(1),
    };
    let stream = match value.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(BadRequest::new(
                "`stream` must be a boolean",
                Some("stream"),
            ))
        }
    };
    let options = value.get("stream_options");
    if kind == EmulatedKind::Vllm && !stream && options.is_some_and(python_truthy) {
        return Err(BadRequest::new(
            "Stream options can only be defined when `stream=True`.",
            Some("stream_options"),
        ));
    }
    // `StreamOptions.include_usage` defaults to true on vLLM, false on SGLang; an
    // explicit `null` is false on both.
    let include_usage = match options.and_then(|o| o.as_object()) {
        Some(o) => match o.get("include_usage") {
            None => kind == EmulatedKind::Vllm,
            Some(v) => v.as_bool().unwrap_or(false),
        },
        None => false,
    };
    let model = value
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let prompts = match endpoint {
        Endpoint::Chat => vec![canonicalize(endpoint, &value)
            .map_err(|e| BadRequest::new(e.to_string(), Some("messages")))?],
        Endpoint::Completions => {
            let prompt = CompletionsPrompt::of_body(&value)
                .map_err(|e| BadRequest::new(e.to_string(), Some("prompt")))?;
            if prompt.len() > max_prompts {
                return Err(BadRequest::new(
                    format!(
                        "`prompt` holds {} prompts; the emulator takes at most {max_prompts} in one batch",
                        prompt.len()
                    ),
                    Some("prompt"),
                ));
            }
            // vLLM refuses an empty prompt, alone or in a batch, rather than serve
            // nothing.
            let empty = match &prompt {
                CompletionsPrompt::Text(s) => s.is_empty(),
                CompletionsPrompt::TextBatch(v) => v.iter().any(|s| s.is_empty()),
                CompletionsPrompt::TokenIds(ids) => ids.is_empty(),
                CompletionsPrompt::TokenIdBatch(v) => v.iter().any(Vec::is_empty),
            };
            if empty {
                return Err(BadRequest::new(
                    "Either prompt or prompt_embeds must be provided and non-empty.",
                    Some("prompt"),
                ));
            }
            prompt.each_canonical()
        }
    };
    Ok(ParsedRequest {
        endpoint,
        prompts,
        output_tokens,
        max_tokens,
        stream,
        include_usage,
        model,
        kind,
    })
}

/// The filler the emulator "generates": a fixed sentence cut in 4-byte tokens.
const FILLER: &[u8] = b"Lorem ipsum dolor sit amet, consectetur adipiscing elit sed do. ";

/// Text of output token `k` (deterministic, 4 ASCII bytes).
pub fn token_text(k: u32) -> &'static str {
    let start = (k as usize * 4) % FILLER.len();
    std::str::from_utf8(&FILLER[start..start + 4]).expect("ASCII filler")
}

/// The whole text of `n` output tokens.
pub fn filler_text(n: u32) -> String {
    (0..n).map(token_text).collect()
}

/// `usage` object with `prompt_tokens_details.cached_tokens`.
pub fn usage(prompt_tokens: u64, completion_tokens: u32, cached_tokens: u64) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens as u64,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Identity of one response: what every chunk repeats.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// Endpoint answered.
    pub endpoint: Endpoint,
    /// `chatcmpl-...` / `cmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name reported.
    pub model: String,
    /// Emit `"usage": null` on chunks and a final usage chunk.
    pub include_usage: bool,
}

impl ResponseMeta {
    /// A new response identity for request number `n`.
    pub fn new(endpoint: Endpoint, n: u64, model: String, include_usage: bool) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        ResponseMeta {
            endpoint,
            id: format!("{prefix}-{n:016x}"),
            created,
            model,
            include_usage,
        }
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    /// One SSE chunk carrying token text of choice `index` (`first` adds the
    /// assistant role on chat).
    pub fn chunk(
        &self,
        index: usize,
        text: &str,
        first: bool,
        finish_reason: Option<&str>,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = match (first, finish_reason) {
                    (_, Some(_)) => json!({}),
                    (true, None) => json!({"role": "assistant", "content": text}),
                    (false, None) => json!({"content": text}),
                };
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
            }
            Endpoint::Completions => {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish_reason})
            }
        };
        let mut v = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The final usage-only chunk (`choices: []`).
    pub fn usage_chunk(&self, usage: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }

    /// A whole non-streaming response: one choice per text, indexed in order, each
    /// with its `finish_reasons` entry.
    pub fn full(&self, texts: &[String], finish_reasons: &[&str], usage: Value) -> Value {
        let choices: Vec<Value> = texts
            .iter()
            .zip(finish_reasons)
            .enumerate()
            .map(|(index, (text, finish_reason))| match self.endpoint {
                Endpoint::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }),
                Endpoint::Completions => json!({
                    "index": index, "text": text, "logprobs": null, "finish_reason": finish_reason,
                }),
            })
            .collect();
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        })
    }
}

/// The error body an engine of `kind` answers with: vLLM's (and OpenAI's) nests the
/// fields under `"error"`; SGLang's `ErrorResponse` is flat, marked
/// `"object": "error"`. The fields keep OpenAI's names on both (`type` such as
/// `invalid_request_error`, `code` such as `context_length_exceeded`) where the
/// engines put an exception name and the HTTP status (docs/engine-profiles.md).
pub fn error_body(
    kind: EmulatedKind,
    message: &str,
    err_type: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Value {
    match kind {
        EmulatedKind::Vllm => {
            json!({"error": {"message": message, "type": err_type, "param": param, "code": code}})
        }
        EmulatedKind::Sglang => json!({
            "object": "error", "message": message, "type": err_type, "param": param, "code": code,
        }),
    }
}

/// The error event that ends a stream: both engines send `{"error": {...}}`, the
/// inner fields as [`error_body`] has them (SGLang's
/// `create_streaming_error_response` wraps its flat body).
pub fn stream_error_body(
    kind: EmulatedKind,
    message: &str,
    err_type: &str,
    code: Option<&str>,
) -> Value {
    let body = error_body(kind, message, err_type, None, code);
    match kind {
        EmulatedKind::Vllm => body,
        EmulatedKind::Sglang => json!({ "error": body }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`super::parse`] as vLLM parses: the rules most tests here check, the same on
    /// SGLang but where the `sglang_*` tests say otherwise.
    fn parse(
        endpoint: Endpoint,
        body: &[u8],
        default_max_tokens: u32,
        max_prompts: usize,
    ) -> Result<ParsedRequest, BadRequest> {
        super::parse(
            EmulatedKind::Vllm,
            endpoint,
            body,
            default_max_tokens,
            max_prompts,
        )
    }

    /// [`super::parse`] as SGLang parses.
    fn sglang(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, BadRequest> {
        super::parse(EmulatedKind::Sglang, endpoint, body, 128, 8)
    }

    /// SGLang has no check of `stream_options` against `stream`: what vLLM refuses it
    /// serves, not streamed. A streamed request's `stream_options` without
    /// `include_usage` asks for usage on vLLM (its default is true), not on SGLang;
    /// an explicit `null` asks on neither.
    #[test]
    fn sglang_ignores_stream_options_without_stream_and_defaults_usage_off() {
        for (endpoint, body) in [
            (
                Endpoint::Chat,
                &br#"{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#[..],
            ),
            (
                Endpoint::Completions,
                br#"{"prompt":"x","stream":false,"stream_options":{"continuous_usage_stats":true}}"#,
            ),
        ] {
            let p = sglang(endpoint, body).unwrap();
            assert!(!p.stream);
            assert_eq!(
                parse(endpoint, body, 128, 8).unwrap_err().param,
                Some("stream_options")
            );
        }
        let streamed = |options: &str| {
            format!(r#"{{"prompt":"x","stream":true,"stream_options":{options}}}"#).into_bytes()
        };
        for (options, vllm, sglang_usage) in [
            ("{}", true, false),
            (r#"{"continuous_usage_stats":false}"#, true, false),
            (r#"{"include_usage":null}"#, false, false),
            (r#"{"include_usage":true}"#, true, true),
            (r#"{"include_usage":false}"#, false, false),
            ("null", false, false),
        ] {
            let body = streamed(options);
            let asked = |p: ParsedRequest| p.include_usage;
            assert_eq!(
                asked(parse(Endpoint::Completions, &body, 128, 8).unwrap()),
                vllm,
                "vllm {options}"
            );
            assert_eq!(
                asked(sglang(Endpoint::Completions, &body).unwrap()),
                sglang_usage,
                "sglang {options}"
            );
        }
    }

    /// `"max_tokens": null` on completions: no limit on vLLM (`Optional[int]`), a 400
    /// naming the field on SGLang (`max_tokens: int = 16`). Absent, 16 on both.
    #[test]
    fn sglang_refuses_a_null_completions_limit() {
        let e = sglang(
            Endpoint::Completions,
            br#"{"prompt":"x","max_tokens":null}"#,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("max_tokens"), "{}", e.message);
        assert!(e.message.contains("null"), "{}", e.message);
        let p = sglang(Endpoint::Completions, br#"{"prompt":"x"}"#).unwrap();
        assert_eq!(p.max_tokens, Some(COMPLETIONS_DEFAULT_MAX_TOKENS));
        // Chat's limit is optional on SGLang too.
        let p = sglang(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":null}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, None);
    }

    /// SGLang refuses a prompt that fills the context whatever the limit, in its own
    /// words, and prompt + limit that reaches the context (vLLM: only past it).
    #[test]
    fn sglang_checks_the_context_in_its_own_way() {
        let limited = br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":96}"#;
        let s = sglang(Endpoint::Chat, limited).unwrap();
        let v = parse(Endpoint::Chat, limited, 128, 8).unwrap();
        // 4000 + 96 = the context: vLLM serves it, SGLang does not.
        assert!(v.budget(4000, 4096).is_ok());
        let e = s.budget(4000, 4096).unwrap_err();
        assert_eq!(
            (e.param, e.code),
            (Some("messages"), Some("context_length_exceeded"))
        );
        assert_eq!(
            e.message,
            "Requested token count exceeds the model's maximum context length of 4096 tokens. \
             You requested a total of 4096 tokens: 4000 tokens from the input messages and 96 \
             tokens for the completion. Please reduce the number of tokens in the input \
             messages or the completion to fit within the limit."
        );
        let b = s.budget(3999, 4096).unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (96, "length"));
        for prompt in [4096, 5000] {
            let e = s.budget(prompt, 4096).unwrap_err();
            assert_eq!(
                e.message,
                format!(
                    "The input ({prompt} tokens) is longer than the model's context length \
                     (4096 tokens)."
                )
            );
            assert_eq!(e.code, Some("context_length_exceeded"));
        }
        // Without a limit, the output takes the room left, as on vLLM.
        let s = sglang(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        let b = s.budget(4000, 4096).unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (96, "length"));
    }

    /// vLLM nests the error's fields under `"error"`; SGLang's are flat beside
    /// `"object": "error"`, and nested only in the event that ends a stream.
    #[test]
    fn error_bodies_take_the_kinds_shape() {
        let fields = json!({"message": "m", "type": "t", "param": "p", "code": "c"});
        assert_eq!(
            error_body(EmulatedKind::Vllm, "m", "t", Some("p"), Some("c")),
            json!({ "error": fields })
        );
        let mut flat = fields.clone();
        flat["object"] = "error".into();
        assert_eq!(
            error_body(EmulatedKind::Sglang, "m", "t", Some("p"), Some("c")),
            flat
        );
        let mut streamed = flat;
        streamed["param"] = Value::Null;
        assert_eq!(
            stream_error_body(EmulatedKind::Sglang, "m", "t", Some("c")),
            json!({ "error": streamed })
        );
        assert_eq!(
            stream_error_body(EmulatedKind::Vllm, "m", "t", Some("c")),
            error_body(EmulatedKind::Vllm, "m", "t", None, Some("c"))
        );
    }

    #[test]
    fn output_length_rules() {
        let p = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
            128,
            8,
        )
        .unwrap();
        assert_eq!(
            (p.output_tokens, p.max_tokens, p.stream),
            (128, None, false)
        );
        let p = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":10,"gorgo_output_tokens":4,"stream":true,"stream_options":{"include_usage":true}}"#,
            128,
            8,
        )
        .unwrap();
        assert_eq!(
            (p.output_tokens, p.max_tokens, p.stream, p.include_usage),
            (4, Some(10), true, true)
        );
        // Without a limit the trace's length stands; completions' default limit cuts it.
        let p = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}],"gorgo_output_tokens":300}"#,
            128,
            8,
        )
        .unwrap();
        assert_eq!((p.output_tokens, p.max_tokens), (300, None));
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":"abcd","gorgo_output_tokens":300}"#,
            128,
            8,
        )
        .unwrap();
        assert_eq!((p.output_tokens, p.max_tokens), (16, Some(16)));
    }

    /// `/v1/completions` without `max_tokens` produces 16 tokens, OpenAI's and vLLM's
    /// default, whatever the emulator's chat default; an explicit `null` is vLLM's
    /// `None` (what the context leaves), as on chat.
    #[test]
    fn completions_default_to_16_tokens() {
        let p = parse(Endpoint::Completions, br#"{"prompt":"abcd"}"#, 128, 8).unwrap();
        assert_eq!((p.output_tokens, p.max_tokens), (16, Some(16)));
        let b = p.budget(1, 4096).unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (16, "length"));
        // Counted in the context check, as vLLM counts its default.
        let e = p.budget(4090, 4096).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(e.message.contains("4106 tokens"), "{}", e.message);
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":"abcd","max_tokens":null}"#,
            128,
            8,
        )
        .unwrap();
        assert_eq!((p.output_tokens, p.max_tokens), (128, None));
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":"abcd","max_tokens":40}"#,
            128,
            8,
        )
        .unwrap();
        assert_eq!((p.output_tokens, p.max_tokens), (40, Some(40)));
    }

    /// Without `max_tokens` vLLM lets the output take what the context leaves: a
    /// prompt that leaves room for one token is accepted and the output cut to the
    /// room (the emulator's default length is not counted); one that fills the context
    /// is refused naming the prompt. With `max_tokens`, prompt + it must fit.
    #[test]
    fn without_max_tokens_a_prompt_that_fits_the_context_is_accepted() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            parse(Endpoint::Chat, body.as_bytes(), 128, 8).unwrap()
        };
        let p = chat("");
        let b = p.budget(100, 4096).unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (128, "stop"));
        let b = p.budget(4000, 4096).unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (96, "length"));
        let b = p.budget(4095, 4096).unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (1, "length"));
        for prompt in [4096, 5000] {
            let e = p.budget(prompt, 4096).unwrap_err();
            assert_eq!(
                (e.param, e.code),
                (Some("messages"), Some("context_length_exceeded"))
            );
            assert!(
                e.message.contains("maximum context length is 4096")
                    && e.message
                        .contains(&format!("{prompt} tokens in the prompt")),
                "{}",
                e.message
            );
        }
        // A trace's length under no limit: cut to the room too.
        let b = chat(r#","gorgo_output_tokens":500"#)
            .budget(4000, 4096)
            .unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (96, "length"));
        // With a limit, the limit is counted, whatever is produced.
        let p = chat(r#","max_tokens":100,"gorgo_output_tokens":5"#);
        let b = p.budget(3996, 4096).unwrap();
        assert_eq!((b.output_tokens, b.finish_reason), (5, "stop"));
        let e = p.budget(3997, 4096).unwrap_err();
        assert!(e.message.contains("4097 tokens"), "{}", e.message);
        assert_eq!(e.code, Some("context_length_exceeded"));
    }

    /// vLLM refuses `stream_options` that Python reads as true unless `stream` is
    /// true (`{}` and `null` pass, as there), naming the field.
    #[test]
    fn stream_options_without_stream_are_refused() {
        for endpoint in [Endpoint::Chat, Endpoint::Completions] {
            let body = |extra: &str| match endpoint {
                Endpoint::Chat => {
                    format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{extra}}}"#)
                }
                Endpoint::Completions => format!(r#"{{"prompt":"x"{extra}}}"#),
            };
            for extra in [
                r#","stream_options":{"include_usage":true}"#,
                r#","stream_options":{"include_usage":false},"stream":false"#,
                r#","stream_options":{"continuous_usage_stats":true},"stream":null"#,
            ] {
                let e = parse(endpoint, body(extra).as_bytes(), 128, 8).unwrap_err();
                assert_eq!(e.param, Some("stream_options"), "{extra}");
                assert_eq!(
                    e.message,
                    "Stream options can only be defined when `stream=True`."
                );
            }
            for extra in [
                r#","stream_options":{}"#,
                r#","stream_options":null"#,
                r#","stream_options":{"include_usage":true},"stream":true"#,
            ] {
                assert!(
                    parse(endpoint, body(extra).as_bytes(), 128, 8).is_ok(),
                    "{extra}"
                );
            }
        }
    }

    #[test]
    fn bad_input_names_the_param() {
        let e = parse(Endpoint::Chat, b"{not json", 1, 8).unwrap_err();
        assert_eq!(e.param, None);
        let e = parse(Endpoint::Chat, br#"{"model":"m"}"#, 1, 8).unwrap_err();
        assert_eq!(e.param, Some("messages"));
        let e = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
            1,
            8,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
        // Integers beyond u32 are named as sent, not clamped, nor called non-integers.
        for big in ["9223372036854775807", "18446744073709551615"] {
            let body = format!(r#"{{"prompt":"x","max_tokens":{big}}}"#);
            let e = parse(Endpoint::Completions, body.as_bytes(), 1, 8).unwrap_err();
            assert_eq!(e.param, Some("max_tokens"));
            assert!(e.message.contains(big), "{}", e.message);
        }
        let e = parse(Endpoint::Completions, br#"{"max_tokens":3}"#, 1, 8).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
    }

    #[test]
    fn more_than_one_choice_is_refused() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            parse(Endpoint::Chat, body.as_bytes(), 1, 8)
        };
        let e = chat(r#","n":2"#).unwrap_err();
        assert_eq!(e.param, Some("n"));
        assert!(e.message.contains("`n`"), "{}", e.message);
        assert_eq!(chat(r#","n":0"#).unwrap_err().param, Some("n"));
        assert_eq!(chat(r#","n":"2""#).unwrap_err().param, Some("n"));
        assert!(chat(r#","n":1"#).is_ok());
        assert!(chat(r#","n":null"#).is_ok());
        let e = parse(
            Endpoint::Completions,
            br#"{"prompt":"x","best_of":2}"#,
            1,
            8,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("best_of"));
    }

    /// A completions batch is one prompt per element, each rendered as it would be
    /// alone; an empty batch or prompt and a batch over the limit are refused naming
    /// `prompt`.
    #[test]
    fn a_batch_is_prompt_by_prompt_within_its_limit() {
        let p = parse(Endpoint::Completions, br#"{"prompt":["ab","cd"]}"#, 1, 2).unwrap();
        assert_eq!(p.prompts, [b"ab".to_vec(), b"cd".to_vec()]);
        let p = parse(Endpoint::Completions, br#"{"prompt":[[1],[2]]}"#, 1, 2).unwrap();
        assert_eq!(p.prompts.len(), 2);
        for body in [
            &br#"{"prompt":["a","b","c"]}"#[..],
            br#"{"prompt":[]}"#,
            br#"{"prompt":""}"#,
            br#"{"prompt":["a",""]}"#,
            br#"{"prompt":[[1],[]]}"#,
        ] {
            let e = parse(Endpoint::Completions, body, 1, 2).unwrap_err();
            assert_eq!(e.param, Some("prompt"), "{}", e.message);
        }
    }

    #[test]
    fn filler_is_four_bytes_per_token() {
        assert!((0..100).all(|k| token_text(k).len() == 4));
        assert_eq!(filler_text(3), "Lorem ipsum ");
    }
}
