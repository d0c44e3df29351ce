"""What every layer may use: argument checks (``checks``), finding NaN and infinity (``nonfinite``) and atomic
checkpoint files (``atomic_io``). Nothing here imports another part of the package."""
