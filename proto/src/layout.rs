//! Reads llama.cpp's raw sequence-state bytes into tensor descriptors.
//!
//! Layout (llama.cpp `llama_kv_cache::state_write`, one block per memory section; a
//! sliding-window model such as Gemma-3 has two sections, the full cache then the SWA cache):
//!
//! ```text
//! u32 magic 0xaf143cd8, i32 source seq id            (llama_context::state_seq_get_data)
//! then per memory section:
//! u32 n_stream
//! per stream: u32 cell_count; if cell_count > 0:
//!   per cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id
//!   u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v
//!   per layer K: i32 type, u64 row_bytes, cell_count x row_bytes
//!   per layer V, v_trans == 0: i32 type, u64 row_bytes, cell_count x row_bytes
//!   per layer V, v_trans == 1: i32 type, u32 elem_bytes, u32 n_embd_v, n_embd_v x cell_count x elem_bytes
//! ```
//!
//! The walk is strict: it must end exactly at the end of the buffer. A layout it does not
//! understand (an architecture whose cells carry extra fields, say) is described as one
//! opaque tensor, so the handoff still works and the receiver still compares descriptors.

use crate::frame::{TensorDescriptor, DTYPE_OPAQUE};

/// `io_magic` of llama.cpp's `llama_context::state_seq_get_data`.
pub const STATE_MAGIC: u32 = 0xaf14_3cd8;
const MAX_STREAMS: u32 = 64;
const MAX_SEQ_PER_CELL: u32 = 256;
const MAX_LAYERS: u32 = 4096;

/// What the walk learned about a state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub descriptors: Vec<TensorDescriptor>,
    /// Largest cell count of any stream of any section: the sequence length the state covers
    /// (sliding-window sections keep fewer cells). `None` for an opaque layout.
    pub max_cells: Option<u64>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: u64) -> Option<usize> {
        let n = usize::try_from(n).ok()?;
        let start = self.pos;
        let end = start.checked_add(n)?;
        if end > self.buf.len() {
            return None;
        }
        self.pos = end;
        Some(start)
    }
    fn u32(&mut self) -> Option<u32> {
        let at = self.take(4)?;
        Some(u32::from_le_bytes(self.buf[at..at + 4].try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        let at = self.take(8)?;
        Some(u64::from_le_bytes(self.buf[at..at + 8].try_into().ok()?))
    }
}

/// Walks the memory sections from `start` to the end of `buf`. Also returns the offset of
/// each stream's `n_rot_k, n_rot_v` pair (fields that sequence-file version 3 lacks).
/// Gives up, setting `too_many`, before it would hold more than `limit` descriptors.
fn walk_sections(
    buf: &[u8],
    start: usize,
    limit: usize,
    too_many: &mut bool,
) -> Option<(Layout, Vec<usize>)> {
    let mut r = Reader { buf, pos: start };
    let mut descriptors = Vec::new();
    let mut rot_fields = Vec::new();
    let mut max_cells = 0u64;
    let mut section = 0;
    while r.pos < buf.len() {
        let n_stream = r.u32()?;
        if n_stream == 0 || n_stream > MAX_STREAMS {
            return None;
        }
        for s in 0..n_stream {
            let cells = u64::from(r.u32()?);
            if cells == 0 {
                continue;
            }
            max_cells = max_cells.max(cells);
            for _ in 0..cells {
                let _pos = r.u32()?;
                let n_seq = r.u32()?;
                if n_seq > MAX_SEQ_PER_CELL {
                    return None;
                }
                r.take(u64::from(n_seq) * 4)?;
            }
            let v_trans = r.u32()?;
            let n_layer = r.u32()?;
            rot_fields.push(r.pos);
            let _n_rot_k = r.u32()?;
            let _n_rot_v = r.u32()?;
            if v_trans > 1 || n_layer > MAX_LAYERS {
                return None;
            }
            for l in 0..n_layer {
                let ty = r.u32()?;
                let row = r.u64()?;
                let nbytes = cells.checked_mul(row)?;
                let offset = r.take(nbytes)? as u64;
                if descriptors.len() >= limit {
                    *too_many = true;
                    return None;
                }
                descriptors.push(TensorDescriptor {
                    name: format!("m{section}.s{s}.l{l}.k"),
                    dtype: ty,
                    dims: vec![cells, row],
                    offset,
                    nbytes,
                });
            }
            for l in 0..n_layer {
                let ty = r.u32()?;
                if descriptors.len() >= limit {
                    *too_many = true;
                    return None;
                }
                if v_trans == 0 {
                    let row = r.u64()?;
                    let nbytes = cells.checked_mul(row)?;
                    let offset = r.take(nbytes)? as u64;
                    descriptors.push(TensorDescriptor {
                        name: format!("m{section}.s{s}.l{l}.v"),
                        dtype: ty,
                        dims: vec![cells, row],
                        offset,
                        nbytes,
                    });
                } else {
                    let el = u64::from(r.u32()?);
                    let n_embd = u64::from(r.u32()?);
                    let nbytes = n_embd.checked_mul(cells)?.checked_mul(el)?;
                    let offset = r.take(nbytes)? as u64;
                    descriptors.push(TensorDescriptor {
                        name: format!("m{section}.s{s}.l{l}.vt"),
                        dtype: ty,
                        dims: vec![n_embd, cells, el],
                        offset,
                        nbytes,
                    });
                }
            }
        }
        section += 1;
    }
    Some((
        Layout {
            descriptors,
            max_cells: Some(max_cells),
        },
        rot_fields,
    ))
}

fn walk(buf: &[u8], limit: usize, too_many: &mut bool) -> Option<Layout> {
    let mut r = Reader { buf, pos: 0 };
    if r.u32()? != STATE_MAGIC {
        return None;
    }
    let _source_seq = r.u32()?;
    walk_sections(buf, r.pos, limit, too_many).map(|(l, _)| l)
}

/// Rewrites the memory sections of a sequence-state *file* body (no io header) from
/// llama.cpp's sequence-file version 4 to version 3, which lacks the per-stream
/// `n_rot_k, n_rot_v` fields. `None` if the body cannot be walked exactly.
#[must_use]
pub fn sections_v4_to_v3(body: &[u8]) -> Option<Vec<u8>> {
    let (_, rot) = walk_sections(body, 0, usize::MAX, &mut false)?;
    let mut out = Vec::with_capacity(body.len());
    let mut from = 0;
    for at in rot {
        out.extend_from_slice(&body[from..at]);
        from = at + 8;
    }
    out.extend_from_slice(&body[from..]);
    Some(out)
}

/// Describes the memory sections of a sequence-state file body (no io header).
#[must_use]
pub fn describe_sections(body: &[u8]) -> Option<Layout> {
    walk_sections(body, 0, usize::MAX, &mut false).map(|(l, _)| l)
}

/// Describes `state` (a raw sequence state: magic, source sequence, sections) as tensors;
/// `None` when it cannot be walked exactly.
#[must_use]
pub fn describe_state(state: &[u8]) -> Option<Layout> {
    walk(state, usize::MAX, &mut false)
}

/// A state that derives more tensor descriptors than a limit ([`describe_within`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooMany;

/// [`describe`], holding at most `limit` descriptors: a receiver compares a payload with
/// the descriptors its sender declared, so it needs no more than their count to find a
/// difference, and a hostile payload of 12-byte layer records does not make it allocate a
/// descriptor for each.
///
/// # Errors
/// [`TooMany`] when the payload derives more than `limit` descriptors.
pub fn describe_within(state: &[u8], limit: usize) -> Result<Layout, TooMany> {
    let mut too_many = false;
    match walk(state, limit, &mut too_many) {
        Some(l) => Ok(l),
        None if too_many => Err(TooMany),
        None => Ok(opaque(state)),
    }
}

/// Describes `state` as tensors; falls back to one opaque tensor if the layout is unknown.
#[must_use]
pub fn describe(state: &[u8]) -> Layout {
    walk(state, usize::MAX, &mut false).unwrap_or_else(|| opaque(state))
}

fn opaque(state: &[u8]) -> Layout {
    Layout {
        descriptors: vec![TensorDescriptor {
            name: "state".into(),
            dtype: DTYPE_OPAQUE,
            dims: vec![state.len() as u64],
            offset: 0,
            nbytes: state.len() as u64,
        }],
        max_cells: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push32(v: &mut Vec<u8>, x: u32) {
        v.extend_from_slice(&x.to_le_bytes());
    }

    /// A synthetic one-stream state: 2 cells, 2 layers, f16 rows of 4 bytes.
    fn synthetic(v_trans: bool) -> Vec<u8> {
        let mut v = Vec::new();
        push32(&mut v, STATE_MAGIC);
        push32(&mut v, 0);
        push32(&mut v, 1);
        push32(&mut v, 2);
        for pos in 0..2 {
            push32(&mut v, pos);
            push32(&mut v, 1);
            push32(&mut v, 0);
        }
        push32(&mut v, u32::from(v_trans));
        push32(&mut v, 2);
        push32(&mut v, 0);
        push32(&mut v, 0);
        for _ in 0..2 {
            push32(&mut v, 1);
            v.extend_from_slice(&4u64.to_le_bytes());
            v.extend_from_slice(&[9; 8]);
        }
        for _ in 0..2 {
            push32(&mut v, 1);
            if v_trans {
                push32(&mut v, 2);
                push32(&mut v, 2);
            } else {
                v.extend_from_slice(&4u64.to_le_bytes());
            }
            v.extend_from_slice(&[8; 8]);
        }
        v
    }

    #[test]
    fn walks_a_plain_state() {
        let s = synthetic(false);
        let l = describe(&s);
        assert_eq!(l.max_cells, Some(2));
        assert_eq!(l.descriptors.len(), 4);
        assert_eq!(l.descriptors[0].name, "m0.s0.l0.k");
        assert_eq!(l.descriptors[3].dims, vec![2, 4]);
        let last = &l.descriptors[3];
        assert_eq!((last.offset + last.nbytes) as usize, s.len());
    }

    #[test]
    fn walks_a_transposed_state_and_two_sections() {
        let mut s = synthetic(true);
        s.extend(&synthetic(false)[8..]);
        let l = describe(&s);
        assert_eq!(l.descriptors.len(), 8);
        assert_eq!(l.descriptors[2].name, "m0.s0.l0.vt");
        assert_eq!(l.descriptors[7].name, "m1.s0.l1.v");
    }

    #[test]
    fn v4_sections_lose_their_rot_fields_in_v3() {
        let s = synthetic(false);
        let body = &s[8..];
        let v3 = sections_v4_to_v3(body).unwrap();
        assert_eq!(v3.len(), body.len() - 8);
        // n_stream, cell_count, two cells (3 words each), v_trans, n_layer: 40 bytes kept,
        // then the 8 bytes of n_rot_k, n_rot_v dropped.
        assert_eq!(&v3[..40], &body[..40]);
        assert_eq!(&v3[40..], &body[48..]);
        assert!(sections_v4_to_v3(&body[..body.len() - 1]).is_none());
    }

    #[test]
    fn unknown_or_truncated_layouts_are_opaque() {
        let mut s = synthetic(false);
        s.pop();
        let l = describe(&s);
        assert_eq!(l.max_cells, None);
        assert_eq!(l.descriptors.len(), 1);
        assert_eq!(l.descriptors[0].dtype, DTYPE_OPAQUE);
        assert_eq!(describe(&[0xff; 3]).descriptors[0].nbytes, 3);
        let mut wrong_magic = synthetic(false);
        wrong_magic[0] ^= 1;
        assert_eq!(describe(&wrong_magic).max_cells, None);
    }

    #[test]
    fn a_walk_holds_no_more_descriptors_than_its_limit() {
        let s = synthetic(false);
        assert_eq!(describe_within(&s, 4), Ok(describe(&s)));
        assert_eq!(describe_within(&s, 3), Err(TooMany));
        assert_eq!(describe_within(&s, 0), Err(TooMany));
        // An unreadable state is opaque, whatever the limit.
        assert_eq!(describe_within(&[0xff; 3], 1), Ok(describe(&[0xff; 3])));
        // 4,096 layers of 12-byte K records over one cell of 0-byte rows: past the limit
        // after `limit` of them, not 4,096 descriptors later.
        let mut many = Vec::new();
        for x in [STATE_MAGIC, 0, 1, 1, 0, 1, 0, 0, 4096, 0, 0] {
            push32(&mut many, x);
        }
        for _ in 0..4096 {
            push32(&mut many, 1);
            many.extend_from_slice(&0u64.to_le_bytes());
        }
        assert_eq!(describe_within(&many, 60), Err(TooMany));
    }
}
