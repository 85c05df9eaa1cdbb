// A probe, not a test: a coordinator on 127.0.0.1 (any free port, a scratch state folder)
// and one Node.js client (@grpc/grpc-js from tests/node, the admin token) that opens N Watch
// streams over CH channels on a queued job, then prints once a second the coordinator's
// thread count, a Get's answer and latency, the refusals by gRPC code and its RSS.
//   node tools/probes/watch_flood.js [N=1000] [CH=8]   (EXTRA="--max-watch-streams 64" adds flags)
// docs/failure-model.md quotes it for the watch-stream limit (--max-watch-streams).
'use strict';
const path = require('node:path'); const fs = require('node:fs'); const os = require('node:os');
const { spawn } = require('node:child_process');
const { grpc, pkg, coordinatorBin, procStatus } = require('./lib.js');
const N = parseInt(process.argv[2] || '1000'), CH = parseInt(process.argv[3] || '8');
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'probe-'));
fs.writeFileSync(path.join(dir, 'train.tokens'), Buffer.alloc(4096));
const child = spawn(coordinatorBin, ['--listen', '127.0.0.1:0', '--state-dir', dir, ...(process.env.EXTRA ? process.env.EXTRA.split(' ') : [])], { stdio: ['ignore', 'pipe', 'inherit'] });
let out = '';
const threads = () => procStatus(child.pid, 'Threads');
child.stdout.on('data', async (d) => {
  out += d; const m = /listening on ([0-9.]+:[0-9]+)/.exec(out); if (!m || child.started) return; child.started = true;
  const token = fs.readFileSync(path.join(dir, 'token'), 'utf8').trim();
  const md = () => { const x = new grpc.Metadata(); x.add('authorization', `Bearer ${token}`); return x; };
  const clients = []; for (let i = 0; i < CH; ++i) clients.push(new pkg.rackrun.v1.JobService(m[1], grpc.credentials.createInsecure(), { 'grpc.use_local_subchannel_pool': 1, 'grpc-node.max_session_memory': 1e9 }));
  const sub = await new Promise((res, rej) => clients[0].Submit({ spec: { name: 'p', model: { width: 32, blocks: 1, heads: 2, seq_len: 16, moe: { experts: 4, top_k: 2 } }, data: { train: path.join(dir, 'train.tokens'), batch_size: 2 }, training: { steps: 5 } }, request_id: 'r1' }, md(), (e, r) => e ? rej(e) : res(r)));
  console.log('submitted', sub.job.id, 'threads', threads());
  let errs = {};
  for (let i = 0; i < N; ++i) { const s = clients[i % CH].Watch({ job_id: sub.job.id }, md()); s.on('data', () => {}); s.on('error', (e) => { errs[e.code] = (errs[e.code] || 0) + 1; }); }
  for (let t = 0; t < 8; ++t) {
    await new Promise(r => setTimeout(r, 1000));
    const t0 = Date.now();
    const r = await new Promise((res) => clients[0].Get({ job_id: sub.job.id }, md(), { deadline: Date.now() + 5000 }, (e, r) => res(e ? 'ERR ' + e.code + ' ' + e.details : 'ok')));
    console.log(`t=${t + 1}s threads ${threads()} get ${r} in ${Date.now() - t0} ms errors ${JSON.stringify(errs)} rss ${procStatus(child.pid, 'VmRSS')} kB`);
  }
  child.on('exit', () => { fs.rmSync(dir, { recursive: true, force: true }); process.exit(0); });
  child.kill('SIGTERM');
});
