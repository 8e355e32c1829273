"""The old name of ``controlplane.warmup_samples``, kept for one importer: ``controlplane/lifecycle/warmups.py``
(changed on another branch right now) imports these four names from here. Once it imports them from
``warmup_samples``, this file goes."""

from controlplane.warmup_samples import keep_learned as keep_learned
from controlplane.warmup_samples import learned_shapes as learned_shapes
from controlplane.warmup_samples import plan_source as plan_source
from controlplane.warmup_samples import read_note as read_note
