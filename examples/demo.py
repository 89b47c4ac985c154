"""``make demo``: train a small causal LM twice from the same seed, standard loss vs cce.

    python -m examples.demo                 # CPU: small model, V = 32768, finishes in a few minutes
    python -m examples.demo --device cuda   # GPU: larger model, V = 131072, bf16 autocast

Run A computes ``logits = lm_head(h)`` and ``F.cross_entropy(logits.float(), labels)``; run B
replaces both with ``cce.LinearCrossEntropy(h, lm_head.weight, labels)`` and never builds the
``(N, V)`` logits. Both start from the same weights and see the same batches, so their loss curves
must agree up to rounding noise. The text is the Python standard library's own source (available
offline wherever Python is), tokenized with a word-level vocabulary built from it; the tokenized
corpus is cached under ``demo_out/``.

Each run lives in its own process (so that each one's peak memory can be measured on its own); the
two processes take turns step by step, so they never compete for the cores. Output: a progress bar,
a side-by-side loss table every few steps, a summary (peak memory, tokens/s), ``demo_out/results.json``
and ``demo_out/loss_curves.png``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing as mp
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch

# Word-level tokens: identifiers / numbers / words, single punctuation characters, and newlines.
_TOKEN = re.compile(r"\w+|[^\w\s]|\n")
UNK = "<unk>"


# ----------------------------------------------------------------------------------------- corpus
def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def build_corpus(out_dir: Path, vocab_size: int) -> dict:
    """Token ids (int32) of the stdlib's source and the vocabulary; cached in ``out_dir``.

    The vocabulary is ``<unk>`` plus the ``vocab_size - 1`` most frequent tokens (ties by name);
    if the text has fewer distinct tokens, the rest are unused ``<unused_i>`` entries.
    """
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_v{vocab_size}"
    cache = out_dir / f"corpus_{tag}.pt"
    if cache.exists():
        corpus = torch.load(cache)
        corpus["source"] = f"cached in {cache}"
        return corpus
    t0 = time.perf_counter()
    files = _stdlib_files()
    tokens: list[str] = []
    chars = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        chars += len(text)
        tokens += _TOKEN.findall(text)
    counts = collections.Counter(tokens)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 1]
    itos = [UNK] + [w for w, _ in ranked]
    n_words = len(itos)
    itos += [f"<unused_{i}>" for i in range(vocab_size - n_words)]
    stoi = {w: i for i, w in enumerate(itos[:n_words])}
    ids = torch.tensor([stoi.get(w, 0) for w in tokens], dtype=torch.int32)
    corpus = {
        "ids": ids,
        "itos": itos,
        "files": len(files),
        "chars": chars,
        "distinct": len(counts),
        "words_in_vocab": n_words - 1,
        "unk_rate": float((ids == 0).double().mean()),
        "build_s": time.perf_counter() - t0,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(corpus, cache)
    corpus["source"] = f"tokenized in {corpus['build_s']:.1f} s, cached in {cache}"
    return corpus


# ----------------------------------------------------------------------------------------- worker
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil  # not Linux: psutil (installed with the hf extra's accelerate) does it

        return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _worker(conn, kind: str, cfg_kw: dict, train_kw: dict, device: str, seed: int) -> None:
    """One training run; answers ('step', ids) / ('eval', [ids]) / ('stats',) / ('stop',)."""
    from examples.gpt import GPT, GPTConfig

    if device == "cpu":
        torch.set_num_threads(train_kw["threads"])
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**cfg_kw), loss=kind).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=train_kw["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    warm, total = train_kw["warmup"], train_kw["steps"]  # read by lr_at at every step

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times: list[float] = []
    conn.send(("ready", sum(p.numel() for p in model.parameters())))
    while True:
        msg = conn.recv()
        if msg[0] == "step":
            x = torch.from_numpy(msg[1]).to(device, non_blocking=True).long()
            t0 = time.perf_counter()
            with amp:
                loss = model(x, labels=x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()  # synchronizes, so the time below is the step's
            times.append(time.perf_counter() - t0)
            conn.send(("loss", value, times[-1]))
        elif msg[0] == "total":  # the driver trimmed the run: the schedule follows
            total = msg[1]
            conn.send(("ok",))
        elif msg[0] == "eval":
            vals = []
            with torch.no_grad(), amp:
                for b in msg[1]:
                    xb = torch.from_numpy(b).to(device).long()
                    vals.append(model(xb, labels=xb).item())
            conn.send(("eval", sum(vals) / len(vals)))
        elif msg[0] == "stats":
            if device == "cuda":
                peak = torch.cuda.max_memory_allocated() - base
            else:
                peak = _peak_rss_bytes() - base
            steady = times[2:] if len(times) > 4 else times  # drop warm-up steps (lazy init, autotune)
            conn.send(("stats", {"peak_bytes": peak, "step_s": sum(steady) / len(steady)}))
        else:
            conn.send(("bye",))
            return


# ----------------------------------------------------------------------------------------- driver
class _Bar:
    """tqdm when installed, else a one-line text bar on stderr."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm

            self._t = tqdm(total=total, desc="training A and B", unit="step", dynamic_ncols=True)
        except ImportError:
            self._t = None
        self.total, self.n = total, 0

    def update(self, postfix: str) -> None:
        self.n += 1
        if self._t is not None:
            self._t.set_postfix_str(postfix, refresh=False)
            self._t.update(1)
        else:
            done = int(30 * self.n / self.total)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} {postfix}")
            sys.stderr.flush()

    def write(self, line: str) -> None:
        if self._t is not None:
            self._t.write(line)
        else:
            sys.stderr.write("\r" + " " * 79 + "\r")
            print(line, flush=True)

    def close(self) -> None:
        if self._t is not None:
            self._t.close()
        else:
            sys.stderr.write("\n")


def _plot(path: Path, steps: list[int], a: list[float], b: list[float], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, or `make demo`)")
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    ax1.plot(steps, a, label="A: lm_head + F.cross_entropy", lw=2.5, alpha=0.6)
    ax1.plot(steps, b, label="B: cce.LinearCrossEntropy", lw=1.0, ls="--", color="black")
    ax1.set_ylabel("training loss (nats)")
    ax1.set_title(title, fontsize=10)
    ax1.legend()
    ax1.grid(alpha=0.3)
    diff = [abs(x - y) for x, y in zip(a, b, strict=True)]
    nz = [(s, v) for s, v in zip(steps, diff, strict=True) if v > 0]
    if nz:
        ax2.semilogy([s for s, _ in nz], [v for _, v in nz], ".", color="tab:red", ms=4)
    ax2.set_ylabel("|A - B|")
    ax2.set_title(f"{len(diff) - len(nz)} of {len(diff)} steps bit-identical (not shown)", fontsize=8)
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _mb(x: float) -> str:
    return f"{x / 2**20:,.0f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 150 CPU, 300 GPU)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: 32768 CPU, 131072 GPU)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--every", type=int, default=None, help="print the table every this many steps")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="CPU: trim the step count so that training fits in this many seconds (default 200)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo_out")
    args = p.parse_args(argv)

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    # CPU: small enough for a 2-core laptop; GPU: a model and vocabulary where the logits hurt.
    d = (
        dict(steps=300, vocab=131072, batch=8, seq=1024, d_model=1024, layers=8, lr=6e-4)
        if gpu
        else dict(steps=150, vocab=32768, batch=8, seq=128, d_model=128, layers=2, lr=1e-3)
    )
    for k in d:
        if getattr(args, k) is not None:
            d[k] = getattr(args, k)
    budget = args.time_budget if args.time_budget is not None else (None if gpu else 200.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    corpus = build_corpus(out, d["vocab"])
    ids = corpus["ids"]
    n_eval = max(len(ids) // 20, d["seq"] * 8 + 1)
    train, held = ids[:-n_eval], ids[-n_eval:]
    print(
        f"corpus: {corpus['files']} .py files of the Python {sys.version_info.major}."
        f"{sys.version_info.minor} standard library, {corpus['chars'] / 1e6:.1f} M chars, "
        f"{len(ids) / 1e6:.2f} M tokens, {corpus['distinct']:,} distinct; vocabulary V = {d['vocab']:,} "
        f"({corpus['words_in_vocab']:,} words, <unk> rate {100 * corpus['unk_rate']:.2f}%); "
        f"{corpus['source']}"
    )

    cfg_kw = dict(
        vocab_size=d["vocab"],
        seq_len=d["seq"],
        d_model=d["d_model"],
        n_layer=d["layers"],
        n_head=max(1, d["d_model"] // 64),
        tie_embeddings=True,
    )
    threads = torch.get_num_threads()
    train_kw = dict(lr=d["lr"], warmup=min(20, max(1, d["steps"] // 5)), steps=d["steps"], threads=threads)
    # Idle OpenMP threads of the waiting run must not spin on the cores the other run is using.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("spawn")
    runs = {}
    for kind in ("torch", "cce"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker, args=(child, kind, cfg_kw, train_kw, device, args.seed), daemon=True
        )
        proc.start()
        runs[kind] = (proc, parent)
    n_params = [conn.recv()[1] for _, conn in runs.values()][0]
    N = d["batch"] * d["seq"]
    dt = "bf16 autocast" if gpu else "fp32"
    print(
        f"model: GPT, {d['layers']} layers, d_model {d['d_model']}, {n_params / 1e6:.1f} M parameters "
        f"(tied embeddings), {dt}, on {device}; batch {d['batch']} x {d['seq']} = {N:,} tokens/step; "
        f"the logits of one step are {N:,} x {d['vocab']:,} = {_mb(N * d['vocab'] * (2 if gpu else 4))}"
    )

    g = torch.Generator().manual_seed(args.seed + 1)

    def batch(src: torch.Tensor) -> object:
        starts = torch.randint(0, len(src) - d["seq"], (d["batch"],), generator=g)
        return torch.stack([src[s : s + d["seq"]] for s in starts.tolist()]).numpy()

    def step_both(x) -> tuple[float, float, float, float]:
        res = []
        for kind in ("torch", "cce"):
            conn = runs[kind][1]
            conn.send(("step", x))
            _, loss, t = conn.recv()
            res += [loss, t]
        return res[0], res[2], res[1], res[3]

    steps = d["steps"]
    every = args.every or max(1, steps // 15)
    hist: dict[str, list] = {"step": [], "A": [], "B": []}
    print(f"{'step':>6} {'loss A (torch)':>15} {'loss B (cce)':>14} {'|A-B|':>10}", flush=True)
    bar = _Bar(steps)
    t_train = time.perf_counter()
    s = 0
    while s < steps:
        la, lb, ta, tb = step_both(batch(train))
        s += 1
        hist["step"].append(s)
        hist["A"].append(la)
        hist["B"].append(lb)
        if budget is not None and s >= 5 and s < steps:
            # Trim the run to the time budget (both runs identically) on a slow or busy machine;
            # re-checked every step, since a shared machine's load changes.
            per = (time.perf_counter() - t_train) / s
            fit = max(int(budget / per), 10, s + 1)
            if fit < steps:
                bar.write(
                    f"  (at {per:.2f} s per step pair, {steps} steps exceed the {budget:.0f} s budget: "
                    f"training {fit} steps; --time-budget / --steps change this)"
                )
                steps = fit
                for _, conn in runs.values():
                    conn.send(("total", steps))
                    conn.recv()
                bar.total = steps
                if bar._t is not None:
                    bar._t.total = steps
                    bar._t.refresh()
                every = args.every or max(1, steps // 15)
        bar.update(f"A {la:.4f} B {lb:.4f}")
        if s % every == 0 or s == 1 or s == steps:
            bar.write(f"{s:>6} {la:>15.6f} {lb:>14.6f} {abs(la - lb):>10.2e}")
    bar.close()

    eval_batches = [batch(held) for _ in range(8)]
    evals, stats = {}, {}
    for kind, (_, conn) in runs.items():
        conn.send(("eval", eval_batches))
        evals[kind] = conn.recv()[1]
        conn.send(("stats",))
        stats[kind] = conn.recv()[1]
        conn.send(("stop",))
        conn.recv()
    for proc, _ in runs.values():
        proc.join(timeout=30)

    diffs = [abs(a - b) for a, b in zip(hist["A"], hist["B"], strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    mem_what = "peak GPU memory allocated above the weights" if gpu else "peak RSS growth during training"
    print()
    print(f"{'run':<36} {'final loss':>10} {'held-out':>9} {mem_what:>44} {'tokens/s':>10} {'ms/step':>8}")
    names = {"torch": "A  lm_head + F.cross_entropy", "cce": "B  cce.LinearCrossEntropy"}
    for kind, col in (("torch", "A"), ("cce", "B")):
        st = stats[kind]
        print(
            f"{names[kind]:<36} {hist[col][-1]:>10.4f} {evals[kind]:>9.4f} {_mb(st['peak_bytes']):>44} "
            f"{N / st['step_s']:>10,.0f} {1e3 * st['step_s']:>8.1f}"
        )
    ratio = stats["torch"]["peak_bytes"] / max(stats["cce"]["peak_bytes"], 1)
    print(
        f"\nmax |A-B| over {len(diffs)} steps: {diffs[worst]:.2e} (step {hist['step'][worst]}); "
        f"at step 1: {diffs[0]:.2e}; final: {diffs[-1]:.2e}; "
        f"held-out |A-B|: {abs(evals['torch'] - evals['cce']):.2e}"
    )
    if not gpu:
        ulp = float(torch.finfo(torch.float32).eps) * 2.0 ** math.floor(math.log2(abs(hist["A"][worst])))
        k = diffs[worst] / ulp
        verdict = "the curves agree to fp32 rounding" if k <= 64 else "MORE than fp32 rounding noise"
        print(f"  = {k:.0f} fp32 ulp(s) of the loss (ulp {ulp:.1e}): {verdict}")
    print(
        f"memory: A/B = {ratio:.1f}x; speed: B/A = "
        f"{stats['torch']['step_s'] / stats['cce']['step_s']:.2f}x tokens/s"
    )
    title = (
        f"{device}, GPT {d['layers']}x{d['d_model']}, V={d['vocab']:,}, {N:,} tokens/step, {dt}; "
        f"max |A-B| = {diffs[worst]:.1e}"
    )
    png = out / "loss_curves.png"
    if _plot(png, hist["step"], hist["A"], hist["B"], title):
        print(f"plot: {png}")
    results = {
        "device": device,
        "torch": torch.__version__,
        "config": {**d, "steps": steps, "tokens_per_step": N, "dtype": dt, "n_params": n_params},
        "loss_A": hist["A"],
        "loss_B": hist["B"],
        "max_abs_diff": diffs[worst],
        "heldout": evals,
        "stats": stats,
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {out / 'results.json'}; total wall time {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
