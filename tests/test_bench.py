"""CPU smoke test of the benchmark harness (bench/): tiny shapes, torch providers only.

Checks the data regimes' definitions, the JSON schema, the fp32 references against autograd, that a
failing provider becomes a row with its error while the run goes on, the matrix, the plots and the
CPU comparison (bench/cpu_compare.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import data
from bench.__main__ import build_parser, config_from_args
from bench.data import Shape
from bench.harness import Config, run
from bench.providers import FWD, FWDBWD, LINEAR, LOGITS, Provider, all_providers
from bench.reference import linear_reference, logits_reference

TORCH_PROVIDERS = ("torch", "chunked8", "torch-ce")
GOOD = (*TORCH_PROVIDERS, "shifted")


def _boom():
    def loss(*args):
        raise RuntimeError("planted failure")

    return loss


def _scribbler():
    def loss(x, t):
        with torch.no_grad():
            x.zero_()  # writes into the shared input: the harness must notice and regenerate it
        return F.cross_entropy(x.float(), t)

    return loss


def _shifted_ce(x, t):
    return F.cross_entropy(x[:-1].float(), t[1:])


def _oom():
    def loss(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (planted)")

    return loss


def test_regimes_deterministic_and_as_defined():
    N, D, V = 96, 64, 500
    for regime in data.REGIMES:
        a = data.make_inputs(N, D, V, regime, seed=3)
        b = data.make_inputs(N, D, V, regime, seed=3)
        c = data.make_inputs(N, D, V, regime, seed=4)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
        assert not torch.equal(a[0], c[0])
        e, cw, t = a
        assert e.shape == (N, D) and cw.shape == (V, D) and t.shape == (N,)
        assert e.dtype == cw.dtype == torch.bfloat16 and t.dtype == torch.int64
        assert (t[:: data.IGNORE_EVERY] == data.IGNORE_INDEX).all()
        valid = t[t != data.IGNORE_INDEX]
        assert ((valid >= 0) & (valid < V)).all()
    # zipf: logit_iv = log f_v + 6.5 g_t.g_v, so the target logit sits ~6.5 above its prior log f_t,
    # and the targets follow f (the most frequent id is drawn most often).
    e, cw, t = data.zipf_inputs(2000, 512, 300, dtype=torch.float32, seed=0, ignore_every=0)
    g = torch.Generator().manual_seed(0)
    logf = data.zipf_log_freq(300, generator=g, device="cpu")
    logits = e @ cw.T
    boost = logits.gather(1, t[:, None])[:, 0] - logf[t]
    assert abs(float(boost.mean()) - data.ZIPF_TARGET_SCALE) < 0.3
    assert int(torch.bincount(t, minlength=300).argmax()) == int(logf.argmax())
    # random: logits ~ N(0, 1)
    e, cw, _ = data.random_inputs(512, 256, 400, dtype=torch.float32, seed=0)
    assert abs(float((e @ cw.T).std()) - 1.0) < 0.05


def test_make_logits_matches_inputs():
    x, t = data.make_logits(40, 32, 70, "zipf", seed=1, dtype=torch.float32)
    e, c, t2 = data.make_inputs(40, 32, 70, "zipf", seed=1, dtype=torch.float32)
    assert torch.equal(t, t2)
    torch.testing.assert_close(x, e @ c.T)


def test_references_match_autograd():
    e, c, t = data.make_inputs(50, 24, 90, "zipf", seed=2, dtype=torch.float32)
    ref = linear_reference(e, c, t)
    eg, cg = e.clone().requires_grad_(), c.clone().requires_grad_()
    loss = F.cross_entropy(eg @ cg.T, t)
    de, dc = torch.autograd.grad(loss, (eg, cg))
    # fp32 both ways, same formula: differences are summation-order rounding only.
    assert math.isclose(ref.loss, float(loss.detach()), rel_tol=1e-5)
    torch.testing.assert_close(ref.de, de, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ref.dc, dc, rtol=1e-4, atol=1e-6)
    x = (e @ c.T).bfloat16()
    lref = logits_reference(x, t)
    for shift in (False, True):
        xg = x.float().requires_grad_()
        if shift:  # the causal shift: row i predicts t[i + 1]; the last row has no target
            loss = F.cross_entropy(xg[:-1], t[1:])
        else:
            loss = F.cross_entropy(xg, t)
        (dx,) = torch.autograd.grad(loss, xg)
        assert math.isclose(lref.losses[shift], float(loss.detach()), rel_tol=1e-5)
        assert lref.grad_err(dx, shift) < 1e-5
        assert lref.grad_err(torch.zeros_like(dx), shift) == pytest.approx(1.0)


def _names(ps):
    return [p.name for p in ps]


def test_cli_selects_shapes_and_providers():
    args = build_parser().parse_args(
        ["--quick", "--providers", "torch,cce", "--data", "zipf", "--device", "cpu"]
    )
    cfg = config_from_args(args)
    assert [s.name for s in cfg.shapes] == ["gemma2-2b", "llama3-8b"]
    assert _names(cfg.providers) == ["torch", "cce"] and cfg.regimes == ("zipf",)
    cfg = config_from_args(build_parser().parse_args(["--sweep", "--device", "cpu"]))
    assert [s.N for s in cfg.shapes] == list(data.SWEEP_N) and cfg.levels == (LINEAR,)
    assert all((s.D, s.V) == data.SHAPES[data.SWEEP_BASE][1:] for s in cfg.shapes)
    cfg = config_from_args(build_parser().parse_args(["--shapes", "8x4x16,gpt2", "--device", "cpu"]))
    assert [(s.N, s.D, s.V) for s in cfg.shapes] == [(8, 4, 16), data.SHAPES["gpt2"]]
    with pytest.raises(SystemExit):
        config_from_args(build_parser().parse_args(["--providers", "nope"]))
    names = _names(all_providers())
    required = [
        "cce",
        "cce-exact",
        "cce-torch",
        "torch",
        "torch-compile",
        "chunked8",
        "apple-cce",
        "liger-flce",
        "quack",
    ]
    required += ["cce-ce", "torch-ce", "torch-ce-compile", "liger-ce", "crossentropy-triton"]
    assert set(required) <= set(names)


@pytest.fixture
def one_thread():
    # Tiny tensors: threads only add contention (the CI machine may be busy).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_smoke_run_schema_and_failures(tmp_path, one_thread):
    # The failing providers come first: the ones after them must still run.
    providers = [
        Provider("boom", LINEAR, _boom, "raises"),
        Provider("oom", LOGITS, _oom, "raises an OOM"),
        Provider("absent", LINEAR, _boom, "not installed", package="surely-not-installed-pkg"),
        Provider("scribbler", LOGITS, _scribbler, "writes into its input"),
        Provider(
            "shifted", LOGITS, lambda: _shifted_ce, "causal shift built in", shift=True, fresh_input=True
        ),
    ]
    providers += [p for p in all_providers() if p.name in TORCH_PROVIDERS]
    cfg = Config(
        shapes=[Shape("tiny", 40, 16, 70)], providers=providers, device="cpu", rep_ms=1.0, min_reps=2,
        out_dir=tmp_path, plots=True, log=lambda s: None,
    )  # fmt: skip
    result = run(cfg)
    saved = sorted(tmp_path.glob("*.json"))
    assert len(saved) == 1 and saved[0].name.startswith("cpu_")
    assert json.loads(saved[0].read_text()) == json.loads(json.dumps(result, default=str))
    assert len(list(tmp_path.glob("*.png"))) >= 1
    meta = result["meta"]
    assert meta["complete"] is True
    for key in ("gpu", "date", "versions", "dtype", "timing", "providers"):
        assert key in meta
    assert meta["versions"]["torch"] == torch.__version__
    rows = result["rows"]
    # 2 regimes x 2 modes x (4 linear + 4 logits providers)
    assert len(rows) == 2 * 2 * 8
    for r in rows:
        for key in ("level", "shape", "N", "D", "V", "regime", "mode", "provider", "status", "error"):
            assert key in r
        if r["provider"] in GOOD:
            assert r["status"] == "ok", r
            assert r["ms"] > 0 and r["loss_err"] < 1e-2
            assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-2)
            if r["level"] == LINEAR:
                assert r["floor_ms"] > 0 and r["x_floor"] > 0
                if r["mode"] == FWDBWD:
                    assert r["de_err"] < 2e-2 and r["dc_err"] < 2e-2  # bf16 gradients: ~1e-2 at most
            elif r["mode"] == FWDBWD:
                assert r["dx_err"] < 2e-2
            if r["mode"] == FWD:
                assert "de_err" not in r and "dx_err" not in r
    by = {(r["provider"], r["regime"], r["mode"]): r for r in rows}
    assert by[("boom", "zipf", FWDBWD)]["status"] == "error"
    assert "planted failure" in by[("boom", "zipf", FWDBWD)]["error"]
    assert by[("oom", "random", FWD)]["status"] == "oom"
    assert by[("absent", "random", FWD)]["status"] == "unavailable"
    for mode in (FWD, FWDBWD):
        assert "modified its inputs" in by[("scribbler", "zipf", mode)]["error"]


def test_rl_output_providers(tmp_path, one_thread):
    """The issue-18 providers run: cce with every output has the plain loss (compared with the
    reference), the entropy-bonus objective is timed but not compared."""
    providers = [p for p in all_providers() if p.name in ("cce-outputs", "cce-entropy-bonus")]
    cfg = Config(
        shapes=[Shape("tiny", 40, 16, 70)], providers=providers, device="cpu", rep_ms=1.0, min_reps=2,
        out_dir=None, plots=False, log=lambda s: None, levels=(LINEAR,), regimes=("zipf",),
    )  # fmt: skip
    rows = run(cfg)["rows"]
    by = {(r["provider"], r["mode"]): r for r in rows}
    assert set(by) == {("cce-outputs", FWD), ("cce-outputs", FWDBWD), ("cce-entropy-bonus", FWDBWD)}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows), rows
    ok = by[("cce-outputs", FWDBWD)]  # bf16 inputs: gradients stored in bf16 (~1e-2 at most)
    assert ok["loss_err"] < 1e-2 and ok["de_err"] < 2e-2 and ok["dc_err"] < 2e-2
    bonus = by[("cce-entropy-bonus", FWDBWD)]
    assert "loss_err" not in bonus and "de_err" not in bonus


def test_check_modes_parse():
    """The former one-off GPU checks are modes of the one CLI (bench/checks.py)."""
    args = build_parser().parse_args(["--check", "linear", "--quick"])
    assert args.check == "linear" and args.quick
    assert build_parser().parse_args(["--check", "logits"]).check == "logits"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--check", "nothing"])


def test_real_and_init_regimes_tiny(monkeypatch):
    """bench/real.py on the CPU at toy size (sequences of 32 tokens): a BPE over installed packages'
    text, a TinyGPT trained a few steps (real) or not (init); held-out rows, targets in range or
    ignored, and training lowers the held-out loss."""
    pytest.importorskip("tokenizers")
    from bench import real

    monkeypatch.setattr(real, "SEQ", 32)
    monkeypatch.setattr(real, "_LAST", {})
    kw = dict(steps=12, corpus_bytes=1 << 19, dtype=torch.float32, device="cpu", seed=0)
    losses = {}
    for trained in (False, True):
        e, c, t = real.real_inputs(300, 32, 600, trained=trained, **kw)
        assert e.shape == (300, 32) and c.shape == (600, 32) and t.shape == (300,)
        assert (t[::17] == -100).all() and ((t >= 0) & (t < 600)).sum() == 300 - len(t[::17])
        losses[trained] = float(F.cross_entropy(e @ c.T, t))
    assert losses[True] < losses[False] - 0.1, losses


def test_matrix_config_and_summary():
    """--matrix: the matrix's heads x token counts at the linear level, fwd+bwd, every regime by
    default; slices by --matrix-heads / --matrix-n; the summary picks the fastest peer per cell."""
    from bench.matrix import MATRIX_HEADS, summarize

    cfg = config_from_args(build_parser().parse_args(["--matrix", "--device", "cpu"]))
    assert len(cfg.shapes) == 3 * len(MATRIX_HEADS) and cfg.levels == (LINEAR,)
    assert cfg.modes == (FWDBWD,) and set(cfg.regimes) == set(data.ALL_REGIMES)
    args = ["--matrix", "--matrix-heads", "gpt2", "--matrix-n", "2048", "--data", "zipf", "--device", "cpu"]
    cfg = config_from_args(build_parser().parse_args(args))
    assert [(s.N, s.D, s.V) for s in cfg.shapes] == [(2048, 768, 50257)] and cfg.regimes == ("zipf",)
    base = dict(level="linear", mode="fwd+bwd", status="ok", shape="s", regime="zipf")
    rows = [
        dict(base, provider="cce", ms=2.0, de_err=1e-3, dc_err=2e-3),
        dict(base, provider="cce-exact", ms=3.0),
        dict(base, provider="torch-compile", ms=4.0),
        dict(base, provider="torch", ms=9.0),
    ]
    text = summarize(rows)
    assert "| s | zipf | 2.00 | 3.00 | torch-compile | 4.00 | 2.00 | yes |" in text
    assert "geometric mean of (fastest peer / cce default) over 1 cells: 2.00" in text


def test_matrix_plot(tmp_path):
    """A --matrix result gets its speedup grid (one panel per regime) beside the bar plots; a
    result of other shapes does not."""
    pytest.importorskip("matplotlib")
    from bench.plot import plot_result

    base = dict(level="linear", mode="fwd+bwd", status="ok", N=2048, D=768, V=50257, floor_ms=1.0,
                grad_mb=1.0, peak_mb=1.5)  # fmt: skip
    rows = [
        dict(base, shape=f"{h}@N={n}", regime=regime, provider=p, ms=ms)
        for h in ("gpt2", "mistral-7b")
        for n in (2048, 8192)
        for regime in ("zipf", "real")
        for p, ms in (("cce", 2.0), ("cce-exact", 3.0), ("torch-compile", 2.5))
    ]
    result = {"meta": {"gpu": "cpu", "dtype": "bfloat16", "date": "today"}, "rows": rows}
    paths = plot_result(result, tmp_path, "m")
    assert tmp_path / "m_matrix.png" in paths and (tmp_path / "m_matrix.png").stat().st_size > 0
    for r in rows:
        r["shape"] = "tiny"
    assert tmp_path / "n_matrix.png" not in plot_result(result, tmp_path, "n")


def test_matrix_split_and_merge():
    """--matrix-gpus: every head in exactly one group, the groups' work (D V) balanced within the
    largest head; merging keeps every part's rows and records each part."""
    from bench.matrix import MATRIX_HEADS, merge, split_heads

    heads = list(MATRIX_HEADS)
    work = {h: MATRIX_HEADS[h][0] * MATRIX_HEADS[h][1] for h in heads}
    for k in (1, 2, 3, 4, 8, 12):
        groups = split_heads(heads, k)
        assert sorted(h for g in groups for h in g) == sorted(heads) and len(groups) == min(k, len(heads))
        loads = [sum(work[h] for h in g) for g in groups]
        assert max(loads) - min(loads) <= max(work.values())
    parts = [
        {"meta": {"gpu": "G", "date": f"d{i}", "seconds": 10.0 * (i + 1), "complete": i == 0, "argv": []},
         "rows": [{"provider": "cce", "shape": f"s{i}"}]}
        for i in range(2)
    ]  # fmt: skip
    m = merge(parts)
    assert [r["shape"] for r in m["rows"]] == ["s0", "s1"] and len(m["meta"]["parts"]) == 2
    assert m["meta"]["complete"] is False and m["meta"]["seconds"] == 20.0


def test_matrix_on_gpus_runs_one_process_per_group(tmp_path, monkeypatch):
    """The processes of --matrix-gpus: one per group of heads, each on its own GPU, with the
    command's other arguments; their results merged into one JSON."""
    import bench.__main__ as bm
    import bench.matrix as bmat

    launched = []

    class FakeProc:
        def __init__(self, cmd, env):
            launched.append((cmd, env["CUDA_VISIBLE_DEVICES"]))
            out = Path(cmd[cmd.index("--out") + 1])
            heads = cmd[cmd.index("--matrix-heads") + 1].split(",")
            out.mkdir(parents=True)
            rows = [{"level": "linear", "mode": "fwd+bwd", "status": "ok", "shape": f"{h}@N=2048",
                     "regime": "zipf", "provider": "cce", "ms": 1.0} for h in heads]  # fmt: skip
            meta = {"gpu": "G", "date": "2026-01-01T00:00:00+00:00", "seconds": 1.0, "complete": True}
            (out / "r.json").write_text(json.dumps({"meta": meta, "rows": rows}))

        def wait(self):
            return 0

    monkeypatch.setattr(bmat.subprocess, "Popen", FakeProc)
    argv = ["--matrix", "--matrix-gpus", "2", "--matrix-n", "2048", "--data", "zipf", "--device", "cpu",
            "--out", str(tmp_path), "--no-plots", "--matrix-heads", "gpt2,mistral-7b,llama3-70b"]  # fmt: skip
    assert bm.main(argv) == 0
    assert sorted(dev for _, dev in launched) == ["0", "1"]
    for cmd, _ in launched:
        assert cmd[cmd.index("--matrix-n") + 1] == "2048" and "--matrix-gpus" not in cmd
        assert cmd.count("--matrix-heads") == 1 and cmd.count("--out") == 1
    merged = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
    assert len(merged) == 1
    assert sorted(r["shape"] for r in merged[0]["rows"]) == [
        "gpt2@N=2048",
        "llama3-70b@N=2048",
        "mistral-7b@N=2048",
    ]


def test_resume_runs_only_the_missing_rows(tmp_path, one_thread, monkeypatch):
    """--resume: the rows of an earlier result with the same (level, shape, regime, mode,
    provider) are kept as they are; only the others run, and a case whose rows are all there
    makes no inputs (the real / init regimes train a model for them). Rows outside the command
    are dropped."""
    import bench.harness as H

    by_name = {p.name: p for p in all_providers()}
    kw = dict(device="cpu", rep_ms=1.0, min_reps=2, plots=False, log=lambda s: None, levels=(LINEAR,))
    shapes = [Shape("a", 24, 8, 40), Shape("b", 16, 8, 30)]
    first = run(Config(shapes=shapes[:1], providers=[by_name["torch"]], out_dir=tmp_path, **kw))
    stray = dict(first["rows"][0], shape="elsewhere")
    calls, made = [], []
    orig_row, orig_inputs = H.run_row, H._case_inputs
    monkeypatch.setattr(
        H, "run_row", lambda p, case, *a: calls.append((case["shape"], p.name)) or orig_row(p, case, *a)
    )
    monkeypatch.setattr(
        H, "_case_inputs", lambda lvl, shape, *a: made.append(shape.name) or orig_inputs(lvl, shape, *a)
    )
    cfg = Config(
        shapes=shapes, providers=[by_name["torch"], by_name["chunked8"]], out_dir=None,
        resume_rows=(*first["rows"], stray), **kw,
    )  # fmt: skip
    second = run(cfg)
    n_cases = len(data.REGIMES) * 2  # regimes x modes
    assert second["meta"]["resumed_rows"] == n_cases
    assert not any(sh == "a" and p == "torch" for sh, p in calls)
    assert sorted(set(calls)) == [("a", "chunked8"), ("b", "chunked8"), ("b", "torch")]
    assert second["rows"][:n_cases] == first["rows"]
    assert len(second["rows"]) == 4 * n_cases and all(r["shape"] != "elsewhere" for r in second["rows"])
    made.clear()
    third = run(
        Config(
            shapes=shapes[:1],
            providers=[by_name["torch"]],
            out_dir=None,
            resume_rows=tuple(first["rows"]),
            **kw,
        )
    )
    assert third["rows"] == first["rows"] and made == []  # every row there: no inputs made


def test_cpu_compare_child_and_summary(tmp_path, monkeypatch, capsys):
    """bench/cpu_compare.py: a child process's measurement (the cheapest provider, run in this
    process), and the parent's rounds, table and JSON from its children's lines."""
    import subprocess

    from bench import cpu_compare

    res = cpu_compare._child("matmul", "peaked", 1)
    assert res["provider"] == "matmul" and len(res["times_s"]) == 1 and res["median_s"] > 0
    calls = []

    def child(cmd, **kw):
        p = cmd[cmd.index("--child") + 1]
        calls.append(p)
        line = json.dumps(dict(provider=p, median_s=2.0 if p == "torch_chunked" else 1.0, times_s=[1.0],
                               peak_rss_growth_mb=10.0, loss=0.5))  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(cpu_compare.subprocess, "run", child)
    out = tmp_path / "cpu.json"
    argv = ["cpu_compare.py", "--rounds", "2", "--providers", "cce_torch,torch_chunked", "--json", str(out)]
    monkeypatch.setattr(cpu_compare.sys, "argv", argv)
    cpu_compare.main()
    assert calls == ["cce_torch", "torch_chunked"] * 2
    saved = json.loads(out.read_text())
    assert saved["summary"]["cce_torch"]["median_s"] == 1.0 and len(saved["runs"]["torch_chunked"]) == 2
    assert "cce_torch" in capsys.readouterr().out
