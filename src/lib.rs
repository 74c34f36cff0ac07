//! flowhost: a Linux process host for governed tools.
//!
//! Data flows one way: manifest -> registry -> resolver -> broker decisions -> records -> diff.
//! This crate holds the host side; the seccomp-notify broker is the `flowhost-broker` crate.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod atomic_file;
pub mod cli;
pub mod diff;
pub mod flow;
pub mod ident;
pub mod label;
pub mod records;
pub mod surface;

pub use flow::{EgressDenial, ToolFlowDeclaration, ToolFlowError, authorize_egress};
pub use ident::{Compartment, DeclassificationPurpose, IdentifierError, PrincipalId};
pub use label::{InformationLabel, LabelError};
