"""Replicas of the jaxinfer server on Ray Serve, with prefix-aware routing.
Needs the `ray` extra (`pip install -e ".[ray]"`: ray[serve]); nothing
else in jaxinfer imports this package, so Ray is imported only when the
replicas are used.

    jaxinfer serve --config configs/smollm2-135m-instruct.yaml --replicas 2
    serve run jaxinfer.scale.run:app config=configs/smollm2-135m-instruct.yaml replicas=2

Modules: `prefix` (a prompt's page hashes as the router computes them,
and which replica was sent which pages; no Ray), `asgi` (a request
through the server's app in-process, streamed; no Ray), `forward` (the
ingress's forwarding of a request to a replica and its response back; no
Ray), `router` (the Ray Serve request router), `deployment` (the replica
and ingress deployments, `build`), `run` (the commands). See
docs/scaling.md.
"""
