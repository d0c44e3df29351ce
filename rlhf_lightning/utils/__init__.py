"""What every layer may use: argument checks (``checks``), finding NaN and infinity (``nonfinite``), atomic
checkpoint files (``atomic_io``), torchmetrics that aggregate over devices (``metrics``), the optimizer and its
schedule (``optim``), named phases of a step (``timing``), analytic FLOPs and the peak they are measured
against (``flops``), whether the machine is too busy for torch's threads
(``machine``), exported files readable as the umask allows (``file_modes``), remote calls retried aloud (``retrying``),
the one HTTP client (``http``), the servers a fit starts as managed subprocesses (``managed_server``) and
every old name still answered, with the release that removes them and the import hook of old module paths
(``compatibility``). Nothing here imports another part of the package."""
