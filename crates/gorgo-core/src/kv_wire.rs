//! The KV-event wire format of vLLM and SGLang, decoded without trusting the sender.
//!
//! An engine publishes over ZeroMQ PUB a multipart message `[topic, seq, payload]`:
//! `seq` an 8-byte big-endian integer counting batches from 0 since the publisher
//! started, `payload` a msgpack `EventBatch` as msgspec encodes it. Older vLLM and
//! SGLang declare their structs `array_like=True`: a batch is `[ts, events,
//! data_parallel_rank]` and each event a tagged array `["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium, ...]`, `["BlockRemoved",
//! block_hashes, medium, ...]`, `["AllBlocksCleared"]`. Newer vLLM encodes the same
//! structs as maps (`{"ts": .., "events": [{"type": "BlockStored", "block_hashes": ..,
//! ..}], ..}`). Both are accepted, fields past the ones read are skipped (new versions
//! append fields), and a block hash may be an integer or bytes (newer vLLM hashes
//! blocks with SHA-256 and sends the digest).
//!
//! The replay socket (a ROUTER) answers a request carrying an 8-byte big-endian start
//! seq with `[seq, payload]` messages for each batch it still buffers from there, then
//! the end marker: seq `-1` with an empty payload.
//!
//! Every size here is capped: the payload before decoding, the nesting depth while
//! decoding; arrays are never preallocated beyond what the bytes can hold.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
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
    /// An event type this version does not know: skipped, counted.
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

/// Most events one batch may carry. An event of two bytes on the wire (`[""]`, an
/// unknown one) decodes to about a hundred, so the payload cap alone let one 8 MiB
/// batch take about 0.5-0.8 GB while it decoded; 65,536 events hold at most a few MiB,
/// far beyond what an engine batches (a handful to a few hundred).
pub const MAX_EVENTS_PER_BATCH: usize = 1 << 16;

/// A batch's event list, refused past [`MAX_EVENTS_PER_BATCH`] while it decodes.
struct CappedEvents(Vec<WireEvent>);

impl<'de> Deserialize<'de> for CappedEvents {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CappedEvents;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of KV events")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<CappedEvents, A::Error> {
                let mut events = Vec::new();
                while let Some(e) = seq.next_element::<WireEvent>()? {
                    if events.len() == MAX_EVENTS_PER_BATCH {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_EVENTS_PER_BATCH} events"
                        )));
                    }
                    events.push(e);
                }
                Ok(CappedEvents(events))
            }
        }
        d.deserialize_seq(V)
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
    let batch = WireBatch::deserialize(&mut de)
        .map_err(|e| CoreError::Malformed(format!("kv event batch: {e}")))?;
    Ok(batch.0)
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
/// the emulator's publisher and the tests.
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
            } => Some(Event::Stored(
                "BlockStored",
                block_hashes,
                *parent,
                token_ids,
                *block_size,
                *lora_id,
                medium.as_deref(),
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
            KvEvent::Unknown => None,
        })
        .collect();
    rmp_serde::to_vec(&Batch(batch.ts, events, batch.data_parallel_rank))
        .expect("encoding plain values into a Vec cannot fail")
}

struct WireBatch(KvEventBatch);

impl<'de> Deserialize<'de> for WireBatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireBatch;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an EventBatch array or map")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<WireBatch, A::Error> {
                let ts: f64 = seq
                    .next_element::<Number>()?
                    .ok_or_else(|| de::Error::missing_field("ts"))?
                    .0;
                let events = seq
                    .next_element::<CappedEvents>()?
                    .ok_or_else(|| de::Error::missing_field("events"))?
                    .0;
                let rank: Option<OptInt> = seq.next_element()?;
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(WireBatch(KvEventBatch {
                    ts,
                    events: events.into_iter().map(|e| e.0).collect(),
                    data_parallel_rank: rank.and_then(|r| r.0),
                }))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireBatch, A::Error> {
                let (mut ts, mut events, mut rank) = (None, None, None);
                while let Some(key) = map.next_key::<FieldName>()? {
                    match key.0.as_str() {
                        "ts" => ts = Some(map.next_value::<Number>()?.0),
                        "events" => events = Some(map.next_value::<CappedEvents>()?.0),
                        "data_parallel_rank" => rank = map.next_value::<OptInt>()?.0,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(WireBatch(KvEventBatch {
                    ts: ts.ok_or_else(|| de::Error::missing_field("ts"))?,
                    events: events
                        .ok_or_else(|| de::Error::missing_field("events"))?
                        .into_iter()
                        .map(|e| e.0)
                        .collect(),
                    data_parallel_rank: rank,
                }))
            }
        }
        d.deserialize_any(V)
    }
}

/// The fields of an event, gathered from either encoding before they are checked.
#[derive(Default)]
struct EventFields {
    tag: Option<String>,
    block_hashes: Option<Vec<u64>>,
    parent: Option<Option<u64>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
}

impl EventFields {
    fn finish<E: de::Error>(self) -> Result<KvEvent, E> {
        let tag = self.tag.ok_or_else(|| E::missing_field("type"))?;
        Ok(match tag.as_str() {
            "BlockStored" => KvEvent::BlockStored {
                block_hashes: self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?,
                parent: self
                    .parent
                    .ok_or_else(|| E::missing_field("parent_block_hash"))?,
                token_ids: self
                    .token_ids
                    .ok_or_else(|| E::missing_field("token_ids"))?,
                block_size: self
                    .block_size
                    .ok_or_else(|| E::missing_field("block_size"))?,
                lora_id: self.lora_id,
                medium: self.medium,
            },
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
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![hash_bytes(&digest)],
                    parent: None,
                    token_ids: (0..16).collect(),
                    block_size: 16,
                    lora_id: None,
                    medium: Some("GPU".into()),
                },
                KvEvent::Unknown,
            ]
        );
    }

    /// A batch of tiny unknown events past the cap is refused while it decodes, not
    /// after it has taken a hundred times its size.
    #[test]
    fn a_batch_of_too_many_events_is_refused() {
        let at_cap = rmp_serde::to_vec(&(0.0f64, vec![("",); MAX_EVENTS_PER_BATCH])).unwrap();
        assert_eq!(
            decode_batch(&at_cap, 8 << 20).unwrap().events.len(),
            MAX_EVENTS_PER_BATCH
        );
        let over = rmp_serde::to_vec(&(0.0f64, vec![("",); MAX_EVENTS_PER_BATCH + 1])).unwrap();
        let e = decode_batch(&over, 8 << 20).unwrap_err().to_string();
        assert!(e.contains("more than 65536 events"), "{e}");
        // The map form too.
        #[derive(Serialize)]
        struct Named {
            ts: f64,
            events: Vec<(&'static str,)>,
        }
        let named = rmp_serde::to_vec_named(&Named {
            ts: 0.0,
            events: vec![("",); MAX_EVENTS_PER_BATCH + 1],
        })
        .unwrap();
        let e = decode_batch(&named, 8 << 20).unwrap_err().to_string();
        assert!(e.contains("more than 65536 events"), "{e}");
    }

    #[test]
    fn trailing_fields_negative_hashes_and_garbage() {
        // ["BlockStored", [-5], -6, [1,2], 2, nil, nil, "extra", 9] in a batch with an
        // extra trailing field.
        let ev = (
            "BlockStored",
            vec![-5i64],
            -6i64,
            vec![1u32, 2],
            2u32,
            None::<i64>,
            None::<String>,
            "extra",
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
