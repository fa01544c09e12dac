// The omniflow dashboard: reads the API (same origin) with the admin key, if the server has keys.
// Pools arrive over SSE (GET /v1/admin/pools/events, read with fetch so the key can be sent);
// the workflow list and an open workflow are re-read when the pools say something changed.
"use strict";

const $ = (sel) => document.querySelector(sel);
const STATES = ["pending", "running", "completed", "failed", "aborted"];
const LIVE = new Set(["pending", "running"]);
const view = { offsets: [0], next: null, filtersKey: "", listing: false, detailId: null, detail: null,
               lastCounts: "", rows: [], stages: [], audioUrl: null, audioFor: null };

// ------------------------------------------------------------------ helpers
function el(tag, attrs, ...children) {
  const node = document.createElementNS(tag.startsWith("svg:") ? "http://www.w3.org/2000/svg"
                                                               : "http://www.w3.org/1999/xhtml",
                                        tag.replace("svg:", ""));
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
const fmtS = (s) => (s === null || s === undefined) ? "–" : s < 1 ? `${Math.round(s * 1000)} ms`
  : s < 120 ? `${s.toFixed(1)} s` : `${Math.round(s / 60)} min`;
const ago = (t) => fmtS(Math.max(0, Date.now() / 1000 - t)) + " ago";
const short = (id) => id.length > 12 ? id.slice(0, 12) + "…" : id;
const key = () => sessionStorage.getItem("omniflow-key") || "";

async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (key()) headers["Authorization"] = `Bearer ${key()}`;
  const resp = await fetch(path, Object.assign({}, opts, { headers }));
  if (resp.status === 401 || resp.status === 403) { askKey(resp.status); throw new Error(`HTTP ${resp.status}`); }
  return resp;
}
async function apiJson(path, opts) {
  const resp = await api(path, opts);
  const body = await resp.json();
  if (!resp.ok) throw new Error(body.error ? `${body.error.code}: ${body.error.message}` : `HTTP ${resp.status}`);
  return body;
}
function askKey(status) {
  $("#auth").hidden = false;
  $("#auth-error").textContent = status === 403 ? "that key is not an admin key" : (key() ? "unknown key" : "");
  setConn("down", "key needed");
}
function setConn(cls, text) { const c = $("#conn"); c.className = `badge ${cls}`; c.textContent = text; }

// ------------------------------------------------------------------ SSE over fetch
async function streamPools() {
  for (;;) {
    try {
      const resp = await api("/v1/admin/pools/events?interval=1");
      if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
      setConn("live", "live");
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut); buf = buf.slice(cut + 2);
          let event = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event: ")) event = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (event === "pools") onPools(JSON.parse(data));
          else if (event === "unavailable") setConn("down", "Redis unreachable");
        }
      }
    } catch (err) {
      if (!$("#auth").hidden) return;            // waiting for a key: streamPools restarts after it
      setConn("down", "reconnecting…");
    }
    await new Promise((r) => setTimeout(r, 1500));
  }
}

// ------------------------------------------------------------------ pools
function onPools(p) {
  $("#inflight-n").textContent = p.in_flight;
  $("#inflight-max").textContent = p.max_in_flight;
  $("#inflight-bar").style.width = `${Math.min(100, 100 * p.in_flight / Math.max(1, p.max_in_flight))}%`;
  $("#pools-at").textContent = `updated ${new Date(p.at * 1000).toLocaleTimeString()}`;
  const pools = $("#pools");
  pools.replaceChildren(...Object.entries(p.stages).map(([name, st]) => poolCard(name, st)));
  renderWorkers(p.workers);
  const stages = Object.keys(p.stages);
  if (stages.join() !== view.stages.join()) { view.stages = stages; fillSelect("#f-stage", stages); }
  $("#counts").textContent = STATES.map((s) => `${s} ${p.workflows[s] ?? 0}`).join(" · ");
  const counts = JSON.stringify(p.workflows);
  const liveRows = view.rows.some((r) => LIVE.has(r.state));
  if (counts !== view.lastCounts || liveRows) { view.lastCounts = counts; loadList(); }
  if (view.detailId && view.detail && LIVE.has(view.detail.state)) loadDetail(view.detailId);
}

function poolCard(name, st) {
  const lm = st.last_minute;
  const rows = [
    ["workers", st.live_workers + (st.draining_workers ? ` (${st.draining_workers} draining)` : ""), "live-workers"],
    ["loading", st.loading_workers ?? 0, "loading-workers"],
    ["busy sessions", `${st.active_sessions} / ${st.capacity}`, "sessions"],
    ["queued · lag · pending", `${st.queued} · ${st.lag} · ${st.pending}`, "queue"],
    ["oldest pending", fmtS(st.oldest_pending_age_s), "oldest-pending"],
    ["oldest unclaimed", fmtS(st.oldest_queued_age_s), "oldest-queued"],
    ["done / min", `${lm.done} (${lm.throughput_per_s.toFixed(2)}/s)`, "throughput"],
    ["p50 · p99", `${fmtS(lm.p50_s)} · ${fmtS(lm.p99_s)}`, "latency"],
    ["failed · retried / min", `${lm.failed} · ${lm.retries}`, "retries"],
    ["dead letters", st.dlq, "dlq"],
  ];
  const dl = el("dl", {});
  for (const [label, value, cls] of rows) dl.append(el("dt", { text: label }), el("dd", { class: cls, text: value }));
  const card = el("div", { class: "pool" + (st.live_workers ? "" : " idle"), "data-stage": name },
                  el("h3", {}, name, el("small", { text: st.live_workers ? "" : "no live worker" })), dl);
  if (st.live_workers === 0) card.querySelector(".live-workers").classList.add("warn");
  return card;
}

// loading: its models (not live yet); lapsed: its lease or loading announcement ran out (dead)
const WORKER_STATE_CLASS = { ready: "", loading: "loading", draining: "warn", stopping: "warn", lapsed: "error" };

function renderWorkers(workers) {
  $("#workers-n").textContent = workers.filter((w) => w.alive).length;
  const body = $("#workers tbody");
  body.replaceChildren(...workers.map((w) => {
    const btn = el("button", { type: "button", text: w.draining ? "undrain" : "drain", disabled: !w.alive });
    btn.addEventListener("click", () => apiJson(`/v1/admin/workers/${encodeURIComponent(w.id)}/${w.draining ? "undrain" : "drain"}`,
                                                { method: "POST" }).catch((e) => alert(e.message)));
    const sessions = w.stages.map((s) => `${s} ${w.sessions[s] ?? 0}/${w.capacity[s] ?? 0}`).join(", ");
    return el("tr", { "data-worker": w.id },
      el("td", {}, el("code", { text: w.id })), el("td", { text: w.stages.join(", ") }),
      el("td", { text: w.host || "–" }), el("td", { text: sessions }),
      el("td", { text: fmtS(w.heartbeat_age_s) }),
      el("td", { class: `worker-state ${WORKER_STATE_CLASS[w.state] ?? ""}`,
                 text: w.state + (w.state_age_s != null ? ` (${fmtS(w.state_age_s)})` : "") }),
      el("td", {}, btn));
  }));
}

function fillSelect(sel, values) {
  const select = $(sel), current = select.value;
  select.replaceChildren(el("option", { value: "", text: "any" }), ...values.map((v) => el("option", { value: v, text: v })));
  select.value = values.includes(current) ? current : "";
}

// ------------------------------------------------------------------ workflow list
function filterQuery() {
  const q = new URLSearchParams();
  const put = (k, v) => { if (v) q.set(k, v); };
  put("state", $("#f-state").value); put("stage", $("#f-stage").value); put("tenant", $("#f-tenant").value.trim());
  put("since_s", $("#f-age").value); put("request_id", $("#f-rid").value.trim());
  return q;
}

async function loadList() {
  if (view.listing || view.detailId) return;
  view.listing = true;
  try {
    const q = filterQuery();
    const fkey = q.toString();
    if (fkey !== view.filtersKey) { view.filtersKey = fkey; view.offsets = [0]; }
    q.set("offset", view.offsets[view.offsets.length - 1]); q.set("limit", 25);
    const page = await apiJson(`/v1/workflows?${q}`);
    view.rows = page.items; view.next = page.next_offset;
    $("#wf-rows").replaceChildren(...page.items.map(listRow));
    if (!page.items.length) $("#wf-rows").append(el("tr", {}, el("td", { colspan: 7, class: "meta",
      text: page.next_offset === null ? "no workflow matches" : `none in the ${page.scanned} records searched; older ›` })));
    const from = page.offset + 1;
    $("#page-info").textContent = page.total !== null && page.total !== undefined
      ? `${page.items.length ? from : 0}–${page.offset + page.items.length} of ${page.total}` : `searched ${page.scanned}`;
    $("#prev").disabled = view.offsets.length <= 1;
    $("#next").disabled = page.next_offset === null;
  } catch (err) { $("#page-info").textContent = err.message; }
  finally { view.listing = false; }
}

function listRow(r) {
  const tr = el("tr", { "data-id": r.id },
    el("td", {}, el("code", { text: short(r.id), title: r.id })), el("td", { text: r.request_id || "" }),
    el("td", { class: `state ${r.state}`, text: r.state }), el("td", { text: r.tenant || "" }),
    el("td", { text: ago(r.created_at), title: new Date(r.created_at * 1000).toISOString() }),
    el("td", { text: r.stages.join(" → ") }), el("td", { class: "err", text: r.error || "" }));
  tr.addEventListener("click", () => { location.hash = `#/wf/${r.id}`; });
  return tr;
}

// ------------------------------------------------------------------ one workflow
async function loadDetail(id) {
  try {
    const [doc, tl] = await Promise.all([apiJson(`/v1/workflows/${id}`), apiJson(`/v1/workflows/${id}/timeline`)]);
    if (view.detailId !== id) return;
    view.detail = doc;
    renderDetail(doc, tl);
  } catch (err) { $("#d-error").textContent = err.message; }
}

function renderDetail(doc, tl) {
  $("#d-id").textContent = doc.id;
  const st = $("#d-state"); st.textContent = doc.state; st.className = `state ${doc.state}`;
  $("#d-meta").textContent = [`tenant ${doc.tenant}`, doc.request_id ? `request ${doc.request_id}` : null,
    `pipeline ${doc.pipeline}`, doc.trace_id ? `trace ${doc.trace_id}` : null, `created ${new Date(doc.created_at * 1000).toLocaleString()}`,
    doc.finished_at ? `took ${fmtS(doc.finished_at - doc.created_at)}` : "still running"].filter(Boolean).join(" · ");
  $("#abort").disabled = !LIVE.has(doc.state);
  $("#retry").disabled = !(doc.state === "failed" || doc.state === "aborted");
  $("#d-error").textContent = doc.error ? `${doc.error_stage ? doc.error_stage + ": " : ""}${doc.error}` : "";
  $("#gantt").replaceChildren(gantt(tl, doc));
  renderOutputs(doc);
  $("#stages tbody").replaceChildren(...Object.entries(doc.stages).map(([name, s]) => el("tr", {},
    el("td", { text: name }), el("td", { class: `state ${s.status}`, text: s.status }), el("td", { text: s.attempt }),
    el("td", { text: s.replica || "–" }), el("td", { class: "err", text: s.error || "" }),
    el("td", { text: s.usage ? JSON.stringify(s.usage) : "" }))));
  renderWebhook(doc.webhook);
}

function renderOutputs(doc) {
  const box = $("#outputs");
  const keep = box.querySelector("audio");            // do not restart a playing player on refresh
  const nodes = [];
  for (const [stage, out] of Object.entries(doc.outputs)) {
    const head = el("b", { text: `${stage} ` }), note = el("small", { text: out.partial ? "(partial)" : "" });
    if (out.type === "text") { nodes.push(el("div", { class: "output", "data-stage": stage }, head, note, el("pre", { text: out.text || "" }))); continue; }
    const card = el("div", { class: "output", "data-stage": stage }, head, note,
      el("span", { text: out.sample_rate ? ` ${out.duration_s.toFixed(2)} s at ${out.sample_rate} Hz` : " no audio yet" }));
    if (!out.partial && out.sample_rate) {
      let player = keep && view.audioFor === `${doc.id}/${stage}` ? keep : null;
      if (!player) {
        player = el("audio", { id: "player", controls: "", preload: "auto" });
        loadAudio(player, doc.id, stage);
      }
      const play = el("button", { id: "play", type: "button", text: "▶ play" });
      play.addEventListener("click", () => player.play());
      card.append(el("div", {}, player, " ", play));
    }
    nodes.push(card);
  }
  box.replaceChildren(...nodes);
}

async function loadAudio(player, id, stage) {
  // <audio src> cannot send the key: fetch the WAV with it and play a blob URL
  const resp = await api(`/v1/workflows/${id}/audio?format=wav&stage=${stage}`);
  if (!resp.ok) return;
  if (view.audioUrl) URL.revokeObjectURL(view.audioUrl);
  view.audioUrl = URL.createObjectURL(await resp.blob());
  view.audioFor = `${id}/${stage}`;
  player.src = view.audioUrl;
}

function renderWebhook(hook) {
  const box = $("#webhook");
  if (!hook) { box.replaceChildren(el("p", { class: "meta", text: "no webhook_url" })); return; }
  const rows = hook.attempts.map((a) => el("tr", {}, el("td", { text: a.attempt }),
    el("td", { text: new Date(a.at * 1000).toLocaleTimeString() }), el("td", { text: a.outcome }),
    el("td", { text: a.status ?? "–" }), el("td", { class: "err", text: a.error || "" })));
  box.replaceChildren(el("p", {}, el("code", { text: hook.url }), ` — ${hook.outcome}`,
      hook.next_attempt_at ? ` (next attempt ${new Date(hook.next_attempt_at * 1000).toLocaleTimeString()})` : ""),
    el("table", { id: "webhook-attempts" }, el("thead", {}, el("tr", {}, ...["attempt", "at", "outcome", "HTTP", "error"]
      .map((h) => el("th", { text: h })))), el("tbody", {}, ...rows)));
}

// The Gantt chart: one lane per stage; per attempt a bar (light while waiting for input) labelled
// with its replica; one tick per output entry; a triangle per retry; the terminal as a dashed line.
function gantt(tl, doc) {
  const laneH = 44, left = 110, right = 20, top = 24;
  const width = Math.max(700, ($("#gantt").clientWidth || 900) - 2);
  const live = LIVE.has(doc.state);
  const nowMs = Math.round(Date.now() - doc.created_at * 1000);
  const span = Math.max(1, live ? Math.max(tl.duration_ms, nowMs) : tl.duration_ms);
  const x = (t) => left + (Math.max(0, t) / span) * (width - left - right);
  const svg = el("svg:svg", { width, height: top + tl.lanes.length * laneH + 10, role: "img",
                              "aria-label": `timeline of workflow ${doc.id}` });
  const axis = el("svg:g", { class: "axis" });
  const step = niceStep(span / 8);
  for (let t = 0; t <= span; t += step) {
    axis.append(el("svg:line", { x1: x(t), x2: x(t), y1: top - 6, y2: top + tl.lanes.length * laneH }),
                el("svg:text", { x: x(t) + 2, y: top - 10, text: t >= 1000 ? `${(t / 1000).toFixed(t % 1000 ? 1 : 0)} s` : `${t} ms` }));
  }
  svg.append(axis);
  tl.lanes.forEach((lane, i) => {
    const y = top + i * laneH;
    const g = el("svg:g", { class: "lane", "data-stage": lane.stage });
    g.append(el("svg:text", { x: 6, y: y + 18, text: lane.stage }));
    for (const a of lane.attempts) {
      const end = a.end ?? (live ? nowMs : tl.duration_ms);
      const runFrom = a.running ?? end;
      if (runFrom > a.start) g.append(titled(el("svg:rect", { class: "wait", x: x(a.start), y: y + 6,
        width: Math.max(1, x(runFrom) - x(a.start)), height: 20 }), `attempt ${a.attempt} waiting for input`));
      const bar = el("svg:rect", { class: `attempt ${a.outcome === "running" ? "run" : a.outcome}`, x: x(runFrom), y: y + 6,
        width: Math.max(2, x(end) - x(runFrom)), height: 20, "data-attempt": a.attempt, "data-replica": a.replica || "" });
      g.append(titled(bar, `attempt ${a.attempt} on ${a.replica || "?"}: ${a.outcome} (${a.start}–${end} ms)`));
      g.append(el("svg:text", { x: x(a.start) + 2, y: y + 38, text: `#${a.attempt} ${a.replica || ""}`.slice(0, 48) }));
    }
    for (const t of lane.ticks) {
      g.append(titled(el("svg:line", { class: `tick tick-${t.kind}`, x1: x(t.t), x2: x(t.t), y1: y + 2, y2: y + 30 }),
                      `${t.kind} ${t.first === t.seq ? "step " + t.seq : "steps " + t.first + "–" + t.seq} at ${t.t} ms`));
    }
    for (const r of lane.retries) {
      const cx = x(r.t);
      g.append(titled(el("svg:path", { class: "retry", d: `M${cx - 5},${y + 32} L${cx + 5},${y + 32} L${cx},${y + 24} Z` }),
                      `retry → attempt ${r.attempt}: ${r.reason}`));
    }
    svg.append(g);
  });
  for (const e of tl.events.filter((ev) => ev.event === "terminal")) {
    svg.append(titled(el("svg:line", { class: "terminal", x1: x(e.t), x2: x(e.t), y1: top - 6, y2: top + tl.lanes.length * laneH }),
                      `${e.state} at ${e.t} ms${e.error ? ": " + e.error : ""}`));
  }
  return svg;
}
function titled(node, text) { node.append(el("svg:title", { text })); return node; }
function niceStep(raw) {
  const p = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1))));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || p * 10;
}

async function act(path, label) {
  $("#action-msg").textContent = `${label}…`;
  try {
    const body = await apiJson(path, { method: "POST" });
    $("#action-msg").textContent = label === "retry" ? `resubmitted as ${body.id}` : `${label}: ${body.state}`;
    if (label === "retry") { location.hash = `#/wf/${body.id}`; return; }
  } catch (err) { $("#action-msg").textContent = err.message; }
  loadDetail(view.detailId);
}

// ------------------------------------------------------------------ routing and wiring
function route() {
  const m = location.hash.match(/^#\/wf\/([A-Za-z0-9_.:-]+)$/);
  view.detailId = m ? m[1] : null;
  view.detail = null;
  $("#detail").hidden = !m;
  $("#list-section").hidden = !!m;
  if (m) { $("#action-msg").textContent = ""; $("#d-error").textContent = ""; loadDetail(m[1]); } else loadList();
}

function start() {
  fillSelect("#f-state", STATES);
  $("#filters").addEventListener("change", () => loadList());
  let timer = null;
  $("#filters").addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(loadList, 300); });
  $("#filters").addEventListener("submit", (e) => { e.preventDefault(); loadList(); });
  $("#next").addEventListener("click", () => { if (view.next !== null) { view.offsets.push(view.next); loadList(); } });
  $("#prev").addEventListener("click", () => { if (view.offsets.length > 1) { view.offsets.pop(); loadList(); } });
  $("#back").addEventListener("click", (e) => { e.preventDefault(); location.hash = ""; });
  $("#abort").addEventListener("click", () => act(`/v1/workflows/${view.detailId}/abort`, "abort"));
  $("#retry").addEventListener("click", () => act(`/v1/workflows/${view.detailId}/retry`, "retry"));
  $("#auth").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("omniflow-key", $("#key").value.trim());
    $("#auth").hidden = true; $("#auth-error").textContent = "";
    streamPools(); route();
  });
  window.addEventListener("hashchange", route);
  streamPools();
  route();
}
start();
