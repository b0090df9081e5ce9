//! Request fields checked at the node, by OpenAI's rules (types and ranges), so a bad
//! request gets a precise 400 naming its field here instead of an engine-specific
//! error (or a crash, or silent coercion) after it was routed, forwarded and queued.
//!
//! Only fields whose meaning is common to OpenAI, vLLM and SGLang are checked; unknown
//! fields pass through (engines have many extensions). The prompt itself (`messages`,
//! `prompt`) is checked where it is canonicalised, in `gorgo_core::prompt`.

use gorgo_core::Endpoint;
use serde_json::Value;

/// A field that breaks the rules: its name, the OpenAI error code (`invalid_type` or
/// `invalid_value`) and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidField {
    /// The request field (`param` in the error body).
    pub param: &'static str,
    /// `invalid_type` or `invalid_value`.
    pub code: &'static str,
    /// What is wrong, for people.
    pub message: String,
}

#[derive(Clone, Copy)]
enum Rule {
    Bool,
    String,
    Object,
    /// An integer in the range.
    Int(i64, i64),
    /// A number in the range.
    Number(f64, f64),
    /// A string or an array of strings.
    Stop,
    /// Chat: a boolean; completions: an integer 0..=20.
    Logprobs,
    /// Chat: at least 1; completions: at least 0 (`max_tokens: 0` with `echo` scores a
    /// prompt without generating: lm-evaluation-harness's loglikelihood requests, which
    /// vLLM and SGLang take).
    MaxTokens,
}

const RULES: &[(&str, Rule)] = &[
    ("model", Rule::String),
    ("stream", Rule::Bool),
    ("max_tokens", Rule::MaxTokens),
    ("max_completion_tokens", Rule::Int(1, i64::MAX)),
    ("n", Rule::Int(1, 128)),
    ("temperature", Rule::Number(0.0, 2.0)),
    ("top_p", Rule::Number(0.0, 1.0)),
    ("presence_penalty", Rule::Number(-2.0, 2.0)),
    ("frequency_penalty", Rule::Number(-2.0, 2.0)),
    ("seed", Rule::Int(i64::MIN, i64::MAX)),
    ("stop", Rule::Stop),
    ("logprobs", Rule::Logprobs),
    ("top_logprobs", Rule::Int(0, 20)),
    ("stream_options", Rule::Object),
    ("logit_bias", Rule::Object),
    ("user", Rule::String),
];

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(param: &'static str, expected: &str, got: &Value) -> InvalidField {
    InvalidField {
        param,
        code: "invalid_type",
        message: format!(
            "Invalid type for '{param}': expected {expected}, but got {} instead.",
            type_name(got)
        ),
    }
}

fn out_of_range(param: &'static str, range: String, got: &Value) -> InvalidField {
    InvalidField {
        param,
        code: "invalid_value",
        message: format!("Invalid value for '{param}': {got} is not in {range}."),
    }
}

fn check(
    param: &'static str,
    rule: Rule,
    v: &Value,
    endpoint: Endpoint,
) -> Result<(), InvalidField> {
    match rule {
        Rule::Bool if v.is_boolean() => Ok(()),
        Rule::Bool => Err(wrong_type(param, "a boolean", v)),
        Rule::String if v.is_string() => Ok(()),
        Rule::String => Err(wrong_type(param, "a string", v)),
        Rule::Object if v.is_object() => Ok(()),
        Rule::Object => Err(wrong_type(param, "an object", v)),
        Rule::Int(lo, hi) => {
            let n = v
                .as_i64()
                .or_else(|| v.as_u64().map(|_| i64::MAX))
                .ok_or_else(|| wrong_type(param, "an integer", v))?;
            if n < lo || n > hi {
                let range = match (lo, hi) {
                    (lo, i64::MAX) => format!("[{lo}, inf)"),
                    (lo, hi) => format!("[{lo}, {hi}]"),
                };
                return Err(out_of_range(param, range, v));
            }
            Ok(())
        }
        Rule::Number(lo, hi) => {
            let x = v.as_f64().ok_or_else(|| wrong_type(param, "a number", v))?;
            if !(lo..=hi).contains(&x) {
                return Err(out_of_range(param, format!("[{lo}, {hi}]"), v));
            }
            Ok(())
        }
        Rule::Stop => match v {
            Value::String(_) => Ok(()),
            Value::Array(items) if items.iter().all(Value::is_string) => Ok(()),
            _ => Err(wrong_type(param, "a string or an array of strings", v)),
        },
        Rule::Logprobs => match endpoint {
            Endpoint::Chat => check(param, Rule::Bool, v, endpoint),
            Endpoint::Completions => check(param, Rule::Int(0, 20), v, endpoint),
        },
        Rule::MaxTokens => match endpoint {
            Endpoint::Chat => check(param, Rule::Int(1, i64::MAX), v, endpoint),
            Endpoint::Completions => check(param, Rule::Int(0, i64::MAX), v, endpoint),
        },
    }
}

/// Check the fields of a parsed request body (a JSON object). `null` means unset, as
/// in OpenAI's API.
pub fn validate_request(endpoint: Endpoint, body: &Value) -> Result<(), InvalidField> {
    for &(param, rule) in RULES {
        match body.get(param) {
            None | Some(Value::Null) => {}
            Some(v) => check(param, rule, v, endpoint)?,
        }
    }
    Ok(())
}

/// Most JSON objects and arrays a client's body may hold. Parsed, each costs hundreds
/// of bytes to a few KiB, whatever its size in the body: a 7.8 MB body of 230,000 tiny
/// messages (refused anyway, over the context) took a node from about 50 to 360 MB of
/// resident memory, and one body parses per runtime worker at a time, so a node on a
/// large machine could be made to hold gigabytes. A conversation of thousands of turns
/// with tool calls holds a few tens of thousands. At the cap a body still costs about
/// 100 MB parsed (65,534 tiny messages in 2 MB: resident memory 17 -> 121 MB, release
/// build); refused before parsing, 230,000 in 6.9 MB cost 7 MB. Scalars are bounded
/// apart, by [`MAX_JSON_VALUES`].
pub const MAX_JSON_CONTAINERS: usize = 65_536;

/// Most JSON values a client's body may hold: every number, string, `true`, `false`,
/// `null`, object and array, and every object key (a member costs its key's `String`
/// and its map entry besides its value: about 126 bytes parsed). Parsed, a value costs
/// 32 bytes and a short string or key about as much again, whatever its size in the
/// body, so the count, not the body's size, must bound what parsing holds: 8 MiB of
/// `0,` parsed to 128 MB, and 256 MiB of it (the ceiling of `limits.max_body_bytes`)
/// would to about 4 GB. 2^21 lets through a token-id prompt of a 1M-token context (1,048,576
/// ids, about 7 MB, 32 MB parsed) twice over, so also batches of token-id lists,
/// `logit_bias` maps of a whole vocabulary and long tool schemas. The worst body within
/// both caps (65,534 one-member objects, the rest one-character strings: 8.3 MB) costs
/// 162 MB parsed, whatever `limits.max_body_bytes` is; 2^21 zeros cost 64 MB (release
/// build, glibc's allocator).
pub const MAX_JSON_VALUES: usize = 1 << 21;

/// Why `body` must not be parsed, if it must not: more than `max_containers` JSON
/// objects and arrays, or more than `max_values` JSON values (see [`MAX_JSON_VALUES`]
/// for what counts), found in one pass over its bytes before it is parsed. The answer
/// is the message of the client's 400. Malformed JSON counts too (a stray byte outside
/// a string as a scalar); the parser says what is wrong with it. Strings' bytes are not
/// counted: a string costs its length once parsed, which the body's size bounds.
pub fn too_much_json(body: &[u8], max_containers: usize, max_values: usize) -> Option<String> {
    let (mut containers, mut values) = (0usize, 0usize);
    // Inside a string; after its backslash; inside a number or literal.
    let (mut in_string, mut escaped, mut in_scalar) = (false, false, false);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        // What ends a number or literal (and is none of it).
        let delimiter = matches!(
            b,
            b'"' | b'{' | b'[' | b'}' | b']' | b',' | b':' | b' ' | b'\t' | b'\n' | b'\r'
        );
        let starts_value = match b {
            b'"' => {
                in_string = true;
                true
            }
            b'{' | b'[' => {
                containers += 1;
                if containers > max_containers {
                    return Some(format!(
                        "request body holds more than {max_containers} JSON objects and arrays"
                    ));
                }
                true
            }
            _ => !delimiter && !in_scalar,
        };
        in_scalar = !delimiter;
        if starts_value {
            values += 1;
            if values > max_values {
                return Some(format!(
                    "request body holds too many JSON values: more than {max_values} \
                     (numbers, strings, literals, objects, arrays and object keys)"
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The containers cap, as [`too_much_json`] applies it with room for every value.
    fn too_many_containers(body: &[u8], max: usize) -> bool {
        too_much_json(body, max, usize::MAX).is_some()
    }

    /// The values cap, as [`too_much_json`] applies it with room for every container.
    fn too_many_values(body: &[u8], max: usize) -> bool {
        too_much_json(body, usize::MAX, max).is_some()
    }

    /// Brackets inside strings, escaped quotes among them, are not containers.
    #[test]
    fn containers_are_counted_outside_strings() {
        let body = br#"{"messages":[{"role":"user","content":"[{ \"[{\" }]"}]}"#;
        assert!(!too_many_containers(body, 3));
        assert!(too_many_containers(body, 2));
        assert!(!too_many_containers(br#""{{{[[[""#, 0));
        assert!(too_many_containers(br#"[["#, 1));
        let m = too_much_json(b"[[", 1, usize::MAX).unwrap();
        assert!(m.contains("more than 1 JSON objects and arrays"), "{m}");
    }

    /// Every value counts once, scalars and object keys too, whatever the spacing and
    /// whatever a string holds; a number is one value however many digits it has.
    #[test]
    fn values_are_counted_scalars_and_keys_too() {
        // Object, key, string, key, array, 3 numbers, true, null, false, key, "".
        let body = br#" { "a" : "x,1 \" 2" , "b":[ -12.5e3 ,0,7, true,null , false],"":""} "#;
        assert!(!too_many_values(body, 13));
        assert!(too_many_values(body, 12));
        assert!(!too_many_values(b"123456789", 1));
        assert!(too_many_values(b"[1,2]", 2));
        assert!(!too_many_values(b"[1,2]", 3));
        // Malformed: a stray byte is a value; the parser refuses it anyway.
        assert!(too_many_values(b"[1 2]", 2));
        let m = too_much_json(b"[0,0,0]", usize::MAX, 3).unwrap();
        assert!(m.contains("too many JSON values: more than 3"), "{m}");
    }

    /// 8 MiB of `0,` (128 MB parsed) is refused by the node's caps; a completions
    /// prompt of token ids filling a 1M-token context passes, as does a batch of such
    /// lists totalling 2 million ids.
    #[test]
    fn a_long_context_token_id_prompt_passes_the_caps() {
        let caps = |body: &[u8]| too_much_json(body, MAX_JSON_CONTAINERS, MAX_JSON_VALUES);
        let zeros = format!("[{}0]", "0,".repeat(4 << 20));
        let m = caps(zeros.as_bytes()).expect("refused");
        assert!(m.contains(&format!("more than {MAX_JSON_VALUES}")), "{m}");
        let ids = |n: usize| {
            (0..n)
                .map(|i| (i * 7919 % 151_000).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let prompt = format!(
            r#"{{"model":"m","max_tokens":16,"logit_bias":{{"50256":-100}},"prompt":[{}]}}"#,
            ids(1 << 20)
        );
        assert_eq!(caps(prompt.as_bytes()), None);
        let quarter = ids(500_000);
        let batch = format!(
            r#"{{"model":"m","prompt":[[{quarter}],[{quarter}],[{quarter}],[{quarter}]]}}"#
        );
        assert_eq!(caps(batch.as_bytes()), None);
    }

    fn err(body: Value) -> InvalidField {
        validate_request(Endpoint::Chat, &body).unwrap_err()
    }

    #[test]
    fn good_requests_pass() {
        let body = json!({"model": "m", "messages": [], "max_tokens": 16, "stream": true,
            "temperature": 0.7, "top_p": 1, "stop": ["\n"], "n": 1, "seed": -3,
            "logprobs": true, "top_logprobs": 5, "stream_options": {"include_usage": true},
            "max_tokens_extension_field": "passes"});
        assert_eq!(validate_request(Endpoint::Chat, &body), Ok(()));
        let nulls = json!({"max_tokens": null, "stream": null, "stop": null});
        assert_eq!(validate_request(Endpoint::Chat, &nulls), Ok(()));
        let completions = json!({"prompt": "x", "logprobs": 3});
        assert_eq!(
            validate_request(Endpoint::Completions, &completions),
            Ok(())
        );
        // A prompt scored, nothing generated (lm-evaluation-harness): completions only.
        let scored = json!({"prompt": "x", "max_tokens": 0, "echo": true, "logprobs": 1});
        assert_eq!(validate_request(Endpoint::Completions, &scored), Ok(()));
        let e = validate_request(Endpoint::Chat, &json!({"max_tokens": 0})).unwrap_err();
        assert_eq!((e.param, e.code), ("max_tokens", "invalid_value"));
    }

    #[test]
    fn the_fields_an_operator_saw_reach_the_engine_are_refused() {
        let e = err(json!({"max_tokens": -1}));
        assert_eq!((e.param, e.code), ("max_tokens", "invalid_value"));
        let e = err(json!({"max_tokens": "ten"}));
        assert_eq!((e.param, e.code), ("max_tokens", "invalid_type"));
        assert!(e.message.contains("expected an integer"), "{}", e.message);
        let e = err(json!({"stream": "yes"}));
        assert_eq!((e.param, e.code), ("stream", "invalid_type"));
        let e = err(json!({"max_tokens": 1.5}));
        assert_eq!(e.param, "max_tokens");
        let e = err(json!({"temperature": 3}));
        assert_eq!((e.param, e.code), ("temperature", "invalid_value"));
        let e = err(json!({"stop": [1]}));
        assert_eq!(e.param, "stop");
        let e = err(json!({"n": 0}));
        assert_eq!(e.param, "n");
        let e = err(json!({"logprobs": 2}));
        assert_eq!(e.param, "logprobs");
        // A huge max_tokens is the context check's business, not a type error.
        let huge = json!({"max_tokens": 18446744073709551615u64});
        assert_eq!(validate_request(Endpoint::Chat, &huge), Ok(()));
    }
}
