//! The receiver (decode node): the handshake's answer, each state or piece checked (its
//! checksum by the decoder, its descriptors against the verified payload) before it is
//! handed to the [`StateSink`], and the bounded server of connections.

use std::future::Future;
use std::sync::Arc;

use futures::SinkExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::codec::Framed;

use crate::auth::{self, Secret};
use crate::codec::{CodecError, V2Codec};
use crate::frame::{Frame, FrameError, Identity, Nack, NackCode, Receipt, StateFrame};
use crate::layout;
use crate::link::Link;

use super::{frame_name, next_frame, HandoffError, Limits, RECEIVER, SENDER, SESSION};

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

    /// Takes room for a state frame's body of `bytes` while it arrives (from its header
    /// on: a frame announcing more than the room left is refused before any of its body
    /// is held), given back with [`StateSink::release`] once it is decoded. The default
    /// sink has no limit.
    ///
    /// # Errors
    /// A NACK (no room).
    fn hold(&self, _bytes: u64) -> Result<(), Nack> {
        Ok(())
    }

    /// Gives back room taken by [`StateSink::reserve`] or [`StateSink::hold`].
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
    /// The buffer the pieces will be joined into, claimed at the first piece (the largest
    /// kept, warm), so that the pieces' own buffers are not it: the join is at the switch.
    out: Option<Vec<u8>>,
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
                out: crate::buffers::POOL.take_largest(),
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
        let t0 = std::time::Instant::now();
        let payloads: Vec<&[u8]> = held.frames.iter().map(|f| &f.payload[..]).collect();
        let needed = usize::try_from(held.bytes).unwrap_or(0);
        let out = match held.out {
            Some(b) if b.capacity() >= needed => b,
            claimed => {
                if let Some(b) = claimed {
                    crate::buffers::give(b);
                }
                crate::buffers::POOL.take(needed)
            }
        };
        let joined = crate::splice::join_from(&payloads, held.first, out)
            .map_err(|e| nack(NackCode::Malformed, handoff_id, e.to_string()))?;
        // At the switch: the answer waits for this (docs/BENCHMARKS.md, the switch's floor).
        tracing::info!(
            handoff_id,
            pieces = held.frames.len(),
            bytes = joined.len(),
            join_ms = t0.elapsed().as_secs_f64() * 1000.0,
            "live handoff's pieces joined"
        );
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
            if let Some(b) = held.out {
                crate::buffers::give(b);
            }
        }
        self.sink.dropped(handoff_id, reason);
    }
}

impl Drop for Pieces<'_> {
    fn drop(&mut self) {
        for (id, held) in self.held.drain() {
            tracing::info!(handoff_id = %id, bytes = held.bytes, "live handoff ended before its last piece; dropped");
            self.sink.release(held.bytes);
            if let Some(b) = held.out {
                crate::buffers::give(b);
            }
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

/// The sink as the decoder's [`crate::frame::Room`].
struct SinkRoom(Arc<dyn StateSink>);

impl crate::frame::Room for SinkRoom {
    fn take(&self, len: usize) -> Result<(), String> {
        self.0.hold(len as u64).map_err(|n| n.reason)
    }

    fn give(&self, len: usize) {
        self.0.release(len as u64);
    }
}

/// Reads away the rest of a refused frame's body (`len` bytes after its header, some of
/// them already in the read buffer), keeping none of it, within `deadline`: the sender,
/// still writing it, then finishes and reads the NACK instead of a reset connection.
async fn discard_body<S>(framed: &mut Framed<S, V2Codec>, len: u64, deadline: std::time::Duration)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    use tokio::io::AsyncReadExt;
    let buffered = framed.read_buffer().len() as u64;
    let mut left = (crate::frame::HEADER_LEN as u64 + len).saturating_sub(buffered);
    framed.read_buffer_mut().clear();
    let io = framed.get_mut();
    let mut scratch = vec![0u8; 64 * 1024];
    let _ = tokio::time::timeout(deadline, async {
        while left > 0 {
            let want = scratch
                .len()
                .min(usize::try_from(left).unwrap_or(usize::MAX));
            match io.read(&mut scratch[..want]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => left -= n as u64,
            }
        }
    })
    .await;
}

/// Serves one receiver connection until the peer closes, an error, or a refusal.
///
/// # Errors
/// The connection's failure, after a NACK has been sent where the protocol allows one.
pub async fn serve_connection<S>(
    io: S,
    ours: &Identity,
    limits: &Limits,
    sink: &Arc<dyn StateSink>,
    secret: Option<&Secret>,
    sealed: bool,
) -> Result<(), HandoffError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let codec = V2Codec::over(limits.max_frame, sealed).with_room(Arc::new(SinkRoom(sink.clone())));
    let mut framed = Framed::new(io, codec);
    let sink = sink.as_ref();
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
                if let HandoffError::Codec(CodecError::Frame(FrameError::NoRoom { len, .. })) = &e {
                    discard_body(&mut framed, *len, limits.frame).await;
                }
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
            if let Err(e) =
                serve_connection(stream, &ours, &limits, &sink, secret.as_deref(), sealed).await
            {
                tracing::warn!(%peer, error = %e, "handoff connection ended with an error");
            }
        });
    }
}
