//! One request id is logged by the router, the prefill node and the decode node for one
//! request (it travels in the gRPC requests and in the V2 STATE frame / V1 upload header).

use crate::common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde_json::json;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn one_request_id_in_all_three_services() {
    let capture = Capture::default();
    let writer = capture.clone();
    tracing_subscriber::fmt()
        .json()
        .with_env_filter("info")
        .with_writer(move || writer.clone())
        .init();
    let s = common::start(common::StackOptions::new(common::SMOLLM2));
    for transport in ["v2", "v1"] {
        let (st, _, v) = common::post(
            &format!("{}/v1/chat/completions", s.router),
            &json!({"messages":[{"role":"user","content":"Hello"}],"max_tokens":4,
                    "edgesplit":{"transport": transport}}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let id = v["edgesplit"]["request_id"].as_str().unwrap().to_string();
        let logs = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
        let targets: std::collections::BTreeSet<String> = logs
            .lines()
            .filter(|l| l.contains(&id))
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| {
                v["target"]
                    .as_str()
                    .map(|t| t.split("::").next().unwrap().to_string())
            })
            .collect();
        for crate_name in ["edgesplit_router", "edgesplit_prefill", "edgesplit_decode"] {
            assert!(
                targets.contains(crate_name),
                "{transport}: {id} not logged by {crate_name}: {targets:?}"
            );
        }
    }
}
