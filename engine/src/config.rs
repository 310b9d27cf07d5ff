//! How an engine loads its model and sizes its contexts: [`EngineConfig`], the flash-attention
//! policy, and the node flags both nodes share ([`EngineArgs`]), which must agree between them.

use std::path::PathBuf;

/// ggml type id of an f16 tensor (the KV cache type we run with).
pub const GGML_TYPE_F16: u32 = 1;

/// How to load the model and size its context.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_path: PathBuf,
    /// Context size in tokens (prompt + answer).
    pub n_ctx: u32,
    /// Prefill batch size.
    pub n_batch: u32,
    /// Threads for decoding and prefill. Default: physical cores.
    pub n_threads: i32,
    /// Flash attention. Never llama.cpp's own "auto" (which depends on the backend): both
    /// nodes must agree, since it decides whether V is stored transposed in the state.
    pub flash_attn: FlashAttn,
    /// Layers to offload to a GPU (only with the `cuda` feature).
    pub n_gpu_layers: u32,
    /// Sequences served at once: one llama.cpp context (one KV cache of `n_ctx` tokens)
    /// each. Running answers take turns, one decode step each, so a sequence computes
    /// exactly what it would alone (same context shape, same single-token batches) and
    /// answers stay identical to a one-at-a-time run. Not done: batching the sequences'
    /// steps into one `llama_decode`, which would raise a CPU node's throughput but changes
    /// the matrix shapes each token is computed with, so its logits would no longer be
    /// bit-identical to the single-device run's. Extra requests wait for a free slot.
    pub n_parallel: u32,
    /// KV cache element types. Both nodes must run the same (the handshake compares);
    /// a quantized V cache needs flash attention (llama.cpp's rule).
    pub cache_type_k: KvType,
    pub cache_type_v: KvType,
    /// A Jinja chat template read from this file instead of the GGUF's (llama-server's
    /// `--chat-template-file`): for a GGUF that has none, or a wrong one.
    pub chat_template_file: Option<PathBuf>,
    /// The layer split: the model's last layers on a ggml RPC device
    /// ([`crate::rpc::add_server`]); the rest, and the output layer, here.
    pub remote_layers: Option<RemoteLayers>,
    /// Test hook (`--test-pace-live`): a live answer writes a token after its first only
    /// for each snapshot its handoff takes, until the handoff stops it or lets go of it, so
    /// that the switch comes within its first few tokens whatever the machine's speed. It
    /// changes when tokens are written, never which (tests/it `common::StackOptions`).
    pub pace_live: bool,
    /// Each slot computes a short batch and two single-token steps before the engine
    /// reports itself ready (llama-server's warm-up, per context): the first computation
    /// pays the weights' page faults, the compute buffers' first touch and the threads'
    /// start, which a client's first request would otherwise pay and a router would
    /// measure as the node's speed.
    pub warmup: bool,
}

/// The model's last `layers` repeating layers (weights and KV), and its output layer, on
/// ggml device `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteLayers {
    pub device: usize,
    pub layers: u32,
}

impl EngineConfig {
    /// Defaults for `model_path`: 4,096 tokens, batch 512, physical cores, flash attention
    /// [`FlashAttn::Auto`], one sequence at a time, warmed up.
    #[must_use]
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        Self {
            model_path: model_path.into(),
            n_ctx: 4096,
            n_batch: 512,
            n_threads: default_threads(),
            flash_attn: FlashAttn::Auto,
            n_gpu_layers: if cfg!(feature = "cuda") { 999 } else { 0 },
            n_parallel: 1,
            cache_type_k: KvType::F16,
            cache_type_v: KvType::F16,
            chat_template_file: None,
            remote_layers: None,
            pace_live: false,
            warmup: true,
        }
    }
}

/// Flash-attention policy.
///
/// `Auto` is on for every model. A sliding-window model's ring-ordered cache and an
/// imported one would attend in another cell order and round differently, so the engine
/// lays a sliding-window cache out the way an import does after every prefill: both
/// orders are the same, with flash attention on or off (on, prefill was ~10% faster for
/// Gemma-3 at 2,000 tokens and decode about equal).
/// Never llama.cpp's own "auto", which depends on the backend: both nodes must resolve
/// to the same setting, and the handshake checks that they did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttn {
    Auto,
    On,
    Off,
}

impl std::str::FromStr for FlashAttn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(FlashAttn::Auto),
            "on" | "true" => Ok(FlashAttn::On),
            "off" | "false" => Ok(FlashAttn::Off),
            other => Err(format!(
                "flash attention must be auto, on or off, not {other:?}"
            )),
        }
    }
}

/// A KV cache element type. Per 32 values on the wire and in memory: f16 64 bytes, q8_0
/// 34 (0.53x), q4_0 18 (0.28x). Quantizing trades a little quality for fewer bytes to
/// hold and to hand over (docs/BENCHMARKS.md measures both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    F16,
    Q8_0,
    Q4_0,
}

impl KvType {
    /// ggml's type id, as the handshake and the state layout carry it.
    #[must_use]
    pub fn ggml_type(self) -> u32 {
        match self {
            KvType::F16 => GGML_TYPE_F16,
            KvType::Q4_0 => 2,
            KvType::Q8_0 => 8,
        }
    }

    /// The type of ggml's type id `t` (what [`KvType::ggml_type`] gives), if it is one of
    /// these.
    #[must_use]
    pub fn of_ggml_type(t: u32) -> Option<KvType> {
        [KvType::F16, KvType::Q8_0, KvType::Q4_0]
            .into_iter()
            .find(|k| k.ggml_type() == t)
    }

    /// Bytes of a row of `n` values (`n` a multiple of 32 for the quantized types, as
    /// llama.cpp requires of the K and V rows it quantizes).
    #[must_use]
    pub fn row_bytes(self, n: u64) -> u64 {
        match self {
            KvType::F16 => n * 2,
            KvType::Q8_0 => n.div_ceil(32) * 34,
            KvType::Q4_0 => n.div_ceil(32) * 18,
        }
    }

    #[must_use]
    pub fn is_quantized(self) -> bool {
        self != KvType::F16
    }

    pub(crate) fn llama(self) -> llama_cpp_2::context::params::KvCacheType {
        use llama_cpp_2::context::params::KvCacheType;
        match self {
            KvType::F16 => KvCacheType::F16,
            KvType::Q8_0 => KvCacheType::Q8_0,
            KvType::Q4_0 => KvCacheType::Q4_0,
        }
    }
}

impl std::str::FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(KvType::F16),
            "q8_0" => Ok(KvType::Q8_0),
            "q4_0" => Ok(KvType::Q4_0),
            other => Err(format!(
                "KV cache type must be f16, q8_0 or q4_0, not {other:?}"
            )),
        }
    }
}

/// Physical cores: more threads than that made decoding ~4x slower on a 2-core machine
/// (oversubscribed OpenMP spin-waits).
#[must_use]
pub fn default_threads() -> i32 {
    i32::try_from(num_cpus::get_physical().max(1)).unwrap_or(1)
}

/// The engine flags both nodes take. The handoff handshake compares what they decide
/// (model fingerprint, context size, flash attention), so the two nodes must be started
/// with the same values; one definition keeps their names, defaults and help the same.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// GGUF model file (the same file on both nodes: their fingerprints are compared).
    #[arg(long, env = "EDGESPLIT_MODEL")]
    pub model: PathBuf,
    /// Context size in tokens; must be equal on both nodes.
    #[arg(long, default_value_t = 4096)]
    pub n_ctx: u32,
    /// Threads (default: physical cores).
    #[arg(long)]
    pub threads: Option<i32>,
    /// Prefill batch size (a resumed or colocated answer is prefilled in batches of it).
    #[arg(long, default_value_t = 512)]
    pub batch: u32,
    /// Flash attention: auto (on), on, off.
    /// Both nodes must resolve to the same setting (the handoff handshake checks).
    #[arg(long, default_value = "auto")]
    pub flash_attn: FlashAttn,
    /// K cache type: f16, q8_0 (0.53x the bytes) or q4_0 (0.28x). Must be equal on both
    /// nodes (the handoff handshake checks).
    #[arg(long, default_value = "f16")]
    pub cache_type_k: KvType,
    /// V cache type: f16, q8_0 or q4_0; a quantized V cache needs `--flash-attn on`.
    #[arg(long, default_value = "f16")]
    pub cache_type_v: KvType,
    /// A Jinja chat template file used instead of the GGUF's (as llama-server's flag): for
    /// a GGUF without one. Read at start; a file that does not compile refuses chat
    /// requests with a 400 naming the error.
    #[arg(long)]
    pub chat_template_file: Option<PathBuf>,
    /// Test hook, not for use: live answers write a token per handoff snapshot
    /// ([`EngineConfig::pace_live`]).
    #[arg(long, hide = true)]
    pub test_pace_live: bool,
    /// Report ready without the warm-up computation (llama-server's `--no-warmup`;
    /// [`EngineConfig::warmup`]): the first request then pays the cold start.
    #[arg(long)]
    pub no_warmup: bool,
}

impl EngineArgs {
    /// Flags with their defaults for `model`.
    #[must_use]
    pub fn new(model: impl Into<PathBuf>) -> Self {
        EngineArgs {
            model: model.into(),
            n_ctx: 4096,
            threads: None,
            batch: 512,
            flash_attn: FlashAttn::Auto,
            cache_type_k: KvType::F16,
            cache_type_v: KvType::F16,
            chat_template_file: None,
            test_pace_live: false,
            no_warmup: false,
        }
    }

    /// The engine configuration these flags ask for, serving `parallel` sequences.
    #[must_use]
    pub fn config(&self, parallel: u32) -> EngineConfig {
        let mut e = EngineConfig::new(&self.model);
        e.n_ctx = self.n_ctx;
        e.n_batch = self.batch;
        e.flash_attn = self.flash_attn;
        e.n_parallel = parallel;
        e.cache_type_k = self.cache_type_k;
        e.cache_type_v = self.cache_type_v;
        e.chat_template_file.clone_from(&self.chat_template_file);
        e.pace_live = self.test_pace_live;
        e.warmup = !self.no_warmup;
        if let Some(t) = self.threads {
            e.n_threads = t;
        }
        e
    }
}
