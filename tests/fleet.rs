//! A fleet sharing its flow state on a real PostgreSQL server (Debian's packages, started
//! here in a temporary directory on loopback, as `nobody`): the store's promises across
//! hosts, two real daemons sharing one database, and the database failing under load.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::lab::Lab;
use flowhost::ident::PrincipalId;
use flowhost::lab::postgres::{Postgres, with_host_setting};
use flowhost::label::InformationLabel;
use flowhost::state::postgres::{PostgresStore, migrate};
use flowhost::state::{FlowStateStore, SessionKey};
use serde_json::{Value, json};

/// A fresh server, or `None` with the reason printed where it cannot run (CI runs as root
/// with the `postgresql` package installed, so there it always runs).
fn postgres() -> Option<Postgres> {
    Postgres::start_unless_unavailable().expect("PostgreSQL did not start")
}

const TERMS: &str = "harbor-goods-terms.md";
const ANALYST: &str = "larkfield-analyst";

fn compartment(c: &str) -> InformationLabel {
    let o = PrincipalId::new("larkfield").unwrap();
    InformationLabel::try_known(
        BTreeMap::from([(o.clone(), BTreeSet::from([o]))]),
        BTreeSet::from([flowhost::ident::Compartment::new(c).unwrap()]),
    )
    .unwrap()
}

fn key(p: &str, s: &str) -> SessionKey {
    SessionKey {
        principal: PrincipalId::new(p).unwrap(),
        session: s.into(),
    }
}

async fn open(pg: &Postgres, host: &str) -> FlowStateStore {
    FlowStateStore::with_backend(Box::new(
        PostgresStore::open(&pg.settings(host)).await.unwrap(),
    ))
}

/// A direct connection, for what the tests inspect or break on purpose.
async fn raw(pg: &Postgres) -> tokio_postgres::Client {
    pg.client().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_store_keeps_its_promises_across_hosts() {
    let Some(pg) = postgres() else { return };
    // No schema yet: a host refuses to start, naming the database but not the password.
    let err = PostgresStore::open(&pg.settings("a")).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("holds no flowhost schema"), "{text}");
    assert!(
        text.contains(&format!("127.0.0.1:{}/postgres", pg.port)),
        "{text}"
    );
    let password = std::fs::read_to_string(&pg.password_file).unwrap();
    assert!(!text.contains(password.trim()), "{text}");

    let report = migrate(&pg.settings("a")).await.unwrap();
    assert_eq!((report.from, report.to), (None, 1));
    let again = migrate(&pg.settings("b")).await.unwrap();
    assert_eq!(again.from, Some(1), "migrating twice changes nothing");

    let (a, b) = (
        Arc::new(open(&pg, "host-a").await),
        Arc::new(open(&pg, "host-b").await),
    );
    // Concurrent raises of one principal from two hosts, each adding its own compartment:
    // every one survives (the join runs under the row lock, not in either host).
    let mut tasks = Vec::new();
    for i in 0..24 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            store
                .join(
                    &key(ANALYST, &format!("s{i}")),
                    &compartment(&format!("c{i}")),
                )
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut all = InformationLabel::bottom();
    for i in 0..24 {
        all = all.join_or_top(&compartment(&format!("c{i}")));
    }
    for store in [&a, &b] {
        let held = store.get(&key(ANALYST, "new")).await.unwrap();
        assert_eq!(held.principal, all, "a raise was lost");
        // A session's label is its host's own.
        assert!(held.session.is_bottom());
    }
    // Joining something lower never lowers the label.
    let st = b
        .join(&key(ANALYST, "s1"), &compartment("c1"))
        .await
        .unwrap();
    assert_eq!(st.principal, all);

    // A grant used on one host is a replay on every other.
    assert!(a.consume_grant("g-1", 10).await.unwrap());
    assert!(!b.consume_grant("g-1", 11).await.unwrap());
    assert!(!a.consume_grant("g-1", 12).await.unwrap());

    // Each host keeps its own records checkpoint.
    a.set_checkpoint(7, "aaaa").await.unwrap();
    b.set_checkpoint(3, "bbbb").await.unwrap();
    assert_eq!(a.checkpoint().await.unwrap(), Some((7, "aaaa".into())));
    assert_eq!(b.checkpoint().await.unwrap(), Some((3, "bbbb".into())));

    // The database goes away: every operation fails (never answers bottom), and the store
    // reports why; when it is back, the next operation reconnects.
    pg.crash().unwrap();
    let err = a.get(&key(ANALYST, "x")).await.unwrap_err().to_string();
    assert!(err.contains("flow-state database"), "{err}");
    assert!(a.join(&key("bob", "x"), &compartment("c0")).await.is_err());
    assert!(b.consume_grant("g-2", 13).await.is_err());
    assert!(a.failure().is_some());
    // A host cannot start on a database it cannot reach.
    let err = PostgresStore::open(&pg.settings("c"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot connect") && err.contains(&format!(":{}/postgres", pg.port)),
        "{err}"
    );
    pg.resume().unwrap();
    assert_eq!(
        a.get(&key(ANALYST, "x")).await.unwrap().principal,
        all,
        "nothing was lowered by the outage"
    );
    assert!(a.failure().is_none());
    assert!(b.consume_grant("g-2", 14).await.unwrap());

    // A schema this build does not know: hosts refuse to start, migrate leaves it alone.
    raw(&pg)
        .await
        .execute("UPDATE flowhost_schema SET version = 99", &[])
        .await
        .unwrap();
    let err = PostgresStore::open(&pg.settings("a"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("schema version 99"), "{err}");
    let err = migrate(&pg.settings("a")).await.unwrap_err().to_string();
    assert!(err.contains("99 is newer"), "{err}");
}

/// A database that comes back lower than a host has seen it (a failover to a lagging
/// replica, a restore) is refused, not trusted: judged against the lower label, a call the
/// higher one refuses would go out. The host writes the label back, for the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_lower_than_this_host_has_seen_is_refused() {
    let Some(pg) = postgres() else { return };
    migrate(&pg.settings("a")).await.unwrap();
    let a = open(&pg, "a").await;
    let k = key(ANALYST, "s");
    a.raise(&k, &compartment("c1"), &compartment("c1"))
        .await
        .unwrap();
    // The database loses the raise behind the host's back (a failover, a restore).
    let lower = || async {
        let restored = InformationLabel::bottom().to_canonical_json();
        raw(&pg)
            .await
            .execute(
                "UPDATE principal_labels SET label = $1 WHERE principal = $2",
                &[&restored, &ANALYST],
            )
            .await
            .unwrap();
    };
    lower().await;
    let err = a.get(&k).await.unwrap_err().to_string();
    assert!(
        err.contains("lower than this host has seen") && err.contains(ANALYST),
        "{err}"
    );
    // The host wrote back what it had seen: a host that never saw the raise reads it, and
    // this one serves again.
    let b = open(&pg, "b").await;
    assert_eq!(
        b.get(&key(ANALYST, "t")).await.unwrap().principal,
        compartment("c1")
    );
    assert_eq!(a.get(&k).await.unwrap().principal, compartment("c1"));
    // Lowered again: refused again, the raise that found it included.
    lower().await;
    let err = a
        .raise(&k, &InformationLabel::bottom(), &InformationLabel::bottom())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("lower than this host has seen"), "{err}");
    // Lowered again, then found by a raise whose join puts the label back as it was: the
    // loss is found all the same. Before, the join was what was checked, so it passed.
    assert_eq!(a.get(&k).await.unwrap().principal, compartment("c1"));
    lower().await;
    let err = a
        .raise(&k, &compartment("c1"), &compartment("c1"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("lower than this host has seen"), "{err}");
}

/// Two lab daemons (own sockets, state and record directories) sharing `pg`.
fn fleet(pg: &Postgres) -> (Lab, Lab) {
    let labs: Vec<Lab> = ["host-a", "host-b"]
        .iter()
        .map(|host| {
            let lab = Lab::prepare().expect("root was checked with the database");
            let text = std::fs::read_to_string(&lab.config).unwrap();
            lab.write_config(&with_host_setting(&text, &pg.state_setting(host)));
            lab
        })
        .collect();
    // Before the schema exists a host refuses to start, naming the database, never the
    // password.
    let out = labs[0].serve_command().output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("holds no flowhost schema")
            && stderr.contains(&format!("127.0.0.1:{}/postgres", pg.port)),
        "{stderr}"
    );
    let password = std::fs::read_to_string(&pg.password_file).unwrap();
    assert!(!stderr.contains(password.trim()), "{stderr}");
    let (code, out, err) = labs[0].cli(&[
        "state",
        "migrate",
        "--config",
        labs[0].config.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("created flowhost schema version 1"), "{out}");
    let mut labs = labs.into_iter();
    let (mut a, mut b) = (labs.next().unwrap(), labs.next().unwrap());
    a.spawn();
    b.spawn();
    (a, b)
}

fn denial(r: &Value) -> (i64, String) {
    (
        r["error"]["code"].as_i64().unwrap_or(0),
        r["error"]["data"]["denial"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

fn publish_publicly(lab: &Lab, c: &mut common::lab::Client) -> Value {
    c.call(
        "public-inbox/publish",
        json!({"message": "a public note", "sink": lab.public.addr.to_string()}),
    )
}

/// Records of decisions refused for `denial` (a refusal before dispatch names it as its
/// denial kind; an allowed call whose output was withheld names it as its outcome).
fn denied(lab: &Lab, denial: &str) -> Vec<Value> {
    lab.records()
        .into_iter()
        .filter(|r| r["flowhost"]["denial_kind"] == denial || r["response"]["status"] == denial)
        .collect()
}

#[test]
fn a_principal_that_read_on_one_host_cannot_publish_from_another() {
    let Some(pg) = postgres() else { return };
    let (mut a, mut b) = fleet(&pg);
    // Before any read, B lets the analyst publish publicly.
    let mut cb = b.client();
    cb.initialize();
    let r = publish_publicly(&b, &mut cb);
    assert!(r.get("result").is_some(), "{r}\n{}", b.log());

    let mut ca = a.client();
    ca.initialize();
    let r = ca.call("workspace/read_terms", json!({"document": TERMS}));
    assert!(r["result"]["isError"] != json!(true), "{r}");

    // The same principal on host B, in a session that never read anything there.
    let mut cb = b.client();
    cb.initialize();
    let r = publish_publicly(&b, &mut cb);
    assert_eq!(denial(&r), (-32011, "flow_violation".into()), "{r}");
    a.stop();
    b.stop();
    let refused = denied(&b, "flow_violation");
    assert_eq!(refused.len(), 1, "{refused:#?}");
    assert_eq!(refused[0]["flowhost"]["principal"], ANALYST);
    // Each host's records still verify on their own, and each restarts bound to them.
    a.spawn();
    b.spawn();
}

#[derive(Default)]
struct Burst {
    ok: usize,
    state_failures: usize,
    other: Vec<Value>,
}

/// Calls `tool` on `lab` until `stop`, sorting every answer; `served` counts the calls
/// served.
fn burst(
    lab: &Lab,
    tool: &'static str,
    args: Value,
    stop: Arc<AtomicBool>,
    served: &AtomicUsize,
) -> Burst {
    let mut c = lab.client();
    c.initialize();
    let mut out = Burst::default();
    while !stop.load(Ordering::SeqCst) {
        let r = c.call(tool, args.clone());
        // A result, even a tool error, is a call the host served.
        if r["result"].is_object() {
            out.ok += 1;
            served.fetch_add(1, Ordering::SeqCst);
        } else if denial(&r) == (-32603, "state_failure".into()) {
            out.state_failures += 1;
        } else {
            out.other.push(r);
        }
    }
    out
}

#[test]
fn a_database_outage_refuses_and_records_every_call_then_service_resumes() {
    let Some(pg) = postgres() else { return };
    let (mut a, mut b) = fleet(&pg);
    let stop = Arc::new(AtomicBool::new(false));
    let served = [AtomicUsize::new(0), AtomicUsize::new(0)];
    let (bursts, after) = std::thread::scope(|s| {
        let ta = s.spawn(|| {
            burst(
                &a,
                "workspace/read_terms",
                json!({"document": TERMS}),
                stop.clone(),
                &served[0],
            )
        });
        let tb = s.spawn(|| {
            burst(
                &b,
                "workspace/read_terms",
                json!({"document": TERMS}),
                stop.clone(),
                &served[1],
            )
        });
        // Both hosts serve calls, then the database crashes under them.
        let deadline = Instant::now() + Duration::from_secs(20);
        while served.iter().any(|n| n.load(Ordering::SeqCst) < 3) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        pg.crash().unwrap();
        // While it is down, every call on either host is refused with the state failure.
        let mut during = Vec::new();
        for lab in [&a, &b] {
            let mut c = lab.client();
            c.initialize();
            for _ in 0..3 {
                during.push(c.call("workspace/list_documents", json!({})));
            }
            let r = publish_publicly(lab, &mut c);
            during.push(r);
        }
        std::thread::sleep(Duration::from_millis(300));
        pg.resume().unwrap();
        stop.store(true, Ordering::SeqCst);
        let bursts = [ta.join().unwrap(), tb.join().unwrap()];
        (bursts, during)
    });
    for r in &after {
        assert_eq!(denial(r), (-32603, "state_failure".into()), "{r}");
    }
    for (host, burst) in ["a", "b"].iter().zip(&bursts) {
        assert!(burst.other.is_empty(), "host {host}: {:#?}", burst.other);
        assert!(burst.ok > 0, "host {host} served nothing before the outage");
    }
    // Service resumes on both hosts once the database is back.
    for lab in [&a, &b] {
        let mut c = lab.client();
        c.initialize();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = c.call("workspace/list_documents", json!({}));
            if r["result"].is_object() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no service after the outage: {r}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Nothing was lowered: the terms both hosts' calls carried still bar a public post.
        let r = publish_publicly(lab, &mut c);
        assert_eq!(denial(&r), (-32011, "flow_violation".into()), "{r}");
    }
    // Every refusal is in the records of the host that refused it.
    a.stop();
    b.stop();
    for (lab, burst, deterministic) in [(&a, &bursts[0], 4), (&b, &bursts[1], 4)] {
        let recorded = denied(lab, "state_failure").len();
        assert_eq!(
            recorded,
            burst.state_failures + deterministic,
            "refused: {} in the burst, {deterministic} after",
            burst.state_failures
        );
    }

    // SIGKILL a daemon mid-burst: every label its records prove is in the database (the
    // restart's continuity check compares them), and the principal's label still bars a
    // public post.
    a.spawn();
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let socket = a.paths.socket.clone();
        let stop = &stop;
        let t = s.spawn(move || {
            // Arguments that pass the signed schema (a schema failure is a tool error that
            // reaches no executor), and a raw client: the kill ends the connection mid-call.
            let mut raw = flowhost::lab::Client::connect(&socket).unwrap();
            raw.request(
                "initialize",
                json!({"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}),
            )
            .unwrap();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let Ok(r) = raw.call(
                    "workspace/summarize_terms",
                    json!({"text": format!("Harbor Goods note {n}"), "max_words": 10}),
                ) else {
                    break;
                };
                if r.get("result").is_none() || r["result"]["isError"] == true {
                    break;
                }
                n += 1;
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        a.kill9();
        stop.store(true, Ordering::SeqCst);
        t.join().unwrap();
    });
    a.spawn();
    let mut c = a.client();
    c.initialize();
    let r = publish_publicly(&a, &mut c);
    assert_eq!(denial(&r), (-32011, "flow_violation".into()), "{r}");
}

/// Runs `openssl` with `args` in `dir`.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a server certificate for 127.0.0.1 signed by it (and a second, unrelated CA).
fn certificates(dir: &std::path::Path) {
    for ca in ["ca", "other-ca"] {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=flowhost test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
            ],
        );
    }
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.crt",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_ca_file_the_connection_is_tls_and_the_server_is_authenticated() {
    let Some(mut pg) = postgres() else { return };
    if std::process::Command::new("openssl")
        .arg("version")
        .output()
        .is_err()
    {
        eprintln!("SKIP: no openssl to make the test certificates");
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    certificates(certs.path());
    pg.restart_with_tls(
        &certs.path().join("server.crt"),
        &certs.path().join("server.key"),
    )
    .unwrap();
    let mut settings = pg.settings("tls");
    settings.ca_file = Some(certs.path().join("ca.pem"));
    let report = migrate(&settings).await.unwrap();
    assert_eq!(report.from, None);
    let store = PostgresStore::open(&settings).await.unwrap();
    let store = FlowStateStore::with_backend(Box::new(store));
    store
        .join(&key(ANALYST, "s"), &compartment("c1"))
        .await
        .unwrap();
    // The server must prove itself with the configured roots: another CA is refused.
    settings.ca_file = Some(certs.path().join("other-ca.pem"));
    let err = PostgresStore::open(&settings)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot connect"), "{err}");
    // The connection really is TLS: the server reports it for flowhost's session.
    let ssl: bool = {
        let url = std::fs::read_to_string(&pg.url_file).unwrap();
        let password = std::fs::read_to_string(&pg.password_file).unwrap();
        let mut config: tokio_postgres::Config = url.trim().parse().unwrap();
        config.password(password.trim());
        let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
            .query_one(
                "SELECT bool_and(ssl) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
                 WHERE application_name = 'flowhost'",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    };
    assert!(ssl, "flowhost's connection is not TLS");
    drop(store);
}

/// What root writes for the lab's server (the URL and password files) sits where the
/// server's user cannot replace it; the server's own files are in a directory it owns, and
/// the password initdb read is gone.
#[test]
fn the_lab_servers_secrets_are_roots_and_its_files_the_servers() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let Some(pg) = postgres() else {
        return;
    };
    let meta = |p: &std::path::Path| std::fs::symlink_metadata(p).unwrap();
    let top = meta(pg.dir());
    assert_eq!((top.uid(), top.permissions().mode() & 0o777), (0, 0o755));
    for secret in [&pg.url_file, &pg.password_file] {
        let m = meta(secret);
        assert_eq!(secret.parent(), Some(pg.dir()));
        assert_eq!((m.uid(), m.permissions().mode() & 0o777), (0, 0o600));
    }
    assert!(!pg.dir().join("initdb-password").exists());
    let server = meta(&pg.dir().join("server"));
    assert_eq!(
        (server.uid(), server.permissions().mode() & 0o777),
        (65534, 0o700)
    );
    let password = std::fs::read_to_string(&pg.password_file).unwrap();
    assert_eq!(password.trim().len(), 48, "24 random bytes, in hex");
}
