//! Where a split request's prompt is prefilled. The decode node keeps each conversation it
//! wrote (its engine's prefix cache); when a request continues one, the decode node can
//! prefill just the new part itself and nothing crosses the link. The router remembers
//! which conversations ended there ([`Conversations`]) and, from the figures it measured
//! ([`Rates`]), how many uncached tokens the decode node may prefill before sending the
//! prompt to the prefill node would be sooner ([`Rates::max_uncached`]). The decode node
//! checks the exact count against its cache and refuses (`not_cached`) past that bound;
//! the request is then split as any other. ARCHITECTURE.md, "Conversations", states the
//! rule.

use std::collections::VecDeque;
use std::time::Instant;

use crate::api::{Input, Message};
use crate::estimate::Estimate;

/// Conversations remembered at most (the decode node's cache holds `--parallel` of them;
/// an entry it no longer holds costs one refused call, then is forgotten).
const MAX_CONVERSATIONS: usize = 64;
/// Characters of conversation text remembered at most, all entries together.
const MAX_CHARS: usize = 4 << 20;

/// A conversation as its next request would start: the request's input, and the answer.
#[derive(Debug, Clone, PartialEq)]
enum Key {
    /// The messages and the answer (which the next request sends as an `assistant`
    /// message).
    Chat(Vec<Message>, String),
    /// The prompt followed by the answer.
    Prompt(String),
}

impl Key {
    fn of(input: &Input, answer: &str) -> Key {
        match input {
            Input::Chat(m) => Key::Chat(m.clone(), answer.to_string()),
            Input::Prompt(p) => Key::Prompt(format!("{p}{answer}")),
        }
    }

    fn chars(&self) -> usize {
        match self {
            Key::Chat(m, a) => a.len() + m.iter().map(message_chars).sum::<usize>(),
            Key::Prompt(p) => p.len(),
        }
    }

    /// `input` goes on from this conversation (and says something after it).
    fn continued_by(&self, input: &Input) -> bool {
        match (self, input) {
            (Key::Chat(held, answer), Input::Chat(msgs)) => {
                let n = held.len();
                msgs.len() > n + 1
                    && msgs[..n] == held[..]
                    && msgs[n].role == "assistant"
                    && msgs[n].tool_calls.is_empty()
                    && !msgs[n].content.trim().is_empty()
                    && answer.trim_start().starts_with(msgs[n].content.trim())
            }
            (Key::Prompt(held), Input::Prompt(p)) => p.len() > held.len() && p.starts_with(held),
            _ => false,
        }
    }
}

/// A message's size as remembered.
/// The characters of a request's input (its messages' text, or its prompt).
#[must_use]
pub fn input_chars(input: &Input) -> usize {
    match input {
        Input::Chat(m) => m.iter().map(message_chars).sum(),
        Input::Prompt(p) => p.len(),
    }
}

fn message_chars(m: &Message) -> usize {
    m.role.len()
        + m.content.len()
        + m.tool_call_id.as_ref().map_or(0, String::len)
        + m.tool_calls
            .iter()
            .map(|c| c.id.len() + c.name.len() + c.arguments.len())
            .sum::<usize>()
}

/// Which node holds a remembered conversation as one device continuing it would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copies {
    /// The decode node alone (it wrote the last answer).
    DecodeNode,
    /// The decode node, and the prefill node is replaying its last answer
    /// ([`Conversations::replaying`]): both alike once that ends.
    Replaying,
    /// Both alike: the prefill node replayed the decode node's last answer.
    Both,
    /// The prefill node answered a later turn itself ([`Conversations::went_on_on_prefill_node`]):
    /// the decode node's copy ends before that turn's answer, which it could only prefill
    /// (not the decode steps that wrote it), so only a tail onto its copy continues there.
    PrefillNodeAhead,
}

/// The conversations whose last answer the decode node wrote, most recent last.
#[derive(Debug, Default)]
pub struct Conversations {
    /// Each with the tokens the decode node holds and which nodes hold it.
    entries: VecDeque<(Key, u32, Copies)>,
}

impl Conversations {
    /// The decode node ended the answer `answer` to `input`, holding `held` tokens of it.
    pub fn record(&mut self, input: &Input, answer: &str, held: u32) {
        let key = Key::of(input, answer);
        // Another client may hold the same conversation so far and still go on from the
        // turn this one continued: entries go by age and size, not superseded.
        self.entries.retain(|(k, _, _)| *k != key);
        self.entries.push_back((key, held, Copies::DecodeNode));
        let mut chars: usize = self.entries.iter().map(|(k, _, _)| k.chars()).sum();
        while self.entries.len() > MAX_CONVERSATIONS
            || (chars > MAX_CHARS && self.entries.len() > 1)
        {
            if let Some((k, _, _)) = self.entries.pop_front() {
                chars -= k.chars();
            }
        }
    }

    /// The prefill node now holds the conversation `record`ed with `input` and `answer`
    /// as the decode node does (the answer replayed there step by step).
    pub fn replayed(&mut self, input: &Input, answer: &str) {
        self.set(
            input,
            answer,
            &[Copies::DecodeNode, Copies::Replaying],
            Copies::Both,
        );
    }

    /// The prefill node replays the answer `answer` to `input` (`record`ed), in the
    /// background: [`Conversations::replayed`] or [`Conversations::not_replayed`] follows.
    pub fn replaying(&mut self, input: &Input, answer: &str) {
        self.set(input, answer, &[Copies::DecodeNode], Copies::Replaying);
    }

    /// The prefill node's replay of `answer` to `input` ended without finishing.
    pub fn not_replayed(&mut self, input: &Input, answer: &str) {
        self.set(input, answer, &[Copies::Replaying], Copies::DecodeNode);
    }

    fn set(&mut self, input: &Input, answer: &str, from: &[Copies], to: Copies) {
        let key = Key::of(input, answer);
        for (k, _, c) in &mut self.entries {
            if *k == key && from.contains(c) {
                *c = to;
            }
        }
    }

    /// The characters of the longest remembered conversation that `input` continues (its
    /// messages and answer, as [`input_chars`] counts them): the rest of `input` is new.
    #[must_use]
    pub fn held_chars(&self, input: &Input) -> Option<usize> {
        self.longest(input).map(|(k, _, _)| k.chars())
    }

    /// Which nodes hold the longest remembered conversation that `input` continues.
    #[must_use]
    pub fn copies(&self, input: &Input) -> Option<Copies> {
        self.longest(input).map(|(_, _, c)| *c)
    }

    /// The prefill node answers `input`, a turn of a conversation both nodes hold,
    /// itself: from then on only a tail continues it on the decode node.
    pub fn went_on_on_prefill_node(&mut self, input: &Input) {
        if let Some(c @ Copies::Both) = self.longest_copies(input) {
            *c = Copies::PrefillNodeAhead;
        }
    }

    /// The prefill node did not hold the conversation `input` continues after all (its
    /// copy evicted): the decode node's copy is the one to go on from.
    pub fn prefill_node_lost(&mut self, input: &Input) {
        if let Some(c) = self.longest_copies(input) {
            *c = Copies::DecodeNode;
        }
    }

    fn longest_copies(&mut self, input: &Input) -> Option<&mut Copies> {
        self.entries
            .iter_mut()
            .filter(|(k, _, _)| k.continued_by(input))
            .max_by_key(|(_, held, _)| *held)
            .map(|(_, _, c)| c)
    }

    fn longest(&self, input: &Input) -> Option<&(Key, u32, Copies)> {
        self.entries
            .iter()
            .filter(|(k, _, _)| k.continued_by(input))
            .max_by_key(|(_, held, _)| *held)
    }

    /// Tokens the decode node holds of the longest remembered conversation that `input`
    /// continues.
    #[must_use]
    pub fn find(&self, input: &Input) -> Option<u32> {
        self.longest(input).map(|(_, held, _)| *held)
    }

    /// The decode node did not hold what `input` continues: forget it.
    pub fn forget(&mut self, input: &Input) {
        self.entries.retain(|(k, _, _)| !k.continued_by(input));
    }
}

/// An exponentially weighted mean of a measured rate.
#[derive(Debug, Clone, Copy, Default)]
struct Ewma(Option<f64>);

impl Ewma {
    fn add(&mut self, v: f64) {
        if v.is_finite() && v > 0.0 {
            self.0 = Some(self.0.map_or(v, |m| 0.7 * m + 0.3 * v));
        }
    }
}

/// Dynamo's default rule, used until the decode node's prefill speed has been measured:
/// prefill on the decode worker when at most this many tokens are not cached there, and
/// they are at most 70% of the prompt.
pub const DEFAULT_MAX_UNCACHED: u32 = 2048;

/// Least prompt tokens a prefill must compute for its speed to be measured (shorter ones
/// are mostly fixed costs).
const MIN_MEASURED_TOKENS: u32 = 32;

/// What the router has measured of the nodes and the link: one [`Estimate`] per device
/// and quantity, fed by every answer (and probe) that measures it. In a pool of decode
/// nodes each pair has its own `Rates`, and they share one [`PrefillSide`]
/// ([`Rates::beside`]): the prefill node is one device, whichever pair's answer measured it.
#[derive(Debug, Default)]
pub struct Rates {
    /// The prefill node's figures and the workload's, shared by the pairs of a pool.
    shared: std::sync::Arc<std::sync::Mutex<PrefillSide>>,
    /// The decode node's prefill speed in tokens per millisecond (prompts it continued or
    /// answered itself, its probes).
    decode_node: Estimate,
    /// Handoff goodput, bytes per millisecond.
    link: Estimate,
    /// The decode node's decode speed in tokens per millisecond (the answers it wrote).
    decode_node_decode: Estimate,
    /// The round trip of an `Info` call to the decode node, milliseconds.
    decode_node_rtt: Estimate,
}

/// What every pair of a pool measures alike: the prefill node's speeds and the requests'
/// sizes.
#[derive(Debug, Default)]
pub struct PrefillSide {
    /// Prefill speed in tokens per millisecond (split prefills, colocated answers, probes).
    prefill: Estimate,
    /// Decode speed in tokens per millisecond (colocated answers, a live answer's tokens
    /// before the switch).
    decode: Estimate,
    /// Input characters per prompt token (chat template included), as tokenized.
    chars_per_token: Ewma,
    /// The length in tokens of the answers whose request set no `max_tokens` (each ended
    /// by itself: a stop, a tool call, or the context's end).
    answer_tokens: Ewma,
}

/// What wants measuring at a moment ([`Rates::stale`]): a device's prefill or decode
/// speed, or the link's goodput, unknown or not refreshed for [`crate::estimate::STALE_AFTER`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stale {
    pub prefill_node: bool,
    pub decode_node: bool,
    pub link: bool,
}

/// Answer tokens expected of a request that sets no `max_tokens`, until such an answer
/// has ended (llama-server's and OpenAI's own default lengths are far longer; this is a
/// chat turn's order of size).
pub const DEFAULT_ANSWER_TOKENS: f64 = 256.0;

/// Characters per token until measured (English text in a BPE vocabulary).
const DEFAULT_CHARS_PER_TOKEN: f64 = 4.0;

/// The rates measured so far (`None`: not yet), as the cost model reads them
/// (`backend/cost.rs`): tokens or bytes per millisecond, and milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Measured {
    pub prefill_node_prefill: Option<f64>,
    pub prefill_node_decode: Option<f64>,
    pub decode_node_prefill: Option<f64>,
    pub decode_node_decode: Option<f64>,
    pub link: Option<f64>,
    pub rtt_ms: Option<f64>,
}

/// Least answer tokens a decode must write for its speed to be measured.
const MIN_MEASURED_STEPS: u32 = 8;

impl Rates {
    /// The rates of another decode node's pair: the same prefill side, the decode node's
    /// and the link's figures its own (none yet).
    #[must_use]
    pub fn beside(&self) -> Rates {
        Rates {
            shared: self.shared.clone(),
            ..Rates::default()
        }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, PrefillSide> {
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The prefill node's prefill speed.
    fn prefill_node(&self) -> Option<f64> {
        self.shared().prefill.value()
    }

    /// A prefill computed `tokens` (the uncached part of its prompt) in `ms`, on the decode
    /// node or the prefill node (a split's or a colocated answer's alike).
    pub fn prefilled(&mut self, on_decode_node: bool, tokens: u32, ms: f64) {
        if tokens >= MIN_MEASURED_TOKENS && ms > 0.0 {
            let v = f64::from(tokens) / ms;
            if on_decode_node {
                self.decode_node.add(v);
            } else {
                self.shared().prefill.add(v);
            }
        }
    }

    /// A node wrote `tokens` answer tokens in `ms` of decoding.
    pub fn decoded(&mut self, on_decode_node: bool, tokens: u32, ms: f64) {
        if tokens >= MIN_MEASURED_STEPS && ms > 0.0 {
            let v = f64::from(tokens) / ms;
            if on_decode_node {
                self.decode_node_decode.add(v);
            } else {
                self.shared().decode.add(v);
            }
        }
    }

    /// A prompt of `chars` input characters was `tokens` tokens.
    pub fn prompt_seen(&mut self, chars: usize, tokens: u32) {
        if tokens >= MIN_MEASURED_TOKENS {
            self.shared()
                .chars_per_token
                .add(chars as f64 / f64::from(tokens));
        }
    }

    /// The prompt tokens expected of `chars` input characters.
    #[must_use]
    pub fn tokens_of(&self, chars: usize) -> f64 {
        chars as f64
            / self
                .shared()
                .chars_per_token
                .0
                .unwrap_or(DEFAULT_CHARS_PER_TOKEN)
    }

    /// An answer whose request set no `max_tokens` ended after `tokens` tokens.
    pub fn answered(&mut self, tokens: u32) {
        self.shared().answer_tokens.add(f64::from(tokens));
    }

    /// The answer tokens a request with `max_tokens` (0: none set) is expected to write:
    /// `max_tokens`, else the mean length of the answers that set none
    /// ([`DEFAULT_ANSWER_TOKENS`] until one has ended).
    #[must_use]
    pub fn expected_answer(&self, max_tokens: u32) -> f64 {
        if max_tokens > 0 {
            f64::from(max_tokens)
        } else {
            self.shared()
                .answer_tokens
                .0
                .unwrap_or(DEFAULT_ANSWER_TOKENS)
        }
    }

    /// An `Info` call to the decode node took `ms` there and back.
    pub fn round_trip(&mut self, ms: f64) {
        self.decode_node_rtt.add(ms);
    }

    /// What is measured so far.
    #[must_use]
    pub fn measured(&self) -> Measured {
        Measured {
            prefill_node_prefill: self.prefill_node(),
            prefill_node_decode: self.shared().decode.value(),
            decode_node_prefill: self.decode_node.value(),
            decode_node_decode: self.decode_node_decode.value(),
            link: self.link.value(),
            rtt_ms: self.decode_node_rtt.value(),
        }
    }

    /// What wants measuring at `now`: each device's speeds and the link's goodput, unknown
    /// or stale.
    #[must_use]
    pub fn stale(&self, now: Instant) -> Stale {
        Stale {
            prefill_node: {
                let shared = self.shared();
                shared.prefill.stale(now) || shared.decode.stale(now)
            },
            decode_node: self.decode_node.stale(now) || self.decode_node_decode.stale(now),
            link: self.link.stale(now),
        }
    }

    /// A handoff moved `bytes` in `ms`.
    pub fn handed_off(&mut self, bytes: u64, ms: f64) {
        if bytes > 0 && ms > 0.0 {
            self.link.add(bytes as f64 / ms);
        }
    }

    /// Whether the prefill node prefills a token and ships its KV sooner than the decode
    /// node prefills it (`1/p + b/g < 1/d`, both speeds measured): then a new turn goes
    /// to the prefill node whenever it holds the conversation too, whatever its length
    /// (only the new part's KV crosses), and the decode node's answers are worth
    /// replaying there.
    #[must_use]
    pub fn prefill_node_sooner(&self, kv_bytes_per_token: u64) -> bool {
        let (Some(d), Some(p)) = (self.decode_node.value(), self.prefill_node()) else {
            return false;
        };
        let cross = self
            .link
            .value()
            .map_or(0.0, |g| kv_bytes_per_token as f64 / g);
        1.0 / p + cross < 1.0 / d
    }

    /// The most tokens the decode node may prefill itself for a prompt that continues a
    /// conversation of which it holds `held` tokens. The decode node prefilling `u` new
    /// tokens takes `u / d`; splitting takes the prefill node's prefill of the prompt
    /// (`held + u` tokens at `p`) and the state's crossing (`(held + u) x b / g` at the
    /// link's goodput `g`) before the decode node can write. So the decode node goes when
    /// `u / d <= (held + u) (1/p + b/g)`, that is `u <= held (1/p + b/g) / (1/d - 1/p -
    /// b/g)` (no bound when the divisor is not positive: the decode node is always
    /// sooner). Until `d` or `p` has been measured: Dynamo's rule (fewer than 2,048
    /// tokens and at most 70% of the prompt).
    #[must_use]
    pub fn max_uncached(&self, held: u32, kv_bytes_per_token: u64) -> u32 {
        let (Some(d), Some(p)) = (self.decode_node.value(), self.prefill_node()) else {
            // u <= 0.7 (held + u)  <=>  u <= held x 7 / 3
            let share = u64::from(held) * 7 / 3;
            return DEFAULT_MAX_UNCACHED.min(u32::try_from(share).unwrap_or(u32::MAX));
        };
        let cross = self
            .link
            .value()
            .map_or(0.0, |g| kv_bytes_per_token as f64 / g);
        let later = 1.0 / p + cross;
        let divisor = 1.0 / d - later;
        if divisor <= 0.0 {
            return u32::MAX;
        }
        (f64::from(held) * later / divisor).min(f64::from(u32::MAX)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two pairs of a pool: what either measures of the prefill node (speeds, prompt
    /// sizes, answer lengths) is one estimate; each decode node's and link's figures are
    /// its pair's own.
    #[test]
    fn pairs_beside_each_other_share_the_prefill_node_and_not_the_decode_node() {
        let mut first = Rates::default();
        let mut second = first.beside();
        first.prefilled(false, 100, 50.0);
        second.prefilled(false, 100, 50.0);
        second.prefilled(false, 100, 25.0);
        second.decoded(false, 10, 100.0);
        first.prompt_seen(400, 100);
        second.answered(40);
        first.prefilled(true, 100, 100.0);
        second.handed_off(1000, 10.0);
        for r in [&first, &second] {
            let m = r.measured();
            assert_eq!(m.prefill_node_prefill, Some(2.0));
            assert_eq!(m.prefill_node_decode, Some(0.1));
            assert_eq!(r.tokens_of(400), 100.0);
            assert_eq!(r.expected_answer(0), 40.0);
        }
        assert_eq!(first.measured().decode_node_prefill, Some(1.0));
        assert_eq!(second.measured().decode_node_prefill, None);
        assert_eq!(first.measured().link, None);
        assert_eq!(second.measured().link, Some(100.0));
    }

    fn chat(msgs: &[(&str, &str)]) -> Input {
        Input::Chat(msgs.iter().map(|(r, c)| Message::text(*r, *c)).collect())
    }

    /// A request's `max_tokens` is what it is expected to write; without one, the mean
    /// length of the answers that set none, the default before any ended.
    #[test]
    fn an_answer_without_max_tokens_is_expected_as_long_as_recent_ones() {
        let mut r = Rates::default();
        assert_eq!(r.expected_answer(0), DEFAULT_ANSWER_TOKENS);
        assert_eq!(r.expected_answer(24), 24.0);
        r.answered(40);
        assert_eq!(r.expected_answer(0), 40.0);
        assert_eq!(r.expected_answer(24), 24.0);
        r.answered(80);
        assert!((r.expected_answer(0) - 52.0).abs() < 1e-9);
        // An empty answer says nothing of the next one's length.
        r.answered(0);
        assert!((r.expected_answer(0) - 52.0).abs() < 1e-9);
    }

    #[test]
    fn a_chat_that_goes_on_from_a_held_answer_is_found() {
        let mut c = Conversations::default();
        let turn1 = chat(&[("user", "Hi")]);
        c.record(&turn1, " Hello! How can I help?", 40);
        let turn2 = chat(&[
            ("user", "Hi"),
            ("assistant", "Hello! How can I help?"),
            ("user", "Tell me a story."),
        ]);
        assert_eq!(c.find(&turn2), Some(40));
        // Cut by a stop string: still a prefix of what the node holds.
        let cut = chat(&[("user", "Hi"), ("assistant", "Hello!"), ("user", "Go on.")]);
        assert_eq!(c.find(&cut), Some(40));
        // An edited earlier message, another answer, or nothing new: not found.
        for other in [
            chat(&[
                ("user", "Hey"),
                ("assistant", "Hello! How can I help?"),
                ("user", "x"),
            ]),
            chat(&[("user", "Hi"), ("assistant", "Goodbye."), ("user", "x")]),
            chat(&[("user", "Hi"), ("assistant", "Hello! How can I help?")]),
            chat(&[("user", "Hi")]),
            Input::Prompt("Hi".into()),
        ] {
            assert_eq!(c.find(&other), None, "{other:?}");
        }
        // The next turn is remembered beside the one it continues (another client may go
        // on from that one too).
        c.record(&turn2, " Once upon a time.", 90);
        assert_eq!(c.entries.len(), 2);
        assert_eq!(c.find(&cut), Some(40));
        c.record(&turn2, " Once upon a time.", 95);
        assert_eq!(c.entries.len(), 2, "the same turn again replaces its entry");
        c.forget(&chat(&[
            ("user", "Hi"),
            ("assistant", "Hello! How can I help?"),
            ("user", "Tell me a story."),
            ("assistant", "Once upon a time."),
            ("user", "More."),
        ]));
        // (The decode node held nothing worth continuing for it: neither turn.)
        assert!(c.entries.is_empty());
    }

    #[test]
    fn a_replayed_conversation_is_known_as_held_by_both_nodes_until_recorded_again() {
        let mut c = Conversations::default();
        let turn1 = Input::Prompt("1, 2, 3,".into());
        let next = Input::Prompt("1, 2, 3, 4, 5, 6".into());
        c.record(&turn1, " 4, 5", 9);
        assert_eq!(
            c.copies(&next),
            Some(Copies::DecodeNode),
            "not replayed yet"
        );
        c.replayed(&turn1, " 4, 6");
        assert_eq!(
            c.copies(&next),
            Some(Copies::DecodeNode),
            "another answer was replayed"
        );
        c.replayed(&turn1, " 4, 5");
        assert_eq!(c.copies(&next), Some(Copies::Both));
        assert_eq!(c.copies(&Input::Prompt("1, 2, 4".into())), None);
        // The same turn answered again (the decode node wrote it anew): not replayed.
        c.record(&turn1, " 4, 5", 9);
        assert_eq!(c.copies(&next), Some(Copies::DecodeNode));
    }

    /// A turn the prefill node answers on its replayed copy leaves the decode node's copy
    /// behind (only a tail continues it there, not the decode node alone); a conversation
    /// only the decode node holds is not marked, and a turn the decode node writes again
    /// makes its copy the one to go on from.
    #[test]
    fn a_turn_answered_on_the_prefill_node_leaves_the_decode_nodes_copy_behind() {
        let mut c = Conversations::default();
        let turn1 = Input::Prompt("1, 2, 3,".into());
        let turn2 = Input::Prompt("1, 2, 3, 4, 5, 6,".into());
        let turn3 = Input::Prompt("1, 2, 3, 4, 5, 6, 7, 8, 9".into());
        c.record(&turn1, " 4, 5", 9);
        c.went_on_on_prefill_node(&turn2);
        assert_eq!(c.copies(&turn2), Some(Copies::DecodeNode), "not replayed");
        c.replayed(&turn1, " 4, 5");
        assert_eq!(c.copies(&turn2), Some(Copies::Both));
        c.went_on_on_prefill_node(&turn2);
        assert_eq!(c.copies(&turn3), Some(Copies::PrefillNodeAhead));
        assert_eq!(
            c.find(&turn3),
            Some(9),
            "the decode node's copy, for a tail"
        );
        assert_eq!(c.held_chars(&turn3), Some("1, 2, 3, 4, 5".len()));
        c.replayed(&turn1, " 4, 5");
        assert_eq!(
            c.copies(&turn3),
            Some(Copies::PrefillNodeAhead),
            "a late replay"
        );
        c.prefill_node_lost(&turn3);
        assert_eq!(
            c.copies(&turn3),
            Some(Copies::DecodeNode),
            "its copy evicted"
        );
        c.record(&turn2, " 7, 8", 15);
        assert_eq!(c.copies(&turn3), Some(Copies::DecodeNode));
        assert_eq!(c.find(&turn3), Some(15));
    }

    /// A replay in flight is neither copy yet: it ends held by both, or by the decode node
    /// alone when it did not finish; an entry in another state is not touched.
    #[test]
    fn a_replay_in_flight_ends_held_by_both_or_by_the_decode_node() {
        let mut c = Conversations::default();
        let turn1 = Input::Prompt("1, 2, 3,".into());
        let next = Input::Prompt("1, 2, 3, 4, 5, 6".into());
        c.record(&turn1, " 4, 5", 9);
        c.replaying(&turn1, " 4, 5");
        assert_eq!(c.copies(&next), Some(Copies::Replaying));
        c.not_replayed(&turn1, " 4, 5");
        assert_eq!(c.copies(&next), Some(Copies::DecodeNode));
        c.replaying(&turn1, " 4, 5");
        c.replayed(&turn1, " 4, 5");
        assert_eq!(c.copies(&next), Some(Copies::Both));
        c.not_replayed(&turn1, " 4, 5");
        c.replaying(&turn1, " 4, 5");
        assert_eq!(c.copies(&next), Some(Copies::Both), "already both");
    }

    /// A split's prefill and a colocated answer's are one figure of the prefill node, and each
    /// device's figures say when they want measuring.
    #[test]
    fn every_answer_that_measures_a_device_feeds_its_one_estimate() {
        let mut r = Rates::default();
        let now = Instant::now();
        assert_eq!(
            r.stale(now),
            Stale {
                prefill_node: true,
                decode_node: true,
                link: true
            }
        );
        r.prefilled(false, 1000, 1000.0); // a split's prefill: 1 token/ms
        r.prefilled(false, 1000, 500.0); // colocated answers: 2 and 2.5
        r.prefilled(false, 1000, 400.0);
        assert_eq!(r.measured().prefill_node_prefill, Some(2.0));
        // Its decode speed not yet measured: the prefill node still wants measuring.
        assert!(r.stale(now).prefill_node);
        r.decoded(false, 100, 1000.0);
        let s = r.stale(Instant::now());
        assert!(!s.prefill_node && s.decode_node && s.link, "{s:?}");
        r.handed_off(1_000_000, 100.0);
        assert!(!r.stale(Instant::now()).link);
        assert_eq!(r.measured().link, Some(10_000.0));
    }

    #[test]
    fn the_prefill_node_is_sooner_only_when_measured_faster_with_the_link() {
        let mut r = Rates::default();
        assert!(!r.prefill_node_sooner(23_040), "nothing measured");
        r.prefilled(false, 1000, 1000.0);
        r.prefilled(true, 250, 1000.0);
        // 1/1 < 1/0.25 with no link measured.
        assert!(r.prefill_node_sooner(23_040));
        // A link of 11,520 bytes/ms: 1 + 2 ms a token < 4 ms.
        r.handed_off(11_520_000, 1000.0);
        assert!(r.prefill_node_sooner(23_040));
        // A slow link (2,304 bytes/ms: 10 ms a token) makes the decode node sooner.
        let mut slow = Rates::default();
        slow.prefilled(false, 1000, 1000.0);
        slow.prefilled(true, 250, 1000.0);
        slow.handed_off(2_304_000, 1000.0);
        assert!(!slow.prefill_node_sooner(23_040));
        // Equal speeds (this machine's two nodes): never.
        let mut same = Rates::default();
        same.prefilled(false, 1000, 1000.0);
        same.prefilled(true, 1000, 1000.0);
        assert!(!same.prefill_node_sooner(23_040));
    }

    #[test]
    fn a_prompt_that_goes_on_from_a_held_answer_is_found() {
        let mut c = Conversations::default();
        c.record(&Input::Prompt("1, 2, 3,".into()), " 4, 5", 9);
        assert_eq!(c.find(&Input::Prompt("1, 2, 3, 4, 5, 6".into())), Some(9));
        assert_eq!(c.find(&Input::Prompt("1, 2, 3, 4, 5".into())), None);
        assert_eq!(c.find(&Input::Prompt("1, 2, 3, 4".into())), None);
    }

    #[test]
    fn the_index_is_bounded() {
        let mut c = Conversations::default();
        for i in 0..(MAX_CONVERSATIONS + 10) {
            c.record(&Input::Prompt(format!("prompt {i}")), "!", 1);
        }
        assert_eq!(c.entries.len(), MAX_CONVERSATIONS);
        let big = "x".repeat(MAX_CHARS);
        c.record(&Input::Prompt(big.clone()), "", 1);
        c.record(&Input::Prompt(big), "y", 1);
        assert_eq!(
            c.entries.len(),
            1,
            "over the character cap: only the newest"
        );
    }

    #[test]
    fn the_decode_node_goes_while_its_prefill_beats_prefill_plus_transfer() {
        let mut r = Rates::default();
        // Unmeasured: Dynamo's rule.
        assert_eq!(r.max_uncached(300, 23_040), 700);
        assert_eq!(r.max_uncached(2000, 23_040), DEFAULT_MAX_UNCACHED);
        // Prefill node 1 token/ms, decode node 0.25 token/ms, no handoff measured:
        // u/0.25 <= (held + u)/1  <=>  u <= held/3.
        r.prefilled(false, 1000, 1000.0);
        r.prefilled(true, 250, 1000.0);
        assert_eq!(r.max_uncached(3000, 23_040), 1000);
        // A link of 11,520 bytes/ms (23,040 bytes/token: 2 ms a token) makes the split
        // slower: u/0.25 <= (held + u) x 3  <=>  u <= 3 held.
        r.handed_off(11_520_000, 1000.0);
        assert_eq!(r.max_uncached(3000, 23_040), 9000);
        // A decode node as fast as the prefill node is always sooner.
        let mut fast = Rates::default();
        fast.prefilled(false, 1000, 1000.0);
        fast.prefilled(true, 1000, 1000.0);
        assert_eq!(fast.max_uncached(10, 23_040), u32::MAX);
        // Prefills too short to measure do not count.
        let mut short = Rates::default();
        short.prefilled(true, 5, 1.0);
        assert!(short.decode_node.value().is_none());
    }
}
