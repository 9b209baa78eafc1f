"""review's command line: one module per ``commviz`` command, each with ``register(parser)``
(its arguments and description; ``func`` set to ``run``) and ``run(args) -> exit status``, as
``commviz.cli`` imports them (only the command being run)."""
