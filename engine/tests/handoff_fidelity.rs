//! Engine-level proof that export -> import into another engine continues exactly like the
//! colocated run (greedy and seeded), on the real default model.

mod common;

use common::model_path;
use edgesplit_engine::{
    Engine, EngineConfig, Export, Exported, GenEvent, Input, SamplingParams, Start,
};

async fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>) -> (Vec<i32>, GenEvent) {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => ids.push(t.id),
            GenEvent::Prefilled { .. } => {}
            other => return (ids, other),
        }
    }
    panic!("generation ended without a final event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imported_state_continues_like_the_colocated_run() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 1024;
    let a = Engine::start(cfg.clone()).await.unwrap();
    let b = Engine::start(cfg).await.unwrap();
    assert_eq!(a.info().kv_bytes_per_token, 23_040);
    // Full attention only: flash attention resolves to on (V stored untransposed).
    assert!(a.info().flash_attn);

    let tokens = a
        .tokenize(Input::Chat(vec![(
            "user".into(),
            "Write three sentences about the sea.".into(),
        )]))
        .await
        .unwrap();
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
        assert!(state.len() > tokens.len() * 23_040);
        // The V2 descriptors see every layer's K and V (30 layers), covering every token.
        let layout = edgesplit_proto::layout::describe(&state);
        assert_eq!(layout.max_cells, Some(tokens.len() as u64));
        assert_eq!(layout.descriptors.len(), 60);
        assert_eq!(layout.descriptors[0].dtype, edgesplit_engine::GGML_TYPE_F16);
        let (rest, done) = collect(
            b.generate(
                Start::Imported {
                    state,
                    tokens: tokens.clone(),
                    first: pre.first.id,
                },
                params.clone(),
                23,
            )
            .await
            .unwrap(),
        )
        .await;
        assert!(matches!(done, GenEvent::Done(_)), "{done:?}");
        let mut split = vec![pre.first.id];
        split.extend(rest);
        assert_eq!(split, colocated, "params {params:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_state_is_refused_and_the_engine_keeps_working() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 512;
    let e = Engine::start(cfg).await.unwrap();
    let (ids, done) = collect(
        e.generate(
            Start::Imported {
                state: vec![1, 0, 0, 0, 5, 0, 0, 0, 1, 2, 3],
                tokens: vec![1, 2, 3, 4, 5],
                first: 1,
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
    // Sliding-window attention: flash attention resolves to off (see `FlashAttn`).
    assert!(!e.info().flash_attn);
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
