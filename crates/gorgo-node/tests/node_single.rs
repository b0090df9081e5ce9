//! One node beside a stub engine: pass-through, headers, errors, admin API.
mod common;

use common::*;
use gorgo_node::metrics::EngineFailureKind;

/// `cost_term_seconds` holds milliseconds over a thousand: `gorgo`'s terms are
/// recorded, `gorgo-paper`'s, which count tokens, are not (a 4,000-token prompt showed
/// as 4 s of prefill).
#[tokio::test]
async fn only_millisecond_terms_reach_the_cost_term_histogram() {
    let engine = StubEngine::start("e").await;
    let series = "gorgo_cost_term_seconds_count{term=\"prefill\"}";
    for (policy, counted) in [("gorgo", 1.0), ("gorgo-paper", 0.0)] {
        let extra = format!("[routing]\npolicy = \"{policy}\"\n");
        let node = start_node(config("a", &engine.url(), &extra), None).await;
        let resp = post_chat(&node, &prompt("terms", 16_000), false).await;
        assert_eq!(resp.status(), 200);
        let text = metrics_text(&node).await;
        assert_eq!(
            metric_value(&text, series).unwrap_or(0.0),
            counted,
            "{policy}"
        );
        node.shutdown.cancel();
    }
}

#[tokio::test]
async fn non_streaming_chat_passes_through_with_headers() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("hi there", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "a");
    assert_eq!(resp.headers()["x-gorgo-hops"], "0");
    // The default policy (gorgo) is cost-based: its prediction comes with the answer.
    let predicted: f64 = resp.headers()["x-gorgo-predicted-ttft-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(predicted.is_finite() && predicted >= 0.0, "{predicted}");
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "hello world");
    // Its decision, and an empty page past it.
    assert_eq!(
        admin_json(&node, "/admin/decisions?limit=5")
            .await
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let past = admin_json(&node, "/admin/decisions?limit=5&offset=1").await;
    assert!(past.as_array().unwrap().is_empty(), "{past}");
    node.shutdown.cancel();
}

#[tokio::test]
async fn streaming_completion_stays_sse_byte_for_byte() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let body = serde_json::json!({"model": "m", "prompt": "once upon a time", "stream": true});
    let via_node = client()
        .post(format!("{}/v1/completions", node.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(via_node.status(), 200);
    assert_eq!(via_node.headers()["content-type"], "text/event-stream");
    let via_node = via_node.bytes().await.unwrap();
    let direct = client()
        .post(format!("{}/v1/completions", engine.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(via_node, direct.bytes().await.unwrap());
    node.shutdown.cancel();
}

#[tokio::test]
async fn models_are_listed() {
    let engine = StubEngine::start("e").await;
    engine.set_models(&["the-model"]);
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let v: serde_json::Value = client()
        .get(format!("{}/v1/models", node.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["data"][0]["id"], "the-model");
    assert_eq!(v["data"][0]["owned_by"], "e", "the engine's own entry");
    assert_eq!(v["data"][0]["nodes"], serde_json::json!(["a"]));
    node.shutdown.cancel();
}

#[tokio::test]
async fn bad_inputs_get_the_right_status_and_openai_errors() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nmax_body_bytes = 1048576\n"),
        None,
    )
    .await;
    let c = client();
    let url = format!("{}/v1/chat/completions", node.base);

    let resp = c
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 400);

    let resp = c
        .post(&url)
        .json(&serde_json::json!({"model": "m"}))
        .send()
        .await
        .unwrap();
    let (status, err) = error_of(resp).await;
    assert_eq!(status, 400, "chat without messages");
    // The field at fault is named, as for the fields `validate` checks.
    assert_eq!(err["error"]["param"], "messages", "{err}");
    // Prompts engines refuse: refused here, naming `prompt`, never reaching the engine.
    let completions = format!("{}/v1/completions", node.base);
    for prompt in [
        serde_json::json!([]),
        serde_json::json!([[]]),
        serde_json::json!(5),
    ] {
        let resp = c
            .post(&completions)
            .json(&serde_json::json!({"model": "m", "prompt": prompt}))
            .send()
            .await
            .unwrap();
        let (status, err) = error_of(resp).await;
        assert_eq!(status, 400, "{prompt}: {err}");
        assert_eq!(err["error"]["param"], "prompt", "{prompt}: {err}");
    }
    assert_eq!(engine.requests(), 0);

    let resp = c
        .post(&url)
        .json(&serde_json::json!([1, 2]))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 400, "not an object");

    let big = vec![b'a'; 10 * 1024 * 1024];
    let resp = c
        .post(&url)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await;
    // The node may answer 413 before reading the whole body; either way the client
    // must not see a success.
    if let Ok(resp) = resp {
        assert_eq!(error_of(resp).await.0, 413);
    }

    let resp = c
        .get(format!("{}/v1/nope", node.base))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 404);

    // Fields the engine would choke on (or coerce) are refused here, naming the field.
    for (field, value, code) in [
        ("max_tokens", serde_json::json!(-1), "invalid_value"),
        ("max_tokens", serde_json::json!("ten"), "invalid_type"),
        ("stream", serde_json::json!("yes"), "invalid_type"),
        ("temperature", serde_json::json!(9), "invalid_value"),
    ] {
        let mut body = chat_body("x", false);
        body[field] = value.clone();
        let resp = c.post(&url).json(&body).send().await.unwrap();
        let (status, err) = error_of(resp).await;
        assert_eq!(status, 400, "{field}={value}");
        assert_eq!(err["error"]["param"], field, "{err}");
        assert_eq!(err["error"]["code"], code, "{err}");
    }

    // A known path with the wrong method, on both ports: OpenAI JSON, not a bare 405.
    let resp = c.get(&url).send().await.unwrap();
    assert_eq!(error_of(resp).await.0, 405);
    let resp = c
        .post(format!("{}/readyz", node.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 405);

    // An oversized request head: 431 in OpenAI's shape.
    let resp = c
        .post(&url)
        .header("x-padding", "p".repeat(70 * 1024))
        .json(&chat_body("x", false))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 431);

    assert_eq!(engine.requests(), 0, "no bad request reached the engine");
    // A prompt scored, nothing generated (lm-evaluation-harness's loglikelihood): not
    // a bad request.
    let resp = c
        .post(format!("{}/v1/completions", node.base))
        .json(&serde_json::json!({"model": "m", "prompt": "a b", "max_tokens": 0, "echo": true, "logprobs": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    node.shutdown.cancel();
}

#[tokio::test]
async fn the_policy_header_is_honoured_only_when_the_config_allows_it() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let url = format!("{}/v1/chat/completions", node.base);
    let resp = client()
        .post(&url)
        .header("x-gorgo-policy", "nope")
        .json(&chat_body("x", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "ignored by default");
    // `/admin/state` says so (`gorgo bench --policy` reads it).
    assert_eq!(
        admin_json(&node, "/admin/state").await["allow_policy_header"],
        false
    );
    node.shutdown.cancel();

    let node = start_node(
        config(
            "b",
            &engine.url(),
            "[routing]\nallow_policy_header = true\n",
        ),
        None,
    )
    .await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .header("x-gorgo-policy", "nope")
        .json(&chat_body("x", false))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 400, "unknown policy header");
    assert_eq!(
        admin_json(&node, "/admin/state").await["allow_policy_header"],
        true
    );
    node.shutdown.cancel();
}

#[tokio::test]
async fn chunked_body_over_the_cap_is_413() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nmax_body_bytes = 1024\n"),
        None,
    )
    .await;
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = (0..8)
        .map(|_| Ok(bytes::Bytes::from(vec![b' '; 512])))
        .collect();
    let resp = client()
        .post(format!("{}/v1/completions", node.base))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 413);
    node.shutdown.cancel();
}

#[tokio::test]
async fn engine_failure_is_502_and_timeout_is_504() {
    let broken = broken_engine().await;
    let node = start_node(config("a", &format!("http://{broken}"), ""), None).await;
    let (status, body) = error_of(post_chat(&node, "x", false).await).await;
    assert_eq!(status, 502);
    // Clients never learn the engine's address (or credentials in its URL).
    assert!(
        !body.to_string().contains(&broken.port().to_string()),
        "{body}"
    );
    node.shutdown.cancel();

    let engine = StubEngine::start("e").await;
    engine.set_mode(HANG);
    let node = start_node(
        config(
            "b",
            &engine.url(),
            "[limits]\nfirst_byte_timeout_ms = 200\n",
        ),
        None,
    )
    .await;
    // Streamed: its head is due with its first token, within the first-byte timeout
    // (one that is not streamed waits up to the request timeout).
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("x", true))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 504);
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// An engine's own 5xx answer reaches a client with nowhere else to go as the engine
/// gave it (status, body, `x-request-id`), as it would from the engine directly:
/// llama-cpp-python answers a body it cannot parse (a role it does not know) 500 with
/// what is wrong, and the node's client got a 502 "engine answered 500" instead.
/// Streamed or not, chat or completions.
#[tokio::test]
async fn an_engines_server_error_reaches_a_client_with_nowhere_else_to_go() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(SERVER_ERROR);
    let node = start_node(
        config_with_engine("a", &engine.url(), "breaker_failures = 100\n"),
        None,
    )
    .await;
    let completion = serde_json::json!({"model": "m", "prompt": "x", "stream": true});
    for (path, body) in [
        ("/v1/chat/completions", chat_body("x", false)),
        ("/v1/completions", completion),
    ] {
        let resp = client()
            .post(format!("{}{path}", node.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 500, "{path}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        assert_eq!(resp.headers()["x-request-id"], "engine-request-7");
        assert_eq!(resp.text().await.unwrap(), SERVER_ERROR_BODY, "{path}");
    }
    // Still an engine failure to the node, counted as the engine answering for the
    // request (not against its breaker); and what the client got, the engine's error,
    // is the request's outcome.
    let metrics = &node.state().metrics;
    assert_eq!(metrics.engine_failures_of(EngineFailureKind::Answered), 2);
    assert_eq!(metrics.engine_failures_of(EngineFailureKind::Gateway), 0);
    let text = metrics_text(&node).await;
    assert_eq!(
        metric_value(&text, r#"gorgo_engine_failures_total{kind="answered"}"#),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        metric_value(&text, r#"gorgo_engine_failures_total{kind="gateway"}"#),
        Some(0.0),
        "{text}"
    );
    let outcomes: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("gorgo_requests_total{"))
        .collect();
    assert!(
        outcomes
            .iter()
            .any(|l| l.contains(r#"outcome="engine_error""#) && l.ends_with(" 2")),
        "{outcomes:?}"
    );
    assert!(
        !outcomes.iter().any(|l| l.contains("engine_failed")),
        "{outcomes:?}"
    );
    node.shutdown.cancel();
}

/// An engine's own 503 passed on to a client with nowhere else to go keeps the
/// `Retry-After` the engine sent, as it would from the engine directly: the node's own
/// back-off (`limits.retry_after_s`) goes only on a 503 that has none.
#[tokio::test]
async fn an_engines_own_503_keeps_its_retry_after() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(UNAVAILABLE);
    let node = start_node(
        config_with_engine("a", &engine.url(), "breaker_failures = 100\n"),
        None,
    )
    .await;
    let resp = post_chat(&node, "x", false).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], UNAVAILABLE_RETRY_AFTER);
    assert_eq!(
        resp.text().await.unwrap(),
        r#"{"error":{"message":"engine unavailable"}}"#
    );
    assert_eq!(
        node.state()
            .metrics
            .engine_failures_of(EngineFailureKind::Gateway),
        1
    );
    node.shutdown.cancel();
}

/// The engine's response headers a client reads reach it on every route: a stream's
/// `x-accel-buffering: no` (llama-cpp-python's, so that an nginx in front does not hold
/// its events back), and an unrouted route's `x-request-id` (only `content-type` was
/// passed on there).
#[tokio::test]
async fn engine_response_headers_pass_on_every_route() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let resp = post_chat(&node, "x", true).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-accel-buffering"], "no");
    resp.bytes().await.unwrap();
    engine.set_mode(SERVER_ERROR);
    let resp = client()
        .post(format!("{}/v1/embeddings", node.base))
        .json(&serde_json::json!({"model": "m", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 500);
    assert_eq!(resp.headers()["x-request-id"], "engine-request-7");
    node.shutdown.cancel();
}

#[tokio::test]
async fn no_engine_and_no_peer_is_503() {
    // An engine address nothing listens on: every health check fails.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let node = start_node(config("a", &format!("http://{gone}"), ""), None).await;
    assert!(!node.state().engine(0).unwrap().adapter.check_health().await);
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("x", false))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 503);
    let resp = client()
        .get(format!("{}/readyz", node.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    node.shutdown.cancel();
}

#[tokio::test]
async fn admin_api_requires_the_token_and_reports_decisions() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let c = client();
    for path in [
        "/admin/state",
        "/admin/peers",
        "/admin/decisions",
        "/admin/weights",
        "/admin/tuning",
    ] {
        let resp = c.get(format!("{}{path}", node.admin)).send().await.unwrap();
        assert_eq!(error_of(resp).await.0, 401, "{path} without token");
        let resp = c
            .get(format!("{}{path}", node.admin))
            .bearer_auth("wrong-token")
            .send()
            .await
            .unwrap();
        assert_eq!(error_of(resp).await.0, 401, "{path} with a wrong token");
        let resp = c
            .get(format!("{}{path}", node.admin))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        // The scheme's name is case-insensitive (RFC 9110); the token is not.
        for (header, status) in [
            (format!("bearer {TOKEN}"), 200),
            (format!("BEARER {TOKEN}"), 200),
            (format!("Bearer {}", TOKEN.to_uppercase()), 401),
            (format!("Basic {TOKEN}"), 401),
        ] {
            let resp = c
                .get(format!("{}{path}", node.admin))
                .header("authorization", &header)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), status, "{path} with {header}");
        }
    }
    c.post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("x", false))
        .send()
        .await
        .unwrap();
    let d = admin_json(&node, "/admin/decisions?limit=5").await;
    assert_eq!(d.as_array().unwrap().len(), 1);
    assert_eq!(d[0]["winner"], "a");
    assert!(
        d[0]["candidates"][0]["terms"]["prefill_ms"].is_number(),
        "{d}"
    );
    // A page is capped: the log is copied under the routing lock.
    let resp = c
        .get(format!("{}/admin/decisions?limit=1000000", node.admin))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let (status, body) = error_of(resp).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "limit", "{body}");

    let put_weights = |body: serde_json::Value| {
        c.put(format!("{}/admin/weights", node.admin))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
    };
    let resp = put_weights(serde_json::json!({"w_rtt": 0.5, "w_queue": 2.0}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(node.state().weights.read().w_queue, 2.0);
    // Refused, naming the field in `param`; a typo names it in the message.
    for (body, param) in [
        (serde_json::json!({"w_rtt": -1.0, "w_queue": 2.0}), "w_rtt"),
        (serde_json::json!({"w_rtt": 1.0}), "w_queue"),
        (serde_json::json!({"w_rt": 1.0, "w_queue": 2.0}), ""),
    ] {
        let (status, err) = error_of(put_weights(body.clone()).await.unwrap()).await;
        assert_eq!(status, 400, "{body}");
        if !param.is_empty() {
            assert_eq!(err["error"]["param"], param, "{err}");
        } else {
            assert!(err.to_string().contains("w_rt"), "{err}");
        }
    }

    let metrics = metrics_text(&node).await;
    assert!(metrics.contains("gorgo_requests_total"), "{metrics}");
    assert!(metrics.contains("gorgo_ttft_seconds"), "{metrics}");
    // What the cluster transport refused, by kind, there before anything was.
    for what in [
        "malformed",
        "spoofed",
        "handshake",
        "unbound_stream",
        "excess_connection",
        "misaddressed_announce",
    ] {
        let line = format!("gorgo_cluster_refused_total{{what=\"{what}\"}} 0");
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
    let resp = c
        .get(format!("{}/healthz", node.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    node.shutdown.cancel();
}

#[tokio::test]
async fn client_disconnect_releases_the_engine_request() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(STREAM_THEN_HANG);
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let mut resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("x", true))
        .send()
        .await
        .unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    assert_eq!(node.state().engine(0).unwrap().adapter.inflight(), 1);
    drop(resp);
    // The node notices the closed client connection and drops the engine stream,
    // which releases the local accounting; wait for that event, not for time.
    let state = node.state().clone();
    tokio::time::timeout(std::time::Duration::from_secs(10), async move {
        while state.engine(0).unwrap().adapter.inflight() != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("accounting released after client disconnect");
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// A response that is not streamed comes whole once the request has finished
/// decoding. Its prompt must not read as queue all that time (at this node and at
/// every peer its stats reach): the view takes its prefill as done when it is
/// expected to end, while the request still runs.
#[tokio::test]
async fn a_request_that_is_not_streamed_leaves_the_queue_at_its_expected_prefill_end() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(HANG);
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let url = format!("{}/v1/chat/completions", node.base);
    let request = tokio::spawn(async move {
        client()
            .post(url)
            .json(&chat_body(&prompt("a", 4000), false))
            .send()
            .await
    });
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    until("the request is dispatched", || adapter.inflight() == 1).await;
    assert!(adapter.queue_stats(0).unfinished_prefill_tokens > 0);
    // The engine holds the request (it is still decoding, as far as anyone can
    // tell), and its prefill is no longer anyone's queue.
    until("its prefill leaves the queue", || {
        adapter.queue_stats(0).unfinished_prefill_tokens == 0
    })
    .await;
    assert_eq!(adapter.inflight(), 1);
    // In flight for the node's gauge too, though no response head has come (it
    // counted from the head, which such a request gets with its last byte).
    let metrics = metrics_text(&node).await;
    assert!(metrics.contains("gorgo_inflight_requests 1\n"), "{metrics}");
    engine.release.notify_waiters();
    let resp = request.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    until("the request finishes", || adapter.inflight() == 0).await;
    until("the client's slot is free", || {
        node.state().client_requests_in_flight() == 0
    })
    .await;
    let metrics = metrics_text(&node).await;
    assert!(metrics.contains("gorgo_inflight_requests 0\n"), "{metrics}");
    node.shutdown.cancel();
}

/// A request that is not streamed teaches the node its engine's decode time, from
/// when its prefill was expected to end to its end: at a serial engine that prices the
/// slot wait (it stayed 0 for clients that do not stream). An error answer teaches
/// nothing (its end came about at once, and would pull the decode time to 0).
#[tokio::test]
async fn a_request_that_is_not_streamed_teaches_the_decode_time_and_an_error_does_not() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(HANG);
    let node = start_node(
        config_with_engine("a", &engine.url(), "max_running_requests = 1\n"),
        None,
    )
    .await;
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    let decode_ms = || adapter.queue_stats(0).slots.unwrap().decode_ms;
    assert_eq!(decode_ms(), 0.0);
    let url = format!("{}/v1/chat/completions", node.base);
    let send = |p: String| {
        let url = url.clone();
        tokio::spawn(async move {
            client()
                .post(url)
                .json(&chat_body(&p, false))
                .send()
                .await
                .unwrap()
        })
    };
    let request = send(prompt("a", 4000));
    until("the request is at the engine", || engine.requests() == 1).await;
    until("its prefill leaves the queue", || {
        adapter.queue_stats(0).unfinished_prefill_tokens == 0
    })
    .await;
    // Decoding, as far as the node can tell, for a while yet.
    let at = node.state().now_ms();
    until("time passes", || node.state().now_ms() >= at + 20).await;
    engine.release.notify_waiters();
    let resp = request.await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    until("the request finishes", || adapter.inflight() == 0).await;
    let learnt = decode_ms();
    assert!(learnt >= 20.0, "{learnt}");
    // An error answer, long before its prefill was expected to end.
    engine.set_mode(REJECT);
    let resp = send(prompt("b", 4000)).await.unwrap();
    assert_eq!(resp.status(), 400);
    resp.bytes().await.unwrap();
    until("the error is released", || adapter.inflight() == 0).await;
    assert_eq!(decode_ms(), learnt);
    node.shutdown.cancel();
}

/// Once the breaker's cooldown has passed, the next request is its half-open probe:
/// it reaches the engine, and its answer closes the breaker (it used to fail unsent,
/// as if the breaker had just opened, and re-open it: with no peer, a 502 from a
/// healthy engine).
#[tokio::test]
async fn a_half_open_breaker_sends_its_probe() {
    let (engine, node, adapter) = half_open_node().await;
    let resp = post_chat(&node, "hi", false).await;
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    assert_eq!(engine.requests(), 1);
    until("the probe's answer closes the breaker", || {
        adapter.breaker() == gorgo_core::health::BreakerState::Closed
    })
    .await;
    node.shutdown.cancel();
}

/// A request sent straight to the engine, as the half-open breaker's probe.
fn spawn_probe(
    adapter: &std::sync::Arc<gorgo_node::engine::EngineAdapter>,
) -> tokio::task::JoinHandle<Result<reqwest::Response, gorgo_node::engine::EngineFailure>> {
    let adapter = adapter.clone();
    tokio::spawn(async move {
        adapter
            .send_streamed(
                http::Method::POST,
                "/v1/completions",
                &[],
                bytes::Bytes::from_static(b"{}"),
                gorgo_node::engine::FirstToken::Streamed,
            )
            .await
    })
}

/// A request not streamed, whose head comes only with its whole answer, is not thrown
/// away when one health check fails and opens the breaker: it waits for its answer
/// (it was abandoned, its generation lost, and its client got a 502 with nowhere else
/// to go). When the engine fails a second check in a row, it is abandoned.
#[tokio::test]
async fn one_failed_health_check_does_not_abandon_a_request_not_streamed() {
    use gorgo_core::health::BreakerState;
    use std::sync::atomic::Ordering::SeqCst;
    let engine = StubEngine::start("e").await;
    let node = start_node(config_with_engine("a", &engine.url(), ""), None).await;
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    // After the first health check (the next is an hour away).
    until("the engine is confirmed", || adapter.is_ready()).await;
    let send = |name: &'static str| {
        let url = format!("{}/v1/chat/completions", node.base);
        tokio::spawn(async move {
            let resp = client()
                .post(url)
                .json(&chat_body(&prompt(name, 200), false))
                .send()
                .await
                .unwrap();
            resp.status()
        })
    };
    engine.set_mode(HANG);
    let held = send("held");
    until("the request is at the engine", || engine.requests() == 1).await;
    engine.unhealthy.store(true, SeqCst);
    assert!(!adapter.check_health().await);
    assert!(matches!(adapter.breaker(), BreakerState::Open { .. }));
    engine.unhealthy.store(false, SeqCst);
    engine.set_mode(NORMAL);
    engine.release.notify_waiters();
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), held)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(status, 200, "its answer reached its client");
    assert_eq!(engine.requests(), 1, "generated once");
    // A second failure in a row: the engine stays unresponsive, and the request moves.
    assert!(adapter.check_health().await);
    engine.set_mode(HANG);
    let held = send("held again");
    until("the request is at the engine", || engine.requests() == 2).await;
    engine.unhealthy.store(true, SeqCst);
    assert!(!adapter.check_health().await);
    assert!(!adapter.check_health().await);
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), held)
        .await
        .expect("abandoned long before its head timeout (600 s)")
        .unwrap();
    assert!(status.is_server_error(), "{status}");
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// A health check that fails while the half-open probe waits for its head opens the
/// breaker again, and the probe fails over at once (its outcome decides nothing any
/// more) instead of waiting out the first-byte timeout (120 s).
#[tokio::test]
async fn a_reopened_breaker_wakes_its_probe() {
    use gorgo_core::health::BreakerState;
    let (engine, node, adapter) = half_open_node().await;
    engine.set_mode(HANG);
    let probe = spawn_probe(&adapter);
    until("the probe reaches the engine", || engine.requests() == 1).await;
    assert_eq!(adapter.breaker(), BreakerState::HalfOpen { probing: true });
    engine
        .unhealthy
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(!adapter.check_health().await);
    let failed = tokio::time::timeout(std::time::Duration::from_secs(20), probe)
        .await
        .expect("the probe fails over long before the first-byte timeout")
        .unwrap();
    assert!(failed.is_err());
    assert!(matches!(adapter.breaker(), BreakerState::Open { .. }));
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// A half-open probe whose request is given up before its head (its client went away)
/// frees the probe slot: the next request may probe at once (it used to wait for the
/// next health check, an hour away here).
#[tokio::test]
async fn an_abandoned_probe_frees_the_breakers_slot() {
    use gorgo_core::health::BreakerState;
    let (engine, node, adapter) = half_open_node().await;
    engine.set_mode(HANG);
    let probe = spawn_probe(&adapter);
    until("the probe reaches the engine", || engine.requests() == 1).await;
    assert_eq!(adapter.breaker(), BreakerState::HalfOpen { probing: true });
    // Another request while the probe is out is refused unsent: the engine did not
    // fail it (a 503 for its client, not a 502, and no engine failure counted).
    let refused = spawn_probe(&adapter).await.unwrap();
    assert!(
        matches!(refused, Err(gorgo_node::engine::EngineFailure::Refused(_))),
        "{refused:?}"
    );
    assert!(!refused.unwrap_err().is_engine_failure());
    probe.abort();
    assert!(probe.await.unwrap_err().is_cancelled());
    assert_eq!(adapter.breaker(), BreakerState::HalfOpen { probing: false });
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// An engine that fails the endpoints the node passes through unrouted opens its
/// breaker as one that fails routed requests does: the end of a 5xx body is no answer
/// (it used to count as one, resetting the failures the head had just counted).
#[tokio::test]
async fn passthrough_server_errors_open_the_breaker() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(UNAVAILABLE);
    let node = start_node(
        config_with_engine("a", &engine.url(), "breaker_failures = 2\n"),
        None,
    )
    .await;
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    until("the engine is confirmed", || adapter.is_ready()).await;
    let embed = || {
        client()
            .post(format!("{}/v1/embeddings", node.base))
            .json(&serde_json::json!({"model": "m", "input": "hi"}))
            .send()
    };
    for _ in 0..2 {
        let resp = embed().await.unwrap();
        assert_eq!(resp.status(), 503);
        assert_eq!(
            resp.text().await.unwrap(),
            r#"{"error":{"message":"engine unavailable"}}"#,
            "the engine's answer"
        );
    }
    until("the relayed bodies end", || adapter.inflight() == 0).await;
    assert!(
        matches!(
            adapter.breaker(),
            gorgo_core::health::BreakerState::Open { .. }
        ),
        "{:?}",
        adapter.breaker()
    );
    // Each 5xx counts as an engine failure, as on the routed paths: a 503, a gateway
    // failure.
    let failures = |kind| node.state().metrics.engine_failures_of(kind);
    assert_eq!(failures(EngineFailureKind::Gateway), 2);
    assert_eq!(failures(EngineFailureKind::Answered), 0);
    // The open breaker takes the next one unsent: the node's 503, not counted as a
    // failure.
    let resp = embed().await.unwrap();
    assert_eq!(resp.status(), 503);
    let text = resp.text().await.unwrap();
    assert!(!text.contains("engine unavailable"), "{text}");
    assert_eq!(failures(EngineFailureKind::Gateway), 2);
    node.shutdown.cancel();
}

/// A 500 is the engine answering for the request (llama-cpp-python's answer to a body
/// it cannot parse), not the engine failing: however many come in a row, on the routed
/// and the unrouted routes, the breaker stays closed and the next good request is
/// served. Counted as 5xx, they let one client's bad requests shut the engine off for
/// everyone for a cooldown.
#[tokio::test]
async fn an_engines_500_answers_do_not_open_the_breaker() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(SERVER_ERROR);
    let node = start_node(
        config_with_engine("a", &engine.url(), "breaker_failures = 2\n"),
        None,
    )
    .await;
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    until("the engine is confirmed", || adapter.is_ready()).await;
    for stream in [false, true, false] {
        let resp = post_chat(&node, "x", stream).await;
        assert_eq!(resp.status(), 500);
        resp.bytes().await.unwrap();
    }
    let resp = client()
        .post(format!("{}/v1/embeddings", node.base))
        .json(&serde_json::json!({"model": "m", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 500);
    resp.bytes().await.unwrap();
    until("the relayed bodies end", || adapter.inflight() == 0).await;
    assert_eq!(
        adapter.breaker(),
        gorgo_core::health::BreakerState::Closed,
        "four 500s in a row"
    );
    engine.set_mode(NORMAL);
    assert_eq!(post_chat(&node, "x", false).await.status(), 200);
    node.shutdown.cancel();
}

/// A forward this node cannot hold (a prompt over its engines' context) is answered
/// 502, naming this region and why, not with the 400 its own client would get: the
/// origin checked the prompt against its own engines and serves it itself
/// (`node_cluster::a_prompt_too_long_for_the_peer_is_served_at_its_origin`).
#[tokio::test]
async fn a_forward_too_long_for_this_node_is_a_502_its_origin_serves() {
    use gorgo_node::api::{ServeError, Upstream};
    use tokio::io::AsyncReadExt;
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let request = forward_request(
        "b",
        gorgo_core::Endpoint::Completions,
        br#"{"prompt":"hello world"}"#.to_vec(),
    );
    let mut ex = forward_exchange(node.state(), &forward_frame(&request).await, |_, _| async {
        Err::<Upstream, _>(ServeError::ContextLength {
            endpoint: gorgo_core::Endpoint::Completions,
            message: "prompt too long".into(),
        })
    })
    .await;
    assert_eq!(ex.head.status, 502);
    let mut len = [0u8; 4];
    ex.from_node.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    ex.from_node.read_exact(&mut body).await.unwrap();
    let err: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let message = err["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("region a cannot serve this forward")
            && message.contains("prompt too long"),
        "{err}"
    );
    drop(ex.to_node);
    node.shutdown.cancel();
}

#[tokio::test]
async fn health_routes_and_local_passthrough_answer_as_engines_do() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let c = client();
    let resp = c.get(format!("{}/health", node.base)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.bytes().await.unwrap().len(),
        0,
        "empty, as SGLang and vLLM answer"
    );
    let resp = c
        .get(format!("{}/health_generate", node.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "a one-token generation went through");
    assert_eq!(engine.requests(), 1);
    // An answer that runs on past its cap is a failed probe, not a node buffering it.
    engine.set_mode(ENDLESS_BODY);
    let resp = c
        .get(format!("{}/health_generate", node.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("over 1 MiB"),
        "{v}"
    );
    engine.set_mode(NORMAL);
    let resp = c
        .post(format!("{}/tokenize", node.base))
        .json(&serde_json::json!({"prompt": "one two three"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "a");
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["count"], 3);
    let resp = c
        .post(format!("{}/tokenize", node.base))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 400);
    node.shutdown.cancel();

    // No engine and no peer: /health says so.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let node = start_node(config("b", &format!("http://{gone}"), ""), None).await;
    assert!(!node.state().engine(0).unwrap().adapter.check_health().await);
    let resp = c.get(format!("{}/health", node.base)).send().await.unwrap();
    assert_eq!(error_of(resp).await.0, 503);
    node.shutdown.cancel();
}

/// A peer's forward stream that carries garbage, or nothing within the body timeout,
/// gets an error head the forwarding node can act on (502: it serves the request
/// itself), and never reaches the engine.
#[tokio::test]
async fn a_forward_that_is_garbage_or_never_sent_gets_a_502_head() {
    let (engine, node) = impatient_node().await;
    let mut garbage = 8u32.to_be_bytes().to_vec();
    garbage.extend_from_slice(b"not bincode");
    assert_eq!(forward_head_status(&node, &garbage).await, 502, "garbage");
    assert_eq!(forward_head_status(&node, &[]).await, 502, "never sent");
    // A forward that left this node before (it came back), or more nodes than any
    // `max_hops` allows: the peer that sent it erred, its origin serves it.
    let node_id = |s: &str| gorgo_core::NodeId::from(s);
    for via in [
        vec![node_id("b"), node_id("a")],
        (0..9).map(|i| node_id(&format!("n{i}"))).collect(),
    ] {
        let request = gorgo_core::wire::ForwardRequest {
            hops: via.len() as u8,
            via,
            ..forward_request(
                "b",
                gorgo_core::Endpoint::Completions,
                br#"{"prompt":"hello world"}"#.to_vec(),
            )
        };
        let frame = forward_frame(&request).await;
        assert_eq!(forward_head_status(&node, &frame).await, 502, "came back");
    }
    assert_eq!(engine.requests(), 0);
    node.shutdown.cancel();
}

/// A forward is as many hops along as the nodes it has been through, whatever its
/// `hops` says: the max-hops guard reads the count, and a peer that sent `hops: 0`
/// with one node in `via` had the request forwarded again past `max_hops`.
#[tokio::test]
async fn a_forward_counts_the_hops_of_its_path() {
    let (_engine, node) = impatient_node().await;
    let request = gorgo_core::wire::ForwardRequest {
        hops: 0,
        ..forward_request(
            "b",
            gorgo_core::Endpoint::Completions,
            br#"{"prompt":"hello world"}"#.to_vec(),
        )
    };
    let frame = forward_frame(&request).await;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let ex = forward_exchange(node.state(), &frame, move |_, req| {
        let _ = tx.send(req.hops);
        std::future::pending()
    });
    let hops = tokio::select! {
        hops = rx => hops.unwrap(),
        _ = ex => panic!("no request served"),
    };
    assert_eq!(hops, 1);
    node.shutdown.cancel();
}

/// A forward this node would serve on an engine that fails it before its first byte,
/// and then refuses (its other engine costs more than the forwarding node's offer),
/// is answered with the refusal: the forwarding node serves it itself and learns from
/// it. It got a 502 (the first failure), as if this node had failed.
#[tokio::test]
async fn a_refusal_after_a_failed_try_is_a_refusal() {
    let dead = StubEngine::start("dead").await;
    let slow = StubEngine::start("slow").await;
    let engines: String = [(dead.url(), 0.01), (slow.url(), 50.0)]
        .iter()
        .map(|(url, t_p_ms)| {
            format!(
                "[[engines]]\nurl = \"{url}\"\nkind = \"sglang\"\nmetrics_interval_ms = 0\n\
                 health_interval_ms = 3600000\nt_p_ms = {t_p_ms}\n"
            )
        })
        .collect();
    let node = start_node(config_text("a", &engines, ""), None).await;
    // The cheap engine dies: connections to it are refused.
    dead.shutdown.cancel();
    let body = serde_json::json!({"model": "m", "prompt": prompt("refused", 200)});
    let request = gorgo_core::wire::ForwardRequest {
        offer: gorgo_core::decision::ForwardOffer::new(
            100.0,
            node.state().tuning.weights(),
            gorgo_core::policy::PolicyKind::Gorgo,
        ),
        ..forward_request(
            "b",
            gorgo_core::Endpoint::Completions,
            serde_json::to_vec(&body).unwrap(),
        )
    };
    let frame = forward_frame(&request).await;
    let ex = forward_exchange(node.state(), &frame, |state, req| async move {
        gorgo_node::serve::serve(&state, req).await
    })
    .await;
    assert!(ex.head.refusal.is_some(), "{:?}", ex.head);
    assert_eq!(slow.requests(), 0);
    node.shutdown.cancel();
}

/// A node whose waits on a peer's or client's bytes end after 50 ms
/// (`limits.body_timeout_ms`), for tests of peers that stop sending or reading.
async fn impatient_node() -> (std::sync::Arc<StubEngine>, TestNode) {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nbody_timeout_ms = 50\n"),
        None,
    )
    .await;
    (engine, node)
}

/// A forwarding node that stops reading the response (no flow-control credit) ends
/// the relay once a write has waited `limits.body_timeout_ms`, instead of holding the
/// forward slot and the engine request for ever.
#[tokio::test]
async fn a_forward_whose_origin_stops_reading_ends() {
    use futures::StreamExt;
    use gorgo_node::api::{ServeError, Upstream};
    use gorgo_node::peers::IncomingForward;
    let (_engine, node) = impatient_node().await;
    let (mut to_node, from_peer) = tokio::io::duplex(1 << 16);
    // A small pipe the test never reads: the response head fits, the body does not.
    let (to_peer, _unread) = tokio::io::duplex(4096);
    let request = forward_request(
        "b",
        gorgo_core::Endpoint::Completions,
        br#"{"prompt":"hello world"}"#.to_vec(),
    );
    gorgo_node::forward::write_frame(&mut to_node, &request)
        .await
        .unwrap();
    let incoming = IncomingForward {
        from: gorgo_core::NodeId::from("b"),
        send: Box::pin(to_peer),
        recv: Box::pin(from_peer),
    };
    let relay =
        gorgo_node::forward::handle_incoming(node.state().clone(), incoming, |_, _| async {
            let body = futures::stream::iter([Ok(bytes::Bytes::from(vec![b'x'; 1 << 20]))])
                .chain(futures::stream::pending());
            Ok::<_, ServeError>(Upstream {
                status: 200,
                headers: Vec::new(),
                served_by: "a".into(),
                served_by_label: "a".into(),
                hops: 1,
                body: Box::pin(body),
                chosen_terms: None,
            })
        });
    tokio::time::timeout(std::time::Duration::from_secs(20), relay)
        .await
        .expect("the relay gives up on an origin that does not read");
    drop(to_node);
    node.shutdown.cancel();
}

/// A peer's stream that grants no flow-control credit: every write to it waits.
struct NoCredit;

impl tokio::io::AsyncWrite for NoCredit {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Pending
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Pending
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Pending
    }
}

/// A peer that announces a large forward, sends no more of it and never reads the
/// answer: the error head waits on it at most `limits.body_timeout_ms`, and the body
/// budget the announced length took goes back (it is shared with the client ingress,
/// which a few such streams would otherwise turn away with 503s).
#[tokio::test]
async fn a_forward_that_never_reads_its_error_gives_everything_back() {
    use gorgo_node::peers::IncomingForward;
    use tokio::io::AsyncWriteExt;
    let (_engine, node) = impatient_node().await;
    let (mut to_node, from_peer) = tokio::io::duplex(1 << 16);
    to_node
        .write_all(&(1u32 << 20).to_be_bytes())
        .await
        .unwrap();
    let incoming = IncomingForward {
        from: gorgo_core::NodeId::from("b"),
        send: Box::pin(NoCredit),
        recv: Box::pin(from_peer),
    };
    let served = gorgo_node::forward::handle_incoming(node.state().clone(), incoming, |_, _| {
        std::future::pending::<Result<gorgo_node::api::Upstream, gorgo_node::api::ServeError>>()
    });
    tokio::time::timeout(std::time::Duration::from_secs(20), served)
        .await
        .expect("the error head gives up on a peer that grants no credit");
    assert_eq!(node.state().metrics.body_bytes_reading.get(), 0);
    drop(to_node);
    node.shutdown.cancel();
}

/// A client that stops reading a streamed answer stops hyper polling its body, so
/// the body's own deadline never fires; the request's deadline still drops the engine
/// stream and frees the request's slot.
#[tokio::test]
async fn a_client_that_stops_reading_loses_its_engine_stream_at_the_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (engine, node) = flooding_tuned_node().await;
    let slots = node.state().permits.available_permits();
    let addr = node.base.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = r#"{"model":"m","prompt":"hi","stream":true}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    // Read the head and a little of the body, then read nothing more.
    let mut first = [0u8; 1024];
    let n = conn.read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    let open = || node.state().tuning.view().open_requests;
    until("its first token counts for tuning", || open() == 1).await;
    let gone = async {
        loop {
            let active = engine.active.load(std::sync::atomic::Ordering::SeqCst);
            if active == 0 && node.state().permits.available_permits() == slots {
                break;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), gone)
        .await
        .expect("the engine stream is dropped and the slot freed at the deadline");
    // Nor is its time so far reported as a lower bound on its E2E for ever after.
    assert_eq!(open(), 0, "still open past its deadline");
    drop(conn);
    node.shutdown.cancel();
}

/// An engine that breaks inside an event: the client's stream ends with the error as
/// an event of its own (the half event is never sent), which an SSE parser reads.
#[tokio::test]
async fn an_engine_breaking_inside_an_event_ends_with_a_whole_error_event() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(FAIL_MID_EVENT);
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("x", true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut resp = resp;
    let mut text = String::from_utf8(resp.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    engine.release.notify_one();
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "{text}");
    for e in &events {
        let data = e.strip_prefix("data: ").expect("one data line per event");
        let v: serde_json::Value = serde_json::from_str(data).expect("each event parses");
        assert!(v.is_object(), "{e}");
    }
    let err: serde_json::Value = serde_json::from_str(&events[1]["data: ".len()..]).unwrap();
    assert_eq!(err["error"]["code"], "engine_failed", "{err}");
    node.shutdown.cancel();
}

/// A bad admin path or an admin body over its limit gets an OpenAI error body (400,
/// and 413 for the size), as every other refusal does, not axum's plain text.
#[tokio::test]
async fn bad_admin_paths_and_bodies_get_openai_errors() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let c = client();
    for (method, path) in [
        (reqwest::Method::DELETE, "/admin/engines/abc"),
        (reqwest::Method::DELETE, "/admin/engines/70000"),
        (reqwest::Method::POST, "/admin/engines/x/drain"),
    ] {
        let resp = c
            .request(method, format!("{}{path}", node.admin))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        let (status, body) = error_of(resp).await;
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body["error"]["message"].is_string(), "{path}: {body}");
    }
    let ids: Vec<u32> = (0..40_000).collect();
    let resp = c
        .post(format!("{}/admin/prefix_match", node.admin))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({ "token_ids": ids }))
        .send()
        .await
        .unwrap();
    let (status, body) = error_of(resp).await;
    assert_eq!(status, 413, "{body}");
    node.shutdown.cancel();
}

/// A listen address that is taken stops the node with an error naming the field and
/// the address, not a bare "address in use".
#[tokio::test]
async fn a_taken_listen_address_is_named() {
    let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = taken.local_addr().unwrap();
    let mut cfg = config("a", "http://127.0.0.1:1", "").into_inner();
    cfg.listen.admin = addr;
    let e = gorgo_node::NodeListeners::bind(&cfg)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`listen.admin`") && e.contains(&addr.to_string()),
        "{e}"
    );
}

/// A client that leaves before the response head (the engine still working on a
/// non-streamed answer, or hung) is counted as cancelled, with the policy that routed
/// it, and its engine request is dropped. It was in no count at all: a hung engine
/// whose clients gave up showed as a node with no traffic and no errors.
#[tokio::test]
async fn a_client_that_leaves_before_the_head_is_counted_as_cancelled() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    engine.set_mode(HANG);
    let adapter = &node.state().engine(0).unwrap().adapter;
    for (sent, stream) in [false, true].into_iter().enumerate() {
        let url = format!("{}/v1/chat/completions", node.base);
        let body = chat_body("leaving early", stream);
        let pending = tokio::spawn(async move { client().post(url).json(&body).send().await });
        until("the engine to hold the request", || {
            engine.requests() as usize > sent && adapter.inflight() == 1
        })
        .await;
        pending.abort();
        until("the engine request to be dropped", || {
            adapter.inflight() == 0
        })
        .await;
    }
    let series = r#"gorgo_requests_total{outcome="cancelled",policy="gorgo",served_by=""}"#;
    let mut counted = None;
    for _ in 0..2000 {
        counted = metric_value(&metrics_text(&node).await, series);
        if counted == Some(2.0) {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(counted, Some(2.0), "{}", metrics_text(&node).await);
    engine.release.notify_waiters();
}

/// The routes passed to the engine unrouted tell malformed JSON from JSON of another
/// shape, as the routed ones do (they called both "must be a JSON object").
#[tokio::test]
async fn passed_through_routes_name_malformed_json() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    for (body, says) in [("{", "malformed JSON"), ("[1]", "must be a JSON object")] {
        let resp = client()
            .post(format!("{}/v1/embeddings", node.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        let v: serde_json::Value = resp.json().await.unwrap();
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
}

/// A body of more JSON objects and arrays than the node parses is refused before it is
/// parsed (its parsed form is many times its size: 230,000 tiny messages in 7.8 MB took
/// a node from 50 to 360 MB), on the routed and the passed-through routes alike; one
/// just within the cap is parsed (and here served).
#[tokio::test]
async fn a_body_of_too_many_objects_is_refused_unparsed() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let body = |messages: usize| {
        let one = r#"{"role":"user","content":"x"}"#;
        format!(
            r#"{{"model":"m","max_tokens":1,"messages":[{}]}}"#,
            vec![one; messages].join(",")
        )
    };
    let cap = gorgo_node::validate::MAX_JSON_CONTAINERS;
    for path in ["/v1/chat/completions", "/v1/embeddings"] {
        let resp = client()
            .post(format!("{}{path}", node.base))
            .header("content-type", "application/json")
            .body(body(cap))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{path}");
        let v: serde_json::Value = resp.json().await.unwrap();
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("JSON objects and arrays"),
            "{path}: {message}"
        );
    }
    assert_eq!(engine.requests(), 0);
    // The body's own object and the array hold two of the cap.
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .header("content-type", "application/json")
        .body(body(cap - 2))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

/// An engine behind a gateway that routes by path (`location /llama/` of an nginx, a
/// KServe or cloud serving endpoint): with `engine.url = "http://gw/llama/"` every
/// request the node makes of the engine (its health check, its `/metrics` scrape, its
/// reads of `/v1/models` and `/get_server_info`, a client's chat) goes under
/// `/llama`, the trailing `/` written once. The URL was refused ("without a path").
#[tokio::test]
async fn an_engine_behind_a_path_prefix_is_asked_everything_under_it() {
    let engine = StubEngine::start("e").await;
    // The gateway: `/llama/...` reaches the stub with the prefix stripped; any other
    // path is 404. Every path asked is recorded.
    use axum::response::IntoResponse;
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = format!("http://{}", listener.local_addr().unwrap());
    let (stub, log) = (engine.url(), seen.clone());
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (stub, log) = (stub.clone(), log.clone());
        async move {
            let path = req.uri().path().to_owned();
            log.lock().push(path.clone());
            let Some(rest) = path.strip_prefix("/llama/") else {
                return (axum::http::StatusCode::NOT_FOUND, Vec::new()).into_response();
            };
            let method = req.method().clone();
            let body = axum::body::to_bytes(req.into_body(), usize::MAX)
                .await
                .unwrap();
            let resp = client()
                .request(method, format!("{stub}/{rest}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = axum::http::StatusCode::from_u16(resp.status().as_u16()).unwrap();
            (status, resp.bytes().await.unwrap().to_vec()).into_response()
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let section = format!(
        "[engine]\nurl = \"{gateway}/llama/\"\nkind = \"sglang\"\n\
         health_interval_ms = 50\nmetrics_interval_ms = 50\n"
    );
    let node = start_node(config_text("a", &section, ""), None).await;
    let asked = |path: &str| seen.lock().iter().any(|p| p == path);
    until("health check, scrape and reads under /llama", || {
        [
            "/llama/health",
            "/llama/metrics",
            "/llama/v1/models",
            "/llama/get_server_info",
        ]
        .iter()
        .all(|p| asked(p))
    })
    .await;
    let resp = post_chat(&node, "behind a gateway", false).await;
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "hello world");
    assert!(asked("/llama/v1/chat/completions"));
    let seen = seen.lock().clone();
    assert!(
        seen.iter()
            .all(|p| p.starts_with("/llama/") && !p.contains("//")),
        "{seen:?}"
    );
    node.shutdown.cancel();
}
