//! Which fields a request may carry beyond the ones its endpoint reads: the other
//! endpoint's are refused by name, and OpenAI fields we do not implement are accepted only
//! at the value that asks for nothing. A field silently ignored would give an answer that
//! looks right and is not what was asked for.

use super::body::Body;
use super::Endpoint;
use crate::error::{refuse_other, ApiError};

fn refused(field: &str, why: impl Into<String>) -> Result<(), ApiError> {
    Err(ApiError::invalid(Some(field.to_string()), why))
}

/// Refuses the first field that `endpoint` does not take or that asks for what we do not
/// implement (null is always "not set").
pub(super) fn known_fields(endpoint: Endpoint, body: &Body) -> Result<(), ApiError> {
    refuse_other(&body.other, "")?;
    let other_endpoint: &[(&str, bool)] = match endpoint {
        Endpoint::Chat => &[("prompt", body.prompt.is_some())],
        Endpoint::Completion => &[
            ("messages", body.messages.is_some()),
            (
                "max_completion_tokens",
                body.max_completion_tokens.is_some(),
            ),
            ("top_logprobs", body.top_logprobs.is_some()),
            ("tools", body.tools.is_some()),
            ("tool_choice", body.tool_choice.is_some()),
            ("parallel_tool_calls", body.parallel_tool_calls.is_some()),
        ],
    };
    if let Some((field, _)) = other_endpoint.iter().find(|(_, set)| *set) {
        return refused(field, format!("unsupported field {field:?}"));
    }
    if body.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return refused("logit_bias", "logit_bias is not supported");
    }
    if body.echo == Some(true) {
        return refused("echo", "echo is not supported");
    }
    if body.best_of.is_some_and(|n| n != 1) {
        return refused("best_of", "only best_of=1 is supported");
    }
    if body.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return refused("suffix", "suffix is not supported");
    }
    if let Some(o) = &body.stream_options {
        refuse_other(&o.other, "stream_options")?;
    }
    if let Some(e) = &body.edgesplit {
        refuse_other(&e.other, "edgesplit")?;
    }
    Ok(())
}
