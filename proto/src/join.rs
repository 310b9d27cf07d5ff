//! Joining a device to a router with a short code: nothing typed but the code, no file
//! copied (ARCHITECTURE.md, "Joining a device").
//!
//! - **The code** ([`Code`]): `NNN-NNNN-NNNN`. The first group is the *nameplate*, public:
//!   it tells which router's pairing the device asks for (several routers may share a LAN).
//!   The eight digits after it are the password, which never crosses the network.
//! - **Finding the router** ([`find`]): the device broadcasts a [`Discovery::Find`] on
//!   UDP port [`DISCOVERY_PORT`] of every interface, and each router answers by unicast
//!   ([`Discovery::Here`]: its id, its join port, the nameplate of its open pairing). A
//!   phone can send broadcasts and receive unicast without Android's multicast lock, which
//!   Termux cannot hold.
//! - **Keys from the code** ([`Pake`]): SPAKE2 (RustCrypto's `spake2`, Ed25519 group,
//!   symmetric) turns the password into a 32-byte key both sides hold and an eavesdropper
//!   cannot compute; an active guesser gets one guess per try, and the router allows
//!   [`TRIES`] a code. Each side then proves the key ([`Keys::confirm`], HMAC-SHA256 under
//!   its own label; the device first, so a wrong code is told apart from a broken link), and
//!   the router sends the device its own link key sealed under it ([`Keys::seal`]:
//!   ChaCha20-Poly1305 under a key derived from it). That key is derived from the
//!   household's secret and the device's id (`auth::Secret::device`): the device never
//!   holds the household's secret, and a removed device's key opens nothing.
//! - **Coming back** ([`Hello::Announce`]): a joined device names its id in the clear, the
//!   router checks its registry (a removed or unknown device is refused there), both sides
//!   wrap the connection in the private link keyed by that device's key, and the device
//!   names itself and its gRPC port; the router takes the address it came from.
//! - **The model** ([`Hello::Model`]): inside the private link, a device that lacks the
//!   model file asks for it from the bytes it holds ([`ModelAsk`]); the router answers
//!   the file's size and SHA-256 ([`ModelOffer`]) and streams the rest.
//!
//! Every message is a JSON object in a frame of a 4-byte big-endian length (at most
//! [`MAX_MESSAGE`] bytes, checked before anything is allocated).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use spake2::{Ed25519Group, Identity, Password, Spake2};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The join protocol's version, in every first message.
pub const VERSION: u32 = 2;
/// The UDP port routers answer [`Discovery::Find`] on.
pub const DISCOVERY_PORT: u16 = 47474;
/// Largest join message, in bytes.
pub const MAX_MESSAGE: usize = 4096;
/// Wrong codes a pairing allows before it closes.
pub const TRIES: u32 = 3;
/// Digits of a code's nameplate and of its password.
const NAMEPLATE_DIGITS: usize = 3;
const PASSWORD_DIGITS: usize = 8;

/// Why a join or announce did not succeed: what the router said, or what went wrong here.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("{0:?} is not a join code: it is three groups of digits, like 417-2093-8861")]
    BadCode(String),
    #[error("the router refused: {reason}: {message}")]
    Refused { reason: Refusal, message: String },
    #[error("the router did not prove the code: it is not the router that showed it")]
    RouterUnproven,
    #[error("malformed join message: {0}")]
    Malformed(String),
    #[error("no router with the pairing or id looked for answered on the LAN within {0:?} ({1} other routers answered)")]
    NotFound(Duration, usize),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A router's reason for refusing a device, as the device reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// No pairing is open under this nameplate.
    NoPairing,
    /// The pairing's time ran out.
    Expired,
    /// The code was wrong (the pairing stays open while tries are left).
    WrongCode,
    /// The pairing closed after [`TRIES`] wrong codes.
    TooManyTries,
    /// The device was removed from the router.
    Revoked,
    /// The router has no device of that id.
    UnknownDevice,
    /// The router cannot take the device now (its pool is full, no shared secret).
    Unavailable,
    /// A message the router could not read.
    Malformed,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        f.write_str(&s)
    }
}

/// A join code. Its `Debug` and `Display` differ: `Debug` shows the nameplate only, so a
/// code in a logged structure does not leak its password.
#[derive(Clone, PartialEq, Eq)]
pub struct Code {
    nameplate: String,
    password: String,
}

impl fmt::Debug for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Code({}-****-****)", self.nameplate)
    }
}

impl fmt::Display for Code {
    /// The whole code, to be shown to the user (never logged).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (a, b) = self.password.split_at(PASSWORD_DIGITS / 2);
        write!(f, "{}-{a}-{b}", self.nameplate)
    }
}

impl Code {
    /// A new random code (the operating system's random source).
    #[must_use]
    pub fn generate() -> Code {
        use rand::Rng;
        let mut rng = rand::rng();
        let mut digits = |n: usize| -> String {
            (0..n)
                .map(|_| char::from(b'0' + rng.random_range(0..10u8)))
                .collect()
        };
        Code {
            nameplate: digits(NAMEPLATE_DIGITS),
            password: digits(PASSWORD_DIGITS),
        }
    }

    /// A code as typed: digits in groups of 3, 4 and 4, separated by `-` or spaces.
    ///
    /// # Errors
    /// [`JoinError::BadCode`] for anything else.
    pub fn parse(s: &str) -> Result<Code, JoinError> {
        let bad = || JoinError::BadCode(s.chars().take(40).collect());
        let groups: Vec<&str> = s
            .trim()
            .split(|c: char| c == '-' || c.is_whitespace())
            .filter(|g| !g.is_empty())
            .collect();
        let sizes_ok = groups.len() == 3
            && groups[0].len() == NAMEPLATE_DIGITS
            && groups[1].len() + groups[2].len() == PASSWORD_DIGITS;
        if !sizes_ok || !groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_digit())) {
            return Err(bad());
        }
        Ok(Code {
            nameplate: groups[0].to_string(),
            password: format!("{}{}", groups[1], groups[2]),
        })
    }

    /// The public part: which pairing the code belongs to.
    #[must_use]
    pub fn nameplate(&self) -> &str {
        &self.nameplate
    }
}

/// One side's half of the key exchange, until the other's message arrives.
pub struct Pake(Spake2<Ed25519Group>);

impl Pake {
    /// Starts the exchange for `code`; returns the message to send.
    #[must_use]
    pub fn start(code: &Code) -> (Pake, Vec<u8>) {
        let id = format!("edgesplit join v{VERSION} {}", code.nameplate);
        let (state, msg) = Spake2::<Ed25519Group>::start_symmetric(
            &Password::new(code.password.as_bytes()),
            &Identity::new(id.as_bytes()),
        );
        (Pake(state), msg)
    }

    /// The shared key, from the other side's message. With different codes both sides
    /// get keys that differ, which [`Keys::confirm`] finds.
    ///
    /// # Errors
    /// A message that is not a SPAKE2 message of this group.
    pub fn finish(self, theirs: &[u8]) -> Result<Keys, JoinError> {
        let key = self
            .0
            .finish(theirs)
            .map_err(|e| JoinError::Malformed(format!("key exchange message: {e:?}")))?;
        Ok(Keys(key))
    }
}

/// The side that proves the key.
#[derive(Debug, Clone, Copy)]
pub enum Side {
    Device,
    Router,
}

/// The key both sides derived from the code.
pub struct Keys(Vec<u8>);

impl Keys {
    fn mac(&self, label: &str) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label.as_bytes());
        m
    }

    /// `side`'s proof that it holds the key.
    #[must_use]
    pub fn confirm(&self, side: Side) -> Vec<u8> {
        self.mac(&format!("edgesplit join confirm {side:?}"))
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Whether `tag` is `side`'s proof (compared in constant time).
    #[must_use]
    pub fn check(&self, side: Side, tag: &[u8]) -> bool {
        self.mac(&format!("edgesplit join confirm {side:?}"))
            .verify_slice(tag)
            .is_ok()
    }

    fn cipher(&self) -> ChaCha20Poly1305 {
        let key = self.mac("edgesplit join seal").finalize().into_bytes();
        ChaCha20Poly1305::new(Key::from_slice(&key))
    }

    /// `plain` sealed (encrypted and authenticated). The key seals one message only, so a
    /// fixed nonce is safe.
    #[must_use]
    pub fn seal(&self, plain: &[u8]) -> Vec<u8> {
        self.cipher()
            .encrypt(Nonce::from_slice(&[0; 12]), plain)
            .expect("ChaCha20-Poly1305 seals any message under 256 GiB")
    }

    /// What [`Keys::seal`] sealed.
    ///
    /// # Errors
    /// The message was not sealed under this key, or was changed.
    pub fn open(&self, sealed: &[u8]) -> Result<Vec<u8>, JoinError> {
        self.cipher()
            .decrypt(Nonce::from_slice(&[0; 12]), sealed)
            .map_err(|_| JoinError::Malformed("the sealed grant does not open".into()))
    }
}

/// A device's first message on a join connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Hello {
    /// A device joining with a code: its key-exchange message (hex) and a name to show.
    Join {
        v: u32,
        nameplate: String,
        pake: String,
        name: String,
    },
    /// Joined device `device` coming back; the private link under its key follows, then
    /// [`Present`].
    Announce { v: u32, device: String },
    /// Joined device `device` asking for the model file; the private link under its key
    /// follows, then [`ModelAsk`].
    Model { v: u32, device: String },
    /// Joined device `device` asking, before its engine starts, for the [`Settings`] it
    /// must share with the prefill node; the private link under its key follows.
    Settings { v: u32, device: String },
}

/// Inside the private link: the bytes of the model file the device holds already (a
/// transfer broken off goes on from there).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelAsk {
    pub have: u64,
}

/// What a joined device's engine takes from the prefill node (the router asks its `Info`):
/// what the handoff's handshake compares (flash attention, the K and V cache types as
/// ggml type numbers) and the context size, which both nodes share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub n_ctx: u32,
    pub flash_attn: bool,
    pub type_k: u32,
    pub type_v: u32,
}

/// The router's model file: its size, SHA-256 (hex) and name. The bytes from the asked
/// offset to `size` follow, raw.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelOffer {
    pub size: u64,
    pub sha256: String,
    pub name: String,
}

/// The router's answer, one per step.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The router's key-exchange message (hex).
    Pake { pake: String },
    /// The router's proof of the key and the sealed [`Grant`] (hex).
    Welcome { confirm: String, sealed: String },
    /// A joined device's first message taken: the private link under its key follows.
    Proceed,
    /// An announce taken: the URL the router now reaches the device at.
    Accepted { url: String },
    /// No: why.
    Refused { reason: Refusal, message: String },
}

/// The device's proof of the key (hex).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Confirm {
    pub confirm: String,
}

/// What a joined device receives, sealed: its own link key and the two ids.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// The device's link key (`auth::Secret::device` of its id), hex.
    pub secret: String,
    /// The router's id.
    pub router: String,
    /// The id the router gave this device.
    pub device: String,
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Grant(router {}, device {})", self.router, self.device)
    }
}

/// A joined device, inside the private link: who it is and where it serves.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Present {
    pub device: String,
    /// Its gRPC port (the router dials the address the announce came from).
    pub port: u16,
    pub name: String,
}

/// A file's size and SHA-256 (hex), read a MiB at a time: the model file a router shares
/// and the one a device received.
///
/// # Errors
/// The file cannot be read.
pub fn sha256_file(path: &std::path::Path) -> std::io::Result<(u64, String)> {
    use sha2::Digest;
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok((size, hex::encode(h.finalize())));
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
}

/// Writes `msg` as one frame.
///
/// # Errors
/// The stream's error.
pub async fn send<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, msg: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(std::io::Error::other)?;
    w.write_all(&len.to_be_bytes()).await?;
    w.write_all(&body).await?;
    w.flush().await
}

/// Reads one frame as a `T`.
///
/// # Errors
/// The stream's error, a length over [`MAX_MESSAGE`] (before any allocation), or a body
/// that is not a `T`.
pub async fn receive<R: AsyncRead + Unpin, T: serde::de::DeserializeOwned>(
    r: &mut R,
) -> Result<T, JoinError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(JoinError::Malformed(format!(
            "a message of {len} bytes; at most {MAX_MESSAGE}"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map_err(|e| JoinError::Malformed(e.to_string()))
}

/// Decodes a hex field of a message.
///
/// # Errors
/// [`JoinError::Malformed`] naming the field.
pub fn unhex(field: &str, s: &str) -> Result<Vec<u8>, JoinError> {
    hex::decode(s).map_err(|_| JoinError::Malformed(format!("{field} is not hex")))
}

fn refused(reply: Reply) -> JoinError {
    match reply {
        Reply::Refused { reason, message } => JoinError::Refused { reason, message },
        other => JoinError::Malformed(format!("unexpected reply {other:?}")),
    }
}

/// The device's side of a join over `stream` (connected to the router's join port).
///
/// # Errors
/// The router's refusal ([`Refusal::WrongCode`] for a wrong code), a router that does not
/// prove the code, or the connection's error.
pub async fn join<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    code: &Code,
    name: &str,
) -> Result<Grant, JoinError> {
    let (pake, msg) = Pake::start(code);
    send(
        stream,
        &Hello::Join {
            v: VERSION,
            nameplate: code.nameplate.clone(),
            pake: hex::encode(msg),
            name: name.to_string(),
        },
    )
    .await?;
    let keys = match receive(stream).await? {
        Reply::Pake { pake: theirs } => pake.finish(&unhex("pake", &theirs)?)?,
        other => return Err(refused(other)),
    };
    send(
        stream,
        &Confirm {
            confirm: hex::encode(keys.confirm(Side::Device)),
        },
    )
    .await?;
    match receive(stream).await? {
        Reply::Welcome { confirm, sealed } => {
            if !keys.check(Side::Router, &unhex("confirm", &confirm)?) {
                return Err(JoinError::RouterUnproven);
            }
            let plain = keys.open(&unhex("sealed", &sealed)?)?;
            serde_json::from_slice(&plain).map_err(|e| JoinError::Malformed(e.to_string()))
        }
        other => Err(refused(other)),
    }
}

/// A joined device's first message ([`Hello::Announce`] or [`Hello::Model`]), sent in the
/// clear; returns once the router knows the device and the private link under its key may
/// follow.
///
/// # Errors
/// The router's refusal ([`Refusal::Revoked`] for a removed device,
/// [`Refusal::UnknownDevice`]) or the connection's error.
pub async fn knock<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    hello: &Hello,
) -> Result<(), JoinError> {
    send(stream, hello).await?;
    match receive(stream).await? {
        Reply::Proceed => Ok(()),
        other => Err(refused(other)),
    }
}

/// The device's side of an announce, after [`Hello::Announce`] and inside the private
/// link: returns the URL the router reaches it at.
///
/// # Errors
/// The router's refusal ([`Refusal::Revoked`] for a removed device) or the connection's
/// error.
pub async fn present<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    me: &Present,
) -> Result<String, JoinError> {
    send(stream, me).await?;
    match receive(stream).await? {
        Reply::Accepted { url } => Ok(url),
        other => Err(refused(other)),
    }
}

/// What crosses UDP to find a router.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "edgesplit", rename_all = "snake_case", deny_unknown_fields)]
pub enum Discovery {
    /// A device looking for routers.
    Find { v: u32 },
    /// A router: its id, its join port, and its open pairing's nameplate.
    Here {
        v: u32,
        router: String,
        join_port: u16,
        pairing: Option<String>,
    },
}

/// Where to send a [`Discovery::Find`]: the broadcast address of every IPv4 interface's
/// subnet, and the limited broadcast.
#[must_use]
pub fn broadcast_addrs() -> Vec<Ipv4Addr> {
    let mut out: Vec<Ipv4Addr> = if_addrs::get_if_addrs()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|i| match i.addr {
            // From the address and mask: an interface set up without a broadcast
            // address (`ip addr add` without `brd`) still has a subnet to reach.
            if_addrs::IfAddr::V4(a) if !a.is_loopback() && a.prefixlen < 31 => {
                Some(Ipv4Addr::from(u32::from(a.ip) | !u32::from(a.netmask)))
            }
            _ => None,
        })
        .collect();
    out.push(Ipv4Addr::BROADCAST);
    out.dedup();
    out
}

/// Finds a router on the LAN: broadcasts [`Discovery::Find`] to `targets` on `port` every
/// half second until a router's answer passes `wanted`, or `within` passes. Returns the
/// router's join address (the answer's source address, the join port it names).
///
/// # Errors
/// [`JoinError::NotFound`], or the socket's error.
pub async fn find(
    targets: &[IpAddr],
    port: u16,
    within: Duration,
    wanted: impl Fn(&str, Option<&str>) -> bool,
) -> Result<SocketAddr, JoinError> {
    let socket = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
    socket.set_broadcast(true)?;
    let find =
        serde_json::to_vec(&Discovery::Find { v: VERSION }).map_err(std::io::Error::other)?;
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 512];
    let mut others = std::collections::HashSet::new();
    loop {
        for t in targets {
            // An interface that cannot send (no route, down) is skipped: another may.
            let _ = socket.send_to(&find, (*t, port)).await;
        }
        let round = (tokio::time::Instant::now() + Duration::from_millis(500)).min(deadline);
        while let Ok(got) = tokio::time::timeout_at(round, socket.recv_from(&mut buf)).await {
            let (n, from) = got?;
            if let Ok(Discovery::Here {
                router,
                join_port,
                pairing,
                ..
            }) = serde_json::from_slice(&buf[..n])
            {
                if wanted(&router, pairing.as_deref()) {
                    return Ok(SocketAddr::new(from.ip(), join_port));
                }
                others.insert(router);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(JoinError::NotFound(within, others.len()));
        }
    }
}

/// A router's answers to [`Discovery::Find`] on `socket`, forever: each gets `here()` by
/// unicast. Anything else is ignored.
pub async fn answer_finds(
    socket: tokio::net::UdpSocket,
    here: impl Fn() -> Discovery + Send + Sync,
) {
    let mut buf = [0u8; 512];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        if let Ok(Discovery::Find { .. }) = serde_json::from_slice(&buf[..n]) {
            if let Ok(reply) = serde_json::to_vec(&here()) {
                let _ = socket.send_to(&reply, from).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_parse_as_typed_and_debug_hides_the_password() {
        let c = Code::generate();
        let shown = c.to_string();
        assert_eq!(Code::parse(&shown).unwrap(), c);
        assert_eq!(Code::parse(&shown.replace('-', " ")).unwrap(), c);
        assert!(!format!("{c:?}").contains(&shown[4..8]), "{c:?}");
        for bad in [
            "",
            "12-3456-7890",
            "123-4567-890a",
            "1234-5678",
            "123-4567-8901-2",
        ] {
            assert!(
                matches!(Code::parse(bad), Err(JoinError::BadCode(_))),
                "{bad}"
            );
        }
    }

    fn keys(a: &Code, b: &Code) -> (Keys, Keys) {
        let (pa, ma) = Pake::start(a);
        let (pb, mb) = Pake::start(b);
        (pa.finish(&mb).unwrap(), pb.finish(&ma).unwrap())
    }

    /// The same code gives both sides one key (each confirms the other's proof and opens
    /// what the other sealed); a code one digit off does not, and the proofs say so.
    #[test]
    fn one_code_one_key_and_a_wrong_code_is_found() {
        let c = Code::parse("417-2093-8861").unwrap();
        let (d, r) = keys(&c, &c);
        assert!(r.check(Side::Device, &d.confirm(Side::Device)));
        assert!(d.check(Side::Router, &r.confirm(Side::Router)));
        assert!(
            !r.check(Side::Device, &d.confirm(Side::Router)),
            "the sides' proofs differ"
        );
        assert_eq!(d.open(&r.seal(b"secret")).unwrap(), b"secret");
        let mut tampered = r.seal(b"secret");
        tampered[0] ^= 1;
        assert!(d.open(&tampered).is_err());

        let wrong = Code::parse("417-2093-8862").unwrap();
        let (d, r) = keys(&wrong, &c);
        assert!(!r.check(Side::Device, &d.confirm(Side::Device)));
        assert!(d.open(&r.seal(b"secret")).is_err());
        // Another nameplate with the same password is another exchange.
        let other = Code::parse("418-2093-8861").unwrap();
        let (d, r) = keys(&other, &c);
        assert!(!r.check(Side::Device, &d.confirm(Side::Device)));
    }

    #[tokio::test]
    async fn a_length_over_the_cap_is_refused_before_allocation() {
        let mut bytes: &[u8] = &[0xff, 0xff, 0xff, 0xff];
        let got: Result<Confirm, _> = receive(&mut bytes).await;
        assert!(matches!(got, Err(JoinError::Malformed(m)) if m.contains("at most")));
        let mut bytes: &[u8] = &[0, 0, 0, 2, b'{', b'}'];
        let got: Result<Confirm, _> = receive(&mut bytes).await;
        assert!(matches!(got, Err(JoinError::Malformed(_))));
    }

    /// A router's answer reaches a device that broadcast on loopback, and an answer the
    /// device does not want (another pairing) is passed over until the deadline.
    #[tokio::test]
    async fn a_find_is_answered_by_unicast() {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = socket.local_addr().unwrap().port();
        tokio::spawn(answer_finds(socket, || Discovery::Here {
            v: VERSION,
            router: "r1".into(),
            join_port: 9,
            pairing: Some("417".into()),
        }));
        let lo = [IpAddr::V4(Ipv4Addr::LOCALHOST)];
        let at = find(&lo, port, Duration::from_secs(5), |_, p| p == Some("417"))
            .await
            .unwrap();
        assert_eq!(at, "127.0.0.1:9".parse().unwrap());
        let none = find(&lo, port, Duration::from_millis(600), |_, p| {
            p == Some("999")
        })
        .await;
        assert!(matches!(none, Err(JoinError::NotFound(_, 1))));
    }
}
