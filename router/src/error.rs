//! One table from failures to HTTP status + OpenAI error object.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
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
            retry_after: None,
        }
    }

    /// The private link to `who` failed its handshake in a way that says the devices are
    /// configured differently: no fallback would help.
    #[must_use]
    pub fn link_refused(who: &str, h: &edgesplit_proto::link::HandshakeFailed) -> Self {
        Self::upstream(
            "auth_failed",
            format!(
                "{who} refused the router's link ({h}): give all three services the same secret"
            ),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("internal_error".into()),
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

    /// Maps a node's gRPC status; `param` names the input field for input errors.
    #[must_use]
    pub fn from_status(st: &tonic::Status, input_param: &str) -> Self {
        let name = st
            .metadata()
            .get(edgesplit_proto_error_key())
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let msg = st.message().to_string();
        // A status made here from a failed connection (it has a source; one a node sent
        // has none): the private link refused (the devices' secrets differ), or the
        // connection broke, not an error of the node's.
        if name.is_empty() {
            if let Some(source) = std::error::Error::source(st) {
                if let Some(h) = edgesplit_proto::link::HandshakeFailed::find(source) {
                    return Self::link_refused("a node", h);
                }
                return Self::unavailable(
                    "node_unavailable",
                    format!("the connection to a node broke: {msg} ({source})"),
                );
            }
        }
        match name.as_str() {
            "context_length_exceeded"
            | "kv_budget_exceeded"
            | "empty_prompt"
            | "template_error" => {
                Self::invalid(Some(input_param.to_string()), msg).with_code(&name)
            }
            "grammar_error" => Self::invalid(Some("response_format".into()), msg).with_code(&name),
            "handoff_unreachable" | "capacity" => Self::unavailable("decode_unavailable", msg),
            "" => match st.code() {
                tonic::Code::Unavailable => Self::unavailable(
                    "node_unavailable",
                    format!("a node could not be reached: {msg}"),
                ),
                tonic::Code::DeadlineExceeded => Self::upstream("timeout", msg),
                tonic::Code::InvalidArgument => Self::invalid(None, msg),
                _ => Self::internal(msg),
            },
            other => Self::upstream(other, msg),
        }
    }
}

impl ApiError {
    /// A failure of the decode node's token stream once it was under way. A status a node
    /// sent on purpose (it names its cause) maps as [`ApiError::from_status`] does; anything
    /// else means the stream itself broke (the node died, its connection dropped), which is
    /// named `decode_node_lost`, not an internal error of ours.
    #[must_use]
    pub fn from_decode_stream(st: &tonic::Status, input_param: &str) -> Self {
        if st.metadata().get(edgesplit_proto_error_key()).is_some() {
            return Self::from_status(st, input_param);
        }
        Self::unavailable(
            "decode_node_lost",
            format!(
                "the decode node's stream broke mid-answer ({:?}: {})",
                st.code(),
                st.message()
            ),
        )
    }
}

fn edgesplit_proto_error_key() -> &'static str {
    // Mirrors `edgesplit_engine::wire::ERROR_CODE_KEY` (the router does not link llama.cpp).
    "x-edgesplit-error"
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
