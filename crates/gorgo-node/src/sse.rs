//! Server-sent events as the node relays them: where an event ends, and what it says.
//!
//! The node relays an engine's event stream chunk by chunk, and chunks are network
//! reads and peer frames, not events. Two places need whole events: the client relay
//! (`ingress`), which ends a broken stream with an error event of its own rather than
//! glued onto half an event, and the serving node's relay, which drops the usage-only
//! event a client did not ask for (`crate::stream_usage`). Both cut the stream with the
//! one `EventFramer` here.

use bytes::{Bytes, BytesMut};

/// Most bytes of an unfinished event held back ([`EventFramer`]); beyond it they go
/// out as they are (an engine whose events never end, or end in a way this does not
/// read, is relayed, not buffered without bound).
pub(crate) const MAX_HELD_EVENT_BYTES: usize = 64 * 1024;

/// Cuts a relayed event stream at event boundaries (a blank line: `\n\n`, `\r\r` or
/// `\r\n\r\n`) and holds back the unfinished event after the last one. What ends an
/// event goes out with the chunk that ended it, so an event is never held longer than
/// its own bytes take to arrive.
#[derive(Debug, Default)]
pub(crate) struct EventFramer {
    held: BytesMut,
    /// The bytes sent so far end inside an event (held bytes overflowed).
    mid_event: bool,
}

impl EventFramer {
    /// What of `chunk` (after what was held) can go out now: everything up to the last
    /// event boundary. Empty when no event ended in it.
    pub(crate) fn push(&mut self, chunk: Bytes) -> Bytes {
        if self.held.is_empty() && last_event_end(&chunk) == Some(chunk.len()) {
            // The usual case: the chunk is whole events. No copy.
            self.mid_event = false;
            return chunk;
        }
        // What was held has no event end in it: only an end in the new bytes counts,
        // and one may start up to 3 bytes back (`\r\n\r\n`). Scanning just that keeps
        // an event sent a byte at a time linear, not quadratic, in its length.
        let from = self.held.len().saturating_sub(3);
        self.held.extend_from_slice(&chunk);
        match last_event_end(&self.held[from..]).map(|end| from + end) {
            Some(end) => {
                self.mid_event = false;
                self.held.split_to(end).freeze()
            }
            None if self.held.len() > MAX_HELD_EVENT_BYTES => {
                self.mid_event = true;
                self.held.split().freeze()
            }
            None => Bytes::new(),
        }
    }

    /// What is held, at the end of the stream.
    pub(crate) fn flush(&mut self) -> Bytes {
        self.held.split().freeze()
    }

    /// Drop the unfinished event (the stream failed).
    pub(crate) fn discard(&mut self) {
        self.held.clear();
    }

    /// Whether what went out ends inside an event.
    pub(crate) fn mid_event(&self) -> bool {
        self.mid_event
    }
}

/// Whether the byte at `i` (with the ones before it) ends a blank line, i.e. an event.
fn blank_line_ends_at(b: &[u8], i: usize) -> bool {
    match (b[i - 1], b[i]) {
        (b'\n', b'\n') | (b'\r', b'\r') => true,
        (b'\r', b'\n') => i >= 3 && b[i - 3] == b'\r' && b[i - 2] == b'\n',
        _ => false,
    }
}

/// The end (exclusive) of the last event boundary in `b`, if any.
pub(crate) fn last_event_end(b: &[u8]) -> Option<usize> {
    (1..b.len())
        .rev()
        .find(|&i| blank_line_ends_at(b, i))
        .map(|i| i + 1)
}

/// The end (exclusive) of the first event boundary in `b`, if any: where the first
/// event of a run of whole events ends.
pub(crate) fn first_event_end(b: &[u8]) -> Option<usize> {
    (1..b.len())
        .find(|&i| blank_line_ends_at(b, i))
        .map(|i| i + 1)
}

/// The data of one event: its `data:` lines' values (one leading space dropped),
/// joined by `\n` as an SSE client joins them; `None` when it has no `data:` line.
pub(crate) fn event_data(event: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in event.split(|&b| b == b'\n' || b == b'\r') {
        let Some(value) = line.strip_prefix(b"data:") else {
            continue;
        };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        match &mut data {
            Some(d) => {
                d.push(b'\n');
                d.extend_from_slice(value);
            }
            None => data = Some(value.to_vec()),
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_boundaries_of_every_line_ending() {
        assert_eq!(last_event_end(b"data: a\n\ndata: b"), Some(9));
        assert_eq!(last_event_end(b"data: a\r\n\r\n"), Some(11));
        assert_eq!(last_event_end(b"data: a\r\rdata"), Some(9));
        assert_eq!(last_event_end(b"data: a\ndata: b\n"), None);
        assert_eq!(last_event_end(b""), None);
        assert_eq!(first_event_end(b"data: a\n\ndata: b\n\n"), Some(9));
        assert_eq!(first_event_end(b"data: a\r\n\r\ndata: b\r\n\r\n"), Some(11));
        assert_eq!(first_event_end(b"data: a\n"), None);
    }

    #[test]
    fn the_framer_sends_whole_events_and_holds_the_rest() {
        let mut f = EventFramer::default();
        // Whole events pass as they are.
        assert_eq!(f.push(Bytes::from_static(b"data: 1\n\n")), "data: 1\n\n");
        // Half an event is held until it ends, then goes out whole.
        assert_eq!(f.push(Bytes::from_static(b"data: 2")), "");
        assert_eq!(f.push(Bytes::from_static(b"\n\ndata: 3")), "data: 2\n\n");
        assert!(!f.mid_event());
        // At the end of the stream the rest goes out as it came; on a failure it is
        // dropped.
        assert_eq!(f.flush(), "data: 3");
        f.push(Bytes::from_static(b"data: 4"));
        f.discard();
        assert_eq!(f.flush(), "");
        // An event that never ends is not held without bound.
        let big = Bytes::from(vec![b'x'; MAX_HELD_EVENT_BYTES + 1]);
        assert_eq!(f.push(big).len(), MAX_HELD_EVENT_BYTES + 1);
        assert!(f.mid_event());
        assert_eq!(f.push(Bytes::from_static(b"\n\n")), "\n\n");
        assert!(!f.mid_event());
    }

    /// The framer as it was: every push rescans all it holds (quadratic in an event's
    /// length when its bytes come one at a time).
    #[derive(Default)]
    struct RescanningFramer {
        held: Vec<u8>,
    }

    impl RescanningFramer {
        fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
            self.held.extend_from_slice(chunk);
            match last_event_end(&self.held) {
                Some(end) => self.held.drain(..end).collect(),
                None if self.held.len() > MAX_HELD_EVENT_BYTES => std::mem::take(&mut self.held),
                None => Vec::new(),
            }
        }
    }

    proptest::proptest! {
        /// However the stream is cut into chunks, the framer sends what one that
        /// rescans all it holds sends, chunk by chunk: scanning only the new bytes
        /// (and the 3 before them) finds the same event ends.
        #[test]
        fn any_chunking_sends_the_stream_at_event_ends(
            parts in proptest::collection::vec(
                proptest::sample::select(vec![
                    &b"data: x"[..], b"\n", b"\r", b"\r\n", b"\n\n", b"\r\n\r\n", b"y",
                ]),
                0..60,
            ),
            cuts in proptest::collection::vec(1usize..8, 1..20),
        ) {
            let stream: Vec<u8> = parts.concat();
            let mut f = EventFramer::default();
            let mut reference = RescanningFramer::default();
            let (mut out, mut at, mut i) = (Vec::new(), 0, 0);
            while at < stream.len() {
                let end = (at + cuts[i % cuts.len()]).min(stream.len());
                let sent = f.push(Bytes::copy_from_slice(&stream[at..end]));
                proptest::prop_assert_eq!(&sent[..], &reference.push(&stream[at..end])[..]);
                out.extend_from_slice(&sent);
                at = end;
                i += 1;
            }
            out.extend_from_slice(&f.flush());
            proptest::prop_assert_eq!(out, stream);
        }
    }

    #[test]
    fn event_data_joins_data_lines() {
        assert_eq!(event_data(b"data: {\"a\":1}\n\n").unwrap(), b"{\"a\":1}");
        assert_eq!(event_data(b"data:x\r\n\r\n").unwrap(), b"x");
        assert_eq!(
            event_data(b": ping\ndata: a\ndata: b\n\n").unwrap(),
            b"a\nb"
        );
        assert_eq!(event_data(b": ping\n\n"), None);
    }
}
