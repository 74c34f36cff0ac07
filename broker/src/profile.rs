//! Execution profiles: the data files in `profiles/` that say how an executor is confined.
//!
//! A profile fixes the network path (none: an empty network namespace; host: the host's
//! network, every outbound attempt mediated), which socket families the filter admits, the
//! namespaces, the Landlock filesystem rules, resource limits and extra denied syscalls. The
//! built-in bypass denials of the filter cannot be relaxed by a profile.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

mod vocabulary;

pub use vocabulary::{NetlinkProtocol, SocketFamily, syscall_number};

/// Why a profile file was refused. Messages name the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file could not be read.
    #[error("{file}: cannot read profile: {source}")]
    Read {
        /// The profile file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file, or the directory it was found in, is one someone other than root or this
    /// process's user could change: they could loosen the sandbox, or place a profile that
    /// shadows a built-in one.
    #[error("{file}: cannot use profile: {path} {why}")]
    Untrusted {
        /// The profile file.
        file: PathBuf,
        /// The file or directory at fault.
        path: PathBuf,
        /// Who else may change it.
        why: String,
    },
    /// The file is not valid TOML for a profile (syntax, unknown field, wrong type).
    #[error("{file}: {message}")]
    Syntax {
        /// The profile file.
        file: PathBuf,
        /// The parser's message, which names the line and the field.
        message: String,
    },
    /// A field has a value the broker cannot honour.
    #[error("{file}: field `{field}`: {message}")]
    Invalid {
        /// The profile file.
        file: PathBuf,
        /// Dotted path of the field, e.g. `filesystem.read_only[2]`.
        field: String,
        /// What is wrong and what would be accepted.
        message: String,
    },
    /// No profile of that name exists in the search path or among the built-in ones.
    #[error(
        "no profile named {name:?}: looked in {searched} and among the built-in profiles ({builtin})"
    )]
    NotFound {
        /// The requested name.
        name: String,
        /// Where it was looked for.
        searched: String,
        /// The built-in profile names.
        builtin: String,
    },
}

/// Whether the executor has any network path of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkPath {
    /// An empty network namespace: nothing is reachable, every attempt is still reported.
    None,
    /// The host's network namespace: every outbound attempt is mediated by the broker.
    Host,
}

/// How strictly Landlock must be enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LandlockMode {
    /// Refuse to spawn on a kernel without Landlock.
    Required,
    /// Use what the kernel offers; spawn without it when it offers none.
    BestEffort,
}

/// Whether the profile's whole-executor bounds (memory, tasks, CPU) must be enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupMode {
    /// Refuse to start when a bound cannot be enforced with a cgroup on this host.
    Required,
    /// Enforce what the host's cgroups allow; say at start which bounds are not in force.
    BestEffort,
}

/// A validated execution profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// Profile name (the file stem).
    pub name: String,
    /// The file it was read from (`<built-in NAME.toml>` for a built-in profile), named in
    /// the bounds report so the operator sees which profile is in force.
    pub file: PathBuf,
    /// What the profile is for.
    pub description: String,
    /// Network path of the executor.
    pub network: NetworkPath,
    /// Socket families `socket(2)` may create.
    pub socket_families: BTreeSet<SocketFamily>,
    /// Netlink protocols `socket(AF_NETLINK, ..)` may use (requires `netlink` in families).
    pub netlink_protocols: BTreeSet<NetlinkProtocol>,
    /// Unix socket paths that do not exist in the executor's view: a `connect` to one fails
    /// with ENOENT, as if nothing listened there, without being reported as an attempt.
    /// For sockets a library tries before every operation and does without (glibc asks
    /// nscd before each lookup; nscd would answer lookups outside the host's mediation).
    pub absent_unix_sockets: Vec<PathBuf>,
    /// New mount namespace (private /tmp, fresh /proc).
    pub mount_namespace: bool,
    /// New pid namespace: the executor is pid 1, and its whole tree dies with it.
    pub pid_namespace: bool,
    /// New IPC namespace.
    pub ipc_namespace: bool,
    /// New UTS namespace.
    pub uts_namespace: bool,
    /// Landlock enforcement level.
    pub landlock: LandlockMode,
    /// Paths the executor may read and execute beneath.
    pub read_only: Vec<PathBuf>,
    /// Paths the executor may read and write beneath.
    pub read_write: Vec<PathBuf>,
    /// Mount a private tmpfs on /tmp (requires the mount namespace).
    pub private_tmp: bool,
    /// Resource limits.
    pub limits: Limits,
    /// Syscalls denied (EPERM) in addition to the built-in bypass denials.
    pub extra_deny: Vec<(String, i64)>,
}

/// Resource limits: per process (rlimits, applied before exec) and per executor as a whole
/// (its cgroup: every process and thread it starts counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock limit after which the executor (and its tree) is killed.
    pub wall_clock: Option<Duration>,
    /// RLIMIT_NOFILE.
    pub open_files: u64,
    /// RLIMIT_NPROC (counted per uid by the kernel; each live executor has a uid of its own
    /// when the host configures a range).
    pub processes: u64,
    /// RLIMIT_AS in bytes, if any. Runtimes that reserve large address ranges (Node's Wasm,
    /// JVMs) fail under a low one; memory is bounded per executor by [`Limits::memory`].
    pub address_space: Option<u64>,
    /// Memory of the whole executor in bytes (cgroup `memory.max` / `memory.limit_in_bytes`).
    pub memory: Option<u64>,
    /// Tasks (processes and threads) of the whole executor (cgroup `pids.max`).
    pub tasks: Option<u64>,
    /// CPU time of the whole executor per period, in percent of one CPU (cgroup `cpu.max`
    /// / `cpu.cfs_quota_us`).
    pub cpu_percent: Option<u64>,
    /// Whether the whole-executor bounds must be enforced.
    pub cgroup: CgroupMode,
    /// RLIMIT_CPU in seconds.
    pub cpu_seconds: u64,
    /// RLIMIT_FSIZE in bytes.
    pub file_size: u64,
}

impl Limits {
    /// No bound at all (placeholder for cgroups found without their profile).
    pub(crate) const NONE: Limits = Limits {
        wall_clock: None,
        open_files: 0,
        processes: 0,
        address_space: None,
        memory: None,
        tasks: None,
        cpu_percent: None,
        cgroup: CgroupMode::BestEffort,
        cpu_seconds: 0,
        file_size: 0,
    };
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    description: String,
    network: NetworkSection,
    #[serde(default)]
    namespaces: NamespaceSection,
    filesystem: FilesystemSection,
    limits: LimitsSection,
    #[serde(default)]
    seccomp: SeccompSection,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkSection {
    path: NetworkPath,
    socket_families: Vec<String>,
    #[serde(default)]
    netlink_protocols: Vec<String>,
    #[serde(default)]
    absent_unix_sockets: Vec<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NamespaceSection {
    mount: bool,
    pid: bool,
    ipc: bool,
    uts: bool,
}

impl Default for NamespaceSection {
    fn default() -> Self {
        Self {
            mount: true,
            pid: true,
            ipc: true,
            uts: true,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FilesystemSection {
    landlock: LandlockMode,
    read_only: Vec<PathBuf>,
    read_write: Vec<PathBuf>,
    // Required: left out, it would mean the service's one /tmp shared by every executor, a
    // channel between sessions that neither the broker nor the flow checks see.
    private_tmp: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsSection {
    wall_clock_seconds: u64,
    open_files: u64,
    processes: u64,
    #[serde(default)]
    address_space_mib: Option<u64>,
    cpu_seconds: u64,
    file_size_mib: u64,
    #[serde(default)]
    memory_mib: Option<u64>,
    #[serde(default)]
    tasks: Option<u64>,
    #[serde(default)]
    cpu_percent: Option<u64>,
    #[serde(default = "cgroup_required")]
    cgroup: CgroupMode,
}

fn cgroup_required() -> CgroupMode {
    CgroupMode::Required
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SeccompSection {
    #[serde(default)]
    extra_deny: Vec<String>,
}

/// How someone other than root or this process's user could change what `meta` describes,
/// if anyone could (`sticky`: a root-owned sticky directory, whose entries others cannot
/// replace, is fine).
fn others_may_change(meta: &std::fs::Metadata, sticky: bool) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let mode = meta.mode() & 0o7777;
    if sticky && mode & 0o1000 != 0 && meta.uid() == 0 {
        return None;
    }
    if mode & 0o022 != 0 {
        return Some(format!(
            "has mode {mode:04o}, so group or others may write it (chmod go-w)"
        ));
    }
    let uid = nix::unistd::geteuid().as_raw();
    (meta.uid() != 0 && meta.uid() != uid).then(|| {
        format!(
            "is owned by uid {}, neither root nor this process's uid {uid}",
            meta.uid()
        )
    })
}

/// The fewest open files a profile may allow a process: the three standard streams and the
/// descriptors the sandbox's own set-up holds at once before the command starts.
pub const MIN_OPEN_FILES: u64 = 16;

/// The profiles compiled into the binary, so a fresh machine runs without installed files.
pub const BUILTIN: &[(&str, &str)] = &[
    ("isolated", include_str!("../../profiles/isolated.toml")),
    ("brokered", include_str!("../../profiles/brokered.toml")),
];

impl Profile {
    /// Loads and validates a profile file; its name is the file stem. The file (judged as
    /// opened) and the directory it is in must be ones only root or this process's user may
    /// change (a root-owned sticky directory excepted).
    pub fn load(file: &Path) -> Result<Self, ProfileError> {
        use std::io::Read;
        let read = |source| ProfileError::Read {
            file: file.to_path_buf(),
            source,
        };
        let mut opened = std::fs::File::open(file).map_err(read)?;
        let meta = opened.metadata().map_err(read)?;
        let dir = match file.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let dir_meta = std::fs::metadata(dir).map_err(read)?;
        for (path, m, may_be_sticky) in [(file, &meta, false), (dir, &dir_meta, true)] {
            if let Some(why) = others_may_change(m, may_be_sticky) {
                return Err(ProfileError::Untrusted {
                    file: file.to_path_buf(),
                    path: path.to_path_buf(),
                    why,
                });
            }
        }
        let mut text = String::new();
        opened.read_to_string(&mut text).map_err(read)?;
        let name = file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self::parse(&name, file, &text)
    }

    /// Finds a profile by name: `DIR/NAME.toml` in each search directory, then the built-in
    /// profiles. Only a file that does not exist is looked for further on: one that is there
    /// but cannot be read (no permission on it or its directory, a dangling link, a
    /// directory, an I/O error) is a [`ProfileError::Read`] naming it, never the looser
    /// built-in profile of that name in its place.
    pub fn find(name: &str, search: &[PathBuf]) -> Result<Self, ProfileError> {
        for dir in search {
            let file = dir.join(format!("{name}.toml"));
            // Not followed: a link whose target is gone is there, and refused by `load`.
            match std::fs::symlink_metadata(&file) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => return Err(ProfileError::Read { file, source }),
                Ok(_) => return Self::load(&file),
            }
        }
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name) {
            return Self::parse(name, Path::new(&format!("<built-in {name}.toml>")), text);
        }
        Err(ProfileError::NotFound {
            name: name.to_string(),
            searched: search
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            builtin: BUILTIN
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// Parses and validates profile text; `file` is only used in messages.
    pub fn parse(name: &str, file: &Path, text: &str) -> Result<Self, ProfileError> {
        let raw: ProfileFile = toml::from_str(text).map_err(|e| ProfileError::Syntax {
            file: file.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        let invalid = |field: String, message: String| ProfileError::Invalid {
            file: file.to_path_buf(),
            field,
            message,
        };
        if raw.description.trim().is_empty() {
            return Err(invalid(
                "description".into(),
                "must say what the profile is for".into(),
            ));
        }
        let mut socket_families = BTreeSet::new();
        for (i, f) in raw.network.socket_families.iter().enumerate() {
            let family = SocketFamily::from_name(f).ok_or_else(|| {
                invalid(
                    format!("network.socket_families[{i}]"),
                    format!(
                        "unknown family {f:?}; accepted: {}",
                        SocketFamily::NAMES.join(", ")
                    ),
                )
            })?;
            if !socket_families.insert(family) {
                return Err(invalid(
                    format!("network.socket_families[{i}]"),
                    format!("{f:?} is listed twice"),
                ));
            }
        }
        let mut netlink_protocols = BTreeSet::new();
        for (i, p) in raw.network.netlink_protocols.iter().enumerate() {
            let proto = NetlinkProtocol::from_name(p).ok_or_else(|| {
                invalid(
                    format!("network.netlink_protocols[{i}]"),
                    format!(
                        "unknown netlink protocol {p:?}; accepted: {}",
                        NetlinkProtocol::NAMES.join(", ")
                    ),
                )
            })?;
            netlink_protocols.insert(proto);
        }
        if !netlink_protocols.is_empty() && !socket_families.contains(&SocketFamily::Netlink) {
            return Err(invalid(
                "network.netlink_protocols".into(),
                "lists protocols but `netlink` is not in network.socket_families".into(),
            ));
        }
        let check_paths = |field: &str, paths: &[PathBuf]| -> Result<(), ProfileError> {
            for (i, p) in paths.iter().enumerate() {
                if !p.is_absolute() {
                    return Err(invalid(
                        format!("filesystem.{field}[{i}]"),
                        format!("{} is not an absolute path", p.display()),
                    ));
                }
            }
            Ok(())
        };
        check_paths("read_only", &raw.filesystem.read_only)?;
        check_paths("read_write", &raw.filesystem.read_write)?;
        if raw.filesystem.private_tmp && !raw.namespaces.mount {
            return Err(invalid(
                "filesystem.private_tmp".into(),
                "needs namespaces.mount = true (the tmpfs is mounted in the executor's own mount namespace)".into(),
            ));
        }
        let l = &raw.limits;
        let positive = |field: &str, v: u64, max: u64| -> Result<u64, ProfileError> {
            if v == 0 || v > max {
                Err(invalid(
                    format!("limits.{field}"),
                    format!("{v} is out of range; use 1 to {max}"),
                ))
            } else {
                Ok(v)
            }
        };
        let limits = Limits {
            wall_clock: Some(Duration::from_secs(positive(
                "wall_clock_seconds",
                l.wall_clock_seconds,
                7 * 24 * 3600,
            )?)),
            open_files: match positive("open_files", l.open_files, 1 << 20)? {
                // The limit is set before the sandbox's own set-up opens its last descriptors
                // (Landlock's rules, the seccomp listener): below this, every spawn would fail
                // there, blamed on the step that ran out.
                n if n < MIN_OPEN_FILES => {
                    return Err(invalid(
                        "limits.open_files".into(),
                        format!(
                            "{n} is too few: the three standard streams and the descriptors the sandbox's own set-up opens before the command starts need {MIN_OPEN_FILES}; use {MIN_OPEN_FILES} to {}",
                            1u64 << 20
                        ),
                    ));
                }
                n => n,
            },
            processes: positive("processes", l.processes, 1 << 22)?,
            address_space: l
                .address_space_mib
                .map(|v| positive("address_space_mib", v, 1 << 30).map(|v| v << 20))
                .transpose()?,
            memory: l
                .memory_mib
                .map(|v| positive("memory_mib", v, 1 << 30).map(|v| v << 20))
                .transpose()?,
            tasks: l.tasks.map(|v| positive("tasks", v, 1 << 22)).transpose()?,
            cpu_percent: l
                .cpu_percent
                .map(|v| positive("cpu_percent", v, 100 * 4096))
                .transpose()?,
            cgroup: l.cgroup,
            cpu_seconds: positive("cpu_seconds", l.cpu_seconds, 7 * 24 * 3600)?,
            file_size: positive("file_size_mib", l.file_size_mib, 1 << 30)? << 20,
        };
        for (i, p) in raw.network.absent_unix_sockets.iter().enumerate() {
            if !p.is_absolute() || p.components().any(|c| c == std::path::Component::ParentDir) {
                return Err(invalid(
                    format!("network.absent_unix_sockets[{i}]"),
                    format!("{} is not an absolute path without '..'", p.display()),
                ));
            }
        }
        let mut extra_deny = Vec::new();
        for (i, name) in raw.seccomp.extra_deny.iter().enumerate() {
            // The filter is in force before the executor's own start, which is an execve:
            // denied, no executor of the profile could ever start.
            if name == "execve" {
                return Err(invalid(
                    format!("seccomp.extra_deny[{i}]"),
                    "\"execve\" cannot be denied: the executor itself starts with execve under \
                     the filter (deny \"execveat\", and leave no program it could run \
                     readable, to keep it from starting others)"
                        .into(),
                ));
            }
            let nr = syscall_number(name).ok_or_else(|| {
                invalid(
                    format!("seccomp.extra_deny[{i}]"),
                    format!("{name:?} is not a syscall this broker knows on x86_64"),
                )
            })?;
            extra_deny.push((name.clone(), nr));
        }
        Ok(Profile {
            name: name.to_string(),
            file: file.to_path_buf(),
            description: raw.description,
            network: raw.network.path,
            socket_families,
            netlink_protocols,
            absent_unix_sockets: raw.network.absent_unix_sockets,
            mount_namespace: raw.namespaces.mount,
            pid_namespace: raw.namespaces.pid,
            ipc_namespace: raw.namespaces.ipc,
            uts_namespace: raw.namespaces.uts,
            landlock: raw.filesystem.landlock,
            read_only: raw.filesystem.read_only,
            read_write: raw.filesystem.read_write,
            private_tmp: raw.filesystem.private_tmp,
            limits,
            extra_deny,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_are_valid() {
        for (name, _) in BUILTIN {
            let p = Profile::find(name, &[]).unwrap();
            assert_eq!(&p.name, name);
        }
        assert_eq!(
            Profile::find("isolated", &[]).unwrap().network,
            NetworkPath::None
        );
        assert_eq!(
            Profile::find("brokered", &[]).unwrap().network,
            NetworkPath::Host
        );
    }

    fn with(edit: impl Fn(&str) -> String) -> Result<Profile, ProfileError> {
        let base = BUILTIN[0].1;
        Profile::parse("t", Path::new("t.toml"), &edit(base))
    }

    #[test]
    fn errors_name_file_and_field() {
        let e = with(|s| s.replace("\"inet6\"", "\"inet7\""))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("t.toml: field `network.socket_families[2]`"),
            "{e}"
        );
        let e = with(|s| s.replace("open_files = ", "open_files = 0 #"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`limits.open_files`"), "{e}");
        let e = with(|s| s.replace("open_files = ", "open_files = 3 #"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`limits.open_files`") && e.contains("3 is too few"),
            "{e}"
        );
        with(|s| s.replace("open_files = ", &format!("open_files = {MIN_OPEN_FILES} #"))).unwrap();
        let e = with(|s| s.replace("[limits]", "[limits]\nbogus = 1"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.toml") && e.contains("unknown field `bogus`"),
            "{e}"
        );
        let e = with(|s| s.replace("extra_deny = []", "extra_deny = [\"no_such_call\"]"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`seccomp.extra_deny[0]`"), "{e}");
        // Accepted before, and no executor of the profile could start.
        let e = with(|s| s.replace("extra_deny = []", "extra_deny = [\"execve\"]"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`seccomp.extra_deny[0]`") && e.contains("starts with execve"),
            "{e}"
        );
        let e = with(|s| s.replace("private_tmp = true", ""))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.toml") && e.contains("missing field `private_tmp`"),
            "{e}"
        );
        let e = with(|s| s.replace("read_only = [", "read_only = [\"relative/dir\", "))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`filesystem.read_only[0]`") && e.contains("absolute"),
            "{e}"
        );
    }

    /// A profile file that is there but cannot be read (a dangling link, a directory, no
    /// permission) must stop the caller, naming it: falling back to the built-in profile of
    /// that name would run executors under other bounds than the operator wrote.
    #[test]
    fn a_profile_file_that_cannot_be_read_is_an_error_not_the_builtin() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("brokered.toml");
        std::os::unix::fs::symlink(dir.path().join("gone.toml"), &link).unwrap();
        let e = Profile::find("brokered", &[dir.path().to_path_buf()])
            .expect_err("a dangling profile link is not the built-in profile");
        assert!(matches!(e, ProfileError::Read { .. }), "{e:?}");
        assert!(e.to_string().contains(&link.display().to_string()), "{e}");
        std::fs::create_dir(dir.path().join("isolated.toml")).unwrap();
        let e = Profile::find("isolated", &[dir.path().to_path_buf()])
            .expect_err("a directory is not the built-in profile");
        assert!(
            e.to_string()
                .contains(&dir.path().join("isolated.toml").display().to_string()),
            "{e}"
        );
        // Absent, it is looked for further on.
        let found = Profile::find(
            "isolated",
            &[PathBuf::from("/nonexistent"), dir.path().join("none")],
        );
        assert_eq!(found.unwrap().name, "isolated");
    }

    /// A profile decides an executor's sandbox, and one found first shadows the built-in
    /// profile of its name: before, any file in a search directory was read, so whoever
    /// could write the file or its directory could loosen the sandbox.
    #[test]
    fn a_profile_others_may_change_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let chmod = |p: &Path, mode| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("isolated.toml");
        let builtin = BUILTIN.iter().find(|(n, _)| *n == "isolated").unwrap().1;
        std::fs::write(&file, builtin).unwrap();
        chmod(&file, 0o644);
        chmod(dir.path(), 0o755);
        let search = [dir.path().to_path_buf()];
        assert_eq!(Profile::find("isolated", &search).unwrap().name, "isolated");
        for (path, mode) in [(file.as_path(), 0o666), (dir.path(), 0o777)] {
            chmod(path, mode);
            let e = Profile::find("isolated", &search).unwrap_err();
            assert!(matches!(e, ProfileError::Untrusted { .. }), "{e:?}");
            let text = e.to_string();
            assert!(
                text.contains(&path.display().to_string()) && text.contains("go-w"),
                "{text}"
            );
            chmod(path, if path == file { 0o644 } else { 0o755 });
        }
    }

    #[test]
    fn unknown_profile_lists_builtins() {
        let e = Profile::find("nope", &[PathBuf::from("/nonexistent")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("isolated, brokered") && e.contains("/nonexistent"),
            "{e}"
        );
    }
}
