"""Starting the replicas: `jaxinfer serve --replicas N` (`serve_replicas`)
and Ray's own command (`app`, an application builder):

    jaxinfer serve --config configs/smollm2-135m-instruct.yaml --replicas 2 [--port 8000] [key=value ...]
    serve run jaxinfer.scale.run:app config=configs/smollm2-135m-instruct.yaml replicas=2 [key=value ...]

Both run the application of `scale.deployment.build` on the Ray cluster at
$RAY_ADDRESS (Ray's variable), else on a new local one, with the OpenAI
routes at /v1: `jaxinfer serve` has the ingress serve HTTP on host:port
itself (no Ray Serve proxy); `serve run` answers through Ray Serve's proxy
(its port, 8000 by default) and, given `listen=host:port`, at that address
through the ingress too, one hop shorter.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Mapping, Optional

import ray
from ray import serve

from jaxinfer.scale.deployment import ReplicaSettings, build

APP_NAME = "jaxinfer"
# `serve run` arguments that are the application's, not config keys (those are overrides)
APP_ARGS = {"config": str, "replicas": int, "router": str, "replica_cpus": float,
            "replica_gpus": float, "max_ongoing_requests": int, "served_model_name": str,
            "api_key": str, "max_request_bytes": int, "max_pages": int, "listen": str}


def app(args: Mapping[str, str]):
    """`serve run jaxinfer.scale.run:app key=value ...`: the application of
    `build`; keys of `APP_ARGS` are its arguments (config: the YAML path;
    listen: host:port where the ingress serves HTTP too), every other
    key=value is a config override.

    Raises:
      ValueError: a value of the wrong type, a listen that is not host:port,
        or what `build` raises.
    """
    options, overrides = {}, []
    for key, value in args.items():
        if key in APP_ARGS:
            try:
                options[key] = APP_ARGS[key](value)
            except ValueError:
                raise ValueError(f"{key}={value!r}: expected {APP_ARGS[key].__name__}") from None
        else:
            overrides.append(f"{key}={value}")
    if "listen" in options:
        host, _, port = options["listen"].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen={options['listen']!r}: expected host:port")
        options["listen"] = (host, int(port))
    config = options.pop("config", None)
    settings = ReplicaSettings(
        config=os.path.abspath(config) if config else None, overrides=tuple(overrides),
        served_model_name=options.pop("served_model_name", None),
        api_key=options.pop("api_key", None),
        max_request_bytes=options.pop("max_request_bytes", 1 << 20))
    return build(settings, **options)


def serve_replicas(settings: ReplicaSettings, *, replicas: int, host: str, port: int,
                   router: str = "prefix", replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                   log: Callable[[str], None] = lambda msg: None,
                   stop: Optional[threading.Event] = None) -> None:
    """Run the application until SIGINT or SIGTERM (or `stop` is set), then
    shut Ray Serve down. Blocks while the replicas load (`serve.run`). The
    ingress serves HTTP at host:port itself (`build`'s `listen`); Ray Serve's
    proxy is not started.

    Raises:
      ValueError: what `build` raises, before Ray starts.
    """
    application = build(settings, replicas=replicas, router=router, replica_cpus=replica_cpus,
                        replica_gpus=replica_gpus, listen=(host, port))
    stop = stop or threading.Event()
    ray.init(ignore_reinit_error=True)
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda *_: stop.set())
    try:
        serve.start(proxy_location="Disabled")
        log(f"starting {replicas} replicas (router {router})")
        serve.run(application, name=APP_NAME, route_prefix="/")
        log(f"serving at http://{host}:{port}/v1 ({replicas} replicas, router {router})")
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
