//! Properties of the canonical prompt rendering: extending a conversation extends its
//! bytes and keeps its full blocks' hashes; arbitrary JSON never panics.

use gorgo_core::prompt::{canonicalize, canonicalize_body};
use gorgo_core::{CoreError, Endpoint, PromptHasher};
use proptest::prelude::*;
use serde_json::{json, Value};

fn message() -> impl Strategy<Value = Value> {
    let text = "[a-z \\n]{0,300}";
    let role = prop_oneof![
        Just("system"),
        Just("user"),
        Just("assistant"),
        Just("tool")
    ];
    let part = prop_oneof![
        3 => text.prop_map(|t| json!({"type": "text", "text": t})),
        1 => "[a-z]{1,12}".prop_map(|u| json!({"type": "image_url", "image_url": {"url": u}})),
    ];
    let content = prop_oneof![
        3 => text.prop_map(Value::from),
        1 => prop::collection::vec(part, 0..4).prop_map(Value::from),
        1 => Just(Value::Null),
    ];
    (role, content).prop_map(|(r, c)| json!({"role": r, "content": c}))
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z]{0,8}".prop_map(Value::from),
        prop_oneof![
            Just("messages"),
            Just("prompt"),
            Just("role"),
            Just("content"),
            Just("text")
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 6, |inner| {
        let key = prop_oneof![
            Just("messages".to_string()),
            Just("prompt".to_string()),
            Just("role".to_string()),
            Just("content".to_string()),
            Just("type".to_string()),
            Just("text".to_string()),
            Just("tools".to_string()),
            Just("tool_calls".to_string()),
            "[a-z]{1,5}",
        ];
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(key, inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    /// Turn n+1 renders to bytes starting with turn n's, so every full block of turn n
    /// hashes identically in turn n+1.
    #[test]
    fn extending_a_conversation_preserves_its_prefix(
        messages in prop::collection::vec(message(), 1..8),
        extra in prop::collection::vec(message(), 1..3),
        block in 1usize..300,
    ) {
        let before = canonicalize(Endpoint::Chat, &json!({"messages": messages})).unwrap();
        let mut longer = messages.clone();
        longer.extend(extra);
        let after = canonicalize(Endpoint::Chat, &json!({"messages": longer})).unwrap();
        prop_assert!(after.starts_with(&before));
        let hasher = PromptHasher::new(block, Box::new(gorgo_core::BytesPerToken(4))).unwrap();
        let (a, b) = (hasher.chain(&before), hasher.chain(&after));
        let full = before.len() / block;
        prop_assert_eq!(&a.hashes[..full], &b.hashes[..full]);
    }

    /// Same for completions prompts given as growing token-id arrays (at least one id:
    /// a prompt of none is refused, as engines refuse it).
    #[test]
    fn extending_token_ids_preserves_prefix(ids in prop::collection::vec(any::<u32>(), 1..200), more in prop::collection::vec(any::<u32>(), 0..50)) {
        let before = canonicalize(Endpoint::Completions, &json!({"prompt": ids})).unwrap();
        let mut longer = ids.clone();
        longer.extend(more);
        let after = canonicalize(Endpoint::Completions, &json!({"prompt": longer})).unwrap();
        prop_assert!(after.starts_with(&before));
        prop_assert_eq!(PromptHasher::default().chain(&after).total_tokens(), longer.len() as u64);
    }

    /// Whatever the JSON, rendering gives bytes or `InvalidRequest`, never a panic.
    #[test]
    fn arbitrary_json_never_panics(body in any_json()) {
        for endpoint in [Endpoint::Chat, Endpoint::Completions] {
            match canonicalize(endpoint, &body) {
                Ok(_) | Err(CoreError::InvalidRequest(_)) => {}
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
        }
    }

    /// Arbitrary bytes as a body: never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = canonicalize_body(Endpoint::Chat, &bytes);
        let _ = canonicalize_body(Endpoint::Completions, &bytes);
    }
}
