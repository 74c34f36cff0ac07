//! Identifiers used inside information labels and flow declarations.
//!
//! `PrincipalId`, `Compartment` and `DeclassificationPurpose` share one rule (README,
//! "Information-flow model"): non-empty, at most [`MAX_IDENTIFIER_BYTES`] bytes of UTF-8, no
//! leading or trailing whitespace, and no control character anywhere (`char::is_control`,
//! which covers C0, DEL and C1 such as U+0085), and no character that draws nothing or
//! reorders the text (zero-width characters, bidirectional controls, the byte-order mark and
//! the like). No other character is restricted.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// Longest identifier accepted, in bytes of UTF-8 (not characters).
pub const MAX_IDENTIFIER_BYTES: usize = 256;

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentifierError {
    /// The string is empty.
    #[error("{kind} is empty; identifiers must be 1 to 256 bytes")]
    Blank {
        /// Which identifier type was being built.
        kind: &'static str,
    },
    /// The string is longer than [`MAX_IDENTIFIER_BYTES`].
    #[error("{kind} is {len} bytes long; the limit is 256 bytes of UTF-8")]
    TooLong {
        /// Which identifier type was being built.
        kind: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The string starts or ends with whitespace.
    #[error("{kind} {value:?} has leading or trailing whitespace")]
    SurroundingWhitespace {
        /// Which identifier type was being built.
        kind: &'static str,
        /// The rejected value (printed with escapes).
        value: String,
    },
    /// The string contains a character that draws nothing or reorders the text around it.
    #[error(
        "{kind} {value:?} contains the invisible character U+{code:04X} at byte {offset}; \
         identifiers hold only characters that can be seen"
    )]
    InvisibleCharacter {
        /// Which identifier type was being built.
        kind: &'static str,
        /// The rejected value (printed with escapes).
        value: String,
        /// The offending code point.
        code: u32,
        /// Byte offset of the offending character.
        offset: usize,
    },
    /// The string contains a control character.
    #[error("{kind} {value:?} contains the control character U+{code:04X} at byte {offset}")]
    ControlCharacter {
        /// Which identifier type was being built.
        kind: &'static str,
        /// The rejected value (printed with escapes).
        value: String,
        /// The offending code point.
        code: u32,
        /// Byte offset of the offending character.
        offset: usize,
    },
}

/// Checks `value` against the shared identifier rule; `kind` names the type in errors.
pub fn validate_identifier(kind: &'static str, value: &str) -> Result<(), IdentifierError> {
    if value.is_empty() {
        return Err(IdentifierError::Blank { kind });
    }
    if value.len() > MAX_IDENTIFIER_BYTES {
        return Err(IdentifierError::TooLong {
            kind,
            len: value.len(),
        });
    }
    if let Some((offset, ch)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(IdentifierError::ControlCharacter {
            kind,
            value: value.to_owned(),
            code: u32::from(ch),
            offset,
        });
    }
    if let Some((offset, ch)) = value.char_indices().find(|&(_, c)| is_invisible(c)) {
        return Err(IdentifierError::InvisibleCharacter {
            kind,
            value: value.to_owned(),
            code: u32::from(ch),
            offset,
        });
    }
    if value.trim() != value {
        return Err(IdentifierError::SurroundingWhitespace {
            kind,
            value: value.to_owned(),
        });
    }
    Ok(())
}

/// Characters that draw nothing or reorder what follows: Unicode's format characters
/// (the zero-width space, bidirectional controls, the byte-order mark, tags, the soft
/// hyphen), variation selectors, the combining grapheme joiner and the Hangul fillers. Two
/// identifiers that differ only by one look the same to the operator who copies one into a
/// policy, and a bidirectional override makes one read as another. The zero-width joiner and
/// non-joiner stay allowed: Persian and the Indic scripts spell words with them.
pub(crate) fn is_invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{034f}'
            | '\u{0600}'..='\u{0605}'
            | '\u{061c}'
            | '\u{06dd}'
            | '\u{070f}'
            | '\u{0890}'..='\u{0891}'
            | '\u{08e2}'
            | '\u{115f}'..='\u{1160}'
            | '\u{17b4}'..='\u{17b5}'
            | '\u{180b}'..='\u{180f}'
            | '\u{200b}'
            | '\u{200e}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{3164}'
            | '\u{fe00}'..='\u{fe0f}'
            | '\u{feff}'
            | '\u{ffa0}'
            | '\u{fff9}'..='\u{fffb}'
            | '\u{110bd}'
            | '\u{110cd}'
            | '\u{13430}'..='\u{1343f}'
            | '\u{1bca0}'..='\u{1bca3}'
            | '\u{1d173}'..='\u{1d17a}'
            | '\u{e0001}'
            | '\u{e0020}'..='\u{e007f}'
            | '\u{e0100}'..='\u{e01ef}'
    )
}

macro_rules! identifier_type {
    ($(#[$meta:meta])* $name:ident, $kind:literal) => {
        $(#[$meta])*
        ///
        /// Always valid: the only constructors check the identifier rule. Cloning is cheap
        /// (a shared, immutable string).
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Builds the identifier, or says why `value` breaks the identifier rule.
            pub fn new(value: impl AsRef<str>) -> Result<Self, IdentifierError> {
                let value = value.as_ref();
                validate_identifier($kind, value)?;
                Ok(Self(Arc::from(value)))
            }

            /// The identifier as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), &*self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdentifierError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct IdVisitor;
                impl Visitor<'_> for IdVisitor {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str(concat!("a ", $kind, " string"))
                    }
                    // Validated on the borrowed text, before an owned copy is made.
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$name, E> {
                        $name::new(v).map_err(E::custom)
                    }
                }
                deserializer.deserialize_str(IdVisitor)
            }
        }
    };
}

identifier_type!(
    /// A principal: an owner or reader in an information label, or a caller identity.
    PrincipalId,
    "principal id"
);
identifier_type!(
    /// A compartment: an extra restriction tag on an information label.
    Compartment,
    "compartment"
);
identifier_type!(
    /// A purpose for which a tool may receive declassified data.
    DeclassificationPurpose,
    "declassification purpose"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_interior_spaces_unicode_and_punctuation() {
        for ok in [
            "alice",
            "larkfield pricing",
            "émile/ops:1",
            "日本",
            &"x".repeat(256),
        ] {
            PrincipalId::new(ok).unwrap();
        }
        // 128 two-byte characters = 256 bytes: at the limit.
        Compartment::new("é".repeat(128)).unwrap();
    }

    #[test]
    fn limit_is_in_bytes_not_characters() {
        let err = Compartment::new("é".repeat(129)).unwrap_err();
        assert_eq!(
            err,
            IdentifierError::TooLong {
                kind: "compartment",
                len: 258
            }
        );
        assert!(PrincipalId::new("x".repeat(257)).is_err());
    }

    #[test]
    fn rejects_blank_whitespace_and_controls() {
        assert!(matches!(
            PrincipalId::new(""),
            Err(IdentifierError::Blank { .. })
        ));
        for bad in [" alice", "alice ", "alice\u{00A0}", "\u{3000}x"] {
            assert!(
                matches!(
                    PrincipalId::new(bad),
                    Err(IdentifierError::SurroundingWhitespace { .. })
                ),
                "{bad:?}"
            );
        }
        for bad in [
            "\talice", "a\u{0}b", "a\nb", "a\u{7f}b", "a\u{85}b", "a\u{9f}",
        ] {
            assert!(
                matches!(
                    DeclassificationPurpose::new(bad),
                    Err(IdentifierError::ControlCharacter { .. })
                ),
                "{bad:?}"
            );
        }
    }

    /// Zero-width characters, bidirectional overrides and the like were accepted, so
    /// `read\u{200b}_file` and `read_file` were two principals, tools or compartments that
    /// look the same, and an override made one identifier read as another.
    #[test]
    fn rejects_invisible_characters() {
        for (bad, code) in [
            ("read\u{200b}_file", 0x200b),
            ("\u{feff}alice", 0xfeff),
            ("a\u{202e}b", 0x202e),
            ("a\u{2066}b", 0x2066),
            ("soft\u{ad}hyphen", 0xad),
            ("a\u{2060}b", 0x2060),
            ("tag\u{e0041}", 0xe0041),
            ("x\u{fe0f}", 0xfe0f),
            ("\u{3164}", 0x3164),
        ] {
            match Compartment::new(bad) {
                Err(IdentifierError::InvisibleCharacter { code: c, .. }) => {
                    assert_eq!(c, code, "{bad:?}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let err = PrincipalId::new("ali\u{200b}ce").unwrap_err();
        assert_eq!(
            err.to_string(),
            "principal id \"ali\\u{200b}ce\" contains the invisible character U+200B at byte 3; \
             identifiers hold only characters that can be seen"
        );
        // Visible characters from other scripts, emoji without a selector, and the joiners
        // some scripts spell with (Persian "می‌خواهم" holds a zero-width non-joiner) stay valid.
        for ok in [
            "Ωmega",
            "ação",
            "🙂",
            "日本/ops",
            "می\u{200c}خواهم",
            "क्\u{200d}ष",
        ] {
            PrincipalId::new(ok).unwrap();
        }
    }

    #[test]
    fn error_message_names_type_and_character() {
        let err = PrincipalId::new("bad\u{85}id").unwrap_err();
        assert_eq!(
            err.to_string(),
            "principal id \"bad\\u{85}id\" contains the control character U+0085 at byte 3"
        );
    }

    #[test]
    fn json_round_trip_and_rejection() {
        let id: PrincipalId = serde_json::from_str("\"alice\"").unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"alice\"");
        assert!(serde_json::from_str::<PrincipalId>("\" alice\"").is_err());
        assert!(serde_json::from_str::<PrincipalId>("\"a\\u0085\"").is_err());
        assert!(serde_json::from_str::<PrincipalId>("7").is_err());
    }
}
