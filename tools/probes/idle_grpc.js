// A probe, not a test: a coordinator on 127.0.0.1 (any free port, a scratch state folder,
// TLS on, its open-file limits set to NOFILE, SOFT[:HARD] as prlimit takes them; systemd's
// default is 1024:524288) and N TCP connections to its gRPC port that
// never send a byte (no TLS handshake: no token needed). Prints once a second for T seconds
// a List call's answer and latency from a new client, the coordinator's open descriptors
// and how many idle connections it has closed.
//   node tools/probes/idle_grpc.js [N=1000] [NOFILE=1024:] [T=12]   (1024: keeps the hard limit)
// docs/failure-model.md quotes it for the gRPC port's idle connections.
'use strict';
const path = require('node:path'); const fs = require('node:fs'); const os = require('node:os');
const net = require('node:net');
const { spawn } = require('node:child_process');
const { grpc, pkg, coordinatorBin, procStatus } = require('./lib.js');
const N = parseInt(process.argv[2] || '1000'), NOFILE = process.argv[3] || '1024:', T = parseInt(process.argv[4] || '12');
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'probe-'));
const child = spawn('prlimit', [`--nofile=${NOFILE}`, coordinatorBin, '--listen', '127.0.0.1:0', '--state-dir', dir, '--tls', 'on'], { stdio: ['ignore', 'pipe', 'inherit'] });
let out = '';
child.stdout.on('data', async (d) => {
  out += d; const m = /listening on ([0-9.]+):([0-9]+)/.exec(out); if (!m || child.started) return; child.started = true;
  const token = fs.readFileSync(path.join(dir, 'token'), 'utf8').trim();
  const ca = fs.readFileSync(path.join(dir, 'ca.crt'));
  const md = () => { const x = new grpc.Metadata(); x.add('authorization', `Bearer ${token}`); return x; };
  let closed = 0;
  for (let i = 0; i < N; ++i) { const s = net.connect(parseInt(m[2]), m[1]); s.on('error', () => {}); s.on('close', () => { ++closed; }); }
  const t0 = Date.now();
  for (let t = 0; t < T; ++t) {
    await new Promise(r => setTimeout(r, 1000));
    const client = new pkg.rackrun.v1.JobService(`${m[1]}:${m[2]}`, grpc.credentials.createSsl(ca), { 'grpc.use_local_subchannel_pool': 1 });
    const c0 = Date.now();
    const r = await new Promise((res) => client.List({}, md(), { deadline: Date.now() + 5000 }, (e) => res(e ? `ERR ${e.code} ${e.details.slice(0, 60)}` : 'ok')));
    client.close();
    const fds = fs.readdirSync(`/proc/${child.pid}/fd`).length;
    console.log(`t=${Math.round((Date.now() - t0) / 1000)}s List ${r} in ${Date.now() - c0} ms; coordinator fds ${fds}, threads ${procStatus(child.pid, 'Threads')}; idle connections closed ${closed}/${N}`);
  }
  child.kill('SIGTERM');
  setTimeout(() => process.exit(0), 500);
});
child.on('exit', () => fs.rmSync(dir, { recursive: true, force: true }));
