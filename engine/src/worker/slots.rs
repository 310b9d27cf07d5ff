//! The scheduler's calls on the worker ([`Slots`]): pick a slot, begin a request (prefill,
//! import or resume), step an answer, score, take a live snapshot, hand over, release.

use std::sync::atomic::Ordering;
use std::time::Instant;

use llama_cpp_2::token::LlamaToken;
use tokio::sync::mpsc;

use crate::cache::{self, Candidate};
use crate::command::{GenerateJob, PrefillJob};
use crate::sampling::{self, SamplingParams};
use crate::scheduler::Slots;
use crate::types::{
    EngineError, Finish, GenEvent, GenSummary, Input, PrefillOutput, Reuse, Snapshot, Start,
    TokenOut,
};

use super::{grammar, ms, Answer, LiveWindow, Worker};

impl Slots for Worker<'_> {
    type Answer = Answer;

    fn count(&self) -> usize {
        self.slots.len()
    }

    fn pick(&mut self, free: &[usize], want: Option<(&[i32], Reuse)>) -> usize {
        let candidates: Vec<Candidate> = free
            .iter()
            .map(|&slot| {
                let s = &self.slots[slot];
                Candidate::new(
                    slot,
                    s.held(),
                    s.used,
                    want,
                    self.n_batch,
                    self.sliding_window,
                )
            })
            .collect();
        let slot = cache::choose(&candidates).unwrap_or(free[0]);
        self.ticks += 1;
        let s = &mut self.slots[slot];
        s.used = self.ticks;
        s.busy = true;
        self.publish_kv();
        slot
    }

    fn tokenize(&mut self, input: Input) -> Result<Vec<i32>, EngineError> {
        Worker::tokenize(self, input)
    }

    fn prefill(
        &mut self,
        slot: usize,
        job: &PrefillJob,
        between: &mut dyn FnMut(&mut Self),
    ) -> Result<PrefillOutput, EngineError> {
        self.prefill_cmd(slot, job, between)
    }

    fn begin(
        &mut self,
        slot: usize,
        job: GenerateJob,
        events: &mpsc::UnboundedSender<GenEvent>,
        summary: &mut GenSummary,
        between: &mut dyn FnMut(&mut Self),
    ) -> Result<Option<Answer>, EngineError> {
        let GenerateJob {
            start,
            params,
            max_tokens,
            live: _,
            pieces,
        } = job;
        let params = &params;
        // Step 0 sampled the first token (on whichever node prefilled); a resumed answer
        // continues at the step after its last token.
        let mut step = 1u32;
        let start = match start {
            Start::Prompt(tokens) => Start::Cached {
                tokens,
                reuse: Reuse::Exact,
                max_uncached: None,
            },
            other => other,
        };
        let (history, first, budget) = match start {
            Start::Cached {
                tokens,
                reuse,
                max_uncached,
            } => {
                let keep = self.reusable(slot, &tokens, reuse);
                let uncached = tokens.len().saturating_sub(keep);
                let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
                // A bound asks to continue what is cached: nothing cached is refused too.
                if let Some(max_uncached) =
                    max_uncached.filter(|&m| keep == 0 || uncached > m as usize)
                {
                    return Err(EngineError::NotCached {
                        cached: count(keep),
                        prompt: count(tokens.len()),
                        max_uncached,
                    });
                }
                self.check_fits(tokens.len(), max_tokens)?;
                summary.prompt_tokens = count(tokens.len());
                summary.cached_tokens = count(keep);
                let t0 = Instant::now();
                let first =
                    self.prefill_in_pieces(slot, &tokens, keep, params, pieces.as_ref(), between)?;
                drop(pieces);
                summary.prefill_ms = ms(t0);
                let prefilled = GenEvent::Prefilled {
                    prompt_tokens: summary.prompt_tokens,
                    cached_tokens: summary.cached_tokens,
                    prefill_ms: summary.prefill_ms,
                };
                if events.send(prefilled).is_err()
                    || events.send(GenEvent::Token(first.clone())).is_err()
                {
                    summary.finish = Finish::Cancelled;
                    return Ok(None);
                }
                (tokens, first, max_tokens.saturating_sub(1))
            }
            Start::Imported {
                state,
                tokens,
                first,
                answered,
                base_digest,
            } => {
                // The first token was emitted by the prefill node; it counts there.
                self.check_fits(tokens.len(), max_tokens + 1)?;
                summary.prompt_tokens = tokens.len() as u32;
                let t0 = Instant::now();
                step = answered.max(1);
                // The prompt's KV came from a prefill (from 0, or for a tail from the cut);
                // the answer's from decode steps.
                let prompt = tokens.len() + 1 - (step as usize).min(tokens.len() + 1);
                match base_digest {
                    None => self.import(slot, &state, &tokens, prompt)?,
                    Some(digest) => {
                        let base = self.import_tail(slot, &state, &tokens, prompt, &digest)?;
                        summary.cached_tokens = u32::try_from(base).unwrap_or(u32::MAX);
                    }
                }
                summary.import_ms = ms(t0);
                (tokens, self.token_out(LlamaToken(first)), max_tokens)
            }
            Start::Prompt(_) => unreachable!("made a Start::Cached above"),
            Start::Resume {
                prompt,
                answer,
                reuse,
            } => {
                let Some((&last, before)) = answer.split_last() else {
                    return Err(EngineError::Decode(
                        "resume needs at least the first token of the answer".into(),
                    ));
                };
                self.check_fits(prompt.len() + answer.len(), max_tokens)?;
                summary.prompt_tokens = prompt.len() as u32;
                let t0 = Instant::now();
                // The same cut and batches as the original prefill (its sampled token is
                // not used).
                let keep = self.reusable(slot, &prompt, reuse);
                summary.cached_tokens = u32::try_from(keep).unwrap_or(u32::MAX);
                // A slot that holds exactly this prompt as a prefill from that cut left it
                // (the interrupted run's own slot, cut back to its prompt when the answer
                // was handed over: past the cut, no decoded token, and either every
                // position exact or the cut the end of the last decoded run, from which
                // the one prefill that wrote the rest started) has nothing to recompute.
                let s = &self.slots[slot];
                let run_end = s.decoded.last().map_or(0, |r| r.1);
                let held = !self.sliding_window
                    && s.tokens == prompt
                    && run_end <= keep
                    && (s.exact >= prompt.len() || (run_end > 0 && keep == run_end));
                if held {
                    summary.cached_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
                } else {
                    self.prefill(slot, &prompt, keep, params, between)?;
                }
                let mut history = prompt;
                for &t in before {
                    self.decode_one(slot, t, &mut history)?;
                }
                summary.prefill_ms = ms(t0);
                step = u32::try_from(answer.len()).unwrap_or(u32::MAX);
                (history, self.token_out(LlamaToken(last)), max_tokens)
            }
        };
        // A live answer's prompt state, laid out (sliding-window models).
        let window = self.slots[slot].laid_out.take().map(|bulk| LiveWindow {
            room: self
                .ring_cells
                .saturating_sub(edgesplit_proto::splice::narrowest(&bulk).unwrap_or(usize::MAX)),
            prompt: history.len(),
            bulk: Some(bulk),
        });
        if first.eog {
            summary.finish = Finish::Stop;
            return Ok(None);
        }
        if budget == 0 {
            return Ok(None);
        }
        // The answer so far: the last `step` tokens of the KV's and the newest.
        let mut answer = history[history.len().saturating_sub(step as usize - 1)..].to_vec();
        answer.push(first.id);
        let grammar = grammar(self.model, params, &answer)?;
        Ok(Some(Answer {
            params: params.clone(),
            history,
            last: first.id,
            step,
            budget,
            grammar,
            window,
        }))
    }

    fn step(&mut self, slot: usize, a: &mut Answer) -> Result<(TokenOut, bool), EngineError> {
        self.decode_one(slot, a.last, &mut a.history)?;
        let ctx = &self.slots[slot].ctx;
        let id = sampling::sample(
            ctx,
            0,
            self.n_vocab,
            &a.params,
            &a.history,
            a.step,
            a.grammar.as_mut(),
        )
        .map_err(EngineError::Grammar)?;
        a.step += 1;
        a.budget -= 1;
        a.last = id.0;
        Ok((self.sampled(id, slot, 0, &a.params), a.budget == 0))
    }

    fn score(
        &mut self,
        slot: usize,
        tokens: &[i32],
        from: usize,
        prefix: Option<&[u8]>,
        out: &mpsc::Sender<Result<Vec<f32>, EngineError>>,
    ) -> Result<(), EngineError> {
        self.check_fits(tokens.len(), 0)?;
        if from >= tokens.len() || (from == 0 && prefix.is_some()) {
            return Err(EngineError::Import(format!(
                "score from position {from} of {} tokens",
                tokens.len()
            )));
        }
        self.clear(slot);
        // The context: imported, or prefilled as a prompt is (so an exported prefill's
        // state, imported, holds the same numbers on the same machine).
        match prefix {
            Some(state) => {
                edgesplit_proto::layout::describe_state(state).ok_or_else(|| {
                    EngineError::Import("the prefix is not a sequence state".into())
                })?;
                self.import(slot, state, &tokens[..from], from)?;
            }
            None if from > 0 => {
                // A measurement: nothing else steps between its batches.
                let params = SamplingParams::default();
                self.prefill(slot, &tokens[..from], 0, &params, &mut |_| {})?;
            }
            None => {}
        }
        // Batches of at most 64 positions, each with its logits: llama.cpp keeps one row
        // of n_vocab floats per position asked for.
        let step = 64.min(self.n_batch);
        for (c, chunk) in tokens[from..].chunks(step).enumerate() {
            self.batch.clear();
            for (i, t) in chunk.iter().enumerate() {
                let pos = (from + c * step + i) as i32;
                self.batch
                    .add(LlamaToken(*t), pos, &[0], true)
                    .map_err(|e| EngineError::Decode(e.to_string()))?;
            }
            let ctx = &mut self.slots[slot].ctx;
            ctx.decode(&mut self.batch)
                .map_err(|e| EngineError::Decode(e.to_string()))?;
            for i in 0..chunk.len() {
                let logits = ctx.get_logits_ith(i as i32);
                let log_z = sampling::log_normaliser(logits);
                let logprobs = logits.iter().map(|l| l - log_z).collect();
                if out.blocking_send(Ok(logprobs)).is_err() {
                    return Ok(()); // the reader left
                }
            }
        }
        Ok(())
    }

    /// A live answer's state from position `from` on. On a sliding-window model the first
    /// piece is the state right after the prefill (answered 1), whenever it is asked for:
    /// a later export no longer holds the window's oldest cells, which the cache still
    /// does in their places. Later pieces are refused once the ring could have wrapped,
    /// and pieces of an answer that did not start live: the handoff is then cancelled.
    fn snapshot(
        &mut self,
        slot: usize,
        a: &mut Answer,
        from: usize,
        digest: bool,
    ) -> Result<Snapshot, EngineError> {
        let t0 = Instant::now();
        if self.sliding_window {
            let cut = |why: &str| EngineError::Export(format!("sliding-window state: {why}"));
            let w = a
                .window
                .as_mut()
                .ok_or_else(|| cut("only a live answer from its prompt is sent in pieces"))?;
            if from == 0 {
                let state = w
                    .bulk
                    .take()
                    .ok_or_else(|| cut("its first piece went already"))?;
                let prompt = w.prompt;
                return Ok(Snapshot {
                    state,
                    from,
                    tokens: a.history[..prompt].to_vec(),
                    last: a.history.get(prompt).copied().unwrap_or(a.last),
                    answered: 1,
                    export_ms: ms(t0),
                    head_digest: None,
                });
            }
            let written = a.history.len() - w.prompt;
            if written > w.room {
                return Err(cut(&format!(
                    "{written} positions written since the prefill, past the {} its ring \
                     holds in order",
                    w.room
                )));
            }
        }
        let state = self.export_from(slot, from)?;
        // `export_from` left the whole state in `export_buf` (from > 0).
        let head_digest = if digest && from > 0 {
            Some(
                edgesplit_proto::splice::head_digest(&self.export_buf, from)
                    .map_err(|e| EngineError::Export(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Snapshot {
            state,
            from,
            tokens: a.history.clone(),
            last: a.last,
            answered: a.step,
            export_ms: ms(t0),
            head_digest,
        })
    }

    /// The rest of the answer is written elsewhere: what this slot decoded of it would be
    /// only the start of the conversation's answer, which the next turn's prompt goes on
    /// past, so a continuation would prefill the rest in a batch where one device decoded
    /// it token by token. Only the prompt stays cached (nothing, for a ring cache): the
    /// answer's decoded run is cut away, the prompt's positions - a conversation's earlier
    /// turns and the new part prefilled after them - are kept, so that the answer can be
    /// replayed onto them as the decode node wrote it (`Start::Resume`, from the same cut).
    fn handed_over(&mut self, slot: usize) {
        if self.sliding_window {
            self.clear(slot);
        } else {
            let s = &self.slots[slot];
            let prompt = s
                .decoded
                .last()
                .filter(|(_, end)| *end == s.tokens.len())
                .map_or(s.tokens.len(), |(start, _)| *start);
            self.cut_back(slot, prompt);
        }
    }

    fn release(&mut self, slot: usize, keep: bool) {
        if !keep {
            self.clear(slot);
        }
        self.slots[slot].busy = false;
        self.publish_kv();
    }

    fn publish_active(&self, n: usize) {
        self.gauges.active.store(n as u64, Ordering::Relaxed);
    }
}
