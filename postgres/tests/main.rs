//! cairn-postgres's tests, against the PostgreSQL of `DATABASE_URL` (`scripts/postgres start`
//! provides one): the runtime's store conformance suite, each check on a fresh database, and
//! what only a shared database has (two stores at once, errors, hints).

// Tests wait on real time (a database's locks, a pool's timeout, hints in flight).
#![allow(clippy::disallowed_methods)]

mod conformance;
mod shared;
mod support;
