//! The `cairn` command line's arguments: every command and its flags, parsed by clap, whose
//! doc comments are the help that `cairn --help` and `cairn COMMAND --help` print.

use crate::cli;
use cairn_runtime::store::embedded::StorageEngine;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "cairn",
    version,
    about = "A durable-workflow runtime for LLM agents"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
// Parsed once per process; boxing `Run`'s flattened flag groups would buy nothing measurable.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Command {
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
        /// Tool calls the model asks for at once in each turn, 1 to 64 (the README's workload:
        /// 2). At one session a turn commits four times when the calls' results share one
        /// append (they finish together), more when some come after that append began.
        #[arg(
            long,
            value_name = "N",
            default_value_t = cairn_devtools::bench::DEFAULT_PARALLEL_TOOLS,
            value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
                .range(1..=cairn_devtools::bench::MAX_PARALLEL_TOOLS as u64),
            conflicts_with_all = ["footprint", "goals", "parked", "stages"]
        )]
        parallel_tools: usize,
        /// Offer the model further tools, never called, whose specs add about this many bytes
        /// of JSON to the built-in ones (each with a description of about a kilobyte, as a
        /// coding agent's tools have): what a model task carries grows with them.
        #[arg(
            long,
            value_name = "BYTES",
            default_value_t = 0,
            conflicts_with_all = ["footprint", "goals", "parked", "stages"]
        )]
        tool_spec_bytes: usize,
        /// Turns each client runs on one session before it starts a fresh one (the README's
        /// workload: 1, a fresh session per turn). A long session's transcript grows from turn
        /// to turn, and through a server every model task carries it.
        #[arg(
            long,
            value_name = "N",
            default_value_t = 1,
            value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000),
            conflicts_with_all = ["footprint", "goals", "parked", "stages"]
        )]
        turns_per_session: usize,
        /// About this many bytes of text in each turn's user message (default: the word
        /// `go`), so that a long session's transcript grows as an agent's does.
        #[arg(
            long,
            value_name = "BYTES",
            default_value_t = 0,
            value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1_000_000),
            conflicts_with_all = ["footprint", "goals", "parked", "stages"]
        )]
        message_bytes: usize,
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

fn parse_engine(name: &str) -> Result<StorageEngine, String> {
    StorageEngine::parse(name).ok_or_else(|| {
        let known: Vec<&str> = StorageEngine::ALL.iter().map(|e| e.as_str()).collect();
        format!("unknown engine {name:?} (known: {})", known.join(", "))
    })
}
