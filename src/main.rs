//! The `cairn` command line: run the offline demo, run turns, inspect and replay histories.

// Printing goes through `cli::out`: a closed pipe must not panic.
#![deny(clippy::print_stdout, clippy::print_stderr)]

mod allocator;
mod cli;

#[global_allocator]
static ALLOCATOR: allocator::Allocator = allocator::Allocator {};

use anyhow::{bail, Context};
use cairn::demo::{DEMO_NOTES, DEMO_PROMPT, DEMO_SCRIPT};
use cairn::host::Host;
use cairn_activities::providers::{render_request, RequestFormat};
use cairn_activities::{CallContext, ModelRequest, ScriptedProvider};
use cairn_ledger::ModelSpec;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::{
    interrupted_output, replay, Error as RuntimeError, Event, SessionOptions, StreamedOutput,
    TurnOutcome,
};
use clap::{Parser, Subcommand};
use cli::out::{note, out, outln, showln};
use cli::{Access, StoreDir, Target};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod bench;
mod footprint;
mod serve;

#[derive(Parser)]
#[command(
    name = "cairn",
    version,
    about = "A durable-workflow runtime for LLM agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once per process; boxing `Run`'s flattened flag groups would buy nothing measurable.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Run a complete offline session (scripted model, two parallel tool calls) in a
    /// temporary store, removed at the end; with --keep in the default store, or in the store
    /// --data names, where the session stays to inspect.
    Demo {
        #[arg(long, value_name = "DIR", help = cli::DATA_HELP)]
        data: Option<PathBuf>,
        /// Storage engine of a new store: fjall (default) or sled.
        #[arg(long, value_parser = parse_engine)]
        engine: Option<StorageEngine>,
        /// Keep the demo's session: run it in the default store (or --data's) instead of a
        /// temporary one.
        #[arg(long)]
        keep: bool,
    },
    /// Start (or continue) a session and run one turn.
    Run {
        /// The store directory, created if missing (default: the server of --server or
        /// $CAIRN_SERVER when given, else $CAIRN_DATA, else $XDG_DATA_HOME/cairn, else
        /// ~/.local/share/cairn).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Storage engine of a new store: fjall (default) or sled; an existing store must
        /// match.
        #[arg(long, value_parser = parse_engine)]
        engine: Option<StorageEngine>,
        /// The model, as PROVIDER:MODEL, e.g. scripted:script.json.
        #[arg(long)]
        model: String,
        /// Continue this session, or start it with this id.
        #[arg(long)]
        session: Option<String>,
        /// A system prompt for a new session (refused for an existing one: it is fixed when
        /// the session starts).
        #[arg(long)]
        system: Option<String>,
        /// Model calls per turn at most, for a new session (default 16; refused for an
        /// existing one: it is fixed when the session starts).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        max_rounds: Option<u32>,
        /// The directory read_file may read (default: the current directory).
        #[arg(long)]
        workdir: Option<PathBuf>,
        /// Do not print thinking while it streams.
        #[arg(long)]
        hide_thinking: bool,
        /// Output token limit of each model call (default: the provider's).
        #[arg(long)]
        max_tokens: Option<u32>,
        /// Enable extended thinking with this token budget (Anthropic and Bedrock need it
        /// below --max-tokens; OpenAI Responses maps it to a reasoning effort).
        #[arg(long)]
        thinking_budget: Option<u32>,
        /// Tools and tool policy of a new session (refused for an existing one).
        #[command(flatten)]
        policy: cli::approvals::PolicyArgs,
        /// Budgets of a new session, and the price table.
        #[command(flatten)]
        budget: Box<cli::budget::BudgetArgs>,
        /// Compaction policy of a new session (refused for an existing one).
        #[command(flatten)]
        compaction: cli::compaction::CompactionArgs,
        /// Tool choice, server tools and prompt caching.
        #[command(flatten)]
        call_options: cli::call_options::CallOptionArgs,
        /// Print nothing while the turn runs, then its outcome as one JSON object.
        #[arg(long)]
        json: bool,
        /// Host the tools of the MCP servers in this JSON file (README, "MCP tools"); a new
        /// session offers them too.
        #[arg(long, value_name = "FILE")]
        mcp_config: Option<PathBuf>,
        /// Send this image or document with the message (repeatable, in order; they go ahead
        /// of the text): a file whose name ends in .png, .jpg, .jpeg, .gif, .webp, .pdf or
        /// .txt, or an http(s) URL ending so. Checked before anything is written.
        #[arg(long, value_name = "FILE|URL")]
        attach: Vec<String>,
        /// The user message (`-`: read it from standard input).
        prompt: String,
    },
    /// Chat in the terminal: each line read is one turn of a session, shown as it runs;
    /// /exit or the end of input ends the chat (the session stays).
    Chat {
        /// The store directory, created if missing (default: $CAIRN_DATA, else
        /// $XDG_DATA_HOME/cairn, else ~/.local/share/cairn).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
        /// Storage engine of a new store: fjall (default) or sled.
        #[arg(long, value_parser = parse_engine)]
        engine: Option<StorageEngine>,
        /// The model, as PROVIDER:MODEL, e.g. scripted:script.json.
        #[arg(long)]
        model: String,
        /// Continue this session, or start it with this id.
        #[arg(long)]
        session: Option<String>,
        /// A system prompt for a new session.
        #[arg(long)]
        system: Option<String>,
        /// The directory a new session's tools work in (default: the current directory).
        #[arg(long)]
        workdir: Option<PathBuf>,
        /// Do not print thinking while it streams.
        #[arg(long)]
        hide_thinking: bool,
    },
    /// List sessions: id, status, model, turns, last activity, usage.
    Sessions {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        #[command(flatten)]
        filter: cli::sessions::SessionFilter,
    },
    /// Describe a session: status, model, working directory, turns with their outcomes,
    /// usage, pending tasks and approvals.
    Describe {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script: `cairn completions bash > ~/.local/share/bash-completion/completions/cairn`.
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Print a session's events, one per line.
    History {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// One JSON object per event (the documented form).
        #[arg(long)]
        json: bool,
    },
    /// Print a session's transcript (the ledger) as canonical JSON.
    Transcript {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// Print instead the exact request body this provider would be sent next:
        /// anthropic, openai-chat, openai-responses or bedrock.
        #[arg(long = "as", value_name = "FORMAT")]
        format: Option<String>,
        /// The model name to render with (default: the session's model).
        #[arg(long)]
        model: Option<String>,
    },
    /// Re-fold a history with this code and check determinism (exit 1 on divergence).
    Replay {
        #[arg(long, value_name = "DIR", help = cli::DATA_HELP)]
        data: Option<PathBuf>,
        /// Session id.
        #[arg(required_unless_present = "dir")]
        session: Option<String>,
        /// Instead of a stored session, replay every export (`*.jsonl`) in this folder with
        /// the current code, naming the first divergence of each (exit 1 if any diverges).
        #[arg(long, value_name = "EXPORTS", conflicts_with_all = ["data", "trace"])]
        dir: Option<PathBuf>,
        /// Print every event with the commands the current code decides on it.
        #[arg(long)]
        trace: bool,
        /// One JSON object: whether it replays, and the divergence if not.
        #[arg(long, conflicts_with_all = ["trace", "dir"])]
        json: bool,
    },
    /// Print a session as it was right after one event: status, usage, pending tasks, open
    /// tool calls and the transcript.
    Show {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// The event (default: the last).
        #[arg(long, value_name = "SEQ")]
        at: Option<u64>,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write a session's history as a file (JSON lines: a header, then `history --json`'s
    /// lines) that `cairn import` reads.
    Export {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// The file to write (default: stdout).
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Start a new session whose history is a session's prefix up to an event (cut where
    /// no decision is half recorded), going on from there: the prefix's model and tool calls
    /// are not run again. The fork records its parent and seq.
    Fork {
        #[arg(long, value_name = "DIR", help = cli::DATA_HELP)]
        data: Option<PathBuf>,
        /// The session to fork.
        session: String,
        /// The last event to copy.
        #[arg(long, value_name = "SEQ")]
        at: u64,
        /// The fork's id (default: generated).
        #[arg(long, value_name = "ID")]
        id: Option<String>,
        /// Another default model, PROVIDER:MODEL (the running turn's too, when the fork is
        /// cut inside one, unless that would switch a tool loop to another provider).
        #[arg(long, value_name = "PROVIDER:MODEL")]
        model: Option<String>,
        /// Another system prompt.
        #[arg(long, value_name = "TEXT")]
        system: Option<String>,
    },
    /// A semantic diff of two sessions: where their histories part, their transcripts'
    /// differences by message and part, and their usage.
    Diff {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session A.
        a: String,
        /// Session B.
        b: String,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Make a session in a store from a `cairn export` file; an interrupted turn resumes
    /// with `cairn resume`. A file that is damaged or out of order is refused, naming the
    /// line, and nothing is written.
    Import {
        #[arg(long, value_name = "DIR", help = cli::DATA_HELP)]
        data: Option<PathBuf>,
        /// The export file.
        file: PathBuf,
    },
    /// Cancel a session (or only its running turn): open tool calls get error results.
    Cancel {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// Cancel only the running turn; the session takes further turns.
        #[arg(long)]
        turn: bool,
        /// Why, recorded in the history.
        #[arg(long, default_value = "cancelled from the command line")]
        reason: String,
    },
    /// Delete a finished session: its history, record and tasks go, atomically and durably,
    /// and its id is never used again. Asks first on a terminal; elsewhere needs --yes.
    Delete {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// Delete without asking.
        #[arg(long, short = 'y')]
        yes: bool,
        /// One JSON object: the session, `deleted` and its event count.
        #[arg(long)]
        json: bool,
    },
    /// Compact a session's transcript now, between turns, with its compaction policy (or
    /// the default one); recorded in its history.
    Compact {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
    },
    /// Approve a tool call the session's policy parked: it runs (by the process that holds
    /// the session's store, or the next `cairn resume`).
    Approve {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// The tool_use id of the parked call (`cairn show` lists them).
        tool_use_id: String,
    },
    /// Deny a tool call the session's policy parked: the model gets an error result carrying
    /// the reason.
    Deny {
        #[arg(long, value_name = "DIR", help = cli::SESSION_DATA_HELP)]
        data: Option<PathBuf>,
        #[command(flatten)]
        server: cli::ServerArgs,
        /// Session id.
        session: String,
        /// The tool_use id of the parked call.
        tool_use_id: String,
        /// Why; the model reads it.
        #[arg(long, default_value = "denied from the command line")]
        reason: String,
    },
    /// Benchmark durable turns: embedded, and through `cairn server` processes with worker
    /// processes, over an embedded store or a PostgreSQL database.
    ///
    /// Above the figures, a line names the machine they were measured on: its CPUs, the
    /// kernel, the file system the stores are made on (mount options, the disk's I/O
    /// scheduler, hardware queues and the CPUs their completion interrupts go to) and the
    /// CPU idle driver, with a KVM guest's halt polling.
    Bench {
        /// Sessions in flight (a closed loop of clients, a fresh session per turn); repeat
        /// or separate with commas for several measurements.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 16, 128])]
        sessions: Vec<usize>,
        /// Worker process counts to measure through a server (none by default: the embedded
        /// rows only).
        #[arg(long, value_delimiter = ',')]
        workers: Vec<usize>,
        /// Server process counts to measure, the worker processes split across them round
        /// robin and the clients spread over all; more than one needs --store.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1usize])]
        servers: Vec<usize>,
        /// Serve from PostgreSQL: each measurement through servers creates a new database on
        /// the server of this URL (postgres://USER@HOST:PORT/DATABASE; any database there
        /// names the server) and drops it afterwards.
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// The scripted model's latency per call.
        #[arg(long, default_value_t = 0)]
        model_latency_ms: u64,
        /// Seconds per measurement (after a warm-up of a tenth of it).
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Measure only through a server.
        #[arg(long)]
        no_embedded: bool,
        /// Activities each worker process runs at once.
        #[arg(long, default_value_t = 16)]
        worker_concurrency: usize,
        /// Storage engines of the embedded stores, each measured: fjall, sled (default: both).
        #[arg(long, value_delimiter = ',', value_parser = parse_engine)]
        engine: Vec<StorageEngine>,
        /// Instead of turns per second: the bytes of one long session (raw messages,
        /// transcript, history by event kind, disk) on each engine.
        #[arg(long, conflicts_with_all = ["parked", "goals", "stages"])]
        footprint: bool,
        /// Instead: every goal of issue 13 measured on each engine in one run (turns/s at 128
        /// sessions, one session's latency, one state transition, replay, parked sessions,
        /// history and disk bytes), one row each with its target and whether it is met.
        #[arg(long)]
        goals: bool,
        /// Turns of the --footprint session, or of the long session --goals measures
        /// [default: 1000].
        #[arg(long)]
        turns: Option<usize>,
        /// Instead: park this many sessions (one turn each) per engine and report the RSS
        /// (with --goals: the sessions the memory goal parks [default: 100000]).
        #[arg(long, value_name = "N")]
        parked: Option<usize>,
        /// Instead: where one session's turn spends its time on each engine, step by step
        /// between the marks on its path (the store's syncs, encoding, the writer, the
        /// workflow, the activity, handing tasks), one table per engine, then the steps the
        /// slowest 1% of its turns spend more time on than the average turn.
        #[arg(long, conflicts_with_all = ["parked", "goals", "workers", "store", "no_embedded"])]
        stages: bool,
    },
    /// Chaos test: a child process runs many sessions and is killed with SIGKILL at random
    /// moments, a new one resumes each time; then every promise of the log is checked and the
    /// figures printed (exit 1 when a check fails).
    Chaos {
        /// SIGKILLs to deliver before the final run.
        #[arg(long, default_value_t = 100)]
        kills: usize,
        /// Concurrent sessions.
        #[arg(long, default_value_t = 20)]
        sessions: usize,
        /// Turns per session (more are added if the work ends before the kills do).
        #[arg(long, default_value_t = 60)]
        turns: usize,
        /// Seed of the kill moments and the script (default: random, printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Kill most children between this many milliseconds after they are ready (opened the
        /// store and resumed; one in five is killed during that instead)...
        #[arg(long, default_value_t = 10)]
        kill_min_ms: u64,
        /// ...and this many.
        #[arg(long, default_value_t = 150)]
        kill_max_ms: u64,
        /// Then SIGKILL this many children 0-50 ms after they start (opening the store,
        /// recovering, resuming), checking the store after each.
        #[arg(long, default_value_t = 0)]
        startup_kills: usize,
        /// Then cut the power of this many children (unsynced writes lost, needs `cc`),
        /// checking the store after each.
        #[arg(long, default_value_t = 0)]
        power_cuts: usize,
        /// Storage engine of the children's store: fjall (default) or sled.
        #[arg(long, value_parser = parse_engine, default_value = "fjall")]
        engine: StorageEngine,
        /// Run the activities in this many worker processes (over HTTP, 1.5 s leases) beside
        /// a child that serves the /v1 API instead of running a pool; each kill then falls
        /// on the child or on a worker (restarted at once). 0: the child runs its own pool.
        /// Not with --startup-kills or --power-cuts.
        #[arg(long, default_value_t = 0)]
        remote_workers: usize,
        /// Data directory, kept (default: a new temporary directory, removed after a run
        /// whose checks pass unless --keep).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Keep the temporary data directory after a run whose checks pass (a failed run's is
        /// always kept, to inspect).
        #[arg(long)]
        keep: bool,
    },
    /// Trains a zstd dictionary for the record codec's compressed bodies from the golden
    /// sessions and writes it to --out (how dictionary 1 was made, byte for byte; a shipped
    /// dictionary never changes, a new one gets a new codec id).
    #[command(hide = true)]
    TrainDictionary {
        /// Where to write the dictionary.
        #[arg(long)]
        out: PathBuf,
        /// The golden files (default: the tests/golden/ this binary was built from).
        #[arg(long)]
        golden: Option<PathBuf>,
        /// Turns of a footprint session also sampled (experiments only: dictionary 1 was
        /// trained without one); 0 leaves it out.
        #[arg(long, default_value_t = 0)]
        turns: usize,
        /// Also try the dictionary on a new footprint session of this many turns and print
        /// its records' bytes as a multiple of its raw message bytes.
        #[arg(long, value_name = "TURNS")]
        evaluate: Option<usize>,
    },
    /// The process `cairn chaos` starts and kills.
    #[command(hide = true)]
    ChaosChild {
        /// Data directory.
        #[arg(long)]
        data: PathBuf,
        /// Sessions.
        #[arg(long)]
        sessions: usize,
        /// Turns per session.
        #[arg(long)]
        turns: usize,
        /// The store engine.
        #[arg(long, default_value = "fjall")]
        store: cairn_devtools::chaos::StoreEngine,
        /// Serve the /v1 API on this loopback port for remote workers instead of running a
        /// pool.
        #[arg(long)]
        serve: Option<u16>,
        /// With --serve: attempts at most of each activity of the sessions it creates.
        #[arg(long, default_value_t = 100)]
        max_attempts: u32,
    },
    /// A worker process of `cairn chaos --remote-workers`: runs the chaos sessions' model and
    /// tool calls for the server at --server until its stdin closes.
    #[command(hide = true)]
    ChaosWorker {
        /// The server, http://HOST:PORT.
        #[arg(long)]
        server: String,
        /// Data directory (the side-effect file).
        #[arg(long)]
        data: PathBuf,
        /// Lease length in ms.
        #[arg(long)]
        lease_ms: u64,
    },
    /// Check a store: every record decodes, histories are complete and replay, queued tasks
    /// match their sessions (exit 0 when clean, 1 on any problem).
    Fsck {
        #[arg(long, value_name = "DIR", help = cli::DATA_HELP)]
        data: Option<PathBuf>,
        /// Make a damaged store usable again: set aside leftovers, write back a damaged sled
        /// `conf`, and accept acknowledged events the storage engine lost. Copies what it
        /// changes into `set-aside/` first. Without it, fsck changes nothing.
        #[arg(long)]
        repair: bool,
        /// One JSON object: the counts and every problem.
        #[arg(long)]
        json: bool,
    },
    /// Copy every session of a store directory (histories, statuses, queued tasks) into a
    /// database that several servers can share; the directory is read, never changed. The
    /// database must hold none of the sessions.
    Migrate {
        /// The store directory to copy from.
        #[arg(long, value_name = "DIR")]
        from: PathBuf,
        /// The database to copy into, e.g. postgres://USER@HOST:PORT/DATABASE.
        #[arg(long, value_name = "URL")]
        to: String,
    },
    /// Run a server's model and tool calls in this process (providers configured from this
    /// process's environment; API keys are never sent) until SIGTERM or SIGINT, then drain.
    Worker {
        #[command(flatten)]
        server: cli::ServerArgs,
        /// A task queue to serve; repeat for several (default: the `default` queue, where
        /// sessions put their tasks unless they name queues).
        #[arg(long = "queue", value_name = "NAME")]
        queues: Vec<String>,
        /// Activities run at once at most (as an embedded pool's default: they mostly wait on
        /// the network, and a slot is a task, not a thread).
        #[arg(long, default_value_t = cairn_workers::DEFAULT_CONCURRENCY)]
        concurrency: usize,
        /// The directory read_file may read (default: the current directory).
        #[arg(long)]
        workdir: Option<PathBuf>,
        /// Host only these built-in tools (comma-separated; default: all of them). The server
        /// never gives this worker a call of a tool it does not host.
        #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
        tools: Option<Vec<String>>,
        /// Host the tools of the MCP servers in this JSON file too (README, "MCP tools").
        #[arg(long, value_name = "FILE")]
        mcp_config: Option<PathBuf>,
        /// Lease length in ms: a task this worker holds runs again elsewhere (as a new,
        /// timed-out attempt) this long after the worker stops renewing it.
        #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..))]
        lease_ms: u64,
    },
    /// Serve the `/v1` HTTP API: this process owns the store and runs the engine; clients and
    /// workers connect over HTTP. Drains and exits 0 on SIGTERM or SIGINT.
    Server {
        /// The store directory, created if missing (default: $CAIRN_DATA, else
        /// $XDG_DATA_HOME/cairn, else ~/.local/share/cairn; $DATABASE_URL, when set, is used
        /// before the default directory).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
        /// A database store several servers may share, e.g.
        /// postgres://USER@HOST:PORT/DATABASE (its schema is created or upgraded on start).
        #[arg(long, value_name = "URL", env = "CAIRN_STORE", hide_env_values = true)]
        store: Option<String>,
        #[command(flatten)]
        pool: cli::database::PoolArgs,
        /// Address to listen on, e.g. 127.0.0.1:8080 (port 0: any free port, printed).
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// Bearer tokens: {"tokens": [{"token", "namespace", "role": "client"|"worker"}]}.
        /// Without it, only loopback addresses are served and every request acts for
        /// namespace `default` with both roles.
        #[arg(long)]
        tokens: Option<PathBuf>,
        /// Storage engine of a new store: fjall (default) or sled; an existing store must
        /// match.
        #[arg(long, value_parser = parse_engine)]
        engine: Option<StorageEngine>,
        /// Run this many activities at once in this process (workers for the tools and model
        /// providers built in); 0: only remote workers run tasks.
        #[arg(long, default_value_t = 0)]
        local_workers: usize,
        /// The directory the in-process workers' read_file may read (default: the current
        /// directory).
        #[arg(long)]
        workdir: Option<PathBuf>,
        /// Long polls (waiting for a turn, leasing) answer after at most this many ms.
        #[arg(long, default_value_t = 300_000)]
        max_poll_ms: u64,
        /// The price table (JSON; see the README) that prices each model call as it is
        /// recorded, instead of `CAIRN_PRICES` or the built-in one.
        #[arg(long, value_name = "FILE")]
        prices: Option<PathBuf>,
        /// Session states kept in memory before parked ones are dropped, least recently
        /// used first (a dropped state is read and folded again from its history when its
        /// session next steps).
        #[arg(long, value_name = "N", default_value_t = cairn_runtime::engine::CACHE_CAPACITY as u64,
              value_parser = clap::value_parser!(u64).range(1..))]
        cache_sessions: u64,
        /// MiB the cached session states may hold before parked ones are dropped, least
        /// recently used first.
        #[arg(long, value_name = "MIB", default_value_t = (cairn_runtime::engine::CACHE_BYTES >> 20) as u64)]
        cache_mib: u64,
        /// Event streams (`GET /v1/sessions/{id}/events`) open at once, at most; one more is
        /// answered 503. Each keeps its session's state in memory, beyond the cache's bounds.
        #[arg(long, value_name = "N", default_value_t = cairn_server::DEFAULT_MAX_STREAMS)]
        max_streams: usize,
        /// Request bodies larger than this are refused with 413 (a message with its media, a
        /// worker's report with its activity's result).
        #[arg(long, value_name = "BYTES", default_value_t = cairn_server::DEFAULT_BODY_LIMIT_BYTES,
              value_parser = clap::value_parser!(u64).range(1024..))]
        max_body_bytes: u64,
    },
    /// Continue every session whose turn was interrupted.
    Resume {
        #[arg(long, value_name = "DIR", help = cli::DATA_HELP)]
        data: Option<PathBuf>,
        /// The directory read_file may read (default: the current directory).
        #[arg(long)]
        workdir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal, never into a pipe or a log file.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = parse_cli();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            note!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        // The reader of our output went away (`cairn history | head`): nothing to say.
        Err(e) if cli::out::is_stdout_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}`: the whole chain of causes, each in words, on one line.
            note!("error: {e:#}");
            ExitCode::from(cli::exit_codes::of_error(&e))
        }
    }
}

/// The command line, with `--help` saying where the default store is on this machine.
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let here = match cli::default_data_dir() {
        Ok(dir) => format!("here: {}", dir.display()),
        Err(e) => format!("here: none, {e:#}"),
    };
    let command = Cli::command().after_help(format!(
        "The store: commands that open one take its directory as --data DIR. Without --data \
         they use the default data directory: {} ({here}). The session commands (run, \
         sessions, history, transcript, cancel) act through a cairn server instead when given \
         --server URL, or $CAIRN_SERVER and no --data.",
        cli::DEFAULT_DATA_RULE
    ));
    let mut matches = command.get_matches();
    Cli::from_arg_matches_mut(&mut matches).unwrap_or_else(|e| e.exit())
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Demo { data, engine, keep } => demo(data, engine, keep).await,
        Command::Run {
            data,
            server,
            engine,
            model,
            session,
            system,
            max_rounds,
            workdir,
            hide_thinking,
            max_tokens,
            thinking_budget,
            policy,
            budget,
            compaction,
            call_options,
            json,
            mcp_config,
            attach,
            prompt,
        } => {
            let prompt = cli::turn::read_prompt(prompt)?;
            // Everything that can be checked is checked before anything is written.
            let media = cli::attach::load(&attach)?;
            let prices = budget.price_table()?;
            if prompt.trim().is_empty() && media.is_empty() {
                cli::exit_codes::usage_bail!(
                    "the prompt is empty: give the message to send as the last argument"
                );
            }
            let model = ModelSpec {
                max_tokens,
                thinking_budget_tokens: thinking_budget,
                ..parse_model(&model)?
            };
            let workdir_given = workdir.clone();
            let workdir = workdir_or_cwd(workdir)?;
            let target = Target::resolve(data, &server)?;
            // A store opened here runs the model from this process: its configuration must be
            // here. (A store held by another process is run by that one, through its socket.)
            if let Target::Store(store) = &target {
                if embedded::detect(&store.path)?.is_none() {
                    check_provider(&model)?;
                }
            }
            let mcp = cli::mcp::connect(mcp_config.as_deref()).await?;
            let mcp_tools = mcp.as_ref().map(|m| m.specs()).unwrap_or_default();
            let access = Access::open(target, OpenMode::Create, engine, workdir.clone()).await?;
            let (mut host, data) = match access {
                Access::Local { mut host, data } => {
                    host.tools = cli::mcp::with_tools(&host.tools, mcp.as_ref());
                    (*host, data)
                }
                Access::Remote(remote) => {
                    let request = cli::remote::RunRequest {
                        model,
                        session,
                        system,
                        max_rounds,
                        prompt,
                        media,
                        show_thinking: !hide_thinking,
                        policy,
                        budget: *budget,
                        compaction,
                        call_options,
                        extra_tools: mcp_tools,
                        json,
                    };
                    return Ok(outcome_code(&remote.run(request).await?));
                }
            };
            check_provider(&model)?;
            host.engine.set_prices(prices);
            // An existing session's turn takes --tool-choice for itself.
            let mut turn_tool_choice = None;
            let session_id = match session {
                Some(id) if session_exists(&host, &id).await? => {
                    refuse_start_options(&id, &system, max_rounds)?;
                    refuse_policy_options(&id, &policy)?;
                    budget.refuse_for_existing(&id)?;
                    compaction.refuse_for_existing(&id)?;
                    call_options.refuse_for_existing(&id)?;
                    turn_tool_choice = call_options.tool_choice.clone();
                    let state = host.engine.state(&id).await?;
                    cli::workdir::refuse_other(&state, workdir_given.as_deref())?;
                    note!("session {id}");
                    id
                }
                requested => {
                    let tools = policy.offered_tools(&mcp_tools);
                    let tool_policy = policy.session_policy(&tools)?;
                    let mut options = SessionOptions::new(model.clone(), tools);
                    options.tool_policy = tool_policy;
                    options.compaction = compaction.session_policy()?;
                    options.call_options = call_options.session_options();
                    options.session_id = requested;
                    options.system_prompt = system;
                    options.workdir = Some(cli::workdir::to_record(&workdir)?);
                    if let Some(max_rounds) = max_rounds {
                        options.limits.max_rounds = max_rounds;
                    }
                    budget.apply(&mut options.limits);
                    let id = host.client.start_session(options).await?;
                    note!("new session {id}");
                    id
                }
            };
            // Only this session's work runs here: an interrupted turn of it is carried on
            // first, other sessions' are left for `cairn resume`.
            if host.engine.state(&session_id).await?.is_running() {
                continue_interrupted(&mut host, &data, &session_id, !hide_thinking, json).await?;
            } else {
                host.start_for(&session_id).await?;
            }
            let state = host.engine.state(&session_id).await?;
            let turn_model = match &state.started {
                Some(s) if s.model != model => Some(model),
                _ => None,
            };
            let mut watch = watch(&host, &session_id, !hide_thinking);
            watch.quiet = json;
            let outcome = watch
                .send_with(&prompt, turn_model, media, turn_tool_choice)
                .await?;
            cli::turn::report(&session_id, &outcome, json)?;
            host.shutdown().await;
            Ok(outcome_code(&outcome))
        }
        Command::Sessions {
            data,
            server,
            filter,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            cli::sessions::list(access.client(), &filter).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Describe {
            data,
            server,
            session,
            json,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            let described = cli::describe::read(access.client(), &session).await?;
            cli::describe::print(&described, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Chat {
            data,
            engine,
            model,
            session,
            system,
            workdir,
            hide_thinking,
        } => {
            let model = parse_model(&model)?;
            check_provider(&model)?;
            cli::chat::run(cli::chat::ChatRequest {
                data: StoreDir::resolve(data)?.path,
                engine,
                model,
                session,
                system,
                workdir: workdir_or_cwd(workdir)?,
                show_thinking: !hide_thinking,
            })
            .await
        }
        Command::Completions { shell } => cli::completions::print::<Cli>(shell),
        Command::History {
            data,
            server,
            session,
            json,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            let events = access.client().history(&session).await?;
            let first_ms = events.first().map_or(0, |e| e.recorded_at_ms);
            for e in &events {
                if json {
                    outln!("{}", serde_json::to_string(e)?)?;
                } else {
                    let elapsed = e.recorded_at_ms.saturating_sub(first_ms);
                    outln!(
                        "{:>5}  +{:>4}.{:03}s  {:<22} {}",
                        e.seq,
                        elapsed / 1000,
                        elapsed % 1000,
                        e.kind,
                        summarize(&e.event)
                    )?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Transcript {
            data,
            server,
            session,
            format,
            model,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            let Some(format) = format else {
                let transcript = access.client().transcript(&session).await?;
                outln!("{}", String::from_utf8_lossy(&transcript.canonical_json()))?;
                return Ok(ExitCode::SUCCESS);
            };
            let state = access.state(&session).await?;
            let format = RequestFormat::parse(&format)?;
            let Some(started) = &state.started else {
                bail!("session {session} has not started");
            };
            let mut spec = state
                .active
                .as_ref()
                .map_or_else(|| started.model.clone(), |a| a.model.clone());
            if let Some(model) = model {
                spec.model = model;
            }
            let request = ModelRequest {
                context: CallContext {
                    session_id: session.clone(),
                    turn: state.turns_started,
                    round: state.active.as_ref().map_or(0, |a| a.round),
                    attempt: 1,
                },
                model: spec,
                transcript: state.transcript.clone(),
                tools: started.tools.clone(),
                options: state.active.as_ref().map_or_else(
                    || started.call_options.for_call(None, 0),
                    |a| {
                        started
                            .call_options
                            .for_call(a.tool_choice.as_ref(), a.round)
                    },
                ),
            };
            let body = render_request(format, &request)?;
            outln!("{}", serde_json::to_string_pretty(&body)?)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Replay {
            data,
            session,
            dir,
            trace,
            json,
        } => {
            let Some(session) = session else {
                let dir = dir.context("replay needs a SESSION or --dir")?;
                return cli::history_files::check_exports(&dir);
            };
            let store = StoreDir::resolve(data)?;
            store.check_exists()?;
            let host =
                Host::open(&store.path, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            let events = host.client.history(&session).await?;
            if trace {
                return cli::history_files::print_trace(&session, &events);
            }
            if json {
                return cli::reports::replay_json(&session, &events);
            }
            match replay(&session, &events) {
                Ok(replayed) => {
                    let bytes = replayed.state.transcript.canonical_json();
                    outln!(
                        "ok: {} events of session {session} replay deterministically ({} commands, ledger {} bytes)",
                        events.len(),
                        replayed.commands.len(),
                        bytes.len()
                    )?;
                    Ok(ExitCode::SUCCESS)
                }
                Err(
                    e @ (RuntimeError::Nondeterminism { .. }
                    | RuntimeError::InvalidEvent { .. }
                    | RuntimeError::StaleReport { .. }),
                ) => {
                    outln!("divergence: {e}")?;
                    Ok(ExitCode::from(cli::exit_codes::CHECK_FAILED))
                }
                Err(e) => Err(e.into()),
            }
        }
        Command::Show {
            data,
            server,
            session,
            at,
            json,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            let events = access.client().history(&session).await?;
            cli::history_files::show(&session, &events, at, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Export {
            data,
            server,
            session,
            output,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            let events = access.client().history(&session).await?;
            cli::history_files::export(&session, &events, output.as_deref())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Fork {
            data,
            session,
            at,
            id,
            model,
            system,
        } => {
            let store = StoreDir::resolve(data)?;
            store.check_exists()?;
            let model = model.as_deref().map(parse_model).transpose()?;
            let request = cairn_runtime::fork::ForkRequest {
                session_id: id.unwrap_or_else(|| {
                    cairn_runtime::fork::default_fork_id(
                        &session,
                        at,
                        cairn_runtime::Clock::now_ms(&cairn_runtime::SystemClock),
                    )
                }),
                parent: session,
                at_seq: at,
                model,
                system_prompt: system,
            };
            cli::history_files::fork(&store.path, &request).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Diff {
            data,
            server,
            a,
            b,
            json,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::ReadOnly, None, PathBuf::from(".")).await?;
            let events_a = access.client().history(&a).await?;
            let events_b = access.client().history(&b).await?;
            cli::history_files::diff((&a, &events_a), (&b, &events_b), json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Import { data, file } => {
            cli::history_files::import(&StoreDir::resolve(data)?.path, &file).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Cancel {
            data,
            server,
            session,
            turn,
            reason,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::Existing, None, PathBuf::from(".")).await?;
            if turn {
                let cancelled = access.client().cancel_turn(&session, &reason).await?;
                outln!("cancelled turn {cancelled} of session {session}")?;
            } else {
                access.client().cancel(&session, &reason).await?;
                outln!("cancelled session {session}")?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Delete {
            data,
            server,
            session,
            yes,
            json,
        } => {
            cli::delete::check_confirmable(&session, yes)?;
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::Existing, None, PathBuf::from(".")).await?;
            cli::delete::run(access.client(), &session, yes, json).await
        }
        Command::Compact {
            data,
            server,
            session,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::Existing, None, PathBuf::from(".")).await?;
            let outcome = access.client().compact(&session).await?;
            outln!("{}", cli::compaction::describe(&session, &outcome))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Approve {
            data,
            server,
            session,
            tool_use_id,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::Existing, None, PathBuf::from(".")).await?;
            access.client().approve(&session, &tool_use_id).await?;
            outln!("approved {tool_use_id} of session {session}")?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Deny {
            data,
            server,
            session,
            tool_use_id,
            reason,
        } => {
            let target = Target::resolve(data, &server)?;
            let access = Access::open(target, OpenMode::Existing, None, PathBuf::from(".")).await?;
            access
                .client()
                .deny(&session, &tool_use_id, &reason)
                .await?;
            outln!("denied {tool_use_id} of session {session}")?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            sessions,
            workers,
            servers,
            store,
            model_latency_ms,
            seconds,
            no_embedded,
            worker_concurrency,
            engine,
            footprint,
            goals,
            turns,
            parked,
            stages,
        } => {
            let engines = if engine.is_empty() {
                StorageEngine::ALL.to_vec()
            } else {
                engine
            };
            if turns.is_some() && !footprint && !goals {
                bail!("--turns goes with --footprint or --goals");
            }
            let turns = turns.unwrap_or(1000);
            if footprint {
                return footprint::run(turns, &engines).await;
            }
            if stages {
                return bench::stages::run(seconds, &engines).await;
            }
            let exe = std::env::current_exe().context("cannot find the cairn executable")?;
            if goals {
                return bench::goals::run(
                    bench::goals::GoalsArgs {
                        seconds,
                        turns,
                        parked: parked.unwrap_or(cairn_devtools::goals::PARKED_SESSIONS),
                        engines,
                    },
                    &exe,
                )
                .await;
            }
            bench::run(
                bench::BenchArgs {
                    sessions,
                    workers,
                    servers,
                    store,
                    model_latency_ms,
                    seconds,
                    no_embedded,
                    worker_concurrency,
                    parked,
                    engines,
                },
                &exe,
            )
            .await
        }
        Command::Chaos {
            kills,
            sessions,
            turns,
            seed,
            kill_min_ms,
            kill_max_ms,
            startup_kills,
            power_cuts,
            engine,
            remote_workers,
            data,
            keep,
        } => {
            chaos(ChaosArgs {
                kills,
                sessions,
                turns,
                seed,
                kill_after_ms: (kill_min_ms, kill_max_ms),
                startup_kills,
                power_cuts,
                engine,
                remote_workers,
                data,
                keep,
            })
            .await
        }
        Command::TrainDictionary {
            out,
            golden,
            turns,
            evaluate,
        } => {
            use cairn_devtools::dictionary;
            let golden = golden.unwrap_or_else(dictionary::default_golden_dir);
            let samples = dictionary::samples(&golden, turns).await?;
            let trained = dictionary::train(&samples)?;
            std::fs::write(&out, &trained).with_context(|| format!("writing {}", out.display()))?;
            let raw: u64 = samples.bodies.iter().map(|b| b.len() as u64).sum();
            let records = dictionary::record_bytes(&samples.bodies, &trained)?;
            for (source, count) in &samples.sources {
                outln!("{source}: {count} records")?;
            }
            outln!(
                "{} bytes of dictionary written to {}; the samples' {raw} body bytes take {records} as records",
                trained.len(),
                out.display()
            )?;
            if let Some(turns) = evaluate {
                let (raw, records) = dictionary::evaluate(&trained, turns).await?;
                outln!(
                    "a new {turns}-turn footprint session: {raw} raw message bytes, {records} record bytes ({:.2}× raw)",
                    records as f64 / raw.max(1) as f64
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::ChaosChild {
            data,
            sessions,
            turns,
            store,
            serve,
            max_attempts,
        } => {
            let serve =
                serve.map(|port| cairn_devtools::chaos::ServeOptions { port, max_attempts });
            cairn_devtools::chaos::run_chaos_child(&data, sessions, turns, store, serve).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::ChaosWorker {
            server,
            data,
            lease_ms,
        } => {
            cairn_devtools::chaos::run_chaos_worker(&server, &data, lease_ms).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate { from, to } => {
            StoreDir::resolve(Some(from.clone()))?.check_exists()?;
            cli::database::migrate(&from, &to).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Fsck { data, repair, json } => {
            let mode = if repair {
                OpenMode::Repair
            } else {
                OpenMode::ReadOnly
            };
            let store = StoreDir::resolve(data)?;
            store.check_exists()?;
            let opened = embedded::open(&store.path, mode, None).await?;
            if !json {
                for note in &opened.notes {
                    outln!("{}: {note}", if repair { "repaired" } else { "note" })?;
                }
            }
            let mut report = cairn_runtime::fsck::fsck(opened.store.as_ref()).await?;
            if !repair {
                report.add_losses(&opened.losses);
            }
            if json {
                cli::reports::fsck_json(&report, &opened.notes, repair)?;
            } else {
                out!("{report}")?;
            }
            Ok(if report.is_clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(cli::exit_codes::CHECK_FAILED)
            })
        }
        Command::Worker {
            server,
            queues,
            concurrency,
            workdir,
            tools,
            mcp_config,
            lease_ms,
        } => {
            let Some((url, token)) = server.resolve(None)? else {
                cli::exit_codes::usage_bail!(
                    "cairn worker needs a server: --server URL, or CAIRN_SERVER"
                );
            };
            cli::worker::run(cli::worker::WorkerRequest {
                url,
                token,
                queues,
                concurrency,
                workdir: workdir_or_cwd(workdir)?,
                tools,
                mcp_config,
                lease_ms,
            })
            .await
        }
        Command::Server {
            data,
            store,
            pool,
            listen,
            tokens,
            engine,
            local_workers,
            workdir,
            max_poll_ms,
            prices,
            cache_sessions,
            cache_mib,
            max_streams,
            max_body_bytes,
        } => {
            serve::run(serve::ServeArgs {
                max_streams,
                body_limit_bytes: usize::try_from(max_body_bytes).unwrap_or(usize::MAX),
                cache_sessions: usize::try_from(cache_sessions).unwrap_or(usize::MAX),
                cache_bytes: usize::try_from(cache_mib.saturating_mul(1 << 20))
                    .unwrap_or(usize::MAX),
                prices: cairn_runtime::PriceTable::from_file_or_env(prices.as_deref())?,
                store: cli::database::StoreLocation::resolve(store, data)?,
                pool,
                listen,
                tokens,
                engine,
                local_workers,
                workdir: workdir_or_cwd(workdir)?,
                max_poll_ms,
            })
            .await
        }
        Command::Resume { data, workdir } => {
            cli::resume::run(StoreDir::resolve(data)?, workdir_or_cwd(workdir)?).await
        }
    }
}

fn parse_engine(name: &str) -> Result<StorageEngine, String> {
    StorageEngine::parse(name).ok_or_else(|| {
        let known: Vec<&str> = StorageEngine::ALL.iter().map(|e| e.as_str()).collect();
        format!("unknown engine {name:?} (known: {})", known.join(", "))
    })
}

fn parse_model(text: &str) -> anyhow::Result<ModelSpec> {
    let Some(spec) = ModelSpec::parse(text) else {
        cli::exit_codes::usage_bail!(
            "invalid --model {text:?}: expected PROVIDER:MODEL, e.g. scripted:script.json"
        );
    };
    match spec.provider.as_str() {
        "scripted" => {
            // Check the script now, so a malformed one is one clear error, not a failed turn.
            ScriptedProvider::from_file(&spec.model)?;
            let absolute = std::path::absolute(&spec.model)
                .with_context(|| format!("cannot resolve {}", spec.model))?;
            Ok(ModelSpec {
                model: absolute.display().to_string(),
                ..spec
            })
        }
        "anthropic" | "openai" | "openai-responses" | "bedrock" => Ok(spec),
        other => cli::exit_codes::usage_bail!(
            "unknown model provider {other:?} (known: scripted, anthropic, openai, openai-responses, bedrock)"
        ),
    }
}

/// `--workdir`, which must be a directory, or the current directory.
fn workdir_or_cwd(workdir: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match workdir {
        Some(w) if w.is_dir() => Ok(w),
        Some(w) if w.exists() => {
            cli::exit_codes::usage_bail!("--workdir {}: not a directory", w.display())
        }
        Some(w) => cli::exit_codes::usage_bail!("--workdir {}: no such directory", w.display()),
        None => std::env::current_dir().context("cannot read the current directory"),
    }
}

/// Refuses a model this process could not call: a provider whose configuration (an API key,
/// a region) is missing from the environment, found as the workers here would find it —
/// without a network call — before a session is written that could only fail.
fn check_provider(model: &ModelSpec) -> anyhow::Result<()> {
    use cairn_workers::ModelResolver;
    cairn_workers::StandardModels::new()
        .resolve(model)
        .map(drop)
        .with_context(|| {
            format!(
                "cannot call {}:{} from this process",
                model.provider, model.model
            )
        })
}

/// Refuses `--system` and `--max-rounds` for a session that exists: both are recorded when a
/// session starts and cannot change, so taking them silently would mislead.
/// Tools and tool policy are fixed when a session starts, like `--system`.
pub(crate) fn refuse_policy_options(
    session_id: &str,
    policy: &cli::approvals::PolicyArgs,
) -> anyhow::Result<()> {
    if policy.given() {
        cli::exit_codes::usage_bail!(
            "session {session_id} exists, and --shell, --allow, --ask, --deny, --policy and \
             --approval-timeout-ms apply only when a session starts (its history records its \
             tools and policy); leave them out to continue the session, or start a new one"
        );
    }
    Ok(())
}

pub(crate) fn refuse_start_options(
    session_id: &str,
    system: &Option<String>,
    max_rounds: Option<u32>,
) -> anyhow::Result<()> {
    let given: Vec<&str> = [
        system.as_ref().map(|_| "--system"),
        max_rounds.map(|_| "--max-rounds"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !given.is_empty() {
        let (verb, them) = if given.len() == 1 {
            ("applies", "it")
        } else {
            ("apply", "them")
        };
        cli::exit_codes::usage_bail!(
            "session {session_id} exists, and {} {verb} only when a session starts (its history \
             records it); leave {them} out to continue the session, or start a new one",
            given.join(" and "),
        );
    }
    Ok(())
}

async fn session_exists(host: &Host, session_id: &str) -> anyhow::Result<bool> {
    match host.engine.state(session_id).await {
        Ok(_) => Ok(true),
        Err(RuntimeError::UnknownSession { .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Carries on `session_id`'s interrupted turn before `run` sends its message: says what the
/// cut-off model call had streamed, resumes that session only (its tasks run again at once)
/// and prints the turn's answer as it streams. A turn that then fails or is cancelled has still
/// ended, so the new message goes on; not being able to continue at all is an error naming
/// `cairn resume`.
async fn continue_interrupted(
    host: &mut Host,
    data: &Path,
    session_id: &str,
    show_thinking: bool,
    quiet: bool,
) -> anyhow::Result<()> {
    let engine = host.engine.clone();
    let state = engine.state(session_id).await?;
    let Some(turn) = state.active.as_ref().map(|a| a.turn) else {
        host.start_for(session_id).await?;
        return Ok(());
    };
    let cannot = || {
        format!(
            "cannot continue the interrupted turn {turn} of session {session_id}; carry it on \
             with `cairn resume --data {}`, then run this message again",
            data.display()
        )
    };
    // `--json` keeps stdout for the outcome: the notices go to stderr then.
    let say = |line: String| {
        if quiet {
            note!("{line}");
        } else {
            showln!("{line}");
        }
    };
    say(format!(
        "[session {session_id}: turn {turn} was interrupted; continuing it first]"
    ));
    let history = host.client.history(session_id).await.with_context(cannot)?;
    if let Some(cut) = interrupted_output(&state, &history) {
        say(interrupted_notice(&cut));
    }
    // Followed from the last event before the workers start, so nothing of the re-run is
    // missed.
    let after_seq = state.next_seq.saturating_sub(1);
    let live = if quiet {
        None
    } else {
        let live =
            cli::live::LiveView::start(&host.client, session_id, after_seq, show_thinking, false);
        Some(live.await.with_context(cannot)?)
    };
    host.start_for(session_id).await.with_context(cannot)?;
    let mut watch = watch(host, session_id, show_thinking);
    watch.quiet = quiet;
    let outcome = watch.running_with(turn, live).await.with_context(cannot)?;
    if !quiet {
        showln!();
    }
    if !matches!(outcome, TurnOutcome::Completed { .. }) {
        note!("{}", describe(&outcome));
    }
    Ok(())
}

/// Says plainly that a model call's streamed output was cut off and is being generated again.
fn interrupted_notice(cut: &StreamedOutput) -> String {
    let what = if cut.text.is_empty() {
        format!(
            "{} characters of reasoning and no answer text",
            cut.thinking.chars().count()
        )
    } else {
        format!(
            "{} characters of its answer: {:?}",
            cut.text.chars().count(),
            one_line(&cut.text, 200)
        )
    };
    format!(
        "[interrupted: turn {} (model call {}, attempt {}) had streamed {what}; that partial answer was cut off and the answer is being generated again]",
        cut.turn, cut.round, cut.attempt
    )
}

/// Sends the prompt and prints the turn live as it runs (see `cli::live`); Ctrl-C cancels
/// it (see `cli::turn`).
async fn run_turn(
    host: &Host,
    session_id: &str,
    prompt: &str,
    model: Option<ModelSpec>,
    show_thinking: bool,
) -> anyhow::Result<TurnOutcome> {
    let outcome = watch(host, session_id, show_thinking)
        .send(prompt, model, Vec::new())
        .await?;
    showln!();
    if !matches!(outcome, TurnOutcome::Completed { .. }) {
        note!("{}", describe(&outcome));
    }
    cli::budget::report(&outcome);
    Ok(outcome)
}

/// How `run` watches `session_id`'s turns.
fn watch<'a>(host: &'a Host, session_id: &'a str, show_thinking: bool) -> cli::turn::Watch<'a> {
    cli::turn::Watch {
        host,
        session_id,
        show_thinking,
        quiet: false,
        data_flag: format!(" --data {}", host.data.display()),
    }
}

fn outcome_code(outcome: &TurnOutcome) -> ExitCode {
    cli::exit_codes::outcome_code(outcome)
}

fn describe(outcome: &TurnOutcome) -> String {
    match outcome {
        TurnOutcome::Completed { turn, answer, .. } => {
            format!("turn {turn} completed: {}", one_line(answer, 100))
        }
        TurnOutcome::Failed { turn, reason, .. } => format!("turn {turn} failed: {reason}"),
        TurnOutcome::Cancelled { turn, reason, .. } => {
            format!("turn {turn} cancelled: {reason}")
        }
    }
}

fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        flat
    } else {
        format!("{}…", flat.chars().take(max).collect::<String>())
    }
}

fn summarize(event: &Event) -> String {
    if let Some(line) = cli::compaction::summarize(event) {
        return line;
    }
    match event {
        Event::SessionStarted(s) => format!(
            "model={}:{} tools=[{}] max_rounds={}",
            s.model.provider,
            s.model.model,
            s.tools
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(","),
            s.limits.max_rounds
        ),
        Event::UserMessage {
            turn, text, media, ..
        } if !media.is_empty() => format!(
            "turn={turn} {:?} media=[{}]",
            one_line(text, 60),
            media
                .iter()
                .map(|m| m.media_type().unwrap_or("url"))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Event::UserMessage { turn, text, .. } => format!("turn={turn} {:?}", one_line(text, 60)),
        Event::ModelCallScheduled {
            turn,
            round,
            attempt,
            ..
        } => format!("turn={turn} round={round} attempt={attempt}"),
        Event::ModelCallCompleted {
            turn,
            round,
            attempt,
            response,
            cost_micros,
        } => format!(
            "turn={turn} round={round} attempt={attempt} stop={} parts=[{}] tokens={}/{}{}",
            response.stop_reason_raw,
            response
                .parts
                .iter()
                .map(|p| p.kind())
                .collect::<Vec<_>>()
                .join(","),
            response.usage.input_tokens,
            response.usage.output_tokens,
            cost_micros.map_or(String::new(), |c| format!(
                " cost={}",
                cairn_runtime::pricing::format_usd(c)
            ))
        ),
        Event::ModelCallFailed {
            turn,
            round,
            attempt,
            failure,
            ..
        } => format!(
            "turn={turn} round={round} attempt={attempt} {}: {}",
            failure.class.as_str(),
            one_line(&failure.message, 60)
        ),
        Event::ToolCallScheduled {
            turn,
            tool_use_id,
            name,
            attempt,
            ..
        } => format!("turn={turn} {name} id={tool_use_id} attempt={attempt}"),
        Event::ToolCallCompleted {
            turn,
            tool_use_id,
            attempt,
            content,
            is_error,
        } => format!(
            "turn={turn} id={tool_use_id} attempt={attempt}{} {}",
            if *is_error { " is_error" } else { "" },
            one_line(&content.canonical_json(), 60)
        ),
        Event::ToolCallFailed {
            turn,
            tool_use_id,
            attempt,
            failure,
        } => format!(
            "turn={turn} id={tool_use_id} attempt={attempt} {}: {}",
            failure.class.as_str(),
            one_line(&failure.message, 60)
        ),
        Event::ToolApprovalRequested {
            turn,
            tool_use_id,
            name,
            deadline_ms,
        } => match deadline_ms {
            Some(deadline) => format!("turn={turn} {name} id={tool_use_id} deadline={deadline}"),
            None => format!("turn={turn} {name} id={tool_use_id}"),
        },
        Event::ToolCallApproved { turn, tool_use_id } => {
            format!("turn={turn} id={tool_use_id}")
        }
        Event::ToolCallDenied {
            turn,
            tool_use_id,
            reason,
            by_deadline,
        } => format!(
            "turn={turn} id={tool_use_id}{} {:?}",
            if *by_deadline { " by_deadline" } else { "" },
            one_line(reason, 60)
        ),
        Event::TurnCompleted { turn, usage } => format!(
            "turn={turn} tokens={}/{}",
            usage.input_tokens, usage.output_tokens
        ),
        Event::TurnFailed { turn, reason, .. } => format!("turn={turn} {}", one_line(reason, 80)),
        Event::TurnCancelled { turn, reason } => format!("turn={turn} {}", one_line(reason, 80)),
        Event::SessionCancelled { reason } => one_line(reason, 80),
        Event::ModelAttemptProgress {
            turn,
            round,
            attempt,
            lease_attempt,
            text_appended,
            thinking_appended,
            ..
        } => {
            let mut line =
                format!("turn={turn} round={round} attempt={attempt} lease={lease_attempt}");
            if !thinking_appended.is_empty() {
                line.push_str(&format!(
                    " thinking+{} {:?}",
                    thinking_appended.chars().count(),
                    one_line(thinking_appended, 40)
                ));
            }
            if !text_appended.is_empty() {
                line.push_str(&format!(
                    " text+{} {:?}",
                    text_appended.chars().count(),
                    one_line(text_appended, 60)
                ));
            }
            line
        }
        // Described by `cli::compaction::summarize` above.
        Event::TranscriptCompacted { .. }
        | Event::CompactionRequested {}
        | Event::SummaryCallScheduled { .. }
        | Event::SummaryCallCompleted { .. }
        | Event::SummaryCallFailed { .. } => String::new(),
    }
}

/// `cairn chaos`: runs the parent of the chaos test in a blocking thread and prints its report.
/// What `cairn chaos` was asked for.
struct ChaosArgs {
    kills: usize,
    sessions: usize,
    turns: usize,
    seed: Option<u64>,
    kill_after_ms: (u64, u64),
    startup_kills: usize,
    power_cuts: usize,
    engine: StorageEngine,
    remote_workers: usize,
    data: Option<PathBuf>,
    keep: bool,
}

async fn chaos(args: ChaosArgs) -> anyhow::Result<ExitCode> {
    let ChaosArgs {
        kills,
        sessions,
        turns,
        seed,
        kill_after_ms,
        startup_kills,
        power_cuts,
        engine,
        remote_workers,
        data,
        keep,
    } = args;
    // Only a directory made here is removed, and only after checks that passed.
    let remove_after = data.is_none() && !keep;
    let data = match data {
        Some(d) => refuse_store_as_chaos_dir(d)?,
        None => tempfile::Builder::new()
            .prefix("cairn-chaos-")
            .tempdir()
            .context("cannot create a temporary directory")?
            .keep(),
    };
    let seed = match seed {
        Some(seed) => seed,
        None => chaos_seed(),
    };
    let config = cairn_devtools::chaos::ChaosConfig {
        data: data.clone(),
        sessions,
        turns_per_session: turns,
        kills,
        seed,
        kill_after_ms,
        startup_kills,
        power_cuts,
        check_each_fault: startup_kills + power_cuts > 0,
        store: engine,
        remote_workers,
        ..cairn_devtools::chaos::ChaosConfig::new(&data, seed)
    };
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let workers = if remote_workers == 0 {
        String::new()
    } else {
        format!(", {remote_workers} remote workers (kills fall on the server or a worker)")
    };
    outln!(
        "chaos on {engine}: {sessions} sessions x {turns} turns, {kills} SIGKILLs (most {}-{} ms after the child is ready), {startup_kills} startup kills, {power_cuts} power cuts{workers}, seed {seed}, data {}",
        kill_after_ms.0,
        kill_after_ms.1,
        data.display()
    )?;
    let report =
        tokio::task::spawn_blocking(move || cairn_devtools::chaos::run_chaos(&config, &exe))
            .await
            .context("the chaos run panicked")??;
    outln!("{report}")?;
    cli::cleanup::chaos_data(&data, remove_after && report.passed())?;
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

// A seed for a run nobody gave one: the one place the CLI reads the clock for randomness.
#[allow(clippy::disallowed_methods)]
fn chaos_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ u64::from(std::process::id()).rotate_left(32)
}

async fn demo(
    data: Option<PathBuf>,
    engine: Option<StorageEngine>,
    keep: bool,
) -> anyhow::Result<ExitCode> {
    // The scripted model and the file its tool call reads: the demo's own, removed when it
    // ends; so is its store, unless the session is to be kept.
    let fixtures = tempfile::Builder::new()
        .prefix("cairn-demo-")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let keep = keep || data.is_some();
    let store = if keep {
        StoreDir::resolve(data)?
    } else {
        StoreDir {
            path: fixtures.path().join("store"),
            defaulted: false,
        }
    };
    let workdir = fixtures.path().join("work");
    std::fs::create_dir_all(&workdir)?;
    std::fs::write(workdir.join("notes.txt"), DEMO_NOTES)?;
    let script = fixtures.path().join("demo-script.json");
    std::fs::write(&script, DEMO_SCRIPT)?;
    let model = parse_model(&format!("scripted:{}", script.display()))?;
    let mut host = Host::open(&store.path, OpenMode::Create, engine, workdir).await?;
    let options = SessionOptions {
        system_prompt: Some("You are a concise assistant. Use tools when they help.".to_owned()),
        // The built-in tools the demo's script calls (the host also hosts shell).
        ..SessionOptions::new(model, cairn_activities::ToolRegistry::builtin(".").specs())
    };
    let session_id = host.client.start_session(options).await?;
    note!("new session {session_id}");
    // Only the demo's session runs: the store may be one with other sessions in it.
    host.start_for(&session_id).await?;
    showln!("> {DEMO_PROMPT}\n");
    let outcome = run_turn(&host, &session_id, DEMO_PROMPT, None, true).await?;
    let events = host.client.history(&session_id).await?;
    let tool_calls = events
        .iter()
        .filter(|e| matches!(e.event, Event::ToolCallCompleted { .. }))
        .count();
    let engine = host.opened.engine;
    host.shutdown().await;
    let size = dir_size(&store.path);
    drop(fixtures);
    let data = store.flag();
    showln!("\n--- summary");
    showln!("session      {session_id}");
    showln!("outcome      {}", describe(&outcome));
    showln!(
        "events       {} written durably ({} tool calls ran in parallel)",
        events.len(),
        tool_calls
    );
    if !keep {
        showln!(
            "store        a temporary one ({engine}, {} KiB on disk), removed: `cairn demo \
             --keep` keeps the session in the default store to inspect",
            size / 1024
        );
        return Ok(outcome_code(&outcome));
    }
    showln!(
        "store        {}{} ({engine}, {} KiB on disk)",
        store.path.display(),
        if store.defaulted { ", the default" } else { "" },
        size / 1024
    );
    showln!("inspect      cairn sessions{data}");
    showln!("             cairn history{data} {session_id}");
    showln!("             cairn transcript{data} {session_id}");
    showln!("             cairn replay{data} {session_id}");
    Ok(outcome_code(&outcome))
}

/// `cairn chaos --data DIR` takes a work directory of its own (its children's store is
/// `DIR/store`, beside their side-effect files): a store given there is refused, so that the
/// run's sessions never mix with a store's.
fn refuse_store_as_chaos_dir(dir: PathBuf) -> anyhow::Result<PathBuf> {
    if embedded::detect(&dir)?.is_some() {
        bail!(
            "{} is a cairn store; cairn chaos --data takes a work directory of its own (the \
             chaos children's store is made in DIR/store): name a new directory",
            dir.display()
        );
    }
    Ok(dir)
}

fn dir_size(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            // Allocated, not apparent: fjall preallocates its journal sparsely.
            #[cfg(unix)]
            Ok(m) => std::os::unix::fs::MetadataExt::blocks(&m) * 512,
            #[cfg(not(unix))]
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
