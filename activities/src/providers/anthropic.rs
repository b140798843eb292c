//! Placeholder: being implemented.

use crate::error::{Error, ErrorKind, Result};
use crate::model::ModelRequest;

/// Renders the next request body (not implemented yet).
pub fn render(_request: &ModelRequest) -> Result<serde_json::Value> {
    Err(Error::Provider {
        kind: ErrorKind::InvalidRequest,
        message: "this provider is not implemented yet".into(),
    })
}
