//! The history viewer at `/ui`: a page of static HTML, CSS and JavaScript embedded in the
//! binary (nothing is loaded from elsewhere), which reads sessions through the `/v1` API with
//! the browser's `fetch` and follows a running one over its event stream.
//!
//! `/ui` (the session list) and `/ui/sessions/{id}` (a session) serve the same page; its
//! script picks the view from the path. The page and its assets hold no data, so they are
//! served without a token; every `/v1` call the script makes carries the token the person
//! typed in (kept in the browser's `localStorage`), as `Authorization: Bearer`. The event
//! stream is read with `fetch` and a stream reader rather than `EventSource`, which cannot
//! send that header, so no token ever goes in a URL.

use crate::app::AppState;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// The page of every view.
const INDEX_HTML: &str = include_str!("../ui/index.html");
/// Its script.
const APP_JS: &str = include_str!("../ui/app.js");
/// Its style sheet.
const APP_CSS: &str = include_str!("../ui/app.css");

/// What the page may load and run: its own assets and `/v1` calls to this server, and
/// nothing inline or from elsewhere, so that text from a transcript can never become code
/// even if a bug were to insert it as markup.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The viewer's routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui") }))
        .route("/ui", get(page))
        .route("/ui/", get(page))
        .route("/ui/sessions/{id}", get(page))
        .route("/ui/assets/app.js", get(script))
        .route("/ui/assets/app.css", get(style))
}

/// An embedded asset with its content type; revalidated on every load, so a new binary's
/// assets are picked up at once.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// `GET /ui`, `GET /ui/sessions/{id}`: the page; the script reads the path.
async fn page() -> Response {
    let mut response = asset("text/html; charset=utf-8", INDEX_HTML);
    response.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    response
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", APP_CSS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_refers_only_to_embedded_assets() {
        assert!(INDEX_HTML.contains("/ui/assets/app.js"));
        assert!(INDEX_HTML.contains("/ui/assets/app.css"));
        for text in [INDEX_HTML, APP_JS, APP_CSS] {
            assert!(!text.contains("http://") && !text.contains("https://"));
        }
        // Untrusted text goes into the page as text nodes only.
        assert!(!APP_JS.contains("innerHTML") && !APP_JS.contains("insertAdjacentHTML"));
    }
}
