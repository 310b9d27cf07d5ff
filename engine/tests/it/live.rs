//! Engine-level proof of the live handoff's pieces on the real default model: the states
//! sent while the prompt is prefilled (one per batch but the last) and a live answer's
//! snapshots, taken between steps while it goes on, cut and join
//! (`edgesplit_proto::splice`) to exactly the state exported at the later boundary, with V
//! stored plain (flash attention on) and transposed (off); and an answer handed over at a
//! boundary and imported by another engine from the joined pieces goes on exactly as the
//! uninterrupted answer, seeded with a frequency penalty.

use crate::common::{hand_over, model_path, read_until, take_over};
use edgesplit_engine::{
    Engine, EngineConfig, FlashAttn, GenEvent, Input, Reuse, SamplingParams, Snapshot, Start,
};
use edgesplit_proto::splice;

/// The history a snapshot must hold: the prompt and the answer but its newest token.
fn check(s: &Snapshot, prompt: &[i32], answer: &[i32]) {
    let n = s.answered as usize;
    assert!(n >= 1 && n <= answer.len(), "answered {n}");
    assert_eq!(s.tokens, [prompt, &answer[..n - 1]].concat());
    assert_eq!(s.last, answer[n - 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_join_to_the_later_state_and_the_handover_goes_on_identically() {
    for flash in [FlashAttn::On, FlashAttn::Off] {
        let mut cfg = EngineConfig::new(model_path());
        cfg.n_ctx = 512;
        // Batches of 8: the prompt is prefilled in several, each a piece.
        cfg.n_batch = 8;
        cfg.flash_attn = flash;
        let a = Engine::start(cfg.clone()).await.unwrap();
        let b = Engine::start(cfg).await.unwrap();
        let prompt = a
            .tokenize(Input::chat(vec![(
                "user",
                "Write three sentences about the sea.",
            )]))
            .await
            .unwrap();
        let params = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 40,
            seed: 7,
            frequency_penalty: 0.4,
            ..SamplingParams::default()
        };
        let mut whole = Vec::new();
        let mut rx = a
            .generate(Start::Prompt(prompt.clone()), params.clone(), 24)
            .await
            .unwrap();
        let end = read_until(&mut rx, &mut whole, usize::MAX).await;
        assert!(matches!(end, Some(GenEvent::Done(_))), "{end:?}");
        assert!(whole.len() >= 16, "the answer ended early: {whole:?}");

        let edgesplit_engine::LiveAnswer {
            events: mut rx,
            live,
            mut pieces,
        } = a
            // Not from the prefix the first run left in the cache: the prefill's pieces
            // are what this test reads.
            .generate_live(
                Start::Cached {
                    tokens: prompt.clone(),
                    reuse: Reuse::None,
                    max_uncached: None,
                },
                params.clone(),
                24,
            )
            .await
            .unwrap();
        let mut ids = Vec::new();
        // The whole state, then the cells since each previous snapshot.
        let first = live.snapshot(false, 0).await.unwrap().unwrap();
        assert!(read_until(&mut rx, &mut ids, 6).await.is_none());
        let mid = live
            .snapshot(false, first.tokens.len())
            .await
            .unwrap()
            .unwrap();
        assert!(read_until(&mut rx, &mut ids, 11).await.is_none());
        // Nothing after the boundary was emitted, and what was is the uninterrupted answer.
        let last = hand_over(&live, &mut rx, &mut ids, mid.tokens.len(), &whole).await;
        for s in [&first, &mid, &last] {
            check(s, &prompt, &whole);
        }
        assert!(first.answered < mid.answered && mid.answered < last.answered);
        assert!(
            live.snapshot(false, 0).await.is_none(),
            "the answer is over"
        );

        // The prefill's pieces: the prompt's first batches, growing by one batch each;
        // joined, and with the rest of the prompt cut from the first snapshot, they are
        // that snapshot's state.
        let mut prefill = Vec::new();
        while let Some(p) = pieces.recv().await {
            prefill.push(p);
        }
        let batches = prompt.len().div_ceil(8);
        assert_eq!(
            prefill.len(),
            batches - 1,
            "one piece per batch but the last"
        );
        let mut joined = prefill[0].state.clone();
        for (i, p) in prefill.iter().enumerate() {
            assert_eq!(p.tokens, prompt[..8 * (i + 1)]);
            assert_eq!(p.answered, 0);
            // Each piece holds the cells since the previous one, cut on the engine thread.
            assert_eq!(p.from, 8 * i);
            assert_eq!(splice::span(&p.state).unwrap(), 8 * i..8 * (i + 1));
            if i > 0 {
                joined = splice::append(&joined, &p.state).unwrap();
            }
        }
        let rest = splice::tail(&first.state, prefill.last().unwrap().tokens.len()).unwrap();
        joined = splice::append(&joined, &rest).unwrap();
        assert!(
            joined == first.state,
            "flash {flash:?}: the prefill's pieces differ"
        );

        // The prompt's state, then two deltas, each exactly the cells since the previous.
        assert_eq!(
            splice::span(&mid.state).unwrap(),
            first.tokens.len()..mid.tokens.len()
        );
        assert_eq!(
            splice::span(&last.state).unwrap(),
            mid.tokens.len()..last.tokens.len()
        );
        assert!(last.state.len() < first.state.len(), "a delta is not small");
        let joined = splice::append(&first.state, &mid.state).unwrap();
        let joined = splice::append(&joined, &last.state).unwrap();
        assert_eq!(splice::span(&joined).unwrap(), 0..last.tokens.len());

        // Another engine takes over from the joined state: the uninterrupted answer.
        let rest = take_over(&b, joined, &last, &params, 24).await;
        assert_eq!(
            [ids, rest].concat(),
            whole,
            "flash {flash:?}: the handed-over answer differs"
        );
    }
}
