//! Routing: candidates from local state and the peer table, the core decision, and a
//! bounded log of recent decisions for `/admin/decisions`.

/// Policy names DESIGN.md defines.
const POLICIES: &[&str] = &[
    "gorgo",
    "gorgo-paper",
    "least-load",
    "least-request",
    "prefix-cache",
    "session-affinity",
    "simple-session-affinity",
    "cache-aware",
    "round-robin",
    "random",
    "local-only",
];

/// Check a policy name; the error lists the valid ones.
pub fn parse_policy(name: &str) -> Result<String, String> {
    if POLICIES.contains(&name) {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "unknown policy `{name}` (expected one of {})",
            POLICIES.join(", ")
        ))
    }
}
