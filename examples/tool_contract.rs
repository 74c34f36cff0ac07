//! The pricing-lab contracts, written against flowhost's own API.
//!
//! A contract reader returns terms owned by `larkfield-pricing`; the pricing team's channel
//! is cleared for that label and egresses; the public pull request is a public sink. Each
//! outcome is asserted before its line is printed.

use std::collections::{BTreeMap, BTreeSet};

use flowhost::{
    EgressDenial, InformationLabel, PrincipalId, ToolFlowDeclaration, authorize_egress,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let owner = PrincipalId::new("larkfield-pricing")?;
    let internal = InformationLabel::try_known(
        BTreeMap::from([(owner.clone(), BTreeSet::from([owner]))]),
        BTreeSet::new(),
    )?;

    // The reader's output carries the contract label; it promises no egress.
    let reader = ToolFlowDeclaration::new(Some(internal.clone()), None, false, BTreeSet::new())?;
    // The team channel accepts contract data and acknowledges with a public output.
    let team_channel = ToolFlowDeclaration::new(
        Some(InformationLabel::bottom()),
        Some(internal.clone()),
        true,
        BTreeSet::new(),
    )?;
    let pull_request = ToolFlowDeclaration::public_egress();

    let read_output = reader
        .output_label()
        .ok_or("reader declares an output label")?;
    let retained = InformationLabel::bottom().join_restrictions(read_output)?;
    assert_eq!(retained, internal);
    println!("READ declaration: retained contract label constructed");

    assert_eq!(
        authorize_egress(&retained, team_channel.input_clearance()),
        Ok(())
    );
    assert!(
        team_channel
            .output_label()
            .is_some_and(InformationLabel::is_bottom)
    );
    // The public acknowledgment joins into state without lowering what was retained.
    let after_ack = retained.join_restrictions(&InformationLabel::bottom())?;
    assert_eq!(after_ack, retained);
    println!("ALLOW pricing-team channel input; its public acknowledgment does not widen input");

    assert_eq!(
        authorize_egress(&after_ack, pull_request.input_clearance()),
        Err(EgressDenial::FlowViolation)
    );
    println!("REFUSE public pull request input: contract restriction retained");

    // Outbound I/O the host observes counts as egress even with no declaration behind it.
    assert_eq!(
        authorize_egress(&after_ack, None),
        Err(EgressDenial::MissingClearance)
    );
    assert!(
        ToolFlowDeclaration::new(None, Some(InformationLabel::Top), true, BTreeSet::new()).is_err()
    );
    println!("REFUSE missing clearance; reject Top at contract construction");
    Ok(())
}
