"""Built-in ``relax.loggers`` plugins: experiment trackers that receive every metrics row the run
writes to ``metrics.jsonl`` (the spec's ``logging:`` list). Each imports its library in
``__init__``, never at module import, so ``relax validate`` checks their options without it."""
