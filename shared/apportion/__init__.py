"""apportion: budgeted, hierarchical fair-share GPU scheduling on Kafka.

The pure domain core lives in :mod:`apportion.domain` (budget tree, occupancy
windows, fair share, placement and preemption). :mod:`apportion.events` is the
event contract every service speaks; :mod:`apportion.topics` names the topics.
Adapters to Kafka and Redis live in :mod:`apportion.bus`.
"""

__version__ = "0.1.0"
