//! Messages sent under an idempotency key: a resend starts no second turn and is answered
//! as the first send was ([`crate::idempotency`] says what a key is and how a resend is told
//! from another message).

use super::Engine;
use crate::error::{Error, Result};
use crate::event::{Event, SessionStarted};
use crate::idempotency::{idempotency_key_problem, message_fingerprint};
use crate::wire::SendMessage;

impl Engine {
    /// Sends a user message under an idempotency key, starting the next turn; returns its
    /// number. When the session already holds a message sent under `key`, nothing is
    /// recorded: the same message gets that message's turn again, another message
    /// [`Error::IdempotencyKeyReused`]. A key that is not 1-255 visible ASCII characters is
    /// refused ([`Error::InvalidEvent`]) before anything is written, as are bad media.
    pub async fn send_idempotent(
        &self,
        session_id: &str,
        key: &str,
        message: &SendMessage,
    ) -> Result<u32> {
        check_key(session_id, key)?;
        let fingerprint = fingerprint(message);
        let mut turn = 0;
        self.submit(
            session_id,
            |state| {
                if let Some(sent) = state.keyed_message(key) {
                    if sent.fingerprint != fingerprint {
                        return Err(Error::IdempotencyKeyReused {
                            session_id: session_id.to_owned(),
                            key: key.to_owned(),
                            turn: sent.turn,
                        });
                    }
                    turn = sent.turn;
                    return Ok(None);
                }
                turn = state.turns_started + 1;
                Ok(Some(user_message(turn, message, key)))
            },
            Vec::new(),
        )
        .await?;
        Ok(turn)
    }

    /// Starts session `session_id` under an idempotency key, with its first message when
    /// given (one commit, the message holding the key); returns that message's turn (1).
    /// When the session exists already, a resend of the same start is answered as the first
    /// was, recording nothing: the same start (equal [`SessionStarted`]) and, with a message,
    /// a first message sent under `key` with the same content (without one, no message sent
    /// under `key`). Anything else is refused as a start of an existing session is
    /// ([`Error::InvalidEvent`]).
    pub async fn start_session_idempotent(
        &self,
        session_id: &str,
        started: SessionStarted,
        key: &str,
        message: Option<&SendMessage>,
    ) -> Result<Option<u32>> {
        crate::store::check_session_id(session_id)?;
        check_key(session_id, key)?;
        let mut inputs = vec![Event::SessionStarted(started.clone())];
        if let Some(message) = message {
            inputs.push(user_message(1, message, key));
        }
        let turn = message.map(|_| 1);
        let exists = match self
            .submit_inputs(
                session_id,
                |_| Ok(Some(inputs.clone())),
                Vec::new(),
                None,
                true,
                None,
            )
            .await
        {
            Ok(_) => return Ok(turn),
            Err(e @ Error::InvalidEvent { .. }) => e,
            Err(e) => return Err(e),
        };
        let Ok(state) = self.state(session_id).await else {
            return Err(exists);
        };
        let same_start = state.started.as_ref() == Some(&started);
        let same_message = match message {
            // Not the start of a session whose first message came under this key.
            None => state.keyed_message(key).is_none(),
            Some(message) => state
                .keyed_message(key)
                .is_some_and(|sent| sent.turn == 1 && sent.fingerprint == fingerprint(message)),
        };
        if same_start && same_message {
            Ok(turn)
        } else {
            Err(exists)
        }
    }
}

/// Refuses a key that is not one, naming the session.
fn check_key(session_id: &str, key: &str) -> Result<()> {
    match idempotency_key_problem(key) {
        None => Ok(()),
        Some(reason) => Err(Error::InvalidEvent {
            session_id: session_id.to_owned(),
            seq: 0,
            reason,
        }),
    }
}

fn fingerprint(message: &SendMessage) -> u64 {
    message_fingerprint(
        &message.text,
        message.model.as_ref(),
        &message.media,
        message.tool_choice.as_ref(),
    )
}

fn user_message(turn: u32, message: &SendMessage, key: &str) -> Event {
    Event::UserMessage {
        turn,
        text: message.text.clone(),
        model: message.model.clone(),
        media: message.media.clone(),
        tool_choice: message.tool_choice.clone(),
        idempotency_key: Some(key.to_owned()),
    }
}
