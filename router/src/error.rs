//! One table from failures to HTTP status + OpenAI error object.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use edgesplit_proto::error::ErrorCode;

use crate::backend::{Class, Failure};
use serde_json::json;

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

/// The one table from the backend's failure classes to HTTP: an input error is a 400
/// naming its field, a node that cannot take the request now a 503 with `Retry-After`, a
/// node's failure a 502 under its code, the router's own a 500.
impl From<Failure> for ApiError {
    fn from(f: Failure) -> Self {
        let (status, kind, retry_after) = match f.class {
            Class::Input => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            Class::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error", Some(1)),
            Class::Upstream => (StatusCode::BAD_GATEWAY, "server_error", None),
            Class::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        Self {
            status,
            message: f.message,
            kind,
            param: f.param,
            code: f.code,
            cause: f.cause,
            retry_after,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
                Failure::unavailable("decode_unavailable", "m"),
                ApiError::unavailable("decode_unavailable", "m"),
            ),
            (
                Failure::upstream("timeout", "m"),
                ApiError::upstream("timeout", "m"),
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
        let e = ApiError::from(Failure::unavailable("decode_unavailable", "m"));
        assert_eq!(e.retry_after, Some(1));
    }
}
