//! Cutting and joining llama.cpp sequence states by position, for the live handoff
//! (PROTOCOL.md, "Live handoff"): the prefill node sends the state of the prompt, then only
//! the cells of the tokens it wrote since ([`tail`]); the decode node joins them
//! ([`append`]) into the state the prefill node would have exported at that moment.
//!
//! Only *linear* states are cut: every stream of every memory section holds the positions
//! `0..n` in order, one sequence per cell. That is what a context with one sequence and no
//! sliding window exports (SmolLM2 here). A sliding-window section keeps the last window
//! only, in ring order, and cannot be joined from pieces: such states are refused with
//! [`SpliceError::NotLinear`] and their handoff goes whole, after prefill.
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

/// A parsed linear state: where everything lies in its buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Parsed {
    seq_id: u32,
    /// Sections, each a list of streams (a stream with no cells has no fields).
    sections: Vec<Vec<Stream>>,
    /// The position of the first cell of every non-empty stream (all the same).
    first: usize,
    /// Cells in every non-empty stream (all the same).
    cells: usize,
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
    let mut span: Option<(usize, usize)> = None;
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
                let first = span.map_or(pos, |(f, _)| f as i32);
                if usize::try_from(pos).ok() != Some(first as usize + c) {
                    return Err(SpliceError::NotLinear(format!(
                        "cell {c} holds position {pos}, not {}",
                        first as usize + c
                    )));
                }
                if c == 0 && span.is_none() {
                    span = Some((
                        usize::try_from(pos).map_err(|_| {
                            SpliceError::NotLinear(format!("negative position {pos}"))
                        })?,
                        cells,
                    ));
                }
            }
            if span.is_some_and(|(_, n)| n != cells) {
                return Err(SpliceError::NotLinear(format!(
                    "a stream holds {cells} cells, another {}",
                    span.map_or(0, |s| s.1)
                )));
            }
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
    let (first, cells) = span.unwrap_or((0, 0));
    Ok(Parsed {
        seq_id,
        sections,
        first,
        cells,
    })
}

/// The positions a linear state covers: `first..first + cells`.
///
/// # Errors
/// A state that is malformed or not linear.
pub fn span(state: &[u8]) -> Result<std::ops::Range<usize>, SpliceError> {
    let p = parse(state)?;
    Ok(p.first..p.first + p.cells)
}

/// Whether `state` can be cut and joined (see the module docs).
#[must_use]
pub fn is_linear(state: &[u8]) -> bool {
    parse(state).is_ok()
}

/// A range of cells `[from, to)` (indices within the stream) of each of `parts`' streams,
/// written as one state into `out` (cleared first): each part's cells follow the previous
/// part's.
fn write(buf_of: &[&[u8]], parts: &[(&Parsed, usize, usize)], mut out: Vec<u8>) -> Vec<u8> {
    let total: usize = buf_of.iter().map(|b| b.len()).sum();
    out.clear();
    out.reserve(total);
    let p0 = parts[0].0;
    out.extend_from_slice(&STATE_MAGIC.to_le_bytes());
    out.extend_from_slice(&p0.seq_id.to_le_bytes());
    let cells: usize = parts.iter().map(|(_, a, b)| b - a).sum();
    for (si, streams) in p0.sections.iter().enumerate() {
        out.extend_from_slice(&(streams.len() as u32).to_le_bytes());
        for (ti, s0) in streams.iter().enumerate() {
            if s0.cells == 0 && parts.iter().all(|(p, _, _)| p.sections[si][ti].cells == 0) {
                out.extend_from_slice(&0u32.to_le_bytes());
                continue;
            }
            out.extend_from_slice(&(cells as u32).to_le_bytes());
            for ((p, a, b), buf) in parts.iter().zip(buf_of) {
                let s = &p.sections[si][ti];
                if s.cells > 0 {
                    out.extend_from_slice(&buf[s.meta_at + a * META..s.meta_at + b * META]);
                }
            }
            let s = parts
                .iter()
                .map(|(p, _, _)| &p.sections[si][ti])
                .find(|s| s.cells > 0)
                .unwrap_or(s0);
            out.extend_from_slice(&s.v_trans.to_le_bytes());
            out.extend_from_slice(&s.n_layer.to_le_bytes());
            out.extend_from_slice(&s.rot);
            for l in 0..s.n_layer as usize {
                write_rows(&mut out, buf_of, parts, si, ti, |st| st.k[l]);
            }
            for l in 0..s.n_layer as usize {
                write_rows(&mut out, buf_of, parts, si, ti, |st| st.v[l]);
            }
        }
    }
    out
}

fn write_rows(
    out: &mut Vec<u8>,
    buf_of: &[&[u8]],
    parts: &[(&Parsed, usize, usize)],
    si: usize,
    ti: usize,
    rows_of: impl Fn(&Stream) -> Rows,
) {
    let present: Vec<(&[u8], &Stream, usize, usize)> = parts
        .iter()
        .zip(buf_of)
        .map(|((p, a, b), buf)| (*buf, &p.sections[si][ti], *a, *b))
        .filter(|(_, s, a, b)| s.cells > 0 && b > a)
        .collect();
    let Some((_, s, _, _)) = present.first() else {
        return;
    };
    match rows_of(s) {
        Rows::Plain { ty, row, .. } => {
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&row.to_le_bytes());
            for (buf, st, a, b) in &present {
                let Rows::Plain { row, at, .. } = rows_of(st) else {
                    continue;
                };
                let row = row as usize;
                out.extend_from_slice(&buf[at + a * row..at + b * row]);
            }
        }
        Rows::Transposed {
            ty, elem, n_embd, ..
        } => {
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&n_embd.to_le_bytes());
            for e in 0..n_embd as usize {
                for (buf, st, a, b) in &present {
                    let Rows::Transposed { elem, at, .. } = rows_of(st) else {
                        continue;
                    };
                    let el = elem as usize;
                    let base = at + e * st.cells * el;
                    out.extend_from_slice(&buf[base + a * el..base + b * el]);
                }
            }
        }
    }
}

/// The cells of `state` at positions `from..`: the state's tail, itself a linear state.
///
/// # Errors
/// A state that is malformed, not linear, or that does not reach past `from`.
pub fn tail(state: &[u8], from: usize) -> Result<Vec<u8>, SpliceError> {
    let p = parse(state)?;
    if p.first != 0 {
        return Err(SpliceError::Mismatch(format!(
            "the state starts at position {}, not 0",
            p.first
        )));
    }
    if from >= p.cells {
        return Err(SpliceError::Mismatch(format!(
            "the state covers {} positions; nothing follows position {from}",
            p.cells
        )));
    }
    Ok(write(&[state], &[(&p, from, p.cells)], Vec::new()))
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
    Ok(t.first..t.first + t.cells)
}

/// Joins consecutive pieces (the first from position 0, each continuing the one before)
/// into one state, written into `out` (cleared first; a buffer kept for reuse saves the
/// page faults of a fresh one).
///
/// # Errors
/// No pieces, a piece malformed or not linear, a first piece that does not start at 0, or
/// pieces that do not continue each other or differ in shape.
pub fn join(pieces: &[&[u8]], out: Vec<u8>) -> Result<Vec<u8>, SpliceError> {
    let parsed = pieces
        .iter()
        .map(|p| parse(p))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(h) = parsed.first() else {
        return Err(SpliceError::Mismatch("no pieces to join".into()));
    };
    if h.first != 0 {
        return Err(SpliceError::Mismatch(format!(
            "the head starts at position {}, not 0",
            h.first
        )));
    }
    for pair in parsed.windows(2) {
        fits(&pair[0], &pair[1])?;
    }
    let parts: Vec<(&Parsed, usize, usize)> = parsed.iter().map(|p| (p, 0, p.cells)).collect();
    Ok(write(pieces, &parts, out))
}

/// `t` continues `h`: it starts where `h` ends, holds cells, and has `h`'s shape.
fn fits(h: &Parsed, t: &Parsed) -> Result<(), SpliceError> {
    if t.first != h.first + h.cells || t.cells == 0 {
        return Err(SpliceError::Mismatch(format!(
            "the head ends at position {}, the tail covers {}..{}",
            h.first + h.cells,
            t.first,
            t.first + t.cells
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

/// Synthetic states for the tests of this crate.
#[cfg(test)]
pub(crate) mod testing {
    use super::STATE_MAGIC;

    fn push32(v: &mut Vec<u8>, x: u32) {
        v.extend_from_slice(&x.to_le_bytes());
    }

    /// A synthetic state of positions `first..first + cells`: `sections` sections of one
    /// stream, 2 layers, K rows of 4 bytes and V rows (or, transposed, 2 elements of 2
    /// bytes) whose bytes encode (section, layer, position, byte) so that any misplaced
    /// byte shows.
    pub(crate) fn synthetic(first: u32, cells: u32, v_trans: bool, sections: u32) -> Vec<u8> {
        let mut v = Vec::new();
        push32(&mut v, STATE_MAGIC);
        push32(&mut v, 0);
        for s in 0..sections {
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
    use testing::synthetic;

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
