"""The engine: what every rank agrees to run, and in what order.

A user's collective becomes a request (:mod:`.submission`) on a coordinator's queue
(:mod:`.request_queue`). The coordinator of each process set (:mod:`.coordinator`) runs cycles: it
negotiates with the other ranks which requests are ready everywhere (:mod:`.negotiation`, in steady
state one bit per known collective through :mod:`.response_cache`), groups ready allreduces into
fusion buffers (:mod:`.fusion`), and runs the agreed responses on this rank (:mod:`.execution`),
through the executors of :mod:`gradsync.executors`. Around the cycle: the messages themselves
(:mod:`.protocol`), what a joined rank contributes (:mod:`.joins`), stalls (:mod:`.stall_inspector`),
dead or hung ranks (:mod:`.liveness`), waiting without spinning a core (:mod:`.waiting`), a blocking
op running the cycle in its own thread (:mod:`.caller_runs`) and the autotuner (:mod:`.autotune`).

Nothing here imports a deep-learning framework; tensors are reached through :mod:`gradsync.arrays`.
"""
