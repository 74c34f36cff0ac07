//! Logging through `tracing`: structured fields to the journal when running under systemd
//! (`JOURNAL_STREAM` is set), to stderr otherwise, JSON lines on request. The level comes
//! from `FLOWHOST_LOG` (an env-filter directive, default `info`).

use tracing_subscriber::EnvFilter;
use tracing_subscriber::prelude::*;

/// Where and how log events go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// The journal under systemd, else human-readable text on stderr.
    Auto,
    /// Human-readable text on stderr.
    Text,
    /// One JSON object per event on stderr.
    Json,
    /// The systemd journal, with structured fields.
    Journal,
}

/// Installs the global subscriber at level `info` (or `FLOWHOST_LOG`). Falls back to text
/// on stderr (and says so) when the journal is requested but unreachable.
pub fn init(format: LogFormat) {
    init_with_default(format, "info")
}

/// Like [`init`], with `default` as the filter when `FLOWHOST_LOG` is unset.
pub fn init_with_default(format: LogFormat, default: &str) {
    let filter =
        || EnvFilter::try_from_env("FLOWHOST_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let format = match format {
        LogFormat::Auto if std::env::var_os("JOURNAL_STREAM").is_some() => LogFormat::Journal,
        LogFormat::Auto => LogFormat::Text,
        other => other,
    };
    // Colour codes only for a person at a terminal: a file, a pipe or the journal gets plain
    // text an operator can grep.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let text = || {
        tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
    };
    let registry = tracing_subscriber::registry().with(filter());
    let result = match format {
        LogFormat::Journal => match tracing_journald::layer() {
            Ok(layer) => registry
                .with(layer.with_syslog_identifier("flowhost".into()))
                .try_init(),
            Err(e) => {
                let r = registry.with(text()).try_init();
                tracing::warn!(error = %e, "the journal is unreachable; logging to stderr");
                r
            }
        },
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_ansi(false)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
        LogFormat::Text | LogFormat::Auto => registry.with(text()).try_init(),
    };
    // A subscriber already installed (tests) is fine.
    drop(result);
}

/// Whether stderr is the systemd journal's stream (`JOURNAL_STREAM` names its device and
/// inode), so lines written there may carry a syslog priority prefix.
pub fn stderr_is_journal() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(stderr) = std::io::stderr().as_fd().try_clone_to_owned() else {
        return false;
    };
    let Ok(meta) = std::fs::File::from(stderr).metadata() else {
        return false;
    };
    stream.to_str() == Some(&format!("{}:{}", meta.dev(), meta.ino()))
}

/// The prefix for a line of a fatal error on stderr: `<3>` (sd-daemon's "err" priority)
/// when stderr is the journal, so `journalctl -p err` shows why the program stopped; else
/// nothing.
pub fn fatal_line_prefix() -> &'static str {
    if stderr_is_journal() { "<3>" } else { "" }
}
