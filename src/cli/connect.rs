//! `flowhost connect`: a stdio bridge, so any MCP client that launches a stdio server can use
//! the daemon. Bytes are relayed unchanged in both directions; the daemon authenticates the
//! caller by the bridge's Unix credentials.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::CliResult;

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
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        out.write_all(&buf[..n]).await?;
        out.flush().await?;
    }
}

/// How a bridged session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// The client closed stdin, and the host closed after its last answer.
    ClientDone,
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
    // that closed because stdin did is never taken for one that closed on its own. (Asking
    // whether the copying task had finished raced with its last steps after the shutdown:
    // under load, a session the client ended was now and then reported as refused.)
    let stdin_closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let up = {
        let stdin_closed = stdin_closed.clone();
        tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let r = tokio::io::copy(&mut stdin, &mut to_daemon).await;
            // Only the end of stdin is the client's: a copy that failed (the host closed
            // first, or stdin could not be read) is no session the client ended.
            if r.is_ok() {
                stdin_closed.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            // Tell the daemon no more requests come, and keep reading its answers.
            let _ = tokio::io::AsyncWriteExt::shutdown(&mut to_daemon).await;
            r
        })
    };
    let mut stdout = tokio::io::stdout();
    let down = relay_out(&mut from_daemon, &mut stdout).await;
    let _ = tokio::io::AsyncWriteExt::flush(&mut stdout).await;
    // A request still being read when the host closed has no one to answer it.
    let ending = if stdin_closed.load(std::sync::atomic::Ordering::SeqCst) {
        if let Ok(Err(e)) = up.await {
            return Err(format!("reading stdin: {e}").into());
        }
        Ending::ClientDone
    } else {
        up.abort();
        Ending::HostClosed
    };
    down?;
    Ok(ending)
}
