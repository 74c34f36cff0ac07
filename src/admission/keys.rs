//! Ed25519 keys for signing manifests: generation, key files and the hex text form.
//!
//! Text form: a public key is 64 lowercase hex digits (32 bytes), a signature 128. A private
//! key file holds a label (`PRIVATE_KEY_LABEL`), the 32-byte secret seed as 64 lowercase hex
//! digits and a newline (one written before the label, the hex alone, is still read); it is
//! created with mode 0600 and never replaces an existing file, and a private key file that
//! its group or others may read or write is refused. A labelled private key is never read as
//! a public one (a file so labelled, or named as a private key file, is refused there); an
//! unlabelled one's hex, given as text, cannot be told from a public key's. A public key file holds the public key
//! in the same text form; one that group or others may write, or that is owned by neither
//! root nor the user flowhost runs as, is refused (whoever can change it could make flowhost
//! trust their own key). Small-order ("weak") public keys are refused everywhere, so a
//! signature can never verify for every message.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ed25519_dalek::{SECRET_KEY_LENGTH, SigningKey, VerifyingKey};
use rand_core::{OsRng, RngCore};
use zeroize::Zeroizing;

use crate::files::{self, FileError};

/// File name suffix of a private key written by [`generate`].
pub const PRIVATE_KEY_SUFFIX: &str = ".key";
/// File name suffix of a public key written by [`generate`].
pub const PUBLIC_KEY_SUFFIX: &str = ".pub";
/// Key files are tiny; anything larger is not a key file.
const MAX_KEY_FILE_BYTES: u64 = 4096;

/// Why a key could not be read, parsed or written.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Text that should be lowercase hex of a fixed length is not.
    #[error("{what}: {reason}")]
    Hex {
        /// What was being decoded (`public key`, `signature`, ...).
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The bytes are not a point on the curve.
    #[error("{what}: not a valid Ed25519 public key")]
    InvalidPublicKey {
        /// What was being decoded.
        what: &'static str,
    },
    /// The key is a small-order point, which would accept forged signatures.
    #[error("{what}: is a small-order (weak) Ed25519 key and is refused")]
    WeakPublicKey {
        /// What was being decoded.
        what: &'static str,
    },
    /// A key file could not be read or written.
    #[error(transparent)]
    File(#[from] FileError),
    /// A private key file that group or others may access.
    #[error(
        "{}: private key file has mode {mode:04o}, so group or others may access it; run `chmod 600 {}`",
        path.display(), path.display()
    )]
    PrivateKeyPermissions {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A public key file that group or others may write: whoever can write it can make
    /// flowhost trust their own key.
    #[error(
        "{}: public key file has mode {mode:04o}, so group or others may write it and replace the key flowhost trusts; run `chmod go-w {}`",
        path.display(), path.display()
    )]
    PublicKeyPermissions {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A public key file owned by neither root nor this process's user: its owner can
    /// change its mode and content, so can make flowhost trust their own key.
    #[error(
        "{}: public key file is owned by uid {owner}, neither root nor this process's uid {uid}, so its owner may replace the key flowhost trusts; run `chown root {}` (or give it to uid {uid})",
        path.display(), path.display()
    )]
    PublicKeyOwner {
        /// The key file.
        path: PathBuf,
        /// The file's owner.
        owner: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// A public key file reached through a directory (or a symbolic link in one) that
    /// someone other than root or this process's user may change: they could put another
    /// key in its place, or point its name at one (another authority's key they hold the
    /// private half of).
    #[error(
        "{}: public key file is reached through {} which {why}, so someone other than root or this process's user could put another key in its place",
        path.display(), dir.display()
    )]
    PublicKeyPlace {
        /// The key file as given.
        path: PathBuf,
        /// The directory others may change.
        dir: PathBuf,
        /// How.
        why: files::OthersMayChange,
    },
    /// A key file whose content is not a key.
    #[error("{}: {reason}", path.display())]
    KeyFileContent {
        /// The key file.
        path: PathBuf,
        /// The decoding problem.
        reason: Box<KeyError>,
    },
    /// A private key file given where a public key is expected: read as one, its secret
    /// would be printed in errors and written into manifests as the signer's key.
    #[error(
        "{}: is a private key file; give the public key (NAME{PUBLIC_KEY_SUFFIX}, written beside it by `flowhost key generate`)",
        path.display()
    )]
    PrivateKeyGiven {
        /// The key file.
        path: PathBuf,
    },
    /// The operating system's random source failed.
    #[error("cannot read the operating system's random source: {0}")]
    Randomness(String),
    /// The output directory could not be created.
    #[error("{}: cannot create directory", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// Decodes exactly `N` bytes from `2 * N` lowercase hex digits.
///
/// Lowercase only, so that one key or signature has exactly one text form.
pub fn decode_lower_hex<const N: usize>(
    what: &'static str,
    text: &str,
) -> Result<[u8; N], KeyError> {
    if text.len() != 2 * N {
        return Err(KeyError::Hex {
            what,
            reason: format!(
                "expected {} lowercase hex digits, found {} characters",
                2 * N,
                text.chars().count()
            ),
        });
    }
    if let Some(bad) = text.chars().find(|c| !matches!(c, '0'..='9' | 'a'..='f')) {
        return Err(KeyError::Hex {
            what,
            reason: format!("{bad:?} is not a lowercase hex digit"),
        });
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(text, &mut out).map_err(|e| KeyError::Hex {
        what,
        reason: e.to_string(),
    })?;
    Ok(out)
}

/// Parses a public key from its hex text form; `what` names it in errors.
pub fn public_key_from_hex(what: &'static str, text: &str) -> Result<VerifyingKey, KeyError> {
    let bytes = decode_lower_hex::<32>(what, text)?;
    let key = VerifyingKey::from_bytes(&bytes).map_err(|_| KeyError::InvalidPublicKey { what })?;
    if key.is_weak() {
        return Err(KeyError::WeakPublicKey { what });
    }
    Ok(key)
}

/// The hex text form of a public key.
pub fn public_key_to_hex(key: &VerifyingKey) -> String {
    hex::encode(key.as_bytes())
}

/// The files written by [`generate`].
#[derive(Debug, Clone)]
pub struct GeneratedKey {
    /// The private key file (mode 0600).
    pub private_path: PathBuf,
    /// The public key file (mode 0644).
    pub public_path: PathBuf,
    /// The public key.
    pub verifying_key: VerifyingKey,
}

/// Generates a key pair from the operating system's random source and writes
/// `DIR/NAME.key` (0600) and `DIR/NAME.pub` (0644), creating `DIR` (0700) if needed.
///
/// Refuses to overwrite either file; on failure nothing is left behind (a file whose name
/// could not be made durable included).
pub fn generate(dir: &Path, name: &str) -> Result<GeneratedKey, KeyError> {
    let mut seed = Zeroizing::new([0u8; SECRET_KEY_LENGTH]);
    OsRng
        .try_fill_bytes(seed.as_mut())
        .map_err(|e| KeyError::Randomness(e.to_string()))?;
    let signing_key = SigningKey::from_bytes(&seed);
    // Synced into its parent, each directory made: a key made durable in a directory whose
    // own entry a power loss takes is lost with it, after its public half was registered.
    crate::files::create_dir_all_synced(dir, 0o700).map_err(|e| KeyError::CreateDir {
        path: e.path,
        source: e.source,
    })?;
    let private_path = dir.join(format!("{name}{PRIVATE_KEY_SUFFIX}"));
    let public_path = dir.join(format!("{name}{PUBLIC_KEY_SUFFIX}"));
    // Refuse up front when either exists, so a pair is never half replaced.
    for path in [&private_path, &public_path] {
        if path.symlink_metadata().is_ok() {
            return Err(FileError::AlreadyExists { path: path.clone() }.into());
        }
    }
    let secret_text = Zeroizing::new(format!(
        "{PRIVATE_KEY_LABEL}{}\n",
        hex::encode(seed.as_ref())
    ));
    files::write_new(&private_path, secret_text.as_bytes(), 0o600)?;
    let verifying_key = signing_key.verifying_key();
    let public_text = format!("{}\n", public_key_to_hex(&verifying_key));
    if let Err(error) = files::write_new(&public_path, public_text.as_bytes(), 0o644) {
        // Best effort: the private key file is ours (just created) and useless alone.
        let _ = std::fs::remove_file(&private_path);
        return Err(error.into());
    }
    Ok(GeneratedKey {
        private_path,
        public_path,
        verifying_key,
    })
}

/// Reads one line of key text: the content, with at most one trailing newline removed.
fn key_text(text: &str) -> &str {
    text.strip_suffix('\n').unwrap_or(text)
}

/// What a private key file's text starts with (files written before it have the hex alone,
/// and are still read): a public key read from such a file is refused, so a private key
/// given by mistake is never printed or written out as a public one.
const PRIVATE_KEY_LABEL: &str = "flowhost-ed25519-private-key ";

/// Loads a private key file, refusing one that group or others may access.
pub fn load_signing_key(path: &Path) -> Result<SigningKey, KeyError> {
    let (file, metadata) = files::open_regular(path)?;
    let mode = metadata.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyError::PrivateKeyPermissions {
            path: path.to_owned(),
            mode,
        });
    }
    let bytes = Zeroizing::new(files::read_opened(
        path,
        file,
        &metadata,
        MAX_KEY_FILE_BYTES,
    )?);
    let content_error = |reason| KeyError::KeyFileContent {
        path: path.to_owned(),
        reason: Box::new(reason),
    };
    let text = std::str::from_utf8(&bytes).map_err(|_| {
        content_error(KeyError::Hex {
            what: "private key",
            reason: "not UTF-8 text".into(),
        })
    })?;
    let text = key_text(text);
    let seed = Zeroizing::new(
        decode_lower_hex::<SECRET_KEY_LENGTH>(
            "private key",
            text.strip_prefix(PRIVATE_KEY_LABEL).unwrap_or(text),
        )
        .map_err(content_error)?,
    );
    Ok(SigningKey::from_bytes(&seed))
}

/// Refuses a public key file with permission bits `mode` that group or others may write, or
/// owned by anyone but root or `uid` (this process's user): the owner of a file may always
/// change its mode, so only those two may own a trusted key.
fn check_public_key_file(path: &Path, mode: u32, owner: u32, uid: u32) -> Result<(), KeyError> {
    match files::others_may_change(mode, owner, uid) {
        None => Ok(()),
        Some(files::OthersMayChange::Mode { mode }) => Err(KeyError::PublicKeyPermissions {
            path: path.to_owned(),
            mode,
        }),
        Some(files::OthersMayChange::Owner { owner, uid }) => Err(KeyError::PublicKeyOwner {
            path: path.to_owned(),
            owner,
            uid,
        }),
    }
}

/// Loads a public key file, refusing one that group or others may write or that is owned
/// by neither root nor this process's user: a public key decides which signatures are
/// trusted, so anyone who could change the file could make flowhost trust their key.
///
/// Every directory its lookup passes, through any symbolic links, must be one only root or
/// this process's user may change (root's sticky ones, such as `/tmp`, pass). The checks of
/// the file itself are made on the opened file (not the path), so the file read is the file
/// checked.
pub fn load_verifying_key(path: &Path) -> Result<VerifyingKey, KeyError> {
    let target = files::trusted_target(path).map_err(|e| match e {
        files::TrustedFileError::Exposed { path: dir, why } => KeyError::PublicKeyPlace {
            path: path.to_owned(),
            dir,
            why,
        },
        files::TrustedFileError::File(e) => KeyError::File(e),
        // Not made by `trusted_target`, which judges directories only.
        files::TrustedFileError::Readable { .. } => KeyError::File(FileError::Open {
            path: path.to_owned(),
            source: std::io::Error::other(e.to_string()),
        }),
    })?;
    // Named as `key generate` names a private key (one written before the label has the
    // hex alone, and would read as a public key), as given or where a link leads.
    if [path, target.as_path()].iter().any(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with(PRIVATE_KEY_SUFFIX))
    }) {
        return Err(KeyError::PrivateKeyGiven {
            path: path.to_owned(),
        });
    }
    let (file, metadata) = files::open_regular(&target)?;
    check_public_key_file(
        path,
        metadata.mode(),
        metadata.uid(),
        nix::unistd::geteuid().as_raw(),
    )?;
    let bytes = files::read_opened(path, file, &metadata, MAX_KEY_FILE_BYTES)?;
    let text = String::from_utf8(bytes).map_err(|e| FileError::NotUtf8 {
        path: path.to_owned(),
        offset: e.utf8_error().valid_up_to(),
    })?;
    if text.starts_with(PRIVATE_KEY_LABEL) {
        return Err(KeyError::PrivateKeyGiven {
            path: path.to_owned(),
        });
    }
    public_key_from_hex("public key", key_text(&text)).map_err(|reason| KeyError::KeyFileContent {
        path: path.to_owned(),
        reason: Box::new(reason),
    })
}

/// Whether `text` is (or starts as) a private key file's text: it must never be echoed,
/// nor taken for a file name that an error would print.
pub fn is_private_key_text(text: &str) -> bool {
    text.trim_start().starts_with(PRIVATE_KEY_LABEL)
}

/// Whether `text` holds a private key file's text anywhere (a configuration a key was
/// pasted into): no error about it may quote its lines.
pub fn holds_private_key_text(text: &str) -> bool {
    text.contains(PRIVATE_KEY_LABEL.trim_end())
}

/// A public key given on a command line: 64 lowercase hex digits, or else the path of a
/// public key file (checked as [`load_verifying_key`] does).
pub fn verifying_key_from_arg(arg: &str) -> Result<VerifyingKey, KeyError> {
    // A private key file's text pasted as the argument (`--key "$(cat NAME.key)"`): refused
    // without being echoed as a path that cannot be opened.
    if is_private_key_text(arg) {
        return Err(KeyError::PrivateKeyGiven {
            path: PathBuf::from("(the text of a private key file)"),
        });
    }
    if arg.len() == 64 && arg.bytes().all(|b| b.is_ascii_hexdigit()) {
        public_key_from_hex("public key", arg)
    } else {
        load_verifying_key(Path::new(arg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The directories `key generate` makes are synced into their parents: a power loss
    /// after the public half was registered cannot take the pair's directory with it.
    #[test]
    fn generate_syncs_the_directories_it_makes() {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("a").join("keys");
        crate::files::SYNCED_DIRS.with(|synced| synced.borrow_mut().clear());
        generate(&keys, "k").unwrap();
        let synced = crate::files::SYNCED_DIRS.with(|synced| synced.take());
        for parent in [dir.path().to_path_buf(), dir.path().join("a")] {
            assert!(synced.contains(&parent), "{parent:?} not in {synced:?}");
        }
    }

    /// A key file whose name cannot be made durable is taken away: nothing is left, and the
    /// next try is not refused as already there. Before, the private key stayed alone. (The
    /// public half's case, where the private key is then removed too, is the same
    /// `write_new`; it is not reached here, since every directory sync fails.)
    #[test]
    fn a_pair_that_cannot_be_made_durable_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        crate::files::FAIL_DIR_SYNCS.with(|f| f.set(true));
        let failed = generate(dir.path(), "k");
        crate::files::FAIL_DIR_SYNCS.with(|f| f.set(false));
        assert!(failed.is_err());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
        generate(dir.path(), "k").unwrap();
    }

    #[test]
    fn generate_writes_a_private_0600_and_a_public_key_and_refuses_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("keys");
        let key = generate(&out, "publisher").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&key.private_path), 0o600);
        assert_eq!(mode(&key.public_path), 0o644);
        assert_eq!(mode(&out), 0o700);
        let signing = load_signing_key(&key.private_path).unwrap();
        assert_eq!(signing.verifying_key(), key.verifying_key);
        assert_eq!(
            load_verifying_key(&key.public_path).unwrap(),
            key.verifying_key
        );
        let before = std::fs::read(&key.private_path).unwrap();
        assert!(matches!(
            generate(&out, "publisher"),
            Err(KeyError::File(FileError::AlreadyExists { .. }))
        ));
        assert_eq!(std::fs::read(&key.private_path).unwrap(), before);
        // Two generations give different keys.
        let other = generate(&out, "other").unwrap();
        assert_ne!(other.verifying_key, key.verifying_key);
    }

    /// A private key file given where a public key is expected is refused, by its label or
    /// its name, and its secret is never in the error: before, about half of them read as a
    /// valid public key, whose hex (the seed) admission errors then printed and `manifest
    /// from-openapi --public-key` wrote into a manifest body.
    #[test]
    fn a_private_key_is_never_read_as_a_public_one() {
        let dir = tempfile::tempdir().unwrap();
        let key = generate(dir.path(), "k").unwrap();
        let secret = std::fs::read_to_string(&key.private_path).unwrap();
        let seed = secret.trim().rsplit(' ').next().unwrap().to_string();
        assert_eq!(seed.len(), 64);
        let elsewhere = dir.path().join("renamed.pub");
        std::fs::copy(&key.private_path, &elsewhere).unwrap();
        for given in [&key.private_path, &elsewhere] {
            let e = load_verifying_key(given).unwrap_err();
            assert!(matches!(e, KeyError::PrivateKeyGiven { .. }), "{e}");
            assert!(!e.to_string().contains(&seed), "{e}");
            let e = verifying_key_from_arg(given.to_str().unwrap()).unwrap_err();
            assert!(matches!(e, KeyError::PrivateKeyGiven { .. }), "{e}");
        }
        // Its text given as the argument is refused without being echoed.
        let e = verifying_key_from_arg(secret.trim()).unwrap_err();
        assert!(!e.to_string().contains(&seed), "{e}");
        // A private key written before the label (the hex alone) still signs, and is
        // refused as a public key by its name.
        let old = dir.path().join("old.key");
        std::fs::write(&old, format!("{seed}\n")).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            load_signing_key(&old).unwrap().verifying_key(),
            key.verifying_key
        );
        assert!(matches!(
            load_verifying_key(&old),
            Err(KeyError::PrivateKeyGiven { .. })
        ));
    }

    #[test]
    fn private_key_readable_by_others_is_refused_with_chmod_advice() {
        let dir = tempfile::tempdir().unwrap();
        let key = generate(dir.path(), "k").unwrap();
        for mode in [0o640, 0o604, 0o660, 0o700 | 0o010] {
            std::fs::set_permissions(&key.private_path, std::fs::Permissions::from_mode(mode))
                .unwrap();
            let err = load_signing_key(&key.private_path).unwrap_err();
            assert!(
                matches!(err, KeyError::PrivateKeyPermissions { .. }),
                "{mode:o}"
            );
            assert!(err.to_string().contains("chmod 600"), "{err}");
        }
        std::fs::set_permissions(&key.private_path, std::fs::Permissions::from_mode(0o400))
            .unwrap();
        load_signing_key(&key.private_path).unwrap();
    }

    #[test]
    fn public_key_writable_by_group_or_others_is_refused_naming_file_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let key = generate(dir.path(), "k").unwrap();
        let public = &key.public_path;
        for mode in [0o664, 0o646, 0o666, 0o620, 0o602] {
            std::fs::set_permissions(public, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = load_verifying_key(public).unwrap_err();
            assert!(
                matches!(err, KeyError::PublicKeyPermissions { .. }),
                "{mode:o}: {err}"
            );
            let message = err.to_string();
            assert!(message.contains(&public.display().to_string()), "{message}");
            assert!(message.contains(&format!("{mode:04o}")), "{message}");
            assert!(message.contains("chmod go-w"), "{message}");
            // The daemon and the CLI take key files through this path too.
            let via_arg = verifying_key_from_arg(public.to_str().unwrap()).unwrap_err();
            assert!(
                matches!(via_arg, KeyError::PublicKeyPermissions { .. }),
                "{via_arg}"
            );
        }
        // Readable by everyone is fine: a public key is no secret, only its integrity counts.
        for mode in [0o644, 0o444, 0o600, 0o400] {
            std::fs::set_permissions(public, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(load_verifying_key(public).unwrap(), key.verifying_key);
        }
    }

    #[test]
    fn a_public_key_in_a_directory_others_may_change_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        let key = generate(&shared, "k").unwrap();
        // A directory group or others may write (not sticky): they could rename the key
        // away and put their own (owned by them, a hard link to a key root trusts for
        // something else, a link) in its place.
        for mode in [0o777, 0o775, 0o757] {
            std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = load_verifying_key(&key.public_path).unwrap_err();
            assert!(
                matches!(err, KeyError::PublicKeyPlace { .. }),
                "{mode:o}: {err}"
            );
            let message = err.to_string();
            assert!(
                message.contains(&key.public_path.display().to_string()),
                "{message}"
            );
            assert!(
                message.contains(&format!("{} which has mode {mode:04o}", shared.display())),
                "{message}"
            );
            assert!(verifying_key_from_arg(key.public_path.to_str().unwrap()).is_err());
        }
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            load_verifying_key(&key.public_path).unwrap(),
            key.verifying_key
        );
        // A link in a trusted place leads where it says; one to a private key is refused.
        let link = dir.path().join("link.pub");
        std::os::unix::fs::symlink(&key.public_path, &link).unwrap();
        assert_eq!(load_verifying_key(&link).unwrap(), key.verifying_key);
        let to_private = dir.path().join("other.pub");
        std::os::unix::fs::symlink(&key.private_path, &to_private).unwrap();
        assert!(matches!(
            load_verifying_key(&to_private).unwrap_err(),
            KeyError::PrivateKeyGiven { .. }
        ));
    }

    #[test]
    fn public_key_owned_by_another_user_is_refused() {
        let path = Path::new("/etc/flowhost/keys/x.pub");
        // Owned by this process's uid, or by root: trusted.
        check_public_key_file(path, 0o644, 1000, 1000).unwrap();
        check_public_key_file(path, 0o644, 0, 1000).unwrap();
        check_public_key_file(path, 0o644, 0, 0).unwrap();
        // Owned by anyone else: that user could replace the key.
        let err = check_public_key_file(path, 0o644, 1001, 1000).unwrap_err();
        assert!(
            matches!(
                err,
                KeyError::PublicKeyOwner {
                    owner: 1001,
                    uid: 1000,
                    ..
                }
            ),
            "{err}"
        );
        let message = err.to_string();
        assert!(message.contains("/etc/flowhost/keys/x.pub"), "{message}");
        assert!(message.contains("uid 1001"), "{message}");
        assert!(check_public_key_file(path, 0o644, 1000, 0).is_err());

        // The real file check, where this test may give a file away (as root).
        if nix::unistd::geteuid().is_root() {
            let dir = tempfile::tempdir().unwrap();
            let key = generate(dir.path(), "k").unwrap();
            std::os::unix::fs::chown(&key.public_path, Some(65534), None).unwrap();
            let err = load_verifying_key(&key.public_path).unwrap_err();
            assert!(
                matches!(err, KeyError::PublicKeyOwner { owner: 65534, .. }),
                "{err}"
            );
        }
    }

    #[test]
    fn private_key_symlink_and_garbage_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let key = generate(dir.path(), "k").unwrap();
        let link = dir.path().join("link.key");
        std::os::unix::fs::symlink(&key.private_path, &link).unwrap();
        assert!(matches!(
            load_signing_key(&link),
            Err(KeyError::File(FileError::Symlink { .. }))
        ));
        let garbage = dir.path().join("garbage.key");
        files::write_new(&garbage, b"not a key\n", 0o600).unwrap();
        assert!(matches!(
            load_signing_key(&garbage),
            Err(KeyError::KeyFileContent { .. })
        ));
    }

    #[test]
    fn hex_is_strict() {
        let key = SigningKey::from_bytes(&[7; 32]).verifying_key();
        let text = public_key_to_hex(&key);
        assert_eq!(public_key_from_hex("k", &text).unwrap(), key);
        assert!(matches!(
            public_key_from_hex("k", &text.to_uppercase()),
            Err(KeyError::Hex { .. })
        ));
        assert!(matches!(
            public_key_from_hex("k", &text[..62]),
            Err(KeyError::Hex { .. })
        ));
        // The identity point is a small-order key.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        assert!(matches!(
            public_key_from_hex("k", &hex::encode(identity)),
            Err(KeyError::WeakPublicKey { .. })
        ));
        assert_eq!(verifying_key_from_arg(&text).unwrap(), key);
        assert!(verifying_key_from_arg("/nonexistent/key.pub").is_err());
    }
}
