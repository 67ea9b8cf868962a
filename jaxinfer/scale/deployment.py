"""The Ray Serve application: N `Replica`s, each a whole jaxinfer server
(engine thread and OpenAI app, as `jaxinfer serve` builds them), behind one
`Ingress` that takes the HTTP requests, hashes each prompt's first pages
and forwards the request through a deployment handle; the replicas'
`PrefixAffinityRouter` (`scale.router`) picks the replica.

    app = build(ReplicaSettings(config="configs/x.yaml", overrides=("max_num_seqs=8",)), replicas=2)
    serve.run(app, name="jaxinfer", route_prefix="/")      # HTTP through Ray Serve's proxy
    app = build(settings, replicas=2, listen=("0.0.0.0", 8000))   # ... or the ingress's own

Through Ray Serve's proxy a request takes two hops (proxy to ingress, ingress
to replica) and the ingress reads its body back from the proxy; with
`listen` the ingress is the HTTP server (uvicorn, as `jaxinfer serve`),
and the one hop left is the deployment handle's to the replica.

A replica runs each forwarded request through its server's own app
(`scale.asgi.call_app`), so routes, validation, errors and streaming are
`jaxinfer serve`'s; a streamed response passes through piece by piece.
Responses carry the header `x-jaxinfer-replica` (the replica's id); with
the prefix router, a request with that header runs on that replica only
(an admin route such as /pause for one replica), and answers 503 (code
"replica_not_found") where no live replica has that id (with router
"pow2", wherever it lands on another replica).

Failures: a replica whose engine thread stopped fails Ray's health check
(`Replica.check_health`) and Ray replaces it; Ray also restarts a replica
whose process died. A request in flight to a replica that dies answers
HTTP 503 (code "replica_failed"), or, when its stream had started, ends
with an error event and `data: [DONE]`; other requests go on, and new ones
go to the live replicas.
"""

# No `from __future__ import annotations` here: `serve.ingress` copies the ingress class, and
# FastAPI must see the route's annotations as classes (a string made `request` a query field).
import asyncio
import dataclasses
import json
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from ray import serve
from ray.serve.config import RequestRouterConfig

from jaxinfer.checkpoint.sources import resolve_model
from jaxinfer.config import GenerationConfig
from jaxinfer.progress import Progress
from jaxinfer.scale.asgi import AppLifespan, Head, call_app
from jaxinfer.scale.forward import REPLICA_HEADER, Forwarder
from jaxinfer.scale.prefix import PromptPages
from jaxinfer.scale.router import PrefixAffinityRouter
from jaxinfer.server.protocol import error_body
from jaxinfer.server.run import bind_socket, build_server
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import PYTHON_SOURCE, enable_compilation_cache, load_tokenizer
from jaxinfer.tokenizer.chat import with_chat_template

ROUTERS = ("prefix", "pow2")    # PrefixAffinityRouter; Ray's default (power of two choices)


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """What each replica serves: the `jaxinfer serve` config and flags.

    Attributes:
      config: the YAML config's path (None: defaults), at the same path on
        every node of the cluster; overrides: its key=value overrides.
      served_model_name: the model name clients pass (None: the config's model).
      api_key: when set, /v1/ routes need `Authorization: Bearer <key>`.
      max_request_bytes: largest request body, bytes.
    """

    config: Optional[str] = None
    overrides: tuple[str, ...] = ()
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    max_request_bytes: int = 1 << 20

    def generation_config(self):
        """The `GenerationConfig`. Raises what `GenerationConfig.load` raises."""
        return GenerationConfig.load(self.config, self.overrides)


class Replica:
    """One jaxinfer server in a Ray Serve replica: the model loaded and
    warmed up as `jaxinfer serve` does (`server.build_server`), its app's
    startup run on the replica's event loop."""

    async def __init__(self, settings: ReplicaSettings):
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.server = await asyncio.to_thread(self._build, settings)
        self.lifespan = AppLifespan(self.server.app)
        await self.lifespan.start()

    @staticmethod
    def _build(settings: ReplicaSettings):
        cfg = settings.generation_config()
        enable_compilation_cache()
        llm = LLM.from_config(cfg, progress=Progress(enabled=False))
        return build_server(llm, model_name=settings.served_model_name or cfg.model,
                            max_num_seqs=cfg.max_num_seqs,
                            max_waiting_requests=cfg.max_waiting_requests, defaults=cfg.sampling,
                            api_key=settings.api_key, max_request_bytes=settings.max_request_bytes,
                            warmup=cfg.warmup, long_prefill_chunk_size=cfg.long_prefill_chunk_size)

    async def handle_request(self, method: str, path: str, query: str,
                             headers: list[tuple[str, str]], body: bytes,
                             pinned: Optional[str] = None, **routing):
        """Run one HTTP request through the server's app; yields a `Head`
        (with `REPLICA_HEADER` added), then the body's pieces. A request
        `pinned` to another replica (the router found no live replica of
        that id) answers 503 instead. `routing` (the page hashes) was the
        router's."""
        if pinned is not None and pinned != self.replica_id:
            yield Head(503, [("content-type", "application/json")])
            yield json.dumps(error_body(f"no live replica {pinned!r}", "server_error",
                                        code="replica_not_found")).encode()
            return
        async for part in call_app(self.server.app, method, path, query, headers, body):
            if isinstance(part, Head):
                part = Head(part.status, part.headers + [(REPLICA_HEADER, self.replica_id)])
            yield part

    def check_health(self) -> None:
        """Ray's health check. Raises RuntimeError when the engine thread stopped."""
        if not self.server.engine.running:
            raise RuntimeError(f"replica {self.replica_id}: the engine thread is not running")

    async def __del__(self):
        if hasattr(self, "lifespan"):
            await self.lifespan.stop()


def router_tokenizer(cfg):
    """The model's tokenizer with the served chat template (None for a
    "python:" model, whose tokenizer comes only with its weights)."""
    if cfg.model.startswith(PYTHON_SOURCE):
        return None
    tokenizer = load_tokenizer(resolve_model(cfg.model))
    return with_chat_template(tokenizer, cfg.chat_template) if cfg.chat_template else tokenizer


ingress_app = FastAPI(title="jaxinfer replicas", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class Ingress:
    """Takes every HTTP request and forwards it to a replica
    (`scale.forward.Forwarder`): the prompt's page hashes go with it for
    the router. With `listen` (host, port), it also serves HTTP itself
    there, so a request skips Ray Serve's proxy and its hop to the ingress.

    Raises:
      ValueError: `listen` cannot be bound (naming the address).
    """

    async def __init__(self, replicas, settings: ReplicaSettings, max_pages: int = 32,
                       listen: Optional[tuple[str, int]] = None):
        cfg = settings.generation_config()
        self.forwarder = Forwarder(PromptPages(router_tokenizer(cfg), cfg.page_size, max_pages),
                                   replicas.options(stream=True).handle_request.remote)
        self.listener = None
        if listen is not None:
            sock = bind_socket(*listen)
            server = uvicorn.Server(uvicorn.Config(self.forwarder, lifespan="off", ws="none",
                                                   log_level="warning", access_log=False))
            self.listener = asyncio.ensure_future(server.serve(sockets=[sock]))

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, request: HTTPRequest):
        return await self.forwarder.respond(request)

    def check_health(self) -> None:
        """Ray's health check. Raises RuntimeError when the `listen` server stopped."""
        if self.listener is not None and self.listener.done():
            raise RuntimeError("the ingress's HTTP server stopped")


def build(settings: ReplicaSettings, replicas: int = 2, router: str = "prefix",
          replica_cpus: float = 1.0, replica_gpus: float = 0.0, max_ongoing_requests: Optional[int] = None,
          health_check_period_s: float = 10.0, max_pages: int = 32,
          listen: Optional[tuple[str, int]] = None):
    """The Ray Serve application (`serve.run` it) of `replicas` replicas of
    `settings` behind one ingress.

    Args:
      router: "prefix" (`PrefixAffinityRouter`) or "pow2" (Ray's default,
        power of two choices: for comparison).
      replica_cpus / replica_gpus: Ray resources each replica takes.
      max_ongoing_requests: requests one replica takes at once (None: the
        config's max_num_seqs plus max_waiting_requests); more wait in the router.
      health_check_period_s: how often Ray checks each replica, seconds.
      max_pages: prompt pages hashed for routing, at most.
      listen: (host, port) where the ingress serves HTTP itself, besides
        Ray Serve's proxy (None: only through the proxy); the ingress then
        runs on the cluster's head node, and binds it there.
    Raises:
      ValueError: replicas < 1, an unknown router, a bad config, tp or
        num_processes > 1 (before Ray starts anything).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    cfg = settings.generation_config()
    if cfg.tp > 1 or cfg.num_processes > 1:
        raise ValueError(f"each replica is one process at tp 1: tp={cfg.tp} and num_processes="
                         f"{cfg.num_processes} are not supported with replicas")
    if max_ongoing_requests is None:
        max_ongoing_requests = cfg.max_num_seqs + (cfg.max_waiting_requests or cfg.max_num_seqs)
    router_config = (RequestRouterConfig(request_router_class=PrefixAffinityRouter)
                     if router == "prefix" else RequestRouterConfig())
    replica = serve.deployment(Replica, name="JaxinferReplica").options(
        num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        health_check_period_s=health_check_period_s, request_router_config=router_config)
    # with `listen`, the ingress runs on the head node (Ray's resource naming it), where it listens
    placement = {"resources": {"node:__internal_head__": 0.001}} if listen is not None else {}
    ingress = serve.deployment(Ingress, name="JaxinferIngress").options(
        ray_actor_options={"num_cpus": 0, **placement},
        max_ongoing_requests=max(1000, replicas * max_ongoing_requests))
    return ingress.bind(replica.bind(settings), settings, max_pages, listen)
