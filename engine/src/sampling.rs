//! Sampling that can be resumed on another machine.
//!
//! A llama.cpp sampler chain keeps state (the RNG of `dist`, the penalty window) that cannot
//! be exported. So every step builds its chain afresh from values that travel with the
//! request: the parameters, the token history, and the step index. The RNG of step `i` is
//! seeded with `mix(seed, i)`. The colocated run and the disaggregated run follow this same
//! rule, which is what makes them token-for-token identical with a fixed seed.

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;

pub use edgesplit_proto::sampling::SamplingParams;

/// Most alternatives reported per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// splitmix64 of (seed, step): independent, reproducible RNG seeds per step.
#[must_use]
pub fn step_seed(seed: u32, step: u32) -> u32 {
    let mut z = (u64::from(seed) << 32 | u64::from(step)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

/// Where an answer stands in its grammar: llama.cpp's grammar sampler, advanced over the
/// answer's tokens so far. Like the rest of the sampler it is never exported: each node
/// builds it from the grammar and the answer's tokens, so a split answer follows the
/// grammar exactly as the one-device answer does.
pub struct Grammar(LlamaSampler);

impl Grammar {
    /// The answer's grammar, if its parameters constrain it, after the answer tokens
    /// `answer`: the JSON documents `json_schema` allows, or the Hermes-format tool calls
    /// whose JSON follows `tool_call_schema`. A schema becomes GBNF by llama.cpp's own
    /// converter, the one llama-server uses for `response_format` and tool calls.
    ///
    /// # Errors
    /// Both are set, the schema cannot be converted, or a token does not fit the grammar.
    pub fn of(
        model: &LlamaModel,
        params: &SamplingParams,
        answer: &[i32],
    ) -> Result<Option<Self>, String> {
        let (gbnf, root) = match (&params.json_schema, &params.tool_call_schema) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => {
                return Err("a JSON schema and forced tool calls cannot both hold an answer".into())
            }
            (Some(schema), None) => (json_gbnf(schema)?, "root"),
            (None, Some(schema)) => (
                tool_calls_gbnf(&json_gbnf(schema)?, params.parallel_tool_calls),
                TOOL_CALLS_ROOT,
            ),
        };
        let sampler = LlamaSampler::grammar(model, &gbnf, root)
            .map_err(|e| format!("the schema's grammar does not parse: {e}"))?;
        let mut g = Grammar(sampler);
        for &t in answer {
            g.accept(LlamaToken(t))?;
        }
        Ok(Some(g))
    }

    /// Advances the grammar over `token`.
    ///
    /// # Errors
    /// The token does not fit the grammar here.
    pub fn accept(&mut self, token: LlamaToken) -> Result<(), String> {
        self.0
            .try_accept(token)
            .map_err(|_| format!("token {} does not fit the grammar", token.0))
    }
}

/// GBNF for the JSON documents `schema` (JSON Schema text) allows; its start rule is `root`.
fn json_gbnf(schema: &str) -> Result<String, String> {
    llama_cpp_2::json_schema_to_grammar(schema)
        .map_err(|e| format!("the schema cannot be turned into a grammar: {e}"))
}

/// The start rule of [`tool_calls_gbnf`]'s grammar.
const TOOL_CALLS_ROOT: &str = "edgesplit-tool-calls";

/// `call` (GBNF whose `root` is one call's JSON) in the Hermes format, as Hermes, Qwen 2.5
/// and SmolLM3 templates teach it: `<tool_call>\n{json}\n</tool_call>`, once, or one or
/// more times a newline apart. After a complete call the grammar allows only the end of
/// generation (or, parallel, the next call).
#[must_use]
pub fn tool_calls_gbnf(call: &str, parallel: bool) -> String {
    let more = if parallel {
        " (\"\\n\" edgesplit-tool-call)*"
    } else {
        ""
    };
    format!(
        "{call}\nedgesplit-tool-call ::= \"<tool_call>\\n\" root \"\\n</tool_call>\"\n\
         {TOOL_CALLS_ROOT} ::= edgesplit-tool-call{more}\n"
    )
}

/// Samples the token at batch index `idx` for generation step `step`, within `grammar`
/// when the answer has one (which then advances over the token).
///
/// `history` is every token before the one being sampled (prompt and answer so far).
///
/// # Errors
/// With a grammar: no token fits it, or the one sampled is refused.
pub fn sample(
    ctx: &LlamaContext<'_>,
    idx: i32,
    n_vocab: i32,
    params: &SamplingParams,
    history: &[i32],
    step: u32,
    grammar: Option<&mut Grammar>,
) -> Result<LlamaToken, String> {
    if let Some(g) = grammar {
        // The grammar masks what cannot come next, then the chain picks among the rest.
        let mut data = ctx.token_data_array_ith(idx);
        data.apply_sampler(&mut g.0);
        data.apply_sampler(&mut chain(n_vocab, params, history, step));
        let token = data
            .selected_token()
            .ok_or_else(|| "no token fits the grammar".to_string())?;
        g.accept(token)?;
        return Ok(token);
    }
    if params.temperature <= 0.0 && !params.penalties_active() {
        // Plain greedy: an argmax over the logits gives llama.cpp's greedy sampler's answer
        // (first maximum wins) without building a candidate array of the whole vocabulary
        // every step.
        return Ok(LlamaToken(argmax(ctx.get_logits_ith(idx))));
    }
    Ok(chain(n_vocab, params, history, step).sample(ctx, idx))
}

/// The sampler chain of step `step`, built afresh from values that travel with the answer.
fn chain(n_vocab: i32, params: &SamplingParams, history: &[i32], step: u32) -> LlamaSampler {
    let mut chain = Vec::with_capacity(6);
    if params.penalties_active() {
        let mut p = LlamaSampler::penalties(
            n_vocab,
            params.penalty_last_n,
            params.repeat_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        );
        let start = history.len().saturating_sub(params.penalty_last_n as usize);
        p.accept_many(history[start..].iter().map(|t| LlamaToken(*t)));
        chain.push(p);
    }
    if params.temperature <= 0.0 {
        chain.push(LlamaSampler::greedy());
    } else {
        if params.top_k > 0 {
            chain.push(LlamaSampler::top_k(params.top_k));
        }
        if params.top_p < 1.0 {
            chain.push(LlamaSampler::top_p(params.top_p, 1));
        }
        if params.min_p > 0.0 {
            chain.push(LlamaSampler::min_p(params.min_p, 1));
        }
        chain.push(LlamaSampler::temp(params.temperature));
        chain.push(LlamaSampler::dist(step_seed(params.seed, step)));
    }
    LlamaSampler::chain_simple(chain)
}

/// `ln(sum(exp(logits)))`, the log of the softmax's normaliser (summed in f64).
#[must_use]
pub fn log_normaliser(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|l| f64::from(l - max).exp()).sum();
    max + sum.ln() as f32
}

/// The log-probability of `chosen` and the `n` most likely tokens (ids and
/// log-probabilities, most likely first, the lower id first on ties), from raw logits.
#[must_use]
pub fn logprobs(logits: &[f32], chosen: i32, n: usize) -> (f32, Vec<(i32, f32)>) {
    let log_z = log_normaliser(logits);
    let mut top: Vec<(i32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() == n && l <= top[n - 1].1 {
                continue;
            }
            let at = top.partition_point(|&(_, x)| x >= l);
            top.insert(at, (i as i32, l));
            top.truncate(n);
        }
    }
    let chosen = usize::try_from(chosen)
        .ok()
        .and_then(|c| logits.get(c))
        .map_or(f32::NEG_INFINITY, |l| l - log_z);
    (
        chosen,
        top.into_iter().map(|(i, l)| (i, l - log_z)).collect(),
    )
}

/// Index of the first maximum (llama.cpp's greedy sampler keeps the first on ties).
fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let (lp, top) = logprobs(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        assert!((f64::from(lp) - (2.0 - z.ln())).abs() < 1e-6, "{lp}");
        // 3.0 twice: the lower id first; then 2.0.
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((top[0].1 - top[1].1).abs() < f32::EPSILON);
        let total: f64 = logits
            .iter()
            .map(|&l| f64::from(l - log_normaliser(&logits)).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(logprobs(&logits, 0, 0).1.is_empty());
        assert_eq!(logprobs(&logits, 9, 1).0, f32::NEG_INFINITY);
        assert_eq!(logprobs(&logits, 4, 9).1.len(), logits.len());
    }

    #[test]
    fn argmax_keeps_the_first_maximum() {
        assert_eq!(argmax(&[0.0, 2.0, 1.0, 2.0]), 1);
        assert_eq!(argmax(&[5.0]), 0);
    }

    #[test]
    fn step_seeds_are_pinned_splitmix64() {
        // splitmix64's published first output for state 0 is 0xE220A8397B1DCDAF; the seed
        // of step 0 of seed 0 is its low half. The others pin the (seed, step) packing, so
        // a change of the derivation (which would change every seeded answer) fails here.
        assert_eq!(step_seed(0, 0), 0x7b1d_cdaf);
        assert_eq!(step_seed(42, 0), 0xbeab_dfbb);
        assert_eq!(step_seed(42, 1), 0x6057_f63c);
        assert_eq!(step_seed(43, 0), 0xb874_4274);
        assert_eq!(step_seed(u32::MAX, 7), 0x4094_fbd5);
    }
}
