//! Trace context: which caller-supplied W3C `traceparent` a record keeps.
//!
//! Only `params._meta.traceparent` is read, and only a strict form is kept: exactly four
//! `-`-separated lowercase-hex fields of lengths 2, 32, 16 and 2, a version other than `ff`,
//! and trace-id and parent-id not all zeros. That is stricter than W3C on purpose (a future
//! version with extra fields counts as malformed), because a kept value is a claim made by the
//! caller, and a claim should be unambiguous. `tracestate` and `baggage` are never kept.

use super::{Correlation, CorrelationBasis};

/// The correlation of a request from its `params` (the JSON-RPC `params` value).
///
/// A valid traceparent is kept verbatim (`propagated_trace_context`, source class
/// `propagated`); any other value, a non-string included, is dropped and marked
/// `malformed_trace_context`; an absent `traceparent` or a `_meta` that is not an object gives
/// `none`.
pub fn correlation_from_params(params: &serde_json::Value) -> Correlation {
    let Some(meta) = params.get("_meta").and_then(serde_json::Value::as_object) else {
        return Correlation::none();
    };
    match meta.get("traceparent") {
        None => Correlation::none(),
        Some(serde_json::Value::String(tp)) if is_valid_traceparent(tp) => Correlation {
            basis: CorrelationBasis::PropagatedTraceContext,
            traceparent: Some(tp.clone()),
            source_class: Some("propagated".to_string()),
        },
        Some(_) => Correlation {
            basis: CorrelationBasis::MalformedTraceContext,
            traceparent: None,
            source_class: None,
        },
    }
}

/// Whether `tp` is a traceparent flowhost keeps (see the module docs).
pub fn is_valid_traceparent(tp: &str) -> bool {
    let fields: Vec<&str> = tp.split('-').collect();
    let [version, trace_id, parent_id, flags] = fields.as_slice() else {
        return false;
    };
    let lower_hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let all_zero = |s: &str| s.bytes().all(|b| b == b'0');
    lower_hex(version, 2)
        && lower_hex(trace_id, 32)
        && lower_hex(parent_id, 16)
        && lower_hex(flags, 2)
        && *version != "ff"
        && !all_zero(trace_id)
        && !all_zero(parent_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn basis(params: serde_json::Value) -> Correlation {
        correlation_from_params(&params)
    }

    #[test]
    fn valid_traceparent_is_kept_verbatim() {
        let c = basis(json!({"_meta": {"traceparent": VALID, "tracestate": "x=1"}}));
        assert_eq!(c.basis, CorrelationBasis::PropagatedTraceContext);
        assert_eq!(c.traceparent.as_deref(), Some(VALID));
        assert_eq!(c.source_class.as_deref(), Some("propagated"));
    }

    #[test]
    fn invalid_traceparents_are_dropped_as_malformed() {
        for bad in [
            json!("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
            json!("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            json!("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            json!("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),
            json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"),
            json!("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01"),
            json!(""),
            json!(17),
            json!(null),
            json!({"v": VALID}),
        ] {
            let c = basis(json!({"_meta": {"traceparent": bad.clone()}}));
            assert_eq!(c.basis, CorrelationBasis::MalformedTraceContext, "{bad}");
            assert_eq!((c.traceparent, c.source_class), (None, None));
        }
    }

    #[test]
    fn absent_or_non_object_meta_is_none() {
        for p in [
            json!({}),
            json!({"_meta": "x"}),
            json!({"_meta": {}}),
            json!(null),
            json!({"traceparent": VALID}),
        ] {
            assert_eq!(basis(p.clone()), Correlation::none(), "{p}");
        }
    }
}
