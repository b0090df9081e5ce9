//! The HTTP headers of GORGO's client API, named once: the node reads and writes them,
//! the bench client sends and reads them, so neither can drift from the other.

/// Response header naming the region that served the request.
pub const SERVED_BY_HEADER: &str = "x-gorgo-served-by";
/// Response header with the number of forwards the request took.
pub const HOPS_HEADER: &str = "x-gorgo-hops";
/// Response header with the TTFT, ms, the cost model predicted for the candidate the
/// client's node chose (`gorgo_core::cost::estimated_ttft_ms`; cost-based policies only),
/// so a benchmark client can report the model's prediction error. A forwarded request
/// carries its first decision's prediction.
pub const PREDICTED_TTFT_HEADER: &str = "x-gorgo-predicted-ttft-ms";
/// Request header selecting the routing policy per request (experiments).
pub const POLICY_HEADER: &str = "x-gorgo-policy";
/// Request header carrying the session key for session-affinity policies.
pub const SESSION_HEADER: &str = "x-session-id";

/// The routing key of a session id sent as [`SESSION_HEADER`]: how every node hashes
/// the header (and how a simulated client's session is keyed), so a session is keyed
/// the same wherever it is routed.
pub fn session_key(session_id: &str) -> u64 {
    crate::hash::hash_bytes(session_id.as_bytes())
}

#[cfg(test)]
mod tests {
    #[test]
    fn session_keys_are_the_hash_of_the_header_bytes() {
        assert_eq!(super::session_key("u/s"), crate::hash::hash_bytes(b"u/s"));
        assert_ne!(super::session_key("u/s"), super::session_key("u/t"));
    }
}
