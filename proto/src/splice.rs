//! Cutting and joining llama.cpp sequence states by position, for the live handoff
//! (PROTOCOL.md, "Live handoff"): the prefill node sends the state of the prompt, then only
//! the cells of the tokens it wrote since ([`tail`]); the decode node joins them
//! ([`append`]) into the state the prefill node holds at that moment.
//!
//! Only *contiguous* states are cut: every stream of every memory section holds consecutive
//! positions in order, one sequence per cell, and all end at the same position. A context
//! with one sequence and no sliding window exports `0..n` in every section (SmolLM2 here).
//! A sliding-window section (Gemma-3) exports only its window, `n - w..n`: right after the
//! engine lays the cache out (`Worker::lay_out_as_imported`) its cells lie in that order
//! from index 0, and the answer's steps add theirs after them, so the prompt's state
//! joined with the cells of the tokens written since is, cell for cell, what the prefill
//! node's cache holds, until the window's ring wraps (the engine stops cutting before).
//! A window in ring order (not laid out) is refused with [`SpliceError::NotLinear`].
//!
//! The cut and the join copy bytes and never interpret them: `append(state(0..n),
//! tail(state(0..m), n))` is `state(0..m)` byte for byte (tested here on synthetic states
//! and in the engine's tests on real ones). Every length is checked against the buffer
//! before it is used (the walk of [`crate::layout`]).

use crate::layout::STATE_MAGIC;

/// Why a state could not be cut or joined.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpliceError {
    #[error("not a sequence state this build can read: {0}")]
    Malformed(&'static str),
    #[error("the state is not linear (a sliding-window cache, or cells out of order): {0}")]
    NotLinear(String),
    #[error("the pieces do not fit together: {0}")]
    Mismatch(String),
}

/// One layer's K or V rows inside a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// `i32 type, u64 row_bytes`, then one row per cell.
    Plain { ty: u32, row: u64, at: usize },
    /// Transposed V: `i32 type, u32 elem_bytes, u32 n_embd`, then per element one value
    /// per cell.
    Transposed {
        ty: u32,
        elem: u32,
        n_embd: u32,
        at: usize,
    },
}

/// One stream of one memory section.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stream {
    /// The position of its first cell (0 when empty).
    first: usize,
    cells: usize,
    /// The cells' metadata (`i32 pos, u32 n_seq_id = 1, i32 seq_id`), 12 bytes each.
    meta_at: usize,
    v_trans: u32,
    n_layer: u32,
    /// `n_rot_k, n_rot_v`, copied as they are.
    rot: [u8; 8],
    k: Vec<Rows>,
    v: Vec<Rows>,
}

/// A parsed contiguous state: where everything lies in its buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Parsed {
    seq_id: u32,
    /// Sections, each a list of streams (a stream with no cells has no fields).
    sections: Vec<Vec<Stream>>,
    /// The first position of the stream that starts earliest (a full cache's).
    first: usize,
    /// The position after the last cell of every non-empty stream (all the same).
    end: usize,
}

impl Parsed {
    fn streams(&self) -> impl Iterator<Item = &Stream> {
        self.sections.iter().flatten().filter(|s| s.cells > 0)
    }
}

const META: usize = 12;
const MAX_STREAMS: u32 = 64;
const MAX_LAYERS: u32 = 4096;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: u64) -> Result<usize, SpliceError> {
        let n = usize::try_from(n).map_err(|_| SpliceError::Malformed("length overflow"))?;
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or(SpliceError::Malformed("truncated"))?;
        let at = self.pos;
        self.pos = end;
        Ok(at)
    }
    fn u32(&mut self) -> Result<u32, SpliceError> {
        let at = self.take(4)?;
        Ok(u32::from_le_bytes(
            self.buf[at..at + 4].try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, SpliceError> {
        let at = self.take(8)?;
        Ok(u64::from_le_bytes(
            self.buf[at..at + 8].try_into().unwrap_or_default(),
        ))
    }
}

fn i32_at(buf: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(buf[at..at + 4].try_into().unwrap_or_default())
}

/// Walks `buf` and checks that it is linear: in every non-empty stream, `cells`
/// consecutive positions from `first`, one sequence per cell.
fn parse(buf: &[u8]) -> Result<Parsed, SpliceError> {
    let mut r = Reader { buf, pos: 0 };
    if r.u32()? != STATE_MAGIC {
        return Err(SpliceError::Malformed("no state magic"));
    }
    let seq_id = r.u32()?;
    let mut sections = Vec::new();
    let mut end: Option<usize> = None;
    while r.pos < buf.len() {
        let n_stream = r.u32()?;
        if n_stream == 0 || n_stream > MAX_STREAMS {
            return Err(SpliceError::Malformed("stream count"));
        }
        let mut streams = Vec::new();
        for _ in 0..n_stream {
            let cells = r.u32()? as usize;
            if cells == 0 {
                streams.push(Stream {
                    first: 0,
                    cells: 0,
                    meta_at: r.pos,
                    v_trans: 0,
                    n_layer: 0,
                    rot: [0; 8],
                    k: Vec::new(),
                    v: Vec::new(),
                });
                continue;
            }
            let meta_at = r.pos;
            let mut first = 0usize;
            for c in 0..cells {
                let at = r.take(8)?;
                let pos = i32_at(buf, at);
                let n_seq = i32_at(buf, at + 4);
                if n_seq != 1 {
                    return Err(SpliceError::NotLinear(format!(
                        "cell {c} belongs to {n_seq} sequences"
                    )));
                }
                r.take(4)?;
                let pos = usize::try_from(pos)
                    .map_err(|_| SpliceError::NotLinear(format!("negative position {pos}")))?;
                if c == 0 {
                    first = pos;
                } else if pos != first + c {
                    return Err(SpliceError::NotLinear(format!(
                        "cell {c} holds position {pos}, not {}",
                        first + c
                    )));
                }
            }
            let stream_end = first + cells;
            if end.is_some_and(|e| e != stream_end) {
                return Err(SpliceError::NotLinear(format!(
                    "a stream ends at position {stream_end}, another at {}",
                    end.unwrap_or(0)
                )));
            }
            end = Some(stream_end);
            let v_trans = r.u32()?;
            let n_layer = r.u32()?;
            let rot_at = r.take(8)?;
            if v_trans > 1 || n_layer > MAX_LAYERS {
                return Err(SpliceError::Malformed("layer header"));
            }
            let n = cells as u64;
            let mut k = Vec::with_capacity(n_layer as usize);
            for _ in 0..n_layer {
                let ty = r.u32()?;
                let row = r.u64()?;
                let at = r.take(n.checked_mul(row).ok_or(SpliceError::Malformed("size"))?)?;
                k.push(Rows::Plain { ty, row, at });
            }
            let mut v = Vec::with_capacity(n_layer as usize);
            for _ in 0..n_layer {
                let ty = r.u32()?;
                if v_trans == 0 {
                    let row = r.u64()?;
                    let at = r.take(n.checked_mul(row).ok_or(SpliceError::Malformed("size"))?)?;
                    v.push(Rows::Plain { ty, row, at });
                } else {
                    let elem = r.u32()?;
                    let n_embd = r.u32()?;
                    let size = n
                        .checked_mul(u64::from(elem))
                        .and_then(|s| s.checked_mul(u64::from(n_embd)))
                        .ok_or(SpliceError::Malformed("size"))?;
                    let at = r.take(size)?;
                    v.push(Rows::Transposed {
                        ty,
                        elem,
                        n_embd,
                        at,
                    });
                }
            }
            let mut rot = [0u8; 8];
            rot.copy_from_slice(&buf[rot_at..rot_at + 8]);
            streams.push(Stream {
                first,
                cells,
                meta_at,
                v_trans,
                n_layer,
                rot,
                k,
                v,
            });
        }
        sections.push(streams);
    }
    if sections.is_empty() {
        return Err(SpliceError::Malformed("no memory section"));
    }
    let end = end.unwrap_or(0);
    let first = sections
        .iter()
        .flatten()
        .filter(|s| s.cells > 0)
        .map(|s| s.first)
        .min()
        .unwrap_or(end);
    Ok(Parsed {
        seq_id,
        sections,
        first,
        end,
    })
}

/// The positions a contiguous state covers: from the first position of the stream that
/// starts earliest (a full cache's) to the end all its streams share.
///
/// # Errors
/// A state that is malformed or not contiguous.
pub fn span(state: &[u8]) -> Result<std::ops::Range<usize>, SpliceError> {
    let p = parse(state)?;
    Ok(p.first..p.end)
}

/// The fewest cells a non-empty stream of `state` holds: a sliding window's, where there
/// is one.
///
/// # Errors
/// A state that is malformed or not contiguous.
pub fn narrowest(state: &[u8]) -> Result<usize, SpliceError> {
    Ok(parse(state)?.streams().map(|s| s.cells).min().unwrap_or(0))
}

/// Whether every non-empty stream of `state` starts at its first position (a whole state
/// without a sliding window, or a tail), and that position.
///
/// # Errors
/// A state that is malformed or not contiguous.
pub fn common_start(state: &[u8]) -> Result<Option<usize>, SpliceError> {
    let p = parse(state)?;
    let common = p.streams().all(|s| s.first == p.first);
    Ok(common.then_some(p.first))
}

/// Whether `state` can be cut and joined (see the module docs).
#[must_use]
pub fn is_linear(state: &[u8]) -> bool {
    parse(state).is_ok()
}

/// The cells of `s` at positions `from..to`, as indices within the stream.
fn cells_of(s: &Stream, from: usize, to: usize) -> (usize, usize) {
    let at = |p: usize| p.saturating_sub(s.first).min(s.cells);
    (at(from), at(to))
}

/// Where [`write`] puts a state's bytes: a buffer, or a hash that never holds them.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for sha2::Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        sha2::Digest::update(self, bytes);
    }
}

/// The positions `[from, to)` of each of `parts`' streams, written as one state into `out`
/// (cleared first): in each stream, each part's cells follow the previous part's.
fn write(buf_of: &[&[u8]], parts: &[(&Parsed, usize, usize)], mut out: Vec<u8>) -> Vec<u8> {
    let total: usize = buf_of.iter().map(|b| b.len()).sum();
    out.clear();
    out.reserve(total);
    write_into(buf_of, parts, &mut out);
    out
}

/// [`write`] into any [`Sink`].
fn write_into(buf_of: &[&[u8]], parts: &[(&Parsed, usize, usize)], out: &mut impl Sink) {
    let p0 = parts[0].0;
    out.put(&STATE_MAGIC.to_le_bytes());
    out.put(&p0.seq_id.to_le_bytes());
    for (si, streams) in p0.sections.iter().enumerate() {
        out.put(&(streams.len() as u32).to_le_bytes());
        for ti in 0..streams.len() {
            // Each part's stream with the cell range it gives.
            let present: Vec<(&[u8], &Stream, usize, usize)> = parts
                .iter()
                .zip(buf_of)
                .map(|((p, from, to), buf)| {
                    let s = &p.sections[si][ti];
                    let (a, b) = cells_of(s, *from, *to);
                    (*buf, s, a, b)
                })
                .filter(|(_, s, a, b)| s.cells > 0 && b > a)
                .collect();
            let cells: usize = present.iter().map(|(_, _, a, b)| b - a).sum();
            out.put(&(cells as u32).to_le_bytes());
            let Some(&(_, s, _, _)) = present.first() else {
                continue;
            };
            for (buf, st, a, b) in &present {
                out.put(&buf[st.meta_at + a * META..st.meta_at + b * META]);
            }
            out.put(&s.v_trans.to_le_bytes());
            out.put(&s.n_layer.to_le_bytes());
            out.put(&s.rot);
            for l in 0..s.n_layer as usize {
                write_rows(out, &present, |st| st.k[l]);
            }
            for l in 0..s.n_layer as usize {
                write_rows(out, &present, |st| st.v[l]);
            }
        }
    }
}

fn write_rows(
    out: &mut impl Sink,
    present: &[(&[u8], &Stream, usize, usize)],
    rows_of: impl Fn(&Stream) -> Rows,
) {
    let Some((_, s, _, _)) = present.first() else {
        return;
    };
    match rows_of(s) {
        Rows::Plain { ty, row, .. } => {
            out.put(&ty.to_le_bytes());
            out.put(&row.to_le_bytes());
            for (buf, st, a, b) in present {
                let Rows::Plain { row, at, .. } = rows_of(st) else {
                    continue;
                };
                let row = row as usize;
                out.put(&buf[at + a * row..at + b * row]);
            }
        }
        Rows::Transposed {
            ty, elem, n_embd, ..
        } => {
            out.put(&ty.to_le_bytes());
            out.put(&elem.to_le_bytes());
            out.put(&n_embd.to_le_bytes());
            for e in 0..n_embd as usize {
                for (buf, st, a, b) in present {
                    let Rows::Transposed { elem, at, .. } = rows_of(st) else {
                        continue;
                    };
                    let el = elem as usize;
                    let base = at + e * st.cells * el;
                    out.put(&buf[base + a * el..base + b * el]);
                }
            }
        }
    }
}

/// The cells of `state` at positions `from..`: the state's tail, itself a contiguous
/// state whose every stream starts at `from`.
///
/// # Errors
/// A state that is malformed or not contiguous, that does not start at position 0, that
/// does not reach past `from`, or a stream (a sliding window) that no longer holds `from`.
pub fn tail(state: &[u8], from: usize) -> Result<Vec<u8>, SpliceError> {
    let p = parse(state)?;
    if p.first != 0 {
        return Err(SpliceError::Mismatch(format!(
            "the state starts at position {}, not 0",
            p.first
        )));
    }
    if from >= p.end {
        return Err(SpliceError::Mismatch(format!(
            "the state covers {} positions; nothing follows position {from}",
            p.end
        )));
    }
    if let Some(s) = p.streams().find(|s| s.first > from) {
        return Err(SpliceError::Mismatch(format!(
            "a sliding window starts at position {}, past {from}: the positions between \
             are no longer held",
            s.first
        )));
    }
    Ok(write(&[state], &[(&p, from, p.end)], Vec::new()))
}

/// The cells of `state` at positions `0..to`: the state a sequence holds after its first
/// `to` tokens. With [`tail`], `append(head(s, n), tail(s, n))` is `s`. A tail handoff
/// (PROTOCOL.md, "Tails") names the prefix it goes on from by the SHA-256 of this.
///
/// # Errors
/// A state that is malformed or not contiguous, that does not start at position 0 in
/// every stream (a sliding window), or that does not hold `to` positions (`to` 0 is
/// refused too: a state holds at least one cell).
pub fn head(state: &[u8], to: usize) -> Result<Vec<u8>, SpliceError> {
    let p = parse_head(state, to)?;
    Ok(write(&[state], &[(&p, 0, to)], Vec::new()))
}

/// `state` parsed, checked to have a head of `to` positions.
fn parse_head(state: &[u8], to: usize) -> Result<Parsed, SpliceError> {
    let p = parse(state)?;
    if p.streams().any(|s| s.first != 0) {
        return Err(SpliceError::NotLinear(
            "a stream does not start at position 0 (a sliding window)".into(),
        ));
    }
    if to == 0 || to > p.end {
        return Err(SpliceError::Mismatch(format!(
            "the state covers {} positions; it has no head of {to}",
            p.end
        )));
    }
    Ok(p)
}

/// SHA-256 of [`head`]`(state, to)`, hashed where the bytes lie (no copy of the head).
///
/// # Errors
/// As [`head`].
pub fn head_digest(state: &[u8], to: usize) -> Result<[u8; 32], SpliceError> {
    use sha2::Digest;
    let p = parse_head(state, to)?;
    let mut h = sha2::Sha256::new();
    write_into(&[state], &[(&p, 0, to)], &mut h);
    Ok(h.finalize().into())
}

/// The positions `0..n` of `state` followed by `tail` (positions `n..m`), written into
/// `out` (cleared first): `append(head(state, n), tail)` without the head's copy.
///
/// # Errors
/// As [`head`] and [`append`].
pub fn graft(state: &[u8], tail: &[u8], out: Vec<u8>) -> Result<Vec<u8>, SpliceError> {
    let t = parse(tail)?;
    let mut h = parse_head(state, t.first)?;
    h.end = t.first;
    fits(&h, &t)?;
    Ok(write(
        &[state, tail],
        &[(&h, 0, t.first), (&t, t.first, t.end)],
        out,
    ))
}

/// Joins `head` (positions `0..n`) and `tail` (positions `n..m`) into the state of
/// positions `0..m`.
///
/// # Errors
/// Either piece malformed or not linear, a tail that does not start where the head ends,
/// or pieces of different shapes (sections, streams, layers, types, row sizes).
pub fn append(head: &[u8], tail: &[u8]) -> Result<Vec<u8>, SpliceError> {
    join(&[head, tail], Vec::new())
}

/// Checks that `next` continues `prev`: its positions start where `prev`'s end, and both
/// have the same shape. Returns the positions `next` covers. The receiver of a live
/// handoff checks each piece this way as it comes and joins them all once, at the last
/// ([`join`]).
///
/// # Errors
/// As [`append`], but `prev` need not start at position 0.
pub fn follows(prev: &[u8], next: &[u8]) -> Result<std::ops::Range<usize>, SpliceError> {
    let (h, t) = (parse(prev)?, parse(next)?);
    fits(&h, &t)?;
    Ok(t.first..t.end)
}

/// Joins consecutive pieces (the first from position 0, each continuing the one before)
/// into one state, written into `out` (cleared first; a buffer kept for reuse saves the
/// page faults of a fresh one).
///
/// # Errors
/// No pieces, a piece malformed or not linear, a first piece that does not start at 0, or
/// pieces that do not continue each other or differ in shape.
pub fn join(pieces: &[&[u8]], out: Vec<u8>) -> Result<Vec<u8>, SpliceError> {
    join_from(pieces, 0, out)
}

/// [`join`] for pieces whose first starts at position `first` (a tail: the receiver
/// holds the positions before, PROTOCOL.md "Tails"); the joined state covers
/// `first..m` in every stream.
///
/// # Errors
/// As [`join`], with `first` in place of 0.
pub fn join_from(pieces: &[&[u8]], first: usize, out: Vec<u8>) -> Result<Vec<u8>, SpliceError> {
    let parsed = pieces
        .iter()
        .map(|p| parse(p))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(h) = parsed.first() else {
        return Err(SpliceError::Mismatch("no pieces to join".into()));
    };
    if h.first != first || (first > 0 && h.streams().any(|s| s.first != first)) {
        return Err(SpliceError::Mismatch(format!(
            "the head starts at position {}, not {first}",
            h.first
        )));
    }
    for pair in parsed.windows(2) {
        fits(&pair[0], &pair[1])?;
    }
    let parts: Vec<(&Parsed, usize, usize)> = parsed.iter().map(|p| (p, p.first, p.end)).collect();
    Ok(write(pieces, &parts, out))
}

/// `t` continues `h`: every stream of it starts where `h` ends, it holds cells, and it has
/// `h`'s shape.
fn fits(h: &Parsed, t: &Parsed) -> Result<(), SpliceError> {
    if t.end <= t.first || t.streams().any(|s| s.first != h.end) {
        return Err(SpliceError::Mismatch(format!(
            "the head ends at position {}, the tail covers {}..{}",
            h.end, t.first, t.end
        )));
    }
    if h.seq_id != t.seq_id || h.sections.len() != t.sections.len() {
        return Err(SpliceError::Mismatch("different sections".into()));
    }
    for (hs, ts) in h.sections.iter().zip(&t.sections) {
        if hs.len() != ts.len() {
            return Err(SpliceError::Mismatch("different stream counts".into()));
        }
        for (a, b) in hs.iter().zip(ts) {
            if (a.cells == 0) != (b.cells == 0) {
                return Err(SpliceError::Mismatch(
                    "a stream is empty in one piece".into(),
                ));
            }
            if a.cells > 0
                && (a.v_trans != b.v_trans
                    || a.n_layer != b.n_layer
                    || a.rot != b.rot
                    || shape(a) != shape(b))
            {
                return Err(SpliceError::Mismatch(
                    "layers, types or row sizes differ".into(),
                ));
            }
        }
    }
    Ok(())
}

/// Each layer's K and V row layout: type, row (or element) bytes, elements.
fn shape(s: &Stream) -> Vec<(u32, u64, u32)> {
    s.k.iter()
        .chain(&s.v)
        .map(|r| match *r {
            Rows::Plain { ty, row, .. } => (ty, row, 0),
            Rows::Transposed {
                ty, elem, n_embd, ..
            } => (ty, u64::from(elem), n_embd),
        })
        .collect()
}

/// Synthetic states for the tests of this crate and the fuzz targets (feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use super::STATE_MAGIC;

    fn push32(v: &mut Vec<u8>, x: u32) {
        v.extend_from_slice(&x.to_le_bytes());
    }

    /// A synthetic state of positions `first..first + cells`: `sections` sections of one
    /// stream, 2 layers, K rows of 4 bytes and V rows (or, transposed, 2 elements of 2
    /// bytes) whose bytes encode (section, layer, position, byte) so that any misplaced
    /// byte shows.
    pub fn synthetic(first: u32, cells: u32, v_trans: bool, sections: u32) -> Vec<u8> {
        let spans: Vec<(u32, u32)> = (0..sections).map(|_| (first, cells)).collect();
        windowed(&spans, v_trans)
    }

    /// As [`synthetic`], with each section's own `(first, cells)`: a sliding window's
    /// section holds fewer, later positions than a full one.
    pub fn windowed(spans: &[(u32, u32)], v_trans: bool) -> Vec<u8> {
        let mut v = Vec::new();
        push32(&mut v, STATE_MAGIC);
        push32(&mut v, 0);
        for (s, &(first, cells)) in (0u32..).zip(spans) {
            push32(&mut v, 1);
            push32(&mut v, cells);
            for pos in first..first + cells {
                push32(&mut v, pos);
                push32(&mut v, 1);
                push32(&mut v, 0);
            }
            push32(&mut v, u32::from(v_trans));
            push32(&mut v, 2);
            push32(&mut v, 64);
            push32(&mut v, 64);
            let byte = |s: u32, l: u32, pos: u32, i: u32| (s * 97 + l * 31 + pos * 7 + i) as u8;
            for l in 0..2 {
                push32(&mut v, 1);
                v.extend_from_slice(&4u64.to_le_bytes());
                for pos in first..first + cells {
                    for i in 0..4 {
                        v.push(byte(s, l, pos, i));
                    }
                }
            }
            for l in 0..2 {
                push32(&mut v, 1);
                if v_trans {
                    push32(&mut v, 2);
                    push32(&mut v, 2);
                    for e in 0..2 {
                        for pos in first..first + cells {
                            for i in 0..2 {
                                v.push(byte(s, l + 2, pos, e * 2 + i));
                            }
                        }
                    }
                } else {
                    v.extend_from_slice(&4u64.to_le_bytes());
                    for pos in first..first + cells {
                        for i in 0..4 {
                            v.push(byte(s, l + 2, pos, i));
                        }
                    }
                }
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use testing::{synthetic, windowed};

    #[test]
    fn a_tail_appended_to_its_head_is_the_whole_state() {
        for v_trans in [false, true] {
            for sections in [1, 2] {
                let whole = synthetic(0, 7, v_trans, sections);
                for n in 1..7 {
                    let head = synthetic(0, n, v_trans, sections);
                    let t = tail(&whole, n as usize).unwrap();
                    assert_eq!(t, synthetic(n, 7 - n, v_trans, sections), "n={n}");
                    assert_eq!(span(&t).unwrap(), n as usize..7);
                    assert_eq!(append(&head, &t).unwrap(), whole, "n={n} v_trans={v_trans}");
                }
            }
        }
    }

    #[test]
    fn a_head_and_its_tail_make_the_whole_state_and_the_tail_joins_on_its_own() {
        for v_trans in [false, true] {
            for sections in [1, 2] {
                let whole = synthetic(0, 7, v_trans, sections);
                for n in 1..7 {
                    let h = head(&whole, n as usize).unwrap();
                    assert_eq!(h, synthetic(0, n, v_trans, sections), "n={n}");
                    let t = tail(&whole, n as usize).unwrap();
                    assert_eq!(append(&h, &t).unwrap(), whole, "n={n} v_trans={v_trans}");
                    // A tail's pieces join from where it starts, not from 0.
                    assert_eq!(join_from(&[&t], n as usize, Vec::new()).unwrap(), t);
                    assert!(
                        join(&[&t], Vec::new()).is_err(),
                        "a tail is not a whole state"
                    );
                }
                assert_eq!(head(&whole, 7).unwrap(), whole);
                // The head grafted onto a tail without its copy: the whole state again.
                for n in 1..7 {
                    let t = tail(&whole, n).unwrap();
                    assert_eq!(graft(&whole, &t, Vec::new()).unwrap(), whole, "n={n}");
                    let longer = synthetic(0, 9, v_trans, sections);
                    assert_eq!(graft(&longer, &t, Vec::new()).unwrap(), whole, "n={n}");
                }
                let hashed: [u8; 32] = {
                    use sha2::Digest;
                    sha2::Sha256::digest(head(&whole, 4).unwrap()).into()
                };
                assert_eq!(head_digest(&whole, 4).unwrap(), hashed);
                assert!(head(&whole, 8).is_err(), "past the end");
                assert!(head(&whole, 0).is_err(), "an empty head");
                assert_eq!(
                    head_digest(&whole, 3).unwrap(),
                    head_digest(&synthetic(0, 3, v_trans, sections), 3).unwrap()
                );
                assert_ne!(
                    head_digest(&whole, 3).unwrap(),
                    head_digest(&whole, 4).unwrap()
                );
            }
        }
        assert_eq!(common_start(&synthetic(3, 4, true, 2)).unwrap(), Some(3));
        assert_eq!(
            common_start(&windowed(&[(0, 9), (5, 4)], false)).unwrap(),
            None
        );
        // A sliding window's stream does not start at 0: no head.
        assert!(matches!(
            head(&windowed(&[(0, 9), (5, 4)], false), 5),
            Err(SpliceError::NotLinear(_))
        ));
    }

    #[test]
    fn pieces_checked_one_by_one_join_once_into_the_whole_state() {
        for v_trans in [false, true] {
            for sections in [1, 2] {
                let whole = synthetic(0, 9, v_trans, sections);
                let pieces = [
                    synthetic(0, 4, v_trans, sections),
                    synthetic(4, 3, v_trans, sections),
                    synthetic(7, 1, v_trans, sections),
                    synthetic(8, 1, v_trans, sections),
                ];
                let spans: Vec<_> = pieces
                    .windows(2)
                    .map(|w| follows(&w[0], &w[1]).unwrap())
                    .collect();
                assert_eq!(spans, [4..7, 7..8, 8..9]);
                // Into a buffer that held something else: it is cleared first.
                let out = vec![0xAB; 17];
                let refs: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
                assert_eq!(join(&refs, out).unwrap(), whole, "v_trans={v_trans}");
            }
        }
        let (a, b) = (synthetic(0, 2, false, 1), synthetic(3, 1, false, 1));
        assert!(matches!(follows(&a, &b), Err(SpliceError::Mismatch(_))));
        assert!(matches!(
            join(&[&a, &b], Vec::new()),
            Err(SpliceError::Mismatch(_))
        ));
        assert!(matches!(
            join(&[&b], Vec::new()),
            Err(SpliceError::Mismatch(_))
        ));
        assert!(matches!(
            join(&[], Vec::new()),
            Err(SpliceError::Mismatch(_))
        ));
    }

    #[test]
    fn pieces_that_do_not_fit_are_refused() {
        let head = synthetic(0, 3, false, 1);
        // A gap, an overlap, a tail of another layout, a head that is itself a tail.
        for t in [
            synthetic(4, 2, false, 1),
            synthetic(2, 2, false, 1),
            synthetic(3, 2, true, 1),
            synthetic(3, 2, false, 2),
        ] {
            assert!(matches!(append(&head, &t), Err(SpliceError::Mismatch(_))));
        }
        assert!(matches!(
            append(&synthetic(1, 2, false, 1), &synthetic(3, 1, false, 1)),
            Err(SpliceError::Mismatch(_))
        ));
        assert!(matches!(tail(&head, 3), Err(SpliceError::Mismatch(_))));
    }

    #[test]
    fn a_window_joins_the_cells_written_after_it() {
        for v_trans in [false, true] {
            // The prompt's state right after the prefill: positions 0..8, and a window
            // section holding its last 4. Two steps later the export holds the window
            // 6..10; its tail from 8 continues both sections.
            let head = windowed(&[(0, 8), (4, 4)], v_trans);
            assert_eq!(span(&head).unwrap(), 0..8);
            let later = windowed(&[(0, 10), (6, 4)], v_trans);
            let t = tail(&later, 8).unwrap();
            assert_eq!(t, windowed(&[(8, 2), (8, 2)], v_trans));
            assert_eq!(follows(&head, &t).unwrap(), 8..10);
            // Joined: what the cache holds, the window's older cells (masked now, still
            // in their places) included.
            let joined = append(&head, &t).unwrap();
            assert_eq!(
                joined,
                windowed(&[(0, 10), (4, 6)], v_trans),
                "v_trans={v_trans}"
            );
            assert_eq!(
                join(
                    &[
                        &head,
                        &t,
                        &tail(&windowed(&[(0, 11), (7, 4)], v_trans), 10).unwrap()
                    ],
                    Vec::new()
                )
                .unwrap(),
                windowed(&[(0, 11), (4, 7)], v_trans)
            );
        }
        // The window has moved past the cut: the positions between are gone.
        let moved = windowed(&[(0, 10), (7, 3)], false);
        assert!(matches!(tail(&moved, 6), Err(SpliceError::Mismatch(_))));
        // A tail whose window section starts elsewhere, and sections that end apart.
        let head = windowed(&[(0, 8), (4, 4)], false);
        let odd = windowed(&[(8, 2), (7, 3)], false);
        assert!(matches!(
            follows(&head, &odd),
            Err(SpliceError::Mismatch(_))
        ));
        assert!(matches!(
            parse(&windowed(&[(0, 8), (4, 3)], false)),
            Err(SpliceError::NotLinear(_))
        ));
    }

    #[test]
    fn ring_ordered_or_shared_cells_are_not_linear() {
        let mut ring = synthetic(0, 3, false, 1);
        // Cell 0 now holds position 5: a sliding window's ring.
        ring[16..20].copy_from_slice(&5u32.to_le_bytes());
        assert!(matches!(parse(&ring), Err(SpliceError::NotLinear(_))));
        assert!(!is_linear(&ring));
        let mut shared = synthetic(0, 3, false, 1);
        shared[20..24].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(parse(&shared), Err(SpliceError::NotLinear(_))));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let s = synthetic(0, 3, true, 2);
        for cut in 0..s.len() {
            // A cut at the end of the first section leaves a shorter valid state.
            if let Ok(p) = parse(&s[..cut]) {
                assert_eq!(p.sections.len(), 1, "cut {cut}");
            }
        }
        let mut bad = s.clone();
        bad[0] ^= 1;
        assert_eq!(
            parse(&bad).unwrap_err(),
            SpliceError::Malformed("no state magic")
        );
    }
}
