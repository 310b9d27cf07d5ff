//! Issue 14 through the engine (its own test binary: llama.cpp's backend initialises once
//! per process, and `sliding_window.rs` drives llama.cpp directly).

mod common;

use common::{collect, continue_imported, gemma_path};

/// The engine end to end: a Gemma-3 prompt past the window, prefilled and exported by one
/// engine and continued by another, samples the same tokens as the colocated run, for
/// several seeds at temperature 1 (the prompt and lengths where the two layouts part
/// early, above). Without the engine's relayout after the prefill this fails: the
/// colocated run decodes from the ring, the importer from index 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_continues_an_imported_window_like_the_colocated_run() {
    use edgesplit_engine::{
        Engine, EngineConfig, Export, Exported, GenEvent, Input, SamplingParams, Start,
    };
    let mut cfg = EngineConfig::new(gemma_path());
    cfg.n_ctx = 2048;
    cfg.n_threads = 2;
    let a = Engine::start(cfg.clone()).await.unwrap();
    let b = Engine::start(cfg).await.unwrap();
    // The default: flash attention on, for sliding-window models too (issue 14).
    assert!(a.info().sliding_window && a.info().flash_attn);
    for reps in [30, 40] {
        let text = "The harbour was quiet in the early morning, and the fishermen were already \
            mending their nets on the stones. "
            .repeat(reps);
        let tokens = a.tokenize(Input::Raw(text)).await.unwrap();
        for seed in 1..=2 {
            let params = SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            };
            let (colocated, _) = collect(
                a.generate(Start::Prompt(tokens.clone()), params.clone(), 64)
                    .await
                    .unwrap(),
            )
            .await;
            let pre = a
                .prefill(tokens.clone(), params.clone(), 64, Export::Raw)
                .await
                .unwrap();
            let Some(Exported::Raw(state)) = pre.state else {
                panic!("state exported")
            };
            let (rest, done) =
                continue_imported(&b, state, &tokens, pre.first.id, &params, 63).await;
            assert!(matches!(done, GenEvent::Done(_)), "{done:?}");
            let mut split = vec![pre.first.id];
            split.extend(rest);
            assert_eq!(
                split,
                colocated,
                "{} prompt tokens, seed {seed}",
                tokens.len()
            );
        }
    }
}
