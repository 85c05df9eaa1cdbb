// rackrun's built-in dashboard: polls the coordinator's read-only JSON views once a second
// (metrics/dashboard.h lists them) and draws them without reloading. uPlot draws the line
// charts; the heatmaps are plain canvases. window.rackrunDashboard exposes counters the
// browser test reads (polls, points added to charts, errors). Numbers are written by
// format.js (window.rackrunFormat): 28.8k, 3.4 ms, 97.8%, never exponents.
//
// The job table scales to a cluster: running jobs first, then the rest newest first, a
// state filter and pages of PAGE_SIZE rows. Expert-parallel domains (StepProgress.domains)
// get a heatmap pair each, side by side, and a per-rank grid grouped by domain. A GPU job
// (StepProgress.device) fills two more charts: device memory and the step's device time by
// phase; a CPU job's say "no GPU". The workers table names each worker's GPU.
'use strict';

(() => {
  const POLL_MS = 1000;
  const KEEP_STEPS = 2000;   // points kept per chart
  const KEEP_HEAT = 300;     // heatmap columns (steps / samples) kept
  const PAGE_SIZE = 10;      // job table rows per page
  const F = window.rackrunFormat;
  // StepProgress.device: memory series and the step's device time by phase.
  const GPU_MEM = ['memory_in_use_bytes', 'memory_peak_bytes', 'memory_reserved_bytes'];
  const GPU_PHASES = ['gemm', 'attention', 'streams', 'routing', 'optimizer', 'other'];
  const state = {
    polls: 0, points: 0, errors: [], jobId: null, next: 0, done: false,
    steps: [], loss: [], val: [], tps: [], plan: [], exchange: [], fanout: [], dispatch: [], reduce: [], fanoutBytes: [],
    gpu: null, gpuMem: GPU_MEM.map(() => []), gpuTime: GPU_PHASES.map(() => []),  // GPU jobs (StepProgress.device)
    heatDomains: [],                     // per domain: {before: [{step, values: [per layer]}], after: [...]}
    lastDomains: [],                     // the last step's StepProgress.domains
    experts: new Map(),                  // layer -> [{step, tokens: []}]
    rankT: [], rankTimes: new Map(),     // rank -> [] aligned with rankT
    rankStep: new Map(),                 // rank -> last heartbeat step time (s) of the selected job
    events: [], charts: {},
    jobs: [], filter: '', page: 0,       // the job table: last list, state filter, page (0-based)
  };
  window.rackrunDashboard = state;

  const $ = (id) => document.getElementById(id);
  const num = (v) => (v === undefined || v === null || v === '' ? 0 : Number(v));
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
  // opts.y formats the y axis' values (format.js), opts.time makes x a time axis.
  function makeChart(key, el, seriesNames, opts = {}) {
    const width = Math.max(300, el.clientWidth || 440);
    const y = opts.y || F.digits;
    const series = [{ label: opts.xLabel || 'step', value: (u, v) => (v == null ? '' : opts.time ? v : F.count(v)) }]
      .concat(seriesNames.map((name, i) => ({
        label: name, stroke: palette[i % palette.length], width: 1.5, spanGaps: true,
        points: { show: false }, value: (u, v) => (v == null ? '' : y(v)),
      })));
    const u = new uPlot({
      width, height: 200, series,
      scales: { x: { time: !!opts.time } },
      axes: [opts.time ? {} : { values: (u, splits) => splits.map((v) => F.count(v)) },
        { size: 64, values: (u, splits) => splits.map((v) => y(v)) }],
      legend: { live: false, show: opts.legend !== false },
    }, [[]].concat(seriesNames.map(() => [])), el);
    state.charts[key] = u;
    return u;
  }
  function resetCharts() {
    for (const u of Object.values(state.charts)) u.destroy();
    state.charts = {};
    makeChart('loss', $('chart-loss'), ['loss', 'validation loss'], { y: F.loss });
    makeChart('tokens', $('chart-tokens'), ['tokens/s'], { y: F.count });
    makeChart('balance', $('chart-balance'), ['plan', 'of it load exchange', 'fan-out', 'all-to-all', 'reduce'],
      { y: F.seconds });
    makeChart('fanout', $('chart-fanout'), ['fan-out bytes'], { y: F.bytes });
    makeChart('gpuMem', $('chart-gpu-mem'), ['in use', 'peak', 'reserved'], { y: F.bytes });
    makeChart('gpuTime', $('chart-gpu-time'), GPU_PHASES, { y: F.seconds });
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
  // One before | after pair per expert-parallel domain, side by side, on one colour scale.
  function drawDomainHeats() {
    const box = $('domain-heats');
    const doms = state.heatDomains;
    if (box.children.length !== doms.length) {
      box.innerHTML = doms.map((d, i) =>
        `<div class="domain-heat" data-domain="${i}"><div class="domain-head"></div>` +
        '<div class="heatpair"><canvas class="heat before"></canvas><canvas class="heat after"></canvas></div></div>').join('');
    }
    let hi = 1.0001;
    for (const d of doms) for (const c of d.before.concat(d.after)) for (const v of c.values) hi = Math.max(hi, v);
    doms.forEach((d, i) => {
      const el = box.children[i];
      const info = state.lastDomains[i] || {};
      const first = num(info.first_rank), g = num(info.ranks);
      const mean = (list) => (list.length ? list[list.length - 1].values.reduce((a, b) => a + b, 0) / Math.max(1, list[list.length - 1].values.length) : 0);
      el.querySelector('.domain-head').textContent = `domain ${i}` + (g ? ` · ranks ${first}–${first + g - 1}` : '') +
        (d.before.length ? ` · ${F.factor(mean(d.before))} → ${F.factor(mean(d.after))}` : '');
      drawHeat(el.querySelector('canvas.before'), d.before, 1, hi);
      drawHeat(el.querySelector('canvas.after'), d.after, 1, hi);
    });
    const d0 = doms[0];
    const last = d0 && d0.before.length ? d0.before[d0.before.length - 1] : null;
    $('heat-legend').textContent = last
      ? `per domain: before | after; rows: MoE layers 0..${last.values.length - 1}; columns: steps ` +
        `${d0.before[0].step}..${last.step}; colour ${F.factor(1)} (balanced, light) .. ${F.factor(hi)} (dark)`
      : 'no expert-parallel steps yet';
  }

  // Per rank of the last step, ranks grouped by domain: tokens before and after balancing
  // as a multiple of the domain's mean, and the heartbeat step time. Compact cells that
  // read at 64 ranks and more; every cell's title has its exact values.
  function drawRankGrid() {
    const doms = state.lastDomains;
    const grid = $('rank-grid');
    if (!doms.length) {
      grid.innerHTML = '';
      $('rank-legend').textContent = 'no expert-parallel steps yet (StepProgress.domains)';
      return;
    }
    const share = (list) => {
      const mean = list.reduce((a, b) => a + b, 0) / Math.max(1, list.length);
      return list.map((v) => (mean > 0 ? v / mean : 0));
    };
    let hi = 1.0001;
    const rows = doms.map((d) => {
      const before = (d.rank_tokens_before || []).map(num), after = (d.rank_tokens_after || []).map(num);
      const sb = share(before), sa = share(after);
      for (const v of sb.concat(sa)) hi = Math.max(hi, v);
      return { d, before, after, sb, sa };
    });
    const times = [...state.rankStep.values()].filter((v) => v > 0);
    const tlo = times.length ? Math.min(...times) : 0, thi = times.length ? Math.max(...times) : 0;
    const cellText = (t) => {  // text colour that stays readable on the dark end of the scale
      return t > 0.55 ? ' dark' : '';
    };
    const html = rows.map(({ d, before, after, sb, sa }, i) => {
      const first = num(d.first_rank), g = Math.max(num(d.ranks), before.length, after.length);
      const narrow = g > 32 ? ' narrow' : '';
      const imb = (key) => { const v = (d[key] || []).map(num); return v.length ? v.reduce((a, b) => a + b, 0) / v.length : 0; };
      const cells = (what) => Array.from({ length: g }, (_, k) => {
        const r = first + k;
        const st = state.rankStep.get(r);
        const title = `rank ${r} (domain ${i}): ${F.count(before[k] ?? 0)} tokens before balancing ` +
          `(${F.factor(sb[k] ?? 0)} the domain's mean), ${F.count(after[k] ?? 0)} after (${F.factor(sa[k] ?? 0)})` +
          (st !== undefined ? `; step time ${F.seconds(st)}` : '');
        let t;
        if (what === 'time') t = st !== undefined && thi > tlo ? (st - tlo) / (thi - tlo) : 0;
        else t = ((what === 'before' ? sb[k] : sa[k]) - 1) / (hi - 1);
        t = Math.max(0, Math.min(1, t || 0));
        const label = narrow ? '' : String(r);
        return `<span class="cell${narrow}${cellText(t)}" data-rank="${r}" data-what="${what}" ` +
          `style="background:${color(t)}" title="${esc(title)}">${label}</span>`;
      }).join('');
      return `<div class="rank-domain" data-domain="${i}"><div class="domain-head">domain ${i} · ranks ${first}–${first + g - 1}` +
        ` · imbalance ${F.factor(imb('imbalance_before'))} → ${F.factor(imb('imbalance_after'))}</div>` +
        `<div class="rank-row"><span class="what">before</span>${cells('before')}</div>` +
        `<div class="rank-row"><span class="what">after</span>${cells('after')}</div>` +
        `<div class="rank-row"><span class="what">step time</span>${cells('time')}</div></div>`;
    }).join('');
    grid.innerHTML = html;
    $('rank-legend').textContent = `tokens: colour ${F.factor(1)} the domain's mean or less (light) .. ${F.factor(hi)} (dark); ` +
      (times.length ? `step time: ${F.seconds(tlo)} (light) .. ${F.seconds(thi)} (dark)` : 'step time: no heartbeats of this job');
  }

  function drawHeatmaps() {
    drawDomainHeats();
    drawRankGrid();
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
      ? `rows: experts 0..${samples[0].tokens.length - 1}; columns: ${samples.length} sampled steps up to ` +
        `${samples[samples.length - 1].step}; colour 0 .. ${F.count(max)} tokens`
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
    // A GPU job's figures (rank 0's GPU); gaps for steps without them (a CPU job: all).
    const dev = p.device;
    if (dev) state.gpu = { name: dev.name, total: num(dev.memory_total_bytes) };
    GPU_MEM.forEach((k, i) => state.gpuMem[i].push(dev ? num(dev[k]) : null));
    GPU_PHASES.forEach((k, i) => state.gpuTime[i].push(dev ? num(dev[`${k}_s`]) : null));
    trim([state.steps, state.loss, state.val, state.tps, state.plan, state.exchange, state.fanout, state.dispatch, state.reduce, state.fanoutBytes,
      ...state.gpuMem, ...state.gpuTime]);
    // Every domain's imbalance (a coordinator without StepProgress.domains: the job's one).
    let domains = p.domains || [];
    if (!domains.length && (p.imbalance_before || []).length) {
      domains = [{ domain: 0, imbalance_before: p.imbalance_before, imbalance_after: p.imbalance_after }];
    }
    if (domains.length) {
      if (state.heatDomains.length !== domains.length) state.heatDomains = domains.map(() => ({ before: [], after: [] }));
      domains.forEach((d, i) => {
        const h = state.heatDomains[i];
        h.before.push({ step, values: (d.imbalance_before || []).map(num) });
        h.after.push({ step, values: (d.imbalance_after || []).map(num) });
        if (h.before.length > KEEP_HEAT) { h.before.shift(); h.after.shift(); }
      });
      state.lastDomains = p.domains || [];
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
    c.gpuMem.setData([state.steps, ...state.gpuMem]);
    c.gpuTime.setData([state.steps, ...state.gpuTime]);
    $('gpu-note').textContent = state.gpu
      ? `${state.gpu.name}: ${F.bytes(state.gpu.total)} device memory; rank 0's GPU`
      : state.steps.length ? 'no GPU: this job runs on the CPU (resources.device: cpu)' : 'no steps yet';
  }

  function selectJob(id) {
    if (state.jobId === id) return;
    Object.assign(state, {
      jobId: id, next: 0, done: false, steps: [], loss: [], val: [], tps: [], plan: [], exchange: [], fanout: [], dispatch: [],
      reduce: [], fanoutBytes: [], gpu: null, gpuMem: GPU_MEM.map(() => []), gpuTime: GPU_PHASES.map(() => []), heatDomains: [], lastDomains: [], experts: new Map(), rankT: [], rankTimes: new Map(),
      rankStep: new Map(), events: [],
    });
    $('job').hidden = false;
    $('job-title').textContent = id;
    if (location.hash !== `#job=${id}`) history.replaceState(null, '', `#job=${id}`);
    resetCharts();
  }

  // Running jobs first, then the rest newest first (the list comes newest first).
  function orderJobs(jobs) {
    const created = (j) => num(j.created_unix_ms);
    return jobs.map((j, i) => ({ j, i })).sort((a, b) => {
      const ra = a.j.state === 'RUNNING' ? 0 : 1, rb = b.j.state === 'RUNNING' ? 0 : 1;
      if (ra !== rb) return ra - rb;
      return created(b.j) - created(a.j) || a.i - b.i;
    }).map((x) => x.j);
  }

  function renderJobs() {
    const all = orderJobs(state.jobs);
    const counts = {};
    for (const j of all) counts[j.state] = (counts[j.state] || 0) + 1;
    for (const o of $('job-filter').options) {
      const n = o.value ? (counts[o.value] || 0) : all.length;
      o.textContent = `${o.value ? o.value.toLowerCase() : 'all'} (${n})`;
    }
    const shown = state.filter ? all.filter((j) => j.state === state.filter) : all;
    const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
    state.page = Math.max(0, Math.min(state.page, pages - 1));
    const from = state.page * PAGE_SIZE, page = shown.slice(from, from + PAGE_SIZE);
    const rows = page.map((j) => {
      const p = j.last_progress || {};
      const steps = p.step === undefined && p.total_steps === undefined ? '–' : `${num(p.step)} / ${num(p.total_steps)}`;
      return `<tr data-id="${esc(j.id)}" data-created="${num(j.created_unix_ms)}" class="${j.id === state.jobId ? 'selected' : ''}">` +
        `<td>${esc(j.id)}</td><td>${esc(j.name)}</td><td><span class="state ${esc(j.state)}">${esc(j.state)}</span></td>` +
        `<td>${steps}</td><td>${p.loss === undefined ? '–' : F.loss(num(p.loss))}</td>` +
        `<td>${p.tokens_per_s === undefined ? '–' : F.count(num(p.tokens_per_s))}</td>` +
        `<td>${num(j.restarts)}</td><td>${esc(time(j.created_unix_ms))}</td></tr>`;
    });
    $('jobs').tBodies[0].innerHTML = rows.join('') ||
      `<tr><td colspan="8" class="muted">${all.length ? 'no jobs in this state' : 'no jobs yet'}</td></tr>`;
    $('page-info').textContent = shown.length
      ? `${from + 1}–${from + page.length} of ${shown.length}${state.filter ? ` ${state.filter.toLowerCase()}` : ''} · page ${state.page + 1} of ${pages}`
      : '0 jobs';
    $('page-prev').disabled = state.page === 0;
    $('page-next').disabled = state.page >= pages - 1;
  }

  function renderWorkers(workers) {
    $('workers').tBodies[0].innerHTML = workers.map((w) =>
      `<tr><td>${esc(w.id)}</td><td>${esc(w.host)}</td><td>${num(w.pid)}</td>` +
      `<td>${w.gpu ? esc(`${w.gpu.name} (${F.bytes(num(w.gpu.total_bytes))})`) : '–'}</td><td><span class="state ${esc(w.state)}">${esc(w.state)}</span></td>` +
      `<td>${esc(w.job_id)}</td><td>${w.job_id ? num(w.rank) : ''}</td><td>${esc(w.phase)}</td><td>${w.job_id ? num(w.step) : ''}</td>` +
      `<td>${F.seconds(num(w.step_time_s))}</td><td>${F.seconds(num(w.heartbeat_age_s))}</td></tr>`).join('') ||
      '<tr><td colspan="11" class="muted">no workers registered</td></tr>';
    // Step time per rank of the selected job, sampled from heartbeats once per poll.
    const mine = workers.filter((w) => w.job_id === state.jobId && w.state === 'BUSY');
    if (!mine.length) return;
    for (const w of mine) state.rankStep.set(num(w.rank), num(w.step_time_s));
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
      // Beyond 16 ranks a legend of every rank buries the chart: the rank grid names them.
      u = makeChart('ranks', $('chart-ranks'), ranks.map((r) => `rank ${r}`),
        { time: true, xLabel: 'time', y: F.seconds, legend: ranks.length <= 16 });
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
    renderEvents();
  }

  async function poll() {
    try {
      const [jobs, workers] = await Promise.all([getJson('/api/jobs'), getJson('/api/workers')]);
      const list = jobs.jobs || [];
      const wanted = (location.hash.match(/^#job=(.+)$/) || [])[1];
      if (wanted && wanted !== state.jobId) selectJob(decodeURIComponent(wanted));
      if (!state.jobId && list.length) selectJob(orderJobs(list)[0].id);
      state.jobs = list;
      renderJobs();
      await pollJob();
      renderWorkers(workers.workers || []);
      if (state.jobId) drawHeatmaps();  // after the workers: the rank grid shows their step times
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
  $('job-filter').addEventListener('change', () => { state.filter = $('job-filter').value; state.page = 0; renderJobs(); });
  $('page-prev').addEventListener('click', () => { state.page -= 1; renderJobs(); });
  $('page-next').addEventListener('click', () => { state.page += 1; renderJobs(); });
  poll();
})();
