//! What bounds an executor of a profile runs under on this host, and how each is enforced or
//! why it is not: the report `flowhost serve` and `flowhost sandbox run` give at start.

use crate::cgroup::{CgroupSupport, Controller, Version};
use crate::profile::Profile;
use crate::uids::UidRange;

/// How one bound is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enforcement {
    /// Enforced, and by what.
    By(String),
    /// Not enforced, and why: a bound of a `best_effort` profile (a `required` one is
    /// refused), or a part of Landlock the kernel lacks (which other layers cover).
    NotInForce(String),
}

/// One bound of a profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// The profile field.
    pub field: &'static str,
    /// The value, with its unit.
    pub value: String,
    /// How it is held.
    pub enforcement: Enforcement,
}

/// Every bound of a profile on this host, plus how executors' uids are chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundsReport {
    /// The profile.
    pub profile: String,
    /// The file the profile was read from (see [`Profile::file`]).
    pub file: std::path::PathBuf,
    /// The bounds, whole-executor ones first.
    pub bounds: Vec<Bound>,
    /// Which uid executors run as, and what that means for per-uid limits.
    pub identity: String,
}

impl BoundsReport {
    pub(crate) fn new(
        profile: &Profile,
        cgroups: &CgroupSupport,
        shared: Option<(u32, u32)>,
        range: Option<UidRange>,
        landlock_abi: i32,
    ) -> Self {
        let l = &profile.limits;
        let mut bounds = landlock_bounds(landlock_abi);
        bounds.extend(separation_bounds(profile));
        for c in Controller::ALL {
            let Some(v) = c.bound(l) else { continue };
            let value = match c {
                Controller::Memory => format!("{} MiB per executor", v >> 20),
                Controller::Pids => format!("{v} tasks per executor"),
                Controller::Cpu => format!("{v}% of one CPU per executor"),
            };
            let enforcement = match cgroups.base(c) {
                Ok(base) => {
                    let by = format!(
                        "cgroup {} {} beneath {}",
                        match base.version {
                            Version::V1 => "v1",
                            Version::V2 => "v2",
                        },
                        c.name(),
                        base.dir.display()
                    );
                    match (c, cgroups.swap_uncapped()) {
                        // RAM is capped, swap is not: the bound is not what it says.
                        (Controller::Memory, Some(why)) => {
                            Enforcement::NotInForce(format!("{why} (the {by} caps RAM only)"))
                        }
                        _ => Enforcement::By(by),
                    }
                }
                Err(why) => Enforcement::NotInForce(why.to_string()),
            };
            bounds.push(Bound {
                field: c.field(),
                value,
                enforcement,
            });
        }
        let rlimit = |field: &'static str, value: String, name: &str| Bound {
            field,
            value,
            enforcement: Enforcement::By(format!("{name} of each process")),
        };
        bounds.push(rlimit(
            "limits.processes",
            format!("{} processes of the executor's uid", l.processes),
            "RLIMIT_NPROC",
        ));
        bounds.push(rlimit(
            "limits.open_files",
            l.open_files.to_string(),
            "RLIMIT_NOFILE",
        ));
        bounds.push(rlimit(
            "limits.cpu_seconds",
            format!("{} s", l.cpu_seconds),
            "RLIMIT_CPU",
        ));
        bounds.push(rlimit(
            "limits.file_size_mib",
            format!("{} MiB", l.file_size >> 20),
            "RLIMIT_FSIZE",
        ));
        if let Some(a) = l.address_space {
            bounds.push(rlimit(
                "limits.address_space_mib",
                format!("{} MiB", a >> 20),
                "RLIMIT_AS",
            ));
        }
        let identity = match (shared, range) {
            (Some((u, g)), _) => format!(
                "every executor runs as uid {u} gid {g} (configured): RLIMIT_NPROC and signal scope are shared between executors"
            ),
            (None, Some(r)) => format!(
                "each live executor runs as a uid (and gid) of its own from {r}: per-uid limits and signal scope never cross executors"
            ),
            (None, None) if profile.mount_namespace => {
                "executors run in a user namespace of the unprivileged host's uid, and see \
                 every file outside their write paths read-only: the modes, times and \
                 attributes of the caller's files, which Landlock does not govern, cannot \
                 change"
                    .to_string()
            }
            (None, None) => {
                bounds.push(Bound {
                    field: "namespaces.mount",
                    value: "files outside the write paths read-only (modes, times, attributes)"
                        .to_string(),
                    enforcement: Enforcement::NotInForce(
                        "namespaces.mount = false: run as the caller's uid, executors would see \
                         the host's /proc (the host's own process readable there) and could \
                         change the modes, times and attributes of any file the caller owns, \
                         which Landlock does not govern; an unprivileged host refuses to spawn \
                         them"
                            .to_string(),
                    ),
                });
                "executors run in a user namespace of the unprivileged host's uid".to_string()
            }
        };
        BoundsReport {
            profile: profile.name.clone(),
            file: profile.file.clone(),
            bounds,
            identity,
        }
    }

    /// The bounds not in force (the profile is `best_effort`, or a Landlock part the kernel
    /// lacks, which other layers cover).
    pub fn not_in_force(&self) -> impl Iterator<Item = &Bound> {
        self.bounds
            .iter()
            .filter(|b| matches!(b.enforcement, Enforcement::NotInForce(_)))
    }
}

impl BoundsReport {
    /// The report of the bounds not in force alone (`None` when every bound is in force),
    /// for a caller that prints no more than it must.
    pub fn shortfalls(&self) -> Option<String> {
        let mut lines = self.not_in_force().map(|b| match &b.enforcement {
            Enforcement::NotInForce(why) => {
                format!("  {}: {} NOT IN FORCE: {why}", b.field, b.value)
            }
            Enforcement::By(_) => String::new(),
        });
        let first = lines.next()?;
        let mut text = format!(
            "bounds of profile {:?} from {} not in force:\n{first}",
            self.profile,
            self.file.display()
        );
        for line in lines {
            text.push('\n');
            text.push_str(&line);
        }
        Some(text)
    }
}

impl std::fmt::Display for BoundsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bounds of profile {:?} from {}:",
            self.profile,
            self.file.display()
        )?;
        for b in &self.bounds {
            match &b.enforcement {
                Enforcement::By(how) => writeln!(f, "  {}: {} (by {how})", b.field, b.value)?,
                Enforcement::NotInForce(why) => {
                    writeln!(f, "  {}: {} NOT IN FORCE: {why}", b.field, b.value)?
                }
            }
        }
        write!(f, "  identity: {}", self.identity)
    }
}

/// How executors (of different sessions, so of different labels) are kept from sharing
/// data outside the broker's view: their own System V IPC and POSIX message queues (an IPC
/// namespace each) and their own `/tmp`. A profile that gives either up is reported, since
/// a channel between executors is one no egress decision sees.
fn separation_bounds(profile: &Profile) -> Vec<Bound> {
    let mut bounds = Vec::new();
    let mut part = |field: &'static str, value: &str, held: bool, why: &str| {
        bounds.push(Bound {
            field,
            value: value.to_string(),
            enforcement: if held {
                Enforcement::By(format!("{field} = true"))
            } else {
                Enforcement::NotInForce(why.to_string())
            },
        });
    };
    part(
        "namespaces.ipc",
        "System V IPC and message queues of each executor its own",
        profile.ipc_namespace,
        "namespaces.ipc = false: executors share the host's System V IPC and POSIX message \
         queues, a channel between executors of different sessions no egress decision sees",
    );
    part(
        "filesystem.private_tmp",
        "a /tmp of each executor its own",
        profile.private_tmp,
        "filesystem.private_tmp = false: executors given the same /tmp may pass data \
         between sessions there, unseen by the broker",
    );
    bounds
}

/// What the executors' Landlock domain holds on a kernel of Landlock ABI `abi`: the file
/// system rules from ABI 1 (truncation by path from ABI 3, device ioctls from ABI 5), the
/// TCP bind and connect rules from ABI 4, and the abstract unix socket and signal scopes
/// from ABI 6. A part the kernel lacks is left out of the domain
/// (the landlock crate's best-effort mode), so it is reported, with what still covers it.
fn landlock_bounds(abi: i32) -> Vec<Bound> {
    let part = |value: &str, from: i32, instead: &str| Bound {
        field: "filesystem.landlock",
        value: value.to_string(),
        enforcement: if abi >= from {
            Enforcement::By(format!("Landlock (ABI {abi})"))
        } else if abi <= 0 {
            Enforcement::NotInForce(format!("this kernel has no Landlock; {instead}"))
        } else {
            Enforcement::NotInForce(format!(
                "needs Landlock ABI {from}, this kernel has {abi}; {instead}"
            ))
        },
    };
    vec![
        part(
            "file system access beyond the profile's paths",
            1,
            "the mount namespace and uid still confine it",
        ),
        part(
            "truncating files beyond the profile's paths",
            3,
            "the mount namespace, its read-only mounts and the uid still confine it",
        ),
        part(
            "TCP bind and connect by the executor itself",
            4,
            "the seccomp filter still hands both to the broker",
        ),
        part(
            "ioctls on devices beyond the profile's paths",
            5,
            "the devices the profile lets it open, and the seccomp filter's refusals of \
             terminal ioctls, still confine it",
        ),
        part(
            "abstract unix sockets and signals outside the executor",
            6,
            "the broker still decides abstract connects, and the executor's own uid and pid \
             namespace still scope its signals",
        ),
    ]
}

#[cfg(test)]
mod landlock_tests {
    use super::*;

    /// A profile that lets executors share IPC or /tmp says so: a channel between executors
    /// of different sessions is one no egress decision sees.
    #[test]
    fn shared_ipc_or_tmp_is_reported_not_in_force() {
        let mut p = crate::profile::Profile::find("isolated", &[]).unwrap();
        let held = |p: &crate::profile::Profile| {
            separation_bounds(p)
                .iter()
                .map(|b| matches!(b.enforcement, Enforcement::By(_)))
                .collect::<Vec<_>>()
        };
        assert_eq!(held(&p), [true, true]);
        p.ipc_namespace = false;
        p.private_tmp = false;
        assert_eq!(held(&p), [false, false]);
    }

    #[test]
    fn landlock_parts_the_kernel_lacks_are_reported_not_in_force() {
        let held = |abi: i32| {
            landlock_bounds(abi)
                .iter()
                .map(|b| matches!(b.enforcement, Enforcement::By(_)))
                .collect::<Vec<_>>()
        };
        assert_eq!(held(6), [true; 5]);
        assert_eq!(held(7), [true; 5]);
        assert_eq!(held(5), [true, true, true, true, false]);
        assert_eq!(held(4), [true, true, true, false, false]);
        assert_eq!(held(3), [true, true, false, false, false]);
        assert_eq!(held(2), [true, false, false, false, false]);
        assert_eq!(held(0), [false; 5]);
        let scopes = &landlock_bounds(5)[4];
        assert!(
            matches!(&scopes.enforcement, Enforcement::NotInForce(why) if why.contains("ABI 6") && why.contains("has 5")),
            "{scopes:?}"
        );
    }
}
