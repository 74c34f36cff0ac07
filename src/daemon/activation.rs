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
    let mut fds = sd_notify::listen_fds()?;
    let Some(fd) = fds.next() else {
        return Ok(None);
    };
    if fd != SD_LISTEN_FDS_START {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("systemd passed descriptor {fd}, expected {SD_LISTEN_FDS_START}"),
        ));
    }
    // SAFETY: systemd passed this descriptor to this process (LISTEN_PID matched) and nothing
    // else in the process has taken ownership of it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let listener = std::os::unix::net::UnixListener::from(owned);
    // A passed descriptor that is not a listening unix socket fails here, not at accept.
    listener.local_addr()?;
    listener.set_nonblocking(true)?;
    Ok(Some(listener))
}

/// The listener to serve on: the one systemd passed, else a new socket at `path` with
/// `mode`. A leftover socket file is replaced only if nothing answers on it.
pub fn bind(
    path: &Path,
    mode: u32,
    passed: Option<std::os::unix::net::UnixListener>,
) -> Result<UnixListener, StartupError> {
    let io = |source| StartupError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(passed) = passed {
        return UnixListener::from_std(passed).map_err(io);
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process is serving on this socket",
            )));
        }
        std::fs::remove_file(path).map_err(io)?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let listener = UnixListener::bind(path).map_err(io)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io)?;
    Ok(listener)
}
