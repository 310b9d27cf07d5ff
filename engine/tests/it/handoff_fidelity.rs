//! Engine-level proof that export -> import into another engine continues exactly like the
//! colocated run (greedy and seeded), on the real default model.

use crate::common::{collect, continue_imported, model_path};
use edgesplit_engine::{
    Engine, EngineConfig, Export, Exported, FlashAttn, GenEvent, Input, KvType, SamplingParams,
    Start,
};

/// Exports a prefilled state from one engine and continues it in another, for greedy and
/// seeded sampling; asserts the tokens equal the colocated run of the first engine with the
/// same settings. Returns the exported state's size.
async fn export_import_equals_colocated(cfg: EngineConfig, ggml_type: u32) -> usize {
    let a = Engine::start(cfg.clone()).await.unwrap();
    let b = Engine::start(cfg).await.unwrap();
    let tokens = a
        .tokenize(Input::chat(vec![(
            "user",
            "Write three sentences about the sea.",
        )]))
        .await
        .unwrap();
    let mut size = 0;
    for params in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 40,
            seed: 42,
            repeat_penalty: 1.1,
            ..SamplingParams::default()
        },
    ] {
        let (colocated, done) = collect(
            a.generate(Start::Prompt(tokens.clone()), params.clone(), 24)
                .await
                .unwrap(),
        )
        .await;
        assert!(matches!(done, GenEvent::Done(_)), "{done:?}");
        assert!(colocated.len() > 1);

        let pre = a
            .prefill(tokens.clone(), params.clone(), 24, Export::Raw)
            .await
            .unwrap();
        assert_eq!(pre.first.id, colocated[0]);
        let Some(Exported::Raw(state)) = pre.state else {
            panic!("state exported")
        };
        size = state.len();
        assert!(state.len() as u64 > tokens.len() as u64 * a.info().kv_bytes_per_token);
        // The V2 descriptors see every layer's K and V (30 layers), covering every token.
        let layout = edgesplit_proto::layout::describe(&state);
        assert_eq!(layout.max_cells, Some(tokens.len() as u64));
        assert_eq!(layout.descriptors.len(), 60);
        assert_eq!(layout.descriptors[0].dtype, ggml_type);
        let (rest, done) = continue_imported(&b, state, &tokens, pre.first.id, &params, 23).await;
        assert!(matches!(done, GenEvent::Done(_)), "{done:?}");
        let mut split = vec![pre.first.id];
        split.extend(rest);
        assert_eq!(split, colocated, "params {params:?}");
    }
    size
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imported_state_continues_like_the_colocated_run() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 1024;
    let info = Engine::start(cfg.clone()).await.unwrap().info().clone();
    assert_eq!(info.kv_bytes_per_token, 23_040);
    // Flash attention resolves to on (V stored untransposed).
    assert!(info.flash_attn);
    export_import_equals_colocated(cfg, edgesplit_engine::GGML_TYPE_F16).await;
}

/// Quantized KV caches (both nodes on the same type): the split answer is still the
/// colocated answer of that type, and the state is as much smaller as the type says
/// (targets: q8_0 <= 0.55x the f16 state, q4_0 <= 0.30x).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_kv_states_continue_identically_and_are_smaller() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 1024;
    cfg.flash_attn = FlashAttn::On;
    let f16 = export_import_equals_colocated(cfg.clone(), edgesplit_engine::GGML_TYPE_F16).await;
    for (kv, max_ratio) in [(KvType::Q8_0, 0.55), (KvType::Q4_0, 0.30)] {
        let mut q = cfg.clone();
        q.cache_type_k = kv;
        q.cache_type_v = kv;
        let bytes = export_import_equals_colocated(q, kv.ggml_type()).await;
        let ratio = bytes as f64 / f16 as f64;
        eprintln!("{kv:?}: state {bytes} bytes, f16 {f16} bytes, ratio {ratio:.3}");
        assert!(
            ratio <= max_ratio,
            "{kv:?}: {bytes} / {f16} bytes = {ratio:.3}"
        );
    }
}

/// A quantized V cache without flash attention is refused at start, with the reason.
#[tokio::test]
async fn a_quantized_v_cache_needs_flash_attention() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 256;
    cfg.flash_attn = FlashAttn::Off;
    cfg.cache_type_v = KvType::Q8_0;
    let Err(e) = Engine::start(cfg).await else {
        panic!("started without flash attention")
    };
    assert!(e.to_string().contains("--flash-attn on"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_state_is_refused_and_the_engine_keeps_working() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 512;
    let e = Engine::start(cfg).await.unwrap();
    let (ids, done) = collect(
        e.generate(
            Start::Imported {
                state: vec![1, 0, 0, 0, 5, 0, 0, 0, 1, 2, 3].into(),
                tokens: vec![1, 2, 3, 4, 5],
                first: 1,
                answered: 1,
                base_digest: None,
            },
            SamplingParams::default(),
            4,
        )
        .await
        .unwrap(),
    )
    .await;
    assert!(ids.is_empty());
    assert!(
        matches!(
            done,
            GenEvent::Error(edgesplit_engine::EngineError::Import(_))
        ),
        "{done:?}"
    );
    let tokens = e.tokenize(Input::Raw("Hello".into())).await.unwrap();
    let (ids, _) = collect(
        e.generate(Start::Prompt(tokens), SamplingParams::default(), 3)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(ids.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_state_is_walked_into_two_sections() {
    let path = model_path().with_file_name("gemma-3-270m-q4_k_m.gguf");
    assert!(
        path.is_file(),
        "{} missing: run scripts/setup.sh --gemma",
        path.display()
    );
    let mut cfg = EngineConfig::new(path);
    cfg.n_ctx = 1024;
    let e = Engine::start(cfg).await.unwrap();
    // Sliding-window attention: flash attention resolves to on too (see `FlashAttn`).
    assert!(e.info().flash_attn);
    let prompt = (0..80)
        .map(|i| format!("line {i} of the log."))
        .collect::<Vec<_>>()
        .join(" ");
    let tokens = e.tokenize(Input::Raw(prompt)).await.unwrap();
    assert!(tokens.len() > 600, "{}", tokens.len());
    let pre = e
        .prefill(tokens.clone(), SamplingParams::default(), 8, Export::Raw)
        .await
        .unwrap();
    let Some(Exported::Raw(state)) = pre.state else {
        panic!("state exported")
    };
    let layout = edgesplit_proto::layout::describe(&state);
    // Full-attention layers keep every token; sliding-window layers keep only the window.
    assert_eq!(layout.max_cells, Some(tokens.len() as u64));
    let sections: std::collections::BTreeSet<_> = layout
        .descriptors
        .iter()
        .map(|d| d.name.split('.').next().unwrap().to_string())
        .collect();
    assert_eq!(sections.len(), 2, "{sections:?}");
    assert_eq!(layout.descriptors.len(), 2 * 18);
    let swa_cells = layout.descriptors.last().unwrap().dims[1];
    assert!(swa_cells < tokens.len() as u64, "{swa_cells}");
}

/// All the positions `score` streams from `from` on, with `prefix` imported.
async fn scored(e: &Engine, tokens: &[i32], from: usize, prefix: Option<Vec<u8>>) -> Vec<Vec<f32>> {
    let mut rx = e.score(tokens.to_vec(), from, prefix).await.unwrap();
    let mut out = Vec::new();
    while let Some(lp) = rx.recv().await {
        out.push(lp.unwrap());
    }
    out
}

/// `score` with the context's exported state imported (how `edgesplit-bench agreement`
/// measures a split across machines) gives the numbers of `score` prefilling the context
/// itself, on one machine: the measurement adds no difference of its own. SmolLM2, and
/// Gemma-3 with a context past its 512-token window. A prefix that is no state, or one
/// that covers every token, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoring_an_imported_context_equals_scoring_a_prefilled_one() {
    let text: String = (0..160)
        .map(|i| format!("Entry {i}: the harbour log notes a ship, the wind and the tide. "))
        .collect();
    for (path, from) in [(model_path(), 40), (crate::common::gemma_path(), 600)] {
        let mut cfg = EngineConfig::new(path);
        cfg.n_ctx = 1024;
        cfg.flash_attn = FlashAttn::On;
        let e = Engine::start(cfg).await.unwrap();
        let all = e.tokenize(Input::Raw(text.clone())).await.unwrap();
        let tokens = all[..from + 70].to_vec();
        let pre = e
            .prefill(
                tokens[..from].to_vec(),
                SamplingParams::default(),
                2,
                Export::Raw,
            )
            .await
            .unwrap();
        let Some(Exported::Raw(state)) = pre.state else {
            panic!("state exported")
        };
        let read = scored(&e, &tokens, from, None).await;
        let imported = scored(&e, &tokens, from, Some(state.clone())).await;
        assert_eq!(read.len(), 70);
        assert!(
            read == imported,
            "the imported context scored other numbers"
        );
        // Bytes that are no state; a state covering every token scored.
        for (tokens, prefix) in [
            (tokens.clone(), vec![1u8, 2, 3]),
            (tokens[..from].to_vec(), state),
        ] {
            let mut rx = e.score(tokens, from, Some(prefix)).await.unwrap();
            let got = rx.recv().await;
            assert!(
                matches!(got, Some(Err(edgesplit_engine::EngineError::Import(_)))),
                "{got:?}"
            );
        }
    }
}
