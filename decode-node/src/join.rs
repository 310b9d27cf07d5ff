//! The device's side of joining a router with a code (`--join CODE`;
//! `edgesplit_proto::join`), and of coming back to it.
//!
//! A join finds the router on the LAN (a broadcast; `--router` skips it), proves the code,
//! and writes what it received to `--join-dir`: `secret` (the shared secret, the node's
//! `--secret-file` from then on) and `router.json` (the router's id, this device's id, the
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
}

/// The flags of joining (`Default`: no join, as a node started in-process by a test).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct JoinArgs {
    /// Join a router with the code it shows (`--pair` or `POST /admin/pairing` there):
    /// the router is found on the LAN, the shared secret received and kept in `--join-dir`.
    #[arg(long, env = "EDGESPLIT_JOIN_CODE")]
    pub join: Option<String>,
    /// The router's join address (host:port of its `--join-listen`), instead of looking
    /// for it with a broadcast.
    #[arg(long)]
    pub router: Option<SocketAddr>,
    /// Where a joined device keeps the secret and its router's identity. Default:
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

async fn announce_once(
    at: SocketAddr,
    link: &Link,
    me: &join::Present,
) -> Result<String, JoinError> {
    let exchange = async {
        let mut tcp = connect(at).await?;
        join::send(&mut tcp, &Hello::Announce { v: join::VERSION }).await?;
        let mut private = link.connect(tcp).await?;
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
    let args = &config.joining;
    let joined = match &args.join {
        Some(code) => Some(args.join(code).await?),
        None if edgesplit_proto::auth::Secret::load(config.node.secret_file.as_deref())?
            .is_some() =>
        {
            None
        }
        None => args.joined()?,
    };
    if joined.is_some() {
        config.node.secret_file = Some(args.dir().join("secret"));
        for addr in [
            &mut config.listen,
            &mut config.handoff_listen,
            &mut config.v1_listen,
        ] {
            *addr = on_every_interface(addr);
        }
    }
    Ok(joined)
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
        assert_eq!(args.joined().unwrap().unwrap().device, "d");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
