use super::*;
use gorgo_core::EngineKind;
use serde_json::json;

fn fixture() -> EngineTokenizer {
    EngineTokenizer::load(Path::new(FIXTURE_TOKENIZER), None, false).unwrap()
}

fn ids(t: &EngineTokenizer, text: &str) -> Vec<u32> {
    t.encode(text, false).unwrap()
}

fn id(t: &EngineTokenizer, piece: &str) -> u32 {
    t.tokenizer.token_to_id(piece).unwrap()
}

#[test]
fn fixture_tokenizes_as_llama_cpp_spm() {
    let t = fixture();
    // "▁the" is a piece but "▁th" is not: pairwise merges stop at "▁t".
    let space_t = id(&t, "\u{e000}t");
    let (h, e) = (id(&t, "h"), id(&t, "e"));
    assert_eq!(ids(&t, "the"), vec![space_t, h, e]);
    // "▁an" then "▁and": words whose prefixes are pieces merge whole.
    assert_eq!(ids(&t, "and"), vec![id(&t, "\u{e000}and")]);
    // A "▁" before a character it cannot merge with falls back to its three bytes, as
    // does the uppercase letter.
    let bytes =
        |s: &str| -> Vec<u32> { s.bytes().map(|b| id(&t, &format!("<0x{b:02X}>"))).collect() };
    assert_eq!(ids(&t, "A"), [bytes("\u{2581}"), bytes("A")].concat());
    assert_eq!(ids(&t, "é"), [bytes("\u{2581}"), bytes("é")].concat());
    // The merge-only "▁" is never emitted.
    let merge_only = id(&t, "\u{e000}");
    let text = "Hello there, the quick brown fox!\n  Ünïcödé 😀 and tabs\tin it";
    assert!(!ids(&t, text).contains(&merge_only));
    // The post-processor adds BOS (tokenizer_config.json's add_bos_token).
    assert_eq!(t.encode("a", true).unwrap()[0], 1);
    assert_eq!(t.encode("a", false).unwrap()[0], id(&t, "\u{e000}a"));
    // Special tokens written in the text are parsed.
    assert_eq!(ids(&t, "<s>a")[0], 1);
}

fn chat(messages: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap()
}

#[test]
fn chat_renders_like_the_template() {
    let t = fixture();
    let body = chat(json!([
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "hi"},
    ]));
    let text = t.render_chat(&body).unwrap();
    assert_eq!(
        text,
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    // BOS comes from the template: once, unless the engine also adds its own.
    let once = t.prompt_ids(Endpoint::Chat, &body).unwrap();
    assert_eq!(once[0], 1);
    assert_ne!(once[1], 1);
    let twice = EngineTokenizer::load(Path::new(FIXTURE_TOKENIZER), None, true).unwrap();
    assert_eq!(
        twice.prompt_ids(Endpoint::Chat, &body).unwrap().len(),
        once.len() + 1
    );
}

#[test]
fn tools_print_as_hf_tojson_in_client_order() {
    let t = fixture();
    // The client's key order, not serde_json's sorted one (`json!` would sort).
    let body = br#"{"messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}"#;
    let text = t.render_chat(body).unwrap();
    // As vLLM's pydantic model dumps it: its fields in their order, a missing
    // `description` as `null`; the schema as the client wrote it.
    assert!(
        text.contains(r#"<tools>
{"type": "function", "function": {"name": "get_weather", "description": null, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
</tools>"#),
        "{text}"
    );
    // An empty tools array is no tools.
    let none = serde_json::to_vec(&json!({
        "messages": [{"role": "user", "content": "weather?"}], "tools": [],
    }))
    .unwrap();
    assert!(!t.render_chat(&none).unwrap().contains("<tools>"));
    // Tool calls and tool responses.
    let body = chat(json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]));
    let text = t.render_chat(&body).unwrap();
    assert!(text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"), "{text}");
    // `arguments` as OpenAI sends them, a JSON string: parsed into the value it holds
    // first, as vLLM does, its keys in the string's order; one that holds no JSON is
    // `{}` to vLLM.
    let with_arguments = |arguments: &str| {
        let call = serde_json::to_string(arguments).unwrap();
        format!(
            r#"{{"messages": [{{"role": "user", "content": "weather?"}},
            {{"role": "assistant", "content": null, "tool_calls": [{{"id": "1", "type": "function", "function": {{"name": "get_weather", "arguments": {call}}}}}]}}]}}"#
        )
    };
    let text = t
        .render_chat(with_arguments(r#"{"city": "Paris", "at": "noon"}"#).as_bytes())
        .unwrap();
    assert!(
        text.contains(r#""arguments": {"city": "Paris", "at": "noon"}}"#),
        "{text}"
    );
    for (sent, printed) in [("not json", "{}"), ("[1, 2]", "[1, 2]")] {
        let text = t.render_chat(with_arguments(sent).as_bytes()).unwrap();
        assert!(
            text.contains(&format!(r#""arguments": {printed}}}"#)),
            "{text}"
        );
    }
}

#[test]
fn completions_forms() {
    let t = fixture();
    let body = |prompt: serde_json::Value| serde_json::to_vec(&json!({"prompt": prompt})).unwrap();
    let one = t
        .prompt_ids(Endpoint::Completions, &body(json!("the cat")))
        .unwrap();
    assert_eq!(one[0], 1, "completions add BOS");
    let two = t
        .prompt_ids(Endpoint::Completions, &body(json!(["the cat", "the cat"])))
        .unwrap();
    assert_eq!(two.len(), 2 * one.len(), "a batch counts each prompt");
    // Beside the total, the longest prompt: what the context check compares.
    let long = t
        .prompt_ids(
            Endpoint::Completions,
            &body(json!("the cat sat on the mat")),
        )
        .unwrap();
    let batch = t
        .tokenize_prompt(
            Endpoint::Completions,
            &body(json!(["the cat", "the cat sat on the mat"])),
        )
        .unwrap();
    assert_eq!(batch.ids, [one.clone(), long.clone()].concat());
    assert_eq!(batch.longest_prompt_tokens, long.len());
    let single = t
        .tokenize_prompt(Endpoint::Completions, &body(json!("the cat")))
        .unwrap();
    assert_eq!(single.longest_prompt_tokens, one.len());
    let ids = t
        .tokenize_prompt(Endpoint::Completions, &body(json!([[5], [6, 7]])))
        .unwrap();
    assert_eq!(ids.longest_prompt_tokens, 2);
    let raw = t
        .prompt_ids(Endpoint::Completions, &body(json!([5, 6, 7])))
        .unwrap();
    assert_eq!(raw, vec![5, 6, 7]);
    let nested = t
        .prompt_ids(Endpoint::Completions, &body(json!([[5], [6, 7]])))
        .unwrap();
    assert_eq!(nested, vec![5, 6, 7]);
    for bad in [json!(5), json!([-1]), json!(["a", 1]), json!(null)] {
        assert!(matches!(
            t.prompt_ids(Endpoint::Completions, &body(bad)),
            Err(TokenizerError::Request(_))
        ));
    }
}

#[test]
fn bad_requests_are_request_errors() {
    let t = fixture();
    for body in [
        chat(json!([{"role": "wizard", "content": "x"}])),
        // (Array content is no longer here: it is joined into a string before the
        // template, as vLLM does, so it renders: `content_is_normalised_as_vllm_does`.)
        // A content part the canonical path refuses too.
        chat(json!([{"role": "user", "content": [{"type": "text"}]}])),
        b"{not json".to_vec(),
        b"{}".to_vec(),
    ] {
        match t.prompt_ids(Endpoint::Chat, &body) {
            Err(TokenizerError::Request(m)) => assert!(!m.is_empty()),
            other => panic!("{}: {other:?}", String::from_utf8_lossy(&body)),
        }
    }
}

#[test]
fn chat_template_kwargs_reach_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("t.jinja");
    std::fs::write(
        &tpl,
        "{% if enable_thinking %}think {% endif %}{{ messages[0].content }}",
    )
    .unwrap();
    let t = EngineTokenizer::load(Path::new(FIXTURE_TOKENIZER), Some(&tpl), false).unwrap();
    let body = |kwargs: serde_json::Value| {
        serde_json::to_vec(&json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kwargs})).unwrap()
    };
    assert_eq!(
        t.render_chat(&body(json!({"enable_thinking": true})))
            .unwrap(),
        "think x"
    );
    assert_eq!(t.render_chat(&body(json!({}))).unwrap(), "x");
    // The fixed arguments win.
    let forced = t.render_chat(&body(json!({"messages": []}))).unwrap();
    assert_eq!(forced, "x");
}

#[test]
fn config_errors_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let err = |r: Result<EngineTokenizer, TokenizerError>| match r {
        Err(TokenizerError::Config { field, reason }) => (field, reason),
        other => panic!("{other:?}"),
    };
    let (field, reason) = err(EngineTokenizer::load(&missing, None, false));
    assert_eq!(field, "tokenizer");
    assert!(reason.contains("nope.json"), "{reason}");
    let junk = dir.path().join("tokenizer.json");
    std::fs::write(&junk, r#"{"hello": 1}"#).unwrap();
    let (field, reason) = err(EngineTokenizer::load(&junk, None, false));
    assert_eq!(field, "tokenizer");
    assert!(reason.contains("not a tokenizer.json"), "{reason}");
    let tpl = dir.path().join("bad.jinja");
    std::fs::write(&tpl, "{% for m in messages %}{{ m.content }").unwrap();
    let (field, reason) = err(EngineTokenizer::load(
        Path::new(FIXTURE_TOKENIZER),
        Some(&tpl),
        false,
    ));
    assert_eq!(field, "chat_template");
    assert!(reason.contains("does not compile"), "{reason}");
    std::fs::write(&tpl, "{{ nothing_here() }}").unwrap();
    let (field, reason) = err(EngineTokenizer::load(
        Path::new(FIXTURE_TOKENIZER),
        Some(&tpl),
        false,
    ));
    assert_eq!(field, "chat_template");
    assert!(reason.contains("does not render"), "{reason}");
    let (field, _) = err(EngineTokenizer::load(
        Path::new(FIXTURE_TOKENIZER),
        Some(&missing),
        false,
    ));
    assert_eq!(field, "chat_template");
    // A chat_template.json holds the template as a string.
    let tj = dir.path().join("chat_template.json");
    std::fs::write(&tj, r#"{"chat_template": "{{ messages[0].content }}!"}"#).unwrap();
    let t = EngineTokenizer::load(Path::new(FIXTURE_TOKENIZER), Some(&tj), false).unwrap();
    assert_eq!(
        t.render_chat(&chat(json!([{"role": "user", "content": "x"}])))
            .unwrap(),
        "x!"
    );
}

#[test]
fn without_a_template_chat_is_refused_but_completions_count() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::copy(FIXTURE_TOKENIZER, &tok).unwrap();
    let t = EngineTokenizer::load(&tok, None, false).unwrap();
    assert!(!t.has_chat_template());
    assert!(matches!(
        t.prompt_ids(
            Endpoint::Chat,
            &chat(json!([{"role": "user", "content": "x"}]))
        ),
        Err(TokenizerError::Request(_))
    ));
    // No tokenizer_config.json: the tokenizer.json's own post-processor (BOS) applies.
    let ids = t
        .prompt_ids(Endpoint::Completions, br#"{"prompt": "a"}"#)
        .unwrap();
    assert_eq!(ids[0], 1);
}

#[test]
fn strftime_fields() {
    // 2024-02-29 13:05:09 UTC, a Thursday.
    let t = 1_709_211_909;
    assert_eq!(
        strftime("%d %b %Y, %A %H:%M:%S %j %y %m %B %a %%", t).unwrap(),
        "29 Feb 2024, Thursday 13:05:09 060 24 02 February Thu %"
    );
    assert!(strftime("%Q", t).is_err());
}

#[test]
fn truncation_and_padding_in_the_file_are_cleared() {
    // HF's `__call__` clears both on every call, so an engine never truncates or pads a
    // prompt there; a count that did would pass any long prompt through the context
    // check.
    let dir = tempfile::tempdir().unwrap();
    let mut file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(FIXTURE_TOKENIZER).unwrap()).unwrap();
    file["truncation"] =
        json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0});
    file["padding"] = json!({"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<unk>"});
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, file.to_string()).unwrap();
    let t = EngineTokenizer::load(&path, None, false).unwrap();
    let long = "the quick brown fox jumps over the lazy dog and the cat";
    assert_eq!(
        t.encode(long, false).unwrap(),
        fixture().encode(long, false).unwrap()
    );
    assert!(t.encode(long, false).unwrap().len() > 8);
    assert_eq!(
        t.encode("a", true).unwrap().len(),
        2,
        "BOS and one piece, no padding"
    );
}

#[test]
fn endless_files_are_refused_naming_the_file() {
    // `/dev/zero` has no length to check beforehand: only a capped read stops it.
    let zero = Path::new("/dev/zero");
    if !zero.exists() {
        return;
    }
    match EngineTokenizer::load(zero, None, false) {
        Err(TokenizerError::Config { field, reason }) => {
            assert_eq!(field, "tokenizer");
            assert!(
                reason.contains("/dev/zero") && reason.contains("larger than"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    match EngineTokenizer::load(Path::new(FIXTURE_TOKENIZER), Some(zero), false) {
        Err(TokenizerError::Config { field, reason }) => {
            assert_eq!(field, "chat_template");
            assert!(
                reason.contains("/dev/zero") && reason.contains("larger than"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn completions_prompts_are_refused_as_the_canonical_path_refuses_them() {
    // One reading of `prompt` (gorgo_core's): the same bodies refused, the same words.
    let t = fixture();
    for body in [
        json!({}),
        json!([1]),
        json!({"prompt": 5}),
        json!({"prompt": null}),
        json!({"prompt": [-1]}),
        json!({"prompt": [4_294_967_296u64]}),
        json!({"prompt": ["a", 1]}),
        json!({"prompt": [[1], ["a"]]}),
        json!({"prompt": [[1.5]]}),
    ] {
        let canonical = match gorgo_core::prompt::canonicalize(Endpoint::Completions, &body) {
            Err(gorgo_core::CoreError::InvalidRequest(m)) => m,
            other => panic!("{body}: {other:?}"),
        };
        match t.prompt_ids(Endpoint::Completions, &serde_json::to_vec(&body).unwrap()) {
            Err(TokenizerError::Request(m)) => assert_eq!(m, canonical, "{body}"),
            other => panic!("{body}: {other:?}"),
        }
    }
}

#[test]
fn content_is_normalised_as_vllm_does() {
    let t = fixture();
    // Text parts joined with "\n" into one string (vLLM's "string" content format).
    let parts = chat(json!([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
    ]}]));
    let joined = chat(json!([{"role": "user", "content": "a\nb"}]));
    assert_eq!(
        t.render_chat(&parts).unwrap(),
        t.render_chat(&joined).unwrap()
    );
    // `null` (and missing) content is "".
    for empty in [
        json!({"role": "assistant", "content": null}),
        json!({"role": "assistant"}),
    ] {
        let body = chat(json!([
            {"role": "user", "content": "hi"}, empty, {"role": "user", "content": "x"},
        ]));
        let text = t.render_chat(&body).unwrap();
        assert!(
            text.contains("<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nx"),
            "{text}"
        );
    }
    // A part that is not text becomes the canonical path's placeholder, so two images
    // are two prompts.
    let image = |url: &str| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"},
        ]}]})
    };
    let canonical = gorgo_core::prompt::canonicalize(Endpoint::Chat, &image("a.png")).unwrap();
    let placeholder = std::str::from_utf8(&canonical)
        .unwrap()
        .strip_prefix("<|user|>\n")
        .and_then(|s| s.strip_suffix("what?\n"))
        .unwrap()
        .to_owned();
    assert!(placeholder.starts_with("<|image_url:"), "{placeholder}");
    let render = |body: &serde_json::Value| t.render_chat(&serde_json::to_vec(body).unwrap());
    let a = render(&image("a.png")).unwrap();
    assert!(
        a.contains(&format!("user\n{placeholder}\nwhat?<|im_end|>")),
        "{a}"
    );
    assert_ne!(a, render(&image("b.png")).unwrap());
}

#[test]
fn a_template_that_loops_over_content_parts_gets_them() {
    // vLLM hands a template that iterates a message's content (vision models' templates:
    // `{% for part in message['content'] %}`) a list of parts, not the joined string
    // (its "openai" content format): iterating a string would print nothing. A string
    // content is one text part, `null` none, media parts are `{"type": "image"}` and
    // the like, and other text-like parts are text.
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("parts.jinja");
    std::fs::write(
        &tpl,
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}\
         {% else %}{%- for part in m['content'] -%}{% if part['type'] == 'text' %}\
         [{{ part['text'] }}]{% elif part['type'] == 'image' %}<img>{% else %}?{% endif %}\
         {% endfor %}{% endif %};{% endfor %}",
    )
    .unwrap();
    let t = EngineTokenizer::load(Path::new(FIXTURE_TOKENIZER), Some(&tpl), false).unwrap();
    let body = chat(json!([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": null},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "d"}]},
    ]));
    assert_eq!(t.render_chat(&body).unwrap(), "[a][b];[c];;[no];<img>[d];");
    let odd = chat(json!([{"role": "user", "content": [{"type": "file", "file": {}}]}]));
    let e = t.render_chat(&odd).unwrap_err().to_string();
    assert!(e.contains("`messages[0].content[0]` has a `type`"), "{e}");
    for (source, loops) in [
        ("{% for c in message.content %}{% endfor %}", true),
        (
            "{%- for c in m[\"content\"] if c.type == 'text' -%}{% endfor %}",
            true,
        ),
        (
            "{% for c in message['content'] | selectattr('type') %}{% endfor %}",
            true,
        ),
        (
            "{% for line in message.content.split('\\n') %}{% endfor %}",
            false,
        ),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", false),
        ("{% for c in message['content'][1:] %}{% endfor %}", true),
        ("{% for c in (message.content) %}{% endfor %}", true),
        (
            "{% for c in message.get('content', []) %}{% endfor %}",
            true,
        ),
        ("{% for c in message.contents %}{% endfor %}", false),
        ("{{ 'for x in message.content' }}", false),
    ] {
        assert_eq!(loops_over_content(source), loops, "{source}");
    }
}

/// A body whose chat template output would be many times its size is refused, at the
/// cap, without building the whole output: a template printing tools with
/// `tojson(indent=4)` turns each `0,` of a deeply nested schema into a line of
/// hundreds of spaces (a 64 KiB body rendered about 16 MB before). Real tools render
/// well within it.
#[test]
fn a_chat_render_is_capped_at_a_multiple_of_the_body() {
    let source = "{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}\
                  {% for m in messages %}{{ m.content }}{% endfor %}"
        .to_owned();
    let template = ChatTemplate::compile(source, "<s>".into(), "</s>".into()).unwrap();
    let render = |body: &str| {
        let value: Value = serde_json::from_str(body).unwrap();
        template.render_capped(&value, rendered_cap(body.len()))
    };
    let tools = |parameters: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": "hi"}}], "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {parameters}}}}}]}}"#
        )
    };
    let nested = format!(
        "{}{}{}",
        "[".repeat(100),
        "0,".repeat(4000) + "0",
        "]".repeat(100)
    );
    let bomb = tools(&nested);
    let value: Value = serde_json::from_str(&bomb).unwrap();
    let whole = template.render(&value).unwrap().len();
    assert!(whole > 40 * bomb.len(), "{whole} from {}", bomb.len());
    let e = render(&bomb).unwrap_err().to_string();
    assert!(e.contains("more than"), "{e}");
    let schema = r#"{"type": "object", "properties": {"city": {"type": "string", "description": "a city"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}"#;
    let text = render(&tools(schema)).unwrap();
    assert!(text.contains("\"city\""), "{text}");
}

/// A message key sent as `null` is no key, as to the engines (SGLang drops None
/// fields, vLLM rebuilds the message from those set): Llama 3's template tests
/// `'tool_calls' in message` and takes its length, which failed on an assistant message
/// re-sent with `"tool_calls": null`, and the node refused a request the engine takes.
#[test]
fn a_null_message_key_is_no_key() {
    let source = "{% for m in messages %}{% if 'tool_calls' in m %}{{ m.tool_calls | length }}\
                  {% else %}{{ m.content }}{% endif %}{% endfor %}"
        .to_owned();
    let template = ChatTemplate::compile(source, "<s>".into(), "</s>".into()).unwrap();
    let body: Value = serde_json::from_str(
        r#"{"messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "tool_calls": null},
            {"role": "user", "content": null, "name": null}]}"#,
    )
    .unwrap();
    assert_eq!(template.render(&body).unwrap(), "hihello");
}

/// vLLM's request fields that change the prompt: `add_generation_prompt: false`
/// leaves the assistant header out, `continue_final_message` cuts the render just
/// after the last message's text (as HF's `apply_chat_template` does), and
/// `add_special_tokens` adds the tokenizer's BOS on top of the template's (chat) or
/// leaves it out (completions). The node counted every request as if none were set.
#[test]
fn generation_prompt_final_message_and_special_tokens_are_the_request_s() {
    let t = fixture();
    let turn = |extra: serde_json::Value| {
        let mut body = json!({"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "The answer is "},
        ]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::to_vec(&body).unwrap()
    };
    let head = "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is ";
    let closed = format!("{head}<|im_end|>\n");
    assert_eq!(
        t.render_chat(&turn(json!({}))).unwrap(),
        format!("{closed}<|im_start|>assistant\n")
    );
    assert_eq!(
        t.render_chat(&turn(json!({"add_generation_prompt": false})))
            .unwrap(),
        closed
    );
    // The template writes the message as sent, so its trailing space is kept.
    let open = json!({"add_generation_prompt": false, "continue_final_message": true});
    assert_eq!(t.render_chat(&turn(open.clone())).unwrap(), head);
    for (extra, error) in [
        (
            json!({"continue_final_message": true}),
            "add_generation_prompt",
        ),
        (
            json!({"add_generation_prompt": "no"}),
            "`add_generation_prompt` must be a boolean",
        ),
        (
            json!({"add_special_tokens": 1}),
            "`add_special_tokens` must be a boolean",
        ),
    ] {
        let e = t.prompt_ids(Endpoint::Chat, &turn(extra)).unwrap_err();
        assert!(e.to_string().contains(error), "{e}");
    }
    // A `null` flag is no flag.
    assert_eq!(
        t.render_chat(&turn(json!({"add_generation_prompt": null})))
            .unwrap(),
        format!("{closed}<|im_start|>assistant\n")
    );
    // A template that strips the message loses its trailing space.
    let trims = ChatTemplate::compile(
        "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}".to_owned(),
        "<s>".into(),
        "</s>".into(),
    )
    .unwrap();
    let body: Value = serde_json::from_slice(&turn(json!({"add_generation_prompt": false,
        "continue_final_message": true})))
    .unwrap();
    assert_eq!(trims.render(&body).unwrap(), "[hi][The answer is");
    // Content parts: the last text part is continued.
    let parts = serde_json::to_vec(&json!({"model": "m", "add_generation_prompt": false,
        "continue_final_message": true, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "The"}, {"type": "text", "text": "answer"}]},
    ]}))
    .unwrap();
    assert!(t.render_chat(&parts).unwrap().ends_with("The\nanswer"));
    // BOS: the template's, then the tokenizer's on request.
    let plain = t.prompt_ids(Endpoint::Chat, &turn(open.clone())).unwrap();
    let mut with_bos = open;
    with_bos["add_special_tokens"] = json!(true);
    let bos = t.prompt_ids(Endpoint::Chat, &turn(with_bos)).unwrap();
    assert_eq!(bos.len(), plain.len() + 1);
    assert_eq!(&bos[..2], &[1, 1]);
    let completions = |extra: serde_json::Value| {
        let mut body = json!({"model": "m", "prompt": "the fox"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        t.prompt_ids(Endpoint::Completions, &serde_json::to_vec(&body).unwrap())
            .unwrap()
    };
    let with = completions(json!({}));
    assert_eq!(with[0], 1);
    assert_eq!(completions(json!({"add_special_tokens": false})), with[1..]);
}

/// A template that loops without writing (every message against every other) is
/// stopped by its fuel, not the output cap, and the client is told why.
#[test]
fn a_render_that_loops_too_long_is_refused() {
    let source = "{% for m in messages %}{% for n in messages %}\
                  {% if m.content == n.content %}{% endif %}{% endfor %}{% endfor %}ok"
        .to_owned();
    let template = ChatTemplate::compile(source, "<s>".into(), "</s>".into()).unwrap();
    let render = |n: usize| {
        let messages: Vec<_> = (0..n)
            .map(|i| json!({"role": "user", "content": i.to_string()}))
            .collect();
        let body = json!({"messages": messages}).to_string();
        let value: Value = serde_json::from_str(&body).unwrap();
        template.render_capped(&value, rendered_cap(body.len()))
    };
    assert_eq!(render(100).unwrap(), "ok");
    let e = render(5_000).unwrap_err().to_string();
    assert!(e.contains("takes too long"), "{e}");
}

/// vLLM's `truncate_prompt_tokens` keeps each prompt's last N ids, after the template
/// and the special tokens: the node counted (and the emulator reported) the whole
/// prompt.
#[test]
fn truncate_prompt_tokens_keeps_each_prompt_s_last_ids() {
    let t = fixture();
    let with = |mut body: serde_json::Value, extra: serde_json::Value| {
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::to_vec(&body).unwrap()
    };
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "the quick brown fox and the dog"}]});
    let whole = t
        .prompt_ids(Endpoint::Chat, &with(chat.clone(), json!({})))
        .unwrap();
    assert!(whole.len() > 8, "{}", whole.len());
    let kept = t
        .prompt_ids(
            Endpoint::Chat,
            &with(chat.clone(), json!({"truncate_prompt_tokens": 8})),
        )
        .unwrap();
    assert_eq!(kept, whole[whole.len() - 8..]);
    for all in [json!(-1), json!(null), json!(10_000)] {
        let body = with(chat.clone(), json!({"truncate_prompt_tokens": all}));
        assert_eq!(t.prompt_ids(Endpoint::Chat, &body).unwrap(), whole);
    }
    for bad in [json!(-2), json!("8"), json!(1.5)] {
        let body = with(chat.clone(), json!({"truncate_prompt_tokens": bad}));
        let e = t.prompt_ids(Endpoint::Chat, &body).unwrap_err().to_string();
        assert!(
            e.contains("`truncate_prompt_tokens` must be an integer"),
            "{e}"
        );
    }
    // A batch: each prompt on its own.
    let batch =
        json!({"model": "m", "prompt": ["the quick brown fox", "a"], "truncate_prompt_tokens": 2});
    let each = t
        .each_prompt_ids(Endpoint::Completions, &serde_json::to_vec(&batch).unwrap())
        .unwrap();
    let first = t.encode("the quick brown fox", true).unwrap();
    assert_eq!(each[0], first[first.len() - 2..]);
    assert_eq!(each[1], t.encode("a", true).unwrap());
}

/// The fixture's tokenizer with `source` as its chat template, counting as `kind`.
fn templated(source: &str, kind: EngineKind) -> EngineTokenizer {
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("t.jinja");
    std::fs::write(&tpl, source).unwrap();
    EngineTokenizer::load(Path::new(FIXTURE_TOKENIZER), Some(&tpl), false)
        .unwrap()
        .for_engine(kind)
}

/// Each engine dumps the request's tools through its own pydantic model before the
/// template prints them (`tojson` in most tool templates): vLLM
/// (`[tool.model_dump() for tool in request.tools]`, `ChatCompletionToolsParam` /
/// `FunctionDefinition`) its fields in their order with `"description": null` where
/// missing and the function's other keys after them, SGLang (`Tool` / `Function`)
/// `description` first, `strict` and a top-level `defer_loading` always, other keys
/// dropped; SGLang also drops the tools on `"tool_choice": "none"`, keeps only the
/// named one, and renders again with the functions alone when its dump fails the
/// template. The node printed the client's dicts as sent. Expected dumps: the engines'
/// models replicated in pydantic 2.14 (`model_dump()`); expected counts: transformers
/// 5.25 `apply_chat_template` on the fixture template with those dumps, tokenised by
/// `tokenizers` 0.23 without special tokens (`crates/gorgo-node/tests/node_tokens.rs`,
/// `tools_and_content_parts_count_as_the_engine_kind_builds_them`, says how).
#[test]
fn tools_reach_the_template_as_each_engine_dumps_them() {
    let tools = r#"[{"function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": true}, "type": "function", "x_note": "dropped"},
        {"type": "function", "function": {"name": "lookup", "description": "Find a thing."}},
        {"type": "function", "function": {"name": "later"}, "defer_loading": true}]"#;
    let body = |extra: &str| {
        format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], "tools": {tools}{extra}}}"#)
    };
    let dump = "{% for t in tools or [] %}{{ t | tojson }}\n{% endfor %}\
                {% for m in messages %}{{ m.content }}{% endfor %}";
    let vllm = r#"{"type": "function", "function": {"name": "get_weather", "description": null, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": true}}
{"type": "function", "function": {"name": "lookup", "description": "Find a thing.", "parameters": null}}
{"type": "function", "function": {"name": "later", "description": null, "parameters": null, "defer_loading": true}, "defer_loading": true}
hi"#;
    let sglang = r#"{"type": "function", "function": {"description": null, "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": true}, "defer_loading": null}
{"type": "function", "function": {"description": "Find a thing.", "name": "lookup", "parameters": null, "strict": false}, "defer_loading": null}
{"type": "function", "function": {"description": null, "name": "later", "parameters": null, "strict": false, "defer_loading": true}, "defer_loading": true}
hi"#;
    let t = templated(dump, EngineKind::Vllm);
    assert_eq!(t.render_chat(body("").as_bytes()).unwrap(), vllm);
    // vLLM renders the tools whatever the choice (`--exclude-tools-when-tool-choice-none`
    // is off by default).
    let none = body(r#", "tool_choice": "none""#);
    assert_eq!(t.render_chat(none.as_bytes()).unwrap(), vllm);
    let s = templated(dump, EngineKind::Sglang);
    assert_eq!(s.render_chat(body("").as_bytes()).unwrap(), sglang);
    assert_eq!(s.render_chat(none.as_bytes()).unwrap(), "hi");
    let named = body(r#", "tool_choice": {"type": "function", "function": {"name": "lookup"}}"#);
    assert_eq!(
        s.render_chat(named.as_bytes()).unwrap(),
        "{\"type\": \"function\", \"function\": {\"description\": \"Find a thing.\", \"name\": \"lookup\", \"parameters\": null, \"strict\": false}, \"defer_loading\": null}\nhi"
    );
    // A template that takes only the functions: SGLang's second render.
    let flat = "{% for t in tools or [] %}{% if t.name is not defined %}\
                {{ raise_exception('flat tools only') }}{% endif %}{{ t.name }}({{ t.strict }}),\
                {% endfor %}{% for m in messages %}{{ m.content }};{% endfor %}";
    assert_eq!(
        templated(flat, EngineKind::Sglang)
            .render_chat(body("").as_bytes())
            .unwrap(),
        "get_weather(True),lookup(False),later(False),hi;"
    );
    let e = templated(flat, EngineKind::Vllm)
        .render_chat(body("").as_bytes())
        .unwrap_err();
    assert!(e.to_string().contains("flat tools only"), "{e}");
    // The fixture's ChatML template: what each engine counts.
    let request = r#"{"model": "m", "messages": [{"role": "system", "content": "Plan trips."}, {"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": true}, "type": "function", "x_note": "dropped"},
                  {"type": "function", "function": {"name": "lookup", "description": "Find a thing."}}]}"#;
    for (kind, tokens) in [(EngineKind::Vllm, 798), (EngineKind::Sglang, 864)] {
        let ids = fixture()
            .for_engine(kind)
            .prompt_ids(Endpoint::Chat, request.as_bytes())
            .unwrap();
        assert_eq!(ids.len(), tokens, "{kind}");
    }
}

/// A message's content parts reach a template that writes `message.content` as one
/// string: vLLM joins the text of its text-like parts (`text`, `input_text`,
/// `output_text`, `refusal`, `thinking`) with "\n", SGLang
/// (`process_content_for_template_format`) those of its `text` and `input_text` parts
/// with " " and leaves every other part out. The node joined every engine's with "\n"
/// and took an `input_text` part for a placeholder. Expected texts and counts:
/// transformers 5.25 `apply_chat_template` as in
/// `tools_reach_the_template_as_each_engine_dumps_them`.
#[test]
fn content_parts_are_joined_as_each_engine_joins_them() {
    let body = br#"{"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare these two lines:"}, {"type": "text", "text": "the cat sat on the mat"}, {"type": "input_text", "text": "the dog sat on the log"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "They differ in"}, {"type": "text", "text": "two words."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which"}, {"type": "text", "text": "words?"}]}]}"#;
    for (kind, text, tokens) in [
        (
            EngineKind::Vllm,
            "<s><|im_start|>user\nCompare these two lines:\nthe cat sat on the mat\nthe dog sat on the log<|im_end|>\n<|im_start|>assistant\nThey differ in\ntwo words.<|im_end|>\n<|im_start|>user\nWhich\nwords?<|im_end|>\n<|im_start|>assistant\n",
            202,
        ),
        (
            EngineKind::Sglang,
            "<s><|im_start|>user\nCompare these two lines: the cat sat on the mat the dog sat on the log<|im_end|>\n<|im_start|>assistant\nThey differ in two words.<|im_end|>\n<|im_start|>user\nWhich words?<|im_end|>\n<|im_start|>assistant\n",
            198,
        ),
    ] {
        let t = fixture().for_engine(kind);
        assert_eq!(t.render_chat(body).unwrap(), text, "{kind}");
        assert_eq!(t.prompt_ids(Endpoint::Chat, body).unwrap().len(), tokens);
    }
    // SGLang leaves an image out of a string content; a part it does not know too.
    let image = br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "what?"}, {"type": "refusal", "refusal": "no"}]}]}"#;
    let s = fixture().for_engine(EngineKind::Sglang);
    assert!(s
        .render_chat(image)
        .unwrap()
        .contains("<|im_start|>user\nwhat?<|im_end|>"));
}

/// A template that loops over content parts (the engines' "openai" content format)
/// still gets a tool message's text parts as one string (most write a tool result
/// as a string): vLLM joins them with "\n", SGLang with " ". SGLang keeps a string
/// content a string, and gives the parts to any template that names a medium
/// (`image`, `audio`, `video`, `vision`), loop or not. Expected texts: transformers
/// 5.25 `apply_chat_template` with each engine's messages.
#[test]
fn a_tool_result_in_parts_is_one_string_as_each_engine_gives_it() {
    let source = "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}\
                  {% else %}{% for p in m.content %}({{ p.type }}{% if p.text is defined %} {{ p.text }}\
                  {% endif %}){% endfor %}{% endif %};{% endfor %}";
    let body = br#"{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": null},
        {"role": "tool", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}]}"#;
    assert_eq!(
        templated(source, EngineKind::Vllm)
            .render_chat(body)
            .unwrap(),
        "user:(text a)(image)(text b);assistant:;tool:c\nd;"
    );
    assert_eq!(
        templated(source, EngineKind::Sglang)
            .render_chat(body)
            .unwrap(),
        "user:(text a)(image)(text b);assistant:;tool:c d;"
    );
    // No loop, but a medium named: SGLang's parts, vLLM's string.
    let media = "{# an image template #}{% for m in messages %}{% if m.content is string %}\
                 S:{{ m.content }}{% else %}L{{ m.content | length }}{% endif %};{% endfor %}";
    let parts = br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "user", "content": "c"}]}"#;
    assert_eq!(
        templated(media, EngineKind::Sglang)
            .render_chat(parts)
            .unwrap(),
        "L2;S:c;"
    );
    assert_eq!(
        templated(media, EngineKind::Vllm)
            .render_chat(parts)
            .unwrap(),
        "S:a\nb;S:c;"
    );
}

/// An assistant's tool-call `arguments` string: vLLM (`_postprocess_messages`) parses
/// any JSON value from it, takes one that holds none (or `null`, or a number) for
/// `{}`, and drops an empty `tool_calls`; SGLang
/// (`normalize_assistant_tool_call_arguments`) refuses a string that holds no JSON
/// object, so the node answers the 400 SGLang would. The node kept such strings.
#[test]
fn tool_call_arguments_are_read_as_each_engine_reads_them() {
    let source =
        "{% for m in messages %}{{ m.role }}{% if 'tool_calls' in m %}{% for c in m.tool_calls %}\
                  <{{ c.function.arguments | tojson }}>{% endfor %}{% endif %};{% endfor %}";
    let calls_then = |arguments: &[&str], then: &str| {
        let calls: Vec<String> = arguments
            .iter()
            .map(|a| {
                format!(r#"{{"id": "1", "type": "function", "function": {{"name": "f", "arguments": {a}}}}}"#)
            })
            .collect();
        format!(
            r#"{{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": null, "tool_calls": [{}]}}{then}]}}"#,
            calls.join(", ")
        )
    };
    let calls = |arguments: &[&str]| calls_then(arguments, "");
    let sent = [
        r#""not json""#,
        r#""[1, 2]""#,
        "5",
        r#"{"x": 1}"#,
        r#""{\"b\": 1, \"a\": 2}""#,
    ];
    let v = templated(source, EngineKind::Vllm);
    assert_eq!(
        v.render_chat(calls(&sent).as_bytes()).unwrap(),
        r#"user;assistant<{}><[1, 2]><{}><{"x": 1}><{"b": 1, "a": 2}>;"#
    );
    assert_eq!(
        v.render_chat(calls(&[]).as_bytes()).unwrap(),
        "user;assistant;"
    );
    let s = templated(source, EngineKind::Sglang);
    assert_eq!(
        s.render_chat(calls(&sent[3..]).as_bytes()).unwrap(),
        r#"user;user;"#,
        "the last assistant message becomes the user's, its calls dropped"
    );
    let last = calls_then(&sent[3..], r#", {"role": "tool", "content": "ok"}"#);
    assert_eq!(
        s.render_chat(last.as_bytes()).unwrap(),
        r#"user;assistant<{"x": 1}><{"b": 1, "a": 2}>;tool;"#
    );
    for (bad, why) in [
        (sent[0], "must be valid JSON"),
        (sent[1], "must be a JSON object"),
    ] {
        let e = s.render_chat(calls(&[bad]).as_bytes()).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("`messages[1].tool_calls[0].function.arguments`") && e.contains(why),
            "{e}"
        );
    }
}

/// A last assistant message: vLLM renders it closed and asks for a new turn, or (with
/// `continue_final_message` and `add_generation_prompt: false`) leaves it open; SGLang
/// (`_handle_last_assistant_message`, no `add_generation_prompt` of its own) makes it
/// the user's, or with `continue_final_message` takes it off and writes its text after
/// the render. Expected texts: transformers 5.25 `apply_chat_template` with each
/// engine's messages and arguments.
#[test]
fn a_last_assistant_message_is_what_each_engine_makes_of_it() {
    let turn = |extra: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "The answer is "}}]{extra}}}"#
        )
    };
    let head = "<s><|im_start|>user\nhi<|im_end|>\n";
    let open = format!("{head}<|im_start|>assistant\nThe answer is ");
    let v = fixture();
    let s = fixture().for_engine(EngineKind::Sglang);
    assert_eq!(
        v.render_chat(turn("").as_bytes()).unwrap(),
        format!("{open}<|im_end|>\n<|im_start|>assistant\n")
    );
    assert_eq!(
        s.render_chat(turn("").as_bytes()).unwrap(),
        format!("{head}<|im_start|>user\nThe answer is <|im_end|>\n<|im_start|>assistant\n")
    );
    let continued = turn(r#", "continue_final_message": true"#);
    assert!(v.render_chat(continued.as_bytes()).is_err());
    assert_eq!(s.render_chat(continued.as_bytes()).unwrap(), open);
    let closed = turn(r#", "continue_final_message": true, "add_generation_prompt": false"#);
    assert_eq!(v.render_chat(closed.as_bytes()).unwrap(), open);
    assert_eq!(s.render_chat(closed.as_bytes()).unwrap(), open);
}

/// vLLM passes the request's `documents` and `reasoning_effort` to the template over
/// its `chat_template_kwargs` (`build_chat_params`), and `enable_thinking` from the
/// effort unless the kwargs set it; SGLang passes `reasoning_effort` under its kwargs
/// and no documents. Both let the kwargs set the special tokens (HF's
/// `{**special_tokens_map, **kwargs}`). The node passed none of these.
#[test]
fn documents_and_reasoning_effort_reach_the_template_as_each_engine_passes_them() {
    let source = "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}\
                  {{ reasoning_effort }}|{{ enable_thinking }}|{{ bos_token }}|{{ messages[0].content }}";
    let body = |extra: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": "x"}}], "documents": [{{"title": "T", "text": "body"}}]{extra}}}"#
        )
    };
    let v = templated(source, EngineKind::Vllm);
    let s = templated(source, EngineKind::Sglang);
    let effort = body(
        r#", "reasoning_effort": "low", "chat_template_kwargs": {"bos_token": "B", "reasoning_effort": "high"}"#,
    );
    assert_eq!(
        v.render_chat(effort.as_bytes()).unwrap(),
        "[T: body]low|True|B|x"
    );
    assert_eq!(s.render_chat(effort.as_bytes()).unwrap(), "high||B|x");
    let off = body(r#", "reasoning_effort": "none""#);
    assert_eq!(
        v.render_chat(off.as_bytes()).unwrap(),
        "[T: body]none|False|<s>|x"
    );
    let kept =
        body(r#", "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}"#);
    assert_eq!(
        v.render_chat(kept.as_bytes()).unwrap(),
        "[T: body]none|True|<s>|x"
    );
    assert_eq!(
        v.render_chat(body("").as_bytes()).unwrap(),
        "[T: body]||<s>|x"
    );
}
