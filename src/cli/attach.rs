//! `cairn run --attach`: files and URLs as the images and documents of the user message, read
//! and checked before anything is written.

use super::exit_codes::usage_bail;
use cairn_ledger::{media_type_for_extension, sniff_image_media_type, Media, MediaKind};
use std::path::Path;

/// The largest file `--attach` reads (32 MiB): far above what any provider takes in one
/// request, so that only a mistake (the wrong file) is refused here.
pub const MAX_ATTACH_BYTES: u64 = 32 * 1024 * 1024;

/// The media of `--attach` values, in order. A value starting with `http://` or `https://` is
/// a URL (its kind from the path's extension); anything else is a file path, its media type
/// from its extension (png, jpg/jpeg, gif, webp, pdf, txt). An image file must hold that kind
/// of image (by its magic number), a text file UTF-8.
pub fn load(values: &[String]) -> anyhow::Result<Vec<Media>> {
    values.iter().map(|value| load_one(value)).collect()
}

fn load_one(value: &str) -> anyhow::Result<Media> {
    const KINDS: &str = "png, jpg, jpeg, gif, webp, pdf or txt";
    if value.starts_with("http://") || value.starts_with("https://") {
        let path = value.split(['?', '#']).next().unwrap_or(value);
        let extension = path.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
        let Some((kind, _)) = media_type_for_extension(extension) else {
            usage_bail!(
                "--attach {value}: cannot tell the URL's kind: its path must end in .{KINDS}"
            );
        };
        let media = Media::url(kind, value);
        if let Err(violation) = media.check() {
            usage_bail!("--attach {value}: {violation}");
        }
        return Ok(media);
    }
    let path = Path::new(value);
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let Some((kind, media_type)) = media_type_for_extension(extension) else {
        usage_bail!("--attach {value}: unsupported file type: the name must end in .{KINDS}");
    };
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(e) => usage_bail!("--attach {value}: {e}"),
    };
    if !metadata.is_file() {
        usage_bail!("--attach {value}: not a file");
    }
    if metadata.len() > MAX_ATTACH_BYTES {
        usage_bail!(
            "--attach {value}: {} bytes is over the {MAX_ATTACH_BYTES}-byte limit",
            metadata.len()
        );
    }
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) => usage_bail!("--attach {value}: {e}"),
    };
    if kind == MediaKind::Image && sniff_image_media_type(&bytes) != Some(media_type) {
        usage_bail!("--attach {value}: the file is not a {media_type} image");
    }
    if media_type == "application/pdf" && !bytes.starts_with(b"%PDF-") {
        usage_bail!("--attach {value}: the file is not a PDF");
    }
    let media = Media {
        name: path.file_name().and_then(|n| n.to_str()).map(str::to_owned),
        ..Media::from_bytes(kind, media_type, &bytes)
    };
    if let Err(violation) = media.check() {
        usage_bail!("--attach {value}: {violation}");
    }
    Ok(media)
}
