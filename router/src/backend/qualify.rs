//! A joined device's qualification, before it enters the pool (`join.rs`): fixed prompts
//! answered greedily on the prefill node alone and split to the device (`after`, V2), token
//! for token the same, each split written on the device. The splits measure the link
//! (goodput, round trip) and the device's decode speed as any answer does, so a device
//! that qualifies enters the pool with figures.

use super::nodes::lock;
use super::route::{Route, Wire};
use super::{Backend, Event, Node};
use crate::api::{Endpoint, ValidRequest};

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
    /// Answers compared, all identical.
    pub answers: usize,
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
    /// Why it does not qualify: an answer failed, was not written on the device, or parts
    /// from the prefill node's at a token (named).
    pub async fn qualify(&self) -> Result<Qualified, String> {
        for i in 0..PROMPTS.len() {
            let req = request(i);
            let here = self
                .tokens(&req, Route::Local, &format!("qualify-{i}-laptop"))
                .await?;
            let split = self
                .tokens(&req, Route::After(Wire::V2), &format!("qualify-{i}-split"))
                .await?;
            if !split.iter().any(|(_, from)| *from == Node::Decode) {
                return Err(format!(
                    "prompt {i}: the split answer was not written on the device"
                ));
            }
            let ids = |a: &[(i32, Node)]| a.iter().map(|t| t.0).collect::<Vec<_>>();
            let (a, b) = (ids(&here), ids(&split));
            if a != b {
                let k = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
                return Err(format!(
                    "prompt {i}: the device's answer parts from the laptop's at token {k} \
                     (another build, architecture or setting computes differently)"
                ));
            }
        }
        let m = lock(&self.learned).rates.measured();
        Ok(Qualified {
            answers: PROMPTS.len(),
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
