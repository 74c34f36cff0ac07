//! What the suites share: paths, scratch space on the real disk, and copies of executables
//! where sandboxed executors (running as another uid, with a private /tmp) can run them.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root.
pub fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// The directory this benchmark binary was built into (`target/release`).
pub fn target_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| repo("target/release"))
}

/// A fresh directory for one suite under `target/bench-scratch` (the real disk, not tmpfs),
/// or under `$FLOWHOST_BENCH_SCRATCH` when set (a tmpfs there takes the disk out of the
/// figures, leaving the host's own cost: see BENCHMARKS.md).
pub fn scratch_dir(name: &str) -> PathBuf {
    let base = std::env::var_os("FLOWHOST_BENCH_SCRATCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("..").join("bench-scratch"));
    let dir = base.join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// Whether this process runs as root (the broker needs it).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

pub fn shared_dir() -> PathBuf {
    let dir = PathBuf::from("/var/tmp/flowhost-bench");
    std::fs::create_dir_all(&dir).expect("create /var/tmp/flowhost-bench");
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755));
    dir
}

fn copy_executable(src: &Path, name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dst = shared_dir().join(name);
    let tmp = shared_dir().join(format!(".{name}.{}", std::process::id()));
    std::fs::copy(src, &tmp).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&tmp, &dst).expect("rename");
    dst
}

/// A copy of workspace binary `name` (built in release mode first if missing) that an
/// executor can exec whatever the checkout's permissions.
pub fn shared_copy(name: &str) -> PathBuf {
    let built = target_dir().join(name);
    if !built.exists() {
        release_build(
            &["-p", "flowhost-example-tools", "-p", "flowhost-probe"],
            "the example executors",
        );
    }
    copy_executable(&built, name)
}

/// Runs `cargo build --release --locked --quiet` with `args` in the repository, panicking
/// (naming `what`) if it fails.
pub fn release_build(args: &[&str], what: &str) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "--locked", "--quiet"])
        .args(args)
        .current_dir(repo(""))
        .status()
        .expect("run cargo build");
    assert!(status.success(), "building {what} failed");
}

/// A copy of this benchmark binary (it runs the timed loops inside the sandbox).
pub fn shared_self() -> PathBuf {
    copy_executable(
        &std::env::current_exe().expect("own path"),
        "flowhost-bench",
    )
}

/// The pricing lab's documents, where executors can read them.
pub fn shared_documents() -> PathBuf {
    let dir = shared_dir().join("documents");
    std::fs::create_dir_all(&dir).expect("create documents");
    for e in std::fs::read_dir(repo("fixtures/pricing-lab/documents"))
        .expect("documents")
        .flatten()
    {
        std::fs::copy(e.path(), dir.join(e.file_name())).expect("copy a document");
    }
    dir
}

/// A loopback TCP listener that accepts and drains connections in the background.
pub fn tcp_sink() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a sink");
    let addr = listener.local_addr().expect("sink address");
    std::thread::spawn(move || {
        for s in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = s;
                let _ = std::io::copy(&mut s, &mut std::io::sink());
            });
        }
    });
    addr
}
