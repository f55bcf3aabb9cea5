# apportion developer commands. Python lives in .venv (made by `make venv`).
#
#   make run        the main job (starts the local stack first)
#   make test       everything CI runs: lint, then the unit, service, simulator and integration tiers (real Kafka, Redis)
#   make test-unit  the pure tier only
#   make lint       ruff, mypy, vulture and the documentation site (--strict)
#   make up / down  interactive stack in .run/: Kafka, Redis, the four services, the dashboard, SIM_NODES simulated
#                   nodes (BROKERS=3: a 3-node KRaft cluster, topics with 3 replicas and min.insync.replicas 2;
#                   SANDBOX_MEMORY_MB_PER_GPU=N: a job's memory limit per GPU, MiB)
#   make status     what of the interactive stack runs and answers (apportion stack status)
#   make infra-up   only Kafka + Redis in .run/ (addresses printed, also in .run/stack.env)
#   make mutate     mutation testing of the rule modules (score and survivors printed)
#   make chaos      the chaos campaign (kills, broker and Redis restarts, hostile records; ARGS="--quick")
#   make bench-slurm  Slurm 22.05 (Debian's, installed when missing) and the live stack side by side (ARGS="--jobs 2000")
#   make bench-rss  RSS of each service over a long run (ARGS="--duration-s 1200": the documented 20 minutes)
#   make gpu-check  the node agent on this machine's NVIDIA GPUs: inventory, utilisation, device isolation, idle
#   make docs       the documentation site in .run/site (MkDocs, --strict: broken links and orphan pages fail)
#   make bench      every bench/bench_*.py, with the figures against their targets
#   make clean      stop the stack, remove run artefacts, caches and the Kafka jars
#
# Prerequisites: Python 3.11+, Java 17+, Maven, redis-server (or root, to apt-get it).

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
RUN_DIR ?= .run
PYTEST_ARGS ?=
# two workers: the tests that need Kafka, Redis or the machine run in order on one (xdist group "serial",
# tests/conftest.py), the unit, service and simulator tiers beside them; PYTEST_XDIST= runs everything in one process
PYTEST_XDIST ?= -n 2 --dist loadgroup
SIM_NODES ?= 8
BROKERS ?= 1
SANDBOX_MEMORY_MB_PER_GPU ?=

.PHONY: help prereqs venv kafka-jars up down status infra-up lint docs test test-unit test-integration bench bench-slurm bench-rss gpu-check chaos chaos-test mutate run clean distclean

help:
	@sed -n 's/^#   //p' Makefile

# System packages the suite needs (redis-server, Java, Maven, chromium, node): installed when missing, as root.
prereqs:
	@infra/prereqs.sh

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required (PYTHON=... make venv)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

kafka-jars: infra/kafka/lib/.complete

infra/kafka/lib/.complete: infra/kafka/pom.xml
	infra/kafka/fetch.sh

up: venv kafka-jars
	$(VENV)/bin/apportion stack up --dir $(RUN_DIR) --sim-nodes $(SIM_NODES) --brokers $(BROKERS) \
	  $(if $(SANDBOX_MEMORY_MB_PER_GPU),--sandbox-memory-mb-per-gpu $(SANDBOX_MEMORY_MB_PER_GPU))

infra-up: venv kafka-jars
	$(PY) -m apportion.bus.stack up --dir $(RUN_DIR) --brokers $(BROKERS)

# Stops what `make up` or `make infra-up` started; without the venv, the scripts read the pid files.
# Without a venv, the shell does what `apportion stack down` does: stop the services, Kafka and Redis, remove
# RUN_DIR/stack.env, replace RUN_DIR/researcher/stack.env (when there is one) by the marker of a stopped stack
# (APPORTION_STACK_STOPPED, RUN_DIR: the other users' CLI then says no stack is running) and remove the per-user
# stack.env when it names this RUN_DIR.
down:
	@if [ -x $(VENV)/bin/apportion ]; then $(VENV)/bin/apportion stack down --dir $(RUN_DIR); else \
	  for f in $(RUN_DIR)/services/*.pid; do [ -f "$$f" ] && kill "$$(cat $$f)" 2>/dev/null; rm -f "$$f"; done; \
	  bash infra/kafka/stop.sh $(RUN_DIR)/kafka; bash infra/redis/stop.sh $(RUN_DIR)/redis; rm -f $(RUN_DIR)/stack.env; \
	  if dir="$$(cd '$(RUN_DIR)' 2>/dev/null && pwd -P)"; then \
	    m="$$dir/researcher/stack.env"; \
	    if [ -f "$$m" ]; then \
	      printf 'APPORTION_STACK_STOPPED=%s\nRUN_DIR=%s\n' "$$(date -u +%Y-%m-%dT%H:%M:%S+00:00)" "$$dir" >"$$m.tmp" \
	        && chmod 644 "$$m.tmp" && mv -f "$$m.tmp" "$$m"; fi; \
	    u="$${XDG_STATE_HOME:-$$HOME/.local/state}/apportion/stack.env"; \
	    if grep -qxF "RUN_DIR=$$dir" "$$u" 2>/dev/null; then rm -f "$$u"; fi; \
	  fi; fi

status: venv
	$(VENV)/bin/apportion stack status --dir $(RUN_DIR)

# Static checks: lint and format (ruff), types (mypy on shared, services, bench, tests and tools; strict on the
# domain), dead code (vulture), the documentation site (mkdocs --strict). `make test` runs them first.
LINT_PATHS := shared services tests bench infra tools
# dead code (vulture): tests count as users, their own pytest-style names are not reported; names used only by
# decorators, pydantic or the event contract are not dead
VULTURE_ARGS := --ignore-decorators "@*.command,@app.callback,@model_validator,@field_validator,@property,@*.agent" \
	--ignore-names "model_config,_*_" --exclude "shared/apportion/events.py"
lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy shared services bench tests tools
	@out="$$($(VENV)/bin/vulture $(LINT_PATHS) tests/vulture_whitelist.py $(VULTURE_ARGS) | grep -v '^tests/')"; \
	if [ -n "$$out" ]; then echo "$$out"; echo "dead code (vulture): remove it, or name it in tests/vulture_whitelist.py"; exit 1; fi; \
	echo "vulture: no dead code outside tests/"
	@$(MAKE) --no-print-directory docs

# The site's reference pages (CLI, events, configuration) are generated at build time by tools/docs_hooks.py.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# pytest exit 5 means "no tests collected": reported, not a failure.
test: prereqs venv lint
	@$(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

test-unit: venv
	@$(PY) -m pytest tests/unit $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

test-integration: venv
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

bench: venv
	$(PY) bench/run_all.py

# Slurm and the live stack on the same jobs, alternated (docs/performance.md): placements/s, time to the last start,
# CPU per 1,000 jobs by component. Installs Slurm from Debian's packages when missing (root). Not part of `make test`.
# Options: make bench-slurm ARGS="--jobs 2000 --nodes 251 --rounds 3 --json"
bench-slurm: venv kafka-jars
	$(PY) bench/slurm_side_by_side.py $(ARGS)

# Resident memory per service over a long steady run, slope and growth over the second half (docs/reliability.md);
# `make bench` runs it too, at its default 300 s. Options: ARGS="--duration-s 1200 --trace dispatcher"
bench-rss: venv kafka-jars
	$(PY) bench/bench_rss.py $(ARGS)

# The node agent against NVML, one verdict line per check (docs/security.md, "Node boundary"); run it as root on a
# GPU node. Without an NVIDIA GPU it prints "SKIP: no NVIDIA GPU" lines and exits 0.
gpu-check: venv
	$(PY) bench/gpu_check.py

# Chaos campaign on its own local stack (docs/reliability.md): exits non-zero when a figure of its last line is off.
# Options: make chaos ARGS="--seed 3 --jobs 500 --kills 20 --hostile 10000" (defaults), ARGS="--quick" (short)
chaos: venv kafka-jars
	$(PY) bench/chaos.py $(ARGS)

# The short seeded campaign as a test alone (about 2 min on the loaded 2-core machine; `make test` runs it too).
chaos-test: venv kafka-jars
	$(PY) -m pytest tests/chaos -p no:cacheprovider --override-ini addopts=-ra

# Mutation testing of the rule modules (fair share, occupancy, preemption rule); scratch copies, not the tree.
# Options: make mutate ARGS="--only fairshare --jobs 2 --keep /tmp/mut"
mutate: venv
	$(PY) -m pip install -q -e '.[mutate]'
	$(PY) bench/mutate.py $(ARGS)

# The main job starts (and stops) its own Kafka and Redis unless KAFKA_BOOTSTRAP/REDIS_URL are set.
# Options: make run ARGS="--slice week44 --time-scale 1440" (see: .venv/bin/python tools/demo.py --help)
run: venv kafka-jars
	$(PY) tools/demo.py $(ARGS)

clean: down
	rm -rf $(RUN_DIR) .pytest_cache .hypothesis out build dist infra/kafka/lib infra/kafka/target
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) *.egg-info
