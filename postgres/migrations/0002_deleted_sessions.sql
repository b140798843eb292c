-- Deleted sessions (schema version 2): a deleted session keeps its cairn_sessions row, with the
-- status 'deleted' and no events, as its tombstone. Appends lock that row, so an append racing a
-- delete waits for it and then finds the tombstone; the id is never used again. Listings and
-- reads skip such rows.
ALTER TABLE cairn_sessions DROP CONSTRAINT IF EXISTS cairn_sessions_status_check;
ALTER TABLE cairn_sessions DROP CONSTRAINT IF EXISTS check_status;
ALTER TABLE cairn_sessions ADD CONSTRAINT cairn_sessions_status_check
    CHECK (status IN ('idle', 'running', 'cancelled', 'deleted'));
