//! ZMTP 3 frame headers read from an untrusted byte stream, so that a size is checked
//! before anything is buffered for it.
//!
//! The engine's KV events arrive over ZeroMQ (docs/kv-events.md), and the `zeromq`
//! crate's decoder reserves whatever length a frame header announces: an 8-byte length
//! of 2^40 from a broken or hostile publisher is an allocation of a terabyte, which
//! aborts the process. [`FrameGuard`] reads the same stream the decoder will read,
//! byte for byte, and refuses it at the first header over a limit; the node's relay
//! (`gorgo-node`, `kv_guard`) closes the connection there, before the decoder sees
//! the header. The same decoder slices a command frame's body by the lengths inside
//! it without checking them (a READY whose property length runs past the frame
//! panics it), so the guard also reads each command's body, at most
//! [`MAX_COMMAND_BYTES`], and refuses one whose lengths do not add up. The rest of
//! the framing (greeting, mechanism, command names) is the decoder's to validate: it
//! refuses those with an error, not a panic.
//!
//! The wire (ZMTP 3.0/3.1, RFC 23 and 37): a 64-byte greeting, then frames, each a
//! flags byte (bit 0 MORE, bit 1 LONG, bit 2 COMMAND), a length (1 byte, or 8 bytes
//! big-endian when LONG) and that many bytes. A message is a run of frames with MORE
//! set, closed by one without it.

use crate::error::CoreError;

/// Bytes of a ZMTP 3 greeting.
pub const GREETING_BYTES: usize = 64;

/// Largest command frame accepted: the handshake's READY carries a few short
/// properties and SUBSCRIBE a topic; 64 KiB is far beyond either.
pub const MAX_COMMAND_BYTES: u64 = 64 << 10;

const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;

/// The sizes a stream may use: its messages' bytes and frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest message, bytes over all its frames.
    pub max_message_bytes: u64,
    /// Most frames in one message.
    pub max_parts: u32,
}

impl FrameLimits {
    /// The limits of a KV-event stream whose batches are at most `max_payload_bytes`:
    /// a message is `[topic, seq, payload]` (the replay's `[empty, seq, payload]`), so
    /// the payload plus 64 KiB for the topic and seq, in at most 8 frames.
    pub fn for_kv_events(max_payload_bytes: usize) -> Self {
        FrameLimits {
            max_message_bytes: (max_payload_bytes as u64).saturating_add(64 << 10),
            max_parts: 8,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Bytes of the greeting still to come.
    Greeting(usize),
    /// A frame's flags byte is next.
    Flags,
    /// Length bytes read so far of a frame with these flags.
    Length { flags: u8, have: u8, value: u64 },
    /// Body bytes still to come.
    Body(u64),
    /// Body bytes of a command still to come (the body so far in `command`).
    CommandBody(u64),
}

/// The sans-IO size check of one ZMTP connection's incoming bytes: feed it every
/// chunk in order ([`FrameGuard::feed`]); it errs at the first frame over the limits
/// and stays failed.
#[derive(Debug, Clone)]
pub struct FrameGuard {
    limits: FrameLimits,
    state: State,
    /// Bytes and frames of the message in progress (its frames so far).
    message_bytes: u64,
    message_parts: u32,
    /// The body of the command frame being read.
    command: Vec<u8>,
    failed: Option<CoreError>,
}

impl FrameGuard {
    /// A guard at the start of a connection (the greeting first).
    pub fn new(limits: FrameLimits) -> Self {
        FrameGuard {
            limits,
            state: State::Greeting(GREETING_BYTES),
            message_bytes: 0,
            message_parts: 0,
            command: Vec::new(),
            failed: None,
        }
    }

    /// Read the next `bytes` of the stream. `Err` once a frame header announces more
    /// than the limits allow (a message's bytes or frames, or a command's bytes); the
    /// bytes must then not reach the decoder, and every later call errs the same.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), CoreError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        while !bytes.is_empty() {
            match self.state {
                State::Greeting(left) => {
                    let n = left.min(bytes.len());
                    bytes = &bytes[n..];
                    self.state = if n == left {
                        State::Flags
                    } else {
                        State::Greeting(left - n)
                    };
                }
                State::Flags => {
                    let flags = bytes[0];
                    bytes = &bytes[1..];
                    self.state = State::Length {
                        flags,
                        have: 0,
                        value: 0,
                    };
                }
                State::Length { flags, have, value } => {
                    let width = if flags & FLAG_LONG != 0 { 8 } else { 1 };
                    let value = (value << 8) | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    let have = have + 1;
                    if have < width {
                        self.state = State::Length { flags, have, value };
                    } else {
                        self.check(flags, value)?;
                        self.state = if flags & FLAG_COMMAND != 0 {
                            self.command.clear();
                            State::CommandBody(value)
                        } else if value == 0 {
                            State::Flags
                        } else {
                            State::Body(value)
                        };
                        if self.state == State::CommandBody(0) {
                            self.end_command()?;
                        }
                    }
                }
                State::Body(left) => {
                    let n = left.min(bytes.len() as u64);
                    bytes = &bytes[n as usize..];
                    self.state = if n == left {
                        State::Flags
                    } else {
                        State::Body(left - n)
                    };
                }
                State::CommandBody(left) => {
                    let n = left.min(bytes.len() as u64);
                    self.command.extend_from_slice(&bytes[..n as usize]);
                    bytes = &bytes[n as usize..];
                    if n == left {
                        self.end_command()?;
                    } else {
                        self.state = State::CommandBody(left - n);
                    }
                }
            }
        }
        Ok(())
    }

    /// The command just read is whole: refuse it unless its name's length fits it
    /// and, for READY, each property's name and value lengths fit what is left.
    fn end_command(&mut self) -> Result<(), CoreError> {
        self.state = State::Flags;
        let body = std::mem::take(&mut self.command);
        if command_fits(&body) {
            return Ok(());
        }
        let e = CoreError::Malformed("a ZMTP command whose lengths overrun it".into());
        self.failed = Some(e.clone());
        Err(e)
    }

    /// Account a frame of `len` bytes with `flags`, before its body is read.
    fn check(&mut self, flags: u8, len: u64) -> Result<(), CoreError> {
        let limit = |size: u64, limit: u64| CoreError::TooLarge {
            size: usize::try_from(size).unwrap_or(usize::MAX),
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
        };
        let verdict = if flags & FLAG_COMMAND != 0 {
            // A command is one frame of its own, never part of a message.
            (len > MAX_COMMAND_BYTES).then(|| limit(len, MAX_COMMAND_BYTES))
        } else {
            let bytes = self.message_bytes.saturating_add(len);
            let parts = self.message_parts + 1;
            if bytes > self.limits.max_message_bytes {
                Some(limit(bytes, self.limits.max_message_bytes))
            } else if parts > self.limits.max_parts {
                Some(CoreError::Malformed(format!(
                    "a message of more than {} frames",
                    self.limits.max_parts
                )))
            } else if flags & FLAG_MORE != 0 {
                self.message_bytes = bytes;
                self.message_parts = parts;
                None
            } else {
                self.message_bytes = 0;
                self.message_parts = 0;
                None
            }
        };
        match verdict {
            Some(e) => {
                self.failed = Some(e.clone());
                Err(e)
            }
            None => Ok(()),
        }
    }
}

/// A command body is a name (a length byte and that many bytes) and, for READY,
/// properties: a name (length byte) and a value (4-byte big-endian length).
fn command_fits(body: &[u8]) -> bool {
    let Some((&name_len, rest)) = body.split_first() else {
        return false;
    };
    let Some((name, mut props)) = rest.split_at_checked(name_len as usize) else {
        return false;
    };
    if name != b"READY" {
        return true;
    }
    while let Some((&prop_len, rest)) = props.split_first() {
        let Some((_, rest)) = rest.split_at_checked(prop_len as usize) else {
            return false;
        };
        let Some((len, rest)) = rest.split_first_chunk::<4>() else {
            return false;
        };
        let Some((_, rest)) = rest.split_at_checked(u32::from_be_bytes(*len) as usize) else {
            return false;
        };
        props = rest;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn limits() -> FrameLimits {
        FrameLimits {
            max_message_bytes: 1000,
            max_parts: 3,
        }
    }

    /// A frame as ZMTP writes it: short when it fits a byte.
    fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        if body.len() > 255 {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            out.push(flags);
            out.push(body.len() as u8);
        }
        out.extend_from_slice(body);
        out
    }

    /// A greeting, a READY command and two three-part messages (one with a long frame).
    fn valid_stream() -> Vec<u8> {
        let mut s = vec![0xff; GREETING_BYTES];
        s.extend(frame(
            FLAG_COMMAND,
            b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB",
        ));
        for payload in [vec![7u8; 20], vec![9u8; 600]] {
            s.extend(frame(FLAG_MORE, b"kv"));
            s.extend(frame(FLAG_MORE, &[0; 8]));
            s.extend(frame(0, &payload));
        }
        s
    }

    #[test]
    fn a_valid_stream_passes_in_any_chunks() {
        let s = valid_stream();
        for chunk in [1, 2, 7, 64, 65, s.len()] {
            let mut g = FrameGuard::new(limits());
            for c in s.chunks(chunk) {
                g.feed(c).unwrap();
            }
        }
    }

    #[test]
    fn a_huge_long_length_is_refused_at_its_header() {
        let mut g = FrameGuard::new(limits());
        let mut s = vec![0xff; GREETING_BYTES];
        s.push(FLAG_LONG);
        s.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let e = g.feed(&s).unwrap_err();
        assert!(matches!(e, CoreError::TooLarge { size, limit: 1000 } if size == 1 << 40));
        // Failed for good: later bytes are refused too.
        assert_eq!(g.feed(&[0]), Err(e));
    }

    #[test]
    fn a_message_over_the_limit_across_frames_is_refused() {
        let mut g = FrameGuard::new(limits());
        let mut s = vec![0xff; GREETING_BYTES];
        s.extend(frame(FLAG_MORE, &[1; 255]));
        s.extend(frame(FLAG_MORE, &[1; 255]));
        g.feed(&s).unwrap();
        // 510 + 600 > 1000, though every frame alone fits.
        let e = g.feed(&frame(0, &[1; 600])).unwrap_err();
        assert!(matches!(e, CoreError::TooLarge { size: 1110, .. }));
    }

    #[test]
    fn too_many_parts_and_a_large_command_are_refused() {
        let mut g = FrameGuard::new(limits());
        let mut s = vec![0xff; GREETING_BYTES];
        // The fourth frame of a message whose limit is three.
        for _ in 0..4 {
            s.extend(frame(FLAG_MORE, b"x"));
        }
        assert!(matches!(g.feed(&s), Err(CoreError::Malformed(_))));

        let mut g = FrameGuard::new(limits());
        let mut s = vec![0xff; GREETING_BYTES];
        s.push(FLAG_COMMAND | FLAG_LONG);
        s.extend_from_slice(&(MAX_COMMAND_BYTES + 1).to_be_bytes());
        assert!(matches!(g.feed(&s), Err(CoreError::TooLarge { .. })));
    }

    #[test]
    fn a_command_whose_lengths_overrun_it_is_refused() {
        let greeting = [0xffu8; GREETING_BYTES];
        for body in [
            &b""[..],
            b"\x09READY",
            b"\x05READY\x0bSocket-Type\x00\x00\x00\x09PUB",
            b"\x05READY\x0bSocket-Type\x00\x00",
            b"\x05READY\x20Socket-Type",
        ] {
            let mut g = FrameGuard::new(limits());
            g.feed(&greeting).unwrap();
            let e = g.feed(&frame(FLAG_COMMAND, body)).unwrap_err();
            assert!(matches!(e, CoreError::Malformed(_)), "{body:?}");
        }
        // Other commands' properties are not the decoder's to parse: only the name.
        let mut g = FrameGuard::new(limits());
        g.feed(&greeting).unwrap();
        g.feed(&frame(FLAG_COMMAND, b"\x04PING\xff")).unwrap();
        g.feed(&frame(FLAG_COMMAND, b"\x05READY")).unwrap();
    }

    #[test]
    fn message_counts_restart_after_the_last_frame() {
        let mut g = FrameGuard::new(limits());
        g.feed(&[0xff; GREETING_BYTES]).unwrap();
        // Many messages of 900 bytes: each alone is under 1000.
        for _ in 0..10 {
            g.feed(&frame(FLAG_MORE, &[0; 100])).unwrap();
            g.feed(&frame(0, &[0; 800])).unwrap();
        }
    }

    proptest! {
        /// Whatever arrives, the guard never panics, and once it refuses it refuses
        /// everything after.
        #[test]
        fn never_panics_and_stays_failed(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..80), 0..40)
        ) {
            let mut g = FrameGuard::new(limits());
            let mut failed = false;
            for c in &chunks {
                let r = g.feed(c);
                prop_assert!(!(failed && r.is_ok()));
                failed |= r.is_err();
            }
        }

        /// A valid stream passes however it is cut.
        #[test]
        fn valid_stream_any_cut(cuts in proptest::collection::vec(0usize..2000, 0..10)) {
            let s = valid_stream();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (s.len() + 1)).collect();
            cuts.push(0);
            cuts.push(s.len());
            cuts.sort_unstable();
            let mut g = FrameGuard::new(limits());
            for w in cuts.windows(2) {
                prop_assert!(g.feed(&s[w[0]..w[1]]).is_ok());
            }
        }
    }
}
