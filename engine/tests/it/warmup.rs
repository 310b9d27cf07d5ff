//! The warm-up at start (`EngineConfig::warmup`) leaves nothing behind: a warmed-up
//! engine's answer and exported state are those of an engine that computed nothing before,
//! and its prefix cache holds nothing.

use crate::common::{collect, model_path};

use edgesplit_engine::{Engine, EngineConfig, Export, Exported, Input, SamplingParams, Start};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warmed_up_engine_answers_as_a_cold_one() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 512;
    cfg.n_parallel = 2;
    assert!(cfg.warmup, "on by default");
    let warm = Engine::start(cfg.clone()).await.unwrap();
    cfg.warmup = false;
    let cold = Engine::start(cfg).await.unwrap();
    let stats = warm.cache_stats();
    assert_eq!((stats.cached_tokens, stats.hits, stats.misses), (0, 0, 0));

    let chat = Input::chat(vec![("user", "Name three rivers and a fact about each.")]);
    let prompt = cold.tokenize(chat).await.unwrap();
    let mut answers = Vec::new();
    let mut states = Vec::new();
    for engine in [&warm, &cold] {
        let (ids, _) = collect(
            engine
                .generate(Start::Prompt(prompt.clone()), SamplingParams::default(), 32)
                .await
                .unwrap(),
        )
        .await;
        answers.push(ids);
        let pre = engine
            .prefill(prompt.clone(), SamplingParams::default(), 8, Export::Raw)
            .await
            .unwrap();
        let Some(Exported::Raw(state)) = pre.state else {
            panic!("state exported")
        };
        states.push(state);
    }
    assert_eq!(answers[0].len(), 32);
    assert_eq!(answers[0], answers[1]);
    assert!(states[0] == states[1], "the exported states differ");
}
