//! Stage 1, admission: signed manifests (canonical JSON, Ed25519 keys, strict decoding,
//! OpenAPI import and export) and the verified registry, the only way a tool gets in.

pub mod keys;
pub mod manifest;
pub mod openapi;
pub mod registry;
