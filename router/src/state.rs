//! The state every handler shares ([`AppState`]) and the router's admission control
//! ([`Admission`]: slots, queue, timeout). Owned here so routes, dashboard and drain all
//! read it without importing each other.

use std::sync::Arc;
use std::time::Instant;

use crate::api::Transport;
use crate::backend::Pool;
use crate::error::{ApiError, HttpCode};

/// Shared state of the handlers.
pub struct AppState {
    /// The prefill node and the decode nodes it pairs with.
    pub pool: Pool,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    pub default_transport: Transport,
    /// What `transport: "auto"` optimizes when a request does not say (`--objective`).
    pub objective: crate::api::Objective,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    pub started: Instant,
    /// The bench record the dashboard reads (`--bench-db`).
    pub bench_db: Option<std::path::PathBuf>,
    /// Clients must send `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// Shutting down: new requests are refused, `/health` says `draining`.
    pub draining: std::sync::atomic::AtomicBool,
    pub admission: Admission,
    /// Devices that join with a code (`--join-listen`).
    pub joins: Option<Arc<crate::join::Joins>>,
}

impl AsRef<Pool> for AppState {
    fn as_ref(&self) -> &Pool {
        &self.pool
    }
}

/// Back-pressure: at most `slots` answers at once, at most `max_queue` requests waiting
/// for one (each up to `timeout`); beyond either, 503 with Retry-After.
pub struct Admission {
    slots: Option<Arc<tokio::sync::Semaphore>>,
    /// The current number of slots (changed by [`Admission::resize`]).
    limit: std::sync::atomic::AtomicUsize,
    waiting: std::sync::atomic::AtomicUsize,
    max_queue: usize,
    timeout: std::time::Duration,
}

impl Admission {
    #[must_use]
    pub fn new(max_in_flight: usize, max_queue: usize, timeout: std::time::Duration) -> Self {
        Self {
            slots: (max_in_flight > 0)
                .then(|| Arc::new(tokio::sync::Semaphore::new(max_in_flight))),
            limit: std::sync::atomic::AtomicUsize::new(max_in_flight),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            max_queue,
            timeout,
        }
    }

    /// Requests waiting for a slot now.
    #[must_use]
    pub fn queued(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The current number of slots (0: unlimited).
    #[must_use]
    pub fn limit(&self) -> usize {
        self.limit.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Changes the number of slots to `to` (at least 1; no effect when unlimited). Growing
    /// frees slots at once; shrinking takes the surplus back as answers end (the taker
    /// queues like a request, so new requests wait meanwhile).
    pub fn resize(&self, to: usize) {
        use std::sync::atomic::Ordering;
        let Some(slots) = &self.slots else {
            return;
        };
        let to = to.max(1);
        let from = self.limit.swap(to, Ordering::SeqCst);
        if to > from {
            slots.add_permits(to - from);
        } else if from > to {
            let (slots, n) = (slots.clone(), from - to);
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            tokio::spawn(async move {
                if let Ok(p) = slots.acquire_many_owned(n).await {
                    p.forget();
                }
            });
        }
    }

    /// A slot for one answer (`None` when unlimited), after a bounded wait.
    ///
    /// # Errors
    /// 503 `queue_full` or `queue_timeout`.
    pub async fn admit(&self) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, ApiError> {
        use std::sync::atomic::Ordering;
        let Some(slots) = &self.slots else {
            return Ok(None);
        };
        if let Ok(p) = slots.clone().try_acquire_owned() {
            return Ok(Some(p));
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::unavailable(
                HttpCode::QueueFull,
                format!(
                    "the router is at capacity ({} requests waiting); retry shortly",
                    self.max_queue
                ),
            ));
        }
        let got = tokio::time::timeout(self.timeout, slots.clone().acquire_owned()).await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        match got {
            Ok(Ok(p)) => Ok(Some(p)),
            _ => Err(ApiError::unavailable(
                HttpCode::QueueTimeout,
                format!("no capacity within {:?}; retry shortly", self.timeout),
            )),
        }
    }
}

/// The decode node's `parallel`, read once (`None` when it did not answer).
pub type ReadParallel<T> = for<'a> fn(
    &'a T,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Option<usize>> + Send + 'a>,
>;

/// Every `every`, reads the decode node's `parallel` and resizes the admission to it (the
/// default `--max-in-flight`), until `state` is gone. Generic over the state so that the
/// rule is tested without nodes.
pub async fn follow_decode<T: Send + Sync + 'static>(
    state: std::sync::Weak<T>,
    every: std::time::Duration,
    admission: fn(&T) -> &Admission,
    read: ReadParallel<T>,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(state) = state.upgrade() else {
            return;
        };
        let adm = admission(&state);
        if let Some(n) = read(&state).await {
            if n > 0 && n != adm.limit() {
                tracing::info!(
                    from = adm.limit(),
                    to = n,
                    "admission limit follows the decode node's sequences"
                );
                adm.resize(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{follow_decode, Admission};
    use std::sync::Arc;
    use std::time::Duration;

    struct Fake {
        admission: Admission,
        parallel: std::sync::atomic::AtomicUsize,
    }

    #[tokio::test(start_paused = true)]
    async fn the_admission_limit_follows_the_decode_nodes_parallel() {
        use std::sync::atomic::Ordering;
        let fake = Arc::new(Fake {
            admission: Admission::new(4, 8, Duration::from_secs(1)),
            parallel: 4.into(),
        });
        let follow = tokio::spawn(follow_decode(
            Arc::downgrade(&fake),
            Duration::from_secs(10),
            |f| &f.admission,
            |f| Box::pin(async { Some(f.parallel.load(Ordering::SeqCst)) }),
        ));
        fake.parallel.store(6, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(fake.admission.limit(), 4, "not before the period");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(fake.admission.limit(), 6, "re-read after 10 s");
        // A node that does not answer (0 or no reading) leaves the limit as it is.
        fake.parallel.store(0, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(fake.admission.limit(), 6);
        fake.parallel.store(2, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(fake.admission.limit(), 2);
        // The loop ends with the state.
        drop(fake);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(follow.is_finished());
    }

    #[tokio::test]
    async fn admission_resizes_both_ways() {
        let a = Admission::new(2, 8, Duration::from_millis(50));
        let p1 = a.admit().await.unwrap();
        let _p2 = a.admit().await.unwrap();
        assert!(a.admit().await.is_err(), "two slots, both taken");
        a.resize(3);
        assert_eq!(a.limit(), 3);
        let _p3 = a.admit().await.unwrap();
        assert!(a.admit().await.is_err(), "three slots, all taken");
        // Down to 1: the surplus comes back as answers end.
        a.resize(1);
        drop(p1);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(a.admit().await.is_err(), "one slot, still taken");
    }
}
