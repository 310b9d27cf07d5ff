//! The dashboard in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
//! which scripts/test.sh installs), driven over WebDriver, against the real services: all
//! cards up, a v2 request run from the page, its streamed text equal to the API's answer
//! for the same request, the figures filled in, the request in the recent table. Leaves a
//! screenshot of the page in `target/tmp/dashboard.png` (docs/dashboard.png is one). And
//! a device joining with a code from the page: the code shown, the device's stages (not
//! announced, failed its qualification, with why) listed, and its removal.
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

/// One browser at a time: each with its services is most of this machine's 2 cores.
static ONE_BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn start_browser(name: &str) -> (Driver, Client) {
    for p in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            std::path::Path::new(p).exists(),
            "{p} missing: scripts/test.sh installs Debian's chromium and chromium-driver"
        );
    }
    let (driver, port) = start_chromedriver();
    let profile =
        std::env::temp_dir().join(format!("edgesplit-chromium-{name}-{}", std::process::id()));
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
    let _one = ONE_BROWSER.lock().await;
    let (_driver, c) = start_browser("request").await;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_pairs_a_device_and_shows_its_stages() {
    use edgesplit_proto::join::{self, Code, Hello, JoinError, Present, Refusal};
    let state = std::env::temp_dir().join(format!("edgesplit-dash-join-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    opts.secret = Some("a-household-secret-for-the-dashboard-test".into());
    opts.join_state_dir = Some(state.clone());
    let stack = common::start(opts);
    let _one = ONE_BROWSER.lock().await;
    let (_driver, c) = start_browser("devices").await;
    c.goto(&format!("{}/dashboard", stack.router))
        .await
        .unwrap();
    let rows = "document.querySelector('#devices tbody').textContent";
    wait_for(
        &c,
        &format!("return {rows}.includes('none joined yet')"),
        "the devices panel",
        Duration::from_secs(20),
    )
    .await;
    c.find(Locator::Id("pair"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(
        &c,
        "return /^[0-9]{3}-[0-9]{4}-[0-9]{4}$/.test(document.getElementById('pair-code').textContent)",
        "the pairing code on the page",
        Duration::from_secs(10),
    )
    .await;
    let code = js(
        &c,
        "return document.getElementById('pair-code').textContent",
    )
    .await;
    let code = code.as_str().unwrap().to_string();
    let hint = js(
        &c,
        "return document.getElementById('pair-command').textContent",
    )
    .await;
    assert_eq!(
        hint,
        json!(format!("edgesplit-decode --join {code} --model MODEL.gguf"))
    );
    let listed = common::get_json(&format!("{}/admin/devices", stack.router)).await;
    assert_eq!(
        listed["pairing"]["nameplate"],
        json!(&code[..3]),
        "{listed}"
    );
    let at = format!("127.0.0.1:{}", listed["join_port"]);

    // A device joins with the code the page shows: listed, not yet announced, and the
    // pairing closed (single-use).
    let mut tcp = tokio::net::TcpStream::connect(&at).await.unwrap();
    let grant = join::join(&mut tcp, &Code::parse(&code).unwrap(), "test-phone")
        .await
        .unwrap();
    wait_for(
        &c,
        &format!(
            "return {rows}.includes('test-phone') && {rows}.includes('not announced') \
             && document.getElementById('pairing').textContent === 'no pairing open'"
        ),
        "the joined device, not announced",
        Duration::from_secs(10),
    )
    .await;
    // It announces a gRPC port where nothing listens, under its own key: its
    // qualification fails, and the page says why.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let key = join::unhex("secret", &grant.secret).unwrap();
    let link = edgesplit_proto::link::Link::new(Some(std::sync::Arc::new(
        edgesplit_proto::auth::Secret::new(&key, "grant").unwrap(),
    )))
    .unwrap();
    let mut tcp = tokio::net::TcpStream::connect(&at).await.unwrap();
    let hello = Hello::Announce {
        v: join::VERSION,
        device: grant.device.clone(),
    };
    join::knock(&mut tcp, &hello).await.unwrap();
    let mut private = link.connect(tcp).await.unwrap();
    let me = Present {
        device: grant.device.clone(),
        port,
        name: "test-phone".into(),
    };
    let url = join::present(&mut private, &me).await.unwrap();
    assert_eq!(url, format!("http://127.0.0.1:{port}"));
    wait_for(
        &c,
        &format!("return {rows}.includes('failed its qualification')"),
        "the failed qualification on the page",
        Duration::from_secs(30),
    )
    .await;
    let why = js(
        &c,
        "return document.querySelector('#devices td.stage-bad').textContent",
    )
    .await;
    assert!(
        why.as_str().unwrap().len() > "failed its qualification: ".len(),
        "{why}"
    );

    // Removed from the page: gone from the list, and its announces refused.
    js(&c, "window.confirm = () => true; return true").await;
    c.find(Locator::Css(&format!(
        "#devices button[data-id='{}']",
        grant.device
    )))
    .await
    .unwrap()
    .click()
    .await
    .unwrap();
    wait_for(
        &c,
        &format!("return {rows}.includes('none joined yet')"),
        "the device removed",
        Duration::from_secs(10),
    )
    .await;
    let listed = common::get_json(&format!("{}/admin/devices", stack.router)).await;
    assert_eq!(listed["devices"], json!([]), "{listed}");
    let mut tcp = tokio::net::TcpStream::connect(&at).await.unwrap();
    match join::knock(&mut tcp, &hello).await {
        Err(JoinError::Refused { reason, .. }) => assert_eq!(reason, Refusal::Revoked),
        other => panic!("{other:?}"),
    }
    c.close().await.unwrap();
    let _ = std::fs::remove_dir_all(&state);
}
