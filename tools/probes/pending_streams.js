// A probe, not a test: a coordinator on 127.0.0.1 (a scratch state folder, TLS on) and C
// HTTP/2 connections over TLS (no client certificate: anyone who can reach the port), each
// opening S streams to RackControl.Register that send their headers with a token
// (`wrong`, `none` or `right`) and never their message. Prints the coordinator's RSS
// before and after, how many streams it refused and how fast, and a List call's latency
// from a new client meanwhile.
//   node tools/probes/pending_streams.js [C=20] [S=500] [TOKEN=wrong] [HOLD=5]
// docs/failure-model.md quotes it for streams that never send their message.
'use strict';
const path = require('node:path'); const fs = require('node:fs'); const os = require('node:os');
const http2 = require('node:http2');
const { spawn } = require('node:child_process');
const { grpc, pkg, coordinatorBin, procStatus } = require('./lib.js');
const C = parseInt(process.argv[2] || '20'), S = parseInt(process.argv[3] || '500');
const TOKEN = process.argv[4] || 'wrong', HOLD = parseInt(process.argv[5] || '5');
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'probe-'));
const child = spawn(coordinatorBin, ['--listen', '127.0.0.1:0', '--state-dir', dir, '--tls', 'on'],
  { stdio: ['ignore', 'pipe', 'inherit'] });
let out = '';
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
child.stdout.on('data', async (d) => {
  out += d; const m = /listening on ([0-9.]+):([0-9]+)/.exec(out); if (!m || child.started) return; child.started = true;
  const token = fs.readFileSync(path.join(dir, 'token'), 'utf8').trim();
  const ca = fs.readFileSync(path.join(dir, 'ca.crt'));
  await sleep(300);
  const rss0 = procStatus(child.pid, 'VmRSS');
  const headers = {
    ':method': 'POST', ':path': '/rackrun.v1.RackControl/Register', 'content-type': 'application/grpc', te: 'trailers',
  };
  if (TOKEN === 'wrong') headers.authorization = 'Bearer 0000';
  if (TOKEN === 'right') headers.authorization = `Bearer ${token}`;
  let refused = 0, errors = 0, open = 0; const refusedMs = [];
  const sessions = [];
  const t0 = Date.now();
  for (let c = 0; c < C; ++c) {
    const session = http2.connect(`https://${m[1]}:${m[2]}`, { ca, peerMaxConcurrentStreams: 1 << 30 });
    session.on('error', () => { ++errors; });
    sessions.push(session);
    for (let s = 0; s < S; ++s) {
      const st = session.request(headers, { endStream: false });
      const s0 = Date.now(); ++open;
      st.on('response', (h) => { if (h['grpc-status'] !== undefined) { ++refused; refusedMs.push(Date.now() - s0); } });
      st.on('trailers', (h) => { if (h['grpc-status'] !== undefined) { ++refused; refusedMs.push(Date.now() - s0); } });
      st.on('error', () => { ++errors; });
      st.on('close', () => { --open; });
    }
  }
  await sleep(HOLD * 1000);
  const client = new pkg.rackrun.v1.JobService(`${m[1]}:${m[2]}`, grpc.credentials.createSsl(ca), { 'grpc.use_local_subchannel_pool': 1 });
  const md = new grpc.Metadata(); md.add('authorization', `Bearer ${token}`);
  const c0 = Date.now();
  const r = await new Promise((res) => client.List({}, md, { deadline: Date.now() + 5000 }, (e) => res(e ? `ERR ${e.code}` : 'ok')));
  refusedMs.sort((a, b) => a - b);
  console.log(`token ${TOKEN}: ${C} connections x ${S} streams without a message, held ${HOLD} s`);
  console.log(`  coordinator RSS ${rss0} kB before, ${procStatus(child.pid, 'VmRSS')} kB after; ${refused} streams refused` +
    (refused ? ` (median ${refusedMs[refusedMs.length >> 1]} ms after opening)` : '') + `, ${open} still open, ${errors} errors`);
  console.log(`  a List from a new client: ${r} in ${Date.now() - c0} ms (total ${Date.now() - t0} ms)`);
  for (const s of sessions) s.destroy();
  client.close(); child.kill('SIGTERM');
  setTimeout(() => process.exit(0), 500);
});
