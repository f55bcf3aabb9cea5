"""Web dashboard wiring: Starlette routes, Jinja2 templates rendered on the server, uvicorn.

Read-only: every route is a GET, nothing is published or written. Pages:

==========================  ==========================================================================
``/``                       the budget tree: share, abs share, O, U, E (GPU-h), r, rank (``apportion share``)
``/budget?path=P``          one budget's row and its occupancy share against its share over the window
``/queue``                  live jobs, running first, pending by position, with pending reasons
``/job/{job_id}``           the timeline ``apportion audit explain`` builds, each decision re-run
``/nodes``                  nodes with state, reason, model, free/total GPUs, running, heartbeat age
``/simulate``               the comparison of each ``--simulate-json`` file given at start
``/metrics``                the dashboard process's own Prometheus metrics
``/healthz``                ``ok`` (no Redis or Kafka read)
``/ready``                  200 when Kafka and Redis answer now, else 503 (JSON: each one's state)
==========================  ==========================================================================

Every number shown carries ``data-field`` and ``data-value`` attributes holding the exact value the CLI's
``--json`` prints (the browser tests compare them). Endpoints are plain functions: Starlette runs them in
its thread pool, so the blocking Redis and Kafka reads do not stall the server.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from services.web import logic
from services.web.config import WebSettings
from services.web.store import Sources, Unavailable, load_simulations

log = logging.getLogger("apportion.web")

TEMPLATES = Path(__file__).parent / "templates"


def create_app(settings: WebSettings, sources: Sources | None = None) -> Any:
    """The Starlette application (routes above) reading ``sources`` (default: the settings' stack)."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, PlainTextResponse, Response
    from starlette.routing import Route

    from apportion import topics
    from apportion.bus.resilience import readiness_for
    from apportion.cli.main import _ratio  # the share table's r format, so page and table read alike
    from apportion.durations import format_duration
    from apportion.metrics import add_process_collectors

    src = sources or Sources(settings.connection(), settings.log_cache_s)
    # nothing of its own to catch up: ready whenever Kafka and Redis answer (probed at each /ready)
    conn = getattr(src, "conn", None)  # sources without a connection (tests): nothing to probe
    readiness = readiness_for(conn.bootstrap, conn.redis_url) if conn is not None else readiness_for()
    readiness.set(True)
    sims = load_simulations(settings.simulate_json)
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
    env.filters.update(
        value=logic.data_value,
        ratio=_ratio,
        gpu_h=logic.fmt_gpu_h,
        duration=lambda s: format_duration(float(s or 0.0)),
        when=lambda t: str(t)[:19].replace("T", " ") if t else "-",
        pct=lambda v: f"{100 * float(v or 0.0):.1f}%",
        num=lambda v, d=3: "-" if v is None else f"{float(v):.{d}f}",
    )
    from apportion.bus.security import kafka_auth

    principal = kafka_auth().get("sasl_plain_username", "")  # shown in the header: `web` under `stack up`
    registry = CollectorRegistry()
    add_process_collectors(registry)
    pages = Counter("apportion_web_requests", "Pages served, by page and status", ["page", "status"], registry=registry)

    def render(request: Request, page: str, name: str, status: int = 200, **ctx: Any) -> Response:
        try:
            body = env.get_template(name).render(
                request=request, page=page, namespace=topics.prefix(), principal=principal, **ctx
            )
        except Unavailable as exc:
            body = env.get_template("error.html").render(
                request=request, page=page, message=str(exc), principal=principal
            )
            status = 503
        pages.labels(page, str(status)).inc()
        return HTMLResponse(body, status_code=status)

    def tree(request: Request) -> Response:
        def rows() -> dict[str, Any]:
            data = src.share()
            return {"meta": data["meta"], "rows": logic.tree_rows(data["budgets"])}

        return _lazy(render, request, "tree", "tree.html", rows)

    def budget(request: Request) -> Response:
        path = request.query_params.get("path", "")

        def ctx() -> dict[str, Any]:
            data = src.share()
            row = next((b for b in data["budgets"] if b.get("path") == path), None)
            series = logic.share_series(src.snapshots(), path)
            from services.web.plots import budget_svg

            return {"path": path, "row": row, "meta": data["meta"], "svg": budget_svg(series), "series": series}

        return _lazy(render, request, "budget", "budget.html", ctx)

    def queue(request: Request) -> Response:
        return _lazy(render, request, "queue", "queue.html", lambda: {"rows": src.queue()})

    def job(request: Request) -> Response:
        job_id = request.path_params["job_id"]

        def ctx() -> dict[str, Any]:
            ex = src.explain(job_id)
            row = next((j for j in src.queue() if j.get("job_id") == job_id), None)
            return {"job_id": job_id, "ex": ex, "row": row}

        try:
            values = ctx()
        except Unavailable as exc:
            return render(request, "job", "error.html", status=503, message=str(exc))
        return render(request, "job", "job.html", status=200 if values["ex"].found else 404, **values)

    def nodes(request: Request) -> Response:
        def ctx() -> dict[str, Any]:
            rows = src.nodes()
            free, total = logic.gpu_totals(rows)
            return {"rows": rows, "free": free, "total": total}

        return _lazy(render, request, "nodes", "nodes.html", ctx)

    def simulate(request: Request) -> Response:
        from services.web.plots import simulate_svgs

        shown = [dict(s, svgs=simulate_svgs(s["doc"])) if "doc" in s else s for s in sims]
        return render(request, "simulate", "simulate.html", sims=shown)

    def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    def ready(request: Request) -> Response:
        ok, details = readiness.check()
        return Response(json.dumps({"ready": ok, **details}) + "\n", 200 if ok else 503, media_type="application/json")

    routes = [
        Route("/", tree),
        Route("/budget", budget),
        Route("/queue", queue),
        Route("/job/{job_id:path}", job),
        Route("/nodes", nodes),
        Route("/simulate", simulate),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/ready", ready),
    ]
    app = Starlette(routes=routes)
    app.state.sources = src
    app.state.readiness = readiness
    return app


def _lazy(render: Any, request: Any, page: str, name: str, ctx: Any) -> Any:
    """Render ``name`` with ``ctx()``; an :class:`Unavailable` read becomes the 503 error page."""
    try:
        values = ctx()
    except Unavailable as exc:
        return render(request, page, "error.html", status=503, message=str(exc))
    return render(request, page, name, **values)


def serve(settings: WebSettings) -> None:
    """Run the dashboard with uvicorn until SIGTERM/SIGINT (JSON logs like every service)."""
    import uvicorn

    from apportion.bus.service import setup_logging

    setup_logging("web", settings.log_level, settings.log_json)
    app = create_app(settings)
    log.info(
        "dashboard on http://%s:%d/ (Kafka %s, Redis %s)",
        settings.web_host,
        settings.web_port,
        app.state.sources.conn.bootstrap,
        app.state.sources.conn.redis_url,
    )
    # pages answer 503 while a source is down; say so once at start, with a line per try, and never exit
    threading.Thread(target=_wait_logged, args=(app.state.readiness,), name="wait-sources", daemon=True).start()
    try:
        uvicorn.run(app, host=settings.web_host, port=settings.web_port, log_config=None, access_log=False)
    finally:
        app.state.sources.close()


def _wait_logged(readiness: Any) -> None:
    """Log ``waiting for Kafka/Redis at ...`` with backoff until both answer (a thread beside the server)."""
    import asyncio

    from apportion.bus.resilience import wait_reachable

    if asyncio.run(wait_reachable(readiness, asyncio.Event())):
        readiness.set(True)
