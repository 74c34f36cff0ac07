//! The information label lattice (README, "Information-flow model").
//!
//! A label is either `Known { owners, compartments }` or `Top`. `owners` maps each owner to
//! the principals it lets read (an owner always reads its own data); `compartments` are extra
//! restriction tags. Bottom (public) is `Known` with neither. Moving up the order adds
//! restrictions: more owners, narrower reader sets, more compartments. `Top` is above all.
//!
//! Every `InformationLabel` value in the program is valid: the `Known` variant cannot be
//! built outside this crate except through [`InformationLabel::try_known`] or strict JSON
//! decoding, both of which check the owner-reads-itself rule and the size limits.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

use crate::ident::{Compartment, PrincipalId};

/// Most owners a label may carry.
pub const MAX_OWNERS: usize = 64;
/// Most readers one owner may list (the owner included).
pub const MAX_READERS_PER_OWNER: usize = 256;
/// Most compartments a label may carry.
pub const MAX_COMPARTMENTS: usize = 64;

/// Owner -> the principals that owner lets read.
pub type OwnerMap = BTreeMap<PrincipalId, BTreeSet<PrincipalId>>;

/// Why a set of owners and compartments is not a valid label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    /// An owner's reader set does not contain the owner.
    #[error(
        "owner {owner:?} is missing from its own reader set; an owner must be able to read its own data"
    )]
    OwnerMissingSelfReader {
        /// The owner at fault.
        owner: String,
    },
    /// More than [`MAX_OWNERS`] owners.
    #[error("label has {count} owners; the limit is 64")]
    TooManyOwners {
        /// How many owners the label would have.
        count: usize,
    },
    /// An owner lists more than [`MAX_READERS_PER_OWNER`] readers.
    #[error("owner {owner:?} lists {count} readers; the limit is 256")]
    TooManyReaders {
        /// The owner at fault.
        owner: String,
        /// How many readers it lists.
        count: usize,
    },
    /// More than [`MAX_COMPARTMENTS`] compartments.
    #[error("label has {count} compartments; the limit is 64")]
    TooManyCompartments {
        /// How many compartments the label would have.
        count: usize,
    },
}

/// A confidentiality label: who may read data carrying it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum InformationLabel {
    /// A label with explicit owners (each with its readers) and compartments.
    #[non_exhaustive]
    Known {
        /// Owner -> readers; every owner is among its own readers.
        owners: OwnerMap,
        /// Restriction tags.
        compartments: BTreeSet<Compartment>,
    },
    /// The top of the lattice: nothing is known about who may read, so nothing may.
    Top,
}

impl InformationLabel {
    /// The public label: no owners, no compartments. It flows everywhere.
    pub fn bottom() -> Self {
        InformationLabel::Known {
            owners: BTreeMap::new(),
            compartments: BTreeSet::new(),
        }
    }

    /// True for exactly the public label.
    pub fn is_bottom(&self) -> bool {
        matches!(self, InformationLabel::Known { owners, compartments } if owners.is_empty() && compartments.is_empty())
    }

    /// True for `Top`.
    pub fn is_top(&self) -> bool {
        matches!(self, InformationLabel::Top)
    }

    /// Builds a `Known` label, checking that every owner reads its own data and the limits.
    pub fn try_known(
        owners: OwnerMap,
        compartments: BTreeSet<Compartment>,
    ) -> Result<Self, LabelError> {
        check_known(&owners, &compartments)?;
        Ok(InformationLabel::Known {
            owners,
            compartments,
        })
    }

    /// The owner map, or `None` for `Top`.
    pub fn owners(&self) -> Option<&OwnerMap> {
        match self {
            InformationLabel::Known { owners, .. } => Some(owners),
            InformationLabel::Top => None,
        }
    }

    /// The compartments, or `None` for `Top`.
    pub fn compartments(&self) -> Option<&BTreeSet<Compartment>> {
        match self {
            InformationLabel::Known { compartments, .. } => Some(compartments),
            InformationLabel::Top => None,
        }
    }

    /// Whether data labelled `self` may flow to a place labelled `to`.
    ///
    /// Anything flows to `Top`; `Top` flows only to `Top`. `Known a` flows to `Known b` when
    /// every compartment of `a` is in `b` and every owner of `a` is an owner of `b` whose
    /// readers in `b` are a subset of its readers in `a`.
    pub fn flows_to(&self, to: &InformationLabel) -> bool {
        match (self, to) {
            (_, InformationLabel::Top) => true,
            (InformationLabel::Top, InformationLabel::Known { .. }) => false,
            (
                InformationLabel::Known {
                    owners: src_owners,
                    compartments: src_compartments,
                },
                InformationLabel::Known {
                    owners: dst_owners,
                    compartments: dst_compartments,
                },
            ) => {
                src_owners.len() <= dst_owners.len()
                    && src_compartments.is_subset(dst_compartments)
                    && src_owners.iter().all(|(owner, src_readers)| {
                        dst_owners
                            .get(owner)
                            .is_some_and(|dst_readers| dst_readers.is_subset(src_readers))
                    })
            }
        }
    }

    /// The least upper bound of `self` and `other`.
    ///
    /// `Top` absorbs. Otherwise owners are united (an owner on both sides keeps the
    /// intersection of its reader sets) and compartments are united. Fails when the result
    /// would exceed the owner or compartment limits.
    pub fn join_restrictions(&self, other: &InformationLabel) -> Result<Self, LabelError> {
        let (
            InformationLabel::Known {
                owners: a_owners,
                compartments: a_compartments,
            },
            InformationLabel::Known {
                owners: b_owners,
                compartments: b_compartments,
            },
        ) = (self, other)
        else {
            return Ok(InformationLabel::Top);
        };
        // Cheap exits keep the common "join with bottom / with itself" cases allocation-light.
        if other.is_bottom() || self == other {
            return Ok(self.clone());
        }
        if self.is_bottom() {
            return Ok(other.clone());
        }
        let mut owners = a_owners.clone();
        for (owner, b_readers) in b_owners {
            match owners.get_mut(owner) {
                Some(readers) => readers.retain(|r| b_readers.contains(r)),
                None => {
                    owners.insert(owner.clone(), b_readers.clone());
                }
            }
        }
        let mut compartments = a_compartments.clone();
        compartments.extend(b_compartments.iter().cloned());
        // Intersections keep each owner (both sides contain it) and only shrink reader sets,
        // so only the owner and compartment counts can exceed a limit here.
        if owners.len() > MAX_OWNERS {
            return Err(LabelError::TooManyOwners {
                count: owners.len(),
            });
        }
        if compartments.len() > MAX_COMPARTMENTS {
            return Err(LabelError::TooManyCompartments {
                count: compartments.len(),
            });
        }
        Ok(InformationLabel::Known {
            owners,
            compartments,
        })
    }

    /// Join for the output path: a join that would exceed the limits becomes `Top`, because
    /// after a tool has run its output must never be labelled lower than it is.
    pub fn join_or_top(&self, other: &InformationLabel) -> Self {
        self.join_restrictions(other)
            .unwrap_or(InformationLabel::Top)
    }

    /// The canonical JSON text: fields in the order `kind`, `owners`, `compartments`, keys and
    /// set members sorted, no whitespace. Re-ordered input yields identical bytes.
    pub fn to_canonical_json(&self) -> String {
        // Serializing owned strings and sorted collections into a String cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Decodes a label from strict JSON (see the module docs of [`crate::label`]).
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

fn check_known(owners: &OwnerMap, compartments: &BTreeSet<Compartment>) -> Result<(), LabelError> {
    if owners.len() > MAX_OWNERS {
        return Err(LabelError::TooManyOwners {
            count: owners.len(),
        });
    }
    if compartments.len() > MAX_COMPARTMENTS {
        return Err(LabelError::TooManyCompartments {
            count: compartments.len(),
        });
    }
    for (owner, readers) in owners {
        if readers.len() > MAX_READERS_PER_OWNER {
            return Err(LabelError::TooManyReaders {
                owner: owner.to_string(),
                count: readers.len(),
            });
        }
        if !readers.contains(owner) {
            return Err(LabelError::OwnerMissingSelfReader {
                owner: owner.to_string(),
            });
        }
    }
    Ok(())
}

impl fmt::Debug for InformationLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_canonical_json())
    }
}

impl fmt::Display for InformationLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InformationLabel::Top => f.write_str("top"),
            _ if self.is_bottom() => f.write_str("bottom"),
            _ => f.write_str(&self.to_canonical_json()),
        }
    }
}

impl Serialize for InformationLabel {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            InformationLabel::Top => {
                let mut map = serializer.serialize_map(Some(1))?;
                map.serialize_entry("kind", "top")?;
                map.end()
            }
            InformationLabel::Known {
                owners,
                compartments,
            } => {
                let mut map = serializer.serialize_map(Some(3))?;
                map.serialize_entry("kind", "known")?;
                map.serialize_entry("owners", owners)?;
                map.serialize_entry("compartments", compartments)?;
                map.end()
            }
        }
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum LabelField {
    Kind,
    Owners,
    Compartments,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum LabelKind {
    Known,
    Top,
}

impl<'de> Deserialize<'de> for InformationLabel {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(LabelVisitor)
    }
}

struct LabelVisitor;

impl<'de> Visitor<'de> for LabelVisitor {
    type Value = InformationLabel;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an information label object ({\"kind\":\"known\",...} or {\"kind\":\"top\"})")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kind: Option<LabelKind> = None;
        let mut owners: Option<OwnerMap> = None;
        let mut compartments: Option<BTreeSet<Compartment>> = None;
        while let Some(field) = map.next_key::<LabelField>()? {
            match field {
                LabelField::Kind => {
                    if kind.is_some() {
                        return Err(de::Error::duplicate_field("kind"));
                    }
                    kind = Some(map.next_value()?);
                }
                LabelField::Owners => {
                    if owners.is_some() {
                        return Err(de::Error::duplicate_field("owners"));
                    }
                    owners = Some(map.next_value::<StrictOwners>()?.0);
                }
                LabelField::Compartments => {
                    if compartments.is_some() {
                        return Err(de::Error::duplicate_field("compartments"));
                    }
                    compartments = Some(
                        map.next_value::<StrictSet<Compartment, MAX_COMPARTMENTS>>()?
                            .0,
                    );
                }
            }
        }
        match kind {
            None => Err(de::Error::missing_field("kind")),
            Some(LabelKind::Top) => {
                if owners.is_some() || compartments.is_some() {
                    Err(de::Error::custom(
                        "top label has payload fields; {\"kind\":\"top\"} takes no owners or compartments",
                    ))
                } else {
                    Ok(InformationLabel::Top)
                }
            }
            Some(LabelKind::Known) => {
                let owners = owners.ok_or_else(|| de::Error::missing_field("owners"))?;
                let compartments =
                    compartments.ok_or_else(|| de::Error::missing_field("compartments"))?;
                InformationLabel::try_known(owners, compartments).map_err(de::Error::custom)
            }
        }
    }
}

/// A JSON array decoded into a set, rejecting duplicates and more than `MAX` members as they
/// stream in (before the set grows past the limit).
pub(crate) struct StrictSet<T, const MAX: usize>(pub(crate) BTreeSet<T>);

impl<'de, T, const MAX: usize> Deserialize<'de> for StrictSet<T, MAX>
where
    T: Deserialize<'de> + Ord + fmt::Display,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SetVisitor<T, const MAX: usize>(std::marker::PhantomData<T>);
        impl<'de, T, const MAX: usize> Visitor<'de> for SetVisitor<T, MAX>
        where
            T: Deserialize<'de> + Ord + fmt::Display,
        {
            type Value = StrictSet<T, MAX>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "an array of at most {MAX} distinct identifiers")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut set = BTreeSet::new();
                while let Some(item) = seq.next_element::<T>()? {
                    if set.len() == MAX {
                        return Err(de::Error::custom(format_args!(
                            "more than {MAX} entries; the limit is {MAX}"
                        )));
                    }
                    if set.contains(&item) {
                        return Err(de::Error::custom(format_args!(
                            "duplicate entry {item:?}",
                            item = item.to_string()
                        )));
                    }
                    set.insert(item);
                }
                Ok(StrictSet(set))
            }
        }
        deserializer.deserialize_seq(SetVisitor::<T, MAX>(std::marker::PhantomData))
    }
}

struct StrictOwners(OwnerMap);

impl<'de> Deserialize<'de> for StrictOwners {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OwnersVisitor;
        impl<'de> Visitor<'de> for OwnersVisitor {
            type Value = StrictOwners;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object mapping each owner to an array of its readers")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut owners = OwnerMap::new();
                while let Some(owner) = map.next_key::<PrincipalId>()? {
                    if owners.len() == MAX_OWNERS {
                        return Err(de::Error::custom(
                            "label has more than 64 owners; the limit is 64",
                        ));
                    }
                    if owners.contains_key(&owner) {
                        return Err(de::Error::custom(format_args!(
                            "duplicate owner {:?}",
                            owner.as_str()
                        )));
                    }
                    let readers = map
                        .next_value::<StrictSet<PrincipalId, MAX_READERS_PER_OWNER>>()
                        .map_err(|e| {
                            de::Error::custom(format_args!(
                                "readers of owner {:?}: {e}",
                                owner.as_str()
                            ))
                        })?;
                    owners.insert(owner, readers.0);
                }
                Ok(StrictOwners(owners))
            }
        }
        deserializer.deserialize_map(OwnersVisitor)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(s: &str) -> PrincipalId {
        PrincipalId::new(s).unwrap()
    }
    fn c(s: &str) -> Compartment {
        Compartment::new(s).unwrap()
    }
    fn known(owners: &[(&str, &[&str])], comps: &[&str]) -> InformationLabel {
        InformationLabel::try_known(
            owners
                .iter()
                .map(|(o, rs)| (p(o), rs.iter().map(|r| p(r)).collect()))
                .collect(),
            comps.iter().map(|x| c(x)).collect(),
        )
        .unwrap()
    }

    #[test]
    fn bottom_is_the_unique_public_label() {
        assert!(InformationLabel::bottom().is_bottom());
        assert!(!InformationLabel::Top.is_bottom());
        assert!(!known(&[("a", &["a"])], &[]).is_bottom());
        assert!(!known(&[], &["x"]).is_bottom());
        assert_eq!(known(&[], &[]), InformationLabel::bottom());
    }

    #[test]
    fn order_direction() {
        let bottom = InformationLabel::bottom();
        let ab = known(&[("a", &["a", "b"])], &[]);
        let a = known(&[("a", &["a"])], &[]);
        let a_fin = known(&[("a", &["a"])], &["fin"]);
        assert!(bottom.flows_to(&ab));
        assert!(ab.flows_to(&a), "narrowing readers moves up");
        assert!(!a.flows_to(&ab));
        assert!(a.flows_to(&a_fin), "adding a compartment moves up");
        assert!(!a_fin.flows_to(&a));
        assert!(a_fin.flows_to(&InformationLabel::Top));
        assert!(InformationLabel::Top.flows_to(&InformationLabel::Top));
        assert!(!InformationLabel::Top.flows_to(&a_fin));
        // An owner missing from the destination blocks the flow.
        assert!(!a.flows_to(&known(&[("b", &["b"])], &[])));
    }

    #[test]
    fn join_intersects_readers_and_unites_the_rest() {
        let x = known(&[("a", &["a", "b", "c"]), ("z", &["z"])], &["fin"]);
        let y = known(&[("a", &["a", "c", "d"]), ("q", &["q"])], &["pii"]);
        let j = x.join_restrictions(&y).unwrap();
        assert_eq!(
            j,
            known(
                &[("a", &["a", "c"]), ("q", &["q"]), ("z", &["z"])],
                &["fin", "pii"]
            )
        );
        assert_eq!(
            x.join_restrictions(&InformationLabel::Top),
            Ok(InformationLabel::Top)
        );
    }

    #[test]
    fn join_overflow_is_an_error_and_top_on_the_output_path() {
        let many = |prefix: &str, n: usize| {
            InformationLabel::try_known(
                (0..n)
                    .map(|i| {
                        let o = p(&format!("{prefix}{i}"));
                        (o.clone(), BTreeSet::from([o]))
                    })
                    .collect(),
                BTreeSet::new(),
            )
            .unwrap()
        };
        let (a, b) = (many("a", 40), many("b", 40));
        assert_eq!(
            a.join_restrictions(&b),
            Err(LabelError::TooManyOwners { count: 80 })
        );
        assert_eq!(a.join_or_top(&b), InformationLabel::Top);
        let comps = |prefix: &str| {
            InformationLabel::try_known(
                BTreeMap::new(),
                (0..40).map(|i| c(&format!("{prefix}{i}"))).collect(),
            )
            .unwrap()
        };
        assert_eq!(
            comps("x").join_restrictions(&comps("y")),
            Err(LabelError::TooManyCompartments { count: 80 })
        );
    }

    #[test]
    fn try_known_checks_rules() {
        assert_eq!(
            InformationLabel::try_known(
                BTreeMap::from([(p("a"), BTreeSet::from([p("b")]))]),
                BTreeSet::new()
            ),
            Err(LabelError::OwnerMissingSelfReader { owner: "a".into() })
        );
        let readers: BTreeSet<_> = (0..257)
            .map(|i| p(&format!("r{i}")))
            .chain([p("a")])
            .collect();
        assert!(matches!(
            InformationLabel::try_known(BTreeMap::from([(p("a"), readers)]), BTreeSet::new()),
            Err(LabelError::TooManyReaders { count: 258, .. })
        ));
    }

    // ---------- JSON ----------

    fn reject(json: &str, needle: &str) {
        let err = InformationLabel::from_json(json)
            .expect_err(json)
            .to_string();
        assert!(
            err.contains(needle),
            "input {json}\nerror {err}\nexpected it to mention {needle:?}"
        );
    }

    #[test]
    fn json_round_trip_is_canonical() {
        let text = r#"{"kind":"known","owners":{"alice":["alice","bob"],"carol":["carol"]},"compartments":["finance","pii"]}"#;
        let label = InformationLabel::from_json(text).unwrap();
        assert_eq!(label.to_canonical_json(), text);
        let reordered = r#"{ "compartments":["pii","finance"], "owners":{"carol":["carol"],"alice":["bob","alice"]}, "kind":"known" }"#;
        assert_eq!(
            InformationLabel::from_json(reordered)
                .unwrap()
                .to_canonical_json(),
            text
        );
        assert_eq!(
            InformationLabel::Top.to_canonical_json(),
            r#"{"kind":"top"}"#
        );
        assert_eq!(
            InformationLabel::from_json(r#"{"kind":"top"}"#).unwrap(),
            InformationLabel::Top
        );
        assert_eq!(
            InformationLabel::bottom().to_canonical_json(),
            r#"{"kind":"known","owners":{},"compartments":[]}"#
        );
    }

    #[test]
    fn json_rejects_bad_identifiers() {
        reject(
            r#"{"kind":"known","owners":{"":[""]},"compartments":[]}"#,
            "empty",
        );
        let long = "x".repeat(257);
        reject(
            &format!(r#"{{"kind":"known","owners":{{}},"compartments":["{long}"]}}"#),
            "257 bytes",
        );
        reject(
            r#"{"kind":"known","owners":{" a":[" a"]},"compartments":[]}"#,
            "whitespace",
        );
        reject(
            r#"{"kind":"known","owners":{"a ":["a "]},"compartments":[]}"#,
            "whitespace",
        );
        reject(
            r#"{"kind":"known","owners":{},"compartments":["a\u0007"]}"#,
            "U+0007",
        );
        reject(
            r#"{"kind":"known","owners":{},"compartments":["a\u0085b"]}"#,
            "U+0085",
        );
    }

    #[test]
    fn json_rejects_structural_problems() {
        reject(
            r#"{"kind":"known","owners":{"a":["b"]},"compartments":[]}"#,
            "missing from its own reader set",
        );
        reject(
            r#"{"kind":"known","owners":{},"compartments":[],"extra":1}"#,
            "unknown field `extra`",
        );
        reject(
            r#"{"kind":"known","kind":"known","owners":{},"compartments":[]}"#,
            "duplicate field `kind`",
        );
        reject(
            r#"{"kind":"known","owners":{"a":["a"],"a":["a"]},"compartments":[]}"#,
            "duplicate owner",
        );
        reject(
            r#"{"kind":"known","owners":{"a":["a","a"]},"compartments":[]}"#,
            "duplicate entry",
        );
        reject(
            r#"{"kind":"known","owners":{},"compartments":["x","x"]}"#,
            "duplicate entry",
        );
        reject(r#"{"kind":"top","owners":{}}"#, "top label has payload");
        reject(
            r#"{"kind":"top","compartments":[]}"#,
            "top label has payload",
        );
        reject(
            r#"{"kind":"known","compartments":[]}"#,
            "missing field `owners`",
        );
        reject(
            r#"{"kind":"known","owners":{}}"#,
            "missing field `compartments`",
        );
        reject(r#"{"owners":{},"compartments":[]}"#, "missing field `kind`");
        reject(r#"{"kind":"bottom"}"#, "unknown variant `bottom`");
        reject("null", "invalid type: null");
        reject(
            r#"{"kind":"known","owners":null,"compartments":[]}"#,
            "invalid type: null",
        );
    }

    #[test]
    fn json_rejects_too_many_entries_while_streaming() {
        let owners: Vec<String> = (0..65).map(|i| format!(r#""o{i}":["o{i}"]"#)).collect();
        reject(
            &format!(
                r#"{{"kind":"known","owners":{{{}}},"compartments":[]}}"#,
                owners.join(",")
            ),
            "more than 64 owners",
        );
        let readers: Vec<String> = (0..257).map(|i| format!(r#""r{i}""#)).collect();
        reject(
            &format!(
                r#"{{"kind":"known","owners":{{"a":[{}]}},"compartments":[]}}"#,
                readers.join(",")
            ),
            "more than 256 entries",
        );
        let comps: Vec<String> = (0..65).map(|i| format!(r#""c{i}""#)).collect();
        reject(
            &format!(
                r#"{{"kind":"known","owners":{{}},"compartments":[{}]}}"#,
                comps.join(",")
            ),
            "more than 64 entries",
        );
    }

    // ---------- properties ----------

    /// Labels over small alphabets, so that generated pairs often share owners, readers and
    /// compartments and the interesting order relations actually occur.
    pub(crate) fn arb_label() -> impl Strategy<Value = InformationLabel> {
        let principal = prop::sample::select(vec!["p0", "p1", "p2", "p3", "p4"]);
        let known = (
            prop::collection::btree_map(
                principal.clone(),
                prop::collection::btree_set(principal, 0..4),
                0..3,
            ),
            prop::collection::btree_set(prop::sample::select(vec!["c0", "c1", "c2"]), 0..3),
        )
            .prop_map(|(owners, comps)| {
                InformationLabel::try_known(
                    owners
                        .into_iter()
                        .map(|(o, rs)| {
                            let o = p(o);
                            let mut readers: BTreeSet<_> = rs.into_iter().map(p).collect();
                            readers.insert(o.clone());
                            (o, readers)
                        })
                        .collect(),
                    comps.into_iter().map(c).collect(),
                )
                .unwrap()
            });
        prop_oneof![9 => known, 1 => Just(InformationLabel::Top)]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

        #[test]
        fn order_is_reflexive(a in arb_label()) {
            prop_assert!(a.flows_to(&a));
        }

        #[test]
        fn order_is_antisymmetric(a in arb_label(), b in arb_label()) {
            if a.flows_to(&b) && b.flows_to(&a) {
                prop_assert_eq!(a, b);
            }
        }

        #[test]
        fn order_is_transitive(a in arb_label(), b in arb_label(), c in arb_label()) {
            if a.flows_to(&b) && b.flows_to(&c) {
                prop_assert!(a.flows_to(&c));
            }
        }

        #[test]
        fn join_is_commutative(a in arb_label(), b in arb_label()) {
            prop_assert_eq!(a.join_restrictions(&b).unwrap(), b.join_restrictions(&a).unwrap());
        }

        #[test]
        fn join_is_associative(a in arb_label(), b in arb_label(), c in arb_label()) {
            let left = a.join_restrictions(&b).unwrap().join_restrictions(&c).unwrap();
            let right = a.join_restrictions(&b.join_restrictions(&c).unwrap()).unwrap();
            prop_assert_eq!(left, right);
        }

        #[test]
        fn join_is_idempotent(a in arb_label()) {
            prop_assert_eq!(a.join_restrictions(&a).unwrap(), a);
        }

        #[test]
        fn join_is_an_upper_bound(a in arb_label(), b in arb_label()) {
            let j = a.join_restrictions(&b).unwrap();
            prop_assert!(a.flows_to(&j));
            prop_assert!(b.flows_to(&j));
        }

        #[test]
        fn join_is_the_least_upper_bound(a in arb_label(), b in arb_label(), u in arb_label()) {
            if a.flows_to(&u) && b.flows_to(&u) {
                prop_assert!(a.join_restrictions(&b).unwrap().flows_to(&u));
            }
        }

        #[test]
        fn bottom_is_least_and_top_is_greatest(a in arb_label()) {
            prop_assert!(InformationLabel::bottom().flows_to(&a));
            prop_assert!(a.flows_to(&InformationLabel::Top));
        }

        #[test]
        fn json_round_trips(a in arb_label()) {
            let text = a.to_canonical_json();
            let back = InformationLabel::from_json(&text).unwrap();
            prop_assert_eq!(&back, &a);
            prop_assert_eq!(back.to_canonical_json(), text);
        }

        #[test]
        fn arbitrary_text_never_panics(text in ".{0,200}") {
            let _ = InformationLabel::from_json(&text);
        }
    }
}
