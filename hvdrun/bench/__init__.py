"""``hvdrun bench``: how does the allreduce scale over the job's hosts, next to gloo and MPI?

- :mod:`sweep`: one job per rank count, collected into a :class:`~hvdrun.bench.sweep.BenchReport`;
- :mod:`bench_job`: what those jobs run on every rank (``python -m hvdrun.bench.bench_job``);
- :mod:`table`: the report on a terminal (rich); :mod:`plot`: its PNG (matplotlib).

Timing collectives and running a job whose output is read are shared with ``hvdrun check``
(:mod:`hvdrun.measure`).
"""
