//! The cost model: for one request, how long each mode is expected to take to the
//! end of its answer and how long it keeps the prefill node busy, from the
//! rates the router measured and the work each node has queued; and the choice among the
//! modes under the user's objective.
//!
//! The modes: `local` (the prefill node alone), `live` (split, the prefill node writes until the state
//! has crossed, then the decode node), `after` (split, the decode node writes from the second token
//! once the state has crossed), `phone` (the decode node prefills and writes; only tokens
//! cross). With `P` prompt tokens to prefill, `N` answer tokens, `pL`/`dL` the prefill node's
//! prefill/decode rates, `pP`/`dP` the decode node's, `g` the link's goodput, `r` its round trip
//! and `x = P kv / g` the state's crossing; and `L(s)`/`F(s)` the time to the end of `s` ms
//! of work on the prefill node/decode node given the work its other answers have left (each engine
//! shares its time among its answers: `s + sum(min(left_i, s))`, [`finish_ms`]; `s` on an
//! idle node):
//!
//! - local: `L(P/pL + N/dL)`; the prefill node is busy `P/pL + N/dL`.
//! - phone: `r + F(P/pP + N/dP)`; the prefill node is not busy.
//! - after: `L(P/pL) + x + r + F((N-1)/dP)`; the prefill node is busy `P/pL`.
//! - live: the prefill node writes `k = x dL / b` tokens while the state crosses (`b`: the answers
//!   sharing the prefill node, this one included); when `k >= N` the answer ends there (as
//!   local); else `L(P/pL) + x + r + 1/dP + F((N-k)/dP)` (the switch's floor is a round trip
//!   and a step); the prefill node is busy `P/pL + k/dL`.
//!
//! The work other answers have left is each one's expected work (the same rates) worked
//! off as the node shares its time (`load.rs`): counting answers alone saw a decode node filling
//! up with long prefills as a decode node with a few answers. A node's decode rate is measured
//! from every answer it writes, times the answers it shared the node with (the mean of the
//! counts at its start and end: approximate when others come and go during it); a prefill
//! rate is measured as the node ran it, between other answers' steps. A mode whose rates
//! are not all measured yet is not predicted. The export is left out (measured: a 2,000
//! token prompt's is ~1% of its prefill), and so is the decode node's work ending while the state
//! crosses (its backlog is read at the request's start).

use std::fmt::Write as _;

pub use crate::api::Objective;
pub use crate::placement::Measured;

use super::route::{Route, Wire};

/// How much later than the soonest mode's an `offload` answer may be expected to end.
pub const OFFLOAD_BOUND: f64 = 1.5;

/// One request as the model sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Prompt tokens to prefill (an estimate before the node tokenizes it).
    pub prompt_tokens: f64,
    /// Answer tokens expected (`max_tokens`, or the measured mean).
    pub answer_tokens: f64,
    pub kv_bytes_per_token: u64,
    /// The other answers on each node and the work each has left.
    pub backlog: Backlog,
}

/// What each node has to do now: the work (ms of the node's time) each of its answers has
/// left.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Backlog {
    pub prefill_node: Vec<f64>,
    pub decode_node: Vec<f64>,
}

/// The end of a new answer of `work_ms` on a node whose answers have `left` ms of work
/// each, when the node shares its time equally among the answers with work left: its own
/// work plus, from each other answer, the time they share (the other's whole rest when
/// that ends first, else as much as its own).
#[must_use]
pub fn finish_ms(work_ms: f64, left: &[f64]) -> f64 {
    let s = work_ms.max(0.0);
    s + left.iter().map(|&l| l.clamp(0.0, s)).sum::<f64>()
}

/// A mode's prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    pub mode: Route,
    /// Expected time to the end of the answer.
    pub e2e_ms: f64,
    /// Expected time the prefill node's engine works on this request.
    pub prefill_node_ms: f64,
}

/// The choice for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub mode: Route,
    /// Why, in words (the objective and the predictions compared).
    pub reason: String,
    /// The chosen mode's prediction (`None`: chosen without one, no rate measured).
    pub predicted: Option<Cost>,
    /// The answer tokens the choice expected (`Request::answer_tokens`; `None`: chosen
    /// by a rule that does not weigh them).
    pub answer_tokens: Option<f64>,
}

/// The prediction of `mode`, or `None` while a rate it needs is not measured.
#[must_use]
pub fn cost(mode: Route, m: &Measured, r: &Request) -> Option<Cost> {
    let (p, n) = (r.prompt_tokens.max(0.0), r.answer_tokens.max(1.0));
    let on_prefill_node = |s: f64| finish_ms(s, &r.backlog.prefill_node);
    let on_decode_node = |s: f64| finish_ms(s, &r.backlog.decode_node);
    let crossing = || -> Option<(f64, f64)> {
        let x = p * r.kv_bytes_per_token as f64 / m.link?;
        Some((x, m.rtt_ms?))
    };
    Some(match mode {
        Route::Local => {
            let (pl, dl) = (m.prefill_node_prefill?, m.prefill_node_decode?);
            Cost {
                mode,
                e2e_ms: on_prefill_node(p / pl + n / dl),
                prefill_node_ms: p / pl + n / dl,
            }
        }
        Route::Phone => {
            let (pp, dp, rtt) = (m.decode_node_prefill?, m.decode_node_decode?, m.rtt_ms?);
            Cost {
                mode,
                e2e_ms: rtt + on_decode_node(p / pp + n / dp),
                prefill_node_ms: 0.0,
            }
        }
        Route::After(Wire::V2) => {
            let (pl, dp) = (m.prefill_node_prefill?, m.decode_node_decode?);
            let (x, rtt) = crossing()?;
            Cost {
                mode,
                e2e_ms: on_prefill_node(p / pl) + x + rtt + on_decode_node((n - 1.0) / dp),
                prefill_node_ms: p / pl,
            }
        }
        Route::Live => {
            let (pl, dl, dp) = (
                m.prefill_node_prefill?,
                m.prefill_node_decode?,
                m.decode_node_decode?,
            );
            let (x, rtt) = crossing()?;
            let sharing = 1.0 + r.backlog.prefill_node.iter().filter(|&&l| l > 0.0).count() as f64;
            let k = x * dl / sharing;
            if k >= n {
                Cost {
                    mode,
                    e2e_ms: on_prefill_node(p / pl + n / dl),
                    prefill_node_ms: p / pl + n / dl,
                }
            } else {
                Cost {
                    mode,
                    e2e_ms: on_prefill_node(p / pl)
                        + x
                        + rtt
                        + 1.0 / dp
                        + on_decode_node((n - k) / dp),
                    prefill_node_ms: p / pl + k / dl,
                }
            }
        }
        // Not among `auto`'s choices: not modelled.
        Route::Layers | Route::After(Wire::V1) => return None,
    })
}

/// The mode for request `r` under `objective`, among `allowed` (the modes this request can
/// take: a layer split, a v1 transport or a held conversation narrow them). `fallback` is
/// taken when none of the allowed modes can be predicted yet.
#[must_use]
pub fn choose(
    m: &Measured,
    r: &Request,
    objective: Objective,
    allowed: &[Route],
    fallback: Route,
) -> Choice {
    let costs: Vec<Cost> = allowed
        .iter()
        .filter_map(|&mode| cost(mode, m, r))
        .collect();
    let Some(soonest) = costs
        .iter()
        .copied()
        .min_by(|a, b| a.e2e_ms.total_cmp(&b.e2e_ms))
    else {
        return Choice {
            mode: fallback,
            reason: format!(
                "no rate measured yet for {}: the default mode",
                names(allowed)
            ),
            predicted: None,
            answer_tokens: Some(r.answer_tokens),
        };
    };
    let prefill_node_busy = r.backlog.prefill_node.len();
    let effective = match objective {
        Objective::Balanced if prefill_node_busy == 0 => Objective::Latency,
        Objective::Balanced => Objective::Offload,
        o => o,
    };
    let chosen = match effective {
        Objective::Offload => costs
            .iter()
            .copied()
            .filter(|c| c.e2e_ms <= soonest.e2e_ms * OFFLOAD_BOUND)
            .min_by(|a, b| {
                a.prefill_node_ms
                    .total_cmp(&b.prefill_node_ms)
                    .then(a.e2e_ms.total_cmp(&b.e2e_ms))
            })
            .unwrap_or(soonest),
        _ => soonest,
    };
    let mut reason = objective.as_str().to_string();
    if objective == Objective::Balanced {
        let _ = write!(
            reason,
            " ({} answers on the prefill node: {})",
            prefill_node_busy,
            effective.as_str()
        );
    }
    reason.push_str(": predicted");
    for c in &costs {
        let _ = write!(
            reason,
            " {} {:.0} ms (prefill node {:.0} ms);",
            c.mode.as_str(),
            c.e2e_ms,
            c.prefill_node_ms
        );
    }
    reason.pop();
    let unknown: Vec<Route> = allowed
        .iter()
        .copied()
        .filter(|mode| costs.iter().all(|c| c.mode != *mode))
        .collect();
    if !unknown.is_empty() {
        let _ = write!(reason, "; not yet measured: {}", names(&unknown));
    }
    Choice {
        mode: chosen.mode,
        reason,
        predicted: Some(chosen),
        answer_tokens: Some(r.answer_tokens),
    }
}

fn names(modes: &[Route]) -> String {
    modes
        .iter()
        .map(|m| m.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefill node that prefills 1 token/ms and decodes 0.05 (50 tok/s), a decode node at half its
    /// speed, 100 Mbit/s Wi-Fi (12,500 bytes/ms) with a 5 ms round trip, SmolLM2's
    /// ~23 KB of KV per token.
    fn rates() -> Measured {
        Measured {
            prefill_node_prefill: Some(1.0),
            prefill_node_decode: Some(0.05),
            decode_node_prefill: Some(0.5),
            decode_node_decode: Some(0.025),
            link: Some(12_500.0),
            rtt_ms: Some(5.0),
        }
    }

    /// A request with `prefill_node_busy` other answers on the prefill node, each with more work left
    /// than this one has.
    fn request(p: f64, n: f64, prefill_node_busy: usize) -> Request {
        Request {
            prompt_tokens: p,
            answer_tokens: n,
            kv_bytes_per_token: 23_040,
            backlog: Backlog {
                prefill_node: vec![1e9; prefill_node_busy],
                decode_node: Vec::new(),
            },
        }
    }

    /// The choice among all four modes, `live` when none is predicted.
    fn pick(m: &Measured, r: Request, objective: Objective) -> Choice {
        choose(m, &r, objective, &Route::CHOSEN, Route::Live)
    }

    /// A decode node at 0.9x the prefill node's speeds.
    fn decode_node_near_the_prefill_nodes_speed() -> Measured {
        Measured {
            decode_node_decode: Some(0.045),
            decode_node_prefill: Some(0.9),
            ..rates()
        }
    }

    fn approx(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn each_mode_is_predicted_by_its_formula() {
        let (m, r) = (rates(), request(2000.0, 512.0, 0));
        let x = 2000.0 * 23_040.0 / 12_500.0; // 3,686.4 ms to cross
        let local = cost(Route::Local, &m, &r).unwrap();
        approx(local.e2e_ms, 2000.0 + 512.0 / 0.05);
        approx(local.prefill_node_ms, local.e2e_ms);
        let phone = cost(Route::Phone, &m, &r).unwrap();
        approx(phone.e2e_ms, 5.0 + 2000.0 / 0.5 + 512.0 / 0.025);
        approx(phone.prefill_node_ms, 0.0);
        let after = cost(Route::After(Wire::V2), &m, &r).unwrap();
        approx(after.e2e_ms, 2000.0 + x + 5.0 + 511.0 / 0.025);
        approx(after.prefill_node_ms, 2000.0);
        let live = cost(Route::Live, &m, &r).unwrap();
        let k = x * 0.05;
        approx(
            live.e2e_ms,
            2000.0 + x + 5.0 + 1.0 / 0.025 + (512.0 - k) / 0.025,
        );
        approx(live.prefill_node_ms, 2000.0 + k / 0.05);
    }

    #[test]
    fn a_new_answer_ends_after_its_work_and_what_it_shares() {
        assert_eq!(finish_ms(100.0, &[]), 100.0);
        // Two answers with more left than it: it gets a third of the node throughout.
        assert_eq!(finish_ms(100.0, &[500.0, 800.0]), 300.0);
        // One with less: it ends first, having taken its 30 ms of the shared time.
        assert_eq!(finish_ms(100.0, &[30.0, 800.0]), 230.0);
        // Three short answers weigh less than one long prefill, which counting answers
        // did not see.
        assert_eq!(finish_ms(100.0, &[5.0, 5.0, 5.0]), 115.0);
        assert_eq!(finish_ms(100.0, &[30_000.0]), 200.0);
        // Nothing left (done as expected, not yet ended): no share.
        assert_eq!(finish_ms(100.0, &[0.0]), 100.0);
    }

    #[test]
    fn each_mode_waits_for_the_work_queued_on_the_nodes_it_uses() {
        let (m, idle) = (rates(), request(2000.0, 512.0, 0));
        let mut r = idle.clone();
        r.backlog = Backlog {
            prefill_node: vec![1_000.0],
            decode_node: vec![3_000.0, 50_000.0],
        };
        let c = |mode, r: &Request| cost(mode, &m, r).unwrap();
        // local: 12,240 ms of work, sharing 1,000 with the prefill node's other answer.
        approx(c(Route::Local, &r).e2e_ms, 12_240.0 + 1_000.0);
        approx(c(Route::Local, &r).prefill_node_ms, 12_240.0);
        // decode node: 24,480 ms of work, 3,000 + 24,480 shared on the decode node.
        approx(
            c(Route::Phone, &r).e2e_ms,
            5.0 + 24_480.0 + 3_000.0 + 24_480.0,
        );
        // after: the prefill shares the prefill node (1,000), the answer the decode node (3,000 +
        // its own 20,440).
        approx(
            c(Route::After(Wire::V2), &r).e2e_ms,
            c(Route::After(Wire::V2), &idle).e2e_ms + 1_000.0 + 3_000.0 + 20_440.0,
        );
        // live: the prefill node is shared while the state crosses, so it writes half the
        // tokens (k), and the decode node writes the rest sharing its time.
        let x = 2000.0 * 23_040.0 / 12_500.0;
        let k = x * 0.05 / 2.0;
        let decode_node_part = (512.0 - k) / 0.025;
        approx(
            c(Route::Live, &r).e2e_ms,
            3_000.0 + x + 5.0 + 40.0 + decode_node_part + 3_000.0 + decode_node_part,
        );
        approx(c(Route::Live, &r).prefill_node_ms, 2_000.0 + k / 0.05);
    }

    #[test]
    fn a_phone_filled_with_long_prefills_is_not_where_offload_sends_the_next() {
        // A slow link (10 Mbit/s: a 2,000-token state crosses in ~37 s), a busy prefill node:
        // balanced offloads, and an idle decode node is within the bound.
        let mut m = rates();
        m.link = Some(1_250.0);
        let mut r = request(2000.0, 128.0, 0);
        r.backlog.prefill_node = vec![20_000.0];
        let c = pick(&m, r.clone(), Objective::Balanced);
        assert_eq!(c.mode, Route::Phone, "{}", c.reason);
        // Three answers on the decode node, each a long prefill still ahead (30 s of its time):
        // three answers, seen as the decode node's next 90 s.
        r.backlog.decode_node = vec![30_000.0; 3];
        let c = pick(&m, r.clone(), Objective::Balanced);
        assert_eq!(c.mode, Route::Local, "{}", c.reason);
        // The same three answers near their ends (0.5 s left each): the decode node again.
        r.backlog.decode_node = vec![500.0; 3];
        let c = pick(&m, r, Objective::Balanced);
        assert_eq!(c.mode, Route::Phone, "{}", c.reason);
    }

    #[test]
    fn a_short_answer_that_ends_before_the_state_crosses_is_local_in_all_but_name() {
        let (m, r) = (rates(), request(2000.0, 32.0, 0));
        let live = cost(Route::Live, &m, &r).unwrap();
        let local = cost(Route::Local, &m, &r).unwrap();
        approx(live.e2e_ms, local.e2e_ms);
        approx(live.prefill_node_ms, local.prefill_node_ms);
    }

    #[test]
    fn latency_takes_the_soonest_and_a_slower_phone_loses_it() {
        let c = pick(&rates(), request(2000.0, 512.0, 0), Objective::Latency);
        assert_eq!(c.mode, Route::Local, "{}", c.reason);
        // A decode node that decodes as fast as the prefill node, on a fast link, and a prefill node with
        // three long answers running: the idle decode node alone is soonest (its prefill at half
        // the prefill node's speed beats a quarter of the prefill node's), then the split (its decode
        // does not share the prefill node).
        let mut m = rates();
        m.decode_node_decode = Some(0.05);
        m.link = Some(125_000.0);
        let c = pick(&m, request(2000.0, 512.0, 3), Objective::Latency);
        assert_eq!(c.mode, Route::Phone, "{}", c.reason);
        let c = choose(
            &m,
            &request(2000.0, 512.0, 3),
            Objective::Latency,
            &[Route::Local, Route::Live, Route::After(Wire::V2)],
            Route::Live,
        );
        assert!(
            matches!(c.mode, Route::Live | Route::After(Wire::V2)),
            "{}",
            c.reason
        );
    }

    #[test]
    fn offload_frees_the_laptop_within_its_bound_and_no_further() {
        let m = rates();
        // The decode node is 2x slower: after / live keep the answer within 1.5x? after:
        // 2000 + 3686 + 5 + 20440 = 26,131 ms against local's 12,240: over the bound, so
        // offload keeps the answer on the prefill node.
        let c = pick(&m, request(2000.0, 512.0, 0), Objective::Offload);
        assert_eq!(c.mode, Route::Local, "{}", c.reason);
        // A decode node at 0.9x the prefill node: `after` is within the bound and frees the prefill node
        // the most.
        let m = decode_node_near_the_prefill_nodes_speed();
        let c = pick(&m, request(2000.0, 512.0, 0), Objective::Offload);
        assert_eq!(c.mode, Route::Phone, "{}", c.reason);
        let c = choose(
            &m,
            &request(2000.0, 512.0, 0),
            Objective::Offload,
            &[Route::Local, Route::Live, Route::After(Wire::V2)],
            Route::Live,
        );
        assert_eq!(c.mode, Route::After(Wire::V2), "{}", c.reason);
    }

    #[test]
    fn balanced_is_latency_on_an_idle_laptop_and_offload_on_a_busy_one() {
        let m = decode_node_near_the_prefill_nodes_speed();
        let idle = pick(&m, request(500.0, 256.0, 0), Objective::Balanced);
        assert_eq!(idle.mode, Route::Local, "{}", idle.reason);
        assert!(idle.reason.contains("latency"), "{}", idle.reason);
        let busy = pick(&m, request(500.0, 256.0, 2), Objective::Balanced);
        assert_eq!(busy.mode, Route::Phone, "{}", busy.reason);
        assert!(busy.reason.contains("offload"), "{}", busy.reason);
    }

    #[test]
    fn a_rate_not_yet_measured_leaves_its_modes_out_and_says_so() {
        let mut m = rates();
        m.decode_node_prefill = None;
        assert_eq!(cost(Route::Phone, &m, &request(100.0, 32.0, 0)), None);
        let c = pick(&m, request(100.0, 32.0, 0), Objective::Offload);
        assert_ne!(c.mode, Route::Phone);
        assert!(c.reason.contains("not yet measured: phone"), "{}", c.reason);
        // Nothing measured: the default mode, said as such.
        let c = choose(
            &Measured::default(),
            &request(100.0, 32.0, 0),
            Objective::Latency,
            &Route::CHOSEN,
            Route::Live,
        );
        assert_eq!((c.mode, c.predicted), (Route::Live, None));
        assert!(c.reason.contains("no rate measured yet"), "{}", c.reason);
    }

    #[test]
    fn only_the_allowed_modes_are_chosen() {
        let c = choose(
            &rates(),
            &request(2000.0, 512.0, 0),
            Objective::Latency,
            &[Route::After(Wire::V2), Route::Phone],
            Route::After(Wire::V2),
        );
        assert!(
            matches!(c.mode, Route::After(Wire::V2) | Route::Phone),
            "{}",
            c.reason
        );
    }
}
