//! Reading and writing the small files the host trusts (manifests, keys, the retained set).
//!
//! Reads never follow a symbolic link in the final path component (`O_NOFOLLOW`), never
//! block on a FIFO or device, accept only regular files, and stop at a size limit before
//! allocating past it. Writes never leave a half-written file behind: the bytes go to a
//! temporary file in the same directory, are flushed to disk, and only then take the final
//! name; the directory is flushed afterwards so the new name survives a crash.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Largest manifest or envelope file accepted: 1 MiB.
pub const MAX_MANIFEST_FILE_BYTES: u64 = 1024 * 1024;

/// Why a trusted file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be opened (missing, no permission, ...).
    #[error("{}: cannot open", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The final path component is a symbolic link, which is refused.
    #[error(
        "{}: is a symbolic link; flowhost does not follow links for files it trusts, name the target file instead",
        path.display()
    )]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// The path names a directory, FIFO, device or socket.
    #[error("{}: is not a regular file", path.display())]
    NotRegular {
        /// The path.
        path: PathBuf,
    },
    /// The file is larger than the limit for its kind.
    #[error("{}: is {size} bytes; the limit is {limit} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (or the bytes read before stopping).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The file is not UTF-8 text.
    #[error("{}: is not UTF-8 text (invalid byte at offset {offset})", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Offset of the first byte that is not valid UTF-8.
        offset: usize,
    },
    /// Reading failed part way.
    #[error("{}: cannot read", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The destination of an exclusive write already exists.
    #[error("{}: already exists; flowhost refuses to overwrite it", path.display())]
    AlreadyExists {
        /// The existing file.
        path: PathBuf,
    },
    /// Writing, flushing or renaming failed; the destination was not changed.
    #[error("{}: cannot write", path.display())]
    Write {
        /// The destination.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The file is in place, but its directory entry could not be made durable: a crash may
    /// still lose it.
    #[error(
        "{}: written, but its directory could not be synced, so a crash may lose it",
        path.display()
    )]
    NotDurable {
        /// The file written.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// A new file was written, but its directory could not be synced, so it was taken away
    /// again: nothing is there.
    #[error(
        "{}: not written: its directory could not be synced (a crash could have lost the \
         file), so the file was taken away again",
        path.display()
    )]
    NotDurableTakenAway {
        /// The file that was written and removed.
        path: PathBuf,
        /// What the OS said of the sync.
        source: io::Error,
    },
}

/// How someone other than root or this process's user could change a file (or directory)
/// flowhost trusts, and so decide what flowhost trusts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OthersMayChange {
    /// Its group or others may write it.
    #[error("has mode {mode:04o}, so group or others may write it (chmod go-w)")]
    Mode {
        /// Its permission bits.
        mode: u32,
    },
    /// It is owned by neither root nor this process's user, and an owner may always change
    /// a file's mode, and then its content.
    #[error(
        "is owned by uid {owner}, neither root nor this process's uid {uid}, so its owner may \
         change it (chown it to root or to uid {uid}, or run this as uid {owner} if that is the \
         host's own user)"
    )]
    Owner {
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        uid: u32,
    },
}

/// Whether anyone but root or `uid` (this process's effective user) may change a file with
/// permission bits `mode` owned by `owner`: `None` when only they may. The mode is judged
/// first.
pub fn others_may_change(mode: u32, owner: u32, uid: u32) -> Option<OthersMayChange> {
    if mode & 0o022 != 0 {
        return Some(OthersMayChange::Mode {
            mode: mode & 0o7777,
        });
    }
    (owner != 0 && owner != uid).then_some(OthersMayChange::Owner { owner, uid })
}

/// [`others_may_change`] for the file `metadata` describes (take it from the opened file, so
/// the file judged is the file read) and this process's effective user.
pub fn others_may_change_file(metadata: &Metadata) -> Option<OthersMayChange> {
    others_may_change(
        metadata.mode(),
        metadata.uid(),
        nix::unistd::geteuid().as_raw(),
    )
}

/// Whether this process could create a file at `path` (as a temporary file renamed into
/// place): no directory is there, and its directory exists and this user may write it, on
/// a mount that is not read-only. The error says which, naming the directory. Checked before the work whose
/// result goes there, so that work is not done for nothing.
pub fn can_create_at(path: &Path) -> io::Result<()> {
    // A directory there cannot be renamed over, nor can a name that must be one (a trailing
    // `/`, `.` or `..`), whether or not it exists yet; anything else there is replaced whole.
    use std::os::unix::ffi::OsStrExt;
    let raw = path.as_os_str().as_bytes();
    if raw.ends_with(b"/")
        || raw.ends_with(b"/.")
        || raw.ends_with(b"/..")
        || path.file_name().is_none()
    {
        return Err(io::Error::new(
            io::ErrorKind::IsADirectory,
            format!(
                "{} names a directory (it ends in `/`, `.` or `..`), not a file",
                path.display()
            ),
        ));
    }
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(io::Error::new(
            io::ErrorKind::IsADirectory,
            format!("{} is a directory, not a file", path.display()),
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    use nix::unistd::AccessFlags;
    nix::unistd::access(dir, AccessFlags::W_OK | AccessFlags::X_OK).map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!(
                "its directory {} {}",
                dir.display(),
                match e {
                    nix::errno::Errno::ENOENT => "does not exist".to_string(),
                    nix::errno::Errno::EROFS => "is on a read-only mount".to_string(),
                    e => format!("cannot be written by this user ({e})"),
                }
            ),
        )
    })
}

/// Why a file that decides what flowhost trusts (a key set, a certificate, a private key)
/// was not read.
#[derive(Debug, thiserror::Error)]
pub enum TrustedFileError {
    /// It could not be opened or read, or is no regular file (a symbolic link, a FIFO).
    #[error(transparent)]
    File(#[from] FileError),
    /// Someone other than root or this process's user could change it, and so decide what
    /// flowhost trusts.
    #[error("{path} {why}")]
    Exposed {
        /// The file.
        path: PathBuf,
        /// How.
        why: OthersMayChange,
    },
    /// A secret that others, or the group this process runs as, may read.
    #[error(
        "{path} has mode {mode:04o}, so others or this process's own group may read the secret \
         it holds (chmod 0600 it, or give it a group of its own that no socket client is in, \
         never the clients' group)"
    )]
    Readable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
}

/// Reads at most `limit` bytes of a file flowhost trusts: a regular file (no symbolic link
/// followed) that no one but root or this process's user may change, and, when `secret`,
/// that others may not read, nor the group this process runs as (unless root's); another
/// group may (a TLS key is often shared with a group such as Debian's `ssl-cert`), which
/// must then hold no client of the daemon's socket: that cannot be told here. The file
/// judged is the file read.
pub fn read_trusted(path: &Path, limit: u64, secret: bool) -> Result<Vec<u8>, TrustedFileError> {
    let (file, metadata) = open_regular(path)?;
    if let Some(why) = others_may_change_file(&metadata) {
        return Err(TrustedFileError::Exposed {
            path: path.to_owned(),
            why,
        });
    }
    let mode = metadata.mode() & 0o7777;
    let own_group = metadata.gid() != 0 && metadata.gid() == nix::unistd::getegid().as_raw();
    if secret && (mode & 0o007 != 0 || own_group && mode & 0o040 != 0) {
        return Err(TrustedFileError::Readable {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(read_opened(path, file, &metadata, limit)?)
}

/// Where `path` leads through any symbolic links, when no one but root or this process's
/// user could change where it leads: every directory above the link and above the file it
/// leads to must be one only they may change (a sticky one, such as `/tmp`, may be written
/// by others, who cannot replace an entry they do not own). Whoever could write one of them
/// could otherwise point the name at a file of their choosing that passes the file's own
/// checks (another service's key they can read).
pub fn trusted_target(path: &Path) -> Result<PathBuf, TrustedFileError> {
    let io = |source| FileError::Open {
        path: path.to_owned(),
        source,
    };
    let (dirs, target) = looked_up_in(path).map_err(io)?;
    for dir in &dirs {
        let meta = std::fs::metadata(dir).map_err(|source| FileError::Open {
            path: dir.to_owned(),
            source,
        })?;
        if meta.mode() & 0o1000 != 0 && meta.uid() == 0 {
            continue;
        }
        if let Some(why) = others_may_change_file(&meta) {
            return Err(TrustedFileError::Exposed {
                path: dir.to_owned(),
                why,
            });
        }
    }
    Ok(target)
}

/// Checks that no one but root, this process's user, and the groups of some directories
/// above it could change where the directory `path` leads, or rename it away and put
/// another in its place: every directory its lookup passes (see [`looked_up_in`]) or, while
/// it does not exist, its nearest existing ancestor's lookup and that ancestor, which it
/// would be made in. Root's sticky directories (`/tmp`) pass: no one else can rename an
/// entry they do not own there. One others may write, or owned by another user, is refused.
/// One only its group may write besides its owner (root or this user), as Ubuntu's
/// `/var/log` (root:syslog 0775) or a directory made under umask 002, is returned, for the
/// caller to warn of: refusing it would refuse common layouts, and only its group's members
/// could replace what is below it. The directory's own mode and owner are left to the
/// caller. Run it again once the directory is made: a parent made meanwhile by someone
/// else, or a `..` in `path`, is only seen then.
pub fn trusted_place_for_dir(
    path: &Path,
) -> Result<Vec<(PathBuf, OthersMayChange)>, TrustedFileError> {
    let mut existing = path;
    while std::fs::symlink_metadata(existing).is_err() {
        match existing.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => existing = parent,
            _ => {
                existing = Path::new(".");
                break;
            }
        }
    }
    let (mut dirs, target) = looked_up_in(existing).map_err(|source| FileError::Open {
        path: existing.to_owned(),
        source,
    })?;
    if existing != path {
        dirs.insert(target);
    }
    let euid = nix::unistd::geteuid().as_raw();
    let mut group_writable = Vec::new();
    for dir in dirs {
        let meta = std::fs::metadata(&dir).map_err(|source| FileError::Open {
            path: dir.clone(),
            source,
        })?;
        if meta.mode() & 0o1000 != 0 && meta.uid() == 0 {
            continue;
        }
        match others_may_change_file(&meta) {
            None => {}
            Some(why @ OthersMayChange::Mode { mode })
                if mode & 0o002 == 0 && (meta.uid() == 0 || meta.uid() == euid) =>
            {
                group_writable.push((dir, why));
            }
            Some(why) => return Err(TrustedFileError::Exposed { path: dir, why }),
        }
    }
    Ok(group_writable)
}

/// Most symbolic links followed in one lookup, as the kernel allows.
const MOST_LINKS: usize = 40;

/// Every directory a lookup of `path` looks an entry up in, following its symbolic links
/// one at a time as the kernel does (each link is an entry of the directory it is in, and
/// what it names is looked up from there, through further links), and the file it leads
/// to. A relative path starts from the working directory, whose own directories count.
fn looked_up_in(path: &Path) -> io::Result<(std::collections::BTreeSet<PathBuf>, PathBuf)> {
    use std::collections::VecDeque;
    use std::path::Component;
    let mut dirs = std::collections::BTreeSet::new();
    let mut current = if path.is_absolute() {
        PathBuf::from("/")
    } else {
        let here = std::fs::canonicalize(".")?;
        dirs.extend(here.ancestors().map(Path::to_path_buf));
        here
    };
    let mut pending: VecDeque<std::ffi::OsString> = VecDeque::new();
    let push_back = |pending: &mut VecDeque<std::ffi::OsString>, p: &Path| {
        for c in p.components() {
            match c {
                Component::Normal(name) => pending.push_back(name.to_owned()),
                Component::ParentDir => pending.push_back("..".into()),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    };
    push_back(&mut pending, path);
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        if name == ".." {
            current.pop();
            continue;
        }
        dirs.insert(current.clone());
        let next = current.join(&name);
        let entry = std::fs::symlink_metadata(&next)?;
        if entry.file_type().is_symlink() {
            // In a directory others may write (a sticky one, such as /tmp, is not judged
            // itself), a link is followed only if root or this process's user made it, as
            // the kernel's protected_symlinks rule would have it: its owner could point it
            // elsewhere whenever they like.
            let me = nix::unistd::geteuid().as_raw();
            let writable_by_others = std::fs::metadata(&current)
                .map(|d| d.mode() & 0o022 != 0)
                .unwrap_or(true);
            if writable_by_others && entry.uid() != 0 && entry.uid() != me {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{} is a link uid {} made in a directory others may write",
                        next.display(),
                        entry.uid()
                    ),
                ));
            }
            links += 1;
            if links > MOST_LINKS {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            let to = std::fs::read_link(&next)?;
            if to.is_absolute() {
                current = PathBuf::from("/");
            }
            let mut rest = VecDeque::new();
            push_back(&mut rest, &to);
            rest.extend(pending);
            pending = rest;
        } else {
            current = next;
        }
    }
    Ok((dirs, current))
}

/// Opens `path` for reading without following a final symbolic link, and checks that it is a
/// regular file. The metadata is that of the opened file, so it cannot change underneath.
pub fn open_regular(path: &Path) -> Result<(File, Metadata), FileError> {
    let file = OpenOptions::new()
        .read(true)
        // O_NONBLOCK keeps a FIFO planted at the path from hanging the host; it has no
        // effect on reads from a regular file.
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| {
            if source.raw_os_error() == Some(libc::ELOOP) {
                FileError::Symlink {
                    path: path.to_owned(),
                }
            } else {
                FileError::Open {
                    path: path.to_owned(),
                    source,
                }
            }
        })?;
    let metadata = file.metadata().map_err(|source| FileError::Read {
        path: path.to_owned(),
        source,
    })?;
    if !metadata.file_type().is_file() {
        return Err(FileError::NotRegular {
            path: path.to_owned(),
        });
    }
    Ok((file, metadata))
}

/// Reads at most `limit` bytes from an already opened regular file.
pub fn read_opened(
    path: &Path,
    file: File,
    metadata: &Metadata,
    limit: u64,
) -> Result<Vec<u8>, FileError> {
    if metadata.len() > limit {
        return Err(FileError::TooLarge {
            path: path.to_owned(),
            size: metadata.len(),
            limit,
        });
    }
    let mut bytes = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
    // Read one byte past the limit so a file that grew after fstat is still caught.
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| FileError::Read {
            path: path.to_owned(),
            source,
        })?;
    let read = bytes.len() as u64;
    if read > limit {
        return Err(FileError::TooLarge {
            path: path.to_owned(),
            size: read,
            limit,
        });
    }
    Ok(bytes)
}

/// Reads a regular file of at most `limit` bytes as UTF-8 text (see the module docs).
pub fn read_text(path: &Path, limit: u64) -> Result<String, FileError> {
    let (file, metadata) = open_regular(path)?;
    let bytes = read_opened(path, file, &metadata, limit)?;
    String::from_utf8(bytes).map_err(|e| FileError::NotUtf8 {
        path: path.to_owned(),
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Replaces (or creates) `path` with `bytes` atomically, with permission bits `mode`.
///
/// Readers see either the old content or the new content, never a mix; after a crash the
/// file holds one or the other.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FileError> {
    let temp = write_temp(path, bytes, mode)?;
    temp.persist(path).map_err(|e| FileError::Write {
        path: path.to_owned(),
        source: e.error,
    })?;
    sync_parent(path)
}

/// Like [`write_atomic`], with the content streamed by `fill` (for outputs too large to hold
/// in memory). An error from `fill` leaves `path` untouched.
pub fn write_atomic_with(
    path: &Path,
    mode: u32,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), FileError> {
    let temp = write_temp_with(path, mode, fill)?;
    temp.persist(path).map_err(|e| FileError::Write {
        path: path.to_owned(),
        source: e.error,
    })?;
    sync_parent(path)
}

/// Makes the entries of `dir` (created, renamed or removed files) durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(test)]
    if FAIL_DIR_SYNCS.with(std::cell::Cell::get) {
        return Err(io::Error::other("a directory sync this test made fail"));
    }
    File::open(dir)?.sync_all()?;
    #[cfg(test)]
    SYNCED_DIRS.with(|synced| synced.borrow_mut().push(dir.to_path_buf()));
    Ok(())
}

/// Whether `path` still names the open `file` (the same device and inode, the path looked at
/// without following a link): `false` once it was removed, renamed away or replaced. An
/// error only when `file` itself cannot be looked at, or `path` cannot for another reason
/// than being gone.
pub fn still_names(path: &Path, file: &File) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let held = file.metadata()?;
    match std::fs::symlink_metadata(path) {
        Ok(named) => Ok((named.dev(), named.ino()) == (held.dev(), held.ino())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Why a directory could not be made durably.
#[derive(Debug, thiserror::Error)]
#[error("cannot {op} {}", path.display())]
pub struct DirError {
    /// What was being done.
    pub op: &'static str,
    /// The directory.
    pub path: PathBuf,
    /// What the OS said.
    #[source]
    pub source: io::Error,
}

/// Creates `dir` and whichever of its ancestors are missing (permission bits `mode`, less the
/// umask), and syncs each one it created into its parent before returning: files made durable
/// in a directory whose own entry a power loss then takes are lost with it. A directory that
/// already exists is left as it is.
pub fn create_dir_all_synced(dir: &Path, mode: u32) -> Result<(), DirError> {
    use std::os::unix::fs::DirBuilderExt;
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .collect();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .map_err(|source| DirError {
            op: "create the directory",
            path: dir.to_path_buf(),
            source,
        })?;
    for created in missing {
        let parent = parent_dir(created);
        sync_dir(parent).map_err(|source| DirError {
            op: "fsync the directory",
            path: parent.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// The directories [`sync_dir`] synced on this thread, for tests to look at (a sync
    /// leaves nothing else to see).
    pub(crate) static SYNCED_DIRS: std::cell::RefCell<Vec<PathBuf>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// Set by a test: every [`sync_dir`] on this thread fails (a power-loss-prone disk
    /// cannot be had on demand).
    pub(crate) static FAIL_DIR_SYNCS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Creates `path` with `bytes` and permission bits `mode`, refusing to replace anything
/// already there. The file appears complete or not at all: one whose name could not be made
/// durable is taken away again, and the error says so.
pub fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FileError> {
    let temp = write_temp(path, bytes, mode)?;
    // persist_noclobber links the finished temporary file into place, which fails with
    // EEXIST instead of replacing an existing file (the O_EXCL guarantee, made atomic).
    temp.persist_noclobber(path).map_err(|e| {
        if e.error.kind() == io::ErrorKind::AlreadyExists {
            FileError::AlreadyExists {
                path: path.to_owned(),
            }
        } else {
            FileError::Write {
                path: path.to_owned(),
                source: e.error,
            }
        }
    })?;
    sync_parent(path).map_err(|e| match e {
        // Linked here without replacing anything, so the file is this call's own: left,
        // it would stand for a write that failed (a key pair's half, a retry refused as
        // already there).
        FileError::NotDurable { path, source } if std::fs::remove_file(&path).is_ok() => {
            FileError::NotDurableTakenAway { path, source }
        }
        other => other,
    })
}

/// The directory holding `path` (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

fn write_temp(path: &Path, bytes: &[u8], mode: u32) -> Result<tempfile::NamedTempFile, FileError> {
    write_temp_with(path, mode, |w| w.write_all(bytes))
}

fn write_temp_with(
    path: &Path,
    mode: u32,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<tempfile::NamedTempFile, FileError> {
    let write_error = |source| FileError::Write {
        path: path.to_owned(),
        source,
    };
    // The temporary file is created with O_EXCL and mode 0600 in the destination's own
    // directory, so the final rename or link never crosses a filesystem, and concurrent
    // writers (threads included) never share a temporary name.
    let mut temp = tempfile::Builder::new()
        .prefix(".flowhost-tmp-")
        .tempfile_in(parent_dir(path))
        .map_err(write_error)?;
    {
        let mut out = io::BufWriter::new(temp.as_file_mut());
        fill(&mut out).map_err(write_error)?;
        out.flush().map_err(write_error)?;
    }
    temp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(write_error)?;
    temp.as_file().sync_all().map_err(write_error)?;
    Ok(temp)
}

fn sync_parent(path: &Path) -> Result<(), FileError> {
    sync_dir(parent_dir(path)).map_err(|source| FileError::NotDurable {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    /// A name that must be a directory is refused before it exists (a rename could never
    /// put a file there); a plain name in a writable directory passes.
    #[test]
    fn a_name_that_must_be_a_directory_is_no_place_for_a_file() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["out/", "out/.", "out/..", "."] {
            let e = can_create_at(&dir.path().join(name)).unwrap_err();
            assert!(e.to_string().contains("names a directory"), "{name}: {e}");
        }
        assert!(can_create_at(Path::new("..")).is_err());
        assert!(can_create_at(&dir.path().join("health.json")).is_ok());
        assert!(can_create_at(&dir.path().join("./health.json")).is_ok());
        let e = can_create_at(&dir.path().join("missing/health.json")).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
    }

    use super::*;

    /// A link in the middle of a path is an entry of the directory above it: one others may
    /// change could point it at another directory of trusted files (an older key set). That
    /// directory is judged, as the path's own are. Before, only where the link led was.
    #[test]
    fn a_directory_holding_a_link_in_the_middle_of_the_path_is_judged() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let keys = root.path().join("srv-keys");
        std::fs::create_dir(&keys).unwrap();
        std::fs::write(keys.join("jwks.json"), "{}").unwrap();
        let etc = root.path().join("etc");
        std::fs::create_dir(&etc).unwrap();
        std::os::unix::fs::symlink(&keys, etc.join("keys")).unwrap();
        let named = etc.join("keys/jwks.json");
        assert_eq!(
            trusted_target(&named).unwrap(),
            std::fs::canonicalize(keys.join("jwks.json")).unwrap()
        );
        std::fs::set_permissions(&etc, std::fs::Permissions::from_mode(0o777)).unwrap();
        match trusted_target(&named) {
            Err(TrustedFileError::Exposed { path, .. }) => {
                assert_eq!(path, std::fs::canonicalize(&etc).unwrap())
            }
            other => panic!("{other:?}"),
        }
        // A chain of links: the directory holding the second one is looked up in too.
        // Before, only where the whole chain ended was judged.
        std::fs::set_permissions(&etc, std::fs::Permissions::from_mode(0o755)).unwrap();
        let links = root.path().join("links");
        std::fs::create_dir(&links).unwrap();
        std::os::unix::fs::symlink(&keys, links.join("k")).unwrap();
        std::fs::remove_file(etc.join("keys")).unwrap();
        std::os::unix::fs::symlink("../links/k", etc.join("keys")).unwrap();
        assert_eq!(
            trusted_target(&named).unwrap(),
            std::fs::canonicalize(keys.join("jwks.json")).unwrap()
        );
        std::fs::set_permissions(&links, std::fs::Permissions::from_mode(0o777)).unwrap();
        match trusted_target(&named) {
            Err(TrustedFileError::Exposed { path, .. }) => {
                assert_eq!(path, std::fs::canonicalize(&links).unwrap())
            }
            other => panic!("{other:?}"),
        }
        // In a sticky directory others may write (like /tmp), a link another user made is
        // not followed: its owner could point it anywhere. Before, the sticky directory
        // was passed, and the link with it.
        if nix::unistd::geteuid().is_root() {
            let shared = root.path().join("shared");
            std::fs::create_dir(&shared).unwrap();
            std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
            let theirs = shared.join("keys");
            std::os::unix::fs::symlink(&keys, &theirs).unwrap();
            std::os::unix::fs::lchown(&theirs, Some(65534), Some(65534)).unwrap();
            let e = trusted_target(&theirs.join("jwks.json")).unwrap_err();
            let e = format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            );
            assert!(e.contains("a link uid 65534 made"), "{e}");
            std::os::unix::fs::lchown(&theirs, Some(0), Some(0)).unwrap();
            trusted_target(&theirs.join("jwks.json")).unwrap();
        }
    }

    #[test]
    fn streamed_write_replaces_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        write_atomic_with(&path, 0o640, |w| w.write_all(b"first")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        let err = write_atomic_with(&path, 0o640, |w| {
            w.write_all(b"half of the second")?;
            Err(io::Error::other("the producer failed"))
        })
        .unwrap_err();
        assert!(matches!(err, FileError::Write { .. }));
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"first",
            "the old content survives"
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file is left behind");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o640
        );
    }

    #[test]
    fn reads_a_small_utf8_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(read_text(&path, 10).unwrap(), "{}");
    }

    #[test]
    fn refuses_a_symlink_a_directory_a_fifo_and_oversize() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target.json");
        std::fs::write(&target, "{}").unwrap();
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(
            read_text(&link, 10),
            Err(FileError::Symlink { .. })
        ));
        assert!(matches!(
            read_text(dir.path(), 10),
            Err(FileError::NotRegular { .. })
        ));
        let fifo = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        assert!(matches!(
            read_text(&fifo, 10),
            Err(FileError::NotRegular { .. })
        ));
        assert!(matches!(
            read_text(&target, 1),
            Err(FileError::TooLarge {
                size: 2,
                limit: 1,
                ..
            })
        ));
    }

    #[test]
    fn refuses_non_utf8() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.json");
        std::fs::write(&path, b"{\"a\":\"\xff\"}").unwrap();
        assert!(matches!(
            read_text(&path, 100),
            Err(FileError::NotUtf8 { offset: 6, .. })
        ));
    }

    #[test]
    fn atomic_write_replaces_and_sets_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        write_atomic(&path, b"one", 0o644).unwrap();
        write_atomic(&path, b"two", 0o640).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        // No temporary files are left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn exclusive_write_refuses_to_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        write_new(&path, b"first", 0o600).unwrap();
        assert!(matches!(
            write_new(&path, b"second", 0o600),
            Err(FileError::AlreadyExists { .. })
        ));
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
