//! A throwaway PostgreSQL server for the fleet tests and the benchmarks: Debian's
//! `postgresql` binaries, a fresh data directory in a temporary directory, listening on
//! 127.0.0.1 only, run as the unprivileged `nobody` (the server refuses root), password
//! authentication (SCRAM) with a random password in a file. Stopped (immediately) when
//! dropped.
//!
//! The temporary directory stays root's: what root writes (the URL, the password, the TLS
//! files) is created there, never following a link, so the server's user cannot redirect
//! those writes. The server's own files (data, socket, log) are in a subdirectory it owns.

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::config::PostgresStateConfig;

/// `nobody`/`nogroup` on Debian.
const NOBODY: u32 = 65534;
/// The login role (its password is in [`Postgres::password_file`]).
const ROLE: &str = "flowhost";

/// Why the server could not be set up or driven.
#[derive(Debug, thiserror::Error)]
pub enum LabPostgresError {
    /// Not root: the server must run as another user, which takes root to arrange.
    #[error("running PostgreSQL as nobody needs root")]
    NotRoot,
    /// The `postgresql` package is not installed.
    #[error(
        "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)"
    )]
    NotInstalled,
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A server tool exited with an error.
    #[error("{tool} failed ({status}): {output}")]
    Tool {
        /// The tool.
        tool: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed.
        output: String,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LabPostgresError {
    let what = what.into();
    move |source| LabPostgresError::Io { what, source }
}

/// A running server.
#[derive(Debug)]
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// The TCP port on 127.0.0.1.
    pub port: u16,
    /// A file holding the connection URL (without the password).
    pub url_file: PathBuf,
    /// A file holding the role's password.
    pub password_file: PathBuf,
    /// Extra server settings (`-c` options), e.g. TLS.
    extra: String,
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
    /// Creates and starts a fresh server. [`LabPostgresError::NotRoot`] and
    /// [`LabPostgresError::NotInstalled`] are reasons to skip, not failures.
    pub fn start() -> Result<Postgres, LabPostgresError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(LabPostgresError::NotRoot);
        }
        let bin = binaries().ok_or(LabPostgresError::NotInstalled)?;
        let dir = tempfile::tempdir().map_err(io("creating a temporary directory"))?;
        // Traversable by the server's user, writable by root alone.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .map_err(io(format!("chmod {}", dir.path().display())))?;
        let server = dir.path().join("server");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&server)
            .map_err(io(format!("creating {}", server.display())))?;
        std::os::unix::fs::chown(&server, Some(NOBODY), Some(NOBODY))
            .map_err(io(format!("chown {}", server.display())))?;
        let mut random = [0u8; 24];
        rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut random);
        let password: String = random.iter().map(|b| format!("{b:02x}")).collect();
        // initdb, running as the server's user, reads the password from a file; it is
        // removed as soon as initdb is done.
        let pwfile = dir.path().join("initdb-password");
        create(&pwfile, &password, 0o400, Some(NOBODY))?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io("choosing a loopback port"))?
            .port();
        let pg = Postgres {
            url_file: dir.path().join("url"),
            password_file: dir.path().join("password"),
            dir,
            bin,
            port,
            extra: String::new(),
        };
        let initdb = pg.run(
            "initdb",
            pg.as_nobody("initdb")
                .arg("-D")
                .arg(pg.data())
                .args([
                    "-U",
                    ROLE,
                    "--auth=scram-sha-256",
                    "--no-sync",
                    "-E",
                    "UTF8",
                ])
                .arg(format!("--pwfile={}", pwfile.display())),
        );
        std::fs::remove_file(&pwfile).map_err(io(format!("removing {}", pwfile.display())))?;
        initdb?;
        create(
            &pg.url_file,
            &format!("postgresql://{ROLE}@127.0.0.1:{port}/postgres\n"),
            0o600,
            None,
        )?;
        create(&pg.password_file, &format!("{password}\n"), 0o600, None)?;
        pg.resume()?;
        Ok(pg)
    }

    /// The server's own directory (owned by its user).
    fn server(&self) -> PathBuf {
        self.dir.path().join("server")
    }

    /// Like [`Postgres::start`], but `Ok(None)` where no server can run here (not root, or
    /// the package missing): a test then skips, saying why.
    pub fn start_unless_unavailable() -> Result<Option<Postgres>, LabPostgresError> {
        match Postgres::start() {
            Ok(pg) => Ok(Some(pg)),
            Err(e @ (LabPostgresError::NotRoot | LabPostgresError::NotInstalled)) => {
                eprintln!("SKIP: {e}");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// A direct connection as the login role, for what a test inspects or breaks on purpose
    /// behind flowhost's back.
    pub async fn client(&self) -> Result<tokio_postgres::Client, LabPostgresError> {
        let read = |file: &Path| {
            std::fs::read_to_string(file).map_err(io(format!("reading {}", file.display())))
        };
        let failed = |e: tokio_postgres::Error| LabPostgresError::Io {
            what: format!("connecting to the lab server on port {}", self.port),
            source: std::io::Error::other(e),
        };
        let mut config: tokio_postgres::Config =
            read(&self.url_file)?.trim().parse().map_err(failed)?;
        config.password(read(&self.password_file)?.trim());
        let (client, connection) = config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(failed)?;
        tokio::spawn(connection);
        Ok(client)
    }

    fn data(&self) -> PathBuf {
        self.server().join("data")
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
        .current_dir(self.server());
        c
    }

    fn run(&self, tool: &str, command: &mut Command) -> Result<(), LabPostgresError> {
        let out = command.output().map_err(io(format!("running {tool}")))?;
        if out.status.success() {
            return Ok(());
        }
        Err(LabPostgresError::Tool {
            tool: tool.into(),
            status: out.status,
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        })
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<(), LabPostgresError> {
        self.run(
            "pg_ctl",
            self.as_nobody("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(args),
        )
    }

    /// (Re)starts the server on its port and waits until it accepts connections.
    pub fn resume(&self) -> Result<(), LabPostgresError> {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -c unix_socket_directories={} \
             -c max_connections=60 -c shared_buffers=16MB{}",
            self.port,
            self.server().display(),
            self.extra
        );
        let log = self.server().join("server.log");
        self.pg_ctl(&[
            "-l",
            &log.display().to_string(),
            "-w",
            "-t",
            "30",
            "-o",
            &options,
            "start",
        ])
    }

    /// Stops the server the way a crash would (`pg_ctl stop -m immediate`: no checkpoint,
    /// every connection cut).
    pub fn crash(&self) -> Result<(), LabPostgresError> {
        self.pg_ctl(&["-w", "-m", "immediate", "stop"])
    }

    /// Restarts the server serving TLS with `cert` and `key` (PEM files, copied in for the
    /// server's user), password authentication still required.
    pub fn restart_with_tls(&mut self, cert: &Path, key: &Path) -> Result<(), LabPostgresError> {
        let (c, k) = (
            self.dir.path().join("server.crt"),
            self.dir.path().join("server.key"),
        );
        for (from, to, mode) in [(cert, &c, 0o444), (key, &k, 0o400)] {
            let text =
                std::fs::read_to_string(from).map_err(io(format!("reading {}", from.display())))?;
            create(to, &text, mode, Some(NOBODY))?;
        }
        self.extra = format!(
            " -c ssl=on -c ssl_cert_file={} -c ssl_key_file={}",
            c.display(),
            k.display()
        );
        self.pg_ctl(&["-w", "-m", "fast", "stop"])?;
        self.resume()
    }

    /// The `[host] state` setting (TOML) pointing a host at this server as `host_id`.
    pub fn state_setting(&self, host_id: &str) -> String {
        format!(
            "state = {{ backend = \"postgres\", url_file = \"{}\", password_file = \"{}\", \
             host_id = \"{host_id}\", server_user = \"{NOBODY}\", timeout_ms = 2000 }}",
            self.url_file.display(),
            self.password_file.display()
        )
    }

    /// The same settings for the library API.
    pub fn settings(&self, host_id: &str) -> PostgresStateConfig {
        PostgresStateConfig {
            url_file: self.url_file.clone(),
            host_id: host_id.into(),
            password_file: Some(self.password_file.clone()),
            ca_file: None,
            server_user: Some(NOBODY.to_string()),
            schema: None,
            timeout: Duration::from_secs(2),
            connections: 4,
        }
    }

    /// The server's temporary directory (its data directory and log are inside).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Creates `path` (which must not exist yet, not even as a link) holding `text`, with `mode`
/// and, if given, owned by `owner`; the mode and owner are set on the open file.
fn create(path: &Path, text: &str, mode: u32, owner: Option<u32>) -> Result<(), LabPostgresError> {
    let what = || format!("writing {}", path.display());
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(io(what()))?;
    file.write_all(text.as_bytes()).map_err(io(what()))?;
    if let Some(uid) = owner {
        std::os::unix::fs::fchown(&file, Some(uid), Some(uid)).map_err(io(what()))?;
    }
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io(what()))
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self.crash();
    }
}

/// Inserts `setting` as the first key of the `[host]` table of configuration `text`.
pub fn with_host_setting(text: &str, setting: &str) -> String {
    text.replacen("[host]\n", &format!("[host]\n{setting}\n"), 1)
}
