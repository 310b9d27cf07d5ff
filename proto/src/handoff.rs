//! V2 handoff connections: the sender (prefill node) and the receiver (decode node).
//!
//! The receiver never hands a state to its sink before the handshake agreed, the frame's
//! SHA-256 passed (checked by the decoder) and the descriptors the sender declared match
//! the ones the receiver derives from the verified payload itself.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::codec::Framed;

use crate::codec::{CodecError, V2Codec};
use crate::frame::{Frame, Identity, Nack, NackCode, StateFrame};
use crate::layout;

/// Time and size limits of a handoff connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// TCP connect.
    pub connect: Duration,
    /// One whole frame, from its first byte (or from the previous frame) to its last.
    pub frame: Duration,
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
}

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
) -> Result<SendReport, HandoffError> {
    let start = Instant::now();
    let stream = tokio::time::timeout(limits.connect, TcpStream::connect(addr))
        .await
        .map_err(|_| HandoffError::Timeout("connect"))?
        .map_err(|source| HandoffError::Connect {
            addr: addr.to_string(),
            source,
        })?;
    stream.set_nodelay(true).ok();
    let mut framed = Framed::new(stream, V2Codec::new(limits.max_frame));
    let payload_bytes = send_on(&mut framed, ours, state, limits).await?;
    Ok(SendReport {
        payload_bytes,
        elapsed: start.elapsed(),
    })
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
) -> Result<u64, HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    tokio::time::timeout(limits.frame, framed.send(Frame::Hello(ours.clone())))
        .await
        .map_err(|_| HandoffError::Timeout("hello"))??;
    match next_frame(framed, limits.frame, "handshake").await? {
        Some(Frame::HelloOk(theirs)) => {
            if let Some(n) = ours.mismatch(&theirs) {
                return Err(HandoffError::Mismatch(n));
            }
        }
        Some(Frame::Nack(n)) => return Err(HandoffError::Refused(n)),
        Some(other) => {
            return Err(HandoffError::Protocol(format!(
                "expected HELLO_OK, got {}",
                frame_name(&other)
            )))
        }
        None => {
            return Err(HandoffError::Protocol(
                "receiver closed during handshake".into(),
            ))
        }
    }
    let handoff_id = state.handoff_id.clone();
    let bytes = state.payload.len() as u64;
    tokio::time::timeout(limits.frame, framed.send(Frame::State(state)))
        .await
        .map_err(|_| HandoffError::Timeout("state transfer"))??;
    match next_frame(framed, limits.frame, "ack").await? {
        Some(Frame::Ack { handoff_id: h, .. }) if h == handoff_id => Ok(bytes),
        Some(Frame::Nack(n)) => Err(HandoffError::Refused(n)),
        Some(other) => Err(HandoffError::Protocol(format!(
            "expected ACK for {handoff_id}, got {}",
            frame_name(&other)
        ))),
        None => Err(HandoffError::Protocol("receiver closed before ACK".into())),
    }
}

fn frame_name(f: &Frame) -> &'static str {
    match f {
        Frame::Hello(_) => "HELLO",
        Frame::HelloOk(_) => "HELLO_OK",
        Frame::State(_) => "STATE",
        Frame::Ack { .. } => "ACK",
        Frame::Nack(_) => "NACK",
    }
}

/// Where a receiver puts verified states.
pub trait StateSink: Send + Sync + 'static {
    /// Takes a state whose checksum and descriptors passed. Returns the bytes stored, or a
    /// refusal (duplicate id, no room, sequence too long...).
    ///
    /// # Errors
    /// A NACK to send back; the sink must not keep anything of a refused state.
    fn accept(&self, state: StateFrame) -> Result<u64, Nack>;

    /// Counts a refusal (for metrics and tests).
    fn refused(&self, _nack: &Nack) {}
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
    let derived = layout::describe(&state.payload);
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
) -> Result<(), HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut framed = Framed::new(io, V2Codec::new(limits.max_frame));
    let refuse = |n: Nack| {
        sink.refused(&n);
        n
    };
    // Handshake.
    let first = match next_frame(&mut framed, limits.frame, "handshake").await {
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
        let Frame::State(state) = frame else {
            let n = refuse(nack(
                NackCode::UnexpectedFrame,
                "",
                format!("expected STATE, got {}", frame_name(&frame)),
            ));
            framed.send(Frame::Nack(n.clone())).await?;
            return Err(HandoffError::Refused(n));
        };
        let handoff_id = state.handoff_id.clone();
        let result = check_descriptors(&state).and_then(|()| sink.accept(state));
        match result {
            Ok(bytes) => framed.send(Frame::Ack { handoff_id, bytes }).await?,
            Err(n) => {
                let n = refuse(n);
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

/// Accepts receiver connections until `shutdown` resolves.
pub async fn serve<F>(
    listener: TcpListener,
    ours: Identity,
    limits: Limits,
    sink: Arc<dyn StateSink>,
    shutdown: F,
) where
    F: Future<Output = ()> + Send,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let ours = Arc::new(ours);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "handoff accept failed");
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "handoff connection refused: too many connections");
            drop(stream);
            continue;
        };
        stream.set_nodelay(true).ok();
        let (ours, sink) = (ours.clone(), sink.clone());
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = serve_connection(stream, &ours, &limits, sink.as_ref()).await {
                tracing::warn!(%peer, error = %e, "handoff connection ended with an error");
            }
        });
    }
}
