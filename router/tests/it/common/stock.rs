//! A stock llama.cpp `llama-server`, built from the llama.cpp sources in the
//! llama-cpp-python 0.3.36 sdist (`scripts/stock-llama.sh`, cached under `.build/`): the
//! server our users come from, run beside ours to compare with.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running stock server, killed on drop.
pub struct StockServer {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

impl Drop for StockServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The folder with the stock binaries, built on first use.
fn stock_bin() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/stock-llama.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("bash runs");
    assert!(out.status.success(), "building stock llama.cpp failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A fresh empty folder under the temp dir, named for `name` and this process.
pub fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("edgesplit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

impl StockServer {
    /// Starts `llama-server` on `model` (2,048 tokens, 2 threads, one slot, flash attention
    /// on, as our nodes) with `extra` arguments, and waits until it is healthy. Port 0:
    /// llama-server binds a free port itself and logs it (no port picked by us, freed, and
    /// raced for by other tests).
    pub async fn start(name: &str, model: &Path, extra: &[&str]) -> StockServer {
        let bin = tokio::task::spawn_blocking(stock_bin).await.unwrap();
        let log_path = tempdir(&format!("{name}-log")).join("llama-server.log");
        let child = Command::new(bin.join("llama-server"))
            .args(["-m", model.to_str().unwrap()])
            .args([
                "-c",
                "2048",
                "-t",
                "2",
                "-np",
                "1",
                "-fa",
                "on",
                "--no-webui",
            ])
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .expect("llama-server starts");
        let mut server = StockServer {
            child,
            base: String::new(),
        };
        let t0 = Instant::now();
        server.base = loop {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            if let Some(url) = log
                .lines()
                .find_map(|l| l.split("listening on ").nth(1))
                .map(str::trim)
            {
                break url.trim_end_matches('/').to_string();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "llama-server did not report its address:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let http = super::client();
        let t0 = Instant::now();
        while http
            .get(format!("{}/health", server.base))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .ok()
            != Some(200)
        {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "llama-server did not become healthy"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        server
    }
}
