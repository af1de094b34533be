"""Seeing a running job from outside its ranks: their vitals sampled from rank 0 and turned into rates
(:mod:`~hvdrun.observe.rates`), the live view ``hvdrun top`` (:mod:`~hvdrun.observe.top`), metrics for tools
(:mod:`~hvdrun.observe.metrics`), the launcher's sampling while a job runs (:mod:`~hvdrun.observe.sampler`) and
the report written when it ends (:mod:`~hvdrun.observe.report`, drawn by :mod:`~hvdrun.observe.charts`).

The ranks' side is :mod:`hvdrun.runtime.vitals`; the request travels as a stacks report does
(:mod:`hvdrun.protocol.inspection`). Nothing here imports the worker runtime.
"""
