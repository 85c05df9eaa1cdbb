// A probe, not a test: a coordinator on 127.0.0.1 (any free ports, a scratch state folder)
// with its metrics endpoint and dashboard; for each, N connections that connect and never
// send a byte, then one GET (/metrics, /healthz) and how long its answer took, and the
// coordinator's threads and open file descriptors.
//   node tools/probes/idle_http.js [N=100]   (RACKRUN_COORDINATOR_BIN picks the binary)
// docs/failure-model.md quotes it for the HTTP endpoints' idle connections.
'use strict';
const path = require('node:path'); const fs = require('node:fs'); const os = require('node:os');
const net = require('node:net'); const http = require('node:http');
const { spawn } = require('node:child_process');
const { coordinatorBin, procStatus } = require('./lib.js');
const N = parseInt(process.argv[2] || '100');
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'probe-'));
const child = spawn(coordinatorBin, ['--listen', '127.0.0.1:0', '--state-dir', dir, '--metrics-listen', '127.0.0.1:0', '--dashboard-listen', '127.0.0.1:0'], { stdio: ['ignore', 'pipe', 'inherit'] });
const get = (port, p) => new Promise((res) => {
  const t0 = Date.now();
  const req = http.get({ host: '127.0.0.1', port, path: p, timeout: 30000 }, (r) => { r.resume(); r.on('end', () => res(`${r.statusCode} in ${Date.now() - t0} ms`)); });
  req.on('timeout', () => { req.destroy(); res(`no answer in ${Date.now() - t0} ms`); });
  req.on('error', (e) => res(`${e.code} after ${Date.now() - t0} ms`));
});
let out = '';
child.stdout.on('data', async (d) => {
  out += d;
  const metrics = /metrics on http:\/\/127\.0\.0\.1:([0-9]+)/.exec(out), dash = /dashboard on http:\/\/127\.0\.0\.1:([0-9]+)/.exec(out);
  if (!metrics || !dash || child.started) return; child.started = true;
  for (const [name, port, p] of [['metrics', metrics[1], '/metrics'], ['dashboard', dash[1], '/healthz']]) {
    const idle = [];
    for (let i = 0; i < N; ++i) { const s = net.connect(parseInt(port), '127.0.0.1'); s.on('error', () => {}); idle.push(s); }
    await new Promise(r => setTimeout(r, 300));
    const fds = fs.readdirSync(`/proc/${child.pid}/fd`).length;
    console.log(`${name}: ${N} idle connections; GET ${p}: ${await get(parseInt(port), p)}; coordinator threads ${procStatus(child.pid, 'Threads')}, fds ${fds}`);
    for (const s of idle) s.destroy();
  }
  child.kill('SIGTERM');
});
child.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }));
