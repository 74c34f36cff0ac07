//! flowhost's own lines on a stderr that is no terminal (a pipe, a file), while the command
//! runs: queued, and written by a thread of their own. Written by the run's one thread, a
//! pipe nobody read (`2>&1 | less`, left unscrolled) stopped the run in `write`: its
//! `--timeout`, the signals it passes on, its decisions. While the command runs, up to
//! [`LIMIT`] bytes wait; beyond, lines are dropped and counted. After, nothing is dropped,
//! and once the run has closed its records and written its health, flowhost waits for the
//! reader to take the rest, as any program would, a `kill` or Ctrl-C ending it meanwhile;
//! the count of what was dropped comes last.
//!
//! A terminal's own relay does the same for a stderr that is one ([`super::terminal`]).

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Most bytes waiting for the writer; what comes beyond is dropped and counted.
const LIMIT: usize = 1024 * 1024;

/// The lines waiting, and whether the writer is at work.
#[derive(Default)]
struct State {
    text: String,
    dropped: usize,
    writing: bool,
    /// Set once the command has ended: nothing is dropped from then on.
    unbounded: bool,
    /// Set once everything was written at the end: lines are written at once from then on.
    closed: bool,
}

#[derive(Default)]
struct Queue {
    state: Mutex<State>,
    changed: Condvar,
}

static QUEUE: OnceLock<Arc<Queue>> = OnceLock::new();

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Only strings and counters are guarded: a panic elsewhere leaves them usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// From now on, while the command runs, [`queued`] takes flowhost's lines (when the writer
/// thread cannot be started, nothing is queued, and lines are written as before).
pub(super) fn start() {
    let queue = Arc::new(Queue::default());
    let writer = queue.clone();
    let started = std::thread::Builder::new()
        .name("stderr".into())
        .spawn(move || write_queued(&writer));
    if started.is_ok() {
        let _ = QUEUE.set(queue);
    }
}

fn write_queued(queue: &Queue) {
    loop {
        let text = {
            let mut state = queue.lock();
            while state.text.is_empty() {
                state = queue.changed.wait(state).unwrap_or_else(|p| p.into_inner());
            }
            state.writing = true;
            std::mem::take(&mut state.text)
        };
        // Nobody reads it any more: the run and its records go on.
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
        queue.lock().writing = false;
        queue.changed.notify_all();
    }
}

/// Queues `text` for stderr; `false` when nothing is being queued (it is for the caller to
/// write).
pub(super) fn queued(text: &str) -> bool {
    let Some(queue) = QUEUE.get() else {
        return false;
    };
    let mut state = queue.lock();
    if state.closed {
        return false;
    }
    if !state.unbounded && state.text.len() + text.len() > LIMIT {
        state.dropped += text.len();
    } else {
        state.text.push_str(text);
    }
    drop(state);
    queue.changed.notify_all();
    true
}

/// The command has ended: what flowhost says from now on (its verdicts) is never dropped.
/// Nothing waits here: the run closes its records and writes its health first.
pub(super) fn command_ended() {
    if let Some(queue) = QUEUE.get() {
        queue.lock().unbounded = true;
    }
}

/// Whether lines are queued and not yet all written at the end: [`finish`] has work to do.
pub(super) fn waiting() -> bool {
    QUEUE.get().is_some_and(|q| !q.lock().closed)
}

/// The run is over (its records closed, its health written) and the interrupts have their
/// default action back (`defaults`: a `kill` or Ctrl-C then ends flowhost, as any program
/// waiting on its output): raises those `taken` says were taken before and not acted on,
/// waits until everything queued is written (as long as the reader takes), says what was
/// dropped, and writes later lines at once. Once done, it does nothing.
pub(super) fn finish(defaults: std::io::Result<()>, taken: &mut dyn FnMut() -> Vec<libc::c_int>) {
    if !waiting() {
        return;
    }
    let Some(queue) = QUEUE.get() else {
        return;
    };
    match defaults {
        Ok(()) => {
            for signal in taken() {
                if let Ok(signal) = nix::sys::signal::Signal::try_from(signal) {
                    let _ = nix::sys::signal::raise(signal);
                }
            }
        }
        Err(e) => {
            queued(&format!(
                "flowhost sandbox: cannot give the interrupts their default action back ({e}): \
                 while flowhost waits for stderr to take its last lines, only SIGKILL ends it\n"
            ));
        }
    }
    let mut state = queue.lock();
    while !state.text.is_empty() || state.writing {
        state = queue.changed.wait(state).unwrap_or_else(|p| p.into_inner());
    }
    state.closed = true;
    let dropped = std::mem::take(&mut state.dropped);
    drop(state);
    if dropped > 0 {
        let _ = std::io::stderr().lock().write_all(
            format!(
                "flowhost sandbox: {dropped} bytes of flowhost's messages were dropped while \
                 stderr took none (the run went on)\n"
            )
            .as_bytes(),
        );
    }
}
