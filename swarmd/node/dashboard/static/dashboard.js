// swarmd dashboard: polls the JSON API and redraws in place (no reload).
// Every string a peer published is inserted with textContent, never as markup.
"use strict";

const POLL_MS = 2000;
const state = { sortKey: "label", sortAsc: true, peers: [], updates: 0, charts: {} };
window.swarmdDashboard = state;

function text(id, value) {
  document.getElementById(id).textContent = value === null || value === undefined ? "-" : String(value);
}

function fmtNumber(value, digits) {
  return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "-";
}

function fmtBytes(value) {
  if (typeof value !== "number") return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = value, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return v.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtAge(seconds) {
  if (typeof seconds !== "number") return "-";
  if (seconds < 120) return seconds.toFixed(0) + " s";
  if (seconds < 7200) return (seconds / 60).toFixed(0) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

function renderRun(run) {
  text("run-name", run.run);
  const status = document.getElementById("status");
  let message = "live";
  if (run.poll_error) message = "cannot read the DHT: " + run.poll_error;
  else if (run.error) message = run.error;
  else if (!run.found) message = run.polls ? "no config for this run in the DHT (yet)" : "reading the DHT…";
  if (run.refused_values) message += " · " + run.refused_values + " malformed value(s) refused";
  status.textContent = message;
  status.classList.toggle("bad", Boolean(run.poll_error || run.error || !run.found));
  const config = run.config || {};
  text("algo", config.algo);
  let model = config.model === undefined ? null : config.model;
  if (model !== null && typeof config.n_layer === "number" && typeof config.n_embd === "number") {
    model += ", " + config.n_layer + " layers × " + config.n_embd;
  }
  text("model", model);
  text("config-hash", config.hash);
  text("creator", config.creator ? config.creator.slice(0, 10) : null);
  text("age", config.age_s === undefined ? null : fmtAge(config.age_s));
  text("round", run.round);
  text("step", run.step);
  text("peer-count", run.live_peers + " live, " + run.gone_peers + " gone");
  text("tokens", fmtNumber(run.tokens_per_s, 0));
  text("bytes-ratio", typeof run.bytes_ratio === "number" ? fmtNumber(run.bytes_ratio, 1) + "× fewer" : null);
  // Streaming DiLoCo: which fragments' rounds are on the wire, and on how many peers.
  const flights = Object.entries(run.fragments_in_flight || {});
  document.getElementById("fragments-fact").hidden = config.algo !== "streaming-diloco";
  text("fragments", flights.length
    ? flights.map(([fragment, peers]) => "#" + fragment + " (" + peers + " peer" + (peers === 1 ? "" : "s") + ")").join(", ")
    : "none");
}

function sortValue(peer, key) {
  if (key === "label") return (peer.name || peer.short_id).toLowerCase();
  const value = peer[key];
  return value === null || value === undefined ? -Infinity : value;
}

function cell(row, value, className) {
  const td = document.createElement("td");
  td.textContent = value;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function peerRow(peer) {
  const row = document.createElement("tr");
  row.className = peer.live ? "peer live" : "peer gone";
  row.dataset.peerId = peer.peer_id;
  const label = cell(row, peer.name ? peer.name + " (" + peer.short_id + ")" : peer.short_id, "text");
  label.title = peer.peer_id + (peer.address ? " at " + peer.address : "");
  cell(row, peer.live ? "live" : "gone", "state text");
  cell(row, peer.device || "-", "text");
  cell(row, fmtNumber(peer.tokens_per_s, 0));
  cell(row, fmtNumber(peer.loss, 4));
  cell(row, fmtNumber(peer.val_loss, 4));
  cell(row, peer.round === null ? "-" : String(peer.round));
  cell(row, peer.group_size === null ? "-" : peer.group_size + " " + (peer.last_outer || ""));
  const agree = peer.state_agrees === null ? "-" : peer.state_agrees ? "agrees" : "differs";
  const hash = cell(row, agree + (peer.state_hash ? " " + peer.state_hash.slice(0, 8) : ""));
  if (peer.state_agrees === false) hash.classList.add("disagrees");
  cell(row, fmtAge(peer.last_seen_s_ago) + " ago");
  cell(row, fmtBytes(peer.sent_bytes));
  cell(row, fmtBytes(peer.received_bytes));
  return row;
}

function renderPeers() {
  const key = state.sortKey, sign = state.sortAsc ? 1 : -1;
  const peers = state.peers.slice().sort((a, b) => {
    const x = sortValue(a, key), y = sortValue(b, key);
    return x < y ? -sign : x > y ? sign : a.peer_id < b.peer_id ? -1 : 1;
  });
  const body = document.querySelector("#peers tbody");
  body.replaceChildren(...peers.map(peerRow));
  for (const th of document.querySelectorAll("#peers th")) {
    th.classList.toggle("sorted", th.dataset.key === key);
    th.classList.toggle("asc", th.dataset.key === key && state.sortAsc);
  }
}

function renderStages(view) {
  const section = document.getElementById("stages-section");
  section.hidden = view.stages.length === 0;
  text("pipeline-rate", fmtNumber(view.pipeline_rate, 1));
  const body = document.querySelector("#stages tbody");
  body.replaceChildren(...view.stages.map((stage) => {
    const row = document.createElement("tr");
    row.className = stage.bottleneck ? "stage bottleneck" : "stage";
    row.dataset.stage = String(stage.stage);
    cell(row, String(stage.stage) + (stage.bottleneck ? " (bottleneck)" : ""), "text");
    cell(row, fmtNumber(stage.rate, 1));
    const names = stage.servers.map((s) =>
      s.label + (s.state === "serving" ? "" : " (" + s.state + ")") + " " + fmtNumber(s.rate, 1) + "/s");
    cell(row, names.length ? names.join(", ") : "none: trainers wait", "text");
    return row;
  }));
  renderEvents(view.recoveries || [], "recoveries", "none");
}

function renderEvents(events, id = "events", empty = null) {
  const list = document.getElementById(id);
  if (!events.length && empty !== null) {
    const item = document.createElement("li");
    item.textContent = empty;
    list.replaceChildren(item);
    return;
  }
  list.replaceChildren(...events.map((event) => {
    const item = document.createElement("li");
    item.className = event.kind;
    const when = new Date(event.time * 1000).toLocaleTimeString();
    item.textContent = when + "  " + event.text;
    return item;
  }));
}

function chart(name, element, series, data, xTime, yLog) {
  const old = state.charts[name];
  const labels = series.map((s) => s.label).join("\u0000");
  if (old && old.labels === labels) {
    old.plot.setData(data);
    return;
  }
  if (old) old.plot.destroy();
  const palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"];
  const opts = {
    width: 460, height: 240,
    // A log y axis where the series differ by orders of magnitude (bytes against DDP).
    scales: yLog ? { x: { time: xTime }, y: { distr: 3 } } : { x: { time: xTime } },
    // Byte counts as KiB/MiB on a log axis: raw numbers there are too wide for the gutter.
    axes: yLog ? [{}, { size: 80, values: (u, ticks) => ticks.map(fmtBytes) }] : undefined,
    series: [{ label: xTime ? "time" : "round" }].concat(series.map((s, i) => ({
      label: s.label, stroke: palette[i % palette.length], spanGaps: true,
      points: { show: true, size: 5 },
    }))),
  };
  state.charts[name] = { labels: labels, plot: new uPlot(opts, data, element) };
}

function renderHistory(history) {
  const loss = history.loss;
  chart("loss", document.getElementById("loss-chart"),
    loss.series.map((s) => ({ label: s.label })),
    [loss.rounds].concat(loss.series.map((s) => s.values)), false);
  chart("tokens", document.getElementById("tokens-chart"), [{ label: "tokens/s" }],
    [history.tokens.times, history.tokens.values], true);
  chart("groups", document.getElementById("groups-chart"), [{ label: "group size" }],
    [history.groups.rounds, history.groups.sizes], false);
  const bytes = history.bytes;
  chart("bytes", document.getElementById("bytes-chart"),
    [{ label: "swarm (B/step)" }, { label: "data-parallel (B/step)" }],
    [bytes.times, bytes.swarm, bytes.ddp], true, true);
}

async function refresh() {
  try {
    const [run, peers, events, history, stages] = await Promise.all(
      ["/api/run", "/api/peers", "/api/events", "/api/history", "/api/stages"].map(getJson));
    renderRun(run);
    state.peers = peers.peers;
    renderPeers();
    renderStages(stages);
    renderEvents(events.events);
    renderHistory(history);
    state.updates += 1;
    text("updates", state.updates);
  } catch (error) {
    const status = document.getElementById("status");
    status.textContent = "dashboard unreachable: " + error.message;
    status.classList.add("bad");
  }
}

function start() {
  for (const th of document.querySelectorAll("#peers th")) {
    th.addEventListener("click", () => {
      state.sortAsc = state.sortKey === th.dataset.key ? !state.sortAsc : true;
      state.sortKey = th.dataset.key;
      renderPeers();
    });
  }
  refresh();
  setInterval(refresh, POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
