"""Rehearsals: a preset's own job (layout, features, cadence, stop signal and resume) run on CPU
with a tiny model, so that a run that would hang or crash on the cluster fails here in minutes.

:mod:`~cooper_mcore.rehearsal.preset` turns a preset into a rehearsal's config,
:mod:`~cooper_mcore.rehearsal.assistant` is the stand-in assistant server, and
:mod:`~cooper_mcore.rehearsal.run` launches the runs, checks them and writes the report.
"""
