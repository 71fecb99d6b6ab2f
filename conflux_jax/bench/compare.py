"""``python -m conflux_jax.bench compare``: our CPU serving vs HF transformers, one run.

The same random token-id prompts go to (a) our in-process engine (or a server with
``--url``), all ``c`` requests at once, and (b) HF transformers' batched ``generate``
(left-padded, greedy, ``min_new_tokens`` = ``max_new_tokens`` so both emit the same
count), and (c) llama.cpp through ``llama-cpp-python`` when it is installed (all
requests batched as ``llama-server``'s parallel slots would be, on the GGUF's own Q4_1
weights), and (d) with ``--peers server``, our own server (``python -m serving``, the
same checkpoint) through the ``--url`` client, beside the in-process engine; each peer
runs in its own process. For each concurrency ``c``:
output tokens/s, mean TTFT and mean TBT (gap between a request's tokens), and our
ratio to each peer (tokens/s: ours/peer, higher is better; TTFT/TBT: peer/ours, higher
is better), from the fastest of ``--repeats`` runs per system; beside it the paired ratio,
the median over rounds of ours / peer within a round (each round runs every system back
to back, so a slow phase of the host hits both sides of a pair). Every number is
measured in this run on this machine; nothing is quoted.
For a server peer the CPU time of the measuring client is recorded too (it runs on the
cores the server uses; the in-process engine runs no client). Every measured run starts on
a quiet host (``quiet.wait_quiet``): a system that keeps the cores busy after its run
(vLLM-CPU's spinning workers) does not slow the one measured after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from conflux_jax.bench import vllm_peer
from conflux_jax.bench.metrics import RequestResult
from conflux_jax.bench.quiet import wait_quiet
from conflux_jax.bench.serve import engine_from_model, run_engine, run_server
from conflux_jax.bench.serve_workload import ServeRequest
from conflux_jax.bench.server_peer import ServerPeer

# Our engine's settings here: all requests arrive at once, so the SLOs only need to be
# loose enough never to refuse or reorder them (the same for the engine and the server).
POLICY, TTFT_SLO_S, TBT_SLO_S = "conflux", 60.0, 10.0


@dataclasses.dataclass
class Measure:
    """One system at one concurrency (means over requests; tokens/s over the wall time)."""

    tokens_per_s: float
    ttft_ms: float
    tbt_ms: float
    wall_s: float
    cached_tokens: int  # prompt tokens a prefix cache served: 0 when prompts are fresh
    # A server peer's: CPU seconds its measuring client took (on the same cores as the
    # server; the in-process engine runs none). None for the others.
    client_cpu_s: float | None = None

    @classmethod
    def from_results(cls, results: list[RequestResult], wall_s: float) -> Measure:
        ok = [r for r in results if r.success and r.token_times]
        if not ok:
            raise RuntimeError(f"no request succeeded: {[r.error for r in results][:3]}")
        gaps = [g for r in ok for g in r.itls]
        return cls(sum(r.output_len for r in ok) / wall_s,
                   1e3 * sum(r.ttft or 0.0 for r in ok) / len(ok),
                   1e3 * sum(gaps) / max(1, len(gaps)), wall_s,
                   sum(r.cached_tokens for r in ok))


def paired_ratio(ours: list[float], peer: list[float]) -> float:
    """The median over rounds of ours / peer within a round (the i-th runs of both ran
    back to back): on a host whose speed drifts, steadier than the best of each."""
    return statistics.median(o / p for o, p in zip(ours, peer, strict=True))


def make_prompts(n: int, prompt_len: int, vocab: int, seed: int | str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]


# ---- peers -----------------------------------------------------------------------------
class HFPeer:
    """transformers' batched generate on the same weights (fp32, CPU)."""

    name = "hf"

    def __init__(self, model: str, threads: int | None = None) -> None:
        import torch
        import transformers

        if threads:
            torch.set_num_threads(threads)
        if model == "default":
            from conflux_jax.checkpoints import default_gguf_path

            path = default_gguf_path()
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                model, dtype=torch.float32).eval()
        self.torch = torch

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[RequestResult], float]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        pad = 0  # left padding, masked out: its id never matters
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        results = [RequestResult(0.0, len(p)) for p in prompts]
        step_times: list[float] = []

        from transformers import StoppingCriteria, StoppingCriteriaList

        class _Clock(StoppingCriteria):  # called once per generated position
            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:  # noqa: ANN401
                step_times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
                                stopping_criteria=StoppingCriteriaList([_Clock()]))
        wall = time.perf_counter() - t0
        for r in results:  # a batch emits one token per request per step
            r.send_s, r.token_times, r.output_len, r.success = (
                t0, list(step_times), len(step_times), True)
        return results, wall


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python's C API, batched the way ``llama-server``
    serves parallel slots: one KV sequence per request, and every ``llama_decode`` call
    carries each generating request's next token plus as many prompt tokens as fit in
    ``n_batch`` (continuous batching). Greedy argmax over the returned logits.

    Its weights are the GGUF's own (Q4_1 matrices, Q8_0 embeddings): llama.cpp's native
    format, not the fp32 our engine and HF run.
    """

    name = "llama.cpp"

    def __init__(self, model: str, threads: int | None = None, n_batch: int = 512) -> None:
        import llama_cpp

        if model != "default":
            raise ValueError("llama.cpp peer: only the default (GGUF) model")
        from conflux_jax.checkpoints import default_gguf_path

        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(
            str(default_gguf_path()).encode(), lib.llama_model_default_params())
        if not self.model:
            raise ValueError("llama.cpp could not load the default GGUF")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.threads, self.n_batch = threads, n_batch
        self.ctx: Any = None
        self.ctx_key: tuple[int, int] | None = None
        self.outputs: list[list[int]] = []  # the last run's sampled ids, per request

    def _context(self, seqs: int, per_seq: int) -> Any:  # noqa: ANN401
        """A context with ``seqs`` KV sequences of ``per_seq`` tokens each (reused while
        the sizes match; its KV is cleared for every run)."""
        lib = self.lib
        if self.ctx_key != (seqs, per_seq):
            if self.ctx is not None:
                lib.llama_free(self.ctx)
            p = lib.llama_context_default_params()
            p.n_ctx, p.n_seq_max = seqs * per_seq, seqs
            p.n_batch = p.n_ubatch = self.n_batch
            if self.threads:
                p.n_threads = p.n_threads_batch = self.threads
            self.ctx, self.ctx_key = lib.llama_init_from_model(self.model, p), (seqs, per_seq)
            if not self.ctx:
                raise RuntimeError("llama.cpp could not create a context")
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        return self.ctx

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[RequestResult], float]:
        import numpy as np

        lib = self.lib
        per_seq = -(-(max(len(p) for p in prompts) + max_tokens) // 256) * 256
        ctx = self._context(len(prompts), per_seq)
        batch = lib.llama_batch_init(self.n_batch + len(prompts), 0, 1)
        results = [RequestResult(0.0, len(p)) for p in prompts]
        fed = [0] * len(prompts)  # prompt tokens already decoded, per request
        last: list[int | None] = [None] * len(prompts)  # newest sampled token
        self.outputs = [[] for _ in prompts]  # the sampled ids, per request
        t0 = time.perf_counter()
        for r in results:
            r.send_s = t0  # all sent at once, as for ours
        try:
            while any(len(r.token_times) < max_tokens for r in results):
                rows: list[tuple[int, int, int, bool]] = []  # (seq, token, position, sample)
                for s, r in enumerate(results):  # decode tokens first, as llama-server
                    if last[s] is not None and len(r.token_times) < max_tokens:
                        rows.append((s, last[s], len(prompts[s]) + len(r.token_times) - 1,
                                     True))
                for s, p in enumerate(prompts):  # then prompt tokens while they fit
                    take = max(0, min(len(p) - fed[s], self.n_batch - len(rows)))
                    rows += [(s, p[i], i, i == len(p) - 1) for i in range(fed[s], fed[s] + take)]
                    fed[s] += take
                for n, (s, token, pos, want) in enumerate(rows):
                    batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                    batch.seq_id[n][0], batch.logits[n] = s, want
                batch.n_tokens = len(rows)
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                now = time.perf_counter()
                for row, (s, *_, want) in enumerate(rows):
                    if not want:
                        continue
                    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, row),
                                                   shape=(self.vocab,))
                    last[s] = int(np.argmax(logits))
                    self.outputs[s].append(last[s])
                    results[s].token_times.append(now)
        finally:
            lib.llama_batch_free(batch)
        for r in results:
            r.output_len, r.success = len(r.token_times), True
        return results, time.perf_counter() - t0


class IsolatedPeer:
    """A peer in its own process: its thread pool (torch/OpenMP, llama.cpp) and ours
    (XLA) would otherwise share, and spin against each other on, the same few cores."""

    def __init__(self, kind: str, model: str, threads: int | None = None) -> None:
        import concurrent.futures
        import multiprocessing

        self.name = kind
        self._pool = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_peer_init,
            initargs=(kind, model, threads))
        self._pool.submit(_peer_ready).result()  # surfaces ImportError / ValueError here

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[RequestResult], float]:
        return self._pool.submit(_peer_run, prompts, max_tokens).result()

    def close(self) -> None:
        self._pool.shutdown()


def our_server_peer(model: str, max_model_len: int, mesh: str | None = None,
                    extra_args: list[str] | None = None) -> ServerPeer:
    """Our own server (``python -m serving``, same model and context, its own process)
    beside the in-process engine in one run shows what HTTP, streaming and
    detokenization cost (issue 19: within 5%)."""
    from conflux_jax.bench.server_process import ServerProcess

    # The in-process engine's settings, so that only the serving path differs.
    args = ["--model", model, "--max-model-len", str(max_model_len), "--log-level",
            "warning", "--policy", POLICY, "--ttft-slo", str(TTFT_SLO_S), "--tbt-slo",
            str(TBT_SLO_S), *(["--mesh", mesh] if mesh else []), *(extra_args or [])]
    return ServerPeer("server", ServerProcess(args))


_PEER: Any = None


def _peer_init(kind: str, model: str, threads: int | None) -> None:
    global _PEER
    try:
        _PEER = (HFPeer if kind == "hf" else LlamaCppPeer)(model, threads)
    except (ImportError, ValueError) as e:  # reported by _peer_ready
        _PEER = e


def _peer_ready() -> bool:
    if isinstance(_PEER, Exception):
        raise _PEER
    return True


def _peer_run(prompts: list[list[int]], max_tokens: int) -> tuple[list[RequestResult], float]:
    return _PEER.run(prompts, max_tokens)


# ---- main ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conflux_jax.bench compare",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default, or an HF checkpoint folder")
    ap.add_argument("--url", help="measure our server here instead of the in-process engine")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--peers", nargs="+", default=["hf", "llama.cpp"],
                    choices=["hf", "llama.cpp", "vllm", "server"],
                    help="vllm: vLLM's CPU build as its own server (scripts/"
                         "setup_peer_vllm.sh); server: our own server beside the "
                         "in-process engine")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="more `python -m serving` arguments for --peers server, one string")
    ap.add_argument("--vllm-python", default=vllm_peer.DEFAULT_PYTHON, metavar="PATH",
                    help="the interpreter vLLM-CPU is installed in (--peers vllm)")
    ap.add_argument("--vllm-args", default="", metavar="ARGS",
                    help="more vLLM server arguments for --peers vllm, one string")
    ap.add_argument("--repeats", type=int, default=2, help="runs per system; the fastest counts")
    ap.add_argument("--threads", type=int, help="torch / llama.cpp threads (default: theirs)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--mesh", help="our engine's mesh, e.g. 'sp=4,tp=1' (simulated CPU devices "
                                   "are created to match); default: every visible device")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bound", action="store_true",
                    help="skip the dense-layer bound (see conflux_jax.bench.dense_bound)")
    ap.add_argument("--quiet-wait-s", type=float, default=5.0, metavar="S",
                    help="before each measured run, wait up to S seconds for the host's CPUs "
                         "to go idle (0: do not wait)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--host-copy-mb", type=int, default=512,
                    help="buffer size of the host floor's copy-bandwidth measurement")
    args = ap.parse_args(argv)
    if args.url and "server" in args.peers:
        ap.error("--peers server compares our server with the in-process engine; "
                 "drop --url")

    if args.url:
        from conflux_jax.bench.serve import server_model

        model_id = server_model(args.url)
        vocab = 32000
        run_ours = lambda reqs: run_server(args.url, model_id, reqs)  # noqa: E731
        ours_label = f"server {args.url}"
    else:
        if args.mesh:
            from conflux_jax.executor.mesh import devices_named_by, simulate_cpu_devices

            simulate_cpu_devices(devices_named_by(args.mesh, 1))
        engine = engine_from_model(args.model, args.max_model_len, POLICY, TTFT_SLO_S,
                                   TBT_SLO_S, mesh=args.mesh)
        vocab = engine.model_config.vocab_size
        run_ours = lambda reqs: run_engine(engine, reqs)  # noqa: E731
        mesh = engine.executor.mesh_spec
        ours_label = f"in-process engine, mesh sp={mesh.sp},tp={mesh.tp}"
    peers: list[Any] = []
    skipped: dict[str, str] = {}
    for name in args.peers:
        if name == "server":  # no skipping: failing to start our own server is an error
            peers.append(our_server_peer(args.model, args.max_model_len, args.mesh,
                                         shlex.split(args.server_args)))
            continue
        try:
            if name == "vllm":
                peers.append(vllm_peer.start(
                    args.model, args.max_model_len, args.vllm_python, args.threads,
                    shlex.split(args.vllm_args)))
            else:
                peers.append(IsolatedPeer(name, args.model, args.threads))
        except (ImportError, ValueError) as e:
            skipped[name] = f"{type(e).__name__}: {e}"

    # Every run gets prompts no system has seen: ours and vLLM cache prompt prefixes, HF
    # and llama.cpp do not, and a repeat of the same prompts would time cache hits.
    def prompts_for(c: int, run: str) -> list[list[int]]:
        return make_prompts(c, args.prompt_len, vocab, f"{args.seed}/{c}/{run}")

    for peer in peers:  # first-call costs (allocations, thread pools), not measured
        peer.run(prompts_for(2, "peer-warmup"), 2)

    def best(runs: list[Measure]) -> dict:
        # The machine is shared: keep the least-disturbed (fastest) of the repeats.
        return dataclasses.asdict(min(runs, key=lambda m: m.wall_s))

    from conflux_jax.bench.host_floor import host_floor
    from conflux_jax.checkpoints import load_checkpoint

    ckpt = load_checkpoint(args.model)  # the bound's weights, the host floor's shapes
    bound = None
    if not args.url and not args.no_bound:
        import jax

        from conflux_jax.bench.dense_bound import dense_bound

        params = jax.device_put(ckpt.params)
        bound = lambda c: dense_bound(ckpt.config, params, c, args.prompt_len,  # noqa: E731
                                      args.max_tokens)
    rows = []
    def requests(batch: list[list[int]]) -> list[ServeRequest]:
        return [ServeRequest(0.0, p, args.max_tokens) for p in batch]

    for c in tqdm(args.concurrency, desc="concurrency"):
        run_ours(requests(prompts_for(c, "warmup")))  # unmeasured: compiles its shapes
        runs: dict[str, list[Measure]] = {"ours": []} | {p.name: [] for p in peers}
        waits: dict[str, list[float]] = {name: [] for name in runs}  # for a quiet host, s
        bounds = []
        for r in range(args.repeats):  # interleaved so slow phases hit every system
            batch = prompts_for(c, str(r))  # the same prompts for every system
            waits["ours"].append(wait_quiet(max_wait_s=args.quiet_wait_s).waited_s)
            runs["ours"].append(Measure.from_results(*run_ours(requests(batch))))
            for peer in peers:
                waits[peer.name].append(wait_quiet(max_wait_s=args.quiet_wait_s).waited_s)
                m = Measure.from_results(*peer.run(batch, args.max_tokens))
                if isinstance(peer, ServerPeer):
                    m = dataclasses.replace(m, client_cpu_s=peer.client_cpu_s)
                runs[peer.name].append(m)
            if bound is not None:  # the bound too: one slow phase once sank it below ours
                bounds.append(bound(c))
        rows.append({"concurrency": c, **{k: best(v) for k, v in runs.items()},
                     "runs_tokens_per_s": {k: [m.tokens_per_s for m in v]
                                           for k, v in runs.items()},
                     "quiet_waits_s": waits})
        if bounds:
            rows[-1]["dense_bound"] = max(bounds, key=lambda b: b.tokens_per_s).as_dict()
        # Every row records this host's floor for a decode step of c rows (issue 19:
        # results from different hosts are read against their own floors).
        rows[-1]["host_floor"] = host_floor(ckpt.config, c, args.host_copy_mb).as_dict()

    for peer in peers:
        peer.close()
    print(f"ours: {ours_label}; model {args.model}; prompt {args.prompt_len} tokens, "
          f"{args.max_tokens} output tokens (ignore_eos, greedy), all requests sent at once; "
          f"best of {args.repeats} interleaved runs")
    for name, why in skipped.items():
        print(f"peer {name} skipped: {why}")
    header = (f"{'conc':>4} {'system':<10} {'out tok/s':>10} {'TTFT ms':>9} {'TBT ms':>8}"
              f"   {'ratio tok/s':>11} {'ratio TTFT':>10} {'ratio TBT':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        o = row["ours"]
        print(f"{row['concurrency']:>4} {'ours':<10} {o['tokens_per_s']:>10.1f} "
              f"{o['ttft_ms']:>9.0f} {o['tbt_ms']:>8.1f}")
        for peer in peers:
            p = row[peer.name]
            row[f"ratio_vs_{peer.name}"] = r = {
                "tokens_per_s": o["tokens_per_s"] / p["tokens_per_s"],
                "tokens_per_s_paired": paired_ratio(row["runs_tokens_per_s"]["ours"],
                                                    row["runs_tokens_per_s"][peer.name]),
                "ttft": p["ttft_ms"] / max(o["ttft_ms"], 1e-9),
                "tbt": p["tbt_ms"] / max(o["tbt_ms"], 1e-9)}
            print(f"{'':>4} {peer.name:<10} {p['tokens_per_s']:>10.1f} {p['ttft_ms']:>9.0f} "
                  f"{p['tbt_ms']:>8.1f}   {r['tokens_per_s']:>10.2f}x {r['ttft']:>9.2f}x "
                  f"{r['tbt']:>8.2f}x")
        if "dense_bound" in row:
            b = row["dense_bound"]
            of = "   ".join(f"{b['tokens_per_s'] / row[p.name]['tokens_per_s']:.2f}x {p.name}"
                           for p in peers)
            print(f"{'':>4} {'bound':<10} {b['tokens_per_s']:>10.1f} {'':>9} "
                  f"{1e3 * b['decode_step_s']:>8.1f}   = {of}")
    if peers and args.repeats > 1:  # each round's systems ran back to back: a slow phase
        print("paired, ours over peer tok/s within each round (median of rounds): " + "; ".join(
            f"{row['concurrency']} streams " + ", ".join(
                f"{p.name} {row[f'ratio_vs_{p.name}']['tokens_per_s_paired']:.2f}x"
                for p in peers) for row in rows))
    http = [p.name for p in peers if isinstance(p, ServerPeer)]
    if http:  # the client's share of the host, beside each server's wall time
        print("measuring client's CPU per run (same cores as the server): " + "; ".join(
            f"{row['concurrency']} streams " + ", ".join(
                f"{n} {row[n]['client_cpu_s']:.2f} s of {row[n]['wall_s']:.2f} s" for n in http)
            for row in rows))
    if args.quiet_wait_s > 0:  # a system that leaves the cores busy delays the next one
        print("waited for a quiet host before each system's runs (s, all levels): " + ", ".join(
            f"{name} {sum(sum(row['quiet_waits_s'][name]) for row in rows):.1f}"
            for name in rows[0]["quiet_waits_s"]))
    h = rows[-1]["host_floor"]
    caps = ", ".join(f"{k}={v}" for k, v in h["isa_caps"].items())
    caps = f"; ISA capped: {caps}" if caps else ""
    print(f"host: {h['cpu']}; {' '.join(h['isa'])}; copy {h['copy_gbs']:.1f} GB/s{caps}")
    for row in rows:
        f = row["host_floor"]
        print(f"{row['concurrency']:>4} rows: sgemm {f['sgemm_gflops']:.0f} GFLOP/s on the "
              f"step's shapes; decode-step floor {1e3 * f['floor_s']:.1f} ms (memory "
              f"{1e3 * f['memory_s']:.1f}, compute {1e3 * f['compute_s']:.1f}); ours TBT "
              f"{row['ours']['tbt_ms'] / (1e3 * f['floor_s']):.2f}x floor")
    print("ratios: ours over peer for tok/s, peer over ours for TTFT/TBT (>1 = ours better)")
    if any("dense_bound" in row for row in rows):
        print("bound: the dense layers and LM head alone (no attention, KV, sampling or host "
              "work), the most any engine can reach here; beside it, bound over peer tok/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "bench": "compare", "ours": ours_label, "model": args.model,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "quiet_wait_s": args.quiet_wait_s,
            "peers": [p.name for p in peers], "skipped_peers": skipped, "rows": rows},
            indent=2))
    return 0
