//! The forward protocol on one bidirectional stream between two nodes.
//!
//! Request: a length-prefixed (u32, big endian) bincode [`ForwardRequest`] holding the
//! client's body. Response: a length-prefixed [`ForwardResponseHead`], then the
//! engine's response bytes, raw, until the stream ends. A stream that ends without
//! finishing cleanly (reset, error) after the head means the serving side failed
//! mid-response.

use gorgo_core::{HashChain, NodeId};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::NodeError;

/// Largest response head accepted from a peer.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Room for the request's fields besides the body.
pub const REQUEST_OVERHEAD_BYTES: usize = 1024 * 1024;

/// A client request travelling to a peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardRequest {
    /// Id for logs across nodes.
    pub request_id: u64,
    /// Hops taken so far, including the one this stream is.
    pub hops: u8,
    /// The node the client talks to.
    pub origin: NodeId,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub endpoint: String,
    /// The prompt's hash chain (so the peer does not re-hash).
    pub chain: HashChain,
    /// The client's JSON body, unchanged.
    pub body: Vec<u8>,
    /// Client headers passed through to the engine.
    pub headers: Vec<(String, String)>,
    /// A per-request policy override (`x-gorgo-policy`).
    pub policy: Option<String>,
}

/// The serving side's answer before the bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardResponseHead {
    /// HTTP status from the engine (or the serving node's error status).
    pub status: u16,
    /// Engine response headers worth passing on.
    pub headers: Vec<(String, String)>,
    /// The region that served the request.
    pub served_by: String,
    /// Hops the request took to get there.
    pub hops: u8,
}

fn bincode_config<const N: usize>() -> bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<N>,
> {
    bincode::config::standard().with_limit::<N>()
}

/// Largest request frame we decode at all; the per-node cap applies on top.
const MAX_REQUEST_FRAME: usize = 256 * 1024 * 1024 + REQUEST_OVERHEAD_BYTES;

/// Write one length-prefixed frame.
pub async fn write_frame<W: AsyncWrite + Unpin + ?Sized, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), NodeError> {
    let bytes = bincode::serde::encode_to_vec(msg, bincode::config::standard())
        .map_err(|e| NodeError::Protocol(format!("encode: {e}")))?;
    let len =
        u32::try_from(bytes.len()).map_err(|_| NodeError::Protocol("frame too large".into()))?;
    w.write_all(&len.to_be_bytes()).await?;
    w.write_all(&bytes).await?;
    w.flush().await?;
    Ok(())
}

/// Read one length-prefixed frame of at most `limit` bytes.
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized, T: for<'de> Deserialize<'de>>(
    r: &mut R,
    limit: usize,
) -> Result<T, NodeError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > limit {
        return Err(NodeError::Protocol(format!(
            "frame of {len} bytes over limit {limit}"
        )));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    let (msg, used) =
        bincode::serde::decode_from_slice(&buf, bincode_config::<MAX_REQUEST_FRAME>())
            .map_err(|e| NodeError::Protocol(format!("decode: {e}")))?;
    if used != len {
        return Err(NodeError::Protocol("trailing bytes in frame".into()));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ForwardRequest {
        ForwardRequest {
            request_id: 7,
            hops: 1,
            origin: NodeId::from("a"),
            endpoint: "/v1/completions".into(),
            chain: HashChain::from_bytes(b"hello world", 4, 4),
            body: br#"{"prompt":"hello world"}"#.to_vec(),
            headers: vec![("content-type".into(), "application/json".into())],
            policy: None,
        }
    }

    #[tokio::test]
    async fn frames_round_trip() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, &sample()).await.unwrap();
        let got: ForwardRequest = read_frame(&mut b, 1 << 16).await.unwrap();
        assert_eq!(got, sample());
    }

    #[tokio::test]
    async fn oversized_frame_is_rejected_before_reading() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let err = read_frame::<_, ForwardRequest>(&mut b, 1024)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("over limit"), "{err}");
    }

    #[tokio::test]
    async fn garbage_frame_is_an_error() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&8u32.to_be_bytes()).await.unwrap();
        a.write_all(&[0xff; 8]).await.unwrap();
        assert!(read_frame::<_, ForwardRequest>(&mut b, 1024).await.is_err());
    }
}
