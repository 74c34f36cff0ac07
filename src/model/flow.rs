//! Tool flow declarations and the egress authorization check (README, "Information-flow model").

use std::collections::BTreeSet;
use std::fmt;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};

use crate::ident::DeclassificationPurpose;
use crate::label::{InformationLabel, StrictSet};

/// Most declassification purposes one declaration may list.
pub const MAX_PURPOSES: usize = 64;

/// Why a flow declaration is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolFlowError {
    /// The declared output label is `Top`, which would make every output unusable.
    #[error(
        "tool output label cannot be top; declare the owners and compartments the output carries"
    )]
    TopOutputLabel,
    /// The declared input clearance is `Top`, which would admit any data to the tool.
    #[error(
        "tool input clearance cannot be top; declare the most restricted label the tool may receive"
    )]
    TopInputClearance,
}

/// A publisher's signed statement of a tool's information-flow behaviour.
///
/// Guarantees: neither label is `Top`. The wire form is strict: unknown fields, an explicit
/// `null` label, an explicit empty purpose list and duplicate purposes are rejected, and
/// `egress` is required. Serialization is canonical (absent labels and an empty purpose set
/// are omitted, purposes are sorted).
///
/// The fields read as public fields (`declaration.output_label`, through
/// [`FlowDeclarationFields`]), but a declaration is only ever built by [`Self::new`],
/// [`Self::public_egress`] or strict decoding, and never changed afterwards.
#[derive(Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "FlowDeclarationWire")]
pub struct ToolFlowDeclaration {
    fields: FlowDeclarationFields,
}

/// The readable fields of a [`ToolFlowDeclaration`] (what the publisher signed).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct FlowDeclarationFields {
    /// The label the tool's output carries, if declared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_label: Option<InformationLabel>,
    /// The most restricted label the tool may receive when it egresses, if declared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_clearance: Option<InformationLabel>,
    /// Whether the publisher declares that the tool sends data out.
    pub egress: bool,
    /// Purposes for which the tool accepts declassified data.
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub declassification_purposes: BTreeSet<DeclassificationPurpose>,
}

impl std::ops::Deref for ToolFlowDeclaration {
    type Target = FlowDeclarationFields;
    fn deref(&self) -> &FlowDeclarationFields {
        &self.fields
    }
}

impl Serialize for ToolFlowDeclaration {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.fields.serialize(serializer)
    }
}

impl ToolFlowDeclaration {
    /// Builds a declaration; a `Top` output label or input clearance is refused.
    pub fn new(
        output_label: Option<InformationLabel>,
        input_clearance: Option<InformationLabel>,
        egress: bool,
        declassification_purposes: BTreeSet<DeclassificationPurpose>,
    ) -> Result<Self, ToolFlowError> {
        if output_label.as_ref().is_some_and(InformationLabel::is_top) {
            return Err(ToolFlowError::TopOutputLabel);
        }
        if input_clearance
            .as_ref()
            .is_some_and(InformationLabel::is_top)
        {
            return Err(ToolFlowError::TopInputClearance);
        }
        Ok(Self {
            fields: FlowDeclarationFields {
                output_label,
                input_clearance,
                egress,
                declassification_purposes,
            },
        })
    }

    /// A public sink: bottom output, bottom input clearance, egress, no purposes.
    pub fn public_egress() -> Self {
        Self {
            fields: FlowDeclarationFields {
                output_label: Some(InformationLabel::bottom()),
                input_clearance: Some(InformationLabel::bottom()),
                egress: true,
                declassification_purposes: BTreeSet::new(),
            },
        }
    }

    /// The label the tool's output carries, if declared.
    pub fn output_label(&self) -> Option<&InformationLabel> {
        self.fields.output_label.as_ref()
    }

    /// The most restricted label the tool may receive when it egresses, if declared.
    pub fn input_clearance(&self) -> Option<&InformationLabel> {
        self.fields.input_clearance.as_ref()
    }

    /// Whether the publisher declares that the tool sends data out.
    pub fn egress(&self) -> bool {
        self.fields.egress
    }

    /// Purposes for which the tool accepts declassified data.
    pub fn declassification_purposes(&self) -> &BTreeSet<DeclassificationPurpose> {
        &self.fields.declassification_purposes
    }

    /// Canonical JSON text of the declaration.
    pub fn to_canonical_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Decodes a declaration from an already parsed JSON value, keeping apart a malformed
    /// wire form from a well-formed declaration that breaks a rule (a `Top` label), so that
    /// callers can report each as its own error.
    pub fn from_json_value(value: &serde_json::Value) -> Result<Self, FlowDecodeError> {
        let wire = FlowDeclarationWire::deserialize(value).map_err(FlowDecodeError::Malformed)?;
        ToolFlowDeclaration::try_from(wire).map_err(FlowDecodeError::Invalid)
    }
}

/// Why [`ToolFlowDeclaration::from_json_value`] refused a value.
#[derive(Debug, thiserror::Error)]
pub enum FlowDecodeError {
    /// The value is not a declaration: unknown or missing field, `null`, wrong type,
    /// duplicate or empty purposes, an invalid label.
    #[error("{0}")]
    Malformed(serde_json::Error),
    /// A well-formed declaration that breaks a rule of [`ToolFlowDeclaration::new`].
    #[error("{0}")]
    Invalid(ToolFlowError),
}

impl fmt::Debug for ToolFlowDeclaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_canonical_json())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FlowDeclarationWire {
    #[serde(default, deserialize_with = "present_label")]
    output_label: Option<InformationLabel>,
    #[serde(default, deserialize_with = "present_label")]
    input_clearance: Option<InformationLabel>,
    egress: bool,
    #[serde(default, deserialize_with = "present_purposes")]
    declassification_purposes: Option<BTreeSet<DeclassificationPurpose>>,
}

impl TryFrom<FlowDeclarationWire> for ToolFlowDeclaration {
    type Error = ToolFlowError;
    fn try_from(w: FlowDeclarationWire) -> Result<Self, Self::Error> {
        ToolFlowDeclaration::new(
            w.output_label,
            w.input_clearance,
            w.egress,
            w.declassification_purposes.unwrap_or_default(),
        )
    }
}

/// A field that, when present, must hold a label: `null` is an error, not "absent".
fn present_label<'de, D: Deserializer<'de>>(d: D) -> Result<Option<InformationLabel>, D::Error> {
    InformationLabel::deserialize(d).map(Some)
}

/// When present, the purpose list must be non-empty and free of duplicates.
fn present_purposes<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeSet<DeclassificationPurpose>>, D::Error> {
    let set = StrictSet::<DeclassificationPurpose, MAX_PURPOSES>::deserialize(d)
        .map_err(|e| de::Error::custom(format_args!("declassification_purposes: {e}")))?
        .0;
    if set.is_empty() {
        return Err(de::Error::custom(
            "declassification_purposes is an explicit empty array; omit the field to declare no purposes",
        ));
    }
    Ok(Some(set))
}

/// Why an egress was refused by [`authorize_egress`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum EgressDenial {
    /// The data's label is `Top`: its history is unknown, so it may go nowhere.
    #[error("source label is top (unknown history); top data never egresses")]
    TopSource,
    /// There is no clearance to check against, so nothing vouches for the destination.
    #[error("egress has no clearance; a destination without a clearance receives nothing")]
    MissingClearance,
    /// The clearance is `Top`, which is not a usable bound.
    #[error("clearance is top, which is not an operational bound")]
    TopClearance,
    /// The data's label does not flow to the clearance.
    #[error("source label does not flow to the clearance (flow violation)")]
    FlowViolation,
}

impl EgressDenial {
    /// A stable snake_case name, used in records and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            EgressDenial::TopSource => "top_source",
            EgressDenial::MissingClearance => "missing_clearance",
            EgressDenial::TopClearance => "top_clearance",
            EgressDenial::FlowViolation => "flow_violation",
        }
    }
}

/// Decides whether data labelled `source` may leave through a destination with `clearance`.
///
/// Checked in this order (README, "Information-flow model"): a `Top` source, a missing
/// clearance, a `Top` clearance, then the flow order.
pub fn authorize_egress(
    source: &InformationLabel,
    clearance: Option<&InformationLabel>,
) -> Result<(), EgressDenial> {
    if source.is_top() {
        return Err(EgressDenial::TopSource);
    }
    let Some(clearance) = clearance else {
        return Err(EgressDenial::MissingClearance);
    };
    if clearance.is_top() {
        return Err(EgressDenial::TopClearance);
    }
    if !source.flows_to(clearance) {
        return Err(EgressDenial::FlowViolation);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ident::PrincipalId;
    use std::collections::BTreeMap;

    fn owner_label(o: &str) -> InformationLabel {
        let o = PrincipalId::new(o).unwrap();
        InformationLabel::try_known(
            BTreeMap::from([(o.clone(), BTreeSet::from([o]))]),
            BTreeSet::new(),
        )
        .unwrap()
    }

    #[test]
    fn new_rejects_top() {
        assert_eq!(
            ToolFlowDeclaration::new(Some(InformationLabel::Top), None, false, BTreeSet::new()),
            Err(ToolFlowError::TopOutputLabel)
        );
        assert_eq!(
            ToolFlowDeclaration::new(None, Some(InformationLabel::Top), true, BTreeSet::new()),
            Err(ToolFlowError::TopInputClearance)
        );
    }

    #[test]
    fn public_egress_shape() {
        let d = ToolFlowDeclaration::public_egress();
        assert!(d.output_label().unwrap().is_bottom());
        assert!(d.input_clearance().unwrap().is_bottom());
        assert!(d.egress());
        assert!(d.declassification_purposes().is_empty());
    }

    #[test]
    fn wire_form_is_canonical() {
        let text = r#"{"declassification_purposes":["support","audit"],"egress":true,
            "input_clearance":{"compartments":[],"owners":{},"kind":"known"}}"#;
        let d: ToolFlowDeclaration = serde_json::from_str(text).unwrap();
        assert_eq!(
            d.to_canonical_json(),
            r#"{"input_clearance":{"kind":"known","owners":{},"compartments":[]},"egress":true,"declassification_purposes":["audit","support"]}"#
        );
        let back: ToolFlowDeclaration = serde_json::from_str(&d.to_canonical_json()).unwrap();
        assert_eq!(back, d);
        assert_eq!(
            serde_json::from_str::<ToolFlowDeclaration>(r#"{"egress":false}"#)
                .unwrap()
                .to_canonical_json(),
            r#"{"egress":false}"#
        );
    }

    fn reject(json: &str, needle: &str) {
        let err = serde_json::from_str::<ToolFlowDeclaration>(json)
            .expect_err(json)
            .to_string();
        assert!(
            err.contains(needle),
            "input {json}\nerror {err}\nwanted {needle:?}"
        );
    }

    #[test]
    fn wire_form_rejections() {
        reject(r#"{}"#, "missing field `egress`");
        reject(r#"{"egress":true,"mode":"x"}"#, "unknown field `mode`");
        reject(
            r#"{"egress":true,"egress":false}"#,
            "duplicate field `egress`",
        );
        reject(
            r#"{"egress":true,"output_label":null}"#,
            "invalid type: null",
        );
        reject(
            r#"{"egress":true,"input_clearance":null}"#,
            "invalid type: null",
        );
        reject(
            r#"{"egress":true,"declassification_purposes":[]}"#,
            "explicit empty array",
        );
        reject(
            r#"{"egress":true,"declassification_purposes":["a","a"]}"#,
            "duplicate entry",
        );
        reject(
            r#"{"egress":true,"declassification_purposes":null}"#,
            "invalid type: null",
        );
        reject(
            r#"{"egress":true,"output_label":{"kind":"top"}}"#,
            "output label cannot be top",
        );
        reject(
            r#"{"egress":true,"input_clearance":{"kind":"top"}}"#,
            "input clearance cannot be top",
        );
        reject(r#"{"egress":"yes"}"#, "invalid type");
    }

    #[test]
    fn from_json_value_separates_malformed_from_invalid() {
        let top = serde_json::json!({"egress": false, "output_label": {"kind": "top"}});
        assert!(matches!(
            ToolFlowDeclaration::from_json_value(&top),
            Err(FlowDecodeError::Invalid(ToolFlowError::TopOutputLabel))
        ));
        let null = serde_json::json!({"egress": false, "input_clearance": null});
        assert!(matches!(
            ToolFlowDeclaration::from_json_value(&null),
            Err(FlowDecodeError::Malformed(_))
        ));
        let ok = serde_json::json!({"egress": true, "declassification_purposes": ["audit"]});
        let d = ToolFlowDeclaration::from_json_value(&ok).unwrap();
        assert!(d.egress());
        assert_eq!(d.declassification_purposes().len(), 1);
    }

    #[test]
    fn authorize_egress_top_source_comes_first() {
        // Top source with no clearance: TopSource wins over MissingClearance.
        assert_eq!(
            authorize_egress(&InformationLabel::Top, None),
            Err(EgressDenial::TopSource)
        );
        assert_eq!(
            authorize_egress(&InformationLabel::Top, Some(&InformationLabel::Top)),
            Err(EgressDenial::TopSource)
        );
    }

    #[test]
    fn authorize_egress_missing_clearance() {
        assert_eq!(
            authorize_egress(&InformationLabel::bottom(), None),
            Err(EgressDenial::MissingClearance)
        );
    }

    #[test]
    fn authorize_egress_top_clearance() {
        // Even though everything flows to Top, Top is not an operational bound.
        assert_eq!(
            authorize_egress(&InformationLabel::bottom(), Some(&InformationLabel::Top)),
            Err(EgressDenial::TopClearance)
        );
    }

    #[test]
    fn authorize_egress_flow_violation_and_allow() {
        let secret = owner_label("larkfield-pricing");
        assert_eq!(
            authorize_egress(&secret, Some(&InformationLabel::bottom())),
            Err(EgressDenial::FlowViolation)
        );
        assert_eq!(authorize_egress(&secret, Some(&secret)), Ok(()));
        assert_eq!(
            authorize_egress(&InformationLabel::bottom(), Some(&secret)),
            Ok(())
        );
    }

    #[test]
    fn denial_messages_are_actionable() {
        assert!(
            EgressDenial::MissingClearance
                .to_string()
                .contains("no clearance")
        );
        assert_eq!(EgressDenial::FlowViolation.as_str(), "flow_violation");
    }
}
