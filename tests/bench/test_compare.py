"""bench compare on a tiny HF checkpoint: ours (in-process engine) vs HF generate and vs our
own server."""

import json

import jax
import pytest
from ckpt_helpers import random_hf_weights, tiny_llama, train_tiny_tokenizer, write_hf_folder

from conflux_jax.bench.__main__ import main

pytest.importorskip("transformers")
pytest.importorskip("torch")


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")
def test_compare_prints_ratio_table(tmp_path, capsys) -> None:
    cfg = tiny_llama()
    folder = write_hf_folder(tmp_path / "tiny", cfg, random_hf_weights(cfg),
                             train_tiny_tokenizer())
    out = tmp_path / "c.json"
    assert main(["compare", "--model", str(folder), "--concurrency", "1", "3",
                 "--prompt-len", "18", "--max-tokens", "3", "--max-model-len", "64",
                 "--peers", "hf", "llama.cpp", "vllm", "server", "--host-copy-mb", "8",
                 "--vllm-python", str(tmp_path / "no-vllm" / "python"),
                 # our server, started by compare, warms up every bucket: few of them
                 "--server-args", "--token-buckets 8 --decode-buckets 4 --decode-page-buckets 16"
                 " --page-size 8 --num-pages 32",
                 # the other test worker keeps a core busy: no run would find the host quiet
                 "--quiet-wait-s", "0", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["concurrency"] for r in d["rows"]] == [1, 3] and d["quiet_wait_s"] == 0
    assert d["peers"] == ["hf", "server"] and "llama.cpp" in d["skipped_peers"]  # GGUF only
    assert "setup_peer_vllm.sh" in d["skipped_peers"]["vllm"]  # says how to get it
    for row in d["rows"]:
        for system in ("ours", "hf", "server"):  # each emitted every token (ignore_eos)
            m = row[system]
            assert m["tokens_per_s"] * m["wall_s"] == pytest.approx(row["concurrency"] * 3)
            # every run's prompts are new to it: no prefix-cache hit flatters ours
            assert m["cached_tokens"] == 0
        # the measuring client's CPU, for the server only: it shares the server's cores
        assert row["server"]["client_cpu_s"] > 0 and row["hf"]["client_cpu_s"] is None
        assert row["ours"]["client_cpu_s"] is None
        assert row["ratio_vs_hf"]["tokens_per_s"] > 0
        assert row["ratio_vs_server"]["tokens_per_s"] > 0
        runs = row["runs_tokens_per_s"]  # every round's figure, the best one among them
        assert len(runs["ours"]) == len(runs["server"]) == 2  # --repeats' default
        assert row["ours"]["tokens_per_s"] == max(runs["ours"])
        assert row["quiet_waits_s"] == {"ours": [0.0, 0.0], "hf": [0.0, 0.0],
                                        "server": [0.0, 0.0]}  # --quiet-wait-s 0
        # paired: the median over rounds of ours / peer within the round
        assert row["ratio_vs_server"]["tokens_per_s_paired"] == pytest.approx(
            (runs["ours"][0] / runs["server"][0] + runs["ours"][1] / runs["server"][1]) / 2)
        b = row["dense_bound"]  # the dense layers alone bound every engine, ours included
        assert b["decode_s"] == pytest.approx(2 * b["decode_step_s"])
        assert b["tokens_per_s"] == pytest.approx(
            row["concurrency"] * 3 / (b["prefill_s"] + b["decode_s"]))
        f = row["host_floor"]  # this host's floor for a step of that many rows
        assert f["rows"] == row["concurrency"] and f["floor_s"] > 0 and f["copy_gbs"] > 0
    text = capsys.readouterr().out
    assert "ratio tok/s" in text and "hf" in text and "bound" in text
    assert "decode-step floor" in text and "x floor" in text
    assert "measuring client's CPU per run" in text and "paired" in text
    with pytest.raises(SystemExit):  # our server beside a server is not a comparison
        main(["compare", "--url", "http://127.0.0.1:9", "--peers", "server"])


def test_llama_cpp_peer_batches_like_solo_runs() -> None:
    """The llama.cpp peer serves all requests as one continuous batch (one KV sequence
    each): every request must get the same greedy tokens as when it runs alone, and its
    first token before any later one. Needs the optional ``peers`` extra."""
    pytest.importorskip("llama_cpp")
    from conflux_jax.bench.compare import LlamaCppPeer, make_prompts

    peer = LlamaCppPeer("default", n_batch=48)  # < the prompts' 3 x 20: prefill spans calls
    prompts = make_prompts(3, 20, peer.vocab, seed=1)
    results, wall = peer.run(prompts, 6)
    batched = peer.outputs
    assert [r.output_len for r in results] == [6, 6, 6] and wall > 0
    assert all(r.token_times == sorted(r.token_times) for r in results)
    for prompt, together in zip(prompts, batched, strict=True):
        peer.run([prompt], 6)
        assert peer.outputs[0] == together

