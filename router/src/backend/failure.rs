//! Why a request failed, as the backend says it: a class, a code, a message, the input
//! field at fault and the node's [`ErrorCode`] it maps. No HTTP here: only the server
//! makes the OpenAI error object from it (`crate::error`, `From<Failure> for ApiError`).
//!
//! The one table from a node's code to a class is [`Failure::from_code`].

use edgesplit_proto::error::{code_of, ErrorCode, Named};
use edgesplit_proto::link::HandshakeFailed;

/// What kind of failure, which decides what the client is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The request's input (the field in [`Failure::param`]); sending it again fails again.
    Input,
    /// A node the request needs cannot take it now; a later try may succeed.
    Unavailable,
    /// A node failed the request, under the code it named.
    Upstream,
    /// A failure of the router's own.
    Internal,
}

/// The router's own failure codes (a node's are its [`ErrorCode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterCode {
    /// A node refused the router's credential or its private link: the devices' secrets
    /// differ.
    AuthFailed,
    /// A node, not known which, could not be reached.
    NodeUnavailable,
    /// The prefill node could not be reached.
    PrefillUnavailable,
    /// No decode node can take the answer (gone, asleep, draining, full): the fallback
    /// policy's cue.
    DecodeUnavailable,
    /// The decode node's stream broke mid-answer (the node died, its connection dropped).
    DecodeNodeLost,
    /// A bounded wait ran out.
    Timeout,
    /// A node sent what the protocol does not allow at that point.
    ProtocolError,
    /// A node's stream ended before the answer did.
    StreamEnded,
    /// A failure of the router's own.
    Internal,
}

impl RouterCode {
    /// The code's name in error objects, metrics and logs.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            RouterCode::AuthFailed => "auth_failed",
            RouterCode::NodeUnavailable => "node_unavailable",
            RouterCode::PrefillUnavailable => "prefill_unavailable",
            RouterCode::DecodeUnavailable => "decode_unavailable",
            RouterCode::DecodeNodeLost => "decode_node_lost",
            RouterCode::Timeout => "timeout",
            RouterCode::ProtocolError => "protocol_error",
            RouterCode::StreamEnded => "stream_ended",
            RouterCode::Internal => "internal_error",
        }
    }
}

/// A failure's machine-readable code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Code {
    /// The router's own.
    Router(RouterCode),
    /// A node's, passed on.
    Node(ErrorCode),
    /// A newer node's code that this router does not know, passed on by name.
    Newer(String),
}

impl Code {
    /// The code's name in error objects, metrics and logs.
    #[must_use]
    pub fn as_str(&self) -> &str {
        match self {
            Code::Router(c) => c.as_str(),
            Code::Node(c) => c.as_str(),
            Code::Newer(name) => name,
        }
    }
}

/// A request's failure in the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub class: Class,
    pub code: Option<Code>,
    pub message: String,
    /// For [`Class::Input`]: the request field at fault.
    pub param: Option<String>,
    /// The node's code this failure maps, when a node named its failure.
    pub cause: Option<ErrorCode>,
}

impl Failure {
    fn new(class: Class, code: Option<Code>, message: impl Into<String>) -> Self {
        Self {
            class,
            code,
            message: message.into(),
            param: None,
            cause: None,
        }
    }

    /// The request's input at `param` (without a code).
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        Self {
            param: param.into(),
            ..Self::new(Class::Input, None, message)
        }
    }

    pub fn unavailable(code: RouterCode, message: impl Into<String>) -> Self {
        Self::new(Class::Unavailable, Some(Code::Router(code)), message)
    }

    pub fn upstream(code: RouterCode, message: impl Into<String>) -> Self {
        Self::new(Class::Upstream, Some(Code::Router(code)), message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            Class::Internal,
            Some(Code::Router(RouterCode::Internal)),
            message,
        )
    }

    /// Whether the failure is the router's `code`.
    #[must_use]
    pub fn is(&self, code: RouterCode) -> bool {
        self.code == Some(Code::Router(code))
    }

    /// The code's name, or the class's where there is no code (what logs and the
    /// fallback's `cause` say).
    #[must_use]
    pub fn name(&self) -> &str {
        match &self.code {
            Some(code) => code.as_str(),
            None => match self.class {
                Class::Input => "invalid_request",
                Class::Unavailable => "unavailable",
                Class::Upstream => "upstream_error",
                Class::Internal => "internal_error",
            },
        }
    }

    /// The private link to `who` failed its handshake in a way that says the devices are
    /// configured differently: no fallback would help.
    #[must_use]
    pub fn link_refused(who: &str, h: &HandshakeFailed) -> Self {
        Self::upstream(
            RouterCode::AuthFailed,
            format!(
                "{who} refused the router's link ({h}): give all three services the same secret"
            ),
        )
    }

    /// Maps a node's gRPC status; `param` names the input field for input errors.
    #[must_use]
    pub fn from_status(st: &tonic::Status, input_param: &str) -> Self {
        Self::from_status_of(st, input_param, (RouterCode::NodeUnavailable, "a node"))
    }

    /// [`Failure::from_status`] for a call to a known node: a failed connection is said
    /// as `who`'s, with `code` (`DecodeUnavailable`, "the decode node").
    #[must_use]
    pub fn from_status_of(
        st: &tonic::Status,
        input_param: &str,
        (code, who): (RouterCode, &str),
    ) -> Self {
        let msg = st.message().to_string();
        match code_of(st) {
            Named::Code(c) => Self {
                cause: Some(c),
                ..Self::from_code(c, msg, input_param)
            },
            // A newer node's code: passed on as it is.
            Named::Unknown(name) => Self::new(Class::Upstream, Some(Code::Newer(name)), msg),
            // A status made here from a failed connection (it has a source; one a node
            // sent has none): the private link refused (the devices' secrets differ), or
            // the connection broke, not an error of the node's.
            Named::None => match std::error::Error::source(st) {
                Some(source) => match HandshakeFailed::find(source) {
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
                    tonic::Code::DeadlineExceeded => Self::upstream(RouterCode::Timeout, msg),
                    tonic::Code::InvalidArgument => Self::invalid(None, msg),
                    _ => Self::internal(msg),
                },
            },
        }
    }

    /// A failure of the decode node's token stream once it was under way. A status a node
    /// sent on purpose (it names its cause) maps as [`Failure::from_status`] does; anything
    /// else means the stream itself broke (the node died, its connection dropped), which is
    /// named `decode_node_lost`, not an internal error of ours.
    #[must_use]
    pub fn from_decode_stream(st: &tonic::Status, input_param: &str) -> Self {
        if code_of(st) != Named::None {
            return Self::from_status(st, input_param);
        }
        Self::unavailable(
            RouterCode::DecodeNodeLost,
            format!(
                "the decode node's stream broke mid-answer ({:?}: {})",
                st.code(),
                st.message()
            ),
        )
    }

    /// The one table from a node's [`ErrorCode`] to a failure (exhaustive: a new code does
    /// not compile until it has a row).
    fn from_code(code: ErrorCode, msg: String, input_param: &str) -> Self {
        use ErrorCode as C;
        let input = |param: &str| Self {
            code: Some(Code::Node(code)),
            ..Self::invalid(Some(param.to_string()), msg.clone())
        };
        match code {
            // The request's input.
            C::ContextLengthExceeded | C::KvBudgetExceeded | C::EmptyPrompt | C::TemplateError => {
                input(input_param)
            }
            C::GrammarError => input("response_format"),
            // No decode node to take the state: the fallback policy may answer here.
            C::HandoffUnreachable | C::Capacity => {
                Self::unavailable(RouterCode::DecodeUnavailable, msg)
            }
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
            | C::InvalidStateFile => Self::new(Class::Upstream, Some(Code::Node(code)), msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code a node can send maps to a failure that keeps it as its cause: input
    /// errors name the field, an unreachable or full decode node is `decode_unavailable`
    /// (the fallback policy's cue), the rest fail upstream under the node's name.
    #[test]
    fn every_node_code_maps_and_keeps_its_cause() {
        for &code in ErrorCode::ALL {
            let st = edgesplit_proto::error::status(tonic::Code::Internal, code, "why");
            let f = Failure::from_status(&st, "messages");
            assert_eq!(f.cause, Some(code));
            assert_eq!(f.message, "why");
            match code {
                ErrorCode::ContextLengthExceeded
                | ErrorCode::KvBudgetExceeded
                | ErrorCode::EmptyPrompt
                | ErrorCode::TemplateError => {
                    assert_eq!(f.class, Class::Input);
                    assert_eq!(f.param.as_deref(), Some("messages"));
                    assert_eq!(f.code, Some(Code::Node(code)));
                }
                ErrorCode::GrammarError => {
                    assert_eq!(f.class, Class::Input);
                    assert_eq!(f.param.as_deref(), Some("response_format"));
                }
                ErrorCode::HandoffUnreachable | ErrorCode::Capacity => {
                    assert_eq!(f.class, Class::Unavailable);
                    assert!(f.is(RouterCode::DecodeUnavailable));
                }
                _ => {
                    assert_eq!(f.class, Class::Upstream, "{code}");
                    assert_eq!(f.code, Some(Code::Node(code)));
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
        let f = Failure::from_status(&st, "prompt");
        assert_eq!(
            (f.class, f.code),
            (Class::Upstream, Some(Code::Newer("newer_than_us".into())))
        );
        assert_eq!(f.cause, None);
        let f = Failure::from_status(&tonic::Status::unavailable("down"), "prompt");
        assert_eq!(
            (f.class, f.code),
            (
                Class::Unavailable,
                Some(Code::Router(RouterCode::NodeUnavailable))
            )
        );
        let f = Failure::from_status(&tonic::Status::deadline_exceeded("slow"), "prompt");
        assert!(f.is(RouterCode::Timeout));
        let f = Failure::from_status(&tonic::Status::invalid_argument("bad"), "prompt");
        assert_eq!(
            (f.class, f.code.clone(), f.name()),
            (Class::Input, None, "invalid_request")
        );
        let f = Failure::from_decode_stream(&tonic::Status::unknown("reset"), "prompt");
        assert!(f.is(RouterCode::DecodeNodeLost));
    }
}
