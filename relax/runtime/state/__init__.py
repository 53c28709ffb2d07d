"""The run state's room: the ``RunState`` actor (the run's control plane), its rollout ledger, its
typed records and the heartbeats it keeps. Imports only the shared modules of ``relax.runtime``
(``tests/test_import_rules.py`` holds this)."""
