//! The sliding-window layout through the engine (its own test binary: llama.cpp's backend initialises once
//! per process, and `sliding_window.rs` drives llama.cpp directly).

use crate::common::{collect, continue_imported, gemma_path};

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
    // The default: flash attention on, for sliding-window models too.
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

/// A live answer on a sliding-window model, handed over from pieces. The first
/// piece is the state laid out right after the prefill, whenever it is asked for; each
/// later one the cells written since; joined, they are the prefill node's cache cell for
/// cell (the window's cells that fell out of attention still in their places), so the
/// answer goes on on the other engine exactly as the uninterrupted one, seeded at
/// temperature 1 (which parts within tens of tokens on another arrangement), flash
/// attention on and off. Batches of 64 make the ring small (llama.cpp: 512 + 64 cells at
/// least), so the last piece comes close to where pieces stop, and past it a piece is
/// refused: the live handoff is then cancelled and the answer stays where it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_window_handed_over_from_pieces_goes_on_identically() {
    use crate::common::read_until;
    use edgesplit_engine::{
        Engine, EngineConfig, FlashAttn, GenEvent, Input, LiveAnswer, Reuse, SamplingParams, Start,
    };
    use edgesplit_proto::splice;
    for flash in [FlashAttn::On, FlashAttn::Off] {
        let mut cfg = EngineConfig::new(gemma_path());
        cfg.n_ctx = 2048;
        cfg.n_threads = 2;
        cfg.n_batch = 64;
        cfg.flash_attn = flash;
        let a = Engine::start(cfg.clone()).await.unwrap();
        let b = Engine::start(cfg).await.unwrap();
        let text = "The harbour was quiet in the early morning, and the fishermen were already \
            mending their nets on the stones. "
            .repeat(30);
        let prompt = a.tokenize(Input::Raw(text)).await.unwrap();
        assert!(prompt.len() > 600, "past the window: {}", prompt.len());
        // The first seed whose uninterrupted answer runs all 96 tokens: which seeds do
        // depends on the build's kernels (seed 3 did until weight repacking was turned
        // off, then ended after 26 tokens), and a short answer ends before its pieces.
        let mut long = None;
        for seed in 1..=16 {
            let params = SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            };
            let (whole, _) = collect(
                a.generate(Start::Prompt(prompt.clone()), params.clone(), 96)
                    .await
                    .unwrap(),
            )
            .await;
            if whole.len() == 96 {
                long = Some((params, whole));
                break;
            }
        }
        let (params, whole) = long.expect("no seed in 1..=16 answers 96 tokens");

        let live_answer = || async {
            a.generate_live(
                Start::Cached {
                    tokens: prompt.clone(),
                    reuse: Reuse::None,
                    max_uncached: None,
                },
                params.clone(),
                96,
            )
            .await
            .unwrap()
        };
        let LiveAnswer {
            events: mut rx,
            live,
            mut pieces,
        } = live_answer().await;
        let mut ids = Vec::new();
        assert!(read_until(&mut rx, &mut ids, 4).await.is_none());
        // Asked for after 4 tokens: still the state right after the prefill.
        let first = live.snapshot(false, 0).await.unwrap().unwrap();
        assert_eq!((first.answered, &first.tokens), (1, &prompt));
        assert_eq!(first.last, whole[0]);
        assert!(
            pieces.recv().await.is_none(),
            "no piece during a window's prefill"
        );
        assert!(read_until(&mut rx, &mut ids, 30).await.is_none());
        let mid = live.snapshot(false, prompt.len()).await.unwrap().unwrap();
        assert!(read_until(&mut rx, &mut ids, 60).await.is_none());
        let last =
            crate::common::hand_over(&live, &mut rx, &mut ids, mid.tokens.len(), &whole).await;
        assert_eq!(
            splice::span(&mid.state).unwrap(),
            prompt.len()..mid.tokens.len()
        );
        let joined = splice::join(&[&first.state, &mid.state, &last.state], Vec::new()).unwrap();
        // The window as it stood after the prefill, and every cell written since.
        assert_eq!(
            splice::narrowest(&joined).unwrap(),
            splice::narrowest(&first.state).unwrap() + last.tokens.len() - prompt.len()
        );
        let rest = crate::common::take_over(&b, joined, &last, &params, 96).await;
        assert_eq!(
            [ids, rest].concat(),
            whole,
            "flash {flash:?}: the handed-over answer differs"
        );

        // Past the ring's room (64 positions here) no piece is cut; the answer goes on.
        let LiveAnswer {
            events: mut rx,
            live,
            ..
        } = live_answer().await;
        let mut ids = Vec::new();
        let first = live.snapshot(false, 0).await.unwrap().unwrap();
        assert!(read_until(&mut rx, &mut ids, 70).await.is_none());
        let refused = live.snapshot(true, first.tokens.len()).await.unwrap();
        assert!(refused.is_err(), "a piece past the ring's room was cut");
        assert!(
            live.snapshot(false, 0).await.unwrap().is_err(),
            "the first piece twice"
        );
        let end = read_until(&mut rx, &mut ids, usize::MAX).await;
        assert!(matches!(end, Some(GenEvent::Done(_))), "{end:?}");
        assert_eq!(ids, whole, "the answer that kept its piece");
    }
}
