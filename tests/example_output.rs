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
    for example in ["tool_contract", "seed_tool_contract"] {
        check_four_outcomes(example);
    }
}

/// The plain program names flowhost only in its `use` lines: the rest is the library's public
/// API read as a tool author reads it.
#[test]
fn the_seed_program_differs_only_in_its_use_lines() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let example = std::fs::read_to_string(root.join("examples/seed_tool_contract.rs")).unwrap();
    let body: Vec<&str> = example
        .lines()
        .filter(|l| !l.starts_with("//!") && !l.starts_with("use flowhost::"))
        .skip_while(|l| l.is_empty())
        .collect();
    assert!(
        body.iter()
            .any(|l| l.contains("reader.output_label.as_ref().unwrap()"))
    );
    assert!(body.iter().all(|l| !l.contains("flowhost")), "{body:?}");
}

fn check_four_outcomes(example: &str) {
    let path = example_path(example);
    assert!(
        path.exists(),
        "{} was not built; run `cargo test --workspace`",
        path.display()
    );
    let out = Command::new(&path).output().expect("run the example");
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
