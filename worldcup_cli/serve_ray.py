"""``worldcup serve-ray``: the service on Ray Serve, from ``deploy/ray/serve.yaml``.

Ray and Serve are imported only when the command runs (the ``serve-ray`` extra).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer


def fail(message: str) -> NoReturn:
    """One line, exit code 2: the CLI's contract for bad input (as worldcup_cli.main's)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def serve_ray(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="A Serve config. Default: deploy/ray/serve.yaml."),
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="A running Ray cluster (host:port of its GCS, or 'auto'). Default: start "
            "Ray here, with this shell's WORLDCUP_* variables for the replicas.",
        ),
    ] = None,
    cpu: Annotated[
        float | None,
        typer.Option(
            "--cpu",
            help="No GPUs: each replica runs the HF engine on this many CPUs (e.g. 1).",
            min=0.01,
        ),
    ] = None,
    replicas: Annotated[
        str | None,
        typer.Option("--replicas", help="MIN:MAX for the autoscaler (e.g. 1:2)."),
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help="The Serve proxy's port.")] = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach", help="Return once it runs (the cluster keeps serving); needs --address."
        ),
    ] = False,
) -> None:
    """Run the service on Ray Serve: replicas that scale, heal and share one Redis."""
    try:
        import ray
        from ray import serve

        from app import serve as ray_app
    except ImportError as exc:
        fail(f"Ray Serve is not installed ({exc.name}): pip install 'worldcup[serve-ray]'")
    if detach and address is None:
        fail("--detach needs --address: a Ray started here stops with this command")
    try:
        bounds = None if replicas is None else tuple(int(n) for n in replicas.split(":"))
    except ValueError:
        bounds = ()
    if bounds is not None and (len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]):
        fail(f"--replicas {replicas!r}: give MIN:MAX with 1 <= MIN <= MAX")
    if address is None:  # the replicas inherit this environment: check it here first
        from pydantic import ValidationError

        from app.core.config import Settings

        try:
            ray_app.check_replica_settings(Settings())
        except (ValidationError, ray_app.ReplicaConfigError) as exc:
            fail(f"the replicas could not start: {exc}")
        os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", ray_app.PROXY_CALLBACK)
    path = config or ray_app.CONFIG
    if not path.is_file():
        fail(f"no Serve config at {path}: pass --config (deploy/ray/serve.yaml in the source)")
    spec = ray_app.load_config(path)
    ray_app.override(
        spec,
        cpus_per_replica=cpu,
        engine="hf" if cpu is not None else None,
        replicas=bounds,
        http_port=port,
    )
    if ray_app.on_loopback(address):  # Ray on this machine: its traffic on loopback
        ray_app.pin_loopback()
    ray.init(address=address, namespace="serve")
    typer.echo("deploying (each replica loads its model: this takes a while)...", err=True)
    ray_app.deploy(spec)
    http = spec.get("http_options", {})
    typer.echo(f"WorldCup on Ray Serve: http://{http.get('host', '127.0.0.1')}:{http.get('port')}")
    if detach:
        return
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        typer.echo("shutting down (replicas drain their requests)...", err=True)
        serve.shutdown()
