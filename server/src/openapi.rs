//! The OpenAPI document, generated from the handlers' `#[utoipa::path]` attributes and the
//! wire types' schemas (never written by hand), and its route.

use crate::auth::AnyCaller;
use crate::{app, compact, delete, events, inspect, sessions, worker, worker_reports};
use axum::http::header;
use axum::response::IntoResponse;
use cairn_runtime::wire::ErrorBody;
use std::sync::OnceLock;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "cairn",
        description = "The cairn server's API: durable LLM agent sessions (client routes) and \
                       the task protocol of remote workers (worker routes). Every route takes \
                       `Authorization: Bearer TOKEN` when the server has a tokens file; every \
                       error is an `ErrorBody`."
    ),
    paths(
        sessions::create_session,
        sessions::list_sessions,
        sessions::describe_session,
        sessions::send_message,
        sessions::wait_turn,
        sessions::history,
        sessions::transcript,
        sessions::cancel,
        delete::delete_session,
        events::events,
        inspect::state_at,
        inspect::fork,
        sessions::decide_approval,
        compact::compact,
        worker::lease,
        worker::input,
        worker::heartbeat,
        worker::progress,
        worker_reports::report,
        worker_reports::reports,
        worker::deltas,
        app::health,
        document,
    ),
    components(schemas(sessions::TranscriptFormat)),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "sessions", description = "Client routes: a token of role `client`"),
        (name = "worker", description = "Worker routes: a token of role `worker`"),
        (name = "server", description = "Either role"),
    )
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI document of the API, as JSON.
pub fn openapi() -> serde_json::Value {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    let mut json = serde_json::to_value(&doc).unwrap_or_default();
    bound_unsigned(&mut json);
    close_enum_wrappers(&mut json);
    require_text_or_media(&mut json);
    json
}

/// Says that a message has text or media: `text` may be empty only when `media` is not, a
/// rule between two fields that utoipa's derive cannot state.
fn require_text_or_media(doc: &mut serde_json::Value) {
    if let Some(message) = doc
        .pointer_mut("/components/schemas/SendMessage")
        .and_then(|v| v.as_object_mut())
    {
        message.insert(
            "anyOf".to_owned(),
            serde_json::json!([
                {"properties": {"text": {"minLength": 1}}},
                {"required": ["media"], "properties": {"media": {"minItems": 1}}}
            ]),
        );
    }
}

/// Enums serde writes externally tagged: `{"VARIANT": ...}`.
const EXTERNALLY_TAGGED: [&str; 8] = [
    "ActivityReport",
    "Part",
    "ToolResultContent",
    "ToolResultBlock",
    "Delta",
    "ImageSource",
    "DocumentSource",
    "ToolChoice",
];

/// Says that an externally tagged enum's object has its one key and no other: serde refuses
/// `{"failed": {...}, "x": 1}`, and utoipa's schema of a variant does not say so.
fn close_enum_wrappers(doc: &mut serde_json::Value) {
    for name in EXTERNALLY_TAGGED {
        let variants = doc
            .pointer_mut(&format!("/components/schemas/{name}/oneOf"))
            .and_then(|v| v.as_array_mut());
        for variant in variants.into_iter().flatten() {
            if let Some(object) = variant.as_object_mut() {
                if object.get("type").and_then(|t| t.as_str()) == Some("object") {
                    object.insert("additionalProperties".to_owned(), false.into());
                }
            }
        }
    }
}

/// Gives every unsigned integer its maximum. utoipa marks them with a format (`uint64`, which
/// it spells `u-int64`) and `minimum: 0` only, and a reader (a client generator, schemathesis)
/// cannot know from an unknown format that `2^64` is refused; with the bound the document says
/// exactly which numbers the server takes.
fn bound_unsigned(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(object) => {
            let maximum: Option<u64> = match object.get("format").and_then(|f| f.as_str()) {
                Some("u-int8" | "uint8") => Some(u8::MAX.into()),
                Some("u-int16" | "uint16") => Some(u16::MAX.into()),
                Some("u-int32" | "uint32") => Some(u32::MAX.into()),
                Some("u-int64" | "uint64") => Some(u64::MAX),
                _ => None,
            };
            if let Some(maximum) = maximum {
                let format = format!("uint{}", 64 - maximum.leading_zeros());
                object.insert("format".to_owned(), format.into());
                object.entry("maximum").or_insert(maximum.into());
            }
            object.values_mut().for_each(bound_unsigned);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(bound_unsigned),
        _ => {}
    }
}

/// `GET /v1/openapi.json`: this document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "server",
    responses(
        (status = 200, description = "The OpenAPI document", body = Object),
        (status = 401, description = "No token, or an unknown one", body = ErrorBody),
        (status = 500, description = "The server failed", body = ErrorBody),
    )
)]
pub async fn document(_caller: AnyCaller) -> axum::response::Response {
    static JSON: OnceLock<String> = OnceLock::new();
    let json = JSON.get_or_init(|| openapi().to_string());
    ([(header::CONTENT_TYPE, "application/json")], json.as_str()).into_response()
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    fn refs<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
        match value {
            Value::Object(object) => {
                if let Some(Value::String(target)) = object.get("$ref") {
                    out.push(target);
                }
                object.values().for_each(|v| refs(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn every_reference_resolves_and_every_operation_is_guarded_and_answers_errors_as_json() {
        let doc = super::openapi();
        let mut targets = Vec::new();
        refs(&doc, &mut targets);
        assert!(!targets.is_empty());
        for target in targets {
            let pointer = target.trim_start_matches('#');
            assert!(doc.pointer(pointer).is_some(), "unresolved {target}");
        }
        assert_eq!(doc["security"][0]["bearer"], serde_json::json!([]));
        let paths = doc["paths"].as_object().unwrap();
        assert_eq!(paths.len(), 21, "{:?}", paths.keys().collect::<Vec<_>>());
        assert!(paths["/v1/sessions/{id}/compact"]["post"].is_object());
        let compaction = &doc["components"]["schemas"]["CompactionPolicy"]["properties"];
        assert_eq!(
            compaction["strategies"]["uniqueItems"], true,
            "{compaction}"
        );
        for (path, operations) in paths {
            for (method, operation) in operations.as_object().unwrap() {
                let responses = operation["responses"].as_object().unwrap();
                for status in ["401", "500"] {
                    assert_eq!(
                        responses[status]["content"]["application/json"]["schema"]["$ref"],
                        "#/components/schemas/ErrorBody",
                        "{method} {path} {status}"
                    );
                }
                if operation.get("requestBody").is_some() {
                    for status in ["400", "413", "415"] {
                        assert!(responses.contains_key(status), "{method} {path} {status}");
                    }
                }
            }
        }
    }

    #[test]
    fn unsigned_integers_carry_their_bounds() {
        let doc = super::openapi();
        let lease = &doc["components"]["schemas"]["LeaseRequest"]["properties"];
        assert_eq!(lease["max"]["maximum"], u64::from(u32::MAX));
        assert_eq!(lease["lease_ms"]["maximum"], u64::MAX);
        assert_eq!(lease["lease_ms"]["format"], "uint64");
        let report = &doc["components"]["schemas"]["ActivityReport"]["oneOf"][0];
        assert_eq!(report["additionalProperties"], false);
    }

    #[test]
    fn a_batch_of_reports_says_how_many_it_holds_and_its_blocks_have_one_key() {
        let doc = super::openapi();
        let schemas = &doc["components"]["schemas"];
        let reports = &schemas["ReportBatch"]["properties"]["reports"];
        assert_eq!(reports["minItems"], 1);
        assert_eq!(
            reports["maxItems"],
            cairn_runtime::wire::MAX_REPORTS_PER_BATCH
        );
        for variant in schemas["ToolResultBlock"]["oneOf"].as_array().unwrap() {
            assert_eq!(variant["additionalProperties"], false, "{variant}");
        }
    }
}
