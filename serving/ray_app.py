"""Many engine instances behind the global router, as a Ray Serve application.

Deployments:

- ``instance-0`` .. ``instance-K-1``: one ``EngineInstance`` replica each, holding one
  engine (built from the single server's flags, any mesh) on its ``EngineLoop``, serving
  the router's calls (``serving.instance.InstanceServer``). One deployment per instance,
  not K replicas of one: Ray's replica routing would not use our router.
- ``ingress``: the single server's FastAPI app (``serving.app.create_app``) over a
  ``RoutedLoop`` (``serving.routed_loop``) whose instances are handles to those
  deployments. It tokenizes, asks every instance for a load report, routes with
  ``conflux_jax.scheduler.router.Router`` and streams the chosen instance's outputs back.

Run it with ``python -m serving.ray_app --instances 2 --model default --router conflux``
(a local Ray cluster, or ``--ray-address`` for a running one), with ``serve run
examples/ray/serve_config.yaml`` (``app_builder`` takes the same flags as a dict), or on
Kubernetes as a KubeRay ``RayService`` (``examples/ray/rayservice.yaml``).

A replica Ray kills or loses fails the requests it was generating (an error naming the
instance) and gets no new ones until it answers again: Ray Serve starts a new replica
(the health check also fails once an instance's engine loop has stopped), which warms up
and rejoins through the router's stats poll.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from conflux_jax.sampling import SamplingParams
from conflux_jax.scheduler.router import ROUTER_POLICIES, InstanceLoad
from serving import cli
from serving.engine_loop import EngineLoop, Stats
from serving.instance import Event, InstanceServer, ModelInfo, Refused
from serving.routed_loop import RoutedLoop, Timeouts, describe_any

log = logging.getLogger("serving")

APP_NAME = "conflux"
# Beyond the HTTP queue: load reports, stats polls and aborts share an instance's slots.
_CONTROL_SLOTS = 64


# ------------------------------------------------------------------------ the flags
def build_parser() -> argparse.ArgumentParser:
    """The single server's flags (``python -m serving``) plus the router's and Ray's."""
    p = cli.build_parser()
    p.prog = "python -m serving.ray_app"
    p.description = ("OpenAI-compatible server: several Conflux engine instances behind "
                     "the global router, as a Ray Serve application.")
    g = p.add_argument_group("many instances behind the global router (Ray Serve)")
    g.add_argument("--instances", type=int, default=2, metavar="K",
                   help="engine instances, one Ray Serve deployment each")
    g.add_argument("--router", choices=ROUTER_POLICIES, default="conflux",
                   help="conflux: lowest predicted TTFT (prefix affinity priced in); "
                        "least-loaded: lowest queued work per rank; round-robin")
    g.add_argument("--instance-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves for each instance's replica")
    g.add_argument("--instance-gpus", type=float, default=0.0,
                   help="GPUs Ray gives each instance's replica (its mesh's devices)")
    g.add_argument("--ingress-replicas", type=int, default=1,
                   help="replicas of the HTTP ingress; each routes on fresh load reports")
    g.add_argument("--ingress-cpus", type=float, default=0.5,
                   help="CPUs Ray reserves for each ingress replica (HTTP, tokenizing)")
    g.add_argument("--report-timeout", type=cli._positive, default=Timeouts.report_s,
                   help="seconds an instance has to answer a load report or stats poll")
    g.add_argument("--start-timeout", type=cli._positive, default=Timeouts.start_s,
                   help="seconds an instance has to accept a forwarded request")
    g.add_argument("--output-timeout", type=cli._positive, default=Timeouts.output_s,
                   help="seconds a request may wait for its next output before it fails")
    g.add_argument("--ray-address", default=None,
                   help="a running Ray cluster ('auto', 'ray://host:10001'); default: "
                        "start a local one")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse what this application does not do (``ValueError`` saying why)."""
    if args.instances < 1 or args.ingress_replicas < 1:
        raise ValueError("--instances and --ingress-replicas must be at least 1")
    if args.coordinator or args.num_processes or args.process_id is not None:
        raise ValueError("an instance here is one Ray replica (one process): "
                         "--coordinator/--num-processes/--process-id are not supported "
                         "under Ray Serve")
    if min(args.instance_cpus, args.instance_gpus, args.ingress_cpus) < 0:
        raise ValueError("--instance-cpus, --instance-gpus and --ingress-cpus must not be "
                         "negative")


# Flags of the command line that an application's args cannot apply.
_CLI_ONLY = {
    "--host": "the Serve config's http_options set where the proxy listens",
    "--port": "the Serve config's http_options set where the proxy listens",
    "--ray-address": "the application runs on the cluster it is deployed to",
}


def args_from_config(config: dict[str, Any]) -> argparse.Namespace:
    """Flags given as a dict (``serve run`` config's ``args``: ``model: default``,
    ``enable_prefix_caching: false``, ``token_buckets: [16, 64]``), parsed and checked by
    the same parser as the command line."""
    parser = build_parser()
    known = parser._option_string_actions
    argv: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag in _CLI_ONLY:
            raise ValueError(f"application arg {key!r}: {_CLI_ONLY[flag]}")
        if flag not in known:
            raise ValueError(f"unknown application arg {key!r} (not a flag of "
                             "python -m serving.ray_app)")
        if known[flag].nargs == 0 and isinstance(value, str) and \
                value.lower() in ("true", "false"):  # `serve run ... key=false`
            value = value.lower() == "true"
        if isinstance(value, bool):
            negative = "--no-" + flag[2:]
            if value:
                argv.append(flag)
            elif negative in known:
                argv.append(negative)
            elif known[flag].default:
                raise ValueError(f"{key}: false is not expressible for {flag}")
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]

    def fail(message: str) -> Any:
        raise ValueError(f"invalid application args: {message}")

    parser.error = fail  # type: ignore[method-assign]  # raise, do not exit the process
    args = parser.parse_args(argv)
    check_args(args)
    return args


# ------------------------------------------------------------------- an instance
def start_engine_loop(args: argparse.Namespace) -> EngineLoop:
    """Build the engine the single server would, warm it up, return its running loop."""
    cli.prepare_local_devices(args)  # before jax initialises in this process
    engine = cli.build_engine(args)
    loop = EngineLoop(engine)
    failed = threading.Event()
    loop.on_fatal = failed.set
    loop.start(warmup=True)
    while not loop.ready.wait(0.5):
        if failed.is_set() or not loop.alive:
            raise RuntimeError("the engine's warm-up failed; see this replica's log")
    return loop


@serve.deployment(health_check_period_s=5, health_check_timeout_s=30)
class EngineInstance:
    """One engine instance (see the module docstring); its methods are
    ``InstanceServer``'s, called by the ingress's router."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        logging.getLogger("serving").setLevel(args.log_level.upper())
        self.server = InstanceServer(name, start_engine_loop(args))

    async def load_report(self, prompt_ids: list[int], cache_salt: str,
                          max_new_tokens: int) -> InstanceLoad | Refused:
        return await self.server.load_report(prompt_ids, cache_salt, max_new_tokens)

    async def generate(self, key: str, prompt_ids: list[int], sampling: SamplingParams,
                       kwargs: dict[str, Any]) -> AsyncIterator[Event]:
        async for event in self.server.generate(key, prompt_ids, sampling, kwargs):
            yield event

    async def abort(self, key: str) -> None:
        await self.server.abort(key)

    async def stats(self) -> Stats:
        return await self.server.stats()

    async def describe(self) -> ModelInfo:
        return await self.server.describe()

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose check fails: here, a stopped engine loop
        (a lost executor) serves nothing again."""
        if not self.server.loop.alive:
            raise RuntimeError(f"{self.server.name}: the engine loop has stopped")


class RayInstance:
    """An ``EngineInstance`` deployment as the router's ``Instance``."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.name = handle.deployment_name
        self._handle = handle
        self._streaming = handle.options(stream=True)

    async def load_report(self, prompt_ids: list[int], cache_salt: str,
                          max_new_tokens: int) -> InstanceLoad | Refused:
        return await _cancel_on_exit(
            self._handle.load_report.remote(prompt_ids, cache_salt, max_new_tokens))

    async def generate(self, key: str, prompt_ids: list[int], sampling: SamplingParams,
                       kwargs: dict[str, Any]) -> AsyncIterator[Event]:
        response = self._streaming.generate.remote(key, prompt_ids, sampling, kwargs)
        done = False
        try:
            async for event in response:
                yield event
            done = True
        finally:
            if not done:  # closed early (abort, timeout, failure): stop the replica's side
                response.cancel()

    async def abort(self, key: str) -> None:
        await _cancel_on_exit(self._handle.abort.remote(key))

    async def stats(self) -> Stats:
        return await _cancel_on_exit(self._handle.stats.remote())

    async def describe(self) -> ModelInfo:
        return await _cancel_on_exit(self._handle.describe.remote())


async def _cancel_on_exit(response: Any) -> Any:
    """Await a handle call; if we stop waiting (a router timeout), cancel it at Ray too."""
    try:
        return await response
    except BaseException:
        response.cancel()
        raise


# ----------------------------------------------------------------------- the ingress
class DeferredApp:
    """The ingress's ASGI app, built at the ASGI lifespan's startup: the OpenAI app needs
    the model's tokenizer, which only an instance can tell (an async call), and Ray Serve
    runs the lifespan, async, as part of starting the replica (an async ``__init__`` is
    not awaited by every Ray version's ingress wrapper). Until then it answers 503."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.app is None and scope["type"] == "lifespan":
            try:
                self.app = await _build_ingress_app()
            except Exception as exc:
                log.exception("the ingress cannot start")
                await receive()  # lifespan.startup
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        if self.app is None:
            from serving.errors import error_response

            await error_response(503, "the router is starting; retry shortly")(
                scope, receive, send)
            return
        await self.app(scope, receive, send)


_SETUP: list[tuple[list[DeploymentHandle], argparse.Namespace]] = []


def _keep_ingress_setup(instances: list[DeploymentHandle], args: argparse.Namespace) -> None:
    # A module function, so that it reaches this module's _SETUP: Ray ships the Ingress
    # class by value (its name is the deployment's), with a copy of the globals it uses.
    _SETUP[:] = [(instances, args)]


async def _build_ingress_app() -> Any:
    """The single server's app over a RoutedLoop of this replica's instance handles."""
    from serving.app import create_app
    from serving.settings import ServerSettings

    if not _SETUP:
        raise RuntimeError("Ingress.__init__ has not run in this process")
    instances, args = _SETUP[0]
    routed = [RayInstance(h) for h in instances]
    timeouts = Timeouts(report_s=args.report_timeout, start_s=args.start_timeout,
                        output_s=args.output_timeout)
    # The instances are warm before the ingress starts (it depends on them); this only
    # waits out a slow first answer.
    info = await describe_any(routed, max(60.0, args.start_timeout))
    loop = RoutedLoop(routed, info, policy=args.router, timeouts=timeouts)
    await loop.start()
    settings = ServerSettings(
        model_name=args.served_model_name or args.model, max_model_len=info.max_model_len,
        api_key=args.api_key, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        max_logprobs=info.max_logprobs, tool_call_parser=args.tool_call_parser,
        chat_template=cli._template(args.chat_template))
    return create_app(loop, settings)


@serve.deployment(name="ingress")
@serve.ingress(DeferredApp())
class Ingress:
    """The single server's OpenAI app over a RoutedLoop of the instance deployments
    (built by ``DeferredApp`` once this constructor has handed it the handles)."""

    def __init__(self, instances: list[DeploymentHandle], args: argparse.Namespace) -> None:
        logging.getLogger("serving").setLevel(args.log_level.upper())
        _keep_ingress_setup(instances, args)


def build_application(args: argparse.Namespace) -> Any:
    """The Ray Serve application: K instance deployments bound into the ingress."""
    check_args(args)
    slots = args.max_queue + _CONTROL_SLOTS
    actor = {"num_cpus": args.instance_cpus, "num_gpus": args.instance_gpus}
    # No per-call access log: the router's polls would be most of it (as the single
    # server, which logs no access either).
    logging_config = {"log_level": args.log_level.upper(), "enable_access_log": False}
    instances = [EngineInstance.options(name=f"instance-{i}", num_replicas=1,
                                        max_ongoing_requests=slots, ray_actor_options=actor,
                                        logging_config=logging_config
                                        ).bind(args, f"instance-{i}")
                 for i in range(args.instances)]
    return Ingress.options(num_replicas=args.ingress_replicas, max_ongoing_requests=slots,
                           ray_actor_options={"num_cpus": args.ingress_cpus},
                           logging_config=logging_config).bind(instances, args)


def app_builder(config: dict[str, Any]) -> Any:
    """``serve run serving.ray_app:app_builder model=default instances=2`` and the
    ``import_path`` of a Serve config file: the flags as a dict."""
    return build_application(args_from_config(config))


# --------------------------------------------------------------------------- the CLI
def local_cpus(args: argparse.Namespace) -> int:
    """CPUs a local cluster declares: the host's, or what the deployments reserve if more
    (Ray would never schedule the rest; the processes then share the cores)."""
    wanted = args.instances * args.instance_cpus + args.ingress_replicas * args.ingress_cpus
    return max(os.cpu_count() or 1, math.ceil(wanted + 1))  # + Serve's own actors


def local_runtime_env() -> dict[str, Any]:
    """Workers of a local cluster import this same source tree (a checkout may not be
    installed, or be installed from elsewhere)."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_args(args)
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    import ray

    if args.ray_address is None:
        ray.init(num_cpus=local_cpus(args), runtime_env=local_runtime_env())
    else:
        ray.init(address=args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        log.info("starting %d engine instances (router %s); each warms up first",
                 args.instances, args.router)
        serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        log.info("ready: serving %s at http://%s:%d/v1 over %d instances",
                 args.served_model_name or args.model, args.host, args.port, args.instances)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy's: Ray ships classes and
    # functions of __main__ by value, each with its own copy of the globals they use, so
    # the ingress would not find the setup its __init__ kept.
    from serving import ray_app

    sys.exit(ray_app.main())
