//! The dashboard in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
//! which scripts/test.sh installs), driven over WebDriver, against the real services: all
//! cards up, a v2 request run from the page, its streamed text equal to the API's answer
//! for the same request, the figures filled in, the request in the recent table. Leaves a
//! screenshot of the page in `target/tmp/dashboard.png` (docs/dashboard.png is one).
//!
//! `EDGESPLIT_DASHBOARD_BENCH_DB=bench/results/bench.sqlite` shows a bench record too.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts chromedriver on a port it picks itself (port 0: none picked by us, freed, and
/// raced for by other tests) and returns it with that port. A chromedriver that exits
/// before it reports its port (seen once on a loaded machine, whatever the cause: the
/// browser is not what is tested here) is started again, at most three times; each such
/// exit is printed with its status and error output.
fn start_chromedriver() -> (Driver, u16) {
    use std::io::{BufRead, Read};
    let mut failures = Vec::new();
    for _ in 0..3 {
        let mut child = Command::new(CHROMEDRIVER)
            .arg("--port=0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromedriver starts");
        let stdout = child.stdout.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        // Drained in the background so that it never blocks on a full pipe.
        let errors = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let mut lines = std::io::BufReader::new(stdout).lines();
        let port = lines.by_ref().map_while(Result::ok).find_map(|l| {
            l.strip_prefix("ChromeDriver was started successfully on port ")?
                .trim_end_matches('.')
                .parse::<u16>()
                .ok()
        });
        if let Some(port) = port {
            std::thread::spawn(move || lines.for_each(drop));
            return (Driver(child), port);
        }
        let status = child.wait().unwrap();
        let failure = format!(
            "chromedriver ended ({status}) before its port: {}",
            errors.join().unwrap()
        );
        eprintln!("{failure}");
        failures.push(failure);
    }
    panic!(
        "chromedriver never reported its port:\n{}",
        failures.join("\n")
    );
}

async fn start_browser() -> (Driver, Client) {
    for p in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            std::path::Path::new(p).exists(),
            "{p} missing: scripts/test.sh installs Debian's chromium and chromium-driver"
        );
    }
    let (driver, port) = start_chromedriver();
    let profile = std::env::temp_dir().join(format!("edgesplit-chromium-{}", std::process::id()));
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,2600",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    let t0 = Instant::now();
    loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(c) => return (driver, c),
            Err(e) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "no WebDriver session: {e}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

async fn js(c: &Client, script: &str) -> Value {
    c.execute(script, vec![]).await.unwrap()
}

/// Polls `script` until it returns `true`.
async fn wait_for(c: &Client, script: &str, what: &str, limit: Duration) {
    let t0 = Instant::now();
    while js(c, script).await != json!(true) {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_runs_a_v2_request_in_a_real_browser() {
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    opts.bench_db = std::env::var_os("EDGESPLIT_DASHBOARD_BENCH_DB").map(Into::into);
    let stack = common::start(opts);
    let (_driver, c) = start_browser().await;

    c.goto(&format!("{}/dashboard", stack.router))
        .await
        .unwrap();
    assert_eq!(c.title().await.unwrap(), "EdgeSplit dashboard");
    wait_for(
        &c,
        "return ['router','prefill','decode','handoff'].every(n => \
         document.getElementById('card-' + n).classList.contains('up'))",
        "all four status cards up",
        Duration::from_secs(20),
    )
    .await;
    // No layer split on this prefill node: the `layers` transport is not offered.
    assert_eq!(
        js(
            &c,
            "const o = document.getElementById('transport-layers'); return o.hidden && o.disabled"
        )
        .await,
        true
    );
    // No API key configured: the page does not ask for one.
    assert_eq!(
        js(
            &c,
            "return getComputedStyle(document.getElementById('key-box')).display"
        )
        .await,
        json!("none")
    );
    let decode_card = js(
        &c,
        "return document.getElementById('card-decode').textContent",
    )
    .await;
    assert!(
        decode_card
            .as_str()
            .unwrap()
            .contains("SmolLM2-135M-Instruct"),
        "{decode_card}"
    );
    assert!(
        decode_card.as_str().unwrap().contains("prefix cache"),
        "the decode node's cache figures: {decode_card}"
    );

    // Fill the form as a user would and run.
    let prompt = "Write one sentence about a phone and a laptop working together.";
    let area = c.find(Locator::Css("#prompt")).await.unwrap();
    area.clear().await.unwrap();
    area.send_keys(prompt).await.unwrap();
    c.find(Locator::Css("#transport"))
        .await
        .unwrap()
        .select_by_value("v2")
        .await
        .unwrap();
    for (id, v) in [("max_tokens", "40"), ("temperature", "0"), ("seed", "7")] {
        let e = c.find(Locator::Id(id)).await.unwrap();
        e.clear().await.unwrap();
        e.send_keys(v).await.unwrap();
    }
    c.find(Locator::Id("run"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(
        &c,
        "return document.getElementById('run-state').textContent.startsWith('done')",
        "the request to finish",
        Duration::from_secs(120),
    )
    .await;
    let shown = js(&c, "return document.getElementById('answer').textContent").await;
    let pieces = js(
        &c,
        "return Number(document.getElementById('answer').dataset.pieces)",
    )
    .await;

    // The same request through the API.
    let body = json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 40, "temperature": 0, "seed": 7,
        "edgesplit": {"transport": "v2"},
    });
    let (status, _, api) =
        common::post(&format!("{}/v1/chat/completions", stack.router), &body).await;
    assert_eq!(status, 200, "{api}");
    let expected = api["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!expected.is_empty());
    assert_eq!(shown.as_str().unwrap(), expected, "page text != API answer");
    assert!(
        pieces.as_u64().unwrap() > 1,
        "the text arrived in {pieces} piece(s): not streamed"
    );

    // The figures of that request.
    let fig = |k: &str| {
        format!("const e = document.querySelector('#figures dd[data-key=\"{k}\"]'); return e ? e.textContent : null")
    };
    assert_eq!(js(&c, &fig("transport")).await, json!("v2"));
    assert_eq!(js(&c, &fig("first_token_from")).await, json!("prefill"));
    assert_eq!(
        js(&c, &fig("completion_tokens")).await,
        json!(api["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
            .to_string())
    );
    for k in [
        "ttft_ms",
        "client_ttft_ms",
        "decode_tokens_per_s",
        "handoff_ms",
    ] {
        let v = js(&c, &fig(k)).await;
        let n: f64 = v
            .as_str()
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("figure {k} is {v}"));
        assert!(n > 0.0, "figure {k} is {v}");
    }
    let bytes = js(&c, &fig("handoff_bytes")).await;
    let (n, unit) = bytes.as_str().unwrap().split_once(' ').unwrap();
    assert!(
        n.parse::<f64>().unwrap() > 0.0 && ["kB", "MB"].contains(&unit),
        "{bytes}"
    );
    let request_id = js(&c, &fig("request_id")).await;
    let request_id = request_id.as_str().unwrap().to_string();
    assert!(request_id.starts_with("req-"));
    let raw = js(&c, "return document.getElementById('raw').textContent").await;
    assert!(raw.as_str().unwrap().contains("\"edgesplit\""));

    // The recent-requests table lists it.
    wait_for(
        &c,
        &format!("return document.getElementById('recent').textContent.includes('{request_id}')"),
        "the request in the recent table",
        Duration::from_secs(10),
    )
    .await;

    // A picture of the page after the request.
    let png = c.screenshot().await.unwrap();
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    std::fs::write(&out, png).unwrap();
    c.close().await.unwrap();
}
