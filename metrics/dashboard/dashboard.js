// rackrun's built-in dashboard: polls the coordinator's read-only JSON views once a second
// (metrics/dashboard.h lists them) and draws them without reloading. uPlot draws the line
// charts; the heatmaps are plain canvases. window.rackrunDashboard exposes counters the
// browser test reads (polls, points added to charts, errors).
'use strict';

(() => {
  const POLL_MS = 1000;
  const KEEP_STEPS = 2000;   // points kept per chart
  const KEEP_HEAT = 300;     // heatmap columns (steps / samples) kept
  const state = {
    polls: 0, points: 0, errors: [], jobId: null, next: 0, done: false,
    steps: [], loss: [], val: [], tps: [], plan: [], exchange: [], fanout: [], dispatch: [], reduce: [], fanoutBytes: [],
    heatBefore: [], heatAfter: [],       // [{step, values: [per layer]}]
    experts: new Map(),                  // layer -> [{step, tokens: []}]
    rankT: [], rankTimes: new Map(),     // rank -> [] aligned with rankT
    events: [], charts: {},
  };
  window.rackrunDashboard = state;

  const $ = (id) => document.getElementById(id);
  const num = (v) => (v === undefined || v === null || v === '' ? 0 : Number(v));
  const fmt = (v, d = 3) => (Number.isFinite(v) ? Number(v).toPrecision(d) : '');
  const esc = (s) => String(s ?? '').replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
  const time = (ms) => (num(ms) > 0 ? new Date(num(ms)).toLocaleTimeString() : '');

  // A remote dashboard needs a token (?token= in the page's address): every view gets it.
  const token = new URLSearchParams(location.search).get('token');
  async function getJson(path) {
    const url = token ? `${path}${path.includes('?') ? '&' : '?'}token=${encodeURIComponent(token)}` : path;
    const r = await fetch(url, { cache: 'no-store' });
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  // ---- charts ----
  const palette = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf'];
  function makeChart(key, el, seriesNames, opts = {}) {
    const width = Math.max(300, el.clientWidth || 440);
    const series = [{ label: opts.xLabel || 'step' }].concat(seriesNames.map((name, i) => ({
      label: name, stroke: palette[i % palette.length], width: 1.5, spanGaps: true,
      points: { show: false },
    })));
    const u = new uPlot({
      width, height: 200, series,
      scales: { x: { time: !!opts.time } },
      axes: [{}, { size: 60 }],
      legend: { live: false },
    }, [[]].concat(seriesNames.map(() => [])), el);
    state.charts[key] = u;
    return u;
  }
  function resetCharts() {
    for (const u of Object.values(state.charts)) u.destroy();
    state.charts = {};
    makeChart('loss', $('chart-loss'), ['loss', 'validation loss']);
    makeChart('tokens', $('chart-tokens'), ['tokens/s']);
    makeChart('balance', $('chart-balance'), ['plan s', 'of it load exchange s', 'fan-out s', 'all-to-all s', 'reduce s']);
    makeChart('fanout', $('chart-fanout'), ['fan-out bytes']);
    state.charts.ranks = null;  // made when the ranks are known
  }
  function trim(arrays) {
    const extra = arrays[0].length - KEEP_STEPS;
    if (extra > 0) for (const a of arrays) a.splice(0, extra);
  }

  // ---- heatmaps ----
  function color(t) {  // 0..1 -> light yellow .. dark blue-purple
    t = Math.max(0, Math.min(1, t));
    const stops = [[255, 255, 204], [161, 218, 180], [65, 182, 196], [44, 127, 184], [37, 52, 148], [60, 10, 90]];
    const x = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    const c = stops[i].map((v, k) => Math.round(v + f * (stops[i + 1][k] - v)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  // columns: [{values: [...rows]}]; lo..hi maps to the colour scale.
  function drawHeat(canvas, columns, lo, hi) {
    const rows = columns.reduce((m, c) => Math.max(m, c.values.length), 0);
    const w = Math.max(1, columns.length), h = Math.max(1, rows);
    canvas.width = w;
    canvas.height = h;
    const g = canvas.getContext('2d');
    g.clearRect(0, 0, w, h);
    columns.forEach((c, x) => c.values.forEach((v, y) => {
      g.fillStyle = color(hi > lo ? (v - lo) / (hi - lo) : 0);
      g.fillRect(x, y, 1, 1);
    }));
  }
  function drawHeatmaps() {
    const all = state.heatBefore.concat(state.heatAfter).flatMap((c) => c.values);
    const hi = Math.max(1.0001, ...all);
    drawHeat($('heat-before'), state.heatBefore, 1, hi);
    drawHeat($('heat-after'), state.heatAfter, 1, hi);
    const last = state.heatBefore.length ? state.heatBefore[state.heatBefore.length - 1] : null;
    $('heat-legend').textContent = last
      ? `rows: MoE layers 0..${last.values.length - 1}; columns: steps ${state.heatBefore[0].step}..${last.step}; ` +
        `colour 1.0 (balanced, light) .. ${fmt(hi)} (dark)`
      : 'no expert-parallel steps yet';
    const layerSel = $('layer');
    const layers = [...state.experts.keys()].sort((a, b) => a - b);
    if (layerSel.options.length !== layers.length) {
      const keep = layerSel.value;
      layerSel.innerHTML = layers.map((l) => `<option value="${l}">${l}</option>`).join('');
      if (layers.map(String).includes(keep)) layerSel.value = keep;
    }
    const samples = state.experts.get(Number(layerSel.value)) || [];
    const cols = samples.map((s) => ({ values: s.tokens }));
    const max = Math.max(1, ...cols.flatMap((c) => c.values));
    drawHeat($('heat-experts'), cols, 0, max);
    $('expert-legend').textContent = samples.length
      ? `rows: experts 0..${samples[0].tokens.length - 1}; columns: ${samples.length} sampled steps up to ${samples[samples.length - 1].step}; colour 0 .. ${max} tokens`
      : 'no expert-load samples yet (StepProgress.expert_loads)';
  }

  // ---- data ----
  function addProgress(p) {
    const step = num(p.step);
    state.steps.push(step);
    state.loss.push(num(p.loss));
    state.val.push(p.val_loss === undefined || p.val_loss === null ? null : num(p.val_loss));
    state.tps.push(num(p.tokens_per_s));
    state.plan.push(num(p.plan_s));
    state.exchange.push(num(p.plan_exchange_s));
    state.fanout.push(num(p.fanout_s));
    state.dispatch.push(num(p.dispatch_s));
    state.reduce.push(num(p.reduce_s));
    state.fanoutBytes.push(num(p.fanout_bytes));
    trim([state.steps, state.loss, state.val, state.tps, state.plan, state.exchange, state.fanout, state.dispatch, state.reduce, state.fanoutBytes]);
    const before = (p.imbalance_before || []).map(num), after = (p.imbalance_after || []).map(num);
    if (before.length) {
      state.heatBefore.push({ step, values: before });
      state.heatAfter.push({ step, values: after });
      if (state.heatBefore.length > KEEP_HEAT) { state.heatBefore.shift(); state.heatAfter.shift(); }
    }
    for (const s of p.expert_loads || []) {
      const layer = num(s.layer);
      if (!state.experts.has(layer)) state.experts.set(layer, []);
      const list = state.experts.get(layer);
      list.push({ step, tokens: (s.tokens || []).map(num) });
      if (list.length > KEEP_HEAT) list.shift();
    }
    state.points += 1;
  }
  function addEvent(e) {
    let text = null, cls = '';
    if (e.failure) {
      const f = e.failure;
      text = `attempt ${e.attempt} failed: ${f.kind} rank ${f.rank} (${f.worker_id} on ${f.host}, pid ${f.pid}) in ${f.phase} at step ${f.step}: ${f.message}`;
      cls = 'failure';
    } else if (e.state) {
      text = `job ${e.state}${num(e.attempt) > 1 ? ` (attempt ${e.attempt})` : ''}`;
    } else if (e.message !== undefined && e.message !== '') {
      text = e.message;
      if (/restart/i.test(text)) cls = 'restart';
    }
    if (text !== null) state.events.push({ time: num(e.time_unix_ms), text, cls });
  }
  function renderEvents() {
    $('events').innerHTML = state.events.slice(-200).map((e) =>
      `<li class="${e.cls}">${esc(time(e.time))} ${esc(e.text)}</li>`).join('');
  }
  function updateCharts() {
    const c = state.charts;
    c.loss.setData([state.steps, state.loss, state.val]);
    c.tokens.setData([state.steps, state.tps]);
    c.balance.setData([state.steps, state.plan, state.exchange, state.fanout, state.dispatch, state.reduce]);
    c.fanout.setData([state.steps, state.fanoutBytes]);
  }

  function selectJob(id) {
    if (state.jobId === id) return;
    Object.assign(state, {
      jobId: id, next: 0, done: false, steps: [], loss: [], val: [], tps: [], plan: [], exchange: [], fanout: [], dispatch: [],
      reduce: [], fanoutBytes: [], heatBefore: [], heatAfter: [], experts: new Map(), rankT: [], rankTimes: new Map(),
      events: [],
    });
    $('job').hidden = false;
    $('job-title').textContent = id;
    if (location.hash !== `#job=${id}`) history.replaceState(null, '', `#job=${id}`);
    resetCharts();
  }

  function renderJobs(jobs) {
    const rows = jobs.map((j) => {
      const p = j.last_progress || {};
      return `<tr data-id="${esc(j.id)}" class="${j.id === state.jobId ? 'selected' : ''}">` +
        `<td>${esc(j.id)}</td><td>${esc(j.name)}</td><td><span class="state ${esc(j.state)}">${esc(j.state)}</span></td>` +
        `<td>${num(p.step)} / ${num(p.total_steps)}</td><td>${fmt(num(p.loss), 4)}</td><td>${fmt(num(p.tokens_per_s), 4)}</td>` +
        `<td>${num(j.restarts)}</td><td>${esc(time(j.created_unix_ms))}</td></tr>`;
    });
    $('jobs').tBodies[0].innerHTML = rows.join('') || '<tr><td colspan="8" class="muted">no jobs yet</td></tr>';
  }

  function renderWorkers(workers) {
    $('workers').tBodies[0].innerHTML = workers.map((w) =>
      `<tr><td>${esc(w.id)}</td><td>${esc(w.host)}</td><td>${num(w.pid)}</td><td><span class="state ${esc(w.state)}">${esc(w.state)}</span></td>` +
      `<td>${esc(w.job_id)}</td><td>${w.job_id ? num(w.rank) : ''}</td><td>${esc(w.phase)}</td><td>${w.job_id ? num(w.step) : ''}</td>` +
      `<td>${fmt(num(w.step_time_s))} s</td><td>${fmt(num(w.heartbeat_age_s), 2)} s</td></tr>`).join('') ||
      '<tr><td colspan="10" class="muted">no workers registered</td></tr>';
    // Step time per rank of the selected job, sampled from heartbeats once per poll.
    const mine = workers.filter((w) => w.job_id === state.jobId && w.state === 'BUSY');
    if (!mine.length) return;
    const t = Date.now() / 1000;
    state.rankT.push(t);
    for (const w of mine) {
      const r = num(w.rank);
      if (!state.rankTimes.has(r)) state.rankTimes.set(r, state.rankT.slice(0, -1).map(() => null));
    }
    for (const [r, list] of state.rankTimes) {
      const w = mine.find((x) => num(x.rank) === r);
      list.push(w ? num(w.step_time_s) : null);
    }
    trim([state.rankT, ...state.rankTimes.values()]);
    const ranks = [...state.rankTimes.keys()].sort((a, b) => a - b);
    let u = state.charts.ranks;
    if (!u || u.series.length !== ranks.length + 1) {
      if (u) u.destroy();
      $('chart-ranks').innerHTML = '';
      u = makeChart('ranks', $('chart-ranks'), ranks.map((r) => `rank ${r}`), { time: true, xLabel: 'time' });
    }
    u.setData([state.rankT, ...ranks.map((r) => state.rankTimes.get(r))]);
    state.points += 1;
  }

  async function pollJob() {
    if (!state.jobId) return;
    const job = await getJson(`/api/jobs/${encodeURIComponent(state.jobId)}`);
    $('job-state').textContent = job.state;
    $('job-state').className = `state ${job.state}`;
    $('job-message').textContent = job.message || '';
    for (let page = 0; page < 10 && !state.done; page++) {
      const r = await getJson(`/api/jobs/${encodeURIComponent(state.jobId)}/events?after=${state.next}`);
      for (const e of r.events) {
        if (e.progress) addProgress(e.progress); else addEvent(e);
      }
      state.next = num(r.next);
      state.done = r.done;
      if (r.events.length < 1000) break;
    }
    updateCharts();
    drawHeatmaps();
    renderEvents();
  }

  async function poll() {
    try {
      const [jobs, workers] = await Promise.all([getJson('/api/jobs'), getJson('/api/workers')]);
      const list = jobs.jobs || [];
      const wanted = (location.hash.match(/^#job=(.+)$/) || [])[1];
      if (wanted && wanted !== state.jobId) selectJob(decodeURIComponent(wanted));
      if (!state.jobId && list.length) {
        const running = list.find((j) => j.state === 'RUNNING');
        selectJob((running || list[0]).id);
      }
      renderJobs(list);
      await pollJob();
      renderWorkers(workers.workers || []);
      state.polls += 1;
      $('status').textContent = `live, updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      state.errors.push(String(err));
      $('status').textContent = `cannot reach the coordinator: ${err}`;
    }
    setTimeout(poll, POLL_MS);
  }

  $('jobs').addEventListener('click', (ev) => {
    const tr = ev.target.closest('tr[data-id]');
    if (tr) {
      location.hash = `job=${tr.dataset.id}`;
      selectJob(tr.dataset.id);
    }
  });
  $('layer').addEventListener('change', drawHeatmaps);
  poll();
})();
