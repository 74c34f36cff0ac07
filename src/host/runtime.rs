//! Whether a server's command can start as an executor, checked before any executor is
//! spawned: each refusal names the path and the real cause (the executor's private /tmp,
//! file permissions for the executor's uid, the Landlock rules of its profile, the missing
//! interpreter of a script), where the kernel would only say ENOENT or EACCES at exec.
//! And, for the daemon, who could change that code: a program, an interpreter or a venv
//! that someone other than root or the daemon's user could change would let them choose
//! the code that runs with every principal's arguments ([`check_unchangeable`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Why an executor of a server could not start its program.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeProblem {
    /// The path is under /tmp, which executors see as a private, empty tmpfs.
    #[error(
        "{path} is under /tmp, which executors see as a private empty tmpfs of their own: install the runtime elsewhere (e.g. /opt, readable by executor uids)"
    )]
    PrivateTmp {
        /// The path as configured or resolved.
        path: PathBuf,
    },
    /// Nothing exists at the path.
    #[error("{path} does not exist")]
    Missing {
        /// The path.
        path: PathBuf,
    },
    /// A directory on the way cannot be searched by the executor's uid.
    #[error(
        "directory {dir} (mode {mode:o}, owner uid {owner}) cannot be searched by the executor uid {uid}, so the executor cannot reach {path}; make it searchable (chmod o+x) or install the runtime under a directory executors can read, such as /opt (not /root, whose mode is usually 0700)"
    )]
    NotSearchable {
        /// The directory.
        dir: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Its owner.
        owner: u32,
        /// The executor uid.
        uid: u32,
        /// The file beneath it (and where it resolves to, when that differs).
        path: String,
    },
    /// The file cannot be read and executed by the executor's uid.
    #[error("{path} (mode {mode:o}, owner uid {owner}) cannot be {need} by the executor uid {uid}")]
    NotExecutable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Its owner.
        owner: u32,
        /// The executor uid.
        uid: u32,
        /// What is needed (`executed`, `read and executed`).
        need: &'static str,
    },
    /// A script's `#!` line names an interpreter that cannot run.
    #[error("{script} is a script whose interpreter {interpreter} cannot run: {why}")]
    Interpreter {
        /// The script.
        script: PathBuf,
        /// The interpreter its first line names.
        interpreter: String,
        /// Why it cannot run.
        why: Box<RuntimeProblem>,
    },
    /// A program or interpreter of a Python venv the executor may not read.
    #[error(
        "{program} belongs to the Python venv {venv}, whose packages the executor may not read (Landlock); add {venv} to the server's read_paths"
    )]
    VenvOutsideLandlock {
        /// The program or interpreter (as the command or a `#!` line names it).
        program: PathBuf,
        /// The venv.
        venv: PathBuf,
    },
    /// Someone other than root or the daemon's user could change the file or a directory on
    /// its way, and so the code executors run.
    #[error(
        "{path} {why}: whoever may change it chooses the code every executor of the server runs, with every principal's arguments (make it, and the directories above it, root's or this host user's and not writable by group or others)"
    )]
    Changeable {
        /// The file or directory.
        path: PathBuf,
        /// How.
        why: String,
    },
    /// A script's `#!` line has `env` search a `PATH` with an entry that is no absolute
    /// directory before it finds its interpreter.
    #[error(
        "{script} has env look for its interpreter in PATH {path_var}, whose entry {entry:?} (before the interpreter is found) is no absolute directory: give the executor's PATH (the server's env) absolute directories only"
    )]
    RelativeSearchPath {
        /// The script.
        script: PathBuf,
        /// The PATH env searches.
        path_var: String,
        /// The entry.
        entry: String,
    },
    /// A script's `#!` line ends in a carriage return, which the kernel takes as part of
    /// the interpreter's name.
    #[error(
        "{script} has a #! line ending in a carriage return (CRLF line endings), so the kernel looks for an interpreter named with it; convert the script to LF line endings"
    )]
    CrlfInterpreterLine {
        /// The script.
        script: PathBuf,
    },
    /// The file is outside every path the profile's Landlock rules let the executor read.
    #[error(
        "{path} is outside the paths the executor may read and execute (Landlock: profile read_only and the server's read_paths: {allowed}); add a directory holding it to the server's read_paths"
    )]
    OutsideLandlock {
        /// The resolved file.
        path: PathBuf,
        /// The allowed paths, listed.
        allowed: String,
    },
}

/// Longest `#!` chain followed (a script run by a script ...).
const MAX_SCRIPT_DEPTH: usize = 4;

/// Checks that `program` can be executed by `(uid, gid)` with Landlock allowing reads and
/// execution beneath `readable` (the program itself is allowed by the host in any case);
/// `path_var` is the executor's `PATH`, where `#!/usr/bin/env NAME` finds NAME.
pub fn check_program(
    program: &Path,
    (uid, gid): (u32, u32),
    readable: &[PathBuf],
    path_var: &str,
) -> Result<(), RuntimeProblem> {
    check_at(program, (uid, gid), readable, path_var, true, 0)
}

/// Checks that no one but root and this process's user could change `program`, the
/// interpreters its `#!` lines lead to (`env NAME` looked up on `path_var`), the directories
/// on their way (links followed as the kernel does), or the venv a Python interpreter
/// reads its packages from (its `lib/python*/site-packages` directories, where one `.pth`
/// file runs at every start). Whoever could would choose the code every executor of the
/// server runs. Run after [`check_program`], which names what is missing.
pub fn check_unchangeable(program: &Path, path_var: &str) -> Result<(), RuntimeProblem> {
    unchangeable_at(program, path_var, 0)
}

/// [`check_unchangeable`] for the script an interpreter is given: the first argument of a
/// server's command that names a host file (an absolute path to a regular file), as in
/// `node /srv/app/index.js` or `python3 /srv/app/server.py`, is the executor's code as much
/// as the program is. Later ones are taken for data (a database another service owns may
/// be named there), and directories and paths not there are left alone.
pub fn check_arguments_unchangeable(args: &[String]) -> Result<(), RuntimeProblem> {
    let script = (args.iter())
        .filter(|a| a.starts_with('/'))
        .find(|a| std::fs::metadata(a).is_ok_and(|m| m.is_file()));
    if let Some(script) = script {
        unchangeable(Path::new(script))?;
    }
    Ok(())
}

fn unchangeable_at(program: &Path, path_var: &str, depth: usize) -> Result<(), RuntimeProblem> {
    let target = unchangeable(program)?;
    let venv = venv_code(program);
    for path in &venv {
        unchangeable(path)?;
    }
    // Read only once the site directories holding them are known to be unchangeable: a
    // `.pth` placed by someone who could write there (a FIFO, /dev/zero behind a link)
    // would otherwise be read before the refusal.
    for path in pth_code(&venv)? {
        unchangeable(&path)?;
    }
    let head = read_head(&target);
    if !head.starts_with(b"#!") {
        return Ok(());
    }
    // Each `env` hop is an exec of its own: a chain has no length the kernel bounds, and
    // what lies past the last one looked at would go unchecked.
    if depth >= MAX_SCRIPT_DEPTH {
        return Err(RuntimeProblem::Changeable {
            path: program.to_path_buf(),
            why: format!(
                "leads through more than {MAX_SCRIPT_DEPTH} #! interpreters, past which nothing is looked at"
            ),
        });
    }
    let found = interpreters(program, &head, path_var)?;
    // `env` tries the PATH's directories in order: one before where NAME is found now is
    // where a file put later would be run instead.
    for dir in &found.searched {
        unchanging_place(dir)?;
    }
    for interpreter in &found.run {
        unchangeable_at(interpreter, path_var, depth + 1)?;
    }
    Ok(())
}

/// Checks that no one but root and this process's user could put a file in the directory
/// `dir`, there or not yet (then the directory it would be made in, where anyone who may
/// write could make it, sticky or not: a sticky `/var/tmp` keeps others from renaming what
/// is there, not from creating what is not).
fn unchanging_place(dir: &Path) -> Result<(), RuntimeProblem> {
    if dir.exists() {
        return unchangeable(dir).map(drop);
    }
    let changeable = |path: PathBuf, why: String| RuntimeProblem::Changeable { path, why };
    if let Some(nearest) = dir.ancestors().skip(1).find(|a| a.exists())
        && let Ok(meta) = std::fs::metadata(nearest)
        && meta.mode() & 0o002 != 0
    {
        return Err(changeable(
            nearest.to_path_buf(),
            format!(
                "has mode {:04o}, so anyone may make {} in it",
                meta.mode() & 0o7777,
                dir.display()
            ),
        ));
    }
    match crate::files::trusted_place_for_dir(dir) {
        Ok(group_writable) => match group_writable.into_iter().next() {
            Some((path, why)) => Err(changeable(path, why.to_string())),
            None => Ok(()),
        },
        Err(crate::files::TrustedFileError::Exposed { path, why }) => {
            Err(changeable(path, why.to_string()))
        }
        Err(other) => Err(unsafe_lookup(dir, &other)),
    }
}

/// A path whose lookup could not be judged safe, with why.
fn unsafe_lookup(path: &Path, e: &crate::files::TrustedFileError) -> RuntimeProblem {
    RuntimeProblem::Changeable {
        path: path.to_path_buf(),
        why: format!(
            "cannot be looked up safely ({})",
            crate::causes::WithCauses(e)
        ),
    }
}

/// Where `path` leads, when no one but root and this process's user could change it or
/// where it leads.
fn unchangeable(path: &Path) -> Result<PathBuf, RuntimeProblem> {
    let changeable = |path: &Path, why: String| RuntimeProblem::Changeable {
        path: path.to_path_buf(),
        why,
    };
    let target = crate::files::trusted_target(path).map_err(|e| match e {
        crate::files::TrustedFileError::Exposed { path, why } => changeable(&path, why.to_string()),
        other => unsafe_lookup(path, &other),
    })?;
    let meta = std::fs::metadata(&target).map_err(|_| RuntimeProblem::Missing {
        path: target.clone(),
    })?;
    match crate::files::others_may_change_file(&meta) {
        Some(why) => Err(changeable(&target, why.to_string())),
        None => Ok(target),
    }
}

/// What a Python venv interpreter `program` (`VENV/bin/python`, next to
/// `VENV/pyvenv.cfg`) loads code from at start: the venv, `pyvenv.cfg`, its `lib`, each
/// `lib/python*` and its site directories, and the standard library of the interpreter
/// `pyvenv.cfg` names as `home` (a copied venv's own is not the one it loads); none for
/// another program. The `.pth` files in the site directories are [`pth_code`]'s.
fn venv_code(program: &Path) -> Vec<PathBuf> {
    let Some(venv) = program.parent().and_then(Path::parent) else {
        return Vec::new();
    };
    let cfg = venv.join("pyvenv.cfg");
    if !cfg.is_file() {
        return Vec::new();
    }
    let mut code = vec![venv.to_path_buf(), cfg.clone()];
    let home = std::fs::read_to_string(&cfg).ok().and_then(|text| {
        text.lines().find_map(|l| {
            let (key, value) = l.split_once('=')?;
            (key.trim() == "home").then(|| PathBuf::from(value.trim()))
        })
    });
    let mut libs = vec![venv.join("lib")];
    if let Some(home) = home.filter(|h| h.is_absolute()) {
        code.push(home.clone());
        if let Some(prefix) = home.parent() {
            libs.push(prefix.join("lib"));
        }
    }
    for lib in libs.into_iter().filter(|l| l.is_dir()) {
        code.push(lib.clone());
        for entry in std::fs::read_dir(&lib).into_iter().flatten().flatten() {
            if !entry.file_name().to_string_lossy().starts_with("python") {
                continue;
            }
            code.push(entry.path());
            for site in ["site-packages", "dist-packages"].map(|s| entry.path().join(s)) {
                if site.is_dir() {
                    code.push(site);
                }
            }
        }
    }
    code
}

/// Largest `.pth` file read.
const MAX_PTH_BYTES: u64 = 64 * 1024;

/// The paths the `.pth` files of the site directories among `venv` (a venv's code as
/// [`venv_code`] lists it, each found unchangeable first) add to Python's path: each `.pth` is
/// found unchangeable (where a link leads included) before it is read, as a regular file
/// of at most [`MAX_PTH_BYTES`]; each line that names something that exists (a directory,
/// a zip or egg file; absolute, or relative to the site directory, as Python joins them)
/// adds it.
fn pth_code(venv: &[PathBuf]) -> Result<Vec<PathBuf>, RuntimeProblem> {
    let mut code = Vec::new();
    let sites = venv.iter().filter(|p| {
        p.file_name()
            .is_some_and(|n| n == "site-packages" || n == "dist-packages")
    });
    for site in sites {
        for entry in std::fs::read_dir(site).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "pth") {
                continue;
            }
            // Read where it leads, as Python does (a package manager may link it).
            let target = unchangeable(&path)?;
            let text = crate::files::read_text(&target, MAX_PTH_BYTES).map_err(|e| {
                RuntimeProblem::Changeable {
                    path: path.clone(),
                    why: format!(
                        "cannot be read as a .pth file ({})",
                        crate::causes::WithCauses(&e)
                    ),
                }
            })?;
            for line in text.lines().map(str::trim_end) {
                if line.is_empty()
                    || line.starts_with('#')
                    || line.starts_with("import ")
                    || line.starts_with("import\t")
                {
                    continue;
                }
                // Python adds whatever exists: a directory, or a zip or egg file.
                let added = site.join(line);
                if added.exists() {
                    code.push(added);
                }
            }
        }
    }
    Ok(code)
}

/// What a script's `#!` line leads to.
struct Interpreters {
    /// The programs it runs: the interpreter it names, and for `env` the NAME it runs.
    run: Vec<PathBuf>,
    /// For `env`: the `PATH` directories looked in for NAME, in order, up to the one that
    /// holds it.
    searched: Vec<PathBuf>,
}

/// The interpreters a script's `#!` line (`head` its first bytes) runs it with: the one it
/// names, and for `/usr/bin/env NAME` also NAME as the executor's `path_var` finds it
/// (env's options and `VAR=value` words before NAME passed over). The kernel passes all
/// that follows the interpreter as one argument; only `env -S` splits it, on spaces and
/// tabs, as it is split here to find NAME.
fn interpreters(
    script: &Path,
    head: &[u8],
    path_var: &str,
) -> Result<Interpreters, RuntimeProblem> {
    let line = head[2..].split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    if line.ends_with('\r') {
        return Err(RuntimeProblem::CrlfInterpreterLine {
            script: script.to_path_buf(),
        });
    }
    let mut words = line.split([' ', '\t']).filter(|w| !w.is_empty());
    let interpreter = words.next().unwrap_or_default().to_string();
    let wrap = |why| RuntimeProblem::Interpreter {
        script: script.to_path_buf(),
        interpreter: interpreter.clone(),
        why: Box::new(why),
    };
    if !interpreter.starts_with('/') {
        return Err(wrap(RuntimeProblem::Missing {
            path: PathBuf::from(&interpreter),
        }));
    }
    let mut found = Interpreters {
        run: vec![PathBuf::from(&interpreter)],
        searched: Vec::new(),
    };
    if Path::new(&interpreter).file_name() != Some(std::ffi::OsStr::new("env")) {
        return Ok(found);
    }
    // env's own words: options (those taking a value take the next word), assignments. A
    // `PATH=` assignment, or `-i` or `-u PATH` (the C library's default path), is where env
    // then looks. `-S` and `--split-string=` may carry their text in the same word.
    let mut split = Vec::new();
    for word in words {
        match word
            .strip_prefix("--split-string=")
            .or_else(|| word.strip_prefix("-S").filter(|rest| !rest.is_empty()))
        {
            Some(rest) => split.push(rest),
            None => split.push(word),
        }
    }
    let mut words = split.into_iter();
    let mut name = None;
    let mut searched_path = path_var.to_string();
    while let Some(word) = words.next() {
        match word {
            "-u" | "--unset" => {
                if words.next() == Some("PATH") {
                    searched_path = "/bin:/usr/bin".into();
                }
            }
            "-uPATH" | "--unset=PATH" => searched_path = "/bin:/usr/bin".into(),
            "-C" | "--chdir" | "-P" => {
                words.next();
            }
            "-i" | "--ignore-environment" | "-" => searched_path = "/bin:/usr/bin".into(),
            w if w.starts_with('-') => {}
            w if w.contains('=') => {
                if let Some(path) = w.strip_prefix("PATH=") {
                    searched_path = path.to_string();
                }
            }
            w => {
                name = Some(w);
                break;
            }
        }
    }
    let path_var = searched_path.as_str();
    let Some(name) = name else {
        return Err(wrap(RuntimeProblem::Missing {
            path: PathBuf::from("(no program named after env's options)"),
        }));
    };
    if name.contains('/') {
        found.run.push(PathBuf::from(name));
        return Ok(found);
    }
    for entry in path_var.split(':') {
        // A relative or empty entry is looked in where env runs, and a `$` is no expansion
        // env makes: neither is a directory the check can look at, if env gets to it.
        if !entry.starts_with('/') || entry.contains('$') {
            return Err(RuntimeProblem::RelativeSearchPath {
                script: script.to_path_buf(),
                path_var: path_var.to_string(),
                entry: entry.to_string(),
            });
        }
        let dir = Path::new(entry);
        found.searched.push(dir.to_path_buf());
        if dir.join(name).is_file() {
            found.run.push(dir.join(name));
            return Ok(found);
        }
    }
    Err(wrap(RuntimeProblem::Missing {
        path: PathBuf::from(format!("{name} (on the executor's PATH {path_var})")),
    }))
}

fn check_at(
    program: &Path,
    id: (u32, u32),
    readable: &[PathBuf],
    path_var: &str,
    itself_allowed: bool,
    depth: usize,
) -> Result<(), RuntimeProblem> {
    let real = reach(program, id)?;
    check_venv(program, readable)?;
    let meta =
        std::fs::metadata(&real).map_err(|_| RuntimeProblem::Missing { path: real.clone() })?;
    let head = read_head(&real);
    let script = head.starts_with(b"#!");
    let (bits, need) = if script {
        (0o5, "read and executed")
    } else {
        (0o1, "executed")
    };
    if !meta.is_file() || !permits(&meta, id, bits) {
        return Err(RuntimeProblem::NotExecutable {
            path: real,
            mode: meta.mode() & 0o7777,
            owner: meta.uid(),
            uid: id.0,
            need,
        });
    }
    if !itself_allowed && !beneath_any(&real, readable) {
        return Err(outside(real, readable));
    }
    if script && depth < MAX_SCRIPT_DEPTH {
        for interpreter in interpreters(program, &head, path_var)?.run {
            check_at(&interpreter, id, readable, path_var, false, depth + 1).map_err(|why| {
                RuntimeProblem::Interpreter {
                    script: program.to_path_buf(),
                    interpreter: interpreter.display().to_string(),
                    why: Box::new(why),
                }
            })?;
        }
    }
    Ok(())
}

/// Where `path` leads, once the executor could reach it: not under /tmp (before or after
/// links), existing, and every directory on the way searchable by `id`.
fn reach(path: &Path, id: (u32, u32)) -> Result<PathBuf, RuntimeProblem> {
    if path.starts_with("/tmp") {
        return Err(RuntimeProblem::PrivateTmp {
            path: path.to_path_buf(),
        });
    }
    let real = std::fs::canonicalize(path).map_err(|_| RuntimeProblem::Missing {
        path: path.to_path_buf(),
    })?;
    if real.starts_with("/tmp") {
        return Err(RuntimeProblem::PrivateTmp { path: real });
    }
    let shown = if real == path {
        path.display().to_string()
    } else {
        format!("{} (which resolves to {})", path.display(), real.display())
    };
    for dir in real.ancestors().skip(1) {
        let meta = std::fs::metadata(dir).map_err(|_| RuntimeProblem::Missing {
            path: dir.to_path_buf(),
        })?;
        if !permits(&meta, id, 0o1) {
            return Err(RuntimeProblem::NotSearchable {
                dir: dir.to_path_buf(),
                mode: meta.mode() & 0o7777,
                owner: meta.uid(),
                uid: id.0,
                path: shown,
            });
        }
    }
    Ok(real)
}

/// A Python venv's interpreter (`VENV/bin/python`, next to `VENV/pyvenv.cfg`) reads the
/// venv's packages: the venv must be beneath the Landlock paths, or the interpreter starts
/// and fails on its first import.
fn check_venv(program: &Path, readable: &[PathBuf]) -> Result<(), RuntimeProblem> {
    let Some(venv) = program.parent().and_then(Path::parent) else {
        return Ok(());
    };
    if !venv.join("pyvenv.cfg").is_file() {
        return Ok(());
    }
    let real = std::fs::canonicalize(venv).unwrap_or_else(|_| venv.to_path_buf());
    if beneath_any(&real, readable) {
        return Ok(());
    }
    Err(RuntimeProblem::VenvOutsideLandlock {
        program: program.to_path_buf(),
        venv: venv.to_path_buf(),
    })
}

fn outside(path: PathBuf, readable: &[PathBuf]) -> RuntimeProblem {
    RuntimeProblem::OutsideLandlock {
        path,
        allowed: readable
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// Checks the arguments of a server's command that name existing files of the host (an
/// absolute path): the executor must reach and read them, so a host file under /tmp, behind a
/// directory the executor uid cannot search, or outside `readable` (the Landlock paths,
/// read-write ones included) is refused with its cause. Other arguments are the program's
/// business.
pub fn check_path_arguments(
    args: &[String],
    id: (u32, u32),
    readable: &[PathBuf],
) -> Result<(), RuntimeProblem> {
    for arg in args.iter().filter(|a| a.starts_with('/')) {
        let path = Path::new(arg);
        // A path that names nothing on the host may be one the program creates (under its
        // private /tmp, say).
        if std::fs::symlink_metadata(path).is_err() {
            continue;
        }
        let real = reach(path, id)?;
        if !beneath_any(&real, readable) {
            return Err(outside(real, readable));
        }
    }
    Ok(())
}

fn read_head(path: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut buf = vec![0u8; 256];
    match std::fs::File::open(path).and_then(|mut f| f.read(&mut buf)) {
        Ok(n) => {
            buf.truncate(n);
            buf
        }
        Err(_) => Vec::new(),
    }
}

/// Whether the permission `bits` (of r=4, w=2, x=1) are granted to `(uid, gid)` by the
/// class of the file's mode that applies to it (owner, group, or others).
fn permits(meta: &std::fs::Metadata, (uid, gid): (u32, u32), bits: u32) -> bool {
    let mode = meta.mode();
    let class = if meta.uid() == uid {
        mode >> 6
    } else if meta.gid() == gid {
        mode >> 3
    } else {
        mode
    };
    class & bits == bits
}

fn beneath_any(path: &Path, readable: &[PathBuf]) -> bool {
    readable.iter().any(|r| {
        let r = std::fs::canonicalize(r).unwrap_or_else(|_| r.clone());
        path.starts_with(&r)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PATH an executor gets by default.
    const P: &str = flowhost_broker::DEFAULT_EXECUTOR_PATH;

    /// An executable file at `path` holding `text`, mode `mode`.
    fn program_at(path: &Path, text: &str, mode: u32) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        file(path, text, mode);
    }

    /// What makes `program` changeable by others, as the refusal names it.
    fn changeable(program: &Path, path_var: &str) -> (PathBuf, String) {
        match check_unchangeable(program, path_var) {
            Err(RuntimeProblem::Changeable { path, why }) => (path, why),
            other => panic!("{program:?}: {other:?}"),
        }
    }

    /// A program, an interpreter its `#!` line or `env` leads to, a directory above either,
    /// or a venv's package directory that group or others may write is refused, naming it:
    /// whoever may change it chooses the code every executor runs. Before, only whether the
    /// executor could run it was checked.
    #[test]
    fn code_others_could_change_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let kept = root.join("kept/bin/tool");
        program_at(&kept, "#!/bin/sh\n", 0o755);
        check_unchangeable(&kept, P).unwrap();

        program_at(&root.join("writable-file/tool"), "#!/bin/sh\n", 0o775);
        let (path, why) = changeable(&root.join("writable-file/tool"), P);
        assert_eq!(path, root.join("writable-file/tool"));
        assert!(why.contains("0775"), "{why}");

        let open_dir = root.join("open");
        program_at(&open_dir.join("tool"), "#!/bin/sh\n", 0o755);
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(changeable(&open_dir.join("tool"), P).0, open_dir);

        // A script whose interpreter others may change, named or found by env.
        let script = root.join("kept/bin/script");
        program_at(&script, &format!("#!{}/tool\n", open_dir.display()), 0o755);
        assert_eq!(changeable(&script, P).0, open_dir);
        program_at(&script, "#!/usr/bin/env tool\n", 0o755);
        let path_var = format!("{}:/usr/bin", open_dir.display());
        assert_eq!(changeable(&script, &path_var).0, open_dir);
        check_unchangeable(&script, &format!("{}/kept/bin:/usr/bin", root.display())).unwrap();

        // A venv whose site-packages others may write (a .pth there runs at every start).
        let venv = root.join("venv");
        program_at(&venv.join("bin/python"), "#!/bin/sh\n", 0o755);
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        let site = venv.join("lib/python3.11/site-packages");
        std::fs::create_dir_all(&site).unwrap();
        check_unchangeable(&venv.join("bin/python"), P).unwrap();
        std::fs::set_permissions(&site, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(changeable(&venv.join("bin/python"), P).0, site);
    }

    /// What `env` looks at before it finds NAME, `env -S NAME ...`, a chain of
    /// interpreters too long to follow, a `.pth` file others may change, an editable
    /// install's source and a script named as an argument are each looked at too (found in
    /// review of the check above: each let another user choose the code).
    #[test]
    fn what_env_searches_and_what_python_and_arguments_load_are_looked_at() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let kept = root.join("kept");
        program_at(&kept.join("tool"), "#!/bin/sh\n", 0o755);
        let open_dir = root.join("open");
        std::fs::create_dir(&open_dir).unwrap();
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        // NAME found after a directory others may write: a file put there later wins.
        let script = kept.join("script");
        program_at(&script, "#!/usr/bin/env tool\n", 0o755);
        let path_var = format!("{}:{}", open_dir.display(), kept.display());
        assert_eq!(changeable(&script, &path_var).0, open_dir);
        // ... or one not there yet, in a directory others may write.
        let path_var = format!("{}:{}", open_dir.join("later").display(), kept.display());
        assert_eq!(changeable(&script, &path_var).0, open_dir);
        check_unchangeable(&script, &format!("{}", kept.display())).unwrap();
        // env -S NAME: NAME found past env's options.
        program_at(&open_dir.join("tool"), "#!/bin/sh\n", 0o755);
        program_at(&script, "#!/usr/bin/env -S tool --flag\n", 0o755);
        assert_eq!(
            changeable(&script, &format!("{}", open_dir.display())).0,
            open_dir
        );
        // env -S PATH=... NAME: NAME looked for where env then looks.
        program_at(
            &script,
            &format!(
                "#!/usr/bin/env -S PATH={}:/usr/bin tool\n",
                open_dir.display()
            ),
            0o755,
        );
        assert_eq!(
            changeable(&script, &format!("{}", kept.display())).0,
            open_dir
        );
        // The same with the text in env's option word; a relative PATH entry is refused.
        program_at(
            &script,
            &format!(
                "#!/usr/bin/env -SPATH={}:/usr/bin tool\n",
                open_dir.display()
            ),
            0o755,
        );
        assert_eq!(
            changeable(&script, &format!("{}", kept.display())).0,
            open_dir
        );
        program_at(&script, "#!/usr/bin/env -S PATH=bin:/usr/bin tool\n", 0o755);
        assert!(matches!(
            check_unchangeable(&script, &format!("{}", kept.display())),
            Err(RuntimeProblem::RelativeSearchPath { .. })
        ));
        // One after the directory NAME is found in is never searched.
        program_at(&script, "#!/usr/bin/env tool\n", 0o755);
        check_unchangeable(&script, &format!("{}:bin:", kept.display())).unwrap();
        // A chain past the depth followed is refused, not passed.
        let mut previous = kept.join("tool");
        for i in 0..=MAX_SCRIPT_DEPTH {
            let next = kept.join(format!("link{i}"));
            program_at(&next, &format!("#!{}\n", previous.display()), 0o755);
            previous = next;
        }
        let (_, why) = changeable(&previous, P);
        assert!(why.contains("more than"), "{why}");
        // A .pth file others may write, and a directory a .pth adds to the path.
        let venv = root.join("venv");
        program_at(&venv.join("bin/python"), "#!/bin/sh\n", 0o755);
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        let site = venv.join("lib/python3.11/site-packages");
        std::fs::create_dir_all(&site).unwrap();
        check_unchangeable(&venv.join("bin/python"), P).unwrap();
        std::fs::write(
            site.join("editable.pth"),
            format!("{}\n", open_dir.display()),
        )
        .unwrap();
        assert_eq!(changeable(&venv.join("bin/python"), P).0, open_dir);
        std::fs::write(site.join("editable.pth"), "import os\n").unwrap();
        std::fs::set_permissions(
            site.join("editable.pth"),
            std::fs::Permissions::from_mode(0o666),
        )
        .unwrap();
        assert_eq!(
            changeable(&venv.join("bin/python"), P).0,
            site.join("editable.pth")
        );
        // A .pth that is no regular file is refused without being read (a FIFO would block
        // the start).
        std::fs::remove_file(site.join("editable.pth")).unwrap();
        nix::unistd::mkfifo(
            &site.join("fifo.pth"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        let (path, why) = changeable(&venv.join("bin/python"), P);
        assert_eq!(path, site.join("fifo.pth"), "{why}");
        // A script named as an argument (the first file named); a later one is data.
        let args = [open_dir.join("tool").display().to_string()];
        match check_arguments_unchangeable(&args) {
            Err(RuntimeProblem::Changeable { path, .. }) => assert_eq!(path, open_dir),
            other => panic!("{other:?}"),
        }
        let script_then_data = [
            open_dir.display().to_string(),
            kept.join("tool").display().to_string(),
            open_dir.join("tool").display().to_string(),
        ];
        check_arguments_unchangeable(&script_then_data).unwrap();
        // A PATH directory not there yet, in a directory anyone may write, sticky or not.
        let sticky = root.join("sticky");
        std::fs::create_dir(&sticky).unwrap();
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
        program_at(&script, "#!/usr/bin/env tool\n", 0o755);
        let path_var = format!("{}:{}", sticky.join("bin").display(), kept.display());
        assert_eq!(changeable(&script, &path_var).0, sticky);
    }

    /// `#!/usr/bin/env NAME` is checked as far as NAME on the executor's PATH, and a `#!`
    /// line ending in a carriage return is named as such. Before, env alone was checked,
    /// and a CRLF line passed (the kernel then looked for `sh\r`).
    #[test]
    fn env_interpreters_and_crlf_lines_are_looked_at() {
        let d = dir_in_var_tmp();
        let script = d.path().join("script");
        program_at(&script, "#!/usr/bin/env no-such-interpreter-here\n", 0o755);
        let readable = [PathBuf::from("/usr")];
        let e = check_program(&script, EXECUTOR, &readable, P).unwrap_err();
        assert!(e.to_string().contains("no-such-interpreter-here"), "{e}");
        program_at(&script, "#!/bin/sh\r\n", 0o755);
        let e = check_program(&script, EXECUTOR, &readable, P).unwrap_err();
        assert!(
            matches!(e, RuntimeProblem::CrlfInterpreterLine { .. }),
            "{e:?}"
        );
    }
    use std::os::unix::fs::PermissionsExt;

    const EXECUTOR: (u32, u32) = (61_000, 61_000);

    fn dir_in_var_tmp() -> tempfile::TempDir {
        std::fs::create_dir_all("/var/tmp").unwrap();
        let d = tempfile::tempdir_in("/var/tmp").unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        d
    }

    fn file(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_program_under_tmp_is_named_with_the_private_tmp() {
        let e = check_program(Path::new("/tmp/venv/bin/server"), EXECUTOR, &[], P).unwrap_err();
        assert!(matches!(e, RuntimeProblem::PrivateTmp { .. }));
        assert!(e.to_string().contains("/tmp/venv/bin/server"), "{e}");
        assert!(e.to_string().contains("private"), "{e}");
    }

    #[test]
    fn a_private_home_directory_is_named_with_the_executor_uid() {
        let d = dir_in_var_tmp();
        let home = d.path().join("home");
        std::fs::create_dir(&home).unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        let program = home.join("server");
        file(&program, "\x7fELF", 0o755);
        let e = check_program(&program, EXECUTOR, &[], P).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, RuntimeProblem::NotSearchable { ref dir, .. } if dir == &home),
            "{text}"
        );
        assert!(text.contains("61000") && text.contains("700"), "{text}");
        // Readable by the executor: accepted.
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o711)).unwrap();
        check_program(&program, EXECUTOR, &[], P).unwrap();
        file(&program, "\x7fELF", 0o700);
        assert!(matches!(
            check_program(&program, EXECUTOR, &[], P),
            Err(RuntimeProblem::NotExecutable { .. })
        ));
    }

    #[test]
    fn an_interpreter_linked_into_a_private_home_is_named_with_where_it_leads() {
        let d = dir_in_var_tmp();
        let home = d.path().join("root");
        std::fs::create_dir(&home).unwrap();
        let real = home.join("python3.11");
        file(&real, "\x7fELF", 0o755);
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        let venv = d.path().join("venv");
        std::fs::create_dir(&venv).unwrap();
        std::os::unix::fs::symlink(&real, venv.join("python3")).unwrap();
        let script = venv.join("server");
        file(
            &script,
            &format!("#!{}\n", venv.join("python3").display()),
            0o755,
        );
        let text = check_program(&script, EXECUTOR, &[d.path().to_path_buf()], P)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains(&format!("which resolves to {}", real.display()))
                && text.contains(&format!("directory {}", home.display())),
            "{text}"
        );
    }

    #[test]
    fn a_venv_outside_the_read_paths_is_named() {
        let d = dir_in_var_tmp();
        let venv = d.path().join("venv");
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        std::os::unix::fs::symlink("/usr/bin/env", venv.join("bin/python3")).unwrap();
        let script = venv.join("bin/server");
        file(
            &script,
            &format!("#!{}\n", venv.join("bin/python3").display()),
            0o755,
        );
        let usr = [PathBuf::from("/usr")];
        let text = check_program(&script, EXECUTOR, &usr, P)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains(&format!("Python venv {}", venv.display()))
                && text.contains("read_paths"),
            "{text}"
        );
        check_program(&script, EXECUTOR, &[PathBuf::from("/usr"), venv.clone()], P).unwrap();
    }

    #[test]
    fn path_arguments_the_executor_cannot_read_are_named() {
        let d = dir_in_var_tmp();
        let script = d.path().join("server.js");
        file(&script, "", 0o644);
        let args = |a: &str| vec!["stdio".to_string(), a.to_string()];
        let usr = [PathBuf::from("/usr")];
        let in_tmp = tempfile::NamedTempFile::new_in("/tmp").unwrap();
        let e = check_path_arguments(&args(&in_tmp.path().display().to_string()), EXECUTOR, &usr)
            .unwrap_err();
        assert!(matches!(e, RuntimeProblem::PrivateTmp { .. }), "{e}");
        // A /tmp path that names nothing on the host may be the program's own output.
        check_path_arguments(&args("/tmp/flowhost-none/out.json"), EXECUTOR, &usr).unwrap();
        let e =
            check_path_arguments(&args(&script.display().to_string()), EXECUTOR, &usr).unwrap_err();
        assert!(matches!(e, RuntimeProblem::OutsideLandlock { .. }), "{e}");
        let ok = [PathBuf::from("/usr"), d.path().to_path_buf()];
        check_path_arguments(&args(&script.display().to_string()), EXECUTOR, &ok).unwrap();
        // An argument naming nothing on the host is the program's business.
        check_path_arguments(&args("/nonexistent/output"), EXECUTOR, &usr).unwrap();
    }

    #[test]
    fn a_scripts_missing_or_unreadable_interpreter_is_named() {
        let d = dir_in_var_tmp();
        let script = d.path().join("server");
        file(&script, "#!/nonexistent/python3 -u\nprint()\n", 0o755);
        let e = check_program(&script, EXECUTOR, &[], P).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("/nonexistent/python3") && text.contains("does not exist"),
            "{text}"
        );
        // An interpreter outside the Landlock paths is named with the rule to add.
        let interpreter = d.path().join("python");
        file(&interpreter, "\x7fELF", 0o755);
        file(
            &script,
            &format!("#!{}\nprint()\n", interpreter.display()),
            0o755,
        );
        let e = check_program(&script, EXECUTOR, &[PathBuf::from("/usr")], P).unwrap_err();
        assert!(
            e.to_string().contains("Landlock") && e.to_string().contains("read_paths"),
            "{e}"
        );
        check_program(&script, EXECUTOR, &[d.path().to_path_buf()], P).unwrap();
        // A real interpreter of the system, through /usr.
        file(&script, "#!/bin/sh\necho\n", 0o755);
        check_program(
            &script,
            EXECUTOR,
            &[PathBuf::from("/usr"), PathBuf::from("/bin")],
            P,
        )
        .unwrap();
    }
}
