//! Prompt tokens as the engine counts them.
//!
//! Without a tokenizer, GORGO estimates a prompt's tokens from its canonical bytes
//! (`gorgo_core::prompt`), and on a real engine that estimate can be off by a factor of
//! several. [`EngineTokenizer`] loads the model's Hugging Face `tokenizer.json` and its
//! chat template and turns an OpenAI request body into the token ids the engine will
//! see, the way vLLM, SGLang and llama.cpp do it:
//!
//! - `chat/completions`: the template is rendered (Jinja, as HF's `apply_chat_template`
//!   renders it: `trim_blocks`, `lstrip_blocks`, loop controls, Python string methods,
//!   HF's `tojson`, `raise_exception`, `strftime_now`) with `messages` as vLLM
//!   normalises them (content parts joined with "\n" into one string unless the
//!   template loops over them, which then gets every content as a list of parts, `null` content as "", a tool call's `arguments` string
//!   parsed into the JSON object it holds), the request's `add_generation_prompt`
//!   (default true), `tools` (none when absent or empty), `bos_token`, `eos_token` and
//!   the request's `chat_template_kwargs`; with `continue_final_message` the text is
//!   cut after the last message's, as HF cuts it. Each render has a fuel budget (a
//!   step count) in proportion to the body. The text is tokenised with special
//!   tokens parsed, and the tokenizer's own added tokens (BOS) when the request's
//!   `add_special_tokens` (vLLM's) says so, or else when `chat_add_special_tokens`
//!   does (vLLM and SGLang: no, the template writes `bos_token` itself;
//!   llama-cpp-python's built-in chat formats: yes).
//! - `completions`: a string prompt is tokenised with special tokens added (all three
//!   engines do) unless the request says `"add_special_tokens": false` (vLLM's
//!   parameter); an array of strings is a batch, counted as the sum (the longest
//!   prompt is given beside it: engines check a batch against the context prompt by
//!   prompt); token ids are taken as they are.
//! - both: vLLM's `truncate_prompt_tokens` N keeps each prompt's last N ids.
//!
//! It lives in its own crate because two programs need the very same counting: the
//! node (routing, context check, hash chain over token ids) and the engine emulator
//! (its `usage.prompt_tokens`), and the sans-IO core must stay free of file reading
//! and of these dependencies.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

use std::path::{Path, PathBuf};

use gorgo_core::prompt::CompletionsPrompt;
use gorgo_core::Endpoint;
use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;

mod pyjson;

/// The test fixture: `tiny_gguf.py`'s vocabulary as a `tokenizer.json`, with a
/// `tokenizer_config.json` holding a ChatML template with tools (`fixtures/tiny-spm`,
/// see its README). Public so the node's and the emulator's tests count with the same
/// file.
pub const FIXTURE_TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/tiny-spm/tokenizer.json"
);

/// Everything that can go wrong loading a tokenizer or counting a request with it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer or template file that is missing, unreadable or invalid; `field`
    /// names the setting (`tokenizer` or `chat_template`) so callers can prefix their
    /// own section (`engine.tokenizer`, `--tokenizer`).
    #[error("invalid `{field}`: {reason}")]
    Config {
        /// `tokenizer` or `chat_template`.
        field: &'static str,
        /// What is wrong, with the path.
        reason: String,
    },
    /// A request body the template cannot render or the tokenizer cannot encode: the
    /// client's fault, answered with a 400.
    #[error("{0}")]
    Request(String),
}

/// The most a chat template may render from a body of `body_bytes`: 8 bytes per body
/// byte, plus 64 KiB for the template's own text (a fixed system prompt). A template
/// that prints tools with `tojson(indent=4)` turns each `0,` of a deeply nested
/// argument schema into a line of hundreds of spaces: a 64 KiB body rendered about
/// 16 MB, rendered and encoded inline, and an 8 MiB one about 2 GB (an allocation
/// failure aborts the process). Pretty-printing a real schema costs 2-4x.
pub fn rendered_cap(body_bytes: usize) -> usize {
    body_bytes.saturating_mul(8).saturating_add(64 << 10)
}

thread_local! {
    /// The cap of the render running on this thread ([`rendered_cap`]): `tojson` lays
    /// its output out under it too, since a filter's whole output is built before the
    /// render writes any of it (a capped writer alone would still let `tojson` build
    /// the 2 GB string).
    static RENDER_CAP: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// Largest tokenizer, template or `tokenizer_config.json` file read, bytes: the
/// largest real `tokenizer.json` files are about 35 MB.
pub const MAX_TOKENIZER_FILE_BYTES: u64 = 64 << 20;

/// A request's prompt token ids ([`EngineTokenizer::tokenize_prompt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptIds {
    /// Every prompt's ids, a completions batch's one after the other: what the hash
    /// chain is built from, and what the engine's `usage.prompt_tokens` counts.
    pub ids: Vec<u32>,
    /// Tokens of the longest prompt: all of `ids` but for a batch. The engine checks a
    /// batch against its context prompt by prompt (vLLM does), so this, not the
    /// total, is what the context check compares.
    pub longest_prompt_tokens: usize,
}

/// The model's tokenizer and chat template, loaded once at startup.
pub struct EngineTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    chat_add_special_tokens: bool,
    source: PathBuf,
}

impl std::fmt::Debug for EngineTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineTokenizer")
            .field("source", &self.source)
            .field("chat_template", &self.template.is_some())
            .field("chat_add_special_tokens", &self.chat_add_special_tokens)
            .finish()
    }
}

/// A compiled chat template with the special-token strings it is rendered with.
struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template loops over content parts ([`loops_over_content`]): a message's
    /// content array is left as it is, not joined into a string.
    takes_content_parts: bool,
}

/// Name of the one template in a [`ChatTemplate`]'s environment.
const TEMPLATE: &str = "chat";

/// What `tokenizer_config.json` (HF's file beside `tokenizer.json`) says that matters.
#[derive(Debug, Default)]
struct TokenizerConfig {
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: Option<bool>,
    add_eos_token: Option<bool>,
}

impl EngineTokenizer {
    /// Load `tokenizer` (a `tokenizer.json`) and the chat template: from
    /// `chat_template` (a Jinja file, or a `chat_template.json` holding one) when given,
    /// else from `tokenizer_config.json` beside the tokenizer. That file, when present,
    /// also gives `bos_token`, `eos_token`, and `add_bos_token` / `add_eos_token`, which
    /// (as HF's Llama tokenizers do) rebuild the post-processor that adds them.
    ///
    /// No template at all is not an error here (a completions-only engine needs none);
    /// chat requests then fail with [`TokenizerError::Request`]. The template is test-
    /// rendered on a one-message conversation, so one that calls something missing
    /// fails at startup. Each file is read with a cap ([`MAX_TOKENIZER_FILE_BYTES`]).
    pub fn load(
        tokenizer: &Path,
        chat_template: Option<&Path>,
        chat_add_special_tokens: bool,
    ) -> Result<Self, TokenizerError> {
        let bad_tokenizer = |reason: String| TokenizerError::Config {
            field: "tokenizer",
            reason: format!("{}: {reason}", tokenizer.display()),
        };
        let text = gorgo_files::read_capped(tokenizer, MAX_TOKENIZER_FILE_BYTES)
            .map_err(|e| bad_tokenizer(e.to_string()))?;
        let mut tok: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| bad_tokenizer(format!("not a tokenizer.json: {e}")))?;
        // HF's `__call__` turns both off on every call unless asked (`no_truncation`,
        // `no_padding`), so an engine never truncates or pads a prompt with what the
        // file sets: kept, they would cap or inflate every count.
        tok.with_truncation(None)
            .map_err(|e| bad_tokenizer(format!("cannot clear its truncation: {e}")))?;
        tok.with_padding(None);
        let config_path = tokenizer.with_file_name("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_tokenizer_config(&config_path).map_err(|reason| TokenizerError::Config {
                field: "tokenizer",
                reason: format!("{}: {reason}", config_path.display()),
            })?
        } else {
            TokenizerConfig::default()
        };
        if config.add_bos_token.is_some() || config.add_eos_token.is_some() {
            let processor = special_tokens_processor(&tok, &config).map_err(bad_tokenizer)?;
            tok.with_post_processor(Some(processor));
        }
        let source = match chat_template {
            Some(path) => Some(read_template_file(path)?),
            None => config.chat_template.clone(),
        };
        let template = match source {
            None => None,
            Some(source) => Some(
                ChatTemplate::compile(
                    source,
                    config.bos_token.clone().unwrap_or_default(),
                    config.eos_token.clone().unwrap_or_default(),
                )
                .map_err(|reason| TokenizerError::Config {
                    field: "chat_template",
                    reason: match chat_template {
                        Some(p) => format!("{}: {reason}", p.display()),
                        None => format!("{} (`chat_template`): {reason}", config_path.display()),
                    },
                })?,
            ),
        };
        Ok(EngineTokenizer {
            tokenizer: tok,
            template,
            chat_add_special_tokens,
            source: tokenizer.to_owned(),
        })
    }

    /// Whether a chat template was found (chat requests can be counted).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The `tokenizer.json` this was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The chat prompt the engine builds from a `chat/completions` body.
    pub fn render_chat(&self, body: &[u8]) -> Result<String, TokenizerError> {
        Ok(self.rendered_chat(body)?.text)
    }

    /// [`EngineTokenizer::render_chat`], with what the body asks of tokenising it.
    fn rendered_chat(&self, body: &[u8]) -> Result<RenderedChat, TokenizerError> {
        let template = self.template.as_ref().ok_or_else(|| {
            TokenizerError::Request(
                "chat requests cannot be counted: the tokenizer has no chat template".into(),
            )
        })?;
        // Parsed into template values directly, which keep the client's key order (the
        // engine's Python dicts do; `tojson` of tools must print them as it does).
        let cap = rendered_cap(body.len());
        let body: Value = serde_json::from_slice(body)
            .map_err(|e| TokenizerError::Request(format!("body is not JSON: {e}")))?;
        Ok(RenderedChat {
            text: template.render_capped(&body, cap)?,
            tokenising: Tokenising::of(|name| chat_field(&body, name))?,
        })
    }

    /// The prompt's token ids as the engine counts them (see the crate docs); a
    /// batch's prompts one after the other.
    pub fn prompt_ids(&self, endpoint: Endpoint, body: &[u8]) -> Result<Vec<u32>, TokenizerError> {
        Ok(self.tokenize_prompt(endpoint, body)?.ids)
    }

    /// The prompt's token ids as [`EngineTokenizer::prompt_ids`] gives them, with the
    /// size of its longest prompt, which the context check needs.
    pub fn tokenize_prompt(
        &self,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Result<PromptIds, TokenizerError> {
        let prompts = self.each_prompt_ids(endpoint, body)?;
        Ok(PromptIds {
            longest_prompt_tokens: prompts.iter().map(Vec::len).max().unwrap_or(0),
            ids: prompts.concat(),
        })
    }

    /// Each prompt's token ids on its own: one prompt for chat and for a single
    /// completions prompt, one per prompt of a completions batch, which an engine
    /// serves as a sequence of its own (the emulator does, as vLLM and SGLang do).
    pub fn each_prompt_ids(
        &self,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Result<Vec<Vec<u32>>, TokenizerError> {
        match endpoint {
            Endpoint::Chat => {
                let chat = self.rendered_chat(body)?;
                let specials = chat
                    .tokenising
                    .add_special_tokens
                    .unwrap_or(self.chat_add_special_tokens);
                let ids = self.encode(&chat.text, specials)?;
                Ok(vec![chat.tokenising.kept(ids)])
            }
            Endpoint::Completions => {
                let body: serde_json::Value = serde_json::from_slice(body)
                    .map_err(|e| TokenizerError::Request(format!("body is not JSON: {e}")))?;
                self.completion_ids(&body)
            }
        }
    }

    /// A completions body's prompts' ids: its `prompt` read as the canonical path reads
    /// it ([`CompletionsPrompt`]), each string tokenised with special tokens added
    /// unless the body says `"add_special_tokens": false` (vLLM's parameter), token ids
    /// as they are.
    fn completion_ids(&self, body: &serde_json::Value) -> Result<Vec<Vec<u32>>, TokenizerError> {
        let prompt = CompletionsPrompt::of_body(body).map_err(|e| match e {
            gorgo_core::CoreError::InvalidRequest(m) => TokenizerError::Request(m),
            other => TokenizerError::Request(other.to_string()),
        })?;
        let tokenising = Tokenising::of(|name| body.get(name).cloned())?;
        let specials = tokenising.add_special_tokens.unwrap_or(true);
        let prompts = match prompt {
            CompletionsPrompt::Text(s) => vec![self.encode(s, specials)?],
            CompletionsPrompt::TextBatch(prompts) => prompts
                .into_iter()
                .map(|s| self.encode(s, specials))
                .collect::<Result<_, _>>()?,
            CompletionsPrompt::TokenIds(ids) => vec![ids],
            CompletionsPrompt::TokenIdBatch(prompts) => prompts,
        };
        Ok(prompts.into_iter().map(|p| tokenising.kept(p)).collect())
    }

    /// Tokenise `text`, special tokens written in it parsed as such; with
    /// `add_special_tokens` the tokenizer's post-processor adds its own (BOS, ...).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Request(format!("cannot tokenize the prompt: {e}")))
    }
}

fn read_template_file(path: &Path) -> Result<String, TokenizerError> {
    let bad = |reason: String| TokenizerError::Config {
        field: "chat_template",
        reason: format!("{}: {reason}", path.display()),
    };
    let text =
        gorgo_files::read_capped(path, MAX_TOKENIZER_FILE_BYTES).map_err(|e| bad(e.to_string()))?;
    if path.extension().is_some_and(|e| e == "json") {
        // `chat_template.json`, as newer HF repositories ship it.
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        return template_of(v.get("chat_template"))
            .ok_or_else(|| bad("no string `chat_template` in it".into()));
    }
    Ok(text)
}

/// A `chat_template` value: a string, or HF's list of named templates (`default`, else
/// the first).
fn template_of(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => {
            let template = |t: &serde_json::Value| t.get("template")?.as_str().map(str::to_owned);
            named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(template)
                .or_else(|| named.first().and_then(template))
        }
        _ => None,
    }
}

fn read_tokenizer_config(path: &Path) -> Result<TokenizerConfig, String> {
    let text =
        gorgo_files::read_capped(path, MAX_TOKENIZER_FILE_BYTES).map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
    // A special token is a string, or an AddedToken object with its `content`.
    let token = |key: &str| match v.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        t => t.get("content")?.as_str().map(str::to_owned),
    };
    Ok(TokenizerConfig {
        chat_template: template_of(v.get("chat_template")),
        bos_token: token("bos_token"),
        eos_token: token("eos_token"),
        add_bos_token: v.get("add_bos_token").and_then(serde_json::Value::as_bool),
        add_eos_token: v.get("add_eos_token").and_then(serde_json::Value::as_bool),
    })
}

/// HF's `LlamaTokenizerFast.update_post_processor`: `bos? $A eos?` (and the pair form)
/// from `add_bos_token` (default on) and `add_eos_token` (default off).
fn special_tokens_processor(
    tok: &tokenizers::Tokenizer,
    config: &TokenizerConfig,
) -> Result<tokenizers::processors::PostProcessorWrapper, String> {
    use tokenizers::processors::template::TemplateProcessing;
    let mut specials = Vec::new();
    let mut wanted =
        |flag: bool, token: &Option<String>, name: &str| -> Result<Option<String>, String> {
            if !flag {
                return Ok(None);
            }
            let t = token
                .clone()
                .ok_or_else(|| format!("`add_{name}_token` is set but `{name}_token` is not"))?;
            let id = tok
                .token_to_id(&t)
                .ok_or_else(|| format!("`{name}_token` {t:?} is not in the vocabulary"))?;
            specials.push((t.clone(), id));
            Ok(Some(t))
        };
    let bos = wanted(
        config.add_bos_token.unwrap_or(true),
        &config.bos_token,
        "bos",
    )?;
    let eos = wanted(
        config.add_eos_token.unwrap_or(false),
        &config.eos_token,
        "eos",
    )?;
    let wrap = |seq: &str, type_id: u8| {
        let mut parts = Vec::new();
        if let Some(b) = &bos {
            parts.push(format!("{b}:{type_id}"));
        }
        parts.push(format!("${seq}:{type_id}"));
        if let Some(e) = &eos {
            parts.push(format!("{e}:{type_id}"));
        }
        parts.join(" ")
    };
    let single = wrap("A", 0);
    let pair = format!("{} {}", wrap("A", 0), wrap("B", 1));
    let processor = TemplateProcessing::builder()
        .try_single(single.as_str())
        .map_err(|e| e.to_string())?
        .try_pair(pair.as_str())
        .map_err(|e| e.to_string())?
        .special_tokens(specials)
        .build()
        .map_err(|e| e.to_string())?;
    Ok(processor.into())
}

/// A chat body's prompt text, and how the body asks for it to be tokenised.
struct RenderedChat {
    text: String,
    tokenising: Tokenising,
}

/// vLLM's request fields (on both endpoints) that change a prompt's ids after the
/// text: `add_special_tokens` turns the tokenizer's own special tokens (BOS) on or off
/// (`None`: the endpoint's default), and `truncate_prompt_tokens` keeps each prompt's
/// last N ids (`None`: all; vLLM's -1, "to the context length", is left to the
/// engine's own check).
struct Tokenising {
    add_special_tokens: Option<bool>,
    truncate_to: Option<usize>,
}

impl Tokenising {
    /// Read from a body whose field `name` is `field(name)` (`None` when absent).
    fn of(field: impl Fn(&str) -> Option<serde_json::Value>) -> Result<Tokenising, TokenizerError> {
        const TRUNCATE: &str = "truncate_prompt_tokens";
        let truncate_to = match field(TRUNCATE) {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(-1 | 0) => None,
                Some(n) if n > 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
                _ => {
                    return Err(TokenizerError::Request(format!(
                        "`{TRUNCATE}` must be an integer of at least -1"
                    )))
                }
            },
        };
        Ok(Tokenising {
            add_special_tokens: bool_of(ADD_SPECIAL_TOKENS, field(ADD_SPECIAL_TOKENS))?,
            truncate_to,
        })
    }

    /// `ids` as the engine keeps them: the last `truncate_to`.
    fn kept(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let Some(n) = self.truncate_to.filter(|&n| n < ids.len()) {
            ids.drain(..ids.len() - n);
        }
        ids
    }
}

/// The field (vLLM's, on both endpoints) that turns the tokenizer's own special tokens
/// (BOS) on or off.
const ADD_SPECIAL_TOKENS: &str = "add_special_tokens";

/// A chat body's field `name` as JSON, `None` when absent.
fn chat_field(body: &Value, name: &str) -> Option<serde_json::Value> {
    let v = body.get_attr(name).ok().filter(|v| !v.is_undefined())?;
    serde_json::to_value(&v).ok()
}

/// The request's boolean `name` from its value `v`; `None` when absent or `null` (a
/// `null` key is no key, as to the engines).
fn bool_of(name: &str, v: Option<serde_json::Value>) -> Result<Option<bool>, TokenizerError> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Bool(b)) => Ok(Some(b)),
        Some(_) => Err(TokenizerError::Request(format!(
            "`{name}` must be a boolean"
        ))),
    }
}

/// The fuel ([`minijinja::Environment::set_fuel`]: about one per instruction, and one
/// per 64 bytes of data) a render whose output is capped at `cap` bytes may burn: 16
/// per byte of the cap, so 128 per body byte plus 1 Mi. The output cap bounds what a
/// render writes, not how long it loops: a template that compares every message with
/// every other one spends its time and writes little, and held a tokenizing thread
/// for minutes. Measured with the fixture's ChatML template, a render burns 0.2-0.3
/// per body byte on `fixtures/chat-prompts.jsonl` and 1.0 on 5,000 messages of two
/// bytes each: the budget leaves templates ten times as busy a wide margin.
fn render_fuel(cap: usize) -> u64 {
    (cap as u64).saturating_mul(16)
}

/// The arguments every chat render gets, beside `messages` and the request's
/// `chat_template_kwargs`.
#[derive(Serialize)]
struct RenderContext<'a> {
    messages: &'a Value,
    tools: Value,
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
}

impl ChatTemplate {
    /// Compile `source` in an environment set up as HF's (`transformers`'
    /// `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with loop
    /// controls, its `tojson`, `raise_exception` and `strftime_now`), then render a
    /// one-message conversation to catch templates that need what we lack.
    fn compile(source: String, bos_token: String, eos_token: String) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let takes_content_parts = loops_over_content(&source);
        env.add_template_owned(TEMPLATE, source)
            .map_err(|e| format!("template does not compile: {e:#}"))?;
        let template = ChatTemplate {
            env,
            bos_token,
            eos_token,
            takes_content_parts,
        };
        let probe = Value::from(Serde(serde_json::json!({
            "messages": [{"role": "user", "content": "hello"}]
        })));
        template
            .render(&probe)
            .map_err(|e| format!("template does not render a one-message chat: {e}"))?;
        Ok(template)
    }

    fn render(&self, body: &Value) -> Result<String, TokenizerError> {
        self.render_capped(body, usize::MAX)
    }

    /// [`ChatTemplate::render`], refused once the output passes `cap` bytes
    /// ([`rendered_cap`]).
    fn render_capped(&self, body: &Value, cap: usize) -> Result<String, TokenizerError> {
        let field = |name: &str| body.get_attr(name).ok().filter(|v| !v.is_undefined());
        let messages = field("messages")
            .ok_or_else(|| TokenizerError::Request("missing `messages`".into()))?;
        let messages = engine_messages(&messages, self.takes_content_parts)?;
        let tools = field("tools")
            .filter(|t| t.len().is_some_and(|n| n > 0))
            .unwrap_or(Value::from(()));
        // vLLM's and SGLang's request fields, rendered as HF's `apply_chat_template`
        // renders them (vLLM calls it): `continue_final_message` leaves the last
        // message open for the model to go on with, which a generation prompt would
        // close.
        let flag = |name: &str| bool_of(name, chat_field(body, name));
        let continue_final = flag("continue_final_message")?.unwrap_or(false);
        let add_generation_prompt = flag("add_generation_prompt")?.unwrap_or(true);
        if continue_final && add_generation_prompt {
            return Err(TokenizerError::Request(
                "`continue_final_message` needs `\"add_generation_prompt\": false`: \
                 the generation prompt would close the message to continue"
                    .into(),
            ));
        }
        let base = Value::from(Serde(RenderContext {
            messages: &messages,
            tools,
            add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
        }));
        // vLLM and SGLang pass `chat_template_kwargs` (e.g. `enable_thinking`) to the
        // template; the fixed arguments win over them.
        let ctx = match field("chat_template_kwargs") {
            Some(extra) if extra.kind() == ValueKind::Map => {
                minijinja::context! { ..base, ..extra }
            }
            _ => base,
        };
        // Fuel is the environment's; a clone (its templates and functions are shared)
        // carries this render's budget.
        let mut env = self.env.clone();
        env.set_fuel(Some(render_fuel(cap)));
        let template = env
            .get_template(TEMPLATE)
            .map_err(|e| TokenizerError::Request(e.to_string()))?;
        let mut w = pyjson::CappedWriter::new(cap);
        let outer = RENDER_CAP.replace(cap);
        let rendered = template.render_captured_to(ctx, &mut w);
        RENDER_CAP.set(outer);
        match rendered {
            Ok(_) => {
                let text = String::from_utf8(w.out).map_err(|e| {
                    TokenizerError::Request(format!(
                        "the chat template rendered invalid UTF-8: {e}"
                    ))
                })?;
                if continue_final {
                    continued(text, &messages)
                } else {
                    Ok(text)
                }
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TokenizerError::Request(format!(
                "the chat template takes too long on this request: it ran past {} steps",
                render_fuel(cap)
            ))),
            Err(e) if w.left == 0 || e.to_string().contains(pyjson::OVER_CAP) => {
                Err(TokenizerError::Request(format!(
                "the chat template renders this request to more than {cap} bytes (8 per body byte, plus 64 KiB)"
            )))
            }
            Err(e) => Err(TokenizerError::Request(format!(
                "the chat template cannot render this request: {e}"
            ))),
        }
    }
}

/// `rendered` cut just after the last message's text, as HF's `apply_chat_template`
/// cuts it for `continue_final_message`: at the last place the text (stripped) appears,
/// keeping its trailing whitespace when the template kept it; a content-parts message
/// continues its last text part.
fn continued(mut rendered: String, messages: &Value) -> Result<String, TokenizerError> {
    let refuse =
        |why: &str| TokenizerError::Request(format!("`continue_final_message` is set but {why}"));
    let last = messages
        .len()
        .and_then(|n| n.checked_sub(1))
        .and_then(|i| messages.get_item_by_index(i).ok())
        .ok_or_else(|| refuse("there is no message to continue"))?;
    let content = last.get_attr("content").unwrap_or_default();
    let text = if content.kind() == ValueKind::Seq {
        iter_of(&content)?
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .find_map(|part| part.get_attr("text").ok().filter(|t| !t.is_undefined()))
            .ok_or_else(|| refuse("the final message has no text to continue"))?
    } else {
        content
    };
    let text = text
        .as_str()
        .ok_or_else(|| refuse("the final message's text is not a string"))?;
    let stripped = text.trim();
    let at = rendered.rfind(stripped).ok_or_else(|| {
        refuse("the chat template does not write the final message's text as sent")
    })?;
    let lstripped = text.trim_start();
    let end = if rendered.get(at..at + lstripped.len()) == Some(text) {
        at + lstripped.len()
    } else {
        at + stripped.len()
    };
    rendered.truncate(end);
    Ok(rendered)
}

/// `messages` as vLLM hands them to the template (its "string" content format, the one
/// templates that write `message.content` as a string need): a message's content parts
/// joined with "\n" into one string (unless `takes_content_parts`: the template loops
/// over them, and gets them as [`engine_content_parts`] gives them), each part read as
/// the canonical path reads it ([`gorgo_core::prompt::content_part_text`]: a non-text
/// part is a placeholder that tells two images apart), `null` or missing content as
/// "", and an assistant's
/// tool-call arguments as objects ([`parsed_tool_arguments`]). Anything that is not a
/// list of objects is left for the template to refuse.
fn engine_messages(messages: &Value, takes_content_parts: bool) -> Result<Value, TokenizerError> {
    if messages.kind() != ValueKind::Seq {
        return Ok(messages.clone());
    }
    let mut out = Vec::with_capacity(messages.len().unwrap_or(0));
    for (i, message) in iter_of(messages)?.enumerate() {
        out.push(engine_message(i, message, takes_content_parts)?);
    }
    Ok(Value::from(out))
}

/// One message of [`engine_messages`], its keys in the client's order.
fn engine_message(
    i: usize,
    message: Value,
    takes_content_parts: bool,
) -> Result<Value, TokenizerError> {
    if message.kind() != ValueKind::Map {
        return Ok(message);
    }
    let assistant = message
        .get_attr("role")
        .is_ok_and(|r| r.as_str() == Some("assistant"));
    let mut pairs = Vec::with_capacity(message.len().unwrap_or(0) + 1);
    let mut has_content = false;
    for key in iter_of(&message)? {
        let value = message
            .get_item(&key)
            .map_err(|e| TokenizerError::Request(e.to_string()))?;
        // A key sent as `null` is no key to the engines (SGLang drops every None
        // field, vLLM rebuilds the message from the ones set): templates test
        // `'tool_calls' in message` and then take its length, which fails on none
        // (SDKs re-send an assistant message with `"tool_calls": null`).
        if value.is_none() && key.as_str() != Some("content") {
            continue;
        }
        let value = match key.as_str() {
            Some("content") => {
                has_content = true;
                match takes_content_parts {
                    false => engine_content(i, &value)?,
                    true => engine_content_parts(i, &value)?,
                }
            }
            Some("tool_calls") if assistant => parsed_tool_arguments(&value),
            _ => value,
        };
        pairs.push((key, value));
    }
    if !has_content {
        let none = if takes_content_parts {
            Value::from(Vec::<Value>::new())
        } else {
            Value::from("")
        };
        pairs.push((Value::from("content"), none));
    }
    Ok(Value::from_pairs(pairs))
}

/// A message's content as [`engine_messages`] says.
fn engine_content(i: usize, content: &Value) -> Result<Value, TokenizerError> {
    if content.is_none() || content.is_undefined() {
        return Ok(Value::from(""));
    }
    if content.kind() != ValueKind::Seq {
        return Ok(content.clone());
    }
    let mut texts = Vec::with_capacity(content.len().unwrap_or(0));
    for (j, part) in iter_of(content)?.enumerate() {
        let bad = |e: &str| TokenizerError::Request(format!("`messages[{i}].content[{j}]` {e}"));
        let part = serde_json::to_value(&part).map_err(|e| bad(&e.to_string()))?;
        texts.push(
            gorgo_core::prompt::content_part_text(&part)
                .map_err(bad)?
                .into_owned(),
        );
    }
    Ok(Value::from(texts.join("\n")))
}

/// A message's content as vLLM's "openai" content format gives it to a template that
/// loops over the parts: always a list (`null` or missing content is empty, a string
/// one text part), each text-like part (`text`, `input_text`, `output_text`,
/// `refusal`, `thinking`) as `{"type": "text", "text": ...}` (one without its text
/// left out), each media part as `{"type": "image"}`, `"audio"` or `"video"` (what
/// templates test to write their placeholder token). A part of another type is
/// refused, as vLLM refuses it.
fn engine_content_parts(i: usize, content: &Value) -> Result<Value, TokenizerError> {
    let text = |t: Value| Value::from_pairs([("type", Value::from("text")), ("text", t)]);
    if content.is_none() || content.is_undefined() {
        return Ok(Value::from(Vec::<Value>::new()));
    }
    if content.kind() == ValueKind::String {
        return Ok(Value::from(vec![text(content.clone())]));
    }
    if content.kind() != ValueKind::Seq {
        return Ok(content.clone());
    }
    let mut parts = Vec::with_capacity(content.len().unwrap_or(0));
    for (j, part) in iter_of(content)?.enumerate() {
        if part.kind() == ValueKind::String {
            parts.push(text(part));
            continue;
        }
        let kind = part.get_attr("type").unwrap_or_default();
        let field = match kind.as_str() {
            Some("text" | "input_text" | "output_text") => "text",
            Some(other @ ("refusal" | "thinking")) => other,
            Some("image_url" | "input_image" | "image_pil" | "image_embeds") => {
                parts.push(Value::from_pairs([("type", "image")]));
                continue;
            }
            Some("audio_url" | "input_audio" | "audio_embeds") => {
                parts.push(Value::from_pairs([("type", "audio")]));
                continue;
            }
            Some("video_url") => {
                parts.push(Value::from_pairs([("type", "video")]));
                continue;
            }
            _ => {
                return Err(TokenizerError::Request(format!(
                    "`messages[{i}].content[{j}]` has a `type` the engine does not take: {kind}"
                )))
            }
        };
        match part.get_attr(field) {
            Ok(t) if !t.is_undefined() && !t.is_none() => parts.push(text(t)),
            _ => {}
        }
    }
    Ok(Value::from(parts))
}

/// An assistant's `tool_calls` with each call's `function.arguments` given as a JSON
/// string (OpenAI's form) parsed into the object it holds, as vLLM does before the
/// template (templates print them with `tojson` and expect an object); its keys keep
/// the string's order, as Python's `json.loads` keeps them. Arguments that are not a
/// string holding a JSON object stay as they are.
fn parsed_tool_arguments(calls: &Value) -> Value {
    if calls.kind() != ValueKind::Seq {
        return calls.clone();
    }
    let Ok(items) = calls.try_iter() else {
        return calls.clone();
    };
    let parsed = |call: Value| -> Option<Value> {
        let function = call.get_attr("function").ok()?;
        let arguments = function.get_attr("arguments").ok()?;
        let object: Value = serde_json::from_str(arguments.as_str()?).ok()?;
        if object.kind() != ValueKind::Map {
            return None;
        }
        let function = with_item(&function, "arguments", object)?;
        with_item(&call, "function", function)
    };
    items
        .map(|call| parsed(call.clone()).unwrap_or(call))
        .collect()
}

/// `map` with `key`'s value replaced, the keys in their order (`None`: not a map).
fn with_item(map: &Value, key: &str, value: Value) -> Option<Value> {
    if map.kind() != ValueKind::Map {
        return None;
    }
    let pairs: Vec<(Value, Value)> = map
        .try_iter()
        .ok()?
        .map(|k| {
            let v = if k.as_str() == Some(key) {
                value.clone()
            } else {
                map.get_item(&k).unwrap_or_default()
            };
            (k, v)
        })
        .collect();
    Some(Value::from_pairs(pairs))
}

/// Whether a template loops over a message's content parts (`{% for part in
/// message['content'] %}`, `message.content`, `m["content"]`): vLLM then hands it the
/// content as a list of parts (its "openai" content format, [`engine_content_parts`])
/// instead of the joined string, which such a template would iterate character by character. vLLM
/// looks for that loop in the template's syntax tree; this looks at each `{% for %}`
/// statement of its source: the iterable, up to a filter, a condition or the end,
/// reads a `content` member (sliced, parenthesised or through `.get` too).
fn loops_over_content(source: &str) -> bool {
    source.split("{%").skip(1).any(|block| {
        let statement = block.split("%}").next().unwrap_or("");
        let statement = statement.trim_start_matches(['-', '+']).trim_start();
        let Some(rest) = statement
            .strip_prefix("for")
            .filter(|r| r.starts_with(char::is_whitespace))
        else {
            return false;
        };
        let Some((_, iterable)) = rest.split_once(" in ") else {
            return false;
        };
        let iterable = iterable
            .trim_start()
            .split(|c: char| c.is_whitespace() || c == '|')
            .next()
            .unwrap_or("")
            .trim_end_matches(['-', '+']);
        // The member itself, sliced, parenthesised or through `.get` loops over the
        // parts (`message['content'][1:]`, `(message.content)`,
        // `message.get('content')`); one its value is only the start of
        // (`message.content.split('\n')`, a string method) does not.
        [
            ".content",
            "['content']",
            "[\"content\"]",
            ".get('content'",
            ".get(\"content\"",
        ]
        .iter()
        .any(|access| {
            iterable.match_indices(access).any(|(at, _)| {
                matches!(
                    iterable[at + access.len()..].chars().next(),
                    None | Some('[' | ')' | ',')
                )
            })
        })
    })
}

/// The items of a sequence, or the keys of a map.
fn iter_of(value: &Value) -> Result<minijinja::value::ValueIter, TokenizerError> {
    value
        .try_iter()
        .map_err(|e| TokenizerError::Request(e.to_string()))
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// HF's `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=..., separators=...,
/// sort_keys=...)`, unlike minijinja's HTML-safe one, so tool definitions print as the
/// engine prints them.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: `separators` must be two strings",
            ))
        }
        // Python's defaults: ", " / ": ", and "," before a newline when indenting.
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let style = pyjson::Style {
        item,
        key,
        indent,
        ensure_ascii,
    };
    let text = if sort_keys {
        // serde_json's map is sorted by key.
        let sorted = serde_json::to_value(value)
            .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
        pyjson::dumps(&sorted, &style, RENDER_CAP.get())
    } else {
        pyjson::dumps(value, &style, RENDER_CAP.get())
    }
    .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e))?;
    Ok(Value::from_safe_string(text))
}

/// `strftime_now(format)`: the current UTC time (transformers passes local time; a node
/// runs in UTC) formatted with the common `strftime` fields (`%d %b %B %Y %y %m %H %M
/// %S %A %a %j %%`), for templates that print today's date (Llama 3).
fn strftime_now(format: String) -> Result<Value, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs).map(Value::from)
}

fn strftime(format: &str, unix_secs: u64) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (unix_secs / 86_400) as i64;
    let secs = unix_secs % 86_400;
    let (year, month, day) = gorgo_core::calendar::civil_from_days(days);
    // Day of the year: days since the year's first day.
    let yday = days - gorgo_core::calendar::days_from_civil(year, 1, 1) + 1;
    let weekday = DAYS[(days.rem_euclid(7)) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported field %{}", other.unwrap_or(' ')),
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
