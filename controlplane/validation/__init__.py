"""The parts of `snoozectl validate` (entry point: ``controlplane/validate.py``): ``report`` (results and
their formats), ``static`` (checks of the files, imports in child processes), ``live`` (load, infer, unload)."""
