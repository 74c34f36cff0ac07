//! The names a profile may use: socket families, netlink protocols and the syscalls it may
//! deny beyond the built-in ones. Each maps to the kernel's own number on x86_64.

/// A socket family a profile may allow. Families outside this set (AF_PACKET, AF_VSOCK,
/// AF_BLUETOOTH, ...) are never allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SocketFamily {
    /// AF_UNIX.
    Unix,
    /// AF_INET.
    Inet,
    /// AF_INET6.
    Inet6,
    /// AF_NETLINK (further limited by protocol).
    Netlink,
}

impl SocketFamily {
    /// The names accepted in profiles.
    pub const NAMES: &'static [&'static str] = &["unix", "inet", "inet6", "netlink"];

    /// Parses a profile name.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "unix" => SocketFamily::Unix,
            "inet" => SocketFamily::Inet,
            "inet6" => SocketFamily::Inet6,
            "netlink" => SocketFamily::Netlink,
            _ => return None,
        })
    }

    /// The AF_* value.
    pub fn af(self) -> i32 {
        match self {
            SocketFamily::Unix => libc::AF_UNIX,
            SocketFamily::Inet => libc::AF_INET,
            SocketFamily::Inet6 => libc::AF_INET6,
            SocketFamily::Netlink => libc::AF_NETLINK,
        }
    }
}

/// A netlink protocol a profile may allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NetlinkProtocol {
    /// NETLINK_ROUTE (interface and address queries).
    Route,
    /// NETLINK_SOCK_DIAG.
    SockDiag,
    /// NETLINK_KOBJECT_UEVENT.
    KobjectUevent,
    /// NETLINK_GENERIC.
    Generic,
}

impl NetlinkProtocol {
    /// The names accepted in profiles.
    pub const NAMES: &'static [&'static str] = &["route", "sock_diag", "kobject_uevent", "generic"];

    /// Parses a profile name.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "route" => NetlinkProtocol::Route,
            "sock_diag" => NetlinkProtocol::SockDiag,
            "kobject_uevent" => NetlinkProtocol::KobjectUevent,
            "generic" => NetlinkProtocol::Generic,
            _ => return None,
        })
    }

    /// The NETLINK_* value.
    pub fn value(self) -> i32 {
        match self {
            NetlinkProtocol::Route => libc::NETLINK_ROUTE,
            NetlinkProtocol::SockDiag => libc::NETLINK_SOCK_DIAG,
            NetlinkProtocol::KobjectUevent => libc::NETLINK_KOBJECT_UEVENT,
            NetlinkProtocol::Generic => libc::NETLINK_GENERIC,
        }
    }
}

/// Syscall names a profile may add to `seccomp.extra_deny` (x86_64 numbers).
const NAMED_SYSCALLS: &[(&str, i64)] = &[
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("chmod", libc::SYS_chmod),
    ("chown", libc::SYS_chown),
    ("clock_settime", libc::SYS_clock_settime),
    ("execveat", libc::SYS_execveat),
    ("fanotify_init", libc::SYS_fanotify_init),
    ("fchmod", libc::SYS_fchmod),
    ("fchown", libc::SYS_fchown),
    ("fork", libc::SYS_fork),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("kcmp", libc::SYS_kcmp),
    ("link", libc::SYS_link),
    ("linkat", libc::SYS_linkat),
    ("listen", libc::SYS_listen),
    ("memfd_create", libc::SYS_memfd_create),
    ("mknod", libc::SYS_mknod),
    ("mknodat", libc::SYS_mknodat),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("process_madvise", libc::SYS_process_madvise),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("rename", libc::SYS_rename),
    ("renameat2", libc::SYS_renameat2),
    ("settimeofday", libc::SYS_settimeofday),
    ("symlink", libc::SYS_symlink),
    ("symlinkat", libc::SYS_symlinkat),
    ("sync", libc::SYS_sync),
    ("syslog", libc::SYS_syslog),
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    ("vfork", libc::SYS_vfork),
];

/// The x86_64 number of a syscall a profile may name.
pub fn syscall_number(name: &str) -> Option<i64> {
    NAMED_SYSCALLS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, nr)| *nr)
}
