//! One measured quantity of a device or the link (a prefill or decode speed, the link's
//! goodput, its round trip), as the router's choice reads it: robust to one figure far from
//! the others, following the present, and known to be stale when not refreshed.
//!
//! The estimate is the median of the last [`WINDOW`] figures. A figure far from the others
//! (a cold first computation, one answer slowed by something else on the device) is
//! outvoted as soon as two more figures agree, where a running mean would carry it for
//! many answers; a device that changes speed for good (a phone that throttles) is followed
//! after two figures at the new speed. Figures older than [`FORGET_AFTER`] at the time of a
//! new one are dropped, so a device measured again after a long pause is judged by what it
//! does now. A figure not refreshed for [`STALE_AFTER`] is stale: the choice still uses it
//! (the best knowledge there is), and the router measures the device again at its next idle
//! moment (`backend/probe.rs`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Figures the median is taken over.
pub const WINDOW: usize = 3;

/// A figure this much older than the newest is dropped.
pub const FORGET_AFTER: Duration = Duration::from_secs(300);

/// A quantity with no figure this recent is stale.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// The recent figures of one quantity, oldest first.
#[derive(Debug, Clone, Default)]
pub struct Estimate {
    figures: VecDeque<(f64, Instant)>,
}

impl Estimate {
    /// Adds a figure measured now; one that is not finite and positive is ignored.
    pub fn add(&mut self, v: f64) {
        self.add_at(v, Instant::now());
    }

    /// Adds a figure measured at `at` (the newest so far).
    pub fn add_at(&mut self, v: f64, at: Instant) {
        if !(v.is_finite() && v > 0.0) {
            return;
        }
        self.figures
            .retain(|&(_, t)| at.saturating_duration_since(t) <= FORGET_AFTER);
        if self.figures.len() == WINDOW {
            self.figures.pop_front();
        }
        self.figures.push_back((v, at));
    }

    /// The median of the figures kept (of two, their mean); `None` before the first.
    #[must_use]
    pub fn value(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.figures.iter().map(|f| f.0).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => None,
            n if n % 2 == 1 => Some(v[n / 2]),
            n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
        }
    }

    /// Whether the quantity wants measuring at `now`: no figure yet, or none within
    /// [`STALE_AFTER`].
    #[must_use]
    pub fn stale(&self, now: Instant) -> bool {
        self.figures
            .back()
            .is_none_or(|&(_, t)| now.saturating_duration_since(t) > STALE_AFTER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, s: u64) -> Instant {
        base + Duration::from_secs(s)
    }

    #[test]
    fn a_tenfold_slow_first_figure_is_forgotten_after_two_answers() {
        let t = Instant::now();
        let mut e = Estimate::default();
        e.add_at(0.1, t); // cold: a tenth of the device's speed
        assert_eq!(e.value(), Some(0.1));
        e.add_at(1.0, at(t, 1));
        e.add_at(1.1, at(t, 2));
        assert_eq!(e.value(), Some(1.0));
        e.add_at(0.9, at(t, 3));
        assert_eq!(e.value(), Some(1.0));
    }

    #[test]
    fn one_figure_far_from_the_others_does_not_rule() {
        let t = Instant::now();
        let mut e = Estimate::default();
        for (i, v) in [1.0, 1.05, 10.0, 0.95].into_iter().enumerate() {
            e.add_at(v, at(t, i as u64));
        }
        assert_eq!(e.value(), Some(1.05));
    }

    #[test]
    fn a_device_that_changes_speed_is_followed_after_two_figures() {
        let t = Instant::now();
        let mut e = Estimate::default();
        for i in 0..5 {
            e.add_at(1.0, at(t, i));
        }
        e.add_at(0.25, at(t, 5));
        assert_eq!(e.value(), Some(1.0));
        e.add_at(0.26, at(t, 6));
        assert_eq!(e.value(), Some(0.26));
        // And back.
        e.add_at(1.0, at(t, 7));
        e.add_at(0.98, at(t, 8));
        assert_eq!(e.value(), Some(0.98));
    }

    #[test]
    fn a_figure_not_refreshed_is_stale_and_a_new_one_makes_it_fresh() {
        let t = Instant::now();
        let mut e = Estimate::default();
        assert!(e.stale(t), "no figure: unknown");
        assert_eq!(e.value(), None);
        e.add_at(1.0, t);
        assert!(!e.stale(at(t, 10)));
        assert!(e.stale(at(t, STALE_AFTER.as_secs() + 1)));
        // Stale, the figure still stands for the choice.
        assert_eq!(e.value(), Some(1.0));
        e.add_at(1.2, at(t, 100));
        assert!(!e.stale(at(t, 101)));
    }

    #[test]
    fn after_a_long_pause_the_device_is_judged_by_its_new_figure() {
        let t = Instant::now();
        let mut e = Estimate::default();
        e.add_at(1.0, t);
        e.add_at(1.0, at(t, 1));
        e.add_at(0.3, at(t, FORGET_AFTER.as_secs() + 10));
        assert_eq!(e.value(), Some(0.3));
    }

    #[test]
    fn figures_that_are_not_positive_and_finite_are_ignored() {
        let mut e = Estimate::default();
        for v in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            e.add(v);
        }
        assert_eq!(e.value(), None);
    }
}
