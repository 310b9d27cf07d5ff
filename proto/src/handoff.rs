//! V2 handoff connections: the sender (prefill node) and the receiver (decode node).
//!
//! The receiver never hands a state to its sink before the handshake agreed, the frame's
//! SHA-256 passed (checked by the decoder) and the descriptors the sender declared match
//! the ones the receiver derives from the verified payload itself.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::codec::Framed;

use crate::auth::{self, Secret};
use crate::codec::{CodecError, V2Codec};
use crate::frame::{self, Frame, Identity, Nack, NackCode, Receipt, StateFrame};
use crate::layout;
use crate::link::{Link, LinkStream};

/// Time and size limits of a handoff connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// TCP connect.
    pub connect: Duration,
    /// The state transfer: the STATE frame (and its ACK), each from its first byte (or
    /// from the previous frame) to its last.
    pub frame: Duration,
    /// Each handshake frame (HELLO, CHALLENGE, AUTH, HELLO_OK), the same way. Short: these
    /// frames are small, and a peer that trickles them is cut off soon.
    pub handshake: Duration,
    /// Largest frame body accepted or sent.
    pub max_frame: usize,
    /// Most connections a receiver serves at once.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            frame: Duration::from_secs(60),
            handshake: Duration::from_secs(10),
            max_frame: crate::frame::DEFAULT_MAX_FRAME,
            max_connections: 64,
        }
    }
}

/// Why a handoff did not complete.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("could not connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("timed out during {0}")]
    Timeout(&'static str),
    #[error("refused by the receiver: {0}")]
    Refused(Nack),
    #[error("receiver identity differs: {0}")]
    Mismatch(Nack),
    #[error("authentication: {0}")]
    Auth(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error(transparent)]
    Codec(#[from] CodecError),
}

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

async fn next_frame<S>(
    framed: &mut Framed<S, V2Codec>,
    limit: Duration,
    stage: &'static str,
) -> Result<Option<Frame>, HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match tokio::time::timeout(limit, framed.next()).await {
        Err(_) => Err(HandoffError::Timeout(stage)),
        Ok(None) => Ok(None),
        Ok(Some(r)) => Ok(Some(r?)),
    }
}

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
async fn handshake<S>(
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

/// MAC labels of the V2 handshake (see PROTOCOL.md). Versionless: the protocol version is
/// compared in every frame's header, before any MAC (they said "v3" from protocol 3 to 6).
const SENDER: &str = "edgesplit handoff sender";
const RECEIVER: &str = "edgesplit handoff receiver";
const SESSION: &str = "edgesplit handoff session";

fn frame_name(f: &Frame) -> &'static str {
    match f {
        Frame::Challenge { .. } => "CHALLENGE",
        Frame::Auth { .. } => "AUTH",
        Frame::Hello(_) => "HELLO",
        Frame::HelloOk(_) => "HELLO_OK",
        Frame::State(_) => "STATE",
        Frame::Part(_) => "PART",
        Frame::Last(_) => "LAST",
        Frame::Ack { .. } => "ACK",
        Frame::Nack(_) => "NACK",
    }
}

/// Where a receiver puts verified states.
pub trait StateSink: Send + Sync + 'static {
    /// Takes a state whose checksum and descriptors passed, with what receiving it took
    /// (all its pieces, for a live handoff). Returns the bytes stored, or a refusal
    /// (duplicate id, no room, sequence too long...).
    ///
    /// # Errors
    /// A NACK to send back; the sink must not keep anything of a refused state.
    fn accept(&self, state: StateFrame, receipt: Receipt) -> Result<u64, Nack>;

    /// Counts a refusal (for metrics and tests).
    fn refused(&self, _nack: &Nack) {}

    /// Makes room for `bytes` more of a live handoff's pieces, held by the connection
    /// until its `Last` piece (or its end). The default sink has no limit.
    ///
    /// # Errors
    /// A NACK (no room, draining).
    fn reserve(&self, _handoff_id: &str, _bytes: u64) -> Result<(), Nack> {
        Ok(())
    }

    /// Gives back room taken by [`StateSink::reserve`].
    fn release(&self, _bytes: u64) {}

    /// A live handoff's pieces were dropped before it completed (a refused piece, or its
    /// connection ended): it will not arrive. A `Generate` call waiting for it can fail
    /// at once instead of waiting out its bound.
    fn dropped(&self, _handoff_id: &str, _reason: &str) {}
}

/// A live handoff's pieces held by one connection: each checked as it comes (its positions
/// continue the previous piece's, its shape is theirs), all joined once at the last, into
/// a buffer kept for reuse. What is left when the connection ends is dropped, its room
/// given back, and the sink told ([`StateSink::dropped`]).
struct Pieces<'a> {
    sink: &'a dyn StateSink,
    held: std::collections::HashMap<String, Held>,
}

/// One handoff's pieces so far.
struct Held {
    frames: Vec<StateFrame>,
    /// The first position the first piece holds (0, or a tail's start).
    first: usize,
    /// Payload bytes, reserved in the sink.
    bytes: u64,
    /// What receiving them took, summed.
    receipt: Receipt,
}

impl Pieces<'_> {
    /// Takes a `Part` or `Last` piece whose checksum and descriptors passed; returns the
    /// handoff's payload bytes so far. On a refusal the caller drops the handoff
    /// ([`Pieces::drop_handoff`]).
    fn add(&mut self, piece: StateFrame, receipt: Receipt) -> Result<u64, Nack> {
        let id = piece.handoff_id.clone();
        let refuse = |code, reason: String| nack(code, &id, reason);
        let size = piece.payload.len() as u64;
        let Some(held) = self.held.get_mut(&id) else {
            let span = crate::splice::span(&piece.payload)
                .map_err(|e| refuse(NackCode::Malformed, e.to_string()))?;
            // A first piece past 0 is a tail (PROTOCOL.md, "Tails"): every stream of it
            // starts there; its `Generate` names the prefix it goes on from.
            if span.start != 0
                && crate::splice::common_start(&piece.payload).ok().flatten() != Some(span.start)
            {
                return Err(refuse(
                    NackCode::UnexpectedFrame,
                    format!(
                        "the first piece of handoff {id} starts at position {}, and not every \
                         stream of it does: not a tail",
                        span.start
                    ),
                ));
            }
            self.sink.reserve(&id, size)?;
            let held = Held {
                frames: vec![piece],
                first: span.start,
                bytes: size,
                receipt,
            };
            self.held.insert(id, held);
            return Ok(size);
        };
        let prev = held.frames.last().map_or(&[][..], |f| &f.payload[..]);
        let fits = crate::splice::follows(prev, &piece.payload)
            .map_err(|e| refuse(NackCode::Malformed, e.to_string()))
            .and_then(|_| self.sink.reserve(&id, size));
        fits?;
        held.frames.push(piece);
        held.bytes += size;
        held.receipt += receipt;
        Ok(held.bytes)
    }

    /// The handoff's pieces joined into one state (their room given back), with what
    /// receiving them took.
    fn finish(&mut self, handoff_id: &str) -> Result<(StateFrame, Receipt), Nack> {
        let Some(held) = self.held.remove(handoff_id) else {
            return Err(nack(NackCode::Internal, handoff_id, "no pieces held"));
        };
        self.sink.release(held.bytes);
        let payloads: Vec<&[u8]> = held.frames.iter().map(|f| &f.payload[..]).collect();
        let out = crate::buffers::POOL.take(usize::try_from(held.bytes).unwrap_or(0));
        let joined = crate::splice::join_from(&payloads, held.first, out)
            .map_err(|e| nack(NackCode::Malformed, handoff_id, e.to_string()))?;
        let first = &held.frames[0];
        let whole = StateFrame {
            handoff_id: first.handoff_id.clone(),
            request_id: first.request_id.clone(),
            tokens: held
                .frames
                .iter()
                .flat_map(|f| f.tokens.iter().copied())
                .collect(),
            descriptors: layout::describe(&joined).descriptors,
            payload: crate::buffers::share(joined),
        };
        Ok((whole, held.receipt))
    }

    /// Drops what is held of `handoff_id` after a refused piece, telling the sink why.
    fn drop_handoff(&mut self, handoff_id: &str, reason: &str) {
        if let Some(held) = self.held.remove(handoff_id) {
            self.sink.release(held.bytes);
        }
        self.sink.dropped(handoff_id, reason);
    }
}

impl Drop for Pieces<'_> {
    fn drop(&mut self) {
        for (id, held) in self.held.drain() {
            tracing::info!(handoff_id = %id, bytes = held.bytes, "live handoff ended before its last piece; dropped");
            self.sink.release(held.bytes);
            self.sink
                .dropped(&id, "the handoff's connection ended before its last piece");
        }
    }
}

fn nack(code: NackCode, handoff_id: &str, reason: impl Into<String>) -> Nack {
    Nack {
        code,
        handoff_id: handoff_id.to_string(),
        reason: reason.into(),
    }
}

/// Checks a state's declared descriptors against the verified payload.
fn check_descriptors(state: &StateFrame) -> Result<(), Nack> {
    let Ok(derived) = layout::describe_within(&state.payload, state.descriptors.len()) else {
        return Err(nack(
            NackCode::DescriptorMismatch,
            &state.handoff_id,
            format!(
                "the payload derives more tensor descriptors than the {} declared",
                state.descriptors.len()
            ),
        ));
    };
    if derived.descriptors != state.descriptors {
        return Err(nack(
            NackCode::DescriptorMismatch,
            &state.handoff_id,
            format!(
                "declared {} tensor descriptors do not match the {} derived from the payload",
                state.descriptors.len(),
                derived.descriptors.len()
            ),
        ));
    }
    if let Some(cells) = derived.max_cells {
        if cells != state.tokens.len() as u64 {
            return Err(nack(
                NackCode::Malformed,
                &state.handoff_id,
                format!(
                    "state holds {cells} cells but {} token ids were sent",
                    state.tokens.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Serves one receiver connection until the peer closes, an error, or a refusal.
///
/// # Errors
/// The connection's failure, after a NACK has been sent where the protocol allows one.
pub async fn serve_connection<S>(
    io: S,
    ours: &Identity,
    limits: &Limits,
    sink: &dyn StateSink,
    secret: Option<&Secret>,
    sealed: bool,
) -> Result<(), HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut framed = Framed::new(io, V2Codec::over(limits.max_frame, sealed));
    let refuse = |n: Nack| {
        sink.refused(&n);
        n
    };
    // Handshake.
    let first = match next_frame(&mut framed, limits.handshake, "handshake").await {
        Ok(f) => f,
        Err(e) => {
            let n = refuse(error_nack(&e));
            let _ = framed.send(Frame::Nack(n)).await;
            return Err(e);
        }
    };
    match first {
        None => return Ok(()),
        Some(Frame::Hello(theirs)) => {
            // Authentication comes first: an unauthenticated peer learns nothing, not
            // even our identity.
            if let Some(secret) = secret {
                let mine = auth::nonce();
                framed.send(Frame::Challenge { nonce: mine }).await?;
                let reply = next_frame(&mut framed, limits.handshake, "authentication").await;
                let theirs_nonce = match reply {
                    Ok(Some(Frame::Auth { nonce, mac }))
                        if secret.verify(SENDER, &[&mine, &nonce], &mac) =>
                    {
                        nonce
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        let n = refuse(error_nack(&e));
                        let _ = framed.send(Frame::Nack(n)).await;
                        return Err(e);
                    }
                    Ok(Some(_)) => {
                        let n = refuse(nack(
                            NackCode::AuthFailed,
                            "",
                            "authentication failed: the sender did not prove it holds the shared secret",
                        ));
                        let _ = framed.send(Frame::Nack(n.clone())).await;
                        return Err(HandoffError::Refused(n));
                    }
                };
                let mac = secret.mac(RECEIVER, &[&theirs_nonce, &mine]);
                framed.send(Frame::Auth { nonce: mine, mac }).await?;
                framed
                    .codec_mut()
                    .set_key(secret.mac(SESSION, &[&mine, &theirs_nonce]));
            }
            if let Some(n) = ours.mismatch(&theirs) {
                let n = refuse(n);
                framed.send(Frame::Nack(n.clone())).await?;
                return Err(HandoffError::Mismatch(n));
            }
            framed.send(Frame::HelloOk(ours.clone())).await?;
        }
        Some(other) => {
            let n = refuse(nack(
                NackCode::UnexpectedFrame,
                "",
                format!("expected HELLO, got {}", frame_name(&other)),
            ));
            framed.send(Frame::Nack(n.clone())).await?;
            return Err(HandoffError::Refused(n));
        }
    }
    // States.
    let mut pieces = Pieces {
        sink,
        held: std::collections::HashMap::new(),
    };
    loop {
        let frame = match next_frame(&mut framed, limits.frame, "state transfer").await {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(()),
            Err(e) => {
                let n = refuse(error_nack(&e));
                let _ = framed.send(Frame::Nack(n)).await;
                return Err(e);
            }
        };
        // A live handoff's frame: its refusal drops the handoff (see below).
        let live = matches!(frame, Frame::Part(_) | Frame::Last(_));
        // (state, is a piece of a live handoff, is its last piece)
        let (state, piece, last) = match frame {
            Frame::State(s) => (s, false, true),
            Frame::Part(s) => (s, true, false),
            // A LAST with no piece before it is a whole state.
            Frame::Last(s) => {
                let held = pieces.held.contains_key(&s.handoff_id);
                (s, held, true)
            }
            other => {
                let n = refuse(nack(
                    NackCode::UnexpectedFrame,
                    "",
                    format!("expected STATE, PART or LAST, got {}", frame_name(&other)),
                ));
                framed.send(Frame::Nack(n.clone())).await?;
                return Err(HandoffError::Refused(n));
            }
        };
        let handoff_id = state.handoff_id.clone();
        let receipt = framed.codec_mut().take_receipt().unwrap_or_default();
        let result = check_descriptors(&state).and_then(|()| {
            if !piece {
                return sink.accept(state, receipt);
            }
            let bytes = pieces.add(state, receipt)?;
            if !last {
                return Ok(bytes);
            }
            let (whole, receipt) = pieces.finish(&handoff_id)?;
            sink.accept(whole, receipt)
        });
        match result {
            Ok(bytes) => framed.send(Frame::Ack { handoff_id, bytes }).await?,
            Err(n) => {
                let n = refuse(n);
                if live {
                    // Nothing of a live handoff survives a refused piece, and its
                    // sender does not retry: a call waiting for it need not wait on.
                    pieces.drop_handoff(&handoff_id, &n.reason);
                }
                framed.send(Frame::Nack(n)).await?;
            }
        }
    }
}

fn error_nack(e: &HandoffError) -> Nack {
    match e {
        HandoffError::Codec(CodecError::Frame(fe)) => nack(fe.nack_code(), "", fe.to_string()),
        HandoffError::Codec(CodecError::Truncated(n)) => nack(
            NackCode::Malformed,
            "",
            format!("connection closed after {n} bytes of an incomplete frame"),
        ),
        HandoffError::Timeout(stage) => nack(
            NackCode::Timeout,
            "",
            format!("no complete frame within the deadline during {stage}"),
        ),
        other => nack(NackCode::Internal, "", other.to_string()),
    }
}

/// Accepts receiver connections until `shutdown` resolves (over `link`: a private link's
/// TLS handshake comes first, within the handshake deadline).
pub async fn serve<F>(
    listener: TcpListener,
    ours: Identity,
    limits: Limits,
    sink: Arc<dyn StateSink>,
    link: Link,
    shutdown: F,
) where
    F: Future<Output = ()> + Send,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let ours = Arc::new(ours);
    let secret = link.secret_arc();
    let sealed = link.is_private();
    let mut incoming = link.listen(listener, limits.handshake);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            a = incoming.next() => a,
        };
        let Some((stream, peer)) = accepted else {
            return;
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "handoff connection refused: too many connections");
            drop(stream);
            continue;
        };
        let (ours, sink, secret) = (ours.clone(), sink.clone(), secret.clone());
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = serve_connection(
                stream,
                &ours,
                &limits,
                sink.as_ref(),
                secret.as_deref(),
                sealed,
            )
            .await
            {
                tracing::warn!(%peer, error = %e, "handoff connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn identity() -> Identity {
        Identity {
            model_fingerprint: [7; 32],
            build_id: "test".into(),
            type_k: 1,
            type_v: 1,
            flash_attn: true,
            n_ctx: 64,
        }
    }

    /// Keeps what it accepts; counts refusals and the room live pieces hold.
    #[derive(Default)]
    struct Sink {
        accepted: Mutex<Vec<String>>,
        payloads: Mutex<Vec<bytes::Bytes>>,
        refused: Mutex<Vec<NackCode>>,
        reserved: std::sync::atomic::AtomicU64,
        dropped: Mutex<Vec<String>>,
    }

    impl StateSink for Sink {
        fn accept(&self, state: StateFrame, _receipt: Receipt) -> Result<u64, Nack> {
            self.accepted.lock().unwrap().push(state.handoff_id);
            self.payloads.lock().unwrap().push(state.payload.clone());
            Ok(state.payload.len() as u64)
        }
        fn refused(&self, nack: &Nack) {
            self.refused.lock().unwrap().push(nack.code);
        }
        fn reserve(&self, _: &str, bytes: u64) -> Result<(), Nack> {
            self.reserved
                .fetch_add(bytes, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
        fn release(&self, bytes: u64) {
            self.reserved
                .fetch_sub(bytes, std::sync::atomic::Ordering::SeqCst);
        }
        fn dropped(&self, handoff_id: &str, _: &str) {
            self.dropped.lock().unwrap().push(handoff_id.into());
        }
    }

    fn piece(id: &str, first: u32, cells: u32) -> StateFrame {
        let payload = bytes::Bytes::from(crate::splice::testing::synthetic(first, cells, true, 1));
        StateFrame {
            handoff_id: id.into(),
            request_id: "r".into(),
            tokens: (first as i32..(first + cells) as i32).collect(),
            descriptors: layout::describe(&payload).descriptors,
            payload,
        }
    }

    /// A live handoff: the prompt's piece, a delta, the last delta; the sink gets the
    /// joined state (byte for byte the whole one) once, at the last piece. A connection
    /// that ends before its last piece gives its room back, stores nothing and tells the
    /// sink the handoff was dropped; a delta that does not continue the held piece is
    /// refused, and the handoff dropped.
    #[tokio::test]
    async fn live_pieces_are_joined_and_dropped_unless_finished() {
        let limits = Limits {
            frame: Duration::from_secs(5),
            ..Limits::default()
        };
        let run = |frames: Vec<Frame>| async move {
            let (a, b) = tokio::io::duplex(1 << 16);
            let sink = Arc::new(Sink::default());
            let recv = {
                let sink = sink.clone();
                tokio::spawn(async move {
                    let _ =
                        serve_connection(b, &identity(), &limits, sink.as_ref(), None, false).await;
                })
            };
            let mut framed = Framed::new(a, V2Codec::new(limits.max_frame));
            handshake(&mut framed, &identity(), &limits, None)
                .await
                .unwrap();
            let mut acks = Vec::new();
            for f in frames {
                acks.push(send_piece(&mut framed, f, &limits).await);
            }
            drop(framed);
            recv.await.unwrap();
            (acks, sink)
        };
        let (acks, sink) = run(vec![
            Frame::Part(piece("h", 0, 3)),
            Frame::Part(piece("h", 3, 2)),
            Frame::Last(piece("h", 5, 1)),
        ])
        .await;
        let whole = crate::splice::testing::synthetic(0, 6, true, 1);
        let acked: Vec<u64> = acks.into_iter().map(|a| a.unwrap().bytes).collect();
        assert_eq!(acked.last(), Some(&(whole.len() as u64)));
        assert_eq!(
            *sink.payloads.lock().unwrap(),
            vec![bytes::Bytes::from(whole)]
        );
        assert_eq!(sink.reserved.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert!(sink.dropped.lock().unwrap().is_empty());

        let (acks, sink) = run(vec![
            Frame::Part(piece("h", 0, 3)),
            Frame::Part(piece("h", 3, 2)),
        ])
        .await;
        assert!(acks.iter().all(Result::is_ok));
        assert!(sink.accepted.lock().unwrap().is_empty());
        assert_eq!(sink.reserved.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(*sink.dropped.lock().unwrap(), ["h"]);

        let (acks, sink) = run(vec![
            Frame::Part(piece("h", 0, 3)),
            Frame::Last(piece("h", 4, 1)),
        ])
        .await;
        match &acks[1] {
            Err(HandoffError::Refused(n)) => assert_eq!(n.code, NackCode::Malformed),
            other => panic!("expected a NACK, got {other:?}"),
        }
        assert!(sink.accepted.lock().unwrap().is_empty());
        assert_eq!(sink.reserved.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(*sink.dropped.lock().unwrap(), ["h"]);

        // A tail: pieces from position 4 on, joined from there (the receiver's
        // `Generate` joins them onto the prefix it holds).
        let (acks, sink) = run(vec![
            Frame::Part(piece("t", 4, 3)),
            Frame::Last(piece("t", 7, 2)),
        ])
        .await;
        assert!(acks.iter().all(Result::is_ok), "{acks:?}");
        assert_eq!(
            *sink.payloads.lock().unwrap(),
            vec![bytes::Bytes::from(crate::splice::testing::synthetic(
                4, 5, true, 1
            ))]
        );
        // A first piece past 0 whose streams do not all start there is no tail.
        let mut odd = piece("w", 4, 3);
        odd.payload = bytes::Bytes::from(crate::splice::testing::windowed(&[(4, 3), (5, 2)], true));
        odd.descriptors = layout::describe(&odd.payload).descriptors;
        let (acks, sink) = run(vec![Frame::Part(odd)]).await;
        match &acks[0] {
            Err(HandoffError::Refused(n)) => assert_eq!(n.code, NackCode::UnexpectedFrame),
            other => panic!("expected a NACK, got {other:?}"),
        }
        assert!(sink.accepted.lock().unwrap().is_empty());
    }

    fn state(id: &str) -> StateFrame {
        let payload = bytes::Bytes::from_static(b"an opaque payload");
        StateFrame {
            handoff_id: id.into(),
            request_id: "r".into(),
            tokens: vec![],
            descriptors: layout::describe(&payload).descriptors,
            payload,
        }
    }

    fn secret(s: &str) -> Secret {
        Secret::new(s.as_bytes(), "test").unwrap()
    }

    /// Runs one sender against one receiver over an in-memory pipe.
    async fn exchange(
        sender: Option<&Secret>,
        receiver: Option<&Secret>,
    ) -> (Result<u64, HandoffError>, Arc<Sink>) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let sink = Arc::new(Sink::default());
        let limits = Limits {
            frame: Duration::from_secs(5),
            ..Limits::default()
        };
        let recv = {
            let (sink, receiver) = (sink.clone(), receiver.cloned());
            tokio::spawn(async move {
                let _ = serve_connection(
                    b,
                    &identity(),
                    &limits,
                    sink.as_ref(),
                    receiver.as_ref(),
                    false,
                )
                .await;
            })
        };
        let mut framed = Framed::new(a, V2Codec::new(limits.max_frame));
        let sent = send_on(&mut framed, &identity(), state("h1"), &limits, sender).await;
        drop(framed);
        let _ = recv.await;
        (sent, sink)
    }

    #[tokio::test]
    async fn same_secret_delivers_the_state() {
        let k = secret("the shared secret");
        let (sent, sink) = exchange(Some(&k), Some(&k)).await;
        assert_eq!(sent.unwrap(), 17);
        assert_eq!(*sink.accepted.lock().unwrap(), vec!["h1".to_string()]);
    }

    #[tokio::test]
    async fn a_wrong_or_missing_secret_is_refused_before_any_state() {
        let (sent, sink) = exchange(
            Some(&secret("not the secret!!")),
            Some(&secret("the shared secret")),
        )
        .await;
        match sent {
            Err(HandoffError::Refused(n)) => assert_eq!(n.code, NackCode::AuthFailed),
            other => panic!("expected an auth_failed NACK, got {other:?}"),
        }
        assert!(sink.accepted.lock().unwrap().is_empty());
        assert_eq!(*sink.refused.lock().unwrap(), vec![NackCode::AuthFailed]);

        let (sent, sink) = exchange(None, Some(&secret("the shared secret"))).await;
        let Err(HandoffError::Auth(why)) = sent else {
            panic!("expected an authentication error, got {sent:?}")
        };
        assert!(why.contains("requires authentication"), "{why}");
        assert!(sink.accepted.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_sender_with_a_secret_refuses_an_unauthenticated_receiver() {
        let (sent, sink) = exchange(Some(&secret("the shared secret")), None).await;
        let Err(HandoffError::Auth(why)) = sent else {
            panic!("expected an authentication error, got {sent:?}")
        };
        assert!(why.contains("unauthenticated receiver"), "{why}");
        assert!(
            sink.accepted.lock().unwrap().is_empty(),
            "no state was sent"
        );
    }

    /// A recorded AUTH answers the challenge of its own session only.
    #[tokio::test]
    async fn a_replayed_auth_is_refused() {
        let k = secret("the shared secret");
        let limits = Limits {
            frame: Duration::from_secs(5),
            ..Limits::default()
        };
        let mut recorded = None;
        for round in 0..2 {
            let (a, b) = tokio::io::duplex(1 << 16);
            let sink = Arc::new(Sink::default());
            let recv = {
                let (sink, k) = (sink.clone(), k.clone());
                tokio::spawn(async move {
                    serve_connection(b, &identity(), &limits, sink.as_ref(), Some(&k), false).await
                })
            };
            let mut framed = Framed::new(a, V2Codec::new(limits.max_frame));
            framed.send(Frame::Hello(identity())).await.unwrap();
            let Some(Ok(Frame::Challenge { nonce })) = framed.next().await else {
                panic!("expected a challenge")
            };
            let auth = match recorded {
                None => {
                    let mine = crate::auth::nonce();
                    let mac = k.mac(SENDER, &[&nonce, &mine]);
                    recorded = Some((mine, mac));
                    Frame::Auth { nonce: mine, mac }
                }
                Some((mine, mac)) => Frame::Auth { nonce: mine, mac },
            };
            framed.send(auth).await.unwrap();
            let reply = framed.next().await;
            if round == 0 {
                assert!(matches!(reply, Some(Ok(Frame::Auth { .. }))), "{reply:?}");
            } else {
                let Some(Ok(Frame::Nack(n))) = reply else {
                    panic!("expected a NACK, got {reply:?}")
                };
                assert_eq!(n.code, NackCode::AuthFailed);
                assert!(recv.await.unwrap().is_err());
            }
        }
    }
}
