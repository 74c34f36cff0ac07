//! Observed decision records (README, "Records and the diff"; docs/ARCHITECTURE.md, "Invariants").
//!
//! Every decision the host takes — each `tools/call` and each broker-observed egress attempt —
//! becomes one [`DecisionRecord`]: one JSON object on one line of a JSONL file. The object is an
//! `assay.tool_decision_surface.v0` decision object plus a `flowhost` extension object
//! ([`FlowhostExtension`]) carrying the flow facts (labels, clearance used, denial kind, egress
//! basis, broker details) and the hash chain (sequence number and previous-record hash).
//!
//! What a record can hold is fixed by its types: there is no field for raw arguments, results
//! or secrets. Targets are projections chosen by the operator's mapping
//! ([`projection::ToolMapping`]), with identifiers hashed where the mapping says so.
//!
//! Records are written by [`writer::RecordWriter`] (group commit, fail closed, rotation),
//! chained and verified by [`chain`], summarised by [`health`].

pub mod chain;
pub mod export;
pub mod health;
pub mod projection;
pub mod ring;
pub mod store;
pub mod trace;
pub mod writer;

mod build;
mod schema;
mod validate;

pub use crate::decision::{Denial, EgressBasis, Failure, Verdict};
pub use build::*;
pub use schema::*;
pub use validate::*;

pub use chain::{ChainHash, Chainer, GENESIS_HASH, line_hash};
pub use health::ToolObservationHealth;
pub use projection::{
    HashedField, Projection, ToolMapping, project_egress, project_tool_call, target_hash,
};
pub use trace::correlation_from_params;
pub use writer::{
    Committed, MIN_RING_BYTES, RING_FILE, RecordError, RecordWriter, WriterOptions, WriterStatus,
};

/// The schema of the decision objects and of the exported envelope.
pub const DECISION_SURFACE_SCHEMA: &str = "assay.tool_decision_surface.v0";
/// The schema string carried in every record's `flowhost.schema`.
pub const RECORD_SCHEMA: &str = "flowhost.decision.v1";
/// The value of `decision.source` in every record flowhost writes.
pub const DECISION_SOURCE: &str = "flowhost";
/// The transport flowhost reports for its servers (MCP over the executor's stdio).
pub const TRANSPORT_MCP: &str = "mcp";
/// Longest free-text field (tool names, ids, plain target values, statuses), in bytes.
pub const MAX_TEXT_BYTES: usize = 1024;
/// Longest snake_case code (categories, reason codes, details, denial kinds), in bytes.
pub const MAX_CODE_BYTES: usize = 128;

#[cfg(test)]
pub(crate) mod tests;
