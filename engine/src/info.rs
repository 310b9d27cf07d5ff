//! Facts about a loaded model: fingerprint, KV bytes per token, build identity, memory.

use std::io::Read;
use std::path::Path;

use llama_cpp_2::model::LlamaModel;
use sha2::{Digest, Sha256};

use crate::EngineConfig;

/// What a node tells the router and its handoff peer about its model and context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// File stem of the GGUF, served as the OpenAI model id.
    pub model_id: String,
    /// SHA-256 of the GGUF file: changes whenever weights or architecture change.
    pub fingerprint: [u8; 32],
    pub n_ctx: u32,
    /// Bytes of K+V per token, from the GGUF's layer count, KV heads and head sizes.
    pub kv_bytes_per_token: u64,
    /// What a handoff peer must share (`platform::Platform::build_id`).
    pub build_id: String,
    /// The CPU architecture and the kernels this build computes with (may differ between
    /// the nodes; `platform::Platform`).
    pub arch: String,
    pub kernels: String,
    /// The engine's threads (`--threads`). Any count gives the same answer
    /// (patches/ggml-cpu-fa-no-split-kv.patch); reported for speed, not checked.
    pub threads: u32,
    pub type_k: u32,
    pub type_v: u32,
    pub flash_attn: bool,
    /// The model has a chat template of its own (the GGUF's, or `--chat-template-file`);
    /// false: chat requests use llama-server's ChatML fallback.
    pub has_chat_template: bool,
    pub n_layer: u32,
    /// The context length the model was trained for.
    pub n_ctx_train: u32,
    /// Sequences served at once (one context each).
    pub parallel: u32,
    /// The model attends through a sliding window (Gemma-3): its state keeps a ring of the
    /// last window and cannot be cut into pieces (`edgesplit_proto::splice`).
    pub sliding_window: bool,
    /// How the chat template writes tool calls (`tools` are refused unless it is Hermes).
    pub tool_call_format: crate::template::ToolCallFormat,
    /// SHA-256 (hex) of the chat template's source; empty when none compiles.
    pub chat_template_fingerprint: String,
}

impl ModelInfo {
    /// The fingerprint as lowercase hex.
    #[must_use]
    pub fn fingerprint_hex(&self) -> String {
        hex::encode(self.fingerprint)
    }

    pub(crate) fn read(
        model: &LlamaModel,
        config: &EngineConfig,
        fingerprint: [u8; 32],
        n_ctx: u32,
        flash_attn: bool,
    ) -> Self {
        let arch = model
            .meta_val_str("general.architecture")
            .unwrap_or_default();
        let meta_u64 = |key: &str| -> Option<u64> {
            model
                .meta_val_str(&format!("{arch}.{key}"))
                .ok()
                .and_then(|v| v.trim().parse().ok())
        };
        let n_layer = model.n_layer();
        let n_head = u64::from(model.n_head().max(1));
        let n_head_kv = u64::from(model.n_head_kv());
        let head = model.n_embd() as u64 / n_head;
        let k_len = meta_u64("attention.key_length").unwrap_or(head);
        let v_len = meta_u64("attention.value_length").unwrap_or(head);
        // One K row and one V row per layer, of the configured types.
        let kv_bytes_per_token = u64::from(n_layer)
            * (config.cache_type_k.row_bytes(n_head_kv * k_len)
                + config.cache_type_v.row_bytes(n_head_kv * v_len));
        let model_id = config
            .model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let platform = crate::platform::read();
        ModelInfo {
            model_id,
            fingerprint,
            n_ctx,
            kv_bytes_per_token,
            build_id: platform.build_id,
            arch: platform.arch,
            kernels: platform.kernels,
            threads: u32::try_from(config.n_threads.max(1)).unwrap_or(1),
            type_k: config.cache_type_k.ggml_type(),
            type_v: config.cache_type_v.ggml_type(),
            flash_attn,
            has_chat_template: config.chat_template_file.is_some()
                || model.chat_template(None).is_ok(),
            n_layer,
            n_ctx_train: model.n_ctx_train(),
            parallel: config.n_parallel.max(1),
            sliding_window: has_sliding_window(model),
            // Set once the template is compiled.
            tool_call_format: crate::template::ToolCallFormat::None,
            chat_template_fingerprint: String::new(),
        }
    }
}

/// Whether the GGUF declares sliding-window attention (`{arch}.attention.sliding_window`).
pub(crate) fn has_sliding_window(model: &LlamaModel) -> bool {
    sliding_window(model).is_some()
}

/// The GGUF's attention window in positions (`{arch}.attention.sliding_window`), if any.
pub(crate) fn sliding_window(model: &LlamaModel) -> Option<usize> {
    let arch = model
        .meta_val_str("general.architecture")
        .unwrap_or_default();
    model
        .meta_val_str(&format!("{arch}.attention.sliding_window"))
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&w| w > 0)
}

/// SHA-256 of the whole GGUF file (~0.1 s per 100 MB with SHA-NI).
pub(crate) fn fingerprint(path: &Path) -> std::io::Result<[u8; 32]> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

/// How much context fits in memory: what `edgesplit-decode --plan` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    /// `MemAvailable` now (not total RAM: a phone reports 7.6 GB total with 1.8 GB usable).
    pub mem_available: u64,
    /// The GGUF's size: its weights are mapped and count against memory.
    pub model_bytes: u64,
    /// Kept free for compute buffers, the OS and other apps: max(10%, 256 MiB).
    pub margin: u64,
    pub kv_bytes_per_token: u64,
    /// Tokens of KV that fit in what is left.
    pub tokens: u64,
}

impl MemoryPlan {
    /// The plan for these figures.
    #[must_use]
    pub fn new(mem_available: u64, model_bytes: u64, kv_bytes_per_token: u64) -> Self {
        let margin = (mem_available / 10).max(256 << 20);
        let left = mem_available
            .saturating_sub(model_bytes)
            .saturating_sub(margin);
        Self {
            mem_available,
            model_bytes,
            margin,
            kv_bytes_per_token,
            tokens: left / kv_bytes_per_token.max(1),
        }
    }

    /// The KV budget to pass as `--kv-budget-bytes`.
    #[must_use]
    pub fn kv_budget_bytes(&self) -> u64 {
        self.tokens * self.kv_bytes_per_token
    }
}

/// `MemAvailable` from /proc/meminfo (what can be allocated without swapping), not total
/// RAM; at most `EDGESPLIT_MEM_BUDGET_BYTES` when that is set (a device's budget for this
/// service: what `Info`, `--plan` and the layer split's plan count).
#[must_use]
pub fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = parse_mem_available(&text)?;
    let budget = mem_budget_bytes().ok().flatten();
    Some(budget.map_or(available, |b| b.min(available)))
}

/// `EDGESPLIT_MEM_BUDGET_BYTES`, if set (the nodes refuse to start with one that is not
/// a byte count).
///
/// # Errors
/// It is set and is not a byte count.
pub fn mem_budget_bytes() -> Result<Option<u64>, String> {
    match std::env::var("EDGESPLIT_MEM_BUDGET_BYTES") {
        Err(_) => Ok(None),
        Ok(b) => b
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| format!("EDGESPLIT_MEM_BUDGET_BYTES={b:?} is not a count of bytes")),
    }
}

fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_parsed_in_bytes() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   1800000 kB\n";
        assert_eq!(parse_mem_available(t), Some(1_800_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn memory_plan_by_hand() {
        // SmolLM2-135M Q4_1: 98,362,432 bytes of GGUF, 30 layers x 3 KV heads x (64 + 64)
        // x 2 bytes = 23,040 bytes of KV per token. With 1.8 GB available (the phone that
        // was OOM-killed): 10% is 180,000,000, less than 256 MiB = 268,435,456, so the
        // margin is 268,435,456; left = 1,800,000,000 - 98,362,432 - 268,435,456 =
        // 1,433,202,112; tokens = floor(1,433,202,112 / 23,040) = 62,204 (62,204.97).
        let p = MemoryPlan::new(1_800_000_000, 98_362_432, 23_040);
        assert_eq!(p.margin, 268_435_456);
        assert_eq!(p.tokens, 62_204);
        assert_eq!(p.kv_budget_bytes(), 62_204 * 23_040);
        // With 24 GB the 10% margin wins; with less memory than the model, nothing fits.
        assert_eq!(MemoryPlan::new(24_000_000_000, 0, 1).margin, 2_400_000_000);
        assert_eq!(MemoryPlan::new(50_000_000, 98_362_432, 23_040).tokens, 0);
    }
}
