//! Every built-in profile is on its documented memory-bandwidth roofline
//! (`support/roofline.rs`, docs/engine-profiles.md): the decode step with the KV cache
//! full, and the KV capacity derived from memory.

mod support {
    pub mod roofline;
}
use support::roofline::Roofline;

use gorgo_engine::Profile;

#[test]
fn every_built_in_profile_has_a_roofline_and_only_those() {
    let names = Profile::built_in_names();
    for name in &names {
        assert!(Roofline::of(name).is_some(), "{name}: no roofline inputs");
    }
    for r in &support::roofline::ROOFLINES {
        assert!(names.contains(&r.profile), "{}: not a profile", r.profile);
    }
}

#[test]
fn decode_step_at_full_kv_is_on_the_roofline() {
    for name in Profile::built_in_names() {
        let p = Profile::by_name(name).unwrap();
        let r = Roofline::of(name).unwrap();
        let (b, c) = (r.full_kv_batch, p.max_total_tokens);
        assert!(
            c / b as u64 <= p.context_length,
            "{name}: batch {b} cannot hold {c} tokens within the context length"
        );
        let model = p.decode_step_ms(b, c);
        let roofline = r.decode_step_ms(b, c);
        let ratio = model / roofline;
        assert!(
            (0.9..=1.1).contains(&ratio),
            "{name}: decode step at batch {b}, {c} context tokens: profile {model:.1} ms, \
             roofline {roofline:.1} ms (ratio {ratio:.3})"
        );
    }
}

#[test]
fn per_context_token_cost_is_the_kv_read() {
    // The per-context-token term alone is the KV bytes over the effective bandwidth.
    for name in Profile::built_in_names() {
        let p = Profile::by_name(name).unwrap();
        let r = Roofline::of(name).unwrap();
        let kv_ms = 1e3 * r.kv_bytes_per_token / (r.bandwidth_bytes_per_s * r.efficiency);
        let ratio = p.per_ctx_token_ms / kv_ms;
        assert!(
            (0.98..=1.02).contains(&ratio),
            "{name}: per_ctx_token_ms {} vs KV read {kv_ms:.3e} ms",
            p.per_ctx_token_ms
        );
    }
}

#[test]
fn kv_capacity_follows_from_memory() {
    for name in Profile::built_in_names() {
        let p = Profile::by_name(name).unwrap();
        let Some(derived) = Roofline::of(name).unwrap().kv_capacity_tokens() else {
            continue; // reported by the real engine
        };
        let ratio = p.max_total_tokens as f64 / derived;
        assert!(
            (0.97..=1.0).contains(&ratio),
            "{name}: max_total_tokens {} vs {derived:.0} from memory",
            p.max_total_tokens
        );
    }
}

#[test]
fn moe_decode_follows_the_expert_union_up_to_the_whole_batch() {
    // The MoE profile's line (capped at `per_seq_batch_cap`) tracks the expected union of
    // experts a batch reads, from batch 4 to the most running requests, at 1k context each.
    for r in support::roofline::ROOFLINES
        .iter()
        .filter(|r| r.experts > 0)
    {
        let p = Profile::by_name(r.profile).unwrap();
        assert!(p.per_seq_batch_cap.is_some(), "{}: no batch cap", r.profile);
        for b in (4..=p.max_running_requests as usize).step_by(4) {
            let c = 1024 * b as u64;
            let ratio = p.decode_step_ms(b, c) / r.decode_step_ms(b, c);
            assert!(
                (0.85..=1.15).contains(&ratio),
                "{}: batch {b}: ratio {ratio:.3}",
                r.profile
            );
        }
    }
}
