//! Pure transcript model: canonical messages and parts, the canonical model response, validation
//! and the tool-result projection. No IO, no clock, no randomness, no hash-map iteration.

mod compaction;
mod error;
pub mod file_versions;
mod heap_bytes;
mod json;
mod media;
mod options;
mod projection;
mod request;
mod response;
mod transcript;
mod validate;

pub use compaction::{
    compact, current_turn_start, cut_for_last_turns, drop_failed_tool_results, drop_reasoning,
    drop_reasoning_by, estimate_tokens, keep_last_turns, starts_turn, summary_request, turn_starts,
    turns_before_cut, Compacted, CompactionPlan, CompactionRules, CompactionStrategy,
    FAILED_RESULT_NOTE, MEDIA_TOKEN_ESTIMATE, SUMMARY_HEADING, SUMMARY_PROMPT,
};
pub use error::{Error, Result, Violation};
pub use json::JsonText;
pub use media::{
    media_type_for_extension, sniff_image_media_type, Media, MediaKind, MediaSource,
    ToolResultBlock, DOCUMENT_MEDIA_TYPES, IMAGE_MEDIA_TYPES,
};
pub use options::{CallOptions, ServerTool, ServerToolKind, ToolChoice};
pub use projection::{project_tool_result, PREVIEW_BYTES, TRANSCRIPT_RESULT_LIMIT_BYTES};
pub use request::{Delta, ModelSpec, ToolSpec};
pub use response::{ModelResponse, StopReason, Usage};
pub use transcript::{
    Message, Part, Provenance, ProviderJson, Role, ToolResult, ToolResultContent, ToolUse,
    Transcript,
};
pub use validate::{
    validate_recorded_response, validate_response, validate_transcript, validate_transcript_from,
};
