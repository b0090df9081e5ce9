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
//!   HF's `tojson`, `raise_exception`, `strftime_now`) with the arguments the engine
//!   passes it, which vLLM and SGLang build differently
//!   ([`EngineTokenizer::for_engine`]; vLLM's unless told, and for `openai` engines):
//!   - `messages`: content parts joined into one string, vLLM's text-like parts with
//!     "\n", SGLang's text parts with " " (its other parts left out), unless the
//!     template wants the parts (its `{% for %}` loops over a message's content; for
//!     SGLang also any template naming a medium), which then get them as the engine
//!     lists them, a tool result's text parts still one string; `null` content as "";
//!     a tool call's `arguments` string parsed (vLLM: any JSON value, `{}` for none;
//!     SGLang: a JSON object or the request is refused); SGLang makes a last
//!     assistant message the user's, or with `continue_final_message` writes its text
//!     after the render;
//!   - `tools` (none when absent or empty) as the engine's pydantic model dumps each
//!     (vLLM: `type`, `function` {`name`, `description`, `parameters`, the client's
//!     other keys}; SGLang: `type`, `function` {`description`, `name`, `parameters`,
//!     `strict`}, `defer_loading`; missing fields as their defaults); SGLang gives
//!     none on `"tool_choice": "none"`, only the named one on a named choice, and
//!     renders again with the bare functions when its dump fails the template;
//!   - `add_generation_prompt` (vLLM: the request's, default true; SGLang: always),
//!     `documents` (vLLM: the request's), `bos_token`, `eos_token`, and the request's
//!     `chat_template_kwargs` with its `reasoning_effort` (vLLM: the request's over
//!     the kwargs, and `enable_thinking` from it; SGLang: the kwargs over it).
//!
//!   With vLLM's `continue_final_message` the text is cut after the last message's, as
//!   HF cuts it. Each render has a fuel budget (a step count) in proportion to the
//!   body. The text is tokenised with special tokens parsed, and the tokenizer's own
//!   added tokens (BOS) when the request's `add_special_tokens` (vLLM's) says so, or
//!   else when `chat_add_special_tokens` does (vLLM and SGLang: no, the template
//!   writes `bos_token` itself; llama-cpp-python's built-in chat formats: yes).
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
use minijinja::value::{merge_maps, Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, ErrorKind};

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
            .field("rules", &self.template.as_ref().map(|t| t.rules))
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
    loops_over_parts: bool,
    /// The template's text names a medium (`image`, `audio`, `video`, `vision`), which
    /// SGLang takes for a template that wants content parts ([`names_media`]).
    names_media: bool,
    /// Whose rules turn a request into the template's arguments.
    rules: Rules,
}

/// Whose rules turn a chat request into the template's arguments: vLLM and SGLang
/// normalise a request differently before the same template sees it (content parts
/// joined with "\n" or " ", tools dumped in another key order, the last assistant
/// message), so the count follows the kind of engine the node fronts
/// ([`EngineTokenizer::for_engine`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Rules {
    /// vLLM's (`vllm/entrypoints/chat_utils.py`, `vllm/renderers/hf.py`,
    /// `ChatCompletionRequest.build_chat_params`); also an `openai` engine's.
    #[default]
    Vllm,
    /// SGLang's (`serving_chat.py` `_process_messages` / `_apply_jinja_template`,
    /// `jinja_template_utils.py` `process_content_for_template_format`).
    Sglang,
}

impl Rules {
    /// The rules an engine of `kind` follows (`openai` counts as vLLM).
    fn of(kind: gorgo_core::EngineKind) -> Rules {
        match kind {
            gorgo_core::EngineKind::Sglang => Rules::Sglang,
            gorgo_core::EngineKind::Vllm | gorgo_core::EngineKind::Openai => Rules::Vllm,
        }
    }
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

    /// Count chat requests as an engine of `kind` builds them: vLLM's rules (the
    /// default, and an `openai` engine's) or SGLang's, which differ in how content parts
    /// are joined, how tools are dumped, and what becomes of a last assistant message
    /// (see the crate docs). The node and the emulator both say which engine they are.
    pub fn for_engine(mut self, kind: gorgo_core::EngineKind) -> Self {
        if let Some(t) = &mut self.template {
            t.rules = Rules::of(kind);
        }
        self
    }

    /// Whether engines of kinds `a` and `b` have their chat prompts counted by the
    /// same rules ([`EngineTokenizer::for_engine`]): a node counts every engine's
    /// prompts with one tokenizer, so its config refuses engines sharing one whose
    /// rules differ (one engine's counts and prefix hashes would be wrong).
    pub fn same_chat_rules(a: gorgo_core::EngineKind, b: gorgo_core::EngineKind) -> bool {
        Rules::of(a) == Rules::of(b)
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
        let loops_over_parts = loops_over_content(&source);
        let names_media = names_media(&source);
        env.add_template_owned(TEMPLATE, source)
            .map_err(|e| format!("template does not compile: {e:#}"))?;
        let template = ChatTemplate {
            env,
            bos_token,
            eos_token,
            loops_over_parts,
            names_media,
            rules: Rules::default(),
        };
        let probe = Value::from(Serde(serde_json::json!({
            "messages": [{"role": "user", "content": "hello"}]
        })));
        template
            .render(&probe)
            .map_err(|e| format!("template does not render a one-message chat: {e}"))?;
        Ok(template)
    }

    /// Whether messages reach the template with their content as a list of parts
    /// (the engine's "openai" content format) rather than one string: vLLM decides
    /// from the template's `{% for %}` loops over a message's content, SGLang also for
    /// any template that names a medium.
    fn takes_content_parts(&self) -> bool {
        match self.rules {
            Rules::Vllm => self.loops_over_parts,
            Rules::Sglang => self.names_media || self.loops_over_parts,
        }
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
        // vLLM's request fields, passed as HF's `apply_chat_template` takes them (vLLM
        // calls it): `continue_final_message` leaves the last message open for the
        // model to go on with, which a generation prompt would close. SGLang has no
        // `add_generation_prompt` (it always asks for the prompt) and continues the
        // last message its own way ([`sglang_final_assistant`]).
        let flag = |name: &str| bool_of(name, chat_field(body, name));
        let continue_final = flag("continue_final_message")?.unwrap_or(false);
        let add_generation_prompt = match self.rules {
            Rules::Vllm => flag("add_generation_prompt")?.unwrap_or(true),
            Rules::Sglang => true,
        };
        if self.rules == Rules::Vllm && continue_final && add_generation_prompt {
            return Err(TokenizerError::Request(
                "`continue_final_message` needs `\"add_generation_prompt\": false`: \
                 the generation prompt would close the message to continue"
                    .into(),
            ));
        }
        let mut messages = engine_messages(&messages, self.takes_content_parts(), self.rules)?;
        let mut continued_with = None;
        if self.rules == Rules::Sglang {
            (messages, continued_with) = sglang_final_assistant(messages, continue_final)?;
        }
        let tools = engine_tools(field("tools"), field("tool_choice"), self.rules);
        let rendered = match self.render_arguments(
            self.arguments(body, &messages, tools.clone(), add_generation_prompt),
            cap,
        ) {
            // SGLang renders again with each tool's `function` alone when its dump
            // fails the template (Mistral's templates expect them so).
            Err(Rendering::Failed(_)) if self.rules == Rules::Sglang && !tools.is_none() => {
                let functions = iter_of(&tools)?
                    .map(|t| match t.get_attr("function") {
                        Ok(f) if !f.is_undefined() => f,
                        _ => t,
                    })
                    .collect::<Vec<_>>();
                self.render_arguments(
                    self.arguments(
                        body,
                        &messages,
                        Value::from(functions),
                        add_generation_prompt,
                    ),
                    cap,
                )
            }
            other => other,
        };
        let text = rendered.map_err(|e| e.into_error(cap))?;
        match (self.rules, continue_final) {
            (Rules::Vllm, true) => continued(text, &messages),
            // SGLang writes the message it took off after the whole render.
            (Rules::Sglang, _) => Ok(text + continued_with.as_deref().unwrap_or("")),
            (Rules::Vllm, false) => Ok(text),
        }
    }

    /// The template's arguments as HF's `apply_chat_template` passes them to the
    /// render: its own (`messages`, `tools`, `documents`, `add_generation_prompt`) over
    /// the engine's keyword arguments over the tokenizer's special tokens (HF's
    /// `{**special_tokens_map, **kwargs}`: `chat_template_kwargs` can set `bos_token`).
    /// The keyword arguments: vLLM's `chat_template_kwargs` under the request's
    /// `documents` and `reasoning_effort` (with `enable_thinking` set from the latter
    /// unless the kwargs set it); SGLang's `reasoning_effort` under its
    /// `chat_template_kwargs`, and no `documents` of its own.
    fn arguments(
        &self,
        body: &Value,
        messages: &Value,
        tools: Value,
        add_generation_prompt: bool,
    ) -> Value {
        let request = |name: &str| {
            body.get_attr(name)
                .ok()
                .filter(|v| !v.is_undefined() && !v.is_none())
        };
        let kwargs = request("chat_template_kwargs")
            .filter(|k| k.kind() == ValueKind::Map)
            .unwrap_or_else(|| Value::from_pairs(Vec::<(Value, Value)>::new()));
        let effort = request("reasoning_effort");
        let extra = match self.rules {
            Rules::Vllm => {
                let mut set = Vec::new();
                if let Some(effort) = effort {
                    if kwargs
                        .get_attr("enable_thinking")
                        .is_ok_and(|v| v.is_undefined())
                    {
                        set.push((
                            "enable_thinking",
                            Value::from(effort.as_str() != Some("none")),
                        ));
                    }
                    set.push(("reasoning_effort", effort));
                }
                if let Some(documents) = request("documents") {
                    set.push(("documents", documents));
                }
                merge_maps([kwargs, Value::from_pairs(set)])
            }
            Rules::Sglang => {
                let set: Vec<_> = effort
                    .map(|e| ("reasoning_effort", e))
                    .into_iter()
                    .collect();
                merge_maps([Value::from_pairs(set), kwargs])
            }
        };
        let documents = extra
            .get_attr("documents")
            .ok()
            .filter(|d| !d.is_undefined())
            .unwrap_or(Value::from(()));
        let own = Value::from_pairs([
            ("messages", messages.clone()),
            ("tools", tools),
            ("documents", documents),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ]);
        let specials = Value::from_pairs([
            ("bos_token", self.bos_token.as_str()),
            ("eos_token", self.eos_token.as_str()),
        ]);
        merge_maps([specials, extra, own])
    }

    /// Render with the arguments `ctx`, the output capped at `cap` bytes and the
    /// steps at [`render_fuel`] of it.
    fn render_arguments(&self, ctx: Value, cap: usize) -> Result<String, Rendering> {
        // Fuel is the environment's; a clone (its templates and functions are shared)
        // carries this render's budget.
        let mut env = self.env.clone();
        env.set_fuel(Some(render_fuel(cap)));
        let template = env
            .get_template(TEMPLATE)
            .map_err(|e| Rendering::Failed(e.to_string()))?;
        let mut w = pyjson::CappedWriter::new(cap);
        let outer = RENDER_CAP.replace(cap);
        let rendered = template.render_captured_to(ctx, &mut w);
        RENDER_CAP.set(outer);
        match rendered {
            Ok(_) => String::from_utf8(w.out).map_err(|e| {
                Rendering::Refused(TokenizerError::Request(format!(
                    "the chat template rendered invalid UTF-8: {e}"
                )))
            }),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(Rendering::OutOfFuel),
            Err(e) if w.left == 0 || e.to_string().contains(pyjson::OVER_CAP) => {
                Err(Rendering::OverCap)
            }
            Err(e) => Err(Rendering::Failed(e.to_string())),
        }
    }
}

/// Why a render gave no text ([`ChatTemplate::render_arguments`]): only a template's
/// own failure is worth another try with other arguments (SGLang's tools fallback).
enum Rendering {
    /// The template raised, or could not do what it was told.
    Failed(String),
    /// The render ran past its fuel.
    OutOfFuel,
    /// The output passed the cap.
    OverCap,
    /// Refused for what it wrote.
    Refused(TokenizerError),
}

impl Rendering {
    /// The client's error for a render capped at `cap` bytes.
    fn into_error(self, cap: usize) -> TokenizerError {
        match self {
            Rendering::Failed(e) => TokenizerError::Request(format!(
                "the chat template cannot render this request: {e}"
            )),
            Rendering::OutOfFuel => TokenizerError::Request(format!(
                "the chat template takes too long on this request: it ran past {} steps",
                render_fuel(cap)
            )),
            Rendering::OverCap => TokenizerError::Request(format!(
                "the chat template renders this request to more than {cap} bytes (8 per body byte, plus 64 KiB)"
            )),
            Rendering::Refused(e) => e,
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

/// `messages` as the engine hands them to the template. vLLM's "string" content format
/// (the one templates that write `message.content` as a string need): a message's
/// content parts joined with "\n" into one string, each part read as the canonical
/// path reads it ([`gorgo_core::prompt::content_part_text`]: a non-text part is a
/// placeholder that tells two images apart); SGLang's: its text parts joined with " ",
/// other parts left out ([`sglang_content`]). With `parts` (the template loops over
/// them, [`ChatTemplate::takes_content_parts`]) the "openai" format instead:
/// [`engine_content_parts`] or [`sglang_content_parts`], a tool message's text parts
/// still joined (vLLM "\n", SGLang " "). Both: `null` or missing content as "" (vLLM's
/// "openai" format: no parts), `null` keys dropped, an assistant's tool-call arguments
/// as the engine parses them ([`engine_tool_calls`]). Anything that is not a list of
/// objects is left for the template to refuse.
fn engine_messages(messages: &Value, parts: bool, rules: Rules) -> Result<Value, TokenizerError> {
    if messages.kind() != ValueKind::Seq {
        return Ok(messages.clone());
    }
    let mut out = Vec::with_capacity(messages.len().unwrap_or(0));
    for (i, message) in iter_of(messages)?.enumerate() {
        out.push(engine_message(i, message, parts, rules)?);
    }
    Ok(Value::from(out))
}

/// One message of [`engine_messages`], its keys in the client's order.
fn engine_message(
    i: usize,
    message: Value,
    parts: bool,
    rules: Rules,
) -> Result<Value, TokenizerError> {
    if message.kind() != ValueKind::Map {
        return Ok(message);
    }
    let role = message.get_attr("role").unwrap_or_default();
    let role = role.as_str();
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
                engine_content(i, &value, role, parts, rules)?
            }
            Some("tool_calls") if role == Some("assistant") => {
                match engine_tool_calls(i, &value, rules)? {
                    Some(calls) => calls,
                    None => continue,
                }
            }
            _ => value,
        };
        pairs.push((key, value));
    }
    if !has_content {
        let content = engine_content(i, &Value::from(()), role, parts, rules)?;
        pairs.push((Value::from("content"), content));
    }
    Ok(Value::from_pairs(pairs))
}

/// A message's content as [`engine_messages`] says, for a message of `role`.
fn engine_content(
    i: usize,
    content: &Value,
    role: Option<&str>,
    parts: bool,
    rules: Rules,
) -> Result<Value, TokenizerError> {
    match (rules, parts) {
        (Rules::Vllm, false) => vllm_content(i, content),
        (Rules::Sglang, false) => sglang_content(i, content),
        (Rules::Vllm, true) => {
            let parts = engine_content_parts(i, content)?;
            // vLLM gives a tool message's parts to the template as one string when
            // they are all text: most templates write a tool result as a string.
            Ok(match role {
                Some("tool") => joined_text_parts(&parts, "\n")?.unwrap_or(parts),
                _ => parts,
            })
        }
        (Rules::Sglang, true) => {
            let parts = sglang_content_parts(i, content)?;
            Ok(match role {
                Some("tool") => joined_text_parts(&parts, " ")?.unwrap_or(parts),
                _ => parts,
            })
        }
    }
}

/// vLLM's "string" content: [`engine_messages`].
fn vllm_content(i: usize, content: &Value) -> Result<Value, TokenizerError> {
    if content.is_none() || content.is_undefined() {
        return Ok(Value::from(""));
    }
    if content.kind() != ValueKind::Seq {
        return Ok(content.clone());
    }
    let mut texts = Vec::with_capacity(content.len().unwrap_or(0));
    for (j, part) in iter_of(content)?.enumerate() {
        let bad = |e: &str| TokenizerError::Request(format!("`messages[{i}].content[{j}]` {e}"));
        match vllm_text_part(&part) {
            Some(Some(text)) => texts.push(
                text.as_str()
                    .ok_or_else(|| bad("has a text that is not a string"))?
                    .to_owned(),
            ),
            // vLLM leaves it out; the canonical path refuses it, and on the node first.
            Some(None) => return Err(bad("has no text")),
            None => {
                let part = serde_json::to_value(&part).map_err(|e| bad(&e.to_string()))?;
                texts.push(
                    gorgo_core::prompt::content_part_text(&part)
                        .map_err(bad)?
                        .into_owned(),
                );
            }
        }
    }
    Ok(Value::from(texts.join("\n")))
}

/// A content part vLLM reads as text (`_parse_chat_message_content_part`): a string, or
/// a `text`, `input_text` or `output_text` part (its `text`), a `refusal` or `thinking`
/// one (the field of that name); `Some(None)` for one without its text (left out).
/// `None`: a part of another type.
fn vllm_text_part(part: &Value) -> Option<Option<Value>> {
    if part.kind() == ValueKind::String {
        return Some(Some(part.clone()));
    }
    let field = match part_type(part)?.as_str() {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        _ => return None,
    };
    Some(
        part.get_attr(field)
            .ok()
            .filter(|t| !t.is_undefined() && !t.is_none()),
    )
}

/// SGLang's "string" content (`process_content_for_template_format`): the text of its
/// `text` and `input_text` parts joined with " ", every other part left out (an image
/// leaves no mark in the prompt), `null` as "".
fn sglang_content(i: usize, content: &Value) -> Result<Value, TokenizerError> {
    if content.is_none() || content.is_undefined() {
        return Ok(Value::from(""));
    }
    if content.kind() != ValueKind::Seq {
        return Ok(content.clone());
    }
    let mut texts = Vec::with_capacity(content.len().unwrap_or(0));
    for (j, part) in iter_of(content)?.enumerate() {
        if matches!(part_type(&part).as_deref(), Some("text" | "input_text")) {
            texts.push(part_text(i, j, &part)?);
        }
    }
    Ok(Value::from(texts.join(" ")))
}

/// SGLang's "openai" content (`process_content_for_template_format`): a string stays a
/// string, `null` is "", and a list keeps its `text` / `input_text` parts as
/// `{"type": "text", "text": ...}`, its media as `{"type": "image"}` (`"video"`,
/// `"audio"`), a `tool_reference` as it is, and drops the rest.
fn sglang_content_parts(i: usize, content: &Value) -> Result<Value, TokenizerError> {
    if content.is_none() || content.is_undefined() {
        return Ok(Value::from(""));
    }
    if content.kind() != ValueKind::Seq {
        return Ok(content.clone());
    }
    let mut parts = Vec::with_capacity(content.len().unwrap_or(0));
    for (j, part) in iter_of(content)?.enumerate() {
        let kind = part_type(&part);
        let medium = match kind.as_deref() {
            Some("text" | "input_text") => {
                parts.push(Value::from_pairs([
                    ("type", Value::from("text")),
                    ("text", Value::from(part_text(i, j, &part)?)),
                ]));
                continue;
            }
            Some("tool_reference") => {
                parts.push(part);
                continue;
            }
            Some("image_url" | "input_image") => "image",
            Some("video_url") => "video",
            Some("audio_url") => "audio",
            _ => continue,
        };
        parts.push(Value::from_pairs([("type", medium)]));
    }
    Ok(Value::from(parts))
}

/// A content part's `type`, when it is an object with a string one.
fn part_type(part: &Value) -> Option<String> {
    if part.kind() != ValueKind::Map {
        return None;
    }
    part.get_attr("type")
        .ok()
        .and_then(|t| t.as_str().map(str::to_owned))
}

/// The `text` of text part `j` of message `i`, which the engines require a string.
fn part_text(i: usize, j: usize, part: &Value) -> Result<String, TokenizerError> {
    part.get_attr("text")
        .ok()
        .and_then(|t| t.as_str().map(str::to_owned))
        .ok_or_else(|| {
            TokenizerError::Request(format!(
                "`messages[{i}].content[{j}].text` must be a string"
            ))
        })
}

/// A tool message's parts as the engines flatten them: when every part is text, their
/// texts joined with `separator` ("" for none); `None` when some part is not text, or
/// the content is not a list.
fn joined_text_parts(parts: &Value, separator: &str) -> Result<Option<Value>, TokenizerError> {
    if parts.kind() != ValueKind::Seq {
        return Ok(None);
    }
    let mut texts = Vec::with_capacity(parts.len().unwrap_or(0));
    for part in iter_of(parts)? {
        if part_type(&part).as_deref() != Some("text") {
            return Ok(None);
        }
        texts.push(
            part.get_attr("text")
                .ok()
                .and_then(|t| t.as_str().map(str::to_owned))
                .unwrap_or_default(),
        );
    }
    Ok(Some(Value::from(texts.join(separator))))
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
        match vllm_text_part(&part) {
            Some(Some(t)) => {
                parts.push(text(t));
                continue;
            }
            Some(None) => continue,
            None => {}
        }
        let kind = part.get_attr("type").unwrap_or_default();
        let medium = match kind.as_str() {
            Some("image_url" | "input_image" | "image_pil" | "image_embeds") => "image",
            Some("audio_url" | "input_audio" | "audio_embeds") => "audio",
            Some("video_url") => "video",
            _ => {
                return Err(TokenizerError::Request(format!(
                    "`messages[{i}].content[{j}]` has a `type` the engine does not take: {kind}"
                )))
            }
        };
        parts.push(Value::from_pairs([("type", medium)]));
    }
    Ok(Value::from(parts))
}

/// An assistant's `tool_calls` as the engine gives them to the template, which prints
/// each call's `function.arguments` with `tojson` and expects a value, not OpenAI's JSON
/// string. vLLM (`_postprocess_messages`): an empty list is no `tool_calls` (`None`
/// here), a string is parsed into the JSON value it holds (its keys in the string's
/// order, as `json.loads` keeps them) or `{}` when it holds no JSON, an object or a
/// list stays, anything else (`null`, a number) is `{}`. SGLang
/// (`normalize_assistant_tool_call_arguments`): a string must hold a JSON object
/// (anything else is the client's error, as SGLang answers it), other values stay.
fn engine_tool_calls(
    i: usize,
    calls: &Value,
    rules: Rules,
) -> Result<Option<Value>, TokenizerError> {
    if calls.kind() != ValueKind::Seq {
        return Ok(Some(calls.clone()));
    }
    if rules == Rules::Vllm && calls.len() == Some(0) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(calls.len().unwrap_or(0));
    for (j, call) in iter_of(calls)?.enumerate() {
        let function = call.get_attr("function").unwrap_or_default();
        if function.kind() != ValueKind::Map {
            out.push(call);
            continue;
        }
        let arguments = function.get_attr("arguments").unwrap_or_default();
        let parsed = match (rules, arguments.as_str()) {
            (Rules::Vllm, Some(text)) => {
                serde_json::from_str::<Value>(text).unwrap_or_else(|_| empty_map())
            }
            (Rules::Vllm, None) if matches!(arguments.kind(), ValueKind::Map | ValueKind::Seq) => {
                out.push(call);
                continue;
            }
            (Rules::Vllm, None) => empty_map(),
            (Rules::Sglang, Some(text)) => {
                let field = format!("`messages[{i}].tool_calls[{j}].function.arguments`");
                let value: Value = serde_json::from_str(text).map_err(|e| {
                    TokenizerError::Request(format!("{field} must be valid JSON: {e}"))
                })?;
                if value.kind() != ValueKind::Map {
                    return Err(TokenizerError::Request(format!(
                        "{field} must be a JSON object"
                    )));
                }
                value
            }
            (Rules::Sglang, None) => {
                out.push(call);
                continue;
            }
        };
        let call = with_item(&function, "arguments", parsed)
            .and_then(|function| with_item(&call, "function", function))
            .unwrap_or(call);
        out.push(call);
    }
    Ok(Some(Value::from(out)))
}

/// `{}`.
fn empty_map() -> Value {
    Value::from_pairs(Vec::<(Value, Value)>::new())
}

/// `map` with `key` set to `value`, the keys in their order, a new key last (`None`: not
/// a map).
fn with_item(map: &Value, key: &str, value: Value) -> Option<Value> {
    if map.kind() != ValueKind::Map {
        return None;
    }
    let mut found = false;
    let mut pairs: Vec<(Value, Value)> = map
        .try_iter()
        .ok()?
        .map(|k| {
            let v = if k.as_str() == Some(key) {
                found = true;
                value.clone()
            } else {
                map.get_item(&k).unwrap_or_default()
            };
            (k, v)
        })
        .collect();
    if !found {
        pairs.push((Value::from(key), value));
    }
    Some(Value::from_pairs(pairs))
}

/// SGLang's `_handle_last_assistant_message`, after its content is normalised: a last
/// assistant message with string content is taken off and its text written after the
/// render (`continue_final_message`, returned beside the messages), or else becomes a
/// user message of that content alone, so the prompt always ends on the user's turn.
fn sglang_final_assistant(
    messages: Value,
    continue_final: bool,
) -> Result<(Value, Option<String>), TokenizerError> {
    if messages.kind() != ValueKind::Seq {
        return Ok((messages, None));
    }
    let mut items: Vec<Value> = iter_of(&messages)?.collect();
    let Some(last) = items.last() else {
        return Ok((messages, None));
    };
    let assistant = last
        .get_attr("role")
        .is_ok_and(|r| r.as_str() == Some("assistant"));
    let content = last.get_attr("content").unwrap_or_default();
    let Some(text) = content.as_str().filter(|_| assistant).map(str::to_owned) else {
        return Ok((messages, None));
    };
    if continue_final {
        items.pop();
        return Ok((Value::from(items), Some(text)));
    }
    let user = Value::from_pairs([("role", Value::from("user")), ("content", content)]);
    *items.last_mut().expect("a last message") = user;
    Ok((Value::from(items), None))
}

/// The request's `tools` as the engine dumps them for the template (none when absent or
/// empty): each tool through the engine's pydantic model ([`engine_tool`]). SGLang
/// also gives none on `"tool_choice": "none"` and only the named one on a named
/// choice; vLLM gives them all (unless started with
/// `--exclude-tools-when-tool-choice-none`, not followed here).
fn engine_tools(tools: Option<Value>, choice: Option<Value>, rules: Rules) -> Value {
    let Some(tools) = tools.filter(|t| t.len().is_some_and(|n| n > 0)) else {
        return Value::from(());
    };
    if tools.kind() != ValueKind::Seq {
        return tools;
    }
    let Ok(items) = tools.try_iter().map(|i| i.collect::<Vec<_>>()) else {
        return tools;
    };
    let choice = choice.unwrap_or_default();
    let named = match rules {
        Rules::Sglang if choice.as_str() == Some("none") => return Value::from(()),
        Rules::Sglang => choice
            .get_attr("function")
            .and_then(|f| f.get_attr("name"))
            .ok()
            .filter(|n| !n.is_undefined() && !n.is_none()),
        Rules::Vllm => None,
    };
    items
        .into_iter()
        .filter(|tool| {
            named.as_ref().is_none_or(|name| {
                tool.get_attr("function")
                    .and_then(|f| f.get_attr("name"))
                    .is_ok_and(|n| &n == name)
            })
        })
        .map(|tool| engine_tool(tool, rules))
        .collect()
}

/// One tool as the engine's `model_dump()` gives it: the model's fields in their
/// declared order, a missing optional one as its default. vLLM
/// (`ChatCompletionToolsParam`, `FunctionDefinition`): `{"type", "function": {"name",
/// "description", "parameters", "defer_loading" when set, then any other key of the
/// client's}, "defer_loading" when set}`, other keys of the tool dropped. SGLang
/// (`Tool`, `Function`): `{"type", "function": {"description", "name", "parameters",
/// "strict", "defer_loading" when set}, "defer_loading"}`, other keys dropped. Both
/// give the function the tool's `defer_loading` when it has none. A tool or function
/// that is not an object is left as it is (the engine refuses it).
fn engine_tool(tool: Value, rules: Rules) -> Value {
    let set = |v: &Value, key: &str| {
        v.get_attr(key)
            .ok()
            .filter(|x| !x.is_undefined() && !x.is_none())
    };
    let function = tool.get_attr("function").unwrap_or_default();
    if tool.kind() != ValueKind::Map || function.kind() != ValueKind::Map {
        return tool;
    }
    let none = Value::from(());
    let tool_defer = set(&tool, "defer_loading");
    let defer = set(&function, "defer_loading").or_else(|| tool_defer.clone());
    let kind = set(&tool, "type").unwrap_or(Value::from("function"));
    let name = function.get_attr("name").unwrap_or_default();
    let description = set(&function, "description").unwrap_or(none.clone());
    let parameters = set(&function, "parameters").unwrap_or(none.clone());
    let mut f: Vec<(Value, Value)> = Vec::new();
    let mut t: Vec<(Value, Value)> = vec![(Value::from("type"), kind)];
    match rules {
        Rules::Vllm => {
            f.push((Value::from("name"), name));
            f.push((Value::from("description"), description));
            f.push((Value::from("parameters"), parameters));
            if let Some(d) = defer {
                f.push((Value::from("defer_loading"), d));
            }
            // Pydantic keeps the keys it does not know (vLLM's models allow them),
            // after its own.
            const OWN: [&str; 4] = ["name", "description", "parameters", "defer_loading"];
            if let Ok(keys) = function.try_iter() {
                for key in keys {
                    if !key.as_str().is_some_and(|k| OWN.contains(&k)) {
                        let value = function.get_item(&key).unwrap_or_default();
                        f.push((key, value));
                    }
                }
            }
            t.push((Value::from("function"), Value::from_pairs(f)));
            if let Some(d) = tool_defer {
                t.push((Value::from("defer_loading"), d));
            }
        }
        Rules::Sglang => {
            f.push((Value::from("description"), description));
            f.push((Value::from("name"), name));
            f.push((Value::from("parameters"), parameters));
            let strict = set(&function, "strict").unwrap_or(Value::from(false));
            f.push((Value::from("strict"), strict));
            if let Some(d) = defer {
                f.push((Value::from("defer_loading"), d));
            }
            t.push((Value::from("function"), Value::from_pairs(f)));
            t.push((Value::from("defer_loading"), tool_defer.unwrap_or(none)));
        }
    }
    Value::from_pairs(t)
}

/// Whether a template's text names a medium: SGLang then gives it content parts
/// whatever its loops (`detect_jinja_template_content_format`'s shortcut for
/// multimodal templates).
fn names_media(source: &str) -> bool {
    ["image", "audio", "video", "vision"]
        .iter()
        .any(|k| source.contains(k))
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
