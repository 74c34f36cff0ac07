//! Tests of cgroup discovery and limits, on fake hierarchies and on the host's own.

use super::*;
use crate::profile::Profile;

fn limits() -> Limits {
    Profile::find("isolated", &[]).unwrap().limits
}

/// A host whose only cgroup is a v1 memory one, `/svc`, in a fake tree beneath `root`.
fn v1_memory_only(root: &std::path::Path) -> CgroupSupport {
    let mem = root.join("memory");
    std::fs::create_dir_all(mem.join("svc")).unwrap();
    let memberships = vec![(4, vec!["memory".to_string()], "/svc".to_string())];
    let mounts = vec![(
        "cgroup".to_string(),
        vec!["memory".to_string()],
        mem,
        "/".to_string(),
    )];
    CgroupSupport::from_layout(&memberships, &mounts, 42)
}

/// An executor's tree is held by its cgroup only where one of its bounds gets a cgroup:
/// never for an unprivileged broker, nor for a profile that sets no whole-executor bound.
#[test]
fn a_tree_is_held_only_where_a_bound_gets_a_cgroup() {
    let root = tempfile::tempdir().unwrap();
    let host = v1_memory_only(root.path());
    assert_eq!(host.holds_tree(&limits()), Ok(()));
    let tasks_only = Limits {
        memory: None,
        cpu_percent: None,
        ..limits()
    };
    let e = host.holds_tree(&tasks_only).unwrap_err();
    assert!(e.contains("limits.tasks cannot be held"), "{e}");
    let unbounded = Limits {
        tasks: None,
        ..tasks_only
    };
    let e = host.holds_tree(&unbounded).unwrap_err();
    assert!(e.contains("no cgroup"), "{e}");
    let e = CgroupSupport::none("the broker runs unprivileged")
        .holds_tree(&limits())
        .unwrap_err();
    assert!(e.contains("the broker runs unprivileged"), "{e}");
}

#[test]
fn v1_layout_is_found_per_controller() {
    let root = tempfile::tempdir().unwrap();
    let mem = root.path().join("memory");
    std::fs::create_dir_all(mem.join("svc/a")).unwrap();
    let memberships = vec![
        (4, vec!["memory".to_string()], "/svc/a".to_string()),
        (8, vec!["pids".to_string()], "/".to_string()),
        (0, vec![], "/".to_string()),
    ];
    let mounts = vec![
        (
            "cgroup".to_string(),
            vec!["rw".to_string(), "memory".to_string()],
            mem.clone(),
            "/".to_string(),
        ),
        (
            "cgroup2".to_string(),
            vec![],
            root.path().join("unified"),
            "/".to_string(),
        ),
    ];
    let s = CgroupSupport::from_layout(&memberships, &mounts, 42);
    assert_eq!(
        s.base(Controller::Memory).unwrap(),
        &Base {
            dir: mem.join("svc/a"),
            version: Version::V1
        }
    );
    assert!(
        s.base(Controller::Pids)
            .unwrap_err()
            .contains("no cgroup hierarchy offers the pids controller")
    );
    // The probe directory was created and removed.
    let left: Vec<_> = std::fs::read_dir(mem.join("svc/a"))
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("flowhost-probe-")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");

    let cg = ExecutorCgroup::create(&s, &limits()).unwrap();
    let dir = &cg.dirs[0].2;
    assert_eq!(
        std::fs::read_to_string(dir.join("memory.limit_in_bytes")).unwrap(),
        (4096u64 << 20).to_string()
    );
    assert_eq!(
        cg.placement(),
        Placement {
            born_in: vec![dir.clone()],
            procs: vec![]
        }
    );
    std::fs::write(
        dir.join("memory.oom_control"),
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
    )
    .unwrap();
    assert_eq!(cg.hit(), Some(BoundHit::Memory { limit: 4096 << 20 }));
}

#[test]
fn a_delegated_v2_subtree_is_taken_over_only_when_alone_in_it() {
    let root = tempfile::tempdir().unwrap();
    let svc = root.path().join("system.slice/flowhost.service");
    std::fs::create_dir_all(&svc).unwrap();
    std::fs::write(
        svc.join("cgroup.controllers"),
        "cpuset cpu io memory pids\n",
    )
    .unwrap();
    std::fs::write(svc.join("cgroup.procs"), "42\n4242\n").unwrap();
    let memberships = vec![(0, vec![], "/system.slice/flowhost.service".to_string())];
    let mounts = vec![(
        "cgroup2".to_string(),
        vec![],
        root.path().to_path_buf(),
        "/".to_string(),
    )];
    let s = CgroupSupport::from_layout(&memberships, &mounts, 42);
    let why = s.base(Controller::Memory).unwrap_err();
    assert!(why.contains("1 other processes share it"), "{why}");
    assert!(!svc.join("flowhost-host").exists());

    std::fs::write(svc.join("cgroup.procs"), "42\n").unwrap();
    let s = CgroupSupport::from_layout(&memberships, &mounts, 42);
    for c in Controller::ALL {
        assert_eq!(
            s.base(c).unwrap(),
            &Base {
                dir: svc.clone(),
                version: Version::V2
            }
        );
    }
    assert_eq!(
        std::fs::read_to_string(svc.join("flowhost-host/cgroup.procs")).unwrap(),
        "42"
    );
    assert_eq!(
        std::fs::read_to_string(svc.join("cgroup.subtree_control")).unwrap(),
        "+memory +pids +cpu"
    );
    // A second broker of the same process (now in the leaf) uses the same subtree.
    std::fs::write(
        svc.join("flowhost-host/cgroup.controllers"),
        "memory pids cpu\n",
    )
    .unwrap();
    let again = CgroupSupport::from_layout(
        &[(
            0,
            vec![],
            "/system.slice/flowhost.service/flowhost-host".to_string(),
        )],
        &mounts,
        42,
    );
    assert_eq!(again, s);
    assert!(!svc.join("flowhost-host/flowhost-host").exists());
    let cg = ExecutorCgroup::create(&s, &limits()).unwrap();
    let dir = &cg.dirs[0].2;
    assert_eq!(
        cg.placement(),
        Placement {
            born_in: vec![],
            procs: vec![dir.join("cgroup.procs")]
        }
    );
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    assert_eq!(read("memory.max"), (4096u64 << 20).to_string());
    assert_eq!(read("pids.max"), "1024");
    assert_eq!(read("cpu.max"), "200000 100000");
    assert_eq!(cg.hit(), None);
    std::fs::write(dir.join("pids.events"), "max 3\n").unwrap();
    assert_eq!(cg.hit(), Some(BoundHit::Tasks { limit: 1024 }));
    std::fs::write(
        dir.join("memory.events"),
        "low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n",
    )
    .unwrap();
    assert_eq!(cg.hit(), Some(BoundHit::Memory { limit: 4096 << 20 }));
}

#[test]
fn removal_kills_what_is_left_on_the_real_unified_hierarchy() {
    // The v2 hierarchy here may offer no controllers, but moving a process into a cgroup
    // and removing the cgroup with it still running is real, and is what every
    // executor's end does.
    let Ok(me) = procfs::process::Process::myself() else {
        return;
    };
    let own = me
        .cgroups()
        .ok()
        .and_then(|c| c.into_iter().find(|g| g.hierarchy == 0))
        .map(|g| g.pathname);
    let unified = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.join("cgroup.procs").exists());
    let (Some(own), Some(unified)) = (own, unified) else {
        eprintln!("SKIP: no cgroup v2 hierarchy here");
        return;
    };
    let dir = unified
        .join(own.trim_start_matches('/'))
        .join(format!("flowhost-exec-{}-test", std::process::id()));
    if let Err(e) = std::fs::create_dir(&dir) {
        assert!(
            !nix::unistd::geteuid().is_root() || e.kind() == std::io::ErrorKind::ReadOnlyFilesystem,
            "root cannot create a v2 cgroup at {}: {e}",
            dir.display()
        );
        eprintln!("SKIP: cannot create v2 cgroups here: {e}");
        return;
    }
    let mut child = std::process::Command::new("/bin/sleep")
        .arg("60")
        .spawn()
        .unwrap();
    std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
    let cg = ExecutorCgroup {
        dirs: vec![(Controller::Pids, Version::V2, dir.clone())],
        limits: Limits::NONE,
    };
    assert!(cg.remove(Duration::from_secs(5)));
    assert!(!dir.exists());
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
}

#[test]
fn v1_executors_are_born_in_their_cgroups_others_are_moved_in() {
    let root = Path::new("/sys/fs/cgroup-fake");
    let (mem, pids, v2) = (root.join("m/x"), root.join("p/x"), root.join("u/x"));
    let mut cg = ExecutorCgroup {
        dirs: vec![
            (Controller::Memory, Version::V1, mem.clone()),
            (Controller::Pids, Version::V1, pids.clone()),
            (Controller::Cpu, Version::V2, v2.clone()),
        ],
        limits: limits(),
    };
    let p = cg.placement();
    assert_eq!(p.born_in, vec![mem.clone(), pids.clone()]);
    assert_eq!(p.procs, vec![v2.join("cgroup.procs")]);
    // Under a bound of one task the spawner thread inside would refuse the clone itself.
    cg.limits.tasks = Some(1);
    let p = cg.placement();
    assert_eq!(p.born_in, vec![mem]);
    assert_eq!(
        p.procs,
        vec![pids.join("cgroup.procs"), v2.join("cgroup.procs")]
    );
}

#[test]
fn removing_an_executor_cgroup_never_signals_the_host() {
    // The spawner thread is inside an executor's v1 cgroups while it clones, so its process
    // may be listed there; the old removal would have sent it SIGKILL.
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("flowhost-exec-1-1");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(
        dir.join("cgroup.procs"),
        format!("{}\n", std::process::id()),
    )
    .unwrap();
    let cg = ExecutorCgroup {
        dirs: vec![(Controller::Memory, Version::V1, dir)],
        limits: Limits::NONE,
    };
    assert!(!cg.remove(Duration::from_millis(30)));
}

#[test]
fn removing_an_executor_cgroup_signals_only_its_members() {
    // A pid read from `cgroup.procs` whose process has ended may name another process by
    // the time it is signalled: here, a process in no such cgroup at all.
    let mut outsider = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("flowhost-exec-1-2");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("cgroup.procs"), format!("{}\n", outsider.id())).unwrap();
    let cg = ExecutorCgroup {
        dirs: vec![(Controller::Memory, Version::V1, dir)],
        limits: Limits::NONE,
    };
    assert!(!cg.remove(Duration::from_millis(30)));
    assert!(
        outsider.try_wait().unwrap().is_none(),
        "a process outside the cgroup was killed"
    );
    outsider.kill().unwrap();
    outsider.wait().unwrap();
}

#[test]
fn the_first_executor_cgroup_proves_a_v1_base_without_a_probe() {
    let root = tempfile::tempdir().unwrap();
    let mem = root.path().join("memory");
    std::fs::create_dir_all(mem.join("svc")).unwrap();
    // The pids hierarchy's directory does not exist: nothing can be created beneath it.
    let memberships = vec![
        (4, vec!["memory".to_string()], "/svc".to_string()),
        (8, vec!["pids".to_string()], "/".to_string()),
    ];
    let mounts = vec![
        (
            "cgroup".to_string(),
            vec!["memory".to_string()],
            mem.clone(),
            "/".to_string(),
        ),
        (
            "cgroup".to_string(),
            vec!["pids".to_string()],
            root.path().join("pids"),
            "/".to_string(),
        ),
    ];
    let entries = |dir: &Path| std::fs::read_dir(dir).unwrap().count();
    let s = CgroupSupport::from_layout(&memberships, &mounts, 42);
    assert_eq!(
        entries(&mem.join("svc")),
        0,
        "nothing is created at detection"
    );

    // The executor's own cgroup is the proof; a base where it cannot be created leaves
    // that bound out of force, as a failed probe did.
    let cg = ExecutorCgroup::create(&s, &limits()).unwrap();
    assert_eq!(
        cg.dirs.iter().map(|(c, ..)| *c).collect::<Vec<_>>(),
        vec![Controller::Memory]
    );
    let why = s.base(Controller::Pids).unwrap_err();
    assert!(why.contains("cannot create cgroups beneath"), "{why}");
    // Proven once, never probed again: the base answers even with its directory gone.
    std::fs::remove_dir_all(&cg.dirs[0].2).unwrap();
    std::fs::rename(mem.join("svc"), mem.join("moved")).unwrap();
    assert_eq!(s.base(Controller::Memory).unwrap().dir, mem.join("svc"));
    std::fs::rename(mem.join("moved"), mem.join("svc")).unwrap();

    // A name already taken is no proof that the base is unwritable: the spawn fails and
    // the bound stays in force.
    let taken = CgroupSupport::from_layout(&memberships, &mounts, 42);
    // (Other tests of this process take names too: every one of the next few is taken.)
    let next = NEXT.load(Ordering::Relaxed);
    let squatters: Vec<_> = (next..next + 64)
        .map(|n| mem.join("svc").join(executor_cgroup_name(n)))
        .collect();
    for d in &squatters {
        std::fs::create_dir(d).unwrap();
    }
    let e = ExecutorCgroup::create(&taken, &limits()).unwrap_err();
    assert!(e.contains("creating the cgroup"), "{e}");
    for d in &squatters {
        std::fs::remove_dir(d).unwrap();
    }
    assert_eq!(taken.base(Controller::Memory).unwrap().dir, mem.join("svc"));

    // Asked before any creation (a `required` profile, the bounds report): the probe.
    let fresh = CgroupSupport::from_layout(&memberships, &mounts, 42);
    assert_eq!(fresh.base(Controller::Memory).unwrap().dir, mem.join("svc"));
    assert_eq!(entries(&mem.join("svc")), 0, "the probe is removed");
    let why = fresh.base(Controller::Pids).unwrap_err();
    assert!(why.contains("cannot create cgroups beneath"), "{why}");
}

#[test]
fn the_sweep_removes_only_what_gone_brokers_left() {
    let root = tempfile::tempdir().unwrap();
    let base = root.path().join("pids");
    // No process has a pid above the kernel's maximum (2^22).
    let gone = base.join("flowhost-exec-999999999-3");
    let gone_now_named = base.join("flowhost-exec-999999999-1234-3");
    let live_before = base.join(format!("flowhost-exec-{}-3", std::process::id()));
    let live = base.join(executor_cgroup_name(3));
    // A process with this pid that could not read its own start named its cgroups so.
    let live_unknown_start = base.join(format!("flowhost-exec-{}-0-3", std::process::id()));
    // An earlier process that had this pid: it started at another time.
    let earlier = base.join(format!("flowhost-exec-{}-1-3", std::process::id()));
    let other = base.join("system.slice");
    for d in [
        &gone,
        &gone_now_named,
        &live_before,
        &live,
        &live_unknown_start,
        &earlier,
        &other,
    ] {
        std::fs::create_dir_all(d).unwrap();
    }
    let s = CgroupSupport::from_layout(
        &[(8, vec!["pids".to_string()], "/".to_string())],
        &[(
            "cgroup".to_string(),
            vec!["pids".to_string()],
            base.clone(),
            "/".to_string(),
        )],
        42,
    );
    assert!(gone.exists(), "detection sweeps nothing");
    s.sweep_stale();
    assert!(!gone.exists() && !gone_now_named.exists() && !earlier.exists());
    assert!(live.exists() && live_before.exists() && other.exists());
    assert!(live_unknown_start.exists(), "its process may be alive");
}

#[test]
fn a_leftover_of_an_earlier_process_with_this_pid_takes_no_name_of_this_one() {
    let root = tempfile::tempdir().unwrap();
    let mem = root.path().join("memory");
    std::fs::create_dir_all(mem.join("svc")).unwrap();
    let s = CgroupSupport::from_layout(
        &[(4, vec!["memory".to_string()], "/svc".to_string())],
        &[(
            "cgroup".to_string(),
            vec!["memory".to_string()],
            mem.clone(),
            "/".to_string(),
        )],
        42,
    );
    // What a process with this pid that was killed before it could remove its executors'
    // cgroups left, in the naming of then: before, this process's next names were these,
    // and every spawn failed with "File exists" until an operator removed them.
    let next = NEXT.load(Ordering::Relaxed);
    for n in next..next + 64 {
        std::fs::create_dir(mem.join(format!("svc/flowhost-exec-{}-{n}", std::process::id())))
            .unwrap();
    }
    let cg = ExecutorCgroup::create(&s, &limits()).unwrap();
    assert_eq!(cg.dirs.len(), 1);
    assert!(
        cg.dirs[0]
            .2
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with(&format!("flowhost-exec-{}-", instance())),
        "{:?}",
        cg.dirs
    );
}

/// A memory bound caps swap only where the hierarchy accounts it: a host with swap and no
/// accounting file beneath the base (or whose swap cannot be read) is named, with a fix.
#[test]
fn swap_without_accounting_leaves_the_memory_bound_uncapped() {
    let root = tempfile::tempdir().unwrap();
    let v1 = Base {
        dir: root.path().join("memory/svc"),
        version: Version::V1,
    };
    let v2 = Base {
        dir: root.path().join("unified/svc"),
        version: Version::V2,
    };
    std::fs::create_dir_all(&v1.dir).unwrap();
    std::fs::create_dir_all(&v2.dir).unwrap();
    let gib = 1u64 << 30;
    // No swap: nothing to cap, with or without accounting.
    assert_eq!(swap_left_uncapped(&v1, Ok(0)), None);
    assert_eq!(swap_left_uncapped(&v2, Ok(0)), None);
    let why = swap_left_uncapped(&v1, Ok(2 * gib)).unwrap();
    assert!(why.contains("2048 MiB of swap"), "{why}");
    assert!(why.contains("memory.memsw.limit_in_bytes"), "{why}");
    assert!(why.contains(&v1.dir.display().to_string()), "{why}");
    let why = swap_left_uncapped(&v2, Ok(gib)).unwrap();
    assert!(why.contains("memory.swap.max"), "{why}");
    let why = swap_left_uncapped(&v2, Err("cannot read /proc/meminfo".into())).unwrap();
    assert!(why.contains("cannot read /proc/meminfo"), "{why}");
    // Accounted: swap is capped with RAM, whatever the host has.
    std::fs::write(v1.dir.join("memory.memsw.limit_in_bytes"), "max").unwrap();
    std::fs::write(v2.dir.join("memory.swap.max"), "max").unwrap();
    assert_eq!(swap_left_uncapped(&v1, Ok(2 * gib)), None);
    assert_eq!(swap_left_uncapped(&v2, Err("unread".into())), None);
}

/// The bounds report does not call a memory bound enforced that leaves swap uncapped.
#[test]
fn the_report_names_a_memory_bound_that_leaves_swap_uncapped() {
    let root = tempfile::tempdir().unwrap();
    let mut host = v1_memory_only(root.path());
    let profile = Profile::find("isolated", &[]).unwrap();
    let memory = |host: &CgroupSupport| {
        crate::bounds::BoundsReport::new(&profile, host, None, None, 6)
            .bounds
            .into_iter()
            .find(|b| b.field == "limits.memory_mib")
            .unwrap()
            .enforcement
    };
    assert!(matches!(memory(&host), crate::bounds::Enforcement::By(_)));
    host.swap = swap_left_uncapped(host.layout(Controller::Memory).unwrap(), Ok(1 << 30));
    match memory(&host) {
        crate::bounds::Enforcement::NotInForce(why) => {
            assert!(
                why.contains("1024 MiB of swap") && why.contains("caps RAM only"),
                "{why}"
            )
        }
        other => panic!("a memory bound leaving swap uncapped was reported {other:?}"),
    }
}

/// Run unprivileged without a mount namespace, executors may change the caller's files'
/// modes, times and attributes: a bound not in force, so `sandbox run --quiet` says it too
/// (before, only the identity line said so, which `--quiet` leaves out).
#[test]
fn an_unprivileged_profile_without_a_mount_namespace_reports_the_view_not_in_force() {
    let root = tempfile::tempdir().unwrap();
    let host = v1_memory_only(root.path());
    let mut profile = Profile::find("isolated", &[]).unwrap();
    let view = |profile: &Profile| {
        crate::bounds::BoundsReport::new(profile, &host, None, None, 6)
            .not_in_force()
            .any(|b| b.field == "namespaces.mount")
    };
    assert!(!view(&profile));
    profile.mount_namespace = false;
    assert!(view(&profile));
    // A uid of its own owns nothing of the caller's.
    let own = crate::bounds::BoundsReport::new(&profile, &host, Some((70000, 70000)), None, 6);
    assert!(!own.not_in_force().any(|b| b.field == "namespaces.mount"));
}

/// A creation that fails part way (here the second controller's cgroup cannot be made)
/// removes the cgroups it made: the sweep passes over this process's own names, so before
/// they stayed until the host stopped, one per spawn. On the host's own v1 hierarchies:
/// only there does removing a cgroup take its control files with it.
#[test]
fn a_creation_that_fails_part_way_leaves_nothing() {
    let s = CgroupSupport::detect();
    let (Ok(mem), Ok(pids)) = (s.base(Controller::Memory), s.base(Controller::Pids)) else {
        eprintln!("SKIP: no memory and pids cgroups can be made here");
        return;
    };
    let (mem, pids) = (mem.dir.clone(), pids.dir.clone());
    if mem == pids {
        eprintln!("SKIP: memory and pids share one hierarchy here");
        return;
    }
    // The pids names of the next few creations are taken (other tests of this process take
    // names too).
    let next = NEXT.load(Ordering::Relaxed);
    let names: Vec<String> = (next..next + 64).map(executor_cgroup_name).collect();
    for n in &names {
        std::fs::create_dir(pids.join(n)).unwrap();
    }
    let e = ExecutorCgroup::create(&s, &limits()).unwrap_err();
    let left: Vec<&String> = names.iter().filter(|n| mem.join(n).exists()).collect();
    for n in &names {
        std::fs::remove_dir(pids.join(n)).unwrap();
    }
    assert!(e.contains("creating the cgroup"), "{e}");
    assert!(
        left.is_empty(),
        "left behind in {}: {left:?}",
        mem.display()
    );
}
