//! What one run under the harness left behind, read back from its decision records: the
//! records themselves, the egress attempts as typed values, and the health; with the checks
//! tool authors assert on.

use std::path::{Path, PathBuf};

use super::HarnessError;
use super::gate;
use crate::destination::{Destination as RuleDestination, DestinationRule};
use crate::diff::DiffReport;
use crate::diff::surface::DeclaredSurface;
use crate::model::decision::Failure;
use crate::records::chain::{Gather, verify_records, verify_records_gathering};
use crate::records::{
    DecisionRecord, DeclarationMismatch, Destination, Effect, EventKind, ToolObservationHealth,
};

/// One outbound attempt the broker intercepted, as its record states it.
#[derive(Debug, Clone, PartialEq)]
pub struct EgressAttempt {
    /// The record's sequence number.
    pub seq: u64,
    /// The tool whose call the executor was serving (`server/tool`), or what `sandbox run`
    /// named the command.
    pub tool: String,
    /// The intercepted syscall (`connect`, `sendto`, ...).
    pub syscall: String,
    /// The socket family (`inet`, `inet6`, `unix`, ...).
    pub family: String,
    /// The protocol (`tcp`, `udp`, ...), when known.
    pub protocol: Option<String>,
    /// Where it was going, when the operation names or implies a destination.
    pub destination: Option<Destination>,
    /// Whether the broker let it happen.
    pub allowed: bool,
    /// The rule that decided, when one did (`allow 127.0.0.1:8080`, `default`, ...).
    pub rule: Option<String>,
    /// The process that tried.
    pub pid: u32,
    /// Its executable, when it could be read.
    pub executable: Option<String>,
    /// The tool's signed declaration says it does not egress.
    pub undeclared: bool,
}

impl EgressAttempt {
    fn from_record(r: &DecisionRecord) -> Option<EgressAttempt> {
        if r.flowhost.event != EventKind::EgressAttempt {
            return None;
        }
        let broker = r.flowhost.broker.as_ref()?;
        Some(EgressAttempt {
            seq: r.flowhost.seq,
            tool: r.tool.name.clone(),
            syscall: broker.syscall.clone(),
            family: broker.family.clone(),
            protocol: broker.protocol.clone(),
            destination: broker.destination.clone(),
            allowed: r.decision.effect == Effect::Allow,
            rule: r.decision.rule_id.clone(),
            pid: broker.pid,
            executable: broker.executable.clone(),
            undeclared: r.flowhost.declaration_mismatch
                == Some(DeclarationMismatch::UndeclaredEgress),
        })
    }

    /// The destination as `ADDR:PORT`, `unix:PATH`, or a description.
    pub fn destination_text(&self) -> String {
        match &self.destination {
            None => "(no destination)".into(),
            Some(Destination::Inet(i)) => std::net::SocketAddr::new(i.address, i.port).to_string(),
            Some(Destination::Unix(u)) => format!("unix:{}", u.unix_path),
            Some(Destination::Netlink(n)) => format!("netlink:{}", n.netlink_port_id),
            Some(Destination::Undecoded(u)) => u.undecoded.clone(),
        }
    }

    /// Whether `rule` names this attempt's destination; fails, naming the record, when a
    /// host name recorded for it does not parse (the rules could not be judged as the host
    /// judged them). A name lookup is named by the rules that name its name (on any port,
    /// as the host decides lookups), never by one naming the resolver's address or port 53:
    /// what a lookup reaches is the name, and one without a name is named by none.
    pub fn matches(&self, rule: &DestinationRule) -> Result<bool, HarnessError> {
        if self.syscall == crate::records::DNS_QUERY_SYSCALL {
            let Some(Destination::Inet(i)) = &self.destination else {
                return Ok(false);
            };
            let Some(name) = i.host_name.as_deref() else {
                return Ok(false);
            };
            let name = name.parse::<crate::destination::HostName>().map_err(|e| {
                HarnessError::Check(format!(
                    "record seq {}: host_name {name:?} is not a host name: {e}",
                    self.seq
                ))
            })?;
            return Ok(rule.names(&name));
        }
        let d = rule_destination(self.destination.as_ref())
            .map_err(|e| HarnessError::Check(format!("record seq {}: {e}", self.seq)))?;
        Ok(d.is_some_and(|d| rule.matches(&d)))
    }
}

/// The rules' view of a recorded destination (`None`: nothing a rule can name); fails when
/// its `host_name` or one of its `other_host_names` is not a host name.
fn rule_destination(d: Option<&Destination>) -> Result<Option<RuleDestination>, String> {
    let Some(d) = d else {
        return Ok(None);
    };
    let parse = |field: &str, n: &str| {
        n.parse::<crate::destination::HostName>()
            .map_err(|e| format!("{field} {n:?} is not a host name: {e}"))
    };
    Ok(Some(match d {
        Destination::Inet(i) => {
            let addr = std::net::SocketAddr::new(i.address, i.port);
            // An address the host handed out for names: host-name rules name it too.
            match i.host_name.as_deref() {
                Some(name) => RuleDestination::Named {
                    addr,
                    name: parse("host_name", name)?,
                    also: i
                        .other_host_names
                        .iter()
                        .map(|n| parse("other_host_names", n))
                        .collect::<Result<_, _>>()?,
                },
                None => RuleDestination::Inet(addr),
            }
        }
        Destination::Unix(u) => match u.unix_path.strip_prefix('@') {
            Some(name) => RuleDestination::UnixAbstract(name.as_bytes().to_vec()),
            None => RuleDestination::UnixPath(PathBuf::from(&u.unix_path)),
        },
        Destination::Netlink(n) => RuleDestination::Netlink {
            port_id: n.netlink_port_id,
        },
        Destination::Undecoded(_) => return Ok(None),
    }))
}

/// Everything one run under the harness produced. The record directory lives as long as
/// the observation (or until [`Observation::keep`]).
#[derive(Debug)]
pub struct Observation {
    /// The exit status of `flowhost` (the command's own, 128 + signal when it was killed).
    pub status: std::process::ExitStatus,
    /// What the command (or the MCP server's host) wrote to stdout, when captured.
    pub stdout: String,
    /// What `flowhost` and the command wrote to stderr.
    pub stderr: String,
    /// Every decision record, in chain order: the records verified (sequence, hash chain,
    /// head anchor, no torn line) and each was strictly decoded and validated when read.
    pub records: Vec<DecisionRecord>,
    /// The egress attempts among them.
    pub attempts: Vec<EgressAttempt>,
    /// The run's `tool_observation_health`.
    pub health: ToolObservationHealth,
    /// The verified records' last sequence number and head hash, which the health must
    /// end at.
    head: Head,
    /// Why the host that served the run failed it, when it did (an MCP server's
    /// `flowhost sandbox mcp` exiting non-zero): the evidence checks then fail.
    host_failed: Option<String>,
    records_dir: PathBuf,
    health_file: PathBuf,
    /// Taken (kept on disk) by [`Observation::keep`], or when an `assert_*` fails: its
    /// message names files in it.
    workspace: std::sync::Mutex<Option<tempfile::TempDir>>,
}

impl Observation {
    /// Reads what a run left in `records_dir` and `health_file`; the workspace holding them
    /// is removed when the observation is dropped. Records that do not verify are refused
    /// ([`read_records`]); when anything cannot be read, the workspace is kept for the
    /// error's reader to look at, and the error says where.
    pub(super) fn read(
        status: std::process::ExitStatus,
        stdout: String,
        stderr: String,
        records_dir: PathBuf,
        health_file: PathBuf,
        workspace: tempfile::TempDir,
    ) -> Result<Observation, HarnessError> {
        let read = ToolObservationHealth::read_from(&health_file)
            .map_err(|e| {
                HarnessError::Run(format!(
                    "flowhost ended with {status} and left no readable health ({e}); it said:\n{}",
                    super::shown(&stderr)
                ))
            })
            .and_then(|health| Ok((health, read_verified(&records_dir)?)));
        let (health, (records, head)) = match read {
            Ok(read) => read,
            Err(e) => {
                let kept = workspace.keep();
                return Err(match e {
                    HarnessError::Run(message) => HarnessError::Run(format!(
                        "{message}\n(the run's records and health are kept in {})",
                        kept.display()
                    )),
                    other => other,
                });
            }
        };
        let attempts = records
            .iter()
            .filter_map(EgressAttempt::from_record)
            .collect();
        Ok(Observation {
            status,
            stdout,
            stderr,
            records,
            attempts,
            health,
            head,
            host_failed: None,
            records_dir,
            health_file,
            workspace: std::sync::Mutex::new(Some(workspace)),
        })
    }

    /// The record directory (the daemon's layout: `flowhost records verify` and
    /// `flowhost diff --observed` take it).
    pub fn records_dir(&self) -> &Path {
        &self.records_dir
    }

    /// The health file written at the end of the run.
    pub fn health_file(&self) -> &Path {
        &self.health_file
    }

    /// Keeps the record directory and health file after the observation is dropped (to
    /// publish them as CI artifacts); returns the directory holding both.
    pub fn keep(&mut self) -> Option<PathBuf> {
        // A poisoned lock still holds the whole value (it is only ever taken whole).
        let workspace = self.workspace.get_mut().unwrap_or_else(|p| p.into_inner());
        workspace.take().map(tempfile::TempDir::keep)
    }

    /// Keeps the workspace for a failed assertion, whose message names files in it.
    fn keep_for_failure(&self) -> Option<PathBuf> {
        let mut workspace = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        workspace.take().map(tempfile::TempDir::keep)
    }

    /// The run succeeded: `flowhost` exited 0.
    pub fn check_success(&self) -> Result<(), HarnessError> {
        if self.status.success() {
            return Ok(());
        }
        Err(HarnessError::Check(format!(
            "the run ended with {}; stderr:\n{}",
            self.status,
            super::shown(&self.stderr)
        )))
    }

    /// The records verify (sequence, hash chain, head anchor, no torn line) as they are on
    /// disk now, and the health says observation was complete.
    pub fn check_complete(&self) -> Result<(), HarnessError> {
        let report = verify_records(&self.records_dir, None).map_err(HarnessError::Records)?;
        if !report.is_ok() {
            return Err(HarnessError::Unverified {
                dir: self.records_dir.clone(),
                problems: report.problems.iter().map(ToString::to_string).collect(),
            });
        }
        self.check_health_complete()
    }

    /// The health says observation was complete, was written as the run ended, and ends
    /// where the records do. (The records were verified when they were read: see
    /// [`Observation::read`].) A health asked for while the run went on (and left in place
    /// when the final one could not be written) says nothing of what came after it.
    /// This observation of a run `flowhost sandbox mcp` served, whose exit status is the
    /// host's own: one that is not success failed the run (a session the host ended early,
    /// a stop that did not complete), and no evidence check passes on it, whatever its
    /// health file says.
    pub(super) fn of_mcp_host(mut self) -> Self {
        if !self.status.success() {
            self.host_failed = Some(format!(
                "flowhost sandbox mcp ended with {}: the run failed (its stderr says why)",
                self.status
            ));
        }
        self
    }

    fn check_health_complete(&self) -> Result<(), HarnessError> {
        let incomplete = |reasons: Vec<String>| HarnessError::Incomplete {
            health: self.health_file.clone(),
            reasons,
        };
        if let Some(why) = &self.host_failed {
            return Err(incomplete(vec![why.clone()]));
        }
        if !self.health.complete {
            return Err(incomplete(self.health.incomplete_reasons.clone()));
        }
        if self.health.run_ended != Some(true) {
            return Err(incomplete(vec![
                "run_ended: the health was not written as the run ended, so it vouches for nothing after it".into(),
            ]));
        }
        let says = (
            self.health.records.last_seq,
            self.health.records.chain_head.as_deref(),
        );
        // No records: the writer's head is the genesis hash.
        let found = (
            self.head.as_ref().map(|h| h.0),
            Some(
                self.head
                    .as_ref()
                    .map_or(crate::records::GENESIS_HASH, |h| h.1.as_str()),
            ),
        );
        if says != found {
            return Err(incomplete(vec![format!(
                "records: the health ends at record {:?} (head {:?}), the records at {:?} (head {:?})",
                says.0, says.1, found.0, found.1
            )]));
        }
        Ok(())
    }

    /// Nothing tried to reach anywhere. Holds only on evidence: the records verified when
    /// they were read, and this fails unless the health says observation was complete,
    /// since an attempt missing from an incomplete observation would read as no attempt.
    pub fn check_no_egress(&self) -> Result<(), HarnessError> {
        self.check_health_complete()?;
        if self.attempts.is_empty() {
            return Ok(());
        }
        Err(HarnessError::Check(format!(
            "expected no egress, but {} attempt(s) were made: {}",
            self.attempts.len(),
            describe(self.attempts.iter())
        )))
    }

    /// Every attempt (allowed or refused) went to a destination one of `rules` names
    /// (`ADDR[:PORT]`, `CIDR[:PORT]`, `*:PORT`, `unix:/path`, `unix:@name`, as `--allow`
    /// takes them). Like [`Observation::check_no_egress`], fails unless the health says
    /// observation was complete.
    pub fn check_only_destinations(&self, rules: &[&str]) -> Result<(), HarnessError> {
        self.check_health_complete()?;
        let parsed = rules
            .iter()
            .map(|r| {
                r.parse::<DestinationRule>()
                    .map_err(|e| HarnessError::Check(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut stray: Vec<&EgressAttempt> = Vec::new();
        for a in &self.attempts {
            let mut named = false;
            for r in &parsed {
                named = named || a.matches(r)?;
            }
            if !named {
                stray.push(a);
            }
        }
        if stray.is_empty() {
            return Ok(());
        }
        Err(HarnessError::Check(format!(
            "attempts outside {rules:?}: {}",
            describe(stray.into_iter())
        )))
    }

    /// The diff of this run's records and health against the declared surface at `path`.
    pub fn diff_declared(&self, path: &Path) -> Result<DiffReport, HarnessError> {
        self.diff_surface(&gate::load_surface(path)?)
    }

    /// The diff of this run's records and health against `surface`; an error for an MCP run
    /// its host failed, which no judgment of the run passes (its health can read complete).
    pub fn diff_surface(&self, surface: &DeclaredSurface) -> Result<DiffReport, HarnessError> {
        if let Some(why) = &self.host_failed {
            return Err(HarnessError::Check(why.clone()));
        }
        gate::judge(surface, &self.records_dir, &self.health)
    }

    /// The gate passes against the declared surface at `path`: the verdict is clean (and an
    /// MCP run's host did not fail the run).
    pub fn check_matches_declared(&self, path: &Path) -> Result<(), HarnessError> {
        let report = self.diff_declared(path)?;
        if gate::passes(&report) {
            return Ok(());
        }
        Err(HarnessError::Check(format!(
            "the run does not match the declared surface {}:\n{}",
            path.display(),
            crate::diff::report::to_text(&report)
        )))
    }

    /// Panics unless [`Observation::check_success`] holds.
    #[track_caller]
    pub fn assert_success(&self) {
        self.assert_ok(self.check_success());
    }

    /// Panics unless [`Observation::check_complete`] holds.
    #[track_caller]
    pub fn assert_complete(&self) {
        self.assert_ok(self.check_complete());
    }

    /// Panics unless [`Observation::check_no_egress`] holds.
    #[track_caller]
    pub fn assert_no_egress(&self) {
        self.assert_ok(self.check_no_egress());
    }

    /// Panics unless [`Observation::check_only_destinations`] holds.
    #[track_caller]
    pub fn assert_only_destinations(&self, rules: &[&str]) {
        self.assert_ok(self.check_only_destinations(rules));
    }

    /// Panics unless [`Observation::check_matches_declared`] holds.
    #[track_caller]
    pub fn assert_matches_declared(&self, path: &Path) {
        self.assert_ok(self.check_matches_declared(path));
    }

    /// Panics with `r`'s error, the workspace kept (the message may name its files).
    #[track_caller]
    fn assert_ok(&self, r: Result<(), HarnessError>) {
        if let Err(e) = r {
            match self.keep_for_failure() {
                Some(kept) => panic!(
                    "{e}\n(the run's records and health are kept in {})",
                    kept.display()
                ),
                None => panic!("{e}"),
            }
        }
    }
}

/// The attempts in words, for a failed check's message: what a tool chose (a unix path, a
/// tool name) is escaped, so it cannot reorder or rewrite the author's terminal.
fn describe<'a>(attempts: impl Iterator<Item = &'a EgressAttempt>) -> String {
    use flowhost_broker::Escaped;
    attempts
        .map(|a| {
            format!(
                "{} {} {} ({}, {})",
                Escaped(&a.tool),
                a.syscall,
                Escaped(&a.destination_text()),
                if a.allowed { "allowed" } else { "refused" },
                Escaped(a.rule.as_deref().unwrap_or("no rule"))
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every record of the directory `dir`, in chain order, only if the directory verifies as
/// `flowhost records verify` checks it (sequence, hash chain, head anchor, no torn last
/// line); each record strictly decoded and validated. Otherwise
/// [`HarnessError::Unverified`], naming each problem's file and line: records that do not
/// verify are no evidence, and a torn last line may be the one attempt a check looks for.
pub fn read_records(dir: &Path) -> Result<Vec<DecisionRecord>, HarnessError> {
    read_verified(dir).map(|(records, _)| records)
}

/// The last sequence number and head hash of verified records (none: no records).
type Head = Option<(u64, String)>;

/// The calls of the records in `dir` (which must verify) that a bound or their deadline
/// ended (`bound_reached`), or that the client cancelled (`cancelled`: its executor was
/// told to stop, or stopped, so what the tool would have done after was not observed
/// either), one description each.
pub(crate) fn calls_cut_short(dir: &Path) -> Result<Vec<String>, HarnessError> {
    let (records, _) = read_verified(dir)?;
    Ok(records
        .iter()
        .filter_map(|r| {
            let why = if r.response.status == Failure::BoundReached.as_str() {
                "ran into a bound or its deadline"
            } else if r.response.status == Failure::Cancelled.as_str() {
                "was cancelled by the client"
            } else {
                return None;
            };
            Some(format!("the call to {} {why}", r.tool.name))
        })
        .collect())
}

/// [`read_records`], with the head of what verified.
fn read_verified(dir: &Path) -> Result<(Vec<DecisionRecord>, Head), HarnessError> {
    let (report, records) =
        verify_records_gathering(dir, None, &Collect).map_err(HarnessError::Records)?;
    if !report.is_ok() {
        return Err(HarnessError::Unverified {
            dir: dir.to_path_buf(),
            problems: report.problems.iter().map(ToString::to_string).collect(),
        });
    }
    // Refused as `flowhost records verify` refuses it: nothing at all, or whole lines cut
    // from its end would not show.
    if let Some(why) = crate::records::chain::refused_as_evidence(dir, &report) {
        return Err(HarnessError::Unverified {
            dir: dir.to_path_buf(),
            problems: vec![why],
        });
    }
    let head = records
        .last()
        .map(|r| r.flowhost.seq)
        .zip(report.head_hash.as_ref().map(|h| h.as_str().to_string()));
    Ok((records, head))
}

/// Keeps every record the verifier decodes, so the records are read and decoded once.
struct Collect;

impl Gather for Collect {
    type Part = Vec<DecisionRecord>;

    fn part(&self) -> Vec<DecisionRecord> {
        Vec::new()
    }

    fn record(&self, part: &mut Vec<DecisionRecord>, record: &DecisionRecord, _: &Path, _: u64) {
        part.push(record.clone());
    }

    fn append(&self, into: &mut Vec<DecisionRecord>, next: Vec<DecisionRecord>, _: u64) {
        into.extend(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::store::list_record_files;
    use crate::records::{InetDestination, UndecodedDestination, UnixDestination};

    fn attempt(destination: Option<Destination>) -> EgressAttempt {
        EgressAttempt {
            seq: 1,
            tool: "sandbox/run".into(),
            syscall: "connect".into(),
            family: "inet".into(),
            protocol: Some("tcp".into()),
            destination,
            allowed: false,
            rule: Some("default".into()),
            pid: 7,
            executable: None,
            undeclared: false,
        }
    }

    fn rule(s: &str) -> DestinationRule {
        s.parse().unwrap()
    }

    /// A run's workspace: the records of the fixture `observed` written by the record
    /// writer into `records`, and a health bound to them at `health.json`, complete or not.
    struct Run {
        ws: tempfile::TempDir,
        records: PathBuf,
        health: PathBuf,
    }

    impl Run {
        fn new(observed: &str, complete: bool) -> Run {
            use crate::records::health::RecordsHealth;
            use crate::records::{RecordWriter, WriterOptions};
            let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
            let ws = tempfile::tempdir().unwrap();
            let records = ws.path().join("records");
            let w = RecordWriter::open(&records, WriterOptions::default()).unwrap();
            let text = std::fs::read_to_string(fixtures.join("observed").join(observed)).unwrap();
            for line in text.lines() {
                w.commit_blocking(DecisionRecord::from_json_line(line.as_bytes()).unwrap())
                    .unwrap();
            }
            w.close_blocking().unwrap();
            let report = verify_records(&records, None).unwrap();
            assert!(report.is_ok(), "{:?}", report.problems);
            let name = if complete {
                "health_complete.json"
            } else {
                "health_incomplete.json"
            };
            let mut h =
                ToolObservationHealth::read_from(&fixtures.join("health").join(name)).unwrap();
            h.records = RecordsHealth::from_verify(&report);
            h.tool_calls_observed = Some(text.matches("\"event\":\"tool_call\"").count() as u64);
            h.run_ended = Some(true);
            let health = ws.path().join("health.json");
            h.write_to(&health).unwrap();
            Run {
                ws,
                records,
                health,
            }
        }

        /// What [`Observation::read`] makes of the run.
        fn read(self) -> Result<Observation, HarnessError> {
            use std::os::unix::process::ExitStatusExt;
            Observation::read(
                std::process::ExitStatus::from_raw(0),
                String::new(),
                String::new(),
                self.records,
                self.health,
                self.ws,
            )
        }

        fn last_file(&self) -> PathBuf {
            list_record_files(&self.records)
                .unwrap()
                .pop()
                .unwrap()
                .path
        }

        /// What the harness reads back, and the first check's verdict.
        fn check(self, check: impl Fn(&Observation) -> Result<(), HarnessError>) -> String {
            self.check_host(None, check)
        }

        /// [`Run::check`] of a run an MCP host served and ended with exit `code`, if given.
        fn check_host(
            self,
            code: Option<i32>,
            check: impl Fn(&Observation) -> Result<(), HarnessError>,
        ) -> String {
            use std::os::unix::process::ExitStatusExt;
            let observed = Observation::read(
                std::process::ExitStatus::from_raw(code.unwrap_or(0) << 8),
                String::new(),
                String::new(),
                self.records,
                self.health,
                self.ws,
            )
            .map(|o| if code.is_some() { o.of_mcp_host() } else { o });
            match observed.and_then(|o| check(&o)) {
                Ok(()) => String::new(),
                Err(e) => e.to_string(),
            }
        }
    }

    fn no_egress(o: &Observation) -> Result<(), HarnessError> {
        o.check_no_egress()
    }

    fn only_nowhere(o: &Observation) -> Result<(), HarnessError> {
        o.check_only_destinations(&["192.0.2.1:9"])
    }

    fn diffed(o: &Observation) -> Result<(), HarnessError> {
        o.diff_surface(&DeclaredSurface::default()).map(drop)
    }

    /// A run its MCP host failed (exit 2) passes no evidence check, whatever its health
    /// file says. Before, the harness never looked at the host's exit: a run the host
    /// failed after a call ran into its deadline, with the health left as the host wrote it
    /// (complete), passed the checks.
    #[test]
    fn a_run_its_mcp_host_failed_passes_no_evidence_check() {
        assert_eq!(
            Run::new("allowed_declared.jsonl", true).check_host(Some(0), no_egress),
            ""
        );
        // Nor a diff of it (before, `passes(&run.diff_declared(..)?)` passed it).
        assert_eq!(
            Run::new("allowed_declared.jsonl", true).check_host(Some(0), diffed),
            ""
        );
        for check in [no_egress, only_nowhere, diffed] {
            let failed = Run::new("allowed_declared.jsonl", true).check_host(Some(2), check);
            assert!(
                failed.contains("flowhost sandbox mcp ended with"),
                "{failed}"
            );
        }
    }

    #[test]
    fn verified_records_and_a_complete_health_pass_the_egress_checks() {
        assert_eq!(
            Run::new("allowed_declared.jsonl", true).check(no_egress),
            ""
        );
        assert_eq!(
            Run::new("allowed_declared.jsonl", true).check(only_nowhere),
            ""
        );
        let egress = Run::new("network_egress.jsonl", true).check(no_egress);
        assert!(egress.contains("expected no egress"), "{egress}");
    }

    /// A health asked for while the run went on (left in place when the final one could
    /// not be written) vouches for nothing after it, and one that ends before the records do
    /// is another moment's: both passed the egress checks before, since only `complete` was
    /// read.
    #[test]
    fn the_egress_checks_need_the_health_written_as_the_run_ended_at_the_records_head() {
        for check in [no_egress, only_nowhere] {
            let run = Run::new("allowed_declared.jsonl", true);
            let mut h = ToolObservationHealth::read_from(&run.health).unwrap();
            h.run_ended = Some(false);
            h.write_to(&run.health).unwrap();
            let said = run.check(check);
            assert!(said.contains("run_ended"), "{said}");

            let run = Run::new("allowed_declared.jsonl", true);
            let mut h = ToolObservationHealth::read_from(&run.health).unwrap();
            h.records.last_seq = h.records.last_seq.map(|s| s - 1);
            h.write_to(&run.health).unwrap();
            let said = run.check(check);
            assert!(said.contains("the health ends at record"), "{said}");
        }
    }

    #[test]
    fn the_egress_checks_fail_on_a_torn_last_line_naming_the_file() {
        for check in [no_egress, only_nowhere] {
            let run = Run::new("allowed_declared.jsonl", true);
            // An egress attempt cut mid-write: read loosely, it vanished, and "no egress"
            // would pass on records that do not verify.
            let egress = std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("fixtures/observed/network_egress.jsonl"),
            )
            .unwrap();
            let file = run.last_file();
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&file)
                .unwrap();
            std::io::Write::write_all(&mut f, &egress.as_bytes()[..200]).unwrap();
            let e = run.check(check);
            assert!(e.contains(&file.display().to_string()), "{e}");
            assert!(e.contains("torn"), "{e}");
        }
    }

    #[test]
    fn the_egress_checks_fail_on_a_broken_chain_naming_the_file() {
        for check in [no_egress, only_nowhere] {
            let run = Run::new("allowed_declared.jsonl", true);
            let file = run.last_file();
            let text = std::fs::read_to_string(&file).unwrap();
            let mut lines: Vec<&str> = text.lines().collect();
            lines.remove(1);
            std::fs::write(&file, lines.join("\n") + "\n").unwrap();
            let e = run.check(check);
            assert!(e.contains(&file.display().to_string()), "{e}");
            assert!(e.contains("do not verify"), "{e}");
        }
    }

    #[test]
    fn the_egress_checks_fail_on_an_incomplete_health_naming_the_file() {
        for check in [no_egress, only_nowhere] {
            let run = Run::new("allowed_declared.jsonl", false);
            let health = run.health.display().to_string();
            let e = run.check(check);
            assert!(e.contains(&health), "{e}");
            assert!(e.contains("incomplete"), "{e}");
        }
    }

    #[test]
    fn read_records_refuses_records_that_do_not_verify() {
        let run = Run::new("network_egress.jsonl", true);
        assert_eq!(read_records(&run.records).unwrap().len(), 4);
        let file = run.last_file();
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(&file, &text[..text.len() - 1]).unwrap();
        let e = read_records(&run.records).unwrap_err().to_string();
        assert!(e.contains(&file.display().to_string()), "{e}");
        assert!(e.contains("torn"), "{e}");
    }

    #[test]
    fn recorded_destinations_match_the_rules_that_name_them() {
        let inet = attempt(Some(Destination::Inet(InetDestination {
            address: "127.0.0.2".parse().unwrap(),
            port: 8080,
            host_name: None,
            other_host_names: Vec::new(),
        })));
        assert!(inet.matches(&rule("127.0.0.2:8080")).unwrap());
        assert!(inet.matches(&rule("127.0.0.0/8")).unwrap());
        assert!(inet.matches(&rule("*:8080")).unwrap());
        assert!(!inet.matches(&rule("127.0.0.1:8080")).unwrap());
        assert!(!inet.matches(&rule("127.0.0.2:8081")).unwrap());
        assert_eq!(inet.destination_text(), "127.0.0.2:8080");

        let path = attempt(Some(Destination::Unix(UnixDestination {
            unix_path: "/run/app.sock".into(),
        })));
        assert!(path.matches(&rule("unix:/run/app.sock")).unwrap());
        assert!(!path.matches(&rule("unix:@/run/app.sock")).unwrap());
        let abstract_name = attempt(Some(Destination::Unix(UnixDestination {
            unix_path: "@bus".into(),
        })));
        assert!(abstract_name.matches(&rule("unix:@bus")).unwrap());
        assert!(!abstract_name.matches(&rule("unix:/bus")).unwrap());
    }

    /// A call the client cancelled was stopped before it finished: like one a bound ended,
    /// the run is cut short. Before, only bounds counted, and a run whose client cancelled
    /// its calls passed its gate on what the tool did before the cancellation alone.
    #[test]
    fn calls_cancelled_or_ended_by_a_bound_are_cut_short() {
        use crate::decision::Verdict;
        use crate::records::{RecordWriter, WriterOptions};
        let dir = tempfile::tempdir().unwrap();
        let w = RecordWriter::open(dir.path(), WriterOptions::default()).unwrap();
        for verdict in [
            Verdict::Succeeded { rule: None },
            Verdict::Failed(Failure::Cancelled),
            Verdict::Failed(Failure::BoundReached),
            Verdict::Failed(Failure::ToolError),
        ] {
            w.commit_blocking(crate::records::tests::sample_tool_call_judged(verdict))
                .unwrap();
        }
        w.close_blocking().unwrap();
        assert_eq!(
            calls_cut_short(dir.path()).unwrap(),
            [
                "the call to github.add_deploy_key was cancelled by the client",
                "the call to github.add_deploy_key ran into a bound or its deadline",
            ]
        );
    }

    /// A lookup is recorded to the executor's resolver (127.53.x.y:53) with the name asked:
    /// it is named by the rules naming that name, on any port, as the host decides it.
    /// Before, a loopback rule (`127.0.0.0/8`) passed the lookup of any name, and a rule
    /// naming the host the tool went on to reach (`api.example.com:443`) failed its lookup.
    #[test]
    fn a_lookup_is_matched_by_the_name_it_asks() {
        let lookup = |name: Option<&str>| EgressAttempt {
            syscall: crate::records::DNS_QUERY_SYSCALL.into(),
            protocol: Some("udp".into()),
            ..attempt(Some(Destination::Inet(InetDestination {
                address: "127.53.0.1".parse().unwrap(),
                port: 53,
                host_name: name.map(str::to_string),
                other_host_names: Vec::new(),
            })))
        };
        let secret = lookup(Some("c2VjcmV0.attacker.example"));
        for r in ["127.0.0.0/8", "127.53.0.1:53", "*:53", "0.0.0.0/0"] {
            assert!(!secret.matches(&rule(r)).unwrap(), "{r}");
        }
        assert!(secret.matches(&rule("*.attacker.example:53")).unwrap());
        let api = lookup(Some("api.example.com"));
        assert!(api.matches(&rule("api.example.com:443")).unwrap());
        assert!(!api.matches(&rule("example.com:443")).unwrap());
        let nameless = lookup(None);
        assert!(!nameless.matches(&rule("127.0.0.0/8")).unwrap());
        let e = lookup(Some("not a name"))
            .matches(&rule("*:53"))
            .unwrap_err();
        assert!(e.to_string().contains("record seq 1"), "{e}");
    }

    #[test]
    fn a_recorded_host_name_that_does_not_parse_is_an_error_naming_the_record() {
        let named = |other: &str| {
            attempt(Some(Destination::Inet(InetDestination {
                address: "192.0.2.50".parse().unwrap(),
                port: 443,
                host_name: Some("www.example.com".into()),
                other_host_names: vec![other.into()],
            })))
        };
        assert!(named("secret.example.com").matches(&rule("*:443")).unwrap());
        let e = named("not a name").matches(&rule("*:443")).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("record seq") && e.contains("other_host_names"),
            "{e}"
        );
    }

    #[test]
    fn what_no_rule_can_name_matches_no_rule() {
        for d in [
            None,
            Some(Destination::Undecoded(UndecodedDestination {
                undecoded: "af_unspec".into(),
            })),
        ] {
            let a = attempt(d);
            assert!(!a.matches(&rule("0.0.0.0/0")).unwrap(), "{a:?}");
            assert!(!a.matches(&rule("*:80")).unwrap(), "{a:?}");
        }
    }

    /// A run whose health or records cannot be read keeps its workspace, and the error says
    /// where: the records and health it names are there to look at. Before, the workspace
    /// was removed with the error, whose message sent its reader to files that were gone.
    #[test]
    fn a_run_that_cannot_be_read_keeps_what_it_left() {
        let run = Run::new("allowed_declared.jsonl", true);
        std::fs::remove_file(&run.health).unwrap();
        let dir = run.ws.path().to_path_buf();
        let e = run.read().unwrap_err().to_string();
        assert!(e.contains(&format!("kept in {}", dir.display())), "{e}");
        assert!(dir.join("records").is_dir(), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();

        let run = Run::new("allowed_declared.jsonl", true);
        let last = run.last_file();
        let text = std::fs::read_to_string(&last).unwrap();
        std::fs::write(&last, text.replacen("allow", "deny!", 1)).unwrap();
        let dir = run.ws.path().to_path_buf();
        let e = run.read().unwrap_err().to_string();
        assert!(e.contains("do not verify"), "{e}");
        assert!(last.is_file(), "the records it names are kept: {e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A failed assertion keeps the workspace its message names files of.
    #[test]
    fn a_failed_assertion_keeps_the_workspace() {
        let run = Run::new("allowed_declared.jsonl", false);
        let dir = run.ws.path().to_path_buf();
        let observed = run.read().unwrap();
        let panicked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| observed.assert_complete()))
                .unwrap_err();
        let message = panicked
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(message.contains("observation was incomplete"), "{message}");
        assert!(
            message.contains(&format!("kept in {}", dir.display())),
            "{message}"
        );
        drop(observed);
        assert!(dir.join("health.json").is_file());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A destination a tool chose is escaped in a failed check's message: a bidirectional
    /// override in a unix socket's name would reorder the author's terminal.
    #[test]
    fn a_described_attempt_escapes_what_the_tool_chose() {
        let named = attempt(Some(Destination::Unix(UnixDestination {
            unix_path: "@x\u{202e}gnp.evil".into(),
        })));
        let said = describe(std::iter::once(&named));
        assert!(!said.contains('\u{202e}'), "{said}");
    }

    /// Records whose directory lost both its anchor and its ring are refused as `records
    /// verify` refuses them: cut at the end, they would otherwise read as a run's whole
    /// evidence. Before, the harness read them.
    #[test]
    fn records_with_neither_anchor_nor_ring_are_refused() {
        let run = Run::new("allowed_declared.jsonl", true);
        std::fs::remove_file(run.records.join(crate::records::store::HEAD_FILE)).unwrap();
        std::fs::remove_file(run.records.join(crate::records::ring::RING_FILE)).unwrap();
        let e = read_records(&run.records).unwrap_err().to_string();
        assert!(e.contains("neither records.head nor records.wal"), "{e}");
        // With its record files gone too, or a directory that never held records, there is
        // nothing: before, that read as a run that recorded no attempt.
        let empty = tempfile::tempdir().unwrap();
        let e = read_records(empty.path()).unwrap_err().to_string();
        assert!(e.contains("holds no record and no head anchor"), "{e}");
    }
}
