//! Whole-executor bounds: each executor gets a cgroup of its own, so its memory, its tasks
//! (processes and threads) and its CPU time are bounded together, whatever it forks, and
//! nothing outside it counts against it.
//!
//! Where each controller lives is found once, at broker start, from `/proc/self/cgroup` and
//! `/proc/self/mountinfo` (whether cgroups can be created there is proven by the first one
//! created, see [`CgroupSupport::base`]):
//! * cgroup v2, when the broker's own cgroup offers the controller and the broker is alone
//!   in it (a subtree delegated to it, as systemd's `Delegate=` does): the broker moves
//!   itself into a leaf `flowhost-host`, enables the controllers for the subtree and creates
//!   executor cgroups beside that leaf (`memory.max`, `memory.swap.max`, `pids.max`,
//!   `cpu.max`).
//! * cgroup v1 otherwise, per controller, beneath the broker's own cgroup of that hierarchy
//!   (`memory.limit_in_bytes` and `memory.memsw.limit_in_bytes`, `pids.max`,
//!   `cpu.cfs_quota_us`).
//!
//! The cgroup files are the kernel's interface and are written directly, here only.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use procfs::Current;

use crate::profile::Limits;
use crate::sys;

/// A cgroup controller bounding executors as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Controller {
    /// Memory (anonymous, page cache, kernel memory of the whole tree).
    Memory,
    /// Tasks: processes and threads.
    Pids,
    /// CPU bandwidth.
    Cpu,
}

impl Controller {
    /// All controllers, in report order.
    pub const ALL: [Controller; 3] = [Controller::Memory, Controller::Pids, Controller::Cpu];

    /// The kernel's name for the controller.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Cpu => "cpu",
        }
    }

    /// The profile field that sets this bound.
    pub fn field(self) -> &'static str {
        match self {
            Controller::Memory => "limits.memory_mib",
            Controller::Pids => "limits.tasks",
            Controller::Cpu => "limits.cpu_percent",
        }
    }

    /// The profile's bound for this controller, if it sets one.
    pub fn bound(self, limits: &Limits) -> Option<u64> {
        match self {
            Controller::Memory => limits.memory,
            Controller::Pids => limits.tasks,
            Controller::Cpu => limits.cpu_percent,
        }
    }
}

/// Which cgroup version a controller is used through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// The legacy per-controller hierarchies.
    V1,
    /// The unified hierarchy.
    V2,
}

/// Where executor cgroups of one controller are created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Base {
    /// The parent directory of executor cgroups.
    pub dir: PathBuf,
    /// The hierarchy's version.
    pub version: Version,
}

/// Where each controller can be used on this host, or why it cannot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupSupport {
    /// Where the layout puts each controller's executor cgroups, or why it cannot.
    bases: BTreeMap<Controller, Result<Base, String>>,
    /// For each v1 base: whether executor cgroups can be created beneath it. Settled once,
    /// by the first cgroup created there (an executor's own) or, when something asks before
    /// any spawn, by creating and removing a probe; unset until then. A run that spawns one
    /// executor so makes one cgroup per controller instead of two.
    writable: BTreeMap<Controller, OnceLock<Result<(), String>>>,
    /// Names the probes (tests use fake trees with a fake pid).
    pid: u32,
    /// Why a memory bound would not cap swap here, if it would not: see [`swap_left_uncapped`].
    swap: Option<String>,
}

fn unavailable(why: &str) -> CgroupSupport {
    CgroupSupport {
        bases: Controller::ALL
            .iter()
            .map(|c| (*c, Err(why.to_string())))
            .collect(),
        writable: BTreeMap::new(),
        pid: std::process::id(),
        swap: None,
    }
}

/// One line of `/proc/self/cgroup`: hierarchy id, controllers, path.
type Membership = (u32, Vec<String>, String);
/// One cgroup mount: filesystem type, super options, mount point, root.
type CgroupMount = (String, Vec<String>, PathBuf, String);

impl CgroupSupport {
    /// Finds, for each controller, where this process may create executor cgroups. Nothing
    /// is changed on the host except, for a delegated v2 subtree, moving this process into
    /// its leaf and enabling the controllers for the subtree. Leftovers of brokers that are
    /// gone are not removed here: see [`CgroupSupport::sweep_stale`].
    pub fn detect() -> CgroupSupport {
        let me = match procfs::process::Process::myself() {
            Ok(me) => me,
            Err(e) => return unavailable(&format!("cannot read /proc/self: {e}")),
        };
        let memberships: Vec<Membership> = match me.cgroups() {
            Ok(c) => c
                .into_iter()
                .map(|g| (g.hierarchy, g.controllers, g.pathname))
                .collect(),
            Err(e) => return unavailable(&format!("cannot read /proc/self/cgroup: {e}")),
        };
        let mounts: Vec<CgroupMount> = match me.mountinfo() {
            Ok(m) => m
                .into_iter()
                .filter(|m| m.fs_type == "cgroup" || m.fs_type == "cgroup2")
                .map(|m| {
                    (
                        m.fs_type,
                        m.super_options.into_keys().collect(),
                        m.mount_point,
                        m.root,
                    )
                })
                .collect(),
            Err(e) => return unavailable(&format!("cannot read /proc/self/mountinfo: {e}")),
        };
        let mut support = Self::from_layout(&memberships, &mounts, std::process::id());
        let host_swap = procfs::Meminfo::current()
            .map(|m| m.swap_total)
            .map_err(|e| format!("cannot read /proc/meminfo for the host's swap: {e}"));
        support.swap = support
            .layout(Controller::Memory)
            .ok()
            .and_then(|base| swap_left_uncapped(base, host_swap));
        support
    }

    /// [`CgroupSupport::detect`] on given memberships and mounts (tests use fake trees).
    pub(crate) fn from_layout(
        memberships: &[Membership],
        mounts: &[CgroupMount],
        pid: u32,
    ) -> CgroupSupport {
        // A cgroup path as seen from a mount whose root may itself be a cgroup.
        let under = |mount_point: &Path, root: &str, path: &str| -> PathBuf {
            let rel = path.strip_prefix(root).unwrap_or(path);
            mount_point.join(rel.trim_start_matches('/'))
        };
        let v2 = mounts
            .iter()
            .find(|(fs, ..)| fs == "cgroup2")
            .and_then(|(_, _, mp, root)| {
                let (_, _, path) = memberships
                    .iter()
                    .find(|(h, c, _)| *h == 0 && c.is_empty())?;
                Some(under(mp, root, path))
            });
        let v2_offers: Vec<String> = v2
            .as_ref()
            .and_then(|d| std::fs::read_to_string(d.join("cgroup.controllers")).ok())
            .map(|s| s.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default();
        let wanted_v2: Vec<Controller> = Controller::ALL
            .into_iter()
            .filter(|c| v2_offers.iter().any(|o| o == c.name()))
            .collect();
        let v2_base = match (&v2, wanted_v2.is_empty()) {
            (Some(dir), false) => Some(delegate_v2(dir, &wanted_v2, pid)),
            _ => None,
        };
        let mut bases = BTreeMap::new();
        let mut writable = BTreeMap::new();
        for c in Controller::ALL {
            if let Some(base) = &v2_base
                && wanted_v2.contains(&c)
            {
                bases.insert(c, base.clone());
                continue;
            }
            let v1 = mounts
                .iter()
                .find(|(fs, opts, ..)| fs == "cgroup" && opts.iter().any(|o| o == c.name()));
            let found = match v1 {
                Some((_, _, mp, root)) => memberships
                    .iter()
                    .find(|(h, ctl, _)| *h != 0 && ctl.iter().any(|x| x == c.name()))
                    .map(|(_, _, path)| under(mp, root, path))
                    .ok_or_else(|| {
                        format!(
                            "the {} hierarchy is mounted at {}, but /proc/self/cgroup lists no cgroup of it",
                            c.name(),
                            mp.display()
                        )
                    })
                    .map(|dir| {
                        writable.insert(c, OnceLock::new());
                        Base {
                            dir,
                            version: Version::V1,
                        }
                    }),
                None => Err(match &v2_base {
                    Some(Err(why)) => why.clone(),
                    _ => format!(
                        "no cgroup hierarchy offers the {} controller to this process",
                        c.name()
                    ),
                }),
            };
            bases.insert(c, found);
        }
        CgroupSupport {
            bases,
            writable,
            pid,
            swap: None,
        }
    }

    /// Why a memory bound would cap RAM but not swap on this host, if so (swap is on and
    /// the memory hierarchy does not account it).
    pub(crate) fn swap_uncapped(&self) -> Option<&str> {
        self.swap.as_deref()
    }

    /// Where `controller` is used, or why it cannot be. Proves, the first time it is asked
    /// before any executor cgroup was created there, that cgroups can be created beneath a
    /// v1 base, by creating and removing one.
    pub fn base(&self, controller: Controller) -> Result<&Base, &str> {
        let base = self.layout(controller)?;
        match self.writable.get(&controller) {
            Some(known) => match known.get_or_init(|| check_writable(&base.dir, self.pid)) {
                Ok(()) => Ok(base),
                Err(why) => Err(why),
            },
            None => Ok(base),
        }
    }

    /// Where the layout puts `controller`'s executor cgroups, whether or not one can be
    /// created there.
    fn layout(&self, controller: Controller) -> Result<&Base, &str> {
        match self.bases.get(&controller) {
            Some(Ok(b)) => Ok(b),
            Some(Err(why)) => Err(why),
            None => Err("not detected"),
        }
    }

    /// Removes the executor cgroups that brokers which are gone left beneath the bases (a
    /// process that exits with executors still being released leaves their cgroups
    /// behind). Slow with many leftovers: the broker runs it on its reaper thread, beside
    /// its first spawns (it never touches a cgroup of a live broker).
    pub(crate) fn sweep_stale(&self) {
        let mut dirs: Vec<&PathBuf> = self.bases.values().flatten().map(|b| &b.dir).collect();
        dirs.sort();
        dirs.dedup();
        for dir in dirs {
            sweep_stale(dir);
        }
    }

    /// Support with no controller, for an unprivileged broker.
    pub fn none(why: &str) -> CgroupSupport {
        unavailable(why)
    }

    /// Whether an executor bounded by `limits` gets a cgroup here, one whatever it starts
    /// enters and whose processes are all killed when it ends; if not, why. Without a pid
    /// namespace nothing else ends an executor's tree with it.
    pub(crate) fn holds_tree(&self, limits: &Limits) -> Result<(), String> {
        let mut why = None;
        for c in Controller::ALL {
            if c.bound(limits).is_none() {
                continue;
            }
            match self.base(c) {
                Ok(_) => return Ok(()),
                Err(e) => {
                    why.get_or_insert_with(|| format!("{} cannot be held: {e}", c.field()));
                }
            }
        }
        Err(why.unwrap_or_else(|| {
            "it sets none of limits.memory_mib, limits.tasks and limits.cpu_percent, so its \
             executors get no cgroup"
                .into()
        }))
    }
}

/// Why an executor cgroup beneath `base` would leave swap uncapped, if it would: the host
/// has swap (`host_swap`, bytes, or why it could not be read) and the hierarchy has no swap
/// accounting (`memory.swap.max` on v2, `memory.memsw.limit_in_bytes` on v1, at the base:
/// an executor cgroup has the file exactly when its parent has). The memory bound then holds
/// RAM only, and an executor may fill the host's swap besides.
fn swap_left_uncapped(base: &Base, host_swap: Result<u64, String>) -> Option<String> {
    let file = match base.version {
        Version::V2 => "memory.swap.max",
        Version::V1 => "memory.memsw.limit_in_bytes",
    };
    let accounted = base.dir.join(file).exists();
    match host_swap {
        Ok(0) => None,
        _ if accounted => None,
        Ok(bytes) => Some(format!(
            "this host has {} MiB of swap and the memory hierarchy does not account it (no {} \
             beneath {}), so the bound would not cap swap; turn swap accounting on \
             (swapaccount=1 on cgroup v1) or swap off",
            bytes >> 20,
            file,
            base.dir.display()
        )),
        Err(why) => Some(format!(
            "{why}, and the memory hierarchy does not account swap (no {file} beneath {}), so \
             the bound may not cap swap",
            base.dir.display()
        )),
    }
}

/// Removes executor cgroups left beneath `dir` by brokers that are gone (a process that
/// exits with executors still being released leaves their cgroups behind).
fn sweep_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_str().and_then(left_by_a_gone_process) == Some(true) {
            let stale = ExecutorCgroup {
                dirs: vec![(Controller::Memory, Version::V1, entry.path())],
                limits: Limits::NONE,
            };
            stale.remove(Duration::from_millis(200));
        }
    }
}

/// Proves that executor cgroups can be created beneath `dir` by creating and removing one.
fn check_writable(dir: &Path, pid: u32) -> Result<(), String> {
    // Unique per call: brokers of one process may be detecting at the same time.
    let probe = dir.join(format!(
        "flowhost-probe-{pid}-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir(&probe)
        .and_then(|()| std::fs::remove_dir(&probe))
        .map_err(|e| unwritable(dir, &e))
}

/// Why executor cgroups cannot be created beneath `dir`.
fn unwritable(dir: &Path, e: &std::io::Error) -> String {
    format!("cannot create cgroups beneath {}: {e}", dir.display())
}

/// The leaf of a delegated v2 subtree the broker moves itself into.
const HOST_LEAF: &str = "flowhost-host";

/// Takes over a delegated v2 cgroup: only when this process is alone in it (never a login
/// session's or another service's cgroup), moves itself into the leaf `flowhost-host` (a
/// cgroup with controllers enabled for its children may hold no process) and enables the
/// controllers for the subtree.
fn delegate_v2(own: &Path, wanted: &[Controller], pid: u32) -> Result<Base, String> {
    let enable: Vec<String> = wanted.iter().map(|c| format!("+{}", c.name())).collect();
    // Already taken over (an earlier broker of this process): the subtree is the parent.
    if own.file_name().is_some_and(|n| n == HOST_LEAF)
        && let Some(dir) = own.parent()
    {
        let control = dir.join("cgroup.subtree_control");
        std::fs::write(&control, enable.join(" "))
            .map_err(|e| format!("cgroup v2: writing {}: {e}", control.display()))?;
        return Ok(Base {
            dir: dir.to_path_buf(),
            version: Version::V2,
        });
    }
    let dir = own;
    let io = |what: &str, p: &Path, e: std::io::Error| {
        format!(
            "cgroup v2 at {}: {what} {}: {e}",
            dir.display(),
            p.display()
        )
    };
    let procs = dir.join("cgroup.procs");
    let members = std::fs::read_to_string(&procs).map_err(|e| io("reading", &procs, e))?;
    let others = members
        .split_whitespace()
        .filter(|p| *p != pid.to_string())
        .count();
    let leaf = dir.join(HOST_LEAF);
    if others > 0 {
        return Err(format!(
            "cgroup v2 at {} offers the controllers but {others} other processes share it: it is \
             not delegated to flowhost (run it under a unit with Delegate=yes)",
            dir.display()
        ));
    }
    if !members.split_whitespace().any(|p| p == pid.to_string()) && !leaf.is_dir() {
        return Err(format!(
            "cgroup v2 at {}: this process is not in it",
            dir.display()
        ));
    }
    match std::fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("creating", &leaf, e)),
    }
    let leaf_procs = leaf.join("cgroup.procs");
    std::fs::write(&leaf_procs, pid.to_string()).map_err(|e| io("moving into", &leaf_procs, e))?;
    let control = dir.join("cgroup.subtree_control");
    std::fs::write(&control, enable.join(" ")).map_err(|e| io("writing", &control, e))?;
    Ok(Base {
        dir: dir.to_path_buf(),
        version: Version::V2,
    })
}

/// Which bound an executor ran into, read from its cgroup after it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundHit {
    /// The memory bound: the kernel's OOM killer killed a task of the executor.
    Memory {
        /// The bound in bytes.
        limit: u64,
    },
    /// The tasks bound: a fork or thread creation failed at it.
    Tasks {
        /// The bound.
        limit: u64,
    },
    /// The CPU-time limit (a per-process rlimit): the kernel killed it at its hard limit
    /// (SIGKILL, which, unlike the SIGXCPU sent below it, no executor can ignore).
    CpuTime {
        /// The limit in seconds.
        seconds: u64,
    },
}

impl std::fmt::Display for BoundHit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BoundHit::Memory { limit } => write!(
                f,
                "the memory bound ({} MiB for the whole executor, limits.memory_mib): the kernel killed it out of memory",
                limit >> 20
            ),
            BoundHit::Tasks { limit } => write!(
                f,
                "the tasks bound ({limit} processes and threads for the whole executor, limits.tasks): a fork or thread creation was refused"
            ),
            BoundHit::CpuTime { seconds } => write!(
                f,
                "the CPU-time limit ({seconds} s, RLIMIT_CPU, limits.cpu_seconds): the kernel killed it when it used that much"
            ),
        }
    }
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Names this process's executor cgroups apart from those of any other process, including
/// an earlier one that had the same pid: `<pid>-<start>`, the start being the process's
/// start time in clock ticks since boot (`/proc/self/stat`, field 22), which no two
/// processes of one pid share while the system runs.
fn instance() -> &'static str {
    static INSTANCE: OnceLock<String> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        let pid = std::process::id();
        // Unreadable only on a broken /proc, where detection has failed already. A name
        // that then collides with a leftover fails that spawn (it never shares the
        // cgroup), and no sweep removes a name with an unknown start (0) while a process
        // has its pid (see `left_by_a_gone_process`).
        let start = match started_at(pid) {
            Ok(Some(start)) => start,
            _ => 0,
        };
        format!("{pid}-{start}")
    })
}

/// When process `pid` started (clock ticks since boot): `None` when no process has that
/// pid, an error when `/proc` could not say (hidden by `hidepid`, out of descriptors).
fn started_at(pid: u32) -> Result<Option<u64>, procfs::ProcError> {
    let Ok(pid) = i32::try_from(pid) else {
        return Ok(None);
    };
    match procfs::process::Process::new(pid).and_then(|p| p.stat()) {
        Ok(stat) => Ok(Some(stat.starttime)),
        Err(procfs::ProcError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The name of this process's `n`th executor cgroup.
fn executor_cgroup_name(n: u64) -> String {
    format!("flowhost-exec-{}-{n}", instance())
}

/// Whether the executor cgroup `name` (from [`executor_cgroup_name`], or the older
/// `flowhost-exec-<pid>-<n>`) was left by a process that has exited; `None` for a name
/// that is not an executor cgroup's. Only what `/proc` shows is taken as gone (no process
/// with the pid, or one that started at another time): a sweep kills what is in the
/// cgroups it removes, so a start it cannot read, or this process's own names, are kept.
fn left_by_a_gone_process(name: &str) -> Option<bool> {
    let fields: Vec<&str> = name.strip_prefix("flowhost-exec-")?.split('-').collect();
    let pid: u32 = fields.first()?.parse().ok()?;
    let ours = name.starts_with(&format!("flowhost-exec-{}-", instance()));
    Some(match fields.as_slice() {
        _ if ours => false,
        // A start of 0 is one its process could not read: like the older names, it is
        // gone only when no process has the pid.
        [_, "0", _] | [_, _] => matches!(started_at(pid), Ok(None)),
        [_, start, _] => {
            let start: u64 = start.parse().ok()?;
            match started_at(pid) {
                Ok(now) => now != Some(start),
                Err(_) => false,
            }
        }
        _ => return None,
    })
}

/// How a new executor enters its cgroups before it runs a single instruction of its program.
///
/// Writing a process into a cgroup (`cgroup.procs`) takes the kernel's global threadgroup
/// lock for writing, which waits for an RCU grace period: several milliseconds per spawn on
/// a small VM. In cgroup v1 one thread can instead move itself (`tasks`, pid 0) without that
/// lock, and a child is born in its creating thread's cgroups: so the spawner thread enters
/// the executor's v1 cgroups, clones, and returns to the broker's own. The child is then
/// bounded from its first instruction, and nothing it does before exec escapes the bounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Placement {
    /// v1 executor cgroups the spawner thread enters before clone and leaves (for the
    /// parent, the broker's own cgroup) once the child has exec'd or exited.
    pub(crate) born_in: Vec<PathBuf>,
    /// `cgroup.procs` files the executor's pid is written to before it may exec (cgroup
    /// v2, where threads of one process share a cgroup, and any v1 cgroup the spawner
    /// thread could not enter).
    pub(crate) procs: Vec<PathBuf>,
}

/// Moves the calling thread, and only it, into the v1 cgroup `dir` (its `tasks` file, pid
/// 0: the caller).
pub(crate) fn move_this_thread(dir: &Path) -> std::io::Result<()> {
    std::fs::write(dir.join("tasks"), "0")
}

/// One executor's cgroups (one directory per v1 controller, or one v2 directory). Removed
/// with [`ExecutorCgroup::remove`] once its processes are gone.
#[derive(Debug)]
pub(crate) struct ExecutorCgroup {
    dirs: Vec<(Controller, Version, PathBuf)>,
    limits: Limits,
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("writing {value:?} to {}: {e}", path.display()))
}

/// A counter named `key` in a flat-keyed cgroup file (`memory.events`, `pids.events`,
/// `memory.oom_control`).
fn counter(path: &Path, key: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok()).flatten()
            })
        })
        .unwrap_or(0)
}

impl ExecutorCgroup {
    /// Creates the cgroups for an executor with `limits` and writes its bounds. Controllers
    /// the host cannot offer are skipped (the caller has already refused a profile that
    /// requires them).
    /// A creation that fails part way removes what it made: the sweep of leftovers passes
    /// over this process's own names, so they would stay until the host stops.
    pub(crate) fn create(support: &CgroupSupport, limits: &Limits) -> Result<Self, String> {
        let mut cg = ExecutorCgroup {
            dirs: Vec::new(),
            limits: *limits,
        };
        match cg.make(support) {
            Ok(()) => Ok(cg),
            Err(e) => {
                // Nothing runs in them yet: each is removed at the first try.
                cg.remove(Duration::from_millis(100));
                Err(e)
            }
        }
    }

    /// Makes the cgroups of [`ExecutorCgroup::create`] and writes their bounds, adding each
    /// to `self.dirs` as it is made.
    fn make(&mut self, support: &CgroupSupport) -> Result<(), String> {
        let name = executor_cgroup_name(NEXT.fetch_add(1, Ordering::Relaxed));
        let limits = self.limits;
        let (cg, limits) = (self, &limits);
        for c in Controller::ALL {
            let (Some(bound), Ok(base)) = (c.bound(limits), support.layout(c)) else {
                continue;
            };
            // Unknown until the first creation beneath a v1 base, which settles it.
            let known = support.writable.get(&c);
            if known.and_then(OnceLock::get).is_some_and(Result::is_err) {
                continue;
            }
            let dir = base.dir.join(&name);
            if !cg.dirs.iter().any(|(_, _, d)| *d == dir) {
                match (std::fs::create_dir(&dir), known) {
                    (Ok(()), Some(known)) => {
                        let _ = known.set(Ok(()));
                    }
                    (Ok(()), None) => {}
                    // This creation was the probe: as a failed probe, the bound is not in
                    // force (a `required` profile has been refused before any spawn, by
                    // `base`, which probes). A name taken already proves nothing about the
                    // base: that spawn fails, as any other failed creation.
                    (Err(e), Some(known))
                        if known.get().is_none()
                            && e.kind() != std::io::ErrorKind::AlreadyExists =>
                    {
                        let _ = known.set(Err(unwritable(&base.dir, &e)));
                        continue;
                    }
                    (Err(e), _) => {
                        return Err(format!("creating the cgroup {}: {e}", dir.display()));
                    }
                }
            }
            cg.dirs.push((c, base.version, dir.clone()));
            let f = |file: &str| dir.join(file);
            match (c, base.version) {
                (Controller::Memory, Version::V2) => {
                    write(&f("memory.max"), &bound.to_string())?;
                    // No swap beyond the bound (absent without swap accounting).
                    if f("memory.swap.max").exists() {
                        write(&f("memory.swap.max"), "0")?;
                    }
                }
                (Controller::Memory, Version::V1) => {
                    write(&f("memory.limit_in_bytes"), &bound.to_string())?;
                    if f("memory.memsw.limit_in_bytes").exists() {
                        write(&f("memory.memsw.limit_in_bytes"), &bound.to_string())?;
                    }
                }
                (Controller::Pids, _) => write(&f("pids.max"), &bound.to_string())?,
                (Controller::Cpu, Version::V2) => {
                    write(&f("cpu.max"), &format!("{} 100000", bound * 1000))?
                }
                (Controller::Cpu, Version::V1) => {
                    write(&f("cpu.cfs_period_us"), "100000")?;
                    write(&f("cpu.cfs_quota_us"), &(bound * 1000).to_string())?;
                }
            }
        }
        Ok(())
    }

    /// How a new executor enters these cgroups (see [`Placement`]).
    pub(crate) fn placement(&self) -> Placement {
        let mut placement = Placement::default();
        let mut seen: Vec<&PathBuf> = Vec::new();
        for (_, version, dir) in &self.dirs {
            if seen.contains(&dir) {
                continue;
            }
            seen.push(dir);
            // The spawning thread counts as a task of the cgroup while it is inside, so a
            // tasks bound below 2 would refuse the clone itself.
            let tasks_room = self
                .dirs
                .iter()
                .filter(|(c, _, d)| d == dir && *c == Controller::Pids)
                .all(|_| self.limits.tasks.is_none_or(|t| t >= 2));
            match (version, dir.parent()) {
                (Version::V1, Some(_)) if tasks_room => placement.born_in.push(dir.clone()),
                _ => placement.procs.push(dir.join("cgroup.procs")),
            }
        }
        placement
    }

    /// The bound the executor ran into, if any (the memory bound first: an OOM kill is
    /// what ends an executor; a refused fork may only have been handled).
    pub(crate) fn hit(&self) -> Option<BoundHit> {
        let dir = |want: Controller| {
            self.dirs
                .iter()
                .find(|(c, _, _)| *c == want)
                .map(|(_, v, d)| (*v, d))
        };
        if let (Some((v, d)), Some(limit)) = (dir(Controller::Memory), self.limits.memory) {
            let file = match v {
                Version::V2 => d.join("memory.events"),
                Version::V1 => d.join("memory.oom_control"),
            };
            if counter(&file, "oom_kill") > 0 {
                return Some(BoundHit::Memory { limit });
            }
        }
        if let (Some((_, d)), Some(limit)) = (dir(Controller::Pids), self.limits.tasks)
            && counter(&d.join("pids.events"), "max") > 0
        {
            return Some(BoundHit::Tasks { limit });
        }
        None
    }

    /// Kills whatever is left in the cgroups and removes them; gives up after `within`.
    /// Returns whether every cgroup is gone (so nothing of the executor still runs).
    pub(crate) fn remove(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut left: Vec<&PathBuf> = self.dirs.iter().map(|(_, _, d)| d).collect();
        left.dedup();
        let removed = |dir: &Path| match std::fs::remove_dir(dir) {
            Ok(()) => true,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        while !left.is_empty() {
            left.retain(|&dir| {
                // Usually empty: the executor and all it started have ended.
                if removed(dir) {
                    return false;
                }
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                // Never the host itself: its spawner thread is inside an executor's v1
                // cgroups while it clones (see `Placement`), and `cgroup.procs` lists the
                // process of every thread inside.
                let host = std::process::id() as i32;
                for pid in procs
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                    .filter(|p| *p != host)
                {
                    kill_member(pid, dir);
                }
                !removed(dir)
            });
            if left.is_empty() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if !left.is_empty() {
            tracing::warn!(cgroups = ?left, "executor cgroups could not be removed");
        }
        left.is_empty()
    }
}

/// Kills process `pid` if it is in the cgroup at `dir`. The pid was read from the cgroup's
/// `cgroup.procs`, but that process may have ended since and the number gone to another:
/// the process is pinned with a pidfd first, its membership read after that, and the
/// signal sent through the pidfd, so only a member is ever signalled.
fn kill_member(pid: i32, dir: &Path) {
    let Ok(pidfd) = sys::pidfd_open(pid) else {
        return;
    };
    let member = procfs::process::Process::new(pid)
        .and_then(|p| p.cgroups())
        .is_ok_and(|groups| {
            groups.into_iter().any(|g| {
                let path = g.pathname.trim_start_matches('/');
                !path.is_empty() && dir.ends_with(path)
            })
        });
    if member {
        let _ = sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests;
