//! `GET /metrics` of the prefill node (`--metrics-listen`), OpenMetrics text, `edgesplit:`
//! names:
//!
//! | series | kind | meaning |
//! |---|---|---|
//! | `edgesplit:request_prefill_time_seconds` | histogram | prefill of disaggregated requests |
//! | `edgesplit:prompt_tokens_total` | counter | their prompt tokens |
//! | `edgesplit:handoff_bytes_total{transport}` | counter | KV bytes handed over |
//! | `edgesplit:handoff_seconds{transport,outcome}` | histogram | handoff time, `ok` or `error` |
//!
//! Colocated (`local`) runs are counted by the router only.

use std::sync::Arc;

use axum::Router;
use edgesplit_proto::metrics::{label, phase_histogram, Labels, Metrics};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

/// The prefill node's series.
pub struct NodeMetrics {
    metrics: Metrics,
    pub prefill: Histogram,
    pub prompt_tokens: Counter,
    pub handoff_bytes: Family<Labels, Counter>,
    pub handoff_seconds: Family<Labels, Histogram>,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        let m = NodeMetrics {
            metrics: Metrics::default(),
            prefill: phase_histogram(),
            prompt_tokens: Counter::default(),
            handoff_bytes: Family::default(),
            handoff_seconds: Family::new_with_constructor(phase_histogram),
        };
        {
            let mut r = m.metrics.registry();
            r.register(
                "edgesplit:request_prefill_time_seconds",
                "Prefill time",
                m.prefill.clone(),
            );
            r.register(
                "edgesplit:prompt_tokens",
                "Prompt tokens prefilled",
                m.prompt_tokens.clone(),
            );
            r.register(
                "edgesplit:handoff_bytes",
                "KV bytes handed over",
                m.handoff_bytes.clone(),
            );
            r.register(
                "edgesplit:handoff_seconds",
                "KV handoff time",
                m.handoff_seconds.clone(),
            );
        }
        m
    }
}

impl NodeMetrics {
    /// Records one handoff.
    pub fn handoff(&self, transport: &str, ok: bool, bytes: u64, seconds: f64) {
        let outcome = if ok { "ok" } else { "error" };
        if ok {
            self.handoff_bytes
                .get_or_create(&label("transport", transport))
                .inc_by(bytes);
        }
        let mut labels = label("transport", transport);
        labels.push(("outcome".into(), outcome.into()));
        self.handoff_seconds.get_or_create(&labels).observe(seconds);
    }

    /// The OpenMetrics text.
    #[must_use]
    pub fn render(&self) -> String {
        self.metrics.render()
    }
}

/// The `/metrics` route.
pub fn router(m: Arc<NodeMetrics>) -> Router {
    edgesplit_proto::metrics::route(m, NodeMetrics::render)
}
