//! [`Engine`]: the cheap, cloneable async handle to an engine's owner thread, through which
//! async code tokenizes, prefills and starts generations without touching llama.cpp.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::command::{CacheStats, Command, Gauges, GenerateJob, InFlight, PrefillJob, SnapshotAsk};
use crate::config::EngineConfig;
use crate::info::ModelInfo;
use crate::sampling::SamplingParams;
use crate::types::{EngineError, Export, GenEvent, Input, PrefillOutput, Reuse, Snapshot, Start};
use crate::worker;

/// Handle to an engine's owner thread. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    info: Arc<ModelInfo>,
    /// Owner-thread gauges: tokens held in KV, slots in use.
    gauges: Arc<Gauges>,
    in_flight: Arc<AtomicU64>,
}

impl Engine {
    /// Loads the model and creates its contexts on a new owner thread, and waits until it
    /// is ready.
    ///
    /// # Errors
    /// [`EngineError::Load`] if the file is missing, llama.cpp refuses it, or a context
    /// cannot be allocated.
    pub async fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        let (tx, rx) = mpsc::channel(64);
        let (ready_tx, ready_rx) = oneshot::channel();
        let gauges = Arc::new(Gauges::default());
        let g = gauges.clone();
        std::thread::Builder::new()
            .name("llama-engine".into())
            .spawn(move || worker::owner_thread(config, rx, ready_tx, g))
            .map_err(|e| EngineError::Load {
                path: String::new(),
                reason: e.to_string(),
            })?;
        let info = ready_rx.await.map_err(|_| EngineError::Closed)??;
        Ok(Engine {
            tx,
            info: Arc::new(info),
            gauges,
            in_flight: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Prefills and generations queued or running now.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Tokens whose KV the slots in use hold now, all together (0 when idle; the prefix
    /// cache kept in idle slots is [`Engine::cache_stats`]).
    #[must_use]
    pub fn kv_tokens(&self) -> u64 {
        self.gauges.kv_tokens.load(Ordering::Relaxed)
    }

    /// The prefix cache: tokens kept in idle slots, hits, misses, tokens reused.
    #[must_use]
    pub fn cache_stats(&self) -> CacheStats {
        let g = &self.gauges;
        CacheStats {
            cached_tokens: g.cached_tokens.load(Ordering::Relaxed),
            hits: g.cache_hits.load(Ordering::Relaxed),
            misses: g.cache_misses.load(Ordering::Relaxed),
            reused_tokens: g.reused_tokens.load(Ordering::Relaxed),
        }
    }

    /// Slots in use now: prefilling, or writing an answer (at most `info().parallel`).
    #[must_use]
    pub fn active(&self) -> u64 {
        self.gauges.active.load(Ordering::Relaxed)
    }

    /// Facts about the loaded model and context.
    #[must_use]
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Renders (chat) and tokenizes the input.
    ///
    /// # Errors
    /// No chat template, template failure, empty prompt.
    pub async fn tokenize(&self, input: Input) -> Result<Vec<i32>, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Tokenize { input, reply }).await?;
        rx.await.map_err(|_| EngineError::Closed)?
    }

    /// Prefills `tokens`, samples the first token, and exports the state if asked and the
    /// answer continues past the first token. Waits for a free sequence slot.
    ///
    /// # Errors
    /// Context overflow, llama.cpp decode or export failure.
    pub async fn prefill(
        &self,
        tokens: Vec<i32>,
        params: SamplingParams,
        max_tokens: u32,
        export: Export,
    ) -> Result<PrefillOutput, EngineError> {
        self.prefill_with(tokens, params, max_tokens, export, Reuse::Exact)
            .await
    }

    /// [`Engine::prefill`] under a given reuse rule for the prefix cache.
    ///
    /// # Errors
    /// Context overflow, llama.cpp decode or export failure.
    pub async fn prefill_with(
        &self,
        tokens: Vec<i32>,
        params: SamplingParams,
        max_tokens: u32,
        export: Export,
        reuse: Reuse,
    ) -> Result<PrefillOutput, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Prefill {
            job: PrefillJob {
                tokens,
                params,
                max_tokens,
                export,
                reuse,
            },
            reply,
            in_flight: InFlight::new(&self.in_flight),
        })
        .await?;
        rx.await.map_err(|_| EngineError::Closed)?
    }

    /// Starts a generation; events arrive on the returned channel (unbounded, so a slow
    /// reader never holds up the other sequences; at most `max_tokens` + 2 events). It
    /// waits for a free sequence slot. Dropping the receiver cancels the generation and
    /// frees its slot.
    ///
    /// # Errors
    /// [`EngineError::Closed`] if the owner thread is gone.
    pub async fn generate(
        &self,
        start: Start,
        params: SamplingParams,
        max_tokens: u32,
    ) -> Result<mpsc::UnboundedReceiver<GenEvent>, EngineError> {
        self.start_generation(start, params, max_tokens, None, None)
            .await
    }

    /// As [`Engine::generate`], and the answer's state can be taken between two steps
    /// ([`Live::snapshot`]) while it goes on, or as it is handed over to another node. A
    /// prompt's prefill also sends its state after each batch but the last to the returned
    /// pieces channel, which closes when the prefill ends.
    ///
    /// # Errors
    /// [`EngineError::Closed`] if the owner thread is gone.
    pub async fn generate_live(
        &self,
        start: Start,
        params: SamplingParams,
        max_tokens: u32,
    ) -> Result<LiveAnswer, EngineError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (pieces_tx, pieces) = mpsc::unbounded_channel();
        let events = self
            .start_generation(start, params, max_tokens, Some(rx), Some(pieces_tx))
            .await?;
        Ok(LiveAnswer {
            events,
            live: Live { tx },
            pieces,
        })
    }

    async fn start_generation(
        &self,
        start: Start,
        params: SamplingParams,
        max_tokens: u32,
        live: Option<mpsc::UnboundedReceiver<SnapshotAsk>>,
        pieces: Option<mpsc::UnboundedSender<Snapshot>>,
    ) -> Result<mpsc::UnboundedReceiver<GenEvent>, EngineError> {
        let (events, rx) = mpsc::unbounded_channel();
        self.send(Command::Generate {
            job: GenerateJob {
                start,
                params,
                max_tokens,
                live,
                pieces,
            },
            events,
            in_flight: InFlight::new(&self.in_flight),
        })
        .await?;
        Ok(rx)
    }

    /// Reads `tokens` and streams, for each position, the log-probabilities of the next
    /// token over the whole vocabulary (for measuring what a KV cache type or another
    /// device costs against a reference; not an answer), from position `from` on. The
    /// positions before it are context: prefilled as a prompt is, or, with `prefix`,
    /// imported from that state (the [`Export::Raw`](crate::Export) of such a prefill,
    /// maybe on another machine). Either way the scored positions are read in the same
    /// batches, so on one machine both give the same numbers. Waits for a free sequence
    /// slot; at most 8 positions wait unread.
    ///
    /// # Errors
    /// [`EngineError::Closed`] if the owner thread is gone.
    pub async fn score(
        &self,
        tokens: Vec<i32>,
        from: usize,
        prefix: Option<Vec<u8>>,
    ) -> Result<mpsc::Receiver<Result<Vec<f32>, EngineError>>, EngineError> {
        let (out, rx) = mpsc::channel(8);
        self.send(Command::Score {
            tokens,
            from,
            prefix,
            out,
            in_flight: InFlight::new(&self.in_flight),
        })
        .await?;
        Ok(rx)
    }

    async fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.tx.send(cmd).await.map_err(|_| EngineError::Closed)
    }
}

/// A live answer's channels ([`Engine::generate_live`]).
pub struct LiveAnswer {
    /// Its events, as [`Engine::generate`]'s.
    pub events: mpsc::UnboundedReceiver<GenEvent>,
    /// Its snapshots between steps.
    pub live: Live,
    /// Its prompt's state after each prefill batch but the last (closed when the prefill
    /// ends; none for a prompt of one batch).
    pub pieces: mpsc::UnboundedReceiver<Snapshot>,
}

/// Takes snapshots of a live answer ([`Engine::generate_live`]).
#[derive(Clone)]
pub struct Live {
    tx: mpsc::UnboundedSender<SnapshotAsk>,
}

impl Live {
    /// The answer's state before its next step, from position `from` on (0: all of it);
    /// with `stop`, the answer ends there ([`crate::Finish::Handover`]) and emits nothing
    /// more. `None` when the answer has already ended (or never started).
    pub async fn snapshot(&self, stop: bool, from: usize) -> Option<Result<Snapshot, EngineError>> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(SnapshotAsk {
                stop,
                at_end: false,
                from,
                digest: false,
                reply,
            })
            .ok()?;
        rx.await.ok()
    }

    /// The answer's state before its next step from position `from` (> 0) on, with the
    /// SHA-256 of the state before it ([`Snapshot::head_digest`]): the first piece of a
    /// tail handoff. `None` when the answer has already ended.
    pub async fn first_tail(&self, from: usize) -> Option<Result<Snapshot, EngineError>> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(SnapshotAsk {
                stop: false,
                at_end: false,
                from,
                digest: true,
                reply,
            })
            .ok()?;
        rx.await.ok()
    }

    /// Asks now for the answer's state from position `from` on as it stands when the
    /// answer ends by itself (end of generation or its length; the positions its last
    /// step wrote included): resolves then, or to `None` when it is handed over, cancelled
    /// or had already ended, or when a newer `at_end` ask replaced this one. Dropping the
    /// future withdraws the ask (nothing is exported for it).
    pub fn at_end(
        &self,
        from: usize,
    ) -> impl std::future::Future<Output = Option<Result<Snapshot, EngineError>>> + Send + 'static
    {
        let (reply, rx) = oneshot::channel();
        let asked = self
            .tx
            .send(SnapshotAsk {
                stop: false,
                at_end: true,
                from,
                digest: false,
                reply,
            })
            .is_ok();
        async move {
            if asked {
                rx.await.ok()
            } else {
                None
            }
        }
    }
}
