//! The last answers the router wrote, typed, newest first, with counts since start: what
//! the dashboard's recent-requests table and status read. Filled by `Metrics::record`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

/// Answers kept for the recent-requests table.
pub const RECENT: usize = 50;

/// How an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Error,
}

/// One answer as the dashboard lists it (and as the metrics count it). A request refused
/// before its first token has only `at`, `status`, `code` and `message`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecentAnswer {
    /// Unix seconds when the answer was created (or refused).
    pub at: u64,
    pub status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<&'static str>,
    /// `stop` or `length` when `status` is ok.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<&'static str>,
    /// The error code when `status` is error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub e2e_ms: Option<f64>,
    pub decode_tokens_per_s: Option<f64>,
    /// Where the time went (flattened: the same names as the `edgesplit` object's).
    #[serde(flatten)]
    pub timing: Timing,
}

/// Where the time went (the `edgesplit` extension object).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Timing {
    pub ttft_ms: Option<f64>,
    pub prefill_ms: Option<f64>,
    /// State bytes sent to the decode node (a cancelled live handoff: before it gave up).
    pub handoff_bytes: Option<u64>,
    pub handoff_ms: Option<f64>,
    pub export_ms: Option<f64>,
    /// Of `handoff_ms` (an `after` handoff): the connect and handshake (V2), and the
    /// sender's hashing of the state.
    pub handoff_connect_ms: Option<f64>,
    pub handoff_hash_ms: Option<f64>,
    /// The decode node: from the state's first byte there to its last, checked; and the
    /// time its check took (hashed as it arrived).
    pub receive_ms: Option<f64>,
    pub verify_ms: Option<f64>,
    pub import_ms: Option<f64>,
    pub decode_ms: Option<f64>,
    pub decode_tokens: u32,
    /// The split failed and the prefill node finished the answer: why.
    pub fallback: Option<String>,
    /// A split answer's handoff mode: `live` or `after`.
    pub handoff_mode: Option<&'static str>,
    /// Live handoff: answer tokens the prefill node wrote (all of them when the answer
    /// ended before the switch).
    pub prefill_tokens: Option<u32>,
    /// Live handoff: milliseconds from the request's arrival to the switch (the decode
    /// node holds the state and takes over).
    pub switch_ms: Option<f64>,
    /// Live handoff: why it gave up, when it did (the answer stayed on the prefill node).
    pub handoff_cancelled: Option<String>,
    /// Which node prefilled the prompt: `prefill_node`, or `decode_node` (it continued a
    /// conversation it held; nothing crossed the link).
    pub placement: Option<&'static str>,
    /// The decode node the answer used (its `--decode-url`): every transport but `local`
    /// and `layers`, whatever part it then took (a fallback says when it took none).
    pub decode_node: Option<String>,
    /// Of the prompt, the tokens whose cached KV was reused (not prefilled).
    pub cached_tokens: Option<u32>,
    /// The node that wrote the answer's first token: `prefill`, or `decode` (it continued
    /// a conversation it held).
    pub first_token_from: Option<&'static str>,
    /// Answer tokens the decode node wrote, as the router received them (whatever ended
    /// the answer: its length, an end of generation, a stop string the router saw).
    pub decode_node_tokens: u32,
    /// The CPU architecture of each node that took part (`x86_64`, `aarch64`), from its
    /// last `Info`: the prefill node's unless the decode node prefilled; the decode node's
    /// when the state crossed (V1, V2) or it continued a conversation (a layer split's
    /// peer need not be the decode node: not reported). They
    /// may differ (PROTOCOL.md, "Compatibility"); then the answer is not bit-identical to
    /// one device's.
    pub prefill_arch: Option<String>,
    pub decode_arch: Option<String>,
    /// The state crossed between the nodes: whether they compute with the same numerics
    /// (architecture and kernels; `Backend::same_numerics`). `true`: the answer is
    /// token-for-token one device's, whatever either node's thread count. `false`: it agrees
    /// up to the first rounding difference that changes a token.
    pub same_numerics: Option<bool>,
    /// `transport: "auto"`: the mode the router chose (`local`, `live`, `after`, `phone`),
    /// under which objective, why (the predictions compared), and the chosen mode's
    /// predicted time to the end of the answer and prefill-node time (`None`: chosen without a
    /// prediction), and the answer tokens it expected (`max_tokens`, else the mean length
    /// of the recent answers that set none). The actual end is `e2e_ms`.
    pub mode: Option<&'static str>,
    pub objective: Option<&'static str>,
    pub reason: Option<String>,
    pub predicted_ms: Option<f64>,
    /// The same answer's actual time from its admission (the router's queue left) to its
    /// end.
    pub actual_ms: Option<f64>,
    pub predicted_prefill_node_ms: Option<f64>,
    pub predicted_tokens: Option<u32>,
}

impl RecentAnswer {
    /// A request that failed before it had an answer (no transport, no tokens).
    #[must_use]
    pub fn refused(at: u64, code: &str, message: &str) -> Self {
        RecentAnswer {
            at,
            status: Status::Error,
            request_id: None,
            transport: None,
            finish_reason: None,
            code: Some(code.to_string()),
            message: Some(message.to_string()),
            prompt_tokens: 0,
            completion_tokens: 0,
            e2e_ms: None,
            decode_tokens_per_s: None,
            timing: Timing::default(),
        }
    }
}

/// The last [`RECENT`] answers, newest first, and counts since start.
#[derive(Default)]
pub struct Recent {
    entries: Mutex<VecDeque<RecentAnswer>>,
    answered: AtomicU64,
    failed: AtomicU64,
}

impl Recent {
    pub fn push(&self, entry: RecentAnswer) {
        match entry.status {
            Status::Ok => self.answered.fetch_add(1, Ordering::Relaxed),
            Status::Error => self.failed.fetch_add(1, Ordering::Relaxed),
        };
        let mut e = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        e.push_front(entry);
        e.truncate(RECENT);
    }

    #[must_use]
    pub fn list(&self) -> Vec<RecentAnswer> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// Answers that ended well since start.
    #[must_use]
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Answers and requests that failed since start.
    #[must_use]
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_keeps_the_newest_and_counts_all() {
        let r = Recent::default();
        for i in 0..(RECENT + 5) {
            let mut a = RecentAnswer::refused(i as u64, "x", "y");
            if i % 5 != 0 {
                a.status = Status::Ok;
            }
            r.push(a);
        }
        let l = r.list();
        assert_eq!(l.len(), RECENT);
        assert_eq!(l[0].at, (RECENT + 4) as u64);
        assert_eq!(r.failed(), 11);
        assert_eq!(r.answered(), (RECENT + 5 - 11) as u64);
    }

    #[test]
    fn a_refusal_serializes_without_answer_fields() {
        let v = serde_json::to_value(RecentAnswer::refused(7, "queue_full", "busy")).unwrap();
        assert_eq!(v["status"], "error");
        assert_eq!(v["code"], "queue_full");
        assert!(v.get("transport").is_none());
        assert!(v.get("finish_reason").is_none());
    }
}
