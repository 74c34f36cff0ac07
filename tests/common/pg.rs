//! A real PostgreSQL server (Debian's packages) in a temporary data directory, listening on
//! loopback only, run as the unprivileged `nobody` and started by the test itself.

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::is_root;

/// `nobody`/`nogroup` on Debian: the server refuses to run as root.
const NOBODY: u32 = 65534;
/// The login role the tests use (its password is in [`Postgres::password_file`]).
const ROLE: &str = "flowhost";

/// A running PostgreSQL server, stopped (immediately) when dropped.
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// The TCP port on 127.0.0.1.
    pub port: u16,
    /// A file holding the connection URL (no password in it).
    pub url_file: PathBuf,
    /// A file holding the role's password.
    pub password_file: PathBuf,
}

/// The newest `/usr/lib/postgresql/*/bin` holding `initdb` and `pg_ctl`.
fn binaries() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("pg_ctl").exists()).then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin)
}

impl Postgres {
    /// Starts a fresh server, or returns `None` with the reason printed (not root, or the
    /// `postgresql` package is not installed; CI installs it and runs as root).
    pub fn start() -> Option<Postgres> {
        if !is_root() {
            eprintln!("SKIP: the PostgreSQL tests need root to run the server as nobody");
            return None;
        }
        let Some(bin) = binaries() else {
            eprintln!(
                "SKIP: no PostgreSQL server binaries under /usr/lib/postgresql/*/bin \
                 (apt-get install postgresql)"
            );
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::chown(dir.path(), Some(NOBODY), Some(NOBODY)).unwrap();
        let password = format!("pw-{}-{}", std::process::id(), rand_suffix());
        let pwfile = dir.path().join("initdb-password");
        std::fs::write(&pwfile, &password).unwrap();
        std::fs::set_permissions(&pwfile, std::fs::Permissions::from_mode(0o644)).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pg = Postgres {
            url_file: dir.path().join("url"),
            password_file: dir.path().join("password"),
            dir,
            bin,
            port,
        };
        let data = pg.data();
        pg.as_nobody("initdb")
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                ROLE,
                "--auth=scram-sha-256",
                "--no-sync",
                "-E",
                "UTF8",
            ])
            .arg(format!("--pwfile={}", pwfile.display()))
            .status_ok("initdb");
        std::fs::write(
            &pg.url_file,
            format!("postgresql://{ROLE}@127.0.0.1:{port}/postgres\n"),
        )
        .unwrap();
        std::fs::write(&pg.password_file, format!("{password}\n")).unwrap();
        std::fs::set_permissions(&pg.password_file, std::fs::Permissions::from_mode(0o600))
            .unwrap();
        pg.resume();
        Some(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn as_nobody(&self, tool: &str) -> Command {
        let mut c = Command::new("setpriv");
        c.args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "--",
        ])
        .arg(self.bin.join(tool))
        .current_dir(self.dir.path());
        c
    }

    /// (Re)starts the server on its port and waits until it accepts connections.
    pub fn resume(&self) {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -c unix_socket_directories={} \
             -c max_connections=60 -c shared_buffers=16MB",
            self.port,
            self.dir.path().display()
        );
        self.as_nobody("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.path().join("server.log"))
            .args(["-w", "-t", "30", "-o", &options, "start"])
            .status_ok("pg_ctl start");
    }

    /// Stops the server the way a crash would (`pg_ctl stop -m immediate`: no checkpoint,
    /// every connection cut).
    pub fn crash(&self) {
        self.as_nobody("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-w", "-m", "immediate", "stop"])
            .status_ok("pg_ctl stop");
    }

    /// The `[host] state` value pointing a host at this server as `host_id`.
    pub fn state_setting(&self, host_id: &str) -> String {
        format!(
            "state = {{ backend = \"postgres\", url_file = \"{}\", password_file = \"{}\", \
             host_id = \"{host_id}\", timeout_ms = 2000 }}",
            self.url_file.display(),
            self.password_file.display()
        )
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// A `[host] state` settings value for the library API.
    pub fn settings(&self, host_id: &str) -> flowhost::config::PostgresStateConfig {
        flowhost::config::PostgresStateConfig {
            url_file: self.url_file.clone(),
            host_id: host_id.into(),
            password_file: Some(self.password_file.clone()),
            ca_file: None,
            timeout: std::time::Duration::from_secs(2),
            connections: 4,
        }
    }

    /// The data directory's path (for messages).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

trait StatusOk {
    fn status_ok(&mut self, what: &str);
}

impl StatusOk for Command {
    fn status_ok(&mut self, what: &str) {
        let out = self.output().unwrap();
        assert!(
            out.status.success(),
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self
            .as_nobody("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "stop"])
            .output();
    }
}

/// Inserts `setting` as the first key of the `[host]` table of configuration `text`.
pub fn with_host_setting(text: &str, setting: &str) -> String {
    text.replacen("[host]\n", &format!("[host]\n{setting}\n"), 1)
}
