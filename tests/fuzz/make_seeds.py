#!/usr/bin/env python3
"""Writes the committed seed corpora of tests/fuzz (corpus/<target>/). Rerun after a
format change: python3 tests/fuzz/make_seeds.py (needs protoc for the coordinator's
request seeds). Seeds are small valid inputs plus a few near misses."""
import json
import os
import struct
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# trace_line
write("trace_line", "valid-2x4",
      '{"microbatch": 0, "layer": 3, "ranks": 2, "experts": 4, "loads": [[1,2,3,4],[0,0,0,5]]}')
write("trace_line", "valid-1x1", '{"microbatch":7,"layer":0,"ranks":1,"experts":1,"loads":[[9]]}')
write("trace_line", "big-count",
      '{"microbatch": 9223372036854775807, "layer": 2147483647, "ranks": 1, "experts": 2, '
      '"loads": [[9223372036854775807, 0]]}')
write("trace_line", "negative", '{"microbatch": 0, "layer": 0, "ranks": 1, "experts": 1, "loads": [[-1]]}')
write("trace_line", "float", '{"microbatch": 0, "layer": 0, "ranks": 1, "experts": 1, "loads": [[1.5]]}')
write("trace_line", "not-multiple", '{"microbatch": 0, "layer": 0, "ranks": 2, "experts": 3, "loads": [[1,2,3],[1,2,3]]}')
write("trace_line", "array", "[1, 2, 3]")


# token_file: header (runtime/data.h) + ids
def tokens(dtype, vocab, eod, ids):
    head = b"RKRTOKNS" + struct.pack("<IIQIi", 1, dtype, len(ids), vocab, eod)
    fmt = "<H" if dtype == 2 else "<I"
    return head + b"".join(struct.pack(fmt, t) for t in ids)


text = [256] + list(b"hello world, a tiny document") + [256] + list(b"and another one here")
write("token_file", "bytes-uint16", tokens(2, 257, 256, text))
write("token_file", "uint32-no-eod", tokens(4, 70000, -1, [1, 69999, 5, 7, 9, 11, 13, 15, 17, 19, 21]))
write("token_file", "huge-vocab", tokens(2, 0xFFFFFFFF, -1, [1, 2, 3]))
write("token_file", "truncated", tokens(2, 257, 256, text)[:-1])


# checkpoint: mode byte 3 = append footer and fix section CRCs (fuzz_checkpoint.cc)
def checkpoint(step, sections):
    body = b"RKRCKPT1" + struct.pack("<IIQ", 1, len(sections), step)
    for name, payload in sections:
        body += struct.pack("<I", len(name)) + name + struct.pack("<Q", len(payload)) + payload
        body += struct.pack("<I", 0)  # fixed up by the target
    return body


write("checkpoint", "two-sections", b"\x03" + checkpoint(100, [(b"model", b"\x00" * 16), (b"meta", b"{}")]))
write("checkpoint", "empty", b"\x03" + checkpoint(0, []))
write("checkpoint", "raw-garbage", b"\x00RKRCKPT1 not really")
write("checkpoint", "huge-count", b"\x03" + b"RKRCKPT1" + struct.pack("<IIQ", 1, 0xFFFFFFFF, 1))

# job_spec: the example, JSON, and --set overrides after a NUL byte
with open(os.path.join(ROOT, "examples", "tiny-moe.yaml"), "rb") as f:
    example = f.read()
write("job_spec", "tiny-moe.yaml", example)
write("job_spec", "tiny-moe-overrides", example + b"\0model.width=64\ntraining.steps=5\nbalancer.policy=eplb\n")
minimal = {"name": "j", "model": {"width": 32, "blocks": 1, "heads": 2, "seq_len": 16,
                                  "moe": {"experts": 4, "top_k": 2, "expert_hidden": 32}},
           "data": {"train": "/tmp/train.tokens", "batch_size": 2}, "training": {"steps": 1}}
write("job_spec", "minimal.json", json.dumps(minimal))
write("job_spec", "bad-field", "model:\n  widht: 3\n")


# coordinator: [method byte][u16 length][request bytes] (fuzz_coordinator.cc)
def encode(message, text_proto):
    out = subprocess.run(
        ["protoc", "-I", os.path.join(ROOT, "proto"), "--encode=rackrun.v1." + message,
         "rackrun/v1/job_service.proto", "rackrun/v1/rack_control.proto"],
        input=text_proto.encode(), capture_output=True, check=True)
    return out.stdout


def stream(method, payload):
    """One call of the coordinator target: [method][u16 length][payload]."""
    return bytes([method]) + struct.pack("<H", len(payload)) + payload


def call(method, message, text_proto):
    return stream(method, encode(message, text_proto))


spec = ('spec { name: "j" model { width: 32 blocks: 1 heads: 2 seq_len: 16 '
        'moe { experts: 4 top_k: 2 expert_hidden: 32 } } '
        'data { train: "/tmp/train.tokens" batch_size: 2 } training { steps: 1 } '
        'checkpoint { dir: "/tmp/ckpt" } } request_id: "r1"')
register = 'host: "h" pid: 1 launcher_rank: -1 device: "cpu" channels: "gloo" threads: 1'
seq = (call(0, "SubmitRequest", spec) + call(5, "RegisterRequest", register) +
       call(6, "HeartbeatRequest", 'worker_id: "w-1" phase: "idle"') +
       call(2, "ListJobsRequest", "page_size: 10") + call(4, "ListWorkersRequest", "") +
       call(1, "GetJobRequest", 'job_id: "j-1"') +
       call(7, "ReportRequest", 'worker_id: "w-1" job_id: "j-1" attempt: 1 progress { step: 1 }') +
       call(9, "StoreSetRequest", 'job_id: "j-1" attempt: 1 key: "k" value: "v"') +
       call(10, "StoreGetRequest", 'job_id: "j-1" attempt: 1 keys: "k"') +
       call(3, "CancelJobRequest", 'job_id: "j-1" reason: "fuzz"') +
       call(8, "DeregisterRequest", 'worker_id: "w-1"'))
write("coordinator", "submit-register-run-cancel", seq)
write("coordinator", "submit-only", call(0, "SubmitRequest", spec))
write("coordinator", "list-bad-page", call(2, "ListJobsRequest", 'page_size: -5 page_token: "zz"'))

# The streams (method 11 Watch, 12 Assignments, 13 Plans: rows of [u8 length][LoadRow]).
def rows(*text_protos):
    out = b""
    for t in text_protos:
        b = encode("LoadRow", t)
        out += bytes([len(b)]) + b
    return out


row = 'job_id: "j-1" attempt: 1 rank: 0 microbatch: 0 layer: 0 training: true loads: [1, 2, 3, 4]'
planned = spec.replace("training { steps: 1 }", 'training { steps: 1 } balancer { mode: "coordinator" }')
beat = call(6, "HeartbeatRequest", 'worker_id: "w-1" phase: "idle"')
# The rack schedules the job onto w-1 once its Assignments stream is open and 1 s of the
# rack's clock (250 ms per call) has passed: Plans then finds attempt 1 running in
# coordinator mode.
streams = (call(0, "SubmitRequest", planned) + call(5, "RegisterRequest", register) + beat +
           call(12, "AssignmentsRequest", 'worker_id: "w-1"') + beat * 6 +
           stream(13, rows(row, 'microbatch: 1 layer: 0 loads: [4, 3, 2, 1]')) +
           call(11, "WatchJobRequest", 'job_id: "j-1"') +
           call(12, "AssignmentsRequest", 'worker_id: "w-1"') +
           call(3, "CancelJobRequest", 'job_id: "j-1" reason: "fuzz"') +
           call(11, "WatchJobRequest", 'job_id: "j-1" from_seq: 2') +
           call(12, "AssignmentsRequest", 'worker_id: "w-1"'))
write("coordinator", "streams", streams)
write("coordinator", "plans-bad-rows",
      stream(13, rows('attempt: 1 rank: 0', row, 'job_id: "other" attempt: 1', 'loads: [-1]')))
write("coordinator", "watch-missing-job", call(11, "WatchJobRequest", 'job_id: "nope" from_seq: -3'))

# dataset_files: a first byte (even: a Megatron dataset, odd: a safetensors file); for the
# dataset, uint16 lengths of the .idx and the record, then the .idx, the record, the .bin.
def megatron_idx(dtype, lengths, docs, element):
    out = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype, len(lengths), len(docs))
    out += struct.pack("<%di" % len(lengths), *lengths)
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at += n * element
    out += struct.pack("<%dq" % len(offsets), *offsets)
    out += struct.pack("<%dq" % len(docs), *docs)
    return out


def dataset(idx, record, binary):
    return b"\x00" + struct.pack("<HH", len(idx), len(record)) + idx + record + binary


tokens = [5, 6, 1, 7, 1, 8, 9, 10, 1]
record = json.dumps({"format": "rackrun dataset record", "version": 1,
                     "tokenizer": {"kind": "bytes", "model_type": "", "vocab": 260, "bos": -1,
                                   "eos": 1, "pad": -1, "model_crc32c": 0, "model": ""},
                     "end_of_document": 1, "documents": 3, "tokens": 9,
                     "unigram_entropy": 1.5, "sources": ["a.txt"]}).encode()
write("dataset_files", "uint16-3-docs",
      dataset(megatron_idx(8, [3, 2, 4], [0, 1, 2, 3], 2), record,
              struct.pack("<9H", *tokens)))
write("dataset_files", "int32-no-record",
      dataset(megatron_idx(4, [3, 2, 4], [0, 3], 4), b"", struct.pack("<9i", *tokens)))
write("dataset_files", "bin-too-short",
      dataset(megatron_idx(8, [3, 2, 4], [0, 1, 2, 3], 2), b"", struct.pack("<5H", *tokens[:5])))
write("dataset_files", "bad-record",
      dataset(megatron_idx(8, [1], [0, 1], 2), b'{"tokenizer": 7}', struct.pack("<H", 3)))


def safetensors(header, buffer):
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return b"\x01" + struct.pack("<Q", len(h)) + h + buffer


write("dataset_files", "safetensors-two",
      safetensors({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                   "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
                   "__metadata__": {"format": "pt"}}, bytes(range(22))))
write("dataset_files", "safetensors-overlap",
      safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)))
write("dataset_files", "safetensors-huge-shape",
      safetensors({"a": {"dtype": "F64", "shape": [4294967296, 4294967296],
                         "data_offsets": [0, 0]}}, b""))
