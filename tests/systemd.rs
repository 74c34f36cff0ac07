//! systemd deployment: the units verify and are hardened, the daemon speaks sd_notify
//! (READY only once it serves, WATCHDOG, RELOADING with MONOTONIC_USEC, STOPPING), serves
//! on a socket handed over with LISTEN_FDS, reloads atomically and keeps its registry when a
//! reload is bad, and runs as a service user holding only the broker's capabilities.

mod common;

use std::collections::BTreeSet;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::lab::{Client, Lab};
use common::{have, is_root};
use serde_json::json;

fn unit(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("systemd")
            .join(name),
    )
    .unwrap()
}

#[test]
fn the_units_verify() {
    assert!(
        have("systemd-analyze"),
        "systemd-analyze is missing (.ci/run installs systemd)"
    );
    let dir = tempfile::tempdir().unwrap();
    // verify checks that ExecStart exists: point it at the binary under test.
    let service =
        unit("flowhost.service").replace("/usr/local/bin/flowhost", env!("CARGO_BIN_EXE_flowhost"));
    std::fs::write(dir.path().join("flowhost.service"), service).unwrap();
    std::fs::write(dir.path().join("flowhost.socket"), unit("flowhost.socket")).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.path().join("flowhost.service"))
        .arg(dir.path().join("flowhost.socket"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_service_exposure_is_3_3_or_lower() {
    assert!(
        have("systemd-analyze"),
        "systemd-analyze is missing (.ci/run installs systemd)"
    );
    let dir = tempfile::tempdir().unwrap();
    let service =
        unit("flowhost.service").replace("/usr/local/bin/flowhost", env!("CARGO_BIN_EXE_flowhost"));
    let path = dir.path().join("flowhost.service");
    std::fs::write(&path, service).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes"])
        .arg(&path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("{text}"));
    let exposure: f64 = line
        .split(':')
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    // 3.0 with exactly the broker's capabilities; CAP_NET_BIND_SERVICE (each executor's
    // resolver listens on port 53, the only port resolv.conf can name) costs 0.1, and the
    // delegated cgroup subtree the executors' bounds are made in (Delegate=yes, without
    // ProtectControlGroups=, which would make it read-only) 0.2, and CAP_KILL (executors
    // run as other uids, and ending them takes it) 0.1.
    assert!(exposure <= 3.4, "exposure {exposure}: {line}");
}

#[test]
fn the_sysusers_and_tmpfiles_snippets_name_the_user_and_directories() {
    let users = unit("flowhost.sysusers.conf");
    assert!(users.lines().any(|l| l.starts_with("u flowhost ")));
    let dirs = unit("flowhost.tmpfiles.conf");
    for d in [
        "/var/lib/flowhost",
        "/var/log/flowhost/records",
        "/etc/flowhost",
    ] {
        assert!(dirs.contains(d), "{d}");
    }
    let service = unit("flowhost.service");
    assert!(service.contains("User=flowhost") && service.contains("StateDirectory=flowhost"));
}

/// Reads notifications until one contains `want`, or panics after 20 s.
fn await_notification(sock: &UnixDatagram, want: &str, seen: &mut Vec<String>) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        if let Ok(n) = sock.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            seen.push(msg.clone());
            if msg.lines().any(|l| l == want) {
                return msg;
            }
        }
    }
    panic!("no {want} notification; saw {seen:?}");
}

#[test]
fn sd_notify_ready_watchdog_reloading_stopping() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let notify_path = lab.dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // systemd sets WATCHDOG_PID to the service's pid; exec keeps the shell's pid.
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!(
            "WATCHDOG_PID=$$ exec {} serve --log-format text --config {}",
            env!("CARGO_BIN_EXE_flowhost"),
            lab.config.display()
        ))
        .env("NOTIFY_SOCKET", &notify_path)
        .env("WATCHDOG_USEC", "400000");
    let socket = lab.paths.socket.clone();
    // Do not wait for the socket: the point is when READY arrives.
    let log = std::fs::File::create(lab.dir.path().join("daemon.log")).unwrap();
    lab.adopt(command.stderr(log).spawn().unwrap());
    let mut seen = Vec::new();
    let ready = await_notification(&notify, "READY=1", &mut seen);
    // Before each server's first executor, the start's timeout is extended by what its
    // `initialize` may take (the lab's call_timeout_ms, 15 s, and 10 s around it): a slow
    // starter must not get the daemon killed by the unit's start timeout, unexplained.
    let extended: Vec<&String> = seen
        .iter()
        .filter(|m| m.lines().any(|l| l == "EXTEND_TIMEOUT_USEC=25000000"))
        .collect();
    assert_eq!(extended.len(), 3, "{seen:?}");
    assert!(
        extended
            .iter()
            .any(|m| m.contains("STATUS=starting an executor of server workspace")),
        "{seen:?}"
    );
    // READY means serving: a connection works at once.
    let mut c = Client::connect(&socket);
    c.initialize();
    assert!(
        ready.contains("STATUS=serving 5 tools from 3 servers"),
        "{ready}"
    );
    await_notification(&notify, "WATCHDOG=1", &mut seen);

    lab.signal(libc::SIGHUP);
    let reloading = await_notification(&notify, "RELOADING=1", &mut seen);
    assert!(
        reloading.lines().any(|l| l.starts_with("MONOTONIC_USEC=")),
        "{reloading}"
    );
    let after = await_notification(&notify, "READY=1", &mut seen);
    assert!(after.contains("STATUS=reloaded"), "{after}");

    lab.signal(libc::SIGTERM);
    let stopping = await_notification(&notify, "STOPPING=1", &mut seen);
    // The stop lets calls run to their deadline (15 s here) and then closes the records:
    // the unit's fixed TimeoutStopSec must not cut it short.
    assert!(
        stopping
            .lines()
            .any(|l| l == "EXTEND_TIMEOUT_USEC=45000000"),
        "{stopping}"
    );
    lab.stop();
    // The health file is written on shutdown.
    assert!(lab.paths.state_dir.join("health.json").exists());
}

#[test]
fn serves_on_a_socket_passed_with_listen_fds() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    assert!(
        have("systemd-socket-activate"),
        "systemd-socket-activate is missing (.ci/run installs systemd)"
    );
    let activated = lab.dir.path().join("activated.sock");
    let mut command = Command::new("systemd-socket-activate");
    command
        .arg("-l")
        .arg(&activated)
        .args(["-E", "FLOWHOST_LOG", "--"])
        .arg(env!("CARGO_BIN_EXE_flowhost"));
    command
        .args(["serve", "--log-format", "text", "--config"])
        .arg(&lab.config);
    // The first connection starts the daemon (systemd-socket-activate waits for it).
    std::thread::spawn({
        let activated = activated.clone();
        move || {
            for _ in 0..200 {
                if UnixStream::connect(&activated).is_ok() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    });
    lab.spawn_with(command, &activated);
    let mut c = Client::connect(&activated);
    c.initialize();
    let tools = c.request("tools/list", json!({}));
    assert_eq!(tools["result"]["tools"].as_array().unwrap().len(), 5);
    assert!(
        !lab.paths.socket.exists(),
        "the daemon did not bind its own socket"
    );
    lab.stop();
}

fn tool_names(c: &mut Client) -> BTreeSet<String> {
    let r = c.request("tools/list", json!({}));
    r["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect()
}

/// Sends SIGHUP and waits until the log shows one more refused reload.
fn reload_and_await_refusal(lab: &Lab) {
    let refusals = lab.log().matches("reload refused").count();
    lab.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(10);
    while lab.log().matches("reload refused").count() == refusals {
        assert!(
            Instant::now() < deadline,
            "no refusal logged:\n{}",
            lab.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn reload_is_atomic_and_a_bad_reload_keeps_the_registry() {
    let Some(lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let old = tool_names(&mut c);
    assert_eq!(old.len(), 5);

    // A new configuration without the public inbox.
    let original = std::fs::read_to_string(&lab.config).unwrap();
    let start = original.find("[[server]]\nid = \"public-inbox\"").unwrap();
    let without_public = original[..start]
        .replace(", \"public-inbox/publish\"", "")
        .replace(
            "\"workspace/list_documents\", \"public-inbox/publish\"",
            "\"workspace/list_documents\"",
        );
    lab.write_config(&without_public);
    lab.signal(libc::SIGHUP);
    let new: BTreeSet<String> = old
        .iter()
        .filter(|t| !t.starts_with("public-inbox/"))
        .cloned()
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = tool_names(&mut c);
        assert!(
            now == old || now == new,
            "a partial registry was visible: {now:?}"
        );
        if now == new {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the reload did not take effect:\n{}",
            lab.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = c.call(
        "public-inbox/publish",
        json!({"message": "x", "sink": lab.public.addr.to_string()}),
    );
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown tool"),
        "{r}"
    );
    // The session keeps working on the new generation.
    assert!(
        common::lab::text(&c.call(
            "workspace/read_terms",
            json!({"document": "harbor-goods-terms.md"})
        ))
        .contains("Harbor Goods")
    );

    // A broken configuration: the old registry stays, and the log says why.
    lab.write_config("[host]\nthis is not toml");
    reload_and_await_refusal(&lab);
    assert!(
        lab.log().contains("host.toml"),
        "the refusal names the file:\n{}",
        lab.log()
    );
    assert_eq!(tool_names(&mut c), new);
    // A manifest that no longer verifies is refused the same way.
    let tampered = lab.dir.path().join("workspace.signed.json");
    let text =
        std::fs::read_to_string(lab.paths.manifests_dir.join("workspace.signed.json")).unwrap();
    std::fs::write(&tampered, text.replacen("read_terms", "read_termz", 1)).unwrap();
    lab.write_config(
        &without_public.replace(
            &lab.paths
                .manifests_dir
                .join("workspace.signed.json")
                .display()
                .to_string(),
            &tampered.display().to_string(),
        ),
    );
    reload_and_await_refusal(&lab);
    assert_eq!(tool_names(&mut c), new);

    // Moving the record directory needs a restart: the reload is refused, naming the key.
    let moved_records = lab.dir.path().join("elsewhere");
    lab.write_config(&without_public.replace(
        &format!(
            "records_dir = {:?}",
            lab.paths.records_dir.display().to_string()
        ),
        &format!("records_dir = {:?}", moved_records.display().to_string()),
    ));
    reload_and_await_refusal(&lab);
    assert!(
        lab.log().contains("records_dir changed"),
        "the refusal names the key:\n{}",
        lab.log()
    );
    assert!(!moved_records.exists());
    assert_eq!(tool_names(&mut c), new);
}

/// Taking a server's key out of the configuration (replacing it, or deleting its file)
/// withdraws trust in what that key signed: the server stops serving at the reload, even
/// though the reload itself is refused (its manifest no longer verifies), and the other
/// servers go on as they were. So does taking a server out while something else is wrong.
#[test]
fn a_server_whose_key_is_taken_out_stops_serving_although_the_reload_is_refused() {
    let Some(lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let all = tool_names(&mut c);
    assert_eq!(all.len(), 5);
    let original = std::fs::read_to_string(&lab.config).unwrap();
    let keys = lab.dir.path().join("keys");
    std::fs::create_dir(&keys).unwrap();
    let key_of = |server: &str| {
        let path = lab.paths.keys_dir.join(format!("{server}.pub"));
        (format!("key = {:?}", path.display().to_string()), path)
    };
    let without = |all: &BTreeSet<String>, server: &str| -> BTreeSet<String> {
        all.iter()
            .filter(|t| !t.starts_with(&format!("{server}/")))
            .cloned()
            .collect()
    };

    // The workspace key replaced by another publisher's.
    let (workspace_key, _) = key_of("workspace");
    let (_, team_path) = key_of("team-inbox");
    let replaced = original.replacen(
        &workspace_key,
        &format!("key = {:?}", team_path.display().to_string()),
        1,
    );
    assert_ne!(replaced, original);
    lab.write_config(&replaced);
    reload_and_await_refusal(&lab);
    let log = lab.log();
    assert!(
        log.contains("server \"workspace\" withdrawn from service although the reload is refused: its manifest is not signed by the key the configuration now names"),
        "{log}"
    );
    let after_replacing = without(&all, "workspace");
    assert_eq!(tool_names(&mut c), after_replacing);
    let r = c.call(
        "workspace/read_terms",
        json!({"document": "harbor-goods-terms.md"}),
    );
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown tool"),
        "{r}"
    );
    // The others serve on.
    let r = c.call(
        "public-inbox/publish",
        json!({"message": "x", "sink": lab.public.addr.to_string()}),
    );
    assert!(
        r["error"].is_null() && r["result"]["isError"] != json!(true),
        "{r}"
    );

    // The team-inbox key named by a file that is then deleted.
    let (team_key, team_path) = key_of("team-inbox");
    let copy = keys.join("team-inbox.pub");
    std::fs::copy(&team_path, &copy).unwrap();
    let named_copy = original.replacen(
        &team_key,
        &format!("key = {:?}", copy.display().to_string()),
        1,
    );
    std::fs::remove_file(&copy).unwrap();
    lab.write_config(&named_copy);
    reload_and_await_refusal(&lab);
    assert!(
        lab.log().contains("server \"team-inbox\" withdrawn from service although the reload is refused: its registered key cannot be read"),
        "{}",
        lab.log()
    );
    let after_deleting = without(&after_replacing, "team-inbox");
    assert_eq!(tool_names(&mut c), after_deleting);

    // A configuration that cannot be read says nothing of any key: nothing more is
    // withdrawn.
    let withdrawals = lab.log().matches("withdrawn from service").count();
    lab.write_config("[host]\nthis is not toml");
    reload_and_await_refusal(&lab);
    assert_eq!(tool_names(&mut c), after_deleting);
    assert_eq!(
        lab.log().matches("withdrawn from service").count(),
        withdrawals
    );
}

/// A tool pattern taken from a principal, and then the principal itself taken out, are
/// withdrawn although the reload is refused for another reason (here a setting that takes
/// a restart): the session's next call of such a tool, and then any request of it, is
/// refused. Before, a refused reload kept the old principals whole, and a user the
/// operator had taken out went on calling as before.
#[test]
fn a_principal_taken_out_loses_access_although_the_reload_is_refused() {
    let Some(lab) = Lab::start() else { return };
    let mut c = lab.client();
    c.initialize();
    let r = c.call("workspace/list_documents", json!({}));
    assert!(r["error"].is_null(), "{r}");
    let original = std::fs::read_to_string(&lab.config).unwrap();
    let restart_only = original.replacen(
        "classifier_version = \"pricing-lab-1\"",
        "classifier_version = \"pricing-lab-2\"",
        1,
    );
    let narrowed = restart_only.replacen(
        "tools = [\"workspace/*\", \"team-inbox/publish\"",
        "tools = [\"team-inbox/publish\"",
        1,
    );
    assert!(restart_only != original && narrowed != restart_only);
    lab.write_config(&narrowed);
    reload_and_await_refusal(&lab);
    assert!(
        lab.log().contains("principal \"larkfield-analyst\" withdrawn although the reload is refused: tools [\"workspace/*\"] taken from it"),
        "{}",
        lab.log()
    );
    let r = c.call("workspace/list_documents", json!({}));
    assert_eq!(r["error"]["data"]["denial"], "access_denied", "{r}");
    let r = c.call(
        "public-inbox/publish",
        json!({"message": "x", "sink": lab.public.addr.to_string()}),
    );
    assert!(r["error"].is_null(), "{r}");

    let start = narrowed
        .find("[[principal]]\nid = \"larkfield-analyst\"")
        .unwrap();
    let end = start + narrowed[start..].find("\n\n").unwrap();
    let taken_out = format!("{}{}", &narrowed[..start], &narrowed[end + 2..]);
    lab.write_config(&taken_out);
    reload_and_await_refusal(&lab);
    assert!(
        lab.log().contains("principal \"larkfield-analyst\" withdrawn although the reload is refused: taken out of the configuration"),
        "{}",
        lab.log()
    );
    let r = c.call(
        "public-inbox/publish",
        json!({"message": "x", "sink": lab.public.addr.to_string()}),
    );
    assert_eq!(r["error"]["data"]["denial"], "access_denied", "{r}");
}

/// A file refused for something else altogether (an unknown key) still withdraws the
/// server and the principal it no longer holds: before, its lenient read failed on the key
/// and withdrew nothing, and the server the operator took out went on serving.
#[test]
fn what_a_file_refused_for_another_reason_takes_out_is_withdrawn() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    // The team inbox's key, copied where this test may remove it.
    let config = std::fs::read_to_string(&lab.config).unwrap();
    let key = config
        .lines()
        .skip_while(|l| *l != "id = \"team-inbox\"")
        .find_map(|l| l.strip_prefix("key = \""))
        .and_then(|k| k.strip_suffix('"'))
        .unwrap()
        .to_string();
    let copy = lab.dir.path().join("team-inbox.pub");
    std::fs::copy(&key, &copy).unwrap();
    lab.write_config(&config.replacen(&key, copy.to_str().unwrap(), 1));
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let r = c.call("workspace/list_documents", json!({}));
    assert!(r["error"].is_null(), "{r}");
    let original = std::fs::read_to_string(&lab.config).unwrap();
    let start = original.find("[[server]]\nid = \"workspace\"").unwrap();
    let end = start + 1 + original[start + 1..].find("\n[[server]]").unwrap();
    let reviewer_at = original
        .find("[[principal]]\nid = \"oss-reviewer\"")
        .unwrap();
    let reviewer_end = reviewer_at + 1 + original[reviewer_at + 1..].find("\n[[").unwrap();
    let mut taken_out = original.clone();
    taken_out.replace_range(start.max(reviewer_at)..end.max(reviewer_end), "");
    taken_out.replace_range(start.min(reviewer_at)..end.min(reviewer_end), "");
    let taken_out = taken_out.replacen("[host]\n", "[host]\nno_such_key = 1\n", 1);
    assert!(!taken_out.contains("id = \"workspace\"") && !taken_out.contains("oss-reviewer"));
    lab.write_config(&taken_out);
    reload_and_await_refusal(&lab);
    let log = lab.log();
    for withdrawn in [
        "server \"workspace\" withdrawn from service although the reload is refused",
        "principal \"oss-reviewer\" withdrawn although the reload is refused",
    ] {
        assert!(log.contains(withdrawn), "{withdrawn:?} not in:\n{log}");
    }
    let r = c.call("workspace/list_documents", json!({}));
    assert!(
        !r["error"].is_null(),
        "the server taken out still serves: {r}"
    );

    // A mistyped header withdraws nothing (it would read as every principal taken out);
    // a server whose key file was removed is withdrawn (its key no longer vouches for it).
    let mistyped = original.replacen("[[principal]]", "[[principals]]", 1);
    lab.write_config(&mistyped);
    reload_and_await_refusal(&lab);
    assert!(
        !lab.log().contains("\"larkfield-analyst\" withdrawn"),
        "{}",
        lab.log()
    );
    std::fs::remove_file(&copy).unwrap();
    lab.write_config(&format!("{original}\nno_such_key = 1\n"));
    reload_and_await_refusal(&lab);
    assert!(
        lab.log().contains(
            "server \"team-inbox\" withdrawn from service although the reload is refused"
        ),
        "{}",
        lab.log()
    );
}

/// A uid taken out of a principal by a refused reload maps to no principal, rather than to
/// another principal by the peer's gid, which neither configuration gave it; and the
/// natural ways of taking it out (the principal left with no uid, a server taken out while
/// a pattern still names it) withdraw what they take, though the file is refused for them.
/// Before, narrowing left uid 0 to fall through to the reviewer by gid 0 (the reviewer's
/// tools), and a file refused for a dangling reference withdrew nothing at all.
#[test]
fn what_a_refused_reload_takes_out_is_withdrawn_and_falls_through_to_nothing() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let original = std::fs::read_to_string(&lab.config).unwrap();
    // The reviewer is also every member of gid 0 (the client's, uid 0's, group).
    let reviewer = "id = \"oss-reviewer\"\n";
    let with_gid = original.replacen(reviewer, &format!("{reviewer}gids = [0]\n"), 1);
    assert_ne!(with_gid, original);
    lab.write_config(&with_gid);
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let r = c.call("workspace/list_documents", json!({}));
    assert!(r["error"].is_null(), "{r}");

    // The analyst left with no uid, and the workspace server taken out while the analyst's
    // `workspace/*` still names it: the file is refused for both, and both are withdrawn.
    let start = with_gid.find("[[server]]\nid = \"workspace\"").unwrap();
    let end = start + 1 + with_gid[start + 1..].find("\n[[server]]").unwrap();
    let taken_out = format!("{}{}", &with_gid[..start], &with_gid[end..]).replacen(
        "uids = [0]\n",
        "uids = []\n",
        1,
    );
    assert!(taken_out.contains("uids = []") && !taken_out.contains("id = \"workspace\""));
    lab.write_config(&taken_out);
    reload_and_await_refusal(&lab);
    let log = lab.log();
    for withdrawn in [
        "server \"workspace\" withdrawn from service although the reload is refused",
        "principal \"larkfield-analyst\" withdrawn although the reload is refused: uids [0]",
    ] {
        assert!(log.contains(withdrawn), "{withdrawn:?} not in:\n{log}");
    }
    // Uid 0 is no one's now: not the reviewer's by its gid.
    let mut fresh = Client::connect(&lab.paths.socket);
    let r = fresh.request(
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}),
    );
    let r = if r["error"].is_null() {
        fresh.call(
            "public-inbox/publish",
            json!({"message": "x", "sink": lab.public.addr.to_string()}),
        )
    } else {
        r
    };
    assert_eq!(r["error"]["data"]["denial"], "access_denied", "{r}");
}

use common::BROKER_CAPS;

/// `flowhost sandbox run --profile brokered -- ARGV` as uid/gid 990 holding `caps`
/// (inheritable and ambient), with `extra` setpriv options (securebits, no_new_privs).
fn sandbox_as_service_user(caps: &str, extra: &[&str], argv: &[&str]) -> std::process::Output {
    sandbox_as_service_user_with(caps, extra, &[], argv)
}

/// [`sandbox_as_service_user`] with `flags` for `sandbox run` before the command.
fn sandbox_as_service_user_with(
    caps: &str,
    extra: &[&str],
    flags: &[&str],
    argv: &[&str],
) -> std::process::Output {
    let flowhost = shared_copy_of_flowhost();
    Command::new("setpriv")
        .args(["--reuid", "990", "--regid", "990", "--clear-groups"])
        .args(["--inh-caps", caps, "--ambient-caps", caps])
        .args(extra)
        .arg("--")
        .arg(&flowhost)
        .args(["sandbox", "run", "--profile", "brokered"])
        .args(flags)
        .arg("--")
        .args(argv)
        .current_dir("/")
        .output()
        .unwrap()
}

/// The stdout of a run that must have succeeded.
fn succeeded(out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The stderr of a run that must have been refused (exit 2).
fn refused(out: &std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    stderr
}

fn can_act_as_service_user() -> bool {
    if !is_root() || !have("setpriv") {
        eprintln!("SKIP: needs root and setpriv to act as the service user");
        return false;
    }
    true
}

#[test]
fn the_broker_runs_as_a_service_user_with_only_its_capabilities() {
    if !can_act_as_service_user() {
        return;
    }
    let out = sandbox_as_service_user(
        BROKER_CAPS,
        &[],
        &["/bin/sh", "-c", "id -u; grep CapEff /proc/self/status"],
    );
    let stdout = succeeded(&out);
    assert!(stdout.contains("CapEff:\t0000000000000000"), "{stdout}");
    assert!(
        !stdout.starts_with("990\n") && !stdout.starts_with("0\n"),
        "the executor runs as its own uid: {stdout}"
    );
    // A partial grant is refused, naming what is missing.
    let stderr = refused(&sandbox_as_service_user("+sys_admin", &[], &["/bin/true"]));
    assert!(stderr.contains("CAP_SYS_PTRACE"), "{stderr}");
}

/// An executor's wall-clock limit ends it under the unit's capabilities and securebits: the
/// broker signals a process of another uid, which takes CAP_KILL. Before, neither the unit
/// nor the broker's check asked for it, every kill the host sent an executor failed
/// unnoticed (the call deadline, a cancelled call, a stop), and `sandbox run --timeout 1 --
/// sleep 20` ran its 20 s, then said the broker had killed it and exited 0. The broker now
/// refuses to start without CAP_KILL, naming it.
#[test]
fn executors_are_ended_under_the_units_capabilities() {
    if !can_act_as_service_user() {
        return;
    }
    let unit = ["--securebits=+noroot,+noroot_locked", "--no-new-privs"];
    let started = std::time::Instant::now();
    let out = sandbox_as_service_user_with(
        BROKER_CAPS,
        &unit,
        &["--timeout", "1"],
        &["/bin/sleep", "20"],
    );
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        took < std::time::Duration::from_secs(15) && !out.status.success(),
        "took {took:?}, {:?}: {stderr}",
        out.status
    );
    assert!(stderr.contains("wall-clock limit"), "{stderr}");
    let without_kill = BROKER_CAPS.replace(",+kill", "");
    assert_ne!(without_kill, BROKER_CAPS);
    let stderr = refused(&sandbox_as_service_user(
        &without_kill,
        &unit,
        &["/bin/true"],
    ));
    assert!(stderr.contains("CAP_KILL"), "{stderr}");
}

/// What the unit's `NoNewPrivileges=yes` and `SecureBits=noroot noroot-locked` give the
/// service: executors still start (the securebits the broker wants are already set and
/// locked), with no capability and no_new_privs.
#[test]
fn the_broker_runs_under_the_units_securebits_and_no_new_privs() {
    if !can_act_as_service_user() {
        return;
    }
    let out = sandbox_as_service_user(
        BROKER_CAPS,
        &["--securebits=+noroot,+noroot_locked", "--no-new-privs"],
        &[
            "/bin/sh",
            "-c",
            "grep -E 'CapEff|NoNewPrivs' /proc/self/status",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("CapEff:\t0000000000000000"), "{stdout}");
    assert!(stdout.contains("NoNewPrivs:\t1"), "{stdout}");
}

/// `SecureBits=noroot-locked` alone locks noroot *off*: executors cannot be given it, and
/// the refusal names securebits (not the bounding set) and says how to fix the unit.
#[test]
fn securebits_locked_against_the_broker_are_refused_by_name() {
    if !can_act_as_service_user() {
        return;
    }
    let stderr = refused(&sandbox_as_service_user(
        BROKER_CAPS,
        &["--securebits=+noroot_locked", "--no-new-privs"],
        &["/bin/true"],
    ));
    assert!(stderr.contains("securebits"), "{stderr}");
    assert!(!stderr.contains("bounding set"), "{stderr}");
    assert!(
        stderr.contains("SecureBits=noroot noroot-locked"),
        "{stderr}"
    );
}

fn shared_copy_of_flowhost() -> std::path::PathBuf {
    // Copied once per process (concurrent copies to one path make exec fail with ETXTBSY).
    common::shared_copy("flowhost")
}

#[test]
fn make_install_stages_a_verifiable_deployment() {
    if !have("make") {
        panic!("make is missing (.ci/run installs it)");
    }
    let stage = tempfile::tempdir().unwrap();
    let build = Path::new(env!("CARGO_BIN_EXE_flowhost")).parent().unwrap();
    let out = Command::new("make")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("install-files")
        .arg(format!("DESTDIR={}", stage.path().display()))
        .arg("PREFIX=/opt/flowhost")
        .arg(format!("BUILD_DIR={}", build.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let root = stage.path();
    for f in [
        "opt/flowhost/bin/flowhost",
        "opt/flowhost/libexec/flowhost/flowhost-tool-workspace",
        "etc/flowhost/profiles/isolated.toml",
        "etc/flowhost/flowhost.toml.example",
        "etc/systemd/system/flowhost.service",
        "etc/systemd/system/flowhost.socket",
        "usr/lib/sysusers.d/flowhost.conf",
        "usr/lib/tmpfiles.d/flowhost.conf",
        // What the example configuration names: manifests, registered keys, documents.
        "etc/flowhost/workspace.signed.json",
        "etc/flowhost/team-inbox.signed.json",
        "etc/flowhost/public-inbox.signed.json",
        "etc/flowhost/keys/workspace.pub",
        "etc/flowhost/keys/team-inbox.pub",
        "etc/flowhost/keys/public-inbox.pub",
        "opt/flowhost/share/flowhost/documents/harbor-goods-terms.md",
    ] {
        assert!(root.join(f).exists(), "{f} was not installed");
    }
    assert!(
        !root.join("etc/flowhost/keys/workspace.key").exists(),
        "no signing key is installed"
    );
    // The installed example loads and verifies as it stands, with PREFIX's paths, and the
    // daemon uses the installed profiles.
    let example =
        flowhost::config::HostConfig::load(&root.join("etc/flowhost/flowhost.toml.example"))
            .unwrap();
    assert_eq!(example.profiles_dir, [Path::new("/etc/flowhost/profiles")]);
    // Verified with the profiles as installed under DESTDIR (the installed host's
    // /etc/flowhost/profiles), which the daemon requires to be there.
    let mut installed = example.clone();
    installed.profiles_dir = vec![root.join("etc/flowhost/profiles")];
    flowhost::daemon::verify_registry(&installed).unwrap();
    assert_eq!(
        example.servers[0].command[..3],
        [
            "/opt/flowhost/libexec/flowhost/flowhost-tool-workspace",
            "--documents",
            "/opt/flowhost/share/flowhost/documents"
        ]
    );
    let service =
        std::fs::read_to_string(root.join("etc/systemd/system/flowhost.service")).unwrap();
    assert!(
        service.contains("ExecStart=/opt/flowhost/bin/flowhost serve"),
        "PREFIX is honoured"
    );
    // The staged unit verifies once its ExecStart points into the stage.
    let staged = service.replace(
        "/opt/flowhost/bin/flowhost",
        &root.join("opt/flowhost/bin/flowhost").display().to_string(),
    );
    std::fs::write(root.join("etc/systemd/system/flowhost.service"), staged).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(root.join("etc/systemd/system/flowhost.service"))
        .arg(root.join("etc/systemd/system/flowhost.socket"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `flowhost profile check /etc/flowhost/profiles/*.toml`, as the README writes it.
    let profiles = root.join("etc/flowhost/profiles");
    let check = |extra: &[&Path]| {
        Command::new(root.join("opt/flowhost/bin/flowhost"))
            .args(["profile", "check"])
            .arg(profiles.join("brokered.toml"))
            .arg(profiles.join("isolated.toml"))
            .args(extra)
            .output()
            .unwrap()
    };
    let out = check(&[]);
    let stdout = succeeded(&out);
    assert_eq!(stdout.matches("is valid").count(), 2, "{stdout}");
    // One bad file among good ones: every file is checked, the bad one named, exit 2.
    let bad = stage.path().join("bad.toml");
    std::fs::write(&bad, "this is not a profile").unwrap();
    let out = check(&[&bad]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .matches("is valid")
            .count(),
        2
    );
    assert!(refused(&out).contains("bad.toml"));
}

/// What a real boot showed the units need: securebits executors can be given, no restart
/// loop on a refusal to start, a reload `systemctl reload` can fail on, a socket directory
/// members of group flowhost-clients can enter from boot on (and that the service does not
/// hand to its own group at each start), and a stop that lets calls finish.
#[test]
fn the_units_carry_what_a_real_boot_needs() {
    let service = unit("flowhost.service");
    let line = |key: &str| {
        service
            .lines()
            .find(|l| l.starts_with(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key}= in flowhost.service"))
            .to_string()
    };
    assert_eq!(line("SecureBits"), "SecureBits=noroot noroot-locked");
    // A stop must not signal the executors of the calls the daemon is finishing.
    assert_eq!(line("KillMode"), "KillMode=mixed");
    assert_eq!(
        line("RestartPreventExitStatus"),
        "RestartPreventExitStatus=2"
    );
    assert_eq!(
        line("ExecReload"),
        "ExecReload=/usr/local/bin/flowhost reload --pid $MAINPID --state-dir /var/lib/flowhost"
    );
    let dirs = unit("flowhost.tmpfiles.conf");
    assert!(
        dirs.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == [
                    "d",
                    "/run/flowhost",
                    "0750",
                    "flowhost",
                    "flowhost-clients",
                    "-"
                ]),
        "{dirs}"
    );
    assert!(
        !service.lines().any(|l| l.starts_with("RuntimeDirectory")),
        "{service}"
    );
}

/// Runs `flowhost serve --config CONFIG` to its end with stderr in a file, as systemd would
/// start it when `journal` is set (JOURNAL_STREAM names that file). Returns (exit code,
/// stderr, notifications received).
fn serve_until_exit(dir: &Path, config: &Path, journal: bool) -> (Option<i32>, String, String) {
    use std::os::unix::fs::MetadataExt;
    let err_path = dir.join("serve.stderr");
    let err = std::fs::File::create(&err_path).unwrap();
    let meta = err.metadata().unwrap();
    let notify_path = dir.join("serve-notify.sock");
    let _ = std::fs::remove_file(&notify_path);
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_nonblocking(true).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_flowhost"));
    command
        .args(["serve", "--config"])
        .arg(config)
        .env("NOTIFY_SOCKET", &notify_path)
        .stdin(std::process::Stdio::null())
        .stderr(err);
    if journal {
        command.env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()));
    } else {
        command.env_remove("JOURNAL_STREAM");
    }
    let mut child = command.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "the daemon did not exit:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut notes = String::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = notify.recv(&mut buf) {
        notes.push_str(&String::from_utf8_lossy(&buf[..n]));
        notes.push('\n');
    }
    (
        status.code(),
        std::fs::read_to_string(&err_path).unwrap(),
        notes,
    )
}

/// The status of a refusal to start is one line whatever its error holds: a line break in a
/// file's name (or in what an executor answered `initialize` with) gave the service manager
/// settings of its own (`WATCHDOG=trigger` makes systemd kill the host). Before, the text was
/// sent as it was.
#[test]
fn a_refusal_to_start_sends_no_setting_of_its_errors_text() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad\nWATCHDOG=trigger\nMAINPID=1.toml");
    let (code, _, notes) = serve_until_exit(dir.path(), &config, false);
    assert_eq!(code, Some(2));
    assert!(notes.contains("STATUS=refusing to start"), "{notes}");
    assert!(
        !notes
            .lines()
            .any(|l| l.starts_with("WATCHDOG=") || l.starts_with("MAINPID=")),
        "{notes}"
    );
}

#[test]
fn a_refusal_to_start_exits_2_and_reaches_the_journal_at_error_priority() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("missing.toml");
    let (code, stderr, notes) = serve_until_exit(dir.path(), &config, true);
    // RestartPreventExitStatus=2: systemd does not retry a refusal to start.
    assert_eq!(code, Some(2), "{stderr}");
    let fatal: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("flowhost: error:"))
        .collect();
    assert!(!fatal.is_empty(), "{stderr}");
    assert!(
        fatal.iter().all(|l| l.starts_with("<3>")) && fatal[0].contains("missing.toml"),
        "fatal lines carry the journal's err priority and name the file: {stderr}"
    );
    assert!(!notes.contains("READY=1"), "{notes}");
    // Every line of a message spanning several (an error and its cause) carries the
    // priority.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    std::fs::write(
        &config,
        format!(
            "[host]\nsocket = {:?}\nstate_dir = {:?}\nrecords_dir = {:?}\n",
            dir.path().join("s.sock"),
            file.join("state"),
            dir.path().join("records")
        ),
    )
    .unwrap();
    let (code, stderr, _) = serve_until_exit(dir.path(), &config, true);
    assert_eq!(code, Some(2), "{stderr}");
    let from = stderr
        .find("<3>flowhost: error:")
        .unwrap_or_else(|| panic!("{stderr}"));
    let fatal: Vec<&str> = stderr[from..].lines().collect();
    assert!(fatal.len() > 1, "{stderr}");
    assert!(fatal.iter().all(|l| l.starts_with("<3>")), "{stderr}");
    std::fs::remove_file(&config).unwrap();
    // Not under the journal: plain text.
    let (code, stderr, _) = serve_until_exit(dir.path(), &config, false);
    assert_eq!(code, Some(2));
    assert!(stderr.starts_with("flowhost: error:"), "{stderr}");
}

#[test]
fn executors_that_cannot_start_stop_the_start_before_ready() {
    let Some(lab) = Lab::prepare() else { return };
    // The publisher exits at once: every spawn of the two inboxes' executors fails.
    let publisher = common::shared_copy("flowhost-tool-publisher")
        .display()
        .to_string();
    let text = std::fs::read_to_string(&lab.config).unwrap();
    assert!(text.contains(&publisher));
    lab.write_config(&text.replace(&publisher, "/bin/false"));
    let (code, stderr, notes) = serve_until_exit(lab.dir.path(), &lab.config, false);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("server \"public-inbox\"") || stderr.contains("server \"team-inbox\""),
        "the refusal names the server: {stderr}"
    );
    assert!(
        !notes.contains("READY=1"),
        "READY despite failing executors: {notes}"
    );
}

#[test]
fn flowhost_reload_waits_for_the_daemons_verdict() {
    let Some(lab) = Lab::start() else { return };
    let pid = lab.pid().to_string();
    let state = lab.paths.state_dir.display().to_string();
    let reload = |lab: &Lab| lab.cli(&["reload", "--pid", &pid, "--state-dir", &state]);
    let (code, stdout, stderr) = reload(&lab);
    assert_eq!(code, 0, "{stdout}{stderr}{}", lab.log());
    assert!(stdout.contains("reloaded: generation 2"), "{stdout}");
    // A broken configuration: refused, the reason printed, exit 1.
    let original = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config("[host]\nthis is not toml");
    let (code, _, stderr) = reload(&lab);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("reload refused") && stderr.contains("host.toml"),
        "{stderr}"
    );
    // What the refusal quotes (here the file's own line) cannot drive the terminal: before,
    // the verdict was printed as the daemon wrote it.
    lab.write_config("[host]\n\x1b]0;pwned\x07\x1b[2J = 1\n");
    let (code, _, stderr) = reload(&lab);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("reload refused") && !stderr.contains('\x1b') && !stderr.contains('\x07'),
        "{stderr:?}"
    );
    // Fixed again: accepted (a later verdict, not the refusal left in the file).
    lab.write_config(&original);
    let (code, stdout, stderr) = reload(&lab);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("generation 3"), "{stdout}");
    // Accepted while nobody reads stdout: the status is still the verdict (what systemd's
    // ExecReload reads), not the failed print of its message.
    let (unread, nobody) = std::io::pipe().unwrap();
    drop(unread);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flowhost"))
        .args(["reload", "--pid", &pid, "--state-dir", &state])
        .stdout(nobody)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    // A configuration whose executors cannot start (the publisher exits at once) and that
    // drops the public inbox: refused, naming the server, and nothing of it is kept but the
    // withdrawal of the server it takes out.
    let retained = lab.paths.state_dir.join("signed-manifests.json");
    let before = std::fs::read_to_string(&retained).unwrap();
    let start = original.find("[[server]]\nid = \"public-inbox\"").unwrap();
    let publisher = common::shared_copy("flowhost-tool-publisher")
        .display()
        .to_string();
    lab.write_config(
        &original[..start]
            .replace(", \"public-inbox/publish\"", "")
            .replace(&publisher, "/bin/false"),
    );
    let (code, _, stderr) = reload(&lab);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("server \"team-inbox\""), "{stderr}");
    assert!(
        stderr.contains(
            "withdrawn from service although the reload is refused: \
             server \"public-inbox\" (taken out of the configuration)"
        ),
        "{stderr}"
    );
    assert!(
        std::fs::read_to_string(&retained).unwrap() == before,
        "the refused reload replaced the retained signed set"
    );
    let mut c = lab.client();
    c.initialize();
    let tools = tool_names(&mut c);
    assert_eq!(tools.len(), 4, "{tools:?}");
    assert!(!tools.iter().any(|t| t.starts_with("public-inbox/")));
}

/// `flowhost sandbox run --profile brokered -- /bin/true` under a seccomp filter that fails
/// `syscall` with EPERM, as systemd-nspawn's or a unit's filter would.
fn sandbox_with_syscall_filtered(syscall: libc::c_long) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    // Classic BPF: load the syscall number; EPERM for `syscall`, allow everything else.
    let program = [
        libc::sock_filter {
            code: 0x20, // BPF_LD | BPF_W | BPF_ABS: seccomp_data.nr
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: 0x15, // BPF_JMP | BPF_JEQ | BPF_K
            jt: 0,
            jf: 1,
            k: syscall as u32,
        },
        libc::sock_filter {
            code: 0x06, // BPF_RET | BPF_K
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: libc::SECCOMP_RET_ALLOW,
        },
    ];
    let mut command = Command::new(env!("CARGO_BIN_EXE_flowhost"));
    command.args(["sandbox", "run", "--profile", "brokered", "--", "/bin/true"]);
    // SAFETY: between fork and exec only prctl runs, on a program that lives in this
    // (copied) stack frame; prctl is async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            let prog = libc::sock_fprog {
                len: program.len() as u16,
                filter: program.as_ptr() as *mut libc::sock_filter,
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &prog as *const libc::sock_fprog,
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.output().unwrap()
}

/// A filtered call is reported as refused by a filter, not as a kernel too old to have it.
#[test]
fn errors_say_a_filter_refused_what_the_kernel_has() {
    if !is_root() {
        eprintln!("SKIP: the privileged broker needs root");
        return;
    }
    let stderr = refused(&sandbox_with_syscall_filtered(libc::SYS_pidfd_getfd));
    assert!(
        stderr.contains("pidfd_getfd was refused with Operation not permitted")
            && stderr.contains("seccomp filter"),
        "{stderr}"
    );
    assert!(!stderr.contains("or later is required"), "{stderr}");

    let stderr = refused(&sandbox_with_syscall_filtered(
        libc::SYS_landlock_create_ruleset,
    ));
    assert!(
        stderr.contains("landlock_create_ruleset was refused with Operation not permitted")
            && stderr.contains("seccomp filter"),
        "{stderr}"
    );
    assert!(!stderr.contains("this kernel does not offer"), "{stderr}");
}

/// Health stays honest after READY: once a server's executors stop starting (here its
/// program disappears), `flowhost/health` is incomplete with broker_active false, and it
/// recovers when they start again.
#[test]
fn health_is_incomplete_while_a_servers_executors_cannot_start() {
    let Some(mut lab) = Lab::prepare() else {
        return;
    };
    let shared = common::shared_copy("flowhost-tool-publisher");
    let private_dir = common::shared_dir().join(format!("publisher-{}", std::process::id()));
    std::fs::create_dir_all(&private_dir).unwrap();
    let private = private_dir.join("flowhost-tool-publisher");
    let copy = || {
        let status = Command::new("cp")
            .arg(&shared)
            .arg(&private)
            .status()
            .unwrap();
        assert!(status.success());
    };
    copy();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&private_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = std::fs::read_to_string(&lab.config).unwrap();
    lab.write_config(&text.replace(
        &shared.display().to_string(),
        &private.display().to_string(),
    ));
    lab.spawn();
    let mut c = lab.client();
    c.initialize();
    let health = |c: &mut Client| c.request("flowhost/health", json!({}))["result"].clone();
    assert_eq!(health(&mut c)["broker_active"], true, "{}", lab.log());

    std::fs::remove_file(&private).unwrap();
    // A call takes a warm executor; the pool's refill then fails.
    c.call(
        "public-inbox/publish",
        json!({"message": "x", "sink": lab.public.addr.to_string()}),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let h = health(&mut c);
        if h["broker_active"] == false {
            assert_eq!(h["complete"], false, "{h}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "health stayed {h}:\n{}",
            lab.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The line follows the failure it reports (health can flip a moment before it is written);
    // the cause is its escaped `error` field, beside the server and the program.
    let deadline = Instant::now() + Duration::from_secs(5);
    let says_why = |log: &str| {
        log.lines().any(|l| {
            l.contains("cannot start a warm executor of server \"public-inbox\"")
                && l.contains("error=cannot start the executor")
                && l.contains("does not exist")
        })
    };
    while !says_why(&lab.log()) {
        assert!(
            Instant::now() < deadline,
            "the log line says why: {}",
            lab.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // The program is back: the next start (a new session acquires an executor, and the
    // pool refills) succeeds and health recovers.
    copy();
    // Each new session's calls acquire executors: once the warm ones are used up, a call starts
    // one itself, and a start that succeeds clears its server's failure.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut c = lab.client();
        c.initialize();
        // Both servers run the program (a refill of either may have failed while it was
        // missing), so both are called.
        c.call(
            "public-inbox/publish",
            json!({"message": "y", "sink": lab.public.addr.to_string()}),
        );
        c.call(
            "team-inbox/publish",
            json!({"message": "y", "sink": lab.team.addr.to_string()}),
        );
        if health(&mut c)["broker_active"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "{}", lab.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    lab.stop();
    let _ = std::fs::remove_dir_all(&private_dir);
}

/// `systemd-socket-activate` listening on `socket` for a daemon whose configuration (in
/// `dir`) is missing, so that it refuses to start.
/// Whether a Unix socket bound at `path` is listening (`/proc/net/unix` flags it
/// `__SO_ACCEPTCON`, 0x10000).
fn listening(path: &Path) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return false;
    };
    let path = path.to_string_lossy();
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() >= 8
            && fields[7] == path
            && u32::from_str_radix(fields[3], 16).is_ok_and(|flags| flags & 0x10000 != 0)
    })
}

fn activate_a_refusing_daemon(socket: &Path, dir: &Path) -> std::process::Child {
    Command::new("systemd-socket-activate")
        .arg("-l")
        .arg(socket)
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_flowhost"))
        .args(["serve", "--log-format", "text", "--config"])
        .arg(dir.join("missing.toml"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// The connection that activated a daemon which then refuses to start gets an answer at
/// once (a JSON-RPC error pointing at the operator's log), not a hang until its timeout.
#[test]
fn a_client_that_activated_a_refusing_daemon_is_answered() {
    assert!(
        have("systemd-socket-activate"),
        "systemd-socket-activate is missing (.ci/run installs systemd)"
    );
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("activated.sock");
    let mut activator = activate_a_refusing_daemon(&socket, dir.path());
    let deadline = Instant::now() + Duration::from_secs(10);
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&socket) {
            break s;
        }
        assert!(Instant::now() < deadline, "the activator did not listen");
        std::thread::sleep(Duration::from_millis(20));
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut line = String::new();
    let read = std::io::BufRead::read_line(&mut std::io::BufReader::new(&stream), &mut line);
    let _ = activator.kill();
    let _ = activator.wait();
    read.unwrap();
    let answer: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(answer["error"]["code"], -32603, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("refused to start"),
        "{answer}"
    );
}

/// The same through the real client, `flowhost connect`, which sends its request at once:
/// the refusing daemon closed with that request unread, the kernel then reported the
/// connection reset to the client, and the client lost the answer it had already received
/// (seen in the booted-systemd test as "Connection reset by peer" and no answer).
#[test]
fn flowhost_connect_that_activated_a_refusing_daemon_prints_its_answer() {
    assert!(
        have("systemd-socket-activate"),
        "systemd-socket-activate is missing (.ci/run installs systemd)"
    );
    for round in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("activated.sock");
        let mut activator = activate_a_refusing_daemon(&socket, dir.path());
        let deadline = Instant::now() + Duration::from_secs(10);
        // Listening, not only bound: a connect between the two is refused. A probe connect
        // would activate the daemon, so the kernel's socket table is read instead.
        while !listening(&socket) {
            assert!(Instant::now() < deadline, "the activator did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut client = Command::new(env!("CARGO_BIN_EXE_flowhost"))
            .args(["connect", "--socket"])
            .arg(&socket)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(
            client.stdin.as_mut().unwrap(),
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n",
        )
        .unwrap();
        drop(client.stdin.take());
        let out = client.wait_with_output().unwrap();
        let _ = activator.kill();
        let _ = activator.wait();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("refused to start"),
            "round {round}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
