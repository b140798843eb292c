//! Images and documents a message or a tool result carries: their kind, where their bytes are
//! (base64 data with a media type, or a URL), and the checks they pass before any provider sees
//! them.

use crate::error::Violation;
use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// The image media types every provider family documents: PNG, JPEG, GIF and WebP.
pub const IMAGE_MEDIA_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// The document media types: PDF, and plain text (UTF-8).
pub const DOCUMENT_MEDIA_TYPES: [&str; 2] = ["application/pdf", "text/plain"];

/// What a piece of media is to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MediaKind {
    /// A picture.
    Image,
    /// A document the model reads (PDF or plain text).
    Document,
}

impl MediaKind {
    /// The kind's name, for errors and views.
    pub fn as_str(self) -> &'static str {
        match self {
            MediaKind::Image => "image",
            MediaKind::Document => "document",
        }
    }

    /// The media types this kind accepts.
    pub fn media_types(self) -> &'static [&'static str] {
        match self {
            MediaKind::Image => &IMAGE_MEDIA_TYPES,
            MediaKind::Document => &DOCUMENT_MEDIA_TYPES,
        }
    }
}

/// Where the bytes of a piece of media are.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MediaSource {
    /// The bytes themselves, in standard padded base64, with their media type.
    Base64 {
        /// MIME type, e.g. `image/png` or `application/pdf`.
        media_type: String,
        /// The base64 text, kept exactly as given.
        data: String,
    },
    /// An http(s) URL the provider fetches itself.
    Url {
        /// The URL.
        url: String,
    },
}

/// An image or a document, as a user message or a tool result carries it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Media {
    /// Image or document.
    pub kind: MediaKind,
    /// Where its bytes are.
    pub source: MediaSource,
    /// A file name or title, when known (documents are named to the model by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Media {
    /// An image from base64 data.
    pub fn image_base64(media_type: impl Into<String>, data: impl Into<String>) -> Self {
        Media {
            kind: MediaKind::Image,
            source: MediaSource::Base64 {
                media_type: media_type.into(),
                data: data.into(),
            },
            name: None,
        }
    }

    /// An image from raw bytes (encoded here as base64).
    pub fn image_bytes(media_type: impl Into<String>, bytes: &[u8]) -> Self {
        Media::from_bytes(MediaKind::Image, media_type, bytes)
    }

    /// Media of `kind` from raw bytes (encoded here as base64).
    pub fn from_bytes(kind: MediaKind, media_type: impl Into<String>, bytes: &[u8]) -> Self {
        Media {
            kind,
            source: MediaSource::Base64 {
                media_type: media_type.into(),
                data: base64::engine::general_purpose::STANDARD.encode(bytes),
            },
            name: None,
        }
    }

    /// A piece of media of `kind` at a URL.
    pub fn url(kind: MediaKind, url: impl Into<String>) -> Self {
        Media {
            kind,
            source: MediaSource::Url { url: url.into() },
            name: None,
        }
    }

    /// The media type, when the source states one (a URL does not).
    pub fn media_type(&self) -> Option<&str> {
        match &self.source {
            MediaSource::Base64 { media_type, .. } => Some(media_type),
            MediaSource::Url { .. } => None,
        }
    }

    /// The decoded bytes of a base64 source; `None` for a URL or bad base64.
    pub fn decoded(&self) -> Option<Vec<u8>> {
        match &self.source {
            MediaSource::Base64 { data, .. } => {
                base64::engine::general_purpose::STANDARD.decode(data).ok()
            }
            MediaSource::Url { .. } => None,
        }
    }

    /// A data: URI of a base64 source (`data:<media type>;base64,<data>`), the form OpenAI's
    /// APIs take inline bytes in; a URL source gives its URL.
    pub fn uri(&self) -> String {
        match &self.source {
            MediaSource::Base64 { media_type, data } => format!("data:{media_type};base64,{data}"),
            MediaSource::Url { url } => url.clone(),
        }
    }

    /// Checks the media alone: a known media type for its kind, non-empty valid base64 (and
    /// UTF-8 for a plain-text document), or an http(s) URL.
    pub fn check(&self) -> Result<(), Violation> {
        match &self.source {
            MediaSource::Base64 { media_type, data } => {
                if media_type.is_empty() {
                    return Err(Violation::EmptyMediaType {
                        kind: self.kind.as_str(),
                    });
                }
                if !self.kind.media_types().contains(&media_type.as_str()) {
                    return Err(Violation::UnsupportedMediaType {
                        kind: self.kind.as_str(),
                        media_type: media_type.clone(),
                    });
                }
                if data.is_empty() {
                    return Err(Violation::EmptyMediaData {
                        kind: self.kind.as_str(),
                    });
                }
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .map_err(|e| Violation::InvalidBase64 {
                        kind: self.kind.as_str(),
                        reason: e.to_string(),
                    })?;
                if media_type == "text/plain" && std::str::from_utf8(&bytes).is_err() {
                    return Err(Violation::TextDocumentNotUtf8);
                }
                Ok(())
            }
            MediaSource::Url { url } => {
                let scheme_ok = ["https://", "http://"]
                    .iter()
                    .any(|p| url.len() > p.len() && url.starts_with(p));
                if !scheme_ok || url.chars().any(char::is_whitespace) {
                    return Err(Violation::InvalidMediaUrl {
                        kind: self.kind.as_str(),
                        url: url.chars().take(200).collect(),
                    });
                }
                Ok(())
            }
        }
    }

    /// The length of the base64 data (0 for a URL): what this media adds to a transcript's
    /// canonical bytes beyond its small envelope.
    pub fn data_len(&self) -> usize {
        match &self.source {
            MediaSource::Base64 { data, .. } => data.len(),
            MediaSource::Url { .. } => 0,
        }
    }
}

/// One block of a tool result made of blocks: text or media.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolResultBlock {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// An image (or a document, where a provider takes one in a tool result).
    Media(Media),
}

/// The media type of a file name by its extension (png, jpg/jpeg, gif, webp, pdf, txt), with the
/// kind it makes; `None` for any other extension.
pub fn media_type_for_extension(extension: &str) -> Option<(MediaKind, &'static str)> {
    let kind_type = match extension.to_ascii_lowercase().as_str() {
        "png" => (MediaKind::Image, "image/png"),
        "jpg" | "jpeg" => (MediaKind::Image, "image/jpeg"),
        "gif" => (MediaKind::Image, "image/gif"),
        "webp" => (MediaKind::Image, "image/webp"),
        "pdf" => (MediaKind::Document, "application/pdf"),
        "txt" => (MediaKind::Document, "text/plain"),
        _ => return None,
    };
    Some(kind_type)
}

/// The image media type of `bytes` by their magic number (PNG, JPEG, GIF, WebP), if any.
pub fn sniff_image_media_type(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && bytes.starts_with(b"RIFF") && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_what_is_wrong() {
        assert_eq!(
            Media::image_base64("image/png", "iVBORw0KGgo=").check(),
            Ok(())
        );
        assert_eq!(
            Media::image_base64("", "iVBORw0KGgo=").check(),
            Err(Violation::EmptyMediaType { kind: "image" })
        );
        assert_eq!(
            Media::image_base64("image/tiff", "iVBORw0KGgo=").check(),
            Err(Violation::UnsupportedMediaType {
                kind: "image",
                media_type: "image/tiff".into()
            })
        );
        assert!(matches!(
            Media::image_base64("image/png", "not base64!").check(),
            Err(Violation::InvalidBase64 { kind: "image", .. })
        ));
        assert_eq!(
            Media::image_base64("image/png", "").check(),
            Err(Violation::EmptyMediaData { kind: "image" })
        );
        let pdf_as_image = Media::image_base64("application/pdf", "JVBERi0=");
        assert!(matches!(
            pdf_as_image.check(),
            Err(Violation::UnsupportedMediaType { .. })
        ));
        let bad_text = Media {
            kind: MediaKind::Document,
            source: MediaSource::Base64 {
                media_type: "text/plain".into(),
                data: "/w==".into(),
            },
            name: None,
        };
        assert_eq!(bad_text.check(), Err(Violation::TextDocumentNotUtf8));
        assert_eq!(
            Media::url(MediaKind::Document, "https://e.com/a.pdf").check(),
            Ok(())
        );
        assert!(matches!(
            Media::url(MediaKind::Image, "file:///etc/passwd").check(),
            Err(Violation::InvalidMediaUrl { .. })
        ));
        assert!(Media::url(MediaKind::Image, "https://").check().is_err());
    }

    #[test]
    fn data_uris_and_extensions() {
        let m = Media::image_bytes("image/png", b"\x89PNG");
        assert_eq!(m.uri(), "data:image/png;base64,iVBORw==");
        assert_eq!(m.decoded().unwrap(), b"\x89PNG");
        assert_eq!(
            media_type_for_extension("JPG"),
            Some((MediaKind::Image, "image/jpeg"))
        );
        assert_eq!(
            media_type_for_extension("pdf"),
            Some((MediaKind::Document, "application/pdf"))
        );
        assert_eq!(media_type_for_extension("exe"), None);
        assert_eq!(
            sniff_image_media_type(b"\x89PNG\r\n\x1a\n...."),
            Some("image/png")
        );
        assert_eq!(
            sniff_image_media_type(b"RIFF\0\0\0\0WEBPVP8 "),
            Some("image/webp")
        );
        assert_eq!(sniff_image_media_type(b"%PDF-1.4"), None);
    }
}
