"""The test kit: what tests of every tier share. Fixtures stay in ``tests/conftest.py`` (pytest reads it there).

- ``audit_history``: a short simulated log (budgets, decisions, accounting snapshots) for the audit tests, and
  ``export`` (a log written as an export file under a topic namespace).
- ``builders``: domain events in one line each, at domain time relative to ``T0`` (``placed``, ``submitted``,
  ``node``, ``budget_set``, ``h``/``m``/``s``).
- ``forecast_history``: ``History``, a dispatcher fed by hand (nodes, submissions, ticks) for forecasts.
- ``fakes``: kafka-python-like records (``Rec``, ``records``, ``log_record``) and a transactional ``FakeRedis``.
- ``domain_dispatch``: given/when/then for the pure dispatcher: ``TREE``, ``CFG``, ``given`` (a state folded from
  a history), ``reg`` (a node registration) and ``types`` (emitted events as ``type:id``); ``REC``, ``_running`` and ``hb`` for
  heartbeat reconciliation.
- ``dispatcher``: the dispatcher service without Kafka: an in-memory log (``ListLog``), ``service``, ``drive``,
  ``submit`` and a short ``history``.
- ``simkit``: seeded simulator scenarios as compact event lines (``at``, ``job``, ``nodes``, ``run``,
  ``decisions``).
- ``reference_cycle``: the slow, literal placement and preemption cycle the fast one is compared with.
- ``narrowing``: ``narrow``/``narrow_each``, a value checked to be of one kind and typed as it for mypy.
- ``signing``: deterministic signing identities, node keys and their registration events.
- ``environment``: the variables every test must leave as it found them (``watched``), the difference
  (``changes``, ``leak_message``) and ``restore``, for the autouse ``environment_unchanged``.
- ``infra``: ``KafkaCluster``, what the ``kafka_cluster`` fixture yields (its stack and client environment).
- ``livestack``: ``apportion stack up`` on the test Kafka and Redis (``live_stack``), a CLI bound to it
  (``Stack``) and the bounded poller ``until``.
- ``node_boundary``: throwaway Unix accounts, a directory job accounts can reach, fake GPUs, job scripts.
- ``checkpoint_workload``: the real workload of the checkpoint tests, as the text of a script.
- ``fixtures/events``: golden JSON of every event type and schema version (``fixtures/make_golden.py`` writes
  them).
- ``cli``: the command line with no stack (``no_stack``, its autouse fixture ``stackless``, ``run``).
- ``engine_world``: ``World``, a fluent cluster and queue for one scheduling cycle over ``TREE`` at ``NOW``, and
  ``placed``/``preempted``; ``goodput_world``: the same world over ``AB`` for the goodput rules, with ``explained``.
- ``preemption``: the preemption rules' inputs: ``view`` (a fair-share queue set by ratios) and ``run_of``.
- ``sim_worlds``: random clusters and job streams (``worlds``) and the decision log check ``check_log``.
- ``occupancy_logs``: random plausible occupancy logs (``event_logs``) over the window ``PROP_W``.
- ``signed_requests``: ``ALICE``'s ``submission`` and its ``queued``; ``dispatcher_identity``: the dispatcher's
  signed requests (``setup``, ``sub``, ``cancel``, ``CAROL``, ``EVE``); ``node_reports``: ``reg_node``, ``log_of``.
- ``audit_replay``: a two-leaf lab (``lab``, ``submission``, ``at``) for re-running decisions.
- ``node_agent``: the node agent's ``Sink`` and the bounded ``until``.
- ``queue_rows``: rows of ``apportion queue --json``; ``broker_config``: the container broker configuration
  rendered and checked (``render``, ``assert_secured``).
- ``live_cluster``: the four services in-process on real Kafka and Redis (``running_cluster``, the ``cluster``
  fixture, ``Cluster``, ``of_job``); ``principals``: clients signed in as one principal (``producer_as``,
  ``as_user``, ``end_offset``).
- ``browser``: chromium and chromedriver found on ``PATH`` (``require_browser``) for the dashboard tests.
- ``kafka_clients``: ``closing_kafka_clients``, a block whose kafka-python clients are all closed at its end, those
  whose constructor failed to bootstrap too (their network thread would run on).
"""
