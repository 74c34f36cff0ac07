//! The executor's seccomp program.
//!
//! seccompiler 0.5 compiles one match action per filter, has no user-notification action and
//! no x32 check. So the program is built as a chain of seccompiler segments, one per action,
//! where a segment's "no match" return is rewritten into a jump to the next segment, and a
//! sentinel match action is rewritten into `SECCOMP_RET_USER_NOTIF`. In front of the chain
//! sits flowhost's own prefix: kill on a foreign architecture (i386 `int 0x80`, so no
//! `socketcall`) and kill on the x32 syscall bit. The first segment that matches decides:
//!
//! | order | action | what |
//! |---|---|---|
//! | 0 | kill process | non-x86_64 arch; syscall number with the x32 bit |
//! | 1 | EPERM | bypass classes (io_uring, ptrace, process_vm_*, userfaultfd, bpf, perf, unshare, setns, mount family, seccomp, prctl(PR_SET_SECCOMP), personality, keyctl, ...), namespace flags to clone, raw/packet IP sockets, terminal-injection ioctls, profile extras |
//! | 2 | EAFNOSUPPORT | socket families and netlink protocols the profile does not allow; socketpair other than AF_UNIX |
//! | 3 | ENOSYS | clone3 (its flags sit behind a pointer; libc falls back to clone) |
//! | 4 | user notification | connect, sendto with an address, sendmsg, sendmmsg, bind |
//! | — | allow | everything else |

use std::collections::{BTreeMap, BTreeSet};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

use crate::profile::Profile;

/// Why a filter could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// seccompiler refused a rule or the program grew too large.
    #[error("seccomp program compilation failed: {0}")]
    Compile(#[from] seccompiler::BackendError),
    /// The chained program exceeds the kernel's 4096-instruction limit.
    #[error("seccomp program is {0} instructions; the kernel accepts at most 4096")]
    TooLarge(usize),
}

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

/// Syscalls that open a path around the broker or the sandbox; denied with EPERM always.
const BYPASS_DENY: &[i64] = &[
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_userfaultfd,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_seccomp,
    libc::SYS_personality,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_open_by_handle_at,
    libc::SYS_pidfd_getfd,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_uselib,
    libc::SYS_vhangup,
];

/// Socket options refused with EPERM: IP options and IPv6 extension headers (hop-by-hop,
/// destination options, routing headers, in both the RFC 3542 and RFC 2292 forms).
pub const SOCKET_OPTIONS_DENIED: &[(i32, i32)] = &[
    (libc::IPPROTO_IP, libc::IP_OPTIONS),
    (libc::IPPROTO_IPV6, libc::IPV6_2292HOPOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_2292DSTOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_2292RTHDR),
    (libc::IPPROTO_IPV6, libc::IPV6_2292PKTOPTIONS),
    (libc::IPPROTO_IPV6, libc::IPV6_HOPOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_RTHDRDSTOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_RTHDR),
    (libc::IPPROTO_IPV6, libc::IPV6_DSTOPTS),
];

/// `ioctl` requests refused with EPERM whatever the profile: each writes into the input of
/// a terminal that other processes (the operator's shell) read, or takes a terminal over.
/// TIOCSTI pushes bytes into a tty's input queue, TIOCLINUX pastes the console selection (and
/// more) into it, TIOCCONS redirects the console, TIOCSCTTY makes a tty the caller's
/// controlling terminal. The kernel's `ioctl` request is 32 bits wide, so only the low half
/// of the argument is compared: high bits set by the caller change nothing.
pub const TERMINAL_IOCTLS_DENIED: &[(&str, u64)] = &[
    ("TIOCSTI", libc::TIOCSTI),
    ("TIOCLINUX", libc::TIOCLINUX),
    ("TIOCCONS", libc::TIOCCONS),
    ("TIOCSCTTY", libc::TIOCSCTTY),
];

/// Syscalls whose arguments name a destination: stopped and handed to the broker.
pub const NOTIFIED: &[i64] = &[
    libc::SYS_connect,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_sendmmsg,
    libc::SYS_bind,
    // Not an address, but an unbound socket's listen binds it implicitly (wildcard address,
    // ephemeral port): the broker decides that bind.
    libc::SYS_listen,
];

const CLONE_NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
];

/// Syscall names a profile may add to `seccomp.extra_deny` (x86_64 numbers).
const NAMED_SYSCALLS: &[(&str, i64)] = &[
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("chmod", libc::SYS_chmod),
    ("chown", libc::SYS_chown),
    ("clock_settime", libc::SYS_clock_settime),
    ("execve", libc::SYS_execve),
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

const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// Match action of the notify segment before it is rewritten; any TRACE value would do,
/// since the rewrite replaces every return that carries it.
const NOTIFY_SENTINEL: u32 = 0x0F10;

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JA: u16 = 0x05;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_TRACE: u32 = 0x7ff0_0000;

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

fn cond(
    arg: u8,
    len: SeccompCmpArgLen,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompCondition, FilterError> {
    Ok(SeccompCondition::new(arg, len, op, value)?)
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, FilterError> {
    Ok(SeccompRule::new(conditions)?)
}

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// Compiles the executor program for `profile`.
pub fn compile(profile: &Profile) -> Result<BpfProgram, FilterError> {
    use SeccompCmpArgLen::{Dword, Qword};
    use SeccompCmpOp::{Eq, MaskedEq, Ne};

    // Segment 1: EPERM.
    let mut eperm: Rules = BTreeMap::new();
    for nr in BYPASS_DENY
        .iter()
        .chain(profile.extra_deny.iter().map(|(_, nr)| nr))
    {
        eperm.insert(*nr, Vec::new());
    }
    eperm.insert(
        libc::SYS_clone,
        CLONE_NAMESPACE_FLAGS
            .iter()
            .map(|flag| rule(vec![cond(0, Qword, MaskedEq(*flag), *flag)?]))
            .collect::<Result<_, _>>()?,
    );
    eperm.insert(
        libc::SYS_prctl,
        vec![rule(vec![cond(
            0,
            Dword,
            Eq,
            libc::PR_SET_SECCOMP as u64,
        )?])?],
    );
    let type_mask = 0xf_u64;
    let mut raw_socket_rules = Vec::new();
    for (family, ty) in [
        (libc::AF_INET, libc::SOCK_RAW),
        (libc::AF_INET6, libc::SOCK_RAW),
        // SOCK_PACKET (10): the obsolete packet interface on AF_INET.
        (libc::AF_INET, 10),
    ] {
        raw_socket_rules.push(rule(vec![
            cond(0, Dword, Eq, family as u64)?,
            cond(1, Dword, MaskedEq(type_mask), ty as u64)?,
        ])?);
    }
    eperm.insert(libc::SYS_socket, raw_socket_rules);
    // IP options and IPv6 extension headers set on a socket travel with every packet the
    // broker later sends on it: an IPv6 routing header, which needs no privilege, would send
    // a connect decided for one address to another. (Control messages carrying them are
    // refused by the broker.)
    eperm.insert(
        libc::SYS_setsockopt,
        SOCKET_OPTIONS_DENIED
            .iter()
            .map(|(level, name)| {
                rule(vec![
                    cond(1, Dword, Eq, *level as u64)?,
                    cond(2, Dword, Eq, *name as u64)?,
                ])
            })
            .collect::<Result<_, _>>()?,
    );

    eperm.insert(
        libc::SYS_ioctl,
        TERMINAL_IOCTLS_DENIED
            .iter()
            .map(|(_, request)| rule(vec![cond(1, Dword, Eq, *request)?]))
            .collect::<Result<_, _>>()?,
    );

    // Segment 2: EAFNOSUPPORT.
    let mut eafnosupport: Rules = BTreeMap::new();
    let mut socket_rules = Vec::new();
    if profile.socket_families.is_empty() {
        socket_rules.push(rule(vec![cond(0, Dword, SeccompCmpOp::Ge, 0)?])?);
    } else {
        socket_rules.push(rule(
            profile
                .socket_families
                .iter()
                .map(|f| cond(0, Dword, Ne, f.af() as u64))
                .collect::<Result<_, _>>()?,
        )?);
    }
    if profile.socket_families.contains(&SocketFamily::Netlink) {
        let mut conditions = vec![cond(0, Dword, Eq, libc::AF_NETLINK as u64)?];
        for p in &profile.netlink_protocols {
            conditions.push(cond(2, Dword, Ne, p.value() as u64)?);
        }
        socket_rules.push(rule(conditions)?);
    }
    eafnosupport.insert(libc::SYS_socket, socket_rules);
    eafnosupport.insert(
        libc::SYS_socketpair,
        vec![rule(vec![cond(0, Dword, Ne, libc::AF_UNIX as u64)?])?],
    );

    // Segment 3: ENOSYS.
    let enosys: Rules = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);

    // Segment 4: user notification. sendto without an address is a connected send whose
    // destination was decided at connect time; it is left to the kernel.
    let mut notify: Rules = BTreeMap::new();
    for nr in NOTIFIED {
        notify.insert(*nr, Vec::new());
    }
    notify.insert(libc::SYS_sendto, vec![rule(vec![cond(4, Qword, Ne, 0)?])?]);

    let segments = [
        (eperm, SeccompAction::Errno(libc::EPERM as u32)),
        (
            eafnosupport,
            SeccompAction::Errno(libc::EAFNOSUPPORT as u32),
        ),
        (enosys, SeccompAction::Errno(libc::ENOSYS as u32)),
        (notify, SeccompAction::Trace(NOTIFY_SENTINEL)),
    ];

    let mut program = vec![
        stmt(BPF_LD_W_ABS, 4), // seccomp_data.arch
        jump(BPF_JMP_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, 0), // seccomp_data.nr
        jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
    ];
    let count = segments.len();
    for (i, (rules, action)) in segments.into_iter().enumerate() {
        let compiled: BpfProgram =
            SeccompFilter::new(rules, SeccompAction::Allow, action, TargetArch::x86_64)?
                .try_into()?;
        // seccompiler starts every program with a 3-instruction arch check; the prefix above
        // already did it, so it is dropped from each segment.
        let body = &compiled[3..];
        let last = i + 1 == count;
        let len = body.len();
        for (idx, ins) in body.iter().enumerate() {
            let mut ins = ins.clone();
            if ins.code == BPF_RET_K && ins.k == libc::SECCOMP_RET_ALLOW && !last {
                // "No match here": continue with the next segment.
                ins = stmt(BPF_JMP_JA, (len - idx - 1) as u32);
            } else if ins.code == BPF_RET_K && ins.k == SECCOMP_RET_TRACE | NOTIFY_SENTINEL {
                ins = stmt(BPF_RET_K, libc::SECCOMP_RET_USER_NOTIF);
            }
            program.push(ins);
        }
    }
    if program.len() > 4096 {
        return Err(FilterError::TooLarge(program.len()));
    }
    Ok(program)
}

/// Which socket families a profile lets `socket(2)` create, as AF_* values (for reports).
pub fn allowed_families(profile: &Profile) -> BTreeSet<i32> {
    profile.socket_families.iter().map(|f| f.af()).collect()
}

/// A small classic-BPF interpreter for the instructions seccompiler and this module emit. It
/// lets tests check what the compiled program really returns for a given syscall.
#[cfg(test)]
pub(crate) mod interp {
    use super::*;

    /// Runs `prog` on a seccomp_data built from `arch`, `nr` and `args`; returns the action.
    pub fn run(prog: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let mut acc: u32 = 0;
        let mut pc = 0usize;
        loop {
            let ins = &prog[pc];
            pc += 1;
            match ins.code {
                0x20 => {
                    let k = ins.k as usize;
                    acc = u32::from_le_bytes(data[k..k + 4].try_into().unwrap());
                }
                0x54 => acc &= ins.k, // ALU AND K
                0x05 => pc += ins.k as usize,
                0x15 | 0x25 | 0x35 | 0x45 => {
                    let taken = match ins.code {
                        0x15 => acc == ins.k,
                        0x25 => acc > ins.k,
                        0x35 => acc >= ins.k,
                        _ => acc & ins.k != 0,
                    };
                    pc += if taken { ins.jt } else { ins.jf } as usize;
                }
                0x06 => return ins.k,
                other => panic!("unexpected BPF opcode {other:#x} at {}", pc - 1),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::interp::run;
    use super::*;
    use crate::profile::Profile;

    const ARCH: u32 = AUDIT_ARCH_X86_64;
    const ERRNO: u32 = libc::SECCOMP_RET_ERRNO;

    fn prog(name: &str) -> BpfProgram {
        compile(&Profile::find(name, &[]).unwrap()).unwrap()
    }

    fn call(p: &[sock_filter], nr: i64, args: [u64; 6]) -> u32 {
        run(p, ARCH, nr as u32, args)
    }

    #[test]
    fn foreign_arch_and_x32_are_killed() {
        let p = prog("brokered");
        const AUDIT_ARCH_I386: u32 = 0x4000_0003;
        // i386 socketcall (102) and anything else from a foreign ABI.
        assert_eq!(
            run(&p, AUDIT_ARCH_I386, 102, [0; 6]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
        assert_eq!(
            run(&p, AUDIT_ARCH_I386, 39, [0; 6]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
        // x32: the x86_64 arch value with the x32 bit in the number.
        assert_eq!(
            call(&p, libc::SYS_getpid | 0x4000_0000, [0; 6]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
        assert_eq!(
            call(&p, libc::SYS_connect | 0x4000_0000, [0; 6]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    #[test]
    fn program_contains_notify_and_no_sentinel() {
        let p = prog("brokered");
        assert!(
            p.iter()
                .any(|i| i.code == BPF_RET_K && i.k == libc::SECCOMP_RET_USER_NOTIF)
        );
        assert!(
            !p.iter()
                .any(|i| i.code == BPF_RET_K && i.k & 0xffff_0000 == SECCOMP_RET_TRACE)
        );
        // The x32 check is really in the program.
        assert!(
            p.iter()
                .any(|i| i.code == BPF_JMP_JGE_K && i.k == X32_SYSCALL_BIT)
        );
    }

    #[test]
    fn ip_options_and_extension_headers_cannot_be_set() {
        let p = prog("brokered");
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        for (level, name) in SOCKET_OPTIONS_DENIED {
            assert_eq!(
                call(
                    &p,
                    libc::SYS_setsockopt,
                    [3, *level as u64, *name as u64, 0, 0, 0]
                ),
                eperm,
                "level {level} option {name}"
            );
        }
        // Ordinary options stay available.
        for (level, name) in [
            (libc::SOL_SOCKET, libc::SO_REUSEADDR),
            (libc::IPPROTO_TCP, libc::TCP_NODELAY),
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY),
        ] {
            assert_eq!(
                call(
                    &p,
                    libc::SYS_setsockopt,
                    [3, level as u64, name as u64, 0, 0, 0]
                ),
                libc::SECCOMP_RET_ALLOW,
                "level {level} option {name}"
            );
        }
    }

    #[test]
    fn destination_syscalls_notify() {
        let p = prog("isolated");
        for nr in [
            libc::SYS_connect,
            libc::SYS_sendmsg,
            libc::SYS_sendmmsg,
            libc::SYS_bind,
            libc::SYS_listen,
        ] {
            assert_eq!(
                call(&p, nr, [3, 0x1000, 16, 0, 0, 0]),
                libc::SECCOMP_RET_USER_NOTIF,
                "{nr}"
            );
        }
        // sendto with an address is notified, a connected sendto (address NULL) is not.
        assert_eq!(
            call(&p, libc::SYS_sendto, [3, 0x1000, 5, 0, 0x2000, 16]),
            libc::SECCOMP_RET_USER_NOTIF
        );
        assert_eq!(
            call(&p, libc::SYS_sendto, [3, 0x1000, 5, 0, 0, 0]),
            libc::SECCOMP_RET_ALLOW
        );
        // An address with only high bits set is still an address.
        assert_eq!(
            call(&p, libc::SYS_sendto, [3, 0x1000, 5, 0, 1 << 40, 16]),
            libc::SECCOMP_RET_USER_NOTIF
        );
    }

    #[test]
    fn bypass_classes_are_denied() {
        let p = prog("brokered");
        for nr in [
            libc::SYS_io_uring_setup,
            libc::SYS_io_uring_enter,
            libc::SYS_io_uring_register,
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_userfaultfd,
            libc::SYS_bpf,
            libc::SYS_perf_event_open,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_mount,
            libc::SYS_seccomp,
            libc::SYS_personality,
            libc::SYS_keyctl,
        ] {
            assert_eq!(
                call(&p, nr, [0; 6]),
                ERRNO | libc::EPERM as u32,
                "syscall {nr}"
            );
        }
        assert_eq!(
            call(
                &p,
                libc::SYS_prctl,
                [libc::PR_SET_SECCOMP as u64, 2, 0, 0, 0, 0]
            ),
            ERRNO | libc::EPERM as u32
        );
        assert_eq!(
            call(
                &p,
                libc::SYS_prctl,
                [libc::PR_SET_NAME as u64, 0, 0, 0, 0, 0]
            ),
            libc::SECCOMP_RET_ALLOW
        );
        assert_eq!(
            call(&p, libc::SYS_clone3, [0; 6]),
            ERRNO | libc::ENOSYS as u32
        );
    }

    #[test]
    fn clone_namespace_flags_are_denied_and_threads_allowed() {
        let p = prog("brokered");
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(
            call(&p, libc::SYS_clone, [thread, 0, 0, 0, 0, 0]),
            libc::SECCOMP_RET_ALLOW
        );
        assert_eq!(
            call(&p, libc::SYS_clone, [libc::SIGCHLD as u64, 0, 0, 0, 0, 0]),
            libc::SECCOMP_RET_ALLOW
        );
        for flag in CLONE_NAMESPACE_FLAGS {
            assert_eq!(
                call(
                    &p,
                    libc::SYS_clone,
                    [flag | libc::SIGCHLD as u64, 0, 0, 0, 0, 0]
                ),
                ERRNO | libc::EPERM as u32,
                "flag {flag:#x}"
            );
        }
    }

    #[test]
    fn socket_families_follow_the_profile() {
        let p = prog("brokered");
        let sock = |af: i32, ty: i32, proto: i32| {
            call(
                &p,
                libc::SYS_socket,
                [af as u64, ty as u64, proto as u64, 0, 0, 0],
            )
        };
        assert_eq!(
            sock(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0),
            libc::SECCOMP_RET_ALLOW
        );
        assert_eq!(
            sock(libc::AF_INET6, libc::SOCK_DGRAM, 0),
            libc::SECCOMP_RET_ALLOW
        );
        assert_eq!(
            sock(libc::AF_UNIX, libc::SOCK_STREAM, 0),
            libc::SECCOMP_RET_ALLOW
        );
        assert_eq!(
            sock(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP),
            ERRNO | libc::EPERM as u32
        );
        assert_eq!(
            sock(libc::AF_INET6, libc::SOCK_RAW | libc::SOCK_NONBLOCK, 58),
            ERRNO | libc::EPERM as u32
        );
        assert_eq!(
            sock(libc::AF_PACKET, libc::SOCK_RAW, 0),
            ERRNO | libc::EAFNOSUPPORT as u32
        );
        assert_eq!(
            sock(libc::AF_VSOCK, libc::SOCK_STREAM, 0),
            ERRNO | libc::EAFNOSUPPORT as u32
        );
        assert_eq!(
            sock(libc::AF_NETLINK, libc::SOCK_RAW, libc::NETLINK_ROUTE),
            ERRNO | libc::EAFNOSUPPORT as u32
        );
        assert_eq!(
            call(
                &p,
                libc::SYS_socketpair,
                [libc::AF_INET as u64, 1, 0, 0, 0, 0]
            ),
            ERRNO | libc::EAFNOSUPPORT as u32
        );
        assert_eq!(
            call(
                &p,
                libc::SYS_socketpair,
                [libc::AF_UNIX as u64, 1, 0, 0, 0, 0]
            ),
            libc::SECCOMP_RET_ALLOW
        );
    }

    #[test]
    fn netlink_protocols_are_filtered() {
        let mut profile = Profile::find("brokered", &[]).unwrap();
        profile.socket_families.insert(SocketFamily::Netlink);
        profile.netlink_protocols.insert(NetlinkProtocol::Route);
        let p = compile(&profile).unwrap();
        let nl = |proto: i32| {
            call(
                &p,
                libc::SYS_socket,
                [
                    libc::AF_NETLINK as u64,
                    libc::SOCK_RAW as u64,
                    proto as u64,
                    0,
                    0,
                    0,
                ],
            )
        };
        assert_eq!(nl(libc::NETLINK_ROUTE), libc::SECCOMP_RET_ALLOW);
        assert_eq!(nl(libc::NETLINK_AUDIT), ERRNO | libc::EAFNOSUPPORT as u32);
        assert_eq!(
            nl(libc::NETLINK_SOCK_DIAG),
            ERRNO | libc::EAFNOSUPPORT as u32
        );
    }

    #[test]
    fn ordinary_syscalls_are_allowed() {
        let p = prog("isolated");
        for nr in [
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_openat,
            libc::SYS_execve,
            libc::SYS_exit_group,
            libc::SYS_getpid,
            libc::SYS_mmap,
        ] {
            assert_eq!(call(&p, nr, [0; 6]), libc::SECCOMP_RET_ALLOW, "{nr}");
        }
    }

    #[test]
    fn terminal_injection_ioctls_are_denied_whatever_the_profile() {
        let eperm = ERRNO | libc::EPERM as u32;
        let mut permissive = Profile::find("brokered", &[]).unwrap();
        permissive.extra_deny.clear();
        permissive.socket_families.insert(SocketFamily::Netlink);
        for p in [
            prog("isolated"),
            prog("brokered"),
            compile(&permissive).unwrap(),
        ] {
            for (name, request) in TERMINAL_IOCTLS_DENIED {
                assert_eq!(
                    call(&p, libc::SYS_ioctl, [0, *request, 0x1000, 0, 0, 0]),
                    eperm,
                    "{name}"
                );
                // The kernel truncates the request to 32 bits: high bits do not evade.
                assert_eq!(
                    call(
                        &p,
                        libc::SYS_ioctl,
                        [0, *request | 0xdead_0000_0000, 0x1000, 0, 0, 0]
                    ),
                    eperm,
                    "{name} with high bits"
                );
            }
            // Ordinary terminal ioctls stay available (isatty, window size, FIONREAD).
            for request in [libc::TCGETS, libc::TIOCGWINSZ, libc::FIONREAD] {
                assert_eq!(
                    call(&p, libc::SYS_ioctl, [0, request, 0x1000, 0, 0, 0]),
                    libc::SECCOMP_RET_ALLOW,
                    "{request:#x}"
                );
            }
        }
    }

    #[test]
    fn profile_extra_denials_apply() {
        let mut profile = Profile::find("isolated", &[]).unwrap();
        profile.extra_deny.push(("listen".into(), libc::SYS_listen));
        let p = compile(&profile).unwrap();
        assert_eq!(
            call(&p, libc::SYS_listen, [3, 1, 0, 0, 0, 0]),
            ERRNO | libc::EPERM as u32
        );
    }
}
