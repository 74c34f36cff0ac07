//! Resolving a unix socket path the way the executor would see it (its working directory
//! and root), and pinning what was decided, so the broker reaches exactly that path.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::as_executor::as_executor;
use super::socket::TakenSocket;
use super::{Caller, Outcome, Step, errno_of};
use crate::attempt::{Destination, EgressSyscall};
use crate::sys;

impl Caller<'_> {
    /// Decodes a copied address as the kernel would read it for this socket and syscall
    /// (see [`Destination::for_socket`]). For pathname unix sockets, resolves `.` and `..`
    /// and the working directory first, then opens the result in the executor's filesystem
    /// view without following symlinks and pins the inode (connect, send) or the parent
    /// directory (bind): what is decided is exactly the path the broker reaches.
    pub(super) fn resolve(
        &self,
        raw: &[u8],
        sock: &TakenSocket,
        syscall: EgressSyscall,
    ) -> (Destination, Step<Target>) {
        let destination = match Destination::for_socket(raw, sock.info.family, syscall) {
            // A ping socket sends to the address alone (the kernel ignores the port): it is
            // decided without one, so no rule's port is taken to allow an ICMP echo.
            Destination::Inet(addr) if sock.info.is_icmp() => {
                Destination::Inet(std::net::SocketAddr::new(addr.ip(), 0))
            }
            other => other,
        };
        let Destination::UnixPath(path) = &destination else {
            return (
                destination,
                Ok(Target {
                    addr: raw.to_vec(),
                    pin: None,
                }),
            );
        };
        let absolute = if path.is_absolute() {
            path.clone()
        } else {
            match std::fs::read_link(format!("/proc/{}/cwd", self.n.pid)) {
                Ok(cwd) => cwd.join(path),
                Err(e) => return (destination, Err(self.failure(&e))),
            }
        };
        // Proves the working directory read above was the waiting thread's.
        if let Err(gone) = self.still_waiting() {
            return (destination, Err(gone));
        }
        let absolute = without_dots(&absolute);
        let usage = if syscall == EgressSyscall::Bind {
            UnixUse::Bind
        } else {
            UnixUse::Connect
        };
        let target = self.pin_unix(&absolute, usage);
        (Destination::UnixPath(absolute), target)
    }

    fn pin_unix(&self, absolute: &Path, usage: UnixUse) -> Step<Target> {
        let root = std::fs::File::open(format!("/proc/{}/root", self.n.pid))
            .map_err(|e| self.failure(&e))?;
        // Proves the root just opened is the waiting thread's, not a reused pid's.
        self.still_waiting()?;
        let root = OwnedFd::from(root);
        let errno = |e: io::Error| Outcome::Errno(errno_of(&e));
        let c = |p: &Path| {
            CString::new(p.as_os_str().as_bytes()).map_err(|_| Outcome::Errno(libc::EINVAL))
        };
        // Looked up as the executor: each directory on the way needs its search permission.
        let open = |path: &Path| {
            let path = c(path)?;
            as_executor(self.ctx.identity, || {
                sys::open_path_nofollow(root.as_fd(), &path, true)
            })
            .map_err(errno)
        };
        match usage {
            UnixUse::Connect => {
                let pin = open(absolute)?;
                let addr = unix_sockaddr(format!("/proc/self/fd/{}", pin.as_raw_fd()).as_bytes())?;
                Ok(Target {
                    addr,
                    pin: Some(pin),
                })
            }
            UnixUse::Bind => {
                // The broker binds outside the executor's Landlock domain (with its identity:
                // see `as_executor`): the socket file is made only where Landlock would let
                // the executor make it, and refused elsewhere as Landlock refuses it (EACCES).
                // Landlock judges the directory the socket is made in.
                if !absolute
                    .parent()
                    .is_some_and(|dir| within_any(dir, &self.ctx.bind_roots))
                {
                    return Err(Outcome::Errno(libc::EACCES));
                }
                let (Some(parent), Some(name)) = (absolute.parent(), absolute.file_name()) else {
                    return Err(Outcome::Errno(libc::EINVAL));
                };
                let dir = open(parent)?;
                let mut path = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
                path.extend_from_slice(name.as_bytes());
                Ok(Target {
                    addr: unix_sockaddr(&path)?,
                    pin: Some(dir),
                })
            }
        }
    }
}

/// Whether `path` (absolute, without `.` or `..`) is one of `roots` or lies beneath one,
/// compared by whole components (`/tmpx` is not beneath `/tmp`). A root given relative, or with `.` or
/// `..` in it, names nothing in the executor's view and holds nothing.
fn within_any(path: &Path, roots: &[PathBuf]) -> bool {
    roots.iter().any(|root| {
        root.is_absolute()
            && !root
                .components()
                .any(|c| matches!(c, Component::CurDir | Component::ParentDir))
            && path.starts_with(root)
    })
}

/// `path` with `.` and `..` resolved lexically. Exact for the broker's lookups, which follow
/// no symlinks: every component is a real directory, so `..` is its parent (and `..` at the
/// root stays there, as under `RESOLVE_IN_ROOT`).
fn without_dots(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// What the broker will pass to the syscall, and any pinned descriptor the address names.
pub(super) struct Target {
    pub(super) addr: Vec<u8>,
    pub(super) pin: Option<OwnedFd>,
}

#[derive(Clone, Copy)]
enum UnixUse {
    Connect,
    Bind,
}

fn unix_sockaddr(path: &[u8]) -> Step<Vec<u8>> {
    if path.len() >= 108 {
        return Err(Outcome::Errno(libc::ENAMETOOLONG));
    }
    let mut v = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
    v.extend_from_slice(path);
    v.push(0);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_path_is_within_a_root_by_whole_components() {
        let roots = [PathBuf::from("/tmp"), PathBuf::from("/srv/out/")];
        assert!(within_any(Path::new("/tmp/a.sock"), &roots));
        assert!(within_any(Path::new("/srv/out/x/a.sock"), &roots));
        assert!(!within_any(Path::new("/tmpx/a.sock"), &roots));
        assert!(!within_any(Path::new("/srv/a.sock"), &roots));
        assert!(!within_any(Path::new("/run/a.sock"), &[]));
        // A root is itself a directory sockets may be made in.
        assert!(within_any(Path::new("/tmp"), &roots));
        for odd in ["tmp", "/srv/../tmp"] {
            assert!(
                !within_any(Path::new("/tmp/a.sock"), &[PathBuf::from(odd)]),
                "{odd}"
            );
        }
    }

    #[test]
    fn unix_addresses_fit_sun_path() {
        assert!(unix_sockaddr("x".repeat(107).as_bytes()).is_ok());
        assert!(matches!(
            unix_sockaddr("x".repeat(108).as_bytes()),
            Err(Outcome::Errno(libc::ENAMETOOLONG))
        ));
    }

    #[test]
    fn dots_resolve_lexically() {
        for (path, want) in [
            ("/run/app/../docker.sock", "/run/docker.sock"),
            ("/run/app/./x/../s.sock", "/run/app/s.sock"),
            ("/../../etc/x", "/etc/x"),
            ("/run/app/s.sock", "/run/app/s.sock"),
        ] {
            assert_eq!(without_dots(Path::new(path)), Path::new(want), "{path}");
        }
    }
}
