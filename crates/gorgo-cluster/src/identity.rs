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
    /// `cluster.rs` takes as the old node going down and the new one coming up), on
    /// its own word only: a relayed one is dropped first (`displaced_by_relayed`).
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

/// The member among `held` (what foca holds, in any state) that `update`, a
/// membership update another member relayed, would replace: another identity at the
/// same address (another node id, or the same id under another generation) that does
/// not win foca's address conflict. foca replaces the member at an address with any
/// identity there of an equal or higher generation, whatever its id (`Rename`).
///
/// Why: SWIM does not authenticate what a member relays, and foca keys members by
/// address, so one relayed update took a live node out of membership: under a made-up
/// id with a huge generation, the node could never win its address back by renewing;
/// under its own id with a huge generation (a "restart"), this node probed a phantom
/// and answered the node's own packets with "you are down", so it renewed again and
/// again. Either way the relaying member could refute every suspicion of the phantom.
/// A new identity at a held address is taken only on its own word (a SWIM packet it
/// sends, which the peer table checks: `PeerTable::sender_claim`), and a holder's
/// being suspect or down changes nothing, since a member can relay that too
/// (docs/cluster.md, "Identity").
pub(crate) fn displaced_by_relayed<'m>(
    held: impl IntoIterator<Item = &'m foca::Member<MemberId>>,
    update: &MemberId,
) -> Option<&'m MemberId> {
    use foca::Identity;
    held.into_iter().map(|m| m.id()).find(|holder| {
        holder.addr == update.addr && *holder != update && !holder.win_addr_conflict(update)
    })
}

/// The SWIM packet `data` with the membership updates it carries (those the sender
/// relays, piggybacked) that `refuse` picks left out; `None` when it picks none, or
/// when the packet does not decode as far as its updates (foca then refuses it
/// itself). The header, the other updates and the custom broadcasts after them are
/// kept byte for byte: this is the one place that reads a packet's updates before
/// foca does.
pub(crate) fn without_updates(
    data: &[u8],
    mut refuse: impl FnMut(&foca::Member<MemberId>) -> bool,
) -> Option<Vec<u8>> {
    use foca::Codec;
    let mut rest = data;
    let header = BincodeCodec.decode_header(&mut rest).ok()?;
    // foca reads updates after any header but a broadcast's (custom broadcasts only)
    // when at least their count's two bytes follow; an announce carries none.
    if matches!(
        header.message,
        foca::Message::Broadcast | foca::Message::Announce
    ) || rest.len() < 2
    {
        return None;
    }
    let header_len = data.len() - rest.len();
    let count = rest.get_u16();
    // The count is the sender's word: each update takes at least a byte of what
    // follows, so no more than that is reserved before they decode.
    let mut kept: Vec<&[u8]> = Vec::with_capacity(usize::from(count).min(rest.len()));
    for _ in 0..count {
        let before = rest;
        let member = BincodeCodec.decode_member(&mut rest).ok()?;
        if !refuse(&member) {
            kept.push(&before[..before.len() - rest.len()]);
        }
    }
    if kept.len() == usize::from(count) {
        return None;
    }
    let mut packet = Vec::with_capacity(data.len());
    packet.extend_from_slice(&data[..header_len]);
    packet.put_u16(u16::try_from(kept.len()).ok()?);
    for member in kept {
        packet.extend_from_slice(member);
    }
    packet.extend_from_slice(rest);
    Some(packet)
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

    fn at(n: &str, g: u64, addr: &str) -> MemberId {
        MemberId {
            addr: addr.parse().unwrap(),
            ..id(n, g)
        }
    }

    #[test]
    fn a_relayed_update_displaces_only_another_identity_at_its_address() {
        let held = [
            foca::Member::alive(at("n1", 5, "10.0.0.1:7000")),
            foca::Member::down(at("n2", 5, "10.0.0.2:7000")),
        ];
        let displaced = |u: MemberId| displaced_by_relayed(&held, &u).map(|m| m.node.0.clone());
        // Another id at a held address with a generation that would win foca's
        // conflict (equal wins too), whatever state the holder is in.
        assert_eq!(displaced(at("n9", 9, "10.0.0.1:7000")), Some("n1".into()));
        assert_eq!(displaced(at("n9", 5, "10.0.0.1:7000")), Some("n1".into()));
        assert_eq!(displaced(at("n9", 9, "10.0.0.2:7000")), Some("n2".into()));
        // One that loses the conflict changes nothing in foca: let through.
        assert_eq!(displaced(at("n9", 4, "10.0.0.1:7000")), None);
        // The holder's own id under a newer generation (a restart at its address, a
        // rejoin, or a forgery of one): the same.
        assert_eq!(displaced(at("n1", 9, "10.0.0.1:7000")), Some("n1".into()));
        // The holder itself (a suspicion, a refutation, "down"), an older identity, a
        // free address: let through.
        assert_eq!(displaced(at("n1", 5, "10.0.0.1:7000")), None);
        assert_eq!(displaced(at("n1", 4, "10.0.0.1:7000")), None);
        assert_eq!(displaced(at("n9", 9, "10.0.0.3:7000")), None);
    }

    /// A packet as foca writes it: header, then (unless a broadcast) the updates'
    /// count and the updates, then custom broadcasts.
    fn packet(message: foca::Message<MemberId>, updates: &[MemberId], tail: &[u8]) -> Vec<u8> {
        let mut buf = Vec::new();
        let header = foca::Header {
            src: id("a", 1),
            src_incarnation: 0,
            dst: id("b", 1),
            message,
        };
        BincodeCodec.encode_header(&header, &mut buf).unwrap();
        if !updates.is_empty() {
            buf.put_u16(updates.len() as u16);
            for u in updates {
                BincodeCodec
                    .encode_member(&foca::Member::alive(u.clone()), &mut buf)
                    .unwrap();
            }
        }
        buf.extend_from_slice(tail);
        buf
    }

    #[test]
    fn updates_are_left_out_byte_for_byte() {
        let updates = [id("x", 1), id("y", 2), id("z", 3)];
        let tail = [7u8, 7, 7];
        let full = packet(foca::Message::Gossip, &updates, &tail);
        let mut seen = Vec::new();
        let cut = without_updates(&full, |m| {
            seen.push(m.clone());
            m.id().node.0 == "y"
        })
        .unwrap();
        let alive: Vec<_> = updates.iter().cloned().map(foca::Member::alive).collect();
        assert_eq!(seen, alive);
        assert_eq!(
            cut,
            packet(foca::Message::Gossip, &[id("x", 1), id("z", 3)], &tail)
        );
        // All left out: a count of zero, as foca reads it.
        let none = without_updates(&full, |_| true).unwrap();
        let mut expected = packet(foca::Message::Gossip, &[], &[]);
        expected.put_u16(0);
        expected.extend_from_slice(&tail);
        assert_eq!(none, expected);
        // Nothing left out, no updates, a broadcast's custom broadcasts, a cut packet:
        // the packet goes to foca as it came.
        assert!(without_updates(&full, |_| false).is_none());
        assert!(without_updates(&packet(foca::Message::Gossip, &[], &[]), |_| true).is_none());
        let broadcast = packet(foca::Message::Broadcast, &[], &[0, 3, 1, 2, 3]);
        assert!(without_updates(&broadcast, |_| true).is_none());
        assert!(without_updates(&full[..full.len() - tail.len() - 2], |_| true).is_none());
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = BincodeCodec.decode_header(&bytes[..]);
            let _ = BincodeCodec.decode_member(&bytes[..]);
            let _ = without_updates(&bytes, |_| true);
        }
    }
}
