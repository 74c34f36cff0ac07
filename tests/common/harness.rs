//! What the harness tests share: the example tool and its files where every user can read
//! them, and running as an unprivileged user (uid/gid 65534 through `setpriv`).

use std::path::{Path, PathBuf};
use std::process::Command;

use flowhost::harness::Harness;

use super::{have, is_root, shared_copy, shared_dir};

/// The unprivileged user the harness tests run flowhost as.
pub const NOBODY: (u32, u32) = (65534, 65534);

/// Who runs flowhost in a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum As {
    /// Root: the broker in its privileged mode.
    Root,
    /// uid/gid 65534 with no capabilities: the broker in its user-namespace mode.
    Nobody,
}

/// Whether the tests can run as `who` here; prints why not. As root (CI) the root mode
/// always runs; the unprivileged mode needs setpriv, user namespaces, and every path the
/// unprivileged user must open readable by it. With `FLOWHOST_TEST_UNPRIVILEGED=required`
/// (set by `.ci/run`) a missing prerequisite fails the test instead.
pub fn can_run(who: As, paths: &[&Path]) -> bool {
    let ready = prerequisites(who, paths);
    if let Err(why) = &ready {
        let required = std::env::var("FLOWHOST_TEST_UNPRIVILEGED").as_deref() == Ok("required");
        assert!(
            !required || !is_root(),
            "FLOWHOST_TEST_UNPRIVILEGED=required, but {why}"
        );
        eprintln!("SKIP: {why}");
    }
    ready.is_ok()
}

fn prerequisites(who: As, paths: &[&Path]) -> Result<(), String> {
    if !is_root() {
        return Err("the harness tests start as root (CI runs them as root)".into());
    }
    if who == As::Root {
        return Ok(());
    }
    if !have("setpriv") {
        return Err("the unprivileged harness tests need setpriv (util-linux)".into());
    }
    let namespaces = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    if namespaces == 0 {
        return Err("user namespaces are disabled (user.max_user_namespaces = 0)".into());
    }
    for p in paths {
        let readable = nobody(Path::new("/bin/sh"))
            .args(["-c", "test -r \"$1\"", "sh"])
            .arg(p)
            .status()
            .is_ok_and(|s| s.success());
        if !readable {
            return Err(format!(
                "{} is not readable by uid {} (put the build somewhere it can read)",
                p.display(),
                NOBODY.0
            ));
        }
    }
    Ok(())
}

/// `program` run as [`NOBODY`] with no supplementary groups, from `/`.
pub fn nobody(program: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        format!("--reuid={}", NOBODY.0),
        format!("--regid={}", NOBODY.1),
        "--clear-groups".into(),
        "--".into(),
    ])
    .arg(program)
    .current_dir("/");
    c
}

/// The flowhost binary `who` can run.
pub fn flowhost_for(who: As) -> PathBuf {
    match who {
        As::Root => PathBuf::from(env!("CARGO_BIN_EXE_flowhost")),
        As::Nobody => shared_copy("flowhost"),
    }
}

/// `flowhost` as `who`.
pub fn flowhost(who: As) -> Command {
    match who {
        As::Root => Command::new(flowhost_for(who)),
        As::Nobody => nobody(&flowhost_for(who)),
    }
}

/// The harness as `who`.
pub fn harness(who: As) -> Harness {
    let h = Harness::with_binary(flowhost_for(who));
    match who {
        As::Root => h,
        As::Nobody => h.run_as(NOBODY.0, NOBODY.1),
    }
}

/// A new directory `who` may write, under the shared directory (removed on drop).
pub fn work_dir(who: As) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("harness-")
        .tempdir_in(shared_dir())
        .unwrap();
    if who == As::Nobody {
        std::os::unix::fs::chown(dir.path(), Some(NOBODY.0), Some(NOBODY.1)).unwrap();
    }
    dir
}

/// The example tool (`examples/harness_tool`), copied where executors can run it. Copies
/// of earlier builds (one per build, each as large as the debug binary) are removed once
/// they are an hour old, so that no test still running from such a build loses its copy.
pub fn example_tool() -> PathBuf {
    let exe = super::workspace_binary("examples/harness_tool");
    let dir = shared_dir().join("examples");
    let staged = flowhost::harness::stage(&exe, &dir).unwrap();
    let hour = std::time::Duration::from_secs(3600);
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > hour));
        if stale && Some(entry.path().as_path()) != staged.parent() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    staged
}

/// The example tool's signed manifest, public key, mappings and declared surface, copied
/// where every user can read them.
pub struct ExampleFiles {
    _dir: tempfile::TempDir,
    pub manifest: PathBuf,
    pub key: PathBuf,
    pub mappings: PathBuf,
    pub declared: PathBuf,
}

pub fn example_files() -> ExampleFiles {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix("example-")
        .tempdir_in(shared_dir())
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/harness_tool");
    let copy = |rel: &str| {
        let dst = dir.path().join(Path::new(rel).file_name().unwrap());
        std::fs::copy(src.join(rel), &dst).unwrap();
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o644)).unwrap();
        dst
    };
    ExampleFiles {
        manifest: copy("manifest.signed.json"),
        key: copy("keys/status-probe.pub"),
        mappings: copy("mappings.toml"),
        declared: copy("declared.json"),
        _dir: dir,
    }
}

/// A declared surface allowing TCP egress to `addr` only, in `dir`.
pub fn surface_allowing(dir: &Path, addr: std::net::SocketAddr) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("declared.json");
    let surface = serde_json::json!({
        "schema": "assay.declared_tool_surface.v0",
        "declared_tool_actions": [{
            "id": "network.sink",
            "provider": "network",
            "action_class": "network_egress",
            "allowed_targets": [{"address": addr.ip().to_string(), "port": addr.port(), "protocol": "tcp"}],
            "allowed_effects": ["allow"],
            "required_decision": "explicit_policy"
        }]
    });
    std::fs::write(&path, surface.to_string()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

/// The stdout of a command that must have succeeded (else both outputs in the panic).
pub fn succeeded(out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
