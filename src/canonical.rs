//! Strict JSON parsing and RFC 8785 (JCS) canonical bytes.
//!
//! Signatures and digests are computed over canonical bytes, so two things must hold for a
//! signed document: the parser must see exactly one value for every key, and the canonical
//! form must denote the same values the host goes on to use. [`parse_strict`] therefore
//! refuses duplicate object keys (which `serde_json` would otherwise silently resolve to the
//! last one) and integers that an IEEE 754 double cannot hold exactly (which RFC 8785 would
//! round, so the signed bytes would mean a different number from the one parsed).
//! [`canonical_bytes`] produces the RFC 8785 encoding: keys sorted by UTF-16 code units,
//! ECMAScript number formatting, minimal string escaping, no whitespace.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Largest integer magnitude kept exact through canonicalization: 2^53 (the I-JSON range of
/// RFC 7493). Beyond it RFC 8785's shortest double formatting may print other digits.
pub const MAX_EXACT_INTEGER: u64 = 1 << 53;

/// A location inside a JSON document, printed as `tools[2].description` (`$` for the root).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JsonPath(String);

impl JsonPath {
    /// The document root.
    pub fn root() -> Self {
        JsonPath(String::new())
    }

    /// A path starting at a named top-level field (for example `manifest`).
    pub fn field(name: &str) -> Self {
        Self::root().key(name)
    }

    /// The member `key` of the object at this path.
    pub fn key(&self, key: &str) -> Self {
        let simple = !key.is_empty()
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        let mut out = self.0.clone();
        if simple {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(key);
        } else {
            // Keys that would be ambiguous in dotted form are quoted (with escapes).
            out.push_str(&format!("[{key:?}]"));
        }
        JsonPath(out)
    }

    /// The element `index` of the array at this path.
    pub fn index(&self, index: usize) -> Self {
        JsonPath(format!("{}[{index}]", self.0))
    }
}

impl fmt::Display for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("$")
        } else {
            f.write_str(&self.0)
        }
    }
}

/// Why a text is not acceptable strict JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JsonError {
    /// Not JSON at all, or JSON with trailing text, or nesting deeper than 128 levels.
    #[error("not valid JSON at line {line}, column {column}: {message}")]
    Syntax {
        /// 1-based line of the problem.
        line: usize,
        /// 1-based column of the problem.
        column: usize,
        /// The parser's description.
        message: String,
    },
    /// An object repeats a key.
    #[error(
        "{path}: duplicate key {key:?} at line {line}, column {column}; a signed document must not repeat a key"
    )]
    DuplicateKey {
        /// The object holding the repeated key.
        path: JsonPath,
        /// The repeated key.
        key: String,
        /// 1-based line of the second occurrence.
        line: usize,
        /// 1-based column of the second occurrence.
        column: usize,
    },
    /// An integer beyond ±2^53, whose canonical text could differ from what was parsed.
    #[error(
        "{path}: the integer {number} is outside ±2^53 (line {line}, column {column}); canonical JSON (RFC 8785) could print other digits for it, so write it as a string or within ±2^53"
    )]
    InexactInteger {
        /// Where the number is.
        path: JsonPath,
        /// The number as parsed.
        number: String,
        /// 1-based line of the number.
        line: usize,
        /// 1-based column of the number.
        column: usize,
    },
}

/// Why canonical bytes could not be produced (not reachable for values built by this crate,
/// which hold only finite numbers and string keys; reported rather than assumed).
#[derive(Debug, thiserror::Error)]
#[error("cannot encode canonical JSON: {0}")]
pub struct CanonicalError(#[from] serde_json::Error);

/// Parses `text` as one JSON value, rejecting duplicate keys and integers beyond ±2^53,
/// before anything is deserialized into a typed structure.
pub fn parse_strict(text: &str) -> Result<Value, JsonError> {
    parse_checked(text, true)
}

/// Parses `text` as one JSON value, rejecting duplicate keys (integers of any size are
/// kept as they are): for JSON another program wrote, whose numbers flowhost never signs
/// or hashes, but whose every key must mean one thing to every reader.
pub fn parse_unique_keys(text: &str) -> Result<Value, JsonError> {
    parse_checked(text, false)
}

fn parse_checked(text: &str, exact_integers: bool) -> Result<Value, JsonError> {
    let fault = Cell::new(None);
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let seed = StrictValue {
        at: &Segment::Root,
        fault: &fault,
        exact_integers,
    };
    let result = seed
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value));
    result.map_err(|error| {
        let (line, column) = (error.line(), error.column());
        match fault.take() {
            Some(Fault::DuplicateKey { path, key }) => JsonError::DuplicateKey {
                path,
                key,
                line,
                column,
            },
            Some(Fault::InexactInteger { path, number }) => JsonError::InexactInteger {
                path,
                number,
                line,
                column,
            },
            None => JsonError::Syntax {
                line,
                column,
                message: error.to_string(),
            },
        }
    })
}

/// The RFC 8785 canonical encoding of `value`.
pub fn canonical_bytes(value: &Value) -> Result<Vec<u8>, CanonicalError> {
    Ok(serde_json_canonicalizer::to_vec(value)?)
}

/// What the strict visitor found, kept aside so the caller gets a typed error rather than
/// serde's text (serde carries only a message through its error type).
enum Fault {
    DuplicateKey { path: JsonPath, key: String },
    InexactInteger { path: JsonPath, number: String },
}

/// The path to the value being parsed, as a chain of borrowed segments: rendering it is
/// only paid for when something is wrong.
enum Segment<'a> {
    Root,
    Key(&'a str, &'a Segment<'a>),
    Index(usize, &'a Segment<'a>),
}

impl Segment<'_> {
    fn render(&self) -> JsonPath {
        match self {
            Segment::Root => JsonPath::root(),
            Segment::Key(key, parent) => parent.render().key(key),
            Segment::Index(index, parent) => parent.render().index(*index),
        }
    }
}

#[derive(Clone, Copy)]
struct StrictValue<'a> {
    at: &'a Segment<'a>,
    fault: &'a Cell<Option<Fault>>,
    /// Whether integers beyond ±2^53 are refused.
    exact_integers: bool,
}

impl StrictValue<'_> {
    fn inexact<E: de::Error>(&self, number: String) -> E {
        self.fault.set(Some(Fault::InexactInteger {
            path: self.at.render(),
            number,
        }));
        E::custom("integer outside ±2^53")
    }
}

impl<'de> DeserializeSeed<'de> for StrictValue<'_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    // serde_json keeps integer tokens that fit 64 bits exact, while RFC 8785 prints every
    // number as the shortest text of a double: past 2^53 the two can disagree (2^60 prints
    // as 1152921504606847000), so such integers are refused. Integer tokens beyond 64 bits
    // already arrive as doubles, so the host and the signature see the same double.
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        if self.exact_integers && v.unsigned_abs() > MAX_EXACT_INTEGER {
            return Err(self.inexact(v.to_string()));
        }
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        if self.exact_integers && v > MAX_EXACT_INTEGER {
            return Err(self.inexact(v.to_string()));
        }
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        // serde_json never yields a non-finite number from text, so from_f64 succeeds.
        serde_json::Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("non-finite number"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let at = Segment::Index(items.len(), self.at);
            let seed = StrictValue {
                at: &at,
                fault: self.fault,
                exact_integers: self.exact_integers,
            };
            match seq.next_element_seed(seed)? {
                Some(item) => items.push(item),
                None => return Ok(Value::Array(items)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                self.fault.set(Some(Fault::DuplicateKey {
                    path: self.at.render(),
                    key,
                }));
                return Err(de::Error::custom("duplicate key"));
            }
            let at = Segment::Key(&key, self.at);
            let value = map.next_value_seed(StrictValue {
                at: &at,
                fault: self.fault,
                exact_integers: self.exact_integers,
            })?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jcs(text: &str) -> String {
        String::from_utf8(canonical_bytes(&parse_strict(text).unwrap()).unwrap()).unwrap()
    }

    #[test]
    fn rfc8785_section_3_2_2_example() {
        // The sample input of RFC 8785 §3.2.2 and its published canonical form.
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        assert_eq!(
            jcs(input),
            "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}"
        );
    }

    #[test]
    fn decimal_text_parses_to_the_nearest_double() {
        // A parser that rounds a decimal to a neighbour of the nearest double prints these
        // as 1.0000000000000001e-23 and 2.9999999999999997e+23; signers that parse
        // correctly (as RFC 8785 requires) would then disagree with flowhost's digest.
        assert_eq!(jcs("1e-23"), "1e-23");
        assert_eq!(jcs("3e23"), "3e+23");
        assert_eq!(
            jcs("[0.1, 2.2250738585072014e-308]"),
            "[0.1,2.2250738585072014e-308]"
        );
    }

    #[test]
    fn rfc8785_section_3_2_3_sorts_by_utf16_code_units() {
        // RFC 8785 §3.2.3: U+1F600 (UTF-16 D83D DE00) sorts before U+FB33, which code point
        // or UTF-8 order would put the other way round.
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "1": "One",
          "\ud83d\ude00": "Emoji: Grinning Face",
          "\u0080": "Control",
          "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let out = jcs(input);
        let keys: Vec<&str> = [
            "\"\\r\"",
            "\"1\"",
            "\"\u{80}\"",
            "\"\u{f6}\"",
            "\"\u{20ac}\"",
            "\"\u{1f600}\"",
            "\"\u{fb33}\"",
        ]
        .to_vec();
        let positions: Vec<usize> = keys.iter().map(|k| out.find(k).unwrap()).collect();
        let mut sorted = positions.clone();
        sorted.sort_unstable();
        assert_eq!(positions, sorted, "{out}");
        assert!(out.starts_with("{\"\\r\":\"Carriage Return\",\"1\":\"One\""));
    }

    #[test]
    fn rfc8785_appendix_b_number_formatting() {
        // (IEEE 754 bit pattern, canonical text) pairs from RFC 8785 Appendix B.
        let table: &[(u64, &str)] = &[
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for &(bits, expected) in table {
            let value = Value::from(f64::from_bits(bits));
            let out = String::from_utf8(canonical_bytes(&value).unwrap()).unwrap();
            assert_eq!(out, expected, "bits {bits:#018x}");
            // And the canonical text parses back to the same double.
            let back = parse_strict(&out).unwrap();
            assert_eq!(back.as_f64().unwrap(), f64::from_bits(bits), "{out}");
        }
    }

    #[test]
    fn string_escaping_is_minimal() {
        assert_eq!(
            jcs(r#""\u0000\u0008\u0009\u000a\u000c\u000d\u001f\u007f/\u00e9""#),
            "\"\\u0000\\b\\t\\n\\f\\r\\u001f\u{7f}/é\""
        );
    }

    #[test]
    fn integers_and_whitespace() {
        assert_eq!(jcs(" [ 1 , -0 , 1.0 , 10 , 1e2 ] "), "[1,0,1,10,100]");
        assert_eq!(jcs("9007199254740992"), "9007199254740992");
    }

    #[test]
    fn duplicate_keys_are_refused_with_their_path() {
        let err = parse_strict(r#"{"tools":[{"name":"a","x":{"k":1,"k":2}}]}"#).unwrap_err();
        match err {
            JsonError::DuplicateKey {
                path, key, line, ..
            } => {
                assert_eq!(path.to_string(), "tools[0].x");
                assert_eq!(key, "k");
                assert_eq!(line, 1);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse_strict(r#"{"a":1,"a":1}"#),
            Err(JsonError::DuplicateKey { .. })
        ));
        // An escaped spelling of the same key is the same key.
        assert!(matches!(
            parse_strict(r#"{"a":1,"\u0061":1}"#),
            Err(JsonError::DuplicateKey { .. })
        ));
    }

    #[test]
    fn integers_beyond_2_pow_53_are_refused() {
        for text in [
            "9007199254740993",
            "-9007199254740993",
            "1152921504606846976",
            "[18446744073709551615]",
        ] {
            assert!(
                matches!(parse_strict(text), Err(JsonError::InexactInteger { .. })),
                "{text}"
            );
        }
        for text in ["-9007199254740992", "9007199254740992"] {
            assert_eq!(jcs(text), text);
        }
    }

    #[test]
    fn syntax_errors_trailing_text_and_deep_nesting() {
        for text in ["", "{", "{} x", "[1,]", r#""\ud800""#, "1e400"] {
            assert!(
                matches!(parse_strict(text), Err(JsonError::Syntax { .. })),
                "{text:?}"
            );
        }
        let deep = "[".repeat(10_000);
        assert!(matches!(parse_strict(&deep), Err(JsonError::Syntax { .. })));
    }

    #[test]
    fn paths_render_readably() {
        let p = JsonPath::field("manifest")
            .key("tools")
            .index(2)
            .key("description");
        assert_eq!(p.to_string(), "manifest.tools[2].description");
        assert_eq!(JsonPath::root().key("a b").to_string(), "[\"a b\"]");
        assert_eq!(JsonPath::root().to_string(), "$");
    }
}
