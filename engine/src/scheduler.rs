//! The owner thread's loop: commands in, waiting work started in free sequence slots, one
//! decode step per running answer per round. It drives any [`Slots`], so its rules are
//! unit-tested with a scripted fake and no model file.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::command::{Command, GenerateJob, InFlight, PrefillJob, SnapshotAsk};
use crate::exit_guard::{park_forever, register_exit_guard, Busy};
use crate::types::{
    EngineError, Finish, GenEvent, GenSummary, Input, PrefillOutput, Reuse, Snapshot, Start,
    TokenOut,
};

/// Most prefills and generations waiting for a free slot; beyond it a request is refused
/// at once with [`EngineError::Busy`] (the router's own queue normally keeps it far lower).
pub const MAX_WAITING: usize = 256;

/// What the scheduler needs of the sequence slots: the llama.cpp worker in the engine, a
/// scripted fake in the tests. Slots are numbered `0..count()`.
pub(crate) trait Slots {
    /// Where a running answer stands between two steps (its history, step index, budget).
    type Answer;

    fn count(&self) -> usize;
    /// Which of the `free` slots (never empty) a job takes, and marks it in use: the one
    /// whose cached sequence the prompt `want` can reuse most of, under its reuse rule;
    /// else an empty one; else the least recently used.
    fn pick(&mut self, free: &[usize], want: Option<(&[i32], Reuse)>) -> usize;
    fn tokenize(&mut self, input: Input) -> Result<Vec<i32>, EngineError>;
    /// Runs a whole prefill in `slot`, calling `between` after every batch but the last:
    /// there the scheduler steps the running answers once ([`Answers::step_all`]), so a
    /// long prompt holds them up one batch at a time, not for its whole prefill.
    fn prefill(
        &mut self,
        slot: usize,
        job: &PrefillJob,
        between: &mut dyn FnMut(&mut Self),
    ) -> Result<PrefillOutput, EngineError>;
    /// Reads `tokens` in `slot` and sends, for each position, the log-probabilities of the
    /// next token (a measurement, not an answer).
    fn score(
        &mut self,
        slot: usize,
        tokens: &[i32],
        from: usize,
        prefix: Option<&[u8]>,
        out: &mpsc::Sender<Result<Vec<f32>, EngineError>>,
    ) -> Result<(), EngineError>;
    /// Sets an answer up in `slot` (prefill, import or rebuild) and emits what comes before
    /// the first decode step. `None` when the answer already ended (`summary.finish` says
    /// why). The scheduler releases the slot when this fails or ends. A prefill in it calls
    /// `between` as [`Slots::prefill`] does.
    fn begin(
        &mut self,
        slot: usize,
        job: GenerateJob,
        events: &mpsc::UnboundedSender<GenEvent>,
        summary: &mut GenSummary,
        between: &mut dyn FnMut(&mut Self),
    ) -> Result<Option<Self::Answer>, EngineError>;
    /// One decode step of the answer in `slot`: the token it samples, and whether the
    /// answer's budget is now spent.
    fn step(
        &mut self,
        slot: usize,
        answer: &mut Self::Answer,
    ) -> Result<(TokenOut, bool), EngineError>;
    /// The state of the answer in `slot`, between two steps.
    fn snapshot(
        &mut self,
        slot: usize,
        answer: &mut Self::Answer,
        from: usize,
        digest: bool,
    ) -> Result<Snapshot, EngineError>;
    /// `slot` is no longer in use: its sequence stays as a cached prefix when `keep` (the
    /// job ended with its KV whole), else it is emptied.
    fn release(&mut self, slot: usize, keep: bool);
    /// The answer in `slot` was handed over: another node writes the rest of it.
    fn handed_over(&mut self, slot: usize);
    /// Publishes how many slots are in use now.
    fn publish_active(&self, n: usize);
}

/// An answer being written in a slot.
struct Running<A> {
    slot: usize,
    answer: A,
    events: mpsc::UnboundedSender<GenEvent>,
    /// A live answer's snapshot requests.
    live: Option<mpsc::UnboundedReceiver<SnapshotAsk>>,
    /// The newest snapshot asked for at the answer's end ([`SnapshotAsk::at_end`]).
    at_end: Option<SnapshotAsk>,
    summary: GenSummary,
    decoding_since: Instant,
    /// Test hook ([`crate::EngineConfig::pace_live`]): the steps this live answer may
    /// take before its handoff's next snapshot; `None` when it is not paced (or no longer:
    /// its handoff let go of it).
    paced: Option<u32>,
    /// Dropped before the final event is sent, so a reader that saw it sees the count
    /// without this answer.
    in_flight: InFlight,
}

/// The answers being written.
struct Answers<A> {
    running: Vec<Running<A>>,
    /// A running answer took a step in the last round (else, paced answers only wait).
    stepped: bool,
}

/// Answers in different slots take turns, one token each, so a long answer does not hold
/// up a short one; on a CPU node the turns share the cores rather than adding throughput
/// (see `EngineConfig::n_parallel`). A prefill (or an answer's start) runs between rounds,
/// and the running answers take a step between each two of its batches: each sequence is
/// still prefilled in its own batches, in its own context, so no answer changes; a
/// running answer waits at most one batch of another's prompt, not all of it (on one core
/// a 2,000-token prompt took ~16 s, past the router's 15 s bound on a token).
pub(crate) struct Scheduler<S: Slots> {
    slots: S,
    rx: mpsc::Receiver<Command>,
    /// Prefills and generations waiting for a free slot, oldest first.
    waiting: VecDeque<Command>,
    answers: Answers<S::Answer>,
    /// Every `Engine` handle is gone: finish what was accepted, then stop.
    closed: bool,
    /// Test hook: live answers are paced ([`crate::EngineConfig::pace_live`]).
    pace_live: bool,
}

impl<S: Slots> Scheduler<S> {
    pub(crate) fn new(slots: S, rx: mpsc::Receiver<Command>) -> Self {
        Scheduler {
            slots,
            rx,
            waiting: VecDeque::new(),
            answers: Answers {
                running: Vec::new(),
                stepped: false,
            },
            closed: false,
            pace_live: false,
        }
    }

    /// With `on`, live answers are paced by their snapshots (the test hook
    /// [`crate::EngineConfig::pace_live`]).
    pub(crate) fn pacing_live(mut self, on: bool) -> Self {
        self.pace_live = on;
        self
    }

    /// Runs until every handle is gone and nothing is left, then frees the slots. Every
    /// round holds [`Busy`], so the process exit waits for it or parks this thread.
    pub(crate) fn run(mut self) {
        loop {
            let mut next = None;
            if self.answers.running.is_empty() && self.waiting.is_empty() {
                if !self.closed {
                    next = self.rx.blocking_recv();
                }
                if next.is_none() {
                    // Every handle is gone and nothing is left: free the contexts.
                    let Some(_busy) = Busy::enter() else {
                        park_forever()
                    };
                    drop(self);
                    return;
                }
            }
            let Some(_busy) = Busy::enter() else {
                park_forever()
            };
            if let Some(cmd) = next {
                self.accept(cmd);
            }
            self.accept_queued();
            self.start_waiting();
            self.answers.stepped = false;
            self.answers.step_all(&mut self.slots, 0);
            register_exit_guard();
            if !self.answers.running.is_empty() && !self.answers.stepped && self.waiting.is_empty()
            {
                // Only paced answers (the test hook) run, each waiting for its handoff's
                // next snapshot: poll for it without spinning a core.
                std::thread::sleep(Duration::from_micros(500));
            }
        }
    }

    /// Takes every command already sent, without blocking.
    fn accept_queued(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => self.accept(cmd),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.closed = true;
                    break;
                }
            }
        }
    }

    fn publish_active(&self, extra: usize) {
        self.slots
            .publish_active(self.answers.running.len() + extra);
    }

    fn accept(&mut self, cmd: Command) {
        match cmd {
            Command::Tokenize { input, reply } => {
                let _ = reply.send(self.slots.tokenize(input));
            }
            other if self.waiting.len() >= MAX_WAITING => {
                let busy = EngineError::Busy {
                    waiting: self.waiting.len(),
                };
                // Dropping the command drops its job (and deletes a held state file).
                match other {
                    Command::Prefill { reply, .. } => {
                        let _ = reply.send(Err(busy));
                    }
                    Command::Score { out, .. } => {
                        let _ = out.try_send(Err(busy));
                    }
                    Command::Generate { events, .. } => {
                        let _ = events.send(GenEvent::Error(busy));
                    }
                    Command::Tokenize { .. } => {}
                }
            }
            other => self.waiting.push_back(other),
        }
    }

    fn free_slots(&self) -> Vec<usize> {
        (0..self.slots.count())
            .filter(|s| self.answers.running.iter().all(|r| r.slot != *s))
            .collect()
    }

    fn start_waiting(&mut self) {
        loop {
            let free = self.free_slots();
            if free.is_empty() {
                return;
            }
            let Some(cmd) = self.waiting.pop_front() else {
                return;
            };
            let slot = self.slots.pick(&free, wanted(&cmd));
            match cmd {
                Command::Prefill {
                    job,
                    reply,
                    in_flight,
                } => {
                    let out = if reply.is_closed() {
                        // Nobody waits for it: the slot is given back untouched.
                        self.slots.release(slot, true);
                        Err(EngineError::Closed)
                    } else {
                        self.publish_active(1);
                        let answers = &mut self.answers;
                        let out = self
                            .slots
                            .prefill(slot, &job, &mut |s| answers.step_all(s, 1));
                        self.slots.release(slot, out.is_ok());
                        self.publish_active(0);
                        out
                    };
                    drop(in_flight);
                    let _ = reply.send(out);
                }
                Command::Generate {
                    job,
                    events,
                    in_flight,
                } => {
                    if events.is_closed() {
                        // Its reader left while it waited: drop it unrun.
                        self.slots.release(slot, true);
                        continue;
                    }
                    self.begin(slot, job, events, in_flight);
                }
                Command::Score {
                    tokens,
                    from,
                    prefix,
                    out,
                    in_flight,
                } => {
                    self.publish_active(1);
                    if let Err(e) = self
                        .slots
                        .score(slot, &tokens, from, prefix.as_deref(), &out)
                    {
                        let _ = out.blocking_send(Err(e));
                    }
                    // Scored in batches of their own: no prefix worth keeping.
                    self.slots.release(slot, false);
                    self.publish_active(0);
                    drop(in_flight);
                }
                Command::Tokenize { .. } => unreachable!("tokenize never waits for a slot"),
            }
        }
    }

    fn begin(
        &mut self,
        slot: usize,
        mut job: GenerateJob,
        events: mpsc::UnboundedSender<GenEvent>,
        in_flight: InFlight,
    ) {
        let mut summary = GenSummary::default();
        self.publish_active(1);
        let live = job.live.take();
        let paced = (self.pace_live && live.is_some()).then_some(0);
        let answers = &mut self.answers;
        let begun = self
            .slots
            .begin(slot, job, &events, &mut summary, &mut |s| {
                answers.step_all(s, 1)
            });
        match begun {
            Ok(Some(answer)) => self.answers.running.push(Running {
                slot,
                answer,
                events,
                live,
                at_end: None,
                summary,
                decoding_since: Instant::now(),
                paced,
                in_flight,
            }),
            Ok(None) => {
                self.slots.release(slot, true);
                drop(in_flight);
                let _ = events.send(GenEvent::Done(summary));
            }
            Err(e) => {
                // A cache that holds too little, or not a tail's prefix, was left as it
                // was.
                self.slots.release(
                    slot,
                    matches!(e, EngineError::NotCached { .. } | EngineError::TailBase(_)),
                );
                drop(in_flight);
                let _ = events.send(GenEvent::Error(e));
            }
        }
        self.publish_active(0);
    }
}

impl<A> Answers<A> {
    /// One step of every running answer, in slot order of their start.
    /// `extra`: slots in use beside the running answers (a prefill between whose batches
    /// this runs).
    fn step_all<S: Slots<Answer = A>>(&mut self, slots: &mut S, extra: usize) {
        let mut i = 0;
        while i < self.running.len() {
            match self.step(slots, i) {
                Ok(false) => i += 1,
                done => {
                    let Running {
                        slot,
                        mut answer,
                        events,
                        live,
                        at_end,
                        mut summary,
                        decoding_since,
                        in_flight,
                        ..
                    } = self.running.remove(i);
                    if summary.finish == Finish::Handover {
                        slots.handed_over(slot);
                    }
                    if done.is_ok() && matches!(summary.finish, Finish::Stop | Finish::Length) {
                        answer_at_end(slots, slot, &mut answer, live, at_end);
                    }
                    slots.release(slot, done.is_ok());
                    slots.publish_active(self.running.len() + extra);
                    summary.decode_ms = decoding_since.elapsed().as_secs_f64() * 1000.0;
                    drop(in_flight);
                    let _ = events.send(match done {
                        Err(e) => GenEvent::Error(e),
                        Ok(_) => GenEvent::Done(summary),
                    });
                }
            }
        }
    }

    /// Steps running answer `i`; `Ok(true)` when it has ended (`summary.finish` says why).
    fn step<S: Slots<Answer = A>>(&mut self, slots: &mut S, i: usize) -> Result<bool, EngineError> {
        let r = &mut self.running[i];
        if r.events.is_closed() {
            r.summary.finish = Finish::Cancelled;
            return Ok(true);
        }
        if let Some(live) = &mut r.live {
            loop {
                let ask = match live.try_recv() {
                    Ok(ask) => ask,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        // The handoff let go of the answer (it gave up): no more pacing.
                        r.paced = None;
                        break;
                    }
                };
                if ask.at_end {
                    r.at_end = Some(ask);
                    continue;
                }
                let snapshot = slots.snapshot(r.slot, &mut r.answer, ask.from, ask.digest);
                let stop = ask.stop && snapshot.is_ok();
                let _ = ask.reply.send(snapshot);
                if stop {
                    r.summary.finish = Finish::Handover;
                    return Ok(true);
                }
                if let Some(steps) = &mut r.paced {
                    *steps += 1;
                }
            }
        }
        match &mut r.paced {
            Some(0) => return Ok(false),
            Some(steps) => *steps -= 1,
            None => {}
        }
        self.stepped = true;
        let (out, spent) = slots.step(r.slot, &mut r.answer)?;
        r.summary.generated += 1;
        let eog = out.eog;
        if r.events.send(GenEvent::Token(out)).is_err() {
            r.summary.finish = Finish::Cancelled;
            return Ok(true);
        }
        if eog {
            r.summary.finish = Finish::Stop;
            return Ok(true);
        }
        Ok(spent)
    }
}

/// An answer that ended by itself: the snapshot asked for at its end, if its asker
/// still waits (asks not yet read count too; the newest wins). Before the slot is
/// released, so the state is the answer's.
fn answer_at_end<S: Slots>(
    slots: &mut S,
    slot: usize,
    answer: &mut S::Answer,
    live: Option<mpsc::UnboundedReceiver<SnapshotAsk>>,
    mut at_end: Option<SnapshotAsk>,
) {
    if let Some(mut live) = live {
        while let Ok(ask) = live.try_recv() {
            if ask.at_end {
                at_end = Some(ask);
            }
        }
    }
    if let Some(ask) = at_end.filter(|a| !a.reply.is_closed()) {
        let _ = ask
            .reply
            .send(slots.snapshot(slot, answer, ask.from, ask.digest));
    }
}

/// The prompt a waiting job would reuse a cached prefix for, and its rule.
fn wanted(cmd: &Command) -> Option<(&[i32], Reuse)> {
    match cmd {
        Command::Prefill { job, .. } => Some((&job.tokens, job.reuse)),
        Command::Generate { job, .. } => match &job.start {
            Start::Prompt(t) => Some((t, Reuse::Exact)),
            Start::Cached { tokens, reuse, .. } => Some((tokens, *reuse)),
            Start::Resume { prompt, reuse, .. } => Some((prompt, *reuse)),
            // A tail goes on from a conversation a slot holds: the one that holds most of it.
            Start::Imported {
                tokens,
                base_digest: Some(_),
                ..
            } => Some((tokens, Reuse::Conversation)),
            Start::Imported { .. } => None,
        },
        Command::Score { .. } | Command::Tokenize { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::sync::{Arc, Mutex};

    use tokio::sync::oneshot;

    use super::*;
    use crate::sampling::SamplingParams;
    use crate::types::{Export, Start};

    /// A scripted slot set: an answer emits `max_tokens` tokens numbered by slot and step,
    /// every call is logged, and a prompt token of -1 makes `begin` fail. A prompt is
    /// prefilled one token per batch (`between` after each but the last).
    struct Fake {
        n: usize,
        log: Arc<Mutex<Vec<String>>>,
        active: Arc<AtomicU64>,
    }

    struct FakeAnswer {
        step: u32,
        budget: u32,
    }

    impl Slots for Fake {
        type Answer = FakeAnswer;
        fn count(&self) -> usize {
            self.n
        }
        fn tokenize(&mut self, _: Input) -> Result<Vec<i32>, EngineError> {
            Ok(vec![1, 2, 3])
        }
        fn prefill(
            &mut self,
            slot: usize,
            job: &PrefillJob,
            between: &mut dyn FnMut(&mut Self),
        ) -> Result<PrefillOutput, EngineError> {
            self.log.lock().unwrap().push(format!("prefill {slot}"));
            self.batches(job.tokens.len(), between);
            Ok(PrefillOutput {
                prompt_tokens: job.tokens.clone(),
                cached_tokens: 0,
                first: token(0, false),
                prefill_ms: 0.0,
                state: None,
                export_ms: 0.0,
            })
        }
        fn begin(
            &mut self,
            slot: usize,
            job: GenerateJob,
            _: &mpsc::UnboundedSender<GenEvent>,
            _: &mut GenSummary,
            between: &mut dyn FnMut(&mut Self),
        ) -> Result<Option<FakeAnswer>, EngineError> {
            self.log.lock().unwrap().push(format!("begin {slot}"));
            if matches!(&job.start, Start::Prompt(p) if p == &[-1]) {
                return Err(EngineError::Decode("scripted".into()));
            }
            if let Start::Prompt(p) = &job.start {
                self.batches(p.len(), between);
            }
            Ok(Some(FakeAnswer {
                step: 0,
                budget: job.max_tokens,
            }))
        }
        fn step(
            &mut self,
            slot: usize,
            a: &mut FakeAnswer,
        ) -> Result<(TokenOut, bool), EngineError> {
            self.log.lock().unwrap().push(format!("step {slot}"));
            a.step += 1;
            a.budget -= 1;
            Ok((
                token(slot as i32 * 100 + a.step as i32, false),
                a.budget == 0,
            ))
        }
        fn score(
            &mut self,
            slot: usize,
            _: &[i32],
            _: usize,
            _: Option<&[u8]>,
            _: &mpsc::Sender<Result<Vec<f32>, EngineError>>,
        ) -> Result<(), EngineError> {
            self.log.lock().unwrap().push(format!("score {slot}"));
            Ok(())
        }
        fn snapshot(
            &mut self,
            slot: usize,
            a: &mut FakeAnswer,
            from: usize,
            _digest: bool,
        ) -> Result<Snapshot, EngineError> {
            self.log.lock().unwrap().push(format!("snapshot {slot}"));
            Ok(Snapshot {
                state: vec![slot as u8; a.step as usize],
                from,
                tokens: Vec::new(),
                last: slot as i32 * 100 + a.step as i32,
                answered: a.step,
                export_ms: 0.0,
                head_digest: None,
            })
        }
        fn pick(&mut self, free: &[usize], _: Option<(&[i32], Reuse)>) -> usize {
            free[0]
        }
        fn release(&mut self, slot: usize, keep: bool) {
            let what = if keep { "keep" } else { "clear" };
            self.log.lock().unwrap().push(format!("{what} {slot}"));
        }
        fn handed_over(&mut self, slot: usize) {
            self.log.lock().unwrap().push(format!("handed over {slot}"));
        }
        fn publish_active(&self, n: usize) {
            self.active
                .store(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    }

    impl Fake {
        fn batches(&mut self, n: usize, between: &mut dyn FnMut(&mut Self)) {
            for _ in 1..n {
                between(self);
            }
        }
    }

    fn token(id: i32, eog: bool) -> TokenOut {
        TokenOut {
            id,
            piece: Vec::new(),
            eog,
            logprobs: None,
        }
    }

    struct Harness {
        sched: Scheduler<Fake>,
        log: Arc<Mutex<Vec<String>>>,
        in_flight: Arc<AtomicU64>,
        _tx: mpsc::Sender<Command>,
    }

    fn harness(n: usize) -> Harness {
        let (tx, rx) = mpsc::channel(8);
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake {
            n,
            log: log.clone(),
            active: Arc::default(),
        };
        Harness {
            sched: Scheduler::new(fake, rx),
            log,
            in_flight: Arc::default(),
            _tx: tx,
        }
    }

    impl Harness {
        fn generate_from(
            &mut self,
            start: Start,
            max_tokens: u32,
        ) -> mpsc::UnboundedReceiver<GenEvent> {
            let (events, rx) = mpsc::unbounded_channel();
            self.sched.accept(Command::Generate {
                job: GenerateJob {
                    start,
                    params: SamplingParams::default(),
                    max_tokens,
                    live: None,
                    pieces: None,
                },
                events,
                in_flight: InFlight::new(&self.in_flight),
            });
            rx
        }

        fn generate(&mut self, max_tokens: u32) -> mpsc::UnboundedReceiver<GenEvent> {
            self.generate_from(Start::Prompt(vec![1]), max_tokens)
        }

        /// A live answer: its events, and where its snapshots are asked for.
        fn generate_live(
            &mut self,
            max_tokens: u32,
        ) -> (
            mpsc::UnboundedReceiver<GenEvent>,
            mpsc::UnboundedSender<SnapshotAsk>,
        ) {
            let (events, rx) = mpsc::unbounded_channel();
            let (asks, live) = mpsc::unbounded_channel();
            self.sched.accept(Command::Generate {
                job: GenerateJob {
                    start: Start::Prompt(vec![1]),
                    params: SamplingParams::default(),
                    max_tokens,
                    live: Some(live),
                    pieces: None,
                },
                events,
                in_flight: InFlight::new(&self.in_flight),
            });
            (rx, asks)
        }

        fn prefill(&mut self) -> oneshot::Receiver<Result<PrefillOutput, EngineError>> {
            self.prefill_of(vec![1, 2])
        }

        fn prefill_of(
            &mut self,
            tokens: Vec<i32>,
        ) -> oneshot::Receiver<Result<PrefillOutput, EngineError>> {
            let (reply, rx) = oneshot::channel();
            self.sched.accept(Command::Prefill {
                job: PrefillJob {
                    tokens,
                    params: SamplingParams::default(),
                    max_tokens: 4,
                    export: Export::None,
                    reuse: Reuse::Exact,
                },
                reply,
                in_flight: InFlight::new(&self.in_flight),
            });
            rx
        }

        /// One round of the run loop, without the channel.
        fn round(&mut self) {
            self.sched.start_waiting();
            self.sched.answers.stepped = false;
            self.sched.answers.step_all(&mut self.sched.slots, 0);
        }

        fn steps(&self) -> Vec<String> {
            let log = self.log.lock().unwrap();
            log.iter()
                .filter(|l| l.starts_with("step"))
                .cloned()
                .collect()
        }

        fn in_flight(&self) -> u64 {
            self.in_flight.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// Asks a live answer for its whole state (with `stop`, handing it over).
    fn ask(
        asks: &mpsc::UnboundedSender<SnapshotAsk>,
        stop: bool,
    ) -> oneshot::Receiver<Result<Snapshot, EngineError>> {
        ask_from(asks, stop, false, 0)
    }

    /// Asks a live answer for its state from `from` on, now or (`at_end`) at its end.
    fn ask_from(
        asks: &mpsc::UnboundedSender<SnapshotAsk>,
        stop: bool,
        at_end: bool,
        from: usize,
    ) -> oneshot::Receiver<Result<Snapshot, EngineError>> {
        let (reply, rx) = oneshot::channel();
        asks.send(SnapshotAsk {
            stop,
            at_end,
            from,
            digest: false,
            reply,
        })
        .unwrap();
        rx
    }

    fn drain(rx: &mut mpsc::UnboundedReceiver<GenEvent>) -> Vec<GenEvent> {
        let mut out = Vec::new();
        while let Ok(e) = rx.try_recv() {
            out.push(e);
        }
        out
    }

    fn ids(events: &[GenEvent]) -> Vec<i32> {
        events
            .iter()
            .filter_map(|e| match e {
                GenEvent::Token(t) => Some(t.id),
                _ => None,
            })
            .collect()
    }

    /// The test hook `pace_live`: a paced live answer takes no step after its first token
    /// until its handoff takes a snapshot, then one step per snapshot; once the handoff
    /// lets go of it (its asker dropped), it writes freely. An unpaced answer beside it is
    /// not held up.
    #[test]
    fn a_paced_live_answer_steps_once_per_snapshot_until_its_handoff_lets_go() {
        let mut h = harness(2);
        h.sched.pace_live = true;
        let (mut rx, asks) = h.generate_live(10);
        let mut plain = h.generate(3);
        for _ in 0..4 {
            h.round();
        }
        // Only the unpaced answer (slot 1) stepped.
        assert_eq!(h.steps(), ["step 1", "step 1", "step 1"]);
        assert!(!h.sched.answers.stepped, "the last round stepped nothing");
        assert_eq!(ids(&drain(&mut plain)).len(), 3);
        let mut snap = ask(&asks, false);
        h.round();
        h.round();
        assert!(snap.try_recv().unwrap().is_ok());
        assert_eq!(
            h.steps(),
            ["step 1", "step 1", "step 1", "step 0"],
            "one step per snapshot"
        );
        drop(asks);
        for _ in 0..3 {
            h.round();
        }
        assert_eq!(h.steps().len(), 3 + 1 + 3, "let go: it writes freely");
        assert_eq!(ids(&drain(&mut rx)).len(), 1 + 3);
    }

    /// A live answer's snapshot is taken between two steps and the answer goes on; a
    /// stopping one ends it there (`Handover`), with nothing emitted after it, and frees
    /// the slot. Once the answer is over, a snapshot is refused.
    #[test]
    fn snapshots_come_between_steps_and_a_stopping_one_hands_over() {
        let mut h = harness(1);
        let (mut rx, asks) = h.generate_live(10);
        h.round();
        h.round();
        let mut first = ask(&asks, false);
        h.round();
        let snap = first.try_recv().unwrap().unwrap();
        assert_eq!((snap.last, snap.answered), (2, 2));
        let mut last = ask(&asks, true);
        h.round();
        let snap = last.try_recv().unwrap().unwrap();
        assert_eq!((snap.last, snap.answered), (3, 3));
        h.round();
        let out = drain(&mut rx);
        assert_eq!(ids(&out), [1, 2, 3]);
        let Some(GenEvent::Done(summary)) = out.last() else {
            panic!("{out:?}")
        };
        assert_eq!(summary.finish, Finish::Handover);
        let log = h.log.lock().unwrap().clone();
        assert_eq!(
            log[1..],
            [
                "step 0",
                "step 0",
                "snapshot 0",
                "step 0",
                "snapshot 0",
                "handed over 0",
                "keep 0"
            ]
        );
        assert_eq!(h.in_flight(), 0);
        assert!(h.sched.answers.running.is_empty());
        assert!(asks
            .send(SnapshotAsk {
                stop: false,
                at_end: false,
                from: 0,
                digest: false,
                reply: oneshot::channel().0
            })
            .is_err());
    }

    /// A snapshot asked for at the end is taken when the answer ends by itself, after its
    /// last step and before the slot is released, from the newest such ask; an answer
    /// handed over or cancelled answers none (the asker sees `None`).
    #[test]
    fn a_snapshot_asked_for_at_the_end_comes_when_the_answer_ends() {
        let at_end =
            |asks: &mpsc::UnboundedSender<SnapshotAsk>, from| ask_from(asks, false, true, from);
        // Ends by its length: the newer ask is answered with the state after the last
        // step, the older one sees None.
        let mut h = harness(1);
        let (mut rx, asks) = h.generate_live(3);
        h.round();
        let mut older = at_end(&asks, 1);
        h.round();
        let mut newer = at_end(&asks, 2);
        assert!(newer.try_recv().is_err(), "not before the end");
        h.round();
        h.round();
        let snap = newer.try_recv().unwrap().unwrap();
        assert_eq!((snap.from, snap.last, snap.answered), (2, 3, 3));
        assert!(older.try_recv().is_err());
        assert!(
            matches!(drain(&mut rx).last(), Some(GenEvent::Done(s)) if s.finish == Finish::Length)
        );
        let log = h.log.lock().unwrap().clone();
        assert_eq!(
            log[log.len() - 2..],
            ["snapshot 0", "keep 0"],
            "before the release"
        );
        // Handed over: the ask made for the end is not answered.
        let mut h = harness(1);
        let (_rx, asks) = h.generate_live(10);
        h.round();
        let mut end = at_end(&asks, 1);
        let mut stop = ask(&asks, true);
        h.round();
        assert!(stop.try_recv().unwrap().is_ok());
        assert!(matches!(
            end.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
    }

    #[test]
    fn running_answers_take_turns_one_step_each() {
        let mut h = harness(2);
        let mut a = h.generate(3);
        let mut b = h.generate(2);
        for _ in 0..3 {
            h.round();
        }
        assert_eq!(
            h.steps(),
            ["step 0", "step 1", "step 0", "step 1", "step 0"],
            "one step per answer per round, in order"
        );
        let (ea, eb) = (drain(&mut a), drain(&mut b));
        assert_eq!(ids(&ea), [1, 2, 3]);
        assert_eq!(ids(&eb), [101, 102]);
        assert!(
            matches!(ea.last(), Some(GenEvent::Done(s)) if s.generated == 3 && s.finish == Finish::Length)
        );
        assert!(matches!(eb.last(), Some(GenEvent::Done(s)) if s.generated == 2));
        assert_eq!(h.in_flight(), 0);
        assert_eq!(
            h.sched
                .slots
                .active
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }

    #[test]
    fn a_third_answer_waits_for_a_free_slot() {
        let mut h = harness(2);
        let _a = h.generate(1);
        let _b = h.generate(5);
        let mut c = h.generate(1);
        h.round();
        assert_eq!(h.sched.waiting.len(), 1, "no third slot");
        assert!(drain(&mut c).is_empty());
        // `a` ended in round 1 and freed slot 0: `c` starts there in round 2.
        h.round();
        assert_eq!(ids(&drain(&mut c)), [1]);
        assert!(h.sched.waiting.is_empty());
    }

    #[test]
    fn more_than_max_waiting_is_refused_at_once() {
        let mut h = harness(1);
        let _running = h.generate(100);
        h.round();
        let mut queued: Vec<_> = (0..MAX_WAITING).map(|_| h.generate(1)).collect();
        assert_eq!(h.sched.waiting.len(), MAX_WAITING);
        let mut refused = h.generate(1);
        assert_eq!(
            drain(&mut refused),
            [GenEvent::Error(EngineError::Busy {
                waiting: MAX_WAITING
            })]
        );
        let mut refused_prefill = h.prefill();
        assert_eq!(
            refused_prefill.try_recv().unwrap().unwrap_err(),
            EngineError::Busy {
                waiting: MAX_WAITING
            }
        );
        assert_eq!(
            h.sched.waiting.len(),
            MAX_WAITING,
            "nothing refused was queued"
        );
        assert!(drain(&mut queued[0]).is_empty());
        assert_eq!(h.in_flight(), 1 + MAX_WAITING as u64);
    }

    #[test]
    fn a_dropped_reader_frees_its_slot() {
        let mut h = harness(1);
        let a = h.generate(100);
        let mut b = h.generate(2);
        h.round();
        assert_eq!(h.steps(), ["step 0"]);
        drop(a);
        // The next round sees `a`'s reader gone, ends it without a step and frees the slot.
        h.round();
        assert_eq!(h.steps(), ["step 0"], "no step for an answer nobody reads");
        // Cancelled between two steps: its KV is whole, kept as a cached prefix.
        assert!(h.log.lock().unwrap().contains(&"keep 0".to_string()));
        h.round();
        assert_eq!(ids(&drain(&mut b)), [1]);
        h.round();
        assert_eq!(h.in_flight(), 0);
    }

    #[test]
    fn a_waiting_answer_whose_reader_left_never_runs() {
        let mut h = harness(1);
        let _a = h.generate(3);
        let b = h.generate_from(
            Start::Imported {
                state: bytes::Bytes::from_static(b"state"),
                tokens: vec![1, 2],
                first: 7,
                answered: 1,
                base_digest: None,
            },
            3,
        );
        h.round();
        drop(b);
        for _ in 0..4 {
            h.round();
        }
        let begins = h
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("begin"))
            .count();
        assert_eq!(begins, 1, "only the first answer began");
        assert_eq!(h.in_flight(), 0);
    }

    #[test]
    fn a_failed_start_frees_the_slot_and_reports_the_error() {
        let mut h = harness(1);
        let mut a = h.generate_from(Start::Prompt(vec![-1]), 3);
        let mut b = h.generate(1);
        h.round();
        assert_eq!(
            drain(&mut a),
            [GenEvent::Error(EngineError::Decode("scripted".into()))]
        );
        assert_eq!(
            ids(&drain(&mut b)),
            [1],
            "the slot was free again in the same round"
        );
    }

    #[test]
    fn prefills_run_whole_between_rounds() {
        let mut h = harness(1);
        let mut p = h.prefill();
        h.round();
        let out = p.try_recv().unwrap().unwrap();
        assert_eq!(out.prompt_tokens, [1, 2]);
        assert_eq!(h.in_flight(), 0);
        assert_eq!(h.log.lock().unwrap()[..], ["prefill 0", "keep 0"]);
    }

    /// A running answer takes a step between each two batches of another request's
    /// prefill (a prefill command's, and an answer's start), and the slots in use are
    /// counted with the prefilling one.
    #[test]
    fn running_answers_step_between_a_prefills_batches() {
        let mut h = harness(3);
        let mut a = h.generate(20);
        h.round();
        h.log.lock().unwrap().clear();
        let mut p = h.prefill_of(vec![1, 2, 3, 4]);
        h.round();
        assert!(p.try_recv().unwrap().is_ok());
        assert_eq!(
            h.log.lock().unwrap()[..],
            [
                "prefill 1",
                "step 0",
                "step 0",
                "step 0",
                "keep 1",
                "step 0"
            ]
        );
        h.log.lock().unwrap().clear();
        let _b = h.generate_from(Start::Prompt(vec![5, 6, 7]), 5);
        h.round();
        assert_eq!(
            h.log.lock().unwrap()[..],
            ["begin 1", "step 0", "step 0", "step 0", "step 1"]
        );
        // Every token of the running answer arrived, in order: 1 + 3 + 1 + 2 + 1 steps.
        let got: Vec<i32> = drain(&mut a)
            .iter()
            .filter_map(|e| match e {
                GenEvent::Token(t) => Some(t.id),
                _ => None,
            })
            .collect();
        assert_eq!(got, (1..=8).collect::<Vec<_>>());
    }

    #[test]
    fn a_prefill_nobody_waits_for_gives_its_slot_back_unrun() {
        let mut h = harness(1);
        drop(h.prefill());
        h.round();
        assert_eq!(h.log.lock().unwrap()[..], ["keep 0"]);
        assert_eq!(h.in_flight(), 0);
    }
}
