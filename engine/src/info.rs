//! Facts about a loaded model: fingerprint, KV bytes per token, build identity, memory.

use std::io::Read;
use std::path::Path;

use llama_cpp_2::model::LlamaModel;
use sha2::{Digest, Sha256};

use crate::{EngineConfig, GGML_TYPE_F16};

/// llama.cpp build identity: the bindings crate pins one llama.cpp commit. Kept in step with
/// the workspace's `=` pin of `llama-cpp-sys-2` (a unit test checks Cargo.lock).
pub const BUILD_ID: &str = "llama-cpp-sys-2 0.1.161";

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
    pub build_id: String,
    pub type_k: u32,
    pub type_v: u32,
    pub flash_attn: bool,
    pub has_chat_template: bool,
    pub n_layer: u32,
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
        // f16 cache: 2 bytes per element.
        let kv_bytes_per_token = u64::from(n_layer) * n_head_kv * (k_len + v_len) * 2;
        let model_id = config
            .model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        ModelInfo {
            model_id,
            fingerprint,
            n_ctx,
            kv_bytes_per_token,
            build_id: BUILD_ID.to_string(),
            type_k: GGML_TYPE_F16,
            type_v: GGML_TYPE_F16,
            flash_attn,
            has_chat_template: model.chat_template(None).is_ok(),
            n_layer,
        }
    }
}

/// Whether the GGUF declares sliding-window attention (`{arch}.attention.sliding_window`).
pub(crate) fn has_sliding_window(model: &LlamaModel) -> bool {
    let arch = model
        .meta_val_str("general.architecture")
        .unwrap_or_default();
    model
        .meta_val_str(&format!("{arch}.attention.sliding_window"))
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|w| w > 0)
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

/// `MemAvailable` from /proc/meminfo (what can be allocated without swapping), not total RAM.
#[must_use]
pub fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
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
    fn build_id_matches_the_locked_bindings() {
        let lock = include_str!("../../Cargo.lock");
        let version = BUILD_ID.rsplit(' ').next().unwrap();
        let needle = format!("name = \"llama-cpp-sys-2\"\nversion = \"{version}\"");
        assert!(lock.contains(&needle), "Cargo.lock does not pin {BUILD_ID}");
    }
}
