"""lm-evaluation-harness on our models: the shared base as an lm-eval model, any role of it answering lm-eval's
requests (``harness_lm``), the tasks to run and their data, found offline or refused in one line (``tasks``), what is
evaluated: an adapter on its base, a merged model or a run folder's export (``evaluated_model``), and the run, its
settings and its results (``harness``). lm-eval is the ``eval`` extra: nothing here is imported before it is needed."""
