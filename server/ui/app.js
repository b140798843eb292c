// The cairn history viewer: the session list (/ui) and a session's page (/ui/sessions/ID),
// read from the server's /v1 API. Every piece of session data reaches the page as a text
// node (el() below); nothing is parsed as markup, since transcripts are untrusted text.
"use strict";

const TOKEN_KEY = "cairn.token";
const LIST_PAGES_MAX = 20; // 20 pages of 1000 sessions; the rest is left out, and said so
const DESCRIBE_CONCURRENCY = 6;

// ---- DOM helpers -------------------------------------------------------------------------

// An element with attributes and children; strings become text nodes.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, ...children);
  return node;
}

function append(node, ...children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

const main = () => document.getElementById("main");

function show(...children) {
  append(clear(main()), children);
}

function badge(status) {
  return el("span", { class: "badge status " + status }, status);
}

function formatTime(ms) {
  if (!ms) return "";
  const date = new Date(ms);
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

function formatDuration(ms) {
  if (ms === undefined || ms === null || ms < 0) return "";
  if (ms < 1000) return `${ms} ms`;
  if (ms < 60000) return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
  return `${Math.floor(ms / 60000)} min ${Math.round((ms % 60000) / 1000)} s`;
}

function formatUsage(usage) {
  if (!usage) return "";
  let text = `${usage.input_tokens} in / ${usage.output_tokens} out`;
  if (usage.cache_read_tokens) text += ` / ${usage.cache_read_tokens} cache read`;
  if (usage.cache_write_tokens) text += ` / ${usage.cache_write_tokens} cache write`;
  if (usage.reasoning_tokens) text += ` / ${usage.reasoning_tokens} reasoning`;
  return text;
}

function modelName(model) {
  return model ? `${model.provider}:${model.model}` : "";
}

// JSON text as it was produced, pretty-printed when it parses (tool arguments may not).
function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch (_) {
    return text;
  }
}

// ---- the API -----------------------------------------------------------------------------

class NeedToken extends Error {}

function authHeaders() {
  const token = localStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}

// A /v1 call answering its JSON; an error body becomes an Error carrying its message.
async function api(path, options = {}) {
  const headers = Object.assign({ Accept: "application/json" }, authHeaders(), options.headers || {});
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  if (response.status === 401) {
    askForToken(localStorage.getItem(TOKEN_KEY) ? "The token was refused." : "");
    throw new NeedToken("a token is needed");
  }
  const text = await response.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const message = body && body.error ? `${body.error.message} (${response.status} ${body.error.code})`
      : `${response.status} ${response.statusText}`;
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return body;
}

function askForToken(reason) {
  document.getElementById("forget-token").hidden = true;
  const input = el("input", { type: "password", id: "token", placeholder: "token", autocomplete: "off" });
  const form = el("form", {
    class: "token",
    onsubmit: (event) => {
      event.preventDefault();
      localStorage.setItem(TOKEN_KEY, input.value.trim());
      route();
    },
  },
  el("h2", {}, "This server needs a token"),
  el("p", { class: "note" }, "A client token of its tokens file. It is kept in this browser's local storage and sent as Authorization: Bearer."),
  reason ? el("p", { class: "error" }, reason) : null,
  input,
  el("button", { type: "submit", class: "primary" }, "Use this token"));
  show(form);
  input.focus();
}

function showError(error) {
  if (error instanceof NeedToken) return;
  show(el("p", { class: "error", id: "error" }, String(error.message || error)));
}

// ---- routing -----------------------------------------------------------------------------

let stopPage = () => {};

function route() {
  stopPage();
  stopPage = () => {};
  const forget = document.getElementById("forget-token");
  forget.hidden = !localStorage.getItem(TOKEN_KEY);
  const path = location.pathname.replace(/\/+$/, "");
  const session = path.match(/^\/ui\/sessions\/([^/]+)$/);
  if (session) {
    sessionPage(decodeURIComponent(session[1])).catch(showError);
  } else {
    listPage().catch(showError);
  }
}

function setCrumbs(...children) {
  append(clear(document.getElementById("crumbs")), children);
}

function setLive(text, on) {
  const live = document.getElementById("live");
  live.hidden = !text;
  live.textContent = text || "";
  live.className = on ? "" : "off";
}

// ---- the session list --------------------------------------------------------------------

async function listPage() {
  document.title = "cairn: sessions";
  setCrumbs("sessions");
  setLive("");
  let sessions = [];
  let after = null;
  let truncated = false;
  for (let page = 0; ; page++) {
    if (page === LIST_PAGES_MAX) {
      truncated = true;
      break;
    }
    const query = "?limit=1000" + (after ? "&after=" + encodeURIComponent(after) : "");
    const answer = await api("/v1/sessions" + query);
    sessions = sessions.concat(answer.sessions);
    if (!answer.next_after) break;
    after = answer.next_after;
  }
  // The most recently active first.
  sessions.sort((a, b) => b.updated_at_ms - a.updated_at_ms || a.session_id.localeCompare(b.session_id));

  const filter = el("input", {
    id: "filter", type: "search", placeholder: "filter by id, status or model",
    oninput: () => applyFilter(filter.value),
  });
  const count = el("span", { class: "note", id: "count" });
  const tbody = el("tbody");
  const rows = sessions.map((s) => {
    const row = el("tr", { class: "session", dataset: { id: s.session_id, status: s.status } },
      el("td", { class: "id mono" }, el("a", { href: "/ui/sessions/" + encodeURIComponent(s.session_id) }, s.session_id)),
      el("td", { class: "status" }, badge(s.status)),
      el("td", { class: "model mono" }),
      el("td", { class: "turns num" }),
      el("td", { class: "events num" }, String(s.events)),
      el("td", { class: "usage" }),
      el("td", { class: "updated" }, formatTime(s.updated_at_ms)));
    row.search = (s.session_id + " " + s.status).toLowerCase();
    tbody.append(row);
    return row;
  });
  function applyFilter(text) {
    const words = text.toLowerCase().split(/\s+/).filter(Boolean);
    let shown = 0;
    for (const row of rows) {
      const visible = words.every((w) => row.search.includes(w));
      row.hidden = !visible;
      if (visible) shown++;
    }
    count.textContent = `${shown} of ${rows.length} sessions` + (truncated ? " (the first " + rows.length + " only)" : "");
  }
  show(
    el("div", { class: "toolbar" }, filter, count,
      el("button", { type: "button", onclick: () => route() }, "refresh")),
    sessions.length === 0 ? el("p", { class: "note", id: "empty" }, "No sessions yet.") : null,
    el("table", { id: "sessions" },
      el("thead", {}, el("tr", {},
        el("th", {}, "session"), el("th", {}, "status"), el("th", {}, "model"),
        el("th", { class: "num" }, "turns"), el("th", { class: "num" }, "events"),
        el("th", {}, "usage (tokens)"), el("th", {}, "last activity"))),
      tbody));
  applyFilter("");

  // Model, turns and usage come from each session's description, a few at a time.
  let alive = true;
  stopPage = () => { alive = false; };
  let next = 0;
  async function describeNext() {
    while (alive && next < rows.length) {
      const row = rows[next++];
      try {
        const d = await api("/v1/sessions/" + encodeURIComponent(row.dataset.id));
        row.querySelector(".model").textContent = modelName(d.model);
        row.querySelector(".turns").textContent = String(d.turns);
        row.querySelector(".usage").textContent = formatUsage(d.usage);
        row.search += " " + modelName(d.model).toLowerCase();
      } catch (error) {
        if (error instanceof NeedToken) return;
        row.querySelector(".model").textContent = "?";
        row.querySelector(".model").title = String(error.message);
      }
    }
    applyFilter(filter.value);
  }
  await Promise.all(Array.from({ length: DESCRIBE_CONCURRENCY }, describeNext));
  if (alive) main().dataset.loaded = "true";
}

// ---- a session's page --------------------------------------------------------------------

async function sessionPage(id) {
  document.title = "cairn: " + id;
  setCrumbs(el("a", { href: "/ui" }, "sessions"), " / ", el("span", { class: "mono", id: "crumb-id" }, id));
  const base = "/v1/sessions/" + encodeURIComponent(id);
  const page = {
    id, base, events: [], lastSeq: 0, selected: null, alive: true, abort: new AbortController(),
    streaming: new Map(), // "turn/activity/attempt" -> streamed text of a running model call
    refreshTimer: null,
  };
  stopPage = () => {
    page.alive = false;
    page.abort.abort();
    clearTimeout(page.refreshTimer);
  };

  const summary = el("div", { class: "summary", id: "summary" }, el("h1", { class: "mono" }, id));
  const timeline = el("div", { class: "body", id: "timeline" });
  const transcript = el("div", { class: "body", id: "transcript" });
  const stateBody = el("div", { class: "body", id: "state-body" });
  const statePane = el("section", { class: "pane", id: "state", hidden: true },
    el("h2", {}, el("span", { id: "state-title" }, "State"),
      el("button", { type: "button", id: "close-state", onclick: () => selectEvent(page, null) }, "close")),
    stateBody);
  const columns = el("div", { class: "columns", id: "columns" },
    el("section", { class: "pane", id: "timeline-pane" }, el("h2", {}, "Timeline"), timeline),
    el("section", { class: "pane", id: "transcript-pane" }, el("h2", {}, "Transcript"), transcript),
    statePane);
  show(summary, columns);
  Object.assign(page, { summary, timeline, transcript, statePane, stateBody, columns });

  // The history so far, page by page, then the live stream from the last seq on.
  let from = 1;
  for (;;) {
    const answer = await api(`${base}/history?from_seq=${from}&limit=1000`);
    page.events.push(...answer.events);
    if (answer.events.length === 0) break;
    from = answer.next_seq;
  }
  page.lastSeq = page.events.length ? page.events[page.events.length - 1].seq : 0;
  await Promise.all([refreshSummary(page), refreshTranscript(page)]);
  renderTimeline(page);
  const wanted = Number(new URLSearchParams(location.hash.slice(1)).get("at"));
  if (wanted) selectEvent(page, wanted);
  main().dataset.loaded = "true";
  follow(page);
}

async function refreshSummary(page) {
  const d = await api(page.base);
  const started = page.events.find((e) => e.kind === "session_started");
  const origin = started && started.event.session_started.forked_from;
  append(clear(page.summary),
    el("h1", { class: "mono" }, page.id),
    badge(d.status),
    el("span", { class: "field" }, "model ", el("b", { class: "mono", id: "model" }, modelName(d.model))),
    el("span", { class: "field" }, "turns ", el("b", { id: "turns" }, String(d.turns))),
    el("span", { class: "field" }, "events ", el("b", { id: "event-count" }, String(d.events))),
    el("span", { class: "field" }, "usage ", el("b", { id: "usage" }, formatUsage(d.usage))),
    d.running_turn ? el("span", { class: "field" }, "turn ", el("b", {}, String(d.running_turn)), " running") : null,
    origin ? el("span", { class: "field", id: "forked-from" }, "forked from ",
      el("a", { class: "mono", href: `/ui/sessions/${encodeURIComponent(origin.session_id)}#at=${origin.seq}` },
        origin.session_id), " at seq ", String(origin.seq)) : null);
  page.status = d.status;
}

async function refreshTranscript(page) {
  const t = await api(page.base + "/transcript");
  const body = clear(page.transcript);
  renderMessages(body, t.messages);
  const live = renderStreaming(page);
  if (live) body.append(live);
  if (!t.messages.length && !live) body.append(el("p", { class: "note" }, "No messages yet."));
}

// Refreshes what the stream's events change, at most every 150 ms.
function scheduleRefresh(page) {
  if (page.refreshTimer) return;
  page.refreshTimer = setTimeout(async () => {
    page.refreshTimer = null;
    if (!page.alive) return;
    try {
      await Promise.all([refreshSummary(page), refreshTranscript(page)]);
    } catch (error) {
      if (!(error instanceof NeedToken)) setLive("refresh failed: " + error.message, false);
    }
  }, 150);
}

// ---- the transcript ----------------------------------------------------------------------

function renderMessages(container, messages) {
  messages.forEach((message, index) => {
    const node = el("div", { class: "message " + message.role, dataset: { index } },
      el("div", { class: "role" }, message.role,
        message.provenance ? el("span", { class: "note" }, "  " + modelName(message.provenance)) : null));
    for (const part of message.parts) node.append(renderPart(part));
    container.append(node);
  });
}

function renderPart(part) {
  const [kind] = Object.keys(part);
  const value = part[kind];
  switch (kind) {
    case "text":
      return el("div", { class: "part text" }, el("pre", {}, value.text));
    case "thinking":
      return el("details", { class: "part thinking" },
        el("summary", {}, "thinking", value.signature ? " (signed)" : ""),
        el("pre", {}, value.text));
    case "redacted_thinking":
      return el("details", { class: "part redacted-thinking" },
        el("summary", {}, "redacted thinking"), el("pre", { class: "mono" }, value.data));
    case "tool_use":
      return el("div", { class: "part tool-use", dataset: { toolUseId: value.id } },
        el("div", { class: "label" }, "tool_use ", el("b", { class: "name mono" }, value.name),
          " ", el("span", { class: "mono" }, value.id)),
        el("pre", { class: "arguments" }, prettyJson(value.arguments)));
    case "tool_result": {
      const content = value.content || {};
      const text = "json" in content ? JSON.stringify(content.json, null, 2)
        : "text" in content ? content.text : JSON.stringify(content, null, 2);
      return el("div", { class: "part tool-result" + (value.is_error ? " is-error" : ""), dataset: { toolUseId: value.tool_use_id } },
        el("div", { class: "label" }, "tool_result for ", el("span", { class: "mono" }, value.tool_use_id),
          value.is_error ? el("b", { class: "error-flag" }, "  is_error") : ""),
        el("pre", { class: "content" }, text));
    }
    default:
      return el("div", { class: "part other" }, el("div", { class: "label" }, kind),
        el("pre", {}, JSON.stringify(value, null, 2)));
  }
}

// What running model calls have streamed so far (deltas; presentation only).
function renderStreaming(page) {
  if (page.streaming.size === 0) return null;
  const node = el("div", { class: "message assistant streaming", id: "streaming" },
    el("div", { class: "role" }, "assistant (streaming)"));
  for (const entry of page.streaming.values()) {
    if (entry.thinking) node.append(el("details", { class: "part thinking" }, el("summary", {}, "thinking"), el("pre", {}, entry.thinking)));
    if (entry.text) node.append(el("div", { class: "part text" }, el("pre", {}, entry.text)));
  }
  return node;
}

// ---- the timeline ------------------------------------------------------------------------

// Groups the events into turns, and a turn's events into its model calls (by round) and
// tool calls (by tool_use id), each with its attempts in order.
function buildTimeline(events) {
  const head = []; // events outside turns
  const turns = new Map();
  const turnOf = (n) => {
    if (!turns.has(n)) turns.set(n, { turn: n, events: [], calls: new Map(), start: null, end: null, outcome: null });
    return turns.get(n);
  };
  for (const event of events) {
    const body = event.event[event.kind] || {};
    if (body.turn === undefined) {
      head.push(event);
      continue;
    }
    const turn = turnOf(body.turn);
    if (event.kind === "user_message") turn.start = event;
    if (["turn_completed", "turn_failed", "turn_cancelled"].includes(event.kind)) {
      turn.end = event;
      turn.outcome = event.kind.replace("turn_", "");
      turn.events.push(event);
      continue;
    }
    let key = null;
    if (event.kind.startsWith("model_")) key = "model:" + body.round;
    else if (event.kind.startsWith("tool_call_")) key = "tool:" + body.tool_use_id;
    if (key === null) {
      turn.events.push(event);
      continue;
    }
    if (!turn.calls.has(key)) {
      turn.calls.set(key, { key, kind: key.startsWith("model") ? "model" : "tool", round: body.round,
        toolUseId: body.tool_use_id, name: body.name, events: [], attempts: new Map(), firstSeq: event.seq });
      turn.events.push({ call: key });
    }
    const call = turn.calls.get(key);
    if (body.name) call.name = body.name;
    call.events.push(event);
    const attempt = call.attempts.get(body.attempt) || { attempt: body.attempt };
    if (event.kind.endsWith("_scheduled")) attempt.scheduled = event;
    if (event.kind.endsWith("_completed")) attempt.completed = event;
    if (event.kind.endsWith("_failed")) attempt.failed = event;
    call.attempts.set(body.attempt, attempt);
  }
  return { head, turns };
}

// How long an attempt ran: from when it could start (scheduled, or its backoff's end) to
// its result being recorded.
function attemptDuration(attempt) {
  const end = attempt.completed || attempt.failed;
  if (!attempt.scheduled || !end) return null;
  const body = attempt.scheduled.event[attempt.scheduled.kind];
  const start = Math.max(attempt.scheduled.recorded_at_ms, body.not_before_ms || 0);
  return end.recorded_at_ms - start;
}

function describeEvent(event) {
  const body = event.event[event.kind] || {};
  switch (event.kind) {
    case "session_started":
      return [`session started: ${modelName(body.model)}, ${(body.tools || []).length} tools`,
        body.forked_from ? ` (fork of ${body.forked_from.session_id} at seq ${body.forked_from.seq})` : ""];
    case "user_message":
      return ["user: ", body.text];
    case "model_call_scheduled":
      return [`model call scheduled (attempt ${body.attempt})`];
    case "model_call_completed": {
      const r = body.response;
      const tools = r.parts.filter((p) => p.tool_use).map((p) => p.tool_use.name);
      return [`model answered (attempt ${body.attempt}): ${r.stop_reason}`,
        tools.length ? ` → ${tools.join(", ")}` : "", "  ", el("span", { class: "usage" }, formatUsage(r.usage))];
    }
    case "model_call_failed":
    case "tool_call_failed":
      return [`attempt ${body.attempt} failed (${body.failure.class}): `, body.failure.message,
        body.failure.usage ? el("span", { class: "usage" }, "  " + formatUsage(body.failure.usage)) : ""];
    case "model_attempt_progress":
      return [`streamed ${body.text_appended ? body.text_appended.length : 0} characters` +
        (body.thinking_appended ? ` (+${body.thinking_appended.length} thinking)` : "") +
        ` (attempt ${body.attempt}, run ${body.lease_attempt})`];
    case "tool_call_scheduled":
      return [`${body.name} scheduled (attempt ${body.attempt})`];
    case "tool_call_completed":
      return [`${body.name || "tool"} returned (attempt ${body.attempt})${body.is_error ? ": is_error" : ""}`];
    case "turn_completed":
      return ["turn completed  ", el("span", { class: "usage" }, formatUsage(body.usage))];
    case "turn_failed":
    case "turn_cancelled":
      return [event.kind.replace("_", " ") + ": ", body.reason];
    case "session_cancelled":
      return ["session cancelled: ", body.reason];
    default:
      return [event.kind];
  }
}

function eventRow(page, event, extra) {
  const failure = event.kind.endsWith("_failed");
  const row = el("li", {
    class: "event " + event.kind + (failure ? " failure" : "") + (event.kind === "model_attempt_progress" ? " progress" : ""),
    dataset: { seq: event.seq, kind: event.kind },
    title: `seq ${event.seq}: ${event.kind} — click for the state after it`,
    onclick: () => selectEvent(page, event.seq),
  },
  el("span", { class: "seq" }, String(event.seq)),
  el("span", { class: "what" }, describeEvent(event)),
  el("span", { class: "when" }, extra || formatTime(event.recorded_at_ms).slice(11)));
  if (page.selected === event.seq) row.classList.add("selected");
  if (page.fresh && page.fresh.has(event.seq)) row.classList.add("fresh");
  return row;
}

function renderCall(page, call) {
  const attempts = [...call.attempts.values()];
  const done = attempts.find((a) => a.completed);
  const failures = attempts.filter((a) => a.failed).length;
  const total = attempts.reduce((sum, a) => sum + (attemptDuration(a) || 0), 0);
  let usage = null;
  if (done && call.kind === "model") usage = done.completed.event.model_call_completed.response.usage;
  const title = call.kind === "model" ? ["model call ", el("b", {}, `round ${call.round}`)]
    : ["tool call ", el("b", { class: "tool-name mono" }, call.name || "?"), " ", el("span", { class: "mono" }, call.toolUseId)];
  const state = done ? "done" : failures && !attempts.some((a) => a.scheduled && !a.failed) ? "failed" : "pending";
  const head = el("div", { class: "head" }, title,
    ` · ${attempts.length} attempt${attempts.length === 1 ? "" : "s"}`,
    failures ? ` · ${failures} failed, retried` : "",
    total ? ` · ${formatDuration(total)}` : "",
    usage ? el("span", { class: "usage" }, " · " + formatUsage(usage)) : "",
    state === "pending" ? " · running" : "");
  const list = el("ol", { class: "events" });
  for (const event of call.events) {
    const attempt = call.attempts.get((event.event[event.kind] || {}).attempt);
    const ended = event.kind.endsWith("_completed") || event.kind.endsWith("_failed");
    const duration = ended && attempt ? attemptDuration(attempt) : null;
    const row = eventRow(page, event, duration !== null ? formatDuration(duration) : null);
    if (event.kind === "tool_call_completed" && !event.event.tool_call_completed.name) {
      row.querySelector(".what").textContent = "";
      append(row.querySelector(".what"), [`${call.name || "tool"} returned (attempt ${event.event.tool_call_completed.attempt})`,
        event.event.tool_call_completed.is_error ? ": is_error" : ""]);
    }
    list.append(row);
  }
  return el("div", { class: `call ${call.kind} ${state}`, dataset: { call: call.key } }, head, list);
}

function renderTimeline(page) {
  const { head, turns } = buildTimeline(page.events);
  const body = clear(page.timeline);
  const top = el("ol", { class: "events" });
  for (const event of head.filter((e) => e.kind === "session_started")) top.append(eventRow(page, event));
  body.append(top);
  for (const turn of turns.values()) {
    const duration = turn.start && turn.end ? turn.end.recorded_at_ms - turn.start.recorded_at_ms : null;
    const usage = turn.end && turn.end.kind === "turn_completed" ? turn.end.event.turn_completed.usage : null;
    const calls = [...turn.calls.values()];
    const section = el("section", { class: "turn", dataset: { turn: turn.turn } },
      el("div", { class: "head" }, `Turn ${turn.turn}`, badge(turn.outcome || "running"),
        el("span", { class: "note" },
          `${calls.filter((c) => c.kind === "model").length} model calls, ${calls.filter((c) => c.kind === "tool").length} tool calls`,
          duration !== null ? ` · ${formatDuration(duration)}` : ""),
        usage ? el("span", { class: "usage" }, formatUsage(usage)) : null));
    let list = el("ol", { class: "events" });
    for (const item of turn.events) {
      if (item.call) {
        if (list.childNodes.length) section.append(list);
        section.append(renderCall(page, turn.calls.get(item.call)));
        list = el("ol", { class: "events" });
      } else {
        list.append(eventRow(page, item));
      }
    }
    if (list.childNodes.length) section.append(list);
    body.append(section);
  }
  const tail = el("ol", { class: "events" });
  for (const event of head.filter((e) => e.kind !== "session_started")) tail.append(eventRow(page, event));
  if (tail.childNodes.length) body.append(tail);
}

// ---- the state at an event, and forking from it ------------------------------------------

async function selectEvent(page, seq) {
  page.selected = seq;
  for (const row of page.timeline.querySelectorAll("li.event")) {
    row.classList.toggle("selected", Number(row.dataset.seq) === seq);
  }
  if (seq === null) {
    page.statePane.hidden = true;
    page.columns.classList.remove("with-state");
    history.replaceState(null, "", location.pathname);
    return;
  }
  history.replaceState(null, "", `${location.pathname}#at=${seq}`);
  page.statePane.hidden = false;
  page.columns.classList.add("with-state");
  document.getElementById("state-title").textContent = `State after seq ${seq}`;
  const body = clear(page.stateBody);
  body.dataset.loaded = "";
  body.append(el("p", { class: "note" }, "Loading…"));
  let state;
  try {
    state = await api(`${page.base}/state?at=${seq}`);
  } catch (error) {
    if (page.selected === seq) {
      clear(body).append(el("p", { class: "error" }, String(error.message)));
      body.dataset.loaded = "error";
    }
    return;
  }
  if (page.selected !== seq) return; // another event was clicked meanwhile
  const event = page.events.find((e) => e.seq === seq);
  const s = state.session;
  const messages = state.transcript.messages || [];
  clear(body).append(
    el("dl", {},
      el("dt", {}, "event"), el("dd", { id: "state-event" }, `${state.at_seq} of ${state.of_seqs}`, event ? ` (${event.kind})` : ""),
      el("dt", {}, "status"), el("dd", { id: "state-status" }, badge(s.status), s.running_turn ? ` turn ${s.running_turn} running` : ""),
      el("dt", {}, "turns"), el("dd", { id: "state-turns" }, String(s.turns)),
      el("dt", {}, "usage so far"), el("dd", { id: "state-usage" }, formatUsage(s.usage)),
      el("dt", {}, "messages"), el("dd", { id: "state-messages" }, String(messages.length)),
      s.last_outcome ? [el("dt", {}, "last outcome"), el("dd", {}, `turn ${s.last_outcome.turn} ${s.last_outcome.status}`)] : null),
    el("h3", {}, "pending tasks"),
    s.pending_tasks.length ? el("ul", { id: "state-pending" }, s.pending_tasks.map((t) =>
      el("li", { class: "mono" }, `${t.activity} attempt ${t.attempt} (seq ${t.scheduled_seq})`))) : el("p", { class: "note" }, "none"),
    el("h3", {}, "open tool calls"),
    state.open_tool_calls.length ? el("ul", { id: "state-open" }, state.open_tool_calls.map((c) =>
      el("li", {}, el("b", { class: "mono" }, c.name), " ", el("span", { class: "mono" }, c.tool_use_id), " ",
        el("code", {}, c.arguments)))) : el("p", { class: "note" }, "none"),
    forkForm(page, seq),
    el("h3", {}, "transcript at this event"),
    el("div", { id: "state-transcript" }));
  renderMessages(document.getElementById("state-transcript"), messages);
  body.dataset.loaded = String(seq);
}

function forkForm(page, seq) {
  const id = el("input", { id: "fork-id", placeholder: "new session id (optional)", autocomplete: "off" });
  const model = el("input", { id: "fork-model", placeholder: "model PROVIDER:MODEL (optional)", autocomplete: "off" });
  const system = el("textarea", { id: "fork-system", rows: 2, placeholder: "system prompt (optional)" });
  const result = el("div", { id: "fork-result" });
  const button = el("button", {
    type: "button", id: "fork", class: "primary",
    onclick: async () => {
      button.disabled = true;
      clear(result);
      const request = { at: seq };
      if (id.value.trim()) request.id = id.value.trim();
      if (model.value.trim()) request.model = model.value.trim();
      if (system.value.trim()) request.system = system.value;
      try {
        const forked = await api(page.base + "/fork", { method: "POST", body: request });
        location.assign("/ui/sessions/" + encodeURIComponent(forked.session_id));
      } catch (error) {
        button.disabled = false;
        if (!(error instanceof NeedToken)) result.append(el("p", { class: "error", id: "fork-error" }, String(error.message)));
      }
    },
  }, `Fork from seq ${seq}`);
  return el("div", { class: "fork" },
    el("div", { class: "note" }, `A new session with this history up to seq ${seq}, going on from there.`),
    id, model, system, el("div", {}, button), result);
}

// ---- the live stream ---------------------------------------------------------------------

// Follows the session's event stream with fetch and a stream reader (EventSource cannot send
// the Authorization header), from the last seq seen, reconnecting after a break.
async function follow(page) {
  let delay = 500;
  while (page.alive) {
    try {
      const response = await fetch(`${page.base}/events?after_seq=${page.lastSeq}`, {
        headers: Object.assign({ Accept: "text/event-stream" }, authHeaders()),
        signal: page.abort.signal,
      });
      if (response.status === 401) {
        askForToken("The token was refused.");
        return;
      }
      if (!response.ok || !response.body) throw new Error(`${response.status} ${response.statusText}`);
      setLive("live", true);
      delay = 500;
      await readStream(page, response.body.getReader());
    } catch (error) {
      if (!page.alive) return;
      setLive("reconnecting…", false);
    }
    if (!page.alive) return;
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, 10000);
  }
}

async function readStream(page, reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const message = { event: "message", data: [] };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "data") message.data.push(text);
        else if (field === "event") message.event = text;
        else if (field === "id") message.id = text;
      }
      if (message.data.length) onMessage(page, message.event, message.data.join("\n"));
    }
  }
}

function onMessage(page, kind, data) {
  let value;
  try {
    value = JSON.parse(data);
  } catch (_) {
    return;
  }
  if (kind === "event") {
    if (value.seq <= page.lastSeq) return; // sent before (a reconnect overlaps nothing, but be sure)
    page.events.push(value);
    page.lastSeq = value.seq;
    page.fresh = page.fresh || new Set();
    page.fresh.add(value.seq);
    // A finished model attempt's streamed text is now in the transcript.
    if (value.kind === "model_call_completed" || value.kind === "model_call_failed") {
      const body = value.event[value.kind];
      page.streaming.delete(`${body.turn}/model:${body.round}/${body.attempt}`);
    }
    renderTimeline(page);
    scheduleRefresh(page);
  } else if (kind === "delta") {
    const key = `${value.origin.turn}/${value.origin.activity}/${value.origin.attempt}`;
    const entry = page.streaming.get(key) || { text: "", thinking: "" };
    if (value.delta.text !== undefined) entry.text += value.delta.text;
    if (value.delta.thinking !== undefined) entry.thinking += value.delta.thinking;
    page.streaming.set(key, entry);
    const old = document.getElementById("streaming");
    const live = renderStreaming(page);
    if (old && live) old.replaceWith(live);
    else if (live) page.transcript.append(live);
  } else if (kind === "error") {
    setLive("stream error: " + (value.error ? value.error.message : data), false);
  }
}

// ---- start -------------------------------------------------------------------------------

document.getElementById("forget-token").addEventListener("click", () => {
  localStorage.removeItem(TOKEN_KEY);
  route();
});
window.addEventListener("popstate", route);
route();
