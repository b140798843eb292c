//! What the engine's test modules share: a new session's options and a model's text answer.

use crate::client::SessionOptions;
use crate::engine::ActivityReport;
use cairn_ledger::{ModelResponse, ModelSpec, Part, StopReason, Usage};

/// Options of a session `id` on the scripted provider's `model`, with no tool.
pub(crate) fn session_options(model: &str, id: &str) -> SessionOptions {
    let mut options = SessionOptions::new(ModelSpec::new("scripted", model), Vec::new());
    options.session_id = Some(id.to_owned());
    options
}

/// The scripted provider's `model` answering `text` and ending its turn.
pub(crate) fn text_answer(model: &str, text: &str) -> ActivityReport {
    ActivityReport::ModelCompleted(ModelResponse {
        provider: "scripted".into(),
        model: model.into(),
        parts: vec![Part::text(text)],
        stop_reason_raw: "end_turn".into(),
        stop_reason: StopReason::EndTurn,
        usage: Usage::default(),
    })
}
