"""The schedulers a lab would pick instead of ours, re-implemented on the engine's primitives (rule D7.baselines).

* :mod:`~apportion.sim.peers.slurm`: multifactor priority with Fair Tree, decayed usage, QOS preemption.
* :mod:`~apportion.sim.peers.kueue`: Kueue fair sharing (share values, borrowing, preemption strategies).
* :mod:`~apportion.sim.peers.kai`: KAI Scheduler's fair share with time-aware fairness and reclaim.

Each module's docstring cites the documentation it follows, the formulas, and what was simplified.
"""
