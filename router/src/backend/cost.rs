//! The cost model (issue 39): for one request, how long each mode is expected to take to the
//! end of its answer and how long it keeps the laptop (the prefill node) busy, from the
//! rates the router measured; and the choice among the modes under the user's objective.
//!
//! The modes: `local` (the laptop alone), `live` (split, the laptop writes until the state
//! has crossed, then the phone), `after` (split, the phone writes from the second token
//! once the state has crossed), `phone` (the decode node prefills and writes; only tokens
//! cross). With `P` prompt tokens to prefill, `N` answer tokens, `b` other answers running
//! on the laptop and `q` on the phone (each engine steps its answers in turn, so an answer's
//! decode rate is the node's divided by the answers sharing it), `pL`/`dL` the laptop's
//! prefill/decode rates, `pP`/`dP` the phone's, `g` the link's goodput, `r` its round trip
//! and `x = P kv / g` the state's crossing:
//!
//! - local: `P/pL + N (b+1)/dL`; the laptop is busy `P/pL + N/dL`.
//! - phone: `r + P/pP + N (q+1)/dP`; the laptop is not busy.
//! - after: `P/pL + x + r + (N-1)(q+1)/dP`; the laptop is busy `P/pL`.
//! - live: the laptop writes `k = x dL/(b+1)` tokens while the state crosses; when
//!   `k >= N` the answer ends there (as local); else `P/pL + x + r + 1/dP + (N-k)(q+1)/dP`
//!   (the switch's floor is a round trip and a step); the laptop is busy `P/pL + k/dL`.
//!
//! A node's decode rate is measured from every answer it writes, times the answers it shared
//! the node with (the mean of the counts at its start and end: approximate when others come
//! and go during it). A mode whose rates are not all measured yet is not predicted.
//! Prefill of others' prompts and the export are left out: they are small beside the
//! terms kept (measured: a 2,000 token prompt's export is ~1% of its prefill).

use std::fmt::Write as _;

pub use crate::api::Objective;
pub use crate::placement::Measured;

use super::route::{Route, Wire};

/// How much later than the soonest mode's an `offload` answer may be expected to end.
pub const OFFLOAD_BOUND: f64 = 1.5;

/// One request as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Prompt tokens to prefill (an estimate before the node tokenizes it).
    pub prompt_tokens: f64,
    /// Answer tokens expected (`max_tokens`, or the measured mean).
    pub answer_tokens: f64,
    pub kv_bytes_per_token: u64,
    /// Other answers running on each node.
    pub laptop_busy: u32,
    pub phone_busy: u32,
}

/// A mode's prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    pub mode: Route,
    /// Expected time to the end of the answer.
    pub e2e_ms: f64,
    /// Expected time the laptop's engine works on this request.
    pub laptop_ms: f64,
}

/// The choice for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub mode: Route,
    /// Why, in words (the objective and the predictions compared).
    pub reason: String,
    /// The chosen mode's prediction (`None`: chosen without one, no rate measured).
    pub predicted: Option<Cost>,
}

/// The prediction of `mode`, or `None` while a rate it needs is not measured.
#[must_use]
pub fn cost(mode: Route, m: &Measured, r: &Request) -> Option<Cost> {
    let (p, n) = (r.prompt_tokens.max(0.0), r.answer_tokens.max(1.0));
    let laptop_share = f64::from(r.laptop_busy) + 1.0;
    let phone_share = f64::from(r.phone_busy) + 1.0;
    let crossing = || -> Option<(f64, f64)> {
        let x = p * r.kv_bytes_per_token as f64 / m.link?;
        Some((x, m.rtt_ms?))
    };
    Some(match mode {
        Route::Local => {
            let (pl, dl) = (m.laptop_prefill?, m.laptop_decode?);
            Cost {
                mode,
                e2e_ms: p / pl + n * laptop_share / dl,
                laptop_ms: p / pl + n / dl,
            }
        }
        Route::Phone => {
            let (pp, dp, rtt) = (m.phone_prefill?, m.phone_decode?, m.rtt_ms?);
            Cost {
                mode,
                e2e_ms: rtt + p / pp + n * phone_share / dp,
                laptop_ms: 0.0,
            }
        }
        Route::After(Wire::V2) => {
            let (pl, dp) = (m.laptop_prefill?, m.phone_decode?);
            let (x, rtt) = crossing()?;
            Cost {
                mode,
                e2e_ms: p / pl + x + rtt + (n - 1.0) * phone_share / dp,
                laptop_ms: p / pl,
            }
        }
        Route::Live => {
            let (pl, dl, dp) = (m.laptop_prefill?, m.laptop_decode?, m.phone_decode?);
            let (x, rtt) = crossing()?;
            let k = x * dl / laptop_share;
            if k >= n {
                Cost {
                    mode,
                    e2e_ms: p / pl + n * laptop_share / dl,
                    laptop_ms: p / pl + n / dl,
                }
            } else {
                Cost {
                    mode,
                    e2e_ms: p / pl + x + rtt + 1.0 / dp + (n - k) * phone_share / dp,
                    laptop_ms: p / pl + k / dl,
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
        };
    };
    let effective = match objective {
        Objective::Balanced if r.laptop_busy == 0 => Objective::Latency,
        Objective::Balanced => Objective::Offload,
        o => o,
    };
    let chosen = match effective {
        Objective::Offload => costs
            .iter()
            .copied()
            .filter(|c| c.e2e_ms <= soonest.e2e_ms * OFFLOAD_BOUND)
            .min_by(|a, b| {
                a.laptop_ms
                    .total_cmp(&b.laptop_ms)
                    .then(a.e2e_ms.total_cmp(&b.e2e_ms))
            })
            .unwrap_or(soonest),
        _ => soonest,
    };
    let mut reason = objective.as_str().to_string();
    if objective == Objective::Balanced {
        let _ = write!(
            reason,
            " ({} answers on the laptop: {})",
            r.laptop_busy,
            effective.as_str()
        );
    }
    reason.push_str(": predicted");
    for c in &costs {
        let _ = write!(
            reason,
            " {} {:.0} ms (laptop {:.0} ms);",
            c.mode.as_str(),
            c.e2e_ms,
            c.laptop_ms
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

    /// A laptop that prefills 1 token/ms and decodes 0.05 (50 tok/s), a phone at half its
    /// speed, 100 Mbit/s Wi-Fi (12,500 bytes/ms) with a 5 ms round trip, SmolLM2's
    /// ~23 KB of KV per token.
    fn rates() -> Measured {
        Measured {
            laptop_prefill: Some(1.0),
            laptop_decode: Some(0.05),
            phone_prefill: Some(0.5),
            phone_decode: Some(0.025),
            link: Some(12_500.0),
            rtt_ms: Some(5.0),
        }
    }

    fn request(p: f64, n: f64, laptop_busy: u32) -> Request {
        Request {
            prompt_tokens: p,
            answer_tokens: n,
            kv_bytes_per_token: 23_040,
            laptop_busy,
            phone_busy: 0,
        }
    }

    /// The choice among all four modes, `live` when none is predicted.
    fn pick(m: &Measured, r: Request, objective: Objective) -> Choice {
        choose(m, &r, objective, &Route::CHOSEN, Route::Live)
    }

    /// A phone at 0.9x the laptop's speeds.
    fn near_laptop_phone() -> Measured {
        Measured {
            phone_decode: Some(0.045),
            phone_prefill: Some(0.9),
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
        approx(local.laptop_ms, local.e2e_ms);
        let phone = cost(Route::Phone, &m, &r).unwrap();
        approx(phone.e2e_ms, 5.0 + 2000.0 / 0.5 + 512.0 / 0.025);
        approx(phone.laptop_ms, 0.0);
        let after = cost(Route::After(Wire::V2), &m, &r).unwrap();
        approx(after.e2e_ms, 2000.0 + x + 5.0 + 511.0 / 0.025);
        approx(after.laptop_ms, 2000.0);
        let live = cost(Route::Live, &m, &r).unwrap();
        let k = x * 0.05;
        approx(
            live.e2e_ms,
            2000.0 + x + 5.0 + 1.0 / 0.025 + (512.0 - k) / 0.025,
        );
        approx(live.laptop_ms, 2000.0 + k / 0.05);
    }

    #[test]
    fn a_short_answer_that_ends_before_the_state_crosses_is_local_in_all_but_name() {
        let (m, r) = (rates(), request(2000.0, 32.0, 0));
        let live = cost(Route::Live, &m, &r).unwrap();
        let local = cost(Route::Local, &m, &r).unwrap();
        approx(live.e2e_ms, local.e2e_ms);
        approx(live.laptop_ms, local.laptop_ms);
    }

    #[test]
    fn latency_takes_the_soonest_and_a_slower_phone_loses_it() {
        let c = pick(&rates(), request(2000.0, 512.0, 0), Objective::Latency);
        assert_eq!(c.mode, Route::Local, "{}", c.reason);
        // A phone as fast as the laptop, on a fast link, and a laptop with three answers
        // running: the split's decode no longer shares the laptop.
        let mut m = rates();
        m.phone_decode = Some(0.05);
        m.link = Some(125_000.0);
        let c = pick(&m, request(2000.0, 512.0, 3), Objective::Latency);
        assert!(
            matches!(c.mode, Route::Live | Route::After(Wire::V2)),
            "{}",
            c.reason
        );
    }

    #[test]
    fn offload_frees_the_laptop_within_its_bound_and_no_further() {
        let m = rates();
        // The phone is 2x slower: after / live keep the answer within 1.5x? after:
        // 2000 + 3686 + 5 + 20440 = 26,131 ms against local's 12,240: over the bound, so
        // offload keeps the answer on the laptop.
        let c = pick(&m, request(2000.0, 512.0, 0), Objective::Offload);
        assert_eq!(c.mode, Route::Local, "{}", c.reason);
        // A phone at 0.9x the laptop: `after` is within the bound and frees the laptop
        // the most.
        let m = near_laptop_phone();
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
        let m = near_laptop_phone();
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
        m.phone_prefill = None;
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
