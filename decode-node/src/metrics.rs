//! `GET /metrics` of the decode node (served on the V1 HTTP listener), Prometheus/OpenMetrics
//! text, `edgesplit:` names:
//!
//! | series | kind | meaning |
//! |---|---|---|
//! | `edgesplit:handoffs_received_total` | counter | states verified and held (V1 and V2) |
//! | `edgesplit:handoff_bytes_received_total` | counter | their bytes |
//! | `edgesplit:handoffs_refused_total` | counter | refused states and uploads |
//! | `edgesplit:kv_bytes_in_use` | gauge | KV of the sequences being decoded (tokens x KV bytes/token) |
//! | `edgesplit:prefix_cache_tokens`, `_bytes` | gauge | the prefix cache: KV kept in idle sequences |
//! | `edgesplit:prefix_cache_hits_total`, `_misses_total`, `_reused_tokens_total` | counter | prompts that reused a cached prefix, that found none; prompt tokens not prefilled |
//! | `edgesplit:pending_handoff_bytes` | gauge | verified states waiting for their `Generate` |
//! | `edgesplit:mem_available_bytes` | gauge | `MemAvailable` of the machine |

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::Router;
use edgesplit_engine::Engine;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::store::Store;

/// What the metrics are read from.
pub struct Sources {
    pub store: Arc<Store>,
    pub engine: Engine,
}

/// The `/metrics` route.
pub fn router(src: Arc<Sources>) -> Router {
    edgesplit_proto::metrics::route(src, render)
}

fn counter(r: &mut Registry, name: &str, help: &str, v: u64) {
    let c = Counter::<u64>::default();
    c.inc_by(v);
    r.register(name, help, c);
}

fn gauge(r: &mut Registry, name: &str, help: &str, v: u64) {
    let g = Gauge::<i64>::default();
    g.set(i64::try_from(v).unwrap_or(i64::MAX));
    r.register(name, help, g);
}

/// Renders the current values.
#[must_use]
pub fn render(src: &Sources) -> String {
    let c = &src.store.counters;
    let mut r = Registry::default();
    counter(
        &mut r,
        "edgesplit:handoffs_received",
        "States verified and held",
        c.handoffs_received.load(Ordering::Relaxed),
    );
    counter(
        &mut r,
        "edgesplit:handoff_bytes_received",
        "Bytes of states verified and held",
        c.bytes_received.load(Ordering::Relaxed),
    );
    counter(
        &mut r,
        "edgesplit:handoffs_refused",
        "Refused states and uploads",
        c.handoffs_refused.load(Ordering::Relaxed),
    );
    let per = src.engine.info().kv_bytes_per_token;
    gauge(
        &mut r,
        "edgesplit:kv_bytes_in_use",
        "KV bytes of the sequences being decoded",
        src.engine.kv_tokens() * per,
    );
    r.register_collector(Box::new(src.engine.cache_collector()));
    gauge(
        &mut r,
        "edgesplit:pending_handoff_bytes",
        "Verified states waiting for Generate",
        src.store.held_bytes(),
    );
    gauge(
        &mut r,
        "edgesplit:mem_available_bytes",
        "MemAvailable",
        edgesplit_engine::mem_available_bytes().unwrap_or(0),
    );
    edgesplit_proto::metrics::render(&r)
}
