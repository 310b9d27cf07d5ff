//! The sender (prefill node): connect and handshake, a state whole or in pieces, each
//! written from the exported buffer and hashed as it goes, and the receiver's ACK.

use std::time::{Duration, Instant};

use futures::SinkExt;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::Framed;

use crate::auth::{self, Secret};
use crate::codec::{CodecError, V2Codec};
use crate::frame::{self, Frame, Identity, StateFrame};
use crate::link::{Link, LinkStream};

use super::{frame_name, next_frame, HandoffError, Limits, RECEIVER, SENDER, SESSION};

/// What a completed send measured.
#[derive(Debug, Clone, Copy)]
pub struct SendReport {
    /// KV payload bytes.
    pub payload_bytes: u64,
    /// From connect to ACK.
    pub elapsed: Duration,
    /// Of which: the connect and the handshake.
    pub connect: Duration,
    /// Of which: hashing the state as it was written (the rest is the writes and the wait
    /// for the ACK).
    pub hash: Duration,
}

/// A state frame the receiver acknowledged.
#[derive(Debug, Clone, Copy)]
pub struct Acked {
    /// The bytes the receiver holds for the handoff.
    pub bytes: u64,
    /// Time spent hashing the frame as it was written.
    pub hash: Duration,
}

/// Payload bytes per write of a state frame: large writes, each hashed just before it
/// goes, so the hash of one overlaps the receiver's reading of the one before.
const WRITE_CHUNK: usize = 512 * 1024;

/// Sends one state to the receiver at `addr` and waits for its ACK.
///
/// # Errors
/// Connect failure, a timeout at any stage, a NACK, or a receiver whose identity differs.
pub async fn send_state(
    addr: &str,
    ours: &Identity,
    state: StateFrame,
    limits: &Limits,
    link: &Link,
) -> Result<SendReport, HandoffError> {
    let start = Instant::now();
    let mut framed = connect(addr, ours, limits, link).await?;
    let connect = start.elapsed();
    let payload_bytes = state.payload.len() as u64;
    let acked = send_piece(&mut framed, Frame::State(state), limits).await?;
    Ok(SendReport {
        payload_bytes,
        elapsed: start.elapsed(),
        connect,
        hash: acked.hash,
    })
}

/// Connects to the receiver at `addr` and completes the handshake: the connection a live
/// handoff sends its pieces on ([`send_piece`]).
///
/// # Errors
/// Connect failure, a timeout, a NACK, or a receiver whose identity differs.
pub async fn connect(
    addr: &str,
    ours: &Identity,
    limits: &Limits,
    link: &Link,
) -> Result<Framed<LinkStream, V2Codec>, HandoffError> {
    let stream = link
        .dial(addr, limits.connect)
        .await
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::TimedOut => HandoffError::Timeout("connect"),
            _ => HandoffError::Connect {
                addr: addr.to_string(),
                source,
            },
        })?;
    let mut framed = Framed::new(stream, V2Codec::over(limits.max_frame, link.is_private()));
    handshake(&mut framed, ours, limits, link.secret()).await?;
    Ok(framed)
}

/// Sends one frame that carries a state (`State`, `Part` or `Last`) and waits for its ACK;
/// returns the bytes the receiver says it holds for the handoff.
///
/// # Errors
/// A timeout, a NACK, or an unexpected reply.
pub async fn send_piece<S>(
    framed: &mut Framed<S, V2Codec>,
    piece: Frame,
    limits: &Limits,
) -> Result<Acked, HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (handoff_id, hash) = write_piece(framed, &piece, limits).await?;
    let bytes = await_ack(framed, &handoff_id, limits).await?;
    Ok(Acked { bytes, hash })
}

/// Writes one frame that carries a state and flushes it, without waiting for its ACK
/// ([`await_ack`]); returns its handoff id and the time spent hashing.
///
/// # Errors
/// A frame that carries no state, a timeout, or the connection's failure.
pub async fn write_piece<S>(
    framed: &mut Framed<S, V2Codec>,
    piece: &Frame,
    limits: &Limits,
) -> Result<(String, Duration), HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (Frame::State(s) | Frame::Part(s) | Frame::Last(s)) = piece else {
        return Err(HandoffError::Protocol(format!(
            "{} carries no state",
            frame_name(piece)
        )));
    };
    let hash = tokio::time::timeout(limits.frame, write_state(framed, piece, s))
        .await
        .map_err(|_| HandoffError::Timeout("state transfer"))??;
    Ok((s.handoff_id.clone(), hash))
}

/// Waits for the receiver's ACK of the state frame of `handoff_id` written last; returns
/// the bytes it says it holds for the handoff.
///
/// # Errors
/// A timeout, a NACK, or an unexpected reply.
pub async fn await_ack<S>(
    framed: &mut Framed<S, V2Codec>,
    handoff_id: &str,
    limits: &Limits,
) -> Result<u64, HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match next_frame(framed, limits.frame, "ack").await? {
        Some(Frame::Ack {
            handoff_id: h,
            bytes,
        }) if h == handoff_id => Ok(bytes),
        Some(Frame::Nack(n)) => Err(HandoffError::Refused(n)),
        Some(other) => Err(HandoffError::Protocol(format!(
            "expected ACK for {handoff_id}, got {}",
            frame_name(&other)
        ))),
        None => Err(HandoffError::Protocol("receiver closed before ACK".into())),
    }
}

/// Writes a state frame straight to the connection: its head, then the payload in large
/// writes from the state's own buffer (no copy into the codec's), hashed as it goes, then
/// the checksum. The bytes are those `frame::encode_keyed` would write. Returns the time
/// spent hashing.
async fn write_state<S>(
    framed: &mut Framed<S, V2Codec>,
    piece: &Frame,
    s: &StateFrame,
) -> Result<Duration, HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // Whatever the codec still buffers goes first.
    SinkExt::<Frame>::flush(framed).await?;
    let mut head = bytes::BytesMut::new();
    frame::encode_state_head(piece, &mut head, framed.codec().max_frame())
        .map_err(CodecError::from)?;
    let mut digest = frame::StateDigest::new(framed.codec().check());
    let mut hashing = Duration::ZERO;
    let mut hash = |digest: &mut frame::StateDigest, b: &[u8]| {
        let t0 = Instant::now();
        digest.update(b);
        hashing += t0.elapsed();
    };
    hash(&mut digest, &head[frame::HEADER_LEN..]);
    let io = framed.get_mut();
    io.write_all(&head).await.map_err(CodecError::from)?;
    for chunk in s.payload.chunks(WRITE_CHUNK) {
        hash(&mut digest, chunk);
        io.write_all(chunk).await.map_err(CodecError::from)?;
    }
    let t0 = Instant::now();
    let sum = digest.finalize();
    let hashing = hashing + t0.elapsed();
    io.write_all(&sum).await.map_err(CodecError::from)?;
    io.flush().await.map_err(CodecError::from)?;
    Ok(hashing)
}

/// The sender's side of one handoff on an open connection (exposed for tests that put a
/// fault-injecting transport underneath).
///
/// # Errors
/// As [`send_state`].
pub async fn send_on<S>(
    framed: &mut Framed<S, V2Codec>,
    ours: &Identity,
    state: StateFrame,
    limits: &Limits,
    secret: Option<&Secret>,
) -> Result<u64, HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    handshake(framed, ours, limits, secret).await?;
    let bytes = state.payload.len() as u64;
    send_piece(framed, Frame::State(state), limits).await?;
    Ok(bytes)
}

/// The sender's side of the handshake: HELLO, the authentication when the receiver asks
/// for it, HELLO_OK with an identity equal to ours.
pub(super) async fn handshake<S>(
    framed: &mut Framed<S, V2Codec>,
    ours: &Identity,
    limits: &Limits,
    secret: Option<&Secret>,
) -> Result<(), HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    tokio::time::timeout(limits.handshake, framed.send(Frame::Hello(ours.clone())))
        .await
        .map_err(|_| HandoffError::Timeout("hello"))??;
    let mut reply = next_frame(framed, limits.handshake, "handshake").await?;
    if let Some(Frame::Challenge { nonce: theirs }) = reply {
        let Some(secret) = secret else {
            return Err(HandoffError::Auth(
                "the receiver requires authentication; configure the shared secret \
                 (--secret-file or EDGESPLIT_SECRET)"
                    .into(),
            ));
        };
        let mine = auth::nonce();
        let mac = secret.mac(SENDER, &[&theirs, &mine]);
        tokio::time::timeout(
            limits.handshake,
            framed.send(Frame::Auth { nonce: mine, mac }),
        )
        .await
        .map_err(|_| HandoffError::Timeout("authentication"))??;
        match next_frame(framed, limits.handshake, "authentication").await? {
            Some(Frame::Auth { nonce, mac })
                if nonce == theirs && secret.verify(RECEIVER, &[&mine, &theirs], &mac) => {}
            Some(Frame::Nack(n)) => return Err(HandoffError::Refused(n)),
            _ => {
                return Err(HandoffError::Auth(
                    "the receiver did not prove it holds the shared secret".into(),
                ))
            }
        }
        framed
            .codec_mut()
            .set_key(secret.mac(SESSION, &[&theirs, &mine]));
        reply = next_frame(framed, limits.handshake, "handshake").await?;
    } else if secret.is_some() && matches!(reply, Some(Frame::HelloOk(_))) {
        // A receiver without the secret could be anyone: the state would leak to it.
        return Err(HandoffError::Auth(
            "the receiver did not ask for authentication; refusing to send a state to an \
             unauthenticated receiver (configure the same secret on the decode node)"
                .into(),
        ));
    }
    match reply {
        Some(Frame::HelloOk(theirs)) => match ours.mismatch(&theirs) {
            Some(n) => Err(HandoffError::Mismatch(n)),
            None => Ok(()),
        },
        Some(Frame::Nack(n)) => Err(HandoffError::Refused(n)),
        Some(other) => Err(HandoffError::Protocol(format!(
            "expected HELLO_OK, got {}",
            frame_name(&other)
        ))),
        None => Err(HandoffError::Protocol(
            "receiver closed during handshake".into(),
        )),
    }
}
