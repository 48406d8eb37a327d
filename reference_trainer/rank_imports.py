"""Imported by the fork server of :mod:`.forked_torchrun` before it forks the ranks: what every
rank of the reference trainer imports, once for all of them (torch, torch._dynamo, the pipeline
schedules, the trainer and its collectors; jsonschema without its ``iri`` grammar, as the trainer
run as a script imports it).  A module for its side effects only."""
from mfuscope.lean_imports import jsonschema_without_iri

jsonschema_without_iri()

from . import train  # noqa: E402,F401 -- imported for the ranks
from .launch import import_for_the_ranks  # noqa: E402

import_for_the_ranks()
