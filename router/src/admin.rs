//! `/admin/decode-nodes`: the router's decode nodes, changed while it serves (behind the
//! API key, as the API is): `GET` lists each node's URL and state, `POST {"url": ...}` adds
//! one (its `Info` asked at once; requests consider it once its calibration is done),
//! `DELETE {"url": ...}` removes one (answers under way there finish). The pool itself is
//! `backend/pool.rs`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::backend::NodeState;
use crate::error::ApiError;
use crate::state::AppState;

/// Longest node URL taken.
const MAX_URL: usize = 512;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/admin/decode-nodes", get(list).post(add).delete(remove))
}

fn node(url: &str, state: &NodeState) -> Value {
    let mut v = json!({"url": url, "state": state.as_str()});
    if let Some(why) = state.why() {
        v["why"] = json!(why);
    }
    v
}

async fn list(State(s): State<Arc<AppState>>) -> Json<Value> {
    let nodes: Vec<Value> = s
        .pool
        .states()
        .iter()
        .map(|(url, state)| node(url, state))
        .collect();
    Json(json!({ "decode_nodes": nodes }))
}

async fn add(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let url = node_url(&body)?;
    let state = s.pool.add(&url).await?;
    Ok(Json(node(&url, &state)))
}

async fn remove(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let url = node_url(&body)?;
    s.pool.remove(&url)?;
    Ok(Json(json!({"url": url, "removed": true})))
}

/// The body `{"url": "http://host:port"}`, and nothing else.
fn node_url(body: &[u8]) -> Result<String, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("the body is not JSON: {e}")))?;
    let Value::Object(obj) = v else {
        return Err(ApiError::invalid(
            None,
            "the body must be a JSON object: {\"url\": \"http://host:port\"}",
        ));
    };
    if let Some(k) = obj.keys().find(|k| *k != "url") {
        return Err(ApiError::invalid(
            Some(k.clone()),
            format!("unsupported field {k:?}"),
        ));
    }
    match obj.get("url") {
        Some(Value::String(u)) if !u.is_empty() && u.len() <= MAX_URL => Ok(u.clone()),
        _ => Err(ApiError::invalid(
            Some("url".to_string()),
            format!("url must be a decode node's gRPC URL (a string of 1 to {MAX_URL} bytes)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::node_url;

    #[test]
    fn a_node_url_body_is_checked_field_by_field() {
        assert_eq!(node_url(br#"{"url": "http://a:1"}"#).unwrap(), "http://a:1");
        for (body, param) in [
            (&br#"{"url": "http://a:1", "x": 1}"#[..], Some("x")),
            (br#"{"url": 5}"#, Some("url")),
            (br#"{"url": ""}"#, Some("url")),
            (br#"{}"#, Some("url")),
            (br#"[1]"#, None),
            (b"{", None),
        ] {
            let e = node_url(body).unwrap_err();
            assert_eq!(
                e.param.as_deref(),
                param,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let long = format!(r#"{{"url": "{}"}}"#, "a".repeat(513));
        assert!(node_url(long.as_bytes()).is_err());
    }
}
