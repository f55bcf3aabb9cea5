"""Rows of ``apportion queue --json`` as the table renders them: ``ROWS``, a running two-node gang and a pending
job with its ``REASON``."""

from __future__ import annotations

from typing import Any

REASON = "budget_ahead: lab/vision (r 0.42) is served before lab/nlp (r 0.61)"
ROWS: list[dict[str, Any]] = [
    {
        "position": None,
        "job_id": "train-llm-7b-0042",
        "budget": "lab/vision/detect",
        "user": "carol",
        "replicas": 2,
        "gpus_per_replica": 8,
        "min_runtime_s": 7200,
        "state": "running",
        "attempt": 1,
        "started_at": "2026-12-03T15:01:22+00:00",
        "nodes": ["node-1", "node-2"],
    },
    {
        "position": 12,
        "job_id": "sweep-17",
        "budget": "lab/nlp",
        "user": "dave",
        "replicas": 1,
        "gpus_per_replica": 1,
        "min_runtime_s": 600,
        "state": "pending",
        "attempt": 0,
        "started_at": None,
        "reason": REASON,
    },
]
