//! The web dashboard at `/dashboard`: one page, its script and style embedded in the
//! binary (no build step, nothing fetched at run time), and the JSON it reads:
//! - `GET /dashboard/api/status`: the router, each node (`Info`) and the decode node's
//!   handoff listeners (a TCP connect to each advertised address);
//! - `GET /dashboard/api/recent`: the last [`RECENT`] answers, in memory;
//! - `GET /dashboard/api/bench`: the newest run in the bench's SQLite record
//!   (`--bench-db`), its summary rows and plot names; `GET /dashboard/bench/{plot}` serves
//!   those plots from the run's output folder.
//!
//! The page runs requests through the public `/v1/chat/completions` API, as any client.

use std::path::PathBuf;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::recent::RECENT;
use crate::state::AppState;

const INDEX: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/app.js");
const STYLE: &str = include_str!("dashboard/style.css");

/// The plots the bench writes, the only files served from its output folder.
const PLOTS: [&str; 3] = ["ttft_vs_prompt.png", "decode_tps.png", "handoff_bytes.png"];

/// The page and its assets (open: the page asks for the API key when one is needed).
pub fn page_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/dashboard", get(|| async { asset("text/html", INDEX) }))
        .route("/dashboard/", get(|| async { asset("text/html", INDEX) }))
        .route(
            "/dashboard/app.js",
            get(|| async { asset("text/javascript", SCRIPT) }),
        )
        .route(
            "/dashboard/style.css",
            get(|| async { asset("text/css", STYLE) }),
        )
        // Images cannot send the key; plots of a benchmark are not private.
        .route("/dashboard/bench/{plot}", get(plot))
}

/// What the page reads (behind the API key when one is configured).
pub fn data_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/dashboard/api/status", get(status))
        .route("/dashboard/api/recent", get(recent))
        .route("/dashboard/api/bench", get(bench))
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, format!("{kind}; charset=utf-8")),
            (header::CACHE_CONTROL, "no-cache".to_string()),
        ],
        body,
    )
        .into_response()
}

fn node_json(
    r: Result<edgesplit_proto::pb::NodeInfo, crate::backend::Failure>,
    url: &str,
) -> Value {
    match r {
        Ok(i) => {
            let mut v = json!({
            "up": true,
            "url": url,
            "model_id": i.model_id,
            "model_fingerprint": i.model_fingerprint,
            "build_id": i.build_id,
            "arch": i.arch,
            "kernels": i.kernels,
            "threads": i.threads,
            "n_ctx": i.n_ctx,
            "flash_attn": i.flash_attn,
            "mem_available_bytes": i.mem_available_bytes,
            "kv_bytes_per_token": i.kv_bytes_per_token,
            "kv_budget_bytes": i.kv_budget_bytes,
            "requests_in_flight": i.requests_in_flight,
            "handoff_addr": i.handoff_addr,
            "v1_url": i.v1_url,
            "handoffs_received": i.handoffs_received,
            "handoffs_refused": i.handoffs_refused,
            "handoff_bytes_received": i.handoff_bytes_received,
            "cached_tokens": i.cached_tokens,
            "cached_bytes": i.cached_tokens * i.kv_bytes_per_token,
            "cache_hits": i.cache_hits,
            "cache_misses": i.cache_misses,
            });
            // The prefill node's layer split (`--rpc-peer`), as `/health` shows it.
            if let Some(l) = &i.layer_split {
                v["layer_split"] = crate::node_json::layer_split(l);
            }
            v
        }
        Err(e) => json!({"up": false, "url": url, "error": e.message}),
    }
}

/// Connects to `addr` (host:port) within a second; the time it took, or why not.
async fn probe(addr: &str) -> Value {
    if addr.is_empty() {
        return json!({"up": false, "addr": addr, "error": "not advertised"});
    }
    let t0 = Instant::now();
    match tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => json!({
            "up": true,
            "addr": addr,
            "connect_ms": t0.elapsed().as_secs_f64() * 1000.0,
        }),
        Ok(Err(e)) => json!({"up": false, "addr": addr, "error": e.to_string()}),
        Err(_) => json!({"up": false, "addr": addr, "error": "no answer within 1 s"}),
    }
}

/// `http://host:port/path` -> `host:port`.
fn host_port(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.split('/').next().unwrap_or("")
}

async fn status(State(s): State<Arc<AppState>>) -> Json<Value> {
    let pool = &s.pool;
    let first = pool.first();
    let (p, d) = tokio::join!(first.prefill_info(), pool.decode_infos());
    let prefill_info = p.as_ref().ok().cloned();
    let mut prefill = node_json(p, &first.prefill_url());
    prefill["tokens_written"] = json!(s.metrics.tokens_written("prefill"));
    let nodes: Vec<Value> = d
        .into_iter()
        .map(|(url, d)| {
            let state = crate::backend::NodeState::of(prefill_info.as_ref(), &d)
                .unless_silent(pool.silent(&url));
            let mut v = node_json(d, &url);
            v["state"] = json!(state.as_str());
            if let Some(why) = state.why() {
                v["why"] = json!(why);
            }
            v["tokens_written"] = json!(s.metrics.tokens_written(&url));
            v
        })
        .collect();
    // The handoff listeners of the first decode node (none in a pool without one).
    let decode = nodes.first().cloned().unwrap_or(Value::Null);
    let (v2, v1) = tokio::join!(
        probe(decode["handoff_addr"].as_str().unwrap_or("")),
        probe(host_port(decode["v1_url"].as_str().unwrap_or(""))),
    );
    let m = &s.metrics;
    Json(json!({
        "router": {
            "up": true,
            "version": env!("CARGO_PKG_VERSION"),
            "default_transport": s.default_transport.as_str(),
            "requests_in_flight": m.running.get() + m.waiting.get(),
            "answered": m.recent.answered(),
            "failed": m.recent.failed(),
            "uptime_s": s.started.elapsed().as_secs(),
            "bench_db": s.bench_db.as_ref().map(|p| p.display().to_string()),
            // Devices may join with a code: the page shows them (`/admin/devices`).
            "joining": s.joins.is_some(),
        },
        "prefill": prefill,
        "decode": decode,
        "decode_nodes": nodes,
        "handoff": {"up": v2["up"] == true && v1["up"] == true, "v2": v2, "v1": v1},
    }))
}

async fn recent(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"requests": s.metrics.recent.list(), "keep": RECENT}))
}

/// The newest run in the bench record: its row, summary rows and plots.
/// The bench record, opened read-only, and its newest finished run.
fn latest_run(db: &std::path::Path) -> Result<(rusqlite::Connection, Value), String> {
    if !db.is_file() {
        return Err(format!(
            "{} does not exist yet: run `edgesplit-bench run`",
            db.display()
        ));
    }
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|e| format!("{}: {e}", db.display()))?;
    let run = conn
        .query_row(
            "SELECT id, started_at, finished_at, command, git_rev, out_dir FROM runs
             WHERE finished_at IS NOT NULL ORDER BY id DESC LIMIT 1",
            [],
            |r| {
                Ok(json!({
                    "id": r.get::<_, i64>(0)?,
                    "started_at": r.get::<_, f64>(1)?,
                    "finished_at": r.get::<_, Option<f64>>(2)?,
                    "command": r.get::<_, String>(3)?,
                    "git_rev": r.get::<_, Option<String>>(4)?,
                    "out_dir": r.get::<_, Option<String>>(5)?,
                }))
            },
        )
        .map_err(|e| format!("{}: {e}", db.display()))?;
    Ok((conn, run))
}

fn read_bench(db: &std::path::Path) -> Result<Value, String> {
    let (conn, run) = latest_run(db)?;
    let e = |e: rusqlite::Error| format!("{}: {e}", db.display());
    let mut stmt = conn
        .prepare(
            "SELECT model, profile, target_prompt_tokens, max_tokens, subject, metric, n, mean,
                    median, p90, min, max FROM summaries WHERE run_id = ?1 ORDER BY id",
        )
        .map_err(e)?;
    let rows = stmt
        .query_map([run["id"].as_i64()], |r| {
            Ok(json!({
                "model": r.get::<_, String>(0)?,
                "profile": r.get::<_, String>(1)?,
                "target_prompt_tokens": r.get::<_, i64>(2)?,
                "max_tokens": r.get::<_, i64>(3)?,
                "subject": r.get::<_, String>(4)?,
                "metric": r.get::<_, String>(5)?,
                "n": r.get::<_, i64>(6)?,
                "mean": r.get::<_, Option<f64>>(7)?,
                "median": r.get::<_, Option<f64>>(8)?,
                "p90": r.get::<_, Option<f64>>(9)?,
                "min": r.get::<_, Option<f64>>(10)?,
                "max": r.get::<_, Option<f64>>(11)?,
            }))
        })
        .map_err(e)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(e)?;
    let plots: Vec<&str> = run["out_dir"]
        .as_str()
        .map(|d| {
            PLOTS
                .iter()
                .copied()
                .filter(|p| std::path::Path::new(d).join(p).is_file())
                .collect()
        })
        .unwrap_or_default();
    Ok(json!({"available": true, "run": run, "summaries": rows, "plots": plots}))
}

async fn bench(State(s): State<Arc<AppState>>) -> Json<Value> {
    let Some(db) = s.bench_db.clone() else {
        return Json(json!({
            "available": false,
            "reason": "no benchmark record configured (start the router with --bench-db bench/results/bench.sqlite)",
        }));
    };
    let r = tokio::task::spawn_blocking(move || read_bench(&db))
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
    Json(r.unwrap_or_else(|reason| json!({"available": false, "reason": reason})))
}

async fn plot(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    let not_found = || (StatusCode::NOT_FOUND, "no such plot").into_response();
    if !PLOTS.contains(&name.as_str()) {
        return not_found();
    }
    let Some(db) = s.bench_db.clone() else {
        return not_found();
    };
    // Only the run's folder is needed, not its summary rows.
    let dir: Option<PathBuf> = tokio::task::spawn_blocking(move || {
        latest_run(&db)
            .ok()
            .and_then(|(_, run)| run["out_dir"].as_str().map(PathBuf::from))
    })
    .await
    .ok()
    .flatten();
    let Some(dir) = dir else {
        return not_found();
    };
    match tokio::fs::read(dir.join(&name)).await {
        Ok(bytes) => ([(header::CONTENT_TYPE, "image/png")], bytes).into_response(),
        Err(_) => not_found(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dashboard reads the bench's record with its own SQL: run it against the
    /// bench's own schema file, so that a renamed column fails here, not on a user's page.
    #[test]
    fn reads_a_record_made_with_the_bench_schema() {
        let dir = std::env::temp_dir().join(format!("edgesplit-dash-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("bench.sqlite");
        let _ = std::fs::remove_file(&db);
        {
            let c = rusqlite::Connection::open(&db).unwrap();
            c.execute_batch(include_str!("../../bench/schema.sql"))
                .unwrap();
            c.execute_batch(
                "INSERT INTO runs (id, started_at, finished_at, command, git_rev, threads, n_ctx, out_dir)
                     VALUES (1, 10.0, 20.0, 'edgesplit-bench run', 'abc', 2, 4096, NULL);
                 INSERT INTO summaries (run_id, model, profile, target_prompt_tokens, max_tokens,
                     subject, metric, n, mean, median, stddev, min, max, p90, attempt_ids)
                     VALUES (1, 'm', 'loopback', 500, 32, 'v2', 'ttft_ms', 5, 1.5, 1.0, 0.1, 0.5, 3.0, 2.5, '[1]');",
            )
            .unwrap();
        }
        let v = read_bench(&db).unwrap();
        assert_eq!(v["run"]["id"], 1);
        assert_eq!(v["run"]["command"], "edgesplit-bench run");
        let row = &v["summaries"][0];
        assert_eq!(row["subject"], "v2");
        assert_eq!(row["metric"], "ttft_ms");
        assert_eq!(row["median"], 1.0);
        assert_eq!(row["p90"], 2.5);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn host_port_of_urls() {
        assert_eq!(
            host_port("http://127.0.0.1:50062/v1/handoff"),
            "127.0.0.1:50062"
        );
        assert_eq!(host_port("10.0.0.2:9"), "10.0.0.2:9");
        assert_eq!(host_port(""), "");
    }
}
