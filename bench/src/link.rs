//! A user-space link emulator: a TCP proxy that adds one-way latency with jitter and caps
//! bandwidth, in both directions, to stand in for the Wi-Fi between a laptop and a phone
//! (this machine's kernel has no netem).
//!
//! Why our own and not a crate: the one Rust port of Toxiproxy (`noxious` 1.0.4) has had no
//! release since April 2021, and Toxiproxy itself (Go) is neither in Debian nor fetchable
//! here. What we need is two of its toxics with the semantics of a real link, which is
//! about a hundred lines:
//! - **bandwidth** as serialisation: a chunk leaves the sender's side of the link when the
//!   link has finished sending everything before it, at `mbit_s`;
//! - **latency** as propagation: each chunk then arrives `one_way_ms` (± up to `jitter_ms`)
//!   later, pipelined - chunks in flight do not wait for each other's delay - and never
//!   overtakes the chunk before it (TCP delivers in order).
//!
//! A sender faster than the link fills a queue of at most [`QUEUE_BYTES`] waiting for the
//! link (a router's buffer), then is pushed back by TCP flow control, as on a real link.
//! Bytes already on the link (bandwidth x delay) are not limited: a real TCP window grows to
//! cover them, and capping them would cap the throughput below the profile's bandwidth.
//! The profile is read per chunk, so one proxy can be switched between profiles while
//! connections (the router's HTTP/2 channel to the decode node) stay open.
//!
//! The one link emulator of the project: the bench's links, and the integration tests'
//! (router/tests/it), which shape each connection as it opens ([`Link::shaped`]) and add
//! [`Faults`] towards the target - a flipped byte, a corrupted V2 LAST frame, a link held
//! still, a connection held back before it is forwarded.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Bytes waiting for the link, per direction, before the sender is pushed back.
pub const QUEUE_BYTES: usize = 256 * 1024;
/// Chunks in flight per direction, a memory bound for unlimited bandwidth.
const MAX_CHUNKS: usize = 1024;
/// Largest chunk read at once.
const CHUNK: usize = 16 * 1024;

/// A link's character.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Profile {
    pub name: String,
    /// Propagation delay each way.
    pub one_way_ms: f64,
    /// Each chunk's delay varies uniformly within ± this.
    pub jitter_ms: f64,
    /// Bandwidth each way; `None` = unlimited.
    pub mbit_s: Option<f64>,
}

impl Profile {
    /// The named profiles.
    pub fn named(name: &str) -> Option<Profile> {
        let (one_way_ms, jitter_ms, mbit_s) = match name {
            "loopback" => (0.0, 0.0, None),
            "wifi" => (25.0, 5.0, Some(100.0)),
            "tailscale-wifi" => (50.0, 10.0, Some(40.0)),
            "slow-wifi" => (50.0, 10.0, Some(10.0)),
            _ => return None,
        };
        Some(Profile {
            name: name.to_string(),
            one_way_ms,
            jitter_ms,
            mbit_s,
        })
    }

    pub fn parse(name: &str) -> Result<Profile, String> {
        Self::named(name).ok_or_else(|| {
            format!("unknown link profile {name:?} (loopback, wifi, tailscale-wifi, slow-wifi)")
        })
    }

    /// Time to put `bytes` on the link.
    fn serialise(&self, bytes: usize) -> Duration {
        match self.mbit_s {
            Some(m) if m > 0.0 => Duration::from_secs_f64(bytes as f64 * 8.0 / (m * 1e6)),
            _ => Duration::ZERO,
        }
    }

    fn delay(&self, rng: &mut impl Rng) -> Duration {
        let j = if self.jitter_ms > 0.0 {
            rng.random_range(-self.jitter_ms..=self.jitter_ms)
        } else {
            0.0
        };
        Duration::from_secs_f64((self.one_way_ms + j).max(0.0) / 1000.0)
    }
}

impl Profile {
    /// No delay, `bytes_per_s` each way (0: unlimited): the tests' links.
    #[must_use]
    pub fn rate(bytes_per_s: u64) -> Profile {
        Profile {
            name: format!("{bytes_per_s} B/s"),
            one_way_ms: 0.0,
            jitter_ms: 0.0,
            mbit_s: (bytes_per_s > 0).then(|| bytes_per_s as f64 * 8.0 / 1e6),
        }
    }
}

/// What a link does to a connection besides timing it (the tests' faults): towards the
/// target only, except `connect_delay`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Flip the byte at this offset of the connection.
    pub corrupt_at: Option<usize>,
    /// Flip the final byte (its checksum's) of every V2 LAST frame.
    pub corrupt_last: bool,
    /// While this says so, nothing more is delivered (checked before every chunk, on
    /// connections already open too).
    pub hold: Option<fn() -> bool>,
    /// Each connection waits this long before it is forwarded (a target gone by then
    /// refuses it as it would have directly).
    pub connect_delay: Duration,
}

/// How a connection through a [`Link::shaped`] is treated, chosen when it opens.
#[derive(Clone, Debug)]
pub struct Shape {
    pub profile: Profile,
    pub faults: Faults,
}

impl Shape {
    /// `bytes_per_s` each way (0: unlimited), no fault.
    #[must_use]
    pub fn rate(bytes_per_s: u64) -> Shape {
        Shape {
            profile: Profile::rate(bytes_per_s),
            faults: Faults::default(),
        }
    }
}

/// A running proxy; change its profile with [`Link::set`].
#[derive(Clone)]
pub struct Link {
    profile: Arc<Mutex<Profile>>,
    /// Where it forwards to: set at start, or later ([`Link::connect`]).
    target: Arc<OnceLock<String>>,
    /// Where clients connect.
    pub addr: std::net::SocketAddr,
}

impl Link {
    /// Listens on a loopback port and forwards every connection to `target`.
    pub async fn start(target: String, profile: Profile) -> std::io::Result<Link> {
        let link = Self::unconnected(profile).await?;
        link.connect(target);
        Ok(link)
    }

    /// Listens on a loopback port for a target known only later ([`Link::connect`]: a
    /// service that reports the address it bound, and must be told the link's address when
    /// it starts); connections that come before it wait for it.
    pub async fn unconnected(profile: Profile) -> std::io::Result<Link> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let profile = Arc::new(Mutex::new(profile));
        let target: Arc<OnceLock<String>> = Arc::default();
        let p = profile.clone();
        tokio::spawn(serve(listener, target.clone(), move || {
            (p.clone(), Faults::default())
        }));
        Ok(Link {
            profile,
            target,
            addr,
        })
    }

    /// Sets where an [`Link::unconnected`] link forwards to (once; later calls do nothing).
    pub fn connect(&self, target: String) {
        let _ = self.target.set(target);
    }

    /// Listens on a loopback port and forwards every connection to `target`, shaped as
    /// `shape()` says when it opens. Returns the address; call it inside a runtime.
    ///
    /// # Panics
    /// When no loopback port can be bound.
    #[must_use]
    pub fn shaped(target: String, shape: fn() -> Shape) -> std::net::SocketAddr {
        let (addr, late) = Self::shaped_unconnected(shape);
        let _ = late.set(target);
        addr
    }

    /// [`Link::shaped`] for a target known only later: set it in the returned cell.
    ///
    /// # Panics
    /// When no loopback port can be bound.
    #[must_use]
    pub fn shaped_unconnected(
        shape: fn() -> Shape,
    ) -> (std::net::SocketAddr, Arc<OnceLock<String>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        l.set_nonblocking(true).expect("a non-blocking listener");
        let addr = l.local_addr().expect("its address");
        let listener = TcpListener::from_std(l).expect("inside a runtime");
        let target: Arc<OnceLock<String>> = Arc::default();
        tokio::spawn(serve(listener, target.clone(), move || {
            let s = shape();
            (Arc::new(Mutex::new(s.profile)), s.faults)
        }));
        (addr, target)
    }

    pub fn set(&self, profile: Profile) {
        *self.profile.lock().expect("profile lock") = profile;
    }
}

/// Accepts connections and forwards each to `target` (waiting for it to be set), as
/// `each()` says when it opens.
async fn serve(
    listener: TcpListener,
    target: Arc<OnceLock<String>>,
    each: impl Fn() -> (Arc<Mutex<Profile>>, Faults) + Send + 'static,
) {
    while let Ok((inbound, _)) = listener.accept().await {
        let target = target.clone();
        let (p, faults) = each();
        tokio::spawn(async move {
            if !faults.connect_delay.is_zero() {
                tokio::time::sleep(faults.connect_delay).await;
            }
            let target = loop {
                match target.get() {
                    Some(t) => break t.clone(),
                    None => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            };
            let Ok(outbound) = TcpStream::connect(&target).await else {
                return;
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::join!(
                pipe(ri, wo, p.clone(), faults),
                pipe(ro, wi, p, Faults::default())
            );
        });
    }
}

/// Follows the V2 frames of one direction to find where each LAST frame ends.
#[derive(Default)]
struct Frames {
    head: Vec<u8>,
    /// Body bytes of the current frame still to come, and whether it is a LAST.
    body: usize,
    last: bool,
}

impl Frames {
    /// Flips the final byte of each LAST frame in `buf` (the next bytes of the stream).
    fn corrupt_last(&mut self, buf: &mut [u8]) {
        use edgesplit_proto::frame::HEADER_LEN;
        let mut i = 0;
        while i < buf.len() {
            if self.body == 0 {
                self.head.push(buf[i]);
                i += 1;
                if self.head.len() == HEADER_LEN {
                    let len: [u8; 4] = self.head[8..12].try_into().expect("4 bytes");
                    self.body = u32::from_le_bytes(len) as usize;
                    self.last = self.head[5] == LAST;
                    self.head.clear();
                }
                continue;
            }
            let n = self.body.min(buf.len() - i);
            self.body -= n;
            i += n;
            if self.body == 0 && self.last {
                buf[i - 1] ^= 0x5a;
            }
        }
    }
}

/// The V2 LAST frame's type byte (PROTOCOL.md).
const LAST: u8 = 9;

/// One direction: read chunks, schedule each, write each at its time.
async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    profile: Arc<Mutex<Profile>>,
    faults: Faults,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(MAX_CHUNKS);
    let reader = async move {
        let mut seen = 0usize;
        let mut frames = Frames::default();
        let mut rng = rand::rngs::StdRng::from_rng(&mut rand::rng());
        let mut link_free = Instant::now();
        let mut last_arrival = Instant::now();
        loop {
            let mut buf = vec![0u8; CHUNK];
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            buf.truncate(n);
            if let Some(at) = faults.corrupt_at.filter(|&at| seen <= at && at < seen + n) {
                buf[at - seen] ^= 0x5a;
            }
            if faults.corrupt_last {
                frames.corrupt_last(&mut buf);
            }
            seen += n;
            let p = profile.lock().expect("profile lock").clone();
            let now = Instant::now();
            link_free = link_free.max(now) + p.serialise(n);
            let arrival = (link_free + p.delay(&mut rng)).max(last_arrival);
            last_arrival = arrival;
            if tx.send((arrival, buf)).await.is_err() {
                break;
            }
            // The queue before the link is full: stop reading until it drains.
            let backlog = link_free.saturating_duration_since(Instant::now());
            let limit = p.serialise(QUEUE_BYTES);
            if backlog > limit {
                tokio::time::sleep(backlog - limit).await;
            }
        }
    };
    let writer = async move {
        while let Some((at, buf)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if let Some(hold) = faults.hold {
                while hold() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            if w.write_all(&buf).await.is_err() {
                return;
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind the link: the round trip of a small message takes two one-way
    /// delays; a large transfer takes its size over the bandwidth.
    #[tokio::test]
    async fn latency_and_bandwidth_are_applied() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let profile = Profile {
            name: "test".into(),
            one_way_ms: 40.0,
            jitter_ms: 0.0,
            mbit_s: Some(80.0),
        };
        let link = Link::start(echo_addr, profile).await.unwrap();
        let mut s = TcpStream::connect(link.addr).await.unwrap();
        let t0 = std::time::Instant::now();
        s.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        s.read_exact(&mut got).await.unwrap();
        let rtt = t0.elapsed();
        assert_eq!(&got, b"ping");
        assert!(rtt >= Duration::from_millis(80), "{rtt:?}");
        assert!(rtt < Duration::from_millis(400), "{rtt:?}");

        // 2 MB at 80 Mbit/s = 200 ms each way (the echo's way back is capped too, but
        // pipelined), plus 80 ms of propagation.
        let data: Vec<u8> = (0..2_000_000u32).map(|i| (i % 251) as u8).collect();
        let (mut r, mut w) = s.into_split();
        let t0 = std::time::Instant::now();
        let send = tokio::spawn({
            let data = data.clone();
            async move { w.write_all(&data).await.unwrap() }
        });
        let mut back = vec![0u8; data.len()];
        r.read_exact(&mut back).await.unwrap();
        send.await.unwrap();
        let took = t0.elapsed();
        assert_eq!(back, data, "bytes arrive intact and in order");
        assert!(took >= Duration::from_millis(270), "{took:?}");
        assert!(took < Duration::from_millis(1500), "{took:?}");

        // One way, 4 MB at 80 Mbit/s is 400 ms on the link plus 40 ms of propagation: the
        // throughput is the profile's, not capped by the data in flight.
        let sink = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sink_addr = sink.local_addr().unwrap().to_string();
        let drained = tokio::spawn(async move {
            let (mut s, _) = sink.accept().await.unwrap();
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.unwrap();
            (buf.len(), std::time::Instant::now())
        });
        let profile = link.profile.lock().unwrap().clone();
        let one_way = Link::start(sink_addr, profile).await.unwrap();
        let mut s = TcpStream::connect(one_way.addr).await.unwrap();
        let t0 = std::time::Instant::now();
        s.write_all(&vec![7u8; 4_000_000]).await.unwrap();
        s.shutdown().await.unwrap();
        let (n, done) = drained.await.unwrap();
        let took = done - t0;
        assert_eq!(n, 4_000_000);
        assert!(took >= Duration::from_millis(430), "{took:?}");
        assert!(
            took < Duration::from_millis(600),
            "{took:?}: below the profile's bandwidth"
        );

        // Switching the profile takes effect at once.
        link.set(Profile::named("loopback").unwrap());
        drop(r);
        let mut s = TcpStream::connect(link.addr).await.unwrap();
        let t0 = std::time::Instant::now();
        s.write_all(b"pong").await.unwrap();
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        assert!(t0.elapsed() < Duration::from_millis(80));
    }

    /// A sink behind a shaped link: what arrived, and when the connection ended.
    async fn through(shape: fn() -> Shape, data: &[u8]) -> (Vec<u8>, Duration) {
        let sink = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = sink.local_addr().unwrap().to_string();
        let got = tokio::spawn(async move {
            let (mut s, _) = sink.accept().await.unwrap();
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.unwrap();
            (buf, std::time::Instant::now())
        });
        let addr = Link::shaped(target, shape);
        let t0 = std::time::Instant::now();
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(data).await.unwrap();
        s.shutdown().await.unwrap();
        let (buf, done) = got.await.unwrap();
        (buf, done - t0)
    }

    /// 400 kB at 1 MB/s: 400 ms. A link idle for a while before saves no credit: the same
    /// bytes after a pause take as long again (the tests' shaper once saved it, which hid
    /// a bug).
    #[tokio::test]
    async fn a_rate_is_a_serial_link_with_no_credit_for_idle_time() {
        let data = vec![3u8; 400_000];
        let (got, took) = through(|| Shape::rate(1_000_000), &data).await;
        assert_eq!(got, data);
        assert!(took >= Duration::from_millis(390), "{took:?}");
        assert!(took < Duration::from_millis(900), "{took:?}");
        // One connection: a burst, an idle second, the same burst.
        let sink = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = sink.local_addr().unwrap().to_string();
        let arrived = tokio::spawn(async move {
            let (mut s, _) = sink.accept().await.unwrap();
            let mut buf = vec![0u8; 2 * 400_000];
            s.read_exact(&mut buf).await.unwrap();
            std::time::Instant::now()
        });
        let mut s = TcpStream::connect(Link::shaped(target, || Shape::rate(1_000_000)))
            .await
            .unwrap();
        s.write_all(&data).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1400)).await;
        let t0 = std::time::Instant::now();
        s.write_all(&data).await.unwrap();
        let took = arrived.await.unwrap() - t0;
        assert!(
            took >= Duration::from_millis(390),
            "{took:?}: credit saved while idle"
        );
    }

    static HOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

    /// A flipped byte at its offset, a corrupted LAST frame's final byte (and nothing
    /// else), a held link that delivers nothing until let go, a connection held back.
    #[tokio::test]
    async fn faults_do_what_they_say_and_nothing_else() {
        use std::sync::atomic::Ordering;
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let (got, _) = through(
            || Shape {
                faults: Faults {
                    corrupt_at: Some(77_777),
                    ..Faults::default()
                },
                ..Shape::rate(0)
            },
            &data,
        )
        .await;
        let differ: Vec<usize> = (0..data.len()).filter(|&i| got[i] != data[i]).collect();
        assert_eq!(differ, [77_777]);

        // Two frames: a PART (type 8) of 20 bytes, then a LAST (type 9) of 30.
        let frame = |ty: u8, len: u32| {
            let mut f = edgesplit_proto::frame::MAGIC.to_vec();
            f.extend([edgesplit_proto::frame::VERSION, ty, 0, 0]);
            f.extend(len.to_le_bytes());
            f.extend(vec![1u8; len as usize]);
            f
        };
        let stream = [frame(8, 20), frame(LAST, 30)].concat();
        let (got, _) = through(
            || Shape {
                faults: Faults {
                    corrupt_last: true,
                    ..Faults::default()
                },
                ..Shape::rate(0)
            },
            &stream,
        )
        .await;
        let differ: Vec<usize> = (0..stream.len()).filter(|&i| got[i] != stream[i]).collect();
        assert_eq!(differ, [stream.len() - 1]);

        let release = tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            HOLD.store(false, Ordering::SeqCst);
        });
        let (got, took) = through(
            || Shape {
                faults: Faults {
                    hold: Some(|| HOLD.load(Ordering::SeqCst)),
                    ..Faults::default()
                },
                ..Shape::rate(0)
            },
            b"held",
        )
        .await;
        release.await.unwrap();
        assert_eq!(got, b"held");
        assert!(took >= Duration::from_millis(490), "{took:?}");

        let (got, took) = through(
            || Shape {
                faults: Faults {
                    connect_delay: Duration::from_millis(300),
                    ..Faults::default()
                },
                ..Shape::rate(0)
            },
            b"late",
        )
        .await;
        assert_eq!(got, b"late");
        assert!(took >= Duration::from_millis(290), "{took:?}");
    }

    #[test]
    fn named_profiles() {
        assert_eq!(Profile::parse("wifi").unwrap().mbit_s, Some(100.0));
        assert_eq!(Profile::parse("slow-wifi").unwrap().one_way_ms, 50.0);
        assert!(Profile::parse("5g")
            .unwrap_err()
            .contains("unknown link profile"));
        let p = Profile::parse("wifi").unwrap();
        // 12.5 MB at 100 Mbit/s is one second.
        assert_eq!(p.serialise(12_500_000), Duration::from_secs(1));
    }
}
