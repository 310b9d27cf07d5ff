//! The error a client sees: an HTTP status and the OpenAI error object. The backend's
//! failures become one in `server.rs` (`From<Failure> for ApiError`); a request's shape
//! (a value of the wrong type, a field we do not take) becomes one here ([`typed`],
//! [`refuse_other`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use edgesplit_proto::error::ErrorCode;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

/// OpenAI's error `type`: the client's request, or the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorType {
    /// `invalid_request_error`: the request (its body, its key, its URL) is at fault.
    InvalidRequest,
    /// `server_error`: a node or the router could not answer it.
    Server,
}

impl ErrorType {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorType::InvalidRequest => "invalid_request_error",
            ErrorType::Server => "server_error",
        }
    }
}

/// The codes of the router's HTTP layer: the request's shape, its key and URL, and the
/// router's own state. A backend failure's code comes from its `Code` (`backend/failure.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpCode {
    /// The body is not JSON.
    InvalidJson,
    /// The body could not be read (too large, not sent as JSON...).
    InvalidBody,
    InvalidApiKey,
    UnknownUrl,
    ModelNotFound,
    /// Tools on a model whose template writes calls in a format not read.
    ToolsUnsupported,
    /// `/admin/pairing` or `/admin/devices` on a router without `--join-listen`.
    JoiningOff,
    /// More requests waiting than `--max-queue`.
    QueueFull,
    /// No capacity within `--queue-timeout`.
    QueueTimeout,
    ShuttingDown,
    /// An answer's events ended before its end.
    StreamEnded,
    Internal,
}

impl HttpCode {
    /// The code's name in error objects and metrics.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            HttpCode::InvalidJson => "invalid_json",
            HttpCode::InvalidBody => "invalid_body",
            HttpCode::InvalidApiKey => "invalid_api_key",
            HttpCode::UnknownUrl => "unknown_url",
            HttpCode::ModelNotFound => "model_not_found",
            HttpCode::ToolsUnsupported => "tools_unsupported",
            HttpCode::JoiningOff => "joining_off",
            HttpCode::QueueFull => "queue_full",
            HttpCode::QueueTimeout => "queue_timeout",
            HttpCode::ShuttingDown => "shutting_down",
            HttpCode::StreamEnded => "stream_ended",
            HttpCode::Internal => "internal_error",
        }
    }
}

/// An error as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: ErrorType,
    pub param: Option<String>,
    pub code: Option<String>,
    /// The node's code this error maps, when a node named its failure.
    pub cause: Option<ErrorCode>,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400 naming the parameter that failed.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: ErrorType::InvalidRequest,
            param: param.into(),
            code: None,
            cause: None,
            retry_after: None,
        }
    }

    /// Sets the machine-readable code.
    #[must_use]
    pub fn with_code(mut self, code: HttpCode) -> Self {
        self.code = Some(code.as_str().to_string());
        self
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist"),
            kind: ErrorType::InvalidRequest,
            param: Some("model".into()),
            code: Some(HttpCode::ModelNotFound.as_str().into()),
            cause: None,
            retry_after: None,
        }
    }

    pub fn unavailable(code: HttpCode, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: ErrorType::Server,
            param: None,
            code: Some(code.as_str().into()),
            cause: None,
            retry_after: Some(1),
        }
    }

    pub fn upstream(code: HttpCode, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            message: message.into(),
            kind: ErrorType::Server,
            param: None,
            code: Some(code.as_str().into()),
            cause: None,
            retry_after: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: ErrorType::Server,
            param: None,
            code: Some(HttpCode::Internal.as_str().into()),
            cause: None,
            retry_after: None,
        }
    }

    /// The OpenAI error object.
    #[must_use]
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind.as_str(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// `value` as a `T`, or a 400 naming the field whose value did not fit.
pub fn typed<T: DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let mut message = e.into_inner().to_string();
        // What serde expected, in the client's words rather than Rust's types.
        for (rust, json) in [
            ("expected f64", "expected a number"),
            ("expected i64", "expected an integer"),
            ("expected u64", "expected a non-negative integer"),
            ("expected u32", "expected an integer from 0 to 4294967295"),
        ] {
            message = message.replace(rust, json);
        }
        if let Some(at) = message.find("expected struct ") {
            message.replace_range(at.., "expected an object");
        }
        if path == "." {
            ApiError::invalid(None, message)
        } else {
            ApiError::invalid(Some(path.clone()), format!("{path}: {message}"))
        }
    })
}

/// Refuses the first field of `other` that is set, by its name under `at` ("" at the top).
pub fn refuse_other(other: &Map<String, Value>, at: &str) -> Result<(), ApiError> {
    match other.iter().find(|(_, v)| !v.is_null()) {
        Some((k, _)) => {
            let name = if at.is_empty() {
                k.clone()
            } else {
                format!("{at}.{k}")
            };
            Err(ApiError::invalid(
                Some(name.clone()),
                format!("unsupported field {name:?}"),
            ))
        }
        None => Ok(()),
    }
}
