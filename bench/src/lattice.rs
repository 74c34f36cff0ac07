//! Label lattice decisions on labels of 8 owners x 8 readers x 8 compartments.

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;

use flowhost::{Compartment, InformationLabel, PrincipalId, authorize_egress};

use crate::harness::{Row, fmt_duration, fmt_rate, per_call};

fn id(s: String) -> PrincipalId {
    PrincipalId::new(s).expect("benchmark identifiers are valid")
}

/// A label of 8 owners (each read by itself and 7 readers) and 8 compartments.
fn label_8x8x8() -> InformationLabel {
    let owners: BTreeMap<_, _> = (0..8)
        .map(|o| {
            let owner = id(format!("owner-{o}"));
            let mut readers: BTreeSet<_> = (0..7).map(|r| id(format!("reader-{r}"))).collect();
            readers.insert(owner.clone());
            (owner, readers)
        })
        .collect();
    let compartments = (0..8)
        .map(|c| Compartment::new(format!("compartment-{c}")).expect("valid"))
        .collect();
    InformationLabel::try_known(owners, compartments).expect("within limits")
}

/// Runs the lattice benchmarks.
pub fn run(quick: bool) -> Vec<Row> {
    let source = label_8x8x8();
    let clearance = {
        let owners = source
            .owners()
            .expect("known")
            .keys()
            .map(|o| (o.clone(), BTreeSet::from([o.clone()])))
            .collect();
        InformationLabel::try_known(owners, source.compartments().expect("known").clone())
            .expect("valid")
    };
    assert_eq!(authorize_egress(&source, Some(&clearance)), Ok(()));
    let samples = if quick { 20 } else { 200 };
    let decide = per_call(samples, 10_000, || {
        black_box(authorize_egress(
            black_box(&source),
            Some(black_box(&clearance)),
        ))
        .ok();
    });
    let median = decide.median();
    let rate = 1e9 / median.as_nanos().max(1) as f64;
    vec![Row {
        name: "authorize_egress, 8x8x8 labels, one core".into(),
        flowhost: format!("{} ({})", fmt_duration(median), fmt_rate(rate)),
        baseline: None,
        comparison: format!("{:.1}x the goal", rate / 1e6),
        goal: ">= 1 M/s".into(),
        met: rate >= 1e6,
    }]
}
