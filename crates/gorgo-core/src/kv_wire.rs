//! The KV-event wire format of vLLM and SGLang, decoded without trusting the sender.
//!
//! An engine publishes over ZeroMQ PUB a multipart message `[topic, seq, payload]`:
//! `seq` an 8-byte big-endian integer counting batches from 0 since the publisher
//! started, `payload` a msgpack `EventBatch` as msgspec encodes it. Older vLLM and
//! SGLang declare their structs `array_like=True`: a batch is `[ts, events,
//! data_parallel_rank]` and each event a tagged array `["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
//! ...]`, `["BlockRemoved", block_hashes, medium, ...]`, `["AllBlocksCleared"]`. Newer
//! vLLM encodes the same structs as maps (`{"ts": .., "events": [{"type":
//! "BlockStored", "block_hashes": .., ..}], ..}`). Both are accepted, fields past the
//! ones read are skipped (new versions append fields), and a block hash may be an
//! integer or bytes (newer vLLM hashes blocks with SHA-256 and sends the digest).
//! SGLang with EAGLE speculative decoding keys its radix tree by token pairs and
//! publishes `token_ids` as pairs (`[[1, 2], [2, 3]]`): such a store decodes as
//! [`KvEvent::TokenPairsStored`], not as an error that would lose the whole batch.
//!
//! The replay socket (a ROUTER) answers a request carrying an 8-byte big-endian start
//! seq with `[seq, payload]` messages for each batch it still buffers from there, then
//! the end marker: seq `-1` with an empty payload.
//!
//! Every size here is capped: the payload before decoding, the nesting depth while
//! decoding; arrays are never preallocated beyond what the bytes can hold, and what a
//! batch decodes to is bounded by its bytes ([`max_events_per_batch`]).

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::hash::hash_bytes;

/// Largest payload decoded by default: 8 MiB holds a batch storing a 1M-token prompt
/// (token ids take up to 5 bytes each), well past what one engine step stores.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 8 << 20;

/// Nesting the decoder follows: a batch is three levels deep, an event's extra fields a
/// few more; anything deeper is garbage.
const MAX_DEPTH: usize = 16;

/// The seq of the replay socket's end marker.
pub const REPLAY_END_SEQ: i64 = -1;

/// The medium of blocks in GPU memory: what the engine's prefix cache matches on.
/// Blocks stored to another tier (`CPU`, disk offloading) are not prefix-cache hits.
pub const MEDIUM_GPU: &str = "GPU";

/// One KV-cache event of an engine, as the node needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks entered the prefix cache, each the child of the one before, the
    /// first the child of `parent` (`None`: the first block of a sequence).
    BlockStored {
        /// Engine block keys (see [`block_key`]), in sequence order.
        block_hashes: Vec<u64>,
        /// Key of the block these extend.
        parent: Option<u64>,
        /// The token ids of all the blocks, `block_size` per block.
        token_ids: Vec<u32>,
        /// Tokens per engine block (vLLM's block size, SGLang's page size).
        block_size: u32,
        /// Set for a LoRA adapter's blocks: they never match a base-model prompt.
        lora_id: Option<i64>,
        /// Where the blocks are (`GPU` or absent: the prefix cache; else another tier).
        medium: Option<String>,
        /// The first block whose hash folds in more than its tokens: vLLM's
        /// `extra_keys`, one entry per block (`nil` for a plain one), name a cache
        /// salt, multimodal or prompt-embedding hashes, a LoRA adapter. Two requests
        /// with the same token ids (an image's placeholder tokens, a salted and an
        /// unsalted prompt) do not share those blocks on the engine, so this block and
        /// the ones after it (their hashes chain from it) are not the plain token
        /// blocks a prompt's chain names. `None`: every block is plain.
        extra_keys_from: Option<usize>,
    },
    /// Blocks stored under keys of token pairs: SGLang with EAGLE speculative decoding
    /// keys its radix tree by bigrams and publishes each page's `token_ids` as pairs.
    /// The node's chains are over single tokens, so these are counted, not mapped.
    TokenPairsStored {
        /// How many blocks the event stored.
        blocks: u64,
    },
    /// Blocks left the prefix cache.
    BlockRemoved {
        /// Engine block keys.
        block_hashes: Vec<u64>,
        /// The tier they left (see [`KvEvent::BlockStored`]'s `medium`).
        medium: Option<String>,
    },
    /// The whole cache was emptied (a reset, an engine restart).
    AllBlocksCleared,
    /// An event type this version does not know: skipped, counted. [`decode_batch`]
    /// counts these in [`KvEventBatch::unknown_events`] instead of listing them (see
    /// [`max_events_per_batch`]); [`encode_batch`] leaves them out.
    Unknown,
}

/// One published batch of events.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// The publisher's clock when the batch was made, seconds.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank of the publishing engine, when it says.
    pub data_parallel_rank: Option<i64>,
    /// Events of a type this version does not know, skipped while decoding: counted
    /// here, not listed, since one can take two bytes on the wire (`[""]`) and a
    /// listed [`KvEvent`] takes over a hundred.
    pub unknown_events: u64,
}

/// The key the node keeps an engine block under: the integer itself, or the one
/// hashing function over a bytes digest. Engine hashes are already uniform, so no
/// information that matters is lost.
pub fn block_key(hash: &EngineBlockHash<'_>) -> u64 {
    match hash {
        EngineBlockHash::Int(v) => *v,
        EngineBlockHash::Bytes(b) => hash_bytes(b),
    }
}

/// A block hash as it comes on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineBlockHash<'a> {
    /// An integer (vLLM before SHA-256 digests; SGLang). Negative values keep their
    /// 64 bits.
    Int(u64),
    /// A digest.
    Bytes(&'a [u8]),
}

/// The shortest encoding of an event a decoded batch lists: `["BlockRemoved", []]`,
/// 15 bytes (an array header, the tag in 13, an empty array). The other kinds are
/// longer (`["BlockStored", [], nil, [], 0]` 17, `["AllBlocksCleared"]` 18, every map
/// form more); an unknown event can be 2 bytes (`[""]`), which is why those are only
/// counted ([`KvEventBatch::unknown_events`]).
pub const MIN_LISTED_EVENT_BYTES: usize = 15;

/// Most events a batch of `max_payload_bytes` can list: what its bytes can hold, so no
/// batch within the byte cap is refused for its count. SGLang publishes one
/// `BlockStored` per page (one token by default) and a whole scheduler step in one
/// batch: 256 requests finishing together with 512 new tokens each store ~131k blocks
/// at once, and evicting a 70k-token radix leaf removes 70k; a count cap below what
/// the bytes hold (65,536, once) refused such batches, and the node forgot every block
/// and resynced on each.
///
/// What that costs while decoding: a listed event takes `size_of::<KvEvent>()` (128
/// bytes on 64-bit) plus its small allocations (a hash list, a medium string) for at
/// least 15 bytes on the wire, and the list is reserved once, never past what the
/// bytes can list (`EventsSeed`). Measured with a counting allocator: 8 MiB of the
/// shortest events (559,239) peak at 68 MiB, 8.5 bytes per byte received; events with
/// a hash, a token id and a medium about 7. The worst stays what one event's hash list
/// always cost, 12 bytes per byte (a 1-byte hash decodes to 8, its `Vec` growing by
/// doubling): an 8 MiB batch, the default cap, decodes to at most ~100 MiB, and a
/// lower `kv_events_max_message_bytes` lowers that in proportion. Unknown events,
/// 2 bytes each at the least, are counted instead of listed.
pub const fn max_events_per_batch(max_payload_bytes: usize) -> usize {
    max_payload_bytes / MIN_LISTED_EVENT_BYTES
}

/// [`max_events_per_batch`] of [`DEFAULT_MAX_PAYLOAD_BYTES`] (559,240): a publisher
/// splitting its batches for a subscriber at the default cap needs no more.
pub const MAX_EVENTS_PER_BATCH: usize = max_events_per_batch(DEFAULT_MAX_PAYLOAD_BYTES);

/// A batch's events as decoded: the ones the node reads, listed; the unknown ones,
/// counted.
struct DecodedEvents {
    events: Vec<KvEvent>,
    unknown: u64,
}

/// Decodes a batch's event list into [`DecodedEvents`]. The list is reserved once, for
/// the count its header announces but never more than the payload's bytes can list
/// (`max_events`): it never grows by doubling (which held up to twice the list, and a
/// copy of it while it grew), and a header that lies reserves no more than honest
/// bytes could fill.
struct EventsSeed {
    max_events: usize,
}

impl<'de> DeserializeSeed<'de> for EventsSeed {
    type Value = DecodedEvents;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<DecodedEvents, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for EventsSeed {
    type Value = DecodedEvents;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of KV events")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<DecodedEvents, A::Error> {
        let reserve = seq.size_hint().unwrap_or(0).min(self.max_events);
        let mut out = DecodedEvents {
            events: Vec::with_capacity(reserve),
            unknown: 0,
        };
        while let Some(e) = seq.next_element::<WireEvent>()? {
            match e.0 {
                KvEvent::Unknown => out.unknown += 1,
                event => out.events.push(event),
            }
        }
        Ok(out)
    }
}

/// Decode a batch payload of at most `max_bytes`.
pub fn decode_batch(payload: &[u8], max_bytes: usize) -> Result<KvEventBatch, CoreError> {
    if payload.len() > max_bytes {
        return Err(CoreError::TooLarge {
            size: payload.len(),
            limit: max_bytes,
        });
    }
    let mut de = rmp_serde::Deserializer::from_read_ref(payload);
    de.set_max_depth(MAX_DEPTH);
    BatchSeed {
        max_events: max_events_per_batch(payload.len()),
    }
    .deserialize(&mut de)
    .map_err(|e| CoreError::Malformed(format!("kv event batch: {e}")))
}

/// Decode the 8-byte big-endian seq frame.
pub fn decode_seq(frame: &[u8]) -> Result<i64, CoreError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| {
        CoreError::Malformed(format!(
            "kv event seq frame of {} bytes, not 8",
            frame.len()
        ))
    })?;
    Ok(i64::from_be_bytes(bytes))
}

/// The 8-byte big-endian seq frame (publishers and replay requests).
pub fn encode_seq(seq: i64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Encode a batch the way SGLang and older vLLM do (`array_like`, integer hashes):
/// the emulator's publisher and the tests. Extra keys are written as vLLM places them
/// (after `lora_name`), a placeholder key standing for the block's (the keys
/// themselves are not kept); token-pair stores and unknown events, only counted when
/// decoded, are left out.
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    #[derive(Serialize)]
    struct Batch<'a>(f64, Vec<Event<'a>>, Option<i64>);
    #[derive(Serialize)]
    #[serde(untagged)]
    enum Event<'a> {
        Stored(
            &'static str,
            &'a [u64],
            Option<u64>,
            &'a [u32],
            u32,
            Option<i64>,
            Option<&'a str>,
        ),
        StoredWithKeys(
            &'static str,
            &'a [u64],
            Option<u64>,
            &'a [u32],
            u32,
            Option<i64>,
            Option<&'a str>,
            Option<&'a str>,
            Vec<Option<(&'static str,)>>,
        ),
        Removed(&'static str, &'a [u64], Option<&'a str>),
        Cleared((&'static str,)),
    }
    let events = batch
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                medium,
                extra_keys_from: None,
            } => Some(Event::Stored(
                "BlockStored",
                block_hashes,
                *parent,
                token_ids,
                *block_size,
                *lora_id,
                medium.as_deref(),
            )),
            KvEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id,
                medium,
                extra_keys_from: Some(keyed),
            } => Some(Event::StoredWithKeys(
                "BlockStored",
                block_hashes,
                *parent,
                token_ids,
                *block_size,
                *lora_id,
                medium.as_deref(),
                None,
                (0..block_hashes.len())
                    .map(|i| (i == *keyed).then_some(("extra key",)))
                    .collect(),
            )),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => Some(Event::Removed(
                "BlockRemoved",
                block_hashes,
                medium.as_deref(),
            )),
            KvEvent::AllBlocksCleared => Some(Event::Cleared(("AllBlocksCleared",))),
            KvEvent::TokenPairsStored { .. } | KvEvent::Unknown => None,
        })
        .collect();
    rmp_serde::to_vec(&Batch(batch.ts, events, batch.data_parallel_rank))
        .expect("encoding plain values into a Vec cannot fail")
}

/// Decodes an `EventBatch` (either encoding) whose event list the payload's bytes
/// bound to `max_events` ([`EventsSeed`]).
struct BatchSeed {
    max_events: usize,
}

impl<'de> DeserializeSeed<'de> for BatchSeed {
    type Value = KvEventBatch;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<KvEventBatch, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for BatchSeed {
    type Value = KvEventBatch;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an EventBatch array or map")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KvEventBatch, A::Error> {
        let ts: f64 = seq
            .next_element::<Number>()?
            .ok_or_else(|| de::Error::missing_field("ts"))?
            .0;
        let events = seq
            .next_element_seed(EventsSeed {
                max_events: self.max_events,
            })?
            .ok_or_else(|| de::Error::missing_field("events"))?;
        let rank: Option<OptInt> = seq.next_element()?;
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(KvEventBatch {
            ts,
            events: events.events,
            data_parallel_rank: rank.and_then(|r| r.0),
            unknown_events: events.unknown,
        })
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KvEventBatch, A::Error> {
        let (mut ts, mut events, mut rank) = (None, None, None);
        while let Some(key) = map.next_key::<FieldName>()? {
            match key.0.as_str() {
                "ts" => ts = Some(map.next_value::<Number>()?.0),
                "events" => {
                    // A repeated key replaces the list: drop the first before
                    // the second is reserved.
                    drop(events.take());
                    events = Some(map.next_value_seed(EventsSeed {
                        max_events: self.max_events,
                    })?);
                }
                "data_parallel_rank" => rank = map.next_value::<OptInt>()?.0,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let events: DecodedEvents = events.ok_or_else(|| de::Error::missing_field("events"))?;
        Ok(KvEventBatch {
            ts: ts.ok_or_else(|| de::Error::missing_field("ts"))?,
            events: events.events,
            data_parallel_rank: rank,
            unknown_events: events.unknown,
        })
    }
}

/// The fields of an event, gathered from either encoding before they are checked.
#[derive(Default)]
struct EventFields {
    tag: Option<String>,
    block_hashes: Option<Vec<u64>>,
    parent: Option<Option<u64>>,
    token_ids: Option<TokenIds>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    extra_keys_from: Option<usize>,
}

impl EventFields {
    fn finish<E: de::Error>(self) -> Result<KvEvent, E> {
        let tag = self.tag.ok_or_else(|| E::missing_field("type"))?;
        Ok(match tag.as_str() {
            "BlockStored" => {
                let block_hashes = self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?;
                let parent = self
                    .parent
                    .ok_or_else(|| E::missing_field("parent_block_hash"))?;
                let token_ids = self
                    .token_ids
                    .ok_or_else(|| E::missing_field("token_ids"))?;
                let block_size = self
                    .block_size
                    .ok_or_else(|| E::missing_field("block_size"))?;
                match token_ids {
                    TokenIds::Pairs => KvEvent::TokenPairsStored {
                        blocks: block_hashes.len() as u64,
                    },
                    TokenIds::Ids(token_ids) => KvEvent::BlockStored {
                        block_hashes,
                        parent,
                        token_ids,
                        block_size,
                        lora_id: self.lora_id,
                        medium: self.medium,
                        extra_keys_from: self.extra_keys_from,
                    },
                }
            }
            "BlockRemoved" => KvEvent::BlockRemoved {
                block_hashes: self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?,
                medium: self.medium,
            },
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            _ => KvEvent::Unknown,
        })
    }
}

struct WireEvent(KvEvent);

impl<'de> Deserialize<'de> for WireEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireEvent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a tagged KV event array or map")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WireEvent, A::Error> {
                let mut f = EventFields {
                    tag: seq.next_element::<FieldName>()?.map(|t| t.0),
                    ..EventFields::default()
                };
                match f.tag.as_deref() {
                    Some("BlockStored") => {
                        f.block_hashes = seq.next_element::<Hashes>()?.map(|h| h.0);
                        f.parent = seq.next_element::<OptHash>()?.map(|h| h.0);
                        f.token_ids = seq.next_element()?;
                        f.block_size = seq.next_element()?;
                        f.lora_id = seq.next_element::<OptInt>()?.and_then(|v| v.0);
                        f.medium = seq.next_element::<Option<String>>()?.flatten();
                        // `lora_name`, then vLLM's `extra_keys`.
                        if seq.next_element::<IgnoredAny>()?.is_some() {
                            f.extra_keys_from = seq.next_element::<ExtraKeys>()?.and_then(|k| k.0);
                        }
                    }
                    Some("BlockRemoved") => {
                        f.block_hashes = seq.next_element::<Hashes>()?.map(|h| h.0);
                        f.medium = seq.next_element::<Option<String>>()?.flatten();
                    }
                    _ => {}
                }
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                f.finish().map(WireEvent)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireEvent, A::Error> {
                let mut f = EventFields::default();
                while let Some(key) = map.next_key::<FieldName>()? {
                    match key.0.as_str() {
                        "type" => f.tag = Some(map.next_value::<FieldName>()?.0),
                        "block_hashes" => f.block_hashes = Some(map.next_value::<Hashes>()?.0),
                        "parent_block_hash" => f.parent = Some(map.next_value::<OptHash>()?.0),
                        "token_ids" => f.token_ids = Some(map.next_value()?),
                        "block_size" => f.block_size = Some(map.next_value()?),
                        "lora_id" => f.lora_id = map.next_value::<OptInt>()?.0,
                        "medium" => f.medium = map.next_value()?,
                        "extra_keys" => f.extra_keys_from = map.next_value::<ExtraKeys>()?.0,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                // msgspec omits fields at their default; an absent parent is `None`.
                if f.tag.as_deref() == Some("BlockStored") && f.parent.is_none() {
                    f.parent = Some(None);
                }
                f.finish().map(WireEvent)
            }
        }
        d.deserialize_any(V)
    }
}

/// A `BlockStored`'s `token_ids`: token ids, or SGLang's EAGLE pairs (`[[1, 2], [2,
/// 3]]`), whose contents are skipped. Any pair makes the whole list pairs.
enum TokenIds {
    Ids(Vec<u32>),
    Pairs,
}

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenIds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of token ids or token pairs")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TokenIds, A::Error> {
                // Grown as the elements come: never preallocated from the header.
                let mut ids = Vec::new();
                let mut pairs = false;
                while let Some(t) = seq.next_element::<TokenId>()? {
                    match t {
                        TokenId::Id(id) if !pairs => ids.push(id),
                        TokenId::Id(_) => {}
                        TokenId::Pair => {
                            pairs = true;
                            ids = Vec::new();
                        }
                    }
                }
                Ok(if pairs {
                    TokenIds::Pairs
                } else {
                    TokenIds::Ids(ids)
                })
            }
        }
        d.deserialize_seq(V)
    }
}

/// One element of `token_ids`: a token id (a `u32`: a larger one is an error), or a
/// list (an EAGLE pair), skipped.
enum TokenId {
    Id(u32),
    Pair,
}

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (u32) or a token pair")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenId, E> {
                u32::try_from(v)
                    .map(TokenId::Id)
                    .map_err(|_| E::custom(format!("token id {v} past u32")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenId, E> {
                u32::try_from(v)
                    .map(TokenId::Id)
                    .map_err(|_| E::custom(format!("token id {v} not a u32")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TokenId, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(TokenId::Pair)
            }
        }
        d.deserialize_any(V)
    }
}

/// vLLM's `extra_keys` (`list[tuple | None] | None`), read as the index of its first
/// non-nil entry; the keys themselves are skipped. Any other value (not vLLM's shape:
/// some fork's field in that place) is taken as keys from the first block on: what
/// this version cannot read is no evidence that the blocks are plain, and failing the
/// batch would lose its other events.
struct ExtraKeys(Option<usize>);

impl<'de> Deserialize<'de> for ExtraKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ExtraKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of extra keys or nil")
            }
            fn visit_unit<E: de::Error>(self) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(Some(0)))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(Some(0)))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(Some(0)))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(Some(0)))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(Some(0)))
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys(Some(0)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ExtraKeys, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ExtraKeys(Some(0)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraKeys, A::Error> {
                let mut first = None;
                let mut i = 0usize;
                while let Some(key) = seq.next_element::<Option<IgnoredAny>>()? {
                    if key.is_some() && first.is_none() {
                        first = Some(i);
                    }
                    i += 1;
                }
                Ok(ExtraKeys(first))
            }
        }
        d.deserialize_any(V)
    }
}

/// A string, read from str or bytes (a tag or a map key).
struct FieldName(String);

impl<'de> Deserialize<'de> for FieldName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = FieldName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<FieldName, E> {
                Ok(FieldName(v.to_owned()))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<FieldName, E> {
                Ok(FieldName(String::from_utf8_lossy(v).into_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A float or an integer (msgspec writes a float `ts`; be lenient).
struct Number(f64);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Number;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Number, E> {
                Ok(Number(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
        }
        d.deserialize_any(V)
    }
}

/// An optional integer (`nil` or an int).
struct OptInt(Option<i64>);

impl<'de> Deserialize<'de> for OptInt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = OptInt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer or nil")
            }
            fn visit_unit<E: de::Error>(self) -> Result<OptInt, E> {
                Ok(OptInt(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<OptInt, E> {
                Ok(OptInt(None))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<OptInt, E> {
                Ok(OptInt(Some(v as i64)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<OptInt, E> {
                Ok(OptInt(Some(v)))
            }
        }
        d.deserialize_any(V)
    }
}

/// One block hash: an integer or a digest, as its [`block_key`].
struct Hash(u64);

struct HashVisitor;

impl Visitor<'_> for HashVisitor {
    type Value = Option<u64>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a block hash (integer or bytes)")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(block_key(&EngineBlockHash::Int(v))))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(block_key(&EngineBlockHash::Int(v as u64))))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        Ok(Some(block_key(&EngineBlockHash::Bytes(v))))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(HashVisitor)?
            .map(Hash)
            .ok_or_else(|| de::Error::custom("a nil block hash"))
    }
}

/// An optional block hash (`parent_block_hash`).
struct OptHash(Option<u64>);

impl<'de> Deserialize<'de> for OptHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(HashVisitor).map(OptHash)
    }
}

/// A list of block hashes.
struct Hashes(Vec<u64>);

impl<'de> Deserialize<'de> for Hashes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v: Vec<Hash> = Deserialize::deserialize(d)?;
        Ok(Hashes(v.into_iter().map(|h| h.0).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![7, 8],
            parent: None,
            token_ids: (0..32).collect(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            extra_keys_from: None,
        }
    }

    #[test]
    fn array_like_round_trips() {
        let batch = KvEventBatch {
            ts: 1.5,
            events: vec![
                stored(),
                KvEvent::BlockRemoved {
                    block_hashes: vec![8],
                    medium: None,
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
            unknown_events: 0,
        };
        let bytes = encode_batch(&batch);
        assert_eq!(decode_batch(&bytes, 1 << 20).unwrap(), batch);
    }

    /// The map encoding of newer vLLM, digests for hashes, unknown trailing fields
    /// and event types.
    #[test]
    fn map_encoding_bytes_hashes_and_extras() {
        #[derive(Serialize)]
        struct Stored<'a> {
            #[serde(rename = "type")]
            tag: &'a str,
            #[serde(with = "serde_bytes_list")]
            block_hashes: Vec<Vec<u8>>,
            token_ids: Vec<u32>,
            block_size: u32,
            lora_id: Option<i64>,
            medium: &'a str,
            lora_name: Option<&'a str>,
            group_idx: u32,
        }
        mod serde_bytes_list {
            use serde::ser::SerializeSeq;
            pub fn serialize<S: serde::Serializer>(v: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
                struct B<'a>(&'a [u8]);
                impl serde::Serialize for B<'_> {
                    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                        s.serialize_bytes(self.0)
                    }
                }
                let mut seq = s.serialize_seq(Some(v.len()))?;
                for b in v {
                    seq.serialize_element(&B(b))?;
                }
                seq.end()
            }
        }
        #[derive(Serialize)]
        struct Other<'a> {
            #[serde(rename = "type")]
            tag: &'a str,
        }
        #[derive(Serialize)]
        #[serde(untagged)]
        enum E<'a> {
            S(Stored<'a>),
            O(Other<'a>),
        }
        #[derive(Serialize)]
        struct Batch<'a> {
            ts: f64,
            events: Vec<E<'a>>,
            extra: u8,
        }
        let digest = vec![0xabu8; 32];
        let b = Batch {
            ts: 2.0,
            events: vec![
                E::S(Stored {
                    tag: "BlockStored",
                    block_hashes: vec![digest.clone()],
                    token_ids: (0..16).collect(),
                    block_size: 16,
                    lora_id: None,
                    medium: "GPU",
                    lora_name: None,
                    group_idx: 0,
                }),
                E::O(Other {
                    tag: "SomethingNew",
                }),
            ],
            extra: 1,
        };
        let bytes = rmp_serde::to_vec_named(&b).unwrap();
        let batch = decode_batch(&bytes, 1 << 20).unwrap();
        assert_eq!(batch.data_parallel_rank, None);
        assert_eq!(
            batch.events,
            vec![KvEvent::BlockStored {
                block_hashes: vec![hash_bytes(&digest)],
                parent: None,
                token_ids: (0..16).collect(),
                block_size: 16,
                lora_id: None,
                medium: Some("GPU".into()),
                extra_keys_from: None,
            }]
        );
        assert_eq!(batch.unknown_events, 1);
    }

    /// The shortest listed event is what [`MIN_LISTED_EVENT_BYTES`] says, so a batch
    /// of them filling the byte cap is within [`max_events_per_batch`]; tiny unknown
    /// events are counted, not listed.
    #[test]
    fn the_event_count_follows_from_the_bytes() {
        let removed = rmp_serde::to_vec(&("BlockRemoved", Vec::<u64>::new())).unwrap();
        assert_eq!(removed.len(), MIN_LISTED_EVENT_BYTES);
        let stored =
            rmp_serde::to_vec(&("BlockStored", Vec::<u64>::new(), (), Vec::<u32>::new(), 0u8))
                .unwrap();
        let cleared = rmp_serde::to_vec(&("AllBlocksCleared",)).unwrap();
        assert!(stored.len() > MIN_LISTED_EVENT_BYTES && cleared.len() > MIN_LISTED_EVENT_BYTES);
        // A batch of nothing but the shortest events, as many as 1 MiB holds.
        let cap = 1 << 20;
        let n = max_events_per_batch(cap) - 1;
        let bytes =
            rmp_serde::to_vec(&(0u8, vec![("BlockRemoved", Vec::<u64>::new()); n])).unwrap();
        assert!(bytes.len() <= cap, "{}", bytes.len());
        assert_eq!(decode_batch(&bytes, cap).unwrap().events.len(), n);
        // Unknown events of two bytes each: counted, the list empty.
        let unknown = rmp_serde::to_vec(&(0.0f64, vec![("",); 4 << 20])).unwrap();
        let batch = decode_batch(&unknown, DEFAULT_MAX_PAYLOAD_BYTES + 16).unwrap();
        assert_eq!((batch.events.len(), batch.unknown_events), (0, 4 << 20));
    }

    /// SGLang publishes one `BlockStored` per one-token page and a scheduler step in one
    /// batch: 70,000 of them (or 70,000 `BlockRemoved`, a long radix leaf evicted) are
    /// within the byte cap and decode, though past the old count cap of 65,536.
    #[test]
    fn a_step_of_one_token_pages_decodes() {
        let stored: Vec<KvEvent> = (0..70_000u64)
            .map(|h| KvEvent::BlockStored {
                block_hashes: vec![h + 1],
                parent: (h > 0).then_some(h),
                token_ids: vec![h as u32],
                block_size: 1,
                lora_id: None,
                medium: Some(MEDIUM_GPU.into()),
                extra_keys_from: None,
            })
            .collect();
        let removed: Vec<KvEvent> = (0..70_000u64)
            .map(|h| KvEvent::BlockRemoved {
                block_hashes: vec![70_000 - h],
                medium: Some(MEDIUM_GPU.into()),
            })
            .collect();
        for events in [stored, removed] {
            let batch = KvEventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: None,
                unknown_events: 0,
            };
            let bytes = encode_batch(&batch);
            assert!(bytes.len() <= DEFAULT_MAX_PAYLOAD_BYTES, "{}", bytes.len());
            assert_eq!(
                decode_batch(&bytes, DEFAULT_MAX_PAYLOAD_BYTES).unwrap(),
                batch
            );
        }
    }

    /// vLLM's `extra_keys` (per block, `nil` for a plain one) give the first keyed
    /// block, in the map form and the array form (after `lora_name`).
    #[test]
    fn extra_keys_mark_the_first_keyed_block() {
        #[derive(Serialize)]
        struct Stored {
            #[serde(rename = "type")]
            tag: &'static str,
            block_hashes: Vec<u64>,
            parent_block_hash: Option<u64>,
            token_ids: Vec<u32>,
            block_size: u32,
            lora_id: Option<i64>,
            medium: &'static str,
            lora_name: Option<&'static str>,
            extra_keys: Option<Vec<Option<(&'static str, u32)>>>,
        }
        #[derive(Serialize)]
        struct Batch {
            ts: f64,
            events: Vec<Stored>,
        }
        let stored = |extra_keys| Stored {
            tag: "BlockStored",
            block_hashes: vec![1, 2, 3, 4],
            parent_block_hash: None,
            token_ids: (0..16).collect(),
            block_size: 4,
            lora_id: None,
            medium: "GPU",
            lora_name: None,
            extra_keys,
        };
        let cases = [
            (Some(vec![Some(("salt", 0)), None, None, None]), Some(0)),
            (Some(vec![None, None, Some(("mm", 7)), None]), Some(2)),
            (Some(vec![None; 4]), None),
            (None, None),
        ];
        for (keys, want) in cases {
            let map = rmp_serde::to_vec_named(&Batch {
                ts: 0.0,
                events: vec![stored(keys.clone())],
            })
            .unwrap();
            let array = rmp_serde::to_vec(&Batch {
                ts: 0.0,
                events: vec![stored(keys.clone())],
            })
            .unwrap();
            for bytes in [map, array] {
                let batch = decode_batch(&bytes, 1 << 20).unwrap();
                match &batch.events[..] {
                    [KvEvent::BlockStored {
                        extra_keys_from, ..
                    }] => assert_eq!(*extra_keys_from, want, "{keys:?}"),
                    other => panic!("{other:?}"),
                }
            }
        }
        // Not vLLM's shape: no evidence the blocks are plain.
        let odd = rmp_serde::to_vec(&(
            0.0f64,
            vec![(
                "BlockStored",
                vec![1u64],
                (),
                vec![1u32],
                1u8,
                (),
                "GPU",
                (),
                9u8,
            )],
        ))
        .unwrap();
        match &decode_batch(&odd, 1 << 20).unwrap().events[..] {
            [KvEvent::BlockStored {
                extra_keys_from, ..
            }] => assert_eq!(*extra_keys_from, Some(0)),
            other => panic!("{other:?}"),
        }
        // And back through the emulator's encoding.
        let keyed = KvEventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored {
                block_hashes: vec![1, 2],
                parent: None,
                token_ids: vec![1, 2],
                block_size: 1,
                lora_id: None,
                medium: None,
                extra_keys_from: Some(1),
            }],
            data_parallel_rank: None,
            unknown_events: 0,
        };
        assert_eq!(decode_batch(&encode_batch(&keyed), 1 << 20).unwrap(), keyed);
    }

    /// SGLang in EAGLE mode publishes token pairs: the store decodes as such (its blocks
    /// counted), and the rest of the batch with it.
    #[test]
    fn token_pairs_decode_without_failing_the_batch() {
        // [0.0, [["BlockStored", [1], nil, [[1, 2]], 1, nil, "GPU"],
        //        ["BlockRemoved", [9], "GPU"]]]
        let bytes = rmp_serde::to_vec(&(
            0.0f64,
            (
                (
                    "BlockStored",
                    vec![1u64],
                    (),
                    vec![(1u32, 2u32)],
                    1u32,
                    (),
                    "GPU",
                ),
                ("BlockRemoved", vec![9u64], "GPU"),
            ),
        ))
        .unwrap();
        assert_eq!(
            &bytes[..],
            b"\x92\xcb\0\0\0\0\0\0\0\0\x92\x97\xabBlockStored\x91\x01\xc0\x91\x92\x01\x02\x01\xc0\xa3GPU\x93\xacBlockRemoved\x91\x09\xa3GPU"
        );
        let batch = decode_batch(&bytes, 1 << 20).unwrap();
        assert_eq!(
            batch.events,
            vec![
                KvEvent::TokenPairsStored { blocks: 1 },
                KvEvent::BlockRemoved {
                    block_hashes: vec![9],
                    medium: Some("GPU".into()),
                },
            ]
        );
        // Pairs after plain ids, in the map form, make the store pairs too; a token id
        // past u32 is still an error.
        #[derive(Serialize)]
        struct Stored {
            #[serde(rename = "type")]
            tag: &'static str,
            block_hashes: Vec<u64>,
            token_ids: (u32, (u32, u32)),
            block_size: u32,
        }
        let mixed = rmp_serde::to_vec_named(&(
            0.0f64,
            vec![Stored {
                tag: "BlockStored",
                block_hashes: vec![1, 2],
                token_ids: (5, (5, 6)),
                block_size: 1,
            }],
        ))
        .unwrap();
        assert_eq!(
            decode_batch(&mixed, 1 << 20).unwrap().events,
            vec![KvEvent::TokenPairsStored { blocks: 2 }]
        );
        let big = rmp_serde::to_vec(&(
            0.0f64,
            vec![("BlockStored", vec![1u64], (), (1u64 << 33, (1u8, 2u8)), 1u8)],
        ))
        .unwrap();
        assert!(decode_batch(&big, 1 << 20).is_err());
    }

    #[test]
    fn trailing_fields_negative_hashes_and_garbage() {
        // ["BlockStored", [-5], -6, [1,2], 2, nil, nil, "extra", nil, 9] (`lora_name`,
        // no `extra_keys`, a field past them) in a batch with an extra trailing field.
        let ev = (
            "BlockStored",
            vec![-5i64],
            -6i64,
            vec![1u32, 2],
            2u32,
            None::<i64>,
            None::<String>,
            "extra",
            (),
            9u8,
        );
        let bytes = rmp_serde::to_vec(&(0.0f64, vec![ev], None::<i64>, "more")).unwrap();
        let batch = decode_batch(&bytes, 1 << 20).unwrap();
        assert_eq!(
            batch.events,
            vec![KvEvent::BlockStored {
                block_hashes: vec![-5i64 as u64],
                parent: Some(-6i64 as u64),
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: None,
                medium: None,
                extra_keys_from: None,
            }]
        );
        for junk in [
            &b""[..],
            b"\xc1",
            b"\x93\xa1x\x90\xc0",
            b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\x91\xabBlockStor",
            b"\xdd\xff\xff\xff\xff",
        ] {
            assert!(decode_batch(junk, 1 << 20).is_err(), "{junk:?}");
        }
        // A token id past u32 and a missing field are errors, not panics.
        let bad = rmp_serde::to_vec(&(
            0.0f64,
            vec![(
                "BlockStored",
                vec![1u64],
                None::<u64>,
                vec![1u64 << 40],
                1u32,
            )],
        ))
        .unwrap();
        assert!(decode_batch(&bad, 1 << 20).is_err());
        let short = rmp_serde::to_vec(&(0.0f64, vec![("BlockRemoved",)])).unwrap();
        assert!(decode_batch(&short, 1 << 20).is_err());
        // Deep nesting stops at the depth cap.
        let mut deep = vec![0x92u8, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
        deep.extend(std::iter::repeat_n(0x91u8, 10_000));
        assert!(decode_batch(&deep, 1 << 20).is_err());
        assert!(matches!(
            decode_batch(&[0u8; 100], 99),
            Err(CoreError::TooLarge {
                size: 100,
                limit: 99
            })
        ));
    }

    /// SGLang's classes: `array_like`, a batch of two fields, `BlockStored` without
    /// `medium`, `BlockRemoved` with the hashes only, pages of one token.
    #[test]
    fn sglang_shapes() {
        let bytes = rmp_serde::to_vec(&(
            0.5f64,
            (
                (
                    "BlockStored",
                    vec![1u64, 2],
                    None::<u64>,
                    vec![5u32, 6],
                    1u32,
                    None::<i64>,
                ),
                ("BlockRemoved", vec![1u64]),
            ),
        ))
        .unwrap();
        let batch = decode_batch(&bytes, 1 << 20).unwrap();
        assert_eq!(batch.data_parallel_rank, None);
        assert_eq!(
            batch.events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![1, 2],
                    parent: None,
                    token_ids: vec![5, 6],
                    block_size: 1,
                    lora_id: None,
                    medium: None,
                    extra_keys_from: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![1],
                    medium: None,
                },
            ]
        );
    }

    #[test]
    fn seq_frames() {
        assert_eq!(decode_seq(&encode_seq(42)).unwrap(), 42);
        assert_eq!(decode_seq(&encode_seq(REPLAY_END_SEQ)).unwrap(), -1);
        assert!(decode_seq(b"1234").is_err());
    }
}
