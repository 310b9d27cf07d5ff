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

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

const SECONDS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
];

fn seconds() -> Histogram {
    Histogram::new(SECONDS)
}

/// The prefill node's series.
pub struct NodeMetrics {
    registry: Mutex<Registry>,
    pub prefill: Histogram,
    pub prompt_tokens: Counter,
    pub handoff_bytes: Family<Labels, Counter>,
    pub handoff_seconds: Family<Labels, Histogram>,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        let m = NodeMetrics {
            registry: Mutex::new(Registry::default()),
            prefill: seconds(),
            prompt_tokens: Counter::default(),
            handoff_bytes: Family::default(),
            handoff_seconds: Family::new_with_constructor(seconds),
        };
        {
            let mut r = m
                .registry
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
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
                .get_or_create(&vec![("transport".into(), transport.into())])
                .inc_by(bytes);
        }
        self.handoff_seconds
            .get_or_create(&vec![
                ("transport".into(), transport.into()),
                ("outcome".into(), outcome.into()),
            ])
            .observe(seconds);
    }

    /// The OpenMetrics text.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        let r = self
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = encode(&mut out, &r);
        out
    }
}

/// The `/metrics` route.
pub fn router(m: Arc<NodeMetrics>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(m)
}

async fn metrics(State(m): State<Arc<NodeMetrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.render(),
    )
}
