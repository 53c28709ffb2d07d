"""The workers' room: what runs in a role worker's Ray process (``RoleWorker``, its role loops in
``roles/``, the plugins it builds, weight channels, ranks, rollout features, bus row layouts).

It imports ``relax.runtime.state`` and the shared modules of ``relax.runtime``, never the driver's
room (``tests/test_import_rules.py`` holds this).
"""
