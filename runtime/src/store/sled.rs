//! The sled store (embedded default): see the module docs once implemented.
