#!/usr/bin/python3
"""PyTorch reference for regression/bench/threads.sh and gpu.sh: the GPT-2 that a resolved
ptrain deck describes (pre-LayerNorm blocks, tanh GELU, causal attention, tied LM head, AdamW
with weight decay, gradient clipping), trained on random tokens at its shapes. Prints the mean
step time and tokens/s over the steps after the first.

  gpt2_torch.py RESOLVED_DECK [steps=4] [--device cpu|cuda] [--dtype fp32|bf16] [--compile]

On the CPU (the default): fp32, attention as written below. On CUDA as PyTorch users train
GPT-2 there: bf16 autocast (--dtype bf16), scaled_dot_product_attention, fused AdamW, and
optionally torch.compile; the clock is read after torch.cuda.synchronize().

RESOLVED_DECK is the deck.nml ptrain writes into its out_dir, so both programs train the
same shapes. Threads come from the environment: run it with OMP_NUM_THREADS=2
OMP_WAIT_POLICY=PASSIVE (the best setting found on a 2-core machine), and on a machine
whose transparent huge pages are "madvise" also with GLIBC_TUNABLES=glibc.malloc.hugetlb=1
(about twice as fast here: PyTorch 1.13 has no huge-page switch of its own).
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F


def read_deck(path):
    """{group: {key: text}} from a namelist as ptrain echoes it (one key per line)."""
    deck, group = {}, None
    with open(path) as f:
        for line in f:
            line = line.split("!", 1)[0].strip()
            if line.startswith("&"):
                group = deck.setdefault(line[1:].strip(), {})
            elif line == "/":
                group = None
            elif group is not None and "=" in line:
                key, value = (s.strip() for s in line.split("=", 1))
                group[key] = value.strip("'")
    return deck


class Block(torch.nn.Module):
    def __init__(self, C, NH, F_):
        super().__init__()
        self.nh = NH
        self.ln1, self.ln2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
        self.qkv, self.proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
        self.fc, self.fc_proj = torch.nn.Linear(C, F_), torch.nn.Linear(F_, C)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        if x.is_cuda:  # PyTorch's fused attention, as GPU users run it
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.nh))
            att = att.masked_fill(mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self, L, C, NH, V, T, F_):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(V, C), torch.nn.Embedding(T, C)
        self.blocks = torch.nn.ModuleList(Block(C, NH, F_) for _ in range(L))
        self.lnf = torch.nn.LayerNorm(C)
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1))
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask)
        logits = self.lnf(x) @ self.wte.weight.t()  # tied LM head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(usage=__doc__)
    ap.add_argument("deck")
    ap.add_argument("steps", nargs="?", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    deck = read_deck(a.deck)
    m, t = deck["model"], deck["train"]
    if t.get("optimizer", "adamw") != "adamw":
        sys.exit("gpt2_torch.py: the reference trains with AdamW only")
    if a.device == "cpu" and a.dtype != "fp32":
        sys.exit("gpt2_torch.py: on the CPU the reference trains fp32 only")
    L, C, NH, V, T = (int(m[k]) for k in ("n_layer", "d_model", "n_head", "vocab", "seq_len"))
    B = int(t["global_batch"])
    dev = torch.device(a.device)
    torch.manual_seed(int(deck["run"].get("seed", "1234")))
    model = GPT(L, C, NH, V, T, int(m.get("ffn_mult", "4")) * C).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=float(t["lr"]),
                            betas=(float(t["beta1"]), float(t["beta2"])),
                            weight_decay=float(t["weight_decay"]),
                            **({"fused": True} if a.device == "cuda" else {}))
    step_model = torch.compile(model) if a.compile else model
    clip = float(t.get("clip", "0"))
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    times = []
    for _ in range(a.steps):
        idx = torch.randint(0, V, (B, T), device=dev)
        targets = torch.randint(0, V, (B, T), device=dev)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = step_model(idx, targets)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    after = times[1:] or times
    mean = sum(after) / len(after)
    where = (f"{torch.get_num_threads()} threads "
             f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})"
             if a.device == "cpu" else torch.cuda.get_device_name())
    print(f"torch {torch.__version__}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"B={B} T={T}, {a.dtype}{' compiled' if a.compile else ''} on {where}, "
          f"final loss {loss.item():.4f}")
    print(f"torch: {mean:.4f} s/step, {B * T / mean:.0f} tok/s "
          f"(mean of {len(after)} steps after the first)")


if __name__ == "__main__":
    main()
