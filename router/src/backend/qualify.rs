//! A joined device's qualification, before it enters the pool (`join.rs`): fixed prompts
//! answered greedily on the prefill node alone and split to the device (`after`, V2), each
//! split written on the device. A device that computes as the prefill node does (the same
//! architecture and kernels; the build is the handshake's) must answer token for token the
//! same; one that computes otherwise (a phone's ARM kernels against a laptop's x86 ones)
//! cannot, and its agreement is measured and reported instead (the tokens before the
//! answers part). The splits measure the link (goodput, round trip) and the device's
//! decode speed as any answer does, so a device that qualifies enters the pool with
//! figures.

use super::nodes::lock;
use super::route::{Route, Wire};
use super::PrefilledOn;
use super::{Backend, Event, Node};
use crate::api::{Endpoint, Transport, ValidRequest};

/// The qualification's prompts: a short one and one of a few hundred tokens.
const PROMPTS: [&str; 2] = [
    "List three facts about the moon.",
    "A device joins a household's inference service. Before it serves, it answers these \
     sentences the way the laptop would, token for token, so that every split answer it \
     writes later is the laptop's own answer. ",
];
/// Times the second prompt's sentences are repeated.
const LONG_REPEAT: usize = 12;
/// Tokens each qualification answer writes.
const TOKENS: u32 = 12;

/// What a qualification measured.
#[derive(Debug, Clone)]
pub struct Qualified {
    /// Answers compared.
    pub answers: usize,
    /// The device computes as the prefill node does (every answer was then identical).
    pub same_numerics: bool,
    /// Tokens of the answers that agree, before any parting, and tokens compared.
    pub agreeing: usize,
    pub compared: usize,
    /// The link's goodput (bytes per ms) and round trip (ms), as the splits measured.
    pub link: Option<f64>,
    pub rtt_ms: Option<f64>,
}

fn request(i: usize) -> ValidRequest {
    let prompt = if i == 0 {
        PROMPTS[0].to_string()
    } else {
        PROMPTS[1].repeat(LONG_REPEAT)
    };
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "cache_prompt": false,
    });
    // A fixed, valid body: parsing it cannot fail.
    crate::api::parse(Endpoint::Completion, body.to_string().as_bytes(), || 0)
        .unwrap_or_else(|e| unreachable!("the qualification's request: {}", e.message))
}

impl Backend {
    /// Qualifies this pair's decode node.
    ///
    /// # Errors
    /// Why it does not qualify: an answer failed, was not written on the device, or (on a
    /// device that computes as the prefill node does) parts from the prefill node's at a
    /// token (named).
    pub async fn qualify(&self) -> Result<Qualified, String> {
        let (mut agreeing, mut compared) = (0, 0);
        let mut same_numerics = true;
        for i in 0..PROMPTS.len() {
            let req = request(i);
            let here = self
                .tokens(&req, Route::Local, &format!("qualify-{i}-laptop"))
                .await?;
            let split = self
                .tokens(&req, Route::After(Wire::V2), &format!("qualify-{i}-split"))
                .await?;
            // Known once the split asked the device's `Info`.
            same_numerics &=
                self.same_numerics(Transport::V2, PrefilledOn::PrefillNode) != Some(false);
            let (k, n) = judge(i, &here, &split, same_numerics)?;
            agreeing += k;
            compared += n;
        }
        let m = lock(&self.learned).rates.measured();
        Ok(Qualified {
            answers: PROMPTS.len(),
            same_numerics,
            agreeing,
            compared,
            link: m.link,
            rtt_ms: m.rtt_ms,
        })
    }

    /// The token ids of `req`'s answer on `route`, with the node that wrote each.
    async fn tokens(
        &self,
        req: &ValidRequest,
        route: Route,
        id: &str,
    ) -> Result<Vec<(i32, Node)>, String> {
        let mut started = self.run(req, route, id).await.map_err(|f| f.message)?;
        let mut out = Vec::new();
        loop {
            match started.events.recv().await {
                Some(Event::Token {
                    id, from, bytes, ..
                }) if !bytes.is_empty() => out.push((id, from)),
                Some(Event::Finished { .. }) => return Ok(out),
                Some(Event::Error(e)) => return Err(e.message),
                Some(_) => {}
                None => return Err("the answer ended without its end".into()),
            }
        }
    }
}

/// Prompt `i`'s split answer against the prefill node's own `here`: the tokens that agree
/// before any parting, and the tokens compared.
///
/// # Errors
/// The split was not written on the device, or, on a device with the same numerics
/// (`same`), it parts from `here` (where, named).
fn judge(
    i: usize,
    here: &[(i32, Node)],
    split: &[(i32, Node)],
    same: bool,
) -> Result<(usize, usize), String> {
    if !split.iter().any(|(_, from)| *from == Node::Decode) {
        return Err(format!(
            "prompt {i}: the split answer was not written on the device"
        ));
    }
    let k = here
        .iter()
        .zip(split)
        .take_while(|(x, y)| x.0 == y.0)
        .count();
    let n = here.len().max(split.len());
    if k < n && same {
        return Err(format!(
            "prompt {i}: the device's answer parts from the laptop's at token {k}, though \
             both compute alike (same architecture, kernels and build): another setting?"
        ));
    }
    Ok((k, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(ids: &[i32], switch_at: usize) -> Vec<(i32, Node)> {
        ids.iter()
            .enumerate()
            .map(|(k, &t)| {
                (
                    t,
                    if k < switch_at {
                        Node::Prefill
                    } else {
                        Node::Decode
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_device_that_computes_alike_must_answer_alike_another_reports_its_agreement() {
        let here = answer(&[1, 2, 3, 4], 4);
        assert_eq!(judge(0, &here, &answer(&[1, 2, 3, 4], 1), true), Ok((4, 4)));
        let parted = answer(&[1, 2, 9, 9], 1);
        let e = judge(1, &here, &parted, true).unwrap_err();
        assert!(e.contains("prompt 1") && e.contains("at token 2"), "{e}");
        // Another architecture: the parting is its agreement, not a failure.
        assert_eq!(judge(1, &here, &parted, false), Ok((2, 4)));
        // A split never written on the device fails either way.
        for same in [true, false] {
            let e = judge(0, &here, &answer(&[1, 2, 3, 4], 4), same).unwrap_err();
            assert!(e.contains("not written on the device"), "{e}");
        }
    }
}
