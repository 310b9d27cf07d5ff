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
//! | `edgesplit:layer_split_peer_layers` | gauge | the layer split (`--rpc-peer`): layers computed on the peer (0 once it is lost) |
//! | `edgesplit:layer_split_restarts` | gauge | engine processes that ran before this one |
//! | `edgesplit:rpc_round_trips_total` | counter | ggml RPC requests that waited for the peer's answer |
//! | `edgesplit:rpc_bytes_total{direction}` | counter | ggml RPC bytes `sent` to the peer, `received` from it |
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

    /// Adds the layer split's series, read on each scrape.
    pub fn watch_layer_split(&self, split: Arc<crate::rpc::Split>) {
        self.metrics
            .registry()
            .register_collector(Box::new(SplitCollector(split)));
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

/// The layer split's series (`watch_layer_split`).
#[derive(Debug)]
struct SplitCollector(Arc<crate::rpc::Split>);

impl prometheus_client::collector::Collector for SplitCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let i = self.0.info();
        for (name, help, v) in [
            (
                "edgesplit:layer_split_peer_layers",
                "Layers computed on the RPC peer",
                i.peer_layers,
            ),
            (
                "edgesplit:layer_split_restarts",
                "Engine processes that ran before this one",
                i.restarts,
            ),
        ] {
            let g = ConstGauge::new(i64::from(v));
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let c = ConstCounter::new(i.round_trips);
        c.encode(encoder.encode_descriptor(
            "edgesplit:rpc_round_trips",
            "ggml RPC requests that waited for the peer's answer",
            None,
            c.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "edgesplit:rpc_bytes",
            "ggml RPC bytes to and from the peer",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (direction, v) in [("sent", i.bytes_sent), ("received", i.bytes_received)] {
            let labels = [("direction", direction)];
            let c = ConstCounter::new(v);
            c.encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
