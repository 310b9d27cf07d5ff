//! HTTP routes and handlers: the OpenAI endpoints, models, health and metrics, with the
//! API-key check; the dashboard's routes are merged in from `dashboard`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{self, Endpoint, Transport};
use crate::backend::{Class, Failure};
use crate::error::{ApiError, ErrorType, HttpCode};
use crate::node_json;
use crate::recent::RecentAnswer;
use crate::respond::{Answer, Meta, Step};
use crate::state::AppState;

/// The router's HTTP API.
pub fn app(state: Arc<AppState>) -> Router {
    let limit = state.max_body_bytes;
    // The API and the dashboard's data need the key; health, metrics and the dashboard
    // page itself (which asks for the key) do not.
    let keyed = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .merge(crate::dashboard::data_routes())
        .merge(crate::admin::routes())
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(keyed)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(crate::dashboard::page_routes())
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// The key a request sends as `Authorization: Bearer <key>`.
fn given_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Constant time in the key's length (`subtle`; a length mismatch is refused at once).
fn key_matches(given: Option<&str>, key: &str) -> bool {
    given.is_some_and(|g| {
        use subtle::ConstantTimeEq;
        bool::from(g.as_bytes().ct_eq(key.as_bytes()))
    })
}

/// `Authorization: Bearer <key>` when an API key is configured; else 401 with an OpenAI
/// error object (`invalid_api_key`).
async fn require_api_key(
    State(s): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(key) = &s.api_key else {
        return next.run(req).await;
    };
    let given = given_key(req.headers());
    let ok = key_matches(given, key);
    if ok {
        return next.run(req).await;
    }
    let message = if given.is_some() {
        "Incorrect API key provided."
    } else {
        "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
    };
    s.metrics.failed(HttpCode::InvalidApiKey.as_str());
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: message.into(),
        kind: ErrorType::InvalidRequest,
        param: None,
        code: Some(HttpCode::InvalidApiKey.as_str().into()),
        cause: None,
        retry_after: None,
    }
    .into_response()
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint".into(),
        kind: ErrorType::InvalidRequest,
        param: None,
        code: Some(HttpCode::UnknownUrl.as_str().into()),
        cause: None,
        retry_after: None,
    }
}

type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

async fn chat(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    serve(s, Endpoint::Chat, &headers, body).await
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    serve(s, Endpoint::Completion, &headers, body).await
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn random_seed() -> u32 {
    // A v4 UUID is 122 random bits; 32 of them make the seed.
    let b = uuid::Uuid::new_v4().into_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

async fn serve(s: Arc<AppState>, endpoint: Endpoint, headers: &HeaderMap, body: Body) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(rej) => {
            let mut e = ApiError::invalid(None, rej.body_text()).with_code(HttpCode::InvalidBody);
            e.status = rej.status();
            return e.into_response();
        }
    };
    let metrics = s.metrics.clone();
    if s.draining.load(std::sync::atomic::Ordering::SeqCst) {
        metrics.failed(HttpCode::ShuttingDown.as_str());
        return ApiError::unavailable(
            HttpCode::ShuttingDown,
            "the router is shutting down; retry on another instance or after it restarts",
        )
        .into_response();
    }
    match serve_inner(s, endpoint, headers, &body).await {
        Ok(r) => r,
        Err(e) => {
            // Failures before the first token; later ones are counted by the answer.
            metrics.record(RecentAnswer::refused(
                unix_now(),
                e.code.as_deref().unwrap_or(e.kind.as_str()),
                &e.message,
            ));
            e.into_response()
        }
    }
}

async fn serve_inner(
    s: Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let received = Instant::now();
    let observer = crate::metrics::RequestObserver::new(s.metrics.clone());
    let req = api::parse(endpoint, body, random_seed)?;
    let observer = observer.holding(s.admission.admit().await?);
    let header_transport = match headers.get("x-edgesplit-transport") {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| "not ASCII".to_string())
                .and_then(Transport::parse)
                .map_err(|m| ApiError::invalid(Some("X-EdgeSplit-Transport".into()), m))?,
        ),
        None => None,
    };
    let transport = req
        .transport
        .or(header_transport)
        .unwrap_or(s.default_transport);
    let info = s
        .pool
        .first()
        .prefill_info_fresh(crate::PREFILL_INFO_MAX_AGE)
        .await?;
    if let Some(m) = &req.model {
        if m != &info.model_id {
            return Err(ApiError::model_not_found(m));
        }
    }
    if req.tools.is_some() {
        tools_supported(&info.tool_call_format)?;
    }
    let request_id = format!("req-{}", uuid::Uuid::new_v4().simple());
    let admitted = Instant::now();
    tracing::info!(%request_id, transport = transport.as_str(), stream = req.stream, "request");
    let (started, pair) = s.pool.start(&req, transport, &request_id).await?;
    let observer = observer.started();
    let meta = Meta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{}", &request_id[4..]),
            Endpoint::Completion => format!("cmpl-{}", &request_id[4..]),
        },
        created: unix_now(),
        model: info.model_id,
        endpoint,
        include_usage: req.include_usage,
        request_id,
        transport: started.transport,
        received,
        admitted,
        return_token_ids: req.return_token_ids,
        seed: req.sampling.seed,
        logprobs: req.sampling.logprobs.is_some(),
        tools: req.tools.clone(),
    };
    let mut answer = Answer::new(
        meta,
        req.stop.clone(),
        started.prompt_tokens,
        started.prefill_ms,
    )
    .observed(observer);
    if req.max_tokens == 0 {
        answer = answer.measuring_length(pair.answer_length_meter());
    }
    answer.timing.placement = Some(started.placement.as_str());
    (answer.timing.prefill_arch, answer.timing.decode_arch) =
        pair.archs(started.transport, started.placement);
    answer.timing.same_numerics = pair.same_numerics(started.transport, started.placement);
    if !matches!(started.transport, Transport::Local | Transport::Layers) {
        answer.timing.decode_node = Some(pair.decode_url());
    }
    answer.timing.cached_tokens = started.cached_tokens;
    if let Some(choice) = started.choice {
        answer.timing.mode = Some(choice.mode.as_str());
        answer.timing.objective = Some(req.objective.unwrap_or(s.objective).as_str());
        answer.timing.predicted_ms = choice.predicted.map(|c| c.e2e_ms);
        answer.timing.predicted_prefill_node_ms = choice.predicted.map(|c| c.prefill_node_ms);
        answer.timing.predicted_tokens = choice.answer_tokens.map(|t| t.round() as u32);
        answer.timing.reason = Some(choice.reason);
    }
    if req.stream {
        Ok(stream_response(answer, started.events).into_response())
    } else {
        whole_response(answer, started.events).await
    }
}

/// A request with tools is refused before any work unless the prefill node's chat
/// template writes calls the router reads (`Info.tool_call_format`, `tools.rs`).
fn tools_supported(format: &str) -> Result<(), ApiError> {
    let why = match format {
        "hermes" => return Ok(()),
        "" => {
            "this model's chat template does not take tools: start both nodes with \
               --chat-template-file and a template that does (for a ChatML model, \
               templates/chatml-tools.jinja)"
        }
        _ => {
            "this model's chat template writes tool calls in a format EdgeSplit does not \
              read (it reads JSON in <tool_call> tags, as Hermes and Qwen 2.5 templates write)"
        }
    };
    Err(ApiError::invalid(Some("tools".into()), why).with_code(HttpCode::ToolsUnsupported))
}

async fn whole_response(
    mut answer: Answer,
    mut events: mpsc::Receiver<crate::backend::Event>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(ev) = events.recv().await {
        match answer.on_event(ev) {
            Step::Nothing => {}
            Step::Text(t) => text.push_str(&t),
            Step::Done(t) => {
                text.push_str(&t);
                return Ok(Json(answer.full_response(&text)).into_response());
            }
            Step::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::upstream(
        HttpCode::StreamEnded,
        "the generation ended without finishing",
    ))
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream_response(
    answer: Answer,
    events: mpsc::Receiver<crate::backend::Event>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    use futures::StreamExt;
    // No task in between: the response pulls each event from the backend as it writes.
    // A client that goes away drops this stream and with it `events`, which cancels the
    // generation on the nodes.
    let role = futures::stream::iter(answer.role_chunk().map(|r| data(&r)));
    let done = || SseEvent::default().data("[DONE]");
    let rest = futures::stream::unfold(Some((answer, events)), move |state| async move {
        let (mut answer, mut events) = state?;
        loop {
            let step = match events.recv().await {
                Some(ev) => answer.on_event(ev),
                None => Step::Failed(ApiError::upstream(
                    HttpCode::StreamEnded,
                    "the generation ended without finishing",
                )),
            };
            let last = match step {
                Step::Nothing => continue,
                Step::Text(t) => {
                    let chunk = vec![data(&answer.text_chunk(&t))];
                    return Some((chunk, Some((answer, events))));
                }
                Step::Done(t) => {
                    let mut chunks = Vec::new();
                    if !t.is_empty() {
                        chunks.push(data(&answer.text_chunk(&t)));
                    }
                    chunks.extend(answer.final_chunks().iter().map(data));
                    chunks
                }
                Step::Failed(e) => {
                    tracing::warn!(request_id = %answer.meta.request_id, error = %e.message, "request failed mid-stream");
                    vec![data(&e.body())]
                }
            };
            return Some(([last, vec![done()]].concat(), None));
        }
    })
    .flat_map(futures::stream::iter);
    Sse::new(role.chain(rest).map(Ok))
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let queued = i64::try_from(s.admission.queued()).unwrap_or(i64::MAX);
    s.metrics.queued.set(queued);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            edgesplit_proto::metrics::OPENMETRICS,
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let info = s
        .pool
        .first()
        .prefill_info_fresh(crate::PREFILL_INFO_MAX_AGE)
        .await?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": info.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "edgesplit",
            "meta": {
                "n_ctx": info.n_ctx,
                "fingerprint": info.model_fingerprint,
                "build_id": info.build_id,
                "kv_bytes_per_token": info.kv_bytes_per_token,
                "has_chat_template": info.has_chat_template,
            }
        }]
    })))
}

/// How old the nodes' `Info` that `/health` shows may be: however often it is hit, it
/// asks each node at most once per this.
const HEALTH_INFO_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the service is up (`ok`, `degraded` or `draining`), for anyone; the nodes'
/// details (addresses, memory, peers) only for a request with the API key when one is
/// configured.
async fn health(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if s.draining.load(std::sync::atomic::Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response();
    }
    let (p, d) = s.pool.infos_within(HEALTH_INFO_MAX_AGE).await;
    let urls = s.pool.urls();
    let silent: Vec<Option<String>> = urls.iter().map(|u| s.pool.silent(u)).collect();
    let nodes = node_json::decode_nodes(&p, &d, &urls, &silent);
    // Every node answers (a decode node refused by the handshake's checks answers too:
    // its `state` says so, and requests go to the others).
    let ok = p.is_ok() && d.iter().all(Result::is_ok);
    let status = if ok { "ok" } else { "degraded" };
    let detailed = s
        .api_key
        .as_ref()
        .is_none_or(|key| key_matches(given_key(&headers), key));
    let body = if detailed {
        json!({
            "status": status,
            "prefill": node_json::health(&p),
            "decode": nodes.first(),
            "decode_nodes": nodes,
        })
    } else {
        json!({"status": status})
    };
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// The one table from the backend's failure classes to HTTP: an input error is a 400
/// naming its field, a node that cannot take the request now a 503 with `Retry-After`, a
/// node's failure a 502 under its code, the router's own a 500.
impl From<Failure> for ApiError {
    fn from(f: Failure) -> Self {
        let (status, kind, retry_after) = match f.class {
            Class::Input => (StatusCode::BAD_REQUEST, ErrorType::InvalidRequest, None),
            Class::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, ErrorType::Server, Some(1)),
            Class::Upstream => (StatusCode::BAD_GATEWAY, ErrorType::Server, None),
            Class::Internal => (StatusCode::INTERNAL_SERVER_ERROR, ErrorType::Server, None),
        };
        Self {
            status,
            message: f.message,
            kind,
            param: f.param,
            code: f.code.map(|c| c.as_str().to_string()),
            cause: f.cause,
            retry_after,
        }
    }
}

#[cfg(test)]
mod failure_tests {
    use super::*;
    use crate::backend::RouterCode;
    use edgesplit_proto::error::ErrorCode;

    /// Each class keeps its status, and a failure's own constructors agree with the
    /// server's (`ApiError::unavailable`/`upstream`/`internal`/`invalid`).
    #[test]
    fn each_failure_class_maps_to_its_http_status() {
        for (f, e) in [
            (
                Failure::invalid(Some("messages".into()), "m"),
                ApiError::invalid(Some("messages".into()), "m"),
            ),
            (
                Failure::unavailable(RouterCode::DecodeUnavailable, "m"),
                ApiError {
                    code: Some("decode_unavailable".into()),
                    ..ApiError::unavailable(HttpCode::Internal, "m")
                },
            ),
            (
                Failure::upstream(RouterCode::Timeout, "m"),
                ApiError {
                    code: Some("timeout".into()),
                    ..ApiError::upstream(HttpCode::Internal, "m")
                },
            ),
            (Failure::internal("m"), ApiError::internal("m")),
        ] {
            assert_eq!(ApiError::from(f), e);
        }
        let st = edgesplit_proto::error::status(
            tonic::Code::Internal,
            ErrorCode::ContextLengthExceeded,
            "long",
        );
        let e = ApiError::from(Failure::from_status(&st, "prompt"));
        assert_eq!(
            (e.status, e.param.as_deref(), e.code.as_deref(), e.cause),
            (
                StatusCode::BAD_REQUEST,
                Some("prompt"),
                Some("context_length_exceeded"),
                Some(ErrorCode::ContextLengthExceeded)
            )
        );
        let e = ApiError::from(Failure::unavailable(RouterCode::DecodeUnavailable, "m"));
        assert_eq!(e.retry_after, Some(1));
    }
}
