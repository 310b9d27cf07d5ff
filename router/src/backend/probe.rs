//! Measuring the devices and the link when no answer does: at start, and at idle moments.
//!
//! `transport: "auto"` predicts a mode only from measured figures (`cost.rs`), and a mode
//! that is never chosen is never measured by an answer. So the router measures for itself,
//! with small requests of its own ([`Probe`]), answered and dropped:
//! - **At start** (calibration): the prefill node alone and the decode node alone at once, then an
//!   `after` split for the link. The first `auto` request waits for it (at most
//!   [`CALIBRATION_WAIT`]), so it is chosen from measured figures; the nodes warm up before
//!   they report ready (the engine's warm-up), so no cold figure enters.
//! - **At idle moments**: a device whose figures are stale (`estimate.rs`: none for 30 s)
//!   is measured again when no answer runs on it (the link: on neither), while clients use
//!   the router (an `auto` request within [`IN_USE`]): a device the choice avoids is
//!   measured still, and a router nobody uses does not keep a decode node busy.
//!
//! A probe never takes a client's request: a request is placed by its prediction only, so no
//! client pays for the router's curiosity, and probing costs only a device's idle time.
//! Probes run through the routes answers take, so their figures are recorded as any
//! answer's (the prefill report, the decode speed, the handoff's goodput); they count on the
//! nodes' load while they run, and not in the answers' metrics.

use std::time::{Duration, Instant};

use super::nodes::lock;
use super::route::{Route, Wire};
use super::{Backend, Class, Event, Failure};
use crate::api::{Endpoint, ValidRequest};

/// The probes' prompt: this sentence, repeated [`PROBE_SENTENCES`] times.
const PROBE_SENTENCE: &str = "A device reads this sentence so that the router learns how fast \
                              it reads a prompt and writes an answer. ";

/// About 20 tokens each: ~170 prompt tokens, long enough for a prefill's speed.
const PROBE_SENTENCES: usize = 8;

/// The probes' answer tokens: enough to measure a decode speed
/// (`placement::Rates::decoded` needs 8).
const PROBE_ANSWER_TOKENS: u32 = 16;

/// Longest wait of the first `auto` requests for the calibration.
pub const CALIBRATION_WAIT: Duration = Duration::from_secs(20);

/// How soon a calibration probe that failed is tried again.
const CALIBRATION_RETRY: Duration = Duration::from_millis(250);

/// The router is in use while an `auto` request came within this.
pub const IN_USE: Duration = Duration::from_secs(60);

/// Least time between two probes of the same kind (one that failed or measured nothing is
/// not repeated at once).
const PROBE_GAP: Duration = Duration::from_secs(10);

/// How often the idle moments are looked for.
pub const IDLE_TICK: Duration = Duration::from_secs(1);

/// What a probe measures, and the route that measures it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The prefill node's prefill and decode speeds: the prefill node alone.
    PrefillNode,
    /// The decode node's: the decode node alone.
    DecodeNode,
    /// The link's goodput (and the decode node's decode): an `after` split.
    Link,
}

impl Probe {
    fn route(self) -> Route {
        match self {
            Probe::PrefillNode => Route::Local,
            Probe::DecodeNode => Route::Phone,
            Probe::Link => Route::After(Wire::V2),
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Probe::PrefillNode => "prefill-node",
            Probe::DecodeNode => "decode-node",
            Probe::Link => "link",
        }
    }
}

/// Why a probe measured nothing.
struct Missed {
    /// A node it needs could not take it (not up yet, or gone): a later try may succeed.
    node_down: bool,
    reason: String,
}

impl From<Failure> for Missed {
    fn from(f: Failure) -> Self {
        Missed {
            node_down: f.class == Class::Unavailable,
            reason: f.message,
        }
    }
}

/// The probes' request: greedy, nothing cached, its answer dropped.
fn probe_request() -> ValidRequest {
    let body = serde_json::json!({
        "prompt": PROBE_SENTENCE.repeat(PROBE_SENTENCES),
        "max_tokens": PROBE_ANSWER_TOKENS,
        "temperature": 0,
        "cache_prompt": false,
    });
    // A fixed, valid body: parsing it cannot fail.
    crate::api::parse(Endpoint::Completion, body.to_string().as_bytes(), || 0)
        .unwrap_or_else(|e| unreachable!("the probe's request: {}", e.message))
}

impl Backend {
    /// Runs one probe to its end (the figures it yields are recorded on the way); why it
    /// measured nothing, if it did not end well.
    async fn probe(&self, probe: Probe) -> Result<(), Missed> {
        lock(&self.learned).probed[probe.index()] = Some(Instant::now());
        let id = format!("probe-{}", probe.as_str());
        let result = match self.run(&probe_request(), probe.route(), &id).await {
            Ok(mut started) => loop {
                match started.events.recv().await {
                    Some(Event::Finished { .. }) => break Ok(()),
                    Some(Event::Error(e)) => break Err(Missed::from(e)),
                    Some(_) => {}
                    None => {
                        break Err(Missed {
                            node_down: false,
                            reason: "the answer ended without its end".into(),
                        })
                    }
                }
            },
            Err(e) => Err(Missed::from(e)),
        };
        if result.is_ok() {
            tracing::info!(probe = probe.as_str(), "measured");
        }
        result
    }

    /// A probe of the calibration, tried again while a node is not up yet (a node
    /// started beside the router reports ready after loading and warming up), until
    /// `deadline`; a node that refused it is not asked again.
    async fn probe_until(&self, probe: Probe, deadline: Instant) {
        loop {
            match self.probe(probe).await {
                Ok(()) => return,
                Err(m) if m.node_down && Instant::now() < deadline => {
                    tokio::time::sleep(CALIBRATION_RETRY).await;
                }
                Err(m) => {
                    tracing::warn!(probe = probe.as_str(), reason = %m.reason, "the calibration measured nothing");
                    return;
                }
            }
        }
    }

    /// The calibration at start: the prefill node (unless another pair of the pool has just
    /// measured it) and the decode node at once, then the link, each tried again while its
    /// nodes are not up (until [`CALIBRATION_WAIT`]); then the `auto` requests waiting for
    /// it go on.
    pub async fn calibrate(&self) {
        let t0 = Instant::now();
        let deadline = t0 + CALIBRATION_WAIT;
        // In a pool the pairs share the prefill node's figures (`Rates::beside`): the
        // pair calibrated first measured it, and a probe run again beside the answers the
        // router already serves would add figures slowed by them.
        let prefill_node_known = !lock(&self.learned).rates.stale(t0).prefill_node;
        tokio::join!(
            async {
                if !prefill_node_known {
                    self.probe_until(Probe::PrefillNode, deadline).await;
                }
            },
            self.probe_until(Probe::DecodeNode, deadline)
        );
        self.probe_until(Probe::Link, deadline).await;
        self.calibrated.send_replace(true);
        let m = lock(&self.learned).rates.measured();
        tracing::info!(
            ms = t0.elapsed().as_millis() as u64,
            prefill_node_prefill = ?m.prefill_node_prefill,
            prefill_node_decode = ?m.prefill_node_decode,
            decode_node_prefill = ?m.decode_node_prefill,
            decode_node_decode = ?m.decode_node_decode,
            link = ?m.link,
            "calibrated (tokens or bytes per ms)"
        );
    }

    /// Whether the calibration at start is done (or probes are off).
    pub(super) fn is_calibrated(&self) -> bool {
        *self.calibrated.borrow()
    }

    /// Waits for the calibration, at most [`CALIBRATION_WAIT`] (at once when it is done,
    /// or off).
    pub(super) async fn calibrated(&self) {
        let mut done = self.calibrated.subscribe();
        let _ = tokio::time::timeout(CALIBRATION_WAIT, done.wait_for(|d| *d)).await;
    }

    /// At an idle moment: the probes whose figures are stale and whose devices run no
    /// answer, one after the other, while the router is in use.
    pub async fn measure_idle(&self) {
        for probe in [Probe::PrefillNode, Probe::DecodeNode, Probe::Link] {
            let now = Instant::now();
            let wanted = {
                let l = lock(&self.learned);
                let in_use = l
                    .last_auto
                    .is_some_and(|t| now.saturating_duration_since(t) < IN_USE);
                let recent = l.probed[probe.index()]
                    .is_some_and(|t| now.saturating_duration_since(t) < PROBE_GAP);
                let stale = l.rates.stale(now);
                let stale = match probe {
                    Probe::PrefillNode => stale.prefill_node,
                    Probe::DecodeNode => stale.decode_node,
                    Probe::Link => stale.link,
                };
                in_use && stale && !recent
            };
            let idle = match probe {
                Probe::PrefillNode => self.load.idle(false),
                Probe::DecodeNode => self.load.idle(true),
                Probe::Link => self.load.idle(false) && self.load.idle(true),
            };
            if wanted && idle {
                if let Err(m) = self.probe(probe).await {
                    tracing::warn!(probe = probe.as_str(), reason = %m.reason, "the probe measured nothing");
                }
            }
        }
    }
}
