"""FSDP2 training with ``cce.transformers.patch`` against one device: losses, gradients, memory.

    torchrun --nproc_per_node 2 -m bench.fsdp_check                         # 2 GPUs, NCCL, bf16
    torchrun --nproc_per_node 2 -m bench.fsdp_check --device cpu --tiny     # CPU, gloo, fp32

A config-built Llama trains from one seed three ways on every rank: unsharded on the global batch,
patched (the reference) and unpatched (the yardstick: the same loss rounded differently), and patched
under ``fully_shard``, each rank on its share of the batch with ``num_items_in_batch`` = the global
count / W (``--per-rank-mean``: each rank's own mean, which fails). Checked: the step-0 gradients
per parameter (see GRAD_TOL_FP32, BF16_UNIT) and the loss at every step, within max(2 x the largest
|L_unpatched - L_ref| so far, LOSS_FLOOR x |L_ref|). docs/distributed.md describes the check.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import cce.transformers

from .dist import RESULTS, exit_now, run_ranks
from .harness import fmt
from .providers import versions
from .reference import rel_l2

IGNORE_INDEX = -100
# Step-0 gradients in fp32: both sides differ in summation order only (~1e-7); 2e-5 as the
# distributed tests allow for cancellation-prone small gradients.
GRAD_TOL_FP32 = 2e-5
# bf16, unit roundoff u = 2^-8. Per parameter p, with g = sum_r g_r the reference gradient and g_r
# rank r's tokens' part: FSDP2 averages W gradients W g_r, each rounded to bf16 once, the reference
# rounds g once, so per entry |diff| <= u (sum_r |g_r| + |g|) and rel. L2 <= u (A_p + 1), A_p =
# ||sum_r |g_r| || / ||g|| (1 without cancellation between ranks); plus 2 u for the auto gradient
# filter (one bf16 rounding, on tiles that differ between the batch compositions, either side) and
# 2 u for intermediates the matmuls of two batch sizes may round differently: u (A_p + 5). (The
# CPU's bf16 embedding backward, summed in bf16, failed this with u = 2^-9 at the default size.)
BF16_UNIT = 2.0**-8
LOSS_FLOOR = 1e-6  # relative, ~8 fp32 ulps of the loss: the first steps, where the references agree


@dataclasses.dataclass(frozen=True)
class ModelSize:
    layers: int = 4
    hidden: int = 256
    intermediate: int = 688
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 32000
    seq: int = 256
    batch: int = 8  # global sequences per step, split evenly over the ranks


TINY = ModelSize(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=263, seq=24, batch=4)


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    size: ModelSize = ModelSize()
    steps: int = 20
    lr: float = 1e-3
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16  # compute dtype; masters, optimizer and reduction in fp32
    impl: str = "auto"
    filter_eps: float | str | None = "auto"
    per_rank_mean: bool = False


def build_model(cfg: CheckConfig, device: torch.device) -> torch.nn.Module:
    """The fp32 model, initialised on the CPU from cfg.seed (the same weights on every rank)."""
    s = cfg.size
    hf = transformers.LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        head_dim=s.hidden // s.heads, max_position_embeddings=s.seq, tie_word_embeddings=False,
    )  # fmt: skip
    hf._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    return transformers.LlamaForCausalLM(hf).float().to(device)


def global_batch(cfg: CheckConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of one step's whole batch, on the CPU, the same on every rank: tokens of
    a Zipf law (exponent 1.1, frequent ids scattered); each sequence's first k labels masked, k
    uniform in [0, 3 seq / 4)."""
    s = cfg.size
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    ranks = torch.arange(1, s.vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-1.1)[torch.randperm(s.vocab, generator=torch.Generator().manual_seed(cfg.seed))]
    ids = torch.multinomial(probs, s.batch * s.seq, replacement=True, generator=g).view(s.batch, s.seq)
    labels = ids.clone()
    prompt = torch.randint(0, 3 * s.seq // 4, (s.batch,), generator=g)
    labels[torch.arange(s.seq)[None, :] < prompt[:, None]] = IGNORE_INDEX
    return ids, labels


def counted(labels: torch.Tensor) -> int:
    """Tokens that count in the shifted causal-LM loss (labels[:, 1:] not ignored)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _peak_mb(device: torch.device, reset: bool = False) -> float | None:
    """The peak MB allocated on the GPU since the last reset (None on the CPU); ``reset`` starts anew."""
    if reset:
        gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    if reset:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def _rank_spread(compute, cfg: CheckConfig, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Per parameter, sum over the ranks' token shards of |g_r| (CPU, fp32) at step 0, where g_r is
    the gradient of shard r's summed loss over the global count: sum_r g_r = g."""
    ids, labels = global_batch(cfg, 0)
    per, total = cfg.size.batch // world, counted(labels)
    spread: dict[str, torch.Tensor] = {}
    for r in range(world):
        mine = slice(r * per, (r + 1) * per)
        ids_r, labels_r = ids[mine].to(device), labels[mine].to(device)
        compute(input_ids=ids_r, labels=labels_r, num_items_in_batch=total).loss.backward()
        for n, p in compute.named_parameters():
            a = p.grad.detach().float().abs().cpu()
            spread[n] = a if n not in spread else spread[n] + a
            p.grad = None
    return spread


def _refresh(pairs) -> None:
    """The compute parameters take their fp32 masters' values (where they are not the masters)."""
    with torch.no_grad():
        for pc, pm in pairs:
            if pc is not pm:
                pc.copy_(pm)


def train_reference(cfg: CheckConfig, device: torch.device, patched: bool, world: int = 1) -> dict:
    """The unsharded run on the global batch: per-step losses, step-0 gradients (CPU), peak MB; with
    ``world`` > 1 also A_p = ||sum_r |g_r| || / ||g|| per parameter (see BF16_UNIT)."""
    _peak_mb(device, reset=True)
    master = build_model(cfg, device)
    compute = master
    if cfg.dtype != torch.float32:
        # Parameters only, as FSDP2's param_dtype: buffers (the rotary inv_freq) stay fp32.
        compute = copy.deepcopy(master)
        for p in compute.parameters():
            p.data = p.data.to(cfg.dtype)
    if patched:
        cce.transformers.patch(compute, impl=cfg.impl, filter_eps=cfg.filter_eps)
    pairs = list(zip(compute.parameters(), master.parameters(), strict=True))
    opt = torch.optim.AdamW(master.parameters(), lr=cfg.lr)
    losses, grads0, spread = [], None, None
    if world > 1:
        _refresh(pairs)
        spread = _rank_spread(compute, cfg, world, device)
    for step in range(cfg.steps):
        ids, labels = global_batch(cfg, step)
        _refresh(pairs)
        loss = compute(input_ids=ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        if compute is not master:
            for pc, pm in pairs:
                pm.grad, pc.grad = pc.grad.float(), None
        if step == 0:
            grads0 = {n: p.grad.detach().cpu() for n, p in master.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    out = dict(losses=torch.stack(losses).cpu().tolist(), grads0=grads0, peak_mb=_peak_mb(device))
    if spread is not None:
        norms = {n: float(g.double().norm()) for n, g in grads0.items()}
        out["spread"] = {n: float(a.double().norm()) / norms[n] if norms[n] > 0 else 1.0
                         for n, a in spread.items()}  # fmt: skip
    return out


def _shard_grad_errors(model, grads0: dict, rank: int, world: int, group) -> dict[str, float]:
    """Per parameter, rel. L2 of the whole FSDP2 gradient vs grads0, from each rank's own rows
    (FSDP2 shards dim 0 as torch.chunk does): one all-reduce of the squared sums."""
    names, sums = [], []
    for n, p in model.named_parameters():
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        chunks = torch.chunk(grads0[n], world, dim=0)
        ref = chunks[rank] if rank < len(chunks) else grads0[n][:0]
        if local.shape != ref.shape:
            raise RuntimeError(f"{n}: local gradient {tuple(local.shape)} vs rows {tuple(ref.shape)}")
        diff = local.detach().cpu().double() - ref.double()
        names.append(n)
        sums.append(torch.stack([diff.square().sum(), ref.double().square().sum()]))
    total = torch.stack(sums).to(local.device)  # (on the gradients' device: NCCL has no CPU tensors)
    dist.all_reduce(total, group=group)
    return {n: float(num.sqrt() / den.sqrt()) if den > 0 else float(num.sqrt())
            for n, (num, den) in zip(names, total.cpu(), strict=True)}  # fmt: skip


def train_sharded(cfg: CheckConfig, device: torch.device, group, grads0: dict) -> dict:
    """The FSDP2 run: every rank its shard of each global batch; all-reduced mean losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if cfg.size.batch % world:
        raise ValueError(f"global batch {cfg.size.batch} does not split over {world} ranks")
    _peak_mb(device, reset=True)
    mesh = init_device_mesh(device.type, (world,))
    model = cce.transformers.patch(build_model(cfg, device), impl=cfg.impl, filter_eps=cfg.filter_eps)
    mp = MixedPrecisionPolicy()  # fp32: none
    if cfg.dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=cfg.dtype, reduce_dtype=torch.float32)
    for module in (*model.model.layers, model.lm_head, model):
        fully_shard(module, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    per = cfg.size.batch // world
    losses, grad_err = [], {}
    for step in range(cfg.steps):
        ids, labels = global_batch(cfg, step)
        mine = slice(rank * per, (rank + 1) * per)
        # A Python float: FSDP2 casts floating tensors among the root's inputs to param_dtype.
        kw = {} if cfg.per_rank_mean else dict(num_items_in_batch=counted(labels) / world)
        loss = model(input_ids=ids[mine].to(device), labels=labels[mine].to(device), **kw).loss
        loss.backward()
        if step == 0:
            grad_err = _shard_grad_errors(model, grads0, rank, world, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    mean = torch.stack(losses)
    dist.all_reduce(mean, group=group)
    return dict(losses=(mean / world).cpu().tolist(), grad_err=grad_err, peak_mb=_peak_mb(device))


def compare(cfg: CheckConfig, sharded: dict, ref: dict, unpatched: dict) -> dict:
    """The pass/fail verdict and its numbers (see the module docstring)."""
    rows, envelope, ok_loss = [], 0.0, True
    runs = zip(sharded["losses"], ref["losses"], unpatched["losses"], strict=True)
    for step, (lf, lr_, lu) in enumerate(runs):
        envelope = max(envelope, abs(lu - lr_))
        tol = max(2.0 * envelope, LOSS_FLOOR * abs(lr_))
        diff = abs(lf - lr_)
        ok_loss &= diff <= tol  # NaN fails
        rows.append(dict(step=step, fsdp=lf, ref=lr_, unpatched=lu, diff=diff, noise=abs(lu - lr_), tol=tol,
                         ok=diff <= tol))  # fmt: skip
    if cfg.dtype == torch.float32:
        tols = dict.fromkeys(sharded["grad_err"], GRAD_TOL_FP32)
    else:
        tols = {n: BF16_UNIT * (a + 5.0) for n, a in ref["spread"].items()}
    errs = sharded["grad_err"]
    worst = max(errs, key=lambda n: errs[n] / tols[n])  # the largest fraction of its tolerance
    grad_ok = all(e <= tols[n] for n, e in errs.items())  # NaN fails
    noise_grad = max(rel_l2(unpatched["grads0"][n], g) for n, g in ref["grads0"].items())
    rel = [r["diff"] / abs(r["ref"]) for r in rows if r["ref"]]
    return dict(
        steps=rows, loss_ok=ok_loss, max_abs_diff=max(r["diff"] for r in rows),
        max_rel_diff=max(rel, default=0.0), max_noise=envelope, grad_err_max=max(errs.values()),
        grad_err_param=worst, grad_err_worst=errs[worst], grad_tol_worst=tols[worst], grad_tol=tols,
        spread=ref.get("spread"), grad_err_unpatched=noise_grad, grad_ok=grad_ok,
        loss_fell=rows[-1]["ref"] < rows[0]["ref"], passed=ok_loss and grad_ok,
    )  # fmt: skip


def run_check(cfg: CheckConfig, device: torch.device, group) -> dict:
    """Every rank: the two references, then the sharded run; returns this rank's result."""
    ref = train_reference(cfg, device, patched=True, world=dist.get_world_size(group))
    unpatched = train_reference(cfg, device, patched=False)
    sharded = train_sharded(cfg, device, group, ref["grads0"])
    return dict(rank=dist.get_rank(group), sharded_peak_mb=sharded["peak_mb"], ref_peak_mb=ref["peak_mb"],
                unpatched_peak_mb=unpatched["peak_mb"], grad_err=sharded["grad_err"],
                **compare(cfg, sharded, ref, unpatched))  # fmt: skip


def table(per_rank: list[dict]) -> str:
    r0 = per_rank[0]
    lines = ["step   fsdp loss    ref loss  unpatched   |fsdp-ref|  |unp-ref|     tol  ok"]
    for s in r0["steps"]:
        lines.append(
            f"{s['step']:>4}  {s['fsdp']:10.6f}  {s['ref']:10.6f}  {s['unpatched']:9.6f}"
            f"   {s['diff']:9.2e}  {s['noise']:9.2e}  {s['tol']:7.1e}  {s['ok']}"
        )
    lines.append(
        f"loss: max |diff| {r0['max_abs_diff']:.2e} (rel {r0['max_rel_diff']:.2e}), unpatched vs ref up to "
        f"{r0['max_noise']:.2e}; within tolerance: {r0['loss_ok']}; loss fell: {r0['loss_fell']}"
    )
    lines.append(
        f"step-0 gradients (rel L2 per parameter): max {r0['grad_err_max']:.2e}; closest to its tolerance: "
        f"{r0['grad_err_param']} {r0['grad_err_worst']:.2e} <= {r0['grad_tol_worst']:.2e}; all within: "
        f"{r0['grad_ok']}  (unpatched vs ref: max {r0['grad_err_unpatched']:.2e})"
    )
    for r in per_rank:
        a, b, c = (fmt(r[f"{k}_peak_mb"], ".0f") for k in ("sharded", "ref", "unpatched"))
        lines.append(f"rank {r['rank']}: peak MB sharded {a}, one device (patched) {b}, (unpatched) {c}")
    lines.append(f"PASSED: {all(r['passed'] for r in per_rank)}")
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[CheckConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--impl", default="auto", choices=("auto", "triton", "torch"))
    ap.add_argument("--filter-eps", default="auto", help="'auto', 'none' or a float (the patch's option)")
    ap.add_argument("--tiny", action="store_true", help=f"a tiny model ({TINY})")
    ap.add_argument("--per-rank-mean", action="store_true", help="each rank its own mean loss (check fails)")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    fe = None if a.filter_eps == "none" else a.filter_eps if a.filter_eps == "auto" else float(a.filter_eps)
    return CheckConfig(
        size=TINY if a.tiny else ModelSize(), steps=a.steps, lr=a.lr, dtype=getattr(torch, dtype),
        impl=a.impl, filter_eps=fe, per_rank_mean=a.per_rank_mean,
    ), a  # fmt: skip


def main(argv=None) -> int:
    cfg, args = parse_args(argv)

    def report(per_rank: list[dict]) -> None:
        v = versions([])
        meta = dict(
            device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            backend=dist.get_backend(), world=len(per_rank), torch=v["torch"], cuda=v["cuda"],
            triton=v["triton"], cce=v["cce"], transformers=transformers.__version__,
            commit=os.environ.get("CCE_BENCH_COMMIT"),
            config=dict(dataclasses.asdict(cfg), dtype=str(cfg.dtype)),
        )  # fmt: skip
        path = Path(args.out) / "fsdp_check.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        passed = all(r["passed"] for r in per_rank)
        path.write_text(json.dumps(dict(meta=meta, per_rank=per_rank, passed=passed), indent=1))
        print(f"bench.fsdp_check: {meta['device']} x {meta['world']} ({meta['backend']}), torch "
              f"{v['torch']}, triton {v['triton']}, transformers {meta['transformers']}, {cfg.dtype}, "
              f"{cfg.size}, {cfg.steps} steps, impl={cfg.impl}; wrote {path}")  # fmt: skip
        print(table(per_rank), flush=True)

    per_rank = run_ranks(args.device, "bench.fsdp_check", "--device cpu --tiny",
                         lambda dev: run_check(cfg, dev, dist.group.WORLD), report)  # fmt: skip
    return 2 if per_rank is None else 0 if all(r["passed"] for r in per_rank) else 1


if __name__ == "__main__":
    exit_now(main())
