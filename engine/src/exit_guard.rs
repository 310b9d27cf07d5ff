//! The process-exit guard: once the process exits, owner threads make no more llama.cpp calls
//! (an `atexit` handler stops them at their next step and waits for the ones mid-step).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

/// Set when the process exits: owner threads make no more llama.cpp calls.
static STOPPING: AtomicBool = AtomicBool::new(false);
/// Owner threads inside llama.cpp calls now.
static BUSY: AtomicUsize = AtomicUsize::new(0);

/// Registers [`quiesce_at_exit`] once, after an engine's first round of work: exit
/// handlers run in reverse order of registration, and ggml creates some of its static
/// objects lazily (function-local statics, registered for destruction at first use, e.g.
/// the CPU backend's extra buffer types during the first compute). Registered at start,
/// the handler would run after their destructors and be useless.
pub(crate) fn register_exit_guard() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain `extern "C" fn` with no captured state.
    ONCE.call_once(|| unsafe {
        libc::atexit(quiesce_at_exit);
    });
}

/// At process exit, before ggml's static objects are destroyed (see
/// [`register_exit_guard`]), stop the owner threads at their next step and wait for the
/// ones mid-step. Without it, an engine still decoding when `main` returns (a drain
/// deadline passed, a test ended) read ggml's destroyed globals: measured as a SIGSEGV in
/// `ggml_cpu_extra_compute_forward` in about one exit in ten.
extern "C" fn quiesce_at_exit() {
    STOPPING.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    while BUSY.load(Ordering::SeqCst) > 0 && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Proof that this owner thread may call llama.cpp until it is dropped.
pub(crate) struct Busy;

impl Busy {
    /// `None` once the process is exiting: the caller must not touch llama.cpp again.
    pub(crate) fn enter() -> Option<Busy> {
        // Dekker-style with `quiesce_at_exit`: count first, then look at the flag (both
        // SeqCst), so the handler either sees us counted or we see the flag.
        BUSY.fetch_add(1, Ordering::SeqCst);
        if STOPPING.load(Ordering::SeqCst) {
            BUSY.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Busy)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Parks an owner thread for the rest of the process (it is exiting), keeping its
/// llama.cpp objects alive and untouched.
pub(crate) fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}
