"""In the browser: the job's communication live, and the run reviewed (docs/serve.md).

``live`` keeps the windows ``commviz watch`` makes (``commviz.live``) and a hung job's verdict,
refreshed by a thread of its own; ``page`` turns them into HTML; ``server`` is ``commviz
serve``, which adds the run reviewed after the job (``after``); ``debug`` is the same page inside
torch's debug server (``commviz.debug_handler``). Nothing here imports torch but ``torchpage``.
"""
