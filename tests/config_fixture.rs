//! The annotated example configuration in fixtures/ is valid, verifies against the signed
//! fixtures, and says exactly what the generated lab configuration (used by the demo and
//! the daemon tests) says, apart from paths, uids and sink ports.

use std::path::Path;

use flowhost::config::HostConfig;
use flowhost::lab::{LabPaths, host_config};

fn fixture() -> HostConfig {
    HostConfig::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pricing-lab/host.toml"))
        .unwrap()
}

#[test]
fn the_annotated_example_is_valid_and_its_manifests_verify() {
    let mut c = fixture();
    assert_eq!(c.servers.len(), 3);
    // An installed host has its profiles directory (`make install` makes it); one that is
    // not there stops the start, so here, where it may not be, the built-in profiles stand
    // in for it.
    c.profiles_dir.retain(|d| d.is_dir());
    let (registry, _) = flowhost::daemon::verify_registry(&c).unwrap();
    assert_eq!(registry.tools().count(), 5);
    assert!(registry.requires_flow_runtime());
    assert!(
        c.servers[0].command[2] == "/usr/local/share/flowhost/documents",
        "{:?}",
        c.servers[0].command
    );
}

#[test]
fn the_example_and_the_generated_lab_agree() {
    let example = fixture();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pricing-lab");
    let paths = LabPaths {
        workspace_command: vec!["/opt/tools/flowhost-tool-workspace".into()],
        publisher_command: vec!["/opt/tools/flowhost-tool-publisher".into()],
        documents: "/usr/local/share/flowhost/documents".into(),
        manifests_dir: dir.clone(),
        keys_dir: dir.join("keys"),
        state_dir: "/var/lib/flowhost".into(),
        records_dir: "/var/log/flowhost/records".into(),
        socket: "/run/flowhost/flowhost.sock".into(),
        team_sink: "127.0.0.1:7401".parse().unwrap(),
        public_sink: "127.0.0.1:7402".parse().unwrap(),
        exfil_sink: "127.0.0.1:7403".parse().unwrap(),
        analyst_uid: 1000,
        reviewer_uid: 1001,
        socket_mode: "660".into(),
    };
    let generated = HostConfig::parse(&dir.join("generated.toml"), &host_config(&paths)).unwrap();
    for (a, b) in example.servers.iter().zip(&generated.servers) {
        assert_eq!(a.id, b.id);
        assert_eq!(a.manifest, b.manifest);
        assert_eq!(a.profile, b.profile);
        assert_eq!(a.policies, b.policies, "{}", a.id);
        assert_eq!(a.record_mappings, b.record_mappings, "{}", a.id);
        assert_eq!(a.destinations, b.destinations, "{}", a.id);
        assert_eq!(a.pool_size, b.pool_size);
        assert_eq!(a.command[1..], b.command[1..], "{}", a.id);
    }
    assert_eq!(example.servers.len(), generated.servers.len());
    let principals = |c: &HostConfig| {
        c.principals
            .iter()
            .map(|p| (p.id.to_string(), p.uids.clone(), p.tools.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(principals(&example), principals(&generated));
    let classifiers = |c: &HostConfig| {
        c.classifiers
            .iter()
            .map(|r| (r.pattern.to_string(), r.label.clone(), r.scopes.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(classifiers(&example), classifiers(&generated));
    assert_eq!(example.classifier_version, generated.classifier_version);
    assert_eq!(example.call_timeout, generated.call_timeout);
}
