//! The `tool_contract` example prints exactly the four lines the issue specifies.

use std::path::PathBuf;
use std::process::Command;

/// `cargo test` builds examples next to the test binaries' parent directory.
fn example_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    profile_dir.join("examples").join(name)
}

#[test]
fn tool_contract_prints_the_four_outcomes() {
    let path = example_path("tool_contract");
    assert!(
        path.exists(),
        "{} was not built; run `cargo test --workspace`",
        path.display()
    );
    let out = Command::new(&path).output().expect("run tool_contract");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "READ declaration: retained contract label constructed\n\
         ALLOW pricing-team channel input; its public acknowledgment does not widen input\n\
         REFUSE public pull request input: contract restriction retained\n\
         REFUSE missing clearance; reject Top at contract construction\n"
    );
}
