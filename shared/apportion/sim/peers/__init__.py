"""The schedulers a lab would pick instead of ours, re-implemented on the engine's primitives (DESIGN section 7).

* :mod:`~apportion.sim.peers.slurm`: multifactor priority with Fair Tree, decayed usage, QOS preemption.
* :mod:`~apportion.sim.peers.kueue`: Kueue fair sharing (share values, borrowing, preemption strategies).
* :mod:`~apportion.sim.peers.kai`: KAI Scheduler's fair share with time-aware fairness and reclaim.

Each module's docstring cites the documentation it follows, the formulas, and what was simplified.
"""

# The registry (apportion.sim.baselines.POLICIES) holds one instance of each peer and the peers use the
# baselines' shape helpers: load it first, so that importing a peer module directly finds both complete.
import apportion.sim.baselines  # noqa: E402, F401
