//! Starting the stack's services as processes: where their binaries are, how each is
//! spawned (its log, secret and memory budget, killed with the bench), the addresses they
//! report, and the guard that kills what a failed start left running.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::link::{Link, Profile};

/// A free loopback port (for ggml's RPC server, which cannot report the one it bound).
pub(crate) fn free_port() -> anyhow::Result<String> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .to_string())
}

/// Where the services' binaries are: next to this executable, or above it when it is a
/// test binary in `target/release/deps`.
pub(crate) fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().context("this executable's folder")?;
    if dir.ends_with("deps") {
        dir = dir.parent().context("above deps")?;
    }
    let p = dir.join(name);
    anyhow::ensure!(
        p.is_file(),
        "{name} is not in {}: run `cargo build --release --bins` first",
        dir.display()
    );
    Ok(p)
}

/// Starts `program` (a binary, or a launcher and its binary) with `args`, logging JSON lines
/// to `log`, with the stack's `secret` and a memory `budget` (`EDGESPLIT_MEM_BUDGET_BYTES`).
/// The services log at `info`, or at the filter `EDGESPLIT_STACK_LOG` holds (for example
/// `info,h2=trace` to follow a connection's frames).
pub(crate) fn spawn(
    program: &[PathBuf],
    args: &[String],
    log: &Path,
    secret: Option<&str>,
    budget: Option<u64>,
) -> anyhow::Result<Child> {
    let file = std::fs::File::create(log)?;
    let mut cmd = Command::new("setpriv");
    cmd.args(["--pdeathsig", "KILL"]).args(program);
    match secret {
        Some(s) => cmd.env("EDGESPLIT_SECRET", s),
        None => cmd.env_remove("EDGESPLIT_SECRET"),
    };
    match budget {
        Some(b) => cmd.env("EDGESPLIT_MEM_BUDGET_BYTES", b.to_string()),
        None => cmd.env_remove("EDGESPLIT_MEM_BUDGET_BYTES"),
    };
    cmd.env_remove("EDGESPLIT_SECRET_FILE")
        .env("EDGESPLIT_LOG_FORMAT", "json")
        .env(
            "RUST_LOG",
            std::env::var("EDGESPLIT_STACK_LOG").unwrap_or_else(|_| "info".into()),
        )
        .args(args)
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .with_context(|| {
            format!(
                "starting {} (through `setpriv`, util-linux)",
                program[0].display()
            )
        })
}

/// The fields of the first JSON line of `log` whose message is `message` (a service that
/// bound port 0 reports the address it got), waiting up to 120 s; an error when `child`
/// (the service, where the caller holds it) exits first.
pub async fn reported(
    log: &Path,
    message: &str,
    mut child: Option<&mut Child>,
) -> anyhow::Result<serde_json::Value> {
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if v["fields"]["message"] == message {
                return Ok(v["fields"].clone());
            }
        }
        if let Some(status) = child.as_mut().map(|c| c.try_wait()).transpose()?.flatten() {
            anyhow::bail!(
                "{} exited ({status}) before it said {message:?}",
                log.display()
            );
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "{} never said {message:?} within 120 s",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A link to be pointed at a reported address, unless `direct`.
pub(crate) async fn unconnected(direct: bool, profile: &Profile) -> std::io::Result<Option<Link>> {
    if direct {
        Ok(None)
    } else {
        Ok(Some(Link::unconnected(profile.clone()).await?))
    }
}

/// A reported address field.
pub(crate) fn field(v: &serde_json::Value, name: &str) -> anyhow::Result<String> {
    v[name]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no {name:?} in {v}"))
}

/// Processes started so far, killed when a later step fails.
pub(crate) struct Guard(pub(crate) Vec<Child>);

impl Guard {
    /// Starts a service ([`spawn`], with its secret and memory budget), keeps it, and
    /// returns what it reports once it says `ready` ([`reported`]).
    pub(crate) async fn start(
        &mut self,
        program: &[PathBuf],
        args: &[String],
        log: &Path,
        ready: &str,
        (secret, budget): (Option<&str>, Option<u64>),
    ) -> anyhow::Result<serde_json::Value> {
        let mut child = spawn(program, args, log, secret, budget)?;
        let r = reported(log, ready, Some(&mut child)).await;
        self.0.push(child);
        r
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service does not outlive the process that started it, even one killed with
    /// SIGKILL (no `Drop` runs): this test runs itself again as that process (the variable
    /// below), which starts a service and prints its pid; the test kills it and watches
    /// the service end (dead, or a zombie waiting for init to reap it).
    #[test]
    fn a_service_ends_with_the_bench_that_started_it() {
        const CHILD: &str = "EDGESPLIT_TEST_PDEATH_LOG";
        if let Some(log) = std::env::var_os(CHILD) {
            let service = spawn(
                &["sleep".into(), "60".into()],
                &[],
                log.as_ref(),
                None,
                None,
            );
            println!("service pid {}", service.unwrap().id());
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        let log = std::env::temp_dir().join(format!("edgesplit-pdeath-{}.log", std::process::id()));
        let mut bench = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "services::tests::a_service_ends_with_the_bench_that_started_it",
            ])
            .args(["--nocapture", "--test-threads", "1"])
            .env(CHILD, &log)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(bench.stdout.take().unwrap());
        let pid = loop {
            let mut line = String::new();
            assert!(
                std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
                "the child test printed no pid"
            );
            // After libtest's "test NAME ... " on the same line.
            if let Some((_, p)) = line.trim().split_once("service pid ") {
                break p.parse::<u32>().unwrap();
            }
        };
        let state = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(") ")?.1.chars().next())
        };
        let alive = |s: Option<char>| !matches!(s, None | Some('Z' | 'X'));
        // Once `setpriv` has become the service (its `prctl` done; a stack's services are
        // used only once they report an address, long after).
        let t0 = Instant::now();
        while std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()
            .as_deref()
            != Some("sleep\n")
        {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "setpriv never ran the service"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            alive(state()),
            "the service runs while its bench does: {:?}",
            state()
        );
        bench.kill().unwrap();
        bench.wait().unwrap();
        let t0 = Instant::now();
        while alive(state()) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the service outlived its bench"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_file(&log);
    }
}
