// Loads the coordinator's dashboard in a real headless Chromium, driven over the DevTools
// protocol on a pipe (no WebSocket, no npm packages), and checks it:
//   node dashboard_check.mjs CHROMIUM URL SCREENSHOT.png [TIMEOUT_S [EXPECT_JSON]]
// Live mode (no EXPECT_JSON; a 1400x1800 window): passes (exit 0) when the page polled
// the coordinator at least 3 times, its charts got new points after the first poll (the job
// is running) and uPlot drew its canvases.
// Cluster mode (EXPECT_JSON = {"jobs", "page", "running", "failed", "domains",
// "ranks_per_domain", "text", optional "gpu": the GPU panel's note}; a 1400x900 window): the job table shows `page` rows a page,
// running jobs first and then newest first, and prev/next walk all `jobs` exactly once; the
// state filter shows only failed jobs (`failed` of them); the page's text has `text` and no
// number in exponent notation; the selected job's charts start above the fold; it shows
// `domains` heatmap pairs and a rank grid of `domains` x `ranks_per_domain` cells per row,
// ranks in order, each with its values in its title.
// Both modes fail on any console error, uncaught exception, failed request or HTTP error,
// and save a screenshot either way. Exit 1 with the reason otherwise; bounded by TIMEOUT_S.
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const [chromium, url, screenshot, timeoutArg, expectArg] = process.argv.slice(2);
const timeoutS = Number(timeoutArg || 45);
const expect = expectArg ? JSON.parse(expectArg) : null;
if (!chromium || !url || !screenshot) {
  console.error('usage: node dashboard_check.mjs CHROMIUM URL SCREENSHOT.png [TIMEOUT_S]');
  process.exit(2);
}
// The profile, and Chromium's own temporary files (its TMPDIR: shared memory files with
// --disable-dev-shm-usage), live in one folder that finish() removes.
const profile = mkdtempSync(join(tmpdir(), 'rackrun-chromium-'));
const chromiumTmp = join(profile, 'tmp');
mkdirSync(chromiumTmp);
const browser = spawn(chromium, [
  '--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run',
  '--no-default-browser-check', '--disable-extensions', '--disable-background-networking',
  '--remote-debugging-pipe', `--user-data-dir=${profile}`, `--window-size=${expect ? '1400,900' : '1400,1800'}`, 'about:blank',
], { stdio: ['ignore', 'ignore', 'pipe', 'pipe', 'pipe'], env: { ...process.env, TMPDIR: chromiumTmp } });
let stderrTail = '';
browser.stderr.on('data', (d) => { stderrTail = (stderrTail + d).slice(-4000); });

const problems = [];
let finished = false;
function finish(code, message) {
  if (finished) return;
  finished = true;
  console.log(message);
  try { browser.kill('SIGKILL'); } catch { /* gone */ }
  // Chromium's child processes may write into the profile for a moment after the browser
  // is killed: remove it until it stays removed (2 s at most), then exit.
  const deadline = Date.now() + 2000;
  const removeAndExit = () => {
    try { rmSync(profile, { recursive: true, force: true, maxRetries: 3 }); } catch { /* retried */ }
    if (existsSync(profile) && Date.now() < deadline) {
      setTimeout(removeAndExit, 100);
      return;
    }
    process.exit(code);
  };
  setTimeout(removeAndExit, 100);
}
const timer = setTimeout(() => finish(1, `FAIL: timed out after ${timeoutS} s; problems: ${JSON.stringify(problems)}; ` +
  `chromium stderr: ${stderrTail.slice(-800)}`), timeoutS * 1000);
browser.on('exit', (code) => finish(1, `FAIL: chromium exited (${code}): ${stderrTail.slice(-800)}`));
// The pipes reset when finish() kills the browser: only an error before that is a failure.
for (const stream of [browser.stdio[2], browser.stdio[3], browser.stdio[4]]) {
  stream.on('error', (e) => finish(1, `FAIL: the pipe to chromium: ${e.message}`));
}

// CDP over fds 3 (to the browser) and 4 (from it): NUL-terminated JSON messages.
const toBrowser = browser.stdio[3], fromBrowser = browser.stdio[4];
let nextId = 1, buffer = '';
const pending = new Map(), listeners = [];
fromBrowser.on('data', (chunk) => {
  buffer += chunk.toString('utf8');
  let end;
  while ((end = buffer.indexOf('\0')) >= 0) {
    const msg = JSON.parse(buffer.slice(0, end));
    buffer = buffer.slice(end + 1);
    if (msg.id && pending.has(msg.id)) {
      const { resolve, reject } = pending.get(msg.id);
      pending.delete(msg.id);
      if (msg.error) reject(new Error(JSON.stringify(msg.error))); else resolve(msg.result);
    } else if (msg.method) {
      for (const l of listeners) l(msg);
    }
  }
});
function send(method, params = {}, sessionId = undefined) {
  const id = nextId++;
  const msg = { id, method, params };
  if (sessionId) msg.sessionId = sessionId;
  toBrowser.write(JSON.stringify(msg) + '\0');
  return new Promise((resolve, reject) => pending.set(id, { resolve, reject }));
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

listeners.push((m) => {
  const p = m.params || {};
  if (m.method === 'Runtime.consoleAPICalled' && (p.type === 'error' || p.type === 'assert')) {
    problems.push(`console.${p.type}: ${(p.args || []).map((a) => a.value ?? a.description).join(' ')}`);
  } else if (m.method === 'Runtime.exceptionThrown') {
    problems.push(`exception: ${p.exceptionDetails?.exception?.description || p.exceptionDetails?.text}`);
  } else if (m.method === 'Log.entryAdded' && p.entry?.level === 'error') {
    problems.push(`log: ${p.entry.text} ${p.entry.url || ''}`);
  } else if (m.method === 'Network.loadingFailed' && !p.canceled) {
    problems.push(`request failed: ${p.errorText} (${p.type})`);
  } else if (m.method === 'Network.responseReceived' && p.response?.status >= 400) {
    problems.push(`HTTP ${p.response.status}: ${p.response.url}`);
  }
});

try {
  const { targetId } = await send('Target.createTarget', { url: 'about:blank' });
  const { sessionId } = await send('Target.attachToTarget', { targetId, flatten: true });
  for (const domain of ['Runtime', 'Log', 'Network', 'Page']) await send(`${domain}.enable`, {}, sessionId);
  await send('Page.navigate', { url }, sessionId);
  const evaluate = async (expr) =>
    (await send('Runtime.evaluate', { expression: expr, returnByValue: true, awaitPromise: true }, sessionId)).result.value;
  if (expect) {
    const message = await clusterChecks(evaluate, expect);
    await sleep(300);  // let the last frame paint
    const shot = await send('Page.captureScreenshot', { format: 'png', captureBeyondViewport: true }, sessionId);
    writeFileSync(screenshot, Buffer.from(shot.data, 'base64'));
    clearTimeout(timer);
    if (problems.length) finish(1, `FAIL: ${problems.join(' | ')}`);
    finish(message.startsWith('OK') ? 0 : 1, `${message}; screenshot ${screenshot}`);
  }
  const probe = `(() => { const d = window.rackrunDashboard; if (!d) return null;
    return { polls: d.polls, points: d.points, errors: d.errors.slice(-3), steps: d.steps.length,
             canvases: document.querySelectorAll('.uplot canvas').length,
             jobs: document.querySelectorAll('#jobs tbody tr[data-id]').length,
             workers: document.querySelectorAll('#workers tbody tr').length }; })()`;
  let first = null, last = null;
  for (;;) {
    last = await evaluate(probe);
    if (problems.length) break;
    if (last && last.polls >= 1 && first === null) first = last;
    if (first && last.polls >= first.polls + 2 && last.points > first.points && last.canvases >= 4 && last.jobs >= 1) break;
    await sleep(250);
  }
  await sleep(300);  // let the last frame paint
  const shot = await send('Page.captureScreenshot', { format: 'png', captureBeyondViewport: true }, sessionId);
  writeFileSync(screenshot, Buffer.from(shot.data, 'base64'));
  clearTimeout(timer);
  if (problems.length) finish(1, `FAIL: ${problems.join(' | ')}`);
  if (last.errors.length) finish(1, `FAIL: page errors: ${last.errors.join(' | ')}`);
  finish(0, `OK: polls ${first.polls} -> ${last.polls}, chart points ${first.points} -> ${last.points}, ` +
    `${last.steps} steps, ${last.canvases} canvases, ${last.jobs} jobs, ${last.workers} workers; screenshot ${screenshot}`);
} catch (err) {
  finish(1, `FAIL: ${err.stack || err}`);
}

// Cluster mode's checks, run in the page once it polled twice and drew the rank grid.
async function clusterChecks(evaluate, x) {
  for (;;) {
    const ready = await evaluate(`(() => { const d = window.rackrunDashboard;
      return !!d && d.polls >= 2 && document.querySelectorAll('#rank-grid .rank-domain').length > 0; })()`);
    if (ready || problems.length) break;
    await sleep(250);
  }
  const result = await evaluate(`(async (x) => {
    const fail = [];
    const $ = (id) => document.getElementById(id);
    const rows = () => [...document.querySelectorAll('#jobs tbody tr[data-id]')].map((tr) => ({
      id: tr.dataset.id, state: tr.querySelector('.state').textContent, created: Number(tr.dataset.created) }));
    const walk = () => {  // every page from the first, by next
      while (!$('page-prev').disabled) $('page-prev').click();
      const seen = [];
      for (let pages = 1; ; pages++) {
        const r = rows();
        if (r.length > x.page) fail.push('a page has ' + r.length + ' rows, more than ' + x.page);
        seen.push(...r);
        if ($('page-next').disabled || pages > 1000) break;
        $('page-next').click();
      }
      $('page-next').disabled || fail.push('next never disabled');
      return seen;
    };
    const first = rows();
    if (first.length !== x.page) fail.push('the first page has ' + first.length + ' rows, want ' + x.page);
    if (!$('page-info').textContent.includes('of ' + x.jobs)) fail.push('page info: ' + $('page-info').textContent);
    const all = walk();
    if (all.length !== x.jobs || new Set(all.map((r) => r.id)).size !== x.jobs) {
      fail.push('prev/next showed ' + all.length + ' rows (' + new Set(all.map((r) => r.id)).size + ' jobs), want ' + x.jobs);
    }
    all.forEach((r, i) => {
      if ((i < x.running) !== (r.state === 'RUNNING')) fail.push('row ' + i + ' (' + r.id + ', ' + r.state + ') breaks running-first');
      if (i > x.running && r.created > all[i - 1].created) fail.push('row ' + i + ' (' + r.id + ') is newer than the row above');
    });
    $('job-filter').value = 'FAILED';
    $('job-filter').dispatchEvent(new Event('change'));
    const failed = walk();
    if (failed.length !== x.failed || failed.some((r) => r.state !== 'FAILED')) {
      fail.push('filter failed: ' + failed.length + ' rows, states ' + [...new Set(failed.map((r) => r.state))].join(','));
    }
    $('job-filter').value = '';
    $('job-filter').dispatchEvent(new Event('change'));
    const text = document.body.innerText;
    const exp = text.match(/\\d(\\.\\d+)?e[+-]?\\d+/i);
    if (exp) fail.push('a number in exponent notation: ' + exp[0]);
    if (!text.includes(x.text)) fail.push('the page does not show ' + x.text);
    if (x.gpu && !$('gpu-note').textContent.includes(x.gpu)) fail.push('the GPU panel says ' + $('gpu-note').textContent);
    const top = $('chart-loss').getBoundingClientRect().top;
    if (!(top < window.innerHeight)) fail.push('the first chart starts at ' + top + ' px, below the fold (' + window.innerHeight + ')');
    const canvases = document.querySelectorAll('.uplot canvas').length;
    if (canvases < 4) fail.push('uPlot drew ' + canvases + ' canvases');
    const heats = document.querySelectorAll('#domain-heats .domain-heat').length;
    if (heats !== x.domains) fail.push(heats + ' domain heatmap pairs, want ' + x.domains);
    const doms = [...document.querySelectorAll('#rank-grid .rank-domain')];
    if (doms.length !== x.domains) fail.push(doms.length + ' domains in the rank grid, want ' + x.domains);
    doms.forEach((d, i) => {
      for (const what of ['before', 'after', 'time']) {
        const cells = [...d.querySelectorAll('.cell[data-what="' + what + '"]')];
        if (cells.length !== x.ranks_per_domain) fail.push('domain ' + i + ' ' + what + ': ' + cells.length + ' cells');
        cells.forEach((c, k) => {
          const r = i * x.ranks_per_domain + k;
          if (Number(c.dataset.rank) !== r) fail.push('domain ' + i + ' cell ' + k + ' is rank ' + c.dataset.rank);
          if (!c.title.startsWith('rank ' + r + ' (domain ' + i + '): ') || /e[+-]\\d/.test(c.title)) fail.push('title: ' + c.title);
        });
      }
    });
    const sample = doms.length ? doms[doms.length - 1].querySelector('.cell[data-what="after"]').title : '';
    return { fail, summary: all.length + ' jobs in ' + Math.ceil(all.length / x.page) + ' pages, ' + failed.length +
      ' failed, first chart at ' + Math.round(top) + ' px of ' + window.innerHeight + ', ' + heats + ' domain heatmaps, ' +
      doms.length + ' x ' + x.ranks_per_domain + ' rank cells (e.g. "' + sample + '")' };
  })(${JSON.stringify(x)})`);
  if (!result) return 'FAIL: the checks returned nothing';
  return result.fail.length ? `FAIL: ${result.fail.slice(0, 20).join(' | ')}` : `OK: ${result.summary}`;
}
