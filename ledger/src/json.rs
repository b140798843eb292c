//! `JsonText`: JSON kept as the exact text it arrived as, so numbers and key order survive.

use serde::de::{self, Deserializer, Visitor};
use serde::ser::{SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::fmt;

/// Valid JSON held as its exact text.
///
/// Binary encodings (the history's msgpack) store it as a string; human-readable ones (the JSON
/// views) embed it verbatim. Keeping text instead of a parsed value is what makes
/// `9007199254740993` and key order survive every round trip.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JsonText(String);

impl JsonText {
    /// Checks that `text` is one JSON value and keeps it byte for byte, less any whitespace
    /// around the value (a JSON view embeds the raw value and cannot keep it, so keeping it here
    /// would make the JSON and msgpack encodings disagree).
    pub fn parse(text: impl Into<String>) -> crate::Result<Self> {
        let text = text.into();
        let raw =
            serde_json::from_str::<&RawValue>(&text).map_err(|e| crate::Error::InvalidJson {
                reason: e.to_string(),
            })?;
        if raw.get().len() == text.len() {
            return Ok(JsonText(text));
        }
        Ok(JsonText(raw.get().to_owned()))
    }

    /// Compact JSON of a value.
    pub fn from_value(value: &serde_json::Value) -> Self {
        // Serializing a `Value` cannot fail: its map keys are strings.
        JsonText(serde_json::to_string(value).unwrap_or_else(|_| "null".to_owned()))
    }

    /// The exact text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Parses into a `serde_json::Value` (numbers beyond f64/u64/i64 may lose precision there).
    pub fn to_value(&self) -> crate::Result<serde_json::Value> {
        serde_json::from_str(&self.0).map_err(|e| crate::Error::InvalidJson {
            reason: e.to_string(),
        })
    }
}

impl fmt::Debug for JsonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonText({})", self.0)
    }
}

impl fmt::Display for JsonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The name through which serde_json takes a raw value from a serializer: a struct of this
/// name with one field of this name holding the text, which is exactly how its own
/// [`RawValue`] serializes itself. Checked against `RawValue` in the tests.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

impl Serialize for JsonText {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            // Written as serde_json's raw value, as `RawValue` itself writes one, without
            // parsing the text again: every way to make a `JsonText` checked it already, and a
            // server's answer to a lease carries every tool schema and JSON part of the
            // transcript through here again for each model call (about 2% of the server's
            // instructions a turn, callgrind found, before this).
            let mut raw = serializer.serialize_struct(RAW_VALUE_TOKEN, 1)?;
            raw.serialize_field(RAW_VALUE_TOKEN, &self.0)?;
            raw.end()
        } else {
            serializer.serialize_str(&self.0)
        }
    }
}

impl<'de> Deserialize<'de> for JsonText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        if deserializer.is_human_readable() {
            let raw = Box::<RawValue>::deserialize(deserializer)?;
            Ok(JsonText(raw.get().to_owned()))
        } else {
            struct TextVisitor;
            impl Visitor<'_> for TextVisitor {
                type Value = JsonText;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a string holding JSON text")
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<JsonText, E> {
                    JsonText::parse(v).map_err(E::custom)
                }
                fn visit_string<E: de::Error>(self, v: String) -> Result<JsonText, E> {
                    JsonText::parse(v).map_err(E::custom)
                }
            }
            deserializer.deserialize_str(TextVisitor)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_numbers_and_key_order_survive_json_and_msgpack() {
        let text = r#"{"z":9007199254740993,"a":[1.0000000000000000001,{"y":1,"b":2}]}"#;
        let json = JsonText::parse(text).unwrap();
        let via_json: JsonText =
            serde_json::from_str(&serde_json::to_string(&json).unwrap()).unwrap();
        assert_eq!(via_json.as_str(), text);
        let bytes = rmp_serde::to_vec_named(&json).unwrap();
        let via_msgpack: JsonText = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(via_msgpack.as_str(), text);
    }

    /// Written without a second parse, a `JsonText` comes out of every serializer exactly
    /// as serde_json's own `RawValue` of the same text does: verbatim in JSON (compact and
    /// pretty), and as the same `Value`.
    #[test]
    fn it_serializes_as_serde_jsons_raw_value_does() {
        let texts = [
            r#"{"z":9007199254740993,"a":[1.0000000000000000001,{"y":1,"b":"\u00e9\n"}]}"#,
            r#""a string with \"quotes\"""#,
            "[]",
            "-0.5e-7",
            "null",
        ];
        for text in texts {
            let json = JsonText::parse(text).unwrap();
            let raw = serde_json::from_str::<&RawValue>(text).unwrap();
            assert_eq!(serde_json::to_string(&json).unwrap(), text);
            assert_eq!(
                serde_json::to_string(&json).unwrap(),
                serde_json::to_string(raw).unwrap()
            );
            assert_eq!(
                serde_json::to_string_pretty(&vec![&json]).unwrap(),
                serde_json::to_string_pretty(&vec![raw]).unwrap()
            );
            assert_eq!(
                serde_json::to_value(&json).unwrap(),
                serde_json::to_value(raw).unwrap()
            );
        }
    }

    #[test]
    fn invalid_json_is_rejected_with_position() {
        let err = JsonText::parse("{\"a\":").unwrap_err();
        assert!(
            matches!(err, crate::Error::InvalidJson { ref reason } if reason.contains("line 1"))
        );
    }
}
