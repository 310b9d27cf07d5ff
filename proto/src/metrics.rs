//! The Prometheus plumbing the router and both nodes share: a registry behind a lock, the
//! OpenMetrics `/metrics` route, label sets, and one bucket table per kind of duration, so
//! that series of the same name on different services can be combined.

use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A series' labels, as `prometheus_client` families take them.
pub type Labels = Vec<(String, String)>;

/// One label.
#[must_use]
pub fn label(name: &str, value: &str) -> Labels {
    vec![(name.into(), value.into())]
}

/// The content type of the OpenMetrics text.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Buckets (seconds) of whole phases of a request: prefill, decode, end to end, handoffs.
/// Used by every service for them: `edgesplit:request_prefill_time_seconds` exists on the
/// router and on the prefill node with the same buckets.
pub const PHASE_SECONDS: [f64; 19] = [
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
    120.0, 300.0,
];

/// A histogram over [`PHASE_SECONDS`].
#[must_use]
pub fn phase_histogram() -> Histogram {
    Histogram::new(PHASE_SECONDS)
}

/// The prefix cache's figures, read on every scrape ([`CacheCollector`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct CacheFigures {
    /// Tokens kept in idle sequences' KV, and their bytes.
    pub cached_tokens: u64,
    pub cached_bytes: u64,
    /// Prompts that reused a cached prefix; prompts that found none.
    pub hits: u64,
    pub misses: u64,
    /// Prompt tokens not prefilled because their cached KV was reused.
    pub reused_tokens: u64,
}

/// The prefix cache's series, read from the engine on each scrape:
/// `edgesplit:prefix_cache_tokens` and `_bytes` (gauges), `edgesplit:prefix_cache_hits`,
/// `_misses` and `_reused_tokens` (counters).
pub struct CacheCollector(pub Box<dyn Fn() -> CacheFigures + Send + Sync>);

impl std::fmt::Debug for CacheCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheCollector")
    }
}

impl prometheus_client::collector::Collector for CacheCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let f = (self.0)();
        let gauge = |v: u64| ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
        for (name, help, v) in [
            (
                "edgesplit:prefix_cache_tokens",
                "Tokens kept in idle sequences' KV",
                f.cached_tokens,
            ),
            (
                "edgesplit:prefix_cache_bytes",
                "KV bytes kept in idle sequences",
                f.cached_bytes,
            ),
        ] {
            let g = gauge(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        for (name, help, v) in [
            (
                "edgesplit:prefix_cache_hits",
                "Prompts that reused a cached prefix",
                f.hits,
            ),
            (
                "edgesplit:prefix_cache_misses",
                "Prompts that found no cached prefix",
                f.misses,
            ),
            (
                "edgesplit:prefix_cache_reused_tokens",
                "Prompt tokens not prefilled: their cached KV was reused",
                f.reused_tokens,
            ),
        ] {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        Ok(())
    }
}

/// A registry that series are registered into once and rendered from on every scrape.
#[derive(Default)]
pub struct Metrics {
    registry: Mutex<Registry>,
}

impl Metrics {
    /// The registry, to register series (a poisoned lock is still usable: it holds no
    /// invariant of its own).
    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The OpenMetrics text of every series.
    #[must_use]
    pub fn render(&self) -> String {
        render(&self.registry())
    }
}

/// The OpenMetrics text of `registry`.
#[must_use]
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

/// `GET /metrics`, answered with `text(&state)` as OpenMetrics.
pub fn route<S: Send + Sync + 'static>(state: Arc<S>, text: fn(&S) -> String) -> Router {
    Router::new().route(
        "/metrics",
        get(move |State(s): State<Arc<S>>| async move {
            ([(header::CONTENT_TYPE, OPENMETRICS)], text(&s)).into_response()
        })
        .with_state(state),
    )
}

/// The handoff series the router and the prefill node both keep:
/// `edgesplit:handoff_bytes_total{transport}` and
/// `edgesplit:handoff_seconds{transport,outcome}`.
pub struct HandoffSeries {
    bytes: prometheus_client::metrics::family::Family<
        Labels,
        prometheus_client::metrics::counter::Counter,
    >,
    seconds: prometheus_client::metrics::family::Family<Labels, Histogram>,
}

impl HandoffSeries {
    /// Creates the two series and registers them.
    pub fn register(registry: &mut Registry) -> Self {
        let s = HandoffSeries {
            bytes: prometheus_client::metrics::family::Family::default(),
            seconds: prometheus_client::metrics::family::Family::new_with_constructor(
                phase_histogram,
            ),
        };
        registry.register(
            "edgesplit:handoff_bytes",
            "KV bytes handed over",
            s.bytes.clone(),
        );
        registry.register(
            "edgesplit:handoff_seconds",
            "KV handoff time",
            s.seconds.clone(),
        );
        s
    }

    /// Records one handoff attempt (its bytes count only when it succeeded).
    pub fn record(&self, transport: &str, ok: bool, bytes: u64, seconds: f64) {
        if ok {
            self.bytes
                .get_or_create(&label("transport", transport))
                .inc_by(bytes);
        }
        let mut labels = label("transport", transport);
        labels.push(("outcome".into(), if ok { "ok" } else { "error" }.into()));
        self.seconds.get_or_create(&labels).observe(seconds);
    }
}
