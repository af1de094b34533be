"""The launcher's side of an elastic job (``hvdrun --min-np/--max-np/--host-discovery-script``).

* ``driver.py``: :class:`~hvdrun.launch.elastic.driver.ElasticDriver`, the decisions: min-np and reset limits,
  who forms each round, when the job ends;
* ``worker_pool.py``: the workers matched to what discovery offers, started and stopped through the job's
  launcher, and the cool-downs of failed slots and hosts;
* ``discovery.py``: where the hosts come from: a fixed list, or a script run every second;
* ``membership_service.py``: answers the workers at every ``init()`` (the messages:
  :mod:`hvdrun.protocol.rounds`; the workers' side: :mod:`hvdrun.runtime.membership`).

:func:`hvdrun.launch.job.run_elastic_job` plans the job and runs the driver.
"""
