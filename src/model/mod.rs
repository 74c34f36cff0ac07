//! The vocabulary every stage speaks: identifiers, information labels and their lattice,
//! tool flow declarations with the egress check, and the decision vocabulary (denials,
//! egress basis, verdicts).

pub mod decision;
pub mod flow;
pub mod ident;
pub mod label;
