//! The conventions a live replay (`gorgo bench`) and a simulation (`gorgo sim`) of one
//! trace must share, each defined once.
//!
//! A simulation is only comparable with a live run when its simulated clients behave
//! like the bench's real ones: the same client sits in the same home region, sends the
//! same session key, has its prompt shortened to the same context, and names the same
//! model (which is part of the body the node hashes). Both drivers call these and
//! nothing else.

use gorgo_core::hash::hash_bytes;

use crate::TraceRequest;

/// The `model` field of the requests `gorgo bench` sends by default: the name the
/// engine emulator answers to. A simulation that builds request bodies like the bench
/// (to hash prompts like the node) uses it too, since the body's bytes decide the chain.
pub const DEFAULT_MODEL: &str = "gorgo-emulated";

/// Tokens the chat template adds around a prompt. The engine counts them against its
/// context, so [`clamp_to_context`] keeps them free.
pub const CHAT_TEMPLATE_TOKENS: u64 = 64;

/// Smallest `--max-context-tokens` (`gorgo bench`, `gorgo sim`): the chat template's
/// [`CHAT_TEMPLATE_TOKENS`], one prompt token and one output token. Only prompts are
/// shortened, never outputs: a row whose output does not fit beside a one-token prompt
/// keeps it, and asks for more than the limit (an engine of that context refuses it).
pub const MIN_CONTEXT_TOKENS: u64 = CHAT_TEMPLATE_TOKENS + 2;

/// The most prompt tokens a request with `output_tokens` may have so that prompt,
/// output and chat template fit an engine context of `max_context` tokens (at least 1).
/// A row of no output is sent (and simulated) asking for one token
/// ([`crate::prompt::chat_body`]): that one counts too.
pub fn context_prompt_limit(output_tokens: u32, max_context: u64) -> u64 {
    max_context
        .saturating_sub(u64::from(output_tokens.max(1)))
        .saturating_sub(CHAT_TEMPLATE_TOKENS)
        .max(1)
}

/// Shorten `req`'s prompt to [`context_prompt_limit`] (`--max-context-tokens` of both
/// `gorgo bench` and `gorgo sim`); returns whether it was shortened. Only the prompt's
/// length changes: its arrival and block ids stay, so a shortened prompt keeps its
/// cacheable prefix.
pub fn clamp_to_context(req: &mut TraceRequest, max_context: u64) -> bool {
    let limit = context_prompt_limit(req.output_tokens, max_context);
    if req.input_tokens > limit {
        req.input_tokens = limit;
        true
    } else {
        false
    }
}

/// The session id a client sends as `x-session-id` for session-affinity policies: the
/// conversation within its user (`user/session`), else the session, else the user;
/// `None` when the trace names neither.
pub fn session_id(req: &TraceRequest) -> Option<String> {
    match (&req.session, &req.user) {
        (Some(s), Some(u)) => Some(format!("{u}/{s}")),
        (Some(s), None) => Some(s.clone()),
        (None, u) => u.clone(),
    }
}

/// [`session_id`] keyed as the node keys the `x-session-id` header it receives
/// ([`gorgo_core::headers::session_key`]): what the routing policy sees.
pub fn session_key(req: &TraceRequest) -> Option<u64> {
    session_id(req).map(|s| gorgo_core::headers::session_key(&s))
}

/// The index in `regions` of the home region of trace request number `index`: the
/// trace's own `home_region` when `regions` has it; else a hash of its user (so a
/// user's requests stay in one region), else of its session, else of its position.
/// `salt` (`gorgo sim --region-seed`) reshuffles the hashed assignment; `None` is the
/// assignment `gorgo bench` uses, so a simulation and a live replay of one trace put
/// every client in the same region. 0 when `regions` is empty.
pub fn home_region(req: &TraceRequest, index: u64, regions: &[String], salt: Option<u64>) -> usize {
    if let Some(r) = &req.home_region {
        if let Some(i) = regions.iter().position(|n| n == r) {
            return i;
        }
    }
    let mut key = match (&req.user, &req.session) {
        (Some(u), _) => u.as_bytes().to_vec(),
        (None, Some(s)) => s.as_bytes().to_vec(),
        (None, None) => index.to_le_bytes().to_vec(),
    };
    if let Some(s) = salt {
        key.extend_from_slice(&s.to_le_bytes());
    }
    (hash_bytes(&key) % regions.len().max(1) as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockIds;

    fn req(user: Option<&str>, session: Option<&str>, home: Option<&str>) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            input_tokens: 40,
            output_tokens: 3,
            blocks: BlockIds::Int(vec![1, 2]),
            tokens_per_block: 16,
            user: user.map(str::to_owned),
            session: session.map(str::to_owned),
            home_region: home.map(str::to_owned),
            request_id: None,
            system_prompt_hash: None,
        }
    }

    fn regions() -> Vec<String> {
        vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]
    }

    #[test]
    fn home_regions_are_stable_and_respect_the_trace() {
        let regions = regions();
        assert_eq!(
            home_region(&req(None, None, Some("b")), 0, &regions, None),
            1
        );
        // The trace's region wins over a salt too.
        assert_eq!(
            home_region(&req(None, None, Some("b")), 0, &regions, Some(7)),
            1
        );
        // Unknown trace region: fall back to hashing, still within the cluster.
        assert!(home_region(&req(None, None, Some("mars")), 5, &regions, None) < 3);
        // One user, one region, whatever the position or session.
        let u0 = home_region(&req(Some("u1"), Some("s1"), None), 0, &regions, None);
        let u9 = home_region(&req(Some("u1"), Some("s2"), None), 9, &regions, None);
        assert_eq!(u0, u9);
        // Positions spread over every region, with or without a salt.
        for salt in [None, Some(3)] {
            let mut seen: Vec<usize> = (0..60)
                .map(|i| home_region(&req(None, None, None), i, &regions, salt))
                .collect();
            seen.sort();
            seen.dedup();
            assert_eq!(seen, vec![0, 1, 2]);
        }
        // A salt changes the assignment of some positions.
        let moved = (0..60)
            .filter(|&i| {
                home_region(&req(None, None, None), i, &regions, None)
                    != home_region(&req(None, None, None), i, &regions, Some(3))
            })
            .count();
        assert!(moved > 0);
        assert_eq!(home_region(&req(None, None, None), 4, &[], None), 0);
    }

    #[test]
    fn session_ids_key_on_the_conversation_within_the_user() {
        assert_eq!(
            session_id(&req(Some("u"), Some("s"), None)).as_deref(),
            Some("u/s")
        );
        assert_eq!(
            session_id(&req(None, Some("s"), None)).as_deref(),
            Some("s")
        );
        assert_eq!(
            session_id(&req(Some("u"), None, None)).as_deref(),
            Some("u")
        );
        assert_eq!(session_id(&req(None, None, None)), None);
        assert_eq!(
            session_key(&req(Some("u"), Some("s"), None)),
            Some(hash_bytes(b"u/s"))
        );
    }

    #[test]
    fn clamping_keeps_prompt_output_and_template_within_the_context() {
        let mut r = req(None, None, None);
        assert!(!clamp_to_context(&mut r, 1000));
        assert_eq!(r.input_tokens, 40);
        r.input_tokens = 5000;
        assert!(clamp_to_context(&mut r, 1000));
        assert_eq!(r.input_tokens, 1000 - 3 - CHAT_TEMPLATE_TOKENS);
        // A context too small for the output still leaves a one-token prompt.
        assert_eq!(context_prompt_limit(500, 100), 1);
        // No output is sent as one token: it counts (the prompt plus the template and
        // the one token asked for overflowed the context by one).
        assert_eq!(
            context_prompt_limit(0, 4096),
            4096 - 1 - CHAT_TEMPLATE_TOKENS
        );
    }

    #[test]
    fn the_default_model_is_the_emulators() {
        let body = crate::chat_body(&req(None, None, None), DEFAULT_MODEL);
        assert_eq!(body["model"], "gorgo-emulated");
    }
}
