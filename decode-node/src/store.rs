//! Verified states waiting for their `Generate` call, in memory (V2 frames and V1 files).
//!
//! The V2 receiver puts a state here only after its checksum, handshake and descriptors
//! passed; `Generate` takes it out (waiting a bounded time for it to arrive). Entries older
//! than the TTL are dropped, and the total bytes held are capped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use edgesplit_proto::frame::{Nack, NackCode, Receipt, StateFrame};
use edgesplit_proto::handoff::StateSink;
use tokio::sync::Notify;

/// Limits of the store.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    /// States not claimed within this time are dropped.
    pub ttl: Duration,
    /// Most payload bytes held at once.
    pub max_bytes: u64,
    /// Longest sequence (tokens) accepted: the context size.
    pub max_tokens: u32,
}

/// Counters exposed through `Info`.
#[derive(Debug, Default)]
pub struct Counters {
    pub bytes_received: AtomicU64,
    pub handoffs_received: AtomicU64,
    pub handoffs_refused: AtomicU64,
}

/// A verified state - a V2 frame (checksum, identity and descriptors verified) or a V1
/// upload (checksum, identity and file header verified; llama.cpp's reader checks the
/// rest when it imports) - with what receiving it took.
#[derive(Debug)]
pub struct Stored {
    pub state: StateFrame,
    pub receipt: Receipt,
}

impl Stored {
    fn bytes(&self) -> u64 {
        self.state.payload.len() as u64
    }
}

struct Entry {
    state: Stored,
    at: Instant,
}

/// Marks `handoff_id` as awaited by a `Generate` call for as long as it lives.
struct Awaiting<'a> {
    store: &'a Store,
    id: &'a str,
}

impl<'a> Awaiting<'a> {
    fn new(store: &'a Store, id: &'a str) -> Self {
        *store.awaited().entry(id.to_string()).or_insert(0) += 1;
        Awaiting { store, id }
    }
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        let mut awaited = self.store.awaited();
        if let Some(n) = awaited.get_mut(self.id) {
            *n -= 1;
            if *n == 0 {
                awaited.remove(self.id);
            }
        }
    }
}

/// The pending-state store; the V2 receiver's sink.
pub struct Store {
    limits: StoreLimits,
    entries: Mutex<HashMap<String, Entry>>,
    arrived: Notify,
    /// Handoff ids a `Generate` call is waiting for, with how many calls wait for each.
    awaited: Mutex<HashMap<String, usize>>,
    /// The node is draining: only awaited states come in.
    draining: AtomicBool,
    /// Bytes of live handoffs' pieces held by their connections (not yet stored here).
    pieces: AtomicU64,
    /// Live handoffs whose pieces were dropped (a refused piece, a connection that ended
    /// first), with why and when: they will not arrive, so a call waiting for one ends at
    /// once. Kept for the TTL, at most [`MAX_DROPPED`].
    dropped: Mutex<HashMap<String, (String, Instant)>>,
    pub counters: Counters,
}

/// Most dropped live handoffs remembered.
const MAX_DROPPED: usize = 1024;

/// Why [`Store::take`] returned no state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// It did not arrive within the wait.
    TimedOut,
    /// A live handoff whose pieces were dropped before its last one: why.
    Dropped(String),
}

impl Store {
    #[must_use]
    pub fn new(limits: StoreLimits) -> Self {
        Self {
            limits,
            entries: Mutex::new(HashMap::new()),
            arrived: Notify::new(),
            awaited: Mutex::new(HashMap::new()),
            draining: AtomicBool::new(false),
            pieces: AtomicU64::new(0),
            dropped: Mutex::new(HashMap::new()),
            counters: Counters::default(),
        }
    }

    fn expire(&self, map: &mut HashMap<String, Entry>) {
        let ttl = self.limits.ttl;
        map.retain(|id, e| {
            let keep = e.at.elapsed() < ttl;
            if !keep {
                tracing::warn!(handoff_id = %id, "dropping unclaimed handoff state after its TTL");
            }
            keep
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding this lock would be a bug elsewhere; the map stays usable.
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn awaited(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.awaited
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// From now on, take only the states a `Generate` call is already waiting for: their
    /// answers are in flight (the client has its first token). Any other state could only
    /// be claimed by a call the draining node refuses.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether a state for `handoff_id` may come in now.
    #[must_use]
    pub fn admits(&self, handoff_id: &str) -> bool {
        !self.draining.load(Ordering::SeqCst) || self.awaited().contains_key(handoff_id)
    }

    /// `Generate` calls waiting for their state now.
    #[must_use]
    pub fn awaited_count(&self) -> usize {
        self.awaited().values().sum()
    }

    /// Takes the state of `handoff_id`, waiting up to `wait` for it to arrive; a live
    /// handoff known to have been dropped ends the wait at once.
    ///
    /// # Errors
    /// [`Missing`]: not there within `wait`, or dropped.
    pub async fn take(&self, handoff_id: &str, wait: Duration) -> Result<Stored, Missing> {
        let deadline = tokio::time::Instant::now() + wait;
        let _awaiting = Awaiting::new(self, handoff_id);
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut map = self.lock();
                self.expire(&mut map);
                if let Some(e) = map.remove(handoff_id) {
                    return Ok(e.state);
                }
            }
            if let Some((why, _)) = self.dropped_list().get(handoff_id) {
                return Err(Missing::Dropped(why.clone()));
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Missing::TimedOut);
            }
        }
    }

    fn dropped_list(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.dropped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Bytes of all states held now, live handoffs' pieces included.
    #[must_use]
    pub fn held_bytes(&self) -> u64 {
        self.used(&self.lock())
    }

    /// Bytes of the states in `map` (the store's, locked) and of the live pieces.
    fn used(&self, map: &HashMap<String, Entry>) -> u64 {
        map.values().map(|e| e.state.bytes()).sum::<u64>() + self.pieces.load(Ordering::SeqCst)
    }

    /// True when `handoff_id` is held now.
    #[must_use]
    pub fn contains(&self, handoff_id: &str) -> bool {
        self.lock().contains_key(handoff_id)
    }

    /// Stores a verified V1 state under `handoff_id`.
    ///
    /// # Errors
    /// A duplicate id or no room; nothing is kept.
    pub fn put_v1(
        &self,
        handoff_id: &str,
        state: StateFrame,
        receipt: Receipt,
    ) -> Result<(), Nack> {
        self.insert(handoff_id, Stored { state, receipt })
    }

    /// Takes room for `bytes` not stored yet (a V1 body being received, a live handoff's
    /// pieces), counted with the states held against the cap; give it back with
    /// [`StateSink::release`].
    ///
    /// # Errors
    /// A NACK when the room is not there.
    pub fn room(&self, handoff_id: &str, bytes: u64) -> Result<(), Nack> {
        let map = self.lock();
        let used = self.used(&map);
        if used + bytes > self.limits.max_bytes {
            return Err(Nack {
                code: NackCode::Capacity,
                handoff_id: handoff_id.to_string(),
                reason: format!(
                    "holding {used} bytes; {bytes} more would exceed the cap of {}",
                    self.limits.max_bytes
                ),
            });
        }
        self.pieces.fetch_add(bytes, Ordering::SeqCst);
        Ok(())
    }

    fn insert(&self, handoff_id: &str, held: Stored) -> Result<(), Nack> {
        let refuse = |code, reason: String| Nack {
            code,
            handoff_id: handoff_id.to_string(),
            reason,
        };
        if !self.admits(handoff_id) {
            return Err(refuse(
                NackCode::Capacity,
                format!("draining: no call is waiting for handoff {handoff_id}"),
            ));
        }
        let bytes = held.bytes();
        let mut map = self.lock();
        self.expire(&mut map);
        if map.contains_key(handoff_id) {
            return Err(refuse(
                NackCode::DuplicateHandoff,
                format!("handoff {handoff_id} is already held"),
            ));
        }
        let used = self.used(&map);
        if used + bytes > self.limits.max_bytes {
            return Err(refuse(
                NackCode::Capacity,
                format!(
                    "holding {used} bytes; {bytes} more would exceed the cap of {}",
                    self.limits.max_bytes
                ),
            ));
        }
        map.insert(
            handoff_id.to_string(),
            Entry {
                state: held,
                at: Instant::now(),
            },
        );
        drop(map);
        self.counters
            .bytes_received
            .fetch_add(bytes, Ordering::Relaxed);
        self.counters
            .handoffs_received
            .fetch_add(1, Ordering::Relaxed);
        self.arrived.notify_waiters();
        Ok(())
    }

    /// Number of states held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no state is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl StateSink for Store {
    fn accept(&self, state: StateFrame, receipt: Receipt) -> Result<u64, Nack> {
        if state.tokens.len() as u64 >= u64::from(self.limits.max_tokens) {
            return Err(Nack {
                code: NackCode::SequenceTooLong,
                handoff_id: state.handoff_id.clone(),
                reason: format!(
                    "sequence of {} tokens does not fit the receiver's context of {}",
                    state.tokens.len(),
                    self.limits.max_tokens
                ),
            });
        }
        let bytes = state.payload.len() as u64;
        tracing::info!(
            handoff_id = %state.handoff_id,
            request_id = %state.request_id,
            tokens = state.tokens.len(),
            bytes,
            "V2 state received and verified"
        );
        let id = state.handoff_id.clone();
        self.insert(&id, Stored { state, receipt })?;
        Ok(bytes)
    }

    fn refused(&self, nack: &Nack) {
        tracing::warn!(code = nack.code.as_str(), reason = %nack.reason, "handoff refused");
        self.counters
            .handoffs_refused
            .fetch_add(1, Ordering::Relaxed);
    }

    fn reserve(&self, handoff_id: &str, bytes: u64) -> Result<(), Nack> {
        // A live handoff ends with a `Generate` call the router makes only after its last
        // piece: a draining node would refuse that call, so it takes no pieces.
        if self.draining.load(Ordering::SeqCst) {
            return Err(Nack {
                code: NackCode::Capacity,
                handoff_id: handoff_id.to_string(),
                reason: format!("draining: no live handoff is taken ({handoff_id})"),
            });
        }
        self.room(handoff_id, bytes)
    }

    fn hold(&self, bytes: u64) -> Result<(), Nack> {
        self.room("", bytes)
    }

    fn release(&self, bytes: u64) {
        let _ = self
            .pieces
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                Some(held.saturating_sub(bytes))
            });
    }

    fn dropped(&self, handoff_id: &str, reason: &str) {
        let mut dropped = self.dropped_list();
        let ttl = self.limits.ttl;
        dropped.retain(|_, (_, at)| at.elapsed() < ttl);
        if dropped.len() >= MAX_DROPPED {
            let oldest = dropped
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(id, _)| id.clone());
            if let Some(id) = oldest {
                dropped.remove(&id);
            }
        }
        dropped.insert(handoff_id.to_string(), (reason.to_string(), Instant::now()));
        drop(dropped);
        self.arrived.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn state(id: &str, n: usize) -> StateFrame {
        StateFrame {
            handoff_id: id.into(),
            request_id: "r".into(),
            tokens: vec![1, 2],
            descriptors: vec![],
            payload: Bytes::from(vec![0u8; n]),
        }
    }

    fn store() -> Store {
        Store::new(StoreLimits {
            ttl: Duration::from_secs(60),
            max_bytes: 100,
            max_tokens: 10,
        })
    }

    #[tokio::test]
    async fn take_waits_for_arrival_and_times_out() {
        let s = std::sync::Arc::new(store());
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.take("a", Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        s.accept(state("a", 10), Receipt::default()).unwrap();
        let Ok(Stored { state: f, .. }) = waiter.await.unwrap() else {
            panic!("frame expected")
        };
        assert_eq!(f.handoff_id, "a");
        assert_eq!(
            s.take("missing", Duration::from_millis(20))
                .await
                .unwrap_err(),
            Missing::TimedOut
        );
        assert!(s.is_empty());
    }

    /// A live handoff dropped on the way (a refused piece) ends the call waiting for it at
    /// once, with the reason; one dropped before the call came, too.
    #[tokio::test]
    async fn a_dropped_live_handoff_ends_its_wait_at_once() {
        let s = std::sync::Arc::new(store());
        let s2 = s.clone();
        let t0 = std::time::Instant::now();
        let waiter = tokio::spawn(async move { s2.take("a", Duration::from_secs(30)).await });
        while s.awaited_count() == 0 {
            tokio::task::yield_now().await;
        }
        s.dropped("a", "checksum mismatch");
        assert_eq!(
            waiter.await.unwrap().unwrap_err(),
            Missing::Dropped("checksum mismatch".into())
        );
        assert!(t0.elapsed() < Duration::from_secs(30));
        s.dropped("b", "the connection ended");
        assert_eq!(
            s.take("b", Duration::from_secs(30)).await.unwrap_err(),
            Missing::Dropped("the connection ended".into())
        );
        // Another handoff is not affected.
        s.accept(state("c", 10), Receipt::default()).unwrap();
        assert!(s.take("c", Duration::from_secs(1)).await.is_ok());
    }

    #[test]
    fn refuses_duplicates_capacity_and_long_sequences() {
        let s = store();
        s.accept(state("a", 60), Receipt::default()).unwrap();
        assert_eq!(
            s.accept(state("a", 1), Receipt::default())
                .unwrap_err()
                .code,
            NackCode::DuplicateHandoff
        );
        assert_eq!(
            s.accept(state("b", 41), Receipt::default())
                .unwrap_err()
                .code,
            NackCode::Capacity
        );
        let mut long = state("c", 1);
        long.tokens = vec![0; 10];
        assert_eq!(
            s.accept(long, Receipt::default()).unwrap_err().code,
            NackCode::SequenceTooLong
        );
        assert_eq!(s.len(), 1);
    }

    #[tokio::test]
    async fn while_draining_only_awaited_states_come_in() {
        let s = std::sync::Arc::new(store());
        s.start_draining();
        let refused = s
            .accept(state("early", 10), Receipt::default())
            .unwrap_err();
        assert_eq!(refused.code, NackCode::Capacity);
        assert!(refused.reason.contains("draining"), "{}", refused.reason);
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.take("a", Duration::from_secs(5)).await });
        while s.awaited_count() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(s.admits("a") && !s.admits("b"));
        s.accept(state("a", 10), Receipt::default()).unwrap();
        assert!(waiter.await.unwrap().is_ok());
        // The call has its state: nothing waits for "a" any more.
        assert_eq!(s.awaited_count(), 0);
        assert!(!s.admits("a"));
        // A call that gave up does not leave its id admitted either.
        assert!(s.take("c", Duration::from_millis(10)).await.is_err());
        assert!(!s.admits("c"));
    }
}
