//! `/admin/decode-nodes`: the router's decode nodes, changed while it serves (behind the
//! API key, as the API is): `GET` lists each node's URL and state, `POST {"url": ...}` adds
//! one (its `Info` asked at once; requests consider it once its calibration is done),
//! `DELETE {"url": ...}` removes one (answers under way there finish). The pool itself is
//! `backend/pool.rs`.
//!
//! With `--join-listen` (`join.rs`): `POST /admin/pairing` (optionally `{"ttl_s": N}`)
//! opens a pairing and answers its code, `DELETE /admin/pairing` closes it, `GET
//! /admin/devices` lists the joined devices and the open pairing, `DELETE
//! /admin/devices/ID` removes a device (out of the pool; its announces refused).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::backend::NodeState;
use crate::error::{ApiError, HttpCode};
use crate::state::AppState;

/// Longest node URL taken.
const MAX_URL: usize = 512;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/decode-nodes", get(list).post(add).delete(remove))
        .route("/admin/pairing", post(pair).delete(unpair))
        .route("/admin/devices", get(devices))
        .route("/admin/devices/{id}", delete(revoke))
}

fn joins(s: &AppState) -> Result<Arc<crate::join::Joins>, ApiError> {
    s.joins.clone().ok_or_else(|| {
        ApiError::invalid(
            None,
            "joining is off: start the router with --join-listen (and a shared secret)",
        )
        .with_code(HttpCode::JoiningOff)
    })
}

async fn pair(State(s): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let joins = joins(&s)?;
    let ttl = pairing_ttl(&body)?;
    let code = joins.pair(ttl);
    Ok(Json(json!({
        "code": code.to_string(),
        "nameplate": code.nameplate(),
        "expires_in_s": ttl.as_secs(),
        "tries": edgesplit_proto::join::TRIES,
    })))
}

async fn unpair(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    joins(&s)?.close_pairing();
    Ok(Json(json!({"pairing": null})))
}

async fn devices(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let joins = joins(&s)?;
    let states = s.pool.states();
    let devices: Vec<Value> = joins
        .devices()
        .into_iter()
        .map(|d| {
            let state = match d
                .url
                .as_ref()
                .and_then(|u| states.iter().find(|(url, _)| url == u))
            {
                Some((_, st)) => st.as_str().to_string(),
                None => joins.stage(&d.id).unwrap_or_else(|| {
                    if d.url.is_some() {
                        "not in the pool"
                    } else {
                        "not announced"
                    }
                    .to_string()
                }),
            };
            json!({"id": d.id, "name": d.name, "url": d.url, "qualified": d.qualified,
                "agreement": d.agreement, "state": state})
        })
        .collect();
    let pairing = joins
        .pairing()
        .map(|(nameplate, left)| json!({"nameplate": nameplate, "expires_in_s": left.as_secs()}));
    Ok(Json(
        json!({"devices": devices, "pairing": pairing, "join_port": joins.join_port()}),
    ))
}

async fn revoke(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let d = joins(&s)?
        .revoke(&id)
        .map_err(|e| ApiError::invalid(Some("id".to_string()), e.to_string()))?;
    let in_pool = match &d.url {
        Some(url) if s.pool.urls().contains(url) => s.pool.remove(url).is_err(),
        _ => false,
    };
    Ok(Json(
        json!({"id": d.id, "removed": true, "still_decoding_as_last_node": in_pool}),
    ))
}

/// The body of `POST /admin/pairing`: empty, or `{"ttl_s": N}` (1 to the most allowed).
fn pairing_ttl(body: &[u8]) -> Result<std::time::Duration, ApiError> {
    use crate::join::{MAX_PAIRING_TTL, PAIRING_TTL};
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(PAIRING_TTL);
    }
    let obj = object_of(body, "ttl_s", "{\"ttl_s\": 300}")?;
    match obj.get("ttl_s").map(Value::as_u64) {
        None => Ok(PAIRING_TTL),
        Some(Some(n)) if (1..=MAX_PAIRING_TTL.as_secs()).contains(&n) => {
            Ok(std::time::Duration::from_secs(n))
        }
        Some(_) => Err(ApiError::invalid(
            Some("ttl_s".to_string()),
            format!(
                "ttl_s must be whole seconds from 1 to {}",
                MAX_PAIRING_TTL.as_secs()
            ),
        )),
    }
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

/// `body` as a JSON object whose only field may be `field` (`example` shows one); a 400
/// naming any other field.
fn object_of(
    body: &[u8],
    field: &str,
    example: &str,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("the body is not JSON: {e}")))?;
    let Value::Object(obj) = v else {
        return Err(ApiError::invalid(
            None,
            format!("the body must be a JSON object: {example}"),
        ));
    };
    if let Some(k) = obj.keys().find(|k| *k != field) {
        return Err(ApiError::invalid(
            Some(k.clone()),
            format!("unsupported field {k:?}"),
        ));
    }
    Ok(obj)
}

/// The body `{"url": "http://host:port"}`, and nothing else.
fn node_url(body: &[u8]) -> Result<String, ApiError> {
    let obj = object_of(body, "url", "{\"url\": \"http://host:port\"}")?;
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
    use super::{node_url, pairing_ttl};

    #[test]
    fn a_pairing_body_is_checked() {
        assert_eq!(pairing_ttl(b"").unwrap().as_secs(), 300);
        assert_eq!(pairing_ttl(br#"{"ttl_s": 2}"#).unwrap().as_secs(), 2);
        for (body, param) in [
            (&br#"{"ttl_s": 0}"#[..], Some("ttl_s")),
            (br#"{"ttl_s": 3601}"#, Some("ttl_s")),
            (br#"{"ttl_s": "5"}"#, Some("ttl_s")),
            (br#"{"code": "1"}"#, Some("code")),
            (b"[]", None),
        ] {
            let e = pairing_ttl(body).unwrap_err();
            assert_eq!(
                e.param.as_deref(),
                param,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

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
