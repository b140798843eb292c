//! JSON bodies as JSON Schema reads them: an integer may be spelled as a whole float (`2.0`),
//! which the OpenAPI document's `integer` admits and serde_json alone refuses for integer
//! fields (a Python client computing `lease_ms` as a float sends `5000.0`). Everything else
//! is serde_json's, and raw JSON values (`JsonText`: tool results, heartbeat details) are
//! captured byte for byte, never re-spelled.
//!
//! [`Lenient`] wraps a deserializer: it asks the inner one for an integer as usual and turns a
//! whole float it gets instead into that integer; compound values are walked through wrapped
//! accessors so that nested fields get the same treatment.

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};
use std::fmt;

/// The name serde_json gives the newtype through which it hands out raw values; passed
/// through untouched so the raw capture sees serde_json's own deserializer.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

/// Parses `bytes` as one JSON value of type `T`, taking whole floats for integers. The error
/// says what is wrong and at which field.
///
/// A body is parsed without tracking the path first, and again with it only when that
/// fails: the tracking wrappers cost about as much as the rest of the parse, and only an
/// error needs the path. Both parses run the same deserializer, so they take and refuse the
/// same bodies.
///
/// The first parse reads the body as text checked for UTF-8 once, whole: parsed from bytes,
/// serde_json checks each string as it meets it, a fifth of a worker's report's parse. A body
/// that is not UTF-8 is refused by the second parse, from the bytes, which says where.
pub fn from_slice<T: de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    if let Ok(text) = std::str::from_utf8(bytes) {
        let mut json = serde_json::Deserializer::from_str(text);
        if let Ok(value) = T::deserialize(Lenient(&mut json)) {
            if json.end().is_ok() {
                return Ok(value);
            }
        }
    }
    let mut json = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(Lenient(&mut json)).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.into_inner().to_string()
        } else {
            format!("at {path}: {}", e.into_inner())
        }
    })?;
    json.end().map_err(|e| e.to_string())?;
    Ok(value)
}

/// A deserializer that takes whole floats for integers.
pub struct Lenient<D>(pub D);

/// A visitor of an integer that also takes a whole float.
struct Whole<V>(V);

/// Any other visitor, walking compound values through wrapped accessors.
struct Wrap<V>(V);

/// A struct's visitor: it takes a JSON object only. serde would also fill a struct from an
/// array, positionally, which the document's `type: object` does not allow.
struct Struct<V>(V);

/// A seed whose deserializer is wrapped.
struct Seed<S>(S);

macro_rules! integer {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
            self.0.$method(Whole(visitor))
        }
    )*};
}

macro_rules! wrapped {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
            self.0.$method(Wrap(visitor))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Lenient<D> {
    type Error = D::Error;

    integer! {
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
    }

    wrapped! {
        deserialize_any deserialize_bool deserialize_f32 deserialize_f64 deserialize_char
        deserialize_str deserialize_string deserialize_bytes deserialize_byte_buf
        deserialize_option deserialize_unit deserialize_seq deserialize_map
        deserialize_identifier deserialize_ignored_any
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_unit_struct(name, Wrap(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        if name == RAW_VALUE_TOKEN {
            self.0.deserialize_newtype_struct(name, visitor)
        } else {
            self.0.deserialize_newtype_struct(name, Wrap(visitor))
        }
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple(len, Wrap(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple_struct(name, len, Wrap(visitor))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_struct(name, fields, Struct(visitor))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_enum(name, variants, Wrap(visitor))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// The integer a whole float spells, if it is one that `f64` holds exactly enough.
fn whole(value: f64) -> Option<Result<u64, i64>> {
    // 2^64 and -2^63 are exact in f64; whole floats within them convert without wrapping.
    const TWO_POW_64: f64 = 18_446_744_073_709_551_616.0;
    const MINUS_TWO_POW_63: f64 = -9_223_372_036_854_775_808.0;
    if !value.is_finite() || value.fract() != 0.0 {
        return None;
    }
    if (0.0..TWO_POW_64).contains(&value) {
        Some(Ok(value as u64))
    } else if (MINUS_TWO_POW_63..0.0).contains(&value) {
        Some(Err(value as i64))
    } else {
        None
    }
}

macro_rules! forward {
    ($($method:ident: $ty:ty)*) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
            self.0.$method(v)
        }
    )*};
}

macro_rules! forward_all {
    () => {
        forward! {
            visit_bool: bool visit_i8: i8 visit_i16: i16 visit_i32: i32 visit_i64: i64
            visit_i128: i128 visit_u8: u8 visit_u16: u16 visit_u32: u32 visit_u64: u64
            visit_u128: u128 visit_f32: f32 visit_char: char visit_str: &str
            visit_borrowed_str: &'de str visit_string: String visit_bytes: &[u8]
            visit_borrowed_bytes: &'de [u8] visit_byte_buf: Vec<u8>
        }

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            self.0.expecting(f)
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            self.0.visit_none()
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            self.0.visit_unit()
        }

        fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            self.0.visit_some(Lenient(d))
        }

        fn visit_newtype_struct<D2: Deserializer<'de>>(
            self,
            d: D2,
        ) -> Result<Self::Value, D2::Error> {
            self.0.visit_newtype_struct(Lenient(d))
        }

        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            self.0.visit_map(Wrap(map))
        }

        fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
            self.0.visit_enum(Wrap(data))
        }
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Whole<V> {
    type Value = V::Value;

    forward_all!();

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        self.0.visit_seq(Wrap(seq))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        match whole(v) {
            Some(Ok(n)) => self.0.visit_u64(n),
            Some(Err(n)) => self.0.visit_i64(n),
            None => self.0.visit_f64(v),
        }
    }
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<V> {
    type Value = V::Value;

    forward_all!();

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        self.0.visit_seq(Wrap(seq))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.0.visit_f64(v)
    }
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Struct<V> {
    type Value = V::Value;

    forward_all!();

    fn visit_seq<A: SeqAccess<'de>>(self, _seq: A) -> Result<Self::Value, A::Error> {
        Err(de::Error::invalid_type(de::Unexpected::Seq, &self))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.0.visit_f64(v)
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Lenient(deserializer))
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Wrap<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(Seed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Wrap<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        self.0.next_key_seed(Seed(seed))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.0.next_value_seed(Seed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for Wrap<A> {
    type Error = A::Error;
    type Variant = Wrap<A::Variant>;

    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Self::Variant), A::Error> {
        let (value, variant) = self.0.variant_seed(Seed(seed))?;
        Ok((value, Wrap(variant)))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Wrap<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.0.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.0.newtype_variant_seed(Seed(seed))
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.0.tuple_variant(len, Wrap(visitor))
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.0.struct_variant(fields, Struct(visitor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::JsonText;
    use cairn_runtime::wire::{HeartbeatRequest, LeaseRequest, ReportRequest};
    use cairn_runtime::ActivityReport;

    #[test]
    fn a_whole_float_of_sixteen_digits_is_read_exactly() {
        // serde_json's default float parsing may miss the nearest double by a bit; this one
        // then reads as 2251799813685247.2 and is refused as a fraction (found by
        // schemathesis on the fork route's `at`).
        let request: cairn_runtime::wire::ForkSession =
            from_slice(br#"{"at": 2251799813685247.0, "id": "f"}"#).unwrap();
        assert_eq!(request.at, 2_251_799_813_685_247);
    }

    #[test]
    fn whole_floats_are_integers_everywhere_but_inside_raw_json() {
        let request: HeartbeatRequest = from_slice(
            br#"{"lease": {"id": {"session_id": "s", "scheduled_seq": 3.0}, "kind": "tool",
                 "lease_attempt": 2e0, "expires_at_ms": 10}, "lease_ms": 5000.0,
                 "details": {"n": 1.0, "big": 9007199254740993, "z": [2.50, {"a": 1}]}}"#,
        )
        .unwrap();
        assert_eq!(request.lease.id.scheduled_seq, 3);
        assert_eq!(request.lease.lease_attempt, 2);
        assert_eq!(request.lease_ms, 5000);
        let details = request.details.unwrap();
        assert_eq!(
            details.as_str(),
            r#"{"n": 1.0, "big": 9007199254740993, "z": [2.50, {"a": 1}]}"#,
            "raw JSON is kept byte for byte"
        );

        let report: ReportRequest = from_slice(
            br#"{"lease": {"id": {"session_id": "s", "scheduled_seq": 3}, "kind": "tool",
                 "lease_attempt": 1, "expires_at_ms": 10},
                 "report": {"tool_completed": {"content": {"json": {"x": 1.0}}, "is_error": false}}}"#,
        )
        .unwrap();
        match report.report {
            ActivityReport::ToolCompleted { content, .. } => assert_eq!(
                content,
                cairn_ledger::ToolResultContent::Json(JsonText::parse(r#"{"x": 1.0}"#).unwrap())
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fractions_negatives_and_out_of_range_floats_are_still_refused_with_their_path() {
        for (body, path) in [
            (r#"{"max": 1.5, "lease_ms": 1}"#, "max"),
            (r#"{"max": -1.0, "lease_ms": 1}"#, "max"),
            (r#"{"max": 1, "lease_ms": 1e30}"#, "lease_ms"),
            (r#"{"max": 1, "lease_ms": 1, "extra": 1}"#, "extra"),
            (
                r#"[1, 1, null, null, null, null]"#,
                "invalid type: sequence",
            ),
        ] {
            let err = from_slice::<LeaseRequest>(body.as_bytes())
                .err()
                .unwrap_or_else(|| panic!("accepted {body}"));
            assert!(err.contains(path), "{body}: {err}");
        }
        assert!(from_slice::<LeaseRequest>(br#"{"max": 1, "lease_ms": 1} x"#).is_err());
        let not_utf8 =
            from_slice::<LeaseRequest>(b"{\"max\": 1, \"lease_ms\": 1, \"queues\": [\"a\xff\"]}")
                .expect_err("a string that is not UTF-8 is refused");
        assert!(
            not_utf8.contains("at queues[0]: invalid unicode code point at line 1 column 40"),
            "says where: {not_utf8}"
        );
        let nested = from_slice::<cairn_runtime::wire::CreateSession>(
            br#"{"model": {"provider": "p", "model": "m"}, "queues": [null, null]}"#,
        );
        assert!(
            nested.as_ref().is_err_and(|e| e.contains("queues")),
            "a struct is an object, not an array: {:?}",
            nested.map(|_| ())
        );
    }
}
