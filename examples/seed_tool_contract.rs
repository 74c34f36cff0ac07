//! The pricing-lab contracts as a tool author's plain program, naming flowhost only in its
//! `use` lines: it compiles against flowhost's public API (declaration fields read as
//! public fields) and prints
//! the same four lines as `examples/tool_contract.rs`.

use flowhost::{EgressDenial, authorize_egress};
use flowhost::{InformationLabel, PrincipalId, ToolFlowDeclaration};
use std::collections::{BTreeMap, BTreeSet};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let owner = PrincipalId::new("larkfield-pricing")?;
    let internal = InformationLabel::try_known(
        BTreeMap::from([(owner.clone(), BTreeSet::from([owner]))]),
        BTreeSet::new(),
    )?;
    let reader = ToolFlowDeclaration::new(
        Some(internal.clone()), // returned contract terms carry this classification
        None,
        false,
        BTreeSet::new(), // this declaration promises no egress
    )?;
    let team_channel = ToolFlowDeclaration::new(
        Some(InformationLabel::bottom()), // public acknowledgment after the send
        Some(internal.clone()),
        true,
        BTreeSet::new(),
    )?;
    let pull_request = ToolFlowDeclaration::public_egress();
    let retained =
        InformationLabel::bottom().join_restrictions(reader.output_label.as_ref().unwrap())?;
    assert_eq!(
        authorize_egress(&retained, team_channel.input_clearance.as_ref()),
        Ok(())
    );
    assert_eq!(
        authorize_egress(&retained, pull_request.input_clearance.as_ref()),
        Err(EgressDenial::FlowViolation)
    );
    assert!(team_channel.output_label.as_ref().unwrap().is_bottom());
    // If runtime topology identifies outbound I/O, a missing declaration cannot hide it.
    assert_eq!(
        authorize_egress(&retained, None),
        Err(EgressDenial::MissingClearance)
    );
    assert!(
        ToolFlowDeclaration::new(None, Some(InformationLabel::Top), true, BTreeSet::new()).is_err()
    );
    println!("READ declaration: retained contract label constructed");
    println!("ALLOW pricing-team channel input; its public acknowledgment does not widen input");
    println!("REFUSE public pull request input: contract restriction retained");
    println!("REFUSE missing clearance; reject Top at contract construction");
    Ok(())
}
