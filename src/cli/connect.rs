//! `flowhost connect`: a stdio bridge, so any MCP client that launches a stdio server can use
//! the daemon. Bytes are relayed unchanged in both directions; the daemon authenticates the
//! caller by the bridge's Unix credentials.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::CliResult;

mod unanswered;

use unanswered::{Direction, Lines, Unanswered};

/// The longest client line the bridge reads for a request id: the most `max_message_bytes`
/// a host may be configured to take, past which every host refuses it (a longer line is
/// still passed on, unread). One the host's own limit refuses is answered with a null id
/// naming its length, which ends what it is owed.
const LONGEST_REQUEST_READ: usize = crate::config::MOST_MESSAGE_BYTES;

/// The longest host line the bridge reads for an answer's id, and a bound on what a host
/// that never ends a line makes the bridge hold. A longer line is still passed on, unread
/// (a host configured to carry such answers would have one reported as owed at the end).
const LONGEST_ANSWER_READ: usize = 256 * 1024 * 1024;

/// Bridge stdin/stdout to the daemon's socket.
#[derive(Debug, clap::Args)]
pub struct ConnectArgs {
    /// The daemon's socket.
    #[arg(long, default_value = "/run/flowhost/flowhost.sock")]
    socket: PathBuf,
}

impl ConnectArgs {
    /// Relays until either side closes.
    pub fn run(self) -> CliResult {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let bridged = runtime.block_on(bridge(&self.socket));
        runtime.shutdown_background();
        match bridged? {
            Ending::ClientDone => Ok(ExitCode::SUCCESS),
            Ending::Unanswered(ids) => Err(format!(
                "{}: the flowhost daemon closed the connection with {} of the client's \
                 requests unanswered (id {}): it stopped or failed part way (its log says \
                 which)",
                self.socket.display(),
                ids.len(),
                listed(&ids)
            )
            .into()),
            // The client still had requests to send: they will never be answered, and the
            // client must not take the bridge's end for a finished session.
            Ending::HostClosed => Err(format!(
                "{}: the flowhost daemon closed the connection while the client was still \
                 sending: it refused the connection or stopped (its log says which)",
                self.socket.display()
            )
            .into()),
        }
    }
}

/// Copies what the host sends to `out` until it closes, writing out every byte read before
/// reporting a read error: a host that closes with requests of ours unread makes the kernel
/// report the connection reset, and what it answered before that must still reach the user
/// (a buffered copy dropped it).
async fn relay_out(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    out: &mut (impl tokio::io::AsyncWrite + Unpin),
    lines: &mut Lines,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        lines.feed(&buf[..n]);
        out.write_all(&buf[..n]).await?;
        out.flush().await?;
    }
}

/// Stdin is still being relayed (or the host closed first).
const STDIN_OPEN: u8 = 0;
/// Stdin ended, and all of it reached the host.
const STDIN_DONE: u8 = 1;
/// Stdin could not be read: the client's requests are cut, whatever the host does next.
const STDIN_FAILED: u8 = 2;

/// Which side stopped the relay of stdin to the host.
enum Up {
    /// Reading stdin failed.
    Stdin(std::io::Error),
    /// Writing to the host failed (it closed).
    Host,
}

/// Copies stdin to the host until stdin ends, telling a failure to read stdin from the host
/// closing, which a plain copy reports alike.
async fn relay_up(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    lines: &mut Lines,
) -> Result<(), Up> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) => {
                lines.finish();
                return Ok(());
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Up::Stdin(e)),
        };
        lines.feed(&buf[..n]);
        to.write_all(&buf[..n]).await.map_err(|_| Up::Host)?;
    }
}

/// How a bridged session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Ending {
    /// The client closed stdin, and the host closed after its last answer.
    ClientDone,
    /// The client closed stdin, and the host closed with these requests (their ids as JSON)
    /// unanswered: it stopped or failed part way.
    Unanswered(Vec<String>),
    /// The host closed while stdin was still open (it refused the connection, or stopped).
    HostClosed,
}

/// Relays stdin to the host's socket and the socket to stdout until the host closes the
/// connection: normally once the client has closed stdin and every answer is out, or when
/// the host stops (also `flowhost sandbox mcp`'s session). Reading stdin happens on a
/// blocking thread that may outlive this: shut the runtime down in the background.
pub(super) async fn bridge(
    socket: &Path,
) -> Result<Ending, Box<dyn std::error::Error + Send + Sync>> {
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| {
        format!(
            "{}: cannot connect to the flowhost daemon: {e}",
            socket.display()
        )
    })?;
    let (mut from_daemon, mut to_daemon) = stream.into_split();
    // Set before the shutdown that lets the host close after its last answer, so a host
    // that closed because stdin did (or because stdin failed) is never taken for one that
    // closed on its own. (Asking whether the copying task had finished raced with its last
    // steps after the shutdown: under load, a session the client ended was now and then
    // reported as refused.)
    let stdin_ended = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(STDIN_OPEN));
    let unanswered = Unanswered::default();
    let up = {
        let stdin_ended = stdin_ended.clone();
        let mut lines = Lines::new(Direction::Up, unanswered.clone(), LONGEST_REQUEST_READ);
        tokio::spawn(async move {
            let r = relay_up(&mut tokio::io::stdin(), &mut to_daemon, &mut lines).await;
            let ended = match &r {
                Ok(()) => STDIN_DONE,
                Err(Up::Stdin(_)) => STDIN_FAILED,
                // The host closed first: no session the client ended.
                Err(Up::Host) => STDIN_OPEN,
            };
            stdin_ended.store(ended, std::sync::atomic::Ordering::SeqCst);
            // Tell the daemon no more requests come, and keep reading its answers.
            let _ = tokio::io::AsyncWriteExt::shutdown(&mut to_daemon).await;
            r
        })
    };
    let mut stdout = tokio::io::stdout();
    let mut lines = Lines::new(Direction::Down, unanswered.clone(), LONGEST_ANSWER_READ);
    let down = relay_out(&mut from_daemon, &mut stdout, &mut lines).await;
    let _ = tokio::io::AsyncWriteExt::flush(&mut stdout).await;
    // A request still being read when the host closed has no one to answer it.
    let ending = match stdin_ended.load(std::sync::atomic::Ordering::SeqCst) {
        STDIN_DONE => match unanswered.ids() {
            ids if ids.is_empty() => Ending::ClientDone,
            ids => Ending::Unanswered(ids),
        },
        STDIN_FAILED => {
            let problem = match up.await {
                Ok(Err(Up::Stdin(e))) => e.to_string(),
                _ => "failed".to_string(),
            };
            return Err(format!("reading stdin: {problem}").into());
        }
        _ => {
            up.abort();
            Ending::HostClosed
        }
    };
    down?;
    Ok(ending)
}

/// The first few of `ids`, for a message.
pub(super) fn listed(ids: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut text = ids
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > SHOWN {
        text.push_str(&format!(" and {} more", ids.len() - SHOWN));
    }
    text
}
