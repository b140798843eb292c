//! Per-request id aliasing: ids a provider cannot accept get an alias for one request, the same
//! for a tool_use and its result, bijectively; the canonical id stays in the log.

use std::collections::BTreeMap;

/// A bijection between canonical ids and the ids sent on the wire, built for one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdAliases {
    to_wire: BTreeMap<String, String>,
    to_canonical: BTreeMap<String, String>,
}

impl IdAliases {
    /// An empty mapping.
    pub fn new() -> Self {
        Self::default()
    }

    /// The wire id of `canonical`: itself when `acceptable` says so and it is not taken, else a
    /// deterministic alias (`prefix` + index, skipping ids already in use).
    pub fn wire_id(
        &mut self,
        canonical: &str,
        acceptable: impl Fn(&str) -> bool,
        prefix: &str,
    ) -> String {
        if let Some(wire) = self.to_wire.get(canonical) {
            return wire.clone();
        }
        let wire = if acceptable(canonical) && !self.to_canonical.contains_key(canonical) {
            canonical.to_owned()
        } else {
            let mut n = self.to_wire.len();
            loop {
                let candidate = format!("{prefix}{n}");
                if !self.to_canonical.contains_key(&candidate) {
                    break candidate;
                }
                n += 1;
            }
        };
        self.to_wire.insert(canonical.to_owned(), wire.clone());
        self.to_canonical.insert(wire.clone(), canonical.to_owned());
        wire
    }

    /// The canonical id of a wire id seen in a response (identity when it was never aliased).
    pub fn canonical_id(&self, wire: &str) -> String {
        self.to_canonical
            .get(wire)
            .cloned()
            .unwrap_or_else(|| wire.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_are_bijective_and_stable() {
        let ok =
            |id: &str| id.len() <= 8 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        let mut a = IdAliases::new();
        assert_eq!(a.wire_id("toolu_1", ok, "c"), "toolu_1");
        let long = a.wire_id("call.with.dots", ok, "c");
        assert_eq!(long, "c1");
        assert_eq!(a.wire_id("call.with.dots", ok, "c"), "c1");
        assert_eq!(a.canonical_id("c1"), "call.with.dots");
        // A canonical id equal to an alias already handed out is aliased too.
        let clash = a.wire_id("c1", ok, "c");
        assert_ne!(clash, "c1");
        assert_eq!(a.canonical_id(&clash), "c1");
    }
}
