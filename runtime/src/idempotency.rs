//! Idempotency keys of user messages: what a key may be, and the fingerprint that tells a
//! resend of a message from another message sent under the same key.
//!
//! A client that sends a message and loses the answer (a broken connection, a server
//! restarting) cannot tell whether the message was recorded. Sent under a key, the message
//! may be sent again: the session remembers each key with the turn its message started, and
//! a resend with the same message starts nothing and is answered with that turn, while a
//! different message under a used key is refused ([`Error::IdempotencyKeyReused`]), as the
//! IETF's `Idempotency-Key` draft and Stripe's API do.
//!
//! [`Error::IdempotencyKeyReused`]: crate::Error::IdempotencyKeyReused

use cairn_ledger::{Media, ModelSpec, ToolChoice};
use serde::Serialize;

/// The longest key taken, in bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;

/// Why `key` is not a valid idempotency key (1 to [`MAX_IDEMPOTENCY_KEY_BYTES`] visible ASCII
/// characters, `!` to `~`: what fits an HTTP header as it is), or `None` when it is valid.
pub fn idempotency_key_problem(key: &str) -> Option<String> {
    if key.is_empty() {
        return Some("the idempotency key is empty".to_owned());
    }
    if key.len() > MAX_IDEMPOTENCY_KEY_BYTES {
        return Some(format!(
            "the idempotency key has {} bytes; at most {MAX_IDEMPOTENCY_KEY_BYTES} are taken",
            key.len()
        ));
    }
    if let Some((at, c)) = key.char_indices().find(|(_, c)| !matches!(c, '!'..='~')) {
        return Some(format!(
            "the idempotency key holds {c:?} at byte {at}; use visible ASCII characters (! to ~)"
        ));
    }
    None
}

/// A message's fingerprint: equal for the same text, model, media and tool choice. Kept in
/// memory only (folded again from the history), so it may change between versions.
pub fn message_fingerprint(
    text: &str,
    model: Option<&ModelSpec>,
    media: &[Media],
    tool_choice: Option<&ToolChoice>,
) -> u64 {
    #[derive(Serialize)]
    struct Fingerprinted<'a> {
        text: &'a str,
        model: Option<&'a ModelSpec>,
        media: &'a [Media],
        tool_choice: Option<&'a ToolChoice>,
    }
    let fingerprinted = Fingerprinted {
        text,
        model,
        media,
        tool_choice,
    };
    // Named fields: positional ones would let two specs that each skip a different unset
    // field (`max_tokens` set, or `thinking_budget_tokens` set, to the same number) encode
    // alike. Plain data with string keys: encoding cannot fail; were it to, every message
    // would share the empty encoding and a changed resend would pass as the same.
    let bytes = rmp_serde::to_vec_named(&fingerprinted).unwrap_or_default();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// A message sent under a key, as the session remembers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedMessage {
    /// The turn the message started.
    pub turn: u32,
    /// Its [`message_fingerprint`].
    pub fingerprint: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_visible_ascii_of_at_most_255_bytes() {
        assert_eq!(idempotency_key_problem("a"), None);
        assert_eq!(idempotency_key_problem(&"k".repeat(255)), None);
        assert_eq!(
            idempotency_key_problem("9f1c-4b2e_x:y/z=~!"),
            None,
            "any visible ASCII"
        );
        assert_eq!(
            idempotency_key_problem("").as_deref(),
            Some("the idempotency key is empty")
        );
        assert_eq!(
            idempotency_key_problem(&"k".repeat(256)).as_deref(),
            Some("the idempotency key has 256 bytes; at most 255 are taken")
        );
        assert_eq!(
            idempotency_key_problem("ab c").as_deref(),
            Some("the idempotency key holds ' ' at byte 2; use visible ASCII characters (! to ~)")
        );
        assert!(idempotency_key_problem("clé").is_some());
        assert!(idempotency_key_problem("a\nb").is_some());
    }

    #[test]
    fn a_fingerprint_changes_with_every_part_of_the_message() {
        let model = ModelSpec {
            provider: "scripted".into(),
            model: "m".into(),
            max_tokens: None,
            thinking_budget_tokens: None,
        };
        let capped = ModelSpec {
            max_tokens: Some(8),
            ..model.clone()
        };
        let thinking = ModelSpec {
            thinking_budget_tokens: Some(8),
            ..model.clone()
        };
        assert_ne!(
            message_fingerprint("hi", Some(&capped), &[], None),
            message_fingerprint("hi", Some(&thinking), &[], None)
        );
        let base = message_fingerprint("hi", None, &[], None);
        assert_eq!(base, message_fingerprint("hi", None, &[], None));
        assert_ne!(base, message_fingerprint("hi!", None, &[], None));
        assert_ne!(base, message_fingerprint("hi", Some(&model), &[], None));
        assert_ne!(
            base,
            message_fingerprint("hi", None, &[], Some(&ToolChoice::None))
        );
        let image = Media::url(cairn_ledger::MediaKind::Image, "https://example.com/a.png");
        assert_ne!(
            base,
            message_fingerprint("hi", None, std::slice::from_ref(&image), None)
        );
    }
}
