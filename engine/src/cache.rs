//! The prefix cache's rules, as plain functions of what a slot holds: how much of a cached
//! sequence a prompt may reuse ([`reusable`]) and which free slot a job takes ([`choose`]).
//! The worker keeps each slot's sequence after its job ends and applies these; they are
//! unit-tested here with no model file.

use crate::types::Reuse;

/// A slot's cached sequence, as the rules see it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotView<'a> {
    /// Every token whose KV the slot holds, in position order.
    pub tokens: &'a [i32],
    /// Of `tokens`, the leading ones whose KV is what a prefill of them from position 0
    /// computes in this engine's batches (the slot prefilled them itself from 0, or
    /// imported such a prefill); the rest came from decode steps or a prefill that
    /// continued a conversation.
    pub exact: usize,
    /// The runs of positions `[start, end)` whose tokens were decoded one at a time (an
    /// answer), in order. A conversation may be cut anywhere in such a run: each of its
    /// tokens was a batch of its own. Not inside a prefill's batch: the tokens after the
    /// cut would be computed in other batches than those of the one device that prefilled
    /// them together.
    pub decoded: &'a [(usize, usize)],
}

/// Length of the common prefix of `a` and `b`.
pub(crate) fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How many leading tokens of `prompt` may keep the KV `held` has for them under `reuse`;
/// the rest is prefilled from there. Always leaves at least the prompt's last token to
/// prefill (its logits give the first answer token: the state holds no logits).
///
/// - [`Reuse::Exact`]: within the exact part, cut down to a multiple of `n_batch`, so the
///   rest is prefilled in the batches a whole prefill would use: the KV is then bit for bit
///   an uncached prefill's. None for a sliding-window model: after a prefill its cache is
///   laid out as an import would (`Worker::lay_out_as_imported`), not as the prefill left
///   it, and a cut-back ring has lost the cells before its window.
/// - [`Reuse::Conversation`]: the common prefix up to the furthest point that lies in a
///   run of decoded tokens (the conversation's earlier answers) - where one device
///   continuing its own copy of the conversation cuts too - when that is past what `Exact`
///   reuses; on a sliding-window model only when the prompt extends everything held (a
///   ring cannot be cut back). Otherwise as `Exact`, so that a repeated prompt still gets
///   the uncached answer.
pub(crate) fn reusable(
    held: SlotView<'_>,
    prompt: &[i32],
    reuse: Reuse,
    n_batch: usize,
    sliding_window: bool,
) -> usize {
    if reuse == Reuse::None || prompt.is_empty() || n_batch == 0 {
        return 0;
    }
    let lcp = common_prefix(held.tokens, prompt);
    let most = lcp.min(prompt.len() - 1);
    let exact = if sliding_window {
        0
    } else {
        most.min(held.exact) / n_batch * n_batch
    };
    if reuse == Reuse::Conversation {
        // The furthest cut at or before `most` after at least one token of a decoded run
        // (none of it: the prompt does not go on from that answer).
        let cut = held
            .decoded
            .iter()
            .filter(|(start, _)| *start < most)
            .map(|(_, end)| (*end).min(most))
            .max();
        if let Some(cut) = cut.filter(|&c| c > exact && c > 0) {
            if !sliding_window || cut == held.tokens.len() {
                return cut;
            }
        }
    }
    exact
}

/// A free slot, as [`choose`] weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub slot: usize,
    /// Tokens the job would reuse there ([`reusable`]).
    pub reusable: usize,
    /// Of them, the tokens decoded one at a time (a conversation's answers).
    pub decoded: usize,
    /// Taking it would cut away decoded tokens of a conversation the job does not go on
    /// from (it reuses at most the exact part).
    pub discards_conversation: bool,
    /// Holds nothing.
    pub empty: bool,
    /// When it was last taken (a counter).
    pub used: u64,
}

impl Candidate {
    /// How a job asking `prompt` under its reuse rule weighs `slot`, which holds `held`.
    pub(crate) fn new(
        slot: usize,
        held: SlotView<'_>,
        used: u64,
        prompt: Option<(&[i32], Reuse)>,
        n_batch: usize,
        sliding_window: bool,
    ) -> Self {
        let reusable = prompt.map_or(0, |(p, r)| reusable(held, p, r, n_batch, sliding_window));
        let decoded = held
            .decoded
            .iter()
            .map(|(start, end)| (*end).min(reusable).saturating_sub(*start))
            .sum();
        Candidate {
            slot,
            reusable,
            decoded,
            discards_conversation: reusable <= held.exact
                && held.decoded.iter().any(|(_, end)| *end > reusable),
            empty: held.tokens.is_empty(),
            used,
        }
    }
}

/// The slot a job takes. First, one where it keeps every conversation it does not go on
/// from (a prefix reused exactly is not worth another client's conversation); among those,
/// the one it reuses most of; between equal reuses, the one whose reused part holds the
/// most decoded tokens (the same tokens may be held as a conversation, written turn by
/// turn, and as a prompt prefilled whole - another client sent the conversation so far as
/// one prompt - and the conversation is what one device going on from it holds); then an
/// empty one; then the least recently used (whose cache is the one given up).
///
/// Not known here: how a state imported from the prefill node was computed before its
/// answer (its prompt counts as prefilled from 0), so where two copies of a conversation
/// differ in length the longer one is taken, whatever its history.
pub(crate) fn choose(candidates: &[Candidate]) -> Option<usize> {
    candidates
        .iter()
        .max_by_key(|c| {
            (
                !c.discards_conversation,
                c.reusable,
                c.decoded,
                c.empty,
                std::cmp::Reverse(c.used),
            )
        })
        .map(|c| c.slot)
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: usize = 4;

    /// Held tokens: a prompt of `exact` prefilled, the rest decoded.
    fn held(tokens: &[i32], exact: usize) -> SlotView<'_> {
        let decoded: &'static [(usize, usize)] = if exact < tokens.len() {
            Box::leak(vec![(exact, tokens.len())].into_boxed_slice())
        } else {
            &[]
        };
        SlotView {
            tokens,
            exact,
            decoded,
        }
    }

    #[test]
    fn exact_reuse_stops_at_a_batch_boundary_inside_the_prefilled_part() {
        let cached: Vec<i32> = (0..10).collect();
        // Prefilled 10, the prompt shares 9: two whole batches of 4.
        let mut prompt: Vec<i32> = (0..9).collect();
        prompt.push(99);
        assert_eq!(
            reusable(held(&cached, 10), &prompt, Reuse::Exact, B, false),
            8
        );
        // Only 7 were prefilled (3 decoded after): one batch.
        assert_eq!(
            reusable(held(&cached, 7), &prompt, Reuse::Exact, B, false),
            4
        );
        // Less than a batch in common: nothing.
        assert_eq!(
            reusable(held(&cached, 10), &[0, 1, 2, 7], Reuse::Exact, B, false),
            0
        );
    }

    #[test]
    fn the_last_prompt_token_is_always_prefilled() {
        let cached: Vec<i32> = (0..8).collect();
        // The same 8 tokens again: the 8th is prefilled, so the exact cut is at 4.
        assert_eq!(
            reusable(held(&cached, 8), &cached, Reuse::Exact, B, false),
            4
        );
        // Continuing a conversation that holds them all (decoded past the exact 2):
        // everything but the last.
        assert_eq!(
            reusable(held(&cached, 2), &cached, Reuse::Conversation, B, false),
            7
        );
    }

    #[test]
    fn a_conversation_reuses_decoded_tokens_and_a_repeated_prompt_does_not() {
        // A prompt of 6, then 4 answer tokens decoded.
        let cached: Vec<i32> = (0..10).collect();
        let mut next: Vec<i32> = (0..10).collect();
        next.extend([50, 51, 52]);
        assert_eq!(
            reusable(held(&cached, 6), &next, Reuse::Conversation, B, false),
            10
        );
        assert_eq!(reusable(held(&cached, 6), &next, Reuse::Exact, B, false), 4);
        // An edited earlier message: only the common prefix, 8 (past the exact 6).
        let mut edited: Vec<i32> = (0..8).collect();
        edited.extend([70, 71]);
        assert_eq!(
            reusable(held(&cached, 6), &edited, Reuse::Conversation, B, false),
            8
        );
        // The same prompt again (nothing decoded in common): the uncached answer's cut.
        let prompt: Vec<i32> = (0..6).chain([80]).collect();
        assert_eq!(
            reusable(held(&cached, 6), &prompt, Reuse::Conversation, B, false),
            4
        );
        assert_eq!(reusable(held(&cached, 6), &next, Reuse::None, B, false), 0);
    }

    #[test]
    fn a_conversation_is_cut_only_where_answers_were_decoded() {
        // Prompt 0..6 prefilled, answer 6..10 decoded, next turn's prompt 10..14
        // prefilled in one batch (continuing), its answer 14..16 decoded.
        let cached: Vec<i32> = (0..16).collect();
        let h = SlotView {
            tokens: &cached,
            exact: 6,
            decoded: &[(6, 10), (14, 16)],
        };
        // The same second-turn prompt again (0..14): not cut inside its batch at 13, but
        // where the answer before it ended, as the first time.
        let again: Vec<i32> = (0..14).collect();
        assert_eq!(reusable(h, &again, Reuse::Conversation, B, false), 10);
        // A third turn going on from all of it: everything.
        let third: Vec<i32> = (0..16).chain([90, 91]).collect();
        assert_eq!(reusable(h, &third, Reuse::Conversation, B, false), 16);
        // An edit inside the second answer: cut there.
        let edited: Vec<i32> = (0..15).chain([90]).collect();
        assert_eq!(reusable(h, &edited, Reuse::Conversation, B, false), 15);
        // An edit inside the second prompt: back to the end of the first answer.
        let edited: Vec<i32> = (0..12).chain([90]).collect();
        assert_eq!(reusable(h, &edited, Reuse::Conversation, B, false), 10);
    }

    #[test]
    fn a_sliding_window_cache_is_only_extended() {
        let cached: Vec<i32> = (0..10).collect();
        let mut next = cached.clone();
        next.push(11);
        assert_eq!(
            reusable(held(&cached, 6), &next, Reuse::Conversation, B, true),
            10
        );
        // Cutting back the ring: no.
        let mut edited: Vec<i32> = (0..8).collect();
        edited.push(70);
        assert_eq!(
            reusable(held(&cached, 6), &edited, Reuse::Conversation, B, true),
            0
        );
        assert_eq!(reusable(held(&cached, 10), &next, Reuse::Exact, B, true), 0);
    }

    #[test]
    fn a_job_takes_the_slot_it_reuses_most_else_an_empty_else_the_oldest() {
        let c = |slot, reusable, empty, used| Candidate {
            slot,
            reusable,
            decoded: 0,
            discards_conversation: false,
            empty,
            used,
        };
        assert_eq!(
            choose(&[c(0, 0, false, 1), c(1, 8, false, 9), c(2, 0, true, 0)]),
            Some(1)
        );
        assert_eq!(
            choose(&[c(0, 0, false, 1), c(1, 0, true, 9), c(2, 0, false, 0)]),
            Some(1)
        );
        assert_eq!(
            choose(&[c(0, 0, false, 5), c(1, 0, false, 2), c(2, 0, false, 7)]),
            Some(1)
        );
        assert_eq!(choose(&[]), None);
    }

    #[test]
    fn conversations_are_kept_and_preferred_to_the_same_tokens_prefilled_whole() {
        // A conversation: prompt 0..6, answer 6..10 decoded.
        let conv: Vec<i32> = (0..10).collect();
        let conversation = SlotView {
            tokens: &conv,
            exact: 6,
            decoded: &[(6, 10)],
        };
        // The same ten tokens sent as one prompt and prefilled whole, then 10..12 decoded.
        let whole: Vec<i32> = (0..12).collect();
        let prefilled = SlotView {
            tokens: &whole,
            exact: 10,
            decoded: &[(10, 12)],
        };
        let empty = SlotView {
            tokens: &[],
            exact: 0,
            decoded: &[],
        };
        let cand = |slot: usize, held, prompt: &[i32], reuse| {
            Candidate::new(slot, held, slot as u64, Some((prompt, reuse)), B, false)
        };
        // Going on from ten tokens: the conversation reuses all ten, the prompt prefilled
        // whole an exact 8 (its decoded run starts after them).
        let next: Vec<i32> = (0..10).chain([50, 51]).collect();
        let a = cand(0, prefilled, &next, Reuse::Conversation);
        let b = cand(1, conversation, &next, Reuse::Conversation);
        assert_eq!((a.reusable, b.reusable), (8, 10));
        assert_eq!(choose(&[a, b]), Some(1));
        // Held as far in both (the whole prompt's slot decoded nothing further): the
        // conversation is taken.
        let whole10: Vec<i32> = (0..10).collect();
        let prefilled10 = SlotView {
            tokens: &whole10,
            exact: 8,
            decoded: &[(8, 10)],
        };
        let further: Vec<i32> = (0..10).chain([50]).collect();
        let a = cand(0, prefilled10, &further, Reuse::Conversation);
        let b = cand(1, conversation, &further, Reuse::Conversation);
        assert_eq!(
            (a.reusable, a.decoded, b.reusable, b.decoded),
            (10, 2, 10, 4)
        );
        assert_eq!(choose(&[a, b]), Some(1));
        // An unrelated prompt sharing the first 4 tokens: an empty slot, not an exact
        // reuse that would cut the conversation's answer away.
        let other: Vec<i32> = (0..4).chain([70, 71, 72]).collect();
        let a = cand(0, conversation, &other, Reuse::Exact);
        let b = cand(1, empty, &other, Reuse::Exact);
        assert!(a.discards_conversation && a.reusable == 4);
        assert_eq!(choose(&[a, b]), Some(1));
        // The same turn again cuts its own conversation back: not a discard.
        let again: Vec<i32> = (0..10).chain([60]).collect();
        let a = cand(0, conversation, &again, Reuse::Conversation);
        assert!(!a.discards_conversation && a.reusable == 10);
        // Equal reuse: the one with more decoded tokens in it.
        let x = Candidate {
            slot: 0,
            reusable: 10,
            decoded: 2,
            discards_conversation: false,
            empty: false,
            used: 0,
        };
        let y = Candidate {
            slot: 1,
            decoded: 6,
            used: 9,
            ..x
        };
        assert_eq!(choose(&[x, y]), Some(1));
    }
}
