"""The replica check (:class:`ReplicaGuard`).

Ranks that hold copies of the same parameters (data-parallel replicas) hold equal ones.
"""
