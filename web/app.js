/* SPDX-License-Identifier: Apache-2.0 */
// tallyd's live page: the list of streams and, for the chosen ones, their histograms, kept up
// to date by one event stream (GET api/v1/events, Server-Sent Events at tallyd's publication
// interval). Plain JavaScript, nothing from elsewhere (the Content-Security-Policy allows only
// this origin). The view is in the URL's fragment (#stream=a&stream=b&log=1&last=10s), so it
// can be bookmarked and shared.
//
// What a test reads: every row of the list is a <tr data-stream=NAME data-values=N>; every
// chosen stream is an <article class="card" data-stream=NAME data-updates=N>, with one
// <div class="channel" data-channel=C data-count=N data-p50=V data-p90=V data-p99=V> per
// channel and a <canvas data-heights="h0,...,h255" data-scale=linear|log data-window=...>
// whose bars are those heights (0..1 of the canvas) in that order. performance marks:
// "first-render" once the list and the chosen streams are first drawn, and a measure "update"
// (from the first event of a tick to the end of its drawing) for every live update.
'use strict';

(function () {
  const WINDOWS = [['5s', 5000], ['10s', 10000], ['30s', 30000], ['1m', 60000], ['5m', 300000],
    ['15m', 900000], ['1h', 3600000]];
  const COLOURS = { '': '#2f6f9f', r: '#c62828', g: '#2e7d32', b: '#1565c0', a: '#616161' };
  const MARKS = [['p50', '#111'], ['p90', '#b26a00'], ['p99', '#b71c1c']];

  const state = {
    chosen: [], // names, in the order chosen
    log: false,
    last: '', // '' for all time
    list: null, // the last `streams` event
    records: new Map(), // name -> the last `stream` event's record, or null when deleted
    updates: new Map(), // name -> records received
    source: null,
    dirty: false,
    tickStart: 0,
    firstDrawn: false,
    windowMs: -1,
  };

  const $ = (id) => document.getElementById(id);

  // ---- The view in the URL's fragment ----------------------------------------------------

  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    state.chosen = p.getAll('stream');
    state.log = p.get('log') === '1';
    state.last = p.get('last') || '';
  }

  function writeHash() {
    const p = new URLSearchParams();
    for (const name of state.chosen) p.append('stream', name);
    if (state.log) p.set('log', '1');
    if (state.last) p.set('last', state.last);
    history.replaceState(null, '', '#' + p.toString());
  }

  // ---- The event stream ------------------------------------------------------------------

  function connect() {
    if (state.source) state.source.close();
    const p = new URLSearchParams();
    for (const name of state.chosen) p.append('stream', name);
    if (state.last) p.set('last', state.last);
    const source = new EventSource('api/v1/events?' + p.toString());
    source.addEventListener('streams', (e) => { state.list = JSON.parse(e.data); changed(); });
    source.addEventListener('stream', (e) => {
      const rec = JSON.parse(e.data);
      state.records.set(rec.stream, rec);
      state.updates.set(rec.stream, (state.updates.get(rec.stream) || 0) + 1);
      changed();
    });
    source.addEventListener('deleted', (e) => {
      state.records.set(JSON.parse(e.data).stream, null);
      changed();
    });
    source.onopen = () => setStatus('live');
    source.onerror = () => setStatus('reconnecting');
    state.source = source;
  }

  function setStatus(s) {
    const el = $('status');
    el.dataset.state = s;
    el.textContent = s;
  }

  // Events of one tick arrive together: draw once, at the next frame.
  function changed() {
    if (state.dirty) return;
    state.dirty = true;
    state.tickStart = performance.now();
    requestAnimationFrame(draw);
  }

  function draw() {
    state.dirty = false;
    drawList();
    drawCards();
    if (!state.firstDrawn && state.list && state.chosen.every((n) => state.records.has(n))) {
      state.firstDrawn = true;
      performance.mark('first-render');
    } else if (state.firstDrawn) {
      performance.measure('update', { start: state.tickStart, end: performance.now() });
    }
  }

  // ---- The list --------------------------------------------------------------------------

  function shortCount(v) {
    if (v === null || v === undefined) return '-';
    const units = ['', 'k', 'M', 'G', 'T'];
    let i = 0;
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
    return (i ? v.toPrecision(3) : String(Math.round(v * 10) / 10)) + units[i];
  }

  function ago(ms, now) {
    if (!ms) return '-';
    const s = Math.max(0, Math.round((now - ms) / 1000));
    if (s < 60) return s + ' s ago';
    if (s < 3600) return Math.floor(s / 60) + ' min ago';
    return new Date(ms).toISOString().replace('T', ' ').slice(0, 19) + ' UTC';
  }

  function cell(tr, text, cls) {
    const td = document.createElement('td');
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  function drawList() {
    const list = state.list;
    if (!list) return;
    updateWindows(list.window_ms);
    const body = $('streams').tBodies[0];
    const rows = [];
    for (const s of list.streams) {
      const tr = document.createElement('tr');
      tr.dataset.stream = s.stream;
      tr.dataset.values = String(s.values);
      const box = document.createElement('input');
      box.type = 'checkbox';
      box.checked = state.chosen.includes(s.stream);
      box.setAttribute('aria-label', 'show ' + s.stream);
      box.addEventListener('change', () => choose(s.stream, box.checked));
      cell(tr, '').appendChild(box);
      cell(tr, s.stream, 'name');
      cell(tr, s.type || '-');
      cell(tr, shortCount(s.values), 'num').title = String(s.values);
      cell(tr, s.rate === null ? '-' : shortCount(s.rate), 'num');
      const when = cell(tr, ago(s.updated_ms, list.time_ms));
      if (s.updated_ms) when.title = new Date(s.updated_ms).toISOString();
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    $('empty').classList.toggle('hidden', list.streams.length > 0);
  }

  function updateWindows(windowMs) {
    if (windowMs === state.windowMs) return;
    state.windowMs = windowMs;
    const select = $('window');
    const options = [new Option('all time', '')];
    for (const [label, ms] of WINDOWS)
      if (ms <= windowMs) options.push(new Option('last ' + label, label));
    select.replaceChildren(...options);
    select.disabled = options.length === 1;
    select.value = state.last;
  }

  function choose(name, on) {
    state.chosen = state.chosen.filter((n) => n !== name);
    if (on) state.chosen.push(name);
    for (const n of [...state.records.keys()])
      if (!state.chosen.includes(n)) state.records.delete(n);
    writeHash();
    connect();
  }

  // ---- The histograms --------------------------------------------------------------------

  function drawCards() {
    const charts = $('charts');
    const cards = [];
    for (const name of state.chosen) {
      if (!state.records.has(name)) continue;
      let card = [...charts.children].find((c) => c.dataset.stream === name);
      if (!card) card = newCard(name);
      fillCard(card, name, state.records.get(name));
      cards.push(card);
    }
    charts.replaceChildren(...cards);
  }

  function newCard(name) {
    const card = document.createElement('article');
    card.className = 'card';
    card.dataset.stream = name;
    const h = document.createElement('h2');
    h.appendChild(document.createTextNode(name));
    h.appendChild(document.createElement('small'));
    card.appendChild(h);
    return card;
  }

  function fillCard(card, name, rec) {
    card.dataset.updates = String(state.updates.get(name) || 0);
    card.dataset.deleted = String(rec === null);
    const small = card.querySelector('h2 small');
    if (rec === null) {
      small.textContent = 'no such stream';
      card.querySelectorAll('.channel').forEach((c) => c.remove());
      return;
    }
    const win = rec.window ? ' · last ' + state.last : '';
    small.textContent = (rec.type || 'no histogram') + (rec.lo !== undefined
      ? ' [' + rec.lo + ', ' + rec.hi + ')' : '') + win;
    const channels = rec.channels || [Object.assign({ channel: '' }, rec)];
    const have = [...card.querySelectorAll('.channel')];
    if (have.length !== channels.length) {
      have.forEach((c) => c.remove());
      for (const ch of channels) card.appendChild(newChannel(ch.channel));
    }
    card.querySelectorAll('.channel').forEach((el, i) => fillChannel(el, rec, channels[i]));
  }

  function newChannel(channel) {
    const el = document.createElement('div');
    el.className = 'channel';
    el.dataset.channel = channel;
    if (channel) {
      const h = document.createElement('h3');
      h.textContent = channel;
      el.appendChild(h);
    }
    el.appendChild(document.createElement('canvas'));
    const dl = document.createElement('dl');
    dl.className = 'summary';
    el.appendChild(dl);
    return el;
  }

  // The 256 in-range bins (a ranged histogram's bins also list underflow and overflow).
  function inRange(ch) {
    return ch.bins.length === 258 ? ch.bins.slice(1, 257) : ch.bins;
  }

  // Where value v falls among the 256 bars.
  function barOf(rec, v) {
    if (rec.lo === undefined) return Math.min(255, Math.max(0, v));
    const b = Math.floor((v - rec.lo) * 256 / (rec.hi - rec.lo));
    return Math.min(255, Math.max(0, b));
  }

  function fillChannel(el, rec, ch) {
    // Each quantile is {"q", "value", "side"} (tally_hist_json_quantiles): the page shows the value.
    const q = {};
    for (const [k, v] of Object.entries(ch.quantiles || {})) q[k] = v.value;
    el.dataset.count = String(ch.count);
    for (const [k] of MARKS) el.dataset[k] = q[k] === undefined ? '' : String(q[k]);
    const bins = inRange(ch).map((b) => b.count);
    const max = Math.max(0, ...bins);
    const heights = bins.map((c) => (max === 0 ? 0 : state.log ? Math.log1p(c) / Math.log1p(max)
      : c / max));
    const canvas = el.querySelector('canvas');
    canvas.dataset.heights = heights.map((h) => h.toFixed(4)).join(',');
    canvas.dataset.scale = state.log ? 'log' : 'linear';
    canvas.dataset.window = state.last || 'all';
    paint(canvas, heights, COLOURS[ch.channel] || COLOURS[''],
      MARKS.filter(([k]) => q[k] !== undefined).map(([k, c]) => [k, c, barOf(rec, q[k])]));
    summary(el.querySelector('dl'), ch, q);
  }

  function paint(canvas, heights, colour, marks) {
    const ratio = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const h = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== w) canvas.width = w;
    if (canvas.height !== h) canvas.height = h;
    const g = canvas.getContext('2d');
    g.clearRect(0, 0, w, h);
    const top = 34 * ratio; // room for the three quantile labels, one row each
    const step = w / heights.length;
    g.fillStyle = colour;
    heights.forEach((v, i) => {
      if (v > 0) {
        const bar = Math.max(1, v * (h - top));
        g.fillRect(i * step, h - bar, Math.max(1, step - (step > 3 ? 1 : 0)), bar);
      }
    });
    g.font = (10 * ratio) + 'px system-ui, sans-serif';
    marks.forEach(([name, c, bar], i) => {
      const x = Math.round((bar + 0.5) * step) + 0.5;
      g.strokeStyle = c;
      g.fillStyle = c;
      g.lineWidth = ratio;
      g.beginPath();
      g.moveTo(x, top);
      g.lineTo(x, h);
      g.stroke();
      const tw = g.measureText(name).width;
      g.fillText(name, Math.min(Math.max(0, x - tw / 2), w - tw), (10 + i * 11) * ratio);
    });
  }

  function summary(dl, ch, q) {
    const items = [['count', shortCount(ch.count)],
      ['mean', ch.mean === null ? '-' : (Math.round(ch.mean * 100) / 100).toString()]];
    for (const [k] of MARKS) items.push([k, q[k] === undefined ? '-' : String(q[k])]);
    if (ch.underflow || ch.overflow) items.push(['under/over', ch.underflow + '/' + ch.overflow]);
    dl.replaceChildren(...items.map(([k, v]) => {
      const div = document.createElement('div');
      const dt = document.createElement('dt');
      const dd = document.createElement('dd');
      dt.textContent = k;
      dd.textContent = v;
      dd.dataset.key = k;
      div.append(dt, dd);
      return div;
    }));
  }

  // ---- Start -----------------------------------------------------------------------------

  function start() {
    readHash();
    $('log').checked = state.log;
    $('log').addEventListener('change', () => {
      state.log = $('log').checked;
      writeHash();
      changed();
    });
    $('window').addEventListener('change', () => {
      state.last = $('window').value;
      state.records.clear();
      writeHash();
      connect();
    });
    window.addEventListener('resize', changed);
    connect();
  }

  start();
}());
