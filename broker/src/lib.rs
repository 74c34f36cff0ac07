//! flowhost-broker: runs tool executors under a seccomp profile with a user-notification
//! broker attached, so that every outbound I/O attempt (connect, sendto with an address,
//! sendmsg, sendmmsg, bind) reaches the host before it happens, is decided by the host, and
//! is carried out or refused by the broker itself.
//!
//! The broker knows nothing of labels or policies: it reports [`EgressAttempt`]s and obeys
//! [`Verdict`]s. See `README.md` (security model) for what the sandbox guarantees.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use flowhost_broker::{Broker, BrokerOptions, Profile, SpawnSpec};
//! let broker = Broker::new(BrokerOptions::default())?;
//! let profile = Arc::new(Profile::find("brokered", &[])?);
//! let mut exec = broker.spawn(SpawnSpec::new(["/usr/bin/curl", "http://127.0.0.1:8080/"], profile)).await?;
//! let mut attempts = exec.take_attempts().expect("first take");
//! while let Some(attempt) = attempts.recv().await {
//!     println!("{:?}", attempt.info().destination);
//!     attempt.deny();
//! }
//! let status = exec.wait().await?;
//! # let _ = status; Ok(()) }
//! ```

#![deny(clippy::unwrap_used, clippy::expect_used)]

mod attempt;
mod bound;
pub mod bounds;
mod broker;
pub mod cgroup;
mod child;
mod escaped;
mod executor;
pub mod filter;
mod host_endpoints;
pub mod profile;
mod reap;
mod spawn;
mod stage;
mod supervisor;
mod sys;
pub mod terminal;
mod uids;

pub use attempt::{
    AttemptInfo, Destination, EgressAttempt, EgressSyscall, Judge, SocketInfo, Verdict, family_name,
};
pub use broker::{Broker, BrokerError, BrokerOptions, BrokerStats, KernelSupport};
pub use escaped::{Escaped, rearranges_lines};
pub use executor::{Delivery, Executor, ExitStatus, Interrupt};
pub use host_endpoints::is_host_address;
pub use profile::{CgroupMode, Limits, NetworkPath, Profile, ProfileError};
pub use spawn::{DEFAULT_EXECUTOR_PATH, SpawnError, SpawnSpec, StdioMode, env_forbidden};
pub use stage::Stage;
pub use supervisor::Counters;
pub use sys::WaitStatus;
pub use uids::{RangeHeld, UidRange, UidScanError};
