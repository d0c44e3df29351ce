"""What the tests share: tiny models, the modules as the tests build them, command-line drivers and the
runs of the distributed and preemption tests. No test module imports another test module; they import from here."""
