"""Names the dead-code check (vulture, in `make lint`) must not report: used by libraries or read as data.

Vulture matches names, so each line below uses one attribute that no code of ours reads but something else
does. Not imported by anything; only vulture reads this file.
"""

from typing import Any

used: Any = object()  # Any: the attributes below are names for vulture, never looked up
used._dumps  # faust calls its codec's _dumps/_loads (bus/faust_app.EventCodec)
used._loads
used.apply_failed  # bus/intake.IntakeStats: a counter, logged and read by the metrics
used.startup_report  # bus/stack.LocalStack: shown to operators
used.job_budget  # sim/core.SimResult: part of the result scripts read
used.description  # topics.Topic: documentation of the registry
used.closed  # gpu.FakeGpuProbe: the test double records close() (no test reads it since test_occupancy dropped a same-named dict)
used.log_message  # http.server calls it for each request (the metrics endpoint silences it: bus/service)
used.daemon_threads  # socketserver reads it (request threads do not hold the process at exit)
used.on_files  # mkdocs calls its hooks by name (tools/docs_hooks.py)
used.HAS_RICH  # typer reads it when it formats help (tools/docs_hooks.cli_page: plain text)
used.metavar  # click reads a parameter's metavar when it formats help (cli/common.readable_help blanks it for flags)
used.rich_markup_mode  # typer reads a command's when it formats help (cli/common.readable_help: click's plain layout)
used._width  # rich reads a console's fixed size (cli/common._Console keeps the size of the start)
used._height
used.deadletter  # cli/main.COMMANDS names each command's function; load_command looks it up by that name
used.schemas_
used.undrain
