//! The baseline: a stock llama.cpp `llama-server` (built by `scripts/stock-llama.sh` from
//! the sources in the llama-cpp-python 0.3.36 sdist) on the same model, context, threads
//! and flash-attention setting, serving the same OpenAI requests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// A running `llama-server`, killed on drop.
pub struct StockServer {
    child: Child,
    pub url: String,
}

impl Drop for StockServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Builds stock llama.cpp if needed (minutes, once) and returns the folder of its binaries.
pub fn build(repo: &Path) -> anyhow::Result<PathBuf> {
    let out = Command::new("bash")
        .arg(repo.join("scripts/stock-llama.sh"))
        .stderr(Stdio::inherit())
        .output()
        .context("running scripts/stock-llama.sh")?;
    anyhow::ensure!(out.status.success(), "scripts/stock-llama.sh failed");
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

impl StockServer {
    /// A stock server with our nodes' settings: context, threads, flash attention and the
    /// KV cache type (`-ctk`/`-ctv`).
    pub async fn start(
        bin: &Path,
        model: &Path,
        n_ctx: u32,
        threads: i32,
        flash_attn: bool,
        cache_type: &str,
    ) -> anyhow::Result<StockServer> {
        Self::start_with(bin, model, n_ctx, threads, flash_attn, cache_type, None).await
    }

    /// [`StockServer::start`], saving and restoring slots in `slot_dir` when given
    /// (`--slot-save-path`: `POST /slots/0?action=save|restore`).
    pub async fn start_with(
        bin: &Path,
        model: &Path,
        n_ctx: u32,
        threads: i32,
        flash_attn: bool,
        cache_type: &str,
        slot_dir: Option<&Path>,
    ) -> anyhow::Result<StockServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut cmd = Command::new(bin.join("llama-server"));
        if let Some(dir) = slot_dir {
            // llama-server joins the file name to this as a string: it needs the slash.
            cmd.arg("--slot-save-path")
                .arg(format!("{}/", dir.display()));
        }
        let child = cmd
            .arg("-m")
            .arg(model)
            .args(["-c", &n_ctx.to_string(), "-t", &threads.to_string()])
            .args(["-np", "1", "-fa", if flash_attn { "on" } else { "off" }])
            .args(["-ctk", cache_type, "-ctv", cache_type])
            .args([
                "--no-webui",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting llama-server")?;
        let server = StockServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let http = reqwest::Client::new();
        let t0 = Instant::now();
        loop {
            let ok = http
                .get(format!("{}/health", server.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(server);
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(120),
                "llama-server did not become healthy in 120 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
