// What the probes share: the repository, @grpc/grpc-js and the JobService package from
// tests/node's modules (tools/setup installs them), the coordinator binary
// (RACKRUN_COORDINATOR_BIN, else build/'s), and a field of a process's /proc status.
'use strict';
const path = require('node:path'); const fs = require('node:fs');
const repo = path.resolve(__dirname, '..', '..');
const nm = path.join(repo, 'tests', 'node', 'node_modules') + '/';
const grpc = require(nm + '@grpc/grpc-js'); const protoLoader = require(nm + '@grpc/proto-loader');
const pkg = grpc.loadPackageDefinition(protoLoader.loadSync(['rackrun/v1/job_service.proto'],
  { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [path.join(repo, 'proto')] }));
const coordinatorBin = process.env.RACKRUN_COORDINATOR_BIN || path.join(repo, 'build', 'coordinator', 'rackrun-coordinator');
// procStatus(pid, 'VmRSS') -> '79392' (kB), 'Threads' -> '12'; 'gone' once the process is.
const procStatus = (pid, field) => {
  try { return new RegExp(`${field}:\\s+(\\d+)`).exec(fs.readFileSync(`/proc/${pid}/status`, 'utf8'))[1]; } catch (e) { return 'gone'; }
};
module.exports = { repo, grpc, pkg, coordinatorBin, procStatus };
