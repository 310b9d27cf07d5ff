//! Devices that join with a code (`--join-listen`): the router's side of
//! `edgesplit_proto::join`, and its registry of joined devices.
//!
//! - **Pairing**: `--pair` at start or `POST /admin/pairing` opens one pairing: a code shown
//!   to the user (the terminal, the admin answer; never the log), single-use, expiring
//!   ([`PAIRING_TTL`] unless asked otherwise), closed after [`join::TRIES`] wrong codes.
//!   A try is counted when the device's key-exchange message arrives, before the router
//!   answers it, so parallel guesses cannot outrun the count.
//! - **Joined**: a device that proves the code gets an id and its own link key (derived
//!   from the household's secret and the id, `Secret::device`), sealed under the code's
//!   key; the router writes the device to its registry (`STATE_DIR/devices.json`, mode
//!   0600) before answering. The key is not stored: it is derived again when needed.
//! - **Announced**: a joined device names its id, the registry is checked, and it connects
//!   over the private link under its key to name its gRPC port; the router (and the
//!   prefill node, told the id in each handoff) reach it under that key, at the address
//!   the announce came from, so a device
//!   whose address changed is found again at its next announce (the device repeats it).
//!   Its URL joins the pool of decode nodes (`backend/pool.rs`), which calibrates it.
//! - **Revoked**: `DELETE /admin/devices/ID` takes the device out of the pool and the
//!   registry; its announces and model requests are refused from then on, before any
//!   TLS. Its key reaches only itself, which no one dials any more.
//! - **Found**: the router answers discovery broadcasts on UDP `--discovery-port`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use edgesplit_proto::auth::Secret;
use edgesplit_proto::join::{self, Code, Discovery, Hello, JoinError, Refusal, Reply};
use edgesplit_proto::link::Link;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};

use crate::backend::Pool;

mod supply;

/// How long a pairing stays open unless asked otherwise.
pub const PAIRING_TTL: Duration = Duration::from_secs(300);
/// The longest pairing that may be asked for.
pub const MAX_PAIRING_TTL: Duration = Duration::from_secs(3600);
/// A join or announce connection's whole time.
const CONNECTION_TIME: Duration = Duration::from_secs(20);
/// Devices the registry holds at most.
const MAX_DEVICES: usize = 64;
/// Longest device name kept.
const MAX_NAME: usize = 64;

/// One joined device, as the registry keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Device {
    pub id: String,
    pub name: String,
    /// Where the router last reached it (its last announce); none before the first.
    pub url: Option<String>,
    /// It passed its qualification (`backend/qualify.rs`); until then it is not used.
    #[serde(default)]
    pub qualified: bool,
    /// How its qualification's answers compared with the laptop's, in words.
    #[serde(default)]
    pub agreement: Option<String>,
}

/// A device's qualification under way, or failed.
#[derive(Debug, Clone)]
enum Stage {
    Qualifying,
    Failed { why: String, at: Instant },
}

/// How soon a device that failed its qualification is qualified again (at an announce).
const REQUALIFY_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Default, Serialize, Deserialize)]
struct Registry {
    router: String,
    devices: Vec<Device>,
    /// Ids of removed devices: their announces are refused.
    revoked: Vec<String>,
}

struct Pairing {
    code: Code,
    until: Instant,
    tries_left: u32,
}

/// The router's pairing, registry and join service.
pub struct Joins {
    path: PathBuf,
    registry: Mutex<Registry>,
    pairing: Mutex<Option<Pairing>>,
    secret: Arc<Secret>,
    link: Link,
    join_port: u16,
    /// The model file joined devices may receive (`--share-model`).
    model: Option<PathBuf>,
    /// Its size and SHA-256 (hex), computed at the first request.
    model_sha: tokio::sync::OnceCell<(u64, String)>,
    /// Qualifications under way or failed, by device id.
    stages: Mutex<std::collections::HashMap<String, Stage>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..16].to_string()
}

impl Joins {
    /// The registry in `dir` (made, with a new router id, when there is none), for a join
    /// service on `join_port`.
    ///
    /// # Errors
    /// No shared secret (a joined device gets the secret: there must be one), or the
    /// registry cannot be read or written.
    pub fn open(
        dir: &Path,
        link: &Link,
        join_port: u16,
        model: Option<PathBuf>,
    ) -> anyhow::Result<Joins> {
        if let Some(m) = &model {
            anyhow::ensure!(m.is_file(), "--share-model {}: no such file", m.display());
        }
        let secret = link.secret_arc().ok_or_else(|| {
            anyhow::anyhow!(
                "--join-listen needs the shared secret (--secret-file, EDGESPLIT_SECRET_FILE or \
                 EDGESPLIT_SECRET; scripts/secret.sh makes one): a joined device receives it"
            )
        })?;
        std::fs::create_dir_all(dir).map_err(|e| {
            anyhow::anyhow!("cannot make the state directory {}: {e}", dir.display())
        })?;
        let path = dir.join("devices.json");
        let registry = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                anyhow::anyhow!("the device registry {} is malformed: {e}", path.display())
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Registry {
                router: new_id(),
                ..Registry::default()
            },
            Err(e) => anyhow::bail!("cannot read the device registry {}: {e}", path.display()),
        };
        let joins = Joins {
            path,
            registry: Mutex::new(registry),
            pairing: Mutex::new(None),
            secret,
            link: link.clone(),
            join_port,
            model,
            model_sha: tokio::sync::OnceCell::new(),
            stages: Mutex::default(),
        };
        joins.save(&lock(&joins.registry))?;
        Ok(joins)
    }

    /// Writes the registry (a new file renamed over the old, mode 0600).
    fn save(&self, r: &Registry) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = self.path.with_extension("json.new");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(r).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)
    }

    /// Opens a pairing for `ttl` (closing any open one); returns its code.
    pub fn pair(&self, ttl: Duration) -> Code {
        let code = Code::generate();
        *lock(&self.pairing) = Some(Pairing {
            code: code.clone(),
            until: Instant::now() + ttl,
            tries_left: join::TRIES,
        });
        tracing::info!(
            nameplate = code.nameplate(),
            ttl_s = ttl.as_secs(),
            "pairing open"
        );
        code
    }

    /// Closes the open pairing, if any.
    pub fn close_pairing(&self) {
        *lock(&self.pairing) = None;
    }

    /// The joined devices.
    #[must_use]
    pub fn devices(&self) -> Vec<Device> {
        lock(&self.registry).devices.clone()
    }

    /// The TCP port devices join and announce on.
    #[must_use]
    pub fn join_port(&self) -> u16 {
        self.join_port
    }

    /// The open pairing's nameplate and the time left, if one is open.
    #[must_use]
    pub fn pairing(&self) -> Option<(String, Duration)> {
        lock(&self.pairing).as_ref().and_then(|p| {
            let left = p.until.checked_duration_since(Instant::now())?;
            Some((p.code.nameplate().to_string(), left))
        })
    }

    /// Removes device `id`: its announces are refused from now on. Returns it.
    ///
    /// # Errors
    /// No such device, or the registry cannot be written.
    pub fn revoke(&self, id: &str) -> anyhow::Result<Device> {
        let mut r = lock(&self.registry);
        let i = r
            .devices
            .iter()
            .position(|d| d.id == id)
            .ok_or_else(|| anyhow::anyhow!("no joined device {id:?}"))?;
        let d = r.devices.remove(i);
        r.revoked.push(d.id.clone());
        self.save(&r)?;
        tracing::info!(device = %d.id, name = %d.name, "device removed");
        Ok(d)
    }

    fn here(&self) -> Discovery {
        Discovery::Here {
            v: join::VERSION,
            router: lock(&self.registry).router.clone(),
            join_port: self.join_port,
            // Held, even expired: a device with that code is then told it expired.
            pairing: lock(&self.pairing)
                .as_ref()
                .map(|p| p.code.nameplate().to_string()),
        }
    }

    /// Answers discovery broadcasts on `socket`, forever.
    pub async fn answer_finds(self: Arc<Self>, socket: tokio::net::UdpSocket) {
        join::answer_finds(socket, move || self.here()).await;
    }

    /// Serves joins and announces on `listener` while the router's state (which holds the
    /// pool of decode nodes) lives.
    pub async fn serve<S: AsRef<Pool> + Send + Sync + 'static>(
        self: Arc<Self>,
        listener: TcpListener,
        state: Weak<S>,
    ) {
        loop {
            let Ok((tcp, peer)) = listener.accept().await else {
                continue;
            };
            let (joins, state) = (self.clone(), state.clone());
            tokio::spawn(async move {
                if let Err(e) = joins.connection(tcp, peer, &state).await {
                    tracing::info!(%peer, error = %e, "join connection refused");
                }
            });
        }
    }

    async fn connection<S: AsRef<Pool> + Send + Sync + 'static>(
        self: &Arc<Self>,
        mut tcp: TcpStream,
        peer: std::net::SocketAddr,
        state: &Weak<S>,
    ) -> Result<(), JoinError> {
        let timed_out = || JoinError::Io(std::io::ErrorKind::TimedOut.into());
        let hello = tokio::time::timeout(CONNECTION_TIME, join::receive::<_, Hello>(&mut tcp))
            .await
            .unwrap_or_else(|_| Err(timed_out()));
        let hello = match hello {
            Ok(h) => h,
            Err(e) => {
                refuse(&mut tcp, Refusal::Malformed, &e.to_string()).await;
                return Err(e);
            }
        };
        match hello {
            Hello::Join {
                v,
                nameplate,
                pake,
                name,
            } if v == join::VERSION => {
                let join = self.join(tcp, &nameplate, &pake, &name);
                tokio::time::timeout(CONNECTION_TIME, join)
                    .await
                    .unwrap_or_else(|_| Err(timed_out()))
            }
            Hello::Announce { v, device } if v == join::VERSION => {
                let announce = async {
                    let link = self.admit(&mut tcp, &device).await?;
                    let mut link = link.accept(tcp).await?;
                    let me: join::Present = join::receive(&mut link).await?;
                    let reply = if me.device != device {
                        Reply::Refused {
                            reason: Refusal::Malformed,
                            message: format!("announced as {device}, presented as {}", me.device),
                        }
                    } else {
                        match self.announced(&me, peer, state).await {
                            Ok(url) => Reply::Accepted { url },
                            Err((reason, message)) => Reply::Refused { reason, message },
                        }
                    };
                    join::send(&mut link, &reply).await?;
                    Ok(())
                };
                tokio::time::timeout(CONNECTION_TIME, announce)
                    .await
                    .unwrap_or_else(|_| Err(timed_out()))
            }
            Hello::Model { v, device } if v == join::VERSION => {
                let link = tokio::time::timeout(CONNECTION_TIME, self.admit(&mut tcp, &device))
                    .await
                    .map_err(|_| timed_out())??;
                let mut link = tokio::time::timeout(CONNECTION_TIME, link.accept(tcp))
                    .await
                    .map_err(|_| timed_out())??;
                let ask: join::ModelAsk =
                    tokio::time::timeout(CONNECTION_TIME, join::receive(&mut link))
                        .await
                        .map_err(|_| timed_out())??;
                self.send_model(&mut link, ask.have, peer).await
            }
            Hello::Settings { v, device } if v == join::VERSION => {
                let settings = async {
                    let link = self.admit(&mut tcp, &device).await?;
                    let mut link = link.accept(tcp).await?;
                    let Some(state) = state.upgrade() else {
                        return Err(JoinError::Malformed("the router is stopping".into()));
                    };
                    Self::send_settings(&mut link, (*state).as_ref()).await
                };
                tokio::time::timeout(CONNECTION_TIME, settings)
                    .await
                    .unwrap_or_else(|_| Err(timed_out()))
            }
            _ => {
                let m = format!("join protocol version {} only", join::VERSION);
                refuse(&mut tcp, Refusal::Malformed, &m).await;
                Err(JoinError::Malformed(m))
            }
        }
    }

    /// Takes a joined device's first message: `Proceed` and the link under its key when
    /// the registry holds `device`, else its refusal (removed, unknown), sent in the clear.
    async fn admit(&self, tcp: &mut TcpStream, device: &str) -> Result<Link, JoinError> {
        let known = {
            let r = lock(&self.registry);
            if r.revoked.iter().any(|d| d == device) {
                Err((Refusal::Revoked, "this device was removed from the router"))
            } else if r.devices.iter().any(|d| d.id == device) {
                Ok(())
            } else {
                Err((Refusal::UnknownDevice, "the router has no such device"))
            }
        };
        if let Err((reason, message)) = known {
            refuse(tcp, reason, message).await;
            return Err(JoinError::Refused {
                reason,
                message: message.into(),
            });
        }
        let link = self
            .link
            .device(device)
            .map_err(|e| JoinError::Io(std::io::Error::other(e)))?;
        join::send(tcp, &Reply::Proceed).await?;
        Ok(link)
    }

    /// Takes a try of the open pairing under `nameplate`, or says why there is none.
    fn take_try(&self, nameplate: &str) -> Result<(Code, u32), (Refusal, String)> {
        let mut slot = lock(&self.pairing);
        let Some(p) = slot.as_mut().filter(|p| p.code.nameplate() == nameplate) else {
            return Err((
                Refusal::NoPairing,
                format!("no pairing is open under {nameplate}: open one on the router"),
            ));
        };
        if Instant::now() >= p.until {
            *slot = None;
            return Err((
                Refusal::Expired,
                "the code expired: open a new pairing on the router".into(),
            ));
        }
        if p.tries_left == 0 {
            return Err((Refusal::TooManyTries, "the pairing is closed".into()));
        }
        p.tries_left -= 1;
        Ok((p.code.clone(), p.tries_left))
    }

    async fn join(
        &self,
        mut tcp: TcpStream,
        nameplate: &str,
        theirs: &str,
        name: &str,
    ) -> Result<(), JoinError> {
        let (code, tries_left) = match self.take_try(nameplate) {
            Ok(t) => t,
            Err((reason, message)) => {
                refuse(&mut tcp, reason, &message).await;
                return Err(JoinError::Refused { reason, message });
            }
        };
        let (pake, mine) = join::Pake::start(&code);
        let keys = pake.finish(&join::unhex("pake", theirs)?)?;
        join::send(
            &mut tcp,
            &Reply::Pake {
                pake: hex::encode(mine),
            },
        )
        .await?;
        let confirm: join::Confirm = join::receive(&mut tcp).await?;
        if !keys.check(
            join::Side::Device,
            &join::unhex("confirm", &confirm.confirm)?,
        ) {
            let (reason, message) = if tries_left == 0 {
                self.close_pairing();
                (
                    Refusal::TooManyTries,
                    "wrong code; the pairing is closed".to_string(),
                )
            } else {
                (
                    Refusal::WrongCode,
                    format!("wrong code; {tries_left} tries left"),
                )
            };
            refuse(&mut tcp, reason, &message).await;
            return Err(JoinError::Refused { reason, message });
        }
        let device = Device {
            id: new_id(),
            name: name.chars().take(MAX_NAME).collect(),
            url: None,
            qualified: false,
            agreement: None,
        };
        let grant = {
            let mut r = lock(&self.registry);
            if r.devices.len() < MAX_DEVICES {
                r.devices.push(device.clone());
                self.save(&r)?;
                Some(join::Grant {
                    secret: hex::encode(self.secret.device(&device.id).bytes()),
                    router: r.router.clone(),
                    device: device.id.clone(),
                })
            } else {
                None
            }
        };
        let Some(grant) = grant else {
            let m = format!("the router has {MAX_DEVICES} joined devices, the most it keeps");
            refuse(&mut tcp, Refusal::Unavailable, &m).await;
            return Err(JoinError::Malformed(m));
        };
        self.close_pairing();
        let sealed = keys.seal(&serde_json::to_vec(&grant).map_err(std::io::Error::other)?);
        join::send(
            &mut tcp,
            &Reply::Welcome {
                confirm: hex::encode(keys.confirm(join::Side::Router)),
                sealed: hex::encode(sealed),
            },
        )
        .await?;
        tracing::info!(device = %device.id, name = %device.name, "device joined");
        Ok(())
    }

    /// A joined device's announce: its URL from the address it came from, into the pool.
    async fn announced<S: AsRef<Pool> + Send + Sync + 'static>(
        self: &Arc<Self>,
        me: &join::Present,
        peer: std::net::SocketAddr,
        state: &Weak<S>,
    ) -> Result<String, (Refusal, String)> {
        let url = match peer.ip() {
            std::net::IpAddr::V4(ip) => format!("http://{ip}:{}", me.port),
            std::net::IpAddr::V6(ip) => format!("http://[{ip}]:{}", me.port),
        };
        let (old, qualified) = {
            let mut r = lock(&self.registry);
            if r.revoked.contains(&me.device) {
                return Err((
                    Refusal::Revoked,
                    "this device was removed from the router".into(),
                ));
            }
            let Some(d) = r.devices.iter_mut().find(|d| d.id == me.device) else {
                return Err((
                    Refusal::UnknownDevice,
                    "the router has no such device".into(),
                ));
            };
            let old = d.url.replace(url.clone());
            let qualified = d.qualified;
            if old.as_deref() != Some(url.as_str()) {
                self.save(&r)
                    .map_err(|e| (Refusal::Unavailable, e.to_string()))?;
            }
            (old, qualified)
        };
        let Some(state) = state.upgrade() else {
            return Err((Refusal::Unavailable, "the router is stopping".into()));
        };
        let pool: &Pool = (*state).as_ref();
        if old.is_some() && !qualified && old.as_deref() != Some(url.as_str()) {
            // A move during a qualification: it is made again at the new address.
            lock(&self.stages).remove(&me.device);
        }
        if let Some(old) = old.as_ref().filter(|o| **o != url) {
            tracing::info!(device = %me.device, from = %old, to = %url, "device moved");
            let _ = pool.remove(old);
        }
        if pool.urls().contains(&url) {
            return Ok(url);
        }
        let pair = pool
            .pair_with(&url, &me.device)
            .map_err(|f| (Refusal::Unavailable, f.message))?;
        if qualified {
            pool.adopt(pair)
                .await
                .map_err(|f| (Refusal::Unavailable, f.message))?;
            return Ok(url);
        }
        let due = match lock(&self.stages).get(&me.device) {
            Some(Stage::Qualifying) => false,
            Some(Stage::Failed { at, .. }) => at.elapsed() >= REQUALIFY_AFTER,
            None => true,
        };
        if due {
            lock(&self.stages).insert(me.device.clone(), Stage::Qualifying);
            tokio::spawn(self.clone().qualify(me.device.clone(), pair, state.clone()));
        }
        Ok(url)
    }

    /// Qualifies device `id` on `pair`; one that passes is marked so and enters the pool.
    async fn qualify<S: AsRef<Pool>>(
        self: Arc<Self>,
        id: String,
        pair: crate::backend::Backend,
        state: Arc<S>,
    ) {
        tracing::info!(device = %id, node = %pair.decode_url(), "qualifying the device");
        match pair.qualify().await {
            Ok(q) => {
                let agreement = if q.same_numerics {
                    "identical to the laptop's (it computes alike)".to_string()
                } else {
                    format!(
                        "{} of {} tokens as the laptop's (another architecture or kernels)",
                        q.agreeing, q.compared
                    )
                };
                {
                    let mut r = lock(&self.registry);
                    if let Some(d) = r.devices.iter_mut().find(|d| d.id == id) {
                        d.qualified = true;
                        d.agreement = Some(agreement.clone());
                    }
                    if let Err(e) = self.save(&r) {
                        tracing::warn!(error = %e, "cannot write the device registry");
                    }
                }
                lock(&self.stages).remove(&id);
                tracing::info!(device = %id, answers = q.answers, %agreement,
                    link_bytes_per_ms = ?q.link, rtt_ms = ?q.rtt_ms, "device qualified");
                let pool: &Pool = (*state).as_ref();
                if let Err(f) = pool.adopt(pair).await {
                    tracing::warn!(device = %id, error = %f.message, "the qualified device did not enter the pool");
                }
            }
            Err(why) => {
                tracing::warn!(device = %id, %why, "the device failed its qualification: not used");
                lock(&self.stages).insert(
                    id,
                    Stage::Failed {
                        why,
                        at: Instant::now(),
                    },
                );
            }
        }
    }

    /// Device `id`'s qualification, in words, while it is under way or failed.
    #[must_use]
    pub fn stage(&self, id: &str) -> Option<String> {
        lock(&self.stages).get(id).map(|s| match s {
            Stage::Qualifying => "qualifying".to_string(),
            Stage::Failed { why, .. } => format!("failed its qualification: {why}"),
        })
    }
}

async fn refuse(tcp: &mut TcpStream, reason: Refusal, message: &str) {
    let reply = Reply::Refused {
        reason,
        message: message.to_string(),
    };
    let _ = join::send(tcp, &reply).await;
}

/// Where the registry lives by default: `$XDG_STATE_HOME/edgesplit`, else
/// `~/.local/state/edgesplit`.
#[must_use]
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("edgesplit");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".local/state/edgesplit")
}
