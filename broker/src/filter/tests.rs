//! Tests of the compiled program, run through a small BPF interpreter.

use interp::run;

use super::*;
use crate::profile::{NetlinkProtocol, Profile, SocketFamily};

/// A small classic-BPF interpreter for the instructions seccompiler and this module emit. It
/// lets tests check what the compiled program really returns for a given syscall.
mod interp {
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
    // Named, so that taking it out of the list fails here.
    assert!(SOCKET_OPTIONS_DENIED.contains(&(libc::IPPROTO_TCP, libc::TCP_ULP)));
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
fn multicast_membership_cannot_be_changed() {
    // A join sends IGMP/MLD reports naming a group the executor chose.
    let p = prog("brokered");
    let eperm = ERRNO | libc::EPERM as u32;
    for (level, name) in [
        (libc::IPPROTO_IP, libc::IP_ADD_MEMBERSHIP),
        (libc::IPPROTO_IP, libc::MCAST_JOIN_GROUP),
        (libc::IPPROTO_IPV6, libc::IPV6_ADD_MEMBERSHIP),
        (libc::IPPROTO_IPV6, libc::MCAST_JOIN_SOURCE_GROUP),
    ] {
        assert_eq!(
            call(
                &p,
                libc::SYS_setsockopt,
                [3, level as u64, name as u64, 0, 0, 0]
            ),
            eperm,
            "level {level} option {name}"
        );
    }
}

#[test]
fn ip_sockets_take_only_protocols_the_broker_sees_all_of() {
    let p = prog("brokered");
    let eperm = ERRNO | libc::EPERM as u32;
    for family in [libc::AF_INET, libc::AF_INET6] {
        // SCTP connects through setsockopt; UDP-Lite and MPTCP are not needed.
        for protocol in [libc::IPPROTO_SCTP, libc::IPPROTO_UDPLITE, 262] {
            assert_eq!(
                call(
                    &p,
                    libc::SYS_socket,
                    [
                        family as u64,
                        libc::SOCK_STREAM as u64,
                        protocol as u64,
                        0,
                        0,
                        0
                    ]
                ),
                eperm,
                "family {family} protocol {protocol}"
            );
        }
        for protocol in [0, libc::IPPROTO_TCP, libc::IPPROTO_UDP] {
            assert_eq!(
                call(
                    &p,
                    libc::SYS_socket,
                    [
                        family as u64,
                        libc::SOCK_STREAM as u64,
                        protocol as u64,
                        0,
                        0,
                        0
                    ]
                ),
                libc::SECCOMP_RET_ALLOW,
                "family {family} protocol {protocol}"
            );
        }
    }
    let ping = |family: i32, protocol: i32| {
        call(
            &p,
            libc::SYS_socket,
            [
                family as u64,
                libc::SOCK_DGRAM as u64,
                protocol as u64,
                0,
                0,
                0,
            ],
        )
    };
    assert_eq!(
        ping(libc::AF_INET, libc::IPPROTO_ICMP),
        libc::SECCOMP_RET_ALLOW
    );
    assert_eq!(
        ping(libc::AF_INET6, libc::IPPROTO_ICMPV6),
        libc::SECCOMP_RET_ALLOW
    );
    // Unix sockets keep their own protocol numbering.
    assert_eq!(
        call(&p, libc::SYS_socket, [libc::AF_UNIX as u64, 1, 5, 0, 0, 0]),
        libc::SECCOMP_RET_ALLOW
    );
}

#[test]
fn syscalls_newer_than_the_filter_are_refused() {
    let p = prog("isolated");
    let enosys = ERRNO | libc::ENOSYS as u32;
    for nr in [HIGHEST_REVIEWED_SYSCALL as i64 + 1, 470, 511, 1000] {
        assert_eq!(call(&p, nr, [0; 6]), enosys, "{nr}");
    }
    let eperm = ERRNO | libc::EPERM as u32;
    // The newest of the mount and quota families are denied like their elders.
    assert_eq!(call(&p, 467, [0; 6]), eperm);
    assert_eq!(call(&p, libc::SYS_quotactl_fd, [0; 6]), eperm);
    assert_eq!(call(&p, libc::SYS_mseal, [0; 6]), libc::SECCOMP_RET_ALLOW);
}

/// A mode with the set-user-ID or set-group-ID bit is refused wherever a file gets one;
/// the same calls without them, and an open that creates nothing, are allowed; openat2,
/// whose mode the filter cannot see, is missing.
#[test]
fn set_id_mode_bits_are_refused() {
    let p = prog("isolated");
    let eperm = ERRNO | libc::EPERM as u32;
    let allow = libc::SECCOMP_RET_ALLOW;
    for bit in [libc::S_ISUID, libc::S_ISGID] {
        let mode = u64::from(0o755 | bit);
        for (nr, args) in [
            (libc::SYS_chmod, [0, mode, 0, 0, 0, 0]),
            (libc::SYS_fchmod, [3, mode, 0, 0, 0, 0]),
            (libc::SYS_fchmodat, [3, 0, mode, 0, 0, 0]),
            (libc::SYS_fchmodat2, [3, 0, mode, 0, 0, 0]),
            (libc::SYS_creat, [0, mode, 0, 0, 0, 0]),
            (
                libc::SYS_mknod,
                [0, mode | u64::from(libc::S_IFREG), 0, 0, 0, 0],
            ),
            (
                libc::SYS_mknodat,
                [3, 0, mode | u64::from(libc::S_IFREG), 0, 0, 0],
            ),
            (libc::SYS_open, [0, libc::O_CREAT as u64, mode, 0, 0, 0]),
            (libc::SYS_open, [0, libc::O_TMPFILE as u64, mode, 0, 0, 0]),
            (
                libc::SYS_openat,
                [3, 0, (libc::O_CREAT | libc::O_WRONLY) as u64, mode, 0, 0],
            ),
            (libc::SYS_openat, [3, 0, libc::O_TMPFILE as u64, mode, 0, 0]),
        ] {
            assert_eq!(call(&p, nr, args), eperm, "syscall {nr} {args:?}");
            let mut plain = args;
            for a in &mut plain {
                if *a == mode || *a == mode | u64::from(libc::S_IFREG) {
                    *a &= !u64::from(bit);
                }
            }
            assert_eq!(call(&p, nr, plain), allow, "syscall {nr} {plain:?}");
        }
        // Without O_CREAT or O_TMPFILE the mode argument is unused, whatever it holds.
        assert_eq!(call(&p, libc::SYS_openat, [3, 0, 0, mode, 0, 0]), allow);
        assert_eq!(
            call(&p, libc::SYS_open, [0, libc::O_RDWR as u64, mode, 0, 0, 0]),
            allow
        );
    }
    assert_eq!(
        call(&p, libc::SYS_openat2, [3, 0, 0, 24, 0, 0]),
        ERRNO | libc::ENOSYS as u32
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
        // Named, not only through the list: a line discipline attached from inside.
        assert_eq!(
            call(&p, libc::SYS_ioctl, [0, libc::TIOCSETD, 0x1000, 0, 0, 0]),
            eperm,
            "TIOCSETD"
        );
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
    // Denied outright although the filter also has rules of its own for it (set-id bits):
    // before, those replaced the denial, and chmod 0755 was allowed.
    profile.extra_deny.push(("chmod".into(), libc::SYS_chmod));
    let p = compile(&profile).unwrap();
    assert_eq!(
        call(&p, libc::SYS_listen, [3, 1, 0, 0, 0, 0]),
        ERRNO | libc::EPERM as u32
    );
    assert_eq!(
        call(&p, libc::SYS_chmod, [0, 0o755, 0, 0, 0, 0]),
        ERRNO | libc::EPERM as u32
    );
}

#[test]
fn programs_are_shared_by_equal_profiles_and_never_stale() {
    let programs = Programs::default();
    let brokered = Profile::find("brokered", &[]).unwrap();
    let first = programs.get(&brokered).unwrap();
    let again = programs
        .get(&Profile::find("brokered", &[]).unwrap())
        .unwrap();
    assert!(
        Arc::ptr_eq(&first, &again),
        "an equal profile reuses the program"
    );
    assert_eq!(programs.compilations(), 1);
    assert_eq!(*first, compile(&brokered).unwrap());

    let mut changed = brokered.clone();
    changed.socket_families.insert(SocketFamily::Netlink);
    changed.netlink_protocols.insert(NetlinkProtocol::Route);
    let other = programs.get(&changed).unwrap();
    assert_eq!(programs.compilations(), 2);
    assert_eq!(*other, compile(&changed).unwrap());
    let netlink = [
        libc::AF_NETLINK as u64,
        0,
        libc::NETLINK_ROUTE as u64,
        0,
        0,
        0,
    ];
    assert_eq!(
        call(&first, libc::SYS_socket, netlink),
        ERRNO | libc::EAFNOSUPPORT as u32
    );
    assert_eq!(
        call(&other, libc::SYS_socket, netlink),
        libc::SECCOMP_RET_ALLOW
    );

    // Only what the program depends on tells profiles apart.
    let mut renamed = brokered.clone();
    renamed.name = "another".into();
    renamed.limits.open_files += 1;
    assert!(Arc::ptr_eq(&programs.get(&renamed).unwrap(), &first));
    assert_eq!(programs.compilations(), 2);
}

#[test]
fn ip_sockets_take_only_stream_and_datagram_types() {
    // Protocol 0 picks a type's first protocol: SCTP for SOCK_SEQPACKET (when its module is
    // loaded), which connects through setsockopt, out of the broker's sight.
    let p = prog("brokered");
    let eperm = ERRNO | libc::EPERM as u32;
    let socket =
        |family: i32, ty: i32| call(&p, libc::SYS_socket, [family as u64, ty as u64, 0, 0, 0, 0]);
    for family in [libc::AF_INET, libc::AF_INET6] {
        for ty in [
            0,
            libc::SOCK_RAW,
            libc::SOCK_RDM,
            libc::SOCK_SEQPACKET,
            6,
            7,
            10,
            15,
        ] {
            for flags in [0, libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC] {
                assert_eq!(
                    socket(family, ty | flags),
                    eperm,
                    "family {family} type {ty}"
                );
            }
        }
        for ty in [libc::SOCK_STREAM, libc::SOCK_DGRAM] {
            for flags in [0, libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC] {
                assert_eq!(
                    socket(family, ty | flags),
                    libc::SECCOMP_RET_ALLOW,
                    "family {family} type {ty}"
                );
            }
        }
    }
    // Other families keep their types (a unix seqpacket socket is mediated by path).
    assert_eq!(
        socket(libc::AF_UNIX, libc::SOCK_SEQPACKET),
        libc::SECCOMP_RET_ALLOW
    );
}

#[test]
fn ipv6_flow_labels_cannot_be_managed() {
    // A flow label created with IPV6_FLOWLABEL_MGR carries IPv6 options (a routing header)
    // that the kernel adds to every send naming the label: a send decided for one address
    // would go to another.
    let p = prog("brokered");
    assert_eq!(
        call(
            &p,
            libc::SYS_setsockopt,
            [
                3,
                libc::IPPROTO_IPV6 as u64,
                libc::IPV6_FLOWLABEL_MGR as u64,
                0,
                0,
                0
            ]
        ),
        ERRNO | libc::EPERM as u32
    );
}
