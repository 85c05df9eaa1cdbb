// A probe, not a test: what a coordinator's memory and start cost after N ended jobs. A
// coordinator on 127.0.0.1 (any free port, a scratch state folder), one Node.js client
// (@grpc/grpc-js from tests/node, the admin token) that submits N jobs and cancels each
// (CC at a time), then: the coordinator's RSS; it is stopped and started again on the same
// state folder, and the probe prints the time until it listens, its RSS, and the answer and
// latency of a Get of the first job and of the first two List pages.
//   node tools/probes/ended_jobs.js [N=20000] [CC=16]
//   (RACKRUN_COORDINATOR_BIN=... picks the binary; EXTRA="--max-ended-jobs-in-memory 100")
// docs/failure-model.md quotes it for --max-ended-jobs-in-memory.
'use strict';
const path = require('node:path'); const fs = require('node:fs'); const os = require('node:os');
const { spawn } = require('node:child_process');
const { grpc, pkg, coordinatorBin, procStatus } = require('./lib.js');
const N = parseInt(process.argv[2] || '20000'), CC = parseInt(process.argv[3] || '16');
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'probe-'));
fs.writeFileSync(path.join(dir, 'train.tokens'), Buffer.alloc(4096));
const rss = (pid) => procStatus(pid, 'VmRSS') + ' kB';

// Starts the coordinator; resolves with {child, address, ms} once it listens.
function start() {
  const t0 = Date.now();
  const child = spawn(coordinatorBin, ['--listen', '127.0.0.1:0', '--state-dir', dir, ...(process.env.EXTRA ? process.env.EXTRA.split(' ') : [])], { stdio: ['ignore', 'pipe', 'inherit'] });
  return new Promise((resolve) => {
    let out = '';
    child.stdout.on('data', (d) => {
      out += d; const m = /listening on ([0-9.]+:[0-9]+)/.exec(out);
      if (m && !child.started) { child.started = true; resolve({ child, address: m[1], ms: Date.now() - t0 }); }
    });
  });
}
const stop = (child) => new Promise((resolve) => { child.on('exit', resolve); child.kill('SIGTERM'); });

(async () => {
  let c = await start();
  const token = fs.readFileSync(path.join(dir, 'token'), 'utf8').trim();
  const md = () => { const x = new grpc.Metadata(); x.add('authorization', `Bearer ${token}`); return x; };
  const call = (client, method, req) => new Promise((res, rej) => client[method](req, md(), { deadline: Date.now() + 30000 }, (e, r) => e ? rej(e) : res(r)));
  let client = new pkg.rackrun.v1.JobService(c.address, grpc.credentials.createInsecure());
  const spec = { name: 'p', model: { width: 32, blocks: 1, heads: 2, seq_len: 16, moe: { experts: 4, top_k: 2 } }, data: { train: path.join(dir, 'train.tokens'), batch_size: 2 }, training: { steps: 5 } };
  const t0 = Date.now();
  let next = 0;
  const worker = async () => {
    while (next < N) {
      const i = next++;
      const sub = await call(client, 'Submit', { spec, request_id: `r${i}` });
      await call(client, 'Cancel', { job_id: sub.job.id, reason: 'probe' });
    }
  };
  await Promise.all(Array.from({ length: CC }, worker));
  console.log(`${N} jobs submitted and cancelled in ${((Date.now() - t0) / 1000).toFixed(1)} s; coordinator RSS ${rss(c.child.pid)}`);
  client.close();
  await stop(c.child);
  c = await start();
  client = new pkg.rackrun.v1.JobService(c.address, grpc.credentials.createInsecure());
  console.log(`restarted: listening after ${c.ms} ms; RSS ${rss(c.child.pid)}`);
  const timed = async (what, f) => { const t = Date.now(); const r = await f(); console.log(`${what}: ${r} in ${Date.now() - t} ms`); };
  await timed('Get j-1', async () => (await call(client, 'Get', { job_id: 'j-1' })).state);
  let token2 = '';
  for (const page of [1, 2]) {
    if (page > 1 && !token2) break;
    await timed(`List page ${page}`, async () => { const r = await call(client, 'List', { page_size: 1000, page_token: token2 }); token2 = r.next_page_token; return `${r.jobs.length} jobs, ${r.jobs[0].id}..${r.jobs[r.jobs.length - 1].id}`; });
  }
  console.log(`after the reads: RSS ${rss(c.child.pid)}`);
  client.close();
  await stop(c.child);
  fs.rmSync(dir, { recursive: true, force: true });
})().catch((e) => { console.error(e); process.exit(1); });
