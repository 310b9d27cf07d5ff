//! A link between the services that the tests shape: a bandwidth, corruption (one byte at
//! an offset, or the checksum of every LAST frame), and holding everything back.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What one connection through [`proxy`] does to the bytes towards the decode node.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Bytes per second let through (0: no limit).
    pub rate: u64,
    /// Flip the byte at this offset of the connection (`usize::MAX`: none).
    pub corrupt_at: usize,
    /// Flip the last byte (its checksum's) of every LAST frame.
    pub corrupt_last: bool,
    /// While this says so, nothing more goes through (checked for every chunk, on
    /// connections already open too).
    pub hold: Option<fn() -> bool>,
}

impl Shape {
    /// A link of `rate` bytes per second that changes nothing.
    pub const fn rate(rate: u64) -> Shape {
        Shape {
            rate,
            corrupt_at: usize::MAX,
            corrupt_last: false,
            hold: None,
        }
    }
}

/// Follows the V2 frames of one upstream to find where each LAST frame ends.
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
        let mut i = 0;
        while i < buf.len() {
            if self.body == 0 {
                self.head.push(buf[i]);
                i += 1;
                if self.head.len() == edgesplit_proto::frame::HEADER_LEN {
                    self.body = u32::from_le_bytes(self.head[8..12].try_into().unwrap()) as usize;
                    self.last = self.head[5] == 9;
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

/// A proxy to `target` whose connections are shaped as `shape()` says when each opens;
/// closes each side when the other closes. Returns its address. Call it inside a runtime.
pub fn proxy(target: String, shape: fn() -> Shape) -> String {
    let (addr, l) = super::proxy_listener();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = l.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                let Ok(outbound) = TcpStream::connect(target).await else {
                    return;
                };
                let (mut ri, mut wi) = inbound.into_split();
                let (mut ro, mut wo) = outbound.into_split();
                let shape = shape();
                let up = async move {
                    let mut free_at = Instant::now();
                    let mut seen = 0usize;
                    let mut buf = vec![0u8; 16 * 1024];
                    let mut frames = Frames::default();
                    loop {
                        let k = match ri.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => k,
                        };
                        if let Some(hold) = shape.hold {
                            while hold() {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        }
                        let at = shape.corrupt_at;
                        if seen <= at && at < seen + k {
                            buf[at - seen] ^= 0x5a;
                        }
                        if shape.corrupt_last {
                            frames.corrupt_last(&mut buf[..k]);
                        }
                        seen += k;
                        if shape.rate > 0 {
                            // A serial link: each chunk takes its time once the link is
                            // free. An idle link saves at most a few milliseconds of
                            // credit (enough to absorb a sleep's overshoot), not a burst.
                            let due = Duration::from_secs_f64(k as f64 / shape.rate as f64);
                            let now = Instant::now();
                            let credit = Duration::from_millis(5);
                            free_at = free_at.max(now.checked_sub(credit).unwrap_or(now)) + due;
                            if free_at > now {
                                tokio::time::sleep_until(free_at.into()).await;
                            }
                        }
                        if wo.write_all(&buf[..k]).await.is_err() {
                            break;
                        }
                    }
                    let _ = wo.shutdown().await;
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut ro, &mut wi).await;
                    let _ = wi.shutdown().await;
                };
                tokio::join!(up, down);
            });
        }
    });
    addr
}
