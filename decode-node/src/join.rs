//! The device's side of joining a router with a code (`--join CODE`;
//! `edgesplit_proto::join`), and of coming back to it.
//!
//! A join finds the router on the LAN (a broadcast; `--router` skips it), proves the code,
//! and writes what it received to `--join-dir`: `secret` (this device's own link key,
//! derived by the router from the household's secret; the node's `--secret-file` from
//! then on) and `router.json` (the router's id, this device's id, the
//! router's last join address), each mode 0600 in a directory of mode 0700. A node started
//! later without `--join` and without a secret of its own finds that directory and serves
//! as the joined device it is. A joined node listens on every interface (a loopback listen
//! address becomes `0.0.0.0` with the same port) and announces itself to the router every
//! `--announce-every-s`; when the router is not where it was, it is found again by its id,
//! so either side's address may change.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use edgesplit_proto::join::{self, Code, Hello, JoinError, Refusal};
use edgesplit_proto::link::Link;
use serde::{Deserialize, Serialize};

/// How long a join looks for the router on the LAN.
const FIND_WITHIN: Duration = Duration::from_secs(30);
/// How long an announce looks for a router that moved, each time.
const REFIND_WITHIN: Duration = Duration::from_secs(5);
/// Connecting to the router's join port.
const CONNECT_TIME: Duration = Duration::from_secs(5);
/// A whole join or announce exchange.
const EXCHANGE_TIME: Duration = Duration::from_secs(20);

/// What a joined device remembers of its router (`router.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Joined {
    pub router: String,
    pub device: String,
    /// The router's join address when last reached.
    pub join_addr: SocketAddr,
    /// The prefill node's settings as the router last gave them (used when the router
    /// does not answer at a start).
    #[serde(default)]
    pub settings: Option<join::Settings>,
}

/// The flags of joining (`Default`: no join, as a node started in-process by a test).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct JoinArgs {
    /// Join a router with the code it shows (`--pair` or `POST /admin/pairing` there):
    /// the router is found on the LAN, this device's own link key received and kept in
    /// `--join-dir`.
    #[arg(long, env = "EDGESPLIT_JOIN_CODE")]
    pub join: Option<String>,
    /// The router's join address (host:port of its `--join-listen`), instead of looking
    /// for it with a broadcast.
    #[arg(long)]
    pub router: Option<SocketAddr>,
    /// Where a joined device keeps its link key and its router's identity. Default:
    /// `~/.config/edgesplit/joined`.
    #[arg(long, env = "EDGESPLIT_JOIN_DIR")]
    pub join_dir: Option<PathBuf>,
    /// The UDP port routers answer on.
    #[arg(long, default_value_t = join::DISCOVERY_PORT)]
    pub discovery_port: u16,
    /// The name the router shows for this device. Default: the host name.
    #[arg(long)]
    pub name: Option<String>,
    /// Seconds between a joined node's announces to its router.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub announce_every_s: u64,
}

impl JoinArgs {
    #[must_use]
    pub fn dir(&self) -> PathBuf {
        self.join_dir.clone().unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
            PathBuf::from(home).join(".config/edgesplit/joined")
        })
    }

    fn name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "device".into())
        })
    }

    fn targets(&self) -> Vec<IpAddr> {
        join::broadcast_addrs()
            .into_iter()
            .map(IpAddr::V4)
            .collect()
    }

    /// The joined state in [`JoinArgs::dir`], if this device has joined a router.
    ///
    /// # Errors
    /// A `router.json` that cannot be read.
    pub fn joined(&self) -> anyhow::Result<Option<Joined>> {
        let path = self.dir().join("router.json");
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(serde_json::from_slice(&b).map_err(|e| {
                anyhow::anyhow!("{} is malformed: {e}", path.display())
            })?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
        }
    }

    /// Joins the router showing `code`; writes the secret and the router's identity.
    ///
    /// # Errors
    /// A malformed code, no router found, the router's refusal (a wrong or expired code),
    /// or the files cannot be written.
    pub async fn join(&self, code: &str) -> anyhow::Result<Joined> {
        let code = Code::parse(code)?;
        let at = match self.router {
            Some(a) => a,
            None => {
                let nameplate = code.nameplate().to_string();
                tracing::info!(nameplate = %nameplate, "looking for the router on the LAN");
                join::find(&self.targets(), self.discovery_port, FIND_WITHIN, |_, p| {
                    p == Some(nameplate.as_str())
                })
                .await?
            }
        };
        let grant = tokio::time::timeout(EXCHANGE_TIME, async {
            let mut tcp = connect(at).await?;
            join::join(&mut tcp, &code, &self.name()).await
        })
        .await
        .map_err(|_| anyhow::anyhow!("the router at {at} did not finish the join in time"))??;
        let secret = hex::decode(&grant.secret)
            .map_err(|_| anyhow::anyhow!("the router sent a secret that is not hex"))?;
        let joined = Joined {
            router: grant.router,
            device: grant.device,
            join_addr: at,
            settings: None,
        };
        let dir = self.dir();
        write_private(&dir, "secret", &secret)?;
        save(&dir, &joined)?;
        tracing::info!(router = %joined.router, device = %joined.device, dir = %dir.display(), "joined the router");
        Ok(joined)
    }

    /// Announces this node (its gRPC `port`) to its router every `--announce-every-s`,
    /// finding the router again when it moved; ends when the router refuses the device
    /// (removed), which it logs.
    pub async fn announce(self, mut joined: Joined, link: Link, port: u16) {
        let every = Duration::from_secs(self.announce_every_s);
        let me = join::Present {
            device: joined.device.clone(),
            port,
            name: self.name(),
        };
        let mut reached: Option<String> = None;
        loop {
            match announce_once(joined.join_addr, &link, &me).await {
                Ok(url) => {
                    if reached.as_deref() != Some(url.as_str()) {
                        tracing::info!(router = %joined.join_addr, %url, "announced to the router");
                        reached = Some(url);
                    }
                    tokio::time::sleep(every).await;
                }
                Err(JoinError::Refused {
                    reason: reason @ (Refusal::Revoked | Refusal::UnknownDevice),
                    message,
                }) => {
                    tracing::error!(%reason, why = %message, "the router refused this device: join it again with a new code");
                    return;
                }
                Err(e) => {
                    reached = None;
                    tracing::warn!(router = %joined.join_addr, error = %e, "the router did not take the announce; looking for it");
                    let id = joined.router.clone();
                    let found = join::find(
                        &self.targets(),
                        self.discovery_port,
                        REFIND_WITHIN,
                        |r, _| r == id,
                    )
                    .await;
                    match found {
                        Ok(at) if at != joined.join_addr => {
                            tracing::info!(from = %joined.join_addr, to = %at, "the router moved");
                            joined.join_addr = at;
                            if let Err(e) = save(&self.dir(), &joined) {
                                tracing::warn!(error = %e, "cannot remember the router's new address");
                            }
                        }
                        Ok(_) => tokio::time::sleep(every.min(Duration::from_secs(1))).await,
                        Err(_) => tokio::time::sleep(every).await,
                    }
                }
            }
        }
    }
}

async fn connect(at: SocketAddr) -> Result<tokio::net::TcpStream, JoinError> {
    let failed = |e: std::io::Error| {
        JoinError::Io(std::io::Error::new(
            e.kind(),
            format!("connecting to the router at {at}: {e}"),
        ))
    };
    tokio::time::timeout(CONNECT_TIME, tokio::net::TcpStream::connect(at))
        .await
        .map_err(|_| failed(std::io::ErrorKind::TimedOut.into()))?
        .map_err(failed)
}

/// A connection to the router at `at` that opened with `hello` (a joined device's first
/// message) and, the router having taken it, runs the private link under this device's key.
async fn knock(
    at: SocketAddr,
    hello: &Hello,
    link: &Link,
) -> Result<edgesplit_proto::link::LinkStream, JoinError> {
    let mut tcp = connect(at).await?;
    join::knock(&mut tcp, hello).await?;
    Ok(link.connect(tcp).await?)
}

async fn announce_once(
    at: SocketAddr,
    link: &Link,
    me: &join::Present,
) -> Result<String, JoinError> {
    let exchange = async {
        let hello = Hello::Announce {
            v: join::VERSION,
            device: me.device.clone(),
        };
        let mut private = knock(at, &hello, link).await?;
        join::present(&mut private, me).await
    };
    tokio::time::timeout(EXCHANGE_TIME, exchange)
        .await
        .unwrap_or_else(|_| Err(JoinError::Io(std::io::ErrorKind::TimedOut.into())))
}

/// Writes `name` in `dir` (made with mode 0700) with mode 0600, through a new file renamed
/// over the old.
fn write_private(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| anyhow::anyhow!("cannot make {}: {e}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let tmp = dir.join(format!("{name}.new"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))?;
    Ok(())
}

fn save(dir: &Path, joined: &Joined) -> anyhow::Result<()> {
    write_private(dir, "router.json", &serde_json::to_vec_pretty(joined)?)
}

/// Joins with `--join`, or finds the joined state of an earlier join when the node has no
/// secret of its own; for a joined node, points `--secret-file` at the received secret and
/// its listeners at every interface. Returns the joined state.
///
/// # Errors
/// A failed join, or a joined state that cannot be read.
pub async fn prepare(config: &mut crate::Config) -> anyhow::Result<Option<Joined>> {
    let args = config.joining.clone();
    let mut joined = match &args.join {
        Some(code) => Some(args.join(code).await?),
        None if edgesplit_proto::auth::Secret::load(config.node.secret_file.as_deref())?
            .is_some() =>
        {
            None
        }
        None => args.joined()?,
    };
    if let Some(joined) = &mut joined {
        config.node.secret_file = Some(args.dir().join("secret"));
        for addr in [
            &mut config.listen,
            &mut config.handoff_listen,
            &mut config.v1_listen,
        ] {
            *addr = on_every_interface(addr);
        }
        let link = config.node.link(&[])?;
        if !config.engine.model.exists() {
            fetch_model(joined, &link, &config.engine.model).await?;
        }
        match fetch_settings(joined, &link).await {
            Ok(s) => {
                if joined.settings.as_ref() != Some(&s) {
                    joined.settings = Some(s);
                    save(&args.dir(), joined)?;
                }
            }
            Err(
                e @ JoinError::Refused {
                    reason: Refusal::Revoked | Refusal::UnknownDevice,
                    ..
                },
            ) => return Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "the router did not give the prefill node's settings: using those it gave last")
            }
        }
        if let Some(s) = &joined.settings {
            take_settings(config, s)?;
        }
        if !config.plan {
            fit_memory(config).await;
        }
    }
    Ok(joined)
}

/// The prefill node's settings, from the router.
async fn fetch_settings(joined: &Joined, link: &Link) -> Result<join::Settings, JoinError> {
    let exchange = async {
        let hello = Hello::Settings {
            v: join::VERSION,
            device: joined.device.clone(),
        };
        let mut private = knock(joined.join_addr, &hello, link).await?;
        let answer: serde_json::Value = join::receive(&mut private).await?;
        if answer.get("op").is_some() {
            return Err(refusal(answer));
        }
        serde_json::from_value(answer).map_err(|e| JoinError::Malformed(e.to_string()))
    };
    tokio::time::timeout(EXCHANGE_TIME, exchange)
        .await
        .unwrap_or_else(|_| Err(JoinError::Io(std::io::ErrorKind::TimedOut.into())))
}

/// The router's answer that is not what was asked for: its refusal.
fn refusal(answer: serde_json::Value) -> JoinError {
    match serde_json::from_value::<join::Reply>(answer) {
        Ok(join::Reply::Refused { reason, message }) => JoinError::Refused { reason, message },
        Ok(other) => JoinError::Malformed(format!("unexpected reply {other:?}")),
        Err(e) => JoinError::Malformed(e.to_string()),
    }
}

/// The engine takes the prefill node's settings: what the handoff's handshake compares
/// (flash attention, KV cache types) and the context size, whatever the flags said.
///
/// # Errors
/// A KV cache type this build does not know.
fn take_settings(config: &mut crate::Config, s: &join::Settings) -> anyhow::Result<()> {
    use edgesplit_engine::{FlashAttn, KvType};
    let kv = |t: u32| {
        KvType::of_ggml_type(t).ok_or_else(|| {
            anyhow::anyhow!("the prefill node's KV cache type {t} is not one this node knows")
        })
    };
    let e = &mut config.engine;
    let (k, v) = (kv(s.type_k)?, kv(s.type_v)?);
    let fa = if s.flash_attn {
        FlashAttn::On
    } else {
        FlashAttn::Off
    };
    if (e.n_ctx, e.cache_type_k, e.cache_type_v) != (s.n_ctx, k, v) || e.flash_attn != fa {
        tracing::info!(n_ctx = s.n_ctx, cache_type_k = ?k, cache_type_v = ?v, flash_attn = s.flash_attn,
            "the prefill node's settings, from the router");
    }
    (e.n_ctx, e.cache_type_k, e.cache_type_v, e.flash_attn) = (s.n_ctx, k, v, fa);
    Ok(())
}

/// Fits the node to the memory available now (`--plan`'s figures) unless
/// `--kv-budget-bytes` was given: as many of `--parallel` contexts of `--n-ctx` tokens as
/// fit (at least one), the context shortened to what fits when one does not, and each
/// sequence's KV budget set, so that the router sends this device only what it holds.
/// Without the figures (MemAvailable unreadable) the flags stand.
async fn fit_memory(config: &mut crate::Config) {
    if config.kv_budget_bytes > 0 {
        return;
    }
    let p = match crate::memory_plan(config).await {
        Ok((p, _)) => p,
        Err(e) => {
            tracing::warn!(error = %e, "no memory plan: the flags' context and parallel stand");
            return;
        }
    };
    let n_ctx = u64::from(config.engine.n_ctx.max(1));
    let fits = p.tokens / n_ctx;
    if fits >= 1 {
        config.parallel = config.parallel.min(u32::try_from(fits).unwrap_or(u32::MAX));
    } else {
        config.parallel = 1;
        config.engine.n_ctx = u32::try_from((p.tokens / 256 * 256).max(256)).unwrap_or(256);
    }
    config.kv_budget_bytes = u64::from(config.engine.n_ctx) * p.kv_bytes_per_token;
    tracing::info!(
        parallel = config.parallel,
        n_ctx = config.engine.n_ctx,
        kv_budget_bytes = config.kv_budget_bytes,
        mem_available = p.mem_available,
        "memory planned"
    );
}

/// Attempts at the model file: a broken transfer goes on from the bytes received, a file
/// whose SHA-256 is not the router's is received again from the start.
const MODEL_ATTEMPTS: usize = 3;

/// Receives the router's model file into `path` (through `path.part`, renamed once its
/// SHA-256 is the router's).
///
/// # Errors
/// The router shares no model, too little free space, or every attempt failed.
pub async fn fetch_model(joined: &Joined, link: &Link, path: &Path) -> anyhow::Result<()> {
    let part = PathBuf::from(format!("{}.part", path.display()));
    let mut last = None;
    for _ in 0..MODEL_ATTEMPTS {
        match fetch_once(joined, link, &part).await {
            Ok(sha) => {
                let got = tokio::task::spawn_blocking({
                    let part = part.clone();
                    move || join::sha256_file(&part).map(|(_, sha)| sha)
                })
                .await??;
                if got == sha {
                    std::fs::rename(&part, path)?;
                    tracing::info!(path = %path.display(), "model file received, SHA-256 checked");
                    return Ok(());
                }
                tracing::warn!("the model file received does not match the router's SHA-256: received again from the start");
                std::fs::remove_file(&part)?;
                last = Some(anyhow::anyhow!(
                    "the model file received did not match its SHA-256"
                ));
            }
            Err(e @ JoinError::Refused { .. }) => return Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "the model transfer broke off: going on from what was received");
                last = Some(e.into());
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt")))
}

/// One attempt: the bytes after those `part` holds, appended to it; returns the router's
/// SHA-256 of the whole file.
async fn fetch_once(joined: &Joined, link: &Link, part: &Path) -> Result<String, JoinError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let have = std::fs::metadata(part).map_or(0, |m| m.len());
    let hello = Hello::Model {
        v: join::VERSION,
        device: joined.device.clone(),
    };
    let mut private = knock(joined.join_addr, &hello, link).await?;
    join::send(&mut private, &join::ModelAsk { have }).await?;
    let answer: serde_json::Value = join::receive(&mut private).await?;
    if answer.get("op").is_some() {
        return Err(refusal(answer));
    }
    let offer: join::ModelOffer =
        serde_json::from_value(answer).map_err(|e| JoinError::Malformed(e.to_string()))?;
    let left = offer.size.checked_sub(have).ok_or_else(|| {
        JoinError::Malformed(format!(
            "the router's file has {} bytes, fewer than the {have} here",
            offer.size
        ))
    })?;
    let dir = part
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    if let Some(free) = free_bytes(dir) {
        if free < left {
            return Err(JoinError::Refused {
                reason: Refusal::Unavailable,
                message: format!(
                    "the model needs {left} more bytes and {} has {free} free",
                    dir.display()
                ),
            });
        }
    }
    tracing::info!(name = %offer.name, size = offer.size, from = have, "receiving the model file");
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .await?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut got, mut shown) = (0u64, 0u64);
    while got < left {
        let want = usize::try_from((left - got).min(buf.len() as u64)).unwrap_or(buf.len());
        let n = tokio::time::timeout(EXCHANGE_TIME, private.read(&mut buf[..want]))
            .await
            .map_err(|_| JoinError::Io(std::io::ErrorKind::TimedOut.into()))??;
        if n == 0 {
            return Err(JoinError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        file.write_all(&buf[..n]).await?;
        got += n as u64;
        let percent = (have + got) * 100 / offer.size.max(1);
        if percent >= shown + 10 {
            shown = percent;
            tracing::info!(percent, "receiving the model file");
        }
    }
    file.sync_all().await?;
    Ok(offer.sha256)
}

/// Bytes free to this user on `dir`'s file system; `None` when it cannot be asked.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a statvfs the call fills.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &raw mut st) };
    // The fields are narrower than u64 on some targets.
    #[allow(clippy::useless_conversion)]
    (rc == 0).then(|| u64::from(st.f_bavail).saturating_mul(u64::from(st.f_frsize)))
}

/// `addr` with a loopback host made `0.0.0.0` (a joined device is reached over the LAN).
#[must_use]
pub fn on_every_interface(addr: &str) -> String {
    match addr.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_loopback() => format!("0.0.0.0:{}", a.port()),
        _ => addr.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_joined_node_listens_on_every_interface() {
        assert_eq!(on_every_interface("127.0.0.1:50052"), "0.0.0.0:50052");
        assert_eq!(on_every_interface("10.0.0.2:50052"), "10.0.0.2:50052");
        assert_eq!(on_every_interface("phone:1"), "phone:1");
    }

    #[test]
    fn the_joined_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("es-join-{}", std::process::id()));
        let joined = Joined {
            router: "r".into(),
            device: "d".into(),
            join_addr: "10.0.0.1:47475".parse().unwrap(),
            settings: Some(join::Settings {
                n_ctx: 2048,
                flash_attn: true,
                type_k: 8,
                type_v: 8,
            }),
        };
        write_private(&dir, "secret", b"0123456789abcdef0123456789abcdef").unwrap();
        save(&dir, &joined).unwrap();
        for (p, mode) in [
            (dir.clone(), 0o700),
            (dir.join("secret"), 0o600),
            (dir.join("router.json"), 0o600),
        ] {
            let m = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(m, mode, "{}", p.display());
        }
        let args = JoinArgs {
            join: None,
            router: None,
            join_dir: Some(dir.clone()),
            discovery_port: 0,
            name: None,
            announce_every_s: 10,
        };
        let back = args.joined().unwrap().unwrap();
        assert_eq!(back.device, "d");
        assert_eq!(back.settings, joined.settings);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_engine_takes_the_prefill_nodes_settings() {
        use clap::Parser;
        use edgesplit_engine::{FlashAttn, KvType};
        let mut c = crate::Config::parse_from(["edgesplit-decode", "--model", "m.gguf"]);
        let mut s = join::Settings {
            n_ctx: 2048,
            flash_attn: true,
            type_k: 8,
            type_v: 2,
        };
        take_settings(&mut c, &s).unwrap();
        let e = &c.engine;
        assert_eq!((e.n_ctx, e.flash_attn), (2048, FlashAttn::On));
        assert_eq!(
            (e.cache_type_k, e.cache_type_v),
            (KvType::Q8_0, KvType::Q4_0)
        );
        s.type_v = 99;
        let err = take_settings(&mut c, &s).unwrap_err().to_string();
        assert!(err.contains("KV cache type 99"), "{err}");
    }
}
