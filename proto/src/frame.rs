//! V2 handoff frames: pure encode/decode, no I/O (see `PROTOCOL.md` beside this crate).
//!
//! `decode` is incremental: `Ok(None)` means "not enough bytes yet", never an error. Every
//! length is checked against the bytes actually present (and the frame cap) before anything
//! is allocated, and a `State` frame's SHA-256 is verified before any of its fields is parsed.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use sha2::{Digest, Sha256};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"ESKV";
/// The protocol version this build speaks. A peer with another version is refused.
pub const VERSION: u8 = 7;
/// Fixed header: magic, version, type, two reserved bytes, body length.
pub const HEADER_LEN: usize = 12;
/// Default cap on one frame's body (a state frame carries the whole KV state).
pub const DEFAULT_MAX_FRAME: usize = 512 * 1024 * 1024;
/// Longest handoff or request id.
pub const MAX_ID_LEN: usize = 128;
/// Longest free-text string (build ids, NACK reasons).
pub const MAX_TEXT_LEN: usize = 4096;
/// Most tensor descriptors in one state frame.
pub const MAX_DESCRIPTORS: usize = 16 * 1024;
/// Largest tensor rank.
pub const MAX_RANK: usize = 4;
/// Descriptor dtype for a payload we could not break into tensors (described as raw bytes).
pub const DTYPE_OPAQUE: u32 = u32::MAX;

/// Frame types (byte 5 of the header): the one table of their wire values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    HelloOk = 2,
    State = 3,
    Ack = 4,
    Nack = 5,
    Challenge = 6,
    Auth = 7,
    Part = 8,
    Last = 9,
}

impl TryFrom<u8> for Kind {
    type Error = FrameError;
    fn try_from(v: u8) -> Result<Self, FrameError> {
        const ALL: [Kind; 9] = [
            Kind::Hello,
            Kind::HelloOk,
            Kind::State,
            Kind::Ack,
            Kind::Nack,
            Kind::Challenge,
            Kind::Auth,
            Kind::Part,
            Kind::Last,
        ];
        ALL.into_iter()
            .find(|k| *k as u8 == v)
            .ok_or(FrameError::UnknownType(v))
    }
}

/// What a node must agree on before any KV byte moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// SHA-256 of the GGUF file.
    pub model_fingerprint: [u8; 32],
    /// llama.cpp build identity (bindings version).
    pub build_id: String,
    /// ggml type of the K cache.
    pub type_k: u32,
    /// ggml type of the V cache.
    pub type_v: u32,
    /// Flash attention decides whether V is stored transposed.
    pub flash_attn: bool,
    /// Context size in tokens.
    pub n_ctx: u32,
}

impl Identity {
    /// The first difference between `self` (ours) and `peer`, as a NACK, or `None` if they agree.
    #[must_use]
    pub fn mismatch(&self, peer: &Identity) -> Option<Nack> {
        let (code, reason) = if self.model_fingerprint != peer.model_fingerprint {
            (
                NackCode::ModelMismatch,
                format!(
                    "model fingerprint mismatch: receiver has {}, sender has {}",
                    hex::encode(self.model_fingerprint),
                    hex::encode(peer.model_fingerprint)
                ),
            )
        } else if self.build_id != peer.build_id {
            (
                NackCode::BuildMismatch,
                format!(
                    "llama.cpp build mismatch: receiver has {:?}, sender has {:?}",
                    self.build_id, peer.build_id
                ),
            )
        } else if self.type_k != peer.type_k || self.type_v != peer.type_v {
            (
                NackCode::KvTypeMismatch,
                format!(
                    "KV cache type mismatch: receiver has K={} V={}, sender has K={} V={}",
                    self.type_k, self.type_v, peer.type_k, peer.type_v
                ),
            )
        } else if self.flash_attn != peer.flash_attn {
            (
                NackCode::FlashAttnMismatch,
                format!(
                    "flash-attention mismatch: receiver has {}, sender has {}",
                    self.flash_attn, peer.flash_attn
                ),
            )
        } else if self.n_ctx != peer.n_ctx {
            (
                NackCode::ContextMismatch,
                format!(
                    "context size mismatch: receiver has {}, sender has {}",
                    self.n_ctx, peer.n_ctx
                ),
            )
        } else {
            return None;
        };
        Some(Nack {
            code,
            handoff_id: String::new(),
            reason,
        })
    }
}

/// One tensor inside a state payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDescriptor {
    /// e.g. `m0.s0.l12.k` (memory section, stream, layer, K or V).
    pub name: String,
    /// ggml type id, or [`DTYPE_OPAQUE`].
    pub dtype: u32,
    /// Shape; see PROTOCOL.md for the meaning of each dimension.
    pub dims: Vec<u64>,
    /// Byte offset of the tensor's data in the payload.
    pub offset: u64,
    /// Byte length of the tensor's data.
    pub nbytes: u64,
}

/// The KV state of one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFrame {
    /// Names this handoff; the decode node's `Generate` asks for it.
    pub handoff_id: String,
    /// The request this state belongs to (for logs).
    pub request_id: String,
    /// Every token the state covers (prompt tokens), in order.
    pub tokens: Vec<i32>,
    /// Tensors of the payload.
    pub descriptors: Vec<TensorDescriptor>,
    /// llama.cpp's raw sequence state (`llama_state_seq_get_data_ext`).
    pub payload: Bytes,
}

/// Machine-readable refusal reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NackCode {
    BadMagic,
    UnsupportedVersion,
    Malformed,
    FrameTooLarge,
    ChecksumMismatch,
    UnexpectedFrame,
    ModelMismatch,
    BuildMismatch,
    KvTypeMismatch,
    FlashAttnMismatch,
    ContextMismatch,
    DescriptorMismatch,
    SequenceTooLong,
    DuplicateHandoff,
    Capacity,
    Timeout,
    Internal,
    /// The peer did not prove it holds the shared secret (or asked us to and we cannot).
    AuthFailed,
    /// A code this build does not know (from a newer peer).
    Other(u16),
}

impl NackCode {
    /// Every known code.
    pub const ALL: [NackCode; 18] = {
        let mut all = [NackCode::Internal; 18];
        let mut i = 0;
        while i < NACK_CODES.len() {
            all[i] = NACK_CODES[i].0;
            i += 1;
        }
        all
    };

    /// Wire value.
    #[must_use]
    pub fn to_u16(self) -> u16 {
        match self {
            NackCode::Other(v) => v,
            known => NACK_CODES
                .iter()
                .find(|(c, _, _)| *c == known)
                .map_or(0, |(_, v, _)| *v),
        }
    }

    /// From the wire value.
    #[must_use]
    pub fn from_u16(v: u16) -> Self {
        NACK_CODES
            .iter()
            .find(|(_, w, _)| *w == v)
            .map_or(NackCode::Other(v), |(c, _, _)| *c)
    }

    /// Stable snake_case name for logs and errors.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        NACK_CODES
            .iter()
            .find(|(c, _, _)| *c == self)
            .map_or("other", |(_, _, name)| name)
    }
}

/// The one table of NACK codes: code, wire value, name.
const NACK_CODES: [(NackCode, u16, &str); 18] = [
    (NackCode::BadMagic, 1, "bad_magic"),
    (NackCode::UnsupportedVersion, 2, "unsupported_version"),
    (NackCode::Malformed, 3, "malformed"),
    (NackCode::FrameTooLarge, 4, "frame_too_large"),
    (NackCode::ChecksumMismatch, 5, "checksum_mismatch"),
    (NackCode::UnexpectedFrame, 6, "unexpected_frame"),
    (NackCode::ModelMismatch, 7, "model_mismatch"),
    (NackCode::BuildMismatch, 8, "build_mismatch"),
    (NackCode::KvTypeMismatch, 9, "kv_type_mismatch"),
    (NackCode::FlashAttnMismatch, 10, "flash_attn_mismatch"),
    (NackCode::ContextMismatch, 11, "context_mismatch"),
    (NackCode::DescriptorMismatch, 12, "descriptor_mismatch"),
    (NackCode::SequenceTooLong, 13, "sequence_too_long"),
    (NackCode::DuplicateHandoff, 14, "duplicate_handoff"),
    (NackCode::Capacity, 15, "capacity"),
    (NackCode::Timeout, 16, "timeout"),
    (NackCode::Internal, 17, "internal"),
    (NackCode::AuthFailed, 18, "auth_failed"),
];

/// A refusal, with a human reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nack {
    pub code: NackCode,
    /// Empty when the refusal is not about one handoff (handshake, framing).
    pub handoff_id: String,
    pub reason: String,
}

impl std::fmt::Display for Nack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.reason)
    }
}

/// One V2 frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Sender -> receiver: who I am.
    Hello(Identity),
    /// Receiver -> sender: we agree; here is who I am.
    HelloOk(Identity),
    /// Sender -> receiver: one sequence's KV state.
    State(StateFrame),
    /// Sender -> receiver, live handoff: a piece of a state still being written (the
    /// prompt's state, then deltas: the cells of the tokens written since). Held while
    /// the connection lasts; dropped if it closes before the `Last` piece.
    Part(StateFrame),
    /// Sender -> receiver, live handoff: the final delta; the joined state is stored for
    /// its `Generate` call as a `State` would be.
    Last(StateFrame),
    /// Receiver -> sender: state verified and stored.
    Ack { handoff_id: String, bytes: u64 },
    /// Either way: refused, with a reason.
    Nack(Nack),
    /// Receiver -> sender, when it holds a shared secret: prove you hold it too.
    Challenge { nonce: [u8; 32] },
    /// Sender -> receiver: my nonce and my proof; receiver -> sender: its proof back.
    Auth { nonce: [u8; 32], mac: [u8; 32] },
}

/// Why bytes could not be decoded into a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:02x?}, expected \"ESKV\"")]
    BadMagic(Vec<u8>),
    #[error("unsupported protocol version {0}, this build speaks {VERSION}")]
    UnsupportedVersion(u8),
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error("frame body of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge { len: u64, max: u64 },
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("state frame checksum mismatch: the SHA-256 (HMAC-SHA256 on an authenticated link) over metadata, descriptors and payload does not match")]
    Checksum,
}

impl FrameError {
    /// The NACK code a receiver answers this error with.
    #[must_use]
    pub fn nack_code(&self) -> NackCode {
        match self {
            FrameError::BadMagic(_) => NackCode::BadMagic,
            FrameError::UnsupportedVersion(_) => NackCode::UnsupportedVersion,
            FrameError::Reserved | FrameError::Malformed(_) => NackCode::Malformed,
            FrameError::UnknownType(_) => NackCode::UnexpectedFrame,
            FrameError::TooLarge { .. } => NackCode::FrameTooLarge,
            FrameError::Checksum => NackCode::ChecksumMismatch,
        }
    }
}

fn malformed(what: &str) -> FrameError {
    FrameError::Malformed(what.to_string())
}

/// Decodes one frame from the front of `buf`, consuming it.
///
/// `Ok(None)`: more bytes are needed (and `buf` has been reserved for the declared body,
/// which is within `max_frame`).
///
/// # Errors
/// Any [`FrameError`]; the connection should NACK and close, since framing is lost.
pub fn decode(buf: &mut BytesMut, max_frame: usize) -> Result<Option<Frame>, FrameError> {
    decode_keyed(buf, max_frame, &Check::Sha256)
}

/// [`decode`] on a link whose states are checked as `check` says: HMAC-SHA256 under the
/// session key of the handshake, or nothing of ours inside TLS, instead of SHA-256.
///
/// One call sees one buffer: a caller that feeds a stream keeps a [`Decoder`] instead,
/// which hashes a state's bytes as they arrive.
///
/// # Errors
/// As [`decode`].
pub fn decode_keyed(
    buf: &mut BytesMut,
    max_frame: usize,
    check: &Check,
) -> Result<Option<Frame>, FrameError> {
    Decoder::default().decode(buf, max_frame, check)
}

/// The header's checks (magic first, even before the whole header is here; version;
/// reserved bytes; the body's length against `max_frame`; the type): `(type, body length)`,
/// or `None` while the header is incomplete.
fn check_header(buf: &[u8], max_frame: usize) -> Result<Option<(Kind, usize)>, FrameError> {
    let seen = buf.len().min(4);
    if buf[..seen] != MAGIC[..seen] {
        return Err(FrameError::BadMagic(buf[..seen].to_vec()));
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let version = buf[4];
    if version != VERSION {
        return Err(FrameError::UnsupportedVersion(version));
    }
    let ty = buf[5];
    if buf[6] != 0 || buf[7] != 0 {
        return Err(FrameError::Reserved);
    }
    let len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
    if len > max_frame {
        return Err(FrameError::TooLarge {
            len: len as u64,
            max: max_frame as u64,
        });
    }
    Ok(Some((Kind::try_from(ty)?, len)))
}

/// What receiving one state frame took: from its first bytes to its last, and how much
/// of that went to its checksum (hashed as the bytes arrived).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Receipt {
    pub receive: std::time::Duration,
    pub verify: std::time::Duration,
}

impl std::ops::AddAssign for Receipt {
    fn add_assign(&mut self, o: Receipt) {
        self.receive += o.receive;
        self.verify += o.verify;
    }
}

/// A state frame being received: its checksum so far over the body's first `hashed`
/// bytes; for a large frame, the body itself, moved out of the read buffer into a buffer of
/// its own as it arrives.
struct Pending {
    kind: Kind,
    len: usize,
    digest: StateDigest,
    hashed: usize,
    started: std::time::Instant,
    hashing: std::time::Duration,
    /// A large frame's body so far ([`crate::buffers`]); `None`: the body stays in the
    /// read buffer until whole.
    body: Option<Vec<u8>>,
}

/// State frames whose body is at least this large are received into a buffer of their own
/// from [`crate::buffers`] (reused from handoff to handoff, so its pages are warm), read
/// through a window of this size.
pub const POOLED_MIN: usize = 1024 * 1024;

/// Decodes frames from a buffer that grows as bytes arrive. A STATE, PART or LAST frame's
/// body is hashed as it comes in, so its check at the end is a comparison, not a pass
/// over tens of megabytes; nothing of the body is parsed before the check passed.
pub struct Decoder {
    pending: Option<Pending>,
    receipt: Option<Receipt>,
    pooled_min: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            pending: None,
            receipt: None,
            pooled_min: POOLED_MIN,
        }
    }
}

impl Decoder {
    /// Decodes one frame from the front of `buf`, consuming it; `Ok(None)`: more bytes are
    /// needed (and `buf` has been reserved for them, within `max_frame`). Call it again
    /// with the same buffer, grown, and the same `check`.
    ///
    /// # Errors
    /// As [`decode`]; the decoder then starts over with the next frame.
    pub fn decode(
        &mut self,
        buf: &mut BytesMut,
        max_frame: usize,
        check: &Check,
    ) -> Result<Option<Frame>, FrameError> {
        let res = self.step(buf, max_frame, check);
        if res.is_err() {
            if let Some(body) = self.pending.take().and_then(|p| p.body) {
                crate::buffers::give(body);
            }
        }
        res
    }

    /// How long the last state frame took to arrive and to check, once (taken).
    pub fn take_receipt(&mut self) -> Option<Receipt> {
        self.receipt.take()
    }

    /// A decoder that receives state bodies from `n` bytes up into their own buffer.
    #[cfg(test)]
    fn with_pooled_min(n: usize) -> Self {
        Decoder {
            pooled_min: n,
            ..Decoder::default()
        }
    }

    fn step(
        &mut self,
        buf: &mut BytesMut,
        max_frame: usize,
        check: &Check,
    ) -> Result<Option<Frame>, FrameError> {
        if self.pending.as_ref().is_some_and(|p| p.body.is_some()) {
            return self.step_pooled(buf);
        }
        let Some((kind, len)) = check_header(buf, max_frame)? else {
            return Ok(None);
        };
        let total = HEADER_LEN + len;
        let stateful = matches!(kind, Kind::State | Kind::Part | Kind::Last);
        if stateful && len >= 32 {
            let pooled = len >= self.pooled_min;
            let p = self.pending.get_or_insert_with(|| Pending {
                kind,
                len,
                digest: StateDigest::new(check),
                hashed: 0,
                started: std::time::Instant::now(),
                hashing: std::time::Duration::ZERO,
                // The declared length passed the cap above.
                body: pooled.then(|| crate::buffers::take(len)),
            });
            if p.body.is_some() {
                buf.advance(HEADER_LEN);
                return self.step_pooled(buf);
            }
            // The checksum covers the body but its last 32 bytes (the checksum itself).
            let upto = (buf.len() - HEADER_LEN).min(len - 32);
            if upto > p.hashed {
                let t0 = std::time::Instant::now();
                p.digest
                    .update(&buf[HEADER_LEN + p.hashed..HEADER_LEN + upto]);
                p.hashing += t0.elapsed();
                p.hashed = upto;
            }
        }
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        let mut frame = buf.split_to(total).freeze();
        frame.advance(HEADER_LEN);
        match self.pending.take() {
            None => parse_body(kind, frame, check).map(Some),
            Some(p) => self.finish(p, frame),
        }
    }

    /// A large state frame: what arrived moves from `buf` (whose room is reused) into the
    /// frame's own buffer, hashed on the way.
    fn step_pooled(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let Some(p) = self.pending.as_mut() else {
            return Ok(None);
        };
        let Some(body) = p.body.as_mut() else {
            return Ok(None);
        };
        let take = (p.len - body.len()).min(buf.len());
        body.extend_from_slice(&buf[..take]);
        buf.advance(take);
        let upto = body.len().min(p.len - 32);
        if upto > p.hashed {
            let t0 = std::time::Instant::now();
            p.digest.update(&body[p.hashed..upto]);
            p.hashing += t0.elapsed();
            p.hashed = upto;
        }
        if body.len() < p.len {
            buf.reserve(POOLED_MIN.min(p.len - body.len()));
            return Ok(None);
        }
        let Some(mut p) = self.pending.take() else {
            return Ok(None);
        };
        let body = p.body.take().unwrap_or_default();
        self.finish(p, crate::buffers::share(body))
    }

    /// A whole state body: its checksum, then its fields.
    fn finish(&mut self, p: Pending, body: Bytes) -> Result<Option<Frame>, FrameError> {
        // Verify first: nothing of the body is interpreted before its checksum passed.
        let t0 = std::time::Instant::now();
        if !p.digest.verify(&body[p.len - 32..]) {
            return Err(FrameError::Checksum);
        }
        self.receipt = Some(Receipt {
            receive: p.started.elapsed(),
            verify: p.hashing + t0.elapsed(),
        });
        let s = parse_state(body.slice(..p.len - 32))?;
        Ok(Some(match p.kind {
            Kind::Part => Frame::Part(s),
            Kind::Last => Frame::Last(s),
            _ => Frame::State(s),
        }))
    }
}

fn get_32(b: &mut Bytes) -> Result<[u8; 32], FrameError> {
    need(b, 32, "32-byte field")?;
    let mut v = [0u8; 32];
    b.copy_to_slice(&mut v);
    Ok(v)
}

/// The STATE checksum: SHA-256, or HMAC-SHA256 under the session key, fed as the body
/// leaves or arrives so that it costs no pass of its own.
#[derive(Clone)]
pub enum StateDigest {
    Plain(Sha256),
    Keyed(hmac::Hmac<Sha256>),
    /// Inside TLS: no digest of ours (see [`Check::Sealed`]); the trailer is 32 zero bytes.
    Sealed,
}

/// How a connection checks the bytes of the states it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Check {
    /// SHA-256 of the body (a plain link without a secret).
    #[default]
    Sha256,
    /// HMAC-SHA256 under the session key of the handshake (a secret over a plain stream).
    Hmac([u8; 32]),
    /// A private link: TLS 1.3 has authenticated every byte of the connection with its
    /// AEAD under keys only the two holders of the secret have, so a digest of ours over
    /// the same bytes would check nothing more and cost a pass of SHA-256 on each side
    /// (issue 16). The trailer is kept (32 zero bytes, checked) so that the frame layout
    /// does not depend on the link.
    Sealed,
}

impl StateDigest {
    /// The digest `check` asks for.
    #[must_use]
    pub fn new(check: &Check) -> Self {
        use hmac::Mac;
        match check {
            Check::Sha256 => StateDigest::Plain(Sha256::new()),
            Check::Hmac(k) => StateDigest::Keyed(
                hmac::Hmac::<Sha256>::new_from_slice(k).expect("HMAC takes keys of any length"),
            ),
            Check::Sealed => StateDigest::Sealed,
        }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        use hmac::Mac;
        match self {
            StateDigest::Plain(h) => h.update(bytes),
            StateDigest::Keyed(m) => m.update(bytes),
            StateDigest::Sealed => {}
        }
    }

    /// The 32-byte trailer.
    #[must_use]
    pub fn finalize(self) -> [u8; 32] {
        use hmac::Mac;
        match self {
            StateDigest::Plain(h) => h.finalize().into(),
            StateDigest::Keyed(m) => m.finalize().into_bytes().into(),
            StateDigest::Sealed => [0; 32],
        }
    }

    /// Checks a trailer; an HMAC is compared in constant time by the `hmac` crate
    /// (`verify_slice`). A sealed link's trailer must be zeros: a sender that checks
    /// otherwise is not on the same kind of link.
    #[must_use]
    pub fn verify(self, sum: &[u8]) -> bool {
        use hmac::Mac;
        match self {
            StateDigest::Plain(h) => h.finalize().as_slice() == sum,
            StateDigest::Keyed(m) => m.verify_slice(sum).is_ok(),
            StateDigest::Sealed => sum.iter().all(|&b| b == 0),
        }
    }
}

fn parse_body(kind: Kind, mut body: Bytes, check: &Check) -> Result<Frame, FrameError> {
    let frame = match kind {
        Kind::Hello => Frame::Hello(get_identity(&mut body)?),
        Kind::HelloOk => Frame::HelloOk(get_identity(&mut body)?),
        Kind::State => Frame::State(get_state(body.clone(), check)?),
        Kind::Part => Frame::Part(get_state(body.clone(), check)?),
        Kind::Last => Frame::Last(get_state(body.clone(), check)?),
        Kind::Challenge => Frame::Challenge {
            nonce: get_32(&mut body)?,
        },
        Kind::Auth => Frame::Auth {
            nonce: get_32(&mut body)?,
            mac: get_32(&mut body)?,
        },
        Kind::Ack => {
            let handoff_id = get_str(&mut body, MAX_ID_LEN)?;
            let bytes = get_u64(&mut body)?;
            Frame::Ack { handoff_id, bytes }
        }
        Kind::Nack => {
            let code = NackCode::from_u16(get_u16(&mut body)?);
            let handoff_id = get_str(&mut body, MAX_ID_LEN)?;
            let reason = get_str(&mut body, MAX_TEXT_LEN)?;
            Frame::Nack(Nack {
                code,
                handoff_id,
                reason,
            })
        }
    };
    if !matches!(kind, Kind::State | Kind::Part | Kind::Last) && body.has_remaining() {
        return Err(malformed("trailing bytes after the frame's fields"));
    }
    Ok(frame)
}

fn need(body: &Bytes, n: usize, what: &str) -> Result<(), FrameError> {
    if body.remaining() < n {
        Err(FrameError::Malformed(format!("truncated {what}")))
    } else {
        Ok(())
    }
}

fn get_u8(b: &mut Bytes) -> Result<u8, FrameError> {
    need(b, 1, "u8")?;
    Ok(b.get_u8())
}
fn get_u16(b: &mut Bytes) -> Result<u16, FrameError> {
    need(b, 2, "u16")?;
    Ok(b.get_u16_le())
}
fn get_u32(b: &mut Bytes) -> Result<u32, FrameError> {
    need(b, 4, "u32")?;
    Ok(b.get_u32_le())
}
fn get_u64(b: &mut Bytes) -> Result<u64, FrameError> {
    need(b, 8, "u64")?;
    Ok(b.get_u64_le())
}

fn get_str(b: &mut Bytes, max: usize) -> Result<String, FrameError> {
    let len = get_u16(b)? as usize;
    if len > max {
        return Err(FrameError::Malformed(format!(
            "string of {len} bytes exceeds {max}"
        )));
    }
    need(b, len, "string")?;
    let raw = b.split_to(len);
    String::from_utf8(raw.to_vec()).map_err(|_| malformed("string is not UTF-8"))
}

fn put_str(out: &mut BytesMut, s: &str) {
    // Callers validate lengths (`encode` checks); truncation here would corrupt framing.
    out.put_u16_le(s.len() as u16);
    out.put_slice(s.as_bytes());
}

fn get_identity(b: &mut Bytes) -> Result<Identity, FrameError> {
    need(b, 32, "model fingerprint")?;
    let mut model_fingerprint = [0u8; 32];
    b.copy_to_slice(&mut model_fingerprint);
    let build_id = get_str(b, MAX_TEXT_LEN)?;
    let type_k = get_u32(b)?;
    let type_v = get_u32(b)?;
    let flash_attn = match get_u8(b)? {
        0 => false,
        1 => true,
        _ => return Err(malformed("flash_attn must be 0 or 1")),
    };
    let n_ctx = get_u32(b)?;
    Ok(Identity {
        model_fingerprint,
        build_id,
        type_k,
        type_v,
        flash_attn,
        n_ctx,
    })
}

fn put_identity(out: &mut BytesMut, id: &Identity) {
    out.put_slice(&id.model_fingerprint);
    put_str(out, &id.build_id);
    out.put_u32_le(id.type_k);
    out.put_u32_le(id.type_v);
    out.put_u8(u8::from(id.flash_attn));
    out.put_u32_le(id.n_ctx);
}

/// Handoff ids name files on the V1 path too: keep them to a safe alphabet.
#[must_use]
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.')
        && !id.starts_with('.')
}

/// A state body whose checksum has not been checked yet (a body too short to hold one).
fn get_state(body: Bytes, check: &Check) -> Result<StateFrame, FrameError> {
    // Verify first: nothing of the body is interpreted before its checksum passed.
    if body.len() < 32 {
        return Err(malformed("state frame shorter than its checksum"));
    }
    let (covered, sum) = body.split_at(body.len() - 32);
    let mut digest = StateDigest::new(check);
    digest.update(covered);
    if !digest.verify(sum) {
        return Err(FrameError::Checksum);
    }
    parse_state(body.slice(..body.len() - 32))
}

/// The fields of a state body whose checksum passed (`b` without its trailer).
fn parse_state(mut b: Bytes) -> Result<StateFrame, FrameError> {
    let handoff_id = get_str(&mut b, MAX_ID_LEN)?;
    if !valid_id(&handoff_id) {
        return Err(malformed(
            "handoff id must be 1-128 of [A-Za-z0-9._-], not starting with '.'",
        ));
    }
    let request_id = get_str(&mut b, MAX_ID_LEN)?;
    let n_tokens = get_u32(&mut b)? as usize;
    // The count is checked against the bytes present before the vector is allocated.
    need(&b, n_tokens.saturating_mul(4), "token ids")?;
    let tokens = (0..n_tokens).map(|_| b.get_i32_le()).collect();
    let n_desc = get_u32(&mut b)? as usize;
    if n_desc > MAX_DESCRIPTORS {
        return Err(FrameError::Malformed(format!(
            "{n_desc} tensor descriptors exceed {MAX_DESCRIPTORS}"
        )));
    }
    // Each descriptor takes at least 2+4+1+8+8 bytes.
    need(&b, n_desc.saturating_mul(23), "tensor descriptors")?;
    let mut descriptors = Vec::with_capacity(n_desc);
    for _ in 0..n_desc {
        let name = get_str(&mut b, MAX_ID_LEN)?;
        let dtype = get_u32(&mut b)?;
        let rank = get_u8(&mut b)? as usize;
        if rank > MAX_RANK {
            return Err(FrameError::Malformed(format!(
                "tensor rank {rank} exceeds {MAX_RANK}"
            )));
        }
        need(&b, rank * 8, "tensor dims")?;
        let dims = (0..rank).map(|_| b.get_u64_le()).collect();
        let offset = get_u64(&mut b)?;
        let nbytes = get_u64(&mut b)?;
        descriptors.push(TensorDescriptor {
            name,
            dtype,
            dims,
            offset,
            nbytes,
        });
    }
    let payload_len = get_u64(&mut b)?;
    if payload_len != b.remaining() as u64 {
        return Err(FrameError::Malformed(format!(
            "payload length {payload_len} does not match the {} bytes present",
            b.remaining()
        )));
    }
    for d in &descriptors {
        let end = d.offset.checked_add(d.nbytes);
        if end.is_none_or(|e| e > payload_len) {
            return Err(FrameError::Malformed(format!(
                "tensor {} lies outside the payload",
                d.name
            )));
        }
    }
    Ok(StateFrame {
        handoff_id,
        request_id,
        tokens,
        descriptors,
        payload: b,
    })
}

/// Why a frame could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("{0} is too long")]
    TooLong(&'static str),
    #[error("invalid handoff id {0:?}")]
    BadId(String),
    #[error("frame body of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("the frame carries no state (or a state went to the wrong encoder)")]
    NotState,
}

fn check_len(s: &str, max: usize, what: &'static str) -> Result<(), EncodeError> {
    if s.len() > max {
        Err(EncodeError::TooLong(what))
    } else {
        Ok(())
    }
}

/// Appends one encoded frame to `out`.
///
/// # Errors
/// A field over its limit, an invalid handoff id, or a body over `max_frame`.
pub fn encode(frame: &Frame, out: &mut BytesMut, max_frame: usize) -> Result<(), EncodeError> {
    encode_keyed(frame, out, max_frame, &Check::Sha256)
}

/// [`encode`] on an authenticated link (see [`decode_keyed`]).
///
/// # Errors
/// As [`encode`].
pub fn encode_keyed(
    frame: &Frame,
    out: &mut BytesMut,
    max_frame: usize,
    check: &Check,
) -> Result<(), EncodeError> {
    if let Frame::State(s) | Frame::Part(s) | Frame::Last(s) = frame {
        let start = out.len();
        out.reserve(s.payload.len() + s.tokens.len() * 4 + s.descriptors.len() * 64 + 160);
        encode_state_head(frame, out, max_frame)?;
        out.put_slice(&s.payload);
        let mut digest = StateDigest::new(check);
        digest.update(&out[start + HEADER_LEN..]);
        out.put_slice(&digest.finalize());
        return Ok(());
    }
    let start = out.len();
    put_header(out, kind_of(frame));
    let body_start = out.len();
    let res = encode_body(frame, out);
    if let Err(e) = res {
        out.truncate(start);
        return Err(e);
    }
    patch_len(out, start, out.len() - body_start, max_frame)
}

/// The head of a STATE, PART or LAST frame: the frame header (its length counting the
/// payload and the checksum) and the body up to the payload. A sender that streams the
/// payload writes this, then the payload, then the checksum over the body so far
/// ([`StateDigest`]): the same bytes as [`encode_keyed`], without copying the payload.
///
/// # Errors
/// As [`encode`]; [`EncodeError::NotState`] for a frame that carries no state.
pub fn encode_state_head(
    frame: &Frame,
    out: &mut BytesMut,
    max_frame: usize,
) -> Result<(), EncodeError> {
    let (Frame::State(s) | Frame::Part(s) | Frame::Last(s)) = frame else {
        return Err(EncodeError::NotState);
    };
    let start = out.len();
    put_header(out, kind_of(frame));
    let body_start = out.len();
    if let Err(e) = put_state_fields(s, out) {
        out.truncate(start);
        return Err(e);
    }
    let len = (out.len() - body_start)
        .saturating_add(s.payload.len())
        .saturating_add(32);
    patch_len(out, start, len, max_frame)
}

fn kind_of(frame: &Frame) -> Kind {
    match frame {
        Frame::Hello(_) => Kind::Hello,
        Frame::HelloOk(_) => Kind::HelloOk,
        Frame::State(_) => Kind::State,
        Frame::Part(_) => Kind::Part,
        Frame::Last(_) => Kind::Last,
        Frame::Ack { .. } => Kind::Ack,
        Frame::Nack(_) => Kind::Nack,
        Frame::Challenge { .. } => Kind::Challenge,
        Frame::Auth { .. } => Kind::Auth,
    }
}

/// Magic, version, type, reserved bytes, and a length patched by [`patch_len`].
fn put_header(out: &mut BytesMut, kind: Kind) {
    out.put_slice(&MAGIC);
    out.put_u8(VERSION);
    out.put_u8(kind as u8);
    out.put_u16_le(0);
    out.put_u32_le(0);
}

/// Writes the body length `len` into the header at `start`, or takes the frame back out
/// of `out` when it is over the cap.
fn patch_len(
    out: &mut BytesMut,
    start: usize,
    len: usize,
    max_frame: usize,
) -> Result<(), EncodeError> {
    if len > max_frame || len > u32::MAX as usize {
        out.truncate(start);
        return Err(EncodeError::TooLarge {
            len,
            max: max_frame,
        });
    }
    out[start + 8..start + 12].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// A state frame's fields before its payload: ids, tokens, descriptors, payload length.
fn put_state_fields(s: &StateFrame, out: &mut BytesMut) -> Result<(), EncodeError> {
    if !valid_id(&s.handoff_id) {
        return Err(EncodeError::BadId(s.handoff_id.clone()));
    }
    check_len(&s.request_id, MAX_ID_LEN, "request id")?;
    if s.descriptors.len() > MAX_DESCRIPTORS {
        return Err(EncodeError::TooLong("descriptor list"));
    }
    put_str(out, &s.handoff_id);
    put_str(out, &s.request_id);
    out.put_u32_le(s.tokens.len() as u32);
    for t in &s.tokens {
        out.put_i32_le(*t);
    }
    out.put_u32_le(s.descriptors.len() as u32);
    for d in &s.descriptors {
        check_len(&d.name, MAX_ID_LEN, "tensor name")?;
        if d.dims.len() > MAX_RANK {
            return Err(EncodeError::TooLong("tensor dims"));
        }
        put_str(out, &d.name);
        out.put_u32_le(d.dtype);
        out.put_u8(d.dims.len() as u8);
        for dim in &d.dims {
            out.put_u64_le(*dim);
        }
        out.put_u64_le(d.offset);
        out.put_u64_le(d.nbytes);
    }
    out.put_u64_le(s.payload.len() as u64);
    Ok(())
}

fn encode_body(frame: &Frame, out: &mut BytesMut) -> Result<(), EncodeError> {
    match frame {
        Frame::Challenge { nonce } => out.put_slice(nonce),
        Frame::Auth { nonce, mac } => {
            out.put_slice(nonce);
            out.put_slice(mac);
        }
        Frame::Hello(id) | Frame::HelloOk(id) => {
            check_len(&id.build_id, MAX_TEXT_LEN, "build id")?;
            put_identity(out, id);
        }
        // Written by `encode_state_head` and the payload's writer.
        Frame::State(_) | Frame::Part(_) | Frame::Last(_) => {
            return Err(EncodeError::NotState);
        }
        Frame::Ack { handoff_id, bytes } => {
            check_len(handoff_id, MAX_ID_LEN, "handoff id")?;
            put_str(out, handoff_id);
            out.put_u64_le(*bytes);
        }
        Frame::Nack(n) => {
            check_len(&n.handoff_id, MAX_ID_LEN, "handoff id")?;
            out.put_u16_le(n.code.to_u16());
            put_str(out, &n.handoff_id);
            // Reasons are for humans: cut long ones at a char boundary rather than fail.
            let mut reason = n.reason.as_str();
            if reason.len() > MAX_TEXT_LEN {
                let mut cut = MAX_TEXT_LEN;
                while !reason.is_char_boundary(cut) {
                    cut -= 1;
                }
                reason = &reason[..cut];
            }
            put_str(out, reason);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nack_table_round_trips_and_names_each_code_once() {
        let mut names = std::collections::HashSet::new();
        let mut values = std::collections::HashSet::new();
        for (code, value, name) in NACK_CODES {
            assert_eq!(code.to_u16(), value);
            assert_eq!(NackCode::from_u16(value), code);
            assert_eq!(code.as_str(), name);
            assert!(names.insert(name) && values.insert(value), "{name} twice");
        }
        assert_eq!(NackCode::from_u16(999), NackCode::Other(999));
        assert_eq!(NackCode::Other(999).to_u16(), 999);
        for v in 0..=u8::MAX {
            match Kind::try_from(v) {
                Ok(k) => assert_eq!(k as u8, v),
                Err(e) => assert!(matches!(e, FrameError::UnknownType(t) if t == v)),
            }
        }
    }
    use proptest::prelude::*;

    fn identity() -> Identity {
        Identity {
            model_fingerprint: [7; 32],
            build_id: "llama-cpp-sys-2 0.1.161".into(),
            type_k: 1,
            type_v: 1,
            flash_attn: false,
            n_ctx: 4096,
        }
    }

    fn state() -> StateFrame {
        StateFrame {
            handoff_id: "h-1".into(),
            request_id: "req".into(),
            tokens: vec![1, 2, 3],
            descriptors: vec![TensorDescriptor {
                name: "state".into(),
                dtype: DTYPE_OPAQUE,
                dims: vec![5],
                offset: 0,
                nbytes: 5,
            }],
            payload: Bytes::from_static(b"hello"),
        }
    }

    fn enc(f: &Frame) -> BytesMut {
        let mut b = BytesMut::new();
        encode(f, &mut b, DEFAULT_MAX_FRAME).unwrap();
        b
    }

    #[test]
    fn every_prefix_is_incomplete_not_an_error() {
        let bytes = enc(&Frame::State(state()));
        for cut in 0..bytes.len() {
            let mut b = BytesMut::from(&bytes[..cut]);
            assert_eq!(decode(&mut b, DEFAULT_MAX_FRAME), Ok(None), "cut at {cut}");
        }
        let mut b = bytes.clone();
        assert_eq!(
            decode(&mut b, DEFAULT_MAX_FRAME),
            Ok(Some(Frame::State(state())))
        );
        assert!(b.is_empty());
    }

    #[test]
    fn wrong_magic_is_refused_at_the_first_byte() {
        let mut b = BytesMut::from(&b"X"[..]);
        assert!(matches!(
            decode(&mut b, DEFAULT_MAX_FRAME),
            Err(FrameError::BadMagic(_))
        ));
        let mut b = BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]);
        assert_eq!(
            decode(&mut b, DEFAULT_MAX_FRAME).unwrap_err().nack_code(),
            NackCode::BadMagic
        );
    }

    #[test]
    fn unknown_version_and_type_and_reserved_are_refused() {
        let good = enc(&Frame::Hello(identity()));
        // Version 2 (before authentication), 3 (before the live handoff's PART and LAST),
        // 4 (before sliding-window pieces and sealed checksums), 5 (before tails), 6 (the
        // "v3" MAC labels) and a future version 8.
        for version in [2, 3, 4, 5, 6, 8] {
            let mut v = good.clone();
            v[4] = version;
            assert_eq!(
                decode(&mut v, DEFAULT_MAX_FRAME),
                Err(FrameError::UnsupportedVersion(version))
            );
        }
        let mut t = good.clone();
        t[5] = 99;
        assert_eq!(
            decode(&mut t, DEFAULT_MAX_FRAME),
            Err(FrameError::UnknownType(99))
        );
        let mut r = good.clone();
        r[6] = 1;
        assert_eq!(decode(&mut r, DEFAULT_MAX_FRAME), Err(FrameError::Reserved));
    }

    #[test]
    fn oversized_length_is_refused_before_allocation() {
        let mut b = BytesMut::new();
        b.put_slice(&MAGIC);
        b.put_u8(VERSION);
        b.put_u8(Kind::State as u8);
        b.put_u16_le(0);
        b.put_u32_le(u32::MAX);
        let cap_before = b.capacity();
        assert_eq!(
            decode(&mut b, 1024),
            Err(FrameError::TooLarge {
                len: u64::from(u32::MAX),
                max: 1024
            })
        );
        assert_eq!(b.capacity(), cap_before);
    }

    #[test]
    fn corrupted_payload_fails_the_checksum() {
        let mut bytes = enc(&Frame::State(state()));
        let n = bytes.len();
        bytes[n - 33] ^= 0x01; // last payload byte
        assert_eq!(
            decode(&mut bytes, DEFAULT_MAX_FRAME),
            Err(FrameError::Checksum)
        );
    }

    #[test]
    fn corrupted_metadata_fails_the_checksum() {
        let mut bytes = enc(&Frame::State(state()));
        bytes[HEADER_LEN + 2] ^= 0x20; // first byte of the handoff id
        assert_eq!(
            decode(&mut bytes, DEFAULT_MAX_FRAME),
            Err(FrameError::Checksum)
        );
    }

    #[test]
    fn lying_token_count_is_malformed_not_a_huge_allocation() {
        // Build a body by hand with a valid checksum but a token count far past the body.
        let mut body = BytesMut::new();
        put_str(&mut body, "h");
        put_str(&mut body, "r");
        body.put_u32_le(u32::MAX);
        let digest = Sha256::digest(&body);
        body.put_slice(&digest);
        let mut b = BytesMut::new();
        b.put_slice(&MAGIC);
        b.put_u8(VERSION);
        b.put_u8(Kind::State as u8);
        b.put_u16_le(0);
        b.put_u32_le(body.len() as u32);
        b.put_slice(&body);
        assert!(matches!(
            decode(&mut b, DEFAULT_MAX_FRAME),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn descriptor_outside_payload_is_malformed() {
        let mut s = state();
        s.descriptors[0].nbytes = 6;
        let mut bytes = enc(&Frame::State(s));
        assert!(matches!(
            decode(&mut bytes, DEFAULT_MAX_FRAME),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn trailing_bytes_are_malformed() {
        let mut bytes = enc(&Frame::Ack {
            handoff_id: "a".into(),
            bytes: 1,
        });
        bytes.put_u8(0);
        let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) + 1;
        bytes[8..12].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(
            decode(&mut bytes, DEFAULT_MAX_FRAME),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn ids_are_restricted() {
        assert!(valid_id("abc-DEF_1.2"));
        assert!(!valid_id(""));
        assert!(!valid_id("../etc"));
        assert!(!valid_id("a/b"));
        assert!(!valid_id(".hidden"));
        assert!(!valid_id(&"a".repeat(129)));
        let mut s = state();
        s.handoff_id = "../x".into();
        let mut b = BytesMut::new();
        assert!(matches!(
            encode(&Frame::State(s), &mut b, DEFAULT_MAX_FRAME),
            Err(EncodeError::BadId(_))
        ));
        assert!(b.is_empty());
    }

    #[test]
    fn keyed_state_checksums_need_the_same_session_key() {
        let f = Frame::State(StateFrame {
            handoff_id: "k".into(),
            request_id: "r".into(),
            tokens: vec![1, 2],
            descriptors: vec![],
            payload: Bytes::from_static(b"payload"),
        });
        let (k1, k2) = ([1u8; 32], [2u8; 32]);
        let mut buf = BytesMut::new();
        encode_keyed(&f, &mut buf, DEFAULT_MAX_FRAME, &Check::Hmac(k1)).unwrap();
        let wire = buf.clone();
        assert_eq!(
            decode_keyed(&mut buf, DEFAULT_MAX_FRAME, &Check::Hmac(k1)).unwrap(),
            Some(f.clone())
        );
        // Another session's key, or a plain SHA-256 check, refuses it: a forger who
        // recomputes the SHA-256 over changed bytes cannot make the MAC.
        let mut other = wire.clone();
        assert_eq!(
            decode_keyed(&mut other, DEFAULT_MAX_FRAME, &Check::Hmac(k2)),
            Err(FrameError::Checksum)
        );
        let mut plain = wire.clone();
        assert_eq!(
            decode(&mut plain, DEFAULT_MAX_FRAME),
            Err(FrameError::Checksum)
        );
        let mut buf = BytesMut::new();
        encode(&f, &mut buf, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(
            decode_keyed(&mut buf, DEFAULT_MAX_FRAME, &Check::Hmac(k1)),
            Err(FrameError::Checksum)
        );
    }

    /// Inside TLS a state frame carries 32 zero bytes where its digest would be, checked:
    /// a frame from a sender that hashes is refused, and a sealed frame is refused by a
    /// receiver that expects a digest. (The bytes themselves are TLS's to check:
    /// `router/tests/it/private.rs` flips one on the wire.)
    #[test]
    fn sealed_links_carry_a_zero_trailer_and_refuse_a_digest() {
        let f = Frame::State(StateFrame {
            handoff_id: "s".into(),
            request_id: "r".into(),
            tokens: vec![1, 2],
            descriptors: vec![],
            payload: Bytes::from_static(b"payload"),
        });
        let mut sealed = BytesMut::new();
        encode_keyed(&f, &mut sealed, DEFAULT_MAX_FRAME, &Check::Sealed).unwrap();
        assert_eq!(sealed[sealed.len() - 32..], [0u8; 32]);
        let wire = sealed.clone();
        assert_eq!(
            decode_keyed(&mut sealed, DEFAULT_MAX_FRAME, &Check::Sealed).unwrap(),
            Some(f.clone())
        );
        for check in [Check::Sha256, Check::Hmac([1; 32])] {
            let mut w = wire.clone();
            assert_eq!(
                decode_keyed(&mut w, DEFAULT_MAX_FRAME, &check),
                Err(FrameError::Checksum)
            );
            let mut hashed = BytesMut::new();
            encode_keyed(&f, &mut hashed, DEFAULT_MAX_FRAME, &check).unwrap();
            assert_eq!(
                decode_keyed(&mut hashed, DEFAULT_MAX_FRAME, &Check::Sealed),
                Err(FrameError::Checksum)
            );
        }
    }

    #[test]
    fn challenge_and_auth_round_trip() {
        for f in [
            Frame::Challenge { nonce: [9; 32] },
            Frame::Auth {
                nonce: [3; 32],
                mac: [4; 32],
            },
        ] {
            let mut buf = BytesMut::new();
            encode(&f, &mut buf, DEFAULT_MAX_FRAME).unwrap();
            assert_eq!(
                buf.len(),
                HEADER_LEN
                    + if matches!(f, Frame::Challenge { .. }) {
                        32
                    } else {
                        64
                    }
            );
            assert_eq!(decode(&mut buf, DEFAULT_MAX_FRAME).unwrap(), Some(f));
        }
        // A short AUTH body is malformed, not a panic.
        let mut buf = BytesMut::new();
        encode(
            &Frame::Challenge { nonce: [0; 32] },
            &mut buf,
            DEFAULT_MAX_FRAME,
        )
        .unwrap();
        buf[5] = Kind::Auth as u8;
        assert!(matches!(
            decode(&mut buf, DEFAULT_MAX_FRAME),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn identity_mismatch_names_the_field() {
        let a = identity();
        assert_eq!(a.mismatch(&a), None);
        let mut b = a.clone();
        b.model_fingerprint = [8; 32];
        assert_eq!(a.mismatch(&b).unwrap().code, NackCode::ModelMismatch);
        let mut b = a.clone();
        b.flash_attn = true;
        assert_eq!(a.mismatch(&b).unwrap().code, NackCode::FlashAttnMismatch);
        let mut b = a.clone();
        b.n_ctx = 1;
        assert!(a.mismatch(&b).unwrap().reason.contains("4096"));
    }

    fn arb_id() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_-][A-Za-z0-9._-]{0,40}"
    }

    fn arb_identity() -> impl Strategy<Value = Identity> {
        (
            any::<[u8; 32]>(),
            ".{0,60}",
            any::<u32>(),
            any::<u32>(),
            any::<bool>(),
            any::<u32>(),
        )
            .prop_map(|(f, b, k, v, fa, n)| Identity {
                model_fingerprint: f,
                build_id: b,
                type_k: k,
                type_v: v,
                flash_attn: fa,
                n_ctx: n,
            })
    }

    fn arb_state() -> impl Strategy<Value = StateFrame> {
        let desc = (
            arb_id(),
            any::<u32>(),
            proptest::collection::vec(any::<u64>(), 0..=4),
        );
        (
            arb_id(),
            "[a-z0-9-]{0,40}",
            proptest::collection::vec(any::<i32>(), 0..50),
            proptest::collection::vec(desc, 0..5),
            proptest::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(|(h, r, tokens, descs, payload)| {
                let len = payload.len() as u64;
                StateFrame {
                    handoff_id: h,
                    request_id: r,
                    tokens,
                    descriptors: descs
                        .into_iter()
                        .map(|(name, dtype, dims)| TensorDescriptor {
                            name,
                            dtype,
                            dims,
                            offset: len / 2,
                            nbytes: len - len / 2,
                        })
                        .collect(),
                    payload: Bytes::from(payload),
                }
            })
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        prop_oneof![
            arb_identity().prop_map(Frame::Hello),
            arb_identity().prop_map(Frame::HelloOk),
            arb_state().prop_map(Frame::State),
            arb_state().prop_map(Frame::Part),
            arb_state().prop_map(Frame::Last),
            (arb_id(), any::<u64>()).prop_map(|(h, n)| Frame::Ack {
                handoff_id: h,
                bytes: n
            }),
            (any::<u16>(), "[a-z]{0,10}", ".{0,100}").prop_map(|(c, h, r)| Frame::Nack(Nack {
                code: NackCode::from_u16(c),
                handoff_id: h,
                reason: r
            })),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(frames in proptest::collection::vec(arb_frame(), 1..4)) {
            let mut buf = BytesMut::new();
            for f in &frames {
                encode(f, &mut buf, DEFAULT_MAX_FRAME).unwrap();
            }
            for f in &frames {
                prop_assert_eq!(decode(&mut buf, DEFAULT_MAX_FRAME).unwrap(), Some(f.clone()));
            }
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut b = BytesMut::from(&bytes[..]);
            let _ = decode(&mut b, 4096);
        }

        #[test]
        fn flipping_any_state_byte_is_detected(
            st in arb_state(),
            pos in any::<prop::sample::Index>(),
            kind in 0..3usize,
        ) {
            // Every generated case is a frame with a state body (STATE, PART or LAST), and
            // the flip is refused for the one right reason: the checksum covers every body
            // byte.
            let kinds: [fn(StateFrame) -> Frame; 3] = [Frame::State, Frame::Part, Frame::Last];
            let f = kinds[kind](st);
            {
                let bytes = {
                    let mut b = BytesMut::new();
                    encode(&f, &mut b, DEFAULT_MAX_FRAME).unwrap();
                    b
                };
                let i = HEADER_LEN + pos.index(bytes.len() - HEADER_LEN);
                let mut bad = bytes.clone();
                bad[i] ^= 0x5a;
                let got = decode(&mut bad, DEFAULT_MAX_FRAME);
                prop_assert!(matches!(got, Err(FrameError::Checksum)), "{:?}", got);
            }
        }

        #[test]
        fn a_streamed_state_is_the_encoded_one_and_decodes_in_any_pieces(
            st in arb_state(),
            kind in 0..3usize,
            keyed in any::<bool>(),
            pooled in any::<bool>(),
            cuts in proptest::collection::vec(1..64usize, 1..40),
            flip in any::<Option<prop::sample::Index>>(),
        ) {
            let kinds: [fn(StateFrame) -> Frame; 3] = [Frame::State, Frame::Part, Frame::Last];
            let f = kinds[kind](st.clone());
            let check = if keyed { Check::Hmac([9u8; 32]) } else { Check::Sha256 };
            let mut whole = BytesMut::new();
            encode_keyed(&f, &mut whole, DEFAULT_MAX_FRAME, &check).unwrap();
            // What a streaming sender writes: the head, the payload, the running digest.
            let mut streamed = BytesMut::new();
            encode_state_head(&f, &mut streamed, DEFAULT_MAX_FRAME).unwrap();
            let mut digest = StateDigest::new(&check);
            digest.update(&streamed[HEADER_LEN..]);
            digest.update(&st.payload);
            streamed.extend_from_slice(&st.payload);
            streamed.extend_from_slice(&digest.finalize());
            prop_assert_eq!(&streamed, &whole);
            // Fed to one decoder a few bytes at a time (hashing as they come; the body in
            // the read buffer, or moved into a buffer of its own), followed by another
            // frame, it decodes to the frame and then the other; one flipped byte anywhere
            // in the body fails the check, even a byte hashed calls ago.
            let state_len = whole.len();
            let ack = Frame::Ack { handoff_id: "next".into(), bytes: 1 };
            encode(&ack, &mut whole, DEFAULT_MAX_FRAME).unwrap();
            let mut wire = whole.to_vec();
            if let Some(i) = flip {
                let i = HEADER_LEN + i.index(state_len - HEADER_LEN);
                wire[i] ^= 0x21;
            }
            let mut dec = if pooled { Decoder::with_pooled_min(0) } else { Decoder::default() };
            let mut buf = BytesMut::new();
            let (mut at, mut got) = (0, Vec::new());
            for cut in cuts.iter().cycle() {
                let end = (at + cut).min(wire.len());
                buf.extend_from_slice(&wire[at..end]);
                at = end;
                loop {
                    match dec.decode(&mut buf, DEFAULT_MAX_FRAME, &check) {
                        Ok(Some(frame)) => got.push(Ok(frame)),
                        Ok(None) => break,
                        Err(e) => {
                            got.push(Err(e));
                            break;
                        }
                    }
                }
                if at == wire.len() || got.iter().any(Result::is_err) {
                    break;
                }
            }
            match flip {
                None => {
                    prop_assert_eq!(got, vec![Ok(f), Ok(ack)]);
                    prop_assert!(buf.is_empty());
                    prop_assert!(dec.take_receipt().is_some());
                }
                Some(_) => prop_assert_eq!(got, vec![Err(FrameError::Checksum)]),
            }
        }
    }
}
