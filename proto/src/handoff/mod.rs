//! V2 handoff connections: the sender (prefill node) and the receiver (decode node).
//!
//! The receiver never hands a state to its sink before the handshake agreed, the frame's
//! SHA-256 passed (checked by the decoder) and the descriptors the sender declared match
//! the ones the receiver derives from the verified payload itself.
//!
//! Rooms: `send` (the sender), `receive` (the receiver); here what both use: the limits,
//! the errors, the handshake's MAC labels, the reading of the next frame.

mod receive;
mod send;

pub use receive::*;
pub use send::*;

use std::time::Duration;

use futures::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::codec::Framed;

use crate::codec::{CodecError, V2Codec};
use crate::frame::{Frame, Nack};

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
        // A private link's peer that closes without TLS's close_notify, between frames:
        // the end of its connection, as a plain close is (inside a frame it stays an
        // error, as the codec's own end-of-stream rule has it).
        Ok(Some(Err(CodecError::Io(e))))
            if e.kind() == std::io::ErrorKind::UnexpectedEof && framed.read_buffer().is_empty() =>
        {
            Ok(None)
        }
        Ok(Some(r)) => Ok(Some(r?)),
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

#[cfg(test)]
mod tests {
    use super::send::handshake;
    use super::*;
    use crate::auth::Secret;
    use crate::codec::V2Codec;
    use crate::frame::{Frame, Identity, Nack, NackCode, Receipt, StateFrame};
    use crate::layout;
    use futures::{SinkExt, StreamExt};
    use std::sync::Arc;
    use std::sync::Mutex;
    use std::time::Duration;
    use tokio_util::codec::Framed;

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
        /// Room for bodies arriving (`hold`), counted with `reserved`; `None`: no limit.
        room: Option<u64>,
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
        fn hold(&self, bytes: u64) -> Result<(), Nack> {
            let held = self.reserved.load(std::sync::atomic::Ordering::SeqCst);
            match self.room {
                Some(room) if held + bytes > room => Err(Nack {
                    code: NackCode::Capacity,
                    handoff_id: String::new(),
                    reason: format!("{} bytes free", room - held),
                }),
                _ => self.reserve("", bytes),
            }
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
                    let _ = serve_connection(
                        b,
                        &identity(),
                        &limits,
                        &(sink as Arc<dyn StateSink>),
                        None,
                        false,
                    )
                    .await;
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
                    &(sink as Arc<dyn StateSink>),
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

    /// A state frame announcing more than the receiver's free room is refused from its
    /// header: the sender reads the NACK and its reason (the receiver reads the body
    /// away, keeping none of it, instead of resetting the connection under the sender's
    /// write: here a 64 KiB pipe that a 4 MiB frame fills), nothing is stored, and the
    /// room is whole again. One that fits is delivered, its room given back.
    #[tokio::test]
    async fn a_frame_larger_than_the_free_room_is_refused_before_its_body() {
        let limits = Limits {
            frame: Duration::from_secs(5),
            ..Limits::default()
        };
        for (size, fits) in [(4 << 20, false), (1 << 20, true)] {
            let (a, b) = tokio::io::duplex(1 << 16);
            let sink = Arc::new(Sink {
                room: Some(2 << 20),
                ..Sink::default()
            });
            let recv = {
                let sink: Arc<dyn StateSink> = sink.clone();
                tokio::spawn(async move {
                    let _ = serve_connection(b, &identity(), &limits, &sink, None, false).await;
                })
            };
            let payload = bytes::Bytes::from(vec![7u8; size]);
            let big = StateFrame {
                handoff_id: "big".into(),
                request_id: "r".into(),
                tokens: vec![],
                descriptors: layout::describe(&payload).descriptors,
                payload,
            };
            let mut framed = Framed::new(a, V2Codec::new(limits.max_frame));
            let sent = send_on(&mut framed, &identity(), big, &limits, None).await;
            drop(framed);
            let _ = recv.await;
            if fits {
                assert_eq!(sent.unwrap(), size as u64);
                assert_eq!(*sink.accepted.lock().unwrap(), vec!["big".to_string()]);
            } else {
                match sent {
                    Err(HandoffError::Refused(n)) => {
                        assert_eq!(n.code, NackCode::Capacity);
                        // The frame's body: the payload and its metadata.
                        let body: usize = n
                            .reason
                            .strip_prefix("no room for a state frame of ")
                            .and_then(|r| r.split(' ').next()?.parse().ok())
                            .unwrap_or(0);
                        assert!(body > size && body < size + 1024, "{}", n.reason);
                        assert!(n.reason.ends_with(": 2097152 bytes free"), "{}", n.reason);
                    }
                    other => panic!("expected a capacity NACK, got {other:?}"),
                }
                assert!(sink.accepted.lock().unwrap().is_empty());
            }
            assert_eq!(sink.reserved.load(std::sync::atomic::Ordering::SeqCst), 0);
        }
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
                    serve_connection(
                        b,
                        &identity(),
                        &limits,
                        &(sink as Arc<dyn StateSink>),
                        Some(&k),
                        false,
                    )
                    .await
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
