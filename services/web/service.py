"""The dashboard without a server: one method per page, rendered from :class:`~services.web.store.Sources`.

Read-only: every page is a GET, nothing is published or written. Pages (:meth:`Dashboard.pages`):

==========================  ==========================================================================
``/``                       the budget tree: share, abs share, O, U, E (GPU-h), r, rank (``apportion share``)
``/budget?path=P``          one budget's row and its occupancy share against its share over the window
``/queue?user=U``           live jobs, running first, pending by position, with pending reasons (``user``: "my jobs")
``/history?user=U&budget=B``  every job of the log, newest first: state, wait, run time, GPU-h, reason
``/job/{job_id}``           the timeline ``apportion audit explain`` builds, each decision re-run
``/nodes``                  nodes with state, reason, model, free/total GPUs, running, heartbeat age
``/simulate``               the comparison of each ``--simulate-json`` file given at start
``/metrics``                the dashboard process's own Prometheus metrics
``/healthz``                ``ok`` (no Redis or Kafka read)
``/ready``                  200 when Kafka and Redis answer now, else 503 (JSON: each one's state)
==========================  ==========================================================================

Every number shown carries ``data-field`` and ``data-value`` attributes holding the exact value the CLI's
``--json`` prints (the browser tests compare them). A read that raises :class:`~services.web.store.Unavailable`
renders the 503 error page. Pages are plain methods: Starlette runs them in its thread pool, so the blocking
Redis and Kafka reads do not stall the server. :func:`services.web.app.create_app` routes them; service tests drive them through Starlette's test client with fake sources.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from apportion.settings import topic_prefix
from services.web import logic
from services.web.config import WebSettings
from services.web.store import Sources, Unavailable, load_simulations

TEMPLATES = Path(__file__).parent / "templates"


def templates() -> Any:
    """The Jinja2 environment of the pages (HTML autoescaped) with the filters they format numbers with:
    ``value`` (the exact ``data-value``), ``ratio`` (the share table's r), ``gpu_h``, ``duration``, ``when``
    (UTC to the second), ``pct`` (one decimal) and ``num`` (``d`` decimals, ``-`` for none)."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    from apportion.cli.common import _ratio  # the share table's r format, so page and table read alike
    from apportion.durations import format_duration

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
    return env


class Dashboard:
    """The pages, each ``page(request) -> Response``.

    Args:
        settings: the dashboard's settings (``simulate_json`` files are read once, here).
        sources: where the numbers come from (:class:`~services.web.store.Sources`, or a fake).
        readiness: what ``/ready`` answers (:class:`apportion.bus.resilience.Readiness`).
        principal: the Kafka principal shown in the header (``web`` under ``stack up``; ``""``: none).
    """

    def __init__(self, settings: WebSettings, sources: Sources, readiness: Any, principal: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter

        from apportion.metrics import add_process_collectors

        self.sources, self.readiness, self.principal = sources, readiness, principal
        self.sims = load_simulations(settings.simulate_json)
        self.env = templates()
        self.registry = CollectorRegistry()
        add_process_collectors(self.registry)
        self.served = Counter(
            "apportion_web_requests", "Pages served, by page and status", ["page", "status"], registry=self.registry
        )

    def pages(self) -> list[tuple[str, Callable[[Any], Any]]]:
        """``(route path, page)`` of every page, in the order of the module's table."""
        return [
            ("/", self.tree),
            ("/budget", self.budget),
            ("/queue", self.queue),
            ("/history", self.history),
            ("/job/{job_id:path}", self.job),
            ("/nodes", self.nodes),
            ("/simulate", self.simulate),
            ("/metrics", self.metrics),
            ("/healthz", self.healthz),
            ("/ready", self.ready),
        ]

    def render(self, request: Any, page: str, name: str, status: int = 200, **ctx: Any) -> Any:
        """Template ``name`` with ``ctx``; one that reads an unavailable source becomes the 503 error page."""
        from starlette.responses import HTMLResponse

        common = {"request": request, "page": page, "principal": self.principal}
        try:
            body = self.env.get_template(name).render(namespace=topic_prefix(), **common, **ctx)
        except Unavailable as exc:
            body = self.env.get_template("error.html").render(message=str(exc), **common)
            status = 503
        self.served.labels(page, str(status)).inc()
        return HTMLResponse(body, status_code=status)

    def lazy(self, request: Any, page: str, name: str, ctx: Callable[[], dict[str, Any]]) -> Any:
        """Render ``name`` with ``ctx()``; an :class:`Unavailable` read becomes the 503 error page."""
        try:
            values = ctx()
        except Unavailable as exc:
            return self.render(request, page, "error.html", status=503, message=str(exc))
        return self.render(request, page, name, **values)

    def tree(self, request: Any) -> Any:
        """``/``: the budget tree in path order."""

        def rows() -> dict[str, Any]:
            data = self.sources.share()
            return {"meta": data["meta"], "rows": logic.tree_rows(data["budgets"])}

        return self.lazy(request, "tree", "tree.html", rows)

    def budget(self, request: Any) -> Any:
        """``/budget?path=P``: the budget's row and its occupancy share over the window (SVG)."""
        from services.web.plots import budget_svg

        path = request.query_params.get("path", "")

        def ctx() -> dict[str, Any]:
            data = self.sources.share()
            row = next((b for b in data["budgets"] if b.get("path") == path), None)
            series = logic.share_series(self.sources.snapshots(), path)
            return {"path": path, "row": row, "meta": data["meta"], "svg": budget_svg(series), "series": series}

        return self.lazy(request, "budget", "budget.html", ctx)

    def queue(self, request: Any) -> Any:
        """``/queue``: live jobs with pending reasons; ``?user=U`` only that user's."""
        user = request.query_params.get("user", "")
        return self.lazy(
            request, "queue", "queue.html", lambda: {"rows": logic.for_user(self.sources.queue(), user), "user": user}
        )

    def history(self, request: Any) -> Any:
        """``/history``: every job the log tells, newest first; ``?user=U``, ``?budget=B`` filter it."""
        user, budget = request.query_params.get("user", ""), request.query_params.get("budget", "")

        def ctx() -> dict[str, Any]:
            rows = logic.history_rows(self.sources.history(), user=user, budget=budget)
            return {"rows": rows, "user": user, "budget": budget}

        return self.lazy(request, "history", "history.html", ctx)

    def job(self, request: Any) -> Any:
        """``/job/{job_id}``: the explained timeline; 404 for a job the log does not name."""
        job_id = request.path_params["job_id"]
        try:
            ex = self.sources.explain(job_id)
            row = next((j for j in self.sources.queue() if j.get("job_id") == job_id), None)
        except Unavailable as exc:
            return self.render(request, "job", "error.html", status=503, message=str(exc))
        return self.render(request, "job", "job.html", status=200 if ex.found else 404, job_id=job_id, ex=ex, row=row)

    def nodes(self, request: Any) -> Any:
        """``/nodes``: the nodes and the free/total GPUs."""

        def ctx() -> dict[str, Any]:
            rows = self.sources.nodes()
            free, total = logic.gpu_totals(rows)
            return {"rows": rows, "free": free, "total": total}

        return self.lazy(request, "nodes", "nodes.html", ctx)

    def simulate(self, request: Any) -> Any:
        """``/simulate``: each ``--simulate-json`` file with its plots."""
        from services.web.plots import simulate_svgs

        shown = [dict(s, svgs=simulate_svgs(s["doc"])) if "doc" in s else s for s in self.sims]
        return self.render(request, "simulate", "simulate.html", sims=shown)

    def metrics(self, request: Any) -> Any:
        """``/metrics``: this process's Prometheus metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def healthz(self, request: Any) -> Any:
        """``/healthz``: ``ok`` while the process serves."""
        from starlette.responses import PlainTextResponse

        return PlainTextResponse("ok")

    def ready(self, request: Any) -> Any:
        """``/ready``: 200 when Kafka and Redis answer now, else 503, with each one's state."""
        from starlette.responses import Response

        ok, details = self.readiness.check()
        return Response(json.dumps({"ready": ok, **details}) + "\n", 200 if ok else 503, media_type="application/json")
