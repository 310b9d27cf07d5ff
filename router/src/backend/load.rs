//! What each node has to do: the answers the router started on it, each with the node time
//! it is expected to take still (its backlog), which the cost model reads (`cost.rs`).
//!
//! An engine shares its time among the answers it runs (each slot its own context, stepped
//! in turn; a long prefill runs in batches between their steps), so a node is modelled as
//! processor sharing: each answer's expected work (prefill and decode, from the measured
//! rates, [`Work`]) is worked off at the node's rate, shared equally among the answers with
//! work left ([`Queue::advance`]). A new answer of work `s` then ends after
//! `s + sum(min(left_i, s))` (`cost::finish_ms`): an answer with less left than it ends first
//! and delays it by what it has left; one with more shares the node with it throughout.
//! Counting answers alone would see a decode node filling up with long prefills as a decode node
//! with a few answers (measured: slow-wifi at 8 clients).
//!
//! Approximate: the expectation is set when the answer starts (from an estimate of its
//! prompt's tokens and its `max_tokens`) and corrected once its prefill is done
//! ([`Busy::prefilled`]); an answer that ends before its `max_tokens` leaves when it ends;
//! one that takes longer than expected counts as done early (nothing left) until it ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::cost::Backlog;
use super::nodes::{lock, Learned};
use crate::api::{HandoffMode, ValidRequest};
use crate::placement::{input_chars, Measured};

/// The answer tokens `req` is expected to write ([`crate::placement::Rates::expected_answer`]).
pub(super) fn answer_tokens(req: &ValidRequest, learned: &Mutex<Learned>) -> f64 {
    lock(learned).rates.expected_answer(req.max_tokens)
}

/// The work queues of a pair's nodes: the prefill node's, shared by every
/// decode node's pair in a pool ([`Load::beside`]), and this pair's decode node's.
#[derive(Debug, Default)]
pub(super) struct Load {
    prefill_node: Arc<Mutex<Queue>>,
    decode_node: Mutex<Queue>,
}

/// Answer ids, unique in the process: pairs share the prefill node's queue.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// One node's answers and the work each has left, as of `at`.
#[derive(Debug, Default)]
struct Queue {
    /// (answer id, expected node ms left).
    jobs: Vec<(u64, f64)>,
    at: Option<Instant>,
}

impl Queue {
    /// Works off the node time from `at` to `now`, shared equally among the answers with
    /// work left (processor sharing: the least first, then the rest share its time).
    fn advance(&mut self, now: Instant) {
        let Some(at) = self.at.replace(now) else {
            return;
        };
        let mut time = now.saturating_duration_since(at).as_secs_f64() * 1000.0;
        let mut left: Vec<f64> = self.jobs.iter().map(|j| j.1).filter(|&l| l > 0.0).collect();
        left.sort_by(f64::total_cmp);
        // Each answer with work left gets `given`; the least ends first.
        let mut given = 0.0;
        let mut sharing = left.len() as f64;
        for l in left {
            let need = (l - given) * sharing;
            if need <= time {
                time -= need;
                given = l;
                sharing -= 1.0;
            } else {
                given += time / sharing;
                break;
            }
        }
        for job in &mut self.jobs {
            job.1 = (job.1 - given).max(0.0);
        }
    }

    fn set(&mut self, id: u64, left_ms: f64) {
        if let Some(job) = self.jobs.iter_mut().find(|j| j.0 == id) {
            job.1 = left_ms.max(0.0);
        }
    }
}

/// An answer's expected work on one node, in tokens, turned into node time by the rates
/// measured so far ([`Work::ms`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Work {
    /// Prompt tokens it prefills there.
    pub(super) prefill: f64,
    /// Answer tokens it writes there.
    pub(super) decode: f64,
    /// Other node time (ms), e.g. a live answer's tokens written while its state crosses.
    pub(super) extra_ms: f64,
}

impl Work {
    /// A whole request on one node: its prompt (estimated from its characters, as the
    /// cost model does, until the node has tokenized it) and its answer.
    pub(super) fn of(req: &ValidRequest, learned: &Mutex<Learned>) -> Work {
        let l = lock(learned);
        Work {
            prefill: l.rates.tokens_of(input_chars(&req.input)),
            decode: l.rates.expected_answer(req.max_tokens),
            extra_ms: 0.0,
        }
    }

    /// Only the answer `req` is expected to write.
    pub(super) fn answer_of(req: &ValidRequest, learned: &Mutex<Learned>) -> Work {
        Work::answer(answer_tokens(req, learned))
    }

    /// Only answer tokens.
    pub(super) fn answer(tokens: f64) -> Work {
        Work {
            decode: tokens,
            ..Work::default()
        }
    }

    /// Node time: what a rate not yet measured would price counts nothing.
    pub(super) fn ms(&self, m: &Measured, on_decode_node: bool) -> f64 {
        let (p, d) = if on_decode_node {
            (m.decode_node_prefill, m.decode_node_decode)
        } else {
            (m.prefill_node_prefill, m.prefill_node_decode)
        };
        let part = |tokens: f64, rate: Option<f64>| rate.map_or(0.0, |r| tokens.max(0.0) / r);
        part(self.prefill, p) + part(self.decode, d) + self.extra_ms.max(0.0)
    }
}

impl super::Backend {
    /// A split request's expected work on the prefill node: its prefill, and in a live handoff
    /// the answer tokens the prefill node writes while the state crosses (as the cost model's
    /// `k`, not shared: the fewer of the answer's and those the crossing lasts), which are
    /// returned too for the correction after the prefill.
    pub(super) fn split_work(&self, req: &ValidRequest, mode: HandoffMode) -> (Work, f64) {
        let whole = Work::of(req, &self.learned);
        let kv = self.kv_bytes_per_token();
        let m = lock(&self.learned).rates.measured();
        let written = match (mode, m.link, m.prefill_node_decode) {
            (HandoffMode::Live, Some(g), Some(d)) if g > 0.0 => {
                (whole.prefill * kv as f64 / g * d).min(whole.decode)
            }
            _ => 0.0,
        };
        let work = Work {
            decode: written,
            ..whole
        };
        (work, written)
    }
}

/// One answer counted on a node while it is held.
#[derive(Debug)]
pub(super) struct Busy {
    load: Arc<Load>,
    on_decode_node: bool,
    id: u64,
    /// Answers on the node when this one started (itself included).
    at_start: u32,
}

impl Load {
    /// The queues of another decode node's pair: the same prefill node, its own decode node.
    pub(super) fn beside(other: &Load) -> Load {
        Load {
            prefill_node: other.prefill_node.clone(),
            decode_node: Mutex::default(),
        }
    }

    fn queue(&self, on_decode_node: bool) -> std::sync::MutexGuard<'_, Queue> {
        let q = if on_decode_node {
            &self.decode_node
        } else {
            &self.prefill_node
        };
        // A poisoned lock holds only estimates.
        q.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts an answer on the decode node or the prefill node until the guard drops,
    /// expected to take `work_ms` of the node's time.
    pub(super) fn take(self: &Arc<Self>, on_decode_node: bool, work_ms: f64) -> Busy {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut q = self.queue(on_decode_node);
        q.advance(Instant::now());
        q.jobs.push((id, work_ms.max(0.0)));
        let at_start = u32::try_from(q.jobs.len()).unwrap_or(u32::MAX);
        Busy {
            load: self.clone(),
            on_decode_node,
            id,
            at_start,
        }
    }

    /// Counts an answer whose work is `work` in tokens, priced by the rates `learned` holds.
    pub(super) fn take_work(
        self: &Arc<Self>,
        learned: &Mutex<Learned>,
        on_decode_node: bool,
        work: Work,
    ) -> Busy {
        let ms = work.ms(&lock(learned).rates.measured(), on_decode_node);
        self.take(on_decode_node, ms)
    }

    /// Whether no answer runs on the decode node or the prefill node.
    pub(super) fn idle(&self, on_decode_node: bool) -> bool {
        self.queue(on_decode_node).jobs.is_empty()
    }

    /// The work (node ms) the answers on the decode node or the prefill node have left,
    /// as of now.
    pub(super) fn backlog_ms(&self, on_decode_node: bool) -> f64 {
        let mut q = self.queue(on_decode_node);
        q.advance(Instant::now());
        q.jobs.iter().map(|j| j.1).sum()
    }

    /// The work each node's answers have left, as of now.
    pub(super) fn backlog(&self) -> Backlog {
        let left = |on_decode_node| {
            let mut q = self.queue(on_decode_node);
            q.advance(Instant::now());
            q.jobs.iter().map(|j| j.1).collect()
        };
        Backlog {
            prefill_node: left(false),
            decode_node: left(true),
        }
    }
}

/// How long a node writing an answer may send nothing before it counts as failed: `idle`
/// (`--token-idle-timeout`) plus `others_ms`, the work its other answers have left there,
/// at most eight times `idle`. A busy engine steps each answer in turn with long prefills
/// between the steps, so a loaded node is slow, not wedged, for as long as that work; its
/// figures say it is slow.
pub(super) fn idle_bound(idle: Duration, others_ms: f64) -> Duration {
    (idle + Duration::from_secs_f64(others_ms.max(0.0) / 1000.0)).min(idle * 8)
}

impl Busy {
    /// The work (node ms) the node's other answers have left, as of now.
    pub(super) fn others_ms(&self) -> f64 {
        let mut q = self.load.queue(self.on_decode_node);
        q.advance(Instant::now());
        q.jobs.iter().filter(|j| j.0 != self.id).map(|j| j.1).sum()
    }

    /// How many answers shared the node with this one (itself included), taken as the mean
    /// of the counts at its start and now: an engine steps its answers in turn, so one
    /// answer's decode speed is about the node's divided by this.
    pub(super) fn sharing(&self) -> f64 {
        let now =
            u32::try_from(self.load.queue(self.on_decode_node).jobs.len()).unwrap_or(u32::MAX);
        (f64::from(self.at_start) + f64::from(now.max(1))) / 2.0
    }

    /// The answer's prefill is done: what it has left is `work` (its answer tokens).
    pub(super) fn prefilled(&self, learned: &Mutex<Learned>, work: Work) {
        let ms = work.ms(&lock(learned).rates.measured(), self.on_decode_node);
        let mut q = self.load.queue(self.on_decode_node);
        q.advance(Instant::now());
        q.set(self.id, ms);
    }

    /// Records the node's decode speed from this answer's `tokens` written in `ms`: the
    /// answer's speed x the answers sharing the node.
    pub(super) fn record(&self, learned: &Mutex<Learned>, tokens: u32, ms: f64) {
        lock(learned)
            .rates
            .decoded(self.on_decode_node, tokens, ms / self.sharing());
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut q = self.load.queue(self.on_decode_node);
        q.advance(Instant::now());
        q.jobs.retain(|j| j.0 != self.id);
        if q.jobs.is_empty() {
            q.at = None;
        }
    }
}

/// An answer counted on its node ([`Busy`]), whose end records the node's decode speed.
pub(super) struct Counted {
    pub(super) learned: Arc<Mutex<Learned>>,
    pub(super) busy: Busy,
}

impl Counted {
    /// Records a `Finished` event's decode speed.
    pub(super) fn seen(&self, ev: &super::Event) {
        decoded(&self.learned, &self.busy, ev);
    }
}

/// Records the node's decode speed from the one a `Finished` event reports for an answer
/// that shared the node (`busy`) with others: the answer's speed x the answers sharing.
pub(super) fn decoded(learned: &Mutex<Learned>, busy: &Busy, ev: &super::Event) {
    if let super::Event::Finished {
        decode_tokens,
        decode_ms,
        ..
    } = ev
    {
        busy.record(learned, *decode_tokens, *decode_ms);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn queue(left: &[f64], at: Instant) -> Queue {
        Queue {
            jobs: left
                .iter()
                .copied()
                .enumerate()
                .map(|(i, l)| (i as u64, l))
                .collect(),
            at: Some(at),
        }
    }

    fn lefts(q: &Queue) -> Vec<f64> {
        q.jobs
            .iter()
            .map(|j| (j.1 * 1000.0).round() / 1000.0)
            .collect()
    }

    #[test]
    fn node_time_is_shared_equally_and_the_least_ends_first() {
        let t0 = Instant::now();
        // 300 ms among three: 100 each.
        let mut q = queue(&[1000.0, 150.0, 400.0], t0);
        q.advance(t0 + Duration::from_millis(300));
        assert_eq!(lefts(&q), vec![900.0, 50.0, 300.0]);
        // 450 ms more: the 50 ends after 150 ms (50 each), the other two share the
        // remaining 300 ms (150 each).
        q.advance(t0 + Duration::from_millis(750));
        assert_eq!(lefts(&q), vec![700.0, 0.0, 100.0]);
        // More time than all the work: nothing left, nothing negative.
        q.advance(t0 + Duration::from_secs(10));
        assert_eq!(lefts(&q), vec![0.0, 0.0, 0.0]);
        // An answer with nothing left (done as expected, not yet ended) takes no share.
        let mut q = queue(&[0.0, 100.0], t0);
        q.advance(t0 + Duration::from_millis(60));
        assert_eq!(lefts(&q), vec![0.0, 40.0]);
    }

    fn counts(load: &Load) -> (usize, usize) {
        let b = load.backlog();
        (b.prefill_node.len(), b.decode_node.len())
    }

    /// A node's next token may take the idle bound plus what its other answers have left
    /// (not the answer's own), at most eight idle bounds.
    #[test]
    fn a_busy_node_may_be_silent_for_its_other_answers_work() {
        let load = Arc::new(Load::default());
        let idle = Duration::from_secs(15);
        let own = load.take(false, 50_000.0);
        assert_eq!(idle_bound(idle, own.others_ms()), idle, "alone");
        let other = load.take(false, 30_000.0);
        let _on_decode_node = load.take(true, 90_000.0);
        let others = own.others_ms();
        assert!((29_000.0..=30_000.0).contains(&others), "{others}");
        let bound = idle_bound(idle, others);
        assert!(
            bound > Duration::from_secs(43) && bound <= Duration::from_secs(45),
            "{bound:?}"
        );
        assert_eq!(idle_bound(idle, 1e9), idle * 8);
        drop(other);
        assert_eq!(own.others_ms(), 0.0);
    }

    #[test]
    fn a_guard_counts_its_answer_until_dropped_and_its_prefill_corrects_it() {
        let load = Arc::new(Load::default());
        let learned = Mutex::new(Learned::default());
        let a = load.take(false, 1000.0);
        let b = load.take(true, 50.0);
        let c = load.take(false, 200.0);
        assert_eq!(counts(&load), (2, 1));
        let backlog = load.backlog();
        assert_eq!(backlog.prefill_node.len(), 2);
        assert!(backlog.prefill_node[0] > 900.0 && backlog.prefill_node[0] <= 1000.0);
        // Rates not measured yet: a prefill's correction prices nothing.
        a.prefilled(
            &learned,
            Work {
                prefill: 0.0,
                decode: 100.0,
                extra_ms: 0.0,
            },
        );
        assert_eq!(load.backlog().prefill_node[0], 0.0);
        lock(&learned).rates.decoded(false, 100, 1000.0); // 0.1 token/ms
        a.prefilled(
            &learned,
            Work {
                prefill: 0.0,
                decode: 100.0,
                extra_ms: 5.0,
            },
        );
        let left = load.backlog().prefill_node[0];
        assert!(left > 900.0 && left <= 1005.0, "{left}");
        drop(a);
        drop(b);
        assert_eq!(counts(&load), (1, 0));
        assert_eq!(load.backlog().decode_node, Vec::<f64>::new());
        drop(c);
        assert_eq!(counts(&load), (0, 0));
    }
}
