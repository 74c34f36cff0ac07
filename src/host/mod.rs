//! The host around the stages: its configuration, the daemon (MCP sessions, the call
//! pipeline, executors, the egress judge that connects the broker to the resolver), MCP
//! framing, logging, and the pricing lab with its demo.

pub mod config;
pub mod daemon;
pub mod demo;
pub mod dns;
pub mod fingerprint;
pub mod lab;
pub mod logging;
pub mod mcp;
pub mod runtime;
pub mod socket_owner;
