//! Encoding: a frame into bytes (with its STATE trailer, keyed or not), and the head of a
//! STATE frame whose payload is written from the exported buffer without a copy.

use bytes::{BufMut, BytesMut};

use super::*;

pub(super) fn put_str(out: &mut BytesMut, s: &str) {
    // Callers validate lengths (`encode` checks); truncation here would corrupt framing.
    out.put_u16_le(s.len() as u16);
    out.put_slice(s.as_bytes());
}

fn put_identity(out: &mut BytesMut, id: &Identity) {
    out.put_slice(&id.model_fingerprint);
    put_str(out, &id.build_id);
    out.put_u32_le(id.type_k);
    out.put_u32_le(id.type_v);
    out.put_u8(u8::from(id.flash_attn));
    out.put_u32_le(id.n_ctx);
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
