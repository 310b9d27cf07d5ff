//! A node's `Info` as the router shows it: `/health` (`server.rs`) and the dashboard
//! (`dashboard.rs`) both read it from here.

use serde_json::{json, Value};

use crate::backend::{Failure, NodeState};
use edgesplit_proto::pb::NodeInfo;

/// A prefill node's layer split (`--rpc-peer`) as `/health` and the dashboard
/// show it.
pub(crate) fn layer_split(l: &edgesplit_proto::pb::LayerSplit) -> Value {
    json!({
        "state": l.state,
        "layers_here": l.layers_here,
        "peer_layers": l.peer_layers,
        "peer": l.peer,
        "rpc_round_trips": l.round_trips,
        "rpc_bytes_sent": l.bytes_sent,
        "rpc_bytes_received": l.bytes_received,
        "restarts": l.restarts,
    })
}

/// A KV cache type's flag value (`f16`, `q8_0`, `q4_0`), from ggml's type id (`enum
/// ggml_type`; the router does not link the engine, which names them too).
fn kv_type(t: u32) -> Value {
    match t {
        1 => json!("f16"),
        2 => json!("q4_0"),
        8 => json!("q8_0"),
        other => json!(other),
    }
}

/// A node's `Info` (or why it is not known) as `/health` shows it.
pub(crate) fn health(r: &Result<edgesplit_proto::pb::NodeInfo, Failure>) -> Value {
    match r {
        Ok(i) => {
            let mut v = json!({
            "status": "ok",
            "model_id": i.model_id,
            "model_fingerprint": i.model_fingerprint,
            "build_id": i.build_id,
            "arch": i.arch,
            "kernels": i.kernels,
            "threads": i.threads,
            "n_ctx": i.n_ctx,
            "flash_attn": i.flash_attn,
            "kv_bytes_per_token": i.kv_bytes_per_token,
            "cache_type_k": kv_type(i.type_k),
            "cache_type_v": kv_type(i.type_v),
            "parallel": i.parallel,
            "kv_budget_bytes": i.kv_budget_bytes,
            "mem_available_bytes": i.mem_available_bytes,
            "handoff_addr": i.handoff_addr,
            "handoff_bytes_received": i.handoff_bytes_received,
            "handoffs_received": i.handoffs_received,
            "handoffs_refused": i.handoffs_refused,
            });
            // The prefill node's: how a live handoff sends the prompt's state.
            if !i.stream_prefill.is_empty() {
                v["stream_prefill"] = json!(i.stream_prefill);
            }
            // The prefill node's layer split (`--rpc-peer`).
            if let Some(l) = &i.layer_split {
                v["layer_split"] = layer_split(l);
            }
            v
        }
        Err(e) => json!({"status": "unavailable", "error": e.message}),
    }
}

/// Each decode node as `/health` shows it (its URL, its state in the pool with why, and its
/// `Info`), from the nodes' answers in `--decode-url` order (`silent`: why each is left out
/// after a silence mid-answer, if it is).
pub(crate) fn decode_nodes(
    prefill: &Result<NodeInfo, Failure>,
    decode: &[Result<NodeInfo, Failure>],
    urls: &[String],
    silent: &[Option<String>],
) -> Vec<Value> {
    decode
        .iter()
        .zip(urls)
        .zip(silent)
        .map(|((d, url), silent)| {
            let state = NodeState::of(prefill.as_ref().ok(), d).unless_silent(silent.clone());
            let mut v = health(d);
            v["url"] = json!(url);
            v["state"] = json!(state.as_str());
            if let Some(why) = state.why() {
                v["why"] = json!(why);
            }
            v
        })
        .collect()
}
