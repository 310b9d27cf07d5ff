//! The router's Prometheus metrics, named as vLLM names them (users' dashboards already
//! know those) under an `edgesplit:` prefix. Histograms have explicit buckets.
//!
//! | series | kind | meaning |
//! |---|---|---|
//! | `edgesplit:time_to_first_token_seconds` | histogram | request received to first text |
//! | `edgesplit:inter_token_latency_seconds` | histogram | between successive tokens |
//! | `edgesplit:e2e_request_latency_seconds` | histogram | request received to end |
//! | `edgesplit:request_prefill_time_seconds` | histogram | prefill, as the node measured it |
//! | `edgesplit:request_decode_time_seconds` | histogram | decode steps, as the node measured them |
//! | `edgesplit:prompt_tokens_total` | counter | prompt tokens of finished requests |
//! | `edgesplit:generation_tokens_total` | counter | tokens generated |
//! | `edgesplit:request_success_total{finished_reason}` | counter | finished requests |
//! | `edgesplit:request_failure_total{code}` | counter | failed requests, by error code |
//! | `edgesplit:num_requests_running` | gauge | answers being streamed |
//! | `edgesplit:num_requests_waiting` | gauge | requests not yet at their first token |
//! | `edgesplit:num_requests_queued` | gauge | requests in the admission queue (`--max-queue`) |
//! | `edgesplit:handoff_bytes_total{transport}` | counter | KV bytes handed over |
//! | `edgesplit:handoff_seconds{transport,outcome}` | histogram | handoff time (connect to ACK) |
//! | `edgesplit:fallbacks_total{cause}` | counter | requests finished on another node than planned |
//! | `edgesplit:node_tokens_total{node}` | counter | answer tokens each node wrote: `prefill`, or a decode node's URL |

pub use edgesplit_proto::metrics::label;
use edgesplit_proto::metrics::{phase_histogram, HandoffSeries, Labels};

use crate::recent::{Recent, RecentAnswer, Status};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

const LATENCY: [f64; 18] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0,
];
/// Buckets of actual / predicted: within 10%, 20%, 50%, twice, ...
const RATIO: [f64; 13] = [
    0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0,
];
const ITL: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];
fn latency() -> Histogram {
    Histogram::new(LATENCY)
}

/// All router series.
pub struct Metrics {
    metrics: edgesplit_proto::metrics::Metrics,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub prefill: Histogram,
    pub decode: Histogram,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub success: Family<Labels, Counter>,
    pub failure: Family<Labels, Counter>,
    pub running: Gauge,
    pub waiting: Gauge,
    /// Requests in the admission queue, set from `Admission::queued` at each scrape.
    pub queued: Gauge,
    /// Same series (and buckets) as the prefill node's of the same names.
    pub handoffs: HandoffSeries,
    pub fallbacks: Family<Labels, Counter>,
    /// Answer tokens written by each node (`node`: `prefill`, or a decode node's URL).
    pub node_tokens: Family<Labels, Counter>,
    /// `transport: "auto"`'s choices, by mode and objective.
    pub choices: Family<Labels, Counter>,
    /// `transport: "auto"`: each answer's actual end over its predicted end, by mode.
    pub actual_over_predicted: Family<Labels, Histogram>,
    /// The last answers, for the dashboard.
    pub recent: Recent,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every series.
    #[must_use]
    pub fn new() -> Self {
        let metrics = edgesplit_proto::metrics::Metrics::default();
        let handoffs = HandoffSeries::register(&mut metrics.registry());
        let m = Metrics {
            metrics,
            ttft: latency(),
            itl: Histogram::new(ITL),
            e2e: phase_histogram(),
            prefill: phase_histogram(),
            decode: phase_histogram(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            success: Family::default(),
            failure: Family::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            queued: Gauge::default(),
            handoffs,
            fallbacks: Family::default(),
            node_tokens: Family::default(),
            choices: Family::default(),
            actual_over_predicted: Family::new_with_constructor(|| Histogram::new(RATIO)),
            recent: Recent::default(),
        };
        {
            let mut r = m.metrics.registry();
            r.register(
                "edgesplit:time_to_first_token_seconds",
                "Time to first token",
                m.ttft.clone(),
            );
            r.register(
                "edgesplit:inter_token_latency_seconds",
                "Time between tokens",
                m.itl.clone(),
            );
            r.register(
                "edgesplit:e2e_request_latency_seconds",
                "Request latency",
                m.e2e.clone(),
            );
            r.register(
                "edgesplit:request_prefill_time_seconds",
                "Prefill time",
                m.prefill.clone(),
            );
            r.register(
                "edgesplit:request_decode_time_seconds",
                "Decode time",
                m.decode.clone(),
            );
            r.register(
                "edgesplit:prompt_tokens",
                "Prompt tokens",
                m.prompt_tokens.clone(),
            );
            r.register(
                "edgesplit:generation_tokens",
                "Generated tokens",
                m.generation_tokens.clone(),
            );
            r.register(
                "edgesplit:request_success",
                "Finished requests",
                m.success.clone(),
            );
            r.register(
                "edgesplit:request_failure",
                "Failed requests",
                m.failure.clone(),
            );
            r.register(
                "edgesplit:num_requests_running",
                "Requests streaming",
                m.running.clone(),
            );
            r.register(
                "edgesplit:num_requests_queued",
                "Requests waiting for a router slot",
                m.queued.clone(),
            );
            r.register(
                "edgesplit:num_requests_waiting",
                "Requests before their first token",
                m.waiting.clone(),
            );
            r.register(
                "edgesplit:fallbacks",
                "Requests that fell back to another node",
                m.fallbacks.clone(),
            );
            r.register(
                "edgesplit:node_tokens",
                "Answer tokens each node wrote: prefill, or a decode node's URL",
                m.node_tokens.clone(),
            );
            r.register(
                "edgesplit:auto_choices",
                "Requests whose mode the router chose (transport auto), by mode and objective",
                m.choices.clone(),
            );
            r.register(
                "edgesplit:auto_actual_over_predicted",
                "Answers whose mode the router chose: the actual end over the predicted, by mode",
                m.actual_over_predicted.clone(),
            );
        }
        m
    }

    /// Answer tokens the node `node` wrote since start (`prefill`, or a decode node's URL).
    #[must_use]
    pub fn tokens_written(&self, node: &str) -> u64 {
        self.node_tokens.get_or_create(&label("node", node)).get()
    }

    /// Counts a failed request.
    pub fn failed(&self, code: &str) {
        self.failure.get_or_create(&label("code", code)).inc();
    }

    /// Records how one answer ended: every series it counts in, and the recent-answers
    /// list. The one place an outcome is recorded (refusals before the first token too).
    pub fn record(&self, a: RecentAnswer) {
        match a.status {
            Status::Ok => {
                if let Some(ms) = a.timing.ttft_ms {
                    self.ttft.observe(ms / 1000.0);
                }
                if let Some(ms) = a.e2e_ms {
                    self.e2e.observe(ms / 1000.0);
                }
                if let Some(ms) = a.timing.prefill_ms {
                    self.prefill.observe(ms / 1000.0);
                }
                if let Some(ms) = a.timing.decode_ms {
                    self.decode.observe(ms / 1000.0);
                }
                self.prompt_tokens.inc_by(u64::from(a.prompt_tokens));
                self.generation_tokens
                    .inc_by(u64::from(a.completion_tokens));
                self.success
                    .get_or_create(&label(
                        "finished_reason",
                        a.finish_reason.unwrap_or("length"),
                    ))
                    .inc();
                if let Some(cause) = &a.timing.fallback {
                    self.fallbacks.get_or_create(&label("cause", cause)).inc();
                }
                let on_decode = a.timing.decode_node_tokens.min(a.completion_tokens);
                if let (Some(node), true) = (&a.timing.decode_node, on_decode > 0) {
                    self.node_tokens
                        .get_or_create(&label("node", node))
                        .inc_by(u64::from(on_decode));
                }
                if a.completion_tokens > on_decode {
                    self.node_tokens
                        .get_or_create(&label("node", "prefill"))
                        .inc_by(u64::from(a.completion_tokens - on_decode));
                }
                if let (Some(mode), Some(objective)) = (a.timing.mode, a.timing.objective) {
                    self.choices
                        .get_or_create(&vec![
                            ("mode".to_string(), mode.to_string()),
                            ("objective".to_string(), objective.to_string()),
                        ])
                        .inc();
                }
                if let (Some(mode), Some(predicted), Some(actual)) =
                    (a.timing.mode, a.timing.predicted_ms, a.timing.actual_ms)
                {
                    if predicted > 0.0 {
                        self.actual_over_predicted
                            .get_or_create(&label("mode", mode))
                            .observe(actual / predicted);
                    }
                }
                if let (Some(b), Some(ms), Some(transport)) =
                    (a.timing.handoff_bytes, a.timing.handoff_ms, a.transport)
                {
                    self.handoffs.record(transport, true, b, ms / 1000.0);
                }
            }
            Status::Error => self.failed(a.code.as_deref().unwrap_or("error")),
        }
        self.recent.push(a);
    }

    /// The Prometheus (OpenMetrics) text of every series.
    #[must_use]
    pub fn render(&self) -> String {
        self.metrics.render()
    }
}

/// Tracks one request in the running/waiting gauges: waiting from creation, running after
/// [`RequestObserver::started`], out of both when dropped.
pub struct RequestObserver {
    pub metrics: std::sync::Arc<Metrics>,
    running: bool,
    /// The request's admission slot, released with the observer (the end of the answer).
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl RequestObserver {
    /// A request that has arrived (counted as waiting).
    #[must_use]
    pub fn new(metrics: std::sync::Arc<Metrics>) -> Self {
        metrics.waiting.inc();
        Self {
            metrics,
            running: false,
            slot: None,
        }
    }

    /// Holds `slot` until the answer ends.
    #[must_use]
    pub fn holding(mut self, slot: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        self.slot = slot;
        self
    }

    /// The request has its first token: waiting -> running.
    #[must_use]
    pub fn started(mut self) -> Self {
        if !self.running {
            self.metrics.waiting.dec();
            self.metrics.running.inc();
            self.running = true;
        }
        self
    }
}

impl Drop for RequestObserver {
    fn drop(&mut self) {
        if self.running {
            self.metrics.running.dec();
        } else {
            self.metrics.waiting.dec();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_style_names() {
        let m = Metrics::new();
        m.prompt_tokens.inc_by(7);
        m.ttft.observe(0.2);
        m.handoffs.record("v2", true, 100, 0.5);
        let text = m.render();
        assert!(text.contains("edgesplit:prompt_tokens_total 7"), "{text}");
        assert!(
            text.contains("edgesplit:time_to_first_token_seconds_bucket{le=\"0.2\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("edgesplit:handoff_bytes_total{transport=\"v2\"} 100"),
            "{text}"
        );
    }
}
