//! One decode step and the sampling of its token: a token's text, its log-probabilities.

use llama_cpp_2::token::LlamaToken;

use crate::sampling::{self, SamplingParams};
use crate::types::{EngineError, TokenLogprobs, TokenOut, TopLogprob};

use super::Worker;

impl Worker<'_> {
    /// Token `id` with its text (none for end-of-generation).
    pub(super) fn token_out(&self, id: LlamaToken) -> TokenOut {
        let eog = self.model.vocab().is_eog(id);
        TokenOut {
            id: id.0,
            piece: if eog { Vec::new() } else { self.piece(id) },
            eog,
            logprobs: None,
        }
    }

    pub(super) fn piece(&self, id: LlamaToken) -> Vec<u8> {
        self.model.vocab().token_to_piece(id, false, None)
    }

    /// The token `id` just sampled in `slot` from the logits at batch index `idx`, with its
    /// log-probabilities when `params` ask for them.
    pub(super) fn sampled(
        &self,
        id: LlamaToken,
        slot: usize,
        idx: i32,
        params: &SamplingParams,
    ) -> TokenOut {
        let mut out = self.token_out(id);
        if let (Some(n), false) = (params.logprobs, out.eog) {
            let logits = self.slots[slot].ctx.get_logits_ith(idx);
            let n = n.min(sampling::MAX_TOP_LOGPROBS) as usize;
            let (logprob, top) = sampling::logprobs(logits, id.0, n);
            let top = top
                .into_iter()
                .map(|(t, logprob)| TopLogprob {
                    id: t,
                    piece: self.piece(LlamaToken(t)),
                    logprob,
                })
                .collect();
            out.logprobs = Some(TokenLogprobs { logprob, top });
        }
        out
    }

    /// Appends `token` to the slot's sequence at the next position: one single-token
    /// decode, as every generated token is decoded.
    pub(super) fn decode_one(
        &mut self,
        slot: usize,
        token: i32,
        history: &mut Vec<i32>,
    ) -> Result<(), EngineError> {
        let pos = history.len() as i32;
        history.push(token);
        self.batch.clear();
        self.batch
            .add(LlamaToken(token), pos, &[0], true)
            .map_err(|e| EngineError::Decode(e.to_string()))?;
        self.slots[slot]
            .ctx
            .decode(&mut self.batch)
            .map_err(|e| EngineError::Decode(e.to_string()))?;
        let s = &mut self.slots[slot];
        let at = s.tokens.len();
        match s.decoded.last_mut() {
            Some(run) if run.1 == at => run.1 += 1,
            _ => s.decoded.push((at, at + 1)),
        }
        s.tokens.push(token);
        self.publish_kv();
        Ok(())
    }
}
