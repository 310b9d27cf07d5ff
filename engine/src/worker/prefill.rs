//! Prefill: a prompt decoded in batches (streamed out in pieces for a live handoff), and
//! the prefill commands that export the state after it.

use std::sync::atomic::Ordering;
use std::time::Instant;

use llama_cpp_2::token::LlamaToken;
use tokio::sync::mpsc;

use crate::command::PrefillJob;
use crate::sampling::{self, SamplingParams};
use crate::types::{EngineError, Export, Exported, PrefillOutput, Snapshot, TokenOut};

use super::{grammar, ms, Worker};

impl Worker<'_> {
    /// Prefills `tokens` in `slot`, keeping the KV the slot holds for the first `keep` of
    /// them (from [`Worker::reusable`]; 0: from an empty slot), and samples the first
    /// answer token (step 0). `between` runs after every batch but the last (the scheduler
    /// steps the other slots' running answers there; they use other contexts, so this
    /// prefill's KV is the same whatever they do).
    pub(super) fn prefill(
        &mut self,
        slot: usize,
        tokens: &[i32],
        keep: usize,
        params: &SamplingParams,
        between: &mut dyn FnMut(&mut Self),
    ) -> Result<TokenOut, EngineError> {
        self.prefill_in_pieces(slot, tokens, keep, params, None, between)
    }

    /// [`Worker::prefill`], sending the state after every batch but the last to `pieces`
    /// (a live handoff streams them while the prefill goes on). The batches, and so the
    /// KV, are the same either way.
    pub(super) fn prefill_in_pieces(
        &mut self,
        slot: usize,
        tokens: &[i32],
        keep: usize,
        params: &SamplingParams,
        pieces: Option<&mpsc::UnboundedSender<Snapshot>>,
        between: &mut dyn FnMut(&mut Self),
    ) -> Result<TokenOut, EngineError> {
        // First: a schema that cannot be a grammar is refused before the prompt is read.
        let mut grammar = grammar(self.model, params, &[])?;
        let keep = self.cut_back(slot, keep.min(tokens.len() - 1));
        // Reusing decoded tokens (a conversation's earlier answer): what follows is not
        // what a prefill from 0 computes.
        let conversation = keep > self.slots[slot].exact;
        let counter = if keep > 0 {
            self.gauges
                .reused_tokens
                .fetch_add(keep as u64, Ordering::Relaxed);
            &self.gauges.cache_hits
        } else {
            &self.gauges.cache_misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let rest = &tokens[keep..];
        let last_chunk = (rest.len() - 1) / self.n_batch;
        // Where the last piece sent ended; pieces stop at the first that fails (the
        // prefill does not: they are an optimisation, and the handoff sends what is left).
        let mut sent = Some(0usize);
        // A sliding window's cells during a prefill are a ring in no order an import
        // keeps: its live handoff sends the state once the prefill is laid out.
        let streamed = pieces.filter(|_| !self.sliding_window);
        // A reused prefix is there already: it is the first piece.
        if let (Some(tx), true) = (streamed, keep > 0) {
            sent = self.send_piece(slot, tokens, 0, keep, tx);
        }
        for (c, chunk) in rest.chunks(self.n_batch).enumerate() {
            let at = keep + c * self.n_batch;
            self.batch.clear();
            for (i, t) in chunk.iter().enumerate() {
                let logits = c == last_chunk && i == chunk.len() - 1;
                self.batch
                    .add(LlamaToken(*t), (at + i) as i32, &[0], logits)
                    .map_err(|e| EngineError::Decode(e.to_string()))?;
            }
            self.slots[slot]
                .ctx
                .decode(&mut self.batch)
                .map_err(|e| EngineError::Decode(e.to_string()))?;
            self.slots[slot].tokens.extend_from_slice(chunk);
            if c < last_chunk {
                if let (Some(tx), Some(from)) = (streamed, sent) {
                    sent = self.send_piece(slot, tokens, from, at + chunk.len(), tx);
                }
                // Other slots' steps reuse `self.batch`: the next batch refills it, and
                // the last (whose logits are sampled below) is not followed by this.
                between(self);
            }
        }
        let ctx = &self.slots[slot].ctx;
        let idx = self.batch.n_tokens() - 1;
        let id = sampling::sample(ctx, idx, self.n_vocab, params, tokens, 0, grammar.as_mut())
            .map_err(EngineError::Grammar)?;
        // Before the relayout, which leaves no logits.
        let first = self.sampled(id, slot, idx, params);
        if self.sliding_window {
            self.lay_out_as_imported(slot, pieces.is_some())?;
        }
        if !conversation {
            self.slots[slot].exact = tokens.len();
        }
        self.publish_kv();
        Ok(first)
    }

    /// Sends the state of `tokens[from..covered]` (all the slot holds) as a live piece;
    /// where the next piece starts, or `None` when this one failed or nobody reads them.
    pub(super) fn send_piece(
        &mut self,
        slot: usize,
        tokens: &[i32],
        from: usize,
        covered: usize,
        tx: &mpsc::UnboundedSender<Snapshot>,
    ) -> Option<usize> {
        if tx.is_closed() {
            return None;
        }
        let t0 = Instant::now();
        let state = self.export_from(slot, from).ok()?;
        let piece = Snapshot {
            state,
            tokens: tokens[..covered].to_vec(),
            from,
            last: 0,
            answered: 0,
            export_ms: ms(t0),
            head_digest: None,
        };
        tx.send(piece).ok().map(|()| covered)
    }

    /// A prefill command: the prompt prefilled (reusing what the slot holds), its first
    /// token, and its state exported when the answer goes on elsewhere.
    pub(super) fn prefill_cmd(
        &mut self,
        slot: usize,
        job: &PrefillJob,
        between: &mut dyn FnMut(&mut Self),
    ) -> Result<PrefillOutput, EngineError> {
        let PrefillJob {
            tokens,
            params,
            max_tokens,
            export,
            reuse,
        } = job;
        self.check_fits(tokens.len(), *max_tokens)?;
        let keep = self.reusable(slot, tokens, *reuse);
        let t0 = Instant::now();
        let first = self.prefill(slot, tokens, keep, params, between)?;
        let prefill_ms = ms(t0);
        let t1 = Instant::now();
        let continues = !first.eog && *max_tokens > 1;
        let state = match export {
            _ if !continues => None,
            Export::None => None,
            Export::Raw => Some(Exported::Raw(self.export(slot)?)),
        };
        Ok(PrefillOutput {
            prompt_tokens: tokens.to_vec(),
            cached_tokens: keep as u32,
            first,
            prefill_ms,
            state,
            export_ms: ms(t1),
        })
    }
}
