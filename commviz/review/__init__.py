"""review: what a run dir says after the job (and, for ``status``, while it runs), by role.

- ``analyses/``: functions over a loaded run, one question a module, and the model they
  return (``model/``): ``reviewing`` runs them all over a run's matched ranks into one
  ``Review``; ``judge`` (why the job hung or died, returning ``model.verdict``), ``desync``,
  ``rollups`` (per group, rank, op and size), ``pipeline``, ``overlap``, ``streams``,
  ``origins``; what the run dir's other files say: ``exits``, ``flightrec``, ``placed``,
  ``kept_windows``; ``asked``: the live ranks' stacks, for ``status``.
- ``render/``: their wording: ``report_formats`` (table, Markdown, JSON, and writing the
  report), ``verdict_text``, ``asked_text`` (whom ``status`` asked), ``wholerun``, ``plots``,
  ``timeline`` (the merged trace drawn).
- ``front``: ``commviz.Run(run_dir)``, the one front for notebooks and the commands: the run
  read once, each analysis a method.
- ``diff``/``roots`` (runs compared, slowdowns named at their root), ``fold``/``groupfold``
  (the comm tables folded) with their outputs ``diffout`` and ``overview``: here until their
  owners move them into ``analyses/``, ``render/`` and ``commands/``.
- ``commands/``: one module per command (``report``, ``status``, ``preview``), each
  ``register(parser)`` setting ``func`` to its ``run(args)``, as ``commviz.cli`` wires them.

``tests/test_layering.py`` holds the order: analyses and model, then render, then the front,
then the commands; nothing imports back up.
"""
