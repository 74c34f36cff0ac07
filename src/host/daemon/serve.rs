//! Serving: accepting connections (each admitted by its peer's credentials), reloading on
//! SIGHUP, feeding the systemd watchdog, and stopping gracefully.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;

use super::*;

/// What a stop may take beyond the calls in flight: the sessions' 2 s, stopping the
/// executors, closing the records, binding the flow state (a database round trip within its
/// timeout) and writing the health.
const STOP_BEYOND_CALLS: Duration = Duration::from_secs(30);

/// The async runtime's worker threads when the operator sets none (`serve --workers`): one
/// fewer than the CPUs, and at least one. The daemon's own work per call is short and mostly
/// hand-offs; the executors, the broker's threads, the records' sync thread and the clients
/// need the CPUs too, and workers that steal each other's tasks wake each other across CPUs.
/// On 2 CPUs one worker served 15.5-18.4 k calls/s (8 sessions x 4 in flight) where two
/// served 11.7-13.7 k/s, one call at a time as fast (BENCHMARKS.md).
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
}

/// The async runtime the daemon serves on, with `workers` threads (at least one). With one,
/// it is a current-thread runtime: its tasks run on the thread that drives it (with
/// `block_on`), which must keep driving it for the host to make progress. One worker of a
/// multi-thread runtime pays for the machinery that lets workers steal each other's tasks
/// with nobody to steal from: on 2 CPUs the current-thread runtime served about 10 % more
/// calls at 8 sessions x 4 in flight, one call at a time as fast (BENCHMARKS.md). Timers,
/// I/O and signals are enabled either way.
pub fn serve_runtime(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = if workers <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(workers);
        b
    };
    builder.enable_all().build()
}

impl Host {
    /// Admits or refuses a new connection by its peer's credentials (checked before it
    /// takes any shared slot); a refusal is logged, rate-limited, and the stream closed.
    fn admit(&self, stream: &tokio::net::UnixStream) -> Option<(admission::Slot, u32, u32)> {
        let Ok(cred) = stream.peer_cred() else {
            tracing::warn!("cannot read a peer's credentials; closing the connection");
            return None;
        };
        let (uid, gid) = (cred.uid(), cred.gid());
        let config = &self.current().config;
        let peer = match config.principal_for(uid, gid) {
            Some(p) => admission::Peer::Principal {
                id: p.id.to_string(),
                configured: config
                    .principals
                    .iter()
                    .filter(|p| !p.uids.is_empty() || !p.gids.is_empty())
                    .count(),
            },
            None => admission::Peer::Stranger(uid),
        };
        match self.admission.admit(&peer) {
            Ok(slot) => Some((slot, uid, gid)),
            Err(refusal) => {
                self.admission.log_refusal(uid, peer.class(), refusal);
                None
            }
        }
    }
}

/// A reload's start (the monotonic clock, for `flowhost reload`) and its outcome.
type ReloadDone = (Option<u64>, Result<u64, StartupError>);

/// Tells systemd a reload starts and starts it on its own task.
fn start_reload(host: &Arc<Host>) -> tokio::task::JoinHandle<ReloadDone> {
    let started_usec = reload::monotonic_usec();
    let states = match started_usec {
        Some(u) => vec![
            sd_notify::NotifyState::Reloading,
            sd_notify::NotifyState::MonotonicUsec(u.into()),
        ],
        None => vec![sd_notify::NotifyState::Reloading],
    };
    let _ = sd_notify::notify(false, &states);
    let host = host.clone();
    tokio::spawn(async move { (started_usec, host.reload().await) })
}

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Served {
    /// Stopped as asked, records closed and health written.
    Clean,
    /// Stopped, but something of the stop failed (the log says what): the records or the
    /// health may not vouch for the end of the run.
    Unclean,
    /// Never served: the signal handlers could not be installed.
    NotStarted,
}

/// A status line for the service manager: `text` with every control character escaped. A
/// notification is lines of `KEY=value`, and text from an executor (the error it answered
/// `initialize` with, in a refusal to start or to reload) could otherwise add settings of
/// its own (`WATCHDOG=trigger`, `MAINPID=...`) to the host's.
pub fn service_status(text: &str) -> String {
    flowhost_broker::Escaped(text).to_string()
}

/// Runs the host until SIGTERM/SIGINT: accepts connections, reloads on SIGHUP, keeps the
/// systemd watchdog fed, and on stop lets sessions finish their current request.
pub async fn run(host: Arc<Host>, listener: UnixListener) -> Served {
    use tokio::signal::unix::{SignalKind, signal};
    let notify = |states: &[sd_notify::NotifyState]| {
        let _ = sd_notify::notify(false, states);
    };
    let (mut term, mut int, mut hup) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(t), Ok(i), Ok(h)) => (t, i, h),
        _ => {
            tracing::error!("cannot install signal handlers; stopping");
            host.begin_shutdown();
            let _ = host
                .finish_refused("nothing was served: the signal handlers could not be installed")
                .await;
            return Served::NotStarted;
        }
    };
    let mut watchdog_usec = 0u64;
    let watchdog = sd_notify::watchdog_enabled(false, &mut watchdog_usec);
    let mut tick = tokio::time::interval(if watchdog {
        Duration::from_micros(watchdog_usec / 2).max(Duration::from_millis(100))
    } else {
        Duration::from_secs(3600)
    });
    let mut summaries = tokio::time::interval(SUMMARY_INTERVAL);
    let http_listener = host.http.lock().ok().and_then(|mut l| l.take());
    let http_task = http_listener.map(|l| tokio::spawn(http::serve(host.clone(), l)));
    let mut sessions = tokio::task::JoinSet::new();
    let mut housekeeping = tokio::time::interval(
        host.refusals
            .interval()
            .min(Duration::from_secs(30))
            .max(Duration::from_millis(100)),
    );
    let mut last_space_warning: Option<tokio::time::Instant> = None;
    // The first tick of an interval is at once; the start has just checked the state.
    let state_check_interval = host.current().config.state_check_interval;
    let mut state_checks = tokio::time::interval_at(
        tokio::time::Instant::now() + state_check_interval,
        state_check_interval,
    );
    state_checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // One check at a time, beside the loop: its reading of the records runs on a blocking
    // thread and may take a while after a busy interval.
    let mut state_check: Option<tokio::task::JoinHandle<()>> = None;
    let status = {
        let generation = host.current();
        // The socket served: under socket activation, the one systemd passed, whatever
        // the configuration's `socket` says.
        let served = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(std::path::Path::to_path_buf))
            .unwrap_or_else(|| generation.config.socket.clone());
        format!(
            "serving {} tools from {} servers on {}",
            generation.registry.tools().count(),
            generation.servers.len(),
            served.display()
        )
    };
    let status = service_status(&status);
    notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&status),
    ]);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        pid = std::process::id(),
        "ready: {status}"
    );
    // A reload runs beside the loop: priming the new generation's executors can take up to
    // the call timeout per server, and meanwhile connections are still accepted, the
    // watchdog fed and a stop obeyed.
    let mut reloading: Option<tokio::task::JoinHandle<ReloadDone>> = None;
    let mut reload_again = false;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // A refused connection is closed at once: the client sees end-of-stream,
                    // not a hang, and the daemon keeps descriptors for the sessions it serves.
                    if let Some((slot, uid, gid)) = host.admit(&stream) {
                        sessions.spawn(session::serve(host.clone(), stream, slot, uid, gid));
                    }
                }
                Err(e) => {
                    // Typically EMFILE/ENFILE: retrying at once would spin; let sessions end.
                    tracing::warn!(error = %e, "accept failed; pausing accepts for 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            // Reap finished sessions so the set does not grow without bound.
            Some(_) = sessions.join_next(), if !sessions.is_empty() => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = host.stopped() => break,
            _ = hup.recv() => {
                if !host.reloads() {
                    tracing::warn!("SIGHUP ignored: this host serves the manifests it started with to the end");
                    continue;
                }
                // One reload at a time; a SIGHUP during one asks for another after it, which
                // reads the configuration as it is then.
                match reloading {
                    Some(_) => reload_again = true,
                    None => reloading = Some(start_reload(&host)),
                }
            }
            done = async {
                match reloading.as_mut() {
                    Some(task) => task.await,
                    None => std::future::pending().await,
                }
            }, if reloading.is_some() => {
                reloading = None;
                let (started_usec, outcome) = match done {
                    Ok(done) => done,
                    Err(e) => (None, Err(StartupError::ReloadAborted(e.to_string()))),
                };
                let (accepted, generation, status) = match &outcome {
                    Ok(id) => (true, *id, format!("reloaded: generation {id}")),
                    Err(e) => (false, host.current().id, format!("reload refused, still serving the previous configuration: {}", crate::causes::WithCauses(e))),
                };
                if accepted {
                    tracing::info!("{status}");
                } else {
                    tracing::error!("{status}");
                }
                notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&service_status(&status))]);
                // `flowhost reload` (ExecReload) waits for this; without it, it fails closed.
                let verdict = reload::ReloadVerdict {
                    pid: std::process::id(),
                    started_usec: started_usec.unwrap_or(0),
                    accepted,
                    generation,
                    message: status,
                };
                if let Err(e) = verdict.write(&host.current().config.state_dir) {
                    tracing::error!("cannot write the reload verdict: {e}");
                }
                if std::mem::take(&mut reload_again) {
                    reloading = Some(start_reload(&host));
                }
            }
            _ = state_checks.tick() => {
                if state_check.as_ref().is_none_or(|t| t.is_finished()) {
                    let host = host.clone();
                    state_check = Some(tokio::spawn(async move {
                        host.check_state_while_serving().await
                    }));
                }
            }
            _ = summaries.tick() => host.admission.summarize(),
            _ = tick.tick() => {
                if watchdog {
                    notify(&[sd_notify::NotifyState::Watchdog]);
                }
            }
            _ = housekeeping.tick() => {
                host.flush_refusals(false).await;
                if let Some(low) = host.records_space_warning()
                    && last_space_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(300))
                {
                    tracing::warn!("{low}");
                    last_space_warning = Some(tokio::time::Instant::now());
                }
            }
        }
    }
    // The stop lets calls in flight run to their deadline, then closes the records and
    // binds the state: the service manager is asked to wait that long (the unit's own
    // TimeoutStopSec is a fixed 45 s), or it would kill the daemon before its records and
    // health are closed.
    let may_take = (host.current().config.call_timeout + STOP_BEYOND_CALLS).as_micros();
    notify(&[
        sd_notify::NotifyState::Stopping,
        sd_notify::NotifyState::ExtendTimeoutUsec(u32::try_from(may_take).unwrap_or(u32::MAX)),
        sd_notify::NotifyState::Status("stopping"),
    ]);
    tracing::info!("stopping: finishing calls in flight");
    // A reload still priming is abandoned: the generation serving now is the one that stops.
    if let Some(task) = reloading.take() {
        task.abort();
    }
    host.begin_shutdown();
    drop(listener);
    let drain = async { while sessions.join_next().await.is_some() {} };
    let mut abandoned = tokio::time::timeout(
        host.current().config.call_timeout + Duration::from_secs(2),
        drain,
    )
    .await
    .is_err();
    if let Some(task) = http_task {
        // A task that failed (it panicked) cannot say its sessions ended.
        abandoned |= task.await.unwrap_or(true);
    }
    if abandoned {
        tracing::warn!(
            "sessions did not finish in time; the final health calls the records incomplete"
        );
    }
    // The stop's own check follows one in progress, never runs beside it.
    if let Some(task) = state_check {
        let _ = task.await;
    }
    if host.finish(abandoned).await {
        tracing::info!("stopped");
        Served::Clean
    } else {
        tracing::error!("stopped, but the stop did not complete (see above)");
        Served::Unclean
    }
}

#[cfg(test)]
mod tests {
    /// What an executor said (in a refusal to start or to reload) stays one status line: a
    /// line break in it would give the service manager a setting of the executor's choosing.
    #[test]
    fn a_status_line_holds_no_setting_of_its_text() {
        let status =
            super::service_status("refusing to start: error -1: x\nWATCHDOG=trigger\nMAINPID=1\r");
        assert!(!status.contains(['\n', '\r']), "{status}");
        assert!(
            status.starts_with("refusing to start: error -1: x"),
            "{status}"
        );
    }
}
