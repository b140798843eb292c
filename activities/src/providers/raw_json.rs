//! Editing a provider's JSON object without re-encoding its values: fields keep their order and
//! every value its exact text (numbers beyond f64 included), so an opaque block assembled from
//! a stream is byte-exact apart from the one field set.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::fmt;

/// An object's fields in order, each value as its raw text.
struct OrderedFields(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for OrderedFields {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FieldsVisitor;
        impl<'de> Visitor<'de> for FieldsVisitor {
            type Value = OrderedFields;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedFields, A::Error> {
                let mut fields = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, Box<RawValue>>()? {
                    fields.push((key, value));
                }
                Ok(OrderedFields(fields))
            }
        }
        deserializer.deserialize_map(FieldsVisitor)
    }
}

/// The members of `object` (a JSON object's text) in order, each value as its exact text. The
/// reason when it is not an object.
pub fn members(object: &str) -> Result<Vec<(String, Box<RawValue>)>, String> {
    let OrderedFields(fields) =
        serde_json::from_str(object).map_err(|e| format!("not a JSON object: {e}"))?;
    Ok(fields)
}

/// The text of an object with `fields`, in order.
fn object_text(fields: &[(String, Box<RawValue>)]) -> String {
    let mut out = String::new();
    out.push('{');
    for (i, (key, value)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Serializing a string cannot fail.
        out.push_str(&serde_json::to_string(key).unwrap_or_default());
        out.push(':');
        out.push_str(value.get());
    }
    out.push('}');
    out
}

/// The JSON kind of a value's text, by its first character.
fn kind_of(value: &str) -> &'static str {
    match value.trim_start().as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        _ => "a scalar",
    }
}

/// `base` extended by `delta` (both JSON texts), the way streamed fragments of one value add
/// up: strings are concatenated, arrays appended, objects merged member by member (a member
/// only in `delta` is appended), and a scalar replaced by a scalar. Values not touched keep
/// their exact text. The reason when the two cannot be combined (e.g. an object and a string).
pub fn extend(base: &str, delta: &str) -> Result<String, String> {
    match (kind_of(base), kind_of(delta)) {
        ("an object", "an object") => {
            let mut fields = members(base)?;
            for (key, value) in members(delta)? {
                match fields.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, slot)) => {
                        let merged = extend(slot.get(), value.get())
                            .map_err(|reason| format!("{key}: {reason}"))?;
                        *slot = RawValue::from_string(merged).map_err(|e| format!("{key}: {e}"))?;
                    }
                    None => fields.push((key, value)),
                }
            }
            Ok(object_text(&fields))
        }
        ("an array", "an array") => {
            let mut items: Vec<Box<RawValue>> =
                serde_json::from_str(base).map_err(|e| format!("not a JSON array: {e}"))?;
            let more: Vec<Box<RawValue>> =
                serde_json::from_str(delta).map_err(|e| format!("not a JSON array: {e}"))?;
            items.extend(more);
            let list: Vec<&str> = items.iter().map(|v| v.get()).collect();
            Ok(format!("[{}]", list.join(",")))
        }
        ("a string", "a string") => {
            let mut text: String =
                serde_json::from_str(base).map_err(|e| format!("not a JSON string: {e}"))?;
            let more: String =
                serde_json::from_str(delta).map_err(|e| format!("not a JSON string: {e}"))?;
            text.push_str(&more);
            serde_json::to_string(&text).map_err(|e| e.to_string())
        }
        ("a scalar", "a scalar") => {
            serde_json::from_str::<&RawValue>(delta).map_err(|e| format!("not JSON: {e}"))?;
            Ok(delta.to_owned())
        }
        (a, b) => Err(format!("{b} cannot extend {a}")),
    }
}

/// `object` (a JSON object's text) with `field` set to the JSON text `value`: replaced in place
/// when present, appended otherwise. The reason when `object` is not an object or `value` not
/// JSON.
pub fn set_field(object: &str, field: &str, value: &str) -> Result<String, String> {
    let mut fields = members(object)?;
    let value = RawValue::from_string(value.to_owned()).map_err(|e| format!("{field}: {e}"))?;
    match fields.iter_mut().find(|(k, _)| k == field) {
        Some((_, slot)) => *slot = value,
        None => fields.push((field.to_owned(), value)),
    }
    Ok(object_text(&fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_keep_order_and_exact_values() {
        let object =
            r#"{"type":"server_tool_use","id":"srvtoolu_1","input":{},"n":9007199254740993}"#;
        assert_eq!(
            set_field(object, "input", r#"{"query":"rust"}"#).unwrap(),
            r#"{"type":"server_tool_use","id":"srvtoolu_1","input":{"query":"rust"},"n":9007199254740993}"#
        );
        assert_eq!(
            set_field(r#"{"a":1}"#, "b", "2").unwrap(),
            r#"{"a":1,"b":2}"#
        );
        assert!(set_field("[1]", "a", "1")
            .unwrap_err()
            .contains("not a JSON object"));
        assert!(set_field("{}", "a", "{").is_err());
    }

    #[test]
    fn deltas_extend_values_and_keep_untouched_text() {
        let base = r#"{"format":"png","n":9007199254740993,"source":{"bytes":"AAAA"},"list":[1]}"#;
        let delta = r#"{"source":{"bytes":"BBBB"},"list":[2.50],"extra":{"k":1.0}}"#;
        assert_eq!(
            extend(base, delta).unwrap(),
            r#"{"format":"png","n":9007199254740993,"source":{"bytes":"AAAABBBB"},"list":[1,2.50],"extra":{"k":1.0}}"#
        );
        assert_eq!(extend(r#""a\u00e9""#, r#""b""#).unwrap(), r#""aéb""#);
        assert_eq!(extend("1", "2").unwrap(), "2");
        let err = extend(r#"{"a":"x"}"#, r#"{"a":{"b":1}}"#).unwrap_err();
        assert_eq!(err, "a: an object cannot extend a string");
        assert!(extend("[1]", "{}").is_err());
    }
}
