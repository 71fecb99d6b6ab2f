"""``conflux-serve`` / ``python -m serving``: load a model, warm up, serve OpenAI's API.

Order matters: on CPU the mesh is simulated with host devices, which XLA only honours if
the flag is set before the jax backend initialises, so this module touches nothing from
jax (or conflux_jax) until the arguments are parsed and the flag is set. A multi-process
instance (``--coordinator``/``--num-processes``/``--process-id``, or the environment of
LeaderWorkerSet or Slurm) joins JAX's distributed runtime at that point too; process 0
serves HTTP and the others only follow its steps.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

log = logging.getLogger("serving")

# Simulated host devices time-share the CPU's cores (each rank reads all the weights every
# step), so one device serves fastest; `--mesh sp=4,tp=1` runs the Conflux mesh on four.
CPU_SIMULATED_DEVICES = 1


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conflux-serve", description="OpenAI-compatible server on the Conflux engine.")
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file, an HF safetensors "
                        "folder or an orbax checkpoint directory")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="store the default model is converted into on first use and loaded "
                        "from (default: $CONFLUX_CHECKPOINT_DIR, else a source checkout's "
                        "checkpoints/, else ~/.cache/conflux_jax/checkpoints)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: the --model value)")
    p.add_argument("--mesh", default=None,
                   help="device mesh, e.g. 'sp=4,tp=1' (default: every device as an sp "
                        f"rank; on CPU {CPU_SIMULATED_DEVICES} host device, or as many "
                        "simulated ones as --mesh names)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("CONFLUX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (or $CONFLUX_API_KEY)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests admitted and not finished; more are refused with 429")
    p.add_argument("--ttft-slo", type=_positive, default=10.0, help="default TTFT SLO, s")
    p.add_argument("--tbt-slo", type=_positive, default=1.0, help="default TBT SLO, s")
    p.add_argument("--overdue-grace", type=_positive, default=None,
                   help="bounded waiting: a request still waiting this long past its TTFT "
                        "deadline is served first, oldest first (default: the TTFT SLO)")
    p.add_argument("--policy", default="conflux",
                   choices=["conflux", "fcfs", "srpt", "chunked", "isolated"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="automatic prefix caching: prompts reuse cached KV of full pages "
                        "(default on, as in vLLM; --no-enable-prefix-caching turns it off)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="plan and start the next iteration before turning the last one's "
                        "tokens into outputs, which the host then builds while the device "
                        "runs (default on; --no-async-scheduling: one iteration at a time)")
    p.add_argument("--plan-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="with async scheduling, also plan the iteration after the running "
                        "one, build its inputs while the device runs and launch it on the "
                        "running one's tokens, read there, where it has no collective "
                        "(default on; "
                        "--no-plan-ahead: plan once the running one's tokens are in)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per rank (default: what --gpu-memory-utilization leaves "
                        "on a GPU/TPU; 256 on CPU)")
    p.add_argument("--linears", choices=("auto", "xla", "packed", "blas"), default="auto",
                   help="how the dense layers multiply: xla (XLA's dot), packed (our GEMM on "
                        "weights packed in 32-column panels, reading each layer in place; "
                        "fp32 on CPU, tp=1) or blas (OpenBLAS in place; fp32 on CPU); auto = "
                        "packed where it runs, else xla")
    p.add_argument("--decode-attention", choices=("auto", "rpa", "cpu"), default="auto",
                   help="decode attention: rpa (the ragged paged attention kernel) or cpu "
                        "(a C++ handler reading each sequence's KV pages in place; fp32 on "
                        "CPU only); auto = cpu where it runs, else rpa")
    p.add_argument("--prefill-attention", choices=("auto", "rpa", "cpu"), default="auto",
                   help="prefill attention: rpa (the ragged paged attention kernel) or cpu "
                        "(a C++ handler for ragged causal chunks reading KV pages in place; "
                        "fp32 on CPU only); auto = cpu where it runs, else rpa")
    p.add_argument("--layer-weights", choices=("auto", "stacked", "per_layer"), default="auto",
                   help="stacked: each weight one [layers, ...] array, the layers in a loop "
                        "(fast to compile); per_layer: arrays of their own, the layers "
                        "unrolled, so no matmul reads a copy of its weights (compiles "
                        "longer); auto = per_layer on a GPU/TPU, stacked on CPU")
    p.add_argument("--kv-layout", choices=("auto", "split", "combined"), default="auto",
                   help="split: a K pool and a V pool; combined: one pool, K and V of each "
                        "head side by side (the layout of JAX's TPU attention kernel); auto "
                        "= combined exactly when attention runs that kernel (on a TPU, head "
                        "dims a multiple of 128), else split")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="share of each device's memory for weights, the largest step's "
                        "temporaries and the KV cache, as in vLLM (default 0.9 on a "
                        "GPU/TPU; on CPU, given, it sizes the pool from host memory)")
    from conflux_jax.executor.buckets import BucketConfig  # stdlib-only module

    cpu = BucketConfig()  # the CPU defaults; accelerators get larger ones (device.py)
    p.add_argument("--token-buckets", type=_ints, default=None,
                   help="token-buffer buckets per rank, each compiled at warm-up (default: "
                        f"{_csv(cpu.tokens)} on CPU, up to 2048 on a GPU/TPU)")
    p.add_argument("--decode-buckets", type=_ints, default=None,
                   help=f"decode slots per rank (default: {_csv(cpu.decode)} on CPU, up to "
                        "256 on a GPU/TPU)")
    p.add_argument("--decode-page-buckets", type=_ints, default=None,
                   help="decode page-table widths in pages (default: the max model "
                        "length's on CPU; 128, 1024, 8192 on a GPU/TPU, capped at it)")
    p.add_argument("--max-prefill-seqs", type=int, default=None,
                   help=f"prefill chunks per step (default: {cpu.max_prefill_seqs} on CPU, "
                        "16 on a GPU/TPU)")
    p.add_argument("--max-logprobs", type=int, default=5,
                   help="top alternatives computed per token (0-20)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls are written and parsed (vLLM's names; default: by "
                        "the model's chat template: llama3_json for Llama 3.x, else hermes)")
    p.add_argument("--chat-template", default=None,
                   help="a jinja chat template (file or text) to use instead of the model's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always on")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights, KV and activations (sums in float32 either way); auto = "
                        "bfloat16 on a GPU/TPU, float32 on CPU")
    p.add_argument("--recalibrate", action="store_true",
                   help="fit the scheduler's latency model anew at warm-up, even if one "
                        "was saved for this model, device and mesh")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--compile-cache", default=None,
                   help="JAX persistent compilation cache directory, or 'off' (default: "
                        "$CONFLUX_COMPILE_CACHE or ~/.cache/conflux_jax/xla)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    from conflux_jax.executor import distributed  # stdlib-only until initialize()

    scale = p.add_argument_group(
        "one instance over several processes (hosts)",
        "every process runs this command with the same model and engine flags; process 0 "
        "serves HTTP. Defaults come from $CONFLUX_COORDINATOR, $CONFLUX_NUM_PROCESSES and "
        "$CONFLUX_PROCESS_ID, else Kubernetes LeaderWorkerSet's LWS_LEADER_ADDRESS (port "
        f"$CONFLUX_COORDINATOR_PORT, default {distributed.DEFAULT_PORT}), LWS_GROUP_SIZE "
        "and LWS_WORKER_INDEX, else a Slurm step's SLURM_NTASKS and SLURM_PROCID")
    scale.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="address of process 0, which hosts JAX's coordination service")
    scale.add_argument("--num-processes", type=int, default=None, metavar="P")
    scale.add_argument("--process-id", type=int, default=None, metavar="I",
                       help="this process's index in [0, P); 0 runs the scheduler and HTTP")
    scale.add_argument("--heartbeat-timeout", type=int, metavar="S",
                       default=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
                       help="seconds of silence after which a process is declared dead "
                            "and the whole instance fails")
    return p


def _template(spec: str | None) -> str | None:
    """vLLM's --chat-template: a path to a template file, or the template itself."""
    if spec is not None and os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return f.read()
    return spec


def _wants_gpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    return any(x in platforms for x in ("cuda", "gpu", "rocm", "tpu"))


def prepare_local_devices(args: argparse.Namespace) -> None:
    """The device environment of a one-process instance, set before jax initialises
    (what ``main`` does for one without ``--coordinator``): the GPU memory share, and on
    CPU as many simulated host devices as ``--mesh`` names."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                          str(args.gpu_memory_utilization or 0.9))
    if not _wants_gpu():
        from conflux_jax.executor.mesh import devices_named_by, simulate_cpu_devices

        simulate_cpu_devices(devices_named_by(args.mesh, CPU_SIMULATED_DEVICES))


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The checkpoint and the executor configuration (the same in every process)."""
    import dataclasses

    from conflux_jax.checkpoints import load_checkpoint
    from conflux_jax.executor.device import default_buckets, default_platform, resolve_dtype
    from conflux_jax.executor.jax_executor import ExecutorConfig

    platform = default_platform()
    dtype = resolve_dtype(args.dtype, platform)
    ckpt = load_checkpoint(args.model, dtype=dtype, checkpoint_dir=args.checkpoint_dir)
    given = {"tokens": args.token_buckets, "decode": args.decode_buckets,
             "decode_pages": args.decode_page_buckets,
             "max_prefill_seqs": args.max_prefill_seqs}
    buckets = dataclasses.replace(default_buckets(platform),
                                  **{k: v for k, v in given.items() if v is not None})
    executor = ExecutorConfig(mesh=args.mesh, page_size=args.page_size,
                              num_pages=args.num_pages, max_model_len=args.max_model_len,
                              buckets=buckets, dtype=dtype,
                              num_top_logprobs=args.max_logprobs,
                              compile_cache=args.compile_cache,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              linears=args.linears,
                              decode_attention=args.decode_attention,
                              prefill_attention=args.prefill_attention,
                              layer_weights=args.layer_weights,
                              kv_layout=args.kv_layout)
    return ckpt, executor


def build_engine(args: argparse.Namespace) -> Any:
    from conflux_jax.engine import Engine, EngineConfig

    ckpt, executor = _load(args)
    return Engine(ckpt.config, ckpt.params, ckpt.tokenizer,
                  EngineConfig(executor=executor, policy=args.policy,
                               ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                               profile=args.model, overdue_grace_s=args.overdue_grace,
                               recalibrate=args.recalibrate,
                               enable_prefix_caching=args.enable_prefix_caching,
                               async_scheduling=args.async_scheduling,
                               plan_ahead=args.plan_ahead))


def follow(args: argparse.Namespace) -> int:
    """Processes 1..: the same executor over the same mesh, compiled alike, running the
    steps process 0 posts until it stops the instance."""
    from conflux_jax.executor.distributed import exit_now
    from conflux_jax.executor.jax_executor import JaxExecutor
    from conflux_jax.plan import ExecutorLost

    try:
        ckpt, config = _load(args)
        executor = JaxExecutor(ckpt.config, ckpt.params, config)
    except Exception as exc:
        log.error("cannot start: %s", exc)
        exit_now(2)  # the others wait at JAX's shutdown barrier for no one
    log.info("process %d: compiling every step shape", executor.process_index)
    executor.warmup(progress=False)
    log.info("process %d: following process 0", executor.process_index)
    try:
        steps = executor.follow()
    except ExecutorLost as exc:
        log.error("the instance failed: %s", exc)
        exit_now(1)
    log.info("stopped after %d steps", steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":  # keep start-up to our few lines: warm-up, ready, stop
        for noisy in ("jax", "absl", "orbax"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    from conflux_jax.executor import distributed  # stdlib-only until initialize()

    try:
        dist = distributed.resolve(args.coordinator, args.num_processes, args.process_id,
                                   heartbeat_timeout_s=args.heartbeat_timeout)
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    # JAX's GPU allocator takes 0.75 of the card unless told otherwise: give it the share
    # the KV pool is sized for (vLLM's meaning of the utilization). No effect on CPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                          str(args.gpu_memory_utilization or 0.9))
    if not _wants_gpu():
        # Importing jax is harmless here: XLA reads the flag when the backend first
        # initialises, which nothing has triggered yet. On a GPU host the flag only
        # affects the (unused) CPU platform.
        from conflux_jax.executor.mesh import devices_named_by, simulate_cpu_devices

        if dist is None:
            simulate_cpu_devices(devices_named_by(args.mesh, CPU_SIMULATED_DEVICES))
        else:  # the mesh's devices, split over the processes
            total = devices_named_by(args.mesh, CPU_SIMULATED_DEVICES * dist.num_processes)
            try:
                simulate_cpu_devices(distributed.local_device_count(total, dist.num_processes))
            except ValueError as exc:
                log.error("cannot start: %s", exc)
                return 2
    if dist is not None:
        distributed.initialize(dist)
        if not dist.is_leader:
            return follow(args)
    from serving.app import create_app
    from serving.engine_loop import EngineLoop
    from serving.http_protocol import uvicorn_config
    from serving.settings import ServerSettings

    try:
        engine = build_engine(args)
    except Exception as exc:  # a bad --model, mesh or bucket set: say why, no traceback
        log.error("cannot start: %s", exc)
        if dist is not None:
            distributed.exit_now(2)  # the followers fail when the coordinator goes
        return 2
    name = args.served_model_name or args.model
    loop = EngineLoop(engine)
    settings = ServerSettings(model_name=name, max_model_len=engine.max_model_len,
                              api_key=args.api_key, max_queue=args.max_queue,
                              max_body_bytes=args.max_body_bytes,
                              max_logprobs=args.max_logprobs,
                              tool_call_parser=args.tool_call_parser,
                              chat_template=_template(args.chat_template))
    app = create_app(loop, settings)

    def ready() -> None:
        mesh = engine.executor.mesh_spec
        log.info("ready: serving %s at http://%s:%d/v1 (warm-up %.1f s, mesh sp=%d,tp=%d)",
                 name, args.host, args.port, loop.warmup_s or 0.0, mesh.sp, mesh.tp)

    loop.on_ready = ready
    # uvicorn's own start-up lines would repeat the address; our "ready" line says it once.
    uv_level = "debug" if args.log_level == "debug" else "warning"
    server = _draining_server(uvicorn_config(app, host=args.host, port=args.port,
                                             log_level=uv_level, access_log=False,
                                             timeout_graceful_shutdown=120))
    failed = False

    def fatal() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    loop.on_fatal = fatal
    log.info("warming up %s: compiling every step shape", name)
    loop.start(warmup=True)
    server.run()  # returns after SIGTERM/SIGINT once in-flight requests have finished
    loop.stop(drain=False, timeout=10)
    log.info("stopped")
    if dist is not None:
        if failed:  # JAX's shutdown barrier would wait for a dead process: leave now
            distributed.exit_now(1)
        engine.executor.close()  # the followers leave their loop and exit
    return 1 if failed else 0


def _draining_server(config: Any) -> Any:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn drains in-flight requests on SIGTERM, then re-raises the signal, so the
        process would die by it; a drained SIGTERM is a clean exit (status 0) here."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
                captured.remove(sig)
                log.info("SIGTERM: draining in-flight requests, then exiting")

    return DrainingServer(config)


if __name__ == "__main__":
    sys.exit(main())
