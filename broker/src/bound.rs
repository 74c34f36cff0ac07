//! Syscalls bounded in time: a call that could block a broker thread for as long as an
//! executor likes (a connect on a socket the executor switched back to blocking mode) is
//! interrupted once its bound has passed.
//!
//! One watchdog thread per process does the interrupting, so a bounded call costs its
//! thread two signal-mask changes and two atomic stores, and no timer: arming and
//! disarming a timer per call reprograms the CPU's timer device, which under a hypervisor
//! costs several microseconds each time, more than the connect itself. The watchdog looks
//! at the calls in progress every [`TICK`] while any thread makes them, and sleeps, woken by
//! the next call, once none has begun for [`IDLE_TICKS`] looks.
//!
//! A call is interrupted by a signal whose handler does nothing and which is installed
//! without `SA_RESTART`, so the interrupted call returns EINTR. The signal is blocked on the
//! thread outside its bounded calls: one sent for a call that has just returned stays
//! pending until the thread's next bounded call unblocks it, and is then taken by the
//! handler before that call starts, so it interrupts nothing else the thread does.

use std::cell::RefCell;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::sys;

/// How often the watchdog looks at the calls in progress while there are any: a call is
/// interrupted at most this long after its bound has passed (and the time the watchdog takes
/// to be scheduled), and again every [`TICK`] until it returns.
const TICK: Duration = Duration::from_millis(1);

/// Looks in a row with no bounded call in progress and none begun since the last look,
/// before the watchdog sleeps until the next call (so a steady stream of calls, however
/// short, never has to wake it).
const IDLE_TICKS: u32 = 100;

/// A thread's bounded call, as the watchdog sees it.
#[derive(Debug)]
struct Slot {
    tid: libc::pid_t,
    /// When the call in progress must have returned, as [`now`]; 0 while there is none.
    deadline: AtomicU64,
    /// Held by the watchdog from reading an overdue deadline to signalling the thread, and
    /// by the thread while it clears the deadline: a signal meant for one call is never sent
    /// once that call has ended, so it cannot cut the thread's next call short.
    signalling: Mutex<()>,
}

/// The calls in progress, and the watchdog's sleep.
struct Watchdog {
    slots: Mutex<Vec<Arc<Slot>>>,
    /// Bounded calls begun so far: the watchdog stays awake while this moves, even when
    /// no look of its falls inside a call.
    calls: AtomicU64,
    /// The watchdog sleeps (or is about to) until a call wakes it.
    parked: AtomicBool,
    wake: Mutex<()>,
    woken: Condvar,
    /// The watchdog thread is running.
    started: OnceLock<()>,
    starting: Mutex<()>,
    /// A signal to an overdue call failed other than with ESRCH (logged once).
    signal_failed: AtomicBool,
}

static WATCHDOG: Watchdog = Watchdog {
    slots: Mutex::new(Vec::new()),
    calls: AtomicU64::new(0),
    parked: AtomicBool::new(false),
    wake: Mutex::new(()),
    woken: Condvar::new(),
    started: OnceLock::new(),
    starting: Mutex::new(()),
    signal_failed: AtomicBool::new(false),
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here leaves its data whole (a push, a retain, a flag).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Nanoseconds since the first look at the clock in this process, plus one: never 0, which
/// stands for "no call".
fn now() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let nanos = EPOCH.get_or_init(Instant::now).elapsed().as_nanos();
    u64::try_from(nanos).unwrap_or(u64::MAX - 1) + 1
}

impl Watchdog {
    /// Starts the watchdog thread (and installs the signal's handler) once per process; a
    /// start that failed is tried again by the next call.
    fn start(&'static self) -> io::Result<()> {
        if self.started.get().is_some() {
            return Ok(());
        }
        let _starting = lock(&self.starting);
        if self.started.get().is_some() {
            return Ok(());
        }
        sys::install_bound_handler()?;
        std::thread::Builder::new()
            .name("flowhost-bound".into())
            .spawn(|| WATCHDOG.run())?;
        let _ = self.started.set(());
        Ok(())
    }

    fn run(&self) {
        // Asleep until the first call: a process that starts the watchdog ahead of its calls
        // (a `sandbox run` whose command connects nowhere makes none) is not woken every
        // tick for nothing. A call begun before the watchdog's first look is found by it.
        let mut idle = IDLE_TICKS;
        let mut calls_seen = 0;
        loop {
            let calls = self.calls.load(Ordering::SeqCst);
            if self.interrupt_overdue() || calls != calls_seen {
                idle = 0;
            } else {
                idle += 1;
            }
            calls_seen = calls;
            if idle >= IDLE_TICKS {
                self.sleep_until_woken();
                idle = 0;
                continue;
            }
            std::thread::sleep(TICK);
        }
    }

    /// Signals every thread whose call is past its deadline; whether any call is in progress.
    fn interrupt_overdue(&self) -> bool {
        let slots = lock(&self.slots);
        let now = now();
        let mut busy = false;
        for slot in slots.iter() {
            let deadline = slot.deadline.load(Ordering::SeqCst);
            if deadline == 0 {
                continue;
            }
            busy = true;
            if now >= deadline {
                let _signalling = lock(&slot.signalling);
                // Read again under the lock: the call may have ended since.
                if slot.deadline.load(Ordering::SeqCst) == deadline {
                    // The thread is alive: it leaves the list (under the list's lock, held
                    // here) only when it exits, which it cannot do in the middle of a call.
                    // ESRCH would mean it has gone, and then nothing is left to interrupt.
                    // Any other failure leaves calls unbounded: said, once.
                    if let Err(e) = sys::signal_bound_thread(slot.tid)
                        && e.raw_os_error() != Some(libc::ESRCH)
                        && !self.signal_failed.swap(true, Ordering::SeqCst)
                    {
                        tracing::error!(error = %e, "cannot interrupt a bounded call: connects may block a thread beyond their bound");
                    }
                }
            }
        }
        busy
    }

    /// Sleeps until a call wakes it. `parked` is set before the calls are looked at once
    /// more, and a call stores its deadline before it reads `parked`, so either the look sees
    /// the call or the call sees `parked` and wakes the watchdog.
    fn sleep_until_woken(&self) {
        let mut wake = lock(&self.wake);
        self.parked.store(true, Ordering::SeqCst);
        let in_progress = lock(&self.slots)
            .iter()
            .any(|s| s.deadline.load(Ordering::SeqCst) != 0);
        if in_progress {
            self.parked.store(false, Ordering::SeqCst);
            return;
        }
        while self.parked.load(Ordering::SeqCst) {
            wake = self.woken.wait(wake).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn wake_if_parked(&self) {
        if self.parked.load(Ordering::SeqCst) {
            let _wake = lock(&self.wake);
            self.parked.store(false, Ordering::SeqCst);
            self.woken.notify_one();
        }
    }
}

/// A thread's place among the watched; it leaves with the thread.
struct Registration(Arc<Slot>);

impl Drop for Registration {
    fn drop(&mut self) {
        lock(&WATCHDOG.slots).retain(|s| !Arc::ptr_eq(s, &self.0));
    }
}

thread_local! {
    static REGISTRATION: RefCell<Option<Registration>> = const { RefCell::new(None) };
}

/// Starts the watchdog now, on the calling thread, rather than on the first bounded call. A
/// thread starts with its creator's credentials: started inside a call made with an
/// executor's identity (see `supervisor::as_executor`), the watchdog would be a broker
/// thread holding that executor's uid and none of the broker's capabilities for good.
pub fn start_watchdog() -> io::Result<()> {
    WATCHDOG.start()
}

/// Makes `call` (one syscall that may block) on the calling thread, interrupted with EINTR if
/// it is still blocked once `limit` has passed (by at most [`TICK`] more, and the watchdog's
/// scheduling). Nothing else the thread does is ever interrupted (see the module docs).
pub fn bounded<T>(limit: Duration, call: impl FnOnce() -> T) -> io::Result<T> {
    WATCHDOG.start()?;
    let slot = REGISTRATION.with(|r| {
        let mut r = r.borrow_mut();
        let registration = r.get_or_insert_with(|| {
            let slot = Arc::new(Slot {
                tid: nix::unistd::gettid().as_raw(),
                deadline: AtomicU64::new(0),
                signalling: Mutex::new(()),
            });
            lock(&WATCHDOG.slots).push(slot.clone());
            Registration(slot)
        });
        registration.0.clone()
    });
    let limit = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
    slot.deadline
        .store(now().saturating_add(limit), Ordering::SeqCst);
    let in_call = InCall(&slot);
    WATCHDOG.calls.fetch_add(1, Ordering::SeqCst);
    WATCHDOG.wake_if_parked();
    sys::block_bound_signal(false)?;
    let result = call();
    drop(in_call);
    Ok(result)
}

/// A bounded call in progress on this thread. However it ends (returned, or unwound by a
/// panic), the signal is blocked again and the deadline cleared, so the watchdog never goes
/// on signalling a thread that has left its call.
struct InCall<'a>(&'a Slot);

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        // Blocking the signal cannot fail (only an unknown `how` makes pthread_sigmask
        // fail); the call has been made, and its result is what the caller needs.
        let _ = sys::block_bound_signal(true);
        let _signalling = lock(&self.0.signalling);
        self.0.deadline.store(0, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn read_blocked(limit: Duration) -> (nix::Result<usize>, Duration) {
        let (read_end, _write_end) = nix::unistd::pipe().unwrap();
        let mut byte = [0u8; 1];
        let started = Instant::now();
        let r = bounded(limit, || nix::unistd::read(&read_end, &mut byte)).unwrap();
        (r, started.elapsed())
    }

    /// A 100 ms poll on `fd` (which never becomes readable) is not interrupted.
    fn poll_runs_its_full_length(fd: &impl AsFd) {
        let mut fds = [nix::poll::PollFd::new(
            fd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let waited = Instant::now();
        assert_eq!(
            nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u8)),
            Ok(0)
        );
        assert!(waited.elapsed() >= Duration::from_millis(95));
    }

    /// A call that blocks is cut off with EINTR at the bound; a quick one is untouched; and
    /// the thread's next blocking call is not interrupted by anything left of the bound.
    #[test]
    fn a_bounded_call_ends_at_its_bound_and_leaves_nothing_behind() {
        let (blocked, took) = read_blocked(Duration::from_millis(30));
        assert_eq!(blocked, Err(nix::errno::Errno::EINTR));
        assert!(took >= Duration::from_millis(30), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        let (read_end, write_end) = nix::unistd::pipe().unwrap();
        nix::unistd::write(&write_end, b"x").unwrap();
        let mut byte = [0u8; 1];
        let quick = bounded(Duration::from_millis(30), || {
            nix::unistd::read(&read_end, &mut byte)
        })
        .unwrap();
        assert_eq!(quick, Ok(1));
        // A call that returns just as its bound passes: the signal sent for it stays pending
        // (blocked) and touches none of the thread's later calls.
        for _ in 0..20 {
            let _ = bounded(Duration::from_micros(900), || {
                std::thread::sleep(Duration::from_millis(1))
            });
        }
        // A signal that comes once the call has returned (as the watchdog's may, racing the
        // call's end) stays pending: a blocking wait of the thread runs its full length, and
        // the next bounded call takes it before it starts, so it still runs to its bound.
        let me = nix::unistd::gettid().as_raw();
        let late_signal = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            sys::signal_bound_thread(me).unwrap();
        });
        poll_runs_its_full_length(&read_end);
        late_signal.join().unwrap();
        let (late, took) = read_blocked(Duration::from_millis(30));
        assert_eq!(late, Err(nix::errno::Errno::EINTR));
        assert!(took >= Duration::from_millis(30), "{took:?}");
        // Past the bound, a blocking wait of the same thread runs its full length.
        std::thread::sleep(Duration::from_millis(60));
        poll_runs_its_full_length(&read_end);
    }

    /// The watchdog that went to sleep for want of calls is woken by the next one, which is
    /// still cut off at its bound; so are calls on several threads at once.
    #[test]
    fn calls_after_an_idle_spell_and_on_several_threads_are_cut_off() {
        let _ = read_blocked(Duration::from_millis(5));
        // Long enough for the watchdog to have gone to sleep.
        std::thread::sleep(TICK * IDLE_TICKS * 3);
        let (after_idle, took) = read_blocked(Duration::from_millis(20));
        assert_eq!(after_idle, Err(nix::errno::Errno::EINTR));
        assert!(took < Duration::from_secs(2), "{took:?}");
        let threads: Vec<_> = (0..4)
            .map(|_| std::thread::spawn(|| read_blocked(Duration::from_millis(20))))
            .collect();
        for t in threads {
            let (r, took) = t.join().unwrap();
            assert_eq!(r, Err(nix::errno::Errno::EINTR));
            assert!(took >= Duration::from_millis(20), "{took:?}");
            assert!(took < Duration::from_secs(2), "{took:?}");
        }
    }
}
