use super::*;
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
    assert!(
        text.contains(r#"<tools>
{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
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
    // `arguments` as OpenAI sends them, a JSON string: parsed into the object first, as
    // vLLM does, its keys in the string's order. A string that is no JSON object stays.
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
    for kept in ["not json", "[1, 2]"] {
        let text = t.render_chat(with_arguments(kept).as_bytes()).unwrap();
        let printed = serde_json::to_string(kept).unwrap();
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
