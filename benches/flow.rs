//! Label lattice benchmarks: `flows_to`, `join_restrictions` and `authorize_egress` on labels
//! of 8 owners x 8 readers x 8 compartments (issue goal: >= 1,000,000 `authorize_egress`
//! decisions per second on one core). Run with `cargo bench --bench flow`.

// `criterion_main!` defines a public `main` that cannot carry a doc comment.
#![allow(missing_docs)]

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flowhost::{Compartment, InformationLabel, PrincipalId, authorize_egress};

/// A label with 8 owners, each readable by itself and 7 others, and 8 compartments.
/// `reader_offset` shifts the shared readers so two labels overlap only partly.
pub fn label_8x8x8(tag: &str, reader_offset: usize) -> InformationLabel {
    let owners = (0..8)
        .map(|o| {
            let owner = PrincipalId::new(format!("owner-{o}")).unwrap();
            let mut readers: BTreeSet<_> = (0..7)
                .map(|r| PrincipalId::new(format!("reader-{}", r + reader_offset)).unwrap())
                .collect();
            readers.insert(owner.clone());
            (owner, readers)
        })
        .collect::<BTreeMap<_, _>>();
    let compartments = (0..8)
        .map(|c| Compartment::new(format!("{tag}-compartment-{c}")).unwrap())
        .collect();
    InformationLabel::try_known(owners, compartments).unwrap()
}

fn lattice(c: &mut Criterion) {
    let source = label_8x8x8("shared", 0);
    // Same owners and compartments, readers narrowed to the owner alone: the source flows to it,
    // so every owner and compartment is compared (the worst case for an allow).
    let clearance = {
        let owners = source
            .owners()
            .unwrap()
            .keys()
            .map(|o| (o.clone(), BTreeSet::from([o.clone()])))
            .collect();
        InformationLabel::try_known(owners, source.compartments().unwrap().clone()).unwrap()
    };
    let other = label_8x8x8("other", 3);
    assert!(source.flows_to(&clearance));
    assert_eq!(authorize_egress(&source, Some(&clearance)), Ok(()));

    let mut group = c.benchmark_group("label_8x8x8");
    group.throughput(Throughput::Elements(1));
    group.bench_function("flows_to", |b| {
        b.iter(|| black_box(black_box(&source).flows_to(black_box(&clearance))))
    });
    group.bench_function("join_restrictions", |b| {
        b.iter(|| black_box(black_box(&source).join_restrictions(black_box(&other))))
    });
    group.bench_function("authorize_egress", |b| {
        b.iter(|| {
            black_box(authorize_egress(
                black_box(&source),
                Some(black_box(&clearance)),
            ))
        })
    });
    group.finish();
}

criterion_group!(benches, lattice);
criterion_main!(benches);
