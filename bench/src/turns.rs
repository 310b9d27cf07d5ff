//! The multi-turn mix of `edgesplit-bench throughput` (`--turns N`): each closed-loop
//! client plays whole conversations of N turns, keeping its history (its own answers as
//! the assistant's messages) with `cache_prompt` on, so that a node holding a conversation
//! can continue it. Conversation `c` opens with a message of the mix's prompt length `c`
//! ("Station c." first, so no two conversations share a prefix) and answers with the mix's
//! answer length `c`; each later user message adds about `--turn-tokens` of new text.
//!
//! What the bench reports of a cell besides its rate: the state bytes that crossed for
//! the turns after the first (their handoffs, and what the prefill node sent after an
//! answer for the decode node to keep the conversation) against a full handoff of each
//! such turn's prompt, the share of their prompt tokens reused, and the turns whose decode
//! node was not the previous turn's.

use serde_json::{json, Value};

use crate::chat_bench;
use crate::client::{self, Ask, Measure, Target};
use crate::stack::Stack;

/// Request `i` of a conversation mix: conversation `i / turns`, turn `i % turns` (0-based).
pub fn place(i: usize, turns: usize) -> (usize, usize) {
    (i / turns, i % turns)
}

/// The user's message of request `i`.
pub fn message(mix: &[(usize, u32)], i: usize, turns: usize, turn_tokens: usize) -> String {
    let (c, t) = place(i, turns);
    chat_bench::user_message(c, t + 1, mix[c % mix.len()].0, turn_tokens)
}

/// Request `i`: its user message added to its conversation's `history`, and the request
/// of the whole conversation so far.
pub fn ask(
    history: &mut Vec<Value>,
    mix: &[(usize, u32)],
    i: usize,
    turns: usize,
    turn_tokens: usize,
    seed: u64,
) -> Ask {
    let (c, _) = place(i, turns);
    history.push(json!({"role": "user", "content": message(mix, i, turns, turn_tokens)}));
    Ask {
        prompt: String::new(),
        max_tokens: mix[c % mix.len()].1,
        chat: true,
        seed,
        messages: Some(Value::Array(history.clone())),
        cache_prompt: true,
    }
}

/// A turn's answer added to its conversation's `history`, as the assistant's message.
pub fn answered(history: &mut Vec<Value>, text: &str) {
    history.push(json!({"role": "assistant", "content": text}));
}

/// The longest conversation of the mix fits the nodes' context: its first message, every
/// later one and every answer, with room for the template's tokens.
pub fn check_fits(
    mix: &[(usize, u32)],
    turns: usize,
    turn_tokens: usize,
    n_ctx: u32,
) -> anyhow::Result<()> {
    let longest = mix
        .iter()
        .map(|&(p, a)| p + (turns - 1) * turn_tokens + turns * a as usize + 16 * turns)
        .max()
        .unwrap_or(0);
    anyhow::ensure!(
        longest <= n_ctx as usize,
        "--turns {turns}: the longest conversation of the mix (first message, {} later messages \
         of ~{turn_tokens} tokens, {turns} answers) needs ~{longest} tokens of context, more \
         than --n-ctx {n_ctx}: shorten --prompt-tokens, --max-tokens or --turn-tokens",
        turns - 1
    );
    Ok(())
}

/// With conversations, each node's `--parallel`: twice the most clients, so that a node
/// keeps every running conversation between its turns (a node gives up the least recently
/// taken of its free slots for a new conversation, and a conversation it gave up is
/// prefilled anew, whose answer is not the one continued from its cache); else the nodes'
/// own.
pub fn parallel(turns: usize, clients: &[usize]) -> Option<u32> {
    let most = clients.iter().copied().max()?;
    (turns > 1).then(|| u32::try_from(2 * most).unwrap_or(u32::MAX))
}

/// Each conversation played alone on `target` (the laptop alone), turn by turn: every
/// request's answer and end, indexed by request.
pub async fn reference(
    http: &reqwest::Client,
    target: &Target,
    mix: &[(usize, u32)],
    requests: usize,
    turns: usize,
    turn_tokens: usize,
    seed: u64,
) -> anyhow::Result<Vec<(String, f64)>> {
    let mut out = Vec::with_capacity(requests);
    let mut history = Vec::new();
    for i in 0..requests {
        if place(i, turns).1 == 0 {
            history.clear();
        }
        let a = ask(&mut history, mix, i, turns, turn_tokens, seed);
        let m = client::run(http, target, &a).await?;
        answered(&mut history, &m.text);
        out.push((m.text, m.e2e_ms));
    }
    Ok(out)
}

/// What crossed for a cell's later turns, and how much of them was reused.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct TurnStats {
    /// Answered turns after a conversation's first.
    pub later_turns: usize,
    /// Their handoffs' bytes.
    pub handoff_bytes: u64,
    /// State the prefill node sent over the cell after answers, for a decode node to keep
    /// the conversation (`v2-kept`; the last turns' included, though nothing uses them).
    pub kept_bytes: u64,
    /// A full handoff of each later turn's prompt (prompt tokens x KV bytes per token).
    pub full_state_bytes: u64,
    /// (handoffs + kept) / full state: the target is at most 0.10.
    pub bytes_ratio: Option<f64>,
    /// Of the later turns' prompt tokens, those whose KV a node reused.
    pub reused_share: Option<f64>,
    /// Later turns written on a decode node other than the previous turn's (both on one).
    pub node_changes: usize,
}

/// The summary's words on the conversations.
pub fn header(turns: usize, turn_tokens: usize, fresh: bool) -> String {
    format!(
        "Conversations of {turns} turns: each client plays whole conversations, the mix's \
         prompt length the first message's and its answer length every turn's, ~{turn_tokens} \
         tokens more a later turn; `cache_prompt` on; each cell on a stack of its own{}.\n",
        if fresh {
            ""
        } else {
            ", warmed by the mix's first requests in the cell's mode, each node serving twice \
             the most clients at once"
        }
    )
}

impl TurnStats {
    /// The summary's line on a cell's later turns.
    pub fn line(&self) -> String {
        let f = |x: Option<f64>, digits: usize| x.map_or("-".into(), |x| format!("{x:.digits$}"));
        format!(
            "{} turns after a conversation's first; state crossed for them {} bytes ({} in \
             handoffs, {} kept after answers) against {} for a full handoff of each: {}; \
             prompt tokens reused {}; turns on another decode node than the turn before: {}",
            self.later_turns,
            self.handoff_bytes + self.kept_bytes,
            self.handoff_bytes,
            self.kept_bytes,
            self.full_state_bytes,
            f(self.bytes_ratio, 3),
            f(self.reused_share, 2),
            self.node_changes
        )
    }
}

/// With conversations, a cell's [`TurnStats`] (the prefill node's `v2-kept` bytes were
/// `kept0` at its start; read again once no state has crossed for 2 s); else none.
pub async fn cell_stats(
    http: &reqwest::Client,
    stack: &Stack,
    kept0: u64,
    answers: &[(usize, &Measure)],
    turns: usize,
) -> anyhow::Result<Option<TurnStats>> {
    if turns < 2 {
        return Ok(None);
    }
    let kept = chat_bench::settled_kept_bytes(http, stack).await? - kept0;
    Ok(Some(stats(answers, turns, stack.kv_bytes_per_token, kept)))
}

/// The statistics of a cell's answers, `(request, answer)` in request order.
pub fn stats(
    answers: &[(usize, &Measure)],
    turns: usize,
    kv_bytes_per_token: u64,
    kept_bytes: u64,
) -> TurnStats {
    let mut s = TurnStats {
        kept_bytes,
        ..TurnStats::default()
    };
    let (mut prompt, mut reused) = (0u64, 0u64);
    let mut previous: Option<(usize, Option<&str>)> = None;
    for &(i, m) in answers {
        let (c, t) = place(i, turns);
        let node = m.decode_node.as_deref();
        if t > 0 {
            s.later_turns += 1;
            s.handoff_bytes += m.handoff_bytes.unwrap_or(0);
            s.full_state_bytes += m.prompt_tokens * kv_bytes_per_token;
            prompt += m.prompt_tokens;
            reused += m.cached_tokens.unwrap_or(0);
            if let Some((pc, Some(before))) = previous {
                if pc == c && node.is_some_and(|n| n != before) {
                    s.node_changes += 1;
                }
            }
        }
        previous = Some((c, node));
    }
    s.bytes_ratio = (s.full_state_bytes > 0)
        .then(|| (s.handoff_bytes + s.kept_bytes) as f64 / s.full_state_bytes as f64);
    s.reused_share = (prompt > 0).then(|| reused as f64 / prompt as f64);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(prompt: u64, cached: u64, bytes: u64, node: Option<&str>) -> Measure {
        Measure {
            prompt_tokens: prompt,
            cached_tokens: Some(cached),
            handoff_bytes: Some(bytes),
            decode_node: node.map(str::to_string),
            ..Measure::default()
        }
    }

    #[test]
    fn requests_are_conversations_of_consecutive_turns() {
        assert_eq!(place(0, 3), (0, 0));
        assert_eq!(place(2, 3), (0, 2));
        assert_eq!(place(3, 3), (1, 0));
        let mix = [(100, 32), (500, 128)];
        assert!(message(&mix, 0, 3, 200).starts_with("Station 0."));
        assert!(message(&mix, 3, 3, 200).starts_with("Station 1."));
        assert!(message(&mix, 1, 3, 200).starts_with("More readings"));
        assert_ne!(message(&mix, 1, 3, 200), message(&mix, 2, 3, 200));
    }

    #[test]
    fn the_first_turns_bytes_do_not_count_and_the_kept_bytes_do() {
        let a = answer(1000, 0, 9_000, Some("n1"));
        let b = answer(1200, 1000, 500, Some("n1"));
        let c = answer(1400, 1200, 0, Some("n2"));
        let d = answer(300, 0, 2_000, Some("n2"));
        let s = stats(&[(0, &a), (1, &b), (2, &c), (3, &d)], 3, 10, 1_500);
        assert_eq!(s.later_turns, 2);
        assert_eq!(s.handoff_bytes, 500);
        assert_eq!(s.full_state_bytes, 26_000);
        assert!((s.bytes_ratio.unwrap() - 2_000.0 / 26_000.0).abs() < 1e-9);
        assert!((s.reused_share.unwrap() - 2_200.0 / 2_600.0).abs() < 1e-9);
        // b -> c changed node; d opens the next conversation, so n2 -> n2 there is no change.
        assert_eq!(s.node_changes, 1);
    }

    #[test]
    fn a_conversation_longer_than_the_context_is_refused_by_name() {
        assert!(check_fits(&[(500, 128)], 4, 200, 4096).is_ok());
        let e = check_fits(&[(2000, 512)], 4, 200, 4096).unwrap_err();
        assert!(e.to_string().contains("--n-ctx 4096"), "{e}");
    }
}
