//! Private links: every connection between the devices (the gRPC control plane, V2
//! handoffs, V1 uploads) runs over TLS 1.3 when a shared secret is configured, with keys
//! that come from the secret itself, so a home pair needs no certificate authority.
//!
//! How (rustls with ring; no cryptography of ours):
//! - Both sides derive the same Ed25519 key from the secret (HMAC-SHA256 of the secret
//!   under a label of its own, used as the key's seed) and wrap it in the same
//!   self-signed certificate (rcgen; every field fixed, so the certificate's bytes are a
//!   function of the secret alone).
//! - Each side presents that certificate and accepts exactly that certificate from its
//!   peer (the server asks for a client certificate): a peer proves the secret by signing
//!   the handshake with the derived key. A wrong secret fails the handshake on both sides.
//! - TLS 1.3 only: ephemeral key exchange (forward secrecy), every record authenticated
//!   (AEAD), fresh randoms on both sides, so a recorded handshake cannot be replayed.
//!
//! Without a secret a [`Link`] is plain TCP (the demo on loopback). The
//! application-level authentication (V2 challenge-response, the V1 and gRPC credentials)
//! stays on inside TLS: it costs little. The states' own digests do not: inside TLS, whose
//! AEAD has authenticated every byte, they are 32 zero bytes (`frame::Check::Sealed`).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::auth::Secret;

/// The label of the key derivation; a new one gives every secret a new key.
const KEY_LABEL: &str = "edgesplit link key v1";
/// The name in the certificate and the one the client asks for (not checked: the pinned
/// key is the identity).
const NAME: &str = "edgesplit";
/// How often a gRPC channel pings its peer, and how long it waits for the answer before
/// it takes the connection for dead.
const KEEPALIVE: Duration = Duration::from_secs(5);
/// Handshakes in progress at once on one listener; more wait for a slot.
const MAX_HANDSHAKES: usize = 64;

/// What the nodes' and the router's connections to each other run over.
#[derive(Clone, Default)]
pub struct Link {
    secret: Option<Arc<Secret>>,
    tls: Option<Tls>,
}

#[derive(Clone)]
struct Tls {
    /// The certificate both sides present and pin.
    identity: CertificateDer<'static>,
    acceptor: tokio_rustls::TlsAcceptor,
    connector: tokio_rustls::TlsConnector,
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_private() {
            "Link(private)"
        } else {
            "Link(plain)"
        })
    }
}

/// The derived key's certificate could not be built (never seen: every input is fixed).
#[derive(Debug, thiserror::Error)]
#[error("private link set-up failed: {0}")]
pub struct LinkError(String);

impl Link {
    /// Plain TCP: no secret configured.
    #[must_use]
    pub fn plain() -> Link {
        Link::default()
    }

    /// A private link keyed by `secret`; plain when there is none.
    ///
    /// # Errors
    /// The certificate or the TLS configuration could not be built.
    pub fn new(secret: Option<Arc<Secret>>) -> Result<Link, LinkError> {
        let Some(secret) = secret else {
            return Ok(Link::plain());
        };
        let fail = |e: &dyn std::fmt::Display| LinkError(e.to_string());
        // RFC 8410's PKCS#8 encoding of an Ed25519 private key: a fixed prefix, then the
        // 32-byte seed.
        let mut pkcs8 = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        pkcs8.extend_from_slice(&secret.mac(KEY_LABEL, &[]));
        let pkcs8 = PrivatePkcs8KeyDer::from(pkcs8);
        let key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
            .map_err(|e| fail(&e))?;
        let cert = rcgen::CertificateParams::new(vec![NAME.to_string()])
            .and_then(|p| p.self_signed(&key))
            .map_err(|e| fail(&e))?
            .der()
            .clone();
        // TLS 1.3's AES-128-GCM alone: 128-bit security, and on this machine ~10% faster
        // than AES-256-GCM for a 48 MB state over loopback (AES-NI either way).
        let provider = Arc::new(rustls::crypto::CryptoProvider {
            cipher_suites: vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256],
            ..rustls::crypto::ring::default_provider()
        });
        let identity = cert.clone();
        let pinned = Arc::new(Pinned {
            cert: cert.clone(),
            algorithms: provider.signature_verification_algorithms,
        });
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| fail(&e))?
            .with_client_cert_verifier(pinned.clone())
            .with_single_cert(vec![cert.clone()], PrivateKeyDer::Pkcs8(pkcs8.clone_key()))
            .map_err(|e| fail(&e))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| fail(&e))?
            .dangerous()
            .with_custom_certificate_verifier(pinned)
            .with_client_auth_cert(vec![cert], PrivateKeyDer::Pkcs8(pkcs8))
            .map_err(|e| fail(&e))?;
        let client = Arc::new(client);
        Ok(Link {
            secret: Some(secret),
            tls: Some(Tls {
                identity,
                acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
                connector: tokio_rustls::TlsConnector::from(client.clone()),
                client,
            }),
        })
    }

    /// The link to the device that joined with a code under `id`, keyed by its own key
    /// ([`Secret::device`]); this link itself for an empty id (a node keyed by the
    /// household's secret) or a plain link.
    ///
    /// # Errors
    /// The certificate or the TLS configuration could not be built.
    pub fn device(&self, id: &str) -> Result<Link, LinkError> {
        match &self.secret {
            Some(s) if !id.is_empty() => Link::new(Some(Arc::new(s.device(id)))),
            _ => Ok(self.clone()),
        }
    }

    /// Whether connections are encrypted and authenticated by TLS.
    #[must_use]
    pub fn is_private(&self) -> bool {
        self.tls.is_some()
    }

    /// A short fingerprint of the pinned key (SHA-256 of its certificate, 8 bytes in hex),
    /// which the services log at start: two devices that show the same one share the
    /// secret. `None` when plain.
    #[must_use]
    pub fn fingerprint(&self) -> Option<String> {
        use sha2::Digest;
        self.tls
            .as_ref()
            .map(|t| hex::encode(&sha2::Sha256::digest(t.identity.as_ref())[..8]))
    }

    /// The shared secret, for the checks made inside the connection.
    #[must_use]
    pub fn secret(&self) -> Option<&Secret> {
        self.secret.as_deref()
    }

    /// The shared secret, shared.
    #[must_use]
    pub fn secret_arc(&self) -> Option<Arc<Secret>> {
        self.secret.clone()
    }

    /// The server side of a connection: the TLS handshake when private.
    ///
    /// # Errors
    /// The handshake failed (a peer without the secret, a plaintext client, a broken
    /// connection).
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<LinkStream> {
        tcp.set_nodelay(true).ok();
        match &self.tls {
            None => Ok(LinkStream::Plain(tcp)),
            Some(t) => t
                .acceptor
                .accept(tcp)
                .await
                .map(|s| LinkStream::Server(Box::new(s)))
                .map_err(explained),
        }
    }

    /// The client side of a connection: the TLS handshake when private.
    ///
    /// # Errors
    /// The handshake failed (a peer without the secret or without TLS).
    pub async fn connect(&self, tcp: TcpStream) -> io::Result<LinkStream> {
        tcp.set_nodelay(true).ok();
        match &self.tls {
            None => Ok(LinkStream::Plain(tcp)),
            Some(t) => t
                .connector
                .connect(ServerName::try_from(NAME).expect("a valid name"), tcp)
                .await
                .map(|s| LinkStream::Client(Box::new(s)))
                .map_err(explained),
        }
    }

    /// Connects to `addr` within `timeout` (the TCP connect and the handshake together).
    ///
    /// # Errors
    /// Connect failure, the handshake's, or the deadline.
    pub async fn dial(&self, addr: &str, timeout: Duration) -> io::Result<LinkStream> {
        tokio::time::timeout(timeout, async {
            let tcp = TcpStream::connect(addr).await?;
            self.connect(tcp).await
        })
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect to {addr}: timed out"),
            )
        })?
    }

    /// Accepts on `listener` in a task of its own, each connection's handshake in a task
    /// of its own bounded by `handshake` (a slow or silent peer holds up no other), and
    /// hands out the connections whose handshake succeeded. Failed handshakes are logged
    /// and dropped. The task ends when the [`Accepted`] is dropped.
    #[must_use]
    pub fn listen(&self, listener: TcpListener, handshake: Duration) -> Accepted {
        let local = listener.local_addr().ok();
        let (tx, rx) = tokio::sync::mpsc::channel(MAX_HANDSHAKES);
        let link = self.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = tx.closed() => return,
                    a = listener.accept() => a,
                };
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: pause rather than spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if !link.is_private() {
                    // No handshake: handed out at once, in order.
                    let Ok(plain) = link.accept(tcp).await else {
                        continue;
                    };
                    if tx.send((plain, peer)).await.is_err() {
                        return;
                    }
                    continue;
                }
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (link, tx) = (link.clone(), tx.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(handshake, link.accept(tcp)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => tracing::warn!(%peer, error = %e, "connection refused"),
                        Err(_) => tracing::warn!(
                            %peer,
                            "connection refused: no private link handshake within {handshake:?}"
                        ),
                    }
                });
            }
        });
        Accepted { rx, local }
    }

    /// A gRPC channel to `url` (`http://host:port`) over this link, connected on first use.
    ///
    /// # Errors
    /// The URL is not valid.
    pub fn grpc_channel(
        &self,
        url: &str,
        connect_timeout: Duration,
    ) -> Result<tonic::transport::Channel, tonic::transport::Error> {
        // HTTP/2 pings find a connection that died without a word (the laptop's or the
        // phone's address changed, a Wi-Fi that dropped the device): the channel then
        // connects again at its next call instead of waiting on it.
        let endpoint = tonic::transport::Endpoint::from_shared(url.to_string())?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE)
            .keep_alive_while_idle(true);
        if !self.is_private() {
            return Ok(endpoint.connect_lazy());
        }
        let link = self.clone();
        let connector = tower::service_fn(move |uri: tonic::codegen::http::Uri| {
            let link = link.clone();
            async move {
                // `host()` keeps an IPv6 address's brackets, as `host:port` needs them.
                let host = uri.host().unwrap_or_default();
                let addr = format!("{host}:{}", uri.port_u16().unwrap_or(80));
                link.dial(&addr, connect_timeout)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        });
        Ok(endpoint.connect_with_connector_lazy(connector))
    }

    /// An HTTP client for V1 uploads over this link: TLS with the pinned key when
    /// private (the upload URL's scheme is then `https`, [`Link::upload_url`]).
    pub fn http_client(&self, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        match &self.tls {
            None => builder,
            Some(t) => builder.use_preconfigured_tls((*t.client).clone()),
        }
    }

    /// `url` with the scheme this link speaks (`https` when private, `http` when not),
    /// whatever the decode node advertised: the link, not the peer, decides whether the
    /// state crosses in the clear.
    #[must_use]
    pub fn upload_url(&self, url: &str) -> String {
        let rest = url
            .strip_prefix("https://")
            .or_else(|| url.strip_prefix("http://"))
            .unwrap_or(url);
        let scheme = if self.is_private() { "https" } else { "http" };
        format!("{scheme}://{rest}")
    }
}

/// A failed handshake's error, told apart: a [`HandshakeFailed`] when what failed says the
/// two devices are configured differently (the peer's key is not ours, the peer refused
/// ours, the peer does not speak TLS); otherwise the error as it came (a broken or
/// corrupted connection, which a retry or a fallback may get past).
fn explained(e: io::Error) -> io::Error {
    use rustls::AlertDescription as A;
    let why = match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidCertificate(CertificateError::Other(_))) => {
            Some(NotOurSecret.to_string())
        }
        Some(rustls::Error::AlertReceived(
            a @ (A::BadCertificate
            | A::CertificateUnknown
            | A::CertificateRequired
            | A::AccessDenied),
        )) => Some(format!(
            "the peer refused this device's key ({a:?}): different secrets?"
        )),
        Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)) => {
            Some("the peer does not speak TLS (no shared secret configured there?)".into())
        }
        _ => None,
    };
    match why {
        Some(why) => io::Error::new(e.kind(), HandshakeFailed(why)),
        None => io::Error::new(e.kind(), format!("private link handshake failed: {e}")),
    }
}

/// A private link's handshake failed: the peers do not share the secret (or one has none).
/// The error inside the `io::Error`s of [`Link`]'s connections, so that a caller can tell
/// a misconfiguration from an outage ([`HandshakeFailed::find`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "private link handshake failed: {0} (both devices need the same shared secret, and both \
     must have one)"
)]
pub struct HandshakeFailed(String);

impl HandshakeFailed {
    /// The handshake failure somewhere in `e`'s chain of sources.
    #[must_use]
    pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a HandshakeFailed> {
        let mut cur = Some(e);
        while let Some(err) = cur {
            if let Some(h) = err.downcast_ref::<HandshakeFailed>() {
                return Some(h);
            }
            if let Some(h) = err
                .downcast_ref::<io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<HandshakeFailed>())
            {
                return Some(h);
            }
            cur = err.source();
        }
        None
    }
}

/// The peer must present exactly the certificate derived from our secret.
#[derive(Debug)]
struct Pinned {
    cert: CertificateDer<'static>,
    algorithms: WebPkiSupportedAlgorithms,
}

/// Why a peer's certificate was refused.
#[derive(Debug, thiserror::Error)]
#[error(
    "the peer's key is not the one derived from this device's shared secret (different secrets?)"
)]
struct NotOurSecret;

impl Pinned {
    fn check(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
    ) -> Result<(), rustls::Error> {
        if intermediates.is_empty() && end_entity.as_ref() == self.cert.as_ref() {
            Ok(())
        } else {
            Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                rustls::OtherError(Arc::new(NotOurSecret)),
            )))
        }
    }

    fn signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }
}

/// TLS 1.2 is not offered; a 1.2 signature is never asked for.
fn no_tls12() -> rustls::Error {
    rustls::Error::General("TLS 1.2 is not used on EdgeSplit links".into())
}

/// The signature methods both verifier traits have, the same for both: TLS 1.3 with the
/// derived Ed25519 key only.
macro_rules! signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(no_tls12())
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            vec![SignatureScheme::ED25519]
        }
    };
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity, intermediates)
            .map(|()| ServerCertVerified::assertion())
    }

    signatures!();
}

impl ClientCertVerifier for Pinned {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity, intermediates)
            .map(|()| ClientCertVerified::assertion())
    }

    signatures!();
}

/// A connection over a [`Link`]: plain TCP, or TLS on either side.
pub enum LinkStream {
    Plain(TcpStream),
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl LinkStream {
    /// The TCP connection underneath.
    #[must_use]
    pub fn tcp(&self) -> &TcpStream {
        match self {
            LinkStream::Plain(s) => s,
            LinkStream::Server(s) => s.get_ref().0,
            LinkStream::Client(s) => s.get_ref().0,
        }
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            LinkStream::Plain($s) => $e,
            LinkStream::Server($s) => $e,
            LinkStream::Client($s) => $e,
        }
    };
}

impl AsyncRead for LinkStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        each!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for LinkStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        each!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        each!(self, s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            LinkStream::Plain(s) => s.is_write_vectored(),
            LinkStream::Server(s) => s.is_write_vectored(),
            LinkStream::Client(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

impl tonic::transport::server::Connected for LinkStream {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.tcp().connect_info()
    }
}

/// The connections a [`Link::listen`] accepted, handshake done: a stream for tonic's
/// `serve_with_incoming*` and a listener for `axum::serve`.
pub struct Accepted {
    rx: tokio::sync::mpsc::Receiver<(LinkStream, SocketAddr)>,
    local: Option<SocketAddr>,
}

impl Accepted {
    /// The next connection; `None` once the accepting task has ended.
    pub async fn next(&mut self) -> Option<(LinkStream, SocketAddr)> {
        self.rx.recv().await
    }
}

impl futures::Stream for Accepted {
    type Item = io::Result<LinkStream>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|c| c.map(|(s, _)| Ok(s)))
    }
}

impl axum::serve::Listener for Accepted {
    type Io = LinkStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accepting task never ends while this is alive; wait as a listener would.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.local
            .ok_or_else(|| io::Error::other("the listener's address is unknown"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const WAIT: Duration = Duration::from_secs(5);

    fn private(s: &str) -> Link {
        Link::new(Some(Arc::new(Secret::new(s.as_bytes(), "test").unwrap()))).unwrap()
    }

    async fn bound() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap().to_string();
        (l, a)
    }

    /// A relay to `target` that records what the client sent and, once `flip_at` is set,
    /// flips the client's byte at that offset.
    struct Relay {
        addr: String,
        from_client: Arc<Mutex<Vec<u8>>>,
        flip_at: Arc<AtomicUsize>,
    }

    async fn relay(target: String) -> Relay {
        let (l, addr) = bound().await;
        let from_client = Arc::new(Mutex::new(Vec::new()));
        let flip_at = Arc::new(AtomicUsize::new(usize::MAX));
        let (rec, flip) = (from_client.clone(), flip_at.clone());
        tokio::spawn(async move {
            let (client, _) = l.accept().await.unwrap();
            let server = TcpStream::connect(target).await.unwrap();
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            });
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match cr.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let at = {
                    let mut r = rec.lock().unwrap();
                    let at = r.len();
                    r.extend_from_slice(&buf[..n]);
                    at
                };
                let f = flip.load(Ordering::SeqCst);
                if (at..at + n).contains(&f) {
                    buf[f - at] ^= 0x01;
                }
                if sw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        });
        Relay {
            addr,
            from_client,
            flip_at,
        }
    }

    /// A connection from `client` to a listener of `server`'s through a [`relay`]: the
    /// relay, the client's side and the server's, handshakes done.
    async fn through_relay(server: &Link, client: &Link) -> (Relay, LinkStream, LinkStream) {
        let (l, target) = bound().await;
        let r = relay(target).await;
        let mut incoming = server.listen(l, WAIT);
        let c = dial(client, &r.addr).await.unwrap();
        let (s, _) = incoming.next().await.unwrap();
        (r, c, s)
    }

    async fn dial(link: &Link, addr: &str) -> io::Result<LinkStream> {
        link.dial(addr, WAIT).await
    }

    #[tokio::test]
    async fn the_same_secret_carries_bytes_both_ways_encrypted() {
        // Two links made apart from the same secret.
        let (server, client) = (private("the shared secret"), private("the shared secret"));
        let (r, mut c, mut s) = through_relay(&server, &client).await;
        c.write_all(b"a prompt about the moons of Jupiter")
            .await
            .unwrap();
        let mut got = [0u8; 35];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"a prompt about the moons of Jupiter");
        s.write_all(b"Io and Europa").await.unwrap();
        let mut back = [0u8; 13];
        c.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"Io and Europa");
        let sent = r.from_client.lock().unwrap().clone();
        assert!(sent.len() > 35);
        assert!(
            !sent.windows(6).any(|w| w == b"prompt"),
            "plaintext on the wire"
        );
    }

    #[tokio::test]
    async fn another_secret_fails_the_handshake_on_both_sides() {
        let (l, addr) = bound().await;
        let server = private("the shared secret");
        let accepted = tokio::spawn(async move {
            let (tcp, _) = l.accept().await.unwrap();
            server.accept(tcp).await
        });
        let err = dial(&private("another secret!!"), &addr)
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("not the one derived"), "{err}");
        // Told apart from a broken connection: a misconfiguration, not an outage.
        assert!(HandshakeFailed::find(&err).is_some(), "{err:?}");
        let err = accepted.await.unwrap().err().unwrap();
        assert!(
            err.to_string().contains("refused this device's key"),
            "{err}"
        );
        assert!(HandshakeFailed::find(&err).is_some(), "{err:?}");
    }

    #[tokio::test]
    async fn a_device_key_reaches_that_device_only() {
        let home = private("the shared secret");
        // The prefill node's link to device d1 and d1's own (its key received at the join,
        // read from its file) handshake; the household's link and another device's do not.
        let d1 = home.device("d1").unwrap();
        let on_device = Link::new(Some(Arc::new(
            Secret::new(home.secret().unwrap().device("d1").bytes(), "file").unwrap(),
        )))
        .unwrap();
        assert_eq!(d1.fingerprint(), on_device.fingerprint());
        let (_r, mut c, mut s) = through_relay(&on_device, &d1).await;
        c.write_all(b"state").await.unwrap();
        let mut got = [0u8; 5];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"state");
        for (who, client) in [
            ("household", home.clone()),
            ("d2", home.device("d2").unwrap()),
        ] {
            let (l, addr) = bound().await;
            let server = on_device.clone();
            let accepted = tokio::spawn(async move {
                let (tcp, _) = l.accept().await.unwrap();
                server.accept(tcp).await
            });
            let err = dial(&client, &addr).await.err();
            assert!(err.is_some(), "{who}'s key reached device d1");
            assert!(accepted.await.unwrap().is_err(), "{who}");
        }
        // An empty id is the household's own link; a plain link stays plain.
        assert_eq!(home.device("").unwrap().fingerprint(), home.fingerprint());
        assert!(!Link::plain().device("d1").unwrap().is_private());
    }

    #[tokio::test]
    async fn a_plaintext_peer_is_refused_either_way() {
        // A plain client against a private listener: nothing is handed out, and the
        // client's bytes get no answer but the end of the connection.
        let (l, addr) = bound().await;
        let mut incoming = private("the shared secret").listen(l, WAIT);
        let mut c = dial(&Link::plain(), &addr).await.unwrap();
        c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let _ = c.read_to_end(&mut buf).await;
        assert!(!buf.windows(4).any(|w| w == b"HTTP"), "{buf:?}");
        assert!(
            tokio::time::timeout(Duration::from_millis(300), incoming.next())
                .await
                .is_err(),
            "a plaintext connection was handed out"
        );
        // A private client against a plain listener.
        let (l, addr) = bound().await;
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        });
        let err = dial(&private("the shared secret"), &addr)
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("handshake failed"), "{err}");
    }

    #[tokio::test]
    async fn a_replayed_handshake_is_refused() {
        let link = private("the shared secret");
        let (r, mut c, mut s) = through_relay(&link, &link).await;
        c.write_all(b"take this state").await.unwrap();
        let mut got = [0u8; 15];
        s.read_exact(&mut got).await.unwrap();
        let recorded = r.from_client.lock().unwrap().clone();
        // The recorded client bytes, replayed on a new connection: the server's fresh
        // random and key share make the old Finished wrong.
        let (l2, addr2) = bound().await;
        let server = link.clone();
        let accepted = tokio::spawn(async move {
            let (tcp, _) = l2.accept().await.unwrap();
            server.accept(tcp).await
        });
        let mut replay = TcpStream::connect(addr2).await.unwrap();
        replay.write_all(&recorded).await.unwrap();
        let err = tokio::time::timeout(WAIT, accepted)
            .await
            .unwrap()
            .unwrap()
            .err()
            .expect("the replay was accepted");
        assert!(err.to_string().contains("handshake failed"), "{err}");
    }

    #[tokio::test]
    async fn a_flipped_byte_is_refused_not_delivered() {
        let link = private("the shared secret");
        // The server side is handed out once the client's last handshake byte arrived.
        let (r, mut c, mut s) = through_relay(&link, &link).await;
        let seen = r.from_client.lock().unwrap().len();
        r.flip_at.store(seen + 40, Ordering::SeqCst);
        c.write_all(&[7u8; 1000]).await.unwrap();
        let mut got = vec![0u8; 1000];
        let err = s
            .read_exact(&mut got)
            .await
            .expect_err("corrupted data was read");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
    }

    #[test]
    fn the_key_is_a_function_of_the_secret() {
        let cert = |s: &str| private(s).tls.unwrap().identity;
        // Two devices with the same secret present the same certificate (the pinned
        // identity); another secret gives another.
        assert_eq!(cert("the shared secret"), cert("the shared secret"));
        assert_eq!(
            private("the shared secret").fingerprint(),
            private("the shared secret").fingerprint()
        );
        assert_eq!(Link::plain().fingerprint(), None);
        assert_ne!(cert("the shared secret"), cert("the shared secreT"));
        assert!(!Link::plain().is_private());
        assert!(Link::new(None).unwrap().secret().is_none());
    }
}
