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

/// `object` (a JSON object's text) with `field` set to the JSON text `value`: replaced in place
/// when present, appended otherwise. The reason when `object` is not an object or `value` not
/// JSON.
pub fn set_field(object: &str, field: &str, value: &str) -> Result<String, String> {
    let OrderedFields(mut fields) =
        serde_json::from_str(object).map_err(|e| format!("not a JSON object: {e}"))?;
    let value = RawValue::from_string(value.to_owned()).map_err(|e| format!("{field}: {e}"))?;
    match fields.iter_mut().find(|(k, _)| k == field) {
        Some((_, slot)) => *slot = value,
        None => fields.push((field.to_owned(), value)),
    }
    let mut out = String::with_capacity(object.len() + 16);
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
    Ok(out)
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
}
