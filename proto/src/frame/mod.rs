//! V2 handoff frames: pure encode/decode, no I/O (see `PROTOCOL.md` beside this crate).
//!
//! `decode` is incremental: `Ok(None)` means "not enough bytes yet", never an error. Every
//! length is checked against the bytes actually present (and the frame cap) before anything
//! is allocated, and a `State` frame's SHA-256 is verified before any of its fields is parsed.
//!
//! Rooms: the frame types and the constants here; `decode` and `encode` (the codec);
//! `check` (the checksum and seal rules of a STATE frame's trailer).

mod check;
mod decode;
mod encode;

pub use check::{Check, StateDigest};
pub use decode::*;
pub use encode::*;

use bytes::Bytes;

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
    #[error("no room for a state frame of {len} bytes: {reason}")]
    NoRoom { len: u64, reason: String },
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
            FrameError::NoRoom { .. } => NackCode::Capacity,
        }
    }
}

fn malformed(what: &str) -> FrameError {
    FrameError::Malformed(what.to_string())
}

#[cfg(test)]
mod tests {
    use super::encode::put_str;
    use super::*;
    use bytes::{BufMut, BytesMut};
    use sha2::{Digest, Sha256};

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

    /// Room that admits bodies up to `free` bytes, counting what it gave.
    struct Free(std::sync::atomic::AtomicUsize);

    impl Room for Free {
        fn take(&self, len: usize) -> Result<(), String> {
            use std::sync::atomic::Ordering;
            self.0
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |f| f.checked_sub(len))
                .map(|_| ())
                .map_err(|f| format!("{f} bytes free"))
        }
        fn give(&self, len: usize) {
            self.0.fetch_add(len, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// The header alone decides: a state frame whose body exceeds the free room is refused
    /// before any body byte has arrived; one that fits holds its room while it arrives and
    /// gives it back once decoded.
    #[test]
    fn a_state_frame_takes_room_from_its_header_and_gives_it_back() {
        let payload = Bytes::from(vec![1u8; 4096]);
        let f = Frame::State(StateFrame {
            handoff_id: "h".into(),
            request_id: "r".into(),
            tokens: vec![],
            descriptors: crate::layout::describe(&payload).descriptors,
            payload,
        });
        let mut wire = BytesMut::new();
        encode(&f, &mut wire, DEFAULT_MAX_FRAME).unwrap();
        let body = wire.len() - HEADER_LEN;
        let room = std::sync::Arc::new(Free((body - 1).into()));
        let mut dec = Decoder::with_room(room.clone());
        let mut head = BytesMut::from(&wire[..HEADER_LEN]);
        match dec.decode(&mut head, DEFAULT_MAX_FRAME, &Check::Sha256) {
            Err(FrameError::NoRoom { len, reason }) => {
                assert_eq!(len, body as u64);
                assert_eq!(reason, format!("{} bytes free", body - 1));
                assert_eq!(
                    FrameError::NoRoom { len, reason }.nack_code(),
                    NackCode::Capacity
                );
            }
            other => panic!("expected NoRoom, got {other:?}"),
        }
        room.give(1);
        let mut dec = Decoder::with_room(room.clone());
        let mut buf = BytesMut::from(&wire[..HEADER_LEN + 10]);
        assert_eq!(
            dec.decode(&mut buf, DEFAULT_MAX_FRAME, &Check::Sha256),
            Ok(None)
        );
        assert_eq!(room.0.load(std::sync::atomic::Ordering::SeqCst), 0);
        buf.extend_from_slice(&wire[HEADER_LEN + 10..]);
        assert_eq!(
            dec.decode(&mut buf, DEFAULT_MAX_FRAME, &Check::Sha256),
            Ok(Some(f))
        );
        assert_eq!(room.0.load(std::sync::atomic::Ordering::SeqCst), body);
    }
}
