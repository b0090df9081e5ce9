//! Messages between nodes and their codec.
//!
//! Everything that crosses the network between nodes is one of the types here,
//! encoded with bincode 2 (standard config: little-endian varints). Decoding is
//! defensive: input over the caller's size limit is rejected before decoding, a length
//! prefix cannot make the decoder allocate more than that limit, and trailing bytes
//! are an error.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::hash::HashChain;
use crate::summary::{SummaryDelta, SummarySnapshot};
use crate::types::{NodeId, QueueStats};

/// The endpoint a forwarded request came to (defined with the prompt rendering it
/// selects; re-exported here because it is part of [`ForwardRequest`]).
pub use crate::prompt::Endpoint;

/// Version of the node-to-node protocol: the encoding of every message in this module
/// and of [`crate::tuning::TuningMessage`].
///
/// bincode is not self-describing: a field added to a message (even one marked
/// `#[serde(default)]`) makes the new encoding unreadable to an older node, and the
/// older node's messages unreadable to the new one, or worse, readable as something
/// else. So any change to these types' encoding is a new version. gorgo-cluster names
/// it in the QUIC ALPN (`gorgo-cluster/<version>`), so that nodes of two versions
/// refuse each other at the handshake instead of misreading each other's messages.
/// A test pins the encoding to this number (docs/design.md, "Protocols").
///
/// 9: a forward names every node it has left (`via`), none of which may serve it; a
/// tuning report says when it was built (`at_ms`); tuning proposals and reports carry
/// the leader's incarnation (version 8: each cell of a tuning report carries the open requests' time so far,
/// lower bounds on their E2E for the E2E guard; version 7: a tuning proposal's switchback
/// block length; version 6: the tuning reports' start-fit sums carry the queue and
/// prefill terms' sums (the cost of joining a queue), and a forward's offer names the
/// policy that priced it; version 5: queue stats carry the engine's slots where its
/// concurrency limit is known; version 4: the tuning messages' start-fit sums and
/// noise-aware tuner state; version 3: the engines' `replica` in gossip)).
pub const PROTOCOL_VERSION: u32 = 9;

/// The most forwards one request may take (the ceiling of `routing.max_hops`): a
/// forward that says it left more nodes than this is malformed.
pub const MAX_HOPS: u8 = 8;

/// Largest gossip message accepted (4 MiB). A snapshot of about 800k fingerprints
/// (a shadow index of ~50M tokens at 64 tokens per block) fits; gossip travels on its
/// own QUIC uni-stream per message, so this also caps what one stream may buffer.
pub const MAX_GOSSIP_MESSAGE: usize = 4 << 20;

/// Largest forwarded request head accepted (16 MiB): the body of an OpenAI request
/// (long contexts of a few MB of text) plus its hash chain and headers.
pub const MAX_FORWARD_HEAD: usize = 16 << 20;

/// Largest forwarded response head accepted (64 KiB): status and headers only; the
/// response body streams after it as raw bytes.
pub const MAX_RESPONSE_HEAD: usize = 64 << 10;

/// Largest tuning message accepted (1 MiB): a proposal with the tuner's state, or a
/// latency sketch report (a sketch is at most a few tens of KiB).
pub const MAX_TUNING_MESSAGE: usize = 1 << 20;

/// Encode a message. Use with [`decode`] on the other end.
///
/// # Panics
/// Only if `T`'s `Serialize` produces a sequence or map of unknown length, which no
/// derived implementation (and no type of this crate) does.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    try_encode(msg).expect("wire types serialise with known lengths")
}

/// Encode a message, reporting a `Serialize` implementation that bincode cannot
/// encode instead of panicking (for types from outside this crate).
pub fn try_encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CoreError> {
    bincode::serde::encode_to_vec(msg, bincode::config::standard())
        .map_err(|e| CoreError::Malformed(format!("cannot encode: {e}")))
}

/// Decode a message of at most `limit` bytes.
///
/// Errors: [`CoreError::TooLarge`] when `bytes` is longer than `limit` (checked first);
/// [`CoreError::Malformed`] when the bytes do not decode, declare more memory than
/// allowed, or leave trailing bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], limit: usize) -> Result<T, CoreError> {
    if bytes.len() > limit {
        return Err(CoreError::TooLarge {
            size: bytes.len(),
            limit,
        });
    }
    let (value, read) = decode_bounded::<T>(bytes, limit)?;
    if read != bytes.len() {
        return Err(CoreError::Malformed(format!(
            "{} trailing bytes",
            bytes.len() - read
        )));
    }
    Ok(value)
}

/// bincode's memory limit is a const generic; pick the smallest power of two at least
/// `limit` (so a length prefix can claim at most twice the caller's limit), from 1 KiB
/// to 256 MiB.
fn decode_bounded<T: DeserializeOwned>(
    bytes: &[u8],
    limit: usize,
) -> Result<(T, usize), CoreError> {
    macro_rules! by_limit {
        ($($shift:literal)*) => {
            $(
                if limit <= (1usize << $shift) {
                    let config = bincode::config::standard().with_limit::<{ 1usize << $shift }>();
                    return bincode::serde::decode_from_slice::<T, _>(bytes, config).map_err(malformed);
                }
            )*
        };
    }
    by_limit!(10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27);
    let config = bincode::config::standard().with_limit::<{ 1usize << 28 }>();
    bincode::serde::decode_from_slice::<T, _>(bytes, config).map_err(malformed)
}

fn malformed(e: bincode::error::DecodeError) -> CoreError {
    match e {
        bincode::error::DecodeError::LimitExceeded => {
            CoreError::Malformed("declared lengths exceed the size limit".into())
        }
        other => CoreError::Malformed(other.to_string()),
    }
}

/// What nodes gossip on their summary streams.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GossipMessage {
    /// The changes to `origin`'s summary since a version, with its current load.
    SummaryDelta {
        /// The node whose summary this is.
        origin: NodeId,
        /// The changes.
        delta: SummaryDelta,
        /// The origin's load signals at the time of sending.
        stats: QueueStats,
    },
    /// `origin`'s whole summary, on join or after a version gap.
    SummarySnapshot {
        /// The node whose summary this is.
        origin: NodeId,
        /// The whole set.
        snapshot: SummarySnapshot,
        /// The origin's load signals at the time of sending.
        stats: QueueStats,
    },
    /// "I hold your summary at `have_version` and saw a gap: send a snapshot."
    SnapshotRequest {
        /// The node asking.
        origin: NodeId,
        /// The version the asker holds.
        have_version: u64,
        /// Which of the receiver's engines the summary is of ([`QueueStats::replica`]).
        replica: u16,
    },
}

/// The head of a forwarded request, first on a forwarding QUIC stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardRequest {
    /// The request's id at its origin (the node its client called): every node it
    /// passes through names it by this one in its logs and decisions.
    pub request_id: u64,
    /// Forwards so far, including this one; the max-hops guard reads it.
    pub hops: u8,
    /// The node the client sent the request to.
    pub origin: NodeId,
    /// Every node the request has left, the origin first and the sender last (at most
    /// [`MAX_HOPS`]): none of them is a candidate where it arrives, so with a
    /// `max_hops` above 1 a forward never goes back to a node it has left.
    pub via: Vec<NodeId>,
    /// The endpoint the client called.
    pub endpoint: Endpoint,
    /// The prompt's hash chain, so the receiver need not re-hash.
    pub chain: HashChain,
    /// The client's request body, unchanged.
    pub body: Vec<u8>,
    /// Client headers worth passing on (e.g. `x-session-id`, `x-gorgo-policy`).
    pub headers: Vec<(String, String)>,
    /// The `model` the body names, so the receiver need not parse the body to route.
    pub model: Option<String>,
    /// What serving the request at the forwarding node itself would cost: the
    /// receiver refuses the forward when serving it would cost more there
    /// ([`crate::decision::refuse_forward`]). `None`: never refused.
    pub offer: Option<crate::decision::ForwardOffer>,
}

/// The head of a forwarded response, first on the return direction of the stream;
/// the engine's response bytes follow unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardResponseHead {
    /// HTTP status from the engine (or the serving node's own error status).
    pub status: u16,
    /// Response headers to relay (e.g. `content-type`).
    pub headers: Vec<(String, String)>,
    /// The node that served the request.
    pub served_by: NodeId,
    /// Hops the request took.
    pub hops: u8,
    /// Set when the receiver refused the forward (status 503, no body follows that
    /// the client should see): the forwarding node serves the request itself.
    pub refusal: Option<crate::decision::Refusal>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary::SummarySample;
    use proptest::prelude::*;

    fn forward_request() -> ForwardRequest {
        ForwardRequest {
            request_id: 42,
            hops: 1,
            origin: NodeId::from("us-ashburn"),
            via: vec![NodeId::from("us-ashburn")],
            endpoint: Endpoint::Chat,
            chain: HashChain::from_bytes(b"hello world, this is a prompt", 8, 4),
            body: br#"{"messages":[]}"#.to_vec(),
            headers: vec![("x-session-id".into(), "s1".into())],
            model: Some("m".into()),
            offer: Some(crate::decision::ForwardOffer {
                cost_ms: 812.5,
                weights: crate::Weights {
                    w_rtt: 1.5,
                    w_queue: 0.5,
                },
                policy: crate::policy::PolicyKind::Gorgo,
            }),
        }
    }

    #[test]
    fn round_trips() {
        let m = one_of_each_message();
        for g in &m.gossip {
            assert_eq!(
                &decode::<GossipMessage>(&encode(g), MAX_GOSSIP_MESSAGE).unwrap(),
                g
            );
        }
        assert_eq!(
            decode::<ForwardRequest>(&encode(&m.forward), MAX_FORWARD_HEAD).unwrap(),
            m.forward
        );
        let served = ForwardResponseHead {
            status: 200,
            refusal: None,
            ..m.refused.clone()
        };
        for h in [&served, &m.refused] {
            assert_eq!(
                &decode::<ForwardResponseHead>(&encode(h), MAX_RESPONSE_HEAD).unwrap(),
                h
            );
        }
        for t in &m.tuning {
            assert_eq!(
                &decode::<crate::tuning::TuningMessage>(&encode(t), MAX_TUNING_MESSAGE).unwrap(),
                t
            );
        }
    }

    /// Every type of message that crosses the network between nodes.
    struct Messages {
        gossip: [GossipMessage; 3],
        forward: ForwardRequest,
        refused: ForwardResponseHead,
        tuning: [crate::tuning::TuningMessage; 2],
    }

    /// One message of every type that crosses the network between nodes, every field
    /// set to something other than its default (so that a field's encoding is in the
    /// bytes), built field by field (so that a changed default value, which is no
    /// change of format, leaves the bytes alone).
    fn one_of_each_message() -> Messages {
        use crate::es::{EsState, Measurement, TrialEvidence};
        use crate::tuning::{
            CellSketches, EpochReport, Phase, Proposal, TermSums, TuningMessage, CELLS,
        };
        let stats = QueueStats {
            version: 9,
            unfinished_prefill_tokens: 1200,
            running: 3,
            waiting: 2,
            kv_used_tokens: 5000,
            kv_capacity_tokens: 420_000,
            queued_prompt_tokens: 700,
            t_p_ms: 0.09,
            base_ms: 40.0,
            decode_step_ms: 15.5,
            epoch: 4,
            incarnation: 1_700_000_000_000,
            draining: true,
            models: vec!["m".into()],
            replica: 2,
            slots: Some(crate::types::EngineSlots {
                max_running: 8,
                decode_ms: 1234.5,
            }),
        };
        let sample = SummarySample::from_bits(2).unwrap();
        let gossip = [
            GossipMessage::SummaryDelta {
                origin: "a".into(),
                delta: SummaryDelta {
                    from_version: 1,
                    to_version: 3,
                    added: vec![9, 10],
                    removed: vec![4],
                    sample,
                },
                stats: stats.clone(),
            },
            GossipMessage::SummarySnapshot {
                origin: "a".into(),
                snapshot: SummarySnapshot {
                    version: 3,
                    fingerprints: vec![9, 10, 11],
                    sample,
                },
                stats,
            },
            GossipMessage::SnapshotRequest {
                origin: "b".into(),
                have_version: 2,
                replica: 1,
            },
        ];
        let refused = ForwardResponseHead {
            status: 503,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            served_by: "b".into(),
            hops: 1,
            refusal: Some(crate::decision::Refusal {
                local_cost_ms: 900.0,
                local_estimated_ttft_ms: Some(850.0),
                origin_cost_ms: 700.0,
            }),
        };
        let w = |w_rtt, w_queue| crate::Weights { w_rtt, w_queue };
        let measurement = Measurement {
            p95_ttft_ms: 1500.0,
            p95_e2e_ms: 9000.0,
            samples: 64,
            tail_ttft_ms: Some(1700.0),
        };
        let state = EsState {
            incumbent: w(1.5, 0.75),
            incumbent_score: Some(1400.0),
            pending_incumbent: Some(measurement),
            sigma: 0.5,
            outcomes: [true, false].into_iter().collect(),
            epoch: 12,
            trials: 5,
            seed: 7,
            draws: 10,
            frozen: true,
            last_incumbent_p95_ms: Some(1450.0),
            noise_var: 0.04,
            noise_samples: 3,
            pending_trial: Some(Box::new(TrialEvidence {
                windows: 2,
                valid: 1,
                sum_log_score: -0.1,
                sum_log_e2e: 0.02,
                sum_ln: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                cand_samples: 30,
                inc_samples: 34,
            })),
            e2e_drift: 0.01,
            start_fitted: true,
        };
        let proposal = TuningMessage::Proposal(Proposal {
            epoch: 13,
            leader: "a".into(),
            incarnation: 21,
            weights: w(1.5, 0.75),
            candidate: Some(w(2.0, 0.5)),
            phase: Phase::Interleaved,
            state,
            switchback_block_ms: Some(10_000),
        });
        let mut cells: Box<[CellSketches; CELLS]> = Box::default();
        cells[1].ttft.add(512.0);
        cells[1].e2e.add(4096.0);
        cells[1].e2e_open.add(8192.0);
        let report = TuningMessage::Report(EpochReport {
            epoch: 13,
            leader: "a".into(),
            incarnation: 21,
            from: "b".into(),
            cells,
            samples: 1,
            terms: TermSums {
                n: 1,
                rr: 1.0,
                rq: 2.0,
                qq: 3.0,
                ry: 4.0,
                qy: 5.0,
                yy: 6.0,
                q: 7.0,
                p: 8.0,
            },
            at_ms: 14,
        });
        Messages {
            gossip,
            forward: forward_request(),
            refused,
            tuning: [proposal, report],
        }
    }

    /// The digest of [`one_of_each_message`]'s encodings, in order, at
    /// [`PROTOCOL_VERSION`].
    const ENCODING_DIGEST: (u32, u64) = (9, 0x0c90_8ee1_7d03_631f);

    /// Fails when a wire type's encoding changes: a node built after the change cannot
    /// talk to one built before, so the change needs a new [`PROTOCOL_VERSION`] (and the
    /// digest printed here recorded in `ENCODING_DIGEST` with it).
    #[test]
    fn the_encoding_is_pinned_to_the_protocol_version() {
        let m = one_of_each_message();
        let mut bytes: Vec<u8> = m.gossip.iter().flat_map(encode).collect();
        bytes.extend(encode(&m.forward));
        bytes.extend(encode(&m.refused));
        m.tuning.iter().for_each(|t| bytes.extend(encode(t)));
        let digest = crate::hash::hash_bytes(&bytes);
        assert_eq!(
            ENCODING_DIGEST,
            (PROTOCOL_VERSION, digest),
            "the node-to-node encoding changed (digest {digest:#018x}): nodes of this \
             build and of the last one would misread each other. Raise PROTOCOL_VERSION \
             and record ({}, {digest:#018x}) in ENCODING_DIGEST",
            PROTOCOL_VERSION + 1
        );
    }

    #[test]
    fn size_limit_and_trailing_bytes() {
        let bytes = encode(&forward_request());
        assert_eq!(
            decode::<ForwardRequest>(&bytes, 10),
            Err(CoreError::TooLarge {
                size: bytes.len(),
                limit: 10
            })
        );
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            decode::<ForwardRequest>(&long, MAX_FORWARD_HEAD),
            Err(CoreError::Malformed(_))
        ));
    }

    #[test]
    fn length_prefix_cannot_claim_more_than_limit() {
        // A tiny message whose body length claims 2^40 bytes.
        let mut bytes = encode(&ForwardResponseHead {
            status: 1,
            headers: vec![],
            served_by: "x".into(),
            hops: 0,
            refusal: None,
        });
        let n = bytes.len();
        // Drop served_by ("x": len 1 + byte), hops and the refusal (`None`: one byte).
        bytes.truncate(n - 4);
        bytes.push(253); // u64 varint marker
        bytes.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(
            decode::<ForwardResponseHead>(&bytes, MAX_RESPONSE_HEAD),
            Err(CoreError::Malformed(_))
        ));
    }

    #[test]
    fn large_legitimate_messages_fit_their_limits() {
        // A 12 MiB prompt body with its 256-byte-block chain.
        let body = vec![b'a'; 12 << 20];
        let r = ForwardRequest {
            chain: HashChain::from_bytes(&body, 256, 4),
            body,
            ..forward_request()
        };
        let bytes = encode(&r);
        assert!(bytes.len() < MAX_FORWARD_HEAD);
        assert_eq!(
            decode::<ForwardRequest>(&bytes, MAX_FORWARD_HEAD).unwrap(),
            r
        );
        // A snapshot of 800k fingerprints.
        let g = GossipMessage::SummarySnapshot {
            origin: "a".into(),
            snapshot: SummarySnapshot {
                version: 1,
                fingerprints: (0..800_000u32)
                    .map(|i| i.wrapping_mul(2_654_435_761))
                    .collect(),
                sample: SummarySample::EVERY_BLOCK,
            },
            stats: QueueStats::default(),
        };
        let bytes = encode(&g);
        assert!(bytes.len() < MAX_GOSSIP_MESSAGE, "{}", bytes.len());
        assert_eq!(
            decode::<GossipMessage>(&bytes, MAX_GOSSIP_MESSAGE).unwrap(),
            g
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<GossipMessage>(&bytes, MAX_GOSSIP_MESSAGE);
            let _ = decode::<ForwardRequest>(&bytes, MAX_FORWARD_HEAD);
            let _ = decode::<ForwardResponseHead>(&bytes, MAX_RESPONSE_HEAD);
            let _ = decode::<crate::sketch::LatencySketch>(&bytes, MAX_TUNING_MESSAGE);
            let _ = decode::<SummaryDelta>(&bytes, MAX_GOSSIP_MESSAGE);
            let _ = decode::<SummarySnapshot>(&bytes, MAX_GOSSIP_MESSAGE);
        }

        /// Mutating a valid message (flip, truncate) never panics either: it reaches
        /// deeper decoder paths than uniformly random bytes.
        #[test]
        fn mutated_messages_never_panic(idx in any::<prop::sample::Index>(), val in any::<u8>(), cut in any::<prop::sample::Index>()) {
            let mut bytes = encode(&forward_request());
            let i = idx.index(bytes.len());
            bytes[i] = val;
            let _ = decode::<ForwardRequest>(&bytes, MAX_FORWARD_HEAD);
            bytes.truncate(cut.index(bytes.len()));
            let _ = decode::<ForwardRequest>(&bytes, MAX_FORWARD_HEAD);
        }
    }
}
