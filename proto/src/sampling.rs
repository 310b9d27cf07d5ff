//! A request's sampling settings: one type from the router's validation to the engine's
//! sampler. [`pb::Sampling`] is its form on the wire, converted here and nowhere else.

use std::sync::Arc;

use crate::pb;

/// Validated sampling parameters (ranges are checked by the router).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub top_k: i32,
    /// 0 = off.
    pub min_p: f32,
    pub seed: u32,
    /// 1 = off.
    pub repeat_penalty: f32,
    /// 0 = off.
    pub presence_penalty: f32,
    /// 0 = off.
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: i32,
    /// Log-probabilities to report per token: None = none; n = the sampled token's and
    /// the n most likely (at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<u32>,
    /// Structured output: the JSON Schema (text) the answer must follow.
    pub json_schema: Option<Arc<str>>,
    /// Forced tool calls: the answer is Hermes-format calls (`<tool_call>\n{json}\n</tool_call>`)
    /// whose JSON follows this schema (text); one, or with `parallel_tool_calls` one or more.
    pub tool_call_schema: Option<Arc<str>>,
    pub parallel_tool_calls: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            logprobs: None,
            json_schema: None,
            tool_call_schema: None,
            parallel_tool_calls: false,
        }
    }
}

impl SamplingParams {
    /// Whether a penalty changes any token's probability.
    #[must_use]
    pub fn penalties_active(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

impl From<&SamplingParams> for pb::Sampling {
    fn from(s: &SamplingParams) -> Self {
        pb::Sampling {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            repeat_penalty: s.repeat_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            penalty_last_n: s.penalty_last_n,
            logprobs: s.logprobs,
            json_schema: s.json_schema.as_deref().unwrap_or_default().to_string(),
            tool_call_schema: s
                .tool_call_schema
                .as_deref()
                .unwrap_or_default()
                .to_string(),
            parallel_tool_calls: s.parallel_tool_calls,
        }
    }
}

impl From<&pb::Sampling> for SamplingParams {
    fn from(s: &pb::Sampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            repeat_penalty: s.repeat_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            penalty_last_n: s.penalty_last_n,
            logprobs: s.logprobs,
            json_schema: (!s.json_schema.is_empty()).then(|| s.json_schema.as_str().into()),
            tool_call_schema: (!s.tool_call_schema.is_empty())
                .then(|| s.tool_call_schema.as_str().into()),
            parallel_tool_calls: s.parallel_tool_calls,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field crosses the wire and comes back as it was (an empty schema is none).
    #[test]
    fn settings_cross_the_wire_unchanged() {
        let all = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            min_p: 0.05,
            seed: 1234,
            repeat_penalty: 1.1,
            presence_penalty: 0.5,
            frequency_penalty: -0.5,
            penalty_last_n: 32,
            logprobs: Some(3),
            json_schema: Some("{\"type\":\"object\"}".into()),
            tool_call_schema: Some("{}".into()),
            parallel_tool_calls: true,
        };
        for s in [all, SamplingParams::default()] {
            assert_eq!(SamplingParams::from(&pb::Sampling::from(&s)), s);
        }
    }
}
