//! What the child reports to the host over its status pipe while it sets up: the stage it
//! failed at (with the errno), or one of two tags for the steps the host takes part in.

/// Where the child failed, reported to the parent with the errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Stage {
    /// Waiting for the parent to write the user-namespace maps.
    UserNamespace = 1,
    /// Making mounts private, mounting /proc or the private /tmp.
    Mounts = 2,
    /// Setting the hostname in the new UTS namespace (no longer fatal; kept for numbering).
    Hostname = 3,
    /// Arranging stdio and inherited descriptors.
    Descriptors = 4,
    /// Changing to the working directory.
    WorkingDirectory = 5,
    /// Applying rlimits.
    Limits = 6,
    /// Dropping the capability bounding set and the ambient set.
    CapabilityBounds = 7,
    /// setgroups / setresgid / setresuid.
    Identity = 8,
    /// Clearing the remaining capabilities.
    Capabilities = 9,
    /// PR_SET_PDEATHSIG / PR_SET_NO_NEW_PRIVS.
    Prctl = 10,
    /// landlock_restrict_self.
    Landlock = 11,
    /// Installing the seccomp filter with a notify listener.
    Seccomp = 12,
    /// Waiting for the parent to take the listener.
    Handshake = 13,
    /// execve itself.
    Exec = 14,
    /// setsid: leaving the host's session and its controlling terminal.
    Session = 15,
    /// Setting and locking securebits (noroot, no_cap_ambient_raise).
    Securebits = 16,
    /// TIOCSCTTY: making the executor's own pseudo-terminal its controlling terminal.
    Terminal = 17,
}

impl Stage {
    /// Decodes a stage number from the status pipe.
    pub fn from_u32(v: u32) -> Option<Stage> {
        use Stage::*;
        Some(match v {
            1 => UserNamespace,
            2 => Mounts,
            3 => Hostname,
            4 => Descriptors,
            5 => WorkingDirectory,
            6 => Limits,
            7 => CapabilityBounds,
            8 => Identity,
            9 => Capabilities,
            10 => Prctl,
            11 => Landlock,
            12 => Seccomp,
            13 => Handshake,
            14 => Exec,
            15 => Session,
            16 => Securebits,
            17 => Terminal,
            _ => return None,
        })
    }

    /// What the stage does, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Stage::UserNamespace => "waiting for user-namespace maps",
            Stage::Mounts => "setting up the mount namespace (private mounts, /proc, /tmp)",
            Stage::Hostname => "setting the executor hostname",
            Stage::Descriptors => "arranging file descriptors",
            Stage::WorkingDirectory => "changing to the working directory",
            Stage::Limits => "applying resource limits",
            Stage::CapabilityBounds => "dropping the capability bounding set and ambient set",
            Stage::Identity => "switching to the executor uid/gid",
            Stage::Capabilities => "clearing capabilities",
            Stage::Prctl => "setting the parent-death signal and no_new_privs",
            Stage::Landlock => "applying Landlock rules",
            Stage::Seccomp => "installing the seccomp filter with a notify listener",
            Stage::Handshake => "handing the seccomp listener to the host",
            Stage::Exec => "executing the command",
            Stage::Session => "starting a new session without a controlling terminal",
            Stage::Securebits => {
                "setting the executor's securebits (noroot, no_cap_ambient_raise, both locked)"
            }
            Stage::Terminal => {
                "making the executor's pseudo-terminal its controlling terminal (TIOCSCTTY)"
            }
        }
    }
}

/// Status message tag meaning "the filter is installed; the value is the listener fd".
pub const READY: u32 = 0xFFFF;
/// Status message tag meaning "started; write the user-namespace maps" (unprivileged mode).
pub const STARTED: u32 = 0xFFFE;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_round_trips_through_the_status_pipe_number() {
        for n in 1..=17 {
            let stage = Stage::from_u32(n).expect("a stage");
            assert_eq!(stage as u32, n);
        }
        assert_eq!(Stage::from_u32(18), None);
        assert!(Stage::Securebits.describe().contains("securebits"));
    }
}
