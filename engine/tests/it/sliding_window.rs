//! Why a sliding-window cache is laid out after each prefill, shown in llama.cpp itself (no engine in between): after a prompt
//! longer than Gemma-3's 512-token window, the prefilling context holds the window's cells
//! in a ring at indices that depend on the batching and the pruning; a context that imports
//! the exported state lays the same cells out from index 0. With flash attention off,
//! decoding the same next token in both gives logits that differ in the last bits - enough
//! for a sampled token to differ, while greedy decoding often hides it. Laid out the way an
//! import lays it out (exported, cleared, imported: what the engine does after every
//! prefill of a sliding-window model, `Worker::lay_out_as_imported`), the prefilling context
//! computes exactly what the importing one does: logits identical to the bit. With flash
//! attention on, the ring itself computes what the importer does: the vendored ggml sums a
//! decode step's cells in order on one thread, skipping the masked ones, whatever their
//! indices (patches/ggml-cpu-fa-no-split-kv.patch; stock ggml's split-KV path cut the cells
//! at fixed indices and parted from the first step, by up to 1.02).

use std::num::NonZeroU32;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::common::gemma_path;

const BATCH: usize = 512;

/// Decodes `tokens` from position `at` in batches of [`BATCH`], logits for the last one.
fn decode(ctx: &mut LlamaContext<'_>, tokens: &[LlamaToken], at: usize) {
    let mut batch = LlamaBatch::new(BATCH, 1);
    let last_chunk = (tokens.len() - 1) / BATCH;
    for (c, chunk) in tokens.chunks(BATCH).enumerate() {
        batch.clear();
        for (i, t) in chunk.iter().enumerate() {
            let pos = (at + c * BATCH + i) as i32;
            let logits = c == last_chunk && i == chunk.len() - 1;
            batch.add(*t, pos, &[0], logits).unwrap();
        }
        ctx.decode(&mut batch).unwrap();
    }
}

fn export(ctx: &LlamaContext<'_>) -> Vec<u8> {
    let flags = LlamaStateSeqFlags::empty();
    let size = ctx.state_seq_get_size_ext(0, flags);
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds the size llama.cpp reported; nothing runs in between.
    let n = unsafe { ctx.state_seq_get_data_ext(buf.as_mut_ptr(), 0, flags) };
    assert_eq!(n, size);
    buf
}

fn import(ctx: &mut LlamaContext<'_>, state: &[u8]) {
    ctx.clear_kv_cache_seq(Some(0), None, None).unwrap();
    // SAFETY: the state was exported by a context of the same model, build and parameters.
    assert!(unsafe { ctx.state_seq_set_data_ext(state, 0, LlamaStateSeqFlags::empty()) });
}

/// The logits of one decode step of `token` at position `at`.
fn step(ctx: &mut LlamaContext<'_>, token: LlamaToken, at: usize) -> Vec<f32> {
    decode(ctx, &[token], at);
    ctx.get_logits_ith(0).to_vec()
}

/// The fixed tokens decoded after the prompt, one per step.
fn token(i: usize) -> LlamaToken {
    LlamaToken(if i == 0 {
        1000
    } else {
        ((i * 7919) % 20000) as i32 + 100
    })
}

const STEPS: usize = 48;

#[test]
fn a_ring_laid_out_like_an_import_computes_what_the_importer_does() {
    // The process's backend (the engines of the other tests in this binary share it), its
    // log sent to `tracing`, which nothing here prints (thousands of lines).
    let backend = edgesplit_engine::backend();
    let model =
        LlamaModel::load_from_file(backend, gemma_path(), &LlamaModelParams::default()).unwrap();
    // The engine's context settings, with flash attention off and on.
    for flash in [
        llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
    ] {
        let cparams = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(2048))
            .with_n_batch(BATCH as u32)
            .with_n_ubatch(BATCH as u32)
            .with_n_seq_max(1)
            .with_n_threads(2)
            .with_n_threads_batch(2)
            .with_flash_attention_policy(flash);
        // Prompt lengths where the two layouts part within the steps decoded here, measured
        // with this build's settings (`GGML_CPU_REPACK=OFF`, `.cargo/config.toml`, and
        // patches/): flash attention off, 684 and 926 tokens, at steps 29 and 6 (640, 662,
        // 728, 772, 816, 882 and 992 tokens do not part within 64 steps, 1,058 parts at 38;
        // where they part follows the kernels' rounding, so another build parts elsewhere).
        // With it on, 662 tokens, where stock ggml parted from the first step: no part.
        let (lengths, ring_parts): (&[usize], bool) =
            if flash == llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED {
                (&[31, 42], true)
            } else {
                (&[30], false)
            };
        for &reps in lengths {
            eprintln!("flash attention {flash}:");
            check(backend, &model, &cparams, reps, ring_parts);
        }
    }
}

/// `ring_parts`: whether the ring, decoded on as it is, is expected to part from the
/// importer within [`STEPS`] (else: identical at every step).
fn check(
    backend: &LlamaBackend,
    model: &LlamaModel,
    cparams: &LlamaContextParams,
    reps: usize,
    ring_parts: bool,
) {
    let text = "The harbour was quiet in the early morning, and the fishermen were already \
        mending their nets on the stones. "
        .repeat(reps);
    let prompt = model.vocab().tokenize(text.as_bytes(), true, true);
    // Past the window, and not a whole number of batches: the prompt's last batch lands
    // after the first in the ring, and the window prunes the oldest cells.
    assert!(
        prompt.len() > 600 && !prompt.len().is_multiple_of(BATCH),
        "{}",
        prompt.len()
    );
    let n = prompt.len();

    // The prefilling context, as it is after its prefill, and one that imported its state.
    let mut sender = model.new_context(backend, cparams.clone()).unwrap();
    decode(&mut sender, &prompt, 0);
    let state = export(&sender);
    let mut receiver = model.new_context(backend, cparams.clone()).unwrap();
    import(&mut receiver, &state);
    // The same tokens decoded on both, step by step, until their logits part.
    let mut first_diff = None;
    for i in 0..STEPS {
        let a = step(&mut sender, token(i), n + i);
        let b = step(&mut receiver, token(i), n + i);
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        if differ > 0 {
            let worst = a
                .iter()
                .zip(&b)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            eprintln!(
                "prompt {n}: step {i}: {differ} of {} logits differ, by at most {worst:e}",
                a.len()
            );
            first_diff = Some(i);
            break;
        }
    }
    eprintln!("prompt {n}: first differing step {first_diff:?}");
    if ring_parts {
        assert!(
            first_diff.is_some(),
            "the ring and the imported layout computed the same logits: the cause is elsewhere"
        );
    } else {
        assert_eq!(
            first_diff, None,
            "the ring and the imported layout parted: a decode step depends on the cells' indices"
        );
    }

    // The same prefill, laid out as an import lays it out, against a fresh importer: the
    // same logits, to the bit, at every step.
    let mut relaid = model.new_context(backend, cparams.clone()).unwrap();
    decode(&mut relaid, &prompt, 0);
    let mine = export(&relaid);
    assert_eq!(mine, state, "the same prefill exports the same state");
    import(&mut relaid, &mine);
    let mut receiver = model.new_context(backend, cparams.clone()).unwrap();
    import(&mut receiver, &state);
    for i in 0..STEPS {
        let a = step(&mut relaid, token(i), n + i);
        let b = step(&mut receiver, token(i), n + i);
        assert!(
            a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
            "laid out like an import, step {i} still differs from the importer's"
        );
    }
}
