//! The offline demo: a scripted model, two parallel tool calls, a streamed answer, on sled.

/// The demo's script (see `activities/SCRIPT.md` for the format).
pub const DEMO_SCRIPT: &str = include_str!("../activities/scripts/demo.json");

/// The file the demo's `read_file` call reads.
pub const DEMO_NOTES: &str = "cairn demo notes: the launch is on Tuesday.\n";

/// The demo's prompt.
pub const DEMO_PROMPT: &str =
    "What is (17 + 25) * 3, and what does notes.txt say about the launch?";
