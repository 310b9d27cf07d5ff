//! `GET /metrics` of the prefill node (`--metrics-listen`), OpenMetrics text, `edgesplit:`
//! names:
//!
//! | series | kind | meaning |
//! |---|---|---|
//! | `edgesplit:request_prefill_time_seconds` | histogram | prefill of disaggregated requests |
//! | `edgesplit:prompt_tokens_total` | counter | their prompt tokens |
//! | `edgesplit:handoff_bytes_total{transport}` | counter | KV bytes handed over |
//! | `edgesplit:handoff_seconds{transport,outcome}` | histogram | handoff time, `ok` or `error` |
//! | `edgesplit:prefix_cache_tokens`, `_bytes` | gauge | the prefix cache: KV kept in idle sequences |
//! | `edgesplit:prefix_cache_hits_total`, `_misses_total`, `_reused_tokens_total` | counter | prompts that reused a cached prefix, that found none; prompt tokens not prefilled |
//!
//! Colocated (`local`) runs are counted by the router only.

use std::sync::Arc;

use axum::Router;
use edgesplit_proto::metrics::{phase_histogram, HandoffSeries, Metrics};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

/// The prefill node's series.
pub struct NodeMetrics {
    metrics: Metrics,
    pub prefill: Histogram,
    pub prompt_tokens: Counter,
    handoffs: HandoffSeries,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        let metrics = Metrics::default();
        let (prefill, prompt_tokens) = (phase_histogram(), Counter::default());
        let handoffs = {
            let mut r = metrics.registry();
            r.register(
                "edgesplit:request_prefill_time_seconds",
                "Prefill time",
                prefill.clone(),
            );
            r.register(
                "edgesplit:prompt_tokens",
                "Prompt tokens prefilled",
                prompt_tokens.clone(),
            );
            HandoffSeries::register(&mut r)
        };
        NodeMetrics {
            metrics,
            prefill,
            prompt_tokens,
            handoffs,
        }
    }
}

impl NodeMetrics {
    /// Records one handoff attempt.
    pub fn handoff(&self, transport: &str, ok: bool, bytes: u64, seconds: f64) {
        self.handoffs.record(transport, ok, bytes, seconds);
    }

    /// Adds the prefix cache's series, read on each scrape.
    pub fn watch_cache(&self, collector: edgesplit_proto::metrics::CacheCollector) {
        self.metrics
            .registry()
            .register_collector(Box::new(collector));
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
