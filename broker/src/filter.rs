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
//! | 0 | ENOSYS | a syscall number above the highest this program was written against |
//! | 1 | EPERM | bypass classes (io_uring, ptrace, process_vm_*, userfaultfd, bpf, perf, unshare, setns, mount family, seccomp, prctl(PR_SET_SECCOMP), personality, keyctl, ...), namespace flags to clone, raw/packet IP sockets and IP protocols other than TCP, UDP and ICMP, IP options, extension headers, multicast membership, UDP cork and interface binding, terminal-injection ioctls, set-user-ID and set-group-ID mode bits, profile extras |
//! | 2 | EAFNOSUPPORT | socket families and netlink protocols the profile does not allow; socketpair other than AF_UNIX |
//! | 3 | ENOSYS | clone3 (its flags sit behind a pointer; libc falls back to clone), openat2 (its mode does too; libc's open does not use it) |
//! | 4 | user notification | connect, sendto with an address, sendmsg, sendmmsg, bind, listen |
//! | — | allow | everything else |

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

use crate::profile::{NetlinkProtocol, Profile, SocketFamily};

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
    libc::SYS_quotactl_fd,
    SYS_OPEN_TREE_ATTR,
    libc::SYS_uselib,
    libc::SYS_vhangup,
];

/// The syscalls that give a file a mode, each with the argument holding the mode and, for
/// those that create a file only when asked, the argument holding the flags that ask.
const MODE_SETTING_SYSCALLS: &[(i64, u8, Option<u8>)] = &[
    (libc::SYS_chmod, 1, None),
    (libc::SYS_fchmod, 1, None),
    (libc::SYS_fchmodat, 2, None),
    (libc::SYS_fchmodat2, 2, None),
    (libc::SYS_creat, 1, None),
    (libc::SYS_mknod, 1, None),
    (libc::SYS_mknodat, 2, None),
    (libc::SYS_open, 2, Some(1)),
    (libc::SYS_openat, 3, Some(2)),
];

/// The bit of `O_TMPFILE` that is its own (the rest is `O_DIRECTORY`): an unnamed file
/// created with a mode, which `linkat` can then give a name.
const O_TMPFILE_BIT: i32 = libc::O_TMPFILE & !libc::O_DIRECTORY;

/// `open_tree_attr` (Linux 6.15, mount family), which the libc crate does not name yet.
const SYS_OPEN_TREE_ATTR: i64 = 467;

/// The highest syscall number this program was written against (`file_setattr`, Linux
/// 6.17). A number above it is a syscall newer than the filter: refused with ENOSYS, as a
/// kernel without it would answer, rather than allowed unreviewed.
pub const HIGHEST_REVIEWED_SYSCALL: u32 = 469;

/// The protocols an IP socket may be created with (0 picks the type's default): those whose
/// every way to reach a peer goes through the syscalls the broker is notified of. SCTP, say,
/// connects and binds through `setsockopt` (`SCTP_SOCKOPT_CONNECTX`, `..._BINDX_ADD`).
pub const IP_PROTOCOLS_ALLOWED: &[(i32, &[i32])] = &[
    (
        libc::AF_INET,
        &[0, libc::IPPROTO_TCP, libc::IPPROTO_UDP, libc::IPPROTO_ICMP],
    ),
    (
        libc::AF_INET6,
        &[
            0,
            libc::IPPROTO_TCP,
            libc::IPPROTO_UDP,
            libc::IPPROTO_ICMPV6,
        ],
    ),
];

/// Socket options refused with EPERM: IP options and IPv6 extension headers (hop-by-hop,
/// destination options, routing headers, in both the RFC 3542 and RFC 2292 forms, and
/// through flow labels); every multicast (and IPv6 anycast) membership change: joining or
/// leaving a group makes the kernel send IGMP or MLD reports out of the host naming a group
/// the executor chose, with no syscall the broker is notified of; `UDP_CORK`, which holds a
/// datagram the broker sent open for bytes a later plain `write` (never notified) adds; and
/// the options that choose the interface a send leaves by (`SO_BINDTODEVICE`,
/// `SO_BINDTOIFINDEX`, `IP_UNICAST_IF`, `IPV6_UNICAST_IF`, `IP_MULTICAST_IF`,
/// `IPV6_MULTICAST_IF`), which a decision by address does not see (on a host with VRFs, one
/// address names a host in each); and `TCP_ULP`, which swaps a TCP socket's operations for
/// another protocol's (`smc` turns it into a socket of a family the broker does not decide
/// for, whose `listen` binds it to every address).
pub const SOCKET_OPTIONS_DENIED: &[(i32, i32)] = &[
    (libc::IPPROTO_IP, libc::IP_ADD_MEMBERSHIP),
    (libc::IPPROTO_IP, libc::IP_DROP_MEMBERSHIP),
    (libc::IPPROTO_IP, libc::IP_UNBLOCK_SOURCE),
    (libc::IPPROTO_IP, libc::IP_BLOCK_SOURCE),
    (libc::IPPROTO_IP, libc::IP_ADD_SOURCE_MEMBERSHIP),
    (libc::IPPROTO_IP, libc::IP_DROP_SOURCE_MEMBERSHIP),
    (libc::IPPROTO_IP, libc::IP_MSFILTER),
    (libc::IPPROTO_IP, libc::MCAST_JOIN_GROUP),
    (libc::IPPROTO_IP, libc::MCAST_BLOCK_SOURCE),
    (libc::IPPROTO_IP, libc::MCAST_UNBLOCK_SOURCE),
    (libc::IPPROTO_IP, libc::MCAST_LEAVE_GROUP),
    (libc::IPPROTO_IP, libc::MCAST_JOIN_SOURCE_GROUP),
    (libc::IPPROTO_IP, libc::MCAST_LEAVE_SOURCE_GROUP),
    (libc::IPPROTO_IP, libc::MCAST_MSFILTER),
    (libc::IPPROTO_IPV6, libc::IPV6_ADD_MEMBERSHIP),
    (libc::IPPROTO_IPV6, libc::IPV6_DROP_MEMBERSHIP),
    (libc::IPPROTO_IPV6, libc::IPV6_JOIN_ANYCAST),
    (libc::IPPROTO_IPV6, libc::IPV6_LEAVE_ANYCAST),
    (libc::IPPROTO_IPV6, libc::MCAST_JOIN_GROUP),
    (libc::IPPROTO_IPV6, libc::MCAST_BLOCK_SOURCE),
    (libc::IPPROTO_IPV6, libc::MCAST_UNBLOCK_SOURCE),
    (libc::IPPROTO_IPV6, libc::MCAST_LEAVE_GROUP),
    (libc::IPPROTO_IPV6, libc::MCAST_JOIN_SOURCE_GROUP),
    (libc::IPPROTO_IPV6, libc::MCAST_LEAVE_SOURCE_GROUP),
    (libc::IPPROTO_IPV6, libc::MCAST_MSFILTER),
    (libc::IPPROTO_IP, libc::IP_OPTIONS),
    (libc::IPPROTO_IPV6, libc::IPV6_2292HOPOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_2292DSTOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_2292RTHDR),
    (libc::IPPROTO_IPV6, libc::IPV6_2292PKTOPTIONS),
    (libc::IPPROTO_IPV6, libc::IPV6_HOPOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_RTHDRDSTOPTS),
    (libc::IPPROTO_IPV6, libc::IPV6_RTHDR),
    (libc::IPPROTO_IPV6, libc::IPV6_DSTOPTS),
    // A flow label carries IPv6 options (a routing header among them) that the kernel adds
    // to every send naming the label in its address or control data.
    (libc::IPPROTO_IPV6, libc::IPV6_FLOWLABEL_MGR),
    (libc::SOL_UDP, libc::UDP_CORK),
    // The kernel's UDP options are read at SOL_UDPLITE too, on a plain UDP socket.
    (libc::IPPROTO_UDPLITE, libc::UDP_CORK),
    (libc::IPPROTO_IP, libc::IP_MULTICAST_IF),
    (libc::IPPROTO_IPV6, libc::IPV6_MULTICAST_IF),
    // Set as an option, an IPv6 PKTINFO sticks: every later send leaves by its interface
    // (the interface index sits behind a pointer the filter cannot read).
    (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO),
    (libc::SOL_SOCKET, libc::SO_BINDTODEVICE),
    // SO_BINDTOIFINDEX (libc has no name for it on this target).
    (libc::SOL_SOCKET, 62),
    (libc::IPPROTO_IP, libc::IP_UNICAST_IF),
    (libc::IPPROTO_IPV6, libc::IPV6_UNICAST_IF),
    (libc::IPPROTO_TCP, libc::TCP_ULP),
];

/// `ioctl` requests refused with EPERM whatever the profile: each writes into the input of
/// a terminal that other processes (the operator's shell) read, or takes a terminal over.
/// TIOCSTI pushes bytes into a tty's input queue, TIOCLINUX pastes the console selection (and
/// more) into it, TIOCCONS redirects the console, TIOCSCTTY makes a tty the caller's
/// controlling terminal, TIOCSETD attaches a line discipline (loading its kernel module on
/// demand: code no executor needs, with a history of privilege escalations). The kernel's
/// `ioctl` request is 32 bits wide, so only the low half of the argument is compared: high
/// bits set by the caller change nothing.
// The libc crate types these as `c_ulong` for glibc and `c_int` for musl; all are small
// positive numbers, so the cast never changes a value.
#[allow(clippy::unnecessary_cast)]
pub const TERMINAL_IOCTLS_DENIED: &[(&str, u64)] = &[
    ("TIOCSTI", libc::TIOCSTI as u64),
    ("TIOCLINUX", libc::TIOCLINUX as u64),
    ("TIOCCONS", libc::TIOCCONS as u64),
    ("TIOCSCTTY", libc::TIOCSCTTY as u64),
    ("TIOCSETD", libc::TIOCSETD as u64),
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

const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// Match action of the notify segment before it is rewritten; any TRACE value would do,
/// since the rewrite replaces every return that carries it.
const NOTIFY_SENTINEL: u32 = 0x0F10;

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JA: u16 = 0x05;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_JMP_JGT_K: u16 = 0x25;
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
    compile_program(&Inputs::of(profile))
}

/// Every part of a profile its program depends on, and nothing else: profiles with equal
/// inputs get the same program, so it is compiled once for all of them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Inputs {
    socket_families: BTreeSet<SocketFamily>,
    netlink_protocols: BTreeSet<NetlinkProtocol>,
    extra_deny: BTreeSet<i64>,
}

impl Inputs {
    fn of(profile: &Profile) -> Self {
        Inputs {
            socket_families: profile.socket_families.clone(),
            netlink_protocols: profile.netlink_protocols.clone(),
            extra_deny: profile.extra_deny.iter().map(|(_, nr)| *nr).collect(),
        }
    }
}

/// Most distinct programs a [`Programs`] cache holds. Profiles come from the operator's
/// configuration, so a host has a handful; past this (many reloads of edited profiles), the
/// cache starts afresh rather than grow, and programs still in use stay alive through their
/// `Arc`s.
const MAX_CACHED_PROGRAMS: usize = 64;

/// The compiled program of every profile a broker has checked or spawned, so each is compiled
/// once (at the profile's startup check) and shared by every spawn of that profile. Keyed by
/// the profile's filter inputs, not its identity: a profile changed after it was compiled
/// (its fields are public) gets a program of its own, never a stale one.
#[derive(Debug, Default)]
pub(crate) struct Programs {
    compiled: std::sync::Mutex<HashMap<Inputs, Arc<BpfProgram>>>,
    compilations: AtomicU64,
}

impl Programs {
    /// The program for `profile`, compiled on first use.
    pub(crate) fn get(&self, profile: &Profile) -> Result<Arc<BpfProgram>, FilterError> {
        let inputs = Inputs::of(profile);
        // A panic while the lock was held cannot leave the map inconsistent (an insert or a
        // clear either happened or did not), so a poisoned lock is used as it is.
        let mut compiled = self
            .compiled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(program) = compiled.get(&inputs) {
            return Ok(program.clone());
        }
        // Compiled under the lock, so concurrent first spawns of a profile compile it once.
        let program = Arc::new(compile_program(&inputs)?);
        self.compilations.fetch_add(1, Ordering::Relaxed);
        if compiled.len() >= MAX_CACHED_PROGRAMS {
            compiled.clear();
        }
        compiled.insert(inputs, program.clone());
        Ok(program)
    }

    /// How many programs have been compiled so far.
    pub(crate) fn compilations(&self) -> u64 {
        self.compilations.load(Ordering::Relaxed)
    }
}

fn compile_program(inputs: &Inputs) -> Result<BpfProgram, FilterError> {
    use SeccompCmpArgLen::{Dword, Qword};
    use SeccompCmpOp::{Eq, MaskedEq, Ne};

    // Segment 1: EPERM.
    let mut eperm: Rules = BTreeMap::new();
    for nr in BYPASS_DENY.iter().chain(inputs.extra_deny.iter()) {
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
    // An IP socket is a stream (TCP) or a datagram (UDP, ping) socket, nothing else: the
    // type's low four bits (the rest are SOCK_NONBLOCK and SOCK_CLOEXEC) must be 1 or 2. Raw
    // and packet sockets reach the network unmediated, and protocol 0 picks a type's first
    // protocol, which for SOCK_SEQPACKET is SCTP (it connects through setsockopt) once its
    // module is loaded. Four masked tests cover every other value: 0, 3, and any with bit 2
    // or bit 3 set.
    let mut raw_socket_rules = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        for (mask, value) in [(0xf_u64, 0_u64), (0xf, 3), (0x4, 0x4), (0x8, 0x8)] {
            raw_socket_rules.push(rule(vec![
                cond(0, Dword, Eq, family as u64)?,
                cond(1, Dword, MaskedEq(mask), value)?,
            ])?);
        }
    }
    for (family, protocols) in IP_PROTOCOLS_ALLOWED {
        let mut conditions = vec![cond(0, Dword, Eq, *family as u64)?];
        for p in *protocols {
            conditions.push(cond(2, Dword, Ne, *p as u64)?);
        }
        raw_socket_rules.push(rule(conditions)?);
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

    // A file the executor makes set-user-ID or set-group-ID would run, for whoever can
    // reach it (a directory the operator let it write), as the executor's uid and gid,
    // which are leased to a later executor once this one ends: the two would share one
    // identity. Refused wherever a mode is given: chmod, and creating a file (open, openat
    // and creat with O_CREAT or O_TMPFILE, mknod).
    for (nr, mode_arg, flags_arg) in MODE_SETTING_SYSCALLS {
        // A profile that denies the syscall outright (an empty rule list matches always)
        // keeps that: conditions added to it would allow the rest.
        if eperm.get(nr).is_some_and(Vec::is_empty) {
            continue;
        }
        let mut rules = Vec::new();
        for bit in [libc::S_ISUID, libc::S_ISGID] {
            let set = cond(*mode_arg, Dword, MaskedEq(u64::from(bit)), u64::from(bit))?;
            match flags_arg {
                None => rules.push(rule(vec![set])?),
                Some(flags) => {
                    for creating in [libc::O_CREAT, O_TMPFILE_BIT] {
                        rules.push(rule(vec![
                            cond(*flags, Dword, MaskedEq(creating as u64), creating as u64)?,
                            set.clone(),
                        ])?);
                    }
                }
            }
        }
        eperm.insert(*nr, rules);
    }

    // Segment 2: EAFNOSUPPORT.
    let mut eafnosupport: Rules = BTreeMap::new();
    let mut socket_rules = Vec::new();
    if inputs.socket_families.is_empty() {
        socket_rules.push(rule(vec![cond(0, Dword, SeccompCmpOp::Ge, 0)?])?);
    } else {
        socket_rules.push(rule(
            inputs
                .socket_families
                .iter()
                .map(|f| cond(0, Dword, Ne, f.af() as u64))
                .collect::<Result<_, _>>()?,
        )?);
    }
    if inputs.socket_families.contains(&SocketFamily::Netlink) {
        let mut conditions = vec![cond(0, Dword, Eq, libc::AF_NETLINK as u64)?];
        for p in &inputs.netlink_protocols {
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
    let enosys: Rules = BTreeMap::from([
        (libc::SYS_clone3, Vec::new()),
        (libc::SYS_openat2, Vec::new()),
    ]);

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
        jump(BPF_JMP_JGT_K, HIGHEST_REVIEWED_SYSCALL, 0, 1),
        stmt(BPF_RET_K, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
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

#[cfg(test)]
mod tests;
