//! The shared secret and the HMAC-SHA256 messages built from it.
//!
//! Nodes and the router share one secret, read from a file (`--secret-file`, or the
//! `EDGESPLIT_SECRET_FILE` variable) or from the `EDGESPLIT_SECRET` variable - never from a
//! flag, which `ps` would show. Every MAC here is over a domain label and length-prefixed
//! parts, so no message of one kind can be replayed as another. Where it is used:
//! - V2 handshake: challenge-response both ways with fresh 32-byte nonces, then the STATE
//!   checksum is an HMAC under a key derived from both nonces (`proto/PROTOCOL.md`);
//! - V1 upload and gRPC calls: a [`Token`] header (time, nonce, MAC), checked against a
//!   time window and a cache of recently seen nonces ([`ReplayGuard`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

/// Shortest secret accepted.
pub const MIN_SECRET_BYTES: usize = 16;
/// The label of a joined device's own key ([`Secret::device`]).
const DEVICE_KEY_LABEL: &str = "edgesplit device key v1";
/// How far a token's time may be from ours.
pub const TOKEN_WINDOW: Duration = Duration::from_secs(120);

/// The shared secret.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Why a secret could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the secret file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the shared secret from {from} is {len} bytes; at least {MIN_SECRET_BYTES} are required (e.g. `openssl rand -hex 32 > secret`)")]
    TooShort { from: String, len: usize },
}

impl Secret {
    /// A secret from bytes (surrounding whitespace, e.g. a file's newline, is dropped).
    ///
    /// # Errors
    /// Fewer than [`MIN_SECRET_BYTES`] bytes.
    pub fn new(bytes: &[u8], from: &str) -> Result<Secret, SecretError> {
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < MIN_SECRET_BYTES {
            return Err(SecretError::TooShort {
                from: from.to_string(),
                len: trimmed.len(),
            });
        }
        Ok(Secret(trimmed.to_vec()))
    }

    /// The configured secret: `file` if given, else `EDGESPLIT_SECRET_FILE`, else
    /// `EDGESPLIT_SECRET`; `None` when none is set (links unauthenticated).
    ///
    /// # Errors
    /// An unreadable file, or a secret too short.
    pub fn load(file: Option<&Path>) -> Result<Option<Secret>, SecretError> {
        let file = file
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("EDGESPLIT_SECRET_FILE").map(Into::into));
        if let Some(path) = file {
            let bytes = std::fs::read(&path).map_err(|source| SecretError::Read {
                path: path.display().to_string(),
                source,
            })?;
            return Secret::new(&bytes, &path.display().to_string()).map(Some);
        }
        match std::env::var("EDGESPLIT_SECRET") {
            Ok(v) if !v.is_empty() => Secret::new(v.as_bytes(), "EDGESPLIT_SECRET").map(Some),
            _ => Ok(None),
        }
    }

    /// The secret's bytes: only for handing a device's own key ([`Secret::device`]) to the
    /// device that proved a join code (`join.rs`, sealed under the code's key).
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// Device `id`'s own key, derived from this (the household's) secret: HMAC-SHA256
    /// under a label of its own and the id, as 64 hex characters. A device that joined
    /// with a code holds this, never the household's secret; the router and the prefill
    /// node derive it to reach that device. From it neither the household's secret nor
    /// another device's key can be computed, so a removed device's key opens nothing the
    /// router still dials, and announces under its id are refused by the registry.
    #[must_use]
    pub fn device(&self, id: &str) -> Secret {
        Secret(hex::encode(self.mac(DEVICE_KEY_LABEL, &[id.as_bytes()])).into_bytes())
    }

    fn hmac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    /// HMAC-SHA256 over a label and length-prefixed parts.
    #[must_use]
    pub fn mac(&self, label: &str, parts: &[&[u8]]) -> [u8; 32] {
        let mut m = self.hmac();
        feed(&mut m, label, parts);
        m.finalize().into_bytes().into()
    }

    /// Constant-time check of [`Secret::mac`].
    #[must_use]
    pub fn verify(&self, label: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut m = self.hmac();
        feed(&mut m, label, parts);
        m.verify_slice(tag).is_ok()
    }
}

fn feed(m: &mut Hmac<Sha256>, label: &str, parts: &[&[u8]]) {
    m.update(&(label.len() as u64).to_le_bytes());
    m.update(label.as_bytes());
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
}

/// 32 random bytes (rand's thread generator: ChaCha12 seeded from the operating system).
#[must_use]
pub fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    rand::rng().fill_bytes(&mut n);
    n
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A per-message credential for HTTP and gRPC: `t=<unix s>,n=<nonce hex>,mac=<hex>`, the
/// MAC over the label, the time, the nonce and the message's own bound fields.
pub struct Token;

impl Token {
    /// A fresh token for `label` and `bound` (e.g. a handoff id and the body's SHA-256).
    #[must_use]
    pub fn make(secret: &Secret, label: &str, bound: &[&[u8]]) -> String {
        let t = unix_now();
        let n = nonce();
        let mac = token_mac(secret, label, t, &n, bound);
        format!("t={t},n={},mac={}", hex::encode(n), hex::encode(mac))
    }

    /// Checks a token: well-formed, MAC valid, time within [`TOKEN_WINDOW`], nonce unseen.
    ///
    /// # Errors
    /// Why it is refused, for the peer.
    pub fn check(
        secret: &Secret,
        label: &str,
        bound: &[&[u8]],
        token: &str,
        guard: &ReplayGuard,
    ) -> Result<(), String> {
        let mut t = None;
        let mut n = None;
        let mut mac = None;
        for field in token.split(',') {
            match field.split_once('=') {
                Some(("t", v)) => t = v.parse::<u64>().ok(),
                Some(("n", v)) => n = hex::decode(v).ok().filter(|b| b.len() == 32),
                Some(("mac", v)) => mac = hex::decode(v).ok().filter(|b| b.len() == 32),
                _ => return Err("malformed credential".into()),
            }
        }
        let (Some(t), Some(n), Some(mac)) = (t, n, mac) else {
            return Err("malformed credential: want t=<unix s>,n=<64 hex>,mac=<64 hex>".into());
        };
        let mut m = secret.hmac();
        feed_owned(&mut m, label, &token_parts(t, &n, bound));
        if m.verify_slice(&mac).is_err() {
            return Err(
                "authentication failed: the credential was not made with our secret".into(),
            );
        }
        let now = unix_now();
        if now.abs_diff(t) > TOKEN_WINDOW.as_secs() {
            return Err(format!(
                "credential expired or from the future: its time is {t}, ours {now} (window {} s); check the clocks",
                TOKEN_WINDOW.as_secs()
            ));
        }
        if !guard.first_use(&n, now) {
            return Err("credential replayed: its nonce was used before".into());
        }
        Ok(())
    }
}

fn token_parts<'a>(t: u64, n: &'a [u8], bound: &[&'a [u8]]) -> Vec<Vec<u8>> {
    let mut v = vec![t.to_le_bytes().to_vec(), n.to_vec()];
    v.extend(bound.iter().map(|b| b.to_vec()));
    v
}

fn token_mac(secret: &Secret, label: &str, t: u64, n: &[u8], bound: &[&[u8]]) -> [u8; 32] {
    let parts = token_parts(t, n, bound);
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    secret.mac(label, &refs)
}

fn feed_owned(m: &mut Hmac<Sha256>, label: &str, parts: &[Vec<u8>]) {
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    feed(m, label, &refs);
}

/// Nonces seen within twice the token window; a second use is a replay.
#[derive(Default)]
pub struct ReplayGuard {
    seen: Mutex<HashMap<[u8; 32], u64>>,
}

/// Most nonces remembered; beyond it, new tokens are refused until old ones expire.
const MAX_NONCES: usize = 100_000;

impl ReplayGuard {
    fn first_use(&self, n: &[u8], now: u64) -> bool {
        let Ok(key) = <[u8; 32]>::try_from(n) else {
            return false;
        };
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.len() >= MAX_NONCES / 2 {
            let horizon = now.saturating_sub(2 * TOKEN_WINDOW.as_secs());
            seen.retain(|_, &mut t| t >= horizon);
        }
        if seen.len() >= MAX_NONCES || seen.contains_key(&key) {
            return false;
        }
        seen.insert(key, now);
        true
    }
}

/// Header (HTTP) and metadata key (gRPC) of a [`Token`].
pub const HEADER: &str = "x-edgesplit-auth";
/// Token label of gRPC calls.
pub const GRPC: &str = "edgesplit grpc";
/// Token label of V1 uploads (bound to the handoff id and the body's length).
pub const V1_UPLOAD: &str = "edgesplit v1 upload";
/// Label of the key of a V1 upload's keyed digest (bound to the handoff id).
pub const V1_DIGEST: &str = "edgesplit v1 digest";

/// Client side of the gRPC control plane: adds a fresh token to every call when a secret
/// is configured.
#[derive(Clone, Default)]
pub struct GrpcCredentials(pub Option<std::sync::Arc<Secret>>);

impl tonic::service::Interceptor for GrpcCredentials {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(secret) = &self.0 {
            let token = Token::make(secret, GRPC, &[]);
            let value = token
                .parse()
                .map_err(|_| tonic::Status::internal("unencodable credential"))?;
            req.metadata_mut().insert(HEADER, value);
        }
        Ok(req)
    }
}

/// Server side of the gRPC control plane: refuses a call without a valid, fresh token
/// (`UNAUTHENTICATED`, code `auth_failed`) before the service sees it.
#[derive(Clone, Default)]
pub struct GrpcGuard {
    pub secret: Option<std::sync::Arc<Secret>>,
    pub seen: std::sync::Arc<ReplayGuard>,
}

impl tonic::service::Interceptor for GrpcGuard {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(secret) = &self.secret else {
            return Ok(req);
        };
        let token = req
            .metadata()
            .get(HEADER)
            .and_then(|v| v.to_str().ok())
            .ok_or("no credential: this node requires the shared secret".to_string())
            .and_then(|t| Token::check(secret, GRPC, &[], t, &self.seen));
        match token {
            Ok(()) => Ok(req),
            Err(why) => Err(crate::error::status(
                tonic::Code::Unauthenticated,
                crate::error::ErrorCode::AuthFailed,
                why,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> Secret {
        Secret::new(s.as_bytes(), "test").unwrap()
    }

    #[test]
    fn short_secrets_are_refused_and_whitespace_dropped() {
        assert!(matches!(
            Secret::new(b"short\n", "f"),
            Err(SecretError::TooShort { len: 5, .. })
        ));
        let a = secret("0123456789abcdef\n");
        let b = secret("0123456789abcdef");
        assert_eq!(a.mac("x", &[b"1"]), b.mac("x", &[b"1"]));
    }

    #[test]
    fn each_device_key_is_its_own_and_reloads_as_written() {
        let home = secret("0123456789abcdef");
        let a = home.device("a1");
        assert_eq!(
            a.bytes(),
            home.device("a1").bytes(),
            "derived alike on both sides"
        );
        assert_ne!(a.bytes(), home.device("a2").bytes());
        assert_ne!(a.bytes(), home.bytes());
        assert_ne!(a.bytes(), secret("another secret!!").device("a1").bytes());
        // Written to the device's secret file and read back, it is the same key.
        assert_eq!(a.bytes().len(), 64);
        assert_eq!(Secret::new(a.bytes(), "file").unwrap().bytes(), a.bytes());
    }

    #[test]
    fn macs_bind_label_and_parts() {
        let k = secret("0123456789abcdef");
        let m = k.mac("label", &[b"ab", b"c"]);
        assert!(k.verify("label", &[b"ab", b"c"], &m));
        assert!(!k.verify("label", &[b"a", b"bc"], &m), "length-prefixed");
        assert!(!k.verify("other", &[b"ab", b"c"], &m));
        assert!(!secret("another secret!!").verify("label", &[b"ab", b"c"], &m));
    }

    #[test]
    fn tokens_check_mac_binding_and_replay() {
        let k = secret("0123456789abcdef");
        let guard = ReplayGuard::default();
        let t = Token::make(&k, "v1", &[b"id-1"]);
        assert_eq!(Token::check(&k, "v1", &[b"id-1"], &t, &guard), Ok(()));
        let again = Token::check(&k, "v1", &[b"id-1"], &t, &guard).unwrap_err();
        assert!(again.contains("replayed"), "{again}");

        let t = Token::make(&k, "v1", &[b"id-1"]);
        assert!(Token::check(&k, "v1", &[b"id-2"], &t, &guard)
            .unwrap_err()
            .contains("authentication failed"));
        assert!(
            Token::check(&secret("wrong secret 123"), "v1", &[b"id-1"], &t, &guard)
                .unwrap_err()
                .contains("authentication failed")
        );
        assert!(Token::check(&k, "v1", &[b"id-1"], "t=1,n=zz", &guard)
            .unwrap_err()
            .contains("malformed"));

        // A valid MAC on a time outside the window.
        let n = nonce();
        let old = unix_now() - 3600;
        let mac = token_mac(&k, "v1", old, &n, &[b"x"]);
        let stale = format!("t={old},n={},mac={}", hex::encode(n), hex::encode(mac));
        assert!(Token::check(&k, "v1", &[b"x"], &stale, &guard)
            .unwrap_err()
            .contains("expired"));
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce(), nonce());
    }
}
