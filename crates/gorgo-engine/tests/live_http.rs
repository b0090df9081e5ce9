//! The emulator through HTTP on the real clock: tolerances, not speed.
//!
//! Each test starts the server in-process on 127.0.0.1:0 and stops it at the end.

use std::time::Instant;

use futures::StreamExt;
use gorgo_engine::{serve, EmulatedKind, EmulatorConfig, Profile};
use serde_json::{json, Value};
use tokio::sync::oneshot;

struct Server {
    base: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(config: EmulatorConfig) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            serve(listener, config, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        Server {
            base,
            stop: Some(stop),
            task,
        }
    }

    async fn shutdown(mut self) {
        self.shutdown_begin();
        self.task.await.unwrap();
    }

    /// Tell the server to stop (it drains), without waiting for it.
    fn shutdown_begin(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// `tokens` tokens of text unique to `seed` (4 bytes per token).
fn text(seed: u64, tokens: usize) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..tokens * 4)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'a' + (x % 26) as u8) as char
        })
        .collect()
}

/// Parsed `data:` payloads of an SSE body (without `[DONE]`), and whether it ended
/// with `[DONE]`.
fn sse_events(body: &str) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    let mut done = false;
    for line in body.lines() {
        if let Some(data) = line.strip_prefix("data: ") {
            if data == "[DONE]" {
                done = true;
            } else {
                out.push(serde_json::from_str(data).unwrap());
            }
        }
    }
    (out, done)
}

/// Stream one chat request; returns (TTFT ms at the client, all events).
async fn stream_chat(
    client: &reqwest::Client,
    base: &str,
    content: &str,
    max_tokens: u32,
) -> (f64, Vec<Value>) {
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut ttft = None;
    let mut all = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        if ttft.is_none() && !chunk.is_empty() {
            ttft = Some(started.elapsed().as_secs_f64() * 1000.0);
        }
        all.extend_from_slice(&chunk);
    }
    let (events, done) = sse_events(std::str::from_utf8(&all).unwrap());
    assert!(done, "stream ends with [DONE]");
    (ttft.unwrap(), events)
}

/// The fields of an error body `v` from an emulator of `kind`, checked to be in that
/// engine's shape: under `"error"` (vLLM) or flat beside `"object": "error"` (SGLang).
fn error_fields(kind: EmulatedKind, v: &Value) -> &Value {
    let fields = match kind {
        EmulatedKind::Vllm => {
            assert_eq!(v.as_object().map(|o| o.len()), Some(1), "{v}");
            &v["error"]
        }
        EmulatedKind::Sglang => {
            assert_eq!(v["object"], "error", "{v}");
            assert!(v.get("error").is_none(), "{v}");
            v
        }
    };
    assert!(
        fields["message"].is_string() && fields["type"].is_string(),
        "{v}"
    );
    fields
}

/// An emulator config of `kind` around `profile`.
fn config_of(kind: EmulatedKind, profile: Profile) -> EmulatorConfig {
    let mut config = EmulatorConfig::new(profile);
    config.kind = kind;
    config
}

fn usage_of(events: &[Value]) -> Value {
    events
        .iter()
        .rev()
        .find(|e| e["usage"].is_object())
        .expect("usage chunk")["usage"]
        .clone()
}

fn fit(xs: &[f64], ys: &[f64]) -> (f64, f64, f64) {
    let n = xs.len() as f64;
    let mx = xs.iter().sum::<f64>() / n;
    let my = ys.iter().sum::<f64>() / n;
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    let b = sxy / sxx;
    let a = my - b * mx;
    let ss_res: f64 = xs
        .iter()
        .zip(ys)
        .map(|(x, y)| (y - a - b * x).powi(2))
        .sum();
    let ss_tot: f64 = ys.iter().map(|y| (y - my).powi(2)).sum();
    (a, b, 1.0 - ss_res / ss_tot)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a100_profile_ttft_slope_cache_hits_and_metrics() {
    let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
    let server = Server::start(EmulatorConfig::new(profile)).await;
    let client = reqwest::Client::new();
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    let mut last = String::new();
    for i in 0..30u64 {
        let tokens = 100 + (i as usize * 7900) / 29;
        last = text(i, tokens);
        let (ttft, events) = stream_chat(&client, &server.base, &last, 1).await;
        let usage = usage_of(&events);
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(usage["completion_tokens"], 1);
        let first = &events[0];
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        xs.push(usage["prompt_tokens"].as_f64().unwrap());
        ys.push(ttft);
    }
    let (a, b, r2) = fit(&xs, &ys);
    eprintln!("live TTFT fit: {a:.2} ms + {b:.5} ms/token, R^2 {r2:.4}");
    assert!(
        (b / 0.0938 - 1.0).abs() <= 0.10,
        "slope {b} not within 10% of 0.0938"
    );
    assert!(r2 >= 0.97, "R^2 {r2}");

    // The same prompt again: (almost) all cached, lower TTFT.
    let (ttft_again, events) = stream_chat(&client, &server.base, &last, 4).await;
    let usage = usage_of(&events);
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached + 16 >= prompt_tokens && cached < prompt_tokens,
        "cached {cached} of {prompt_tokens}"
    );
    assert!(
        ttft_again < ys[29] - 300.0,
        "repeat TTFT {ttft_again} vs first {}",
        ys[29]
    );
    let text_out: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text_out, gorgo_engine::openai::filler_text(4));

    // /metrics parses as Prometheus text and carries SGLang's names. prometheus-parse
    // only accepts `\w+` metric names, so SGLang's `sglang:` prefix (valid Prometheus,
    // and what real SGLang emits) is parsed as `sglang_`; the real sample is checked
    // the same way so both sides are held to one parser.
    let scrape = client
        .get(format!("{}/metrics", server.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let parse = |text: &str| {
        prometheus_parse::Scrape::parse(
            text.replace("sglang:", "sglang_")
                .lines()
                .map(|l| Ok(l.to_owned())),
        )
        .unwrap()
    };
    let parsed = parse(&scrape);
    let sample_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/reference/sglang_metrics_sample.txt"
    );
    let real = std::fs::read_to_string(sample_path).ok().map(|t| parse(&t));
    if real.is_none() {
        eprintln!("note: {sample_path} missing; not comparing names with a real scrape");
    }
    let value = |name: &str| -> f64 {
        let name = name.replace("sglang:", "sglang_");
        assert!(scrape.contains(&format!("{}{{", name.replace("sglang_", "sglang:"))));
        if let Some(real) = &real {
            assert!(
                real.samples.iter().any(|s| s.metric == name),
                "{name} not in SGLang's sample"
            );
        }
        let s = parsed
            .samples
            .iter()
            .find(|s| s.metric == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        match s.value {
            prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => panic!("{name} is not a scalar"),
        }
    };
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_used_tokens",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
    ] {
        value(name);
    }
    assert_eq!(value("sglang:max_total_num_tokens"), 420000.0);
    assert_eq!(value("sglang:num_requests_total"), 31.0);
    assert!(value("sglang:cache_hit_rate") > 0.0);
    let ttft_hist = parsed
        .samples
        .iter()
        .find(|s| s.metric == "sglang_time_to_first_token_seconds")
        .expect("TTFT histogram");
    match &ttft_hist.value {
        prometheus_parse::Value::Histogram(buckets) => {
            assert_eq!(buckets.last().unwrap().count, 31.0);
        }
        other => panic!("TTFT is not a histogram: {other:?}"),
    }
    server.shutdown().await;
}

/// A body that fails to read for another reason than its size is the client's
/// fault (400), not one over the limit (413).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_body_is_400_not_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let profile = Profile::by_name("h200-dense-1.5b").unwrap();
    let server = Server::start(EmulatorConfig::new(profile)).await;
    let addr = server.base.trim_start_matches("http://").to_owned();
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // `ZZ` is no chunk size.
    tcp.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\n\r\nZZ\r\n",
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(n > 0, "connection closed before a response: {head:?}");
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    drop(tcp);
    server.shutdown().await;
}

/// Bad input gets a 400 (404, 405) naming the field at fault, in the error shape of
/// the engine each kind passes for; SGLang's `/get_server_info` is there only on the
/// SGLang kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors() {
    for kind in EmulatedKind::ALL {
        bad_input_gets_openai_errors_of(kind).await;
    }
}

async fn bad_input_gets_openai_errors_of(kind: EmulatedKind) {
    let profile = Profile::by_name("h200-dense-1.5b").unwrap();
    let server = Server::start(config_of(kind, profile)).await;
    let client = reqwest::Client::new();
    let post = |path: &str, body: String| {
        client
            .post(format!("{}{path}", server.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let cases = [
        (
            "/v1/chat/completions",
            "{\"messages\": [".to_owned(),
            400,
            None,
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m"}).to_string(),
            400,
            Some("messages"),
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}).to_string(),
            400,
            Some("max_tokens"),
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": text(1, 40_000)}]}).to_string(),
            400,
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 2}).to_string(),
            400,
            Some("prompt"),
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "n": 2}).to_string(),
            400,
            Some("n"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "best_of": 3}).to_string(),
            400,
            Some("best_of"),
            None,
        ),
        ("/v1/nothing", "{}".to_owned(), 404, None, Some("not_found")),
    ];
    for (path, body, status, param, code) in cases {
        let resp = post(path, body).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{kind} {path}");
        let v: Value = resp.json().await.unwrap();
        let err = error_fields(kind, &v);
        assert_eq!(err["param"].as_str(), param, "{v}");
        assert_eq!(err["code"].as_str(), code, "{v}");
    }
    // A known route with the wrong method: 405 with OpenAI's error JSON.
    let resp = client
        .get(format!("{}/v1/chat/completions", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(error_fields(kind, &v)["code"], "method_not_allowed", "{v}");
    // Non-streaming completion and the small endpoints.
    let resp = post(
        "/v1/completions",
        json!({"prompt": "abcdabcd", "max_tokens": 3}).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Lorem ipsum ");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let get_json = |path: &str| {
        let req = client.get(format!("{}{path}", server.base));
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let models = get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "Qwen/Qwen2.5-1.5B-Instruct");
    // SGLang's server info, where a node reads the concurrency limit; vLLM has none.
    let info = get_json("/get_server_info").await;
    match kind {
        EmulatedKind::Sglang => assert_eq!(info["max_running_requests"], 512),
        EmulatedKind::Vllm => assert_eq!(error_fields(kind, &info)["code"], "not_found"),
    }
    let health = client
        .get(format!("{}/health", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    server.shutdown().await;
}

/// The defaults vLLM applies, through HTTP: a chat prompt that fits the context
/// without `max_tokens` is served (its output cut to the room the context leaves, not
/// refused for the emulator's default length), `/v1/completions` without `max_tokens`
/// produces 16 tokens, and `stream_options` without `stream` is a 400 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_max_tokens_and_stray_stream_options_follow_vllm() {
    let mut profile = Profile::by_name("h200-dense-1.5b").unwrap();
    profile.context_length = 300;
    let server = Server::start(config_of(EmulatedKind::Vllm, profile)).await;
    let client = reqwest::Client::new();
    let post = |path: &str, body: Value| {
        client
            .post(format!("{}{path}", server.base))
            .json(&body)
            .send()
    };
    // About 250 prompt tokens: with the default 128 counted, over the context.
    let chat = json!({"messages": [{"role": "user", "content": text(3, 250)}]});
    let resp = post("/v1/chat/completions", chat).await.unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 300 - 128 && prompt < 300, "{v}");
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(300 - prompt));
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    // Short of the room: the default length, ended as an answer ends.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let v: Value = post("/v1/chat/completions", chat)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 128, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");

    let resp = post("/v1/completions", json!({"prompt": "abcdabcd"}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");

    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "stream": false, "stream_options": {"include_usage": true}}),
        ),
    ] {
        let resp = post(path, body).await.unwrap();
        assert_eq!(resp.status(), 400, "{path}");
        let v: Value = resp.json().await.unwrap();
        let err = error_fields(EmulatedKind::Vllm, &v);
        assert_eq!(err["param"], "stream_options", "{v}");
        assert_eq!(err["type"], "invalid_request_error", "{v}");
        assert_eq!(
            err["message"], "Stream options can only be defined when `stream=True`.",
            "{v}"
        );
    }
    server.shutdown().await;
}

/// SGLang's ways where vLLM's differ, through HTTP: `stream_options` without
/// `stream` is served (no usage chunk to give), a `null` completions limit is a 400 in
/// SGLang's flat error shape, prompt + limit reaching the context is refused, and
/// `stream_options: {}` does not ask for usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_stream_options_and_limits_follow_sglang() {
    let mut profile = Profile::by_name("h200-dense-1.5b").unwrap();
    profile.context_length = 300;
    let server = Server::start(config_of(EmulatedKind::Sglang, profile)).await;
    let client = reqwest::Client::new();
    let post = |path: &str, body: Value| {
        client
            .post(format!("{}{path}", server.base))
            .json(&body)
            .send()
    };
    let resp = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream_options": {"include_usage": true}}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");

    let resp = post(
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": null}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        error_fields(EmulatedKind::Sglang, &v)["param"],
        "max_tokens",
        "{v}"
    );

    // A prompt of exactly 200 tokens (completions count what they are sent) and a
    // limit of 100: the context's 300, which vLLM would serve.
    let resp = post(
        "/v1/completions",
        json!({"prompt": text(4, 200), "max_tokens": 100}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    let err = error_fields(EmulatedKind::Sglang, &v);
    assert_eq!(err["code"], "context_length_exceeded", "{v}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .starts_with("Requested token count exceeds"),
        "{v}"
    );

    let resp = post(
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 2, "stream": true, "stream_options": {}}),
    )
    .await
    .unwrap();
    let (events, done) = sse_events(&resp.text().await.unwrap());
    assert!(done);
    assert!(
        events.iter().all(|e| e.get("usage").is_none()),
        "{events:?}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_503_and_a_disconnect_frees_the_slot() {
    let mut profile = Profile::by_name("h200-mistral7b").unwrap();
    profile.max_running_requests = 1;
    let mut config = EmulatorConfig::new(profile);
    config.max_queue = 1;
    let server = Server::start(config).await;
    let client = reqwest::Client::new();
    let chat = |content: String, max_tokens: u32| {
        client
            .post(format!("{}/v1/chat/completions", server.base))
            .json(&json!({
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "stream": true,
            }))
            .send()
    };
    // A holds the only slot for ~35 s of decode (8,000 steps); wait for its first token.
    let a = chat(text(1, 200), 8000).await.unwrap();
    let mut a_stream = a.bytes_stream();
    a_stream.next().await.unwrap().unwrap();
    // B waits (queue of 1), C is refused.
    let b = chat(text(2, 200), 3).await.unwrap();
    assert_eq!(b.status(), 200);
    let c = chat(text(3, 200), 3).await.unwrap();
    assert_eq!(c.status(), 503);
    let v: Value = c.json().await.unwrap();
    assert_eq!(error_fields(EmulatedKind::Sglang, &v)["code"], "overloaded");
    // A's client goes away: its slot and KV reference are freed and B completes.
    drop(a_stream);
    let body = b.text().await.unwrap();
    let (events, done) = sse_events(&body);
    assert!(done);
    assert_eq!(
        events
            .iter()
            .filter(|e| e["choices"][0]["delta"]["content"].is_string())
            .count(),
        3
    );
    let scrape = client
        .get(format!("{}/metrics", server.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(scrape.contains("sglang:num_running_reqs{") && scrape.contains("} 0.0\n"));
    server.shutdown().await;
}

/// Read `resp`'s body until `pred` holds on what came so far (or the body ends).
async fn read_until(resp: &mut reqwest::Response, mut pred: impl FnMut(&str) -> bool) -> String {
    let mut body = String::new();
    while !pred(&body) {
        match resp.chunk().await.unwrap() {
            Some(c) => body.push_str(std::str::from_utf8(&c).unwrap()),
            None => break,
        }
    }
    body
}

/// A shutdown drains: a stream in flight when it comes finishes with `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_lets_the_streams_in_flight_finish() {
    let mut profile = Profile::by_name("h200-dense-1.5b").unwrap();
    // Slow enough that the shutdown lands mid-stream.
    profile.decode_base_ms = 50.0;
    let mut server = Server::start(EmulatorConfig::new(profile)).await;
    let client = reqwest::Client::new();
    let body = json!({"prompt": "hello", "max_tokens": 10, "stream": true});
    let mut resp = client
        .post(format!("{}/v1/completions", server.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    let first = read_until(&mut resp, |b| b.contains("data: ")).await;
    server.shutdown_begin();
    let rest = read_until(&mut resp, |b| b.contains("[DONE]")).await;
    let (events, done) = sse_events(&(first + &rest));
    assert!(done, "{events:?}");
    assert_eq!(
        events.len(),
        11,
        "ten tokens and the finish chunk: {events:?}"
    );
    server.task.await.unwrap();
}

/// The drain has a deadline: a stream that would outlast it by far (a client that
/// stopped reading, or a very long output) is cut, and `serve` returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_ends_at_its_deadline() {
    let mut profile = Profile::by_name("h200-dense-1.5b").unwrap();
    // 1000 tokens of 10 s each: hours, far beyond any test's patience.
    profile.decode_base_ms = 10_000.0;
    let mut config = EmulatorConfig::new(profile);
    config.drain_timeout = std::time::Duration::from_millis(100);
    let mut server = Server::start(config).await;
    let client = reqwest::Client::new();
    let body = json!({"prompt": "hello", "max_tokens": 1000, "stream": true});
    let mut resp = client
        .post(format!("{}/v1/completions", server.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    read_until(&mut resp, |b| b.contains("data: ")).await;
    server.shutdown_begin();
    // Not a speed bound: only a guard against hanging for hours without the deadline.
    tokio::time::timeout(std::time::Duration::from_secs(120), server.task)
        .await
        .expect("serve returned after its drain deadline")
        .unwrap();
    drop(resp);
}

/// A completions batch is served as vLLM serves it: one sequence per prompt, each
/// checked against the context on its own, one choice each, usage summed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completions_batch_is_one_sequence_per_prompt() {
    let mut profile = Profile::by_name("h200-mistral7b").unwrap();
    assert_eq!(profile.context_length, 32768);
    // Not a timing test: prefill quickly.
    profile.t_p_ms_per_token = 0.0001;
    let mut config = EmulatorConfig::new(profile);
    config.max_queue = 3;
    let server = Server::start(config).await;
    let client = reqwest::Client::new();
    let post = |body: Value| {
        client
            .post(format!("{}/v1/completions", server.base))
            .json(&body)
            .send()
    };
    // Together 36 000 tokens, over the context; each 12 000, within it.
    let prompts: Vec<String> = (0..3).map(|i| text(100 + i, 12_000)).collect();
    let resp = post(json!({"prompt": prompts, "max_tokens": 4}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let choices = v["choices"].as_array().unwrap();
    let indexes: Vec<u64> = choices
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, [0, 1, 2], "{v}");
    for c in choices {
        assert_eq!(c["text"], "Lorem ipsum dolo", "{v}");
        assert_eq!(c["finish_reason"], "length", "{v}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], 36_000, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");

    // Streaming, token ids: each chunk names its choice, each choice finishes, and
    // the usage chunk sums them.
    let body = json!({
        "prompt": [[1, 2, 3], [4, 5]],
        "max_tokens": 3,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let text_body = post(body).await.unwrap().text().await.unwrap();
    let (events, done) = sse_events(&text_body);
    assert!(done, "{text_body}");
    let mut tokens = [0; 2];
    let mut finished = [0; 2];
    for e in &events {
        for c in e["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if c["finish_reason"].is_null() {
                tokens[i] += 1;
            } else {
                finished[i] += 1;
            }
        }
    }
    assert_eq!((tokens, finished), ([3, 3], [1, 1]), "{text_body}");
    let usage = usage_of(&events);
    assert_eq!(usage["prompt_tokens"], 5, "{usage}");
    assert_eq!(usage["completion_tokens"], 6, "{usage}");

    // A batch of more prompts than the queue could ever hold, or of none: 400.
    for prompt in [json!(["a", "b", "c", "d"]), json!([])] {
        let resp = post(json!({"prompt": prompt})).await.unwrap();
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(
            error_fields(EmulatedKind::Sglang, &v)["param"],
            "prompt",
            "{v}"
        );
    }
    // One prompt of a batch over the context is refused, naming it.
    let long = vec![text(7, 10), text(8, 33_000)];
    let resp = post(json!({"prompt": long, "max_tokens": 4}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        error_fields(EmulatedKind::Sglang, &v)["code"],
        "context_length_exceeded",
        "{v}"
    );
    server.shutdown().await;
}
