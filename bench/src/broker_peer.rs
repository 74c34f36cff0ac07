//! sandlock, the peer of the broker suite: a public seccomp-user-notification sandbox
//! (`cargo install sandlock-cli`). When it is installed, the connect and sendto loops and the
//! whole-process `/bin/true` also run under it, interleaved with flowhost's rounds.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where `.ci/install-interop` and `cargo install --root /opt/sandlock` put it.
const WELL_KNOWN: &str = "/opt/sandlock/bin/sandlock";

/// An installed sandlock and its version.
#[derive(Debug, Clone)]
pub struct Sandlock {
    path: PathBuf,
    /// `sandlock --version`, e.g. "sandlock 0.9.0".
    pub version: String,
}

impl Sandlock {
    /// Finds sandlock on PATH or at the well-known path; prints why not when it is absent
    /// or does not run.
    pub fn find() -> Option<Sandlock> {
        let on_path = std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("sandlock"))
                .find(|c| c.is_file())
        });
        let Some(path) = on_path.or_else(|| {
            Path::new(WELL_KNOWN)
                .is_file()
                .then(|| PathBuf::from(WELL_KNOWN))
        }) else {
            eprintln!(
                "sandlock is not installed (not on PATH, not at {WELL_KNOWN}; `cargo install \
                 sandlock-cli`): the broker suite has no sandlock rows"
            );
            return None;
        };
        let version = match Command::new(&path).arg("--version").output() {
            Ok(out) if out.status.success() => {
                String::from_utf8_lossy(&out.stdout).trim().to_string()
            }
            Ok(out) => {
                eprintln!(
                    "{} --version failed ({}): no sandlock rows",
                    path.display(),
                    out.status
                );
                return None;
            }
            Err(e) => {
                eprintln!("{} does not run ({e}): no sandlock rows", path.display());
                return None;
            }
        };
        let probe = Sandlock { path, version };
        match probe.command(&[], &["/bin/true"]).status() {
            Ok(s) if s.success() => Some(probe),
            other => {
                eprintln!(
                    "{} cannot run /bin/true here ({other:?}; see `sandlock check`): no sandlock rows",
                    probe.path.display()
                );
                None
            }
        }
    }

    /// `sandlock run -r / [policy] -- argv`, stdio to /dev/null except stdout (piped by the
    /// caller when it wants it).
    pub fn command(&self, policy: &[String], argv: &[&str]) -> Command {
        let mut c = Command::new(&self.path);
        c.args(["run", "-r", "/"])
            .args(policy)
            .arg("--")
            .args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    }

    /// One whole-process `sandlock run -r / -- /bin/true`.
    pub fn true_once(&self) -> Duration {
        let start = Instant::now();
        let status = self
            .command(&[], &["/bin/true"])
            .status()
            .expect("run sandlock");
        assert!(status.success(), "sandlock run /bin/true failed: {status}");
        start.elapsed()
    }

    /// The policy that lets the loop reach `target` and nothing else: a TCP endpoint for
    /// connect, a UDP one for sendto.
    pub fn allow(kind: &str, target: &str) -> Vec<String> {
        let spec = if kind == "connect" {
            target.to_string()
        } else {
            format!("udp://{target}")
        };
        vec!["--net-allow".into(), spec]
    }
}
