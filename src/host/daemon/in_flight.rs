//! Whether a `tools/call` is alone in the daemon: the signal a call uses to let the sync of
//! its authorization record run on its own thread (see
//! [`crate::records::RecordWriter::commit_alone`]).
//!
//! Alone means: no other call is being run, and none ran beside another for the last
//! [`OVERLAP_WINDOW`]. The second test is what keeps concurrent clients grouped: while one
//! call holds the runtime's worker for its sync, the other sessions' next requests wait
//! unread in their sockets, so they are not counted in flight, yet they would have shared
//! the sync thread's next group. Calls that overlapped a moment ago will again.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long after two calls were in flight together no call counts as alone.
pub const OVERLAP_WINDOW: Duration = Duration::from_millis(2);

/// The `tools/call` requests being run, and when two last ran together.
#[derive(Debug)]
pub struct CallsInFlight {
    count: AtomicUsize,
    /// When (nanoseconds after `epoch`) a call last started while another was in flight.
    overlapped_at: AtomicU64,
    epoch: Instant,
}

/// One call, counted in [`CallsInFlight`] until it is dropped.
pub struct InFlight<'a>(&'a CallsInFlight);

impl Default for CallsInFlight {
    fn default() -> Self {
        CallsInFlight {
            count: AtomicUsize::new(0),
            overlapped_at: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl CallsInFlight {
    /// Counts a call until the returned guard is dropped.
    pub fn enter(&self) -> InFlight<'_> {
        if self.count.fetch_add(1, Ordering::Relaxed) > 0 {
            self.overlapped_at.store(self.now(), Ordering::Relaxed);
        }
        InFlight(self)
    }

    /// At most one call is being run (the asking one, or none), and no two ran together
    /// for the last [`OVERLAP_WINDOW`].
    pub fn alone(&self) -> bool {
        self.count.load(Ordering::Relaxed) <= 1
            && self
                .now()
                .saturating_sub(self.overlapped_at.load(Ordering::Relaxed))
                >= OVERLAP_WINDOW.as_nanos() as u64
    }

    fn now(&self) -> u64 {
        // u64 nanoseconds cover 584 years of uptime.
        self.epoch.elapsed().as_nanos() as u64
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_alone_only_when_no_two_ran_together_lately() {
        let calls = CallsInFlight::default();
        std::thread::sleep(OVERLAP_WINDOW);
        // One call after another, from whichever session: alone.
        for _ in 0..3 {
            let call = calls.enter();
            assert!(calls.alone(), "calls one after another");
            drop(call);
        }
        let first = calls.enter();
        let second = calls.enter();
        assert!(!calls.alone(), "two calls in flight");
        drop(second);
        assert!(!calls.alone(), "two calls overlapped a moment ago");
        drop(first);
        let next = calls.enter();
        assert!(!calls.alone(), "still within the window");
        drop(next);
        std::thread::sleep(OVERLAP_WINDOW);
        let later = calls.enter();
        assert!(calls.alone(), "no overlap for a whole window");
        drop(later);
    }
}
