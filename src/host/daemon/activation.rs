//! The daemon's listening socket: bound by the host (mode from the configuration, 0660 by
//! default), or handed over by systemd socket activation (`LISTEN_FDS`).

// Adopting a descriptor number systemd passed is the one place the host crate must assert
// ownership of a raw fd.
#![allow(unsafe_code)]

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;

use tokio::net::UnixListener;

use super::StartupError;

const SD_LISTEN_FDS_START: i32 = 3;

/// The listening socket systemd passed, if any (`LISTEN_PID` matches and `LISTEN_FDS` >= 1).
/// Must be called before other threads read the environment (it clears the variables).
pub fn listener_from_systemd() -> std::io::Result<Option<std::os::unix::net::UnixListener>> {
    let fds: Vec<i32> = sd_notify::listen_fds()?.collect();
    let Some(&fd) = fds.first() else {
        return Ok(None);
    };
    if fds.len() > 1 {
        return Err(invalid(format!(
            "systemd passed {} descriptors; flowhost serves one listening socket (a socket \
             unit with one ListenStream=)",
            fds.len()
        )));
    }
    if fd != SD_LISTEN_FDS_START {
        return Err(invalid(format!(
            "systemd passed descriptor {fd}, expected {SD_LISTEN_FDS_START}"
        )));
    }
    // SAFETY: systemd passed this descriptor to this process (LISTEN_PID matched) and nothing
    // else in the process has taken ownership of it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    adopt(owned).map(Some)
}

fn invalid(why: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, why)
}

/// The listener `fd` is, if it is a listening unix stream socket bound to a file: anything
/// else (a datagram or seqpacket socket, one not listening, another family, an abstract or
/// unnamed socket, which no file mode guards and no path keeps executors from) is refused
/// here, where the start can say so, rather than failing every accept of a daemon that
/// reports itself ready.
fn adopt(fd: OwnedFd) -> std::io::Result<std::os::unix::net::UnixListener> {
    use nix::sys::socket::{SockType, SockaddrLike, getsockname, getsockopt, sockopt};
    use std::os::fd::AsRawFd;
    let refused = |what: &str| invalid(format!("the socket systemd passed {what}"));
    let family = getsockname::<nix::sys::socket::SockaddrStorage>(fd.as_raw_fd())
        .map_err(std::io::Error::from)?
        .family();
    if family != Some(nix::sys::socket::AddressFamily::Unix) {
        return Err(refused("is not a unix socket"));
    }
    if getsockopt(&fd, sockopt::SockType).map_err(std::io::Error::from)? != SockType::Stream {
        return Err(refused(
            "is not a stream socket (the socket unit needs ListenStream=)",
        ));
    }
    if !getsockopt(&fd, sockopt::AcceptConn).map_err(std::io::Error::from)? {
        return Err(refused("is not listening"));
    }
    let listener = std::os::unix::net::UnixListener::from(fd);
    if listener.local_addr()?.as_pathname().is_none() {
        return Err(refused(
            "is not bound to a file (an abstract or unnamed socket, which no file mode guards; the socket unit needs ListenStream=/path)",
        ));
    }
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The listener to serve on: the one systemd passed, else a new socket at `path` with
/// `mode`. What is at `path` is looked at without following links: only a socket that
/// nothing answers on is replaced; anything else (a regular file, a symlink, a directory)
/// is refused and left as it is. The mode is set without following links either.
pub fn bind(
    path: &Path,
    mode: u32,
    passed: Option<std::os::unix::net::UnixListener>,
) -> Result<UnixListener, StartupError> {
    use std::os::unix::fs::FileTypeExt;
    let io = |source| StartupError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(passed) = passed {
        check_passed(&passed, mode)?;
        let served = passed.local_addr().ok();
        if let Some(served) = served.as_ref().and_then(|a| a.as_pathname())
            && served != path
        {
            tracing::warn!(
                served = %served.display(),
                configured = %path.display(),
                "the socket systemd passed is not the configuration's `socket`: clients must use the one served"
            );
        }
        return UnixListener::from_std(passed).map_err(io);
    }
    if let Some(dir) = path.parent() {
        // Made writable by its owner alone whatever the umask (check_socket_dir refuses
        // a directory others could change), searchable by the clients the socket's mode
        // lets in.
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o755)
            .create(dir)
            .map_err(io)?;
        check_socket_dir(dir)?;
        // Nor may anyone else change a directory above it, and so put another in its
        // place, with a listener of theirs.
        let group_writable = crate::files::trusted_place_for_dir(dir).map_err(|e| {
            io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("the socket's directory cannot be trusted: {e}"),
            ))
        })?;
        for (above, why) in group_writable {
            tracing::warn!(
                "{} {why}: its group's members could replace the socket's directory {} below it",
                above.display(),
                dir.display()
            );
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if !is_stale(path).map_err(io)? {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    "another process is serving on this socket",
                )));
            }
            // unlink removes the entry itself, never what a link (swapped in since the
            // check) points at.
            std::fs::remove_file(path).map_err(io)?;
        }
        Ok(meta) => {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!(
                    "a {} is at the socket path; only a stale socket is replaced: remove it or \
                     configure another host.socket",
                    kind_of(&meta.file_type())
                ),
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let listener = bind_with_mode(path, mode).map_err(io)?;
    // bind applied the umask to the mode; this sets it exactly. A link swapped in for the
    // new socket makes this fail rather than change its target.
    nix::sys::stat::fchmodat(
        nix::fcntl::AT_FDCWD,
        path,
        nix::sys::stat::Mode::from_bits_truncate(mode),
        nix::sys::stat::FchmodatFlags::NoFollowSymlink,
    )
    .map_err(|e| io(e.into()))?;
    Ok(listener)
}

/// Refuses a socket systemd passed that lets in more than `mode` would (connecting takes
/// write permission on its file: a socket unit without `SocketMode=` makes it 0666, open to
/// every local user), or whose directory another user could swap it in. Its path is the one
/// it is bound to (`adopt` proved it has one).
fn check_passed(passed: &std::os::unix::net::UnixListener, mode: u32) -> Result<(), StartupError> {
    use std::os::unix::fs::MetadataExt;
    let addr = passed.local_addr().map_err(|source| StartupError::Io {
        path: std::path::PathBuf::from("(the socket systemd passed)"),
        source,
    })?;
    let Some(path) = addr.as_pathname() else {
        return Ok(());
    };
    let io = |source| StartupError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::symlink_metadata(path).map_err(io)?;
    let more = meta.mode() & 0o222 & !(mode & 0o222);
    if more != 0 {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the socket systemd passed has mode {:04o}, which lets {} connect, beyond \
                 socket_mode {mode:03o}: set SocketMode=0{mode:03o} (and SocketUser=, \
                 SocketGroup=) in the socket unit",
                meta.mode() & 0o7777,
                match (more & 0o020 != 0, more & 0o002 != 0) {
                    (_, true) => "every local user",
                    (true, false) => "its group",
                    (false, false) => "its owner",
                }
            ),
        )));
    }
    if let Some(dir) = path.parent() {
        check_socket_dir(dir)?;
    }
    Ok(())
}

/// Whether the socket at `path` is stale: only a refused connection says nothing serves on
/// it. A connection accepted or queued, a full backlog, or any other error (a socket this
/// process may not connect to, say) leaves it alone. The connect never blocks.
fn is_stale(path: &Path) -> std::io::Result<bool> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let probe = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    match connect(std::os::fd::AsRawFd::as_raw_fd(&probe), &addr) {
        Err(nix::Error::ECONNREFUSED) => Ok(true),
        Ok(()) | Err(nix::Error::EAGAIN | nix::Error::EINPROGRESS) => Ok(false),
        Err(e) => Err(std::io::Error::other(format!(
            "cannot tell whether another process serves on this socket ({e}); remove it if \
             nothing does"
        ))),
    }
}

/// Refuses a socket directory another user could swap the socket in: one not owned by this
/// process's user or root, or writable by group or others without the sticky bit.
fn check_socket_dir(dir: &Path) -> Result<(), StartupError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|source| StartupError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let euid = nix::unistd::geteuid().as_raw();
    // In a sticky directory others may add entries but not remove or rename ours.
    let mode = if meta.mode() & 0o1000 != 0 {
        meta.mode() & !0o022
    } else {
        meta.mode()
    };
    if let Some(why) = crate::files::others_may_change(mode, meta.uid(), euid) {
        return Err(StartupError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "the socket's directory {why}: it must be owned by uid {euid} or root and \
                     not writable by group or others (unless sticky), or another user could \
                     replace the socket"
                ),
            ),
        });
    }
    Ok(())
}

/// A listening socket bound at `path` whose file never has more permissions than `mode`:
/// the socket's own mode is set before `bind`, which creates the file from it (less the
/// umask).
fn bind_with_mode(path: &Path, mode: u32) -> std::io::Result<UnixListener> {
    use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen};
    let fd = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(mode & 0o777))?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(path)?)?;
    listen(&fd, Backlog::MAXCONN)?;
    UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
}

fn kind_of(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_symlink() {
        "symbolic link"
    } else if t.is_dir() {
        "directory"
    } else if t.is_file() {
        "regular file"
    } else if t.is_fifo() {
        "named pipe"
    } else {
        "device or other special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn refused(path: &Path) -> String {
        match bind(path, 0o600, None) {
            Ok(_) => panic!("{} was replaced", path.display()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_passed_socket_that_lets_in_more_than_socket_mode_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let listening = std::os::unix::net::UnixListener::bind(&path).unwrap();
        for (file_mode, refused_for) in [(0o666, "every local user"), (0o670, "its group")] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(file_mode)).unwrap();
            let e = check_passed(&listening, 0o600).unwrap_err().to_string();
            assert!(
                e.contains(&format!("mode {file_mode:04o}"))
                    && e.contains(refused_for)
                    && e.contains("SocketMode=0600")
                    && e.contains(&path.display().to_string()),
                "{e}"
            );
        }
        // Read and search bits let no one connect.
        for file_mode in [0o600, 0o755, 0o644] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(file_mode)).unwrap();
            check_passed(&listening, 0o660).unwrap();
        }
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_passed(&listening, 0o660).unwrap_err().to_string();
        assert!(e.contains("socket's directory"), "{e}");
    }

    #[test]
    fn a_passed_socket_must_be_a_listening_unix_stream_socket() {
        let dir = tempfile::tempdir().unwrap();
        let listening = std::os::unix::net::UnixListener::bind(dir.path().join("l")).unwrap();
        assert!(adopt(OwnedFd::from(listening)).is_ok());
        let datagram = std::os::unix::net::UnixDatagram::bind(dir.path().join("d")).unwrap();
        let e = adopt(OwnedFd::from(datagram)).unwrap_err().to_string();
        assert!(e.contains("not a stream socket"), "{e}");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let e = adopt(OwnedFd::from(tcp)).unwrap_err().to_string();
        assert!(e.contains("not a unix socket"), "{e}");
        // Bound but never listening: every accept would fail.
        let bound = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let addr = nix::sys::socket::UnixAddr::new(&dir.path().join("b")).unwrap();
        nix::sys::socket::bind(std::os::fd::AsRawFd::as_raw_fd(&bound), &addr).unwrap();
        let e = adopt(bound).unwrap_err().to_string();
        assert!(e.contains("not listening"), "{e}");
        // An abstract socket: anyone may connect whatever the configured mode.
        use std::os::linux::net::SocketAddrExt;
        let name = format!("flowhost-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let abstract_socket = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        let e = adopt(OwnedFd::from(abstract_socket))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not bound to a file"), "{e}");
    }

    #[tokio::test]
    async fn only_a_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("flowhost.sock");

        std::fs::write(&path, "operator data").unwrap();
        let e = refused(&path);
        assert!(
            e.contains("flowhost.sock") && e.contains("a regular file is at the socket path"),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "operator data");
        std::fs::remove_file(&path).unwrap();

        let target = dir.path().join("target");
        std::fs::write(&target, "x").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let e = refused(&path);
        assert!(e.contains("symbolic link"), "{e}");
        assert!(std::fs::symlink_metadata(&path).unwrap().is_symlink());
        let target_mode = std::fs::metadata(&target).unwrap().permissions().mode();
        assert_eq!(target_mode & 0o777, 0o640);
        std::fs::remove_file(&path).unwrap();

        std::fs::create_dir(&path).unwrap();
        assert!(refused(&path).contains("directory"));
        std::fs::remove_dir(&path).unwrap();

        // A live socket is never taken over; a stale one is replaced and gets the mode.
        let live = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let e = refused(&path);
        assert!(e.contains("another process is serving"), "{e}");
        drop(live);
        let listener = bind(&path, 0o600, None).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        drop(listener);
    }

    #[tokio::test]
    async fn a_socket_with_a_full_backlog_is_live_and_answered_at_once() {
        use nix::sys::socket::{Backlog, listen};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("flowhost.sock");
        let live = std::os::unix::net::UnixListener::bind(&path).unwrap();
        listen(&live, Backlog::new(0).unwrap()).unwrap();
        // Fill the backlog: nobody accepts.
        let mut queued = Vec::new();
        while let Ok(c) = {
            let s = nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Unix,
                nix::sys::socket::SockType::Stream,
                nix::sys::socket::SockFlag::SOCK_NONBLOCK,
                None,
            )
            .unwrap();
            nix::sys::socket::connect(
                std::os::fd::AsRawFd::as_raw_fd(&s),
                &nix::sys::socket::UnixAddr::new(&path).unwrap(),
            )
            .map(|()| s)
        } {
            queued.push(c);
        }
        let started = std::time::Instant::now();
        let e = refused(&path);
        assert!(e.contains("another process is serving"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        assert!(std::fs::symlink_metadata(&path).is_ok(), "left in place");
        drop(live);
    }

    #[tokio::test]
    async fn a_socket_directory_others_could_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = refused(&open.join("flowhost.sock"));
        assert!(
            e.contains("open") && e.contains("not writable by group"),
            "{e}"
        );
        // Sticky, as /tmp: others cannot remove what is ours.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        drop(bind(&open.join("flowhost.sock"), 0o600, None).unwrap());
        if nix::unistd::geteuid().is_root() {
            let theirs = dir.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let e = refused(&theirs.join("flowhost.sock"));
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }
}
