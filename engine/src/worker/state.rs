//! A sequence's state: exported (whole or from a position), imported (whole or as a tail
//! joined onto a held prefix), cut back, and laid out the way an import lays it out.

use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;

use crate::types::EngineError;

use super::Worker;

impl Worker<'_> {
    /// Keeps the first `keep` positions of `slot`'s sequence and removes the rest; returns
    /// how many it kept (0, the slot cleared, when llama.cpp cannot cut this cache).
    pub(super) fn cut_back(&mut self, slot: usize, keep: usize) -> usize {
        let s = &mut self.slots[slot];
        if keep == 0 || keep > s.tokens.len() {
            self.clear(slot);
            return 0;
        }
        if keep < s.tokens.len() {
            let p0 = u32::try_from(keep).ok();
            if !matches!(s.ctx.clear_kv_cache_seq(Some(0), p0, None), Ok(true)) {
                self.clear(slot);
                return 0;
            }
            s.tokens.truncate(keep);
            s.exact = s.exact.min(keep);
            s.decoded.retain(|(start, _)| *start < keep);
            if let Some(last) = s.decoded.last_mut() {
                last.1 = last.1.min(keep);
            }
        }
        keep
    }

    /// After a prefill, a sliding-window cache holds the window's cells in a ring, at
    /// indices that depend on how the prompt was batched and the window pruned; a state
    /// imported on another node is laid out from index 0 in the order it was exported.
    /// Attention over the same cells in another arrangement rounds differently in the
    /// last bits, enough to change a sampled token. So every path lays its
    /// cache out the way an import does - exported, cleared, imported - right after the
    /// prefill, before its first decode step: the colocated run, the prefill node before
    /// it exports (what it sends is then exactly what it holds), a resumed answer. Every
    /// node then decodes from the same arrangement. The first token is sampled before,
    /// from the prefill's own logits, on every path alike.
    ///
    /// With `keep` (a live answer) the export is kept as the slot's `laid_out`: the state
    /// the live handoff's first piece must be.
    pub(super) fn lay_out_as_imported(
        &mut self,
        slot: usize,
        keep: bool,
    ) -> Result<(), EngineError> {
        let mut state = if keep {
            let ctx = &self.slots[slot].ctx;
            edgesplit_proto::buffers::take(
                ctx.state_seq_get_size_ext(0, LlamaStateSeqFlags::empty()),
            )
        } else {
            std::mem::take(&mut self.export_buf)
        };
        Self::export_into(&self.slots[slot].ctx, &mut state)?;
        let ctx = &mut self.slots[slot].ctx;
        let _ = ctx.clear_kv_cache_seq(Some(0), None, None);
        let res = Self::import_raw(ctx, &state).map(|_| ());
        if keep {
            self.slots[slot].laid_out = res.is_ok().then_some(state);
        } else {
            self.export_buf = state;
        }
        res
    }

    /// The slot's whole state, in a buffer from `edgesplit_proto::buffers` (kept from
    /// handoff to handoff: its pages are warm, and the copy runs at memory speed).
    pub(super) fn export(&self, slot: usize) -> Result<Vec<u8>, EngineError> {
        let ctx = &self.slots[slot].ctx;
        let size = ctx.state_seq_get_size_ext(0, LlamaStateSeqFlags::empty());
        let mut buf = edgesplit_proto::buffers::take(size);
        Self::export_into(ctx, &mut buf)?;
        Ok(buf)
    }

    /// Exports the slot's state into `buf`, replacing what it held (a buffer kept between
    /// exports has its pages already, so the copy runs at memory speed).
    pub(super) fn export_into(
        ctx: &LlamaContext<'_>,
        buf: &mut Vec<u8>,
    ) -> Result<(), EngineError> {
        let flags = LlamaStateSeqFlags::empty();
        let size = ctx.state_seq_get_size_ext(0, flags);
        if size == 0 {
            return Err(EngineError::Export(
                "llama.cpp reported an empty state".into(),
            ));
        }
        buf.clear();
        buf.reserve(size);
        // SAFETY: `buf` has room for the size llama.cpp reported for this sequence, and the
        // context is not modified between the size query and the copy (same thread).
        let n = unsafe { ctx.state_seq_get_data_ext(buf.as_mut_ptr(), 0, flags) };
        if n != size {
            return Err(EngineError::Export(format!(
                "llama.cpp wrote {n} bytes, expected {size}"
            )));
        }
        // SAFETY: llama.cpp wrote the first `n` bytes (it returns what it wrote), and `n`
        // is within the capacity reserved above.
        unsafe { buf.set_len(n) };
        Ok(())
    }

    /// The slot's state from position `from` on (all of it for 0): exported into the
    /// worker's kept buffer, and only the cells asked for copied out
    /// (`edgesplit_proto::splice::tail`).
    pub(super) fn export_from(&mut self, slot: usize, from: usize) -> Result<Vec<u8>, EngineError> {
        if from == 0 {
            return self.export(slot);
        }
        Self::export_into(&self.slots[slot].ctx, &mut self.export_buf)?;
        edgesplit_proto::splice::tail(&self.export_buf, from)
            .map_err(|e| EngineError::Export(e.to_string()))
    }

    /// Imports `state`, the KV of `tokens`, into the emptied `slot`; the first `exact` of
    /// them are what a prefill from 0 computes.
    pub(super) fn import(
        &mut self,
        slot: usize,
        state: &[u8],
        tokens: &[i32],
        exact: usize,
    ) -> Result<(), EngineError> {
        self.clear(slot);
        let held = Self::import_raw(&mut self.slots[slot].ctx, state)?;
        if held != tokens.len() {
            self.clear(slot);
            return Err(EngineError::Import(format!(
                "the state holds {held} positions for {} tokens",
                tokens.len()
            )));
        }
        let s = &mut self.slots[slot];
        s.tokens = tokens.to_vec();
        s.exact = exact.min(held);
        // The tokens after the prompt were decoded (on the node that sent the state).
        if s.exact < held {
            s.decoded = vec![(s.exact, held)];
        }
        self.publish_kv();
        Ok(())
    }

    /// Joins a tail (`state`: the positions `n..` of `tokens`) onto the prefix `slot`
    /// holds and imports the whole into it; returns `n`. The slot must hold `tokens[..n]`
    /// with a state whose SHA-256 is `digest` (what the sender held under the same
    /// tokens: the KV is then the sender's bit for bit); otherwise nothing changes. Of the
    /// joined tokens, the slot's marks are kept below `n`; the tail's prompt positions
    /// (below `prompt`) continued a conversation, the rest were decoded.
    pub(super) fn import_tail(
        &mut self,
        slot: usize,
        state: &[u8],
        tokens: &[i32],
        prompt: usize,
        digest: &[u8; 32],
    ) -> Result<usize, EngineError> {
        use edgesplit_proto::splice;
        let refuse = |why: String| EngineError::Import(format!("tail handoff: {why}"));
        let missing = EngineError::TailBase;
        let n = splice::span(state)
            .map_err(|e| refuse(e.to_string()))?
            .start;
        if n == 0 || n >= tokens.len() {
            return Err(refuse(format!(
                "a tail from position {n} of {} tokens",
                tokens.len()
            )));
        }
        let s = &self.slots[slot];
        if s.tokens.len() < n || s.tokens[..n] != tokens[..n] {
            return Err(missing(format!(
                "no cached sequence here holds the {n} tokens it goes on from"
            )));
        }
        Self::export_into(&self.slots[slot].ctx, &mut self.export_buf)?;
        // The prefix is hashed where it lies, on another thread, while the joined state is
        // written (into a kept buffer, whose pages are warm): the join is at the switch,
        // where the answer waits for it.
        let exported = &self.export_buf;
        let (mine, joined) = std::thread::scope(|scope| {
            let hashing = scope.spawn(|| splice::head_digest(exported, n));
            let out = edgesplit_proto::buffers::take(exported.len() + state.len());
            let joined = splice::graft(exported, state, out);
            (hashing.join(), joined)
        });
        let mine = mine
            .map_err(|_| refuse("the prefix's hash failed".into()))?
            .map_err(|e| refuse(e.to_string()))?;
        let joined = joined.map_err(|e| refuse(e.to_string()))?;
        if &mine != digest {
            edgesplit_proto::buffers::give(joined);
            return Err(missing(format!(
                "the cached state of its first {n} tokens differs from the sender's"
            )));
        }
        let (exact, mut decoded) = {
            let s = &self.slots[slot];
            (s.exact.min(n), s.decoded.clone())
        };
        decoded.retain(|(start, _)| *start < n);
        if let Some(last) = decoded.last_mut() {
            last.1 = last.1.min(n);
        }
        let imported = self.import(slot, &joined, tokens, 0);
        edgesplit_proto::buffers::give(joined);
        imported?;
        let s = &mut self.slots[slot];
        s.exact = exact;
        if prompt < tokens.len() {
            decoded.push((prompt.max(n), tokens.len()));
        }
        s.decoded = decoded;
        Ok(n)
    }

    /// Imports `state` into `ctx`'s (empty) sequence; returns the positions it holds.
    pub(super) fn import_raw(
        ctx: &mut LlamaContext<'_>,
        state: &[u8],
    ) -> Result<usize, EngineError> {
        // SAFETY: the bytes were produced by `state_seq_get_data_ext` of the same llama.cpp
        // build and model (the V2 handshake compared build id and model fingerprint), their
        // SHA-256 passed and their tensor layout was re-derived and compared before we got
        // here. llama.cpp's reader is bounds-checked against `state.len()` and rejects
        // shape mismatches.
        let ok = unsafe { ctx.state_seq_set_data_ext(state, 0, LlamaStateSeqFlags::empty()) };
        if !ok {
            return Err(EngineError::Import(
                "llama.cpp refused the state (shape or type mismatch)".into(),
            ));
        }
        let held = ctx.kv_cache_seq_pos_max(0) + 1;
        Ok(usize::try_from(held).unwrap_or(0))
    }
}
