//! The emulator's KV events: its radix cache's stores and evictions published as vLLM
//! publishes them (`gorgo engine --kv-events tcp://...`), so that a node, a test or
//! `gorgo up` can follow either source.
//!
//! A ZeroMQ PUB socket sends `[topic, seq, payload]` (seq 8-byte big-endian from 0,
//! payload an `EventBatch` in SGLang's and older vLLM's `array_like` msgpack:
//! [`gorgo_core::kv_wire::encode_batch`]); a ROUTER socket answers replay requests from
//! a ring of the last batches, ending with seq -1 and an empty payload, as vLLM's
//! `ZmqEventPublisher` does. The engine's blocks are published with their token ids:
//! the tokenizer's, or without one the prompt's 4-byte chunks as little-endian ids
//! (a node without a tokenizer hashes the same bytes: docs/kv-events.md). A partial
//! last block is not published (vLLM publishes full blocks only).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use gorgo_core::kv_wire::{encode_batch, encode_seq, KvEvent, KvEventBatch, REPLAY_END_SEQ};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::error::EngineError;
use crate::model::CacheChange;

/// Batches kept for replay (vLLM's `buffer_steps` default).
pub const REPLAY_BUFFER_BATCHES: usize = 10_000;

/// Batches waiting for the PUB socket at most; past it a batch is not sent live (a
/// subscriber sees the gap and asks for the replay, which has it).
const SEND_QUEUE: usize = 4096;

/// Aborts its task when dropped: the publisher's sockets live as long as it does.
#[derive(Debug)]
struct TaskGuard(tokio::task::JoinHandle<()>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The sockets' tasks and the replay ring; the engine's driver hands it cache
/// changes with [`KvPublisher::publish_changes`].
#[derive(Debug)]
pub struct KvPublisher {
    next_seq: u64,
    ring: Arc<Mutex<VecDeque<(u64, Bytes)>>>,
    live: mpsc::Sender<(u64, Bytes)>,
    /// Tokens per published block.
    block_tokens: usize,
    /// The endpoint the PUB socket is bound to (the port resolved).
    pub endpoint: String,
    /// The endpoint the replay ROUTER is bound to.
    pub replay_endpoint: Option<String>,
    _tasks: Vec<TaskGuard>,
}

fn zmq_error(what: &str, e: zeromq::ZmqError) -> EngineError {
    EngineError::Serve(std::io::Error::other(format!("kv events {what}: {e}")))
}

impl KvPublisher {
    /// Bind the PUB socket at `endpoint` (`tcp://127.0.0.1:0` picks a port) and the
    /// replay ROUTER at `replay_endpoint`; blocks hold `block_tokens` tokens.
    pub async fn bind(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        block_tokens: usize,
    ) -> Result<Self, EngineError> {
        let mut publisher = zeromq::PubSocket::new();
        let bound = publisher
            .bind(endpoint)
            .await
            .map_err(|e| zmq_error("bind", e))?
            .to_string();
        let ring = Arc::new(Mutex::new(VecDeque::new()));
        let (live, mut queue) = mpsc::channel::<(u64, Bytes)>(SEND_QUEUE);
        let mut tasks = vec![TaskGuard(tokio::spawn(async move {
            while let Some((seq, payload)) = queue.recv().await {
                let frames = vec![
                    Bytes::new(),
                    Bytes::copy_from_slice(&encode_seq(seq as i64)),
                    payload,
                ];
                let Ok(msg) = ZmqMessage::try_from(frames) else {
                    continue;
                };
                if let Err(e) = publisher.send(msg).await {
                    tracing::warn!(error = %e, "kv events: publish failed");
                }
            }
        }))];
        let mut replay_bound = None;
        if let Some(replay_endpoint) = replay_endpoint {
            let mut router = zeromq::RouterSocket::new();
            replay_bound = Some(
                router
                    .bind(replay_endpoint)
                    .await
                    .map_err(|e| zmq_error("replay bind", e))?
                    .to_string(),
            );
            let ring = ring.clone();
            tasks.push(TaskGuard(tokio::spawn(serve_replays(router, ring))));
        }
        Ok(KvPublisher {
            next_seq: 0,
            ring,
            live,
            block_tokens,
            endpoint: bound,
            replay_endpoint: replay_bound,
            _tasks: tasks,
        })
    }

    /// Tokens per published block (what [`encode_changes`] needs to cut token ids).
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Publish one batch of the engine's cache changes (nothing when empty);
    /// `tokens_of` gives a live request's token ids.
    pub fn publish_changes(
        &mut self,
        changes: &[CacheChange],
        tokens_of: &HashMap<u64, Arc<[u32]>>,
        ts: f64,
    ) {
        let events = encode_changes(changes, tokens_of, self.block_tokens);
        if !events.is_empty() {
            self.publish(events, ts);
        }
    }

    /// Publish `events` as the next batch, or as consecutive batches where one would
    /// hold more events or bytes than a subscriber decodes
    /// ([`gorgo_core::kv_wire::MAX_EVENTS_PER_BATCH`], the default payload cap): one
    /// admission round that evicts 85k blocks made a batch the node refused as
    /// undecodable, and it resynced (a replay gave it the same batch again).
    pub fn publish(&mut self, events: Vec<KvEvent>, ts: f64) {
        if events.is_empty() {
            // An empty batch is a batch (a heartbeat): it goes out as one.
            return self.publish_within_cap(&[], ts);
        }
        for chunk in events.chunks(gorgo_core::kv_wire::MAX_EVENTS_PER_BATCH) {
            self.publish_within_cap(chunk, ts);
        }
    }

    /// Publish `events` as one batch if its payload is within the default cap, else
    /// halves of them, each in turn.
    fn publish_within_cap(&mut self, events: &[KvEvent], ts: f64) {
        let payload = encode_batch(&KvEventBatch {
            ts,
            events: events.to_vec(),
            data_parallel_rank: Some(0),
            unknown_events: 0,
        });
        if payload.len() > gorgo_core::kv_wire::DEFAULT_MAX_PAYLOAD_BYTES && events.len() > 1 {
            let (first, rest) = events.split_at(events.len() / 2);
            self.publish_within_cap(first, ts);
            self.publish_within_cap(rest, ts);
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(payload);
        {
            let mut ring = self.ring.lock().expect("ring lock poisoned");
            if ring.len() == REPLAY_BUFFER_BATCHES {
                ring.pop_front();
            }
            ring.push_back((seq, payload.clone()));
        }
        // A full queue drops the live copy only: the replay ring has it.
        let _ = self.live.try_send((seq, payload));
    }
}

/// The KV events of the engine's cache changes, with blocks of `block_tokens` tokens:
/// separate from publishing so the engine's driver can encode a step's changes while
/// the token ids of the requests that made them are still at hand. A stored block is
/// left out when it is partial or when `tokens_of` lacks its request's token ids (or
/// some of them: a byte prompt's last block whose bytes end short of a 4-byte id counts
/// as full but has no ids that hash back to it).
pub fn encode_changes(
    changes: &[CacheChange],
    tokens_of: &HashMap<u64, Arc<[u32]>>,
    block_tokens: usize,
) -> Vec<KvEvent> {
    let mut events = Vec::new();
    for change in changes {
        match *change {
            CacheChange::Stored {
                hash,
                parent,
                tokens,
                request,
                block,
            } => {
                if tokens as usize != block_tokens {
                    continue;
                }
                let Some(ids) = block.checked_mul(block_tokens).and_then(|start| {
                    tokens_of
                        .get(&request)
                        .and_then(|ids| ids.get(start..start.checked_add(block_tokens)?))
                }) else {
                    continue;
                };
                events.push(KvEvent::BlockStored {
                    block_hashes: vec![hash],
                    parent,
                    token_ids: ids.to_vec(),
                    block_size: block_tokens as u32,
                    lora_id: None,
                    medium: Some(gorgo_core::kv_wire::MEDIUM_GPU.to_owned()),
                    extra_keys_from: None,
                });
            }
            CacheChange::Removed { hash } => events.push(KvEvent::BlockRemoved {
                block_hashes: vec![hash],
                medium: Some(gorgo_core::kv_wire::MEDIUM_GPU.to_owned()),
            }),
        }
    }
    events
}

/// Answer replay requests `[identity, "", start seq]` with every buffered batch from
/// there, then the end marker.
async fn serve_replays(mut router: zeromq::RouterSocket, ring: Arc<Mutex<VecDeque<(u64, Bytes)>>>) {
    loop {
        let Ok(msg) = router.recv().await else {
            // Do not spin on a broken socket.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let frames = msg.into_vec();
        let [identity, _, start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = gorgo_core::kv_wire::decode_seq(start) else {
            continue;
        };
        let batches: Vec<(u64, Bytes)> = ring
            .lock()
            .expect("ring lock poisoned")
            .iter()
            .filter(|(seq, _)| *seq as i64 >= start)
            .cloned()
            .collect();
        let end = (REPLAY_END_SEQ as u64, Bytes::new());
        for (seq, payload) in batches.into_iter().chain(std::iter::once(end)) {
            let frames = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&encode_seq(seq as i64)),
                payload,
            ];
            let Ok(msg) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if router.send(msg).await.is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gorgo_core::kv_wire::{decode_batch, DEFAULT_MAX_PAYLOAD_BYTES, MAX_EVENTS_PER_BATCH};

    /// A step's changes past what a subscriber decodes in one batch (by events, or by
    /// bytes: 64-token blocks' ids) go out as consecutive batches, each decodable, the
    /// events in order.
    #[tokio::test]
    async fn a_step_past_a_batchs_caps_goes_out_in_decodable_batches() {
        let mut publisher = KvPublisher::bind("tcp://127.0.0.1:0", None, 16)
            .await
            .unwrap();
        let removed = (0..MAX_EVENTS_PER_BATCH as u64 + 4_464)
            .map(|h| KvEvent::BlockRemoved {
                block_hashes: vec![h],
                medium: None,
            })
            .collect();
        publisher.publish(removed, 0.0);
        let stored = (0..40_000u64)
            .map(|h| KvEvent::BlockStored {
                block_hashes: vec![h],
                parent: None,
                token_ids: vec![u32::MAX; 64],
                block_size: 64,
                lora_id: None,
                medium: None,
                extra_keys_from: None,
            })
            .collect();
        publisher.publish(stored, 0.0);
        // An empty batch (a heartbeat) is one batch still.
        let batches = publisher.ring.lock().unwrap().len();
        publisher.publish(Vec::new(), 0.0);
        assert_eq!(publisher.ring.lock().unwrap().len(), batches + 1);
        let ring = publisher.ring.lock().unwrap();
        assert!(ring.len() >= 4, "{} batches", ring.len());
        let mut removed_seen = 0u64;
        for (i, (seq, payload)) in ring.iter().enumerate() {
            assert_eq!(*seq, i as u64);
            let batch = decode_batch(payload, DEFAULT_MAX_PAYLOAD_BYTES).expect("decodable");
            for e in batch.events {
                if let KvEvent::BlockRemoved { block_hashes, .. } = e {
                    assert_eq!(block_hashes, [removed_seen], "in order");
                    removed_seen += 1;
                }
            }
        }
        assert_eq!(removed_seen, MAX_EVENTS_PER_BATCH as u64 + 4_464);
    }
}
