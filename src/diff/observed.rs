//! Reading observed decisions for the diff: the JSONL record stream (flowhost's, or any
//! producer's decision objects one per line) or an `assay.tool_decision_surface.v0` envelope.
//!
//! The diff reads decisions leniently: it takes only the fields it judges (`tool`,
//! `classification`, `action.class`, `action.target`, `decision.effect`, `server.id`, and
//! from the `flowhost` extension when present `seq`, `prev_hash`, `event`, `egress_basis`,
//! `folded` and `broker.destination.other_host_names`, the last three leniently) and ignores
//! the rest, so other producers' extensions are accepted. Strings are
//! borrowed from the input where possible: the diff reads a million records in well under
//! two seconds. Leniency never extends to ambiguity: a target naming a field twice is
//! refused, and an envelope is first parsed strictly (no key repeated anywhere), so the
//! decisions judged are the very ones the chain verifies.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::surface::ScalarView;
use crate::records::{DecisionRecord, TargetValue};

/// A string borrowed from the input when it has no escapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Text<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(PhantomData))
    }
}

/// One scalar of an observed target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scalar<'a> {
    Text(Cow<'a, str>),
    Integer(u64),
    Flag(bool),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for Scalar<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Scalar<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Scalar::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Scalar::Text(Cow::Owned(v.to_string())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Scalar::Integer(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(u64::try_from(v).map_or(Scalar::Other, Scalar::Integer))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(Scalar::Flag(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// An observed target: its fields in input order, each named once (a field named twice is
/// refused when reading, as the record schema's `Target` refuses it: readers keeping the first
/// and readers keeping the last value would judge the same decision differently).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct ObsTarget<'a>(pub Vec<(Cow<'a, str>, Scalar<'a>)>);

impl<'de: 'a, 'a> Deserialize<'de> for ObsTarget<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ObsTarget<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a target object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut fields = Vec::with_capacity(6);
                while let Some((k, v)) = m.next_entry::<Text<'a>, Scalar<'a>>()? {
                    // Targets hold a handful of fields: a linear scan is cheaper than a set.
                    if fields.iter().any(|(seen, _)| *seen == k.0) {
                        return Err(de::Error::custom(format_args!(
                            "action.target field {:?} appears twice; a decision must name each target field once",
                            k.0
                        )));
                    }
                    fields.push((k.0, v));
                }
                Ok(ObsTarget(fields))
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

impl<'a> ObsTarget<'a> {
    /// A field, as the matcher sees it.
    pub fn get(&self, field: &str) -> Option<ScalarView<'_>> {
        self.0
            .iter()
            .find(|(k, _)| k == field)
            .map(|(_, v)| match v {
                Scalar::Text(s) => ScalarView::Text(s),
                Scalar::Integer(n) => ScalarView::Integer(*n),
                Scalar::Flag(b) => ScalarView::Flag(*b),
                Scalar::Other => ScalarView::Other,
            })
    }

    /// The provider string.
    pub fn provider(&self) -> Option<&str> {
        match self.get("provider") {
            Some(ScalarView::Text(s)) => Some(s),
            _ => None,
        }
    }

    /// The target as canonical JSON (fields sorted), for reports.
    pub fn to_json(&self) -> serde_json::Value {
        let map: serde_json::Map<String, serde_json::Value> = self
            .0
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Scalar::Text(s) => serde_json::Value::from(s.as_ref()),
                    Scalar::Integer(n) => serde_json::Value::from(*n),
                    Scalar::Flag(b) => serde_json::Value::from(*b),
                    Scalar::Other => serde_json::Value::Null,
                };
                (k.to_string(), v)
            })
            .collect();
        serde_json::Value::Object(map)
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct ObsTool<'a> {
    #[serde(borrow)]
    pub name: Text<'a>,
    #[serde(default, borrow)]
    pub category: Option<Text<'a>>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ObsAction<'a> {
    #[serde(default, borrow)]
    pub class: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub verb: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub target: Option<ObsTarget<'a>>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ObsVerdict<'a> {
    #[serde(borrow)]
    pub effect: Text<'a>,
}

/// `flowhost.egress_basis`, read leniently: anything that is not an object with boolean
/// `declared` and `observed` reads as unknown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ObsEgressBasis {
    pub declared: Option<bool>,
    pub observed: Option<bool>,
}

impl ObsEgressBasis {
    /// The broker saw outbound I/O that the signed declaration says does not happen.
    pub fn undeclared_but_observed(&self) -> bool {
        self.declared == Some(false) && self.observed == Some(true)
    }
}

impl<'de> Deserialize<'de> for ObsEgressBasis {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EgressBasisVisitor)
    }
}

/// Reads an egress basis leniently (any value that is not an object, and any field that is
/// not a boolean, reads as unknown) but never ambiguously: a field named twice is an error,
/// since readers keeping the first and readers keeping the last would judge the line
/// differently.
struct EgressBasisVisitor;

impl<'de> Visitor<'de> for EgressBasisVisitor {
    type Value = ObsEgressBasis;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an egress basis")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ObsEgressBasis, A::Error> {
        let mut basis = ObsEgressBasis::default();
        let (mut declared, mut observed) = (false, false);
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            let (seen, slot) = match key.as_ref() {
                "declared" => (&mut declared, &mut basis.declared),
                "observed" => (&mut observed, &mut basis.observed),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            if std::mem::replace(seen, true) {
                return Err(de::Error::custom(format_args!(
                    "egress_basis.{key} is given twice"
                )));
            }
            *slot = map.next_value::<serde_json::Value>()?.as_bool();
        }
        Ok(basis)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ObsEgressBasis, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ObsEgressBasis::default())
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<ObsEgressBasis, E> {
        Ok(ObsEgressBasis::default())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<ObsEgressBasis, E> {
        Ok(ObsEgressBasis::default())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<ObsEgressBasis, E> {
        Ok(ObsEgressBasis::default())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<ObsEgressBasis, E> {
        Ok(ObsEgressBasis::default())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<ObsEgressBasis, E> {
        Ok(ObsEgressBasis::default())
    }

    fn visit_unit<E: de::Error>(self) -> Result<ObsEgressBasis, E> {
        Ok(ObsEgressBasis::default())
    }
}

/// The parts of the `flowhost` extension the diff reads: the chain fields (whose presence
/// makes a decision a flowhost record that must verify), the event kind and the egress basis.
#[derive(Debug, Deserialize)]
pub(crate) struct ObsExtension<'a> {
    #[serde(default)]
    pub seq: Option<u64>,
    #[serde(default)]
    pub prev_hash: Option<IgnoredAny>,
    #[serde(default, borrow)]
    pub event: Option<Text<'a>>,
    #[serde(default)]
    pub egress_basis: Option<ObsEgressBasis>,
    /// `flowhost.folded`: counted only on a chained refusal (see [`ObsExtension::times`]);
    /// a count is evidence of how often, never of whether.
    #[serde(default)]
    pub folded: Option<ObsFolded>,
    /// `flowhost.broker`, read leniently (as `egress_basis` is) for its destination's
    /// `other_host_names`: the other names the host handed the address out for, by any of
    /// which enforcement judged it (see [`ObsExtension::other_host_names`]).
    #[serde(default)]
    pub broker: Option<serde_json::Value>,
}

impl ObsExtension<'_> {
    /// The other names the target's address was handed out for: the strings of
    /// `broker.destination.other_host_names`, none when it is absent or of another shape.
    pub fn other_host_names(&self) -> Vec<&str> {
        self.broker
            .as_ref()
            .and_then(|b| b.get("destination")?.get("other_host_names")?.as_array())
            .map_or_else(Vec::new, |names| {
                names.iter().filter_map(serde_json::Value::as_str).collect()
            })
    }
}

/// `flowhost.folded`, read leniently: its `count` when that is a non-negative integer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ObsFolded {
    pub count: Option<u64>,
}

impl<'de> Deserialize<'de> for ObsFolded {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        Ok(ObsFolded {
            count: value.get("count").and_then(serde_json::Value::as_u64),
        })
    }
}

impl ObsExtension<'_> {
    /// How many decisions a record of `effect` stands for: a chained refusal folding
    /// identical ones stands for its `folded.count` (only refusals fold); any other for one.
    pub fn times(&self, effect: &str) -> u64 {
        match self.folded {
            Some(ObsFolded { count: Some(n) }) if self.chained() && effect == "deny" => n.max(1),
            _ => 1,
        }
    }

    /// The decision carries the flowhost chain fields.
    pub fn chained(&self) -> bool {
        self.seq.is_some() || self.prev_hash.is_some()
    }

    /// `flowhost.event` is `value`.
    pub fn event_is(&self, value: &str) -> bool {
        self.event.as_ref().is_some_and(|e| e.0 == value)
    }
}

/// The server a decision names, when it names one.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ObsServer<'a> {
    #[serde(default, borrow)]
    pub id: Option<Text<'a>>,
}

/// The fields of one observed decision the diff judges.
#[derive(Debug, Deserialize)]
pub(crate) struct ObsDecision<'a> {
    #[serde(borrow)]
    pub tool: ObsTool<'a>,
    #[serde(borrow)]
    pub classification: Text<'a>,
    #[serde(borrow)]
    pub action: ObsAction<'a>,
    #[serde(borrow)]
    pub decision: ObsVerdict<'a>,
    #[serde(default, borrow)]
    pub flowhost: Option<ObsExtension<'a>>,
    #[serde(default, borrow)]
    pub server: Option<ObsServer<'a>>,
}

/// An exported surface envelope.
#[derive(Debug, Deserialize)]
pub(crate) struct ObsEnvelope<'a> {
    #[serde(borrow)]
    pub schema: Text<'a>,
    #[serde(borrow)]
    pub observed_tool_decisions: Vec<ObsDecision<'a>>,
    #[serde(default)]
    #[allow(dead_code)]
    // read for shape only: the diff has no use for the producer's non-claims
    pub non_claims: Option<IgnoredAny>,
}

/// Enough of a first line to tell an envelope from a record, and flowhost records from
/// other producers' decisions.
#[derive(Debug, Deserialize)]
pub(crate) struct Probe {
    #[serde(default)]
    pub observed_tool_decisions: Option<IgnoredAny>,
    /// Read as any value: a line whose extension is malformed is still a decision (the
    /// lenient read judges it, and verification then rejects it).
    #[serde(default)]
    pub flowhost: Option<serde_json::Value>,
}

impl Probe {
    /// The line carries the flowhost chain fields (as [`ObsExtension::chained`] says).
    pub fn chained(&self) -> bool {
        let field = |name: &str| {
            self.flowhost
                .as_ref()
                .and_then(|x| x.get(name))
                .is_some_and(|v| !v.is_null())
        };
        field("seq") || field("prev_hash")
    }
}

impl<'r> ObsDecision<'r> {
    /// The fields the diff judges of a strictly decoded record, borrowed from it: what
    /// reading the record's line leniently would give.
    pub fn of_record(r: &'r DecisionRecord) -> Self {
        let text = |s: &'r str| Text(Cow::Borrowed(s));
        let target = r.action.target.as_ref().map(|t| {
            ObsTarget(
                t.0.iter()
                    .map(|(k, v)| {
                        let v = match v {
                            TargetValue::Text(s) => Scalar::Text(Cow::Borrowed(s.as_str())),
                            TargetValue::Integer(n) => Scalar::Integer(*n),
                            TargetValue::Flag(b) => Scalar::Flag(*b),
                        };
                        (Cow::Borrowed(k.as_str()), v)
                    })
                    .collect(),
            )
        });
        let x = &r.flowhost;
        ObsDecision {
            tool: ObsTool {
                name: text(&r.tool.name),
                category: r.tool.category.as_deref().map(text),
            },
            classification: text(r.classification.as_str()),
            action: ObsAction {
                class: Some(text(r.action.class.as_str())),
                verb: r.action.verb.as_deref().map(text),
                target,
            },
            decision: ObsVerdict {
                effect: text(r.decision.effect.as_str()),
            },
            flowhost: Some(ObsExtension {
                seq: Some(x.seq),
                prev_hash: Some(IgnoredAny),
                event: Some(text(x.event.as_str())),
                egress_basis: x.egress_basis.map(|b| ObsEgressBasis {
                    declared: Some(b.declared),
                    observed: Some(b.observed),
                }),
                folded: x.folded.as_ref().map(|f| ObsFolded {
                    count: Some(f.count),
                }),
                broker: match x.broker.as_ref().and_then(|b| b.destination.as_ref()) {
                    Some(crate::records::Destination::Inet(d))
                        if !d.other_host_names.is_empty() =>
                    {
                        Some(
                            serde_json::json!({"destination": {"other_host_names": d.other_host_names}}),
                        )
                    }
                    _ => None,
                },
            }),
            server: Some(ObsServer {
                id: Some(text(&r.server.id)),
            }),
        }
    }
}
