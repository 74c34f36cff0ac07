//! flowhost: a Linux process host for governed tools.
//!
//! Data flows one way: manifest -> registry -> resolver -> broker decisions -> records -> diff.
//! This crate holds the host side; the seccomp-notify broker is the `flowhost-broker` crate.

#![deny(unsafe_code)]
#![deny(clippy::unwrap_used, clippy::expect_used)]

// The tree shows the stages: model (the vocabulary), admission (manifest -> registry),
// resolve (resolver, state, rules, grants), the broker (its own crate), records, diff; the
// host wires them together and cli drives it. The old flat paths stay available below.
pub mod admission;
pub mod canonical;
pub mod causes;
pub mod cli;
pub mod diff;
pub mod files;
pub mod harness;
pub mod host;
pub mod model;
pub mod records;
pub mod resolve;

pub use admission::{keys, manifest, openapi, registry};
pub use host::{config, daemon, demo, dns, lab, logging, mcp, runtime};
pub use model::{decision, flow, ident, label};
pub use resolve::{continuity, destination, grant, resolver, state};

pub use flow::{
    EgressDenial, FlowDecodeError, ToolFlowDeclaration, ToolFlowError, authorize_egress,
};
pub use ident::{Compartment, DeclassificationPurpose, IdentifierError, PrincipalId};
pub use label::{InformationLabel, LabelError};
pub use manifest::{
    ManifestBody, ManifestDigest, ManifestError, SignedManifest, ToolDefinition, VerifyError,
};
pub use registry::{
    AdmissionError, AdmittedTool, AdmittedToolSecurity, BridgeSecurityMetadata, RuntimeTopology,
    ToolPolicy, VerifiedRegistry,
};
