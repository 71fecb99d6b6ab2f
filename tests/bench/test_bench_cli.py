"""Bench CLI: subcommand dispatch, scheduler-overhead and sim smoke runs with --json."""

import json
import subprocess
import sys

import pytest

from conflux_jax.bench.__main__ import SUBCOMMANDS, main
from conflux_jax.bench.workloads import TOOLAGENT_OUTPUT, TOOLAGENT_PROMPT, at_rate, toolagent_like
from conflux_jax.slo import goodput


def test_usage_and_unknown_subcommand(capsys) -> None:
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "scheduler-overhead" in capsys.readouterr().out
    assert main(["nope"]) == 2
    assert {"scheduler-overhead", "sim", "kernels"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize(("name", "option"), [("kernels", "--gpu-dry-run"),
                                              ("executor", "--startup"),
                                              ("host-time", "--decodes")])
def test_subcommand_help_runs_as_users_run_it(tmp_path, name: str, option: str) -> None:
    # A fresh interpreter outside the checkout: the subcommand is a real module of the
    # package, not a script loaded from the source tree's bench/ folder.
    res = subprocess.run([sys.executable, "-m", "conflux_jax.bench", name, "--help"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"usage: python -m conflux_jax.bench {name}" in res.stdout
    assert option in res.stdout and "--json" in res.stdout


def test_scheduler_overhead_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "o.json"
    assert main(["scheduler-overhead", "--depths", "10", "50", "--steps", "5",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["depth"] for r in rows] == [10, 50]
    assert all(r["mean_ms"] > 0 and r["paper_mean_ms"] for r in rows)
    assert "0.36" in capsys.readouterr().out


def test_sim_writes_json_and_png(tmp_path) -> None:
    out = tmp_path / "s.json"
    assert main(["sim", "--model", "qwen3-14b", "--rates", "1", "6", "--num-requests", "60",
                 "--policies", "ConfluxServe", "Chunked", "LoongServe",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert set(d["goodput_rps"]) == {"ConfluxServe", "Chunked", "LoongServe"}
    assert [r["rate"] for r in d["results"]["ConfluxServe"]] == [1, 6]
    assert 0.0 <= d["results"]["Chunked"][0]["attainment"] <= 1.0
    assert out.with_suffix(".png").stat().st_size > 1000
    # Per policy: the estimate it planned with, and for a baseline its sweep and choice.
    conflux, chunked = d["settings"]["ConfluxServe"], d["settings"]["Chunked"]
    assert conflux["estimate"]["source"] == "fitted" and conflux["chosen"] is None
    assert conflux["estimate"]["test_mape_vs_truth_pct"] > 0
    budgets = [t["value"] for t in chunked["swept"]]
    assert len(budgets) >= 5 and chunked["chosen"] in budgets
    assert chunked["token_budget"] == chunked["chosen"]


def test_goodput_and_workloads() -> None:
    assert goodput([1, 2, 3, 4], [1.0, 0.96, 0.9, 0.97]) == 4
    assert goodput([1, 2], [0.5, 0.2]) == 0.0
    base = toolagent_like(4000, seed=1)
    prompts = sorted(p for _, p, _ in base)
    outs = sorted(o for _, _, o in base)
    assert abs(prompts[2000] / TOOLAGENT_PROMPT[0] - 1) < 0.1
    assert abs(prompts[3800] / TOOLAGENT_PROMPT[1] - 1) < 0.15
    assert abs(outs[2000] / TOOLAGENT_OUTPUT[0] - 1) < 0.15
    reqs = at_rate(base, rate=5.0, num=1000, max_context=32_768)
    assert len(reqs) == 1000
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert abs(999 / span - 5.0) < 1e-6
    assert max(r.prompt_len + r.max_new_tokens for r in reqs) <= 32_768


def test_sim_prefix_cache_is_bounded_by_default_and_raises_attainment(tmp_path, capsys
                                                                       ) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--unbounded-prefix-cache", "--rates", "1"])  # toolagent: no hash ids
    assert "Mooncake trace" in capsys.readouterr().err
    # 60 requests resending one 16K-token context plus a fresh block: with the cache only
    # the fresh block is prefilled, so the same rate is served far better.
    rows = [{"timestamp": 100 * i, "input_length": 16_384 + 512, "output_length": 8,
             "hash_ids": list(range(32)) + [1000 + i]} for i in range(60)]
    trace = tmp_path / "shared.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    got, hit = {}, {}
    for flag in ([], ["--no-prefix-caching"]):
        out = tmp_path / f"s{len(flag)}.json"
        assert main(["sim", "--model", "llama3.1-8b", "--trace", str(trace), "--rates", "8",
                     "--num-requests", "60", "--policies", "ConfluxServe", "Chunked",
                     "DistServe", "--no-sweep", "--json", str(out), *flag]) == 0
        d = json.loads(out.read_text())
        assert ("bounded" in (d["prefix_cache_model"] or "")) == (not flag)
        got[not flag] = {p: rows[0]["attainment"] for p, rows in d["results"].items()}
        hit[not flag] = {p: rows[0]["prefix_hit_rate"] for p, rows in d["results"].items()}
    assert "prefix hit %" in capsys.readouterr().out
    # every policy, baselines included, reuses the shared 16K tokens of all but the first
    assert all(h > 0.9 for h in hit[True].values()), hit
    assert all(h == 0 for h in hit[False].values()), hit
    assert got[True]["Chunked"] > got[False]["Chunked"] + 0.5
    assert got[True]["ConfluxServe"] >= got[False]["ConfluxServe"]
    assert got[True]["DistServe"] >= got[False]["DistServe"]


def test_sim_instances_behind_each_router(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--instances", "2", "--policies", "DistServe", "--rates", "1"])
    assert "cannot run behind the global router" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "--routers", "conflux", "--rates", "1"])
    assert "--instances > 1" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["sim", "--model", "llama3.1-8b", "--instances", "2", "--rates", "8",
                 "--num-requests", "40", "--policies", "ConfluxServe", "--no-sweep",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["instances"] == 2 and d["routers"] == ["conflux", "least-loaded", "round-robin"]
    assert set(d["results"]) == {"ConfluxServe @conflux", "ConfluxServe @least-loaded",
                                 "ConfluxServe @round-robin"}
    assert d["settings"]["ConfluxServe @conflux"]["router"] == "conflux"
    assert "2 instances of llama3.1-8b" in capsys.readouterr().out
