//! The SWIM identity of a node and the bincode codec foca speaks over QUIC datagrams.

use std::net::SocketAddr;

use bytes::{Buf, BufMut};
use gorgo_core::NodeId;
use serde::{Deserialize, Serialize};

/// Largest SWIM packet: fits one QUIC datagram at the minimum 1200-byte path MTU.
pub const MAX_SWIM_PACKET: usize = 1100;

/// Who a member is: node id, region, the address peers dial, and a generation that
/// grows on every restart or rejoin so the newest incarnation of a node wins.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MemberId {
    /// Cluster-unique node id (also the TLS server name of its certificate).
    pub node: NodeId,
    /// The region the node serves.
    pub region: String,
    /// The QUIC address peers dial.
    pub addr: SocketAddr,
    /// Bumped on rejoin; the higher generation wins an address conflict.
    pub generation: u64,
}

impl MemberId {
    /// A placeholder identity for a seed address whose node is not known yet: foca
    /// accepts an announce addressed to any identity with the receiver's address.
    pub(crate) fn seed(addr: SocketAddr) -> Self {
        MemberId {
            node: NodeId(String::new()),
            region: String::new(),
            addr,
            generation: 0,
        }
    }
}

impl foca::Identity for MemberId {
    /// foca keys members by this alone: a member with another node id and a higher
    /// generation at a known address replaces the one there (`Rename`, which
    /// `cluster.rs` takes as the old node going down and the new one coming up).
    /// Not `(NodeId, SocketAddr)`: seeds are announced to with a placeholder identity
    /// that has no node id (`MemberId::seed`), and foca takes an announce only when
    /// its destination's `addr()` equals its own.
    type Addr = SocketAddr;

    fn renew(&self) -> Option<Self> {
        Some(MemberId {
            generation: self.generation.wrapping_add(1),
            ..self.clone()
        })
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.generation > adversary.generation
    }
}

/// Codec failures: always bad input from the network, never a bug.
#[derive(Debug, thiserror::Error)]
#[error("swim codec: {0}")]
pub struct CodecError(String);

/// foca's codec: bincode (standard config) with a hard decode limit.
#[derive(Debug, Default, Clone, Copy)]
pub struct BincodeCodec;

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_SWIM_PACKET>()
}

fn encode<T: Serialize>(value: &T, mut buf: impl BufMut) -> Result<(), CodecError> {
    let bytes =
        bincode::serde::encode_to_vec(value, config()).map_err(|e| CodecError(e.to_string()))?;
    // foca requires that a failed encode leaves the buffer untouched.
    if buf.remaining_mut() < bytes.len() {
        return Err(CodecError("buffer full".into()));
    }
    buf.put_slice(&bytes);
    Ok(())
}

fn decode<T: serde::de::DeserializeOwned>(mut buf: impl Buf) -> Result<T, CodecError> {
    let (value, used) = bincode::serde::decode_from_slice(buf.chunk(), config())
        .map_err(|e| CodecError(e.to_string()))?;
    buf.advance(used);
    Ok(value)
}

impl foca::Codec<MemberId> for BincodeCodec {
    type Error = CodecError;

    fn encode_header(
        &mut self,
        header: &foca::Header<MemberId>,
        buf: impl BufMut,
    ) -> Result<(), CodecError> {
        encode(header, buf)
    }

    fn decode_header(&mut self, buf: impl Buf) -> Result<foca::Header<MemberId>, CodecError> {
        decode(buf)
    }

    fn encode_member(
        &mut self,
        member: &foca::Member<MemberId>,
        buf: impl BufMut,
    ) -> Result<(), CodecError> {
        encode(member, buf)
    }

    fn decode_member(&mut self, buf: impl Buf) -> Result<foca::Member<MemberId>, CodecError> {
        decode(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use foca::Codec;
    use proptest::prelude::*;

    fn id(n: &str, g: u64) -> MemberId {
        MemberId {
            node: NodeId::from(n),
            region: "eu".into(),
            addr: "10.0.0.1:7000".parse().unwrap(),
            generation: g,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = foca::Header {
            src: id("a", 1),
            src_incarnation: 3,
            dst: id("b", 2),
            message: foca::Message::Ping(7),
        };
        let mut buf = Vec::new();
        BincodeCodec.encode_header(&h, &mut buf).unwrap();
        let mut slice = &buf[..];
        assert_eq!(BincodeCodec.decode_header(&mut slice).unwrap(), h);
        assert!(slice.is_empty());
    }

    /// SWIM's packets are part of the cluster protocol too: a change to [`MemberId`]'s
    /// encoding (or foca's) needs a new `gorgo_core::wire::PROTOCOL_VERSION`, like a
    /// change to the core's messages.
    #[test]
    fn swim_encoding_is_pinned_to_the_protocol_version() {
        let h = foca::Header {
            src: MemberId {
                node: NodeId::from("a"),
                region: "eu".into(),
                addr: "[2001:db8::1]:7000".parse().unwrap(),
                generation: 5,
            },
            src_incarnation: 3,
            dst: id("b", 2),
            message: foca::Message::Ping(7),
        };
        let mut buf = Vec::new();
        BincodeCodec.encode_header(&h, &mut buf).unwrap();
        let digest = gorgo_core::hash::hash_bytes(&buf);
        // Recorded with the version: a new version re-records it, changed or not.
        assert_eq!(
            (9, 0x14a0_99e1_dc80_35d0),
            (gorgo_core::wire::PROTOCOL_VERSION, digest),
            "SWIM's encoding changed (digest {digest:#018x}), or the protocol version \
             did: a changed encoding needs a new PROTOCOL_VERSION; record the pair here"
        );
    }

    #[test]
    fn newer_generation_wins() {
        use foca::Identity;
        assert!(id("a", 2).win_addr_conflict(&id("a", 1)));
        assert!(!id("a", 1).win_addr_conflict(&id("a", 2)));
        assert_eq!(id("a", 1).renew().unwrap().generation, 2);
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = BincodeCodec.decode_header(&bytes[..]);
            let _ = BincodeCodec.decode_member(&bytes[..]);
        }
    }
}
