/* SPDX-License-Identifier: Apache-2.0 */
// tallyd's live page: the list of streams and, for the chosen ones, their histograms, kept up
// to date by one event stream (GET api/v1/events, Server-Sent Events at tallyd's publication
// interval). Plain JavaScript, nothing from elsewhere (the Content-Security-Policy allows only
// this origin). The view is in the URL's fragment (#stream=a&stream=b&log=1&last=10s), so it
// can be bookmarked and shared; changing the fragment of an open page changes the view.
//
// A view tallyd refuses (a bookmark with a window longer than its ring, a name that is not a
// stream name) makes the event stream answer an HTTP error, after which EventSource gives up
// without saying why. The page then asks the same URL with fetch to read tallyd's message,
// shows it (#error), and falls back to a view tallyd takes: without the window, then without
// the streams. Other refusals (503: too many event streams, tallyd stopping) are retried.
//
// Each channel's summary says what `tally query` prints for it, in the same words: the count,
// the mean to two decimals ("(in range)" for i32 and u16, whose underflow and overflow it leaves
// out), p50, p90 and p99 ("< lo" and ">= hi" beyond the range), and underflow and overflow.
//
// What a test reads: every row of the list is a <tr data-stream=NAME data-values=N> (hidden
// when the name filter leaves it out); every chosen stream is an <article class="card"
// data-stream=NAME data-updates=N>, with one <div class="channel" data-channel=C data-count=N
// data-p50=V data-p90=V data-p99=V> per channel, its summary as <dd data-key=ROW> items, and a
// <canvas data-heights="h0,...,h255" data-scale=linear|log data-window=...> whose bars are
// those heights (0..1 of the canvas) in that order. performance marks: "first-render" once the
// list and the chosen streams are first drawn, and a measure "update" (from the first event of a
// tick to the end of its drawing) for every live update.
//
// A fleet worker (its list says "fleet") shows the whole fleet: the page asks GET api/v1/streams
// (every member's streams) at the publication interval instead of taking the event stream's
// list, which holds this worker's streams alone, and asks each chosen stream another member
// owns of GET api/v1/streams/NAME (its owner answers through this worker) at the same pace; a
// row and a card of such a stream carry data-member=OWNER, and a list some member did not
// answer in time says so (#partial).
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
    generation: 0, // connections made: a refusal's answer for an older one is ignored
    filter: '', // the list's name filter, lowercase
    member: '', // this worker's member id in a fleet, '' otherwise
    fleetList: null, // a fleet worker's list of the whole fleet (GET api/v1/streams)
    polling: false,
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

  // The fragment changed (a bookmark or a link followed on the open page): show its view.
  function hashChanged() {
    readHash();
    $('log').checked = state.log;
    $('window').value = state.last;
    state.records.clear();
    showError('');
    connect();
    changed();
  }

  // ---- The event stream ------------------------------------------------------------------

  function eventsUrl() {
    const p = new URLSearchParams();
    for (const name of state.chosen) p.append('stream', name);
    if (state.last) p.set('last', state.last);
    return 'api/v1/events?' + p.toString();
  }

  function connect() {
    if (state.source) state.source.close();
    const generation = ++state.generation;
    const url = eventsUrl();
    const source = new EventSource(url);
    source.addEventListener('streams', (e) => {
      state.list = JSON.parse(e.data);
      if (state.list.fleet && !state.polling) startFleet(state.list.fleet.member);
      changed();
    });
    source.addEventListener('stream', (e) => {
      const rec = JSON.parse(e.data);
      state.records.set(rec.stream, rec);
      state.updates.set(rec.stream, (state.updates.get(rec.stream) || 0) + 1);
      changed();
    });
    source.addEventListener('deleted', (e) => {
      const name = JSON.parse(e.data).stream;
      if (ownerOf(name)) return; // another member's: not in this worker's table
      state.records.set(name, null);
      changed();
    });
    source.onopen = () => setStatus('live');
    source.onerror = () => {
      // CONNECTING: the connection was lost and EventSource tries again by itself. CLOSED:
      // tallyd answered with an error, and EventSource will not try again.
      if (source.readyState !== EventSource.CLOSED) {
        setStatus('reconnecting');
        return;
      }
      setStatus('refused');
      refused(url, generation);
    };
    state.source = source;
  }

  function setStatus(s) {
    const el = $('status');
    el.dataset.state = s;
    el.textContent = s;
  }

  function showError(text) {
    $('error').textContent = text;
    $('error').classList.toggle('hidden', !text);
  }

  // tallyd's answer to url, which the event stream could not open: {status, message}. A 200
  // (the refusal has passed) is not read: it would stream.
  async function askWhy(url) {
    const abort = new AbortController();
    try {
      const r = await fetch(url, { signal: abort.signal, cache: 'no-store' });
      if (r.ok) {
        abort.abort();
        return { status: r.status, message: '' };
      }
      const body = await r.json().catch(() => null);
      return { status: r.status, message: (body && body.message) || 'HTTP ' + r.status };
    } catch (e) {
      return { status: 0, message: 'tallyd does not answer' };
    }
  }

  // The event stream of connection `generation` was refused: show why and fall back to a view
  // tallyd takes (a 400 is about the view: first without the window, then without the
  // streams), or try the same view again in 5 s (too many event streams, tallyd stopping).
  async function refused(url, generation) {
    const why = await askWhy(url);
    if (generation !== state.generation) return; // the view changed meanwhile
    let instead = '';
    if (why.status === 400 && state.last) {
      state.last = '';
      $('window').value = '';
      instead = 'showing all time instead';
    } else if (why.status === 400 && state.chosen.length) {
      state.chosen = [];
      instead = 'showing no stream instead';
    }
    if (why.status === 200) { // refused no more: try again, a moment later
      setTimeout(() => { if (generation === state.generation) connect(); }, 1000);
    } else if (instead) {
      state.records.clear();
      showError(why.message + ' (' + instead + ')');
      writeHash();
      connect();
      changed();
    } else {
      showError(why.message + ' (trying again in 5 s)');
      setTimeout(() => { if (generation === state.generation) connect(); }, 5000);
    }
  }

  // ---- A fleet ---------------------------------------------------------------------------

  // The member that owns stream `name` when it is not this worker, else ''.
  function ownerOf(name) {
    const list = state.fleetList;
    const s = list && list.streams.find((e) => e.stream === name);
    return s && s.member && s.member !== state.member ? s.member : '';
  }

  async function getJson(url) {
    try {
      const r = await fetch(url, { cache: 'no-store' });
      return { status: r.status, body: await r.json() };
    } catch (e) {
      return { status: 0, body: null };
    }
  }

  function startFleet(member) {
    state.member = member;
    state.polling = true;
    pollFleet();
  }

  // The whole fleet's list, then the chosen streams other members own; again an interval later.
  async function pollFleet() {
    const list = await getJson('api/v1/streams');
    if (list.status === 200) {
      state.fleetList = list.body;
      $('partial').classList.toggle('hidden', !list.body.fleet.partial);
      changed();
    }
    const generation = state.generation;
    for (const name of state.chosen.filter(ownerOf)) {
      const q = state.last ? '?last=' + encodeURIComponent(state.last) : '';
      const rec = await getJson('api/v1/streams/' + encodeURIComponent(name) + q);
      if (generation !== state.generation || !state.chosen.includes(name)) continue;
      if (rec.status !== 200 && rec.status !== 404) continue; // asked again next time
      state.records.set(name, rec.status === 200 ? rec.body : null);
      if (rec.status === 200) state.updates.set(name, (state.updates.get(name) || 0) + 1);
      changed();
    }
    const every = state.list ? Math.max(state.list.interval_ms, 500) : 1000;
    setTimeout(pollFleet, every);
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
    const list = state.fleetList || state.list;
    if (!list) return;
    updateWindows(list.window_ms);
    const body = $('streams').tBodies[0];
    const rows = [];
    for (const s of list.streams) {
      const tr = document.createElement('tr');
      tr.dataset.stream = s.stream;
      tr.dataset.values = String(s.values === undefined ? '' : s.values);
      if (s.member) tr.dataset.member = s.member;
      tr.hidden = !matches(s.stream);
      const box = document.createElement('input');
      box.type = 'checkbox';
      box.checked = state.chosen.includes(s.stream);
      box.setAttribute('aria-label', 'show ' + s.stream);
      box.addEventListener('change', () => choose(s.stream, box.checked));
      cell(tr, '').appendChild(box);
      const name = cell(tr, s.stream, 'name');
      if (s.member && s.member !== state.member) name.title = 'on ' + s.member;
      cell(tr, s.type || '-');
      cell(tr, shortCount(s.values), 'num').title = String(s.values);
      cell(tr, s.rate === null || s.rate === undefined ? '-' : shortCount(s.rate), 'num');
      const when = cell(tr, ago(s.updated_ms, list.time_ms));
      if (s.updated_ms) when.title = new Date(s.updated_ms).toISOString();
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    notes();
  }

  function matches(name) {
    return !state.filter || name.toLowerCase().includes(state.filter);
  }

  // "No streams yet" once tallyd says so (not before), and what the filter leaves.
  function notes() {
    const list = state.fleetList || state.list;
    const total = list ? list.streams.length : 0;
    const shown = [...$('streams').tBodies[0].rows].filter((r) => !r.hidden).length;
    $('empty').classList.toggle('hidden', !state.list || total > 0);
    $('nomatch').classList.toggle('hidden', total === 0 || shown > 0);
    $('shown').textContent = state.filter && total ? shown + ' of ' + total : '';
  }

  function filterChanged() {
    state.filter = $('filter').value.trim().toLowerCase();
    for (const tr of $('streams').tBodies[0].rows) tr.hidden = !matches(tr.dataset.stream);
    notes();
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
    showError('');
    writeHash();
    connect();
  }

  // ---- The histograms --------------------------------------------------------------------

  function drawCards() {
    const charts = $('charts');
    const cards = [];
    for (const name of state.chosen) {
      if (!state.records.has(name)) continue;
      cards.push([...charts.children].find((c) => c.dataset.stream === name) || newCard(name));
    }
    charts.replaceChildren(...cards);
    // Filled once in the page: a canvas outside it has no size to paint at.
    for (const card of cards)
      fillCard(card, card.dataset.stream, state.records.get(card.dataset.stream));
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
    if (ownerOf(name)) card.dataset.member = ownerOf(name);
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
    // Each quantile is {"q", "value", "side"} (tally_hist_json_quantiles): the marks stand at
    // the value, the summary says it as tally query does.
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
    summary(el.querySelector('dl'), rec, ch);
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

  // C's printf("%.2f"): toFixed rounds the same way except on an exact tie (0.125), which C
  // rounds to even and toFixed up.
  function fixed2(v) {
    const exact = Math.abs(v).toFixed(100);
    const cut = exact.slice(0, exact.indexOf('.') + 3);
    if (!/^\d+\.\d\d50*$/.test(exact) || +cut.slice(-1) % 2) return v.toFixed(2);
    return (v < 0 ? '-' : '') + cut;
  }

  // The mean as tally query computes it (tally_hist_summarize): each in-range value at the
  // centre of its bin's integers, (lo + hi - 1) / 2, summed exactly, then divided once. (The
  // record's "mean" has 10 significant digits: too few for two decimals of a large value.)
  function meanOf(ch) {
    let twice = 0n;
    let n = 0n;
    for (const b of inRange(ch)) {
      if (!b.count) continue;
      twice += BigInt(b.lo + b.hi - 1) * BigInt(b.count);
      n += BigInt(b.count);
    }
    return n === 0n ? null : Number(twice) / Number(2n * n);
  }

  // A quantile as tally query prints it: beyond the range only its side is known.
  function quantileText(rec, quantile) {
    if (!quantile) return '-';
    if (quantile.side === 'underflow') return '< ' + rec.lo;
    if (quantile.side === 'overflow') return '>= ' + rec.hi;
    return String(quantile.value);
  }

  // The rows of tally query's table that the card shows, in its words.
  function summary(dl, rec, ch) {
    const ranged = rec.lo !== undefined;
    const mean = meanOf(ch);
    const qs = ch.quantiles || {};
    const items = [['count', String(ch.count)],
      ['mean', mean === null ? '-' : fixed2(mean) + (ranged ? ' (in range)' : '')]];
    for (const [k] of MARKS) items.push([k, ch.count ? quantileText(rec, qs[k]) : '-']);
    if (ranged) items.push(['underflow', String(ch.underflow)], ['overflow', String(ch.overflow)]);
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
      showError('');
      writeHash();
      connect();
    });
    $('filter').addEventListener('input', filterChanged);
    window.addEventListener('resize', changed);
    window.addEventListener('hashchange', hashChanged);
    connect();
  }

  start();
}());
