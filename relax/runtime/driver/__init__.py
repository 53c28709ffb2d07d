"""The driver's room: what runs in the process that started ``relax run`` (launch, the controller
and its parts: the fleet of workers, the supervisor's fault policy, recovery and scaling; the control
endpoint, the run's text and report).

It imports ``relax.runtime.state`` and the shared modules of ``relax.runtime``; of the worker's room
only ``relax.runtime.worker.workers``, whose ``RoleWorker`` is the class Ray starts each worker as
(``tests/test_import_rules.py`` holds this).
"""
