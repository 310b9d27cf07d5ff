//! GPU board power, sampled every 100 ms across a request with `nvidia-smi`, integrated to
//! joules. Where `nvidia-smi` is missing the record says so instead of a number.

use std::process::Stdio;
use std::time::Instant;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// What a request's energy field says when there is no figure.
pub const NOT_AVAILABLE: &str = "not available: no nvidia-smi on this machine";

pub struct Sampler {
    child: Child,
    task: JoinHandle<Vec<(Instant, f64)>>,
}

/// Whether `nvidia-smi` answers here (for the report's header; no sampler is started).
pub fn available() -> bool {
    std::process::Command::new("nvidia-smi")
        .arg("-L")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts sampling, or `None` where there is no `nvidia-smi`.
pub fn start() -> Option<Sampler> {
    let mut child = Command::new("nvidia-smi")
        .args([
            "--query-gpu=power.draw",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .ok()?;
    let out = child.stdout.take()?;
    let task = tokio::spawn(async move {
        let mut lines = BufReader::new(out).lines();
        let mut samples = Vec::new();
        while let Ok(Some(line)) = lines.next_line().await {
            // One line per GPU per sample; the first GPU is the one we run on.
            if let Ok(w) = line.split(',').next().unwrap_or("").trim().parse::<f64>() {
                samples.push((Instant::now(), w));
            }
        }
        samples
    });
    Some(Sampler { child, task })
}

impl Sampler {
    /// Stops and returns joules (trapezoid rule over the samples), or why there are none.
    pub async fn stop(mut self) -> Result<f64, String> {
        let _ = self.child.kill().await;
        let samples = self.task.await.map_err(|e| e.to_string())?;
        edgesplit_bench::energy::integrate(&samples)
            .ok_or_else(|| "not available: fewer than two power samples".into())
    }
}
