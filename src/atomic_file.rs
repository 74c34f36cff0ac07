//! Whole-file replacement that never leaves a half-written file behind.
//!
//! Readers of a path written here see either the previous content or the new content, never
//! a mix, and after [`write_atomic`] returns the new content survives a crash: the bytes go to
//! a temporary file in the same directory, which is fsynced, renamed over the target, and the
//! directory is fsynced so the rename itself is durable.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Why a file could not be replaced.
#[derive(Debug, thiserror::Error)]
#[error("cannot {op} {path}: {source}")]
pub struct AtomicWriteError {
    /// What was being done when it failed (e.g. "write", "rename into place").
    pub op: &'static str,
    /// The file the operation was on.
    pub path: PathBuf,
    /// The operating system's error.
    #[source]
    pub source: io::Error,
}

/// Replaces `path` with `bytes` atomically and durably (see the module docs).
///
/// The temporary file is `<name>.tmp-<pid>` next to `path`; on failure it is removed on a
/// best-effort basis and `path` keeps its previous content.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), AtomicWriteError> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// Like [`write_atomic`], with the content streamed by `fill` (for outputs too large to hold
/// in memory). An error from `fill` leaves `path` untouched.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), AtomicWriteError> {
    let err = |op, p: &Path| {
        let p = p.to_path_buf();
        move |source| AtomicWriteError {
            op,
            path: p,
            source,
        }
    };
    let dir = parent_dir(path);
    let name = path.file_name().ok_or_else(|| AtomicWriteError {
        op: "name",
        path: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"),
    })?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = (|| {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(err("create", &tmp))?;
        let mut out = io::BufWriter::new(file);
        fill(&mut out).map_err(err("write", &tmp))?;
        let file = out
            .into_inner()
            .map_err(|e| err("write", &tmp)(e.into_error()))?;
        file.sync_all().map_err(err("fsync", &tmp))?;
        drop(file);
        fs::rename(&tmp, path).map_err(err("rename into place", path))?;
        sync_dir(&dir).map_err(err("fsync directory", &dir))
    })();
    if result.is_err() {
        // Best effort: the temporary file is garbage either way, and the original error is
        // the one the operator needs.
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Makes the entries of `dir` (created, renamed or removed files) durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The directory holding `path` (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
    }

    #[test]
    fn failure_names_the_path_and_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("x.json");
        let e = write_atomic(&path, b"x").unwrap_err();
        assert!(e.to_string().contains("missing-dir"), "{e}");
    }
}
