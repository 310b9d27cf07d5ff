//! tokio-util codec over [`crate::frame`], for `Framed<TcpStream, V2Codec>`.

use bytes::BytesMut;
use tokio_util::codec::{Decoder, Encoder};

use crate::frame::{self, EncodeError, Frame, FrameError};

/// Frames V2 messages on a byte stream, with a cap on any one frame's body. A state
/// frame's checksum is computed as its bytes arrive ([`frame::Decoder`]).
pub struct V2Codec {
    max_frame: usize,
    /// How STATE frames are checked: SHA-256 until an authenticated handshake derives a
    /// session key (HMAC-SHA256 under it), or nothing of ours on a sealed (TLS) link.
    check: frame::Check,
    /// The connection runs over TLS: an authenticated handshake seals it instead of
    /// keying it.
    sealed: bool,
    decoder: frame::Decoder,
}

impl V2Codec {
    /// A codec that refuses frames whose body exceeds `max_frame` bytes.
    #[must_use]
    pub fn new(max_frame: usize) -> Self {
        Self {
            max_frame,
            check: frame::Check::Sha256,
            sealed: false,
            decoder: frame::Decoder::default(),
        }
    }

    /// [`V2Codec::new`] for a connection that runs over TLS when `sealed`: once the
    /// handshake authenticated the peer, states carry no digest of ours
    /// ([`frame::Check::Sealed`]).
    #[must_use]
    pub fn over(max_frame: usize, sealed: bool) -> Self {
        Self {
            sealed,
            ..Self::new(max_frame)
        }
    }

    /// This codec, asking `room` for each state frame's body when its header arrives
    /// ([`frame::Decoder::with_room`]).
    #[must_use]
    pub fn with_room(mut self, room: std::sync::Arc<dyn frame::Room>) -> Self {
        self.decoder = frame::Decoder::with_room(room);
        self
    }

    /// The cap on one frame's body.
    #[must_use]
    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// How state frames are checked now.
    #[must_use]
    pub fn check(&self) -> &frame::Check {
        &self.check
    }

    /// How long the last state frame decoded took to arrive and to check (once).
    pub fn take_receipt(&mut self) -> Option<frame::Receipt> {
        self.decoder.take_receipt()
    }

    /// The handshake authenticated the peer: STATE checksums become HMAC-SHA256 under
    /// `key` (both directions), or, on a TLS connection, nothing of ours.
    pub fn set_key(&mut self, key: [u8; 32]) {
        self.check = if self.sealed {
            frame::Check::Sealed
        } else {
            frame::Check::Hmac(key)
        };
    }
}

impl Default for V2Codec {
    fn default() -> Self {
        Self::new(frame::DEFAULT_MAX_FRAME)
    }
}

/// Errors of a framed V2 connection.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error("connection closed in the middle of a frame ({0} bytes buffered)")]
    Truncated(usize),
}

impl Decoder for V2Codec {
    type Item = Frame;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, CodecError> {
        if src.is_empty() {
            return Ok(None);
        }
        Ok(self.decoder.decode(src, self.max_frame, &self.check)?)
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, CodecError> {
        match self.decode(src)? {
            Some(f) => Ok(Some(f)),
            None if src.is_empty() => Ok(None),
            None => Err(CodecError::Truncated(src.len())),
        }
    }
}

impl Encoder<Frame> for V2Codec {
    type Error = CodecError;

    fn encode(&mut self, item: Frame, dst: &mut BytesMut) -> Result<(), CodecError> {
        Ok(frame::encode_keyed(
            &item,
            dst,
            self.max_frame,
            &self.check,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{SinkExt, StreamExt};
    use tokio::io::AsyncWriteExt;
    use tokio_util::codec::{FramedRead, FramedWrite};

    #[tokio::test]
    async fn truncated_stream_is_an_error_clean_end_is_none() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut w = FramedWrite::new(a, V2Codec::default());
        w.send(Frame::Ack {
            handoff_id: "x".into(),
            bytes: 3,
        })
        .await
        .unwrap();
        let mut inner = w.into_inner();
        inner.write_all(&crate::frame::MAGIC).await.unwrap();
        drop(inner);
        let mut r = FramedRead::new(b, V2Codec::default());
        assert!(matches!(r.next().await, Some(Ok(Frame::Ack { .. }))));
        assert!(matches!(
            r.next().await,
            Some(Err(CodecError::Truncated(4)))
        ));

        let (a, b) = tokio::io::duplex(64);
        drop(a);
        let mut r = FramedRead::new(b, V2Codec::default());
        assert!(r.next().await.is_none());
    }
}
