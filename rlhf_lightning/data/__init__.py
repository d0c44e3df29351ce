"""Datasets and batches, knowing nothing of models or training: raw rows read from files, folders and hub ids
(``sources``), parsed into typed examples per stage (``formats``, their errors in ``format_errors``), tokenized with chat templates (``tokenize``),
padded into batches (``collate``) and served by a loader that resumes mid-epoch (``loader``); the stages' data
modules (``modules``, the names configs use), built on what they share (``stage_data``): demonstrations and
step-labelled responses (``demonstrations``), preferences (``preferences``) and prompts (``prompts``); reasoning-gym's
procedural tasks as prompts and demonstrations (``reasoning_gym_data``)."""
