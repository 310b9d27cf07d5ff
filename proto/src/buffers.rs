//! Large buffers kept for reuse by the handoff paths.
//!
//! A fresh 47 MB buffer costs ~20 ms of page faults on the machines measured here (the
//! kernel zeroes each page on first touch, and allocations this large are always fresh
//! mappings), a reused one none: a warm copy of the same bytes takes ~4 ms. So a state is
//! exported into, and received into, a buffer taken from here, and the buffer comes back
//! when the last [`Bytes`] sharing it is dropped ([`share`]).
//!
//! Bounded: at most [`KEEP`] buffers, [`KEEP_BYTES`] in all, are kept between handoffs;
//! a node's resident memory after a handoff is that much above its working set. Buffers
//! under [`MIN_KEPT`] are not worth keeping and are freed as usual.

use std::sync::Mutex;

use bytes::Bytes;

/// Most buffers kept: a live handoff's receiver holds a buffer per piece (two or three)
/// and the one its pieces are joined into; with fewer kept, the pieces took the joined
/// state's buffer and the join at the switch paid a fresh one's page faults (51-70 ms of
/// a 286 ms pause for a 50 MB state at phone speed 0.5, measured).
pub const KEEP: usize = 4;
/// Most bytes kept in all.
pub const KEEP_BYTES: usize = 512 * 1024 * 1024;
/// Smaller buffers are not kept.
pub const MIN_KEPT: usize = 1024 * 1024;
/// A new buffer has 1/HEADROOM more capacity than asked for, so that a kept one serves a
/// later state up to that much larger (the warm-up answers of a bench paid a fresh join
/// buffer when the next state was a few hundred KB larger).
pub const HEADROOM: usize = 8;

/// A pool of kept buffers. The handoff paths use [`POOL`] (through [`take`], [`give`],
/// [`share`]); tests make their own.
pub struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
}

/// The process's pool.
pub static POOL: Pool = Pool::new();

impl Pool {
    #[must_use]
    pub const fn new() -> Pool {
        Pool {
            free: Mutex::new(Vec::new()),
        }
    }

    fn free(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        // A panic while holding the lock leaves only a list of spare buffers behind.
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An empty buffer with room for at least `capacity` bytes: the smallest kept one that
    /// fits, else a new one.
    #[must_use]
    pub fn take(&self, capacity: usize) -> Vec<u8> {
        let mut free = self.free();
        let fit = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= capacity)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = fit {
            let mut b = free.swap_remove(i);
            b.clear();
            return b;
        }
        drop(free);
        // Room to grow: the next state of a similar prompt is often a little larger, and
        // untouched capacity costs no memory (its pages are never faulted in).
        Vec::with_capacity(capacity + capacity / HEADROOM)
    }

    /// The largest kept buffer, empty, if one is kept: claimed early by a job that will
    /// need the most room last (a live handoff's join), so that smaller takes before it
    /// (its pieces) do not get it.
    #[must_use]
    pub fn take_largest(&self) -> Option<Vec<u8>> {
        let mut free = self.free();
        let i = free
            .iter()
            .enumerate()
            .max_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)?;
        let mut b = free.swap_remove(i);
        b.clear();
        Some(b)
    }

    /// Keeps `buf` for a later [`Pool::take`] (within the bounds), or frees it.
    pub fn give(&self, mut buf: Vec<u8>) {
        if buf.capacity() < MIN_KEPT || buf.capacity() > KEEP_BYTES {
            return;
        }
        buf.clear();
        let mut free = self.free();
        free.push(buf);
        // Over the bounds: the smallest go first.
        free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
        while free.len() > KEEP || free.iter().map(Vec::capacity).sum::<usize>() > KEEP_BYTES {
            free.pop();
        }
    }

    /// Bytes sharing `buf`, which comes back to this pool when the last of them is dropped.
    #[must_use]
    pub fn share(&'static self, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Recycled { buf, pool: self })
    }

    /// How many buffers are kept now, and their bytes.
    #[must_use]
    pub fn kept(&self) -> (usize, usize) {
        let free = self.free();
        (free.len(), free.iter().map(Vec::capacity).sum())
    }
}

impl Default for Pool {
    fn default() -> Self {
        Self::new()
    }
}

/// [`Pool::take`] from [`POOL`].
#[must_use]
pub fn take(capacity: usize) -> Vec<u8> {
    POOL.take(capacity)
}

/// [`Pool::give`] to [`POOL`].
pub fn give(buf: Vec<u8>) {
    POOL.give(buf);
}

/// [`Pool::share`] with [`POOL`].
#[must_use]
pub fn share(buf: Vec<u8>) -> Bytes {
    POOL.share(buf)
}

/// A buffer on its way back to its pool.
struct Recycled {
    buf: Vec<u8>,
    pool: &'static Pool,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_buffer_comes_back_when_its_last_bytes_go_and_is_taken_again() {
        static P: Pool = Pool::new();
        let mut b = P.take(3 * MIN_KEPT);
        b.extend_from_slice(&vec![7u8; 3 * MIN_KEPT]);
        let ptr = b.as_ptr();
        let whole = P.share(b);
        let part = whole.slice(10..20);
        drop(whole);
        assert_eq!(P.kept().0, 0, "a slice still shares it");
        assert_eq!(&part[..], &[7u8; 10]);
        drop(part);
        assert_eq!(P.kept().0, 1);
        // A smaller request takes it (empty, same memory); a larger one gets a new one.
        let again = P.take(MIN_KEPT);
        assert!(again.is_empty() && again.as_ptr() == ptr);
        P.give(again);
        let bigger = P.take(4 * MIN_KEPT);
        assert_ne!(bigger.as_ptr(), ptr);
        // Bounded: small ones are not kept, and no more than KEEP in all.
        P.give(Vec::with_capacity(16));
        P.give(bigger);
        for k in 0..KEEP {
            P.give(Vec::with_capacity((k + 1) * MIN_KEPT));
        }
        let (n, bytes) = P.kept();
        assert_eq!(n, KEEP);
        let largest: usize = (1..KEEP).map(|k| (k + 1) * MIN_KEPT).sum::<usize>() + 4 * MIN_KEPT;
        assert!(bytes >= largest, "the largest are kept");
    }

    /// A live handoff's buffers, handoff after handoff: the join's buffer claimed first
    /// (the largest kept), then one per piece, all given back; the next handoff, of other
    /// sizes within them, takes every one of them again and allocates nothing.
    #[test]
    fn a_live_handoffs_pieces_and_join_are_reused_by_the_next() {
        static P: Pool = Pool::new();
        let mb = MIN_KEPT;
        let round = |pieces: &[usize], joined: usize| -> Vec<*const u8> {
            let mut out = P.take_largest().unwrap_or_default();
            let held: Vec<Vec<u8>> = pieces.iter().map(|&n| P.take(n * mb)).collect();
            if out.capacity() < joined * mb {
                P.give(out);
                out = P.take(joined * mb);
            }
            let ptrs = held.iter().chain([&out]).map(|b| b.as_ptr()).collect();
            for b in held {
                P.give(b);
            }
            P.give(out);
            ptrs
        };
        let first = round(&[24, 23, 3], 50);
        let second = round(&[23, 22, 2], 48);
        let mut a = first.clone();
        let mut b = second.clone();
        a.sort();
        b.sort();
        assert_eq!(
            a, b,
            "every buffer of the second handoff was one of the first's"
        );
        // A slightly larger handoff (within the headroom) still allocates nothing.
        let mut c = round(&[25, 24, 3], 53);
        c.sort();
        assert_eq!(a, c, "a handoff a few percent larger reuses them too");
    }
}
