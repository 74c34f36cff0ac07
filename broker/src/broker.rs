//! The broker: checks the kernel once, owns the spawner and reaper threads, and supervises
//! every executor it starts.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

use crate::attempt::Judge;
use crate::cgroup::{CgroupSupport, Controller, ExecutorCgroup};
use crate::executor::Executor;
use crate::filter::Programs;
use crate::profile::{CgroupMode, LandlockMode, Profile};
use crate::reap::{Lease, LeaseGuard, Reap, ReaperJob};
use crate::spawn::{self, Prepared, SpawnError, SpawnSpec, Started};
use crate::supervisor::{self, Context, Counters, End};
use crate::sys;
use crate::uids::{UidPool, UidRange};

/// Why the broker cannot run on this host. The host must not serve anything that needs
/// mediation in that case.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// A kernel primitive the broker cannot work without is missing.
    #[error("the native broker cannot run here: {0}")]
    Unsupported(String),
    /// The process holds some but not all of the capabilities privileged mode needs (or is
    /// root without them).
    #[error("the native broker needs these capabilities, which this process lacks: {0}")]
    MissingCapabilities(String),
    /// The process's securebits lock off a bit every executor must hold.
    #[error(
        "the process's securebits (0x{bits:x}) lock {} off, so no executor can be given {}; \
         under systemd set SecureBits=noroot noroot-locked (or leave SecureBits= unset)",
        locked_off.join(" and "),
        if locked_off.len() == 1 { "it" } else { "them" }
    )]
    LockedSecurebits {
        /// The securebits the process holds.
        bits: libc::c_ulong,
        /// The executor securebits they lock off.
        locked_off: Vec<&'static str>,
    },
    /// A helper thread could not be started.
    #[error("cannot start the broker's {0} thread: {1}")]
    Thread(&'static str, std::io::Error),
    /// The range of executor uids holds a user's or group's id, or cannot be checked.
    #[error(transparent)]
    UidRange(#[from] crate::uids::RangeHeld),
}

/// Options for [`Broker::new`].
#[derive(Debug, Clone, Default)]
pub struct BrokerOptions {
    /// One uid/gid every executor shares in privileged mode. When unset (the default), each
    /// live executor gets a uid of its own from [`BrokerOptions::executor_uids`].
    pub executor_identity: Option<(u32, u32)>,
    /// The range executors' own uids come from (default [`UidRange::DEFAULT`]).
    pub executor_uids: Option<UidRange>,
}

/// What the broker knows about the kernel it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSupport {
    /// Landlock ABI version (0 = none).
    pub landlock_abi: i32,
    /// Whether the broker holds its capabilities (executors get namespaces and a dedicated
    /// uid) or runs unprivileged (executors get a user namespace).
    pub privileged: bool,
}

/// A snapshot of the broker's supervision counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BrokerStats {
    /// Executors started.
    pub spawned: u64,
    /// Executors whose supervision ended because they exited.
    pub exited: u64,
    /// Supervisors that failed (their executor was killed).
    pub supervisor_failures: u64,
    /// Spawns refused or failed.
    pub failed_spawns: u64,
    /// Notifications received.
    pub notifications: u64,
    /// Attempts allowed.
    pub allowed: u64,
    /// Attempts refused.
    pub denied: u64,
    /// Notifications the broker could not handle.
    pub failed_notifications: u64,
    /// Seccomp programs compiled: one per distinct profile, however many spawns it has.
    pub programs_compiled: u64,
}

impl BrokerStats {
    /// Executors currently under supervision.
    pub fn supervised(&self) -> u64 {
        self.spawned - self.exited - self.supervisor_failures
    }
}

/// Stack of a supervision thread: handlers keep their state on the heap, and what runs on
/// the stack is syscalls and small buffers.
const SUPERVISOR_STACK: usize = 1024 * 1024;

/// Work for the spawner thread.
// One of each per spawn, moved once through a channel: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Job {
    /// Start a prepared executor.
    Start {
        prepared: Prepared,
        /// Its uid and cgroups: held by the started executor, so that a caller that gave up
        /// does not release them before the executor is killed and reaped.
        lease: LeaseGuard,
        reply: oneshot::Sender<Result<(Started, Prepared), (SpawnError, Prepared)>>,
    },
    /// Lease a uid for an executor being prepared: the scan of the host's processes this
    /// takes runs here while the caller creates the executor's cgroups.
    LeaseUid {
        pool: Arc<UidPool>,
        reply: oneshot::Sender<Result<Option<crate::uids::UidLease>, crate::uids::UidScanError>>,
    },
}

struct Inner {
    jobs: std::sync::Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    reaper: std::sync::mpsc::Sender<ReaperJob>,
    support: KernelSupport,
    identity: Option<(u32, u32)>,
    uids: Option<Arc<UidPool>>,
    cgroups: Arc<CgroupSupport>,
    /// Each profile's seccomp program, compiled once.
    programs: Programs,
    counters: Arc<Counters>,
    /// Notifications being handled across all executors (bounded by `supervisor::BROKER_HANDLERS`).
    handlers: Arc<tokio::sync::Semaphore>,
    spawned: AtomicU64,
    exited: AtomicU64,
    supervisor_failures: AtomicU64,
    failed_spawns: AtomicU64,
    /// The host's own listeners, which no executor reaches.
    host_endpoints: Arc<crate::host_endpoints::HostEndpoints>,
}

/// The native broker. Cheap to clone. Executors die with the broker: they carry a
/// parent-death signal bound to the broker's spawner thread, which lives exactly as long as
/// the last clone of the broker.
#[derive(Clone)]
pub struct Broker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("support", &self.inner.support)
            .finish()
    }
}

fn probe_pidfd_getfd() -> Result<(), String> {
    let me = sys::pidfd_open(std::process::id() as i32)
        .map_err(|e| sys::describe_pidfd_failure("pidfd_open", "5.3", &e))?;
    sys::pidfd_getfd(me.as_fd(), 0)
        .map(drop)
        .map_err(|e| sys::describe_pidfd_failure("pidfd_getfd", "5.6", &e))
}

impl Broker {
    /// Checks the kernel and the process, and starts the broker's threads. Fails closed:
    /// without seccomp user notification, pidfds, or the capabilities (or a user namespace)
    /// to confine and supervise executors, there is no broker.
    pub fn new(options: BrokerOptions) -> Result<Self, BrokerError> {
        if !sys::user_notif_available() {
            return Err(BrokerError::Unsupported(
                "seccomp user notification (SECCOMP_RET_USER_NOTIF) is not available; Linux 5.0 or later with seccomp filters is required".into(),
            ));
        }
        probe_pidfd_getfd().map_err(BrokerError::Unsupported)?;
        // Privileged mode (namespaces, a dedicated executor uid) needs these capabilities,
        // whether the host runs as root or as a service user granted them (systemd
        // AmbientCapabilities). With none of them, the broker uses a user namespace.
        use caps::{CapSet, Capability};
        let needed = [
            (Capability::CAP_SYS_ADMIN, "namespaces and mounts"),
            (
                Capability::CAP_SYS_PTRACE,
                "reading executor memory and taking their sockets",
            ),
            (Capability::CAP_SETUID, "switching executors to their uid"),
            (Capability::CAP_SETGID, "switching executors to their gid"),
            (
                Capability::CAP_SETPCAP,
                "emptying executors' capability bounding set",
            ),
            // An executor runs as a uid of its own: signalling it (its wall-clock limit, a
            // call's deadline, a stop) needs the right to signal another user's process.
            (
                Capability::CAP_KILL,
                "ending executors, which run as other uids",
            ),
        ];
        let have = |c: &Capability| caps::has_cap(None, CapSet::Effective, *c).unwrap_or(false);
        let missing: Vec<String> = needed
            .iter()
            .filter(|(c, _)| !have(c))
            .map(|(c, why)| format!("{c} ({why})"))
            .collect();
        let root = nix::unistd::geteuid().is_root();
        let privileged = missing.is_empty();
        if !privileged && (root || missing.len() < needed.len()) {
            // Root without them, or a partial grant: a misconfiguration, not a reason to
            // fall back to weaker isolation.
            return Err(BrokerError::MissingCapabilities(missing.join(", ")));
        }
        if !privileged {
            let max = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(0);
            if max == 0 {
                return Err(BrokerError::Unsupported(
                    "the process has none of the broker's capabilities and user namespaces are disabled (user.max_user_namespaces = 0); run as root, grant the capabilities, or enable user namespaces".into(),
                ));
            }
        }
        if privileged {
            // Executors inherit the host's securebits: a bit locked off here (systemd's
            // SecureBits=noroot-locked without noroot) would fail every spawn.
            let bits = sys::securebits().map_err(|e| {
                BrokerError::Unsupported(format!("cannot read the process's securebits: {e}"))
            })?;
            let locked_off = crate::child::securebits_locked_off(bits);
            if !locked_off.is_empty() {
                return Err(BrokerError::LockedSecurebits { bits, locked_off });
            }
        }
        let support = KernelSupport {
            landlock_abi: sys::landlock_abi(),
            privileged,
        };
        // A shared identity only when the operator names one; else a uid per executor.
        let identity = if privileged {
            options.executor_identity
        } else {
            None
        };
        // Every broker that hands out uids checks the range, however it was started
        // (the daemon, `sandbox run`, the demo).
        let uids = match (privileged, identity) {
            (true, None) => {
                let range = options.executor_uids.unwrap_or(UidRange::DEFAULT);
                range.held_by_nobody()?;
                Some(Arc::new(UidPool::new(range)))
            }
            _ => None,
        };
        let cgroups = Arc::new(if privileged {
            CgroupSupport::detect()
        } else {
            CgroupSupport::none(
                "the broker runs unprivileged (executors in a user namespace) and creates no cgroups",
            )
        });

        // Here, with the broker's own credentials (see `bound::start_watchdog`).
        crate::bound::start_watchdog().map_err(|e| BrokerError::Thread("connect watchdog", e))?;
        let (handshake_tx, handshake_rx) = std::sync::mpsc::channel::<spawn::HandshakeJob>();
        std::thread::Builder::new()
            .name("flowhost-handshk".into())
            .spawn(move || spawn::run_handshakes(handshake_rx))
            .map_err(|e| BrokerError::Thread("handshake", e))?;
        let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("flowhost-spawner".into())
            .spawn(move || {
                // Executors' parent-death signal is tied to this thread: it ends only when
                // the last Broker handle is gone.
                while let Ok(job) = jobs_rx.recv() {
                    let (prepared, lease, reply) = match job {
                        Job::Start {
                            prepared,
                            lease,
                            reply,
                        } => (prepared, lease, reply),
                        Job::LeaseUid { pool, reply } => {
                            // A caller that gave up drops the lease unanswered: returned.
                            let _ = reply.send(pool.lease());
                            continue;
                        }
                    };
                    let result = spawn::start(&prepared, &handshake_tx);
                    let reply_with = match result {
                        Ok(started) => Ok((started.holding(lease), prepared)),
                        // A child that failed to start was killed and reaped.
                        Err(e) => Err((e, prepared)),
                    };
                    // A caller that gave up drops the answer, and with it the executor,
                    // killed and reaped (see `Started`), here or wherever the answer
                    // waiting for it is dropped.
                    let _ = reply.send(reply_with);
                }
            })
            .map_err(|e| BrokerError::Thread("spawner", e))?;
        let (reaper_tx, reaper_rx) = std::sync::mpsc::channel::<ReaperJob>();
        std::thread::Builder::new()
            .name("flowhost-reaper".into())
            .spawn(move || {
                while let Ok(job) = reaper_rx.recv() {
                    job.run();
                }
            })
            .map_err(|e| BrokerError::Thread("reaper", e))?;
        // Beside the first spawns rather than before them: a sweep never touches the
        // cgroups of a live broker, and the cgroups of this one do not exist yet.
        let _ = reaper_tx.send(ReaperJob::Sweep(cgroups.clone()));

        Ok(Broker {
            inner: Arc::new(Inner {
                jobs: std::sync::Mutex::new(Some(jobs_tx)),
                reaper: reaper_tx,
                support,
                identity,
                uids,
                cgroups,
                programs: Programs::default(),
                counters: Arc::new(Counters::default()),
                handlers: Arc::new(tokio::sync::Semaphore::new(
                    crate::supervisor::BROKER_HANDLERS,
                )),
                spawned: AtomicU64::new(0),
                exited: AtomicU64::new(0),
                supervisor_failures: AtomicU64::new(0),
                failed_spawns: AtomicU64::new(0),
                host_endpoints: Default::default(),
            }),
        })
    }

    /// Keeps every executor, running or to come, from the host's own listeners: a connect
    /// or send to the unix socket file at any of `unix` (by its inode, so through any link
    /// or mount of it), or a TCP connect to any of `tcp` (by any address that leads there),
    /// is refused with ECONNREFUSED, as if nothing listened, before it is decided. The
    /// broker makes those connections itself, so one that reached the host would arrive
    /// as the broker and could be taken for whoever the host maps the broker's uid to.
    /// Fails when a socket file cannot be looked at.
    pub fn keep_executors_from(
        &self,
        unix: &[&std::path::Path],
        tcp: &[std::net::SocketAddr],
    ) -> std::io::Result<()> {
        self.inner.host_endpoints.add(unix, tcp)
    }

    /// What the broker found about the kernel and process.
    pub fn support(&self) -> KernelSupport {
        self.inner.support
    }

    /// Checks that `profile` can be enforced on this kernel (call at startup, so a profile
    /// that cannot be honoured stops the host before it serves anything): Landlock when it
    /// is required, every whole-executor bound the profile sets when its cgroup mode is
    /// `required`, and, for a profile without a pid namespace, a cgroup for each executor
    /// (the only thing that would end its tree when it is killed).
    pub fn check_profile(&self, profile: &Profile) -> Result<(), SpawnError> {
        if profile.landlock == LandlockMode::Required && self.inner.support.landlock_abi <= 0 {
            return Err(SpawnError::Unsupported {
                profile: profile.name.clone(),
                feature: "Landlock",
                observed: sys::landlock_unavailable().unwrap_or_default(),
            });
        }
        self.require_bounds(profile)?;
        self.inner
            .programs
            .get(profile)
            .map(drop)
            .map_err(|e| SpawnError::Prepare(e.to_string()))
    }

    /// Refuses a `required` profile whose whole-executor bounds this host cannot enforce,
    /// and a profile without a pid namespace whose executors would get no cgroup: killing
    /// such an executor would leave what it started running (only pid 1 of a pid namespace
    /// takes its tree with it, and only a cgroup reaches the tree otherwise).
    fn require_bounds(&self, profile: &Profile) -> Result<(), SpawnError> {
        if !profile.pid_namespace {
            self.inner
                .cgroups
                .holds_tree(&profile.limits)
                .map_err(|why| SpawnError::TreeUnheld {
                    profile: profile.name.clone(),
                    why,
                })?;
        }
        if profile.limits.cgroup != CgroupMode::Required {
            return Ok(());
        }
        let cgroups = &self.inner.cgroups;
        for c in Controller::ALL {
            if c.bound(&profile.limits).is_none() {
                continue;
            }
            let unheld = match (cgroups.base(c), c) {
                (Err(why), _) => Some(why),
                (Ok(_), Controller::Memory) => cgroups.swap_uncapped(),
                (Ok(_), _) => None,
            };
            if let Some(why) = unheld {
                return Err(SpawnError::BoundUnenforceable {
                    profile: profile.name.clone(),
                    field: c.field(),
                    why: why.to_string(),
                });
            }
        }
        Ok(())
    }

    /// The uids executors run as, as this host sees them: the shared identity, the range each
    /// executor's own uid is leased from, or, unprivileged, the broker's own uid (which an
    /// executor keeps, in a user namespace). What a host-side service only executors may use
    /// (an executor's resolver) checks its peers against.
    pub fn executor_uids(&self) -> UidRange {
        match (self.inner.identity, &self.inner.uids) {
            (Some((uid, _)), _) => UidRange {
                first: uid,
                count: 1,
            },
            (None, Some(pool)) => pool.range(),
            (None, None) => UidRange {
                first: nix::unistd::getuid().as_raw(),
                count: 1,
            },
        }
    }

    /// Which bounds an executor of `profile` runs under on this host, and how each is
    /// enforced or why it is not (printed at start by `serve` and `sandbox run`).
    pub fn bounds(&self, profile: &Profile) -> crate::bounds::BoundsReport {
        crate::bounds::BoundsReport::new(
            profile,
            &self.inner.cgroups,
            self.inner.identity,
            self.inner.uids.as_ref().map(|u| u.range()),
            self.inner.support.landlock_abi,
        )
    }

    /// Hands `job` to the spawner thread.
    fn send(&self, job: Job) -> Result<(), SpawnError> {
        let jobs = self.inner.jobs.lock().map_err(|_| SpawnError::BrokerGone)?;
        jobs.as_ref()
            .ok_or(SpawnError::BrokerGone)?
            .send(job)
            .map_err(|_| SpawnError::BrokerGone)
    }

    /// Waits (at most `within`) until the cgroups and uids of every executor that has
    /// ended so far are released, so that a process that exits next leaves no executor
    /// cgroup behind. Returns whether they were.
    pub async fn released(&self, within: Duration) -> bool {
        let (done, finished) = oneshot::channel();
        if self.inner.reaper.send(ReaperJob::Flush(done)).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(within, finished).await, Ok(Ok(())))
    }

    /// Supervision counters across every executor this broker started.
    pub fn stats(&self) -> BrokerStats {
        let c = &self.inner.counters;
        BrokerStats {
            spawned: self.inner.spawned.load(Ordering::SeqCst),
            exited: self.inner.exited.load(Ordering::SeqCst),
            supervisor_failures: self.inner.supervisor_failures.load(Ordering::SeqCst),
            failed_spawns: self.inner.failed_spawns.load(Ordering::SeqCst),
            notifications: c.notifications.load(Ordering::Relaxed),
            allowed: c.allowed.load(Ordering::Relaxed),
            denied: c.denied.load(Ordering::Relaxed),
            failed_notifications: c.failed.load(Ordering::Relaxed),
            programs_compiled: self.inner.programs.compilations(),
        }
    }

    /// Starts an executor under `spec`. Returns only once the executor has exec'd with its
    /// filter installed and its listener held by a running supervisor. Must be called
    /// within a tokio runtime; supervision lives as long as that runtime (a task on it that
    /// receives the notifications, and every attempt goes to the executor's attempt stream).
    pub async fn spawn(&self, spec: SpawnSpec) -> Result<Executor, SpawnError> {
        self.spawn_judged(spec, None).await
    }

    /// [`Broker::spawn`], with a synchronous [`Judge`] that may decide each attempt as soon
    /// as it is known. With a judge, notifications are received and handled on a thread of
    /// their own, and the attempts the judge leaves undecided go to the executor's attempt
    /// stream; without one, this is [`Broker::spawn`].
    pub async fn spawn_judged(
        &self,
        spec: SpawnSpec,
        judge: Option<Judge>,
    ) -> Result<Executor, SpawnError> {
        let fail = |e: SpawnError| {
            self.inner.failed_spawns.fetch_add(1, Ordering::SeqCst);
            e
        };
        // Checked at every spawn too: a caller that skipped check_profile must not get an
        // executor without the bounds its profile demands.
        self.require_bounds(&spec.profile).map_err(fail)?;
        // The executor's own uid and cgroup, released by the reaper once it has ended. The
        // uid is leased on the spawner thread while this one creates the cgroups.
        let pending_uid = match (&spec.identity, &self.inner.uids) {
            (None, Some(pool)) => {
                let (reply, leased) = oneshot::channel();
                self.send(Job::LeaseUid {
                    pool: pool.clone(),
                    reply,
                })
                .map_err(fail)?;
                Some((pool.range(), leased))
            }
            _ => None,
        };
        // Guarded from its first part on: a spawn dropped while it waits for its uid (a call
        // cancelled, a deadline) sends the cgroups made meanwhile to the reaper.
        let mut lease = LeaseGuard::new(Lease::default(), self.inner.reaper.clone());
        let limits = spec.profile.limits;
        let absent_unix_sockets = Arc::new(spec.profile.absent_unix_sockets.clone());
        // As Landlock's rules name them: a path in what the child mounts afresh (its private
        // /tmp) as written, since its rule is made on the executor's file; any other opened
        // here (symlinks followed, a relative one from here), and one that cannot be opened
        // has no rule, and holds nothing here either.
        let bind_roots = Arc::new(
            spec.profile
                .read_write
                .iter()
                .chain(&spec.write_paths)
                .filter_map(|p| {
                    if spawn::remounted(&spec.profile, p) {
                        Some(p.clone())
                    } else {
                        std::fs::canonicalize(p).ok()
                    }
                })
                .collect::<Vec<_>>(),
        );
        if Controller::ALL.iter().any(|c| c.bound(&limits).is_some()) {
            lease.hold_cgroup(
                ExecutorCgroup::create(&self.inner.cgroups, &limits)
                    .map_err(|e| fail(SpawnError::Cgroup(e)))?,
            );
        }
        // On every way out below, the guard sends the cgroups to the reaper (the usual way).
        if let Some((range, leased)) = pending_uid {
            match leased.await {
                Ok(Ok(Some(uid))) => lease.hold_uid(uid),
                Ok(Err(e)) => return Err(fail(SpawnError::UidScan(e))),
                Ok(Ok(None)) => {
                    return Err(fail(SpawnError::NoFreeUid {
                        range: range.to_string(),
                    }));
                }
                Err(_) => return Err(fail(SpawnError::BrokerGone)),
            }
        }
        // The one identity the executor runs as (the spec's own first, as `prepare` takes
        // it), and so the one its unix and netlink operations are performed as: the broker's
        // own, with its capabilities, never.
        let identity = spec
            .identity
            .or(lease.uid().map(|u| (u, u)))
            .or(self.inner.identity);
        let filter = self
            .inner
            .programs
            .get(&spec.profile)
            .map_err(|e| fail(SpawnError::Prepare(e.to_string())))?;
        let mut prepared = spawn::prepare(
            spec,
            self.inner.support.privileged,
            identity,
            self.inner.support.landlock_abi,
            filter,
        )
        .map_err(fail)?;
        prepared.cgroup = lease.placement();
        let (reply, rx) = oneshot::channel();
        self.send(Job::Start {
            prepared,
            lease,
            reply,
        })
        .map_err(fail)?;
        let (started, mut prepared) = match rx.await {
            Ok(Ok(v)) => v,
            Ok(Err((e, _))) => return Err(fail(e)),
            Err(_) => return Err(fail(SpawnError::BrokerGone)),
        };
        // Killed before its supervision is set up, the executor made no brokered attempt
        // (its first notification waits, unanswered, for the supervisor): a spawn that
        // failed. It is counted spawned, and so supervised, only once supervision exists.
        let spawn_failed = || {
            self.inner.failed_spawns.fetch_add(1, Ordering::SeqCst);
        };

        let host =
            |what: &'static str| move |source: std::io::Error| SpawnError::Host { what, source };
        let (pid, pidfd, listener, lease) = started.supervise();
        // Sent with the job, and given back with the child it started.
        let Some(lease) = lease else {
            sys::kill_and_reap(pid);
            return Err(fail(SpawnError::BrokerGone));
        };
        // The executor is running: any failure from here on must kill it, and its uid and
        // cgroup go back only once it is reaped.
        let pidfd = match sys::async_fd(pidfd) {
            Ok(fd) => Arc::new(fd),
            Err(source) => {
                // Its pidfd went with the failed registration; it is this process's child,
                // reaped by no one else, so its pid still names it.
                sys::kill_and_reap(pid);
                drop(lease);
                spawn_failed();
                return Err(host("watching the executor")(source));
            }
        };
        let mut kill = KillOnDrop(Some(pidfd.clone()));
        let reap = Arc::new(Reap::new(pidfd.clone(), lease, limits.cpu_seconds));
        let reaper = self.inner.reaper.clone();
        let abandon = |e: SpawnError| {
            // Killed when `kill` drops as this returns; reaped (then its lease released) by
            // the reaper thread.
            let _ = reaper.send(ReaperJob::Wait(reap.clone()));
            spawn_failed();
            e
        };
        let wrap_tx = |fd: Option<OwnedFd>| fd.map(pipe::Sender::from_owned_fd).transpose();
        let wrap_rx = |fd: Option<OwnedFd>| fd.map(pipe::Receiver::from_owned_fd).transpose();
        let stdin = wrap_tx(prepared.stdio_parent[0].take())
            .map_err(|e| abandon(host("wrapping stdin")(e)))?;
        let stdout = wrap_rx(prepared.stdio_parent[1].take())
            .map_err(|e| abandon(host("wrapping stdout")(e)))?;
        let stderr = wrap_rx(prepared.stdio_parent[2].take())
            .map_err(|e| abandon(host("wrapping stderr")(e)))?;

        // Counted before its supervision starts, which counts the executor's exit or the
        // supervisor's failure.
        self.inner.spawned.fetch_add(1, Ordering::SeqCst);
        let (tx, attempts) = mpsc::channel(64);
        let counters = Arc::new(Counters::default());
        let on_thread = judge.is_some();
        let ctx = Arc::new(Context {
            listener,
            runtime: tokio::runtime::Handle::current(),
            judge,
            pidfds: Default::default(),
            sockets: Default::default(),
            reap: reap.clone(),
            attempts: tx,
            counters: counters.clone(),
            broker_counters: self.inner.counters.clone(),
            handlers: Arc::new(tokio::sync::Semaphore::new(
                crate::supervisor::EXECUTOR_HANDLERS,
            )),
            broker_handlers: self.inner.handlers.clone(),
            bound: std::sync::Mutex::new(Default::default()),
            datagram_order: Default::default(),
            held: Default::default(),
            toggles: Default::default(),
            absent_unix_sockets,
            bind_roots,
            host_endpoints: self.inner.host_endpoints.clone(),
            // Unprivileged, the executor runs as the broker's own uid (in a user namespace).
            identity: identity.filter(|_| self.inner.support.privileged),
        });
        let inner = self.inner.clone();
        if on_thread {
            supervise_on_thread(ctx, inner, pidfd.clone(), pid).map_err(|e| {
                // Its supervision never started (no thread), so no notification of it was
                // answered: a failed spawn, as one killed a step earlier.
                self.inner.spawned.fetch_sub(1, Ordering::SeqCst);
                abandon(e)
            })?;
        } else {
            // If the supervision task ends for any reason other than the executor's exit (an
            // error, a runtime shutdown dropping it, even before its first poll), the
            // executor is killed: it never runs unsupervised. The guard is built here and
            // moved into the task so that dropping the unpolled task drops the guard too.
            let guard = KillOnDrop(Some(pidfd.clone()));
            tokio::spawn(async move {
                let mut guard = guard;
                let end = supervisor::supervise_on_runtime(ctx).await;
                settle_supervision(&inner, &mut guard, pid, Some(end));
            });
        }

        let timed_out = Arc::new(AtomicBool::new(false));
        let watchdog = prepared.wall_clock.map(|limit: Duration| {
            let pidfd = pidfd.clone();
            let flag = timed_out.clone();
            tokio::spawn(async move {
                tokio::time::sleep(limit).await;
                // Said only of a kill that was made: an executor that outlived its limit
                // is not reported as ended by it.
                match sys::pidfd_send_signal(pidfd.get_ref().as_fd(), libc::SIGKILL) {
                    Ok(()) => flag.store(true, Ordering::SeqCst),
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                    Err(e) => {
                        tracing::error!(pid, "cannot end an executor at its wall-clock limit: {e}");
                    }
                }
            })
        });
        drop(prepared);
        kill.0 = None;
        Ok(Executor {
            pid,
            pidfd,
            reap,
            stdin,
            stdout,
            stderr,
            attempts: Some(attempts),
            exit: None,
            timed_out,
            watchdog,
            counters,
            reaper: self.inner.reaper.clone(),
        })
    }
}

/// Kills an executor unless disarmed (reaping is left to its [`Executor`] handle).
struct KillOnDrop(Option<Arc<AsyncFd<OwnedFd>>>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pidfd) = self.0.take() {
            let _ = sys::pidfd_send_signal(pidfd.get_ref().as_fd(), libc::SIGKILL);
        }
    }
}

/// Starts the supervision thread of an executor with a synchronous judge. It runs until the
/// executor is gone or the stop pipe hangs up. The pipe's write end lives in a task on the
/// caller's runtime: if that task ends for any reason other than the executor's exit (a
/// supervision error, a runtime shutdown dropping it, even before its first poll), the
/// executor is killed and the thread stops; it never runs unsupervised. The guard is built
/// here and moved into the task so that dropping the unpolled task drops the guard too.
fn supervise_on_thread(
    ctx: Arc<Context>,
    inner: Arc<Inner>,
    pidfd: Arc<AsyncFd<OwnedFd>>,
    pid: i32,
) -> Result<(), SpawnError> {
    let (stop, stopper) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| SpawnError::Host {
            what: "creating the supervisor's stop pipe",
            source: e.into(),
        })?;
    let (ended, end) = oneshot::channel();
    std::thread::Builder::new()
        .name("flowhost-notify".into())
        .stack_size(SUPERVISOR_STACK)
        .spawn(move || {
            let _ = ended.send(supervisor::supervise(ctx, stop));
        })
        .map_err(|source| SpawnError::Host {
            what: "starting the supervision thread",
            source,
        })?;
    let guard = KillOnDrop(Some(pidfd));
    tokio::spawn(async move {
        let mut guard = guard;
        let _stopper = stopper;
        let end = end.await.ok();
        settle_supervision(&inner, &mut guard, pid, end);
    });
    Ok(())
}

/// Counts how supervision ended and disarms the kill guard only when the executor is gone.
fn settle_supervision(inner: &Inner, guard: &mut KillOnDrop, pid: i32, end: Option<End>) {
    match end {
        Some(End::ExecutorGone) => {
            inner.exited.fetch_add(1, Ordering::SeqCst);
            guard.0 = None;
        }
        Some(End::Error(e)) => {
            inner.supervisor_failures.fetch_add(1, Ordering::SeqCst);
            tracing::error!(pid, error = %e, "supervisor failed; killing the executor");
        }
        Some(End::Stopped) | None => {
            inner.supervisor_failures.fetch_add(1, Ordering::SeqCst);
            tracing::error!(pid, "the supervision thread ended; killing the executor");
        }
    }
}
