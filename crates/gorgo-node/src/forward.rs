//! The forward protocol on one bidirectional stream between two nodes.
//!
//! Request: a length-prefixed (u32, big endian) bincode [`ForwardRequest`] holding the
//! client's body. Response: a length-prefixed [`ForwardResponseHead`], then the
//! engine's response bytes, raw, until the stream ends. A stream that ends without
//! finishing cleanly (reset, error) after the head means the serving side failed
//! mid-response.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::NodeError;

pub use gorgo_core::wire::{
    ForwardRequest, ForwardResponseHead, MAX_FORWARD_HEAD, MAX_RESPONSE_HEAD,
};

/// Room for a forwarded request's fields besides the body.
pub const REQUEST_OVERHEAD_BYTES: usize = 1024 * 1024;

/// Write one length-prefixed frame.
pub async fn write_frame<W: AsyncWrite + Unpin + ?Sized, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), NodeError> {
    let bytes =
        gorgo_core::wire::try_encode(msg).map_err(|e| NodeError::Protocol(e.to_string()))?;
    let len =
        u32::try_from(bytes.len()).map_err(|_| NodeError::Protocol("frame too large".into()))?;
    w.write_all(&len.to_be_bytes()).await?;
    w.write_all(&bytes).await?;
    w.flush().await?;
    Ok(())
}

/// Read one length-prefixed frame of at most `limit` bytes.
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized, T: DeserializeOwned>(
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
    gorgo_core::wire::decode(&buf, limit).map_err(|e| NodeError::Protocol(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gorgo_core::{HashChain, NodeId};

    fn sample() -> ForwardRequest {
        ForwardRequest {
            request_id: 7,
            hops: 1,
            origin: NodeId::from("a"),
            endpoint: gorgo_core::Endpoint::Completions,
            chain: HashChain::from_bytes(b"hello world", 4, 4),
            body: br#"{"prompt":"hello world"}"#.to_vec(),
            headers: vec![("content-type".into(), "application/json".into())],
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
