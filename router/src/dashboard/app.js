// EdgeSplit dashboard: plain JavaScript, no framework, nothing fetched from the internet.
'use strict';

const $ = (id) => document.getElementById(id);

const EXAMPLES = [
  ['Sky', 'Explain in two sentences why the sky is blue.'],
  ['Haiku', 'Write a haiku about a phone and a laptop sharing one thought.'],
  ['Recipe', 'Give me a short recipe for pancakes, as a numbered list.'],
  ['Code', 'Write a Python function that reverses a string, with a docstring.'],
];

const KEY = 'edgesplit-api-key';

// Headers with the API key, when the user gave one.
function authed(extra) {
  const h = Object.assign({}, extra || {});
  const k = sessionStorage.getItem(KEY);
  if (k) h.authorization = 'Bearer ' + k;
  return h;
}

async function getJson(url) {
  const r = await fetch(url, { cache: 'no-store', headers: authed() });
  if (r.status === 401) {
    $('key-box').hidden = false;
    throw new Error('this router needs an API key');
  }
  return r.json();
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmtBytes(b) {
  if (b === null || b === undefined) return '-';
  if (b >= 1e9) return (b / 1e9).toFixed(2) + ' GB';
  if (b >= 1e6) return (b / 1e6).toFixed(2) + ' MB';
  if (b >= 1e3) return (b / 1e3).toFixed(1) + ' kB';
  return b + ' B';
}

function fmt(x, digits) {
  return (x === null || x === undefined || Number.isNaN(x)) ? '-' : Number(x).toFixed(digits);
}

function setCard(id, up, stateText, rows) {
  const card = $(id);
  card.className = 'card ' + (up ? 'up' : 'down');
  card.querySelector('.state').textContent = stateText;
  const old = card.querySelector('dl');
  if (old) old.remove();
  const dl = el('dl');
  for (const [k, v] of rows) dl.append(el('dt', {}, k), el('dd', {}, v));
  card.append(dl);
}

function nodeRows(n) {
  if (!n.up) return [['address', n.url], ['error', n.error || 'unreachable']];
  return [
    ['model', n.model_id],
    ['fingerprint', (n.model_fingerprint || '').slice(0, 16) + '…'],
    ['build', n.build_id],
    ['device', n.arch + ' (' + n.kernels + '), ' + n.threads + ' threads'],
    ['context', n.n_ctx + ' tokens, flash attention ' + (n.flash_attn ? 'on' : 'off')],
    ['memory available', fmtBytes(n.mem_available_bytes)],
    ['requests in flight', n.requests_in_flight],
    ['prefix cache', n.cached_tokens + ' tokens (' + fmtBytes(n.cached_bytes) + '), ' +
      n.cache_hits + ' hits / ' + n.cache_misses + ' misses'],
    ['address', n.url],
  ];
}

async function refreshStatus() {
  let s;
  try {
    s = await getJson('/dashboard/api/status');
  } catch (e) {
    for (const id of ['card-router', 'card-prefill', 'card-decode', 'card-handoff']) {
      setCard(id, false, 'unknown', [['error', String(e.message || e)]]);
    }
    return;
  }
  const r = s.router;
  if (r.joining && $('devices-panel').hidden) {
    $('devices-panel').hidden = false;
    refreshDevices();
    setInterval(refreshDevices, 2000);
  }
  setCard('card-router', r.up, 'up', [
    ['version', r.version],
    ['default transport', r.default_transport],
    ['requests in flight', r.requests_in_flight],
    ['answered / failed', r.answered + ' / ' + r.failed],
    ['uptime', r.uptime_s + ' s'],
  ]);
  const prows = nodeRows(s.prefill);
  const ls = s.prefill.up && s.prefill.layer_split;
  if (ls) {
    // The layer split: where the layers run and what each token cost the link.
    prows.push(['layer split', ls.state === 'split'
      ? ls.layers_here + ' layers here, last ' + ls.peer_layers + ' + output on ' + ls.peer
      : 'peer ' + ls.peer + ' lost: every layer here']);
    prows.push(['RPC round trips', ls.rpc_round_trips + ' (' + fmtBytes(ls.rpc_bytes_sent) +
      ' sent, ' + fmtBytes(ls.rpc_bytes_received) + ' received), restarts ' + ls.restarts]);
  }
  setCard('card-prefill', s.prefill.up, s.prefill.up ? 'up' : 'down', prows);
  // The `layers` transport is offered while the prefill node serves a layer split.
  const layers = $('transport-layers');
  layers.hidden = layers.disabled = !(ls && ls.state === 'split');
  if (layers.disabled && $('transport').value === 'layers') $('transport').value = 'auto';
  // A card per decode node: the first is the page's own, the others are added after it.
  if (s.decode_nodes.length === 0) {
    setCard('card-decode', false, 'none', [['decode nodes', 'none yet: a device joins with a code, or --decode-url']]);
  }
  const written = s.decode_nodes.reduce((t, d) => t + d.tokens_written, s.prefill.tokens_written || 0);
  s.decode_nodes.forEach((d, i) => {
    const id = i === 0 ? 'card-decode' : 'card-decode-' + i;
    if (!$(id)) {
      const prev = $(i === 1 ? 'card-decode' : 'card-decode-' + (i - 1));
      const card = el('article', { class: 'card unknown', id }, el('h2', {}, 'Decode node'),
        el('p', { class: 'state' }, '…'));
      prev.after(card);
    }
    if (s.decode_nodes.length > 1) {
      $(id).querySelector('h2').textContent = 'Decode node ' + (i + 1) + ' of ' + s.decode_nodes.length;
    }
    const drows = nodeRows(d);
    if (d.up) {
      drows.push(['handoffs received / refused', d.handoffs_received + ' / ' + d.handoffs_refused]);
      drows.push(['KV bytes received', fmtBytes(d.handoff_bytes_received)]);
      if (d.kv_budget_bytes) drows.push(['KV budget', fmtBytes(d.kv_budget_bytes)]);
    }
    if (d.why) drows.push(['not used', d.why]);
    drows.push(['answer tokens written', d.tokens_written +
      (written ? ' (' + fmt(100 * d.tokens_written / written, 0) + '%)' : '')]);
    setCard(id, d.state === 'ready', d.state, drows);
  });
  const h = s.handoff;
  const hrow = (name, x) => [name, x.up ? x.addr + ' (connect ' + fmt(x.connect_ms, 1) + ' ms)' : (x.addr || '-') + ': ' + x.error];
  setCard('card-handoff', h.up, h.up ? 'up' : 'down', [hrow('V2 (TCP)', h.v2), hrow('V1 (HTTP)', h.v1)]);
  $('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
}

async function refreshRecent() {
  let list;
  try {
    list = (await getJson('/dashboard/api/recent')).requests;
  } catch (e) { return; }
  const tbody = $('recent').querySelector('tbody');
  tbody.replaceChildren();
  for (const q of list) {
    const ok = q.status === 'ok';
    tbody.append(el('tr', {},
      el('td', {}, new Date(q.at * 1000).toLocaleTimeString()),
      el('td', {}, q.transport || '-'),
      el('td', { class: ok ? 'status-ok' : 'status-error' }, ok ? (q.finish_reason || 'ok') : (q.code || 'error')),
      el('td', { class: 'num' }, q.prompt_tokens ?? '-'),
      el('td', { class: 'num' }, q.completion_tokens ?? '-'),
      el('td', { class: 'num' }, fmt(q.ttft_ms, 1)),
      el('td', { class: 'num' }, fmt(q.decode_tokens_per_s, 1)),
      el('td', { class: 'num' }, q.handoff_bytes ? fmtBytes(q.handoff_bytes) + ' / ' + fmt(q.handoff_ms, 1) + ' ms' : '-'),
      el('td', { class: 'num' }, q.predicted_ms && q.actual_ms ? q.mode + ' ' + fmt(q.actual_ms / q.predicted_ms, 2) + 'x' : '-'),
      el('td', {}, q.request_id || '-'),
    ));
  }
}

const FIGURES = [
  ['client_ttft_ms', 'TTFT (this page)', (v) => fmt(v, 1) + ' ms'],
  ['ttft_ms', 'TTFT (router)', (v) => fmt(v, 1) + ' ms'],
  ['decode_tokens_per_s', 'decode speed', (v) => fmt(v, 1) + ' tok/s'],
  ['completion_tokens', 'output tokens', (v) => v],
  ['prompt_tokens', 'prompt tokens', (v) => v],
  ['prefill_ms', 'prefill', (v) => fmt(v, 1) + ' ms'],
  ['handoff_bytes', 'handoff size', (v) => v ? fmtBytes(v) : '-'],
  ['handoff_ms', 'handoff time', (v) => v ? fmt(v, 1) + ' ms' : '-'],
  ['import_ms', 'state import', (v) => v ? fmt(v, 1) + ' ms' : '-'],
  ['transport', 'transport', (v) => v],
  ['mode', 'mode (auto)', (v) => v || '-'],
  ['reason', 'why', (v) => v || '-'],
  ['predicted_ms', 'predicted end', (v) => v ? fmt(v, 0) + ' ms' : '-'],
  ['actual_ms', 'actual end', (v) => v ? fmt(v, 0) + ' ms' : '-'],
  ['predicted_tokens', 'predicted answer', (v) => v ? v + ' tokens' : '-'],
  ['first_token_from', 'first token from', (v) => v],
  ['fallback', 'fallback', (v) => v || 'none'],
  ['finish_reason', 'finish', (v) => v],
  ['request_id', 'request id', (v) => v],
];

function showFigures(f) {
  const dl = $('figures');
  dl.replaceChildren();
  for (const [key, label, show] of FIGURES) {
    if (!(key in f)) continue;
    dl.append(el('div', {}, el('dt', {}, label), el('dd', { 'data-key': key }, show(f[key]))));
  }
}

async function run(ev) {
  ev.preventDefault();
  const button = $('run');
  const state = $('run-state');
  const answer = $('answer');
  button.disabled = true;
  answer.textContent = '';
  answer.classList.remove('error');
  $('figures').replaceChildren();
  $('raw').textContent = '';
  state.textContent = 'running…';
  const body = {
    messages: [{ role: 'user', content: $('prompt').value }],
    max_tokens: Number($('max_tokens').value),
    temperature: Number($('temperature').value),
    seed: Number($('seed').value),
    stream: true,
    stream_options: { include_usage: true },
    edgesplit: { transport: $('transport').value },
  };
  const t0 = performance.now();
  let clientTtft = null;
  let pieces = 0;
  answer.dataset.pieces = '0';
  let finish = null;
  let last = null;
  try {
    const res = await fetch('/v1/chat/completions', {
      method: 'POST', headers: authed({ 'content-type': 'application/json' }), body: JSON.stringify(body),
    });
    if (res.status === 401) $('key-box').hidden = false;
    if (!res.ok) {
      const err = await res.json().catch(() => ({ error: { message: res.statusText } }));
      throw new Error('HTTP ' + res.status + ': ' + err.error.message);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = '';
    let done = false;
    while (!done) {
      const chunk = await reader.read();
      if (chunk.done) break;
      buf += decoder.decode(chunk.value, { stream: true });
      let cut;
      while ((cut = buf.indexOf('\n\n')) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const line = event.split('\n').find((l) => l.startsWith('data:'));
        if (!line) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') { done = true; break; }
        const v = JSON.parse(data);
        $('raw').textContent = JSON.stringify(v, null, 2);
        if (v.error) throw new Error(v.error.message);
        const c = v.choices && v.choices[0];
        if (c && c.delta && c.delta.content) {
          if (clientTtft === null) clientTtft = performance.now() - t0;
          answer.textContent += c.delta.content;
          answer.dataset.pieces = String(++pieces); // how many chunks the text arrived in
        }
        if (c && c.finish_reason) finish = c.finish_reason;
        if (v.usage) last = v;
      }
    }
    if (!done) throw new Error('the stream ended without [DONE]');
    const f = Object.assign({}, last ? last.edgesplit : {}, last ? last.usage : {});
    f.client_ttft_ms = clientTtft;
    f.finish_reason = finish;
    showFigures(f);
    state.textContent = 'done in ' + fmt(performance.now() - t0, 0) + ' ms';
  } catch (e) {
    answer.classList.add('error');
    answer.textContent += (answer.textContent ? '\n' : '') + String(e.message || e);
    state.textContent = 'failed';
  } finally {
    button.disabled = false;
    refreshRecent();
    refreshStatus();
  }
}

async function loadBench() {
  const box = $('bench-body');
  let b;
  try {
    b = await getJson('/dashboard/api/bench');
  } catch (e) { box.textContent = 'could not load: ' + e; return; }
  if (!b.available) { box.textContent = b.reason; return; }
  box.className = '';
  box.replaceChildren();
  const run = b.run;
  box.append(el('p', { class: 'muted' }, 'Run ' + run.id + ' of ' + new Date(run.started_at * 1000).toLocaleString() +
    (run.git_rev ? ' (commit ' + run.git_rev + ')' : '') + ': ', el('code', {}, run.command)));
  // One row per (model, link, prompt length, transport): median TTFT, decode speed, e2e, handoff.
  const rows = new Map();
  for (const s of b.summaries) {
    if (s.subject.startsWith('ratio') || s.subject.includes(' x')) continue;
    const key = [s.model, s.profile, s.target_prompt_tokens, s.max_tokens, s.subject].join('|');
    if (!rows.has(key)) rows.set(key, { s, m: {} });
    rows.get(key).m[s.metric] = s.median;
  }
  const t = el('table', {}, el('thead', {}, el('tr', {},
    el('th', {}, 'model'), el('th', {}, 'link'), el('th', { class: 'num' }, 'prompt tok'), el('th', {}, 'transport'),
    el('th', { class: 'num' }, 'TTFT ms'), el('th', { class: 'num' }, 'decode tok/s'), el('th', { class: 'num' }, 'e2e ms'),
    el('th', { class: 'num' }, 'handoff MB'), el('th', { class: 'num' }, 'handoff ms'))));
  const tb = el('tbody');
  for (const { s, m } of rows.values()) {
    tb.append(el('tr', {}, el('td', {}, s.model), el('td', {}, s.profile), el('td', { class: 'num' }, fmt(m.prompt_tokens, 0)),
      el('td', {}, s.subject), el('td', { class: 'num' }, fmt(m.ttft_ms, 1)), el('td', { class: 'num' }, fmt(m.decode_tps, 1)),
      el('td', { class: 'num' }, fmt(m.e2e_ms, 1)), el('td', { class: 'num' }, fmt(m.handoff_mb, 2)),
      el('td', { class: 'num' }, fmt(m.handoff_ms, 1))));
  }
  t.append(tb);
  box.append(el('div', { class: 'scroll' }, t));
  const plots = el('div', { class: 'plots' });
  for (const p of b.plots) plots.append(el('img', { src: '/dashboard/bench/' + p, alt: p, loading: 'lazy' }));
  box.append(plots);
}

// The code this page opened, shown while its pairing is open (the router shows only the
// nameplate of a pairing opened elsewhere: the code is never read back).
let pairCode = null;

function fmtLeft(s) {
  return Math.floor(s / 60) + ':' + String(s % 60).padStart(2, '0');
}

// Devices that join with a code (`/admin/devices`, behind the API key): each one's stage
// (not announced, qualifying, failed its qualification and why, then the pool's
// ready / down / refused), the open pairing, and a button that opens one.
async function refreshDevices() {
  let d;
  try {
    d = await getJson('/admin/devices');
  } catch (e) {
    $('pairing').textContent = String(e.message || e);
    return;
  }
  if (!d.devices) return;
  const p = d.pairing;
  const mine = p && pairCode && pairCode.startsWith(p.nameplate + '-') ? pairCode : null;
  if (!p) pairCode = null;
  $('pairing').textContent = !p ? 'no pairing open'
    : mine ? 'code, ' + fmtLeft(p.expires_in_s) + ' left:'
      : 'a pairing is open under ' + p.nameplate + ', ' + fmtLeft(p.expires_in_s) + ' left';
  $('pair-code').textContent = mine || '';
  $('pair-command').textContent = mine ? 'edgesplit-decode --join ' + mine + ' --model MODEL.gguf' : '';
  $('pair-hint').hidden = !mine;
  $('pair').textContent = p ? 'New code' : 'Pair a device';
  const tb = $('devices').querySelector('tbody');
  tb.replaceChildren();
  if (d.devices.length === 0) {
    tb.append(el('tr', {}, el('td', { colspan: '6', class: 'muted' }, 'none joined yet')));
  }
  for (const dev of d.devices) {
    const bad = /^(failed|down|refused)/.test(dev.state);
    const remove = el('button', { type: 'button', 'data-id': dev.id }, 'Remove');
    remove.addEventListener('click', async () => {
      if (!confirm('Remove ' + dev.name + '? It must join again with a new code.')) return;
      await fetch('/admin/devices/' + encodeURIComponent(dev.id), { method: 'DELETE', headers: authed() });
      refreshDevices();
    });
    tb.append(el('tr', { 'data-id': dev.id }, el('td', {}, dev.name), el('td', {}, dev.id),
      el('td', { class: bad ? 'stage-bad' : dev.state === 'ready' ? 'stage-ok' : '' }, dev.state),
      el('td', {}, dev.agreement || '-'), el('td', {}, dev.url || '-'), el('td', {}, remove)));
  }
}

async function pair() {
  $('pair').disabled = true;
  try {
    const r = await fetch('/admin/pairing', { method: 'POST', headers: authed({ 'content-type': 'application/json' }), body: '{}' });
    const v = await r.json();
    if (r.ok) pairCode = v.code; else $('pairing').textContent = v.error ? v.error.message : 'HTTP ' + r.status;
  } finally {
    $('pair').disabled = false;
  }
  refreshDevices();
}

function init() {
  for (const [name, text] of EXAMPLES) {
    const b = el('button', { type: 'button' }, name);
    b.addEventListener('click', () => { $('prompt').value = text; });
    $('examples').append(b);
  }
  $('run-form').addEventListener('submit', run);
  $('pair').addEventListener('click', pair);
  $('key-box').addEventListener('submit', (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $('api-key').value.trim());
    $('key-box').hidden = true;
    refreshStatus();
    refreshRecent();
    loadBench();
  });
  refreshStatus();
  refreshRecent();
  loadBench();
  setInterval(refreshStatus, 2000);
  setInterval(refreshRecent, 5000);
}

init();
