//! Where a request runs: the split's handoff mode, and for a conversation the decode node
//! holds, whether it goes on there (`--continue-on`, the measured rule of `placement.rs`).

use std::fmt::Write as _;

use edgesplit_proto::error::ErrorCode;

use super::cost::{self, Choice};
use super::nodes::lock;
use super::route::{Route, Wire};
use super::Failure;
use super::{Backend, PrefilledOn, Started};
use crate::api::{HandoffMode, Transport, ValidRequest};
use crate::placement::{input_chars, Copies};

/// Where a new turn of a conversation the decode node holds is prefilled (`--continue-on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ContinueOn {
    /// By the measured rule (`placement::Rates`): on the decode node while that is sooner,
    /// else on the prefill node, shipping only the new part's KV when the prefill node
    /// holds the conversation too.
    #[default]
    Measured,
    /// Always on the prefill node, shipping only the new part's KV (a tail) when it can.
    PrefillNode,
}

/// Where a held conversation's next turn goes first ([`Backend::held_turn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HeldFirst {
    /// By `--continue-on`.
    ByRule,
    /// The decode node prefills the new part (`auto` chose `phone` for it).
    DecodeNode,
    /// The prefill node prefills the new part and ships its KV (`auto` chose a split).
    PrefillNode,
}

impl Backend {
    /// A live answer that ends on the prefill node is handed over after it all the same
    /// (`Handoff.keep`) when its conversation may go on on the decode node: a request that
    /// allows its prompt cache, rendered alike by both nodes.
    pub(super) fn keeps(&self, req: &ValidRequest, mode: HandoffMode) -> bool {
        mode == HandoffMode::Live && req.cache_prompt && self.renders_alike(&req.input)
    }

    /// A split request that continues a conversation the decode node holds (`held` of its
    /// tokens, as remembered): the decode node prefills the new part itself, if it still
    /// holds some of the conversation and, where the prefill node holds it too (`both`),
    /// if that is sooner than a split ([`Rates::max_uncached`]). A conversation only the
    /// decode node holds goes on there whatever its new part: the prefill node could only
    /// prefill the answers the decode node decoded, which is not the conversation
    /// continued. `Err` with code `not_cached` when it refused (nothing changed there).
    pub(super) async fn continue_on_decode_node(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
        held: u32,
        both: bool,
    ) -> Result<Started, Failure> {
        let kv_per_token = self.known.decode_kv_bytes_per_token();
        let max_uncached = if both {
            lock(&self.learned).rates.max_uncached(held, kv_per_token)
        } else {
            u32::MAX
        };
        self.on_decode_node(req, transport, request_id, Some(max_uncached))
            .await
    }

    /// How many tokens of `req`'s conversation the decode node holds (from its earlier
    /// turns), when the request may reuse them (`cache_prompt`, a template that renders
    /// a conversation's turns alike).
    pub(super) fn held(&self, req: &ValidRequest) -> Option<u32> {
        (req.cache_prompt && self.renders_alike(&req.input))
            .then(|| lock(&self.learned).conversations.find(&req.input))
            .flatten()
    }

    /// A new turn of a conversation the decode node holds goes on there when the choice
    /// (`first`) says so and the node still holds it ([`Backend::continue_on_decode_node`]): `Ok`
    /// with its answer started. Else `Err` with how many tokens of the conversation the
    /// decode node holds for a split to ship only the new part's KV after (0: none).
    pub(super) async fn held_turn(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
        first: HeldFirst,
    ) -> Result<Started, u32> {
        let mut held = self.held(req);
        // The prefill node goes first when told to, when it holds the conversation further
        // than the decode node, or when it holds it too and is measured sooner per token:
        // only the new part's KV then crosses. Its copy must be whole first: a replay in
        // flight is waited for.
        let prefill_node_first = |copies: Option<Copies>| {
            let kv = self.known.decode_kv_bytes_per_token();
            match (first, copies) {
                (_, Some(Copies::PrefillNodeAhead)) | (HeldFirst::PrefillNode, _) => true,
                (HeldFirst::DecodeNode, _) => false,
                (HeldFirst::ByRule, copies) => match self.config.continue_on {
                    ContinueOn::PrefillNode => true,
                    ContinueOn::Measured => {
                        matches!(copies, Some(Copies::Both | Copies::Replaying))
                            && lock(&self.learned).rates.prefill_node_sooner(kv)
                    }
                },
            }
        };
        let copies = lock(&self.learned).conversations.copies(&req.input);
        let prefill_node_first = held.is_some()
            && prefill_node_first(copies)
            && match copies {
                Some(Copies::Replaying) => {
                    let settled = self.replay_settled(&req.input).await;
                    // Not replayed: only the decode node continues the conversation, unless
                    // told to split it.
                    settled != Some(Copies::DecodeNode)
                        || (first == HeldFirst::ByRule
                            && self.config.continue_on == ContinueOn::PrefillNode)
                }
                _ => true,
            };
        if let (Some(h), false) = (held, prefill_node_first) {
            // Whether the prefill node holds the conversation as the decode node does, or
            // is replaying it (a tail from there is then the conversation continued).
            let mut both = copies != Some(Copies::DecodeNode);
            loop {
                let e = match self
                    .continue_on_decode_node(req, transport, request_id, h, both)
                    .await
                {
                    Ok(started) => return Ok(started),
                    Err(e) => e,
                };
                if both
                    && e.cause == Some(ErrorCode::UncachedPartTooLong)
                    && self.replay_settled(&req.input).await != Some(Copies::Both)
                {
                    // The new part is long, but the replay did not end whole: only the
                    // decode node continues the conversation.
                    both = false;
                    continue;
                }
                // Held, but the new part is long: the split ships only that part's KV when
                // it can (`Handoff.base_max`).
                if e.cause != Some(ErrorCode::UncachedPartTooLong) {
                    held = None;
                }
                if e.cause == Some(ErrorCode::NotCached) {
                    lock(&self.learned).conversations.forget(&req.input);
                }
                tracing::info!(request_id, reason = %e.message, "split after all");
                break;
            }
        }
        Err(held.unwrap_or(0))
    }

    /// Which nodes hold the conversation `input` continues, once the prefill node's replay
    /// of it in flight (if any) has ended, waiting at most the first-token bound.
    async fn replay_settled(&self, input: &crate::api::Input) -> Option<Copies> {
        let deadline = tokio::time::Instant::now() + self.config.first_token_timeout;
        loop {
            let replays = lock(&self.learned).replays.clone();
            let ended = replays.notified();
            let copies = lock(&self.learned).conversations.copies(input);
            if copies != Some(Copies::Replaying)
                || tokio::time::timeout_at(deadline, ended).await.is_err()
            {
                return copies;
            }
        }
    }

    /// Runs the route `auto` chose. The decode node it chose could not take the answer (gone,
    /// asleep, or it refused what the prefill node would serve): the prefill node answers under the
    /// fallback policy, as a split that finds no decode node does, and says so
    /// (`fallback`).
    pub(super) async fn run_chosen(
        &self,
        req: &ValidRequest,
        route: Route,
        request_id: &str,
    ) -> Result<Started, Failure> {
        match self.run(req, route, request_id).await {
            Err(e) if route == Route::Phone && self.config.fallback => {
                self.answer_here_instead(req, request_id, &e, Transport::Phone)
                    .await
            }
            r => r,
        }
    }

    /// `transport: "auto"`: the cost model's choice among the modes this request can take
    /// under its objective (`cost.rs`), then that mode's path.
    pub(super) async fn start_auto(
        &self,
        req: &ValidRequest,
        request_id: &str,
    ) -> Result<Started, Failure> {
        let plan = self.plan_auto(req).await?;
        self.run_auto(req, plan, request_id).await
    }

    /// What `auto` chooses for `req` on this pair, before anything runs. A request that
    /// names its handoff mode is split in that mode. A conversation the decode node holds
    /// goes on by the cost model when the prefill node holds it too (replayed: the same
    /// answer either way), among going on on the decode node (`phone`, only the new part
    /// prefilled there), on the prefill node alone (`local`, only the new part prefilled)
    /// and a split shipping only the new part's KV; else by the placement rule
    /// (`held_turn`, `--continue-on`).
    pub(super) async fn plan_auto(&self, req: &ValidRequest) -> Result<AutoPlan, Failure> {
        lock(&self.learned).last_auto = Some(std::time::Instant::now());
        self.calibrated().await;
        let objective = req.objective.unwrap_or(self.config.objective);
        let held = self.held(req);
        let chars = input_chars(&req.input);
        let default = Route::split(Wire::V2, req.handoff.unwrap_or(self.config.handoff))?;
        let (measured, prompt_tokens, answer_tokens, copies, new_part) = {
            let l = lock(&self.learned);
            let prompt_tokens = l.rates.tokens_of(chars);
            // The held tokens are counted; the new part's are estimated from its characters
            // too (the whole prompt's estimate misses the template's tokens of the held part).
            let new_part = match (held, l.conversations.held_chars(&req.input)) {
                (Some(h), Some(c)) => (prompt_tokens - f64::from(h))
                    .max(l.rates.tokens_of(chars.saturating_sub(c)))
                    .max(1.0),
                _ => prompt_tokens,
            };
            (
                l.rates.measured(),
                prompt_tokens,
                l.rates.expected_answer(req.max_tokens),
                l.conversations.copies(&req.input),
                new_part,
            )
        };
        let request = |prompt_tokens: f64| cost::Request {
            prompt_tokens,
            answer_tokens,
            kv_bytes_per_token: self.kv_bytes_per_token(),
            backlog: self.load.backlog(),
        };
        // A split ships only the new part's KV (a tail) live and without a sliding window;
        // a whole state would cross otherwise, which the prefill node alone beats.
        let tail = default == Route::Live && self.known.decode().is_some_and(|i| !i.sliding_window);
        let mut held_modes = vec![Route::Local];
        if tail {
            held_modes.push(default);
        }
        if matches!(copies, Some(Copies::Both | Copies::Replaying)) {
            held_modes.push(Route::Phone);
        }
        let choice = match (held, copies) {
            // A replay in flight counts as the prefill node's work (the queue's): the modes
            // on the prefill node then wait for its end.
            (Some(_), Some(Copies::Both | Copies::Replaying | Copies::PrefillNodeAhead))
                if req.handoff.is_none() =>
            {
                let mut c = cost::choose(
                    &measured,
                    &request(new_part),
                    objective,
                    &held_modes,
                    default,
                );
                let copies = match copies {
                    Some(Copies::Replaying) => "both nodes hold once its replay ends",
                    Some(Copies::PrefillNodeAhead) => "the prefill node holds further",
                    _ => "both nodes hold",
                };
                let _ = write!(
                    c.reason,
                    "; a conversation {copies}, ~{new_part:.0} new tokens"
                );
                c
            }
            (Some(_), _) => Choice {
                mode: default,
                reason: "a conversation the decode node holds: the placement rule \
                         (--continue-on)"
                    .into(),
                predicted: None,
                answer_tokens: None,
            },
            (None, _) => {
                let forced = req.handoff.map(|_| default);
                // A chat that goes on from an answer the decode node does not hold may go
                // on from the prefill node's: prefilled there (it reuses its copy), never
                // on the decode node alone, which would prefill the answer that the prefill
                // node decoded (not the conversation continued).
                let prefill_node_copy = [Route::Local, Route::Live, Route::After(Wire::V2)];
                let allowed: &[Route] = match &forced {
                    Some(m) => std::slice::from_ref(m),
                    None if req.cache_prompt && goes_on(&req.input) => &prefill_node_copy,
                    None => &Route::CHOSEN,
                };
                cost::choose(
                    &measured,
                    &request(prompt_tokens),
                    objective,
                    allowed,
                    default,
                )
            }
        };
        Ok(AutoPlan {
            held,
            default,
            choice,
        })
    }

    /// Runs what [`Backend::plan_auto`] chose.
    pub(super) async fn run_auto(
        &self,
        req: &ValidRequest,
        plan: AutoPlan,
        request_id: &str,
    ) -> Result<Started, Failure> {
        let AutoPlan {
            held,
            default,
            mut choice,
        } = plan;
        tracing::info!(request_id, mode = choice.mode.as_str(), reason = %choice.reason, "auto");
        let mut started = if let Some(h) = held {
            // A held conversation: the prefill node alone when the cost model chose it,
            // else the default split's way, where `held_turn` goes first on the node the
            // cost model chose, or by the placement rule.
            let first = match (choice.predicted, choice.mode) {
                (None, _) => HeldFirst::ByRule,
                (Some(_), Route::Phone) => HeldFirst::DecodeNode,
                (Some(_), _) => HeldFirst::PrefillNode,
            };
            // The prefill node's copy is whole once its replay in flight has ended; not
            // replayed, only the decode node continues the conversation.
            let whole = first != HeldFirst::PrefillNode
                || self.replay_settled(&req.input).await != Some(Copies::DecodeNode);
            if !whole {
                choice.mode = Route::Phone;
                let _ = write!(choice.reason, "; not replayed: on the decode node");
                self.run_held(req, default, request_id, HeldFirst::DecodeNode)
                    .await?
            } else if choice.predicted.is_some() && choice.mode == Route::Local {
                lock(&self.learned)
                    .conversations
                    .went_on_on_prefill_node(&req.input);
                let started = self.run(req, Route::Local, request_id).await?;
                if started.cached_tokens.unwrap_or(0) >= h {
                    started
                } else {
                    // The prefill node did not hold its copy (another answer took the
                    // slot) and prefilled the conversation anew: that answer is dropped
                    // before any token of it is sent, and the decode node continues it.
                    drop(started);
                    lock(&self.learned)
                        .conversations
                        .prefill_node_lost(&req.input);
                    tracing::info!(
                        request_id,
                        "the prefill node did not hold the conversation: on the decode node"
                    );
                    choice.mode = Route::Phone;
                    let _ = write!(
                        choice.reason,
                        "; the prefill node's copy was gone: on the decode node"
                    );
                    self.run_held(req, default, request_id, HeldFirst::DecodeNode)
                        .await?
                }
            } else {
                self.run_held(req, default, request_id, first).await?
            }
        } else {
            self.run_chosen(req, choice.mode, request_id).await?
        };
        if let Some(tokens) = started.prompt_tokens {
            lock(&self.learned)
                .rates
                .prompt_seen(input_chars(&req.input), tokens);
        }
        if held.is_some() && started.placement == PrefilledOn::DecodeNode {
            choice.mode = Route::Phone;
        } else if held.is_some() && choice.mode == Route::Phone {
            // The decode node refused to go on (its copy gone, or the new part too long):
            // the split ran.
            choice.mode = default;
        }
        started.choice = Some(choice);
        Ok(started)
    }
}

/// Whether `input` goes on from an earlier answer (a chat with an assistant message).
fn goes_on(input: &crate::api::Input) -> bool {
    matches!(input, crate::api::Input::Chat(m) if m.iter().any(|m| m.role == "assistant"))
}

/// `auto`'s choice for one request on one pair, not yet run.
#[derive(Debug, Clone)]
pub(super) struct AutoPlan {
    /// How many tokens of the request's conversation the decode node holds.
    pub(super) held: Option<u32>,
    /// The split the request takes when nothing is measured (its handoff mode).
    pub(super) default: Route,
    pub(super) choice: Choice,
}

/// For an `auto` answer's reason: the decode node chosen (`plans[chosen]`, whose pairs'
/// URLs are `urls`) and what the others' pairs predicted.
pub(super) fn others_said(plans: &[(usize, AutoPlan)], urls: &[String], chosen: usize) -> String {
    let mut s = format!("; decode node {} of {}", urls[chosen], plans.len());
    for (k, (_, p)) in plans.iter().enumerate() {
        if k == chosen {
            continue;
        }
        let url = &urls[k];
        let _ = match p.choice.predicted {
            Some(c) => write!(s, "; {url}: {} {:.0} ms", c.mode.as_str(), c.e2e_ms),
            None => write!(s, "; {url}: not yet measured"),
        };
    }
    s
}
