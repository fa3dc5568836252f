// The fleetbus dashboard page. Everything shown comes from the bus: session ids,
// tool arguments and outputs are untrusted text, so the page only ever sets
// textContent, never markup, and builds elements one by one.
"use strict";

const MAX_EVENT_ROWS = 500;
const token = document.querySelector('meta[name="fleetbus-token"]').content;
let selected = null; // {agent, session}
let sessionSource = null;
let lastSnapshot = null;

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "class") node.className = value;
    else if (key === "data") Object.assign(node.dataset, value);
    else if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function setBadge(id, text, good) {
  const badge = document.getElementById(id);
  badge.textContent = text;
  badge.className = "badge " + (good ? "good" : "bad");
}

function replaceRows(tableId, rows) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows);
}

function clock(iso) {
  if (!iso) return "";
  const when = new Date(iso);
  return isNaN(when) ? String(iso) : when.toLocaleTimeString();
}

function statusCell(status) {
  return el("td", { class: "status-" + status }, status);
}

// -- the fleet ------------------------------------------------------------------------

function renderFleet(snap) {
  lastSnapshot = snap;
  document.getElementById("prefix").textContent = "prefix " + snap.prefix;
  setBadge("bus-status", snap.bus.connected ? "bus: connected" : "bus: disconnected",
    snap.bus.connected);
  const errors = document.getElementById("errors");
  const problems = Object.values(snap.errors || {});
  errors.hidden = problems.length === 0;
  errors.textContent = problems.join("\n");

  replaceRows("agents", snap.agents.map((a) => el("tr", { data: { agent: a.name } },
    el("td", {}, a.name),
    el("td", {}, a.replicas.map((r) => r.replica).join(", ") || "none seen"),
    el("td", {}, a.sessions), el("td", {}, a.running), el("td", {}, a.paused),
    el("td", { class: "dim" }, a.sources.join(", ")))));

  const workerRows = [];
  for (const w of snap.workers) {
    const endpoints = w.endpoints.length ? w.endpoints : [null];
    for (const e of endpoints) {
      workerRows.push(el("tr", { data: { worker: w.worker_id, tool: e ? e.name : "" } },
        el("td", {}, w.worker_id), el("td", {}, e ? e.name : "no tools"),
        el("td", { class: "requests" }, e ? e.num_requests : ""),
        el("td", { class: "errors-count" }, e ? e.num_errors : ""),
        el("td", {}, e && e.average_ms !== null ? e.average_ms.toFixed(2) : ""),
        el("td", { class: "dim" }, e ? e.last_error : "")));
    }
  }
  if (!workerRows.length) {
    workerRows.push(el("tr", {}, el("td", { colspan: 6, class: "dim" },
      "no tool worker of this fleet answered $SRV.STATS")));
  }
  replaceRows("workers", workerRows);

  document.getElementById("session-count").textContent =
    `(${snap.sessions.length}; at most ${snap.limits.sessions} listed)`;
  replaceRows("sessions", snap.sessions.map((s) => {
    const row = el("tr", { data: { agent: s.agent, session: s.session, status: s.status } },
      el("td", {}, s.agent), el("td", {}, s.session), statusCell(s.status),
      el("td", {}, s.step), el("td", { class: "dim" }, s.owner || ""),
      el("td", {}, clock(s.updated_at)), el("td", { class: "dim" }, s.last_event || ""),
      el("td", {}, s.last_answer || ""));
    if (selected && selected.agent === s.agent && selected.session === s.session) {
      row.classList.add("selected");
    }
    row.addEventListener("click", () => select(s.agent, s.session));
    return row;
  }));

  renderPaused(snap.sessions.filter((s) => s.status === "paused" && s.pending.length));
  if (selected) {
    const current = snap.sessions.find(
      (s) => s.agent === selected.agent && s.session === selected.session);
    if (current) {
      const status = document.getElementById("detail-status");
      status.textContent = current.status;
      status.className = "badge status-" + current.status;
      document.getElementById("detail-answer").textContent = current.last_answer || "";
    }
  }
}

let pausedKey = null;

function renderPaused(paused) {
  document.getElementById("paused-empty").hidden = paused.length > 0;
  // Drawn again only when what waits changes: a person may be typing in a card.
  const key = JSON.stringify(paused.map((s) => [s.agent, s.session, s.pending]));
  if (key === pausedKey) return;
  pausedKey = key;
  const cards = paused.map((s) => {
    const always = el("input", { type: "checkbox", class: "always" });
    const card = el("div", { class: "pending", data: { agent: s.agent, session: s.session } },
      el("div", {}, el("strong", {}, s.agent), " · session ", el("strong", {}, s.session),
        " · step ", s.step),
      el("label", { class: "dim" }, always, " always (add a rule for these tools)"));
    for (const call of s.pending) {
      card.append(call.kind === "confirm"
        ? confirmCall(s, call, always) : externalCall(s, call));
    }
    return card;
  });
  document.getElementById("paused").replaceChildren(...cards);
}

function callHead(call, note) {
  return [el("strong", {}, call.tool_name), el("code", {}, call.parameters),
    el("span", { class: "dim" }, note)];
}

// A call to confirm: allow or deny it, or allow it with an edited input; allow
// rules the agent suggests can be accepted with it.
function confirmCall(s, call, always) {
  const buttons = [];
  const disable = () => buttons.forEach((b) => { b.disabled = true; });
  const rules = (call.suggested_rules || []).map((rule) => {
    const box = el("input", { type: "checkbox", class: "rule", data: { rule } });
    return { rule, box, label: el("label", { class: "dim" }, box, " accept rule ", el("code", {}, rule)) };
  });
  const accepted = () => rules.filter((r) => r.box.checked).map((r) => r.rule);
  const edit = el("textarea", { class: "edit-input", rows: 3, cols: 60, hidden: "",
    "aria-label": `input of ${call.call_id}` });
  edit.value = call.clipped ? "" : call.parameters;
  if (call.clipped) edit.setAttribute("placeholder", "the input, as a JSON object");
  const send = (decision) => () => {
    disable();
    confirm(s.agent, s.session, call.call_id, { ...decision, always: always.checked,
      accept_rules: decision.deny ? [] : accepted() });
  };
  const allowEdited = el("button", { class: "allow-edited", data: { call: call.call_id },
    hidden: "" }, "Allow edited");
  allowEdited.addEventListener("click", () => {
    let input;
    try {
      input = JSON.parse(edit.value);
    } catch (error) {
      report(`${s.session}: the edited input is not JSON (${error.message})`);
      return;
    }
    if (input === null || typeof input !== "object" || Array.isArray(input)) {
      report(`${s.session}: the edited input must be a JSON object`);
      return;
    }
    send({ edits: { [call.call_id]: input } })();
  });
  const editButton = el("button", { class: "edit", data: { call: call.call_id } }, "Edit…");
  editButton.addEventListener("click", () => {
    edit.hidden = !edit.hidden;
    allowEdited.hidden = edit.hidden;
    if (!edit.hidden) edit.focus();
  });
  buttons.push(
    el("button", { class: "allow", data: { call: call.call_id },
      onclick: send({ allow: [call.call_id] }) }, "Allow"),
    el("button", { class: "deny", data: { call: call.call_id },
      onclick: send({ deny: [call.call_id] }) }, "Deny"),
    editButton, allowEdited);
  return el("div", { class: "call", data: { call: call.call_id } },
    ...callHead(call, `call ${call.call_id}` + (call.rule ? ` (rule ${call.rule})` : "")),
    ...buttons.slice(0, 3),
    el("div", { class: "edit-form" }, edit, allowEdited),
    ...rules.map((r) => el("div", {}, r.label)));
}

// A call to run outside the agent: its output (JSON) or why it failed.
function externalCall(s, call) {
  const output = el("textarea", { class: "result-input", rows: 2, cols: 60,
    placeholder: "the output, as JSON (a text in quotes); or why the call failed",
    "aria-label": `result of ${call.call_id}` });
  const buttons = [];
  const sendResult = el("button", { class: "send-result", data: { call: call.call_id } },
    "Send result");
  const sendError = el("button", { class: "send-error", data: { call: call.call_id } },
    "Send as failed");
  buttons.push(sendResult, sendError);
  sendResult.addEventListener("click", () => {
    let value;
    try {
      value = JSON.parse(output.value);
    } catch (error) {
      report(`${s.session}: the result is not JSON (${error.message}); put a text in quotes`);
      return;
    }
    buttons.forEach((b) => { b.disabled = true; });
    resume(s.agent, s.session, call.call_id, { results: { [call.call_id]: value } });
  });
  sendError.addEventListener("click", () => {
    buttons.forEach((b) => { b.disabled = true; });
    resume(s.agent, s.session, call.call_id,
      { errors: { [call.call_id]: output.value || "the call failed" } });
  });
  return el("div", { class: "call", data: { call: call.call_id } },
    ...callHead(call, `call ${call.call_id}: to run outside the agent`),
    el("div", { class: "edit-form" }, output, ...buttons));
}

function report(text) {
  document.getElementById("confirm-result").textContent = text;
}

async function post(session, action, agent, body) {
  const path = `/api/sessions/${encodeURIComponent(agent)}/${encodeURIComponent(session)}/${action}`;
  try {
    const response = await fetch(path, {
      method: "POST",
      headers: { "content-type": "application/json", "x-fleetbus-token": token },
      body: JSON.stringify(body),
    });
    const answer = await response.json();
    report(response.ok
      ? `${session}: ${answer.message}`
      : `${session}: not sent: ${answer.message || answer.error}`);
  } catch (error) {
    report(`${session}: the dashboard did not answer (${error})`);
  }
  pausedKey = null; // a refused answer leaves the call waiting: its buttons again
  if (lastSnapshot) renderFleet(lastSnapshot);
}

async function confirm(agent, session, callId, decision) {
  const verb = decision.edits ? "allowing (edited)" : decision.allow ? "allowing" : "denying";
  report(`${verb} ${callId}…`);
  await post(session, "confirm", agent, decision);
}

async function resume(agent, session, callId, results) {
  report(`sending the result of ${callId}…`);
  await post(session, "resume", agent, results);
}

// -- one session's events -------------------------------------------------------------

function describe(item) {
  const data = item.data || {};
  switch (item.type) {
    case "event":
      switch (item.event) {
        case "text_delta": case "thinking_delta": return data.text || "";
        case "tool_call":
          return `${data.tool_name || ""}(${JSON.stringify(data.parameters || {})})`;
        case "tool_result":
          return `${data.tool_name || ""}: ${data.status || ""} — ${JSON.stringify(data.output)}`;
        case "require_user_confirm": case "require_external_execution":
          return (data.calls || []).map((c) => `${c.tool_name} ${c.call_id}`).join(", ");
        case "reply_end":
          return (data.finished_reason || "") +
            (data.handoff && data.handoff.agent ? ` → ${data.handoff.agent}` : "");
        case "guardrail":
          return `${data.name || ""} on ${data.stage || ""}` +
            (data.tool_name ? ` ${data.tool_name}` : "") +
            `: ${data.action || ""}` + (data.reason ? ` — ${data.reason}` : "");
        default: return typeof data === "string" ? data : JSON.stringify(data);
      }
    case "final_answer":
      return `${item.finished_reason}` +
        (item.handoff && item.handoff.agent ? ` → ${item.handoff.agent}` : "") +
        (item.guardrail ? ` (guardrail ${item.guardrail.name} on ${item.guardrail.stage})` : "") +
        ": " + (typeof item.content === "string"
        ? item.content : JSON.stringify(item.content));
    default: return JSON.stringify(item);
  }
}

function addEvent(item) {
  const list = document.getElementById("events");
  const kind = item.type === "event" ? item.event : item.type;
  list.append(el("li", { data: { kind } }, el("span", { class: "dim" }, clock(item.timestamp)),
    " ", el("span", { class: "kind" }, kind), describe(item)));
  while (list.children.length > MAX_EVENT_ROWS) list.firstChild.remove();
  list.scrollTop = list.scrollHeight;
}

function select(agent, session) {
  selected = { agent, session };
  if (sessionSource) sessionSource.close();
  document.getElementById("detail").hidden = false;
  document.getElementById("detail-title").textContent = `${agent} · ${session}`;
  document.getElementById("events").replaceChildren();
  const path = `/api/sessions/${encodeURIComponent(agent)}/${encodeURIComponent(session)}/stream`;
  const seen = new Set();
  sessionSource = new EventSource(path);
  sessionSource.addEventListener("message", (e) => {
    const item = JSON.parse(e.data);
    if (seen.has(item.id)) return; // sent again after a reconnection
    if (seen.size > 5000) seen.clear();
    seen.add(item.id);
    addEvent(item);
  });
  if (lastSnapshot) renderFleet(lastSnapshot);
}

// -- the live connection ----------------------------------------------------------------

function connect() {
  const source = new EventSource("/api/fleet/stream");
  source.addEventListener("open", () => setBadge("page-status", "dashboard: connected", true));
  source.addEventListener("fleet", (e) => renderFleet(JSON.parse(e.data)));
  source.addEventListener("error", () => {
    // The browser reconnects on its own (the server asks for 2 s).
    setBadge("page-status", "dashboard: disconnected, reconnecting…", false);
    setBadge("bus-status", "bus: unknown", false);
  });
}

connect();
