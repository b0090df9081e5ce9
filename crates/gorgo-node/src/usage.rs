//! The engine's `usage` numbers, read from a response as it passes through.
//!
//! The engine's own counts correct what the node estimated: `cached_tokens` corrects
//! the shadow index, `prompt_tokens` teaches the bytes-per-token ratio and measures the
//! node's count. [`UsageScanner`] looks at each chunk as it is relayed (before a usage
//! chunk the client did not ask for is dropped) for the two keys, without parsing the
//! JSON (the usage object comes at the end of a non-streamed body, and in the last
//! chunk of a stream with `stream_options.include_usage`, which the serving node asks
//! for on every stream: `crate::stream_usage`), keeping only a short tail of the
//! previous chunk so that a key split across chunks is still found. What it holds is
//! bounded by that tail.
//! A key inside generated text cannot match: JSON escapes its quotes.

/// Longest key plus the longest number we read: what a split across two chunks can cut
/// (16 bytes of key, [`MAX_DIGITS`] digits and the byte that ends them, with room for
/// a few spaces).
const CARRY: usize = 48;
/// Digits in the largest number we accept: `u64::MAX` has 20; a 20-digit number above
/// it fails to parse, and is no count.
const MAX_DIGITS: usize = 20;

/// Finds `usage.prompt_tokens` and `prompt_tokens_details.cached_tokens` in a stream
/// of response chunks (see the module docs).
#[derive(Debug, Default)]
pub struct UsageScanner {
    tail: Vec<u8>,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
}

impl UsageScanner {
    /// Look at the next chunk of the response body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.prompt_tokens.is_some() && self.cached_tokens.is_some() {
            return;
        }
        // The tail of the previous chunk and this one, scanned together only where a
        // key could straddle them; the rest of the chunk is scanned in place.
        let head = &chunk[..chunk.len().min(CARRY)];
        let mut joined = std::mem::take(&mut self.tail);
        joined.extend_from_slice(head);
        for window in [&joined[..], chunk] {
            if self.prompt_tokens.is_none() {
                self.prompt_tokens = find_number(window, b"\"prompt_tokens\":");
            }
            if self.cached_tokens.is_none() {
                self.cached_tokens = find_number(window, b"\"cached_tokens\":");
            }
        }
        let keep = chunk.len().min(CARRY);
        self.tail = if chunk.len() >= CARRY {
            chunk[chunk.len() - keep..].to_vec()
        } else {
            // A short chunk: keep what came before it too, up to the carry.
            let start = joined.len().saturating_sub(CARRY);
            joined[start..].to_vec()
        };
    }

    /// `usage.prompt_tokens`, once seen.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.prompt_tokens
    }

    /// `usage.prompt_tokens_details.cached_tokens`, once seen.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.cached_tokens
    }
}

/// The integer after `key` (whitespace allowed) in `bytes`; `None` for `null`, a
/// number that is not a `u64`, or a number cut by the end of `bytes`.
fn find_number(bytes: &[u8], key: &[u8]) -> Option<u64> {
    let at = bytes.windows(key.len()).position(|w| w == key)?;
    let rest = &bytes[at + key.len()..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits = &rest[start..];
    let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
    if len == 0 || len > MAX_DIGITS || len == digits.len() {
        // No digits, too many, or the number may go on in the next chunk.
        return None;
    }
    std::str::from_utf8(&digits[..len]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&[u8]]) -> (Option<u64>, Option<u64>) {
        let mut s = UsageScanner::default();
        for c in chunks {
            s.feed(c);
        }
        (s.prompt_tokens(), s.cached_tokens())
    }

    #[test]
    fn finds_usage_in_one_chunk() {
        let chunk = br#"data: {"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens": 64}}}"#;
        assert_eq!(scan(&[chunk]), (Some(10), Some(64)));
        assert_eq!(scan(&[br#"{"cached_tokens":null}"#]), (None, None));
        assert_eq!(scan(&[b"data: [DONE]"]), (None, None));
        assert_eq!(
            scan(&[br#"{"cached_tokens":99999999999999999999999}"#]),
            (None, None)
        );
        // Generated text that quotes a key is escaped, so it does not match.
        assert_eq!(
            scan(&[br#"{"content":"\"prompt_tokens\": 5","usage":{"prompt_tokens": 7}}"#]),
            (Some(7), None)
        );
    }

    #[test]
    fn every_u64_is_read_and_no_more() {
        // u64::MAX has 20 digits; one more is no u64.
        let body = br#"{"usage":{"prompt_tokens":18446744073709551615,"prompt_tokens_details":{"cached_tokens":18446744073709551616}}}"#;
        assert_eq!(scan(&[body]), (Some(u64::MAX), None));
        // Split anywhere, the carry still holds the key and all 20 digits.
        for cut in 1..body.len() {
            let (a, b) = body.split_at(cut);
            assert_eq!(scan(&[a, b]), (Some(u64::MAX), None), "cut at {cut}");
        }
        let chunks: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(scan(&chunks), (Some(u64::MAX), None));
    }

    #[test]
    fn finds_keys_split_across_chunks() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":1234,"total_tokens":1300,"prompt_tokens_details":{"cached_tokens":512}}}"#;
        for cut in 1..body.len() {
            let (a, b) = body.split_at(cut);
            assert_eq!(scan(&[a, b]), (Some(1234), Some(512)), "cut at {cut}");
        }
        // Byte by byte.
        let chunks: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(scan(&chunks), (Some(1234), Some(512)));
    }
}
