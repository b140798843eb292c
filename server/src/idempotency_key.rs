//! The `Idempotency-Key` request header of the routes that start a turn and of a worker's
//! lease request: read and checked, and the session id a create without one is given, derived
//! from its key so that a resend finds the session the first request started.

use crate::errors::{single_header, ApiError};
use axum::http::HeaderMap;
use cairn_runtime::idempotency::idempotency_key_problem;
use utoipa::IntoParams;

/// The header's name.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The header, as the OpenAPI document describes it.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Header)]
pub struct IdempotencyKeyHeader {
    /// A key the client chose for this message (a UUID, say): sent again with the same
    /// request, say after a lost answer, it starts no second turn and is answered as the
    /// first request was; with another message it is refused (422
    /// `idempotency_key_reused`). Remembered for the session's life. On `POST /v1/sessions`,
    /// a body without `session_id` gets an id derived from the key.
    #[param(rename = "Idempotency-Key", pattern = r"^[!-~]{1,255}$")]
    #[allow(dead_code)] // read from the headers; here for the document only
    idempotency_key: Option<String>,
}

/// The `Idempotency-Key` of a lease request, as the OpenAPI document describes it.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Header)]
pub struct LeaseIdempotencyKey {
    /// A key the worker chose for this lease request (128 random bits, say): the same
    /// request sent again under it, after a lost answer, is answered with the tasks the
    /// first try leased while their leases last, rather than leasing more (whatever the body
    /// of the try sent again says). 1-255 visible ASCII characters.
    #[param(rename = "Idempotency-Key", pattern = r"^[!-~]{1,255}$")]
    #[allow(dead_code)] // read from the headers; here for the document only
    idempotency_key: Option<String>,
}

/// The request's `Idempotency-Key`, checked: 1-255 visible ASCII characters.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(key) = single_header(
        headers,
        IDEMPOTENCY_KEY,
        "Idempotency-Key",
        "use visible ASCII characters (! to ~)",
    )?
    else {
        return Ok(None);
    };
    match idempotency_key_problem(key) {
        None => Ok(Some(key.to_owned())),
        Some(problem) => Err(ApiError::invalid(format!("Idempotency-Key: {problem}"))),
    }
}

/// The id of a session created under `key` without an id of its own: `k` and 32 hex digits
/// of the key's 128-bit XXH3 (a specified hash: the same id from every server and version).
pub fn session_id_for_key(key: &str) -> String {
    format!("k{:032x}", xxhash_rust::xxh3::xxh3_128(key.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_derives_one_session_id_of_the_id_alphabet() {
        let id = session_id_for_key("create-1");
        assert_eq!(id, session_id_for_key("create-1"));
        assert_ne!(id, session_id_for_key("create-2"));
        assert_eq!(id.len(), 33);
        assert!(id.bytes().all(|b| b.is_ascii_alphanumeric()), "{id}");
        // Pinned: a resend to a newer server must find the session an older one created.
        assert_eq!(
            session_id_for_key("create-1"),
            "k61d21f915b62f57af37a61f968df3179"
        );
    }
}
