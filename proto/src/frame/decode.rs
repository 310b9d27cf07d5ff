//! Decoding: a frame's header checked before its body is read, the incremental
//! [`Decoder`] that hashes a large STATE body as it arrives, and the parse of each body.

use bytes::{Buf, Bytes, BytesMut};

use super::*;

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

/// Room for state frame bodies, asked for when a state frame's header arrives, before any
/// of its body is held (the decode node's store, whose cap counts what it holds and what
/// is arriving).
pub trait Room: Send + Sync {
    /// Takes room for a body of `len` bytes, or says why there is none.
    ///
    /// # Errors
    /// Why the room is not there (the receiver's NACK reason).
    fn take(&self, len: usize) -> Result<(), String>;
    /// Gives back room taken by [`Room::take`].
    fn give(&self, len: usize);
}

/// Room taken for one frame's body, given back when it is dropped (the frame decoded, or
/// its decoding failed).
struct Taken {
    room: std::sync::Arc<dyn Room>,
    len: usize,
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.room.give(self.len);
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
    /// The room it was given, while it is received.
    _room: Option<Taken>,
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
    room: Option<std::sync::Arc<dyn Room>>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            pending: None,
            receipt: None,
            pooled_min: POOLED_MIN,
            room: None,
        }
    }
}

impl Decoder {
    /// A decoder that asks `room` for each state frame's body when its header arrives and
    /// refuses the frame ([`FrameError::NoRoom`]) before holding any of its body when
    /// there is none.
    #[must_use]
    pub fn with_room(room: std::sync::Arc<dyn Room>) -> Self {
        Decoder {
            room: Some(room),
            ..Decoder::default()
        }
    }

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
    pub(super) fn with_pooled_min(n: usize) -> Self {
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
            if self.pending.is_none() {
                // Room first: nothing of the body is held without it.
                let room = match &self.room {
                    Some(r) => {
                        r.take(len).map_err(|reason| FrameError::NoRoom {
                            len: len as u64,
                            reason,
                        })?;
                        Some(Taken {
                            room: r.clone(),
                            len,
                        })
                    }
                    None => None,
                };
                self.pending = Some(Pending {
                    kind,
                    len,
                    digest: StateDigest::new(check),
                    hashed: 0,
                    started: std::time::Instant::now(),
                    hashing: std::time::Duration::ZERO,
                    // The declared length passed the cap above.
                    body: (len >= self.pooled_min).then(|| crate::buffers::take(len)),
                    _room: room,
                });
            }
            let Some(p) = self.pending.as_mut() else {
                return Ok(None);
            };
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
