//! The layer split's plan: how many of a model's last layers go to the peer,
//! from what each side has available now (`MemAvailable`, never total RAM: the seed
//! project's phone reported 7.6 GB total with 1.9 GB usable, got 4.9 GB of weights, and
//! Android killed it) and what each layer really takes (its tensors' sizes as stored in
//! the GGUF, an expert layer at its full size, plus its KV for the context), with a
//! reserve on each side for compute buffers and the system. Read before anything is
//! loaded; a plan that does not fit is refused with its numbers.

use std::ffi::{CStr, CString};
use std::path::Path;

use llama_cpp_sys_2 as sys;

use crate::config::KvType;

/// What a model's layers take, from its GGUF.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLayers {
    /// Bytes of each repeating layer's tensors (`blk.N.*`), in layer order.
    pub layers: Vec<u64>,
    /// The input side: token embeddings and whatever else is not a layer or the output
    /// (llama.cpp keeps it on the CPU, here).
    pub input: u64,
    /// The output layer: its norm and head (a model whose head is tied to the token
    /// embeddings gets a copy of them), which goes with the last layers.
    pub output: u64,
    /// K elements per token of one layer (`n_head_kv x key_length`).
    pub k_per_token: u64,
    /// V elements per token of one layer (`n_head_kv x value_length`).
    pub v_per_token: u64,
}

/// Reads a GGUF's tensor sizes and attention shape without loading its weights.
///
/// # Errors
/// The file is not a GGUF llama.cpp reads, or lacks the attention shape.
pub fn model_layers(path: &Path) -> Result<ModelLayers, String> {
    let cpath = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: bad path", path.display()))?;
    let params = sys::gguf_init_params {
        no_alloc: true,
        ctx: std::ptr::null_mut(),
    };
    let ctx = unsafe { sys::gguf_init_from_file(cpath.as_ptr(), params) };
    if ctx.is_null() {
        return Err(format!(
            "{}: not a GGUF file llama.cpp reads",
            path.display()
        ));
    }
    struct Free(*mut sys::gguf_context);
    impl Drop for Free {
        fn drop(&mut self) {
            unsafe { sys::gguf_free(self.0) };
        }
    }
    let _free = Free(ctx);
    let str_of = |key: &str| -> Option<String> {
        let k = CString::new(key).ok()?;
        let id = unsafe { sys::gguf_find_key(ctx, k.as_ptr()) };
        if id < 0 || unsafe { sys::gguf_get_kv_type(ctx, id) } != sys::GGUF_TYPE_STRING {
            return None;
        }
        let s = unsafe { CStr::from_ptr(sys::gguf_get_val_str(ctx, id)) };
        Some(s.to_string_lossy().into_owned())
    };
    let u32_of = |key: &str| -> Option<u64> {
        let k = CString::new(key).ok()?;
        let id = unsafe { sys::gguf_find_key(ctx, k.as_ptr()) };
        if id < 0 || unsafe { sys::gguf_get_kv_type(ctx, id) } != sys::GGUF_TYPE_UINT32 {
            return None;
        }
        Some(u64::from(unsafe { sys::gguf_get_val_u32(ctx, id) }))
    };
    let arch = str_of("general.architecture").ok_or("no general.architecture")?;
    let missing = |k: &str| format!("{}: no {arch}.{k}", path.display());
    let n_layer = u32_of(&format!("{arch}.block_count")).ok_or_else(|| missing("block_count"))?;
    let n_head = u32_of(&format!("{arch}.attention.head_count"))
        .ok_or_else(|| missing("attention.head_count"))?;
    let n_head_kv = u32_of(&format!("{arch}.attention.head_count_kv")).unwrap_or(n_head);
    let n_embd =
        u32_of(&format!("{arch}.embedding_length")).ok_or_else(|| missing("embedding_length"))?;
    let head = n_embd / n_head.max(1);
    let k = u32_of(&format!("{arch}.attention.key_length")).unwrap_or(head);
    let v = u32_of(&format!("{arch}.attention.value_length")).unwrap_or(head);
    let mut layers = vec![0u64; usize::try_from(n_layer).map_err(|e| e.to_string())?];
    let (mut input, mut output, mut embeddings, mut head) = (0u64, 0u64, 0u64, None);
    for i in 0..unsafe { sys::gguf_get_n_tensors(ctx) } {
        let name = unsafe { CStr::from_ptr(sys::gguf_get_tensor_name(ctx, i)) }.to_string_lossy();
        let size = unsafe { sys::gguf_get_tensor_size(ctx, i) } as u64;
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        if let Some(bytes) = layer.and_then(|l| layers.get_mut(l)) {
            *bytes += size;
            continue;
        }
        match &*name {
            "output.weight" => head = Some(size),
            n if n.starts_with("output") => output += size,
            n => {
                if n == "token_embd.weight" {
                    embeddings = size;
                }
                input += size;
            }
        }
    }
    Ok(ModelLayers {
        layers,
        input,
        output: output + head.unwrap_or(embeddings),
        k_per_token: n_head_kv * k,
        v_per_token: n_head_kv * v,
    })
}

/// What one side holds under a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Side {
    /// `MemAvailable` when planned.
    pub available: u64,
    pub weights: u64,
    pub kv: u64,
    /// Kept free for compute buffers, the OS and other apps: max(10%, 256 MiB).
    pub reserve: u64,
}

impl Side {
    fn new(available: u64, weights: u64, kv: u64) -> Self {
        Side {
            available,
            weights,
            kv,
            reserve: (available / 10).max(256 << 20),
        }
    }

    #[must_use]
    pub fn needed(&self) -> u64 {
        self.weights + self.kv + self.reserve
    }

    #[must_use]
    pub fn fits(&self) -> bool {
        self.needed() <= self.available
    }
}

/// The split: the last `peer_layers` layers, and the output layer with them, on the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlan {
    pub n_layer: u32,
    pub peer_layers: u32,
    pub here: Side,
    pub peer: Side,
}

impl std::fmt::Display for LayerPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / f64::from(1 << 20);
        let side = |f: &mut std::fmt::Formatter<'_>, name: &str, s: &Side| {
            if s.available == u64::MAX {
                return writeln!(
                    f,
                    "  {name}: {:.0} MiB of weights + {:.0} KV (its available memory unknown)",
                    mib(s.weights),
                    mib(s.kv)
                );
            }
            writeln!(
                f,
                "  {name}: {:.0} MiB needed ({:.0} weights + {:.0} KV + {:.0} reserve) of {:.0} MiB available{}",
                mib(s.needed()),
                mib(s.weights),
                mib(s.kv),
                mib(s.reserve),
                mib(s.available),
                if s.fits() { "" } else { ": does not fit" }
            )
        };
        writeln!(
            f,
            "layer split: {} of {} layers here, the last {} and the output layer on the peer",
            self.n_layer - self.peer_layers,
            self.n_layer,
            self.peer_layers
        )?;
        side(f, "here", &self.here)?;
        side(f, "peer", &self.peer)
    }
}

impl LayerPlan {
    /// The plan with the last `peer_layers` layers on the peer, each layer's KV for
    /// `kv_cells` cells of the cache types `kv` (K, V).
    #[must_use]
    pub fn with(
        model: &ModelLayers,
        peer_layers: u32,
        kv_cells: u64,
        kv: (KvType, KvType),
        here_available: u64,
        peer_available: u64,
    ) -> Self {
        let n_layer = u32::try_from(model.layers.len()).unwrap_or(u32::MAX);
        let peer_layers = peer_layers.min(n_layer);
        let cut = (n_layer - peer_layers) as usize;
        let kv_layer =
            (kv.0.row_bytes(model.k_per_token) + kv.1.row_bytes(model.v_per_token)) * kv_cells;
        // The output layer goes with the last layers (llama.cpp offloads it first).
        let output_there = if peer_layers > 0 { model.output } else { 0 };
        let here_w: u64 =
            model.layers[..cut].iter().sum::<u64>() + model.input + model.output - output_there;
        let peer_w: u64 = model.layers[cut..].iter().sum::<u64>() + output_there;
        LayerPlan {
            n_layer,
            peer_layers,
            here: Side::new(here_available, here_w, kv_layer * cut as u64),
            peer: Side::new(peer_available, peer_w, kv_layer * u64::from(peer_layers)),
        }
    }

    /// Whether both sides fit.
    #[must_use]
    pub fn fits(&self) -> bool {
        self.here.fits() && self.peer.fits()
    }

    /// The fewest layers on the peer with which both sides fit (each split layer costs a
    /// round trip of the link per token, so no more than needed; 0 when this side holds
    /// the model alone).
    ///
    /// # Errors
    /// No split fits: the closest one's numbers.
    pub fn fewest(
        model: &ModelLayers,
        kv_cells: u64,
        kv: (KvType, KvType),
        here_available: u64,
        peer_available: u64,
    ) -> Result<Self, String> {
        let n = u32::try_from(model.layers.len()).unwrap_or(u32::MAX);
        let plans: Vec<LayerPlan> = (0..=n)
            .map(|p| Self::with(model, p, kv_cells, kv, here_available, peer_available))
            .collect();
        if let Some(p) = plans.iter().find(|p| p.fits()) {
            return Ok(p.clone());
        }
        // The first plan that fits here (the peer's side is then the smallest it can be).
        let closest = plans
            .iter()
            .find(|p| p.here.fits())
            .unwrap_or(&plans[plans.len() - 1]);
        Err(format!(
            "the model does not fit on both devices:\n{closest}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F16: (KvType, KvType) = (KvType::F16, KvType::F16);

    fn model() -> ModelLayers {
        ModelLayers {
            layers: vec![100 << 20; 10],
            input: 30 << 20,
            output: 20 << 20,
            k_per_token: 256,
            v_per_token: 256,
        }
    }

    /// The fewest layers that fit go to the peer; none when this side holds it all; a
    /// plan that fits nowhere is refused with both sides' numbers.
    #[test]
    fn the_fewest_layers_that_fit_go_to_the_peer() {
        let gib = 1u64 << 30;
        // Here: 1 GiB available, 256 MiB reserve: 768 MiB for 50 MiB + layers (+ KV).
        let p = LayerPlan::fewest(&model(), 1024, F16, gib, 4 * gib).unwrap();
        assert_eq!(p.peer_layers, 3, "{p}");
        assert!(p.fits());
        let alone = LayerPlan::fewest(&model(), 1024, F16, 4 * gib, gib).unwrap();
        assert_eq!(alone.peer_layers, 0);
        let e = LayerPlan::fewest(&model(), 1024, F16, gib, gib / 2).unwrap_err();
        assert!(
            e.contains("does not fit") && e.contains("MiB available"),
            "{e}"
        );
        // KV counts: each layer's 1024 cells x 512 elements x 2 bytes = 1 MiB.
        let p = LayerPlan::with(&model(), 3, 1024, F16, gib, gib);
        assert_eq!((p.here.kv, p.peer.kv), (7 << 20, 3 << 20));
        assert_eq!(
            p.peer.weights,
            (300 << 20) + (20 << 20),
            "the output layer goes too"
        );
        assert_eq!(p.here.weights, (700 << 20) + (30 << 20));
        assert_eq!(alone.here.weights, (1000 << 20) + (50 << 20));
    }
}
