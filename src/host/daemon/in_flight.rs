//! How many `tools/call` requests the daemon is running: the signal a call uses to know it
//! is alone, so that the sync of its authorization record may run on its own thread (see
//! [`crate::records::RecordWriter::commit_alone`]).

use std::sync::atomic::{AtomicUsize, Ordering};

/// The number of `tools/call` requests being run.
#[derive(Debug, Default)]
pub struct CallsInFlight(AtomicUsize);

/// One call, counted in [`CallsInFlight`] until it is dropped.
pub struct InFlight<'a>(&'a CallsInFlight);

impl CallsInFlight {
    /// Counts a call until the returned guard is dropped.
    pub fn enter(&self) -> InFlight<'_> {
        self.0.fetch_add(1, Ordering::Relaxed);
        InFlight(self)
    }

    /// At most one call is being run (the asking one, or none). A request still unread in a
    /// session's socket is not counted; the record writer's own test (whether the last sync
    /// served a group) covers the rest.
    pub fn alone(&self) -> bool {
        self.0.load(Ordering::Relaxed) <= 1
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_alone_until_a_second_one_starts_and_again_once_it_ends() {
        let calls = CallsInFlight::default();
        assert!(calls.alone());
        let first = calls.enter();
        assert!(calls.alone());
        let second = calls.enter();
        assert!(!calls.alone());
        drop(second);
        assert!(calls.alone());
        drop(first);
        assert!(calls.alone());
    }
}
