//! One table from failures to HTTP status + OpenAI error object.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use edgesplit_proto::error::{code_of, ErrorCode, Named};
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

    /// Maps a node's gRPC status; `param` names the input field for input errors.
    #[must_use]
    pub fn from_status(st: &tonic::Status, input_param: &str) -> Self {
        Self::from_status_of(st, input_param, ("node_unavailable", "a node"))
    }

    /// [`ApiError::from_status`] for a call to a known node: a failed connection is said
    /// as `who`'s, with `code` (`decode_unavailable`, "the decode node").
    #[must_use]
    pub fn from_status_of(
        st: &tonic::Status,
        input_param: &str,
        (code, who): (&str, &str),
    ) -> Self {
        let msg = st.message().to_string();
        match code_of(st) {
            Named::Code(c) => {
                let mut e = Self::from_code(c, msg, input_param);
                e.cause = Some(c);
                e
            }
            // A newer node's code: passed on as it is.
            Named::Unknown(name) => Self::upstream(&name, msg),
            // A status made here from a failed connection (it has a source; one a node
            // sent has none): the private link refused (the devices' secrets differ), or
            // the connection broke, not an error of the node's.
            Named::None => match std::error::Error::source(st) {
                Some(source) => match edgesplit_proto::link::HandshakeFailed::find(source) {
                    Some(h) => Self::link_refused(who, h),
                    None => Self::unavailable(
                        code,
                        format!("the connection to {who} broke: {msg} ({source})"),
                    ),
                },
                None => match st.code() {
                    tonic::Code::Unavailable => {
                        Self::unavailable(code, format!("{who} could not be reached: {msg}"))
                    }
                    tonic::Code::DeadlineExceeded => Self::upstream("timeout", msg),
                    tonic::Code::InvalidArgument => Self::invalid(None, msg),
                    _ => Self::internal(msg),
                },
            },
        }
    }

    /// The one table from a node's [`ErrorCode`] to what the client sees (exhaustive: a
    /// new code does not compile until it has a row).
    fn from_code(code: ErrorCode, msg: String, input_param: &str) -> Self {
        use ErrorCode as C;
        match code {
            // The request's input.
            C::ContextLengthExceeded | C::KvBudgetExceeded | C::EmptyPrompt | C::TemplateError => {
                Self::invalid(Some(input_param.to_string()), msg).with_code(code.as_str())
            }
            C::GrammarError => {
                Self::invalid(Some("response_format".into()), msg).with_code(code.as_str())
            }
            // No decode node to take the state: the fallback policy may answer here.
            C::HandoffUnreachable | C::Capacity => Self::unavailable("decode_unavailable", msg),
            // Everything else failed upstream, under the node's own name.
            C::InvalidTail
            | C::NotCached
            | C::UncachedPartTooLong
            | C::TailBaseMissing
            | C::ImportFailed
            | C::ExportFailed
            | C::EngineBusy
            | C::EngineError
            | C::HandoffMissing
            | C::HandoffFailed
            | C::HandoffTimeout
            | C::AuthFailed
            | C::Draining
            | C::BadMagic
            | C::UnsupportedVersion
            | C::Malformed
            | C::FrameTooLarge
            | C::ChecksumMismatch
            | C::UnexpectedFrame
            | C::ModelMismatch
            | C::BuildMismatch
            | C::KvTypeMismatch
            | C::FlashAttnMismatch
            | C::ContextMismatch
            | C::DescriptorMismatch
            | C::SequenceTooLong
            | C::DuplicateHandoff
            | C::Timeout
            | C::Internal
            | C::OtherRefusal
            | C::InvalidHandoffId
            | C::MissingChecksum
            | C::LengthRequired
            | C::Truncated
            | C::TooLarge
            | C::UploadTimeout
            | C::LengthMismatch
            | C::InvalidStateFile => Self::upstream(code.as_str(), msg),
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
        if code_of(st) != Named::None {
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

    /// Every code a node can send maps to an error that keeps it as its cause: input
    /// errors are 400 naming the field, an unreachable or full decode node is 503
    /// `decode_unavailable` (the fallback policy's cue), the rest 502 under the node's name.
    #[test]
    fn every_node_code_maps_and_keeps_its_cause() {
        for &code in ErrorCode::ALL {
            let st = edgesplit_proto::error::status(tonic::Code::Internal, code, "why");
            let e = ApiError::from_status(&st, "messages");
            assert_eq!(e.cause, Some(code));
            assert_eq!(e.message, "why");
            match code {
                ErrorCode::ContextLengthExceeded
                | ErrorCode::KvBudgetExceeded
                | ErrorCode::EmptyPrompt
                | ErrorCode::TemplateError => {
                    assert_eq!(e.status, StatusCode::BAD_REQUEST);
                    assert_eq!(e.param.as_deref(), Some("messages"));
                    assert_eq!(e.code.as_deref(), Some(code.as_str()));
                }
                ErrorCode::GrammarError => {
                    assert_eq!(e.status, StatusCode::BAD_REQUEST);
                    assert_eq!(e.param.as_deref(), Some("response_format"));
                }
                ErrorCode::HandoffUnreachable | ErrorCode::Capacity => {
                    assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
                    assert_eq!(e.code.as_deref(), Some("decode_unavailable"));
                }
                _ => {
                    assert_eq!(e.status, StatusCode::BAD_GATEWAY, "{code}");
                    assert_eq!(e.code.as_deref(), Some(code.as_str()));
                }
            }
        }
    }

    #[test]
    fn a_newer_nodes_code_is_passed_on_and_a_status_without_one_is_classed_by_grpc() {
        let mut st = tonic::Status::internal("new");
        st.metadata_mut().insert(
            edgesplit_proto::error::KEY,
            "newer_than_us".parse().unwrap(),
        );
        let e = ApiError::from_status(&st, "prompt");
        assert_eq!(
            (e.status, e.code.as_deref()),
            (StatusCode::BAD_GATEWAY, Some("newer_than_us"))
        );
        assert_eq!(e.cause, None);
        let e = ApiError::from_status(&tonic::Status::unavailable("down"), "prompt");
        assert_eq!(e.code.as_deref(), Some("node_unavailable"));
        let e = ApiError::from_status(&tonic::Status::deadline_exceeded("slow"), "prompt");
        assert_eq!(e.code.as_deref(), Some("timeout"));
    }
}
