//! flowhost: a Linux process host for governed tools.
//!
//! Data flows one way: manifest -> registry -> resolver -> broker decisions -> records -> diff.
//! This crate holds the host side; the seccomp-notify broker is the `flowhost-broker` crate.

#![deny(unsafe_code)]
#![deny(clippy::unwrap_used, clippy::expect_used)]

pub mod canonical;
pub mod cli;
pub mod config;
pub mod continuity;
pub mod daemon;
pub mod decision;
pub mod demo;
pub mod destination;
pub mod diff;
pub mod files;
pub mod flow;
pub mod grant;
pub mod ident;
pub mod keys;
pub mod lab;
pub mod label;
pub mod logging;
pub mod manifest;
pub mod mcp;
pub mod openapi;
pub mod records;
pub mod registry;
pub mod resolver;
pub mod state;

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
