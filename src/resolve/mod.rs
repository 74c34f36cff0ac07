//! Stage 2, resolution: the flow resolver that decides every call before dispatch and every
//! egress attempt at the syscall, the durable flow state (bound to the records), operator
//! destination rules, and declassification grants.

pub mod continuity;
pub mod destination;
pub mod grant;
pub mod resolver;
pub mod state;
