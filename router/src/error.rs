//! The error a client sees: an HTTP status and the OpenAI error object. The backend's
//! failures become one in `server.rs` (`From<Failure> for ApiError`); a request's shape
//! (a value of the wrong type, a field we do not take) becomes one here ([`typed`],
//! [`refuse_other`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use edgesplit_proto::error::ErrorCode;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

/// An error as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI `type`: invalid_request_error, authentication_error, server_error...
    pub kind: &'static str,
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
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
            cause: None,
            retry_after: None,
        }
    }

    /// Sets the machine-readable code.
    #[must_use]
    pub fn with_code(mut self, code: &str) -> Self {
        self.code = Some(code.to_string());
        self
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found".into()),
            cause: None,
            retry_after: None,
        }
    }

    pub fn unavailable(code: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code.into()),
            cause: None,
            retry_after: Some(1),
        }
    }

    pub fn upstream(code: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code.into()),
            cause: None,
            retry_after: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("internal_error".into()),
            cause: None,
            retry_after: None,
        }
    }

    /// The OpenAI error object.
    #[must_use]
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
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
