//! The `cairn` command line: run the offline demo, run turns, inspect and replay histories.

// Printing goes through `cli::out`: a closed pipe must not panic.
#![deny(clippy::print_stdout, clippy::print_stderr)]

mod allocator;
mod cli;

#[global_allocator]
static ALLOCATOR: allocator::Allocator = allocator::Allocator {};

use anyhow::{bail, Context};
use cairn::host::Host;
use cairn_activities::providers::{render_request, RequestFormat};
use cairn_activities::{CallContext, ModelRequest, ScriptedProvider};
use cairn_ledger::ModelSpec;
use cairn_runtime::store::embedded::{self, OpenMode, StorageEngine};
use cairn_runtime::{
    interrupted_output, replay, Error as RuntimeError, SessionOptions, StreamedOutput, TurnOutcome,
};
use cli::args::{Cli, Command};
use cli::out::{note, out, outln, showln};
use cli::summary::{describe, one_line, summarize};
use cli::{Access, StoreDir, Target};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod bench;
mod footprint;
mod serve;

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
        Command::Demo { data, engine, keep } => cli::demo_command::run(data, engine, keep).await,
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
            parallel_tools,
            tool_spec_bytes,
            turns_per_session,
            message_bytes,
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
                    parallel_tools,
                    tool_spec_bytes,
                    turns_per_session,
                    message_bytes,
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
            cli::chaos::run(cli::chaos::ChaosArgs {
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
