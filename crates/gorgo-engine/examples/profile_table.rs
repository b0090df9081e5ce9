//! Prints every built-in profile's decode step beside its memory-bandwidth roofline
//! (`tests/support/roofline.rs`): batch 1, 32 and 128 at 1,024 context tokens per
//! sequence and with the KV full. The tables in docs/engine-profiles.md come from here.
//!
//! `cargo run -p gorgo-engine --release --example profile_table`

#[path = "../tests/support/roofline.rs"]
mod roofline;

use gorgo_engine::Profile;
use roofline::Roofline;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for name in Profile::built_in_names() {
        let p = Profile::by_name(name)?;
        let r = Roofline::of(name).ok_or("no roofline inputs")?;
        println!(
            "\n{name}: decode {} ms + {} ms/seq (cap {:?}) + {} ms/context token, KV {} tokens",
            p.decode_base_ms,
            p.per_seq_ms,
            p.per_seq_batch_cap,
            p.per_ctx_token_ms,
            p.max_total_tokens
        );
        println!("| batch | context | total context | profile ms | roofline ms | ratio |");
        println!("|---:|---|---:|---:|---:|---:|");
        for b in [1usize, 32, 128] {
            // Full: the KV cache full, or every sequence at the context length if the
            // batch cannot fill it.
            let full = p.max_total_tokens.min(b as u64 * p.context_length);
            for (what, c) in [("1k each", b as u64 * 1024), ("full KV", full)] {
                let (m, f) = (p.decode_step_ms(b, c), r.decode_step_ms(b, c));
                println!("| {b} | {what} | {c} | {m:.1} | {f:.1} | {:.2} |", m / f);
            }
        }
        let (b, c) = (r.full_kv_batch, p.max_total_tokens);
        println!(
            "pinned (tests/profile_roofline.rs): batch {b}, {c} tokens: profile {:.1} ms, roofline {:.1} ms",
            p.decode_step_ms(b, c),
            r.decode_step_ms(b, c)
        );
    }
    Ok(())
}
