// An independent client of rackrun-coordinator in another language (issue 9 section 8):
// Node.js with @grpc/grpc-js and @grpc/proto-loader, loading the service contract from
// proto/. It starts a real coordinator on 127.0.0.1 (any free port, a scratch state
// folder) and checks health, reflection, submit/get/watch/cancel, token refusal, the roles
// (one call per role and service), and a second coordinator with --tls=on whose automatic
// CA grpc-js verifies.
//
// Run by CTest (tests/node/CMakeLists.txt):
//   RACKRUN_COORDINATOR_BIN=build/coordinator/rackrun-coordinator \
//   RACKRUN_PROTO_DIR=proto node --test tests/node/coordinator_client.test.js
// The packages come from tests/node/node_modules (tools/setup runs `npm ci` there).
'use strict';

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

let grpc;
let protoLoader;
try {
  grpc = require('@grpc/grpc-js');
  protoLoader = require('@grpc/proto-loader');
} catch (e) {
  throw new Error(`the npm packages are missing (${e.message}); run tools/setup ` +
                  '(npm ci in tests/node)');
}

const repo = path.resolve(__dirname, '..', '..');
const coordinatorBin = process.env.RACKRUN_COORDINATOR_BIN ||
    path.join(repo, 'build', 'coordinator', 'rackrun-coordinator');
const protoDir = process.env.RACKRUN_PROTO_DIR || path.join(repo, 'proto');
const CALL_MS = 10000;

const loadOptions = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const rackrunPkg = grpc.loadPackageDefinition(protoLoader.loadSync(
    ['rackrun/v1/job_service.proto', 'rackrun/v1/rack_control.proto'],
    { ...loadOptions, includeDirs: [protoDir] }));
const localProtos = path.join(__dirname, 'proto');
const healthPkg = grpc.loadPackageDefinition(protoLoader.loadSync(
    'grpc/health/v1/health.proto', { ...loadOptions, includeDirs: [localProtos] }));
const reflectionPkg = grpc.loadPackageDefinition(protoLoader.loadSync(
    'grpc/reflection/v1alpha/reflection.proto', { ...loadOptions, includeDirs: [localProtos] }));

let stateDir;
let coordinator;
let address;
let token;
let jobs;

function deadline() {
  return { deadline: Date.now() + CALL_MS };
}

function auth(value = token) {
  const md = new grpc.Metadata();
  if (value !== null) md.add('authorization', `Bearer ${value}`);
  return md;
}

// Promise form of a unary call: resolves with the response, rejects with the grpc error.
function call(client, method, request, metadata = auth()) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, deadline(), (err, response) => {
      if (err) reject(err); else resolve(response);
    });
  });
}

// A small spec the coordinator accepts (it stays QUEUED: no workers run here).
function spec(name) {
  return {
    name,
    model: { width: 32, blocks: 1, heads: 2, seq_len: 16, moe: { experts: 4, top_k: 2 } },
    data: { train: path.join(stateDir, 'train.tokens'), batch_size: 2 },
    training: { steps: 5 },
  };
}

// Starts a coordinator on `dir` and resolves with { child, address } (HOST:PORT from its
// banner line).
function spawnCoordinator(dir, extra = []) {
  return new Promise((resolve, reject) => {
    const child = spawn(coordinatorBin,
                        ['--listen', '127.0.0.1:0', '--state-dir', dir, ...extra],
                        { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    const timer = setTimeout(
        () => reject(new Error(`no banner from ${coordinatorBin} within 15 s: ${out}${err}`)),
        15000);
    child.stdout.on('data', (d) => {
      out += d;
      const m = /listening on ([0-9.]+):([0-9]+)/.exec(out);
      if (m) {
        clearTimeout(timer);
        resolve({ child, address: `${m[1]}:${m[2]}` });
      }
    });
    child.stderr.on('data', (d) => { err += d; });
    child.on('error', (e) => { clearTimeout(timer); reject(e); });
    child.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`${coordinatorBin} exited with ${code} before its banner: ${out}${err}`));
    });
  });
}

async function stopCoordinator(child) {
  if (child && child.exitCode === null) {
    const exited = new Promise((resolve) => child.once('exit', resolve));
    child.kill('SIGTERM');
    const timer = setTimeout(() => child.kill('SIGKILL'), 5000);
    await exited;
    clearTimeout(timer);
  }
}

function readToken(dir, name) {
  const file = path.join(dir, name);
  assert.equal(fs.statSync(file).mode & 0o077, 0, `${name} must be private (0600)`);
  return fs.readFileSync(file, 'utf8').trim();
}

before(async () => {
  stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'rackrun-node-'));
  ({ child: coordinator, address } = await spawnCoordinator(stateDir));
  token = readToken(stateDir, 'token');
  jobs = new rackrunPkg.rackrun.v1.JobService(address, grpc.credentials.createInsecure());
});

after(async () => {
  if (jobs) jobs.close();
  await stopCoordinator(coordinator);
  if (stateDir) fs.rmSync(stateDir, { recursive: true, force: true });
});

test('health check says SERVING', { timeout: 15000 }, async () => {
  const health = new healthPkg.grpc.health.v1.Health(address, grpc.credentials.createInsecure());
  try {
    const r = await call(health, 'Check', { service: '' }, new grpc.Metadata());
    assert.equal(r.status, 'SERVING');
  } finally {
    health.close();
  }
});

test('reflection lists JobService and RackControl', { timeout: 15000 }, async () => {
  const reflection = new reflectionPkg.grpc.reflection.v1alpha.ServerReflection(
      address, grpc.credentials.createInsecure());
  try {
    const names = await new Promise((resolve, reject) => {
      const stream = reflection.ServerReflectionInfo(deadline());
      stream.on('data', (r) => {
        if (r.message_response !== 'list_services_response') {
          reject(new Error(`unexpected reflection reply ${JSON.stringify(r)}`));
        } else {
          resolve(r.list_services_response.service.map((s) => s.name));
        }
        stream.end();
      });
      stream.on('error', reject);
      stream.write({ host: '', list_services: '*' });
    });
    assert.ok(names.includes('rackrun.v1.JobService'), names.join(', '));
    assert.ok(names.includes('rackrun.v1.RackControl'), names.join(', '));
  } finally {
    reflection.close();
  }
});

test('submit is idempotent by request id; get returns the job', { timeout: 15000 }, async () => {
  const requestId = `node-${process.pid}-submit`;
  const first = await call(jobs, 'Submit', { spec: spec('node-submit'), request_id: requestId });
  assert.equal(first.created, true);
  assert.ok(first.job.id.length > 0);
  assert.equal(first.job.state, 'QUEUED');
  const again = await call(jobs, 'Submit', { spec: spec('node-submit'), request_id: requestId });
  assert.equal(again.created, false);
  assert.equal(again.job.id, first.job.id);

  const got = await call(jobs, 'Get', { job_id: first.job.id });
  assert.equal(got.id, first.job.id);
  assert.equal(got.name, 'node-submit');
  assert.equal(got.request_id, requestId);
  assert.equal(got.spec.data.train, path.join(stateDir, 'train.tokens'));

  await assert.rejects(call(jobs, 'Get', { job_id: 'no-such-job' }),
                       (e) => e.code === grpc.status.NOT_FOUND);
});

test('a bad spec is INVALID_ARGUMENT naming the field', { timeout: 15000 }, async () => {
  const bad = spec('node-bad');
  bad.model.moe.top_k = 99;
  await assert.rejects(call(jobs, 'Submit', { spec: bad, request_id: `node-${process.pid}-bad` }),
                       (e) => e.code === grpc.status.INVALID_ARGUMENT &&
                              e.details.includes('model.moe.top_k'));
});

// Collects a Watch stream's events until it ends; `onEvent` may act on each one.
function watch(jobId, fromSeq, onEvent = () => {}) {
  return new Promise((resolve, reject) => {
    const events = [];
    const stream = jobs.Watch({ job_id: jobId, from_seq: fromSeq }, auth(),
                              { deadline: Date.now() + 20000 });
    stream.on('data', (e) => {
      events.push(e);
      onEvent(e, events);
    });
    stream.on('error', reject);
    stream.on('end', () => resolve(events));
  });
}

test('watch streams events with increasing seq; cancel ends it with CANCELLED',
     { timeout: 30000 }, async () => {
  const submitted = await call(jobs, 'Submit',
                               { spec: spec('node-watch'), request_id: `node-${process.pid}-watch` });
  const jobId = submitted.job.id;
  let cancelled = null;
  const events = await watch(jobId, 0, (e) => {
    if (cancelled === null && e.event === 'state' && e.state === 'QUEUED') {
      cancelled = call(jobs, 'Cancel', { job_id: jobId, reason: 'node test' });
    }
  });
  assert.ok(cancelled !== null, `no QUEUED event: ${JSON.stringify(events)}`);
  assert.equal((await cancelled).state, 'CANCELLED');
  events.forEach((e, i) => {
    assert.equal(e.job_id, jobId);
    assert.equal(Number(e.seq), i + 1, `seq 1, 2, ... without gaps: ${JSON.stringify(events)}`);
  });
  const last = events[events.length - 1];
  assert.equal(last.event, 'state');
  assert.equal(last.state, 'CANCELLED');

  // Resumable: from the first seq on, the same events again, nothing before.
  const resumed = await watch(jobId, 1);
  assert.deepEqual(resumed.map((e) => Number(e.seq)), events.slice(1).map((e) => Number(e.seq)));
  assert.equal(resumed[resumed.length - 1].state, 'CANCELLED');

  // Cancelling a finished job is FAILED_PRECONDITION.
  await assert.rejects(call(jobs, 'Cancel', { job_id: jobId }),
                       (e) => e.code === grpc.status.FAILED_PRECONDITION);
});

test('calls without the right token are UNAUTHENTICATED and create nothing',
     { timeout: 15000 }, async () => {
  const before = await call(jobs, 'List', { page_size: 1000 });
  for (const metadata of [auth(null), auth('not-the-token')]) {
    await assert.rejects(
        call(jobs, 'Submit', { spec: spec('node-unauth'), request_id: `node-${process.pid}-unauth` },
             metadata),
        (e) => e.code === grpc.status.UNAUTHENTICATED);
    await assert.rejects(call(jobs, 'List', {}, metadata),
                         (e) => e.code === grpc.status.UNAUTHENTICATED);
  }
  const afterList = await call(jobs, 'List', { page_size: 1000 });
  assert.deepEqual(afterList.jobs.map((j) => j.id), before.jobs.map((j) => j.id));
  assert.ok(!afterList.jobs.some((j) => j.name === 'node-unauth'));
});

// One call per role and service. Reads (List) are open to every role; Submit needs the
// user role; RackControl (Heartbeat of an unknown worker here: admitted calls answer
// NOT_FOUND, refused ones PERMISSION_DENIED before looking) needs the worker role.
test('each role token may make only its own calls', { timeout: 20000 }, async () => {
  const roles = {
    user: readToken(stateDir, 'token-user'),
    worker: readToken(stateDir, 'token-worker'),
    readonly: readToken(stateDir, 'token-readonly'),
    admin: token,
  };
  assert.equal(new Set(Object.values(roles)).size, 4, 'every role has its own token');
  const rack = new rackrunPkg.rackrun.v1.RackControl(address, grpc.credentials.createInsecure());
  try {
    const denied = (needed) => (e) => e.code === grpc.status.PERMISSION_DENIED &&
        e.details.includes(`needs the ${needed} role`);
    for (const [role, value] of Object.entries(roles)) {
      await call(jobs, 'List', { page_size: 1 }, auth(value));  // every role may read
      const submit = call(jobs, 'Submit',
                          { spec: spec(`node-${role}`), request_id: `node-${process.pid}-${role}` },
                          auth(value));
      if (role === 'user' || role === 'admin') {
        assert.equal((await submit).created, true, role);
      } else {
        await assert.rejects(submit, denied('user'), role);
      }
      const heartbeat = call(rack, 'Heartbeat', { worker_id: 'w-none', phase: 'idle' }, auth(value));
      if (role === 'worker' || role === 'admin') {
        await assert.rejects(heartbeat, (e) => e.code !== grpc.status.PERMISSION_DENIED &&
                                               e.code !== grpc.status.UNAUTHENTICATED, role);
      } else {
        await assert.rejects(heartbeat, denied('worker'), role);
      }
    }
    // The refused submissions created nothing.
    const names = (await call(jobs, 'List', { page_size: 1000 })).jobs.map((j) => j.name);
    assert.ok(names.includes('node-user') && names.includes('node-admin'), names.join(','));
    assert.ok(!names.includes('node-worker') && !names.includes('node-readonly'), names.join(','));
  } finally {
    rack.close();
  }
});

// --tls=on: grpc-js trusts only the coordinator's automatic CA (STATE_DIR/ca.crt), checks
// the server certificate against it and against 127.0.0.1, and calls with a role token.
// The join token's hash is the SHA-256 of that CA's DER form.
test('a TLS coordinator is verified against its automatic CA', { timeout: 20000 }, async () => {
  const crypto = require('node:crypto');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rackrun-node-tls-'));
  let tls;
  try {
    tls = await spawnCoordinator(dir, ['--tls=on']);
    const caPem = fs.readFileSync(path.join(dir, 'ca.crt'));
    const der = new crypto.X509Certificate(caPem).raw;
    const join = readToken(dir, 'join-token-readonly');
    assert.equal(join, `rr1-${crypto.createHash('sha256').update(der).digest('hex')}::` +
                       readToken(dir, 'token-readonly'));
    const secure = new rackrunPkg.rackrun.v1.JobService(tls.address, grpc.credentials.createSsl(caPem));
    try {
      const r = await call(secure, 'List', {}, auth(readToken(dir, 'token-readonly')));
      assert.deepEqual(r.jobs, []);
    } finally {
      secure.close();
    }
    // Plaintext gets no answer from it.
    const plain = new rackrunPkg.rackrun.v1.JobService(tls.address, grpc.credentials.createInsecure());
    try {
      await assert.rejects(call(plain, 'List', {}, auth(readToken(dir, 'token-readonly'))),
                           (e) => e.code === grpc.status.UNAVAILABLE);
    } finally {
      plain.close();
    }
  } finally {
    if (tls) await stopCoordinator(tls.child);
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
