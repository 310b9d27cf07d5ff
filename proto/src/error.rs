//! One error vocabulary: the machine-readable codes a node names its failures with, on a
//! gRPC status (metadata key [`KEY`]), in a V1 upload's refusal (the OpenAI error object's
//! `code`) and, for a V2 refusal passed on, the NACK's name ([`crate::frame::NackCode`]).
//! The engine and the nodes write an [`ErrorCode`]; the router reads it back with
//! [`code_of`] and maps every code to HTTP in one exhaustive table (router/src/error.rs),
//! so a new code is a compile error there, not a silent misroute.

/// gRPC metadata key carrying an [`ErrorCode`]'s name.
pub const KEY: &str = "x-edgesplit-error";

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// A failure's machine-readable name, the same on every wire.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The wire name (snake_case).
            #[must_use]
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $name,)*
                }
            }

            /// The code of a wire name; `None` for a name this build does not know (a
            /// newer peer's).
            #[must_use]
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some(ErrorCode::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

codes! {
    // The request's input (the router answers 400).
    /// The prompt and the answer do not fit the context.
    ContextLengthExceeded = "context_length_exceeded",
    /// The prompt and the answer need more KV than the node's memory budget allows.
    KvBudgetExceeded = "kv_budget_exceeded",
    /// Nothing to prefill.
    EmptyPrompt = "empty_prompt",
    /// The chat template could not render the messages.
    TemplateError = "template_error",
    /// The response format's grammar could not be built.
    GrammarError = "grammar_error",
    /// A tail's tokens do not continue the conversation the request names.
    InvalidTail = "invalid_tail",

    // What a node holds.
    /// The node holds no state the request could continue.
    NotCached = "not_cached",
    /// Held, but the new part is longer than the caller's bound (a tail handoff may send it).
    UncachedPartTooLong = "uncached_part_too_long",
    /// A tail arrived for a base the node no longer holds.
    TailBaseMissing = "tail_base_missing",

    // The engine.
    /// A received state could not be imported.
    ImportFailed = "import_failed",
    /// The state could not be exported.
    ExportFailed = "export_failed",
    /// Every slot busy and the wait full.
    EngineBusy = "engine_busy",
    /// Any other engine failure (load, decode, closed).
    EngineError = "engine_error",

    // The handoff, as the nodes report it.
    /// The decode node was asked to continue a handoff it never received.
    HandoffMissing = "handoff_missing",
    /// The handoff failed for a reason not named below.
    HandoffFailed = "handoff_failed",
    /// The handoff did not complete in time.
    HandoffTimeout = "handoff_timeout",
    /// The decode node's handoff listener could not be reached.
    HandoffUnreachable = "handoff_unreachable",
    /// The peer did not prove it holds the shared secret.
    AuthFailed = "auth_failed",
    /// The decode node is shutting down and takes no new handoff.
    Draining = "draining",

    // A V2 refusal (NACK) passed on: the same names as `NackCode`.
    /// Not a V2 frame.
    BadMagic = "bad_magic",
    /// A protocol version the receiver does not speak.
    UnsupportedVersion = "unsupported_version",
    /// A frame that does not parse.
    Malformed = "malformed",
    /// A frame over the receiver's limit.
    FrameTooLarge = "frame_too_large",
    /// Bytes that do not match their checksum.
    ChecksumMismatch = "checksum_mismatch",
    /// A frame out of order.
    UnexpectedFrame = "unexpected_frame",
    /// Another model.
    ModelMismatch = "model_mismatch",
    /// Another llama.cpp build.
    BuildMismatch = "build_mismatch",
    /// Other KV cache types.
    KvTypeMismatch = "kv_type_mismatch",
    /// Another flash-attention setting.
    FlashAttnMismatch = "flash_attn_mismatch",
    /// Another context size.
    ContextMismatch = "context_mismatch",
    /// Tensor descriptors that do not match the receiver's.
    DescriptorMismatch = "descriptor_mismatch",
    /// A sequence longer than the receiver's context.
    SequenceTooLong = "sequence_too_long",
    /// A handoff id already received.
    DuplicateHandoff = "duplicate_handoff",
    /// No room for another state.
    Capacity = "capacity",
    /// The peer took too long.
    Timeout = "timeout",
    /// The receiver failed.
    Internal = "internal",
    /// A NACK code this build does not know (from a newer peer).
    OtherRefusal = "other",

    // A V1 upload's refusal (decode-node/src/upload.rs), passed on.
    /// A handoff id that is not one.
    InvalidHandoffId = "invalid_handoff_id",
    /// An upload without its checksum.
    MissingChecksum = "missing_checksum",
    /// An upload without its length.
    LengthRequired = "length_required",
    /// An upload that ended early.
    Truncated = "truncated",
    /// An upload over the receiver's limit.
    TooLarge = "too_large",
    /// An upload that did not arrive in time.
    UploadTimeout = "upload_timeout",
    /// An upload whose length is not the one declared.
    LengthMismatch = "length_mismatch",
    /// An upload that is not a state file of this model and context.
    InvalidStateFile = "invalid_state_file",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<crate::frame::NackCode> for ErrorCode {
    /// The refusal's code under the NACK's own name.
    fn from(n: crate::frame::NackCode) -> Self {
        ErrorCode::from_name(n.as_str()).unwrap_or(ErrorCode::OtherRefusal)
    }
}

/// A status with `code`'s name in its metadata.
#[must_use]
pub fn status(grpc: tonic::Code, code: ErrorCode, message: impl Into<String>) -> tonic::Status {
    let mut st = tonic::Status::new(grpc, message);
    st.metadata_mut().insert(
        KEY,
        tonic::metadata::MetadataValue::from_static(code.as_str()),
    );
    st
}

/// What a status says of its cause: the node's [`ErrorCode`], a name this build does not
/// know, or nothing (a status no node wrote: a failed connection, a gRPC error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Named {
    Code(ErrorCode),
    Unknown(String),
    None,
}

/// Reads a status's cause.
#[must_use]
pub fn code_of(st: &tonic::Status) -> Named {
    match st.metadata().get(KEY).map(|v| v.to_str()) {
        None => Named::None,
        Some(Ok(name)) => {
            ErrorCode::from_name(name).map_or_else(|| Named::Unknown(name.into()), Named::Code)
        }
        Some(Err(_)) => Named::Unknown("(not text)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::NackCode;

    #[test]
    fn every_code_goes_over_a_status_and_back() {
        let mut names = std::collections::HashSet::new();
        for &c in ErrorCode::ALL {
            assert!(names.insert(c.as_str()), "{c} named twice");
            assert_eq!(ErrorCode::from_name(c.as_str()), Some(c));
            let st = status(tonic::Code::Unavailable, c, "why");
            assert_eq!(code_of(&st), Named::Code(c));
            assert_eq!(st.message(), "why");
        }
        assert_eq!(ErrorCode::from_name("newer_than_us"), None);
    }

    #[test]
    fn a_status_without_a_code_or_with_an_unknown_one_says_so() {
        assert_eq!(code_of(&tonic::Status::unavailable("down")), Named::None);
        let mut st = tonic::Status::internal("x");
        st.metadata_mut()
            .insert(KEY, "newer_than_us".parse().unwrap());
        assert_eq!(code_of(&st), Named::Unknown("newer_than_us".into()));
    }

    #[test]
    fn every_nack_passes_on_under_its_own_name() {
        for n in NackCode::ALL {
            let c = ErrorCode::from(n);
            assert_eq!(c.as_str(), n.as_str(), "{n:?}");
        }
        assert_eq!(
            ErrorCode::from(NackCode::Other(999)),
            ErrorCode::OtherRefusal
        );
    }
}
