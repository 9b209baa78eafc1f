"""review's analyses: each module answers one question about a loaded run, as functions (or
small classes) without state of their own, returning dataclasses; none renders or prints.
``reviewing.review_run`` runs the report's set; ``commviz.Run`` calls them one by one."""
