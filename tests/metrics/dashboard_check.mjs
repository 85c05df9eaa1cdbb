// Loads the coordinator's dashboard in a real headless Chromium, driven over the DevTools
// protocol on a pipe (no WebSocket, no npm packages), and checks it works live:
//   node dashboard_check.mjs CHROMIUM URL SCREENSHOT.png [TIMEOUT_S]
// Passes (exit 0) when the page polled the coordinator at least 3 times, its charts got
// new points after the first poll (the job is running), uPlot drew its canvases, and no
// console error, uncaught exception, failed request or HTTP error happened; saves a
// screenshot either way. Exit 1 with the reason otherwise; bounded by TIMEOUT_S.
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const [chromium, url, screenshot, timeoutArg] = process.argv.slice(2);
const timeoutS = Number(timeoutArg || 45);
if (!chromium || !url || !screenshot) {
  console.error('usage: node dashboard_check.mjs CHROMIUM URL SCREENSHOT.png [TIMEOUT_S]');
  process.exit(2);
}
const profile = mkdtempSync(join(tmpdir(), 'rackrun-chromium-'));
const browser = spawn(chromium, [
  '--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run',
  '--no-default-browser-check', '--disable-extensions', '--disable-background-networking',
  '--remote-debugging-pipe', `--user-data-dir=${profile}`, '--window-size=1400,1800', 'about:blank',
], { stdio: ['ignore', 'ignore', 'pipe', 'pipe', 'pipe'] });
let stderrTail = '';
browser.stderr.on('data', (d) => { stderrTail = (stderrTail + d).slice(-4000); });

const problems = [];
let finished = false;
function finish(code, message) {
  if (finished) return;
  finished = true;
  console.log(message);
  try { browser.kill('SIGKILL'); } catch { /* gone */ }
  try { rmSync(profile, { recursive: true, force: true }); } catch { /* best effort */ }
  process.exit(code);
}
const timer = setTimeout(() => finish(1, `FAIL: timed out after ${timeoutS} s; problems: ${JSON.stringify(problems)}; ` +
  `chromium stderr: ${stderrTail.slice(-800)}`), timeoutS * 1000);
browser.on('exit', (code) => finish(1, `FAIL: chromium exited (${code}): ${stderrTail.slice(-800)}`));

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
    (await send('Runtime.evaluate', { expression: expr, returnByValue: true }, sessionId)).result.value;
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
