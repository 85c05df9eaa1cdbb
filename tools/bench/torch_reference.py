#!/usr/bin/python3
"""PyTorch reference of the rackrun demo model, for the training-step throughput comparison.

The same model as runtime/model.h: byte embedding -> L blocks of [attention sublayer, MoE
sublayer] wrapped by the residual streams (vanilla, mhc or xhc, docs/design.md section 5) ->
sum of the streams -> final RMSNorm -> LM head -> next-token cross-entropy. Attention: pre-norm
RMSNorm, fused QKV, rotary embedding, causal softmax. MoE: pre-norm RMSNorm, softmax
router, top-k with renormalised gates, SwiGLU experts run on their gathered tokens.
xhc: stream router (sigmoid of LayerNorm(vec X) W_r, m fixed + top-(k-m) routed), dense
read, active-set Sinkhorn mixing (20 iterations, row-sum clamp), write-back weights,
temporal write-back basis for MLP sublayers (causal depthwise convolutions 4/8/12 +
modified Gram-Schmidt). mhc (N=4 by default): dynamic H_pre, H_post and a Sinkhorn H_res over
all N streams from RMSNorm(vec X). Autograd does the backward; torch.optim.AdamW the update.
--compile runs the model through torch.compile (PyTorch >= 2.0; Debian's 1.13 refuses it with a
clear error); the warm-up steps then include the compilation.

Run with Debian's python (tools/setup --torch):
  /usr/bin/python3 tools/bench/torch_reference.py --residual xhc --threads 2 --json
Prints one JSON object (tokens_per_s, step_s, optimizer_s, ...) with --json.

On a GPU (--device cuda; bench_gpu_train_step_bench runs it so): the model, its data and the
optimizer live on the GPU; --precision tf32 allows TF32 matmuls, bf16 runs the forward under
torch.autocast(bfloat16) (fp32 master weights and optimizer state either way); attention is
F.scaled_dot_product_attention(is_causal=True) (the CPU keeps the explicit softmax); the
step is timed between torch.cuda.synchronize() calls; the JSON adds peak_memory_bytes
(torch.cuda.max_memory_allocated over the run) and device_name. --config c1024 sets the
issue-35 shape (C=1024, 16 heads, 64 experts top-4, F=1024, seq 1024); explicit shape options
override it. Not run on a GPU yet.
"""
import argparse
import contextlib
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Attention(torch.nn.Module):
    def __init__(self, c, heads, seq, theta, std, out_std):
        super().__init__()
        self.heads, self.d = heads, c // heads
        self.gain = torch.nn.Parameter(torch.ones(c))
        self.wqkv = torch.nn.Parameter(torch.randn(c, 3 * c) * std)
        self.wo = torch.nn.Parameter(torch.randn(c, c) * out_std)
        half = self.d // 2
        freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.d)
        ang = torch.arange(seq, dtype=torch.float64)[:, None] * freq[None, :]
        self.register_buffer("cos", torch.cos(ang).float())
        self.register_buffer("sin", torch.sin(ang).float())
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1))

    def rope(self, x):  # x: [B, H, S, D], pairs (2i, 2i+1)
        s = x.shape[2]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, n = self.cos[:s], self.sin[:s]
        return torch.stack((x0 * c - x1 * n, x0 * n + x1 * c), dim=-1).flatten(-2)

    def forward(self, u, batch, seq):
        xn = rms_norm(u) * self.gain
        qkv = (xn @ self.wqkv).view(batch, seq, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        q, k, v = self.rope(qkv[0]), self.rope(qkv[1]), qkv[2]
        if u.is_cuda:  # one type for the fused kernel (rope's tables promote q, k to fp32)
            o = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, is_causal=True)
        else:
            att = (q @ k.transpose(-1, -2)) / math.sqrt(self.d) + self.mask[:seq, :seq]
            o = torch.softmax(att, dim=-1) @ v
        return o.permute(0, 2, 1, 3).reshape(batch * seq, -1) @ self.wo


class Moe(torch.nn.Module):
    def __init__(self, c, experts, top_k, hidden, std, out_std):
        super().__init__()
        self.e, self.k, self.f = experts, top_k, hidden
        self.gain = torch.nn.Parameter(torch.ones(c))
        self.router = torch.nn.Parameter(torch.randn(c, experts) * std)
        self.w13 = torch.nn.Parameter(torch.randn(experts, c, 2 * hidden) * std)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, c) * out_std)
        self.counts = None

    def forward(self, u):
        xn = rms_norm(u) * self.gain
        scores = torch.softmax(xn @ self.router, dim=-1)
        top, sel = torch.topk(scores, self.k, dim=-1)
        gates = top / top.sum(-1, keepdim=True)
        flat_sel = sel.reshape(-1)
        order = torch.argsort(flat_sel, stable=True)
        counts = torch.bincount(flat_sel, minlength=self.e).tolist()
        self.counts = counts
        token_of = order // self.k
        xs = xn[token_of]
        outs = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            x = xs[start:start + n]
            h = x @ self.w13[e]
            outs.append((F.silu(h[:, :self.f]) * h[:, self.f:]) @ self.w2[e])
            start += n
        y = torch.cat(outs, 0) * gates.reshape(-1)[order, None]
        return torch.zeros_like(xn).index_add_(0, token_of, y.to(xn.dtype))


def sinkhorn(z, iters=20, eps=1e-6):
    m = torch.exp(z - z.amax(dim=(-1, -2), keepdim=True))
    for _ in range(iters):
        m = m / (m.sum(-2, keepdim=True) + eps)
        m = m / (m.sum(-1, keepdim=True) + eps)
    return m


class Mhc(torch.nn.Module):
    """One sublayer's mhc mappings (docs/design.md sections 5.3, 5.6): from v = RMSNorm(vec X),
    H_pre = sigma(a_pre v W_pre + b_pre), H_post = 2 sigma(a_post v W_post + b_post), H_res =
    Sinkhorn(a_res mat(v W_res) + b_res); X' = H_res X + H_post^T F(H_pre X)."""

    def __init__(self, c, n, layer):
        super().__init__()
        self.n = n
        self.w = torch.nn.Parameter(torch.zeros(n * c, 2 * n + n * n))  # [pre | post | res]
        b_pre = torch.full((n,), -2.0)
        b_pre[layer % n] = 2.0
        self.b_pre = torch.nn.Parameter(b_pre)
        self.b_post = torch.nn.Parameter(torch.zeros(n))
        self.b_res = torch.nn.Parameter(torch.full((n, n), -2.0).fill_diagonal_(0.0))
        self.a = torch.nn.Parameter(torch.full((3,), 0.01))  # a_pre, a_post, a_res

    def forward(self, x, body):  # x: [T, N, C]
        t, n, _ = x.shape
        z = rms_norm(x.reshape(t, -1)) @ self.w
        h_pre = torch.sigmoid(self.a[0] * z[:, :n] + self.b_pre)
        h_post = 2 * torch.sigmoid(self.a[1] * z[:, n:2 * n] + self.b_post)
        h_res = sinkhorn(self.a[2] * z[:, 2 * n:].view(t, n, n) + self.b_res)
        out = body((h_pre[:, :, None] * x).sum(1))
        return h_res @ x + h_post[:, :, None] * out[:, None, :].to(x.dtype)


class Xhc(torch.nn.Module):
    """One sublayer's xhc mappings (docs/design.md section 5.4)."""

    def __init__(self, c, n, k, m, mlp, convs=(4, 8, 12)):
        super().__init__()
        self.n, self.k, self.m, self.mlp = n, k, m, mlp
        self.kr = 1 + len(convs) if mlp else 1
        self.w_router = torch.nn.Parameter(torch.randn(n * c, n) * 0.02)
        self.w_pre = torch.nn.Parameter(torch.zeros(n * c, n))
        self.b_pre = torch.nn.Parameter(torch.zeros(n))
        self.a_pre = torch.nn.Parameter(torch.tensor(0.01))
        self.w_res = torch.nn.Parameter(torch.zeros(k * c, k * k))
        self.b_res = torch.nn.Parameter(torch.zeros(k, k))
        self.a_res = torch.nn.Parameter(torch.tensor(0.01))
        self.w_post = torch.nn.Parameter(torch.zeros(k * c, k * self.kr))
        self.b_post = torch.nn.Parameter(torch.zeros(k, self.kr))
        self.a_post = torch.nn.Parameter(torch.tensor(0.01))
        self.convs = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(c, 1, w)) for w in convs] if mlp else [])

    def read(self, x):  # x: [T, N, C]
        t, n, c = x.shape
        flat = x.reshape(t, n * c)
        s = torch.sigmoid(F.layer_norm(flat, (n * c,)) @ self.w_router)
        _, routed = torch.topk(s[:, self.m:], self.k - self.m, dim=-1)
        routed = torch.sort(routed + self.m, dim=-1).values
        fixed = torch.arange(self.m, device=x.device).expand(t, self.m)
        idx = torch.cat([fixed, routed], dim=-1)  # [T, k]
        routed_gate = torch.gather(s, 1, routed)
        ones = torch.ones(t, self.m, device=x.device, dtype=routed_gate.dtype)
        gate = torch.cat([ones, routed_gate], dim=-1)
        h_pre = torch.sigmoid(self.a_pre * (rms_norm(flat) @ self.w_pre) + self.b_pre)
        u = (h_pre[:, :, None] * x).sum(1)
        return u, idx, gate

    def write(self, x, out, idx, gate, batch, seq):
        t, n, c = x.shape
        gidx = idx[:, :, None].expand(t, self.k, c)
        xa = torch.gather(x, 1, gidx)  # [T, k, C]
        xan = rms_norm(xa.reshape(t, self.k * c))
        h_res = sinkhorn(self.a_res * (xan @ self.w_res).view(t, self.k, self.k) + self.b_res)
        h_res = h_res / h_res.sum(-1, keepdim=True).clamp(min=1.0)
        h_post = 2 * torch.sigmoid(
            self.a_post * (xan @ self.w_post).view(t, self.k, self.kr) + self.b_post)
        if self.mlp:
            seqs = out.view(batch, seq, c).transpose(1, 2)  # [B, C, S]
            basis = [out]
            for w in self.convs:
                g = F.conv1d(F.pad(seqs, (w.shape[-1] - 1, 0)), w.flip(-1), groups=c)
                basis.append(g.transpose(1, 2).reshape(t, c).to(out.dtype))
            vs = []
            for g in basis:  # modified Gram-Schmidt, no unit scaling
                v = g
                for p in vs:
                    v = v - ((v * p).sum(-1, keepdim=True) / ((p * p).sum(-1, keepdim=True) + 1e-6)) * p
                vs.append(v)
            o = torch.stack(vs, 1)  # [T, Kr, C]
        else:
            o = out[:, None, :]
        new = h_res @ xa + gate[:, :, None] * (h_post @ o)
        return x.scatter(1, gidx, new.to(x.dtype))


class Model(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        n = a.streams if a.residual in ("xhc", "mhc") else 1
        out_std = 0.02 / math.sqrt(n)
        self.embed = torch.nn.Parameter(torch.randn(a.vocab, a.width) * 0.02)
        self.attn = torch.nn.ModuleList(
            [Attention(a.width, a.heads, a.seq, 10000.0, 0.02, out_std) for _ in range(a.blocks)])
        self.moe = torch.nn.ModuleList(
            [Moe(a.width, a.experts, a.top_k, a.expert_hidden, 0.02, out_std)
             for _ in range(a.blocks)])
        self.xhc = torch.nn.ModuleList(
            [Xhc(a.width, a.streams, a.active, a.fixed, mlp=(i % 2 == 1))
             for i in range(2 * a.blocks)] if a.residual == "xhc" else [])
        self.mhc = torch.nn.ModuleList(
            [Mhc(a.width, a.streams, i) for i in range(2 * a.blocks)]
            if a.residual == "mhc" else [])
        self.final_gain = torch.nn.Parameter(torch.ones(a.width))
        self.head = torch.nn.Parameter(torch.randn(a.width, a.vocab) * 0.02)

    def forward(self, inputs, targets, batch, seq):
        e = self.embed[inputs.reshape(-1)]
        bodies = []
        for b in range(self.a.blocks):
            bodies.append(lambda u, b=b: self.attn[b](u, batch, seq))
            bodies.append(lambda u, b=b: self.moe[b](u))
        if self.a.residual == "xhc":
            x = e[:, None, :].expand(-1, self.a.streams, -1).contiguous()
            for layer, body in zip(self.xhc, bodies):
                u, idx, gate = layer.read(x)
                x = layer.write(x, body(u), idx, gate, batch, seq)
            y = x.sum(1)
        elif self.a.residual == "mhc":
            x = e[:, None, :].expand(-1, self.a.streams, -1).contiguous()
            for layer, body in zip(self.mhc, bodies):
                x = layer(x, body)
            y = x.sum(1)
        else:
            y = e
            for body in bodies:
                y = y + body(y)
        logits = (rms_norm(y) * self.final_gain) @ self.head
        return F.cross_entropy(logits, targets.reshape(-1))


# Shapes bench_gpu_train_step_bench names (tools/bench/train_step.h); explicit options win.
CONFIGS = {
    "demo": {},
    "c1024": {"width": 1024, "heads": 16, "experts": 64, "top_k": 4, "expert_hidden": 1024,
              "seq": 1024},
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="demo", choices=sorted(CONFIGS),
                   help="shape preset (explicit shape options override it)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"],
                   help="compute precision on cuda (the CPU runs fp32 only)")
    p.add_argument("--residual", default="xhc", choices=["vanilla", "mhc", "xhc"])
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=256)
    p.add_argument("--streams", type=int, default=None, help="N (default 16 for xhc, 4 for mhc)")
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--fixed", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true",
                   help="run the model through torch.compile (PyTorch >= 2.0; warm-up steps "
                   "include the compilation)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(**CONFIGS[p.parse_known_args()[0].config])
    a = p.parse_args()
    if a.streams is None:
        a.streams = 4 if a.residual == "mhc" else 16
    cuda = a.device == "cuda"
    if a.compile and not hasattr(torch, "compile"):
        p.error("--compile needs torch.compile (PyTorch >= 2.0); this is torch %s"
                % torch.__version__)
    if not cuda and a.precision != "fp32":
        p.error("--precision %s needs --device cuda" % a.precision)
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: torch %s sees no GPU" % torch.__version__)

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
        with torch.device("cuda"):  # parameters drawn on the GPU (823M at c1024)
            model = Model(a).to("cuda")
    else:
        model = Model(a)
    step_model = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen).to(a.device)
    inputs, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if a.precision == "bf16"
                else contextlib.nullcontext())

    def now():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    steps, fb, opt_s, losses = [], [], [], []
    for i in range(a.warmup + a.steps):
        t0 = now()
        opt.zero_grad(set_to_none=False)
        with autocast:
            loss = step_model(inputs, targets, a.batch, a.seq)
        loss.backward()
        t1 = now()
        opt.step()
        t2 = now()
        if i >= a.warmup:
            steps.append(t2 - t0)
            fb.append(t1 - t0)
            opt_s.append(t2 - t1)
            losses.append(loss.item())
    tokens = a.batch * a.seq
    step = statistics.median(steps)
    result = {
        "impl": "pytorch", "torch": torch.__version__, "residual": a.residual,
        "compiled": a.compile, "streams": a.streams if a.residual != "vanilla" else 1,
        "threads": a.threads, "tokens_per_step": tokens, "step_s": step,
        "forward_backward_s": statistics.median(fb), "optimizer_s": statistics.median(opt_s),
        "tokens_per_s": tokens / step, "first_loss": losses[0],
        "parameters": sum(q.numel() for q in model.parameters()),
    }
    if cuda:
        result["device"] = "cuda"
        result["precision"] = a.precision
        result["device_name"] = torch.cuda.get_device_name()
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    if a.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")


if __name__ == "__main__":
    sys.exit(main())
